#pragma once
// Nearest centroid by inner product, fused with the score tiles: each tile of scores is reduced
// to a running argmax at once, so no L x n score matrix is kept. The scores are the read's
// (TileOps::scores_rows): a row's scores, and so its assignment, are the same bits whatever the
// other rows of the call. Where the kernels score from packed keys (packs_keys_v), each block
// of up to 256 rows packs each centroid tile once; a few rows (a VQ decode step assigns one row
// against the whole codebook) read the centroid rows in place. Memory: a block of rows in the
// kernels' query type, one tile of scores, and one packed tile per thread.
//
//   best[i] = max_r (x_i . C[r] + offset[r]),  arg[i] = the smallest r reaching it
//
// OVQ uses offset = none (k . D_k[r]); VQ uses offset = -|C_r|^2 / 2, for which the argmax is
// the argmin of |k - C_r|^2. Rows of x with no centroid get best = -inf, arg = -1.
// Shapes: x (L x d), C (n x d), offset (n), best and arg (L). Cost: 2 L n d flops, plus L n
// vector compares and a scalar pass over the tiles where a row's best improves.
//
// score_row_against scores one row against many (OVQ's seeding scores the chunk's keys against
// each new centroid) with the same micro-kernel, the row as the query: x . C[r] and C[r] . x
// are the same bits (the micro-kernels' per-score operations are products, commutative, summed
// in an order fixed by the feature index), so a new centroid is scored exactly as it would be
// among the old ones.
#include <algorithm>
#include <limits>
#include <vector>

#include "ovq/core/types.hpp"
#include "ovq/kernels/arch/tile_ops.hpp"

namespace ovq::kernels {

namespace assign_detail {

// Folds one row's scores s[0, n) (plus offset[0, n) when given) for centroids r0 ... r0 + n - 1
// into its running (best, arg). Strictly greater wins, so on ties the smallest index stays; the
// first centroid is taken whatever its score (arg < 0: none yet), so even an overflowing score
// gets an assignment. The running pair is kept in locals (updated through the references, the
// loop reloaded arg from memory on every step, GCC 12).
template <class Scalar>
inline void argmax_update(const Scalar* s, const Scalar* offset, Index n, Index r0, Scalar& best,
                          Index& arg) {
  Scalar b = best;
  Index a = arg;
  Index j = 0;
  auto score = [&](Index c) { return offset != nullptr ? s[c] + offset[c] : s[c]; };
  if (a < 0 && n > 0) {
    b = score(0);
    a = r0;
    j = 1;
  }
  for (; j < n; ++j) {
    const Scalar v = score(j);
    if (v > b) {
      b = v;
      a = r0 + j;
    }
  }
  best = b;
  arg = a;
}

}  // namespace assign_detail

// Element: what x and the centroids hold; scores, offsets and bests are in its compute type.
template <class Element, class Arch = arch::native>
void assign_nearest(ConstRowsView<Element> x, ConstRowsView<Element> centroids,
                    const compute_t<Element>* offset, compute_t<Element>* best, Index* arg) {
  using Scalar = compute_t<Element>;
  using Ops = TileOps<Element, Arch>;
  using assign_detail::argmax_update;
  constexpr Index kTile = Ops::kKeyTile;
  constexpr Index kRows = 32;         // rows of x per score tile
  constexpr Index kBlockRows = 256;   // rows of x that share each packed centroid tile
  constexpr Index kPackMinRows = 32;  // rows from which packing a centroid tile pays
  const Index n = centroids.rows;
  const Index d = x.cols;
  for (Index i = 0; i < x.rows; ++i) {
    best[i] = -std::numeric_limits<Scalar>::infinity();
    arg[i] = -1;
  }
  if (n == 0 || x.rows == 0) return;
  AlignedVector<typename Ops::Query> x_rows(
      static_cast<std::size_t>(std::min(kBlockRows, x.rows) * d));
  AlignedVector<Scalar> scores(static_cast<std::size_t>(kRows * kTile));
  using Packed = packed_word_t<Ops>;
  thread_local AlignedVector<Packed> panel;  // one packed centroid tile
  [[maybe_unused]] const TileSession<Ops> session;  // AMX: one tile configuration for all
  // Blocks of rows, each against every centroid tile in order (each row's running argmax sees
  // the tiles in order, whatever the blocks): a tile is packed once per block of rows.
  for (Index b0 = 0; b0 < x.rows; b0 += kBlockRows) {
    const Index nb = std::min(kBlockRows, x.rows - b0);
    for (Index i = 0; i < nb; ++i) copy_query(x.row(b0 + i), d, x_rows.data() + i * d);
    bool pack = false;
    if constexpr (packs_keys_v<Ops>) {
      pack = nb >= kPackMinRows && Ops::packs_keys();
      if (pack) panel.resize(static_cast<std::size_t>(Ops::packed_key_words(d)));
    }
    for (Index r0 = 0; r0 < n; r0 += kTile) {
      const Index br = std::min(kTile, n - r0);
      // Slots past the last centroid repeat centroid r0; their scores are not looked at.
      const Element* rows[kTile];
      for (Index j = 0; j < kTile; ++j) rows[j] = centroids.row(r0 + (j < br ? j : 0));
      if constexpr (packs_keys_v<Ops>) {
        if (pack) Ops::pack_keys(rows, d, panel.data());
      }
      const Scalar* tile_offset = offset != nullptr ? offset + r0 : nullptr;
      for (Index i0 = 0; i0 < nb; i0 += kRows) {
        const Index bq = std::min(kRows, nb - i0);
        const typename Ops::Query* q = x_rows.data() + i0 * d;
        if constexpr (packs_keys_v<Ops>) {
          if (pack) Ops::scores_rows_packed(q, d, bq, rows, panel.data(), d, Scalar(1), scores.data());
        }
        if (!pack) Ops::scores_rows(q, d, bq, rows, d, Scalar(1), scores.data());
        for (Index i = 0; i < bq; ++i) {
          const Scalar* row = scores.data() + i * kTile;
          Scalar& row_best = best[b0 + i0 + i];
          Index& row_arg = arg[b0 + i0 + i];
          // Most tiles hold no score above the row's running best (centroids in random order:
          // a row's best improves in about ln(n / kTile) + 1 of its n / kTile tiles, the
          // expected number of records): one vector pass says so, and only the other tiles
          // run the argmax's scalar loop.
          if (row_arg >= 0 && !Ops::any_greater(row, tile_offset, br, row_best)) continue;
          argmax_update(row, tile_offset, br, r0, row_best, row_arg);
        }
      }
    }
  }
}

// out[j] = x . rows[j] for the n rows of `rows` (x: d entries). Cost: 2 n d flops.
template <class Element, class Arch = arch::native>
void score_row_against(const Element* x, ConstRowsView<Element> rows, compute_t<Element>* out) {
  using Scalar = compute_t<Element>;
  using Ops = TileOps<Element, Arch>;
  constexpr Index kTile = Ops::kKeyTile;
  const Index n = rows.rows;
  const Index d = rows.cols;
  alignas(64) Scalar scores[kTile];
  [[maybe_unused]] const TileSession<Ops> session;
  for (Index j0 = 0; j0 < n; j0 += kTile) {
    const Index bj = std::min(kTile, n - j0);
    // Slots past the last row repeat row j0; their scores are not kept.
    const Element* keys[kTile];
    for (Index j = 0; j < kTile; ++j) keys[j] = rows.row(j0 + (j < bj ? j : 0));
    Ops::scores_rows(x, d, 1, keys, d, Scalar(1), scores);
    std::copy(scores, scores + bj, out + j0);
  }
}

}  // namespace ovq::kernels
