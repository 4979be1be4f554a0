// ovq._ovq: the C++ mixers, states and multi-head layers for Python (nanobind).
//
// The extension is the thin, checked layer between Python arrays and the library: it reads every
// array in place through its DLPack/buffer view (a decode step's output, when the caller gives
// none, is allocated here as the inputs' kind: a torch tensor or a NumPy array), and
// refuses, with TypeError or ValueError naming the argument, anything the library cannot read
// in place: another dtype than the state's, another rank, a non C-contiguous layout, a
// read-only output, memory on another device, outputs overlapping inputs. The library's own
// checks (shapes against the state, finite inputs) run before any state changes and come back
// as ValueError. While a mixer computes the GIL is released and the state's lock held, so two
// Python threads may share a state without a data race (they take turns). The multi-head layers
// are also reachable from C, by handle, through the table of op_table.h (ovq._torch_ops's
// PyTorch operators call it without the GIL).
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <sstream>
#include <stdexcept>
#include <string>
#include <tuple>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <variant>
#include <vector>

#if defined(_OPENMP)
#include <omp.h>
#endif

#include "ovq/ovq.hpp"
#include "ovq/ref/reference.hpp"
#include "op_table.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace ovq::python {

// ---- elements ----

template <class S>
constexpr nb::dlpack::dtype dlpack_dtype() {
  if constexpr (std::is_same_v<S, bf16>) {
    return {static_cast<std::uint8_t>(nb::dlpack::dtype_code::Bfloat), 16, 1};
  } else {
    return {static_cast<std::uint8_t>(nb::dlpack::dtype_code::Float),
            static_cast<std::uint8_t>(8 * sizeof(S)), 1};
  }
}

std::string dtype_name(nb::dlpack::dtype d) {
  using C = nb::dlpack::dtype_code;
  const auto code = static_cast<C>(d.code);
  const char* kind = code == C::Float    ? "float"
                     : code == C::Bfloat ? "bfloat"
                     : code == C::Int    ? "int"
                     : code == C::UInt   ? "uint"
                     : code == C::Bool   ? "bool"
                     : code == C::Complex ? "complex"
                                          : "other";
  return std::string(kind) + std::to_string(d.bits) + (d.lanes != 1 ? "x" + std::to_string(d.lanes) : "");
}

// The element types, in the order of the state variants.
using Elements = std::tuple<float, double, bf16, fp16>;

// Calls f(S{}) for the element named `name` ("float32", "float64", "bfloat16", "float16").
template <class F>
decltype(auto) with_element(const std::string& name, F&& f) {
  if (name == "float32") return f(float{});
  if (name == "float64") return f(double{});
  if (name == "bfloat16") return f(bf16{});
  if (name == "float16") return f(fp16{});
  throw nb::type_error(("dtype " + name +
                        " is not one ovq computes in, expected float32, float64, bfloat16 or "
                        "float16")
                           .c_str());
}

// ---- argument checks ----

using InArray = nb::ndarray<nb::ro>;
using OutArray = nb::ndarray<>;

template <class... Parts>
std::string str(const Parts&... parts) {
  std::ostringstream out;
  (out << ... << parts);
  return out.str();
}

// An array described by the torch ops (op_table.h): nb::ndarray's accessors over plain values,
// so that the same checks and reads run without the GIL (an nb::ndarray needs it to be made and
// freed).
struct PlainArray {
  const ops::Array* a;
  std::int32_t device_type() const { return a->device_type; }
  nb::dlpack::dtype dtype() const { return {a->code, a->bits, 1}; }
  std::size_t ndim() const { return static_cast<std::size_t>(a->ndim); }
  std::size_t shape(std::size_t i) const { return static_cast<std::size_t>(a->shape[i]); }
  std::int64_t stride(std::size_t i) const { return a->strides[i]; }
  std::size_t size() const {
    std::size_t n = 1;
    for (std::size_t i = 0; i < ndim(); ++i) n *= shape(i);
    return n;
  }
  std::size_t nbytes() const { return size() * a->bits / 8; }
  void* data() const { return a->data; }
};

template <class A>
std::string shape_string(const A& a) {
  std::string s = "(";
  for (std::size_t i = 0; i < a.ndim(); ++i) s += (i ? ", " : "") + std::to_string(a.shape(i));
  return s + (a.ndim() == 1 ? ",)" : ")");
}

// The name of an array's element type, if ovq computes in it.
std::string element_of_array(const InArray& a, const char* where, const char* name) {
  for (const char* element : {"float32", "float64", "bfloat16", "float16"}) {
    const bool match =
        with_element(element, [&](auto s) { return a.dtype() == dlpack_dtype<decltype(s)>(); });
    if (match) return element;
  }
  throw nb::type_error(str(where, ": ", name, " has dtype ", dtype_name(a.dtype()),
                           ", expected float32, float64, bfloat16 or float16")
                           .c_str());
}

// The array seen read-only, whatever its writability (for the common checks).
template <class A>
InArray as_input(const A& a) {
  return InArray(a);
}

// `name` must be a C-contiguous, aligned CPU array of `ndim` dimensions (`dims` in messages) and
// element S.
template <class S, class A>
void check_array(const char* where, const char* name, const A& a, std::size_t ndim,
                 const char* dims) {
  if (a.device_type() != nb::device::cpu::value)
    throw nb::type_error(str(where, ": ", name, " is on a device (DLPack device type ",
                             a.device_type(),
                             "), expected CPU memory: this build of ovq runs on the CPU")
                             .c_str());
  if (a.dtype() != dlpack_dtype<S>())
    throw nb::type_error(str(where, ": ", name, " has dtype ", dtype_name(a.dtype()),
                             ", expected ", element_name<S>(), " (the state's)")
                             .c_str());
  if (a.ndim() != ndim)
    throw nb::value_error(str(where, ": ", name, " has shape ", shape_string(a), ", expected ",
                              ndim, " dimensions ", dims)
                              .c_str());
  if (a.size() == 0) return;  // no element to address: any strides will do
  std::int64_t expected = 1;
  for (std::size_t i = ndim; i-- > 0;) {
    if (a.shape(i) != 1 && a.stride(i) != expected)
      throw nb::value_error(str(where, ": ", name, " of shape ", shape_string(a),
                                " is not C-contiguous, expected a C-contiguous array "
                                "(numpy.ascontiguousarray, or Tensor.contiguous())")
                                .c_str());
    expected *= static_cast<std::int64_t>(a.shape(i));
  }
  // An element is read only at an address that is a multiple of its alignment; NumPy and torch
  // can make arrays that start elsewhere (a buffer viewed from an odd byte offset).
  if (reinterpret_cast<std::uintptr_t>(a.data()) % alignof(S) != 0)
    throw nb::value_error(str(where, ": ", name, " starts at an address that is not a multiple of ",
                              alignof(S), " bytes, expected an array aligned to its elements (a "
                              "copy: numpy.array, or Tensor.clone())")
                              .c_str());
}

// The array as rows: its last dimension is the row, every other one stacks rows.
template <class S, class A>
ConstRowsView<S> rows_of(const A& a) {
  Index cols = a.ndim() == 0 ? 1 : static_cast<Index>(a.shape(a.ndim() - 1));
  Index rows = 1;
  for (std::size_t i = 0; i + 1 < a.ndim(); ++i) rows *= static_cast<Index>(a.shape(i));
  return {static_cast<const S*>(a.data()), rows, cols, cols};
}
// An output's rows, writable.
template <class S, class A>
RowsView<S> out_rows_of(const A& a) {
  const ConstRowsView<S> r = rows_of<S>(a);
  return {const_cast<S*>(r.data), r.rows, r.cols, r.stride};
}
inline const PlainArray& as_input(const PlainArray& a) { return a; }

struct ByteRange {
  const char* first;
  const char* last;
};
template <class A>
ByteRange bytes_of(const A& a) {
  const char* p = static_cast<const char*>(a.data());
  return {p, p + a.nbytes()};
}

// Outputs must not share memory with the inputs (or each other): a read would see its own
// results half written.
template <class A>
void check_disjoint(const char* where, const char* out_name, const A& out,
                    std::initializer_list<std::pair<const char*, const A*>> others) {
  const ByteRange o = bytes_of(out);
  if (o.first == o.last) return;
  for (const auto& [name, arr] : others) {
    if (arr == nullptr) continue;
    const ByteRange r = bytes_of(*arr);
    if (r.first < o.last && o.first < r.last)
      throw nb::value_error(
          str(where, ": ", out_name, " overlaps ", name, ", expected a separate output array")
              .c_str());
  }
}

// ---- arrays from Python objects ----
//
// NumPy arrays (and anything else with a buffer or DLPack) come through nanobind's ndarray
// caster. A torch.Tensor is read without a DLPack capsule, which would cost more than a small
// decode step: through PyTorch's DLPack exchange table where it can be used, else through the
// tensor's own accessors (its pointer, shape and strides), with the tensor as the owner. ovq
// never imports torch: a tensor exists only if the caller did.

// The C function table a framework puts on its tensor type as `__dlpack_c_exchange_api__`
// (DLPack 1.3, major version 1): a tensor described as a DLTensor, and new tensors, without a
// Python call.
namespace exchange {
struct Version {
  std::uint32_t major, minor;
};
struct ManagedTensor {  // DLManagedTensorVersioned
  Version version;
  void* manager_ctx;
  void (*deleter)(ManagedTensor*);
  std::uint64_t flags;
  nb::dlpack::dltensor tensor;
};
using SetError = void (*)(void* context, const char* kind, const char* message);
struct Table {  // DLPackExchangeAPI
  Version version;
  const void* previous_version;
  int (*allocate)(nb::dlpack::dltensor* prototype, ManagedTensor** out, void* context,
                  SetError set_error);
  int (*to_managed)(void* object, ManagedTensor** out);
  int (*to_object)(ManagedTensor* tensor, void** object);
  int (*describe)(void* object, nb::dlpack::dltensor* out);  // may be null
  int (*current_stream)(std::int32_t device_type, std::int32_t device_id, void** stream);
};

// The table of `type`, or null where it has none this code can use.
const Table* table_of(PyObject* type) {
  PyObject* capsule = PyObject_GetAttrString(type, "__dlpack_c_exchange_api__");
  if (capsule == nullptr) {
    PyErr_Clear();
    return nullptr;
  }
  auto* table = static_cast<const Table*>(PyCapsule_GetPointer(capsule, "dlpack_exchange_api"));
  if (table == nullptr) {
    PyErr_Clear();
    Py_DECREF(capsule);
    return nullptr;
  }
  // The table lives as long as the type (for the process: torch is never unloaded); the
  // capsule is kept with it.
  if (table->version.major != 1 || table->describe == nullptr || table->allocate == nullptr ||
      table->to_object == nullptr) {
    Py_DECREF(capsule);
    return nullptr;
  }
  return table;
}
}  // namespace exchange

struct TorchTypes {
  PyObject* tensor = nullptr;     // torch.Tensor
  PyObject* parameter = nullptr;  // torch.nn.Parameter (or null)
  PyObject* strided = nullptr;    // torch.strided
  PyObject* empty = nullptr;      // torch.empty
  PyObject* f32 = nullptr;
  PyObject* f64 = nullptr;
  PyObject* f16 = nullptr;
  PyObject* bf16 = nullptr;
  const exchange::Table* table = nullptr;  // torch.Tensor's exchange table, or null
  struct {  // interned attribute names: looked up without making a string each time
    PyObject* layout = PyUnicode_InternFromString("layout");
    PyObject* is_cpu = PyUnicode_InternFromString("is_cpu");
    PyObject* is_nested = PyUnicode_InternFromString("is_nested");
    PyObject* is_neg = PyUnicode_InternFromString("is_neg");
  } names;
};

const TorchTypes* torch_types() {
  static TorchTypes types;
  if (types.tensor == nullptr) {
    nb::object name = nb::str("torch");
    PyObject* torch = PyImport_GetModule(name.ptr());
    if (torch == nullptr) return nullptr;
    nb::object mod = nb::steal(torch);
    // Kept for the life of the process (torch is never unloaded).
    types.f32 = nb::object(mod.attr("float32")).release().ptr();
    types.f64 = nb::object(mod.attr("float64")).release().ptr();
    types.f16 = nb::object(mod.attr("float16")).release().ptr();
    types.bf16 = nb::object(mod.attr("bfloat16")).release().ptr();
    types.strided = nb::object(mod.attr("strided")).release().ptr();
    types.empty = nb::object(mod.attr("empty")).release().ptr();
    types.table = exchange::table_of(nb::object(mod.attr("Tensor")).ptr());
    try {
      nb::object parameter = mod.attr("nn").attr("Parameter");
      // The table may only see objects of the type it came from, or of one that carries it.
      if (types.table != nullptr && exchange::table_of(parameter.ptr()) == types.table)
        types.parameter = parameter.release().ptr();
    } catch (nb::python_error&) {
      types.parameter = nullptr;
    }
    types.tensor = nb::object(mod.attr("Tensor")).release().ptr();
  }
  return &types;
}

bool is_torch_tensor(nb::handle h) {
  const TorchTypes* t = torch_types();
  if (t == nullptr) return false;
  const int is = PyObject_IsInstance(h.ptr(), t->tensor);
  if (is < 0) PyErr_Clear();  // (a broken __class__): not a tensor
  return is == 1;
}

// str(x), for messages.
std::string text_of(nb::handle x) {
  PyObject* s = PyObject_Str(x.ptr());
  if (s == nullptr) {
    PyErr_Clear();
    return "?";
  }
  const nb::str owned = nb::steal<nb::str>(s);
  return owned.c_str();
}

// The array a DLTensor describes, owned by `owner`; nothing where it is not one of the four
// elements in CPU memory with strides.
template <class Array>
std::optional<Array> array_of_dltensor(const nb::dlpack::dltensor& dl, nb::handle owner) {
  const bool known = dl.dtype == dlpack_dtype<float>() || dl.dtype == dlpack_dtype<double>() ||
                     dl.dtype == dlpack_dtype<bf16>() || dl.dtype == dlpack_dtype<fp16>();
  if (!known || dl.device.device_type != nb::device::cpu::value || dl.ndim < 0 || dl.ndim > 8 ||
      dl.data == nullptr || dl.strides == nullptr)
    return std::nullopt;
  std::size_t sizes[8];
  for (std::int32_t i = 0; i < dl.ndim; ++i) sizes[i] = static_cast<std::size_t>(dl.shape[i]);
  return Array(static_cast<char*>(dl.data) + dl.byte_offset, static_cast<std::size_t>(dl.ndim),
               sizes, owner, dl.strides, dl.dtype, nb::device::cpu::value);
}

// A tensor attribute (`name`: an interned string), or the result of calling the method of that
// name, read as a flag; one the tensor lacks (or that fails) reads as `otherwise`.
bool tensor_flag(nb::handle h, PyObject* name, bool call, bool otherwise) {
  PyObject* value = call ? PyObject_CallMethodNoArgs(h.ptr(), name) : PyObject_GetAttr(h.ptr(), name);
  if (value == nullptr) {
    PyErr_Clear();
    return otherwise;
  }
  const bool flag = value == Py_True;
  Py_DECREF(value);
  return flag;
}

// The tensor as an array through the exchange table, or nothing where the table cannot be
// trusted with it: its functions check nothing (a sparse or nested tensor crashes them, a
// lazily negated view reads as the memory under it), so they only see dense, un-negated CPU
// tensors of the two plain tensor types, with one of the four elements and memory behind them.
// Everything else takes the accessors' path, which names what is wrong.
template <class Array>
std::optional<Array> exchanged_array(const TorchTypes& t, nb::handle h) {
  PyObject* type = reinterpret_cast<PyObject*>(Py_TYPE(h.ptr()));
  if (t.table == nullptr || (type != t.tensor && type != t.parameter)) return std::nullopt;
  PyObject* layout = PyObject_GetAttr(h.ptr(), t.names.layout);
  if (layout == nullptr) {
    PyErr_Clear();
    return std::nullopt;
  }
  const bool strided = layout == t.strided;
  Py_DECREF(layout);
  if (!strided || !tensor_flag(h, t.names.is_cpu, false, false) ||
      tensor_flag(h, t.names.is_nested, false, true) || tensor_flag(h, t.names.is_neg, true, true))
    return std::nullopt;
  nb::dlpack::dltensor dl;
  if (t.table->describe(h.ptr(), &dl) != 0) {
    PyErr_Clear();
    return std::nullopt;
  }
  return array_of_dltensor<Array>(dl, h);
}

template <class Array>
Array torch_array(nb::handle h, const char* where, const char* name) {
  const TorchTypes* t = torch_types();
  if (std::optional<Array> fast = exchanged_array<Array>(*t, h)) return *std::move(fast);
  if (!nb::cast<bool>(h.attr("is_cpu"))) {
    const std::string device = text_of(h.attr("device"));
    throw nb::type_error(str(where, ": ", name, " is on ", device,
                             ", expected CPU memory: this build of ovq runs on the CPU")
                             .c_str());
  }
  if (tensor_flag(h, t->names.is_nested, false, false))
    throw nb::type_error(str(where, ": ", name, " is a nested tensor, expected a dense tensor")
                             .c_str());
  nb::object dtype = h.attr("dtype");
  nb::dlpack::dtype dt;
  if (dtype.ptr() == t->f32) {
    dt = dlpack_dtype<float>();
  } else if (dtype.ptr() == t->f64) {
    dt = dlpack_dtype<double>();
  } else if (dtype.ptr() == t->f16) {
    dt = dlpack_dtype<fp16>();
  } else if (dtype.ptr() == t->bf16) {
    dt = dlpack_dtype<bf16>();
  } else {
    const std::string text = text_of(dtype);
    throw nb::type_error(str(where, ": ", name, " has dtype ", text,
                             ", expected float32, float64, bfloat16 or float16").c_str());
  }
  // (A real tensor is never a lazy conjugate; it can be a lazy negation.)
  if (nb::cast<bool>(h.attr("is_neg")()))
    throw nb::value_error(str(where, ": ", name, " is a lazily negated view, expected its "
                              "values (Tensor.resolve_neg())").c_str());
  void* data = nullptr;
  nb::tuple shape, strides;
  try {
    data = PyLong_AsVoidPtr(h.attr("data_ptr")().ptr());
    if (data == nullptr && PyErr_Occurred()) throw nb::python_error();
    shape = nb::borrow<nb::tuple>(h.attr("shape"));
    strides = nb::borrow<nb::tuple>(h.attr("stride")());
  } catch (nb::python_error&) {
    // Sparse and other layouts have no strided memory (their accessors raise): asking only
    // then keeps the dense case one call cheaper.
    const std::string layout = text_of(h.attr("layout"));
    throw nb::type_error(str(where, ": ", name, " has layout ", layout,
                             ", expected a dense (torch.strided) tensor").c_str());
  }
  const std::size_t ndim = nb::len(shape);
  std::vector<std::size_t> sizes(ndim);
  std::vector<std::int64_t> steps(ndim);
  std::size_t elements = 1;
  for (std::size_t i = 0; i < ndim; ++i) {
    sizes[i] = nb::cast<std::size_t>(shape[i]);
    steps[i] = nb::cast<std::int64_t>(strides[i]);
    elements *= sizes[i];
  }
  // A ZeroTensor (what autograd can hand out for an all-zero gradient) has no memory at all.
  if (data == nullptr && elements > 0)
    throw nb::value_error(str(where, ": ", name, " has no memory behind its values (a "
                              "ZeroTensor), expected a tensor whose values are stored "
                              "(torch.zeros)").c_str());
  return Array(data, ndim, sizes.data(), h, steps.data(), dt, nb::device::cpu::value);
}

// `name` as an array the library can read.
InArray input(nb::handle h, const char* where, const char* name) {
  if (is_torch_tensor(h)) return torch_array<InArray>(h, where, name);
  InArray a;
  if (!nb::try_cast<InArray>(h, a, false))
    throw nb::type_error(str(where, ": ", name, " is a ", nb::type_name(h.type()).c_str(),
                             ", expected a NumPy array or a torch tensor").c_str());
  return a;
}

// `name` as an array the library can write.
OutArray output(nb::handle h, const char* where, const char* name) {
  if (is_torch_tensor(h)) return torch_array<OutArray>(h, where, name);
  OutArray a;
  if (!nb::try_cast<OutArray>(h, a, false))
    throw nb::type_error(str(where, ": ", name, " is a ", nb::type_name(h.type()).c_str(),
                             ", expected a writable NumPy array or a torch tensor").c_str());
  return a;
}

std::optional<OutArray> optional_output(nb::handle h, const char* where, const char* name) {
  if (h.is_none()) return std::nullopt;
  return output(h, where, name);
}

// ---- outputs made here ----

void set_python_error(void* /*context*/, const char* kind, const char* message) {
  PyErr_SetString(std::strcmp(kind, "MemoryError") == 0 ? PyExc_MemoryError : PyExc_RuntimeError,
                  message);
}

// An output made here: the Python object the caller gets, and the array ovq writes.
struct NewOutput {
  nb::object object;
  OutArray array;
};

// A new uninitialised C-contiguous tensor of `shape` and element S, from PyTorch's allocator
// through the exchange table (no Python call).
template <class S>
NewOutput table_output(const TorchTypes& t, const std::vector<std::int64_t>& shape,
                       const char* where) {
  nb::dlpack::dltensor prototype;
  prototype.device = {nb::device::cpu::value, 0};
  prototype.ndim = static_cast<std::int32_t>(shape.size());
  prototype.dtype = dlpack_dtype<S>();
  prototype.shape = const_cast<std::int64_t*>(shape.data());
  exchange::ManagedTensor* tensor = nullptr;
  if (t.table->allocate(&prototype, &tensor, nullptr, set_python_error) != 0)
    throw nb::python_error();
  if (tensor == nullptr) throw std::runtime_error(str(where, ": PyTorch made no tensor"));
  // Freed here until the tensor object takes it over.
  struct Unclaimed {
    exchange::ManagedTensor* tensor;
    ~Unclaimed() {
      if (tensor != nullptr && tensor->deleter != nullptr) tensor->deleter(tensor);
    }
  } unclaimed{tensor};
  // Described before the tensor object takes it over (its shape and strides live as long
  // as it does, not necessarily as the DLPack wrapper); `made` keeps the memory alive.
  std::optional<OutArray> array = array_of_dltensor<OutArray>(tensor->tensor, nb::handle());
  void* object = nullptr;
  unclaimed.tensor = nullptr;  // to_object takes the tensor, whatever it returns
  if (t.table->to_object(tensor, &object) != 0) throw nb::python_error();
  if (object == nullptr) throw std::runtime_error(str(where, ": PyTorch made no tensor"));
  nb::object made = nb::steal(static_cast<PyObject*>(object));
  if (!array) array = output(made, where, "out");
  return {std::move(made), *std::move(array)};
}

// A new uninitialised C-contiguous array of `shape` and element S, of the kind of `like`: a CPU
// torch tensor for a tensor (through the exchange table where torch has one, else torch.empty),
// else a NumPy array.
template <class S>
NewOutput new_output_like(nb::handle like, const std::vector<std::int64_t>& shape,
                          const char* where) {
  nb::object empty, dtype;  // the Python allocator, and its dtype argument
  if (is_torch_tensor(like)) {
    const TorchTypes& t = *torch_types();
    if (t.table != nullptr) return table_output<S>(t, shape, where);
    empty = nb::borrow(t.empty);
    dtype = nb::borrow(std::is_same_v<S, float>    ? t.f32
                       : std::is_same_v<S, double> ? t.f64
                       : std::is_same_v<S, fp16>   ? t.f16
                                                   : t.bf16);
  } else if constexpr (std::is_same_v<S, bf16>) {
    throw nb::type_error(str(where, ": bfloat16 needs torch tensors: NumPy has no bfloat16").c_str());
  } else {
    // Kept for the life of the process, like the torch objects above; set under the GIL (a
    // function-local static's own lock, taken around an import, could deadlock with it).
    static PyObject* numpy_empty = nullptr;
    if (numpy_empty == nullptr)
      numpy_empty = nb::object(nb::module_::import_("numpy").attr("empty")).release().ptr();
    empty = nb::borrow(numpy_empty);
    dtype = nb::str(element_name<S>());
  }
  nb::list dims;
  for (std::int64_t n : shape) dims.append(n);
  nb::object made = empty(nb::tuple(dims), "dtype"_a = dtype);
  OutArray array = output(made, where, "out");
  return {std::move(made), std::move(array)};
}

// ---- threads ----

// Bounds the OpenMP threads of this (calling) thread for one call; 0 keeps the default.
class ThreadScope {
 public:
  explicit ThreadScope(int threads) {
    if (threads < 0)
      throw nb::value_error(str("threads = ", threads, ", expected >= 0 (0: OpenMP's default)").c_str());
#if defined(_OPENMP)
    if (threads > 0) {
      previous_ = omp_get_max_threads();
      omp_set_num_threads(threads);
    }
#endif
  }
  ~ThreadScope() {
#if defined(_OPENMP)
    if (previous_ > 0) omp_set_num_threads(previous_);
#endif
  }
  ThreadScope(const ThreadScope&) = delete;
  ThreadScope& operator=(const ThreadScope&) = delete;

 private:
  int previous_ = 0;
};

// Gives up the GIL for a scope where this thread holds it: a layer's Python methods hold it,
// the torch ops' calls (op_table.h) do not.
class WithoutGil {
 public:
  WithoutGil()
      : saved_(Py_IsInitialized() && PyGILState_Check() ? PyEval_SaveThread() : nullptr) {}
  ~WithoutGil() {
    if (saved_ != nullptr) PyEval_RestoreThread(saved_);
  }
  WithoutGil(const WithoutGil&) = delete;
  WithoutGil& operator=(const WithoutGil&) = delete;

 private:
  PyThreadState* saved_;
};

// ---- options from keyword arguments, and back ----

const char* feature_map_name(FeatureMap m) {
  return m == FeatureMap::identity ? "identity" : m == FeatureMap::elu1 ? "elu1" : "relu";
}
FeatureMap feature_map_of(const std::string& s) {
  if (s == "identity") return FeatureMap::identity;
  if (s == "elu1") return FeatureMap::elu1;
  if (s == "relu") return FeatureMap::relu;
  throw nb::value_error(
      ("LinearAttention: feature_map = '" + s + "', expected 'identity', 'elu1' or 'relu'").c_str());
}

const char* value_update_name(ValueUpdate u) { return u == ValueUpdate::mean ? "mean" : "delta"; }
ValueUpdate value_update_of(const std::string& s) {
  if (s == "mean") return ValueUpdate::mean;
  if (s == "delta") return ValueUpdate::delta;
  throw nb::value_error(
      ("OVQAttention: value_update = '" + s + "', expected 'mean' or 'delta'").c_str());
}

class Kwargs {
 public:
  Kwargs(const char* where, nb::dict d) : where_(where), d_(std::move(d)) {}

  template <class T>
  void get(const char* key, T& out) {
    known_.push_back(key);
    if (!d_.contains(key)) return;
    used_.insert(key);
    nb::handle h = d_[key];
    if constexpr (std::is_same_v<T, bool>) {
      if (!PyBool_Check(h.ptr()))
        throw nb::type_error(str(where_, ": ", key, " must be a bool").c_str());
    }
    if constexpr (std::is_floating_point_v<T>) {
      if (PyBool_Check(h.ptr()))
        throw nb::type_error(str(where_, ": ", key, " must be a number, not a bool").c_str());
    }
    if constexpr (std::is_integral_v<T> && !std::is_same_v<T, bool>) {
      if (PyBool_Check(h.ptr()) || !PyLong_Check(h.ptr()))
        throw nb::type_error(str(where_, ": ", key, " must be an int").c_str());
    }
    if (!nb::try_cast<T>(h, out, /*convert=*/true))
      throw nb::type_error(str(where_, ": ", key, " = ", nb::repr(h).c_str(),
                               " has the wrong type")
                               .c_str());
  }

  void get(const char* key, FeatureMap& out) {
    std::string name = feature_map_name(out);
    get(key, name);
    out = feature_map_of(name);
  }

  void get(const char* key, ValueUpdate& out) {
    std::string name = value_update_name(out);
    get(key, name);
    out = value_update_of(name);
  }

  void finish() const {
    for (auto item : d_) {
      const std::string key = nb::cast<std::string>(item.first);
      if (used_.count(key) == 0) {
        std::string all;
        for (const std::string& k : known_) all += (all.empty() ? "" : ", ") + k;
        throw nb::type_error(str(where_, "() got an unexpected keyword argument '", key,
                                 "', expected one of: ", all)
                                 .c_str());
      }
    }
  }

 private:
  const char* where_;
  nb::dict d_;
  std::vector<std::string> known_;
  std::set<std::string> used_;
};

// One list of fields per mixer, read from keyword arguments and written back as a dict: the
// state file's list where its names are the keywords (OVQ's file flattens its policies).
struct StateFileFields {
  template <class O, class V>
  static void fields(O& o, V&& v) {
    io::state_detail::visit_options(o, std::forward<V>(v));
  }
};

struct SelfFamily : StateFileFields {
  template <class S>
  using Mixer = SelfAttention<S>;
  using Options = SelfAttentionOptions;
  static constexpr const char* name = "SelfAttention";
};

struct LinearFamily : StateFileFields {
  template <class S>
  using Mixer = LinearAttention<S>;
  using Options = LinearAttentionOptions;
  static constexpr const char* name = "LinearAttention";
};

struct VqFamily : StateFileFields {
  template <class S>
  using Mixer = VqAttention<S>;
  using Options = VqAttentionOptions;
  static constexpr const char* name = "VQAttention";
};

struct OvqFamily {
  template <class S>
  using Mixer = OvqAttention<S>;
  using Options = OvqOptions;
  static constexpr const char* name = "OVQAttention";
  template <class O, class V>
  static void fields(O& o, V&& v) {
    v("capacity", o.capacity);
    v("chunk", o.chunk);
    v("beta", o.beta);
    v("growth", o.growth);
    v("seeding", o.seeding);
    v("rate", o.rate);
    v("renormalize", o.renormalize);
    v("renormalize_values", o.renormalize_values);
    v("count_bias", o.count_bias);
    v("value_update", o.value_update);
  }
};

template <class F>
typename F::Options options_from(nb::dict d) {
  typename F::Options o;
  Kwargs kw(F::name, std::move(d));
  F::fields(o, [&](const char* key, auto& field) { kw.get(key, field); });
  kw.finish();
  o.validate();
  return o;
}

template <class T>
nb::object to_python(const T& field) {
  if constexpr (std::is_same_v<T, FeatureMap>) {
    return nb::str(feature_map_name(field));
  } else if constexpr (std::is_same_v<T, ValueUpdate>) {
    return nb::str(value_update_name(field));
  } else {
    return nb::cast(field);
  }
}

template <class F>
nb::dict options_dict(const typename F::Options& o) {
  nb::dict d;
  F::fields(o, [&](const char* key, const auto& field) { d[key] = to_python(field); });
  return d;
}

// ---- mixers and states ----

template <class F>
class PyMixer {
 public:
  using Options = typename F::Options;
  template <class S>
  using Mixer = typename F::template Mixer<S>;

  explicit PyMixer(const Options& options) : options_(options) {}

  const Options& options() const { return options_; }

  // The mixer of element S, made on first use (its constructor checks that beta and eps are
  // representable in S). Called with the GIL held.
  template <class S>
  const Mixer<S>& typed() const {
    auto& slot = std::get<std::shared_ptr<const Mixer<S>>>(typed_);
    if (!slot) slot = std::make_shared<const Mixer<S>>(options_);
    return *slot;
  }

 private:
  Options options_;
  mutable std::tuple<std::shared_ptr<const Mixer<float>>, std::shared_ptr<const Mixer<double>>,
                     std::shared_ptr<const Mixer<bf16>>, std::shared_ptr<const Mixer<fp16>>>
      typed_;
};

template <class F>
struct PyState {
  using Options = typename F::Options;
  template <class S>
  using State = typename F::template Mixer<S>::State;
  using Variant = std::variant<State<float>, State<double>, State<bf16>, State<fp16>>;

  PyState(const Options& o, Variant s) : options(o), state(std::move(s)) {}
  PyState(const PyState& other) : options(other.options), state(other.locked_copy()) {}
  PyState& operator=(const PyState&) = delete;

  Variant locked_copy() const {
    std::lock_guard<std::mutex> lock(*mutex);
    return state;
  }

  Options options;  // of the mixer that made or loaded it: what its file records
  Variant state;
  std::unique_ptr<std::mutex> mutex = std::make_unique<std::mutex>();
};

template <class S>
using Compute = compute_t<S>;

template <class F, class S>
using MixerOf = typename F::template Mixer<S>;

// What each state shows: n, the rows it holds.
template <class S>
Index rows_held(const KvCache<S>& s) { return s.size(); }
template <class S>
Index rows_held(const LinearState<S>& s) { return s.pending(); }
template <class S>
Index rows_held(const VqState<S>& s) { return s.codebook_size(); }
template <class S>
Index rows_held(const OvqState<S>& s) { return s.dictionary().size(); }

template <class S>
const Dictionary<S>* dictionary_of(const KvCache<S>&) { return nullptr; }
template <class S>
const Dictionary<S>* dictionary_of(const LinearState<S>&) { return nullptr; }
template <class S>
const Dictionary<S>* dictionary_of(const VqState<S>& s) { return &s.dictionary(); }
template <class S>
const Dictionary<S>* dictionary_of(const OvqState<S>& s) { return &s.dictionary(); }

// ---- the calls ----

template <class F, class S>
const MixerOf<F, S>& typed_mixer(const PyMixer<F>& m) {
  return m.template typed<S>();
}

template <class F, class Fn>
decltype(auto) visit(PyState<F>& st, Fn&& fn) {
  return std::visit(std::forward<Fn>(fn), st.state);
}
template <class F, class Fn>
decltype(auto) visit(const PyState<F>& st, Fn&& fn) {
  return std::visit(std::forward<Fn>(fn), st.state);
}

template <class State>
using element_of = typename State::scalar_type;

// forward (ndim 2: q, k (T, dk), v, out (T, dv), lse (T,) or none) and step (ndim 1: q, k (dk,),
// v, out (dv,), no lse): the same checks and the same call, on one row or T.
template <class F>
void read_call(const char* where, std::size_t ndim, const PyMixer<F>& self, PyState<F>& st,
               const InArray& q, const InArray& k, const InArray& v, const OutArray& out,
               const std::optional<OutArray>& lse, int threads) {
  const bool rows = ndim == 2;
  visit(st, [&](auto& state) {
    using S = element_of<std::decay_t<decltype(state)>>;
    const auto& mixer = typed_mixer<F, S>(self);
    check_array<S>(where, "q", q, ndim, rows ? "(T, dk)" : "(dk,)");
    check_array<S>(where, "k", k, ndim, rows ? "(T, dk)" : "(dk,)");
    check_array<S>(where, "v", v, ndim, rows ? "(T, dv)" : "(dv,)");
    const InArray out_in = as_input(out);
    check_array<S>(where, "out", out_in, ndim, rows ? "(T, dv)" : "(dv,)");
    check_disjoint(where, "out", out_in, {{"q", &q}, {"k", &k}, {"v", &v}});
    Compute<S>* lse_ptr = nullptr;
    if (lse) {
      if (!MixerOf<F, S>::kHasLogSumExp)
        throw nb::value_error("forward: return_lse: linear attention has no softmax, so no "
                              "log-sum-exp");
      const InArray lse_in = as_input(*lse);
      check_array<Compute<S>>(where, "lse", lse_in, 1, "(T,)");
      if (static_cast<Index>(lse_in.shape(0)) != static_cast<Index>(q.shape(0)))
        throw nb::value_error(str(where, ": lse has ", lse_in.shape(0), " entries, expected ",
                                  q.shape(0), " (the rows of q)")
                                  .c_str());
      check_disjoint(where, "lse", lse_in, {{"q", &q}, {"k", &k}, {"v", &v}, {"out", &out_in}});
      lse_ptr = static_cast<Compute<S>*>(lse->data());
    }
    const ConstRowsView<S> qv = rows_of<S>(q);
    const RowsView<S> ov = out_rows_of<S>(out);
    nb::gil_scoped_release release;
    std::lock_guard<std::mutex> lock(*st.mutex);
    ThreadScope scope(threads);
    mixer.forward_heads(state, &qv, 1, rows_of<S>(k), rows_of<S>(v), &ov, where,
                        lse_ptr ? &lse_ptr : nullptr);
  });
}

// step's output when the caller gives none: (dv,) of the state's element, like q. The inputs
// are checked first, so that a bad one is what the caller hears about.
template <class F>
NewOutput new_step_output(PyState<F>& st, nb::handle like, const InArray& q, const InArray& k,
                           const InArray& v) {
  return visit(st, [&](auto& state) {
    using S = element_of<std::decay_t<decltype(state)>>;
    check_array<S>("step", "q", q, 1, "(dk,)");
    check_array<S>("step", "k", k, 1, "(dk,)");
    check_array<S>("step", "v", v, 1, "(dv,)");
    return new_output_like<S>(like, {static_cast<std::int64_t>(v.shape(0))}, "step");
  });
}

// absorb(state, k (T, dk), v (T, dv), threads)
template <class F>
void absorb(const PyMixer<F>& self, PyState<F>& st, const InArray& k, const InArray& v,
            int threads) {
  visit(st, [&](auto& state) {
    using S = element_of<std::decay_t<decltype(state)>>;
    const char* where = "absorb";
    const auto& mixer = typed_mixer<F, S>(self);
    check_array<S>(where, "k", k, 2, "(T, dk)");
    check_array<S>(where, "v", v, 2, "(T, dv)");
    const ConstRowsView<S> kv = rows_of<S>(k);
    const ConstRowsView<S> vv = rows_of<S>(v);
    nb::gil_scoped_release release;
    std::lock_guard<std::mutex> lock(*st.mutex);
    ThreadScope scope(threads);
    mixer.check_write(where, state, kv, vv);
    mixer.forward_unchecked(state, nullptr, 0, kv, vv, nullptr, nullptr);
  });
}

// The state file's element type, from its header (so that load_state needs no dtype).
std::string file_element(const nb::bytes& data) {
  const auto* p = static_cast<const unsigned char*>(data.data());
  if (data.size() < io::state_detail::kHeaderSize ||
      std::memcmp(p, io::state_detail::kMagic, sizeof io::state_detail::kMagic) != 0)
    throw ovq::FormatError("state file: not an ovq state file (bad magic or too short)");
  std::uint32_t code = 0;
  for (int i = 0; i < 4; ++i) code |= std::uint32_t(p[24 + i]) << (8 * i);
  const std::string name = io::state_detail::element_name_of(code);
  if (name == "no element type")
    throw ovq::FormatError("state file: element type code " + std::to_string(code) +
                           ", expected float32, float64, float16 or bfloat16");
  return name;
}

template <class F>
nb::bytes encode(const PyState<F>& st) {
  std::vector<unsigned char> bytes;
  {
    std::lock_guard<std::mutex> lock(*st.mutex);
    visit(st, [&](const auto& state) {
      using S = element_of<std::decay_t<decltype(state)>>;
      const MixerOf<F, S> mixer(st.options);
      bytes = io::encode_state(mixer, state);
    });
  }
  return nb::bytes(reinterpret_cast<const char*>(bytes.data()), bytes.size());
}

template <class F>
PyState<F> decode(const typename F::Options& options, const nb::bytes& data) {
  return with_element(file_element(data), [&](auto s) -> PyState<F> {
    using S = decltype(s);
    const MixerOf<F, S> mixer(options);
    return PyState<F>(options, io::decode_state(mixer, static_cast<const unsigned char*>(data.data()),
                                                data.size()));
  });
}

template <class S>
void check_codebook(const InArray& codebook) {
  check_array<S>("make_state", "codebook", codebook, 2, "(S, dk)");
}

// ---- the multi-head layer ----

// What an op handle (op_table.h) names: its layer, while the layer lives. An op's call holds
// `lock` throughout, and the layer's destructor takes it to clear `layer`, so a layer is never
// freed under a call.
struct LayerOps;
struct OpTarget {
  std::mutex lock;
  void* layer = nullptr;          // a PyMultiHead<F>
  const LayerOps* ops = nullptr;  // its family's calls
};

// handle -> target, for every layer that was given a handle and still lives.
struct OpRegistry {
  std::mutex lock;
  std::unordered_map<std::int64_t, std::shared_ptr<OpTarget>> targets;
  std::int64_t next = 1;
};
OpRegistry& op_registry() {
  // Never destroyed: layers can outlive the module's teardown at exit.
  static OpRegistry* registry = new OpRegistry;
  return *registry;
}

std::shared_ptr<OpTarget> find_op_target(std::int64_t handle) {
  OpRegistry& r = op_registry();
  std::lock_guard<std::mutex> lock(r.lock);
  const auto it = r.targets.find(handle);
  return it == r.targets.end() ? nullptr : it->second;
}

template <class F>
struct PyMultiHead {
  template <class S>
  using Layer = MultiHead<MixerOf<F, S>>;
  using Variant = std::variant<Layer<float>, Layer<double>, Layer<bf16>, Layer<fp16>>;

  PyMultiHead(typename F::Options o, Variant l) : options(std::move(o)), layer(std::move(l)) {}
  PyMultiHead(const PyMultiHead& other) : options(other.options), layer(other.locked_copy()) {}
  Variant locked_copy() const {
    std::lock_guard<std::mutex> lock(*mutex);
    return layer;
  }
  PyMultiHead& operator=(const PyMultiHead&) = delete;
  ~PyMultiHead() {
    if (op_target == nullptr) return;
    {
      OpRegistry& r = op_registry();
      std::lock_guard<std::mutex> lock(r.lock);
      r.targets.erase(op_handle);
    }
    // Waits for an op's call in flight (which never needs the GIL: other threads may run).
    WithoutGil release;
    std::lock_guard<std::mutex> lock(op_target->lock);
    op_target->layer = nullptr;
  }

  typename F::Options options;
  Variant layer;
  std::unique_ptr<std::mutex> mutex = std::make_unique<std::mutex>();
  // The handle the torch ops know this layer by (0: none yet; a copy gets its own).
  std::int64_t op_handle = 0;
  std::shared_ptr<OpTarget> op_target;
};

// The layer's forward (ndim 4: q (B, Hq, T, dk), k, v (B, Hkv, T, d), out (B, Hq, T, dv), lse
// (B, Hq, T) or none) and step (ndim 3: the same without T). The leading dimensions are checked
// against the layer's: the layer itself sees only rows, and (B, H) of another split with the
// same product would be read as a different layout.
// (Out is deduced from `out` alone, so that lse may be std::nullopt.)
template <class T>
struct Same {
  using type = T;
};
template <class F, class In, class Out>
void mh_read(const char* where, std::size_t ndim, PyMultiHead<F>& self, const In& q,
             const In& k, const In& v, const Out& out,
             const std::optional<typename Same<Out>::type>& lse, int threads) {
  const bool tokens = ndim == 4;
  std::visit(
      [&](auto& layer) {
        using S = typename std::decay_t<decltype(layer)>::Scalar;
        check_array<S>(where, "q", q, ndim, tokens ? "(B, Hq, T, dk)" : "(B, Hq, dk)");
        check_array<S>(where, "k", k, ndim, tokens ? "(B, Hkv, T, dk)" : "(B, Hkv, dk)");
        check_array<S>(where, "v", v, ndim, tokens ? "(B, Hkv, T, dv)" : "(B, Hkv, dv)");
        const In& out_in = as_input(out);
        check_array<S>(where, "out", out_in, ndim, tokens ? "(B, Hq, T, dv)" : "(B, Hq, dv)");
        check_disjoint(where, "out", out_in, {{"q", &q}, {"k", &k}, {"v", &v}});
        const Index t = tokens ? static_cast<Index>(q.shape(2)) : 1;
        const auto want = [&](const char* name, const In& a, Index h) {
          if (static_cast<Index>(a.shape(0)) != layer.batch() ||
              static_cast<Index>(a.shape(1)) != h ||
              (tokens && static_cast<Index>(a.shape(2)) != t))
            throw nb::value_error(str(where, ": ", name, " has shape ", shape_string(a),
                                      ", expected (", layer.batch(), ", ", h,
                                      tokens ? str(", ", t) : std::string(), ", ...)")
                                      .c_str());
        };
        want("q", q, layer.query_heads());
        want("k", k, layer.kv_heads());
        want("v", v, layer.kv_heads());
        want("out", out_in, layer.query_heads());
        Compute<S>* lse_ptr = nullptr;
        if (lse) {
          if (!MixerOf<F, S>::kHasLogSumExp)
            throw nb::value_error("forward: return_lse: linear attention has no softmax, so no "
                                  "log-sum-exp");
          const In& lse_in = as_input(*lse);
          check_array<Compute<S>>(where, "lse", lse_in, 3, "(B, Hq, T)");
          want("lse", lse_in, layer.query_heads());
          check_disjoint(where, "lse", lse_in, {{"q", &q}, {"k", &k}, {"v", &v}, {"out", &out_in}});
          lse_ptr = static_cast<Compute<S>*>(lse->data());
        }
        const ConstRowsView<S> qv = rows_of<S>(q), kv = rows_of<S>(k), vv = rows_of<S>(v);
        const RowsView<S> ov = out_rows_of<S>(out);
        WithoutGil release;
        std::lock_guard<std::mutex> lock(*self.mutex);
        ThreadScope scope(threads);
        using Map = Eigen::Map<const RowMatrix<S>>;
        const Map qm(qv.data, qv.rows, qv.cols), km(kv.data, kv.rows, kv.cols),
            vm(vv.data, vv.rows, vv.cols);
        Eigen::Map<RowMatrix<S>> om(ov.data, ov.rows, ov.cols);
        if (!tokens) {
          layer.step(qm, km, vm, om);
        } else if (lse_ptr) {
          Eigen::Map<RowVector<Compute<S>>> lm(lse_ptr, qv.rows);
          layer.forward(qm, km, vm, om, lm);
        } else {
          layer.forward(qm, km, vm, om);
        }
      },
      self.layer);
}

// The layer's step output when the caller gives none: (B, Hq, dv) of the layer's element, like
// q, once the inputs passed their checks.
template <class F>
NewOutput mh_new_step_output(PyMultiHead<F>& self, nb::handle like, const InArray& q,
                              const InArray& k, const InArray& v) {
  return std::visit(
      [&](auto& layer) {
        using S = typename std::decay_t<decltype(layer)>::Scalar;
        check_array<S>("step", "q", q, 3, "(B, Hq, dk)");
        check_array<S>("step", "k", k, 3, "(B, Hkv, dk)");
        check_array<S>("step", "v", v, 3, "(B, Hkv, dv)");
        return new_output_like<S>(like,
                                  {static_cast<std::int64_t>(layer.batch()),
                                   static_cast<std::int64_t>(layer.query_heads()),
                                   static_cast<std::int64_t>(layer.value_dim())},
                                  "step");
      },
      self.layer);
}

template <class F, class In>
void mh_absorb(PyMultiHead<F>& self, const In& k, const In& v, int threads) {
  std::visit(
      [&](auto& layer) {
        using S = typename std::decay_t<decltype(layer)>::Scalar;
        const char* where = "absorb";
        check_array<S>(where, "k", k, 4, "(B, Hkv, T, dk)");
        check_array<S>(where, "v", v, 4, "(B, Hkv, T, dv)");
        const ConstRowsView<S> kv = rows_of<S>(k), vv = rows_of<S>(v);
        WithoutGil release;
        std::lock_guard<std::mutex> lock(*self.mutex);
        ThreadScope scope(threads);
        using Map = Eigen::Map<const RowMatrix<S>>;
        layer.absorb(Map(kv.data, kv.rows, kv.cols), Map(vv.data, vv.rows, vv.cols));
      },
      self.layer);
}

// The same step `iters` times in C++, no Python in between: seconds per call (the benchmark's
// baseline for the per-call overhead of the Python paths).
template <class F>
double mh_time_steps(PyMultiHead<F>& self, const InArray& q, const InArray& k, const InArray& v,
                     const OutArray& out, int iters, int threads) {
  if (iters < 1) throw nb::value_error("iters must be >= 1");
  mh_read("step", 3, self, q, k, v, out, std::nullopt, threads);  // checks the arguments once
  return std::visit(
      [&](auto& layer) {
        using S = typename std::decay_t<decltype(layer)>::Scalar;
        const ConstRowsView<S> qv = rows_of<S>(q), kv = rows_of<S>(k), vv = rows_of<S>(v);
        const RowsView<S> ov = out_rows_of<S>(out);
        using Map = Eigen::Map<const RowMatrix<S>>;
        const Map qm(qv.data, qv.rows, qv.cols), km(kv.data, kv.rows, kv.cols),
            vm(vv.data, vv.rows, vv.cols);
        Eigen::Map<RowMatrix<S>> om(ov.data, ov.rows, ov.cols);
        nb::gil_scoped_release release;
        std::lock_guard<std::mutex> lock(*self.mutex);
        ThreadScope scope(threads);
        const auto start = std::chrono::steady_clock::now();
        for (int i = 0; i < iters; ++i) layer.step(qm, km, vm, om);
        const std::chrono::duration<double> took = std::chrono::steady_clock::now() - start;
        return took.count() / iters;
      },
      self.layer);
}

// ---- the torch ops' table (op_table.h) ----

// The outputs of a torch op, from its caller's allocator (op_table.h).
struct OpAllocator {
  ops::Allocate allocate;
  void* context;
  // A new C-contiguous array of `shape` and element `dtype`, described into *out.
  void operator()(const std::vector<std::int64_t>& shape, nb::dlpack::dtype dtype,
                  ops::Array* out) const {
    char message[512];
    if (allocate(context, static_cast<std::int32_t>(shape.size()), shape.data(), dtype.code,
                 dtype.bits, out, message, sizeof message) != ops::kOpOk)
      throw std::runtime_error(message);
  }
};

// A torch op's forward (ndim 4) or step (ndim 3): q, k and v checked as the Python methods
// check them before they make an output (mh_new_step_output), then the outputs the layer makes
// (out (B, Hq, [T,] dv) of its element, lse (B, Hq, T) of its accumulation type) from the
// caller's allocator, then mh_read, which checks the rest and runs.
template <class F>
void op_read(PyMultiHead<F>& self, std::size_t ndim, const PlainArray& q, const PlainArray& k,
             const PlainArray& v, bool with_lse, const OpAllocator& allocate, int threads) {
  const bool tokens = ndim == 4;
  const char* where = tokens ? "forward" : "step";
  std::vector<std::int64_t> shape;
  nb::dlpack::dtype element{}, compute{};
  {
    std::lock_guard<std::mutex> lock(*self.mutex);  // (another call may be loading the states)
    std::visit(
        [&](const auto& layer) {
          using S = typename std::decay_t<decltype(layer)>::Scalar;
          check_array<S>(where, "q", q, ndim, tokens ? "(B, Hq, T, dk)" : "(B, Hq, dk)");
          check_array<S>(where, "k", k, ndim, tokens ? "(B, Hkv, T, dk)" : "(B, Hkv, dk)");
          check_array<S>(where, "v", v, ndim, tokens ? "(B, Hkv, T, dv)" : "(B, Hkv, dv)");
          shape = {layer.batch(), layer.query_heads()};
          if (tokens) shape.push_back(static_cast<std::int64_t>(q.shape(2)));
          shape.push_back(layer.value_dim());
          element = dlpack_dtype<S>();
          compute = dlpack_dtype<Compute<S>>();
        },
        self.layer);
  }
  ops::Array out{}, lse{};
  allocate(shape, element, &out);
  std::optional<PlainArray> lse_array;
  if (with_lse) {
    shape.pop_back();
    allocate(shape, compute, &lse);
    lse_array = PlainArray{&lse};
  }
  mh_read(where, ndim, self, q, k, v, PlainArray{&out}, lse_array, threads);
}

// A family's calls on a layer the table only knows as a pointer.
struct LayerOps {
  void (*read)(void* layer, std::size_t ndim, const PlainArray& q, const PlainArray& k,
               const PlainArray& v, bool with_lse, const OpAllocator& allocate, int threads);
  void (*absorb)(void* layer, const PlainArray& k, const PlainArray& v, int threads);
};

template <class F>
constexpr LayerOps kLayerOps = {
    [](void* layer, std::size_t ndim, const PlainArray& q, const PlainArray& k,
       const PlainArray& v, bool with_lse, const OpAllocator& allocate, int threads) {
      op_read(*static_cast<PyMultiHead<F>*>(layer), ndim, q, k, v, with_lse, allocate, threads);
    },
    [](void* layer, const PlainArray& k, const PlainArray& v, int threads) {
      mh_absorb(*static_cast<PyMultiHead<F>*>(layer), k, v, threads);
    },
};

// The handle of a layer for the torch ops, made on first use.
template <class F>
std::int64_t op_handle_of(PyMultiHead<F>& self) {
  if (self.op_target == nullptr) {
    auto target = std::make_shared<OpTarget>();
    target->layer = &self;
    target->ops = &kLayerOps<F>;
    OpRegistry& r = op_registry();
    std::lock_guard<std::mutex> lock(r.lock);
    self.op_handle = r.next++;
    r.targets.emplace(self.op_handle, target);
    self.op_target = std::move(target);
  }
  return self.op_handle;
}

// Runs `call` on the layer of `handle` as op_table.h says: without the GIL, with the layer kept
// alive, and an error returned as its kind and message.
template <class Call>
int run_op(std::int64_t handle, char* message, std::size_t capacity, Call&& call) {
  // Without the GIL for the whole call (where the caller holds it): waiting for the layer's
  // locks would otherwise stall every Python thread.
  WithoutGil release;
  const auto fail = [&](int kind, const char* what) {
    if (capacity > 0) std::snprintf(message, capacity, "%s", what);
    return kind;
  };
  try {
    const std::shared_ptr<OpTarget> target = find_op_target(handle);
    std::unique_lock<std::mutex> lock;
    if (target != nullptr) lock = std::unique_lock<std::mutex>(target->lock);
    if (target == nullptr || target->layer == nullptr)
      return fail(ops::kOpRuntimeError,
                  str("ovq.torch: no layer has handle ", handle, " (it was freed, or never made)")
                      .c_str());
    call(*target->ops, target->layer);
    return ops::kOpOk;
  } catch (const nb::builtin_exception& e) {
    const nb::exception_type type = e.type();
    return fail(type == nb::exception_type::type_error    ? ops::kOpTypeError
                : type == nb::exception_type::value_error ? ops::kOpValueError
                                                          : ops::kOpRuntimeError,
                e.what());
  } catch (const ovq::ArgumentError& e) {
    return fail(ops::kOpValueError, e.what());
  } catch (const ovq::FormatError& e) {
    return fail(ops::kOpValueError, e.what());
  } catch (const std::exception& e) {
    return fail(ops::kOpRuntimeError, e.what());
  } catch (...) {
    return fail(ops::kOpRuntimeError, "ovq: an unknown C++ exception");
  }
}

const ops::Table kOpTable = {
    ops::kOpTableVersion,
    [](std::int64_t handle, std::int32_t ndim, const ops::Array* q, const ops::Array* k,
       const ops::Array* v, bool with_lse, ops::Allocate allocate, void* context, int threads,
       char* message, std::size_t capacity) {
      return run_op(handle, message, capacity, [&](const LayerOps& o, void* layer) {
        o.read(layer, static_cast<std::size_t>(ndim), PlainArray{q}, PlainArray{k},
               PlainArray{v}, with_lse, OpAllocator{allocate, context}, threads);
      });
    },
    [](std::int64_t handle, const ops::Array* k, const ops::Array* v, int threads,
       char* message, std::size_t capacity) {
      return run_op(handle, message, capacity, [&](const LayerOps& o, void* layer) {
        o.absorb(layer, PlainArray{k}, PlainArray{v}, threads);
      });
    },
};

template <class F>
nb::bytes mh_encode(const PyMultiHead<F>& self) {
  std::vector<unsigned char> bytes;
  {
    std::lock_guard<std::mutex> lock(*self.mutex);
    std::visit([&](const auto& layer) { bytes = io::encode_state(layer); }, self.layer);
  }
  return nb::bytes(reinterpret_cast<const char*>(bytes.data()), bytes.size());
}

template <class F>
void mh_decode(PyMultiHead<F>& self, const nb::bytes& data) {
  std::lock_guard<std::mutex> lock(*self.mutex);
  std::visit(
      [&](auto& layer) {
        using S = typename std::decay_t<decltype(layer)>::Scalar;
        const std::string got = file_element(data);
        if (got != element_name<S>())
          throw ovq::FormatError(str("state file: elements are ", got, ", expected ",
                                     element_name<S>(), " (the layer's)"));
        io::decode_state(layer, static_cast<const unsigned char*>(data.data()), data.size());
      },
      self.layer);
}

// ---- what a state shows ----

// A copy of `rows` as a NumPy array (bf16 as float32).
template <class S>
nb::object numpy_copy_rows(ConstRowsView<S> rows) {
  using Out = std::conditional_t<std::is_same_v<S, bf16>, float, S>;
  auto* copy = new std::vector<Out>(static_cast<std::size_t>(rows.rows * rows.cols));
  for (Index i = 0; i < rows.rows; ++i)
    for (Index c = 0; c < rows.cols; ++c)
      (*copy)[static_cast<std::size_t>(i * rows.cols + c)] = static_cast<Out>(rows.row(i)[c]);
  const std::size_t shape[2] = {static_cast<std::size_t>(rows.rows),
                                static_cast<std::size_t>(rows.cols)};
  nb::capsule free(copy, [](void* p) noexcept { delete static_cast<std::vector<Out>*>(p); });
  return nb::ndarray<nb::numpy, nb::ro>(copy->data(), 2, shape, free, nullptr, dlpack_dtype<Out>())
      .cast();
}

// A read-only view of `rows` kept alive by `owner` (bf16: a float32 copy, NumPy has no bf16).
template <class S>
nb::object numpy_view_rows(ConstRowsView<S> rows, nb::handle owner) {
  if constexpr (std::is_same_v<S, bf16>) {
    return numpy_copy_rows(rows);
  } else {
    const std::size_t shape[2] = {static_cast<std::size_t>(rows.rows),
                                  static_cast<std::size_t>(rows.cols)};
    const std::int64_t strides[2] = {static_cast<std::int64_t>(rows.stride), 1};
    return nb::ndarray<nb::numpy, nb::ro>(rows.data, 2, shape, owner, strides, dlpack_dtype<S>())
        .cast();
  }
}

template <class T>
nb::object numpy_view_vector(const T* data, Index n, nb::handle owner) {
  const std::size_t shape[1] = {static_cast<std::size_t>(n)};
  return nb::ndarray<nb::numpy, nb::ro>(data, 1, shape, owner, nullptr, nb::dtype<T>())
      .cast();
}

// ---- the double-precision references (ovq/ref/reference.hpp), for the tests ----

ref::Matrix reference_of(const SelfAttentionOptions& o, const ref::Matrix& q, const ref::Matrix& k,
                         const ref::Matrix& v, const ref::Matrix*) {
  return ref::self_attention(q, k, v, o.beta, o.causal, o.window);
}
ref::Matrix reference_of(const LinearAttentionOptions& o, const ref::Matrix& q,
                         const ref::Matrix& k, const ref::Matrix& v, const ref::Matrix*) {
  return ref::linear_attention(q, k, v, o);
}
ref::Matrix reference_of(const VqAttentionOptions& o, const ref::Matrix& q, const ref::Matrix& k,
                         const ref::Matrix& v, const ref::Matrix* codebook) {
  if (codebook == nullptr) throw nb::value_error("reference: VQ-attention needs its codebook");
  return ref::vq_attention(q, k, v, *codebook, o.beta);
}
ref::Matrix reference_of(const OvqOptions& o, const ref::Matrix& q, const ref::Matrix& k,
                         const ref::Matrix& v, const ref::Matrix*) {
  return ref::ovq_attention(q, k, v, o);
}

ref::Matrix matrix_of(const InArray& a, const char* name) {
  check_array<double>("reference", name, a, 2, "(T, d)");
  const ConstRowsView<double> r = rows_of<double>(a);
  return Eigen::Map<const RowMatrix<double>>(r.data, r.rows, r.cols);
}

template <class F>
nb::object reference(const PyMixer<F>& self, const InArray& q, const InArray& k, const InArray& v,
                     const std::optional<InArray>& codebook) {
  const ref::Matrix qm = matrix_of(q, "q"), km = matrix_of(k, "k"), vm = matrix_of(v, "v");
  std::optional<ref::Matrix> cb;
  if (codebook) cb = matrix_of(*codebook, "codebook");
  ref::Matrix o;
  {
    nb::gil_scoped_release release;
    o = reference_of(self.options(), qm, km, vm, cb ? &*cb : nullptr);
  }
  return numpy_copy_rows<double>({o.data(), o.rows(), o.cols(), o.cols()});
}

// ---- binding ----

template <class F>
void bind_state_common(nb::class_<PyState<F>>& cls) {
  using St = PyState<F>;
  cls.def_prop_ro("dtype", [](const St& s) {
       return visit(s, [](const auto& state) {
         return std::string(element_name<element_of<std::decay_t<decltype(state)>>>());
       });
     }, "The element type of its rows: 'float32', 'float64', 'bfloat16' or 'float16'.")
      .def_prop_ro("dk", [](const St& s) { return visit(s, [](const auto& x) { return x.key_dim(); }); })
      .def_prop_ro("dv", [](const St& s) { return visit(s, [](const auto& x) { return x.value_dim(); }); })
      .def_prop_ro("t", [](const St& s) {
         std::lock_guard<std::mutex> lock(*s.mutex);
         return visit(s, [](const auto& x) { return x.tokens(); });
       }, "Tokens the state has seen.")
      .def_prop_ro("n", [](const St& s) {
         std::lock_guard<std::mutex> lock(*s.mutex);
         return visit(s, [](const auto& x) { return rows_held(x); });
       }, "Rows it holds: the cache's rows (self), pending rows (linear), codebook rows (VQ), "
          "dictionary rows (OVQ).")
      .def_prop_ro("bytes", [](const St& s) {
         std::lock_guard<std::mutex> lock(*s.mutex);
         return visit(s, [](const auto& x) { return x.bytes(); });
       }, "Bytes of memory its contents take.")
      .def("reset", [](St& s) {
         std::lock_guard<std::mutex> lock(*s.mutex);
         visit(s, [](auto& x) { x.reset(); });
       }, "Forgets every token (a VQ state keeps its codebook).")
      .def("__copy__", [](const St& s) { return St(s); })
      .def("__deepcopy__", [](const St& s, nb::handle) { return St(s); }, "memo"_a)
      .def("__eq__", [](const St& a, const St& b) {
         if (&a == &b) return true;
         const typename St::Variant x = a.locked_copy();
         std::lock_guard<std::mutex> lock(*b.mutex);
         return x == b.state;
       })
      .def("__getstate__", [](const St& s) {
         return std::make_tuple(nb::object(options_dict<F>(s.options)), encode(s));
       })
      .def("__setstate__", [](St& s, const std::tuple<nb::dict, nb::bytes>& t) {
         new (&s) St(decode<F>(options_from<F>(std::get<0>(t)), std::get<1>(t)));
       })
      .def("to_bytes", [](const St& s) { return encode(s); },
           "The state file's bytes (what save_state writes): bitwise the state.")
      .def("options", [](const St& s) { return options_dict<F>(s.options); },
           "The options of the mixer that made it.");
  cls.attr("__hash__") = nb::none();
}

template <class F>
nb::class_<PyMixer<F>> bind_mixer(nb::module_& m, const char* layer_name) {
  using M = PyMixer<F>;
  using St = PyState<F>;

  auto cls = nb::class_<M>(m, (std::string("_") + F::name).c_str());
  cls.def("__init__", [](M* self, nb::kwargs kw) { new (self) M(options_from<F>(nb::dict(kw))); })
      .def("options", [](const M& self) { return options_dict<F>(self.options()); })
      .def("_check_dtype", [](const M& self, const std::string& dtype) {
         with_element(dtype, [&](auto s) { typed_mixer<F, decltype(s)>(self); });
       })
      .def("_forward", [](const M& self, St& st, nb::handle q, nb::handle k, nb::handle v,
                          nb::handle out, nb::handle lse, int threads) {
         // One after the other: arguments of a call are converted in no set order, and the
         // first bad one is the one to report.
         const char* w = "forward";
         const InArray qa = input(q, w, "q"), ka = input(k, w, "k"), va = input(v, w, "v");
         const OutArray oa = output(out, w, "out");
         read_call(w, 2, self, st, qa, ka, va, oa, optional_output(lse, w, "lse"), threads);
       }, "state"_a, "q"_a, "k"_a, "v"_a, "out"_a, "lse"_a.none(), "threads"_a)
      .def("_step", [](const M& self, St& st, nb::handle q, nb::handle k, nb::handle v,
                       nb::handle out, int threads) {
         const char* w = "step";
         const InArray qa = input(q, w, "q"), ka = input(k, w, "k"), va = input(v, w, "v");
         if (!out.is_none()) {
           read_call(w, 1, self, st, qa, ka, va, output(out, w, "out"), std::nullopt, threads);
           return nb::borrow(out);
         }
         NewOutput o = new_step_output(st, q, qa, ka, va);
         read_call(w, 1, self, st, qa, ka, va, o.array, std::nullopt, threads);
         return o.object;
       }, "state"_a, "q"_a, "k"_a, "v"_a, "out"_a.none(), "threads"_a)
      .def("_absorb", [](const M& self, St& st, nb::handle k, nb::handle v, int threads) {
         const InArray ka = input(k, "absorb", "k"), va = input(v, "absorb", "v");
         absorb(self, st, ka, va, threads);
       }, "state"_a, "k"_a, "v"_a, "threads"_a)
      .def("_decode", [](const M& self, const nb::bytes& data) { return decode<F>(self.options(), data); })
      .def("_reference", &reference<F>, "q"_a, "k"_a, "v"_a, "codebook"_a.none() = nb::none(),
           "The double-precision reference of MATH.md over float64 q, k, v (tests).")
      .def("_matches", [](const M& self, const St& s) {
         // The mixer can run the state: its shape options agree (capacity, chunk, window).
         return visit(s, [&](const auto& state) {
           using S = element_of<std::decay_t<decltype(state)>>;
           try {
             typed_mixer<F, S>(self).check_state("forward", state);
             return true;
           } catch (const ovq::ArgumentError&) {
             return false;
           }
         });
       });

  // The multi-head layer of this mixer.
  using L = PyMultiHead<F>;
  auto layer = nb::class_<L>(m, layer_name);
  layer.def_prop_ro("dtype", [](const L& l) {
         return std::visit([](const auto& x) { return std::string(element_name<typename std::decay_t<decltype(x)>::Scalar>()); }, l.layer);
       })
      .def_prop_ro("batch", [](const L& l) { return std::visit([](const auto& x) { return x.batch(); }, l.layer); })
      .def_prop_ro("query_heads", [](const L& l) { return std::visit([](const auto& x) { return x.query_heads(); }, l.layer); })
      .def_prop_ro("kv_heads", [](const L& l) { return std::visit([](const auto& x) { return x.kv_heads(); }, l.layer); })
      .def_prop_ro("dk", [](const L& l) { return std::visit([](const auto& x) { return x.key_dim(); }, l.layer); })
      .def_prop_ro("dv", [](const L& l) { return std::visit([](const auto& x) { return x.value_dim(); }, l.layer); })
      .def_prop_ro("bytes", [](const L& l) {
         std::lock_guard<std::mutex> lock(*l.mutex);
         return std::visit([](const auto& x) { return x.bytes(); }, l.layer);
       })
      .def("reset", [](L& l) {
         std::lock_guard<std::mutex> lock(*l.mutex);
         std::visit([](auto& x) { x.reset(); }, l.layer);
       })
      .def_prop_ro("head_betas", [](const L& l) {
         std::lock_guard<std::mutex> lock(*l.mutex);
         return std::visit([](const auto& x) { return x.head_betas(); }, l.layer);
       })
      .def("set_head_betas", [](L& l, const std::vector<double>& betas) {
         std::lock_guard<std::mutex> lock(*l.mutex);
         std::visit([&](auto& x) { x.set_head_betas(betas); }, l.layer);
       }, "betas"_a)
      .def("state", [](const L& l, Index b, Index h) {
         std::lock_guard<std::mutex> lock(*l.mutex);
         return std::visit([&](const auto& x) {
           return St(l.options, typename St::Variant(x.state(b, h)));
         }, l.layer);
       }, "b"_a, "kv_head"_a, "A copy of the state of batch entry b, key/value head kv_head.")
      .def("_forward", [](L& l, nb::handle q, nb::handle k, nb::handle v, nb::handle out,
                          nb::handle lse, int threads) {
         const char* w = "forward";
         const InArray qa = input(q, w, "q"), ka = input(k, w, "k"), va = input(v, w, "v");
         const OutArray oa = output(out, w, "out");
         mh_read(w, 4, l, qa, ka, va, oa, optional_output(lse, w, "lse"), threads);
       }, "q"_a, "k"_a, "v"_a, "out"_a, "lse"_a.none(), "threads"_a)
      .def("_step", [](L& l, nb::handle q, nb::handle k, nb::handle v, nb::handle out,
                       int threads) {
         const char* w = "step";
         const InArray qa = input(q, w, "q"), ka = input(k, w, "k"), va = input(v, w, "v");
         if (!out.is_none()) {
           mh_read(w, 3, l, qa, ka, va, output(out, w, "out"), std::nullopt, threads);
           return nb::borrow(out);
         }
         NewOutput o = mh_new_step_output(l, q, qa, ka, va);
         mh_read(w, 3, l, qa, ka, va, o.array, std::nullopt, threads);
         return o.object;
       }, "q"_a, "k"_a, "v"_a, "out"_a.none(), "threads"_a)
      .def("_absorb", [](L& l, nb::handle k, nb::handle v, int threads) {
         const InArray ka = input(k, "absorb", "k"), va = input(v, "absorb", "v");
         mh_absorb(l, ka, va, threads);
       }, "k"_a, "v"_a, "threads"_a)
      .def("_time_steps", [](L& l, nb::handle q, nb::handle k, nb::handle v, nb::handle out,
                             int iters, int threads) {
         const char* w = "step";
         const InArray qa = input(q, w, "q"), ka = input(k, w, "k"), va = input(v, w, "v");
         return mh_time_steps(l, qa, ka, va, output(out, w, "out"), iters, threads);
       }, "q"_a, "k"_a, "v"_a, "out"_a, "iters"_a, "threads"_a)
      .def("_op_handle", &op_handle_of<F>,
           "The handle torch.ops.ovq.* know this layer by (op_table.h).")
      .def("to_bytes", &mh_encode<F>)
      .def("_load_bytes", &mh_decode<F>)
      .def("__copy__", [](const L& l) { return L(l); })
      .def("__deepcopy__", [](const L& l, nb::handle) { return L(l); }, "memo"_a);
  return cls;
}

template <class F>
void bind_dims_state(nb::class_<PyMixer<F>>& cls) {
  using M = PyMixer<F>;
  cls.def("_make_state", [](const M& self, Index dk, Index dv, const std::string& dtype) {
    return with_element(dtype, [&](auto s) {
      using S = decltype(s);
      return PyState<F>(self.options(),
                        typename PyState<F>::Variant(typed_mixer<F, S>(self).make_state(dk, dv)));
    });
  });
  cls.def("_make_layer", [](const M& self, Index batch, Index hq, Index hkv, Index dk, Index dv,
                            const std::string& dtype) {
    return with_element(dtype, [&](auto s) {
      using S = decltype(s);
      return PyMultiHead<F>(self.options(), typename PyMultiHead<F>::Variant(MultiHead<MixerOf<F, S>>(
                                                typed_mixer<F, S>(self), batch, hq, hkv, dk, dv)));
    });
  });
}

template <class S>
ConstRowsView<S> codebook_rows(const InArray& a, Index first, Index rows) {
  const ConstRowsView<S> all = rows_of<S>(a);
  return {all.data + first * all.cols, rows, all.cols, all.cols};
}

void bind_vq_state(nb::class_<PyMixer<VqFamily>>& cls) {
  using F = VqFamily;
  using M = PyMixer<F>;
  cls.def("_make_state", [](const M& self, const InArray& codebook, Index dv) {
    const std::string dtype = element_of_array(codebook, "make_state", "codebook");
    return with_element(dtype, [&](auto s) {
      using S = decltype(s);
      check_codebook<S>(codebook);
      const auto& mixer = typed_mixer<F, S>(self);
      const ConstRowsView<S> cb = rows_of<S>(codebook);
      Eigen::Map<const RowMatrix<S>> map(cb.data, cb.rows, cb.cols);
      return PyState<F>(self.options(), typename PyState<F>::Variant(mixer.make_state(map, dv)));
    });
  });
  // codebooks: (Hkv, S, dk), one codebook per key/value head.
  cls.def("_make_layer", [](const M& self, Index batch, Index hq, const InArray& codebooks, Index dv) {
    const std::string dtype = element_of_array(codebooks, "MultiHead", "codebooks");
    return with_element(dtype, [&](auto s) {
      using S = decltype(s);
      check_array<S>("MultiHead", "codebooks", codebooks, 3, "(Hkv, S, dk)");
      const auto& mixer = typed_mixer<F, S>(self);
      const Index hkv = static_cast<Index>(codebooks.shape(0));
      const Index size = static_cast<Index>(codebooks.shape(1));
      std::vector<typename MixerOf<F, S>::State> states;
      for (Index h = 0; h < hkv; ++h) {
        const ConstRowsView<S> cb = codebook_rows<S>(codebooks, h * size, size);
        Eigen::Map<const RowMatrix<S>> map(cb.data, cb.rows, cb.cols);
        states.push_back(mixer.make_state(map, dv));
      }
      return PyMultiHead<F>(self.options(), typename PyMultiHead<F>::Variant(
                                                MultiHead<MixerOf<F, S>>(mixer, batch, hq, std::move(states))));
    });
  });
}

template <class F, class Get>
auto locked_view(Get get) {
  return [get](nb::handle self_obj) {
    const PyState<F>& s = nb::cast<const PyState<F>&>(self_obj);
    std::lock_guard<std::mutex> lock(*s.mutex);
    return visit(s, [&](const auto& x) { return get(x, self_obj); });
  };
}

void bind_views(nb::class_<PyState<SelfFamily>>& cls) {
  using F = SelfFamily;
  // Copies: the cache's buffer moves as it grows.
  cls.def_prop_ro("keys", locked_view<F>([](const auto& x, nb::handle) { return numpy_copy_rows(x.keys()); }),
                  "The cached keys (n, dk), a copy (the cache's buffer moves as it grows).")
      .def_prop_ro("values", locked_view<F>([](const auto& x, nb::handle) { return numpy_copy_rows(x.values()); }),
                   "The cached values (n, dv), a copy.");
}

void bind_views(nb::class_<PyState<LinearFamily>>& cls) {
  using F = LinearFamily;
  cls.def_prop_ro("kv", locked_view<F>([](const auto& x, nb::handle owner) {
         const auto& kv = x.kv();
         return numpy_view_rows(ConstRowsView<std::decay_t<decltype(*kv.data())>>{kv.data(), kv.rows(), kv.cols(), kv.cols()}, owner);
       }), "S (dk, dv) over the complete chunks, a read-only view (fp32 for 16-bit elements).")
      .def_prop_ro("k_sum", locked_view<F>([](const auto& x, nb::handle owner) {
         return numpy_view_vector(x.k_sum().data(), x.k_sum().size(), owner);
       }), "z (dk) over the complete chunks, a read-only view.")
      .def_prop_ro("keys", locked_view<F>([](const auto& x, nb::handle) { return numpy_copy_rows(x.pending_keys()); }),
                   "The pending chunk's keys (n, dk), a copy.")
      .def_prop_ro("values", locked_view<F>([](const auto& x, nb::handle) { return numpy_copy_rows(x.pending_values()); }),
                   "The pending chunk's values (n, dv), a copy.");
}

template <class F>
void bind_dictionary_views(nb::class_<PyState<F>>& cls) {
  cls.def_prop_ro("keys", locked_view<F>([](const auto& x, nb::handle owner) {
         return numpy_view_rows(dictionary_of(x)->keys(), owner);
       }), "D_k (n, dk): the active rows as the reads see them, a read-only view.")
      .def_prop_ro("values", locked_view<F>([](const auto& x, nb::handle owner) {
         return numpy_view_rows(dictionary_of(x)->values(), owner);
       }), "D_v (n, dv), a read-only view.")
      .def_prop_ro("counts", locked_view<F>([](const auto& x, nb::handle owner) {
         const auto* d = dictionary_of(x);
         return numpy_view_vector(d->counts(), d->size(), owner);
       }), "Tokens assigned to each active row (n,), int64, a read-only view.")
      .def_prop_ro("pending", locked_view<F>([](const auto& x, nb::handle) { return x.pending(); }),
                   "Tokens of the current chunk, not yet written into the dictionary.");
}

// ---- policies ----

void bind_policies(nb::module_& m) {
  nb::class_<Growth>(m, "Growth", "How the OVQ dictionary grows: Growth.dirichlet(alpha) or Growth.linear(rate).")
      .def_static("dirichlet", [](double alpha) {
         Growth g = Growth::dirichlet(alpha);
         g.validate("Growth.dirichlet");
         return g;
       }, "alpha"_a = 0.0,
       "G(t) = ceil(N (1 - (1 + t / alpha)^(-alpha / N))); alpha = 0: the capacity N.")
      .def_static("linear", [](double rate) {
         Growth g = Growth::linear(rate);
         g.validate("Growth.linear");
         return g;
       }, "rate"_a = 1.0, "G(t) = ceil(rate t).")
      .def_static("saturating", &Growth::saturating,
                  "G(t) = floor(N t / (N + t)): dirichlet with alpha = N rounded down.")
      .def_prop_ro("kind", [](const Growth& g) {
         return g.kind == Growth::Kind::dirichlet ? "dirichlet"
                : g.kind == Growth::Kind::linear  ? "linear"
                                                  : "saturating";
       })
      .def_ro("alpha", &Growth::alpha)
      .def_ro("rate", &Growth::rate)
      .def("target", [](const Growth& g, std::int64_t t, Index capacity) { return g.target(t, capacity); },
           "t"_a, "capacity"_a, "min(N, G(t)).")
      .def("__eq__", [](const Growth& a, const Growth& b) { return a.kind == b.kind && a.alpha == b.alpha && a.rate == b.rate; })
      .def("__repr__", [](const Growth& g) {
         if (g.kind == Growth::Kind::saturating) return std::string("Growth.saturating()");
         return g.kind == Growth::Kind::dirichlet ? str("Growth.dirichlet(alpha=", g.alpha, ")")
                                                  : str("Growth.linear(rate=", g.rate, ")");
       })
      .def("__getstate__", [](const Growth& g) { return std::make_tuple(int(g.kind), g.alpha, g.rate); })
      .def("__setstate__", [](Growth& g, const std::tuple<int, double, double>& t) {
         const int kind = std::get<0>(t);
         if (kind < 0 || kind > 2) throw nb::value_error("Growth: kind out of range");
         new (&g) Growth{static_cast<Growth::Kind>(kind), std::get<1>(t), std::get<2>(t)};
       });
  nb::class_<Seeding>(m, "Seeding", "How new OVQ centroids are chosen: Seeding.spread() or Seeding.random(seed).")
      .def_static("spread", &Seeding::spread, "Greedy spread-maximising: the chunk key least similar to every centroid so far.")
      .def_static("random", &Seeding::random, "seed"_a, "Distinct chunk rows from a generator seeded with (seed, chunk index).")
      .def_static("lowest_similarity", &Seeding::lowest_similarity,
                  "Assignment first; the keys least similar to their nearest row seed rows of their own.")
      .def_prop_ro("kind", [](const Seeding& s) {
         return s.kind == Seeding::Kind::spread   ? "spread"
                : s.kind == Seeding::Kind::random ? "random"
                                                  : "lowest_similarity";
       })
      .def_ro("seed", &Seeding::seed)
      .def("__eq__", [](const Seeding& a, const Seeding& b) { return a.kind == b.kind && a.seed == b.seed; })
      .def("__repr__", [](const Seeding& s) {
         if (s.kind == Seeding::Kind::lowest_similarity) return std::string("Seeding.lowest_similarity()");
         return s.kind == Seeding::Kind::spread ? std::string("Seeding.spread()") : str("Seeding.random(seed=", s.seed, ")");
       })
      .def("__getstate__", [](const Seeding& s) { return std::make_tuple(int(s.kind), s.seed); })
      .def("__setstate__", [](Seeding& s, const std::tuple<int, std::uint64_t>& t) {
         const int kind = std::get<0>(t);
         if (kind < 0 || kind > 2) throw nb::value_error("Seeding: kind out of range");
         new (&s) Seeding{static_cast<Seeding::Kind>(kind), std::get<1>(t)};
       });
  nb::class_<UpdateRate>(m, "UpdateRate", "How a centroid moves: UpdateRate.adaptive() (running mean) or UpdateRate.constant(eta).")
      .def_static("adaptive", &UpdateRate::adaptive, "Running mean, rate cnt / (c + cnt).")
      .def_static("constant", [](double eta) {
         UpdateRate r = UpdateRate::constant(eta);
         r.validate("UpdateRate.constant");
         return r;
       }, "eta"_a, "D = (1 - eta) D + eta mean(new members).")
      .def_prop_ro("kind", [](const UpdateRate& r) { return r.kind == UpdateRate::Kind::adaptive ? "adaptive" : "constant"; })
      .def_ro("eta", &UpdateRate::eta)
      .def("__eq__", [](const UpdateRate& a, const UpdateRate& b) { return a.kind == b.kind && a.eta == b.eta; })
      .def("__repr__", [](const UpdateRate& r) {
         return r.kind == UpdateRate::Kind::adaptive ? std::string("UpdateRate.adaptive()") : str("UpdateRate.constant(eta=", r.eta, ")");
       })
      .def("__getstate__", [](const UpdateRate& r) { return std::make_tuple(int(r.kind), r.eta); })
      .def("__setstate__", [](UpdateRate& r, const std::tuple<int, double>& t) {
         new (&r) UpdateRate{std::get<0>(t) == 0 ? UpdateRate::Kind::adaptive : UpdateRate::Kind::constant, std::get<1>(t)};
       });
}

// ---- free functions ----

// merge(o_a, lse_a, o_b, lse_b): folds b into a, in place. o: (..., d), lse: (...).
void merge(const OutArray& o_a, const OutArray& lse_a, const InArray& o_b, const InArray& lse_b) {
  const char* where = "merge";
  const InArray oa = as_input(o_a), la = as_input(lse_a);
  auto run = [&](auto s) {
    using S = decltype(s);
    using C = Compute<S>;
    check_array<S>(where, "o_a", oa, oa.ndim(), "");
    check_array<S>(where, "o_b", o_b, oa.ndim(), "(the rank of o_a)");
    check_array<C>(where, "lse_a", la, oa.ndim() == 0 ? 0 : oa.ndim() - 1, "(o_a's without its last)");
    check_array<C>(where, "lse_b", lse_b, la.ndim(), "(lse_a's)");
    for (std::size_t i = 0; i < oa.ndim(); ++i)
      if (oa.shape(i) != o_b.shape(i))
        throw nb::value_error(str(where, ": o_b has shape ", shape_string(o_b), ", expected o_a's ", shape_string(oa)).c_str());
    for (std::size_t i = 0; i < la.ndim(); ++i)
      if (la.shape(i) != oa.shape(i) || lse_b.shape(i) != oa.shape(i))
        throw nb::value_error(str(where, ": lse_a ", shape_string(la), " and lse_b ", shape_string(lse_b),
                                  " must have o_a's shape without its last dimension, ", shape_string(oa)).c_str());
    check_disjoint(where, "o_a", oa, {{"lse_a", &la}, {"o_b", &o_b}, {"lse_b", &lse_b}});
    check_disjoint(where, "lse_a", la, {{"o_b", &o_b}, {"lse_b", &lse_b}});
    const RowsView<S> a = out_rows_of<S>(o_a);
    const ConstRowsView<S> b = rows_of<S>(o_b);
    nb::gil_scoped_release release;
    merge_partials(a, static_cast<C*>(lse_a.data()), b, static_cast<const C*>(lse_b.data()));
  };
  if (oa.ndim() < 1) throw nb::value_error("merge: o_a must have at least one dimension");
  with_element(element_of_array(oa, where, "o_a"), run);
}

// fit_codebook(keys (n, dk), size, ...) -> (size, dk), of keys' dtype (float32 or float64).
nb::object fit_codebook_py(const InArray& keys, Index size, Index max_iterations, double tolerance,
                           std::uint64_t seed) {
  KMeansOptions opt;
  opt.max_iterations = max_iterations;
  opt.tolerance = tolerance;
  opt.seed = seed;
  auto run = [&](auto s) -> nb::object {
    using S = decltype(s);
    check_array<S>("fit_codebook", "keys", keys, 2, "(n, dk)");
    const ConstRowsView<S> k = rows_of<S>(keys);
    RowMatrix<S> c;
    {
      nb::gil_scoped_release release;
      c = fit_codebook<S>(Eigen::Map<const RowMatrix<S>>(k.data, k.rows, k.cols), size, opt);
    }
    return numpy_copy_rows<S>({c.data(), c.rows(), c.cols(), c.cols()});
  };
  if (keys.dtype() == dlpack_dtype<float>()) return run(float{});
  if (keys.dtype() == dlpack_dtype<double>()) return run(double{});
  throw nb::type_error(str("fit_codebook: keys have dtype ", dtype_name(keys.dtype()),
                           ", expected float32 or float64").c_str());
}

}  // namespace ovq::python

NB_MODULE(_ovq, m) {
  using namespace ovq::python;
  m.doc() = "ovq's C++ mixers, states and layers; use the ovq package, which wraps this module.";
  m.def("_torch_exchange_table", [] {
    const TorchTypes* t = torch_types();
    return t != nullptr && t->table != nullptr;
  }, "Whether torch tensors are read through PyTorch's DLPack exchange table (tests).");
  // Objects still referenced when the interpreter exits (a layer in a module-level registry, a
  // state in a global) are freed after this module; that is not a leak worth a warning.
  nb::set_leak_warnings(false);

  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const ovq::ArgumentError& e) {
      PyErr_SetString(PyExc_ValueError, e.what());
    } catch (const ovq::FormatError& e) {
      PyErr_SetString(PyExc_ValueError, e.what());
    } catch (const ovq::IoError& e) {
      PyErr_SetString(PyExc_OSError, e.what());
    }
  });

  bind_policies(m);

  // The states first: the mixers' signatures name them.
  nb::class_<PyState<SelfFamily>> self_state(m, "SelfAttentionState", "A key/value cache.");
  bind_state_common<SelfFamily>(self_state);
  bind_views(self_state);
  nb::class_<PyState<LinearFamily>> linear_state(m, "LinearAttentionState",
                                                 "Linear attention's sums S, z and pending rows.");
  bind_state_common<LinearFamily>(linear_state);
  bind_views(linear_state);
  nb::class_<PyState<VqFamily>> vq_state(m, "VQAttentionState",
                                         "A fixed codebook with running-mean values and counts.");
  bind_state_common<VqFamily>(vq_state);
  bind_dictionary_views<VqFamily>(vq_state);
  nb::class_<PyState<OvqFamily>> ovq_state(m, "OVQAttentionState",
                                           "The online dictionary and its pending chunk.");
  bind_state_common<OvqFamily>(ovq_state);
  bind_dictionary_views<OvqFamily>(ovq_state);

  auto self_cls = bind_mixer<SelfFamily>(m, "_SelfAttentionLayer");
  bind_dims_state<SelfFamily>(self_cls);
  auto linear_cls = bind_mixer<LinearFamily>(m, "_LinearAttentionLayer");
  bind_dims_state<LinearFamily>(linear_cls);
  linear_cls.def("_chain", [](const PyMixer<LinearFamily>& self, const PyState<LinearFamily>& prefix,
                              const PyState<LinearFamily>& summary) {
    const auto a = prefix.locked_copy();
    const auto b = summary.locked_copy();
    if (a.index() != b.index())
      throw nb::type_error("chain: prefix and summary have different dtypes");
    return std::visit([&](const auto& pa) {
      using State = std::decay_t<decltype(pa)>;
      using S = element_of<State>;
      const State& pb = std::get<State>(b);
      return PyState<LinearFamily>(self.options(), typename PyState<LinearFamily>::Variant(
                                                       typed_mixer<LinearFamily, S>(self).chain(pa, pb)));
    }, a);
  }, "prefix"_a, "summary"_a);
  auto vq_cls = bind_mixer<VqFamily>(m, "_VQAttentionLayer");
  bind_vq_state(vq_cls);
  auto ovq_cls = bind_mixer<OvqFamily>(m, "_OVQAttentionLayer");
  bind_dims_state<OvqFamily>(ovq_cls);

  m.def("_ovq_preset", [](const std::string& name) -> nb::dict {
    return options_dict<OvqFamily>(ovq::OvqOptions::preset(name));
  }, "name"_a);
  nb::list presets;
  for (const char* name : ovq::OvqOptions::kPresetNames) presets.append(nb::str(name));
  m.attr("_ovq_presets") = nb::tuple(presets);
  m.def("_merge", &merge, "o_a"_a, "lse_a"_a, "o_b"_a, "lse_b"_a);
  m.def("_fit_codebook", &fit_codebook_py, "keys"_a, "size"_a, "max_iterations"_a, "tolerance"_a,
        "seed"_a);
  m.def("_file_dtype", [](const nb::bytes& data) { return file_element(data); });
  m.def("_op_table", [] { return nb::capsule(&kOpTable, ops::kOpTableCapsule); },
        "The layers' C table for ovq._torch_ops (op_table.h).");
#if defined(_OPENMP)
  m.attr("openmp") = true;
#else
  m.attr("openmp") = false;
#endif
  m.attr("simd") = ovq::arch::native::kName;
}
