// The four single-head mixers against the double-precision references of MATH.md, and the
// identities the contract promises: streaming == chunked == uneven pieces, OVQ (linear growth,
// rate 1, N >= T) == causal self-attention, VQ == self-attention over quantised keys, linear
// attention chunked == its recurrence, and the state snapshot / reset / bytes behaviour.
//
// Inputs are seeded (tests/support/fixtures.hpp), so every run sees the same numbers. Float
// runs get float inputs; the reference then runs on exactly those values, widened to double.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "support/catch.hpp"
#include "support/emulated_avx512.hpp"
#include "support/fixtures.hpp"
#include "support/matchers.hpp"

// Everything below lives in this file's own namespace, so the suite can be built as one
// unity source without the files' helpers colliding.
namespace ovq_test_mixers {

namespace {

using namespace ovq;
using ovq::test::random_matrix;
using ovq::test::random_unit_rows;
using ovq::test::relative_error;
using ovq::test::tolerance;
using ovq::test::MessageHas;
using DMat = RowMatrix<double>;

// ---------------------------------------------------------------------------------------------
// Inputs
// ---------------------------------------------------------------------------------------------

// Q, K, V in Scalar, and the same values in double for the references.
template <class S>
struct Qkv {
  RowMatrix<S> q, k, v;
  DMat qd, kd, vd;
};

template <class S>
Qkv<S> make_qkv(const DMat& q, const DMat& k, const DMat& v) {
  Qkv<S> x;
  x.q = q.cast<S>();
  x.k = k.cast<S>();
  x.v = v.cast<S>();
  x.qd = x.q.template cast<double>();
  x.kd = x.k.template cast<double>();
  x.vd = x.v.template cast<double>();
  return x;
}

template <class S>
Qkv<S> gaussian_qkv(Index t, Index dk, Index dv, std::uint64_t seed, double qk_scale = 1.0) {
  return make_qkv<S>(random_matrix(t, dk, seed, qk_scale), random_matrix(t, dk, seed + 1, qk_scale),
                     random_matrix(t, dv, seed + 2));
}

// Unit-norm queries and keys (what VQ / OVQ assume), Gaussian values.
template <class S>
Qkv<S> unit_qkv(Index t, Index dk, Index dv, std::uint64_t seed) {
  return make_qkv<S>(random_unit_rows(t, dk, seed), random_unit_rows(t, dk, seed + 1),
                     random_matrix(t, dv, seed + 2));
}

// Piece lengths 1, 7, L - 1, L + 3, then the rest, cut to T (no empty pieces).
std::vector<Index> uneven_pieces(Index t, Index l) {
  std::vector<Index> pieces;
  Index left = t;
  for (Index p : {Index(1), Index(7), l - 1, l + 3}) {
    const Index take = std::min(std::max<Index>(p, 1), left);
    if (take > 0) pieces.push_back(take);
    left -= take;
  }
  if (left > 0) pieces.push_back(left);
  return pieces;
}

// ---------------------------------------------------------------------------------------------
// Running a mixer three ways
// ---------------------------------------------------------------------------------------------

template <class Mixer>
struct Run {
  RowMatrix<typename Mixer::scalar_type> o;
  typename Mixer::State state;
};

template <class Mixer, class S = typename Mixer::scalar_type>
Run<Mixer> run_whole(const Mixer& mixer, typename Mixer::State state, const RowMatrix<S>& q,
                     const RowMatrix<S>& k, const RowMatrix<S>& v) {
  Run<Mixer> r{RowMatrix<S>(q.rows(), v.cols()), std::move(state)};
  mixer.forward(r.state, q, k, v, r.o);
  return r;
}

template <class Mixer, class S = typename Mixer::scalar_type>
Run<Mixer> run_steps(const Mixer& mixer, typename Mixer::State state, const RowMatrix<S>& q,
                     const RowMatrix<S>& k, const RowMatrix<S>& v) {
  Run<Mixer> r{RowMatrix<S>(q.rows(), v.cols()), std::move(state)};
  for (Index i = 0; i < q.rows(); ++i) mixer.step(r.state, q.row(i), k.row(i), v.row(i), r.o.row(i));
  return r;
}

template <class Mixer, class S = typename Mixer::scalar_type>
Run<Mixer> run_pieces(const Mixer& mixer, typename Mixer::State state, const RowMatrix<S>& q,
                      const RowMatrix<S>& k, const RowMatrix<S>& v,
                      const std::vector<Index>& pieces) {
  Run<Mixer> r{RowMatrix<S>(q.rows(), v.cols()), std::move(state)};
  Index pos = 0;
  for (Index p : pieces) {
    mixer.forward(r.state, q.middleRows(pos, p), k.middleRows(pos, p), v.middleRows(pos, p),
                  r.o.middleRows(pos, p));
    pos += p;
  }
  REQUIRE(pos == q.rows());
  return r;
}

// ---------------------------------------------------------------------------------------------
// State comparisons
// ---------------------------------------------------------------------------------------------

// Bitwise: a KV cache only ever holds copies of the input rows.
template <class S>
void check_same_state(const KvCache<S>& a, const KvCache<S>& b, double) {
  CHECK(a.size() == b.size());
  CHECK(a.tokens() == b.tokens());
  CHECK(a == b);
}

// Bitwise: (S, z) only ever absorb complete chunks at fixed stream positions, by the same code
// on the same rows; the pending rows are copies of the inputs.
template <class S>
void check_same_state(const LinearState<S>& a, const LinearState<S>& b, double) {
  CHECK(a.tokens() == b.tokens());
  CHECK(a.absorbed() == b.absorbed());
  CHECK(a.pending() == b.pending());
  CHECK((a.kv() == b.kv()));
  CHECK((a.k_sum() == b.k_sum()));
  CHECK(a == b);
}

// Bitwise, like OVQ: counts and means only ever absorb complete chunks; the pending rows are
// their codes and copies of the input values.
template <class S>
void check_same_state(const VqState<S>& a, const VqState<S>& b, double) {
  const Dictionary<S>& da = a.dictionary();
  const Dictionary<S>& db = b.dictionary();
  REQUIRE(da.size() == db.size());
  for (Index r = 0; r < da.size(); ++r) {
    INFO("code " << r);
    CHECK(da.count(r) == db.count(r));
  }
  CHECK(a.tokens() == b.tokens());
  CHECK(a.pending() == b.pending());
  CHECK((as_eigen(da.keys()) == as_eigen(db.keys())));
  CHECK((as_eigen(da.values()) == as_eigen(db.values())));
  CHECK(a == b);
}

// Bitwise: the dictionary write only sees complete chunks of the pending buffer (copies of the
// input rows) and the dictionary itself, never the reads, so however the tokens were fed, every
// write runs the same kernel on the same numbers.
template <class S>
void check_same_state(const OvqState<S>& a, const OvqState<S>& b, double) {
  const Dictionary<S>& da = a.dictionary();
  const Dictionary<S>& db = b.dictionary();
  CHECK(a.absorbed() == b.absorbed());
  CHECK(a.pending() == b.pending());
  REQUIRE(da.size() == db.size());
  for (Index r = 0; r < da.size(); ++r) {
    INFO("centroid " << r);
    CHECK(da.count(r) == db.count(r));
  }
  CHECK((as_eigen(da.keys()) == as_eigen(db.keys())));
  CHECK((as_eigen(da.values()) == as_eigen(db.values())));
  CHECK((as_eigen(a.pending_keys()) == as_eigen(b.pending_keys())));
  CHECK((as_eigen(a.pending_values()) == as_eigen(b.pending_values())));
  CHECK(a == b);
}

// An OVQ state against the reference's: n and the counts exactly, D_k / D_v to tolerance,
// t exactly, the pending rows exactly (copies of the inputs).
template <class S>
void check_against_ref(const OvqState<S>& st, const ref::OvqRefState& r, double tol) {
  const Dictionary<S>& d = st.dictionary();
  CHECK(st.absorbed() == r.t);
  CHECK(st.pending() == r.pending_k.rows());
  REQUIRE(d.size() == r.size());
  std::int64_t total = 0;
  for (Index i = 0; i < d.size(); ++i) {
    INFO("centroid " << i);
    CHECK(d.count(i) == r.count[static_cast<std::size_t>(i)]);
    total += r.count[static_cast<std::size_t>(i)];
  }
  CHECK(d.total_count() == total);
  CHECK(total == r.t);  // every absorbed token is counted once
  if (d.size() > 0) {
    CHECK(relative_error(as_eigen(d.keys()), r.dk) <= tol);
    CHECK(relative_error(as_eigen(d.values()), r.dv) <= tol);
  }
  if (st.pending() == r.pending_k.rows() && st.pending() > 0) {
    CHECK((as_eigen(st.pending_keys()).template cast<double>() == r.pending_k));
    CHECK((as_eigen(st.pending_values()).template cast<double>() == r.pending_v));
  }
}

std::string growth_name(const Growth& g) {
  if (g.kind == Growth::Kind::linear) return "linear(" + std::to_string(g.rate) + ")";
  if (g.kind == Growth::Kind::saturating) return "saturating";
  return "dirichlet(" + std::to_string(g.alpha) + ")";
}

// ---------------------------------------------------------------------------------------------
// Self-attention
// ---------------------------------------------------------------------------------------------

struct Shape {
  Index t, dk, dv;
};

template <class S>
void self_attention_against_reference() {
  const double tol = tolerance<S>();
  const Shape shapes[] = {{1, 8, 5}, {7, 6, 11}, {50, 8, 3}, {129, 5, 7}, {300, 8, 6}};
  std::uint64_t seed = 100;
  for (const Shape& sh : shapes) {
    const double beta = 1.0 / std::sqrt(static_cast<double>(sh.dk));
    const Qkv<S> x = gaussian_qkv<S>(sh.t, sh.dk, sh.dv, seed += 10);
    CAPTURE(sh.t, sh.dk, sh.dv);

    // Causal, unbounded, several chunk lengths (chunk < T, = T, > T).
    const DMat want = ref::self_attention(x.qd, x.kd, x.vd, beta, true, 0);
    for (Index chunk : {Index(1), Index(16), Index(37), Index(256)}) {
      CAPTURE(chunk);
      SelfAttentionOptions opt;
      opt.beta = beta;
      opt.chunk = chunk;
      SelfAttention<S> mixer(opt);
      auto st = mixer.make_state(sh.dk, sh.dv);
      const RowMatrix<S> o = mixer.forward(st, x.q, x.k, x.v);
      CHECK(relative_error(o, want) <= tol);
      CHECK(st.tokens() == sh.t);
      CHECK(st.size() == sh.t);
    }

    // Sliding windows, including W = 1 (a token sees only itself) and W > T (= causal).
    for (Index w : {Index(1), Index(2), Index(5), Index(16), sh.t + 3}) {
      CAPTURE(w);
      const DMat want_w = ref::self_attention(x.qd, x.kd, x.vd, beta, true, w);
      for (Index chunk : {Index(3), Index(64)}) {
        CAPTURE(chunk);
        SelfAttentionOptions opt;
        opt.beta = beta;
        opt.window = w;
        opt.chunk = chunk;
        SelfAttention<S> mixer(opt);
        auto st = mixer.make_state(sh.dk, sh.dv);
        const RowMatrix<S> o = mixer.forward(st, x.q, x.k, x.v);
        CHECK(relative_error(o, want_w) <= tol);
        CHECK(st.size() == std::min(sh.t, w - 1));  // the cache keeps the last W - 1 rows
        CHECK(st.tokens() == sh.t);
      }
      if (w == 1) {  // W = 1: every output row is its own value row
        CHECK(relative_error(want_w, x.vd) <= 1e-15);
      }
    }

    // Non-causal (one call).
    {
      const DMat want_nc = ref::self_attention(x.qd, x.kd, x.vd, beta, false, 0);
      SelfAttentionOptions opt;
      opt.beta = beta;
      opt.causal = false;
      opt.chunk = 4;  // must not split the call: every query sees every key
      SelfAttention<S> mixer(opt);
      auto st = mixer.make_state(sh.dk, sh.dv);
      const RowMatrix<S> o = mixer.forward(st, x.q, x.k, x.v);
      CHECK(relative_error(o, want_nc) <= tol);
      if (sh.t > 1) CHECK(relative_error(want_nc, want) > 1e-3);  // it is not the causal result
    }
  }
}

TEST_CASE("self-attention matches the reference (causal, windows, non-causal), double",
          "[self][reference]") {
  self_attention_against_reference<double>();
}

TEST_CASE("self-attention matches the reference (causal, windows, non-causal), float",
          "[self][reference][precision]") {
  self_attention_against_reference<float>();
}

TEST_CASE("self-attention does not depend on its chunk option", "[self]") {
  const Index t = 150, dk = 7, dv = 4;
  const Qkv<double> x = gaussian_qkv<double>(t, dk, dv, 7);
  for (Index w : {Index(0), Index(1), Index(9)}) {
    CAPTURE(w);
    SelfAttentionOptions base;
    base.beta = 0.6;
    base.window = w;
    base.chunk = t;
    SelfAttention<double> one(base);
    const Run<SelfAttention<double>> whole = run_whole(one, one.make_state(dk, dv), x.q, x.k, x.v);
    for (Index chunk : {Index(1), Index(2), Index(5), Index(32), Index(149), Index(1000)}) {
      CAPTURE(chunk);
      SelfAttentionOptions opt = base;
      opt.chunk = chunk;
      SelfAttention<double> mixer(opt);
      const Run<SelfAttention<double>> r = run_whole(mixer, mixer.make_state(dk, dv), x.q, x.k, x.v);
      CHECK(relative_error(r.o, whole.o) <= tolerance<double>());
      check_same_state(r.state, whole.state, 0.0);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Linear attention
// ---------------------------------------------------------------------------------------------

template <class S>
void linear_attention_against_reference() {
  const double tol = tolerance<S>();
  const Shape shapes[] = {{1, 5, 3}, {7, 6, 4}, {50, 8, 5}, {203, 6, 9}};
  std::uint64_t seed = 300;
  for (const Shape& sh : shapes) {
    CAPTURE(sh.t, sh.dk, sh.dv);
    for (FeatureMap map : {FeatureMap::identity, FeatureMap::elu1, FeatureMap::relu}) {
      for (bool normalize : {false, true}) {
        for (double decay : {1.0, 0.9}) {
          CAPTURE(static_cast<int>(map), normalize, decay);
          // A normalised identity map divides by q . z, which crosses zero for zero-mean inputs:
          // shift the queries and keys to keep that denominator away from 0.
          Qkv<S> x = gaussian_qkv<S>(sh.t, sh.dk, sh.dv, seed += 10);
          if (normalize && map == FeatureMap::identity) {
            x = make_qkv<S>((x.qd.array() * 0.3 + 1.0).matrix(), (x.kd.array() * 0.3 + 1.0).matrix(),
                            x.vd);
          }
          LinearAttentionOptions opt;
          opt.beta = 0.7;
          opt.feature_map = map;
          opt.normalize = normalize;
          opt.decay = decay;
          ref::LinearRefState ref_state;
          const DMat want = ref::linear_attention(x.qd, x.kd, x.vd, opt, &ref_state);
          // Chunk lengths 1, 3, 16, 64 and T: chunked == the recurrence.
          for (Index chunk : {Index(1), Index(3), Index(16), Index(64), sh.t}) {
            CAPTURE(chunk);
            opt.chunk = chunk;
            LinearAttention<S> mixer(opt);
            auto st = mixer.make_state(sh.dk, sh.dv);
            const RowMatrix<S> o = mixer.forward(st, x.q, x.k, x.v);
            CHECK(relative_error(o, want) <= tol);
            // The state keeps the last, incomplete chunk apart; sums() folds it in.
            const auto sums = mixer.sums(st);
            CHECK(relative_error(sums.kv, ref_state.s) <= tol);
            CHECK(relative_error(sums.k_sum, ref_state.z.transpose()) <= tol);
            CHECK(st.tokens() == sh.t);
            CHECK(st.pending() == sh.t % chunk);
            CHECK(st.absorbed() == sh.t - sh.t % chunk);
          }
        }
      }
    }
  }
}

TEST_CASE("linear attention chunked equals its recurrence, every feature map, double",
          "[linear][reference]") {
  linear_attention_against_reference<double>();
}

TEST_CASE("linear attention chunked equals its recurrence, every feature map, float",
          "[linear][reference][precision]") {
  linear_attention_against_reference<float>();
}

TEST_CASE("linear attention: normalised output does not depend on beta", "[linear]") {
  const Qkv<double> x = gaussian_qkv<double>(40, 6, 5, 31);
  LinearAttentionOptions opt;
  opt.feature_map = FeatureMap::elu1;
  opt.normalize = true;
  opt.decay = 0.95;
  opt.chunk = 16;
  opt.beta = 1.0;
  LinearAttention<double> a(opt);
  opt.beta = 3.5;
  LinearAttention<double> b(opt);
  auto sa = a.make_state(6, 5);
  auto sb = b.make_state(6, 5);
  CHECK(relative_error(a.forward(sa, x.q, x.k, x.v), b.forward(sb, x.q, x.k, x.v)) <= 1e-14);
}

// ---------------------------------------------------------------------------------------------
// VQ-attention
// ---------------------------------------------------------------------------------------------

template <class S>
void vq_attention_against_reference() {
  const double tol = tolerance<S>();
  const Shape shapes[] = {{1, 6, 4}, {9, 8, 5}, {70, 8, 3}, {300, 5, 7}};
  std::uint64_t seed = 500;
  for (const Shape& sh : shapes) {
    CAPTURE(sh.t, sh.dk, sh.dv);
    for (Index codes : {Index(1), Index(3), Index(16)}) {
      CAPTURE(codes);
      const Qkv<S> x = gaussian_qkv<S>(sh.t, sh.dk, sh.dv, seed += 10);
      const RowMatrix<S> codebook = random_matrix<S>(codes, sh.dk, seed + 5);
      const DMat codebook_d = codebook.template cast<double>();
      const double beta = 0.5;
      const DMat want = ref::vq_attention(x.qd, x.kd, x.vd, codebook_d, beta);
      const std::vector<Index> z = ref::quantise(x.kd, codebook_d);
      for (Index chunk : {Index(1), Index(5), Index(64), sh.t}) {
        CAPTURE(chunk);
        VqAttentionOptions opt;
        opt.beta = beta;
        opt.chunk = chunk;
        VqAttention<S> mixer(opt);
        auto st = mixer.make_state(codebook, sh.dv);
        const RowMatrix<S> o = mixer.forward(st, x.q, x.k, x.v);
        CHECK(relative_error(o, want) <= tol);
        // The state: per code the number of keys of the complete chunks quantised to it and the
        // mean of their values; the last, incomplete chunk pending (codes and values).
        const Index absorbed = sh.t - sh.t % chunk;
        REQUIRE(st.pending() == sh.t % chunk);
        for (Index j = absorbed; j < sh.t; ++j) {
          CAPTURE(j);
          CHECK(st.pending_codes()[j - absorbed] == z[static_cast<std::size_t>(j)]);
          CHECK((as_eigen(st.pending_values()).row(j - absorbed) == x.v.row(j)));
          CHECK((as_eigen(st.pending_keys()).row(j - absorbed) ==
                 codebook.row(z[static_cast<std::size_t>(j)])));
        }
        const Dictionary<S>& d = st.dictionary();
        REQUIRE(d.size() == codes);
        CHECK((as_eigen(d.keys()) == codebook));
        DMat mean = DMat::Zero(codes, sh.dv);
        std::vector<std::int64_t> count(static_cast<std::size_t>(codes), 0);
        for (Index j = 0; j < absorbed; ++j) {
          mean.row(z[static_cast<std::size_t>(j)]) += x.vd.row(j);
          ++count[static_cast<std::size_t>(z[static_cast<std::size_t>(j)])];
        }
        for (Index s = 0; s < codes; ++s) {
          CAPTURE(s);
          CHECK(d.count(s) == count[static_cast<std::size_t>(s)]);
          if (count[static_cast<std::size_t>(s)] > 0) mean.row(s) /= static_cast<double>(count[static_cast<std::size_t>(s)]);
        }
        CHECK(relative_error(as_eigen(d.values()), mean) <= tol);
        CHECK(st.absorbed() == absorbed);
        CHECK(st.tokens() == sh.t);
      }
    }
  }
}

TEST_CASE("VQ-attention matches the reference, any chunk length, double", "[vq][reference]") {
  vq_attention_against_reference<double>();
}

TEST_CASE("VQ-attention matches the reference, any chunk length, float",
          "[vq][reference][precision]") {
  vq_attention_against_reference<float>();
}

TEST_CASE("VQ-attention equals self-attention over the quantised keys", "[vq][self]") {
  const Index dk = 6, dv = 5, codes = 12;
  for (Index t : {Index(1), Index(13), Index(64), Index(257)}) {
    CAPTURE(t);
    const Qkv<double> x = gaussian_qkv<double>(t, dk, dv, 900 + static_cast<std::uint64_t>(t));
    const DMat codebook = random_matrix(codes, dk, 77);
    const DMat khat = ref::quantised_keys(x.kd, codebook);
    SelfAttentionOptions sopt;
    sopt.beta = 0.8;
    SelfAttention<double> self(sopt);
    auto self_state = self.make_state(dk, dv);
    const DMat via_self = self.forward(self_state, x.q, khat, x.v);
    CHECK(relative_error(via_self, ref::self_attention(x.qd, khat, x.vd, 0.8)) <= 1e-12);
    for (Index chunk : {Index(1), Index(5), Index(64), t}) {
      CAPTURE(chunk);
      VqAttentionOptions opt;
      opt.beta = 0.8;
      opt.chunk = chunk;
      VqAttention<double> vq(opt);
      auto st = vq.make_state(codebook, dv);
      CHECK(relative_error(vq.forward(st, x.q, x.k, x.v), via_self) <= tolerance<double>());
    }
  }
}

TEST_CASE("VQ-attention: nearest code by distance, ties to the smallest index", "[vq]") {
  // Codes of very different norms: the nearest by distance is not the largest inner product.
  DMat codebook(3, 2);
  codebook << 10.0, 0.0,  //
      1.0, 0.0,           //
      1.0, 0.0;           // a duplicate of code 1: never chosen (ties go to the smallest index)
  DMat k(2, 2), q(2, 2), v(2, 1);
  k << 1.2, 0.1,  //
      6.0, 0.0;   // 4 from code 0, 5 from code 1
  q << 0.3, 0.2,  //
      -0.1, 0.4;
  v << 1.0, 3.0;
  VqAttention<double> mixer(VqAttentionOptions{1.0, 2});  // one chunk: both keys are counted
  auto st = mixer.make_state(codebook, 1);
  const DMat o = mixer.forward(st, q, k, v);
  CHECK(relative_error(o, ref::vq_attention(q, k, v, codebook, 1.0)) <= 1e-14);
  CHECK(st.dictionary().count(0) == 1);
  CHECK(st.dictionary().count(1) == 1);
  CHECK(st.dictionary().count(2) == 0);
  CHECK(o(0, 0) == Approx(1.0));
}

// ---------------------------------------------------------------------------------------------
// OVQ-attention
// ---------------------------------------------------------------------------------------------

struct OvqShape {
  Index t, dk, dv, chunk, capacity;
};

std::vector<OvqOptions> all_ovq_options(double beta) {
  std::vector<OvqOptions> all;
  const Growth growths[] = {Growth::dirichlet(), Growth::dirichlet(3.0), Growth::linear(1.0),
                            Growth::linear(0.25), Growth::saturating()};
  const Seeding seedings[] = {Seeding::spread(), Seeding::random(12345),
                              Seeding::lowest_similarity()};
  const UpdateRate rates[] = {UpdateRate::adaptive(), UpdateRate::constant(0.3)};
  for (const Growth& g : growths)
    for (const Seeding& s : seedings)
      for (const UpdateRate& r : rates)
        for (bool renorm : {false, true}) {
          OvqOptions opt;
          opt.beta = beta;
          opt.growth = g;
          opt.seeding = s;
          opt.rate = r;
          opt.renormalize = renorm;
          all.push_back(opt);
        }
  // The value and read options of the second reading (docs/math.md, "Two readings of the
  // paper"), over both growth families that reading is compared with.
  for (const Growth& g : {Growth::dirichlet(), Growth::saturating()})
    for (const Seeding& s : seedings)
      for (const UpdateRate& r : rates)
        for (ValueUpdate rule : {ValueUpdate::mean, ValueUpdate::delta})
          for (bool renorm_values : {false, true})
            for (bool bias : {true, false}) {
              if (renorm_values && rule == ValueUpdate::delta) continue;  // refused
              if (rule == ValueUpdate::mean && !renorm_values && bias) continue;  // above
              OvqOptions opt;
              opt.beta = beta;
              opt.growth = g;
              opt.seeding = s;
              opt.rate = r;
              opt.renormalize = true;
              opt.renormalize_values = renorm_values;
              opt.count_bias = bias;
              opt.value_update = rule;
              all.push_back(opt);
            }
  return all;
}

// The presets and the options of the second reading that change the stream's state.
std::vector<std::pair<std::string, OvqOptions>> ovq_readings() {
  OvqOptions no_bias = OvqOptions::kvm_delta();
  no_bias.count_bias = false;
  OvqOptions kvm_no_bias = OvqOptions::kvm();
  kvm_no_bias.count_bias = false;
  return {{"default", OvqOptions::preset("default")},
          {"kvm", OvqOptions::preset("kvm")},
          {"kvm-delta", OvqOptions::preset("kvm-delta")},
          {"kvm, no count bias", kvm_no_bias},
          {"kvm-delta, no count bias", no_bias}};
}

template <class S>
void ovq_against_reference(const std::vector<OvqShape>& shapes, double qk_scale, double beta) {
  const double tol = tolerance<S>();
  std::uint64_t seed = 700;
  for (const OvqShape& sh : shapes) {
    CAPTURE(sh.t, sh.dk, sh.dv, sh.chunk, sh.capacity);
    const Qkv<S> x = gaussian_qkv<S>(sh.t, sh.dk, sh.dv, seed += 10, qk_scale);
    for (OvqOptions opt : all_ovq_options(beta)) {
      opt.chunk = sh.chunk;
      opt.capacity = sh.capacity;
      INFO("growth " << growth_name(opt.growth) << ", seeding "
                     << (opt.seeding.kind == Seeding::Kind::spread   ? "spread"
                         : opt.seeding.kind == Seeding::Kind::random ? "random"
                                                                     : "lowest_similarity")
                     << ", rate "
                     << (opt.rate.kind == UpdateRate::Kind::adaptive ? "adaptive" : "constant")
                     << ", renormalize " << opt.renormalize << ", renormalize_values "
                     << opt.renormalize_values << ", count_bias " << opt.count_bias
                     << ", value_update "
                     << (opt.value_update == ValueUpdate::delta ? "delta" : "mean"));
      ref::OvqRefState ref_state;
      const DMat want = ref::ovq_attention(x.qd, x.kd, x.vd, opt, &ref_state);
      OvqAttention<S> mixer(opt);
      auto st = mixer.make_state(sh.dk, sh.dv);
      const RowMatrix<S> o = mixer.forward(st, x.q, x.k, x.v);
      CHECK(relative_error(o, want) <= tol);
      check_against_ref(st, ref_state, tol);
      CHECK(st.tokens() == sh.t);
      CHECK(st.absorbed() == (sh.t / sh.chunk) * sh.chunk);
      CHECK(st.dictionary().size() <= sh.capacity);
    }
  }
}

TEST_CASE("OVQ-attention matches the reference for every option combination, double",
          "[ovq][reference]") {
  // T = 1; T < L; T not a multiple of L with T >= 4 L and a dictionary that fills up;
  // T = 4 L exactly; a longer stream.
  ovq_against_reference<double>({{1, 6, 4, 4, 8},
                                 {5, 6, 4, 8, 16},
                                 {45, 8, 5, 8, 12},
                                 {64, 5, 9, 16, 64},
                                 {150, 8, 6, 16, 24}},
                                0.5, 1.0);
}

TEST_CASE("OVQ-attention matches the reference for every option combination, float",
          "[ovq][reference][precision]") {
  // Modest T and soft logits, so that no assignment sits close enough to a tie to flip.
  ovq_against_reference<float>(
      {{1, 6, 4, 4, 8}, {5, 6, 4, 8, 16}, {37, 8, 5, 8, 12}, {48, 5, 7, 8, 32}}, 0.5, 1.5);
}

TEST_CASE("OVQ-attention continues a state like the reference does", "[ovq][reference][stream]") {
  // Three calls of uneven lengths, each compared with the reference continued from its state.
  const Index dk = 6, dv = 5;
  OvqOptions opt;
  opt.capacity = 6;
  opt.chunk = 8;
  opt.beta = 2.0;
  OvqAttention<double> mixer(opt);
  auto st = mixer.make_state(dk, dv);
  ref::OvqRefState ref_state;
  std::uint64_t seed = 1300;
  for (Index t : {Index(11), Index(3), Index(42)}) {
    CAPTURE(t);
    const Qkv<double> x = unit_qkv<double>(t, dk, dv, seed += 10);
    const DMat want = ref::ovq_attention(x.qd, x.kd, x.vd, opt, &ref_state);
    CHECK(relative_error(mixer.forward(st, x.q, x.k, x.v), want) <= tolerance<double>());
    check_against_ref(st, ref_state, tolerance<double>());
  }
  CHECK(st.dictionary().size() == 6);  // full (G(56) = 6 for N = 6): the last writes only assigned
}

TEST_CASE("saturating growth: floor(N t / (N + t)), exact for large t, never N", "[ovq]") {
  const Growth g = Growth::saturating();
  for (const Index n : {Index(1), Index(7), Index(2048), Index(1) << 30}) {
    INFO("N = " << n);
    CHECK(g.target(0, n) == 0);
    std::vector<std::int64_t> ts = {1, 2, 63, n, 3 * std::int64_t(n) + 1, std::int64_t(1) << 40,
                                    std::int64_t(1) << 62};
    std::sort(ts.begin(), ts.end());
    Index previous = 0;
    for (const std::int64_t t : ts) {
      const Index got = g.target(t, n);
      // floor(N t / (N + t)) by 128-bit integers, independently of the 64-bit rearrangement.
      __extension__ using U128 = unsigned __int128;  // a GCC and Clang extension
      const auto exact =
          static_cast<Index>((static_cast<U128>(n) * t) / (static_cast<U128>(n) + t));
      CHECK(got == exact);
      CHECK(got < n);
      CHECK(got >= previous);
      previous = got;
    }
  }
}

TEST_CASE("OVQ growth schedules open the expected number of centroids", "[ovq]") {
  const Index dk = 5, dv = 3, l = 8, n_cap = 20;
  const Qkv<double> x = unit_qkv<double>(10 * l + 3, dk, dv, 1500);
  for (const Growth& g : {Growth::dirichlet(), Growth::dirichlet(3.0), Growth::linear(1.0),
                          Growth::linear(0.25), Growth::saturating()}) {
    INFO(growth_name(g));
    OvqOptions opt;
    opt.capacity = n_cap;
    opt.chunk = l;
    opt.growth = g;
    OvqAttention<double> mixer(opt);
    auto st = mixer.make_state(dk, dv);
    Index n = 0;
    std::int64_t t = 0;
    for (Index c0 = 0; c0 + l <= x.q.rows(); c0 += l) {
      mixer.forward(st, x.q.middleRows(c0, l), x.k.middleRows(c0, l), x.v.middleRows(c0, l));
      // MATH.md section 4, step 1, evaluated here independently.
      double target;
      const double a = g.alpha > 0 ? g.alpha : static_cast<double>(n_cap);
      const double tt = static_cast<double>(t + l);
      if (g.kind == Growth::Kind::dirichlet)
        target = std::ceil(n_cap * (1.0 - std::pow(1.0 + tt / a, -a / n_cap)));
      else if (g.kind == Growth::Kind::saturating)
        target = std::floor(n_cap * tt / (n_cap + tt));
      else
        target = std::ceil(g.rate * tt);
      Index m = std::clamp<Index>(std::min<Index>(n_cap, static_cast<Index>(target)) - n, 0, l);
      if (n == 0) m = std::max<Index>(m, 1);
      n += m;
      t += l;
      CAPTURE(t);
      CHECK(st.dictionary().size() == n);
      CHECK(st.absorbed() == t);
      CHECK(st.dictionary().total_count() == t);
    }
  }
}

TEST_CASE("OVQ with linear growth, rate 1, N >= T and unit keys is causal self-attention",
          "[ovq][self]") {
  const Index dk = 8, dv = 5;
  for (Index t : {Index(1), Index(6), Index(53), Index(128)}) {
    const Qkv<double> x = unit_qkv<double>(t, dk, dv, 1700 + static_cast<std::uint64_t>(t));
    const double beta = 3.0;
    const DMat want = ref::self_attention(x.qd, x.kd, x.vd, beta);
    SelfAttentionOptions sopt;
    sopt.beta = beta;
    SelfAttention<double> self(sopt);
    auto self_state = self.make_state(dk, dv);
    const DMat via_self = self.forward(self_state, x.q, x.k, x.v);
    CHECK(relative_error(via_self, want) <= tolerance<double>());
    for (Index chunk : {Index(1), Index(4), Index(16), Index(64)}) {
      for (const Seeding& seeding :
           {Seeding::spread(), Seeding::random(3), Seeding::lowest_similarity()}) {
        for (ValueUpdate rule : {ValueUpdate::mean, ValueUpdate::delta}) {
          for (bool bias : {true, false}) {
            // Counts of 1 make the bias 0 either way, and a row opened in its chunk takes its
            // seed's value under the delta rule too.
            CAPTURE(t, chunk, static_cast<int>(seeding.kind), static_cast<int>(rule), bias);
            OvqOptions opt;
            opt.capacity = t + 5;
            opt.chunk = chunk;
            opt.beta = beta;
            opt.growth = Growth::linear(1.0);
            opt.seeding = seeding;
            opt.value_update = rule;
            opt.count_bias = bias;
            OvqAttention<double> mixer(opt);
            auto st = mixer.make_state(dk, dv);
            const DMat o = mixer.forward(st, x.q, x.k, x.v);
            CHECK(relative_error(o, want) <= tolerance<double>());
            CHECK(relative_error(o, via_self) <= tolerance<double>());
            // Every absorbed key is its own centroid with count 1.
            const Index absorbed = (t / chunk) * chunk;
            REQUIRE(st.dictionary().size() == absorbed);
            for (Index r = 0; r < absorbed; ++r) CHECK(st.dictionary().count(r) == 1);
          }
        }
      }
    }
  }
}

TEST_CASE("OVQ delta rule: with one row the prediction is the row, so it is the running mean",
          "[ovq][reference]") {
  // softmax over one row returns its value: v_i - yhat_i = v_i - D_v[0], and
  // D_v += sum (v_i - D_v) / c' is the running mean. Both rates, float and double.
  const Index dk = 6, dv = 5;
  for (const UpdateRate& rate : {UpdateRate::adaptive(), UpdateRate::constant(0.3)}) {
    CAPTURE(static_cast<int>(rate.kind));
    OvqOptions mean;
    mean.capacity = 1;
    mean.chunk = 8;
    mean.beta = 1.5;
    mean.rate = rate;
    OvqOptions delta = mean;
    delta.value_update = ValueUpdate::delta;
    const Qkv<double> x = gaussian_qkv<double>(77, dk, dv, 1750);
    const DMat want = ref::ovq_attention(x.qd, x.kd, x.vd, mean);
    CHECK(relative_error(ref::ovq_attention(x.qd, x.kd, x.vd, delta), want) <= 1e-13);
    OvqAttention<double> d(delta);
    auto st = d.make_state(dk, dv);
    CHECK(relative_error(d.forward(st, x.q, x.k, x.v), want) <= tolerance<double>());
    const Qkv<float> xf = gaussian_qkv<float>(77, dk, dv, 1750);
    OvqAttention<float> f(delta);
    auto sf = f.make_state(dk, dv);
    const DMat want_f = ref::ovq_attention(xf.qd, xf.kd, xf.vd, mean);
    CHECK(relative_error(f.forward(sf, xf.q, xf.k, xf.v), want_f) <= tolerance<float>());
  }
}

TEST_CASE("OVQ delta rule: a row moves by its members' residuals against the old read",
          "[ovq][reference]") {
  // Two rows (keys e0, e1, values a, b, counts 1 each after the first chunk), then a chunk of two
  // keys both nearest e0: yhat_i = softmax(beta k_i . e_r + log 1) over {a, b}, and
  // D_v[0] = a + ((v_0 - yhat_0) + (v_1 - yhat_1)) / 3, D_v[1] = b.
  const Index dk = 2, dv = 2;
  OvqOptions opt;
  opt.capacity = 2;
  opt.chunk = 2;
  opt.beta = 2.0;
  opt.growth = Growth::linear(1.0);
  opt.seeding = Seeding::lowest_similarity();
  opt.value_update = ValueUpdate::delta;
  DMat k(4, dk), v(4, dv);
  k << 1, 0, 0, 1, 0.9, 0.1, 0.8, -0.2;
  v << 1, 2, -3, 4, 0.5, 0.25, 2, -1;
  OvqAttention<double> mixer(opt);
  auto st = mixer.make_state(dk, dv);
  mixer.absorb(st, k, v);
  REQUIRE(st.dictionary().size() == 2);
  Eigen::RowVector2d expect0 = v.row(0);
  Eigen::RowVector2d residual = Eigen::RowVector2d::Zero();
  for (Index i : {Index(2), Index(3)}) {
    const double w0 = std::exp(2.0 * k(i, 0)), w1 = std::exp(2.0 * k(i, 1));
    residual += v.row(i) - (w0 * v.row(0) + w1 * v.row(1)) / (w0 + w1);
  }
  expect0 += residual / 3.0;
  const auto values = as_eigen(st.dictionary().values());
  CHECK((values.row(0) - expect0).norm() <= 1e-15);
  CHECK((values.row(1) - v.row(1)).norm() == 0.0);
  CHECK(st.dictionary().count(0) == 3);
}

TEST_CASE("OVQ presets: names, the options they set, and refused combinations", "[ovq][errors]") {
  const OvqOptions kvm = OvqOptions::preset("kvm");
  CHECK(kvm.growth.kind == Growth::Kind::saturating);
  CHECK(kvm.seeding.kind == Seeding::Kind::lowest_similarity);
  CHECK((kvm.renormalize && kvm.renormalize_values && kvm.count_bias));
  CHECK(kvm.value_update == ValueUpdate::mean);
  const OvqOptions delta = OvqOptions::preset("kvm-delta");
  CHECK((delta.renormalize && !delta.renormalize_values));
  CHECK(delta.value_update == ValueUpdate::delta);
  CHECK(OvqOptions::preset("default").growth.kind == Growth::Kind::dirichlet);
  CHECK(std::size(OvqOptions::kPresetNames) == 3);
  for (const char* name : OvqOptions::kPresetNames)
    CHECK_NOTHROW(OvqOptions::preset(name).validate());
  CHECK_THROWS_MATCHES(OvqOptions::preset("KVM"), ArgumentError,
                       MessageHas({"name = 'KVM'", "expected default, kvm or kvm-delta"}));
  OvqOptions bad = OvqOptions::kvm_delta();
  bad.renormalize_values = true;
  CHECK_THROWS_MATCHES(OvqAttention<float>(bad), ArgumentError,
                       MessageHas({"renormalize_values = true with value_update = delta"}));
}

TEST_CASE("OVQ: a full dictionary only assigns and updates", "[ovq]") {
  const Index dk = 4, dv = 3;
  OvqOptions opt;
  opt.capacity = 3;
  opt.chunk = 4;
  opt.growth = Growth::linear(1.0);
  OvqAttention<double> mixer(opt);
  auto st = mixer.make_state(dk, dv);
  const Qkv<double> x = unit_qkv<double>(40, dk, dv, 1900);
  ref::OvqRefState ref_state;
  const DMat want = ref::ovq_attention(x.qd, x.kd, x.vd, opt, &ref_state);
  CHECK(relative_error(mixer.forward(st, x.q, x.k, x.v), want) <= tolerance<double>());
  CHECK(st.dictionary().size() == 3);
  CHECK(st.dictionary().total_count() == 40);
  check_against_ref(st, ref_state, tolerance<double>());
}

// ---------------------------------------------------------------------------------------------
// Streaming == chunked == uneven pieces, for all four mixers
// ---------------------------------------------------------------------------------------------

// Outputs agree to rounding here (linear and VQ attention: bitwise, see "any split of a stream
// gives the same bits" below). States: see the check_same_state overloads.
template <class Mixer>
void check_streaming(const Mixer& mixer, const typename Mixer::State& fresh,
                     const Qkv<typename Mixer::scalar_type>& x, Index l, double tol) {
  const Run<Mixer> whole = run_whole(mixer, fresh, x.q, x.k, x.v);
  const Run<Mixer> steps = run_steps(mixer, fresh, x.q, x.k, x.v);
  const std::vector<Index> pieces = uneven_pieces(x.q.rows(), l);
  const Run<Mixer> parts = run_pieces(mixer, fresh, x.q, x.k, x.v, pieces);
  {
    INFO("token by token vs one forward");
    CHECK(relative_error(steps.o, whole.o) <= tol);
    check_same_state(steps.state, whole.state, tol);
  }
  {
    INFO("uneven pieces vs one forward");
    CHECK(relative_error(parts.o, whole.o) <= tol);
    check_same_state(parts.state, whole.state, tol);
  }
}

template <class S>
void streaming_all_mixers() {
  const double tol = tolerance<S>();
  const Index dk = 6, dv = 4;
  for (Index t : {Index(1), Index(5), Index(23), Index(71), Index(130)}) {
    CAPTURE(t);
    const Qkv<S> x = unit_qkv<S>(t, dk, dv, 2000 + static_cast<std::uint64_t>(t));
    for (Index l : {Index(4), Index(16)}) {
      CAPTURE(l);
      {
        INFO("self-attention");
        for (Index w : {Index(0), Index(1), Index(6)}) {
          CAPTURE(w);
          SelfAttentionOptions opt;
          opt.beta = 2.0;
          opt.window = w;
          opt.chunk = l;
          SelfAttention<S> mixer(opt);
          check_streaming(mixer, mixer.make_state(dk, dv), x, l, tol);
          // And the one-shot formula.
          CHECK(relative_error(run_steps(mixer, mixer.make_state(dk, dv), x.q, x.k, x.v).o,
                               ref::self_attention(x.qd, x.kd, x.vd, 2.0, true, w)) <= tol);
        }
      }
      {
        INFO("linear attention");
        for (bool normalize : {false, true}) {
          CAPTURE(normalize);
          LinearAttentionOptions opt;
          opt.beta = 0.9;
          opt.feature_map = FeatureMap::elu1;
          opt.normalize = normalize;
          opt.decay = 0.9;
          opt.chunk = l;
          LinearAttention<S> mixer(opt);
          check_streaming(mixer, mixer.make_state(dk, dv), x, l, tol);
        }
      }
      {
        INFO("VQ-attention");
        VqAttentionOptions opt;
        opt.beta = 2.0;
        opt.chunk = l;
        VqAttention<S> mixer(opt);
        const RowMatrix<S> codebook = random_unit_rows<S>(9, dk, 2100);
        check_streaming(mixer, mixer.make_state(codebook, dv), x, l, tol);
      }
      {
        INFO("OVQ-attention");
        std::vector<std::pair<std::string, OvqOptions>> configs = ovq_readings();
        configs.emplace_back("random seeding", OvqOptions{});
        configs.back().second.seeding = Seeding::random(99);
        for (auto [name, opt] : configs) {
          INFO(name);
          opt.capacity = 12;
          opt.chunk = l;
          opt.beta = 2.0;
          OvqAttention<S> mixer(opt);
          check_streaming(mixer, mixer.make_state(dk, dv), x, l, tol);
          ref::OvqRefState ref_state;
          const DMat want = ref::ovq_attention(x.qd, x.kd, x.vd, opt, &ref_state);
          const Run<OvqAttention<S>> steps = run_steps(mixer, mixer.make_state(dk, dv), x.q, x.k, x.v);
          CHECK(relative_error(steps.o, want) <= tol);
          check_against_ref(steps.state, ref_state, tol);
        }
      }
    }
  }
}

TEST_CASE("streaming token by token == one forward == uneven pieces, all mixers, double",
          "[stream][self][linear][vq][ovq]") {
  streaming_all_mixers<double>();
}

TEST_CASE("streaming token by token == one forward == uneven pieces, all mixers, float",
          "[stream][self][linear][vq][ovq][precision]") {
  streaming_all_mixers<float>();
}

// absorb(): the write alone leaves the state forward() leaves, bitwise (the same write code on
// the same rows; only the reads are skipped).
template <class Mixer>
void check_absorb(const Mixer& mixer, const typename Mixer::State& fresh,
                  const Qkv<typename Mixer::scalar_type>& x, const std::vector<Index>& pieces) {
  typename Mixer::State by_forward = fresh;
  typename Mixer::State by_absorb = fresh;
  Index pos = 0;
  for (Index p : pieces) {
    mixer.forward(by_forward, x.q.middleRows(pos, p), x.k.middleRows(pos, p), x.v.middleRows(pos, p));
    mixer.absorb(by_absorb, x.k.middleRows(pos, p), x.v.middleRows(pos, p));
    pos += p;
    CHECK((by_absorb == by_forward));
  }
  // And the next read sees the same memory.
  const RowMatrix<typename Mixer::scalar_type> a = mixer.forward(by_forward, x.q.topRows(5), x.k.topRows(5), x.v.topRows(5));
  const RowMatrix<typename Mixer::scalar_type> b = mixer.forward(by_absorb, x.q.topRows(5), x.k.topRows(5), x.v.topRows(5));
  CHECK((a == b));
}

TEST_CASE("absorb() writes the state forward() writes, all mixers", "[stream][self][linear][vq][ovq]") {
  const Index dk = 5, dv = 7, l = 8;
  const Qkv<double> x = unit_qkv<double>(83, dk, dv, 2700);
  const std::vector<Index> pieces = uneven_pieces(83, l);
  {
    INFO("self-attention");
    for (Index w : {Index(0), Index(4)}) {
      SelfAttentionOptions opt;
      opt.window = w;
      opt.chunk = l;
      SelfAttention<double> mixer(opt);
      check_absorb(mixer, mixer.make_state(dk, dv), x, pieces);
    }
  }
  {
    INFO("linear attention");
    LinearAttentionOptions opt;
    opt.decay = 0.8;
    opt.normalize = true;
    opt.feature_map = FeatureMap::elu1;
    opt.chunk = l;
    LinearAttention<double> mixer(opt);
    check_absorb(mixer, mixer.make_state(dk, dv), x, pieces);
  }
  {
    INFO("VQ-attention");
    VqAttention<double> mixer(VqAttentionOptions{1.5, l});
    check_absorb(mixer, mixer.make_state(random_unit_rows(11, dk, 2800), dv), x, pieces);
  }
  {
    INFO("OVQ-attention");
    OvqOptions opt;
    opt.capacity = 16;
    opt.chunk = l;
    opt.seeding = Seeding::random(5);
    OvqAttention<double> mixer(opt);
    check_absorb(mixer, mixer.make_state(dk, dv), x, pieces);
  }
}

// Decoding over a long memory: enough work for the read to split the memory across threads
// (when built with OpenMP) and merge the partial softmax states. Most VQ codes are unused
// (count 0, bias -inf), so some parts see no visible row at all.
TEST_CASE("decode over a long memory (split read) matches the formula", "[stream][self][vq]") {
  // 2 (16384 + 1) (dk + dv) flops per decoded token: past the read's threshold for threads.
  const Index dk = 16, dv = 112;
  {
    INFO("VQ-attention, 16384 codes");
    const Index codes = 16384, t = 8;
    const RowMatrix<double> codebook = random_unit_rows(codes, dk, 2900);
    const Qkv<double> x = unit_qkv<double>(t, dk, dv, 2910);
    VqAttention<double> mixer(VqAttentionOptions{4.0, 64});
    const DMat want = ref::vq_attention(x.qd, x.kd, x.vd, codebook, 4.0);
    const Run<VqAttention<double>> steps = run_steps(mixer, mixer.make_state(codebook, dv), x.q, x.k, x.v);
    const Run<VqAttention<double>> whole = run_whole(mixer, mixer.make_state(codebook, dv), x.q, x.k, x.v);
    CHECK(relative_error(steps.o, want) <= tolerance<double>());
    CHECK(relative_error(whole.o, want) <= tolerance<double>());
    check_same_state(steps.state, whole.state, tolerance<double>());
  }
  {
    INFO("self-attention over an absorbed cache of 16384 rows");
    const Index past = 16384, t = 6;
    const Qkv<double> ctx = gaussian_qkv<double>(past, dk, dv, 2920, 0.4);
    const Qkv<double> x = gaussian_qkv<double>(t, dk, dv, 2930, 0.4);
    SelfAttentionOptions opt;
    opt.beta = 0.5;
    SelfAttention<double> mixer(opt);
    auto filled = mixer.make_state(dk, dv);
    mixer.absorb(filled, ctx.k, ctx.v);
    REQUIRE(filled.size() == past);
    // The formula: token i sees the whole context and tokens 0..i of x.
    DMat all_k(past + t, dk), all_v(past + t, dv);
    all_k << ctx.kd, x.kd;
    all_v << ctx.vd, x.vd;
    DMat want(t, dv);
    for (Index i = 0; i < t; ++i) {
      const Eigen::VectorXd logits = opt.beta * (all_k.topRows(past + i + 1) * x.qd.row(i).transpose());
      const Eigen::VectorXd w = (logits.array() - logits.maxCoeff()).exp().matrix();
      want.row(i) = (w.transpose() * all_v.topRows(past + i + 1)) / w.sum();
    }
    const Run<SelfAttention<double>> steps = run_steps(mixer, filled, x.q, x.k, x.v);
    const Run<SelfAttention<double>> whole = run_whole(mixer, filled, x.q, x.k, x.v);
    CHECK(relative_error(steps.o, want) <= tolerance<double>());
    CHECK(relative_error(whole.o, want) <= tolerance<double>());
    check_same_state(steps.state, whole.state, 0.0);
  }
}

// ---------------------------------------------------------------------------------------------
// float against double
// ---------------------------------------------------------------------------------------------

template <class Mixer64, class Mixer32, class State64, class State32>
void check_float_vs_double(const Mixer64& m64, State64 s64, const Mixer32& m32, State32 s32,
                           const Qkv<float>& x, double tol) {
  const RowMatrix<double> o64 = m64.forward(s64, x.qd, x.kd, x.vd);
  const RowMatrix<float> o32 = m32.forward(s32, x.q, x.k, x.v);
  const double err = relative_error(o32, o64);
  CHECK(err <= tol);
  if (x.q.rows() > 1) CHECK(err > 0.0);  // really computed in float
}

TEST_CASE("float mixers agree with double mixers on the same inputs", "[precision]") {
  const Index dk = 8, dv = 6;
  for (Index t : {Index(1), Index(40), Index(150)}) {
    CAPTURE(t);
    const Qkv<float> x = unit_qkv<float>(t, dk, dv, 2500 + static_cast<std::uint64_t>(t));
    const double tol = tolerance<float>();
    {
      INFO("self-attention");
      SelfAttentionOptions opt;
      opt.beta = 2.0;
      opt.chunk = 32;
      check_float_vs_double(SelfAttention<double>(opt), SelfAttention<double>(opt).make_state(dk, dv),
                            SelfAttention<float>(opt), SelfAttention<float>(opt).make_state(dk, dv), x,
                            tol);
    }
    {
      INFO("linear attention");
      LinearAttentionOptions opt;
      opt.feature_map = FeatureMap::elu1;
      opt.normalize = true;
      opt.decay = 0.95;
      opt.chunk = 16;
      check_float_vs_double(LinearAttention<double>(opt), LinearAttention<double>(opt).make_state(dk, dv),
                            LinearAttention<float>(opt), LinearAttention<float>(opt).make_state(dk, dv), x,
                            tol);
    }
    {
      INFO("VQ-attention");
      VqAttentionOptions opt;
      opt.beta = 2.0;
      opt.chunk = 16;
      const RowMatrix<float> cb = random_unit_rows<float>(10, dk, 2600);
      check_float_vs_double(VqAttention<double>(opt),
                            VqAttention<double>(opt).make_state(cb.cast<double>(), dv),
                            VqAttention<float>(opt), VqAttention<float>(opt).make_state(cb, dv), x,
                            tol);
    }
    {
      INFO("OVQ-attention");
      OvqOptions opt;
      opt.capacity = 16;
      opt.chunk = 8;
      opt.beta = 1.5;
      check_float_vs_double(OvqAttention<double>(opt), OvqAttention<double>(opt).make_state(dk, dv),
                            OvqAttention<float>(opt), OvqAttention<float>(opt).make_state(dk, dv), x,
                            tol);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Snapshots, reset, bytes
// ---------------------------------------------------------------------------------------------

// Copy the state mid-stream, feed both copies the same rest: identical (bitwise) outputs and
// states, since the same code runs on the same numbers. reset() then gives a fresh state's results.
template <class Mixer>
void check_snapshot_and_reset(const Mixer& mixer, const typename Mixer::State& fresh,
                              const Qkv<typename Mixer::scalar_type>& x, Index split) {
  using S = typename Mixer::scalar_type;
  const Index t = x.q.rows();
  typename Mixer::State a = fresh;
  mixer.forward(a, x.q.topRows(split), x.k.topRows(split), x.v.topRows(split));
  typename Mixer::State b = a;  // the snapshot
  const RowMatrix<S> oa = mixer.forward(a, x.q.bottomRows(t - split), x.k.bottomRows(t - split),
                                        x.v.bottomRows(t - split));
  const RowMatrix<S> ob = mixer.forward(b, x.q.bottomRows(t - split), x.k.bottomRows(t - split),
                                        x.v.bottomRows(t - split));
  CHECK((oa == ob));
  CHECK((a == b));

  // The snapshot is independent: advancing the copy leaves the original untouched.
  typename Mixer::State c = a;
  mixer.forward(c, x.q.topRows(3), x.k.topRows(3), x.v.topRows(3));
  CHECK((b == a));
  CHECK(!(c == a));

  a.reset();
  CHECK((a == fresh));
  typename Mixer::State d = fresh;
  const RowMatrix<S> o_reset = mixer.forward(a, x.q, x.k, x.v);
  const RowMatrix<S> o_fresh = mixer.forward(d, x.q, x.k, x.v);
  CHECK((o_reset == o_fresh));
  CHECK((a == d));
}

TEST_CASE("state snapshots continue identically; reset() gives a fresh state",
          "[stream][self][linear][vq][ovq]") {
  const Index dk = 6, dv = 5, t = 61, split = 27;
  const Qkv<double> x = unit_qkv<double>(t, dk, dv, 3000);
  {
    INFO("self-attention");
    for (Index w : {Index(0), Index(5)}) {
      SelfAttentionOptions opt;
      opt.window = w;
      opt.chunk = 8;
      SelfAttention<double> mixer(opt);
      check_snapshot_and_reset(mixer, mixer.make_state(dk, dv), x, split);
    }
  }
  {
    INFO("linear attention");
    LinearAttentionOptions opt;
    opt.feature_map = FeatureMap::relu;
    opt.normalize = true;
    opt.decay = 0.9;
    opt.chunk = 8;
    LinearAttention<double> mixer(opt);
    check_snapshot_and_reset(mixer, mixer.make_state(dk, dv), x, split);
  }
  {
    INFO("VQ-attention");
    VqAttention<double> mixer(VqAttentionOptions{2.0, 8});
    check_snapshot_and_reset(mixer, mixer.make_state(random_unit_rows(7, dk, 3100), dv), x, split);
  }
  {
    INFO("OVQ-attention");
    OvqOptions opt;
    opt.capacity = 10;
    opt.chunk = 8;
    opt.beta = 2.0;
    OvqAttention<double> mixer(opt);
    check_snapshot_and_reset(mixer, mixer.make_state(dk, dv), x, split);  // split mid-chunk
  }
}

TEST_CASE("bytes(): KV cache grows with rows, OVQ and linear states are constant",
          "[self][linear][ovq][stream]") {
  const Index dk = 7, dv = 3, l = 8;
  const Qkv<float> x = unit_qkv<float>(20 * l + 5, dk, dv, 3200);
  {
    SelfAttention<float> mixer;
    auto st = mixer.make_state(dk, dv);
    CHECK(st.bytes() == 0);
    mixer.forward(st, x.q.topRows(13), x.k.topRows(13), x.v.topRows(13));
    CHECK(st.bytes() == 13 * (dk + dv) * sizeof(float));
    SelfAttentionOptions wopt;
    wopt.window = 6;
    SelfAttention<double> windowed(wopt);
    auto ws = windowed.make_state(dk, dv);
    windowed.forward(ws, x.qd, x.kd, x.vd);
    CHECK(ws.bytes() == 5 * (dk + dv) * sizeof(double));  // the last W - 1 rows
  }
  {
    // S and z, dk (dv + 1) scalars, and the pending buffer, L (dk + dv) scalars (L = 64).
    LinearAttention<float> mixer;
    auto st = mixer.make_state(dk, dv);
    const std::size_t want = static_cast<std::size_t>(dk * (dv + 1) + 64 * (dk + dv)) * sizeof(float);
    CHECK(st.bytes() == want);
    mixer.forward(st, x.q, x.k, x.v);
    CHECK(st.bytes() == want);
    LinearAttention<double> mixer64;
    CHECK(mixer64.make_state(dk, dv).bytes() ==
          static_cast<std::size_t>(dk * (dv + 1) + 64 * (dk + dv)) * sizeof(double));
  }
  {
    OvqOptions opt;
    opt.capacity = 32;
    opt.chunk = l;
    OvqAttention<float> mixer(opt);
    auto st = mixer.make_state(dk, dv);
    const std::size_t empty = st.bytes();
    // N (dk + dv + 1) scalars (keys, values, log counts), N 64-bit counts, L (dk + dv) pending.
    CHECK(empty == 32 * ((dk + dv + 1) * sizeof(float) + sizeof(std::int64_t)) +
                       l * (dk + dv) * sizeof(float));
    mixer.forward(st, x.q.topRows(l), x.k.topRows(l), x.v.topRows(l));
    const std::size_t after_one = st.bytes();
    mixer.forward(st, x.q.middleRows(l, 19 * l), x.k.middleRows(l, 19 * l), x.v.middleRows(l, 19 * l));
    CHECK(st.absorbed() == 20 * l);
    CHECK(after_one == empty);
    CHECK(st.bytes() == after_one);
  }
}

// ---------------------------------------------------------------------------------------------
// Linear and VQ attention: chunks at fixed stream positions, bitwise the same however the stream
// is split into calls
// ---------------------------------------------------------------------------------------------

// Bitwise equality of two matrices of the same shape.
template <class S>
bool same_bits(const RowMatrix<S>& a, const RowMatrix<S>& b) {
  return a.rows() == b.rows() && a.cols() == b.cols() &&
         std::memcmp(a.data(), b.data(), static_cast<std::size_t>(a.size()) * sizeof(S)) == 0;
}

// Random piece lengths in [1, 2 L + 3], seeded, summing to t.
std::vector<Index> random_pieces(Index t, Index l, std::uint64_t seed) {
  std::mt19937_64 gen(seed);
  std::uniform_int_distribution<Index> len(1, 2 * l + 3);
  std::vector<Index> pieces;
  for (Index left = t; left > 0;) {
    const Index p = std::min(left, len(gen));
    pieces.push_back(p);
    left -= p;
  }
  return pieces;
}

// One forward call, token-by-token steps, uneven pieces, random pieces, and two query heads
// through forward_heads: the same outputs and final state, bit for bit.
template <class Mixer>
void check_splits_exact(const Mixer& mixer, const typename Mixer::State& fresh,
                        const Qkv<typename Mixer::scalar_type>& x, Index l) {
  using S = typename Mixer::scalar_type;
  const Index t = x.q.rows();
  const Run<Mixer> whole = run_whole(mixer, fresh, x.q, x.k, x.v);
  const Run<Mixer> steps = run_steps(mixer, fresh, x.q, x.k, x.v);
  const Run<Mixer> uneven = run_pieces(mixer, fresh, x.q, x.k, x.v, uneven_pieces(t, l));
  {
    INFO("token by token vs one forward");
    CHECK(same_bits(steps.o, whole.o));
    check_same_state(steps.state, whole.state, 0.0);
  }
  {
    INFO("uneven pieces vs one forward");
    CHECK(same_bits(uneven.o, whole.o));
    check_same_state(uneven.state, whole.state, 0.0);
  }
  for (std::uint64_t seed : {1, 2, 3}) {
    INFO("random pieces, seed " << seed);
    const Run<Mixer> r = run_pieces(mixer, fresh, x.q, x.k, x.v, random_pieces(t, l, seed));
    CHECK(same_bits(r.o, whole.o));
    check_same_state(r.state, whole.state, 0.0);
  }
  {
    INFO("two query heads in pieces: each head as if alone");
    typename Mixer::State st = fresh;
    const RowMatrix<S> q2 = x.q.colwise().reverse();
    RowMatrix<S> o1(t, x.v.cols()), o2(t, x.v.cols());
    Index pos = 0;
    for (Index p : random_pieces(t, l, 9)) {
      const ConstRowsView<S> qs[2] = {rows_view(x.q.middleRows(pos, p)),
                                      rows_view(q2.middleRows(pos, p))};
      auto b1 = o1.middleRows(pos, p);
      auto b2 = o2.middleRows(pos, p);
      const RowsView<S> os[2] = {rows_view(b1), rows_view(b2)};
      mixer.forward_heads(st, qs, 2, rows_view(x.k.middleRows(pos, p)),
                          rows_view(x.v.middleRows(pos, p)), os);
      pos += p;
    }
    CHECK(same_bits(o1, whole.o));
    CHECK(same_bits(o2, run_whole(mixer, fresh, q2, x.k, x.v).o));
    check_same_state(st, whole.state, 0.0);
  }
}

template <class S, class Arch>
void linear_splits_exact() {
  // dk = 70 > every key tile (the S read runs over several tiles of dk); chunks of 1, 5, 33 and
  // 100 tokens (100: several key tiles inside a chunk).
  for (const Index dk : {Index(6), Index(70)}) {
    for (const Index l : {Index(1), Index(5), Index(33), Index(100)}) {
      const Index t = 3 * l + 7;
      const Qkv<S> x = gaussian_qkv<S>(t, dk, 11, 4000 + static_cast<std::uint64_t>(l + dk));
      for (FeatureMap map : {FeatureMap::identity, FeatureMap::elu1, FeatureMap::relu}) {
        for (bool normalize : {false, true}) {
          CAPTURE(Arch::kName, dk, l, static_cast<int>(map), normalize);
          LinearAttentionOptions opt;
          opt.beta = 0.7;
          opt.feature_map = map;
          opt.normalize = normalize;
          opt.decay = normalize ? 0.9 : 1.0;
          opt.chunk = l;
          LinearAttention<S, Arch> mixer(opt);
          check_splits_exact(mixer, mixer.make_state(dk, 11), x, l);
        }
      }
    }
  }
}

TEST_CASE("linear attention: any split of a stream gives the same bits", "[linear][stream][exact]") {
  linear_splits_exact<float, arch::native>();
  linear_splits_exact<double, arch::native>();
  linear_splits_exact<float, arch::scalar>();
#if defined(OVQ_ARCH_AVX2)
  linear_splits_exact<float, test::emulated_avx512>();  // the AVX-512 kernels' 16 lanes
#endif
}

TEST_CASE("VQ-attention: any split of a stream gives the same bits", "[vq][stream][exact]") {
  for (const Index l : {Index(1), Index(5), Index(33), Index(100)}) {
    const Index t = 3 * l + 7, dk = 8, dv = 6;
    CAPTURE(l);
    VqAttentionOptions opt;
    opt.beta = 2.0;
    opt.chunk = l;
    {
      INFO("float");
      const Qkv<float> x = unit_qkv<float>(t, dk, dv, 4100 + static_cast<std::uint64_t>(l));
      const RowMatrix<float> codebook = random_unit_rows<float>(9, dk, 4150);
      VqAttention<float> mixer(opt);
      check_splits_exact(mixer, mixer.make_state(codebook, dv), x, l);
#if defined(OVQ_ARCH_AVX2)
      VqAttention<float, test::emulated_avx512> emulated(opt);
      check_splits_exact(emulated, emulated.make_state(codebook, dv), x, l);
#endif
    }
    {
      INFO("double");
      const Qkv<double> x = unit_qkv<double>(t, dk, dv, 4200 + static_cast<std::uint64_t>(l));
      VqAttention<double> mixer(opt);
      check_splits_exact(mixer, mixer.make_state(random_unit_rows(9, dk, 4250), dv), x, l);
    }
  }
}

TEST_CASE("self-attention: any split of a stream gives the same bits", "[self][stream][exact]") {
  // 1100 tokens: the KV cache crosses a 1024-position merge block; dv = 11 is not a multiple of
  // a vector; windows that reach into the cache and that drop rows from it.
  const Index t = 1100, dk = 16, dv = 11;
  for (const Index window : {Index(0), Index(1), Index(40), Index(700)}) {
    for (const Index chunk : {Index(1), Index(64), Index(256)}) {
      CAPTURE(window, chunk);
      SelfAttentionOptions opt;
      opt.beta = 0.6;
      opt.window = window;
      opt.chunk = chunk;
      {
        const Qkv<float> x = gaussian_qkv<float>(t, dk, dv, 4300 + static_cast<std::uint64_t>(window));
        SelfAttention<float> mixer(opt);
        check_splits_exact(mixer, mixer.make_state(dk, dv), x, 97);
        SelfAttention<float, arch::scalar> portable(opt);
        check_splits_exact(portable, portable.make_state(dk, dv), x, 97);
#if defined(OVQ_ARCH_AVX2)
        SelfAttention<float, test::emulated_avx512> emulated(opt);
        check_splits_exact(emulated, emulated.make_state(dk, dv), x, 97);
#endif
      }
      if (chunk == 64) {
        const Qkv<double> x = gaussian_qkv<double>(t, dk, dv, 4400 + static_cast<std::uint64_t>(window));
        SelfAttention<double> mixer(opt);
        check_splits_exact(mixer, mixer.make_state(dk, dv), x, 97);
      }
    }
  }
}

TEST_CASE("OVQ-attention: any split of a stream gives the same bits", "[ovq][stream][exact]") {
  for (const Index l : {Index(1), Index(7), Index(40), Index(130)}) {
    const Index t = 4 * l + 9, dk = 12, dv = 9;
    for (auto [name, opt] : ovq_readings()) {
      CAPTURE(l, name);
      opt.capacity = 3 * l + 2;
      opt.chunk = l;
      opt.beta = 1.5;
      {
        const Qkv<float> x = unit_qkv<float>(t, dk, dv, 4500 + static_cast<std::uint64_t>(l));
        OvqAttention<float> mixer(opt);
        check_splits_exact(mixer, mixer.make_state(dk, dv), x, l);
        OvqAttention<float, arch::scalar> portable(opt);
        check_splits_exact(portable, portable.make_state(dk, dv), x, l);
#if defined(OVQ_ARCH_AVX2)
        OvqAttention<float, test::emulated_avx512> emulated(opt);
        check_splits_exact(emulated, emulated.make_state(dk, dv), x, l);
#endif
      }
      {
        const Qkv<double> x = unit_qkv<double>(t, dk, dv, 4600 + static_cast<std::uint64_t>(l));
        OvqAttention<double> mixer(opt);
        check_splits_exact(mixer, mixer.make_state(dk, dv), x, l);
      }
    }
  }
}

TEST_CASE("linear attention: the pending chunk waits in the state until it is complete",
          "[linear][stream]") {
  const Index dk = 5, dv = 4, l = 8;
  const Qkv<double> x = gaussian_qkv<double>(3 * l + 3, dk, dv, 4300);
  LinearAttentionOptions opt;
  opt.feature_map = FeatureMap::elu1;
  opt.decay = 0.9;
  opt.chunk = l;
  LinearAttention<double> mixer(opt);
  auto st = mixer.make_state(dk, dv);
  CHECK(st.chunk() == l);

  // A chunk minus one token: everything pending, (S, z) still zero.
  mixer.forward(st, x.q.topRows(l - 1), x.k.topRows(l - 1), x.v.topRows(l - 1));
  CHECK(st.pending() == l - 1);
  CHECK(st.absorbed() == 0);
  CHECK(st.tokens() == l - 1);
  CHECK(st.kv().isZero(0.0));
  CHECK(st.k_sum().isZero(0.0));
  CHECK((as_eigen(st.pending_keys()) == x.k.topRows(l - 1)));  // raw keys, before phi
  CHECK((as_eigen(st.pending_values()) == x.v.topRows(l - 1)));

  // The last token of the chunk: it is folded in, nothing pending.
  mixer.step(st, x.q.row(l - 1), x.k.row(l - 1), x.v.row(l - 1));
  CHECK(st.pending() == 0);
  CHECK(st.absorbed() == l);
  auto one_chunk = mixer.make_state(dk, dv);
  mixer.absorb(one_chunk, x.k.topRows(l), x.v.topRows(l));
  CHECK((st == one_chunk));

  // Past two more chunks and three tokens: (S, z) hold three chunks, three rows pending, and
  // sums() folds them in: the recurrence's S_t and z_t.
  mixer.forward(st, x.q.bottomRows(2 * l + 3), x.k.bottomRows(2 * l + 3), x.v.bottomRows(2 * l + 3));
  CHECK(st.absorbed() == 3 * l);
  CHECK(st.pending() == 3);
  CHECK((as_eigen(st.pending_keys()) == x.k.bottomRows(3)));
  auto three_chunks = mixer.make_state(dk, dv);
  mixer.absorb(three_chunks, x.k.topRows(3 * l), x.v.topRows(3 * l));
  CHECK((st.kv() == three_chunks.kv()));
  CHECK((st.k_sum() == three_chunks.k_sum()));
  ref::LinearRefState ref_state;
  ref::linear_attention(x.qd, x.kd, x.vd, opt, &ref_state);
  const auto sums = mixer.sums(st);
  CHECK(relative_error(sums.kv, ref_state.s) <= tolerance<double>());
  CHECK(relative_error(sums.k_sum, ref_state.z.transpose()) <= tolerance<double>());
  // sums() of a state with nothing pending is (S, z) itself.
  CHECK((mixer.sums(three_chunks).kv == three_chunks.kv()));

  st.reset();
  CHECK((st == mixer.make_state(dk, dv)));
}

TEST_CASE("VQ-attention: the pending chunk waits in the state until it is complete",
          "[vq][stream]") {
  const Index dk = 6, dv = 3, l = 8;
  const Qkv<double> x = unit_qkv<double>(2 * l + 3, dk, dv, 4400);
  const DMat codebook = random_unit_rows(5, dk, 4410);
  const std::vector<Index> z = ref::quantise(x.kd, codebook);
  VqAttention<double> mixer(VqAttentionOptions{1.5, l});
  auto st = mixer.make_state(codebook, dv);
  CHECK(st.chunk() == l);

  mixer.forward(st, x.q.topRows(l - 1), x.k.topRows(l - 1), x.v.topRows(l - 1));
  CHECK(st.pending() == l - 1);
  CHECK(st.absorbed() == 0);
  CHECK(st.tokens() == l - 1);
  CHECK(st.dictionary().total_count() == 0);
  CHECK(as_eigen(st.dictionary().values()).isZero(0.0));
  for (Index j = 0; j < l - 1; ++j) {
    CAPTURE(j);
    CHECK(st.pending_codes()[j] == z[static_cast<std::size_t>(j)]);
    CHECK((as_eigen(st.pending_keys()).row(j) == codebook.row(z[static_cast<std::size_t>(j)])));
  }
  CHECK((as_eigen(st.pending_values()) == x.v.topRows(l - 1)));

  mixer.step(st, x.q.row(l - 1), x.k.row(l - 1), x.v.row(l - 1));
  CHECK(st.pending() == 0);
  CHECK(st.absorbed() == l);
  CHECK(st.dictionary().total_count() == l);

  mixer.forward(st, x.q.bottomRows(l + 3), x.k.bottomRows(l + 3), x.v.bottomRows(l + 3));
  CHECK(st.absorbed() == 2 * l);
  CHECK(st.pending() == 3);
  auto two_chunks = mixer.make_state(codebook, dv);
  mixer.absorb(two_chunks, x.k.topRows(2 * l), x.v.topRows(2 * l));
  CHECK((st.dictionary() == two_chunks.dictionary()));
  CHECK(!(st == two_chunks));  // the pending rows differ

  st.reset();
  CHECK((st == mixer.make_state(codebook, dv)));
}

}  // namespace

}  // namespace ovq_test_mixers
