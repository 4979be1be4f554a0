#pragma once
// Fitting a VQ-attention codebook without a trained model: k-means on a calibration set of keys.
//
//   ovq::KMeansOptions opt;                              // iterations, tolerance, seed
//   ovq::RowMatrix<float> C = ovq::fit_codebook<float>(calibration_keys, S, opt);   // S x dk
//   ovq::VqAttention<float> vq;
//   auto state = vq.make_state(C, dv);
//
// Algorithm (deterministic for a given seed, on every platform):
//   1. k-means++ initialisation: the first centroid is a uniformly drawn row, each next one a row
//      drawn with probability proportional to its squared distance to the nearest centroid so far
//      (uniform draws from splitmix64, distances accumulated in double). When every remaining
//      distance is zero (fewer distinct rows than centroids) the next centroid is the lowest row
//      index not yet used, so that some centroids coincide.
//   2. Lloyd iterations: assign every row to its nearest centroid (kernels::assign_nearest with
//      offset -|c|^2 / 2, which is the Euclidean argmin; ties: smallest centroid index), then move
//      each centroid to the mean of its rows (summed in double). A centroid left without rows is
//      re-seeded on the row farthest from its own centroid (ties: smallest row index; each row
//      re-seeds at most one centroid per iteration).
//   3. Stop after max_iterations updates, when no assignment changes, or when the inertia (sum of
//      squared distances to the nearest centroid) fell by at most tolerance x its previous value.
//
// Cost: init 2 S n dk flops as S matrix-vector products; each iteration 2 S n dk (assignment, as
// tiled GEMMs) + O(n dk) (update), for n rows of dimension dk and S centroids. Serial: callers
// that fit several codebooks can run them in parallel.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "ovq/core/checks.hpp"
#include "ovq/core/threads.hpp"
#include "ovq/core/types.hpp"
#include "ovq/kernels/assign.hpp"
#include "ovq/state/policies.hpp"

namespace ovq {

struct KMeansOptions {
  Index max_iterations = 25;  // Lloyd updates after the initialisation (0: k-means++ only)
  double tolerance = 1e-4;    // relative inertia decrease below which the iterations stop
  std::uint64_t seed = 0;     // k-means++ draws

  void validate(const char* where = "fit_codebook") const {
    detail::require(max_iterations >= 0, where, "max_iterations = ", max_iterations,
                    ", expected >= 0");
    detail::require(std::isfinite(tolerance) && tolerance >= 0.0, where, "tolerance = ",
                    tolerance, ", expected a finite value >= 0");
  }
};

template <class Scalar>
struct KMeansResult {
  RowMatrix<Scalar> centroids;    // size x dk
  std::vector<Index> assignment;  // n: nearest centroid of each row (for the returned centroids)
  double inertia = 0.0;           // sum over rows of |x_i - c_{assignment_i}|^2
  Index iterations = 0;           // Lloyd updates performed
  bool converged = false;         // stopped by the tolerance or by unchanged assignments
};

namespace detail {

// Uniform double in [0, 1) from splitmix64 (53 random bits).
inline double uniform01(std::uint64_t& state) {
  return static_cast<double>(splitmix64(state) >> 11) * 0x1.0p-53;
}

// Nearest centroid of every row: arg (n) and squared distance d2 (n, double). Returns the inertia.
template <class Scalar>
double kmeans_assign(ConstRowsView<Scalar> x, const RowMatrix<Scalar>& centroids,
                     const std::vector<double>& row_norms2, std::vector<Scalar>& offset,
                     std::vector<Scalar>& best, std::vector<Index>& arg,
                     std::vector<double>& d2) {
  const Index n = x.rows;
  const Index s = centroids.rows();
  for (Index r = 0; r < s; ++r)
    offset[static_cast<std::size_t>(r)] = Scalar(-0.5) * centroids.row(r).squaredNorm();
  kernels::assign_nearest<Scalar>(x, rows_view(centroids), offset.data(), best.data(),
                                  arg.data());
  double inertia = 0.0;
  for (Index i = 0; i < n; ++i) {
    const auto u = static_cast<std::size_t>(i);
    // |x - c|^2 = |x|^2 - 2 (x . c - |c|^2 / 2), clamped against rounding below zero.
    const double d = std::max(0.0, row_norms2[u] - 2.0 * static_cast<double>(best[u]));
    d2[u] = d;
    inertia += d;
  }
  return inertia;
}

}  // namespace detail

// k-means on the rows of `keys` (n x dk): `size` centroids, 1 <= size <= n, finite keys.
template <class Scalar>
KMeansResult<Scalar> fit_kmeans(const ConstMatrixRef<Scalar>& keys, Index size,
                                const KMeansOptions& options = {}) {
  static_assert(is_supported_scalar_v<Scalar>, "fit_kmeans runs in float or double");
  const char* where = "fit_codebook";
  options.validate(where);
  const ConstRowsView<Scalar> x = rows_view(keys);
  const Index n = x.rows;
  const Index dk = x.cols;
  detail::check_positive(where, "keys rows", n);
  detail::check_positive(where, "keys columns", dk);
  detail::check_positive(where, "size", size);
  detail::require(size <= n, where, "size = ", size, ", expected <= ", n,
                  " (the number of key rows)");
  detail::check_finite<Scalar>(where, "keys", x);

  const detail::SerialEigenScope serial;
  const auto nn = static_cast<std::size_t>(n);
  const auto ns = static_cast<std::size_t>(size);
  const auto X = as_eigen(x);

  std::vector<double> row_norms2(nn);
  for (Index i = 0; i < n; ++i) row_norms2[static_cast<std::size_t>(i)] =
      X.row(i).template cast<double>().squaredNorm();

  KMeansResult<Scalar> result;
  RowMatrix<Scalar>& c = result.centroids;
  c.resize(size, dk);

  // 1. k-means++.
  std::uint64_t rng = options.seed ^ 0x6a09e667f3bcc909ULL;
  std::vector<double> d2(nn, std::numeric_limits<double>::infinity());
  std::vector<char> used(nn, 0);
  Eigen::Matrix<Scalar, Eigen::Dynamic, 1> dots(n);
  Index pick = static_cast<Index>(detail::splitmix64(rng) % static_cast<std::uint64_t>(n));
  Index next_unused = 0;  // lowest row index not yet a centroid (for the zero-distance case)
  for (Index s = 0;; ++s) {
    c.row(s) = X.row(pick);
    used[static_cast<std::size_t>(pick)] = 1;
    if (s + 1 == size) break;
    // d2_i = min(d2_i, |x_i - c_s|^2) with one matrix-vector product.
    dots.noalias() = X * c.row(s).transpose();
    const double cn = c.row(s).template cast<double>().squaredNorm();
    double total = 0.0;
    for (Index i = 0; i < n; ++i) {
      const auto u = static_cast<std::size_t>(i);
      const double d = std::max(0.0, row_norms2[u] - 2.0 * static_cast<double>(dots[i]) + cn);
      if (d < d2[u]) d2[u] = d;
      if (used[u]) d2[u] = 0.0;
      total += d2[u];
    }
    if (total > 0.0) {
      double r = detail::uniform01(rng) * total;
      pick = -1;
      for (Index i = 0; i < n; ++i) {
        const double d = d2[static_cast<std::size_t>(i)];
        if (d <= 0.0) continue;
        pick = i;  // the last row of positive weight, should rounding exhaust r
        r -= d;
        if (r < 0.0) break;
      }
    } else {
      while (used[static_cast<std::size_t>(next_unused)]) ++next_unused;
      pick = next_unused;
    }
  }

  // 2-3. Lloyd iterations.
  std::vector<Scalar> offset(ns), best(nn);
  std::vector<Index>& arg = result.assignment;
  arg.assign(nn, -1);
  std::vector<Index> previous;
  double inertia = detail::kmeans_assign(x, c, row_norms2, offset, best, arg, d2);
  Eigen::Matrix<double, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor> sums(size, dk);
  std::vector<Index> members(ns);
  std::vector<char> reseeded(nn);
  for (Index it = 0; it < options.max_iterations; ++it) {
    sums.setZero();
    std::fill(members.begin(), members.end(), Index(0));
    for (Index i = 0; i < n; ++i) {
      const Index a = arg[static_cast<std::size_t>(i)];
      sums.row(a) += X.row(i).template cast<double>();
      ++members[static_cast<std::size_t>(a)];
    }
    std::fill(reseeded.begin(), reseeded.end(), char(0));
    for (Index r = 0; r < size; ++r) {
      const Index m = members[static_cast<std::size_t>(r)];
      if (m > 0) {
        c.row(r) = (sums.row(r) / static_cast<double>(m)).template cast<Scalar>();
        continue;
      }
      Index far = -1;
      for (Index i = 0; i < n; ++i) {
        const auto u = static_cast<std::size_t>(i);
        if (reseeded[u]) continue;
        if (far < 0 || d2[u] > d2[static_cast<std::size_t>(far)]) far = i;
      }
      reseeded[static_cast<std::size_t>(far)] = 1;
      c.row(r) = X.row(far);
    }
    previous = arg;
    const double before = inertia;
    inertia = detail::kmeans_assign(x, c, row_norms2, offset, best, arg, d2);
    result.iterations = it + 1;
    if (arg == previous || before - inertia <= options.tolerance * before) {
      result.converged = true;
      break;
    }
  }
  result.inertia = inertia;
  return result;
}

// The codebook alone (size x dk): what VqAttention::make_state takes.
template <class Scalar>
RowMatrix<Scalar> fit_codebook(const ConstMatrixRef<Scalar>& keys, Index size,
                               const KMeansOptions& options = {}) {
  return fit_kmeans<Scalar>(keys, size, options).centroids;
}

}  // namespace ovq
