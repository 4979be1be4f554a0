#pragma once
// The online-softmax state (o, m, l) of one query row: the common currency of every read.
//
// Over the logits s_j seen so far, m = max_j s_j, l = sum_j exp(s_j - m) and
// o = sum_j exp(s_j - m) u_j / l, the softmax average itself. Keeping o normalised (rather than
// the running sum) keeps every partial result a convex combination of values, so it cannot
// overflow whatever the number of rows. Two states over disjoint sets of rows merge exactly,
// which is what lets a read be tiled, and split across threads or GPU blocks for decoding.
// No Eigen here: the CPU tile loop and the CUDA kernels share these definitions.
#include <cmath>

#include "ovq/config.hpp"
#include "ovq/core/views.hpp"

namespace ovq {

template <class Scalar>
struct SoftmaxStats {
  Scalar m = -Scalar(INFINITY);
  Scalar l = Scalar(0);

  OVQ_HOST_DEVICE bool empty() const { return !(l > Scalar(0)); }
};

// Whether merges round o_a wa + o_b wb once (fused) or twice. The default is the target's native
// form; the CUDA kernels and their host emulation always fuse, so that both give the same bits.
#if defined(OVQ_HAS_FMA)
inline constexpr bool kNativeFusedMerge = true;
#else
inline constexpr bool kNativeFusedMerge = false;
#endif

// Folds the state (o_b, b) into (o_a, a). o_a and o_b have `dim` entries. Cost O(dim).
template <bool kFused = kNativeFusedMerge, class Scalar>
OVQ_HOST_DEVICE void merge_softmax(Scalar* o_a, SoftmaxStats<Scalar>& a, const Scalar* o_b,
                                   const SoftmaxStats<Scalar>& b, Index dim) {
  if (b.empty()) return;
  if (a.empty()) {
    for (Index d = 0; d < dim; ++d) o_a[d] = o_b[d];
    a = b;
    return;
  }
  const Scalar m = a.m > b.m ? a.m : b.m;
  const Scalar la = a.l * std::exp(a.m - m);
  const Scalar lb = b.l * std::exp(b.m - m);
  const Scalar l = la + lb;
  const Scalar wa = la / l, wb = lb / l;
  // A side whose weight is 0 is dropped, not multiplied: its average may have rounded past
  // the largest finite value, and 0 * inf would be NaN.
  if (wa == Scalar(0) || wb == Scalar(0)) {
    if (wa == Scalar(0))
      for (Index d = 0; d < dim; ++d) o_a[d] = o_b[d];
    a.l = l;
    a.m = m;
    return;
  }
  // One explicit rounding pattern, never left to the compiler's contraction choices, so every
  // compiled copy of a merge gives the same bits.
  for (Index d = 0; d < dim; ++d) {
    const Scalar b_part = o_b[d] * wb;
    if constexpr (kFused) {
      o_a[d] = std::fma(o_a[d], wa, b_part);
    } else {
      const Scalar a_part = o_a[d] * wa;
      o_a[d] = a_part + b_part;
    }
  }
  a.l = l;
  a.m = m;
}

}  // namespace ovq
