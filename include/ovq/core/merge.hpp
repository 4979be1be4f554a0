#pragma once
// Merging two partial reads of the same queries over disjoint sets of rows (context
// parallelism, attention sinks, cascades):
//
//   (o_a, lse_a), (o_b, lse_b) -> lse = log(e^lse_a + e^lse_b),
//                                 o = e^(lse_a - lse) o_a + e^(lse_b - lse) o_b
//
// where each o is a softmax average and lse its log-sum-exp, as forward(..., lse) gives them. A
// side with lse = -inf saw no row and is dropped. The weights are the online softmax's merge
// (core/online_softmax.hpp), so merging the reads of two halves of the keys is the read of both
// up to rounding. Cost: O(rows * cols).
#include <cmath>
#include <limits>

#include "ovq/core/checks.hpp"
#include "ovq/core/online_softmax.hpp"
#include "ovq/core/types.hpp"

namespace ovq {

// Folds (o_b, lse_b) into (o_a, lse_a), in place: o_a and o_b are rows x cols, lse_a and lse_b
// hold `rows` entries. Throws ArgumentError (nothing written) on mismatched shapes or a NaN lse.
template <class Element>
void merge_partials(RowsView<Element> o_a, compute_t<Element>* lse_a, ConstRowsView<Element> o_b,
                    const compute_t<Element>* lse_b) {
  using Compute = compute_t<Element>;
  const char* where = "merge_partials";
  detail::check_shape(where, "o_b", o_b.rows, o_b.cols, o_a.rows, o_a.cols);
  for (Index r = 0; r < o_a.rows; ++r) {
    detail::require(!std::isnan(lse_a[r]) && !std::isnan(lse_b[r]) && lse_a[r] != INFINITY &&
                        lse_b[r] != INFINITY,
                    where, "lse row ", r, " is (", lse_a[r], ", ", lse_b[r],
                    "), expected finite values or -inf");
  }
  auto stats = [](Compute lse) {
    return lse == -std::numeric_limits<Compute>::infinity() ? SoftmaxStats<Compute>{}
                                                            : SoftmaxStats<Compute>{lse, 1};
  };
  for (Index r = 0; r < o_a.rows; ++r) {
    const MergeWeights<Compute> w = merge_weights(stats(lse_a[r]), stats(lse_b[r]));
    Element* a = o_a.row(r);
    const Element* b = o_b.row(r);
    for (Index c = 0; c < o_a.cols; ++c)
      a[c] = narrow<Element>(merge_entry(w, widen(a[c]), widen(b[c])));
    lse_a[r] = w.stats.empty() ? -std::numeric_limits<Compute>::infinity()
                               : w.stats.m + std::log(w.stats.l);
  }
}

}  // namespace ovq
