#pragma once
// Host-side argument checks of the device mixers: shapes, widths and strides, all before
// anything is launched, with the CPU path's ovq::ArgumentError messages. (Values, which live on
// the device, are checked there: kernels/rows.hpp.)
#include <utility>

#include "ovq/core/checks.hpp"
#include "ovq/core/error.hpp"
#include "ovq/cuda/kernels/launch.hpp"
#include "ovq/cuda/views.hpp"

namespace ovq::cuda {

// The longest chunk of the device mixers (the dictionary writes' grouping is quadratic in L).
inline constexpr Index kMaxDeviceChunk = 4096;

}  // namespace ovq::cuda

namespace ovq::cuda::detail {

using ovq::detail::concat;
using ovq::detail::require;

// An input may repeat rows (a stride of 0 broadcasts a head); an output's entries must not
// overlap, or two threads would write one entry. Its two strides nest: the smaller one (rows of a
// head, or the heads of a token side by side as in a (B, T, H, d) tensor) at least a row's
// columns, the larger at least the span of the smaller axis. (An axis of one entry has no stride.)
template <class Scalar>
void check_view(const char* where, const char* name, const ConstHeadsView<Scalar>& x,
                bool output = false) {
  require(x.heads >= 0 && x.rows >= 0 && x.cols >= 0, where, name, " has shape (", x.heads, ", ",
          x.rows, ", ", x.cols, "), expected sizes >= 0");
  if (x.heads == 0 || x.rows == 0 || x.cols == 0) return;
  require(x.data != nullptr, where, name, " has no data, expected a device pointer");
  require(x.row_stride >= 0 && x.head_stride >= 0, where, name, " has strides (", x.head_stride,
          ", ", x.row_stride, "), expected >= 0");
  if (!output) return;
  struct Axis {
    const char* name;
    Index count, stride;
  };
  Axis inner{"row", x.rows, x.row_stride}, outer{"head", x.heads, x.head_stride};
  if (inner.count == 1 || (outer.count > 1 && outer.stride < inner.stride)) std::swap(inner, outer);
  require(inner.count == 1 || inner.stride >= x.cols, where, name, " has ", inner.name,
          " stride ", inner.stride, ", expected >= its ", x.cols,
          " columns (an output's entries must not overlap)");
  const Index span = (inner.count - 1) * inner.stride + x.cols;
  require(outer.count == 1 || outer.stride >= span, where, name, " has ", outer.name, " stride ",
          outer.stride, ", expected >= ", span, ", the span of its ", inner.count, " ",
          inner.name, "s (an output's entries must not overlap)");
}

// The inputs of a read and write call: q (heads * group, T, dk), k (heads, T, dk),
// v (heads, T, dv), o (heads * group, T, dv). q and o are skipped for a write-only call.
template <class Scalar>
void check_call(const char* where, Index heads, Index dk, Index dv, const ConstHeadsView<Scalar>* q,
                const ConstHeadsView<Scalar>& k, const ConstHeadsView<Scalar>& v,
                const HeadsView<Scalar>* o) {
  check_view(where, "K", k);
  check_view(where, "V", v);
  require(k.heads == heads, where, "K has ", k.heads, " heads, expected ", heads,
          " (the state's key/value heads)");
  ovq::detail::check_cols(where, "K", k.cols, dk, "the state's dk");
  ovq::detail::check_cols(where, "V", v.cols, dv, "the state's dv");
  require(v.heads == heads, where, "V has ", v.heads, " heads, expected ", heads);
  ovq::detail::check_rows(where, "V", v.rows, k.rows, "the rows of K");
  if (q == nullptr) return;
  check_view(where, "Q", *q);
  check_view(where, "O", ConstHeadsView<Scalar>(*o), true);
  require(q->heads >= heads && q->heads % heads == 0, where, "Q has ", q->heads,
          " heads, expected a multiple of the ", heads, " key/value heads");
  ovq::detail::check_cols(where, "Q", q->cols, dk, "the state's dk");
  ovq::detail::check_rows(where, "Q", q->rows, k.rows, "the rows of K");
  require(o->heads == q->heads && o->rows == q->rows && o->cols == dv, where, "O has shape (",
          o->heads, ", ", o->rows, ", ", o->cols, "), expected (", q->heads, ", ", q->rows, ", ",
          dv, ")");
}

// A forward call's log-sum-exp output: lse (heads * group, T, 1), as Q's rows.
template <class Compute, class Scalar>
void check_lse(const char* where, const HeadsView<Compute>& lse, const ConstHeadsView<Scalar>& q) {
  check_view(where, "lse", ConstHeadsView<Compute>(lse), true);
  require(lse.heads == q.heads && lse.rows == q.rows && lse.cols == 1, where, "lse has shape (",
          lse.heads, ", ", lse.rows, ", ", lse.cols, "), expected (", q.heads, ", ", q.rows,
          ", 1): one entry per query");
}

inline void check_query_heads(const char* where, Index query_heads, Index heads) {
  require(query_heads >= heads && query_heads % heads == 0, where, "query heads = ", query_heads,
          ", expected a multiple of the ", heads, " key/value heads");
}

inline void check_device_chunk(const char* where, Index chunk) {
  require(chunk >= 1 && chunk <= kMaxDeviceChunk, where, "chunk = ", chunk, ", expected 1 ... ",
          kMaxDeviceChunk, " on CUDA");
}

inline void check_widths(const char* where, Index dk, Index dv) {
  require(dk >= 1 && dk <= kernels::kMaxHeadWidth, where, "dk = ", dk, ", expected 1 ... ",
          kernels::kMaxHeadWidth, " (the CUDA kernels' widest head)");
  require(dv >= 1 && dv <= kernels::kMaxHeadWidth, where, "dv = ", dv, ", expected 1 ... ",
          kernels::kMaxHeadWidth, " (the CUDA kernels' widest head)");
}

}  // namespace ovq::cuda::detail
