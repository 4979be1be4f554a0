#pragma once
// The group and update phases of a dictionary write (OVQ's chunk write, VQ's mean values): the
// chunk rows grouped by centroid, then the sparse centroid update (only rows with at least one
// new member change), the counts, and OVQ's optional renormalisation.
//
// For each row r with cnt_r > 0 members among the chunk rows x_i (a_i = r), count c_r before:
//   adaptive: D[r] += (sum_{a_i = r} x_i - cnt_r D[r]) / (c_r + cnt_r)
//             (= (c_r D[r] + sum x_i) / (c_r + cnt_r), the running mean, in a form that keeps
//             float precision when c_r is large)
//   constant: D[r] = (1 - eta) D[r] + eta * mean_{a_i = r} x_i
// Shapes: D (n x d), x (L x d), a (L), counts (n, before the update). Cost: O(L d).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "ovq/core/types.hpp"
#include "ovq/state/dictionary_rows.hpp"
#include "ovq/state/policies.hpp"

namespace ovq::kernels {

// The chunk rows grouped by centroid: members of group g are order[begin[g] .. begin[g+1]).
struct AssignmentGroups {
  std::vector<Index> rows;     // touched centroid of each group, increasing
  std::vector<Index> begin;    // groups + 1 offsets into order
  std::vector<Index> order;    // chunk rows, grouped

  void build(const Index* assignment, Index n_rows, Index n_centroids) {
    std::vector<Index> count(static_cast<std::size_t>(n_centroids) + 1, 0);
    for (Index i = 0; i < n_rows; ++i) ++count[static_cast<std::size_t>(assignment[i])];
    rows.clear();
    begin.clear();
    std::vector<Index> slot(static_cast<std::size_t>(n_centroids), -1);
    Index offset = 0;
    for (Index r = 0; r < n_centroids; ++r) {
      if (count[static_cast<std::size_t>(r)] == 0) continue;
      slot[static_cast<std::size_t>(r)] = offset;
      rows.push_back(r);
      begin.push_back(offset);
      offset += count[static_cast<std::size_t>(r)];
    }
    begin.push_back(offset);
    order.assign(static_cast<std::size_t>(n_rows), 0);
    for (Index i = 0; i < n_rows; ++i)
      order[static_cast<std::size_t>(slot[static_cast<std::size_t>(assignment[i])]++)] = i;
  }

  Index size() const { return static_cast<Index>(rows.size()); }
  Index members(Index g) const {
    return begin[static_cast<std::size_t>(g) + 1] - begin[static_cast<std::size_t>(g)];
  }
};

// Sums of members are formed in a wider type (double for float, long double for double), so
// that L keys near the largest finite value still average to a finite centroid.
template <class Scalar>
using WideAccumulator = std::conditional_t<std::is_same_v<Scalar, float>, double, long double>;

// dict: the running means (compute type) of the rows x (elements) update.
template <class Element>
void scatter_mean_update(RowsView<compute_t<Element>> dict, const std::int64_t* counts_before,
                         const AssignmentGroups& groups, ConstRowsView<Element> x,
                         const UpdateRate& rate) {
  using Scalar = compute_t<Element>;
  using Wide = WideAccumulator<Scalar>;
  const Index d = dict.cols;
  std::vector<Wide> sum(static_cast<std::size_t>(d));
  for (Index g = 0; g < groups.size(); ++g) {
    const Index r = groups.rows[static_cast<std::size_t>(g)];
    const Index cnt = groups.members(g);
    std::fill(sum.begin(), sum.end(), Wide(0));
    for (Index m = groups.begin[static_cast<std::size_t>(g)];
         m < groups.begin[static_cast<std::size_t>(g) + 1]; ++m) {
      const Element* row = x.row(groups.order[static_cast<std::size_t>(m)]);
      for (Index c = 0; c < d; ++c) sum[static_cast<std::size_t>(c)] += widen(row[c]);
    }
    Scalar* target = dict.row(r);
    if (rate.kind == UpdateRate::Kind::adaptive) {
      const Wide inv_total = Wide(1) / static_cast<Wide>(counts_before[r] + cnt);
      const Wide n_new = static_cast<Wide>(cnt);
      for (Index c = 0; c < d; ++c) {
        const Wide t = target[c];
        target[c] = static_cast<Scalar>(t + (sum[static_cast<std::size_t>(c)] - n_new * t) * inv_total);
      }
    } else {
      const Wide eta = static_cast<Wide>(rate.eta);
      const Wide inv_cnt = Wide(1) / static_cast<Wide>(cnt);
      for (Index c = 0; c < d; ++c)
        target[c] = static_cast<Scalar>((Wide(1) - eta) * target[c] +
                                        eta * (sum[static_cast<std::size_t>(c)] * inv_cnt));
    }
  }
}

// The delta rule's new value x held within the element's finite range: unlike a mean, a row
// moved by residuals (differences of values) can pass every value it saw, and a row past the
// largest element would read as infinity. The CUDA write holds it the same way.
template <class Element, class Wide>
Wide delta_limit(Wide x) {
  const Wide limit = static_cast<Wide>(largest_finite<Element>());
  return x < -limit ? -limit : (x > limit ? limit : x);
}

// The delta rule (ValueUpdate::delta) on the value means: a row r < predicted_rows (it existed
// before the chunk) moves by its members' residuals against their predictions yhat (L x d),
//   adaptive: D[r] += sum_{a_i = r} (x_i - yhat_i) / (c_r + cnt_r)
//   constant: D[r] += eta * mean_{a_i = r} (x_i - yhat_i),
// held within the element's finite range (delta_limit); a row opened in the chunk takes
// scatter_mean_update's running mean of its members.
template <class Element>
void scatter_delta_update(RowsView<compute_t<Element>> dict, const std::int64_t* counts_before,
                          const AssignmentGroups& groups, ConstRowsView<Element> x,
                          ConstRowsView<Element> yhat, Index predicted_rows,
                          const UpdateRate& rate) {
  using Scalar = compute_t<Element>;
  using Wide = WideAccumulator<Scalar>;
  AssignmentGroups opened;  // the groups of rows opened in the chunk
  const Index d = dict.cols;
  std::vector<Wide> sum(static_cast<std::size_t>(d));
  for (Index g = 0; g < groups.size(); ++g) {
    const Index r = groups.rows[static_cast<std::size_t>(g)];
    const Index first = groups.begin[static_cast<std::size_t>(g)];
    const Index last = groups.begin[static_cast<std::size_t>(g) + 1];
    if (r >= predicted_rows) {
      opened.rows.push_back(r);
      opened.begin.push_back(static_cast<Index>(opened.order.size()));
      for (Index m = first; m < last; ++m)
        opened.order.push_back(groups.order[static_cast<std::size_t>(m)]);
      continue;
    }
    std::fill(sum.begin(), sum.end(), Wide(0));
    for (Index m = first; m < last; ++m) {
      const Index i = groups.order[static_cast<std::size_t>(m)];
      for (Index c = 0; c < d; ++c)
        sum[static_cast<std::size_t>(c)] += static_cast<Wide>(widen(x.row(i)[c])) -
                                            static_cast<Wide>(widen(yhat.row(i)[c]));
    }
    const Wide factor = rate.kind == UpdateRate::Kind::adaptive
                            ? Wide(1) / static_cast<Wide>(counts_before[r] + (last - first))
                            : static_cast<Wide>(rate.eta) / static_cast<Wide>(last - first);
    Scalar* target = dict.row(r);
    for (Index c = 0; c < d; ++c)
      target[c] = static_cast<Scalar>(delta_limit<Element>(
          target[c] + sum[static_cast<std::size_t>(c)] * factor));
  }
  opened.begin.push_back(static_cast<Index>(opened.order.size()));
  scatter_mean_update<Element>(dict, counts_before, opened, x, rate);
}

// c_r += members for every touched centroid (counts and log counts): the count update of both
// dictionary writes, after their row updates (which read the counts from before).
template <class Scalar>
void add_group_counts(const DictionaryRows<Scalar>& d, const AssignmentGroups& groups) {
  for (Index g = 0; g < groups.size(); ++g) {
    const Index r = groups.rows[static_cast<std::size_t>(g)];
    set_count(d, r, d.counts[r] + groups.members(g));
  }
}

// The touched rows as the reads see them: their means rounded (16-bit elements; the means are the
// rows otherwise).
template <class Element>
void publish_groups(const DictionaryRows<Element>& d, const AssignmentGroups& groups) {
  if constexpr (DictionaryRows<Element>::kSeparateMeans) {
    for (Index r : groups.rows) {
      for (Index c = 0; c < d.keys.cols; ++c) d.keys.row(r)[c] = narrow<Element>(d.mean_keys.row(r)[c]);
      for (Index c = 0; c < d.values.cols; ++c)
        d.values.row(r)[c] = narrow<Element>(d.mean_values.row(r)[c]);
    }
  } else {
    (void)d;
    (void)groups;
  }
}

// row /= |row| (d entries), unless the row is 0. The norm is taken of the row scaled by its
// largest magnitude, so rows near the largest finite value do not overflow. Cost: O(d).
template <class Scalar>
OVQ_HOST_DEVICE void renormalize_row(Scalar* row, Index d) {
  Scalar scale = Scalar(0);
  for (Index c = 0; c < d; ++c) {
    const Scalar a = row[c] < Scalar(0) ? -row[c] : row[c];
    if (a > scale) scale = a;
  }
  if (!(scale > Scalar(0))) return;
  Scalar sum = Scalar(0);
  for (Index c = 0; c < d; ++c) {
    const Scalar x = row[c] / scale;
    sum = std::fma(x, x, sum);
  }
  const Scalar norm = scale * std::sqrt(sum);
  for (Index c = 0; c < d; ++c) row[c] /= norm;
}

}  // namespace ovq::kernels
