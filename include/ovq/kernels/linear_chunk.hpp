#pragma once
// Linear attention over one chunk of Lc tokens, in GEMM form, carrying (S, z) across chunks.
//
// With decay g, A = (phi(Q) phi(K)^T) o G, G_ij = g^(i-j) for j <= i and 0 above:
//   num_i = (A V)_i + g^(i+1) phi(q_i) S_prev          den_i = (A 1)_i + g^(i+1) phi(q_i) . z_prev
//   o_i = beta num_i  (unnormalised)     o_i = num_i / (den_i + eps)  (normalised)
// and after the chunk: S = g^Lc S_prev + phi(K)^T diag(g^(Lc-1-j)) V, z likewise.
// This equals the token recurrence S_i = g S_{i-1} + phi(k_i) v_i^T to rounding.
// Shapes: phi_q (Lc x dk), phi_k (Lc x dk), v (Lc x dv), S (dk x dv), z (dk), o (Lc x dv).
// Cost: 2 Lc^2 (dk + dv) / 2 + 4 Lc dk dv flops per head and chunk.
#include <cmath>
#include <vector>

#include "ovq/core/threads.hpp"
#include "ovq/core/types.hpp"

namespace ovq::kernels {

enum class FeatureMap { identity, elu1, relu };

template <class Scalar>
Scalar apply_feature_map(FeatureMap map, Scalar x) {
  switch (map) {
    case FeatureMap::elu1:
      return x > Scalar(0) ? x + Scalar(1) : std::exp(x);
    case FeatureMap::relu:
      return x > Scalar(0) ? x : Scalar(0);
    case FeatureMap::identity:
    default:
      return x;
  }
}

// out = phi(x), rows of x copied through the feature map. out is resized to x's shape.
template <class Scalar>
void feature_map_rows(FeatureMap map, ConstRowsView<Scalar> x, RowMatrix<Scalar>& out) {
  out.resize(x.rows, x.cols);
  for (Index i = 0; i < x.rows; ++i)
    for (Index j = 0; j < x.cols; ++j) out(i, j) = apply_feature_map(map, x.row(i)[j]);
}

template <class Scalar>
struct LinearChunkParams {
  Scalar beta = Scalar(1);
  Scalar decay = Scalar(1);
  bool normalize = false;
  Scalar eps = Scalar(1e-6);
};

// powers[i] = decay^i for i in [0, n], in double then rounded once.
template <class Scalar>
std::vector<Scalar> decay_powers(Scalar decay, Index n) {
  std::vector<Scalar> p(static_cast<std::size_t>(n) + 1);
  for (Index i = 0; i <= n; ++i)
    p[static_cast<std::size_t>(i)] =
        static_cast<Scalar>(std::pow(static_cast<double>(decay), static_cast<double>(i)));
  return p;
}

// g^(i+1) for rows i in [0, lc).
template <class Scalar>
Eigen::Matrix<Scalar, Eigen::Dynamic, 1> powers_head(const std::vector<Scalar>& powers, Index lc) {
  Eigen::Matrix<Scalar, Eigen::Dynamic, 1> h(lc);
  for (Index i = 0; i < lc; ++i) h[i] = powers[static_cast<std::size_t>(i) + 1];
  return h;
}

// Reads one chunk for one query head; the state is not changed.
template <class Scalar>
void linear_chunk_read(const RowMatrix<Scalar>& phi_q, const RowMatrix<Scalar>& phi_k,
                       ConstRowsView<Scalar> v, const RowMatrix<Scalar>& kv,
                       const RowVector<Scalar>& k_sum, const std::vector<Scalar>& powers,
                       const LinearChunkParams<Scalar>& p, RowsView<Scalar> o) {
  const detail::SerialEigenScope serial;
  const Index lc = phi_q.rows();
  RowMatrix<Scalar> a = phi_q * phi_k.transpose();
  for (Index i = 0; i < lc; ++i)
    for (Index j = 0; j < lc; ++j)
      a(i, j) = j <= i ? a(i, j) * powers[static_cast<std::size_t>(i - j)] : Scalar(0);
  RowMatrix<Scalar> num = a * as_eigen(v);
  num.noalias() += (powers_head(powers, lc).asDiagonal() * phi_q) * kv;
  auto out = as_eigen(o);
  if (!p.normalize) {
    out = p.beta * num;
    return;
  }
  const Eigen::Matrix<Scalar, Eigen::Dynamic, 1> den =
      a.rowwise().sum() + powers_head(powers, lc).asDiagonal() * (phi_q * k_sum.transpose());
  // A zero normaliser (relu features that are all 0, eps = 0) means nothing was attended to:
  // the output is 0 rather than 0 / 0.
  for (Index i = 0; i < lc; ++i) {
    const Scalar d = den[i] + p.eps;
    if (d == Scalar(0)) {
      out.row(i).setZero();
    } else {
      out.row(i) = num.row(i) / d;
    }
  }
}

// Absorbs the chunk into (S, z).
template <class Scalar>
void linear_chunk_write(const RowMatrix<Scalar>& phi_k, ConstRowsView<Scalar> v,
                        RowMatrix<Scalar>& kv, RowVector<Scalar>& k_sum,
                        const std::vector<Scalar>& powers) {
  const detail::SerialEigenScope serial;
  const Index lc = phi_k.rows();
  // w_j = g^(Lc-1-j): how much of token j is left at the end of the chunk.
  Eigen::Matrix<Scalar, Eigen::Dynamic, 1> w(lc);
  for (Index j = 0; j < lc; ++j) w[j] = powers[static_cast<std::size_t>(lc - 1 - j)];
  const Scalar carry = powers[static_cast<std::size_t>(lc)];
  kv *= carry;
  kv.noalias() += phi_k.transpose() * (w.asDiagonal() * as_eigen(v));
  k_sum *= carry;
  k_sum.noalias() += w.transpose() * phi_k;
}

}  // namespace ovq::kernels
