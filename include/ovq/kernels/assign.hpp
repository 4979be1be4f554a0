#pragma once
// Nearest centroid by inner product, fused with the score tiles: each tile of scores is reduced
// to a running argmax at once, so no L x n score matrix is kept. The scores are the read's
// (TileOps::scores_rows, centroid rows read in place): a row's scores, and so its assignment,
// are the same bits whatever the other rows of the call, and nothing is packed per call (a VQ
// decode step assigns one row against the whole codebook).
//
//   best[i] = max_r (x_i . C[r] + offset[r]),  arg[i] = the smallest r reaching it
//
// OVQ uses offset = none (k . D_k[r]); VQ uses offset = -|C_r|^2 / 2, for which the argmax is
// the argmin of |k - C_r|^2. Rows of x with no centroid get best = -inf, arg = -1.
// Shapes: x (L x d), C (n x d), offset (n), best and arg (L). Cost: 2 L n d flops.
#include <algorithm>
#include <limits>
#include <vector>

#include "ovq/core/types.hpp"
#include "ovq/kernels/arch/tile_ops.hpp"

namespace ovq::kernels {

template <class Scalar, class Arch = arch::native>
void assign_nearest(ConstRowsView<Scalar> x, ConstRowsView<Scalar> centroids,
                    const Scalar* offset, Scalar* best, Index* arg) {
  using Ops = TileOps<Scalar, Arch>;
  constexpr Index kTile = Ops::kKeyTile;
  constexpr Index kRows = 32;  // rows of x per score tile
  const Index n = centroids.rows;
  const Index d = x.cols;
  for (Index i = 0; i < x.rows; ++i) {
    best[i] = -std::numeric_limits<Scalar>::infinity();
    arg[i] = -1;
  }
  if (n == 0 || x.rows == 0) return;
  AlignedVector<Scalar> x_rows(static_cast<std::size_t>(kRows * d));
  AlignedVector<Scalar> scores(static_cast<std::size_t>(kRows * kTile));
  for (Index i0 = 0; i0 < x.rows; i0 += kRows) {
    const Index bq = std::min(kRows, x.rows - i0);
    for (Index i = 0; i < bq; ++i)
      std::copy(x.row(i0 + i), x.row(i0 + i) + d, x_rows.data() + i * d);
    for (Index r0 = 0; r0 < n; r0 += kTile) {
      const Index br = std::min(kTile, n - r0);
      // Slots past the last centroid repeat centroid r0; their scores are not looked at.
      const Scalar* rows[kTile];
      for (Index j = 0; j < kTile; ++j) rows[j] = centroids.row(r0 + (j < br ? j : 0));
      Ops::scores_rows(x_rows.data(), d, bq, rows, d, Scalar(1), scores.data());
      for (Index i = 0; i < bq; ++i) {
        const Scalar* s = scores.data() + i * kTile;
        Scalar& b = best[i0 + i];
        Index& a = arg[i0 + i];
        for (Index j = 0; j < br; ++j) {
          const Scalar v = offset != nullptr ? s[j] + offset[r0 + j] : s[j];
          // Strictly greater: on ties the smallest centroid index wins. The first centroid
          // always wins against -inf, so even an overflowing score gets an assignment.
          if (v > b || a < 0) {
            b = v;
            a = r0 + j;
          }
        }
      }
    }
  }
}

}  // namespace ovq::kernels
