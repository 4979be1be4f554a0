#pragma once
// Shared test helpers: seeded random inputs, tolerances in one place, and comparisons that
// report the normalised error.
#include <cmath>
#include <cstdint>
#include <random>
#include <type_traits>

#include "ovq/ovq.hpp"
#include "ovq/ref/reference.hpp"

namespace ovq::test {

// Relative (Frobenius) error tolerances of an implementation against the double reference.
template <class Scalar>
constexpr double tolerance() {
  return std::is_same_v<Scalar, float> ? 2e-5 : 1e-11;
}

// Gaussian entries scaled by `scale`, from a seeded generator: every run sees the same data.
template <class Scalar = double>
RowMatrix<Scalar> random_matrix(Index rows, Index cols, std::uint64_t seed, double scale = 1.0) {
  std::mt19937_64 gen(seed);
  std::normal_distribution<double> normal(0.0, 1.0);
  RowMatrix<Scalar> m(rows, cols);
  for (Index i = 0; i < rows; ++i)
    for (Index j = 0; j < cols; ++j) m(i, j) = static_cast<Scalar>(scale * normal(gen));
  return m;
}

// Rows of unit norm (distinct with probability one).
template <class Scalar = double>
RowMatrix<Scalar> random_unit_rows(Index rows, Index cols, std::uint64_t seed) {
  RowMatrix<Scalar> m = random_matrix<Scalar>(rows, cols, seed);
  m.rowwise().normalize();
  return m;
}

template <class A, class B>
double relative_error(const A& a, const B& b) {
  const RowMatrix<double> da = a.template cast<double>();
  const RowMatrix<double> db = b.template cast<double>();
  const double denom = std::max(db.norm(), 1e-300);
  return (da - db).norm() / denom;
}

}  // namespace ovq::test
