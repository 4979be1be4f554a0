#pragma once
// The grow and seed phases of the OVQ write (MATH.md section 4, steps 1 and 2), on plain views:
//
//   centroids_to_open     m = clamp(min(N, G(t + L)) - n, 0, L), at least 1 when n = 0
//   least_similar_unpicked  the spread rule's next pick: the unpicked chunk row with the smallest
//                         similarity to its nearest centroid so far (ties: smallest row)
//   draw_seed_rows        random seeding's m distinct chunk rows, from (seed, chunk index)
//   open_row              chunk row i becomes centroid r: its key, its value, count 0
//   fold_new_centroid     centroid r's scores against the chunk rows into their running
//                         (nearest, assigned): the assignment's argmax, one centroid at a time
//
// least_similar_unpicked, draw_seed_rows and fold_new_centroid are OVQ_HOST_DEVICE: the CUDA
// write runs the same rules (it opens rows itself; the functions returning vectors are host code).
#include <algorithm>
#include <cstdint>
#include <vector>

#include "ovq/config.hpp"
#include "ovq/core/random.hpp"
#include "ovq/core/views.hpp"
#include "ovq/state/dictionary_rows.hpp"
#include "ovq/state/policies.hpp"

namespace ovq::kernels {

// Number of centroids to open when t tokens are absorbed and a chunk of `chunk` rows arrives.
inline Index centroids_to_open(const Growth& growth, std::int64_t t, Index chunk, Index size,
                               Index capacity) {
  const Index target = growth.target(t + chunk, capacity);
  Index m = std::clamp<Index>(target - size, 0, chunk);
  if (size == 0) m = std::max<Index>(m, 1);
  return std::min(m, capacity - size);
}

// The `count` rows i < n, i != skip, with the smallest s[i], in increasing (s[i], i), NaNs last:
// the rows lowest-similarity seeding opens, in the order it opens them.
template <class Scalar>
std::vector<Index> lowest_similarity_rows(const Scalar* s, Index n, Index count, Index skip) {
  std::vector<Index> rows;
  for (Index i = 0; i < n; ++i)
    if (i != skip) rows.push_back(i);
  std::stable_sort(rows.begin(), rows.end(), [&](Index a, Index b) {
    return s[a] < s[b] || (s[b] != s[b] && s[a] == s[a]);
  });
  rows.resize(static_cast<std::size_t>(std::clamp<Index>(count, 0, static_cast<Index>(rows.size()))));
  return rows;
}

// Row i < n with picked[i] == 0 and the smallest nearest[i] (ties: smallest i); -1 if none.
template <class Scalar>
OVQ_HOST_DEVICE Index least_similar_unpicked(const Scalar* nearest, const unsigned char* picked,
                                             Index n) {
  Index best = -1;
  for (Index i = 0; i < n; ++i) {
    if (picked[i]) continue;
    if (best < 0 || nearest[i] < nearest[best]) best = i;
  }
  return best;
}

// The m distinct chunk rows drawn for random seeding, into rows[0, m): a partial Fisher-Yates
// shuffle of rows[0, chunk) (scratch of `chunk` entries) driven by a generator seeded from
// (seed, chunk index), so the draw depends only on the stream position.
OVQ_HOST_DEVICE inline void draw_seed_rows(std::uint64_t seed, std::int64_t chunk_index,
                                           Index chunk, Index m, Index* rows) {
  std::uint64_t state =
      seed ^ (0xd1b54a32d192ed03ULL * static_cast<std::uint64_t>(chunk_index + 1));
  for (Index i = 0; i < chunk; ++i) rows[i] = i;
  for (Index j = 0; j < m; ++j) {
    const auto span = static_cast<std::uint64_t>(chunk - j);
    const Index pick = j + static_cast<Index>(ovq::detail::splitmix64(state) % span);
    const Index kept = rows[j];
    rows[j] = rows[pick];
    rows[pick] = kept;
  }
}

inline std::vector<Index> random_seed_rows(std::uint64_t seed, std::int64_t chunk_index,
                                           Index chunk, Index m) {
  std::vector<Index> rows(static_cast<std::size_t>(chunk));
  draw_seed_rows(seed, chunk_index, chunk, m, rows.data());
  rows.resize(static_cast<std::size_t>(m));
  return rows;
}

// Centroid r := (key, value) with count 0 (its running means: the same, widened). Host code
// (Eigen's 16-bit widening is; the device write opens rows itself).
template <class Element>
void open_row(const DictionaryRows<Element>& d, Index r, const Element* key,
                              const Element* value) {
  Element* k = d.keys.row(r);
  Element* v = d.values.row(r);
  for (Index c = 0; c < d.keys.cols; ++c) k[c] = key[c];
  for (Index c = 0; c < d.values.cols; ++c) v[c] = value[c];
  if constexpr (DictionaryRows<Element>::kSeparateMeans) {
    for (Index c = 0; c < d.keys.cols; ++c) d.mean_keys.row(r)[c] = widen(key[c]);
    for (Index c = 0; c < d.values.cols; ++c) d.mean_values.row(r)[c] = widen(value[c]);
  }
  set_count(d, r, 0);
}

// scores[i] = k_i . D_k[r] for the n chunk rows: centroid r replaces a row's nearest centroid
// where it is strictly more similar, or where the row had none (the first centroid wins whatever
// its score, as in assign_nearest).
template <class Scalar>
OVQ_HOST_DEVICE void fold_new_centroid(const Scalar* scores, Index r, Scalar* nearest,
                                       Index* assigned, Index n) {
  for (Index i = 0; i < n; ++i) {
    if (scores[i] > nearest[i] || assigned[i] < 0) {
      nearest[i] = scores[i];
      assigned[i] = r;
    }
  }
}

}  // namespace ovq::kernels
