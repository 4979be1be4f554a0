// Extreme inputs: each has a defined result, checked here for every mixer it applies to, in float
// and double.
//
//   beta = 1e6           softmax becomes argmax: the output is the value of the largest logit
//                        (VQ: a convex combination of the top code's values, see below;
//                        linear attention: beta only scales the unnormalised output)
//   identical keys       every logit is equal: the uniform average of the visible values
//   all-zero K or Q      the same (OVQ and VQ: the count-weighted mean values, which is the same
//                        average); linear attention with phi = identity: exactly 0
//   values near max/4    a convex combination never leaves [min v, max v]: finite, in range
//   |beta q . k| beyond the scalar's range
//                        either ovq::ArgumentError naming the argument, or finite outputs in
//                        the values' range (the mathematical result is a convex combination)
//   OVQ, capacity <= chunk, linear growth: full after the first chunk (n == N), and from then
//                        on nothing is evicted: rows only ever gain counts, counts sum to t
//   OVQ, capacity 1 / chunk 1: the reference result, counts == t, pending empty (chunk 1)
//
// Linear attention's state is an unnormalised sum (S = sum phi(k) v^T), so values or keys near
// the largest finite scalar overflow it by definition; those cases do not apply to it.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "support/catch.hpp"
#include "support/fixtures.hpp"

// Everything below lives in this file's own namespace, so the suite can be built as one
// unity source without the files' helpers colliding.
namespace ovq_test_extremes {

namespace {

using ovq::Index;
template <class S>
using Mat = ovq::RowMatrix<S>;
using MatD = ovq::RowMatrix<double>;

template <class S>
constexpr double tol() {
  return std::is_same_v<S, float> ? 2e-5 : 1e-12;
}

template <class S>
bool all_finite(const Mat<S>& m) {
  return m.allFinite();
}

// A state's rows (S may be const-qualified).
template <class S>
bool all_finite(ovq::RowsView<S> v) {
  return ovq::as_eigen(v).allFinite();
}

// max |a - b| / scale, in double.
template <class A, class B>
double scaled_diff(const A& a, const B& b, double scale) {
  const MatD da = a.template cast<double>();
  const MatD db = b.template cast<double>();
  if (da.rows() != db.rows() || da.cols() != db.cols())
    return std::numeric_limits<double>::infinity();
  if (da.size() == 0) return 0.0;
  return (da - db).cwiseAbs().maxCoeff() / scale;
}

// Row i: the mean of rows [first(i), i] of v (the uniform average of what token i sees).
MatD running_mean(const MatD& v, Index window = 0) {
  MatD out(v.rows(), v.cols());
  for (Index i = 0; i < v.rows(); ++i) {
    const Index first = window > 0 ? std::max<Index>(0, i - window + 1) : 0;
    out.row(i) = v.middleRows(first, i - first + 1).colwise().mean();
  }
  return out;
}

// Every output entry within [min, max] of its column of v, up to a relative `slack`.
template <class S>
bool within_value_range(const Mat<S>& o, const Mat<S>& v, double slack = 1e-6) {
  for (Index c = 0; c < v.cols(); ++c) {
    const double lo = static_cast<double>(v.col(c).minCoeff());
    const double hi = static_cast<double>(v.col(c).maxCoeff());
    const double pad = slack * std::max(std::abs(lo), std::abs(hi));
    for (Index i = 0; i < o.rows(); ++i) {
      const double x = static_cast<double>(o(i, c));
      if (!(x >= lo - pad && x <= hi + pad)) return false;
    }
  }
  return true;
}

template <class S>
ovq::SelfAttention<S> self_mixer(double beta = 1.0, Index window = 0) {
  ovq::SelfAttentionOptions o;
  o.beta = beta;
  o.window = window;
  o.chunk = 8;
  return ovq::SelfAttention<S>(o);
}

template <class S>
ovq::VqAttention<S> vq_mixer(double beta = 1.0) {
  ovq::VqAttentionOptions o;
  o.beta = beta;
  o.chunk = 8;
  return ovq::VqAttention<S>(o);
}

template <class S>
ovq::OvqAttention<S> ovq_mixer(double beta = 1.0, Index capacity = 6, Index chunk = 8) {
  ovq::OvqOptions o;
  o.beta = beta;
  o.capacity = capacity;
  o.chunk = chunk;
  return ovq::OvqAttention<S>(o);
}

template <class S>
Mat<S> codebook(Index dk) {
  return ovq::test::random_unit_rows<S>(5, dk, 500);
}

template <class S>
Mat<S> run_self(const Mat<S>& q, const Mat<S>& k, const Mat<S>& v, double beta = 1.0,
                Index window = 0) {
  const auto m = self_mixer<S>(beta, window);
  auto state = m.make_state(k.cols(), v.cols());
  return m.forward(state, q, k, v);
}

template <class S>
Mat<S> run_vq(const Mat<S>& q, const Mat<S>& k, const Mat<S>& v, double beta = 1.0) {
  const auto m = vq_mixer<S>(beta);
  auto state = m.make_state(codebook<S>(k.cols()), v.cols());
  return m.forward(state, q, k, v);
}

template <class S>
Mat<S> run_ovq(const Mat<S>& q, const Mat<S>& k, const Mat<S>& v, double beta = 1.0,
               ovq::OvqState<S>* final_state = nullptr) {
  const auto m = ovq_mixer<S>(beta);
  auto state = m.make_state(k.cols(), v.cols());
  const Mat<S> o = m.forward(state, q, k, v);
  if (final_state != nullptr) *final_state = state;
  return o;
}

template <class S>
Mat<S> run_linear(const Mat<S>& q, const Mat<S>& k, const Mat<S>& v, double beta,
                  ovq::FeatureMap map, bool normalize) {
  ovq::LinearAttentionOptions o;
  o.beta = beta;
  o.feature_map = map;
  o.normalize = normalize;
  o.chunk = 8;
  const ovq::LinearAttention<S> m(o);
  auto state = m.make_state(k.cols(), v.cols());
  return m.forward(state, q, k, v);
}

// The counts of an OVQ state add up to t, exactly.
template <class S>
void check_counts(const ovq::OvqState<S>& s) {
  CHECK(s.dictionary().total_count() == s.absorbed());
  CHECK(s.dictionary().size() <= s.capacity());
  CHECK(s.tokens() == s.absorbed() + s.pending());
  for (Index r = 0; r < s.dictionary().size(); ++r) CHECK(s.dictionary().count(r) >= 0);
}

constexpr Index kT = 37;  // four chunks of 8 and a partial one
constexpr Index kDk = 4;
constexpr Index kDv = 3;

// ---------------------------------------------------------------------------------------------
// beta = 1e6
// ---------------------------------------------------------------------------------------------

// The largest of `logits` and the value it selects, or nothing when the runner-up is within
// `min_gap` (a near-tie, where the output is legitimately a blend).
struct Argmax {
  bool clear = false;
  Eigen::RowVectorXd value;
};

Argmax argmax(const std::vector<double>& logits, const std::vector<Eigen::RowVectorXd>& values,
              double min_gap) {
  Argmax out;
  std::size_t best = 0;
  for (std::size_t j = 1; j < logits.size(); ++j)
    if (logits[j] > logits[best]) best = j;
  double second = -std::numeric_limits<double>::infinity();
  for (std::size_t j = 0; j < logits.size(); ++j)
    if (j != best && !(values[j] == values[best])) second = std::max(second, logits[j]);
  out.clear = logits[best] - second > min_gap;
  out.value = values[best];
  return out;
}

constexpr double kHugeBeta = 1e6;
constexpr double kMinLogitGap = 60.0;  // e^-60 < 1e-26: the runner-up is invisible

TEMPLATE_TEST_CASE("extremes: beta = 1e6 turns self-attention into argmax", "[extremes][self]",
                   float, double) {
  using S = TestType;
  const Mat<S> q = ovq::test::random_unit_rows<S>(kT, kDk, 1);
  const Mat<S> k = ovq::test::random_unit_rows<S>(kT, kDk, 2);
  const Mat<S> v = ovq::test::random_matrix<S>(kT, kDv, 3);
  for (const Index window : {Index(0), Index(5)}) {
    const Mat<S> o = run_self<S>(q, k, v, kHugeBeta, window);
    CHECK(all_finite(o));
    Index checked = 0;
    for (Index i = 0; i < kT; ++i) {
      std::vector<double> logits;
      std::vector<Eigen::RowVectorXd> values;
      const Index first = window > 0 ? std::max<Index>(0, i - window + 1) : 0;
      for (Index j = first; j <= i; ++j) {
        logits.push_back(kHugeBeta *
                         q.row(i).template cast<double>().dot(k.row(j).template cast<double>()));
        values.push_back(v.row(j).template cast<double>());
      }
      const Argmax a = argmax(logits, values, kMinLogitGap);
      if (!a.clear) continue;
      ++checked;
      CAPTURE(window, i);
      CHECK(scaled_diff(o.row(i), a.value, 1.0) <= tol<S>());
    }
    CHECK(checked >= kT / 2);
  }
}

// VQ: the rows of the top code are tied, and they reach the read by two paths: the code's memory
// row (logit beta q.C + log c, value the mean of its past values) and its rows in the current
// chunk (logit beta q.C each). At |logit| ~ beta, the rounding of beta q.C and of the added
// log c is delta ~ beta (dk + 2) eps, so tied rows are weighed up to e^{+-delta} apart: the
// output is a convex combination of the top code's values (the argmax, at the level of codes),
// within (e^delta - 1) x their spread of their mean. That is 0.3 in float (logits of 1e6 carry
// no digit after the point) and ~1e-9 in double.
TEMPLATE_TEST_CASE("extremes: beta = 1e6 turns VQ-attention into argmax over codes",
                   "[extremes][vq]", float, double) {
  using S = TestType;
  const Mat<S> q = ovq::test::random_unit_rows<S>(kT, kDk, 11);
  const Mat<S> k = ovq::test::random_unit_rows<S>(kT, kDk, 12);
  const Mat<S> v = ovq::test::random_matrix<S>(kT, kDv, 13);
  const Mat<S> o = run_vq<S>(q, k, v, kHugeBeta);
  CHECK(all_finite(o));
  const MatD c = codebook<S>(kDk).template cast<double>();
  const std::vector<Index> code = ovq::ref::quantise(k.template cast<double>(), c);
  Index checked = 0;
  for (Index i = 0; i < kT; ++i) {
    // One logit per code in use up to i; its value is the mean of the values quantised to it.
    std::vector<double> logits;
    std::vector<Eigen::RowVectorXd> values;
    std::vector<MatD> members;
    for (Index s = 0; s < c.rows(); ++s) {
      MatD rows(0, kDv);
      for (Index j = 0; j <= i; ++j) {
        if (code[static_cast<std::size_t>(j)] != s) continue;
        rows.conservativeResize(rows.rows() + 1, kDv);
        rows.row(rows.rows() - 1) = v.row(j).template cast<double>();
      }
      if (rows.rows() == 0) continue;
      logits.push_back(kHugeBeta * q.row(i).template cast<double>().dot(c.row(s)));
      values.push_back(rows.colwise().mean());
      members.push_back(rows);
    }
    const Argmax a = argmax(logits, values, kMinLogitGap);
    if (!a.clear) continue;
    ++checked;
    const MatD& top = members[static_cast<std::size_t>(
        std::find(values.begin(), values.end(), a.value) - values.begin())];
    const double delta = kHugeBeta * (kDk + 2) * std::numeric_limits<S>::epsilon();
    const double spread = (top.rowwise() - a.value).cwiseAbs().maxCoeff();
    CAPTURE(i, top.rows(), delta);
    const Mat<S> oi = o.row(i);
    CHECK(within_value_range(oi, top.cast<S>().eval()));
    CHECK(scaled_diff(oi, a.value, 1.0) <= std::expm1(delta) * spread + tol<S>());
  }
  CHECK(checked >= kT / 2);
}

TEMPLATE_TEST_CASE(
    "extremes: beta = 1e6 turns OVQ-attention into argmax over the dictionary "
    "and the chunk",
    "[extremes][ovq]", float, double) {
  using S = TestType;
  const Mat<S> q = ovq::test::random_unit_rows<S>(kT, kDk, 21);
  const Mat<S> k = ovq::test::random_unit_rows<S>(kT, kDk, 22);
  const Mat<S> v = ovq::test::random_matrix<S>(kT, kDv, 23);
  const auto m = ovq_mixer<S>(kHugeBeta);
  auto state = m.make_state(kDk, kDv);
  Index checked = 0;
  for (Index i = 0; i < kT; ++i) {
    // The candidates token i reads: dictionary rows with their log-count bias, the pending rows
    // of its chunk, and itself.
    std::vector<double> logits;
    std::vector<Eigen::RowVectorXd> values;
    const Eigen::RowVectorXd qi = q.row(i).template cast<double>();
    const auto& d = state.dictionary();
    for (Index r = 0; r < d.size(); ++r) {
      if (d.count(r) == 0) continue;
      logits.push_back(kHugeBeta * qi.dot(ovq::row_map(d.keys(), r).template cast<double>()) +
                       std::log(static_cast<double>(d.count(r))));
      values.push_back(ovq::row_map(d.values(), r).template cast<double>());
    }
    for (Index j = 0; j < state.pending(); ++j) {
      logits.push_back(kHugeBeta *
                       qi.dot(ovq::row_map(state.pending_keys(), j).template cast<double>()));
      values.push_back(ovq::row_map(state.pending_values(), j).template cast<double>());
    }
    logits.push_back(kHugeBeta * qi.dot(k.row(i).template cast<double>()));
    values.push_back(v.row(i).template cast<double>());
    const Argmax a = argmax(logits, values, kMinLogitGap);

    const ovq::RowVector<S> o = m.step(state, q.row(i), k.row(i), v.row(i));
    CHECK(o.allFinite());
    if (!a.clear) continue;
    ++checked;
    CAPTURE(i);
    CHECK(scaled_diff(o, a.value, 1.0) <= tol<S>());
  }
  CHECK(checked >= kT / 2);
  check_counts(state);
}

TEMPLATE_TEST_CASE("extremes: beta = 1e6 only scales unnormalised linear attention",
                   "[extremes][linear]", float, double) {
  using S = TestType;
  const Mat<S> q = ovq::test::random_unit_rows<S>(kT, kDk, 31);
  const Mat<S> k = ovq::test::random_unit_rows<S>(kT, kDk, 32);
  const Mat<S> v = ovq::test::random_matrix<S>(kT, kDv, 33);
  for (const auto map : {ovq::FeatureMap::identity, ovq::FeatureMap::elu1}) {
    const Mat<S> big = run_linear<S>(q, k, v, kHugeBeta, map, false);
    const Mat<S> one = run_linear<S>(q, k, v, 1.0, map, false);
    CHECK(all_finite(big));
    const double scale = one.template cast<double>().cwiseAbs().maxCoeff();
    CHECK(scaled_diff((big.template cast<double>() / kHugeBeta).eval(), one, scale) <= tol<S>());
    // Normalised: beta cancels.
    const Mat<S> big_n = run_linear<S>(q, k, v, kHugeBeta, map, true);
    const Mat<S> one_n = run_linear<S>(q, k, v, 1.0, map, true);
    CHECK(all_finite(big_n));
    CHECK(scaled_diff(big_n, one_n, 1.0) <= tol<S>());
  }
}

// ---------------------------------------------------------------------------------------------
// Identical keys, all-zero keys, all-zero queries: the uniform average.
// ---------------------------------------------------------------------------------------------

enum class Flat { identical_keys, zero_keys, zero_queries };

template <class S>
struct FlatInputs {
  Mat<S> q, k, v;
  FlatInputs(Flat kind, std::uint64_t seed)
      : q(ovq::test::random_unit_rows<S>(kT, kDk, seed)),
        k(ovq::test::random_unit_rows<S>(kT, kDk, seed + 1)),
        v(ovq::test::random_matrix<S>(kT, kDv, seed + 2)) {
    switch (kind) {
      case Flat::identical_keys:
        for (Index i = 1; i < kT; ++i) k.row(i) = k.row(0);
        break;
      case Flat::zero_keys:
        k.setZero();
        break;
      case Flat::zero_queries:
        q.setZero();
        break;
    }
  }
};

const char* flat_name(Flat f) {
  switch (f) {
    case Flat::identical_keys:
      return "identical keys";
    case Flat::zero_keys:
      return "all-zero keys";
    case Flat::zero_queries:
      return "all-zero queries";
  }
  return "?";
}

TEMPLATE_TEST_CASE(
    "extremes: identical keys, zero keys or zero queries give the uniform "
    "average (self, VQ, OVQ)",
    "[extremes][self][vq][ovq]", float, double) {
  using S = TestType;
  for (const Flat kind : {Flat::identical_keys, Flat::zero_keys, Flat::zero_queries}) {
    CAPTURE(flat_name(kind));
    const FlatInputs<S> in(kind, 41);
    const MatD v = in.v.template cast<double>();
    const double scale = v.cwiseAbs().maxCoeff();
    for (const double beta : {1.0, 30.0}) {
      CAPTURE(beta);
      const Mat<S> o_self = run_self<S>(in.q, in.k, in.v, beta);
      CHECK(all_finite(o_self));
      CHECK(scaled_diff(o_self, running_mean(v), scale) <= tol<S>());

      const Mat<S> o_window = run_self<S>(in.q, in.k, in.v, beta, 6);
      CHECK(all_finite(o_window));
      CHECK(scaled_diff(o_window, running_mean(v, 6), scale) <= tol<S>());

      // Identical or zero keys all quantise to one code; zero queries weigh codes by count.
      const Mat<S> o_vq = run_vq<S>(in.q, in.k, in.v, beta);
      CHECK(all_finite(o_vq));
      CHECK(scaled_diff(o_vq, running_mean(v), scale) <= tol<S>());

      ovq::OvqState<S> state;
      const Mat<S> o_ovq = run_ovq<S>(in.q, in.k, in.v, beta, &state);
      CHECK(all_finite(o_ovq));
      CHECK(scaled_diff(o_ovq, running_mean(v), scale) <= tol<S>());
      check_counts(state);
      CHECK(all_finite(state.dictionary().keys()));
      CHECK(all_finite(state.dictionary().values()));
    }
  }
}

TEMPLATE_TEST_CASE("extremes: linear attention with identical, zero keys or zero queries",
                   "[extremes][linear]", float, double) {
  using S = TestType;
  for (const Flat kind : {Flat::identical_keys, Flat::zero_keys, Flat::zero_queries}) {
    CAPTURE(flat_name(kind));
    const FlatInputs<S> in(kind, 51);
    const MatD q = in.q.template cast<double>();
    const MatD k = in.k.template cast<double>();
    const MatD v = in.v.template cast<double>();
    // phi = identity: zero keys or zero queries give exactly 0, normalised or not.
    if (kind != Flat::identical_keys) {
      for (const bool normalize : {false, true}) {
        const Mat<S> o = run_linear<S>(in.q, in.k, in.v, 1.0, ovq::FeatureMap::identity, normalize);
        CHECK(all_finite(o));
        CHECK(o.isZero(0.0));
      }
    }
    // Every output is the reference recurrence (finite, no 0/0).
    for (const auto map :
         {ovq::FeatureMap::identity, ovq::FeatureMap::elu1, ovq::FeatureMap::relu}) {
      for (const bool normalize : {false, true}) {
        CAPTURE(static_cast<int>(map), normalize);
        ovq::LinearAttentionOptions o;
        o.feature_map = map;
        o.normalize = normalize;
        const MatD want = ovq::ref::linear_attention(q, k, v, o);
        const Mat<S> got = run_linear<S>(in.q, in.k, in.v, 1.0, map, normalize);
        CHECK(all_finite(got));
        CHECK(scaled_diff(got, want, std::max(1.0, want.cwiseAbs().maxCoeff())) <= 10 * tol<S>());
      }
    }
    // phi = elu1 and identical or zero keys: every phi(k) is the same positive vector, so the
    // normalised output is the running mean, up to eps in the denominator.
    if (kind != Flat::zero_queries) {
      const Mat<S> o = run_linear<S>(in.q, in.k, in.v, 1.0, ovq::FeatureMap::elu1, true);
      CHECK(scaled_diff(o, running_mean(v), v.cwiseAbs().maxCoeff()) <= 1e-5);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Values near the largest finite scalar.
// ---------------------------------------------------------------------------------------------

// Values of magnitude max/4 (one sign, or mixed signs).
template <class S>
Mat<S> huge_values(Index rows, Index cols, bool mixed_signs, std::uint64_t seed) {
  const double top = static_cast<double>(std::numeric_limits<S>::max()) / 4;
  Mat<S> v(rows, cols);
  const Mat<double> u = ovq::test::random_matrix<double>(rows, cols, seed);
  for (Index i = 0; i < rows; ++i)
    for (Index j = 0; j < cols; ++j) {
      const double mag = top * (0.5 + 0.5 * std::min(1.0, std::abs(u(i, j)) / 3.0));
      v(i, j) = static_cast<S>(mixed_signs && u(i, j) < 0 ? -mag : mag);
    }
  return v;
}

TEMPLATE_TEST_CASE("extremes: values near the largest finite scalar stay finite and in range",
                   "[extremes][self][vq][ovq]", float, double) {
  using S = TestType;
  const Mat<S> q = ovq::test::random_unit_rows<S>(kT, kDk, 61);
  const Mat<S> k = ovq::test::random_unit_rows<S>(kT, kDk, 62);
  Mat<S> k_same = k;
  for (Index i = 1; i < kT; ++i) k_same.row(i) = k.row(0);
  for (const bool mixed : {false, true}) {
    const Mat<S> v = huge_values<S>(kT, kDv, mixed, 63);
    for (const Mat<S>* keys : std::vector<const Mat<S>*>{&k, &k_same}) {
      CAPTURE(mixed, keys == &k_same);
      const Mat<S> o_self = run_self<S>(q, *keys, v);
      CHECK(all_finite(o_self));
      CHECK(within_value_range(o_self, v));

      const Mat<S> o_vq = run_vq<S>(q, *keys, v);
      CHECK(all_finite(o_vq));
      CHECK(within_value_range(o_vq, v));

      ovq::OvqState<S> state;
      const Mat<S> o_ovq = run_ovq<S>(q, *keys, v, 1.0, &state);
      CHECK(all_finite(o_ovq));
      CHECK(within_value_range(o_ovq, v));
      // Centroid values are means of values: finite and in range too.
      const Mat<S> dv = ovq::as_eigen(state.dictionary().values());
      CHECK(all_finite(dv));
      CHECK(within_value_range(dv, v));
      check_counts(state);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// |beta q . k| beyond the scalar's range.
// ---------------------------------------------------------------------------------------------

// What a call with overflowing logits may do: refuse with an ArgumentError naming the input at
// fault (Q, K or beta), or return finite outputs in the values' range.
// `expected`, where given, is the exact result (identical keys: the running mean).
template <class Run, class S>
void check_overflow_case(const char* what, Run run, const Mat<S>& v,
                         const MatD* expected = nullptr) {
  CAPTURE(what);
  try {
    const Mat<S> o = run();
    CHECK(all_finite(o));
    CHECK(within_value_range(o, v));
    if (expected != nullptr)
      CHECK(scaled_diff(o, *expected, v.template cast<double>().cwiseAbs().maxCoeff()) <= tol<S>());
  } catch (const ovq::ArgumentError& e) {
    const std::string msg = e.what();
    CAPTURE(msg);
    CHECK((msg.find("Q") != std::string::npos || msg.find("K") != std::string::npos ||
           msg.find("beta") != std::string::npos));
  }
}

TEMPLATE_TEST_CASE("extremes: logits beyond the scalar's range are refused or computed safely",
                   "[extremes][self][vq][ovq]", float, double) {
  using S = TestType;
  // Entries of this size make |q . k| overflow: float 1e20 (q . k ~ 1e40 > 3.4e38), double
  // 1e160 (~1e320 > 1.8e308); each entry alone is far from the range.
  const double huge = std::is_same_v<S, float> ? 1e20 : 1e160;
  const Mat<S> q = (ovq::test::random_unit_rows<double>(kT, kDk, 71) * huge).cast<S>();
  const Mat<S> k = (ovq::test::random_unit_rows<double>(kT, kDk, 72) * huge).cast<S>();
  const Mat<S> v = ovq::test::random_matrix<S>(kT, kDv, 73);
  Mat<S> k_same = k;
  for (Index i = 1; i < kT; ++i) k_same.row(i) = k.row(0);
  const Mat<S> k_neg = -k_same;
  // Moderate q . k (|q| = |k| = 4), beta = max / 2: beta q . k overflows all the same.
  const Mat<S> q1 = (4 * ovq::test::random_unit_rows<S>(kT, kDk, 74)).eval();
  const Mat<S> k1 = (4 * ovq::test::random_unit_rows<S>(kT, kDk, 75)).eval();
  const double beta_huge = static_cast<double>(std::numeric_limits<S>::max()) / 2;
  const MatD uniform = running_mean(v.template cast<double>());

  check_overflow_case(
      "self, huge q and k", [&] { return run_self<S>(q, k, v); }, v);
  // One key repeated: whatever the logits, they are all equal, and the result is the mean.
  check_overflow_case(
      "self, huge q, one huge key", [&] { return run_self<S>(q, k_same, v); }, v, &uniform);
  check_overflow_case(
      "self, huge q, one huge key negated", [&] { return run_self<S>(q, k_neg, v); }, v, &uniform);
  check_overflow_case(
      "self, huge beta", [&] { return run_self<S>(q1, k1, v, beta_huge); }, v);
  check_overflow_case(
      "self, window, huge q and k", [&] { return run_self<S>(q, k, v, 1.0, 5); }, v);
  check_overflow_case(
      "ovq, huge q and k", [&] { return run_ovq<S>(q, k, v); }, v);
  // OVQ with one key repeated: mathematically the logits differ only by log count, so the
  // result is the running mean; but beta q . k saturates at the largest finite value, where
  // adding log count no longer changes anything, so saturated rows weigh the same whatever
  // their counts. Defined behaviour: finite, in the values' range (checked), not the mean.
  check_overflow_case(
      "ovq, huge q, one huge key", [&] { return run_ovq<S>(q, k_same, v); }, v);
  check_overflow_case(
      "ovq, huge beta", [&] { return run_ovq<S>(q1, k1, v, beta_huge); }, v);
  // VQ reads quantised keys (unit codebook rows): only a huge beta or huge queries with a huge
  // beta reach the overflow.
  check_overflow_case(
      "vq, huge beta", [&] { return run_vq<S>(q1, k1, v, beta_huge); }, v);
  check_overflow_case(
      "vq, huge q and beta", [&] { return run_vq<S>(q, k, v, huge); }, v);
}

// ---------------------------------------------------------------------------------------------
// OVQ dictionaries that are full from the first chunk, capacity 1, chunk 1.
// ---------------------------------------------------------------------------------------------

TEMPLATE_TEST_CASE(
    "extremes: OVQ with capacity <= chunk is full after the first chunk and "
    "never evicts",
    "[extremes][ovq]", float, double) {
  using S = TestType;
  const Index chunk = 8, chunks = 6;
  const Mat<S> q = ovq::test::random_unit_rows<S>(chunk * chunks + 3, kDk, 81);
  const Mat<S> k = ovq::test::random_unit_rows<S>(chunk * chunks + 3, kDk, 82);
  const Mat<S> v = ovq::test::random_matrix<S>(chunk * chunks + 3, kDv, 83);
  for (const Index capacity : {Index(1), Index(3), Index(8)}) {
    CAPTURE(capacity);
    ovq::OvqOptions opt;
    opt.capacity = capacity;
    opt.chunk = chunk;
    opt.growth = ovq::Growth::linear(1.0);  // G(L) = L >= N: every centroid opens at once
    const ovq::OvqAttention<S> m(opt);
    auto state = m.make_state(kDk, kDv);

    // The first chunk but one token: nothing written yet.
    CHECK(all_finite(
        m.forward(state, q.topRows(chunk - 1), k.topRows(chunk - 1), v.topRows(chunk - 1))));
    CHECK(state.dictionary().size() == 0);
    CHECK(state.pending() == chunk - 1);
    Index done = chunk - 1;
    auto prev = state;
    for (Index c = 0; c < chunks; ++c) {
      const Index len = c == 0 ? 1 : chunk;
      const Mat<S> o = m.forward(state, q.middleRows(done, len), k.middleRows(done, len),
                                 v.middleRows(done, len));
      done += len;
      CAPTURE(c, done);
      CHECK(all_finite(o));
      CHECK(state.dictionary().size() == capacity);  // full from the first write on
      CHECK(state.pending() == 0);
      CHECK(state.absorbed() == (c + 1) * chunk);
      check_counts(state);
      if (c > 0) {
        // Nothing evicted: every row keeps its place and only gains counts; a row that gained
        // nothing is bitwise unchanged.
        const auto& d = state.dictionary();
        const auto& d0 = prev.dictionary();
        for (Index r = 0; r < capacity; ++r) {
          CHECK(d.count(r) >= d0.count(r));
          if (d.count(r) == d0.count(r)) {
            CHECK(ovq::row_map(d.keys(), r) == ovq::row_map(d0.keys(), r));
            CHECK(ovq::row_map(d.values(), r) == ovq::row_map(d0.values(), r));
          }
        }
      }
      prev = state;
    }
    // The same stream against the reference.
    const Index t = chunk * chunks + 3;
    auto fresh = m.make_state(kDk, kDv);
    const Mat<S> o = m.forward(fresh, q, k, v);
    const MatD want = ovq::ref::ovq_attention(q.template cast<double>(), k.template cast<double>(),
                                              v.template cast<double>(), opt);
    CHECK(ovq::test::relative_error(o, want) <= 10 * ovq::test::tolerance<S>());
    CHECK(fresh.dictionary().total_count() == (t / chunk) * chunk);
  }
}

// The delta rule moves a row by residuals, differences of values: with values near the largest
// finite scalar a row can be pushed past it. Two rows at +M and -M (M = 0.9 x the largest); a
// weak beta predicts about their average, 0, for the next key of row 0, whose value +M then
// moves row 0 by M / 2 towards 1.35 x the largest. The row is held at the largest finite value
// instead, and every output stays finite.
TEMPLATE_TEST_CASE("extremes: the delta rule holds value rows within the scalar's range",
                   "[extremes][ovq]", float, double) {
  using S = TestType;
  const double big = 0.9 * static_cast<double>(std::numeric_limits<S>::max());
  const Index t = 6, dk = 2, dv = 2;
  Mat<S> q = Mat<S>::Zero(t, dk), k(t, dk), v(t, dv);
  for (Index i = 0; i < t; ++i) {
    const bool first = i % 2 == 0;
    k.row(i) << S(first ? 1 : 0), S(first ? 0 : 1);
    v.row(i).setConstant(static_cast<S>(first ? big : -big));
    q.row(i) << S(1), S(0);
  }
  ovq::OvqOptions opt;
  opt.capacity = 2;
  opt.chunk = 1;
  opt.beta = 1e-6;
  opt.growth = ovq::Growth::linear(1.0);
  opt.value_update = ovq::ValueUpdate::delta;
  const ovq::OvqAttention<S> m(opt);
  auto state = m.make_state(dk, dv);
  const Mat<S> o = m.forward(state, q, k, v);
  CHECK(all_finite(o));
  REQUIRE(state.dictionary().size() == 2);
  const Mat<S> rows = ovq::as_eigen(state.dictionary().values());
  CHECK(all_finite(rows));
  // Row 0 was pushed past the largest value and held there.
  CHECK(rows(0, 0) == std::numeric_limits<S>::max());
  check_counts(state);
}

TEMPLATE_TEST_CASE("extremes: OVQ with capacity 1 keeps the mean of everything", "[extremes][ovq]",
                   float, double) {
  using S = TestType;
  const Index chunk = 4, t = 6 * chunk + 2;
  const Mat<S> q = ovq::test::random_unit_rows<S>(t, kDk, 91);
  const Mat<S> k = ovq::test::random_unit_rows<S>(t, kDk, 92);
  const Mat<S> v = ovq::test::random_matrix<S>(t, kDv, 93);
  for (const auto growth : {ovq::Growth::dirichlet(), ovq::Growth::linear(1.0)}) {
    ovq::OvqOptions opt;
    opt.capacity = 1;
    opt.chunk = chunk;
    opt.growth = growth;
    const ovq::OvqAttention<S> m(opt);
    auto state = m.make_state(kDk, kDv);
    const Mat<S> o = m.forward(state, q, k, v);
    CHECK(all_finite(o));
    REQUIRE(state.dictionary().size() == 1);
    CHECK(state.dictionary().count(0) == 6 * chunk);
    check_counts(state);
    const Index absorbed = 6 * chunk;
    const MatD mean_k = k.topRows(absorbed).template cast<double>().colwise().mean();
    const MatD mean_v = v.topRows(absorbed).template cast<double>().colwise().mean();
    CHECK(scaled_diff(ovq::as_eigen(state.dictionary().keys()), mean_k, 1.0) <= 10 * tol<S>());
    CHECK(scaled_diff(ovq::as_eigen(state.dictionary().values()), mean_v, 1.0) <= 10 * tol<S>());
    const MatD want = ovq::ref::ovq_attention(q.template cast<double>(), k.template cast<double>(),
                                              v.template cast<double>(), opt);
    CHECK(ovq::test::relative_error(o, want) <= 10 * ovq::test::tolerance<S>());
  }
}

TEMPLATE_TEST_CASE("extremes: OVQ with chunk 1 writes every token at once", "[extremes][ovq]",
                   float, double) {
  using S = TestType;
  const Index t = 30;
  const Mat<S> q = ovq::test::random_unit_rows<S>(t, kDk, 101);
  const Mat<S> k = ovq::test::random_unit_rows<S>(t, kDk, 102);
  const Mat<S> v = ovq::test::random_matrix<S>(t, kDv, 103);
  for (const Index capacity : {Index(1), Index(4), Index(64)}) {
    CAPTURE(capacity);
    ovq::OvqOptions opt;
    opt.capacity = capacity;
    opt.chunk = 1;
    const ovq::OvqAttention<S> m(opt);
    auto state = m.make_state(kDk, kDv);
    Mat<S> o(t, kDv);
    for (Index i = 0; i < t; ++i) {
      o.row(i) = m.step(state, q.row(i), k.row(i), v.row(i));
      CHECK(state.pending() == 0);
      CHECK(state.absorbed() == i + 1);
      CHECK(state.dictionary().total_count() == i + 1);
    }
    CHECK(all_finite(o));
    check_counts(state);
    CHECK(state.dictionary().size() <= std::min<Index>(capacity, t));
    // The first token reads only itself.
    CHECK(scaled_diff(o.row(0), v.row(0), 1.0) <= tol<S>());
    auto whole = m.make_state(kDk, kDv);
    CHECK(ovq::test::relative_error(m.forward(whole, q, k, v), o) <= ovq::test::tolerance<S>());
    CHECK(whole == state);
    const MatD want = ovq::ref::ovq_attention(q.template cast<double>(), k.template cast<double>(),
                                              v.template cast<double>(), opt);
    CHECK(ovq::test::relative_error(o, want) <= 10 * ovq::test::tolerance<S>());
  }
}

}  // namespace

}  // namespace ovq_test_extremes
