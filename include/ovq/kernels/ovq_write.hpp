#pragma once
// The OVQ write (MATH.md section 4, "Write"): one complete chunk of L rows into the dictionary.
//
//   1. grow:   m = clamp(min(N, G(t + L)) - n, 0, L), at least 1 when n = 0
//   2. seed:   m chunk rows become centroids (spread-maximising, or random)
//   3. assign: a_i = argmax_r k_i . D_k[r] over the dictionary after seeding (ties: smallest r)
//   4. update: sparse running mean (or constant rate) of the assigned rows, counts += members
//
// The scores of the chunk against the old centroids are computed once and serve both seeding
// (s_i = max_r k_i . D_k[r], the similarity to the nearest centroid) and assignment: a new
// centroid only raises s_i where it beats the old best, which is exactly the argmax update.
// Shapes: K (L x dk), V (L x dv). Cost: 2 L n dk (scores) + 2 L m dk (seeding) + O(L (dk + dv)).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <vector>

#include "ovq/kernels/assign.hpp"
#include "ovq/kernels/update.hpp"
#include "ovq/state/dictionary.hpp"
#include "ovq/state/policies.hpp"

namespace ovq::kernels {

struct OvqWriteParams {
  Growth growth;
  Seeding seeding;
  UpdateRate rate;
  bool renormalize = false;
};

// Number of centroids to open when t tokens are absorbed and a chunk of `chunk` rows arrives.
inline Index centroids_to_open(const Growth& growth, std::int64_t t, Index chunk, Index size,
                               Index capacity) {
  const Index target = growth.target(t + chunk, capacity);
  Index m = std::clamp<Index>(target - size, 0, chunk);
  if (size == 0) m = std::max<Index>(m, 1);
  return std::min(m, capacity - size);
}

// The m distinct chunk rows drawn for random seeding: a partial Fisher-Yates shuffle driven by
// a generator seeded from (seed, chunk index), so the draw depends only on the stream position.
inline std::vector<Index> random_seed_rows(std::uint64_t seed, std::int64_t chunk_index,
                                           Index chunk, Index m) {
  std::uint64_t state = seed ^ (0xd1b54a32d192ed03ULL * static_cast<std::uint64_t>(chunk_index + 1));
  std::vector<Index> rows(static_cast<std::size_t>(chunk));
  std::iota(rows.begin(), rows.end(), Index(0));
  for (Index j = 0; j < m; ++j) {
    const auto span = static_cast<std::uint64_t>(chunk - j);
    const Index pick = j + static_cast<Index>(ovq::detail::splitmix64(state) % span);
    std::swap(rows[static_cast<std::size_t>(j)], rows[static_cast<std::size_t>(pick)]);
  }
  rows.resize(static_cast<std::size_t>(m));
  return rows;
}

template <class Scalar, class Arch = arch::native>
void ovq_write_chunk(Dictionary<Scalar>& dict, std::int64_t absorbed, ConstRowsView<Scalar> k,
                     ConstRowsView<Scalar> v, const OvqWriteParams& params) {
  const Index chunk = k.rows;
  const Index m = centroids_to_open(params.growth, absorbed, chunk, dict.size(), dict.capacity());

  // s_i / a_i: similarity to, and index of, the nearest centroid so far.
  std::vector<Scalar> nearest(static_cast<std::size_t>(chunk));
  std::vector<Index> assigned(static_cast<std::size_t>(chunk));
  assign_nearest<Scalar, Arch>(k, dict.keys(), nullptr, nearest.data(), assigned.data());

  auto open_centroid = [&](Index row) {
    dict.push(k.row(row), v.row(row), 0);
    const Index r = dict.size() - 1;
    const auto seed_key = row_map(k, row);
    for (Index i = 0; i < chunk; ++i) {
      const Scalar g = row_map(k, i).dot(seed_key);
      if (g > nearest[i] || assigned[i] < 0) {
        nearest[i] = g;
        assigned[i] = r;
      }
    }
  };

  if (params.seeding.kind == Seeding::Kind::spread) {
    std::vector<char> picked(static_cast<std::size_t>(chunk), 0);
    for (Index step = 0; step < m; ++step) {
      Index best = -1;
      for (Index i = 0; i < chunk; ++i) {
        if (picked[i]) continue;
        if (best < 0 || nearest[i] < nearest[best]) best = i;  // ties: smallest i
      }
      picked[best] = 1;
      open_centroid(best);
    }
  } else {
    const std::int64_t chunk_index = absorbed / chunk;
    for (Index row : random_seed_rows(params.seeding.seed, chunk_index, chunk, m))
      open_centroid(row);
  }

  AssignmentGroups groups;
  groups.build(assigned.data(), chunk, dict.size());
  scatter_mean_update<Scalar>(dict.keys(), dict.counts(), groups, k, params.rate);
  scatter_mean_update<Scalar>(dict.values(), dict.counts(), groups, v, params.rate);
  for (Index g = 0; g < groups.size(); ++g) {
    const Index r = groups.rows[static_cast<std::size_t>(g)];
    dict.set_count(r, dict.count(r) + groups.members(g));
    if (params.renormalize) {
      auto row = row_map(dict.keys(), r);
      const Scalar norm = row.stableNorm();  // no overflow for keys near the largest value
      if (norm > Scalar(0)) row /= norm;
    }
  }
}

}  // namespace ovq::kernels
