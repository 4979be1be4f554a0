#pragma once
// Plain references of MATH.md, in double precision, token by token and quadratic where the
// definition is: obviously correct rather than fast. Tests compare every optimised path with
// these; users can use them to debug numerics. Nothing here shares code with the kernels,
// except the definition of the random seeding draw (a generator has to be the same one).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "ovq/core/types.hpp"
#include "ovq/kernels/ovq_write.hpp"
#include "ovq/mixers/linear_attention.hpp"
#include "ovq/mixers/ovq_attention.hpp"

namespace ovq::ref {

using Matrix = RowMatrix<double>;
using Vector = Eigen::VectorXd;

// softmax over logits (entries of -inf ignored) of the rows of values.
inline Vector softmax_read(const std::vector<double>& logits, const std::vector<Vector>& values,
                           Index dv) {
  double m = -std::numeric_limits<double>::infinity();
  for (double l : logits) m = std::max(m, l);
  Vector num = Vector::Zero(dv);
  double den = 0.0;
  if (m == -std::numeric_limits<double>::infinity()) return num;
  for (std::size_t j = 0; j < logits.size(); ++j) {
    const double w = std::exp(logits[j] - m);
    num += w * values[j];
    den += w;
  }
  return num / den;
}

// Section 1. causal: j <= i; window W > 0: i - W < j <= i; non-causal: every j.
inline Matrix self_attention(const Matrix& q, const Matrix& k, const Matrix& v, double beta,
                             bool causal = true, Index window = 0) {
  const Index t = q.rows();
  Matrix o(t, v.cols());
  for (Index i = 0; i < t; ++i) {
    std::vector<double> logits;
    std::vector<Vector> values;
    for (Index j = 0; j < k.rows(); ++j) {
      if (causal && j > i) continue;
      if (causal && window > 0 && j <= i - window) continue;
      logits.push_back(beta * q.row(i).dot(k.row(j)));
      values.push_back(v.row(j).transpose());
    }
    o.row(i) = softmax_read(logits, values, v.cols()).transpose();
  }
  return o;
}

inline double feature(FeatureMap map, double x) {
  switch (map) {
    case FeatureMap::elu1:
      return x > 0.0 ? x + 1.0 : std::exp(x);
    case FeatureMap::relu:
      return std::max(x, 0.0);
    default:
      return x;
  }
}

struct LinearRefState {
  Matrix s;  // dk x dv
  Vector z;  // dk
};

// Section 2, the recurrence S_i = gamma S_{i-1} + phi(k_i) v_i^T, z_i likewise.
inline Matrix linear_attention(const Matrix& q, const Matrix& k, const Matrix& v,
                               const LinearAttentionOptions& opt,
                               LinearRefState* state = nullptr) {
  const Index dk = k.cols();
  const Index dv = v.cols();
  LinearRefState st{Matrix::Zero(dk, dv), Vector::Zero(dk)};
  if (state != nullptr && state->s.size() > 0) st = *state;
  Matrix o(q.rows(), dv);
  for (Index i = 0; i < q.rows(); ++i) {
    Vector pk(dk), pq(dk);
    for (Index d = 0; d < dk; ++d) {
      pk[d] = feature(opt.feature_map, k(i, d));
      pq[d] = feature(opt.feature_map, q(i, d));
    }
    st.s = opt.decay * st.s + pk * v.row(i);
    st.z = opt.decay * st.z + pk;
    const Vector num = st.s.transpose() * pq;
    if (opt.normalize) {
      o.row(i) = (num / (st.z.dot(pq) + opt.eps)).transpose();
    } else {
      o.row(i) = (opt.beta * num).transpose();
    }
  }
  if (state != nullptr) *state = st;
  return o;
}

// Section 3: z_j = argmin_s |k_j - C_s|^2 (ties: smallest s).
inline std::vector<Index> quantise(const Matrix& k, const Matrix& codebook) {
  std::vector<Index> z(static_cast<std::size_t>(k.rows()));
  for (Index j = 0; j < k.rows(); ++j) {
    double best = std::numeric_limits<double>::infinity();
    for (Index s = 0; s < codebook.rows(); ++s) {
      const double d = (k.row(j) - codebook.row(s)).squaredNorm();
      if (d < best) {
        best = d;
        z[static_cast<std::size_t>(j)] = s;
      }
    }
  }
  return z;
}

inline Matrix quantised_keys(const Matrix& k, const Matrix& codebook) {
  const std::vector<Index> z = quantise(k, codebook);
  Matrix khat(k.rows(), k.cols());
  for (Index j = 0; j < k.rows(); ++j) khat.row(j) = codebook.row(z[static_cast<std::size_t>(j)]);
  return khat;
}

// Section 3, the quadratic form: causal self-attention over the quantised keys.
inline Matrix vq_attention(const Matrix& q, const Matrix& k, const Matrix& v,
                           const Matrix& codebook, double beta) {
  return self_attention(q, quantised_keys(k, codebook), v, beta, true, 0);
}

// Section 4.
struct OvqRefState {
  Matrix dk, dv;                    // n x dk, n x dv
  std::vector<std::int64_t> count;  // n
  std::int64_t t = 0;
  Matrix pending_k, pending_v;      // pending rows

  Index size() const { return dk.rows(); }
};

inline Index ovq_growth_target(const OvqOptions& opt, std::int64_t t) {
  const double n_cap = static_cast<double>(opt.capacity);
  double g;
  if (opt.growth.kind == Growth::Kind::dirichlet) {
    const double a = opt.growth.alpha > 0.0 ? opt.growth.alpha : n_cap;
    g = std::ceil(n_cap * (1.0 - std::pow(1.0 + static_cast<double>(t) / a, -a / n_cap)));
  } else if (opt.growth.kind == Growth::Kind::saturating) {
    const long double tt = static_cast<long double>(t);
    g = static_cast<double>(std::floor(static_cast<long double>(opt.capacity) * tt /
                                       (static_cast<long double>(opt.capacity) + tt)));
  } else {
    g = std::ceil(opt.growth.rate * static_cast<double>(t));
  }
  return static_cast<Index>(std::min(g, n_cap));
}

inline void append_row(Matrix& m, const Eigen::RowVectorXd& row) {
  m.conservativeResize(m.rows() + 1, row.size());
  m.row(m.rows() - 1) = row;
}

// The read of the dictionary's rows with members by query q: bias log c, or 0 without the
// count bias.
inline Vector ovq_dictionary_read(const OvqRefState& st, const OvqOptions& opt,
                                  const Eigen::RowVectorXd& q, Index dv,
                                  std::vector<double>* logits_out = nullptr,
                                  std::vector<Vector>* values_out = nullptr) {
  std::vector<double> logits;
  std::vector<Vector> values;
  for (Index r = 0; r < st.size(); ++r) {
    if (st.count[r] == 0) continue;
    const double bias = opt.count_bias ? std::log(static_cast<double>(st.count[r])) : 0.0;
    logits.push_back(opt.beta * q.dot(st.dk.row(r)) + bias);
    values.push_back(st.dv.row(r).transpose());
  }
  if (logits_out != nullptr) *logits_out = logits;
  if (values_out != nullptr) *values_out = values;
  return softmax_read(logits, values, dv);
}

inline void ovq_write(OvqRefState& st, const OvqOptions& opt) {
  const Matrix kc = st.pending_k;
  const Matrix vc = st.pending_v;
  const Index l = kc.rows();
  const Index n = st.size();
  // The delta rule's predictions, by the dictionary before the chunk.
  const bool delta = opt.value_update == ValueUpdate::delta;
  Matrix yhat = Matrix::Zero(l, vc.cols());
  for (Index i = 0; i < l && delta; ++i)
    yhat.row(i) = ovq_dictionary_read(st, opt, kc.row(i), vc.cols()).transpose();
  const Index target = std::min<Index>(opt.capacity, ovq_growth_target(opt, st.t + l));
  Index m = std::clamp<Index>(target - n, 0, l);
  if (n == 0) m = std::max<Index>(m, 1);

  // Seed (and, for lowest-similarity seeding, assign first).
  std::vector<Index> seeds;
  std::vector<Index> a(static_cast<std::size_t>(l), 0);
  const bool assign_first = opt.seeding.kind == Seeding::Kind::lowest_similarity;
  if (assign_first) {
    // s_i against the old rows (or key 0 into an empty dictionary); the m smallest, by (s_i, i).
    std::vector<std::pair<double, Index>> ranked;
    for (Index i = n == 0 ? 1 : 0; i < l; ++i) {
      double s = -std::numeric_limits<double>::infinity();
      if (n == 0) s = kc.row(i).dot(kc.row(0));
      for (Index r = 0; r < n; ++r) {
        const double d = kc.row(i).dot(st.dk.row(r));
        if (d > s) {
          s = d;
          a[i] = r;
        }
      }
      ranked.emplace_back(s, i);
    }
    std::sort(ranked.begin(), ranked.end());
    if (n == 0) seeds.push_back(0);
    for (const auto& [s, i] : ranked)
      if (static_cast<Index>(seeds.size()) < m) seeds.push_back(i);
    for (std::size_t j = 0; j < seeds.size(); ++j) a[seeds[j]] = n + static_cast<Index>(j);
  } else if (opt.seeding.kind == Seeding::Kind::spread) {
    std::vector<double> s(static_cast<std::size_t>(l), -std::numeric_limits<double>::infinity());
    for (Index i = 0; i < l; ++i)
      for (Index r = 0; r < n; ++r) s[i] = std::max(s[i], kc.row(i).dot(st.dk.row(r)));
    std::vector<bool> picked(static_cast<std::size_t>(l), false);
    for (Index step = 0; step < m; ++step) {
      Index best = -1;
      for (Index i = 0; i < l; ++i)
        if (!picked[i] && (best < 0 || s[i] < s[best])) best = i;
      picked[best] = true;
      seeds.push_back(best);
      for (Index i = 0; i < l; ++i) s[i] = std::max(s[i], kc.row(i).dot(kc.row(best)));
    }
  } else {
    seeds = kernels::random_seed_rows(opt.seeding.seed, st.t / l, l, m);
  }
  for (Index i : seeds) {
    append_row(st.dk, kc.row(i));
    append_row(st.dv, vc.row(i));
    st.count.push_back(0);
  }

  // Assign with the dictionary after seeding.
  for (Index i = 0; i < l && !assign_first; ++i) {
    Index best = 0;
    for (Index r = 1; r < st.size(); ++r)
      if (kc.row(i).dot(st.dk.row(r)) > kc.row(i).dot(st.dk.row(best))) best = r;
    a[i] = best;
  }

  // Update every row with members.
  for (Index r = 0; r < st.size(); ++r) {
    Index cnt = 0;
    Eigen::RowVectorXd sk = Eigen::RowVectorXd::Zero(kc.cols());
    Eigen::RowVectorXd sv = Eigen::RowVectorXd::Zero(vc.cols());
    Eigen::RowVectorXd residual = Eigen::RowVectorXd::Zero(vc.cols());
    for (Index i = 0; i < l; ++i) {
      if (a[i] != r) continue;
      ++cnt;
      sk += kc.row(i);
      sv += vc.row(i);
      residual += vc.row(i) - yhat.row(i);
    }
    if (cnt == 0) continue;
    const double c = static_cast<double>(st.count[r]);
    const double c_new = c + static_cast<double>(cnt);
    const bool predicted = delta && r < n;  // a row opened in this chunk takes the mean
    if (opt.rate.kind == UpdateRate::Kind::adaptive) {
      st.dk.row(r) = (c * st.dk.row(r) + sk) / c_new;
      st.dv.row(r) = predicted ? Eigen::RowVectorXd(st.dv.row(r) + residual / c_new)
                               : Eigen::RowVectorXd((c * st.dv.row(r) + sv) / c_new);
    } else {
      const double eta = opt.rate.eta;
      st.dk.row(r) = (1.0 - eta) * st.dk.row(r) + eta * sk / static_cast<double>(cnt);
      const double n_new = static_cast<double>(cnt);
      st.dv.row(r) = predicted ? Eigen::RowVectorXd(st.dv.row(r) + eta * residual / n_new)
                               : Eigen::RowVectorXd((1.0 - eta) * st.dv.row(r) + eta * sv / n_new);
    }
    if (opt.renormalize && st.dk.row(r).norm() > 0.0) st.dk.row(r).normalize();
    if (opt.renormalize_values && st.dv.row(r).norm() > 0.0) st.dv.row(r).normalize();
    st.count[r] += cnt;
  }
  st.t += l;
  st.pending_k.resize(0, kc.cols());
  st.pending_v.resize(0, vc.cols());
}

// Token by token: read (dictionary before the chunk + raw pending rows), then write when a chunk
// is complete. `state` (optional) is continued from and receives the final state.
inline Matrix ovq_attention(const Matrix& q, const Matrix& k, const Matrix& v,
                            const OvqOptions& opt, OvqRefState* state = nullptr) {
  OvqRefState st;
  if (state != nullptr) st = *state;
  if (st.pending_k.cols() != k.cols()) st.pending_k.resize(0, k.cols());
  if (st.pending_v.cols() != v.cols()) st.pending_v.resize(0, v.cols());
  if (st.dk.cols() != k.cols()) st.dk.resize(0, k.cols());
  if (st.dv.cols() != v.cols()) st.dv.resize(0, v.cols());
  Matrix o(q.rows(), v.cols());
  for (Index i = 0; i < q.rows(); ++i) {
    append_row(st.pending_k, k.row(i));
    append_row(st.pending_v, v.row(i));
    std::vector<double> logits;
    std::vector<Vector> values;
    ovq_dictionary_read(st, opt, q.row(i), v.cols(), &logits, &values);
    for (Index j = 0; j < st.pending_k.rows(); ++j) {
      logits.push_back(opt.beta * q.row(i).dot(st.pending_k.row(j)));
      values.push_back(st.pending_v.row(j).transpose());
    }
    o.row(i) = softmax_read(logits, values, v.cols()).transpose();
    if (st.pending_k.rows() == opt.chunk) ovq_write(st, opt);
  }
  if (state != nullptr) *state = st;
  return o;
}

}  // namespace ovq::ref
