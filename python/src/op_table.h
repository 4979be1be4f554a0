// The C interface between ovq._ovq (which owns the multi-head layers) and ovq._torch_ops (which
// registers them with PyTorch's dispatcher as the ops torch.ops.ovq.*): plain structs and
// function pointers, so that the two modules share no C++ types and the second can be built
// against PyTorch's headers alone.
//
// ovq._ovq hands the table out as a capsule named kOpTableCapsule. Every function runs without
// the GIL (PyTorch calls its kernels without it; one that holds it gives it up for the call),
// finds the layer by its handle (MultiHead._op_handle()), runs the same checks and the same
// code as the layer's Python methods, and returns kOpOk, or an error kind with the message
// written to `message` (NUL-terminated, at most `capacity` bytes).
#ifndef OVQ_PYTHON_OP_TABLE_H
#define OVQ_PYTHON_OP_TABLE_H

#include <cstddef>
#include <cstdint>

namespace ovq::python::ops {

inline constexpr const char* kOpTableCapsule = "ovq._ovq.op_table";
inline constexpr std::uint32_t kOpTableVersion = 3;
inline constexpr int kMaxDims = 8;

// A strided array in memory: DLPack's element codes (kDLFloat 2, kDLBfloat 4, ...), device
// types (kDLCPU 1) and strides in elements.
struct Array {
  void* data;
  std::int32_t device_type;
  std::uint8_t code, bits;
  std::int32_t ndim;
  std::int64_t shape[kMaxDims];
  std::int64_t strides[kMaxDims];
};

enum Status : int { kOpOk = 0, kOpTypeError = 1, kOpValueError = 2, kOpRuntimeError = 3 };

// The caller's allocator for the outputs: a new C-contiguous CPU array of `shape` (ndim
// dimensions) and element (code, bits), described into *out; kOpOk, or an error kind with the
// message. A call checks its inputs before it asks (so a bad input is what the caller hears
// about), and asks for the outputs the layer would make: out (B, Hq, [T,] dv) of the layer's
// element, lse (B, Hq, T) of its accumulation type.
using Allocate = int (*)(void* context, std::int32_t ndim, const std::int64_t* shape,
                         std::uint8_t code, std::uint8_t bits, Array* out, char* message,
                         std::size_t capacity);

struct Table {
  std::uint32_t version;  // kOpTableVersion
  // ndim 4, forward: q (B, Hq, T, dk), k (B, Hkv, T, dk), v (B, Hkv, T, dv) -> out
  // (B, Hq, T, dv), and lse (B, Hq, T) with `with_lse`. ndim 3, step: the same without T (and
  // no lse).
  int (*read)(std::int64_t handle, std::int32_t ndim, const Array* q, const Array* k,
              const Array* v, bool with_lse, Allocate allocate, void* context, int threads,
              char* message, std::size_t capacity);
  // k (B, Hkv, T, dk), v (B, Hkv, T, dv) into the states.
  int (*absorb)(std::int64_t handle, const Array* k, const Array* v, int threads, char* message,
                std::size_t capacity);
};

}  // namespace ovq::python::ops

#endif  // OVQ_PYTHON_OP_TABLE_H
