// Partial results for sequence parallelism: each query's log-sum-exp (forward(..., lse)),
// merge_partials, and LinearAttention::chain.
//
// lse_i = log sum_j exp(s_ij) over the logits query i saw: s_ij = beta q_i . k_j for the keys of
// self-attention, and beta q_i . D_k[r] + log c_r for a dictionary's rows. Checked against that
// formula in double, across cuts of the stream (the same bits), through the multi-head layer, and
// by merging the reads of two halves of the keys into the read of all of them.
#include <cmath>
#include <limits>
#include <utility>
#include <vector>

#include "support/catch.hpp"
#include "support/fixtures.hpp"

namespace ovq_test_partials {

namespace {

using namespace ovq;
using ovq::test::random_matrix;
using ovq::test::random_unit_rows;
using ovq::test::relative_error;

// log sum_j exp(x_j), in double, from the largest term.
double log_sum_exp(const std::vector<double>& x) {
  double m = -std::numeric_limits<double>::infinity();
  for (double v : x) m = std::max(m, v);
  if (m == -std::numeric_limits<double>::infinity()) return m;
  double s = 0.0;
  for (double v : x) s += std::exp(v - m);
  return m + std::log(s);
}

// Causal self-attention's lse of query i over keys [0, i] (window W: (i - W, i]).
RowVector<double> causal_lse(const RowMatrix<double>& q, const RowMatrix<double>& k, double beta,
                             Index window = 0) {
  RowVector<double> out(q.rows());
  for (Index i = 0; i < q.rows(); ++i) {
    std::vector<double> s;
    for (Index j = window > 0 ? std::max<Index>(0, i - window + 1) : 0; j <= i; ++j)
      s.push_back(beta * q.row(i).dot(k.row(j)));
    out(i) = log_sum_exp(s);
  }
  return out;
}

// A dictionary mixer's lse for one chunk of queries read right after the dictionary `dict`
// (bias log count) and the chunk's own rows causally.
template <class S>
RowVector<double> dictionary_lse(const Dictionary<S>& dict, const RowMatrix<double>& q,
                                 const RowMatrix<double>& chunk_keys, double beta) {
  RowVector<double> out(q.rows());
  for (Index i = 0; i < q.rows(); ++i) {
    std::vector<double> s;
    for (Index r = 0; r < dict.size(); ++r) {
      if (dict.count(r) == 0) continue;
      double dot = 0.0;
      for (Index c = 0; c < dict.key_dim(); ++c)
        dot += q(i, c) * static_cast<double>(dict.keys().row(r)[c]);
      s.push_back(beta * dot + std::log(static_cast<double>(dict.count(r))));
    }
    for (Index j = 0; j <= i; ++j) s.push_back(beta * q.row(i).dot(chunk_keys.row(j)));
    out(i) = log_sum_exp(s);
  }
  return out;
}

template <class S>
double max_abs_diff(const RowVector<S>& a, const RowVector<double>& b) {
  double worst = 0.0;
  for (Index i = 0; i < a.size(); ++i)
    worst = std::max(worst, std::abs(static_cast<double>(a(i)) - b(i)));
  return worst;
}

template <class S>
constexpr double lse_tolerance() {
  return std::is_same_v<S, float> ? 2e-5 : 1e-12;
}

}  // namespace

TEMPLATE_TEST_CASE("lse: self-attention's equals log sum exp of its logits", "[lse]", float,
                   double) {
  using S = TestType;
  const Index t = 300, dk = 24, dv = 16;
  const double beta = 0.4;
  const RowMatrix<double> q = random_matrix(t, dk, 1), k = random_matrix(t, dk, 2);
  const RowMatrix<double> v = random_matrix(t, dv, 3);
  for (const Index window : {Index(0), Index(37)}) {
    SelfAttentionOptions opt;
    opt.beta = beta;
    opt.window = window;
    opt.chunk = 64;
    const SelfAttention<S> mixer(opt);
    auto state = mixer.make_state(dk, dv);
    RowMatrix<S> o(t, dv);
    RowVector<compute_t<S>> lse(t);
    mixer.forward(state, q.cast<S>(), k.cast<S>(), v.cast<S>(), o, lse);
    INFO("window " << window);
    CHECK(max_abs_diff(lse, causal_lse(q.cast<S>().template cast<double>(),
                                       k.cast<S>().template cast<double>(), beta, window)) <=
          lse_tolerance<S>() * 10);
    // The outputs are those of the call without lse, bit for bit.
    auto plain = mixer.make_state(dk, dv);
    CHECK(mixer.forward(plain, q.cast<S>(), k.cast<S>(), v.cast<S>()) == o);
  }
}

TEMPLATE_TEST_CASE("lse: VQ and OVQ read the dictionary with its bias log c", "[lse]", float,
                   double) {
  using S = TestType;
  const Index dk = 16, dv = 8, chunk = 32;
  const double beta = 0.7;
  const RowMatrix<S> k = random_unit_rows<S>(5 * chunk, dk, 11);
  const RowMatrix<S> v = random_matrix<S>(5 * chunk, dv, 12);
  const RowMatrix<S> q = random_matrix<S>(chunk, dk, 13);
  const RowMatrix<S> k_last = random_unit_rows<S>(chunk, dk, 14);
  const RowMatrix<S> v_last = random_matrix<S>(chunk, dv, 15);
  RowVector<compute_t<S>> lse(chunk);
  RowMatrix<S> o(chunk, dv);

  SECTION("OVQ") {
    OvqOptions opt;
    opt.capacity = 24;
    opt.chunk = chunk;
    opt.beta = beta;
    const OvqAttention<S> mixer(opt);
    auto state = mixer.make_state(dk, dv);
    mixer.absorb(state, k, v);
    const Dictionary<S> before = state.dictionary();
    REQUIRE(before.size() > 0);
    mixer.forward(state, q, k_last, v_last, o, lse);
    CHECK(max_abs_diff(lse, dictionary_lse(before, q.template cast<double>(),
                                           k_last.template cast<double>(), beta)) <=
          lse_tolerance<S>() * 10);
  }
  SECTION("VQ") {
    VqAttentionOptions opt;
    opt.chunk = chunk;
    opt.beta = beta;
    const VqAttention<S> mixer(opt);
    auto state = mixer.make_state(random_unit_rows<S>(12, dk, 16), dv);
    mixer.absorb(state, k, v);
    const Dictionary<S> before = state.dictionary();
    mixer.forward(state, q, k_last, v_last, o, lse);
    // VQ's local rows are the chunk keys' codewords.
    RowMatrix<double> codes(chunk, dk);
    for (Index i = 0; i < chunk; ++i)
      for (Index c = 0; c < dk; ++c)
        codes(i, c) = static_cast<double>(state.pending_keys().row(i)[c]);
    CHECK(max_abs_diff(lse, dictionary_lse(before, q.template cast<double>(), codes, beta)) <=
          lse_tolerance<S>() * 10);
  }
}

TEST_CASE("lse: the same bits however the stream is cut, and through the multi-head layer",
          "[lse]") {
  using S = float;
  const Index t = 200, dk = 16, dv = 12;
  const RowMatrix<S> q = random_matrix<S>(t, dk, 21), k = random_unit_rows<S>(t, dk, 22);
  const RowMatrix<S> v = random_matrix<S>(t, dv, 23);
  OvqOptions opt;
  opt.capacity = 32;
  opt.chunk = 16;
  const OvqAttention<S> mixer(opt);

  auto whole = mixer.make_state(dk, dv);
  RowMatrix<S> o_whole(t, dv);
  RowVector<float> lse_whole(t);
  mixer.forward(whole, q, k, v, o_whole, lse_whole);

  auto cut = mixer.make_state(dk, dv);
  RowMatrix<S> o_cut(t, dv);
  RowVector<float> lse_cut(t);
  for (Index pos = 0, len = 7; pos < t; pos += len, len = len % 23 + 5) {
    const Index n = std::min(len, t - pos);
    RowMatrix<S> o_part(n, dv);
    RowVector<float> lse_part(n);
    mixer.forward(cut, q.middleRows(pos, n), k.middleRows(pos, n), v.middleRows(pos, n), o_part,
                  lse_part);
    o_cut.middleRows(pos, n) = o_part;
    lse_cut.segment(pos, n) = lse_part;
  }
  CHECK(o_cut == o_whole);
  CHECK(lse_cut == lse_whole);

  // Two query heads on one key/value head: each query head's lse is the single-head one.
  MultiHead<OvqAttention<S>> layer(mixer, 1, 2, 1, dk, dv);
  RowMatrix<S> q2(2 * t, dk);
  q2 << q, q.colwise().reverse();
  RowMatrix<S> o2(2 * t, dv);
  RowVector<float> lse2(2 * t);
  layer.forward(q2, k, v, o2, lse2);
  CHECK(lse2.head(t) == lse_whole);
  auto other = mixer.make_state(dk, dv);
  RowMatrix<S> o_rev(t, dv);
  RowVector<float> lse_rev(t);
  mixer.forward(other, q.colwise().reverse(), k, v, o_rev, lse_rev);
  CHECK((lse2.tail(t) - lse_rev).cwiseAbs().maxCoeff() == 0.0f);
  CHECK(o2.bottomRows(t) == o_rev);
}

TEMPLATE_TEST_CASE("merge_partials: two halves of the keys merge into the read of all of them",
                   "[lse]", float, double) {
  using S = TestType;
  using C = compute_t<S>;
  const Index half = 96, dk = 20, dv = 10;
  const RowMatrix<S> q = random_matrix<S>(2 * half, dk, 31, 0.5);
  const RowMatrix<S> k = random_matrix<S>(2 * half, dk, 32);
  const RowMatrix<S> v = random_matrix<S>(2 * half, dv, 33);

  // One process: causal attention over all 2 * half tokens.
  const SelfAttention<S> causal;
  auto full_state = causal.make_state(dk, dv);
  RowMatrix<S> o_full(2 * half, dv);
  RowVector<C> lse_full(2 * half);
  causal.forward(full_state, q, k, v, o_full, lse_full);

  // The second half's queries: every key of the first half (non-causal), then their own keys
  // causally; merged.
  SelfAttentionOptions all_visible;
  all_visible.causal = false;
  const SelfAttention<S> noncausal(all_visible);
  auto first_keys = noncausal.make_state(dk, dv);
  RowMatrix<S> o_a(half, dv);
  RowVector<C> lse_a(half);
  noncausal.forward(first_keys, q.bottomRows(half), k.topRows(half), v.topRows(half), o_a, lse_a);
  auto own_keys = causal.make_state(dk, dv);
  RowMatrix<S> o_b(half, dv);
  RowVector<C> lse_b(half);
  causal.forward(own_keys, q.bottomRows(half), k.bottomRows(half), v.bottomRows(half), o_b, lse_b);

  merge_partials(rows_view(o_a), lse_a.data(), rows_view(std::as_const(o_b)), lse_b.data());
  CHECK(relative_error(o_a, o_full.bottomRows(half)) <= ovq::test::tolerance<S>());
  CHECK(max_abs_diff(lse_a, lse_full.tail(half).template cast<double>()) <=
        lse_tolerance<S>() * 10);

  SECTION("a side that saw nothing (-inf) is dropped") {
    RowMatrix<S> o = o_b;
    RowVector<C> lse = lse_b;
    RowMatrix<S> empty = RowMatrix<S>::Constant(half, dv, S(7));
    RowVector<C> none = RowVector<C>::Constant(half, -std::numeric_limits<C>::infinity());
    merge_partials(rows_view(o), lse.data(), rows_view(std::as_const(empty)), none.data());
    CHECK(o == o_b);
    CHECK(lse == lse_b);
  }
  SECTION("bad input: mismatched shapes and NaN, nothing written") {
    RowMatrix<S> o = o_b;
    RowVector<C> lse = lse_b;
    const RowMatrix<S> narrow_rows(half, dv - 1);
    CHECK_THROWS_AS(merge_partials(rows_view(o), lse.data(), rows_view(narrow_rows), lse_b.data()),
                    ArgumentError);
    RowVector<C> bad = lse_b;
    bad(3) = std::numeric_limits<C>::quiet_NaN();
    CHECK_THROWS_AS(merge_partials(rows_view(o), lse.data(), rows_view(std::as_const(o_a)), bad.data()),
                    ArgumentError);
    CHECK(o == o_b);
    CHECK(lse == lse_b);
  }
}

TEMPLATE_TEST_CASE("chain: shards summarised apart and chained equal one run", "[lse][linear]",
                   float, double) {
  using S = TestType;
  const Index dk = 12, dv = 9, chunk = 16;
  const Index shard[] = {3 * chunk, 2 * chunk, 37};  // the last one ends inside a chunk
  const Index t = shard[0] + shard[1] + shard[2];
  const RowMatrix<S> q = random_matrix<S>(t, dk, 51, 0.3), k = random_matrix<S>(t, dk, 52, 0.3);
  const RowMatrix<S> v = random_matrix<S>(t, dv, 53);
  LinearAttentionOptions opt;
  opt.chunk = chunk;
  opt.decay = 0.97;
  opt.normalize = true;
  opt.feature_map = FeatureMap::elu1;
  const LinearAttention<S> mixer(opt);

  auto one_run = mixer.make_state(dk, dv);
  const RowMatrix<S> o_one = mixer.forward(one_run, q, k, v);

  // Each shard summarised from an empty state, then the prefixes chained in order; each shard's
  // outputs from its prefix.
  auto prefix = mixer.make_state(dk, dv);
  RowMatrix<S> o_parallel(t, dv);
  for (Index r = 0, pos = 0; r < 3; pos += shard[r], ++r) {
    auto summary = mixer.make_state(dk, dv);
    mixer.absorb(summary, k.middleRows(pos, shard[r]), v.middleRows(pos, shard[r]));
    auto from_prefix = prefix;
    o_parallel.middleRows(pos, shard[r]) = mixer.forward(
        from_prefix, q.middleRows(pos, shard[r]), k.middleRows(pos, shard[r]),
        v.middleRows(pos, shard[r]));
    prefix = mixer.chain(prefix, summary);
  }
  CHECK(prefix.tokens() == one_run.tokens());
  CHECK(prefix.pending() == one_run.pending());
  CHECK(relative_error(prefix.kv(), one_run.kv()) <= ovq::test::tolerance<S>());
  CHECK(relative_error(prefix.k_sum(), one_run.k_sum()) <= ovq::test::tolerance<S>());
  CHECK(relative_error(o_parallel, o_one) <= ovq::test::tolerance<S>());

  SECTION("a prefix with pending rows is refused") {
    auto part = mixer.make_state(dk, dv);
    mixer.absorb(part, k.topRows(5), v.topRows(5));
    CHECK_THROWS_AS(mixer.chain(part, one_run), ArgumentError);
  }
}

TEST_CASE("lse: linear attention has none and says so", "[lse][errors]") {
  const LinearAttention<float> mixer;
  auto state = mixer.make_state(4, 4);
  const RowMatrix<float> x = random_matrix<float>(3, 4, 41);
  RowMatrix<float> o(3, 4);
  RowVector<float> lse(3);
  CHECK_THROWS_AS(mixer.forward(state, x, x, x, o, lse), ArgumentError);
  CHECK(state.tokens() == 0);
  const SelfAttention<float> self;
  auto cache = self.make_state(4, 4);
  RowVector<float> short_lse(2);
  CHECK_THROWS_AS(self.forward(cache, x, x, x, o, short_lse), ArgumentError);
  CHECK(cache.tokens() == 0);
}

}  // namespace ovq_test_partials
