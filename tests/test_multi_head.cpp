// MultiHead<Mixer>: batch x heads around a single-head mixer, with grouped-query attention.
//
// Layout: Q (B Hq T) x dk, K (B Hkv T) x dk, V (B Hkv T) x dv, O (B Hq T) x dv; head h of batch b
// holds rows [(b H + h) T, (b H + h + 1) T); query head h reads key/value head h / (Hq / Hkv).
// Every check compares with the single-head mixer run by hand on the matching state.
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "support/catch.hpp"
#include "support/fixtures.hpp"
#include "support/matchers.hpp"

// Everything below lives in this file's own namespace, so the suite can be built as one
// unity source without the files' helpers colliding.
namespace ovq_test_multi_head {

namespace {

using namespace ovq;
using ovq::test::random_matrix;
using ovq::test::random_unit_rows;
using ovq::test::relative_error;
using ovq::test::tolerance;
using ovq::test::MessageHas;

struct Heads {
  Index batch, hq, hkv;
};

template <class S>
RowMatrix<S> head_rows(const RowMatrix<S>& m, Index head_index, Index t) {
  return m.middleRows(head_index * t, t);
}

// Row (b H + h) of the one-token-per-head matrices, from token i of the (B H T) x d layout.
template <class S>
RowMatrix<S> token_rows(const RowMatrix<S>& m, Index heads_total, Index t, Index i) {
  RowMatrix<S> out(heads_total, m.cols());
  for (Index h = 0; h < heads_total; ++h) out.row(h) = m.row(h * t + i);
  return out;
}

// States: exact where the same writes ran on the same rows (see the comments at the call sites).
template <class S>
void check_state_close(const KvCache<S>& a, const KvCache<S>& b, double) {
  CHECK(a == b);
}
template <class S>
void check_state_close(const OvqState<S>& a, const OvqState<S>& b, double) {
  CHECK(a.absorbed() == b.absorbed());
  CHECK(a.pending() == b.pending());
  CHECK(a.dictionary().size() == b.dictionary().size());
  CHECK(a == b);
}
template <class S>
void check_state_close(const LinearState<S>& a, const LinearState<S>& b, double tol) {
  CHECK(a.tokens() == b.tokens());
  CHECK(relative_error(a.kv(), b.kv()) <= tol);
  CHECK(relative_error(a.k_sum(), b.k_sum()) <= tol);
}
template <class S>
void check_state_close(const VqState<S>& a, const VqState<S>& b, double tol) {
  const Dictionary<S>& da = a.dictionary();
  const Dictionary<S>& db = b.dictionary();
  REQUIRE(da.size() == db.size());
  for (Index r = 0; r < da.size(); ++r) CHECK(da.count(r) == db.count(r));
  CHECK((as_eigen(da.keys()) == as_eigen(db.keys())));
  CHECK(relative_error(as_eigen(da.values()), as_eigen(db.values())) <= tol);
}

// Tokens written into one state: every mixer's state counts them once per call.
template <class S>
std::int64_t tokens_of(const KvCache<S>& s) {
  return s.tokens();
}
template <class S>
std::int64_t tokens_of(const LinearState<S>& s) {
  return s.tokens();
}
template <class S>
std::int64_t tokens_of(const VqState<S>& s) {
  return s.tokens();
}
template <class S>
std::int64_t tokens_of(const OvqState<S>& s) {
  return s.tokens();
}

template <class Mixer>
MultiHead<Mixer> make_layer(const Mixer& mixer, const Heads& h,
                            const std::vector<typename Mixer::State>& kv_states, bool per_head) {
  if constexpr (std::is_same_v<Mixer, VqAttention<typename Mixer::scalar_type>>) {
    REQUIRE(per_head);  // a VQ state needs a codebook: no make_state(dk, dv)
    return MultiHead<Mixer>(mixer, h.batch, h.hq, kv_states);
  } else {
    if (per_head) return MultiHead<Mixer>(mixer, h.batch, h.hq, kv_states);
    return MultiHead<Mixer>(mixer, h.batch, h.hq, h.hkv, kv_states[0].key_dim(),
                            kv_states[0].value_dim());
  }
}

// The whole contract of the layer for one mixer and one head configuration.
//   kv_states[g]: the initial state of key/value head g (all equal to make_state(dk, dv) unless
//   per_head, which uses the per-kv-head constructor).
template <class Mixer>
void check_layer(const Mixer& mixer, const Heads& h, Index t1, Index t2,
                 const std::vector<typename Mixer::State>& kv_states, bool per_head,
                 std::uint64_t seed, bool exact_state_after_steps) {
  using S = typename Mixer::scalar_type;
  using State = typename Mixer::State;
  const double tol = tolerance<S>();
  const Index dk = kv_states[0].key_dim();
  const Index dv = kv_states[0].value_dim();
  const Index group = h.hq / h.hkv;
  CAPTURE(h.batch, h.hq, h.hkv, t1, t2, dk, dv);

  MultiHead<Mixer> layer = make_layer(mixer, h, kv_states, per_head);
  REQUIRE(layer.batch() == h.batch);
  REQUIRE(layer.query_heads() == h.hq);
  REQUIRE(layer.kv_heads() == h.hkv);
  REQUIRE(layer.states().size() == static_cast<std::size_t>(h.batch * h.hkv));

  // Single-head states by hand, one per (batch, kv head).
  std::vector<State> single;
  for (Index b = 0; b < h.batch; ++b)
    for (Index g = 0; g < h.hkv; ++g) single.push_back(kv_states[static_cast<std::size_t>(g)]);

  // Two calls, to check the layer continues its states.
  for (Index call = 0; call < 2; ++call) {
    const Index t = call == 0 ? t1 : t2;
    CAPTURE(call, t);
    const std::uint64_t s = seed + 10 * static_cast<std::uint64_t>(call);
    const RowMatrix<S> q = random_unit_rows<S>(h.batch * h.hq * t, dk, s);
    const RowMatrix<S> k = random_unit_rows<S>(h.batch * h.hkv * t, dk, s + 1);
    const RowMatrix<S> v = random_matrix<S>(h.batch * h.hkv * t, dv, s + 2);
    const RowMatrix<S> o = layer.forward(q, k, v);
    REQUIRE(o.rows() == h.batch * h.hq * t);
    REQUIRE(o.cols() == dv);

    for (Index b = 0; b < h.batch; ++b) {
      for (Index g = 0; g < h.hkv; ++g) {
        State& ref_state = single[static_cast<std::size_t>(b * h.hkv + g)];
        const RowMatrix<S> kg = head_rows(k, b * h.hkv + g, t);
        const RowMatrix<S> vg = head_rows(v, b * h.hkv + g, t);
        State after = ref_state;
        for (Index j = 0; j < group; ++j) {
          const Index head = g * group + j;  // query heads g G .. g G + G - 1 read kv head g
          CAPTURE(b, g, head);
          State s_head = ref_state;
          const RowMatrix<S> want = mixer.forward(s_head, head_rows(q, b * h.hq + head, t), kg, vg);
          // The same read kernel on the same rows, yet only equal to rounding: reading a group
          // of heads in one call runs another inlined copy of the read loop, and GCC's default
          // -ffp-contract=fast may fuse multiply-adds differently there (seen with
          // -march=native: 1 ulp apart for Hq > Hkv, bitwise equal with -ffp-contract=off).
          CHECK(relative_error(head_rows(o, b * h.hq + head, t), want) <= tol);
          after = s_head;
        }
        ref_state = after;
        // The state was written once with this (b, g)'s keys and values: exactly the single-head
        // state (the write sees the same rows in the same chunks).
        INFO("state (" << b << ", " << g << ")");
        check_state_close(layer.state(b, g), ref_state, 0.0);
        CHECK(layer.state(b, g) == ref_state);
      }
    }
  }
  // Written once per kv head, not once per query head of its group.
  for (Index b = 0; b < h.batch; ++b)
    for (Index g = 0; g < h.hkv; ++g) CHECK(tokens_of(layer.state(b, g)) == t1 + t2);

  // step() over tokens == forward, on a fresh layer.
  {
    INFO("step over tokens");
    const Index t = t1;
    MultiHead<Mixer> by_forward = make_layer(mixer, h, kv_states, per_head);
    MultiHead<Mixer> by_step = make_layer(mixer, h, kv_states, per_head);
    const RowMatrix<S> q = random_unit_rows<S>(h.batch * h.hq * t, dk, seed + 100);
    const RowMatrix<S> k = random_unit_rows<S>(h.batch * h.hkv * t, dk, seed + 101);
    const RowMatrix<S> v = random_matrix<S>(h.batch * h.hkv * t, dv, seed + 102);
    const RowMatrix<S> o = by_forward.forward(q, k, v);
    RowMatrix<S> o_step(o.rows(), dv);
    for (Index i = 0; i < t; ++i) {
      const RowMatrix<S> qi = token_rows(q, h.batch * h.hq, t, i);
      const RowMatrix<S> ki = token_rows(k, h.batch * h.hkv, t, i);
      const RowMatrix<S> vi = token_rows(v, h.batch * h.hkv, t, i);
      RowMatrix<S> oi(h.batch * h.hq, dv);
      by_step.step(qi, ki, vi, oi);
      for (Index r = 0; r < h.batch * h.hq; ++r) o_step.row(r * t + i) = oi.row(r);
    }
    CHECK(relative_error(o_step, o) <= tol);
    for (Index b = 0; b < h.batch; ++b) {
      for (Index g = 0; g < h.hkv; ++g) {
        CAPTURE(b, g);
        CHECK(tokens_of(by_step.state(b, g)) == t);
        check_state_close(by_step.state(b, g), by_forward.state(b, g), tol);
        if (exact_state_after_steps) CHECK(by_step.state(b, g) == by_forward.state(b, g));
      }
    }
  }

  // Eigen::Map over the caller's buffers: read in place, O written in place.
  {
    INFO("Eigen::Map over std::vector buffers");
    const Index t = t1;
    using Map = Eigen::Map<RowMatrix<S>>;
    using CMap = Eigen::Map<const RowMatrix<S>>;
    const RowMatrix<S> q = random_unit_rows<S>(h.batch * h.hq * t, dk, seed + 200);
    const RowMatrix<S> k = random_unit_rows<S>(h.batch * h.hkv * t, dk, seed + 201);
    const RowMatrix<S> v = random_matrix<S>(h.batch * h.hkv * t, dv, seed + 202);
    std::vector<S> qbuf(q.data(), q.data() + q.size());
    std::vector<S> kbuf(k.data(), k.data() + k.size());
    std::vector<S> vbuf(v.data(), v.data() + v.size());
    const S sentinel = std::numeric_limits<S>::quiet_NaN();
    std::vector<S> obuf(static_cast<std::size_t>(h.batch * h.hq * t * dv), sentinel);

    MultiHead<Mixer> by_matrix = make_layer(mixer, h, kv_states, per_head);
    MultiHead<Mixer> by_map = make_layer(mixer, h, kv_states, per_head);
    const RowMatrix<S> want = by_matrix.forward(q, k, v);
    by_map.forward(CMap(qbuf.data(), q.rows(), dk), CMap(kbuf.data(), k.rows(), dk),
                   CMap(vbuf.data(), v.rows(), dv), Map(obuf.data(), q.rows(), dv));
    std::size_t written = 0;
    for (const S& x : obuf) written += std::isnan(x) ? 0 : 1;
    CHECK(written == obuf.size());
    // Same computation on the same values: bitwise equal.
    CHECK((CMap(obuf.data(), q.rows(), dv) == want));
    for (std::size_t s = 0; s < by_map.states().size(); ++s)
      CHECK(by_map.states()[s] == by_matrix.states()[s]);

    // A mapped block of a larger row-major buffer (outer stride > dv) is written in place too,
    // and the columns outside the block are left alone.
    const Index wide = dv + 3;
    std::vector<S> obig(static_cast<std::size_t>(q.rows() * wide), S(-7));
    Map big(obig.data(), q.rows(), wide);
    MultiHead<Mixer> by_block = make_layer(mixer, h, kv_states, per_head);
    by_block.forward(CMap(qbuf.data(), q.rows(), dk), CMap(kbuf.data(), k.rows(), dk),
                     CMap(vbuf.data(), v.rows(), dv), big.leftCols(dv));
    CHECK((big.leftCols(dv) == want));
    CHECK((big.rightCols(3).array() == S(-7)).all());
  }
}

template <class State>
std::vector<State> replicate(Index n, const State& s) {
  return std::vector<State>(static_cast<std::size_t>(n), s);
}

// The four mixers for one (batch, heads) configuration.
template <class S>
void all_mixers_multi_head(const Heads& h, std::uint64_t seed) {
  const Index dk = 8, dv = 5;
  const Index l = 4;
  for (Index t1 : {Index(1), Index(3), Index(13)}) {
    const Index t2 = 2 * l + 1;
    {
      INFO("self-attention");
      for (Index w : {Index(0), Index(3)}) {
        SelfAttentionOptions opt;
        opt.beta = 2.0;
        opt.window = w;
        opt.chunk = l;
        SelfAttention<S> mixer(opt);
        // Exact after steps too: the KV cache holds copies of the rows.
        check_layer(mixer, h, t1, t2, replicate(h.hkv, mixer.make_state(dk, dv)),
                    false, seed, true);
      }
    }
    {
      INFO("linear attention");
      LinearAttentionOptions opt;
      opt.feature_map = FeatureMap::elu1;
      opt.normalize = true;
      opt.decay = 0.9;
      opt.chunk = l;
      LinearAttention<S> mixer(opt);
      check_layer(mixer, h, t1, t2, replicate(h.hkv, mixer.make_state(dk, dv)),
                  false, seed + 1000, false);
    }
    {
      INFO("VQ-attention, one codebook per kv head");
      VqAttentionOptions opt;
      opt.beta = 2.0;
      opt.chunk = l;
      VqAttention<S> mixer(opt);
      std::vector<VqState<S>> per_head;
      for (Index g = 0; g < h.hkv; ++g)
        per_head.push_back(
            mixer.make_state(random_unit_rows<S>(6, dk, seed + 50 + static_cast<std::uint64_t>(g)), dv));
      check_layer(mixer, h, t1, t2, per_head, true, seed + 2000, false);
    }
    {
      INFO("OVQ-attention");
      OvqOptions opt;
      opt.capacity = 6;
      opt.chunk = l;
      opt.beta = 2.0;
      OvqAttention<S> mixer(opt);
      // Exact after steps too: the dictionary writes see the same complete chunks.
      check_layer(mixer, h, t1, t2, replicate(h.hkv, mixer.make_state(dk, dv)),
                  false, seed + 3000, true);
    }
  }
}

TEST_CASE("MultiHead: batch 2, Hq = 4, Hkv = 2 (grouped queries), all mixers",
          "[multihead][self][linear][vq][ovq]") {
  all_mixers_multi_head<double>({2, 4, 2}, 10);
}

TEST_CASE("MultiHead: batch 2, Hq = Hkv = 3, all mixers", "[multihead][self][linear][vq][ovq]") {
  all_mixers_multi_head<double>({2, 3, 3}, 20);
}

TEST_CASE("MultiHead: batch 2, Hq = 6, Hkv = 1 (multi-query), all mixers",
          "[multihead][self][linear][vq][ovq]") {
  all_mixers_multi_head<double>({2, 6, 1}, 30);
}

TEST_CASE("MultiHead in float: batch 2, Hq = 4, Hkv = 2, all mixers",
          "[multihead][precision][self][linear][vq][ovq]") {
  all_mixers_multi_head<float>({2, 4, 2}, 40);
}

TEST_CASE("MultiHead: more query heads per kv head than one stacked tile holds",
          "[multihead][self][linear][vq][ovq]") {
  all_mixers_multi_head<double>({1, 70, 1}, 50);
  all_mixers_multi_head<double>({1, 130, 2}, 60);
}

// MultiHead::absorb writes every state as forward() does, bitwise (the same writes).
template <class Mixer>
void check_layer_absorb(const Mixer& mixer, const std::vector<typename Mixer::State>& kv_states,
                        const Heads& h, Index t, std::uint64_t seed) {
  using S = typename Mixer::scalar_type;
  const Index dk = kv_states[0].key_dim(), dv = kv_states[0].value_dim();
  MultiHead<Mixer> a = make_layer(mixer, h, kv_states, true);
  MultiHead<Mixer> b = make_layer(mixer, h, kv_states, true);
  const RowMatrix<S> q = random_unit_rows<S>(h.batch * h.hq * t, dk, seed);
  const RowMatrix<S> k = random_unit_rows<S>(h.batch * h.hkv * t, dk, seed + 1);
  const RowMatrix<S> v = random_matrix<S>(h.batch * h.hkv * t, dv, seed + 2);
  a.forward(q, k, v);
  b.absorb(k, v);
  for (std::size_t s = 0; s < a.states().size(); ++s) {
    CAPTURE(s);
    CHECK(a.states()[s] == b.states()[s]);
    CHECK(tokens_of(b.states()[s]) == t);
  }
}

TEST_CASE("MultiHead::absorb writes the states forward() writes", "[multihead][stream]") {
  const Heads h{2, 4, 2};
  const Index dk = 6, dv = 5, t = 19;
  {
    SelfAttentionOptions opt;
    opt.window = 5;
    SelfAttention<double> mixer(opt);
    check_layer_absorb(mixer, replicate(h.hkv, mixer.make_state(dk, dv)), h, t, 70);
  }
  {
    LinearAttentionOptions opt;
    opt.chunk = 4;
    opt.decay = 0.9;
    LinearAttention<double> mixer(opt);
    check_layer_absorb(mixer, replicate(h.hkv, mixer.make_state(dk, dv)), h, t, 80);
  }
  {
    VqAttention<double> mixer(VqAttentionOptions{1.0, 4});
    std::vector<VqState<double>> per_head;
    for (Index g = 0; g < h.hkv; ++g)
      per_head.push_back(mixer.make_state(random_unit_rows(5, dk, 90 + static_cast<std::uint64_t>(g)), dv));
    check_layer_absorb(mixer, per_head, h, t, 100);
  }
  {
    OvqOptions opt;
    opt.capacity = 8;
    opt.chunk = 4;
    OvqAttention<double> mixer(opt);
    check_layer_absorb(mixer, replicate(h.hkv, mixer.make_state(dk, dv)), h, t, 110);
  }
}

TEST_CASE("MultiHead: OVQ absorbs T rounded down to L per kv head", "[multihead][ovq]") {
  const Index dk = 6, dv = 4, l = 8, t = 29, batch = 2, hq = 4, hkv = 2;
  OvqOptions opt;
  opt.capacity = 16;
  opt.chunk = l;
  OvqAttention<double> mixer(opt);
  MultiHead<OvqAttention<double>> layer(mixer, batch, hq, hkv, dk, dv);
  const RowMatrix<double> q = random_unit_rows(batch * hq * t, dk, 5);
  const RowMatrix<double> k = random_unit_rows(batch * hkv * t, dk, 6);
  const RowMatrix<double> v = random_matrix(batch * hkv * t, dv, 7);
  layer.forward(q, k, v);
  for (Index b = 0; b < batch; ++b) {
    for (Index g = 0; g < hkv; ++g) {
      CAPTURE(b, g);
      const OvqState<double>& s = layer.state(b, g);
      CHECK(s.absorbed() == (t / l) * l);  // 24: not multiplied by the group size 2
      CHECK(s.pending() == t % l);
      CHECK(s.dictionary().total_count() == (t / l) * l);
      // The pending rows are this (b, g)'s last keys.
      CHECK((as_eigen(s.pending_keys()) == k.middleRows((b * hkv + g) * t + (t / l) * l, t % l)));
    }
  }
  // Different kv heads got different keys: their states differ.
  CHECK(!(layer.state(0, 0) == layer.state(0, 1)));
  CHECK(!(layer.state(0, 0) == layer.state(1, 0)));
  CHECK(layer.bytes() == static_cast<std::size_t>(batch * hkv) * layer.state(0, 0).bytes());
  layer.reset();
  for (const auto& s : layer.states()) CHECK(s == mixer.make_state(dk, dv));
}

// One beta per query head: each head reads as the single-head mixer with its beta, and the
// states are those of the mixer (the write does not read with beta), or, for OVQ's delta rule,
// of the mixer with the group's shared beta.
template <class Mixer>
void check_head_betas(Mixer mixer, const std::vector<typename Mixer::State>& kv_states,
                      const std::vector<double>& betas, std::uint64_t seed) {
  using S = typename Mixer::scalar_type;
  const Index batch = 2, hq = 4, hkv = 2, t = 11, group = hq / hkv;
  const Index dk = kv_states[0].key_dim(), dv = kv_states[0].value_dim();
  MultiHead<Mixer> layer(mixer, batch, hq, kv_states);
  layer.set_head_betas(betas);
  CHECK(layer.head_betas() == betas);
  const RowMatrix<S> q = random_unit_rows<S>(batch * hq * t, dk, seed);
  const RowMatrix<S> k = random_unit_rows<S>(batch * hkv * t, dk, seed + 1);
  const RowMatrix<S> v = random_matrix<S>(batch * hkv * t, dv, seed + 2);
  const RowMatrix<S> o = layer.forward(q, k, v);
  for (Index b = 0; b < batch; ++b)
    for (Index g = 0; g < hkv; ++g)
      for (Index j = 0; j < group; ++j) {
        const Index head = g * group + j;
        CAPTURE(b, g, head);
        auto options = mixer.options();
        options.beta = betas[static_cast<std::size_t>(head)];
        const Mixer alone(options);
        auto st = kv_states[static_cast<std::size_t>(g)];
        const RowMatrix<S> want =
            alone.forward(st, head_rows(q, b * hq + head, t), head_rows(k, b * hkv + g, t),
                          head_rows(v, b * hkv + g, t));
        CHECK(relative_error(head_rows(o, b * hq + head, t), want) <= tolerance<S>());
        if (j == 0) check_state_close(layer.state(b, g), st, tolerance<S>());
      }
  // absorb writes what forward wrote: the delta rule's write predicts with each key/value
  // head's own beta there too.
  MultiHead<Mixer> writer(mixer, batch, hq, kv_states);
  writer.set_head_betas(betas);
  writer.absorb(k, v);
  for (Index b = 0; b < batch; ++b)
    for (Index g = 0; g < hkv; ++g) CHECK(writer.state(b, g) == layer.state(b, g));
  // Without head betas again: the mixer's beta.
  layer.set_head_betas({});
  CHECK(layer.head_betas().empty());
}

TEST_CASE("MultiHead: one beta per query head", "[multihead][self][vq][ovq]") {
  const Index dk = 6, dv = 5;
  const std::vector<double> betas = {0.5, 1.0, 2.0, 3.5};
  {
    INFO("self-attention");
    SelfAttentionOptions opt;
    opt.chunk = 4;
    SelfAttention<double> mixer(opt);
    check_head_betas(mixer, replicate(2, mixer.make_state(dk, dv)), betas, 900);
  }
  {
    INFO("VQ-attention");
    VqAttentionOptions opt;
    opt.chunk = 4;
    VqAttention<float> mixer(opt);
    check_head_betas(mixer,
                     {mixer.make_state(random_unit_rows<float>(5, dk, 910), dv),
                      mixer.make_state(random_unit_rows<float>(5, dk, 911), dv)},
                     betas, 920);
  }
  for (const char* preset : OvqOptions::kPresetNames) {
    INFO("OVQ-attention, preset " << preset);
    OvqOptions opt = OvqOptions::preset(preset);
    opt.capacity = 6;
    opt.chunk = 4;
    OvqAttention<double> mixer(opt);
    // The delta rule's write reads with beta: one per key/value head.
    const std::vector<double> shared =
        mixer.write_uses_beta() ? std::vector<double>{0.5, 0.5, 2.0, 2.0} : betas;
    check_head_betas(mixer, replicate(2, mixer.make_state(dk, dv)), shared, 930);
  }
}

TEST_CASE("MultiHead::set_head_betas: bad betas are refused and change nothing",
          "[multihead][errors]") {
  const Index dk = 4, dv = 3;
  OvqAttention<float> mixer(OvqOptions::kvm_delta());
  MultiHead<OvqAttention<float>> layer(mixer, 1, 4, 2, dk, dv);
  layer.set_head_betas({1.0, 1.0, 2.0, 2.0});
  CHECK_THROWS_MATCHES(layer.set_head_betas({1.0, 2.0}), ArgumentError,
                       MessageHas({"betas has 2 entries, expected 4"}));
  CHECK_THROWS_MATCHES(layer.set_head_betas({1.0, 1.0, -2.0, -2.0}), ArgumentError,
                       MessageHas({"betas[2] = -2", "expected a finite value > 0"}));
  CHECK_THROWS_MATCHES(
      layer.set_head_betas({1.0, 1.0, std::numeric_limits<double>::infinity(), 1.0}), ArgumentError,
      MessageHas({"betas[2] = inf"}));
  CHECK_THROWS_MATCHES(layer.set_head_betas({1.0, 1.5, 2.0, 2.0}), ArgumentError,
                       MessageHas({"betas[1] = 1.5, expected 1 (betas[0]"}));
  CHECK(layer.head_betas() == std::vector<double>{1.0, 1.0, 2.0, 2.0});  // unchanged
  CHECK_THROWS_MATCHES(layer.set_head_betas({1e300, 1e300, 1.0, 1.0}), ArgumentError,
                       MessageHas({"betas[0]"}));  // not a float
  LinearAttention<float> linear;
  MultiHead<LinearAttention<float>> lin(linear, 1, 2, 2, dk, dv);
  CHECK_THROWS_MATCHES(lin.set_head_betas({1.0, 2.0}), ArgumentError,
                       MessageHas({"expected no head betas"}));
  CHECK_NOTHROW(lin.set_head_betas({}));
}

}  // namespace

}  // namespace ovq_test_multi_head
