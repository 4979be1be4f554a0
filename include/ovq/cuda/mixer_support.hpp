#pragma once
// The launches every device mixer makes around its own kernels: the finiteness check of a
// call's inputs, rows into a pending chunk, counter updates, and the common part of a read's
// parameters.
#include <cstdint>

#include "ovq/cuda/block.hpp"
#include "ovq/cuda/counters.hpp"
#include "ovq/cuda/kernels/read.hpp"
#include "ovq/cuda/kernels/rows.hpp"
#include "ovq/cuda/views.hpp"

namespace ovq::cuda::detail {

// Q (when given), K and V finite, or the state's fault is raised and the call changes nothing.
template <class Backend, class Scalar>
void launch_finite_check(StateCounters* counters, const ConstHeadsView<Scalar>* q,
                         ConstHeadsView<Scalar> k, ConstHeadsView<Scalar> v,
                         typename Backend::Stream stream) {
  kernels::CheckFiniteParams<Scalar> check;
  check.inputs[check.count++] = k;
  check.inputs[check.count++] = v;
  if (q != nullptr) check.inputs[check.count++] = *q;
  check.counters = counters;
  using P = kernels::CheckFiniteProgram<Scalar>;
  Backend::template launch<P>(Grid{P::kBlocks, 1, 1}, check, stream);
}

template <class Backend>
void launch_counters(StateCounters* counters, kernels::CounterOp op, Index n, Index limit,
                     const std::int64_t* opened, typename Backend::Stream stream,
                     Index keep = -1) {
  kernels::CounterParams u;
  u.counters = counters;
  u.op = op;
  u.n = n;
  u.keep = keep;
  u.limit = limit;
  u.opened = opened;
  Backend::template launch<kernels::CounterProgram>(Grid{}, u, stream);
}

// The call's rows k, v (heads x n) after the pending rows of each head (chunk rows each).
template <class Backend, class Scalar>
void launch_push(StateCounters* counters, ConstHeadsView<Scalar> k, ConstHeadsView<Scalar> v,
                 HeadsView<Scalar> pending_keys, HeadsView<Scalar> pending_values, Index chunk,
                 typename Backend::Stream stream) {
  kernels::CopyRowsParams<Scalar> c;
  c.src[0] = k;
  c.src[1] = v;
  c.dst[0] = pending_keys;
  c.dst[1] = pending_values;
  c.counters = counters;
  c.to_pending = true;
  c.limit = chunk;
  Backend::template launch<kernels::CopyRowsProgram<Scalar>>(
      Grid{static_cast<int>(k.rows), static_cast<int>(k.heads), 1}, c, stream);
  launch_counters<Backend>(counters, kernels::CounterOp::push, k.rows, chunk, nullptr, stream);
}

// Whether a call of `rows` rows a head over `heads` key/value heads (and `q_heads` query heads,
// 0 without queries) is small enough for CheckCopyProgram: a decode step's few rows.
inline bool small_call(Index rows, Index heads, Index q_heads) {
  using P = kernels::CheckCopyProgram<float>;
  return rows * heads <= P::kMaxRows && rows * q_heads <= P::kMaxRows;
}

// A small call's finiteness check, copy of K and V (into a pending chunk: `copy.to_pending`, or a
// cache) and counter update, in one block: launch_finite_check, then the copy and the counters'
// update, in one launch.
template <class Backend, class Scalar>
void launch_check_copy(StateCounters* counters, const ConstHeadsView<Scalar>* q,
                       ConstHeadsView<Scalar> k, ConstHeadsView<Scalar> v,
                       kernels::CopyRowsParams<Scalar> copy, kernels::CounterParams count,
                       typename Backend::Stream stream) {
  kernels::CheckCopyParams<Scalar> p;
  p.check.inputs[p.check.count++] = k;
  p.check.inputs[p.check.count++] = v;
  if (q != nullptr) p.check.inputs[p.check.count++] = *q;
  p.check.counters = counters;
  copy.src[0] = k;
  copy.src[1] = v;
  copy.counters = counters;
  p.copy = copy;
  count.counters = counters;
  p.count = count;
  Backend::template launch<kernels::CheckCopyProgram<Scalar>>(Grid{}, p, stream);
}

// The same for a pending chunk of `chunk` rows (launch_push's copy and push).
template <class Backend, class Scalar>
void launch_check_push(StateCounters* counters, const ConstHeadsView<Scalar>* q,
                       ConstHeadsView<Scalar> k, ConstHeadsView<Scalar> v,
                       HeadsView<Scalar> pending_keys, HeadsView<Scalar> pending_values,
                       Index chunk, typename Backend::Stream stream) {
  kernels::CopyRowsParams<Scalar> copy;
  copy.dst[0] = pending_keys;
  copy.dst[1] = pending_values;
  copy.to_pending = true;
  copy.limit = chunk;
  kernels::CounterParams count;
  count.op = kernels::CounterOp::push;
  count.n = k.rows;
  count.limit = chunk;
  launch_check_copy<Backend>(counters, q, k, v, copy, count, stream);
}

// Whether every row of `rows` (d entries each) starts at a 16-byte boundary and holds whole
// 16-byte pieces: the rows the 16-bit read loads 16 bytes at a time.
template <class Stored>
bool aligned_rows(const kernels::HeadRows<Stored>& rows, Index d) {
  constexpr Index kPiece = 16 / sizeof(Stored);
  return reinterpret_cast<std::uintptr_t>(rows.data) % 16 == 0 && rows.head_stride % kPiece == 0 &&
         rows.row_stride % kPiece == 0 && d % kPiece == 0;
}

// Whether a read's queries and all its rows may be loaded 16 bytes at a time (rows it does not
// have are null, which passes).
template <class Scalar, class Stored>
bool aligned_read_rows(const kernels::ReadParams<Scalar, Stored>& p) {
  return aligned_rows(p.q, p.dk) && aligned_rows(p.memory_keys, p.dk) &&
         aligned_rows(p.memory_values, p.dv) && aligned_rows(p.local_keys, p.dk) &&
         aligned_rows(p.local_values, p.dv);
}

// A read's queries, outputs and shape: q (heads g, n, dk), o (heads g, n, dv); Scalar is the
// arithmetic, Stored the rows' element.
template <class Scalar, class Stored>
kernels::ReadParams<Scalar, Stored> read_params(ConstHeadsView<Stored> q, HeadsView<Stored> o,
                                                Index heads, Index dk, Index dv, double beta,
                                                StateCounters* counters) {
  kernels::ReadParams<Scalar, Stored> p;
  p.q = {q.data, q.head_stride, q.row_stride};
  p.o = {o.data, o.head_stride, o.row_stride};
  p.states = heads;
  p.group = q.heads / heads;
  p.n_queries = q.rows;
  p.dk = dk;
  p.dv = dv;
  p.beta = static_cast<Scalar>(beta);
  p.counters = counters;
  return p;
}

}  // namespace ovq::cuda::detail
