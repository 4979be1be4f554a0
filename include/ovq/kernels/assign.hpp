#pragma once
// Nearest centroid by inner product, tile by tile over the centroids (no L x n matrix kept).
//
//   best[i] = max_r (x_i . C[r] + offset[r]),  arg[i] = the smallest r reaching it
//
// OVQ uses offset = none (k . D_k[r]); VQ uses offset = -|C_r|^2 / 2, for which the argmax is
// the argmin of |k - C_r|^2. Rows of x with no centroid get best = -inf, arg = -1.
// Shapes: x (L x d), C (n x d), offset (n), best and arg (L). Cost: 2 L n d flops.
#include <algorithm>
#include <limits>

#include "ovq/core/threads.hpp"
#include "ovq/core/types.hpp"

namespace ovq::kernels {

inline constexpr Index kAssignCentroidTile = 256;

template <class Scalar>
void assign_nearest(ConstRowsView<Scalar> x, ConstRowsView<Scalar> centroids,
                    const Scalar* offset, Scalar* best, Index* arg) {
  const detail::SerialEigenScope serial;
  const Index n = centroids.rows;
  for (Index i = 0; i < x.rows; ++i) {
    best[i] = -std::numeric_limits<Scalar>::infinity();
    arg[i] = -1;
  }
  RowMatrix<Scalar> scores(x.rows, std::min(kAssignCentroidTile, std::max<Index>(n, 1)));
  for (Index r0 = 0; r0 < n; r0 += kAssignCentroidTile) {
    const Index br = std::min(kAssignCentroidTile, n - r0);
    auto s = scores.leftCols(br);
    s.noalias() = as_eigen(x) * as_eigen(centroids.middle_rows(r0, br)).transpose();
    for (Index i = 0; i < x.rows; ++i) {
      for (Index j = 0; j < br; ++j) {
        const Scalar v = offset != nullptr ? s(i, j) + offset[r0 + j] : s(i, j);
        // Strictly greater: on ties the smallest centroid index wins. The first centroid
        // always wins against -inf, so even an overflowing score gets an assignment.
        if (v > best[i] || arg[i] < 0) {
          best[i] = v;
          arg[i] = r0 + j;
        }
      }
    }
  }
}

}  // namespace ovq::kernels
