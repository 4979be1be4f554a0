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
#include "ovq/core/exact_math.hpp"
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

// The exponential of a merge: the host's std::exp on the CPU, ovq's own (core/exact_math.hpp)
// in the CUDA kernels and their emulation.
struct StdExp {
  template <class Scalar>
  OVQ_HOST_DEVICE Scalar operator()(Scalar x) const {
    return std::exp(x);
  }
};
struct ExactExp {
  template <class Scalar>
  OVQ_HOST_DEVICE Scalar operator()(Scalar x) const {
    return detail::exp_nonpositive(x);
  }
};

// How a merge of (o_b, b) into (o_a, a) treats each entry, and the merged statistics: computed
// once per row, applied to each of its entries (merge_entry). Split this way so that executors
// holding a row's entries in different places (a CPU buffer, GPU registers, a GPU workspace)
// apply one definition.
template <class Scalar>
struct MergeWeights {
  enum class Mode : unsigned char { keep, copy, blend };
  Mode mode = Mode::keep;  // keep o_a, copy o_b, or blend the two
  Scalar wa = Scalar(0), wb = Scalar(0);
  SoftmaxStats<Scalar> stats;  // the merged state
};

template <class Exp = StdExp, class Scalar>
OVQ_HOST_DEVICE MergeWeights<Scalar> merge_weights(const SoftmaxStats<Scalar>& a,
                                                   const SoftmaxStats<Scalar>& b) {
  using Mode = typename MergeWeights<Scalar>::Mode;
  MergeWeights<Scalar> w;
  if (b.empty()) {
    w.stats = a;
    return w;
  }
  if (a.empty()) {
    w.mode = Mode::copy;
    w.stats = b;
    return w;
  }
  const Exp exp_of{};
  const Scalar m = a.m > b.m ? a.m : b.m;
  const Scalar la = detail::mul_rn(a.l, exp_of(a.m - m));
  const Scalar lb = detail::mul_rn(b.l, exp_of(b.m - m));
  const Scalar l = la + lb;
  w.wa = la / l;
  w.wb = lb / l;
  w.stats.m = m;
  w.stats.l = l;
  // A side whose weight is 0 is dropped, not multiplied: its average may have rounded past
  // the largest finite value, and 0 * inf would be NaN.
  if (w.wa == Scalar(0)) {
    w.mode = Mode::copy;
  } else if (w.wb == Scalar(0)) {
    w.mode = Mode::keep;
  } else {
    w.mode = Mode::blend;
  }
  return w;
}

// One entry of the merged average. One explicit rounding pattern (kFused: o_a wa + o_b wb
// rounded once after the product o_b wb), never left to the compiler's contraction choices, so
// every compiled copy of a merge gives the same bits.
template <bool kFused = kNativeFusedMerge, class Scalar>
OVQ_HOST_DEVICE Scalar merge_entry(const MergeWeights<Scalar>& w, Scalar o_a, Scalar o_b) {
  using Mode = typename MergeWeights<Scalar>::Mode;
  if (w.mode == Mode::keep) return o_a;
  if (w.mode == Mode::copy) return o_b;
  const Scalar b_part = detail::mul_rn(o_b, w.wb);
  if constexpr (kFused) {
    return std::fma(o_a, w.wa, b_part);
  } else {
    return detail::mul_rn(o_a, w.wa) + b_part;
  }
}

// Folds the state (o_b, b) into (o_a, a). o_a and o_b have `dim` entries. Cost O(dim).
template <bool kFused = kNativeFusedMerge, class Exp = StdExp, class Scalar>
OVQ_HOST_DEVICE void merge_softmax(Scalar* o_a, SoftmaxStats<Scalar>& a, const Scalar* o_b,
                                   const SoftmaxStats<Scalar>& b, Index dim) {
  const MergeWeights<Scalar> w = merge_weights<Exp>(a, b);
  if (w.mode != MergeWeights<Scalar>::Mode::keep)
    for (Index d = 0; d < dim; ++d) o_a[d] = merge_entry<kFused>(w, o_a[d], o_b[d]);
  a = w.stats;
}

}  // namespace ovq
