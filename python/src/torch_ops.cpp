// ovq._torch_ops: the multi-head layers as PyTorch operators, registered with the dispatcher
// in C++ so that a call costs what a built-in operator's does (a Python kernel costs several
// times more: the dispatcher boxes its arguments into Python objects, and an autograd kernel in
// Python doubles that).
//
//   ovq::forward(Tensor(a!) handle, Tensor q, Tensor k, Tensor v, int threads) -> Tensor
//   ovq::forward_lse(...same...) -> (Tensor, Tensor)
//   ovq::step(Tensor(a!) handle, Tensor q, Tensor k, Tensor v, int threads) -> Tensor
//   ovq::absorb(Tensor(a!) handle, Tensor k, Tensor v, int threads) -> ()
//
// `handle` is a one-element int64 tensor holding the layer's handle (MultiHead._op_handle());
// the ops declare it mutated so that torch.compile keeps their calls in order. Kernels:
//   CompositeExplicitAutograd  allocates the outputs and calls ovq._ovq's table (op_table.h),
//                              which checks everything and runs the layer, without the GIL;
//   Meta                       the outputs' shapes (fake tensors, torch.compile);
//   Autograd                   the call below autograd, with outputs whose backward raises
//                              (the ops are forward only).
// This file sees PyTorch's headers and op_table.h only: no ovq type crosses between modules.
#include <nanobind/nanobind.h>

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/EmptyTensor.h>
#include <ATen/ops/empty.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/basic_ops.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/library.h>

#include <climits>
#include <cstdio>
#include <cstdint>
#include <sstream>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "op_table.h"

namespace nb = nanobind;
namespace ops = ovq::python::ops;

namespace {

// ovq._ovq's table: set by the module's init before it registers the ops.
const ops::Table* g_table = nullptr;

// "(2, 8, 64)", as the extension writes shapes (sizes, or a fake tensor's symbolic sizes).
template <class Size>
std::string shape_text(c10::ArrayRef<Size> sizes) {
  std::ostringstream out;
  out << '(';
  for (std::size_t i = 0; i < sizes.size(); ++i) out << (i ? ", " : "") << sizes[i];
  out << (sizes.size() == 1 ? ",)" : ")");
  return out.str();
}

// The element as DLPack names it (code, bits); an element ovq does not compute in is passed on
// with its code, and the table's check names it.
std::pair<std::uint8_t, std::uint8_t> dlpack_element(at::ScalarType t) {
  constexpr std::uint8_t kInt = 0, kUInt = 1, kFloat = 2, kBfloat = 4, kComplex = 5, kBool = 6;
  const auto bits = static_cast<std::uint8_t>(8 * c10::elementSize(t));
  switch (t) {
    case at::kFloat:
    case at::kDouble:
    case at::kHalf:
      return {kFloat, bits};
    case at::kBFloat16:
      return {kBfloat, bits};
    case at::kChar:
    case at::kShort:
    case at::kInt:
    case at::kLong:
      return {kInt, bits};
    case at::kByte:
    case at::kUInt16:
    case at::kUInt32:
    case at::kUInt64:
      return {kUInt, bits};
    case at::kBool:
      return {kBool, bits};
    case at::kComplexHalf:
    case at::kComplexFloat:
    case at::kComplexDouble:
      return {kComplex, bits};
    default:
      return {255, bits};
  }
}

// The tensor as the table's array; what only a tensor can be (another device or layout) is
// refused here, in the extension's words, and the table checks the rest. (A lazily negated view
// or a ZeroTensor never gets here: the dispatcher's fallbacks give the op their values.)
ops::Array describe(const at::Tensor& t, const char* where, const char* name) {
  TORCH_CHECK_TYPE(t.defined(), where, ": ", name, " is an undefined tensor, expected a tensor");
  TORCH_CHECK_TYPE(t.layout() == at::kStrided, where, ": ", name, " has layout ", t.layout(),
                   ", expected a dense (torch.strided) tensor");
  TORCH_CHECK_TYPE(t.is_cpu(), where, ": ", name, " is on ", t.device(),
                   ", expected CPU memory: this build of ovq runs on the CPU");
  TORCH_CHECK_VALUE(t.dim() <= ops::kMaxDims, where, ": ", name, " has shape ",
                    shape_text(t.sizes()), ", expected at most ", ops::kMaxDims, " dimensions");
  ops::Array a{};
  // (The table writes only the outputs, which are made here: an input is read through its
  // const pointer, which leaves a copy-on-write tensor shared.)
  a.data = t.numel() > 0 ? const_cast<void*>(t.const_data_ptr()) : nullptr;
  a.device_type = 1;  // kDLCPU
  std::tie(a.code, a.bits) = dlpack_element(t.scalar_type());
  a.ndim = static_cast<std::int32_t>(t.dim());
  for (std::int64_t i = 0; i < t.dim(); ++i) {
    a.shape[i] = t.size(i);
    a.strides[i] = t.stride(i);
  }
  return a;
}

std::int64_t handle_of(const at::Tensor& handle, const char* where) {
  TORCH_CHECK_TYPE(handle.defined() && handle.layout() == at::kStrided && handle.is_cpu() &&
                       handle.scalar_type() == at::kLong && handle.numel() == 1 &&
                       !handle._is_zerotensor(),
                   where, ": handle is not a layer's handle, expected a one-element int64 CPU "
                   "tensor (ovq.torch.Attention.handle)");
  return *handle.const_data_ptr<std::int64_t>();
}

int threads_of(std::int64_t threads) {
  TORCH_CHECK_VALUE(threads >= 0 && threads <= INT_MAX, "threads = ", threads,
                    ", expected 0 <= threads <= ", INT_MAX, " (0: OpenMP's default)");
  return static_cast<int>(threads);
}

// The Meta kernels' check before they read an output's shape from the inputs: `ndim`
// dimensions (the real kernels' table checks everything).
void check_dims(const at::Tensor& t, std::int64_t ndim, const char* where, const char* name,
                const char* dims) {
  TORCH_CHECK_VALUE(t.dim() == ndim, where, ": ", name, " has shape ", shape_text(t.sym_sizes()),
                    ", expected ", ndim, " dimensions ", dims);
}

void raise(int status, const char* message) {
  switch (status) {
    case ops::kOpOk:
      return;
    case ops::kOpTypeError:
      TORCH_CHECK_TYPE(false, message);
    case ops::kOpValueError:
      TORCH_CHECK_VALUE(false, message);
    default:
      TORCH_CHECK(false, message);
  }
}

constexpr std::size_t kMessageBytes = 1024;

// The outputs a call asks for (op_table.h's Allocate), made as C-contiguous CPU tensors
// straight from the CPU allocator (at::empty would go through the dispatcher again).
struct Outputs {
  at::Tensor made[2];
  int count = 0;
};

at::ScalarType scalar_type_of(std::uint8_t code, std::uint8_t bits) {
  if (code == 4 && bits == 16) return at::kBFloat16;
  TORCH_CHECK(code == 2 && (bits == 16 || bits == 32 || bits == 64),
              "ovq._torch_ops: asked for an output of DLPack element (", int(code), ", ",
              int(bits), ")");
  return bits == 16 ? at::kHalf : bits == 32 ? at::kFloat : at::kDouble;
}

int allocate_output(void* context, std::int32_t ndim, const std::int64_t* shape,
                    std::uint8_t code, std::uint8_t bits, ops::Array* out, char* message,
                    std::size_t capacity) noexcept {
  try {
    auto& outputs = *static_cast<Outputs*>(context);
    TORCH_CHECK(outputs.count < 2, "ovq._torch_ops: asked for a third output");
    at::Tensor t(at::detail::empty_cpu(c10::IntArrayRef(shape, ndim), scalar_type_of(code, bits)));
    *out = describe(t, "ovq._torch_ops", "an output");
    outputs.made[outputs.count++] = std::move(t);
    return ops::kOpOk;
  } catch (const std::exception& e) {
    if (capacity > 0) std::snprintf(message, capacity, "%s", e.what());
    return ops::kOpRuntimeError;
  }
}

// ---- CompositeExplicitAutograd: the calls ----

// forward (ndim 4, with or without lse) or step (ndim 3): (out, lse or undefined).
std::tuple<at::Tensor, at::Tensor> read(const char* where, std::int32_t ndim,
                                        const at::Tensor& handle, const at::Tensor& q,
                                        const at::Tensor& k, const at::Tensor& v,
                                        std::int64_t threads, bool with_lse) {
  const std::int64_t h = handle_of(handle, where);
  const int n = threads_of(threads);
  const ops::Array qa = describe(q, where, "q"), ka = describe(k, where, "k"),
                   va = describe(v, where, "v");
  Outputs outputs;
  char message[kMessageBytes];
  raise(g_table->read(h, ndim, &qa, &ka, &va, with_lse, allocate_output, &outputs, n, message,
                      sizeof message),
        message);
  return {outputs.made[0], outputs.made[1]};
}

at::Tensor forward_cpu(at::Tensor& handle, const at::Tensor& q, const at::Tensor& k,
                       const at::Tensor& v, std::int64_t threads) {
  return std::get<0>(read("forward", 4, handle, q, k, v, threads, false));
}

std::tuple<at::Tensor, at::Tensor> forward_lse_cpu(at::Tensor& handle, const at::Tensor& q,
                                                   const at::Tensor& k, const at::Tensor& v,
                                                   std::int64_t threads) {
  return read("forward", 4, handle, q, k, v, threads, true);
}

at::Tensor step_cpu(at::Tensor& handle, const at::Tensor& q, const at::Tensor& k,
                    const at::Tensor& v, std::int64_t threads) {
  return std::get<0>(read("step", 3, handle, q, k, v, threads, false));
}

void absorb_cpu(at::Tensor& handle, const at::Tensor& k, const at::Tensor& v,
                std::int64_t threads) {
  const char* where = "absorb";
  const std::int64_t h = handle_of(handle, where);
  const int n = threads_of(threads);
  const ops::Array ka = describe(k, where, "k"), va = describe(v, where, "v");
  char message[kMessageBytes];
  raise(g_table->absorb(h, &ka, &va, n, message, sizeof message), message);
}

// ---- Meta: the outputs' shapes ----

at::Tensor forward_meta(at::Tensor&, const at::Tensor& q, const at::Tensor&, const at::Tensor& v,
                        std::int64_t) {
  check_dims(q, 4, "forward", "q", "(B, Hq, T, dk)");
  check_dims(v, 4, "forward", "v", "(B, Hkv, T, dv)");
  return at::empty_symint({q.sym_size(0), q.sym_size(1), q.sym_size(2), v.sym_size(3)},
                          q.options());
}

std::tuple<at::Tensor, at::Tensor> forward_lse_meta(at::Tensor& handle, const at::Tensor& q,
                                                    const at::Tensor& k, const at::Tensor& v,
                                                    std::int64_t threads) {
  at::Tensor out = forward_meta(handle, q, k, v, threads);
  at::Tensor lse = at::empty_symint(
      {q.sym_size(0), q.sym_size(1), q.sym_size(2)},
      q.options().dtype(q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat));
  return {out, lse};
}

at::Tensor step_meta(at::Tensor&, const at::Tensor& q, const at::Tensor&, const at::Tensor& v,
                     std::int64_t) {
  check_dims(q, 3, "step", "q", "(B, Hq, dk)");
  check_dims(v, 3, "step", "v", "(B, Hkv, dv)");
  return at::empty_symint({q.sym_size(0), q.sym_size(1), v.sym_size(2)}, q.options());
}

void absorb_meta(at::Tensor&, const at::Tensor&, const at::Tensor&, std::int64_t) {}

// ---- Autograd: forward only ----

template <class Signature>
c10::TypedOperatorHandle<Signature> op_handle(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

constexpr char kForward[] = "ovq::forward";
constexpr char kForwardLse[] = "ovq::forward_lse";
constexpr char kStep[] = "ovq::step";

// The op kName below autograd; where q, k or v needs a gradient, its outputs then get a
// backward that raises (the ops are forward only). Result: a tensor, or (out, lse).
template <const char* kName, class Result>
Result forward_only(at::Tensor& handle, const at::Tensor& q, const at::Tensor& k,
                    const at::Tensor& v, std::int64_t threads) {
  namespace ag = torch::autograd;
  static const auto op =
      op_handle<Result(at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                       std::int64_t)>(kName);
  Result result;
  {
    at::AutoDispatchBelowADInplaceOrView below;
    result = op.call(handle, q, k, v, threads);
  }
  if (ag::compute_requires_grad(q, k, v)) {
    const std::string message =
        std::string("ovq.torch: the ovq ops are forward only; there is no backward through ") +
        kName + " (detach its inputs, or run it under torch.no_grad())";
    auto node = c10::make_intrusive<ag::Error>(message, ag::collect_next_edges(q, k, v));
    if constexpr (std::is_same_v<Result, at::Tensor>)
      ag::set_history(result, node);
    else
      ag::set_history({std::get<0>(result), std::get<1>(result)}, node);
  }
  return result;
}

// Registers the ops with the dispatcher (what TORCH_LIBRARY does at load time), here once the
// table is known good, so that a module that fails to connect registers nothing and ovq.torch
// can fall back to its Python ops. The libraries live as long as the process.
void register_ops() {
  static torch::Library defs(torch::Library::DEF, "ovq", std::nullopt, __FILE__, __LINE__);
  defs.def("forward(Tensor(a!) handle, Tensor q, Tensor k, Tensor v, int threads) -> Tensor");
  defs.def("forward_lse(Tensor(a!) handle, Tensor q, Tensor k, Tensor v, int threads) -> "
           "(Tensor, Tensor)");
  defs.def("step(Tensor(a!) handle, Tensor q, Tensor k, Tensor v, int threads) -> Tensor");
  defs.def("absorb(Tensor(a!) handle, Tensor k, Tensor v, int threads) -> ()");

  static torch::Library calls(torch::Library::IMPL, "ovq",
                              c10::DispatchKey::CompositeExplicitAutograd, __FILE__, __LINE__);
  calls.impl("forward", &forward_cpu);
  calls.impl("forward_lse", &forward_lse_cpu);
  calls.impl("step", &step_cpu);
  calls.impl("absorb", &absorb_cpu);

  static torch::Library meta(torch::Library::IMPL, "ovq", c10::DispatchKey::Meta, __FILE__,
                             __LINE__);
  meta.impl("forward", &forward_meta);
  meta.impl("forward_lse", &forward_lse_meta);
  meta.impl("step", &step_meta);
  meta.impl("absorb", &absorb_meta);

  static torch::Library autograd(torch::Library::IMPL, "ovq", c10::DispatchKey::Autograd,
                                 __FILE__, __LINE__);
  autograd.impl("forward", &forward_only<kForward, at::Tensor>);
  autograd.impl("forward_lse", &forward_only<kForwardLse, std::tuple<at::Tensor, at::Tensor>>);
  autograd.impl("step", &forward_only<kStep, at::Tensor>);
}

}  // namespace

NB_MODULE(_torch_ops, m) {
  m.doc() = "torch.ops.ovq.*: ovq's multi-head layers as PyTorch operators (used by ovq.torch).";
  nb::object capsule = nb::module_::import_("ovq._ovq").attr("_op_table")();
  const auto* t =
      static_cast<const ops::Table*>(PyCapsule_GetPointer(capsule.ptr(), ops::kOpTableCapsule));
  if (t == nullptr) throw nb::python_error();
  if (t->version != ops::kOpTableVersion)
    throw nb::import_error("ovq._torch_ops: ovq._ovq's op table has another version: rebuild "
                           "ovq (pip install --no-build-isolation ./python)");
  g_table = t;
  register_ops();
}
