#pragma once
// The OVQ write (MATH.md section 4, "Write"): one complete chunk of L rows into the dictionary,
// as its phases on the dictionary's plain views (kernels/seed.hpp, kernels/update.hpp):
//
//   1. grow:   m = clamp(min(N, G(t + L)) - n, 0, L), at least 1 when n = 0
//   2. seed:   m chunk rows become centroids (spread-maximising, or random)
//   3. assign: a_i = argmax_r k_i . D_k[r] over the dictionary after seeding (ties: smallest r)
//              (lowest-similarity seeding assigns first, against the old rows only, and then
//              gives each of its m seeds a row of its own)
//   4. update: sparse running mean (or constant rate) of the assigned rows, counts += members;
//              with the delta value rule, the value rows that existed before the chunk move by
//              their members' residuals v_i - yhat_i, yhat the read of the dictionary before
//              the chunk with the query k_i (memory rows only, the read's bias)
//   5. renormalise the touched key rows (and value rows) when asked
//
// The scores of the chunk against the old centroids are computed once and serve both seeding
// (s_i = max_r k_i . D_k[r], the similarity to the nearest centroid) and assignment: a new
// centroid only raises s_i where it beats the old best, which is exactly the argmax update. New
// centroids are scored by the same micro-kernel as the old ones (score_row_against), so a key's
// assignment does not depend on whether its centroid was opened in this chunk or before.
// Shapes: K (L x dk), V (L x dv). Cost: 2 L n dk (scores) + 2 L m dk (seeding) + O(L (dk + dv)),
// and 2 L n (dk + dv) for the delta rule's prediction.
#include <cstdint>
#include <vector>

#include "ovq/kernels/assign.hpp"
#include "ovq/kernels/read.hpp"
#include "ovq/kernels/seed.hpp"
#include "ovq/kernels/update.hpp"
#include "ovq/state/dictionary.hpp"
#include "ovq/state/policies.hpp"

namespace ovq::kernels {

struct OvqWriteParams {
  Growth growth;
  Seeding seeding;
  UpdateRate rate;
  bool renormalize = false;
  bool renormalize_values = false;
  bool count_bias = true;  // the read bias of the delta rule's prediction: log c, or 0
  ValueUpdate value_update = ValueUpdate::mean;
  double beta = 1.0;  // the delta rule's prediction reads with it
};

// yhat (L x dv): the read of the dictionary's active rows (the read's bias) with the chunk's
// keys as queries and no local rows, by the read kernel itself, so the prediction is what a read
// of the same rows returns (rounded to the element type, as every read's output). Cost:
// 2 L n (dk + dv).
template <class Element, class Arch>
void predict_values(const Dictionary<Element>& dict, ConstRowsView<Element> k,
                    const OvqWriteParams& params, RowMatrix<Element>& yhat) {
  using Scalar = compute_t<Element>;
  yhat.setZero(k.rows, dict.value_dim());
  if (dict.size() == 0) return;
  std::vector<Scalar> bias;
  const MemoryRows<Element> memory{dict.keys(), dict.values(),
                                   dict.read_bias(params.count_bias, bias)};
  const Index dv = dict.value_dim();
  const LocalRows<Element> local{{nullptr, 0, k.cols, k.cols}, {nullptr, 0, dv, dv}};
  const ReadMask mask{false, 0, 0};
  RowsView<Element> out = rows_view(yhat);
  read<Element, Arch>(&k, 1, memory, local, mask, static_cast<Scalar>(params.beta), &out);
}

// A dictionary of 16-bit elements is written in float: its keys are assigned and seeded against
// the running means (the chunk's keys widened), exactly as a float dictionary of the widened
// stream; only its read rows are rounded.
template <class Element, class Arch = arch::native>
void ovq_write_chunk(Dictionary<Element>& dict, std::int64_t absorbed, ConstRowsView<Element> k,
                     ConstRowsView<Element> v, const OvqWriteParams& params) {
  using Scalar = compute_t<Element>;
  const Index chunk = k.rows;
  const Index m = centroids_to_open(params.growth, absorbed, chunk, dict.size(), dict.capacity());

  // The chunk's keys in the compute type (a view of k itself for float and double).
  RowMatrix<Scalar> widened;
  ConstRowsView<Scalar> keys;
  if constexpr (std::is_same_v<Element, Scalar>) {
    keys = k;
  } else {
    widened.resize(chunk, k.cols);
    for (Index i = 0; i < chunk; ++i)
      for (Index c = 0; c < k.cols; ++c) widened(i, c) = widen(k.row(i)[c]);
    keys = rows_view(widened);
  }

  // The delta rule's prediction, from the dictionary before the chunk.
  RowMatrix<Element> yhat;
  const bool delta = params.value_update == ValueUpdate::delta;
  if (delta) predict_values<Element, Arch>(dict, k, params, yhat);
  const Index old_rows = dict.size();

  // Assign against the old centroids: s_i / a_i, the similarity to and index of the nearest.
  std::vector<Scalar> nearest(static_cast<std::size_t>(chunk));
  std::vector<Index> assigned(static_cast<std::size_t>(chunk));
  assign_nearest<Scalar, Arch>(keys, dict.mean_keys(), nullptr, nearest.data(), assigned.data());

  // Seed: each new centroid is opened, scored against the chunk and folded into (s, a).
  const DictionaryRows<Element> rows = dict.rows();
  Index n = dict.size();
  std::vector<Scalar> scores(static_cast<std::size_t>(chunk));
  auto open = [&](Index row) {
    open_row(rows, n, k.row(row), v.row(row));
    score_row_against<Scalar, Arch>(keys.row(row), keys, scores.data());
    fold_new_centroid(scores.data(), n, nearest.data(), assigned.data(), chunk);
    ++n;
  };
  if (params.seeding.kind == Seeding::Kind::lowest_similarity) {
    Index skip = -1;
    Index seeds = m;
    if (n == 0) {
      // Key 0 opens row 0 and takes every key; its similarity to each is what ranks the rest.
      open_row(rows, n, k.row(0), v.row(0));
      score_row_against<Scalar, Arch>(keys.row(0), keys, nearest.data());
      std::fill(assigned.begin(), assigned.end(), Index(0));
      ++n;
      skip = 0;
      --seeds;
    }
    for (Index row : lowest_similarity_rows(nearest.data(), chunk, seeds, skip)) {
      open_row(rows, n, k.row(row), v.row(row));
      assigned[static_cast<std::size_t>(row)] = n;
      ++n;
    }
  } else if (params.seeding.kind == Seeding::Kind::spread) {
    std::vector<unsigned char> picked(static_cast<std::size_t>(chunk), 0);
    for (Index step = 0; step < m; ++step) {
      const Index row = least_similar_unpicked(nearest.data(), picked.data(), chunk);
      if (row < 0) break;  // every row picked: m <= chunk keeps this from happening
      picked[static_cast<std::size_t>(row)] = 1;
      open(row);
    }
  } else {
    for (Index row : random_seed_rows(params.seeding.seed, absorbed / chunk, chunk, m)) open(row);
  }
  dict.set_size(n);

  // Group and update: rows, then counts (the rows' rates read the counts from before).
  AssignmentGroups groups;
  groups.build(assigned.data(), chunk, n);
  scatter_mean_update<Element>(rows.mean_keys, dict.counts(), groups, k, params.rate);
  if (delta) {
    scatter_delta_update<Element>(rows.mean_values, dict.counts(), groups, v, rows_view(yhat),
                                  old_rows, params.rate);
  } else {
    scatter_mean_update<Element>(rows.mean_values, dict.counts(), groups, v, params.rate);
  }
  add_group_counts(rows, groups);
  if (params.renormalize)
    for (Index r : groups.rows) renormalize_row(rows.mean_keys.row(r), rows.keys.cols);
  if (params.renormalize_values)
    for (Index r : groups.rows) renormalize_row(rows.mean_values.row(r), rows.values.cols);
  publish_groups(rows, groups);
}

}  // namespace ovq::kernels
