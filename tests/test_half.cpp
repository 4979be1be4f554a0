// The 16-bit elements (bf16, fp16): every mixer on 16-bit inputs against the float mixer on the
// same values widened (what a 16-bit mixer computes, by construction: its kernels widen each
// element as they load it and compute in float), against the double references within the
// bounds a 16-bit input allows, across cuts of the stream, through state files; and the
// dictionaries' float running means, which keep moving where 16-bit rows would freeze.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "ovq/io/state_file.hpp"
#include "support/catch.hpp"
#include "support/emulated_amx.hpp"
#include "support/emulated_avx512.hpp"
#include "support/fixtures.hpp"
#include "support/matchers.hpp"

namespace ovq_test_half {

namespace {

using namespace ovq;
using ovq::test::random_matrix;
using ovq::test::relative_error;

// Normalised error of a 16-bit run against the double reference: the inputs themselves carry a
// relative rounding error of 2^-8 (bf16) or 2^-11 (fp16), the outputs one more.
template <class H>
constexpr double half_bound() {
  return std::is_same_v<H, bf16> ? 1.5e-2 : 2e-3;
}

template <class H>
RowMatrix<H> to_half(const RowMatrix<float>& m) {
  return m.unaryExpr([](float x) { return narrow<H>(x); });
}
template <class H>
RowMatrix<float> widened(const RowMatrix<H>& m) {
  return m.unaryExpr([](H x) { return widen(x); });
}

template <class A, class B>
bool same_bits(const A& a, const B& b) {
  static_assert(sizeof(typename A::Scalar) == sizeof(typename B::Scalar), "same width");
  return a.rows() == b.rows() && a.cols() == b.cols() &&
         std::memcmp(a.data(), b.data(), sizeof(typename A::Scalar) * a.size()) == 0;
}

// Inputs of a multi-head stream, 16-bit and widened.
template <class H>
struct Inputs {
  RowMatrix<H> q, k, v;
  RowMatrix<float> qf, kf, vf;
};

template <class H>
Inputs<H> inputs(Index hq, Index hkv, Index t, Index dk, Index dv, std::uint64_t seed,
                 bool unit_keys = false) {
  RowMatrix<float> q = random_matrix<float>(hq * t, dk, seed);
  RowMatrix<float> k = random_matrix<float>(hkv * t, dk, seed + 1);
  if (unit_keys) k.rowwise().normalize();
  const RowMatrix<float> v = random_matrix<float>(hkv * t, dv, seed + 2);
  Inputs<H> in{to_half<H>(q), to_half<H>(k), to_half<H>(v), {}, {}, {}};
  in.qf = widened(in.q);
  in.kf = widened(in.k);
  in.vf = widened(in.v);
  return in;
}

// The layer fed in pieces (1: a step), outputs in the layer's element type.
template <class Layer, class M>
M feed(Layer& layer, const M& q, const M& k, const M& v, Index hq, Index hkv, Index t,
       const std::vector<Index>& pieces) {
  M o(q.rows(), layer.value_dim());
  Index pos = 0;
  for (std::size_t i = 0; pos < t; ++i) {
    const Index len = i < pieces.size() ? std::min(pieces[i], t - pos) : t - pos;
    M qp(hq * len, q.cols()), kp(hkv * len, k.cols()), vp(hkv * len, v.cols()),
        op(hq * len, layer.value_dim());
    for (Index h = 0; h < hq; ++h) qp.middleRows(h * len, len) = q.middleRows(h * t + pos, len);
    for (Index h = 0; h < hkv; ++h) {
      kp.middleRows(h * len, len) = k.middleRows(h * t + pos, len);
      vp.middleRows(h * len, len) = v.middleRows(h * t + pos, len);
    }
    if (len == 1) {
      layer.step(qp, kp, vp, op);
    } else {
      layer.forward(qp, kp, vp, op);
    }
    for (Index h = 0; h < hq; ++h) o.middleRows(h * t + pos, len) = op.middleRows(h * len, len);
    pos += len;
  }
  return o;
}

const std::vector<std::vector<Index>> kCuts = {{}, {33, 1, 1, 1, 50}, {1, 1, 7, 64, 2}};

// Whether the native kernels of H compute exactly the float kernels on the widened values: all
// but bf16 on AVX512-BF16 and AMX, whose products come from pair dot products or tiles (another
// rounding order).
template <class H>
constexpr bool native_widens_exactly() {
  return !(std::is_same_v<H, bf16> && (std::is_same_v<arch::native, arch::avx512bf16> ||
                                       std::is_same_v<arch::native, arch::amx>));
}

// The double reference of causal self-attention over one head's widened rows.
RowMatrix<double> self_reference(const RowMatrix<float>& q, const RowMatrix<float>& k,
                                 const RowMatrix<float>& v, Index hq, Index hkv, Index t,
                                 double beta, Index window) {
  RowMatrix<double> o(q.rows(), v.cols());
  const Index g = hq / hkv;
  for (Index h = 0; h < hq; ++h)
    o.middleRows(h * t, t) = ref::self_attention(
        q.middleRows(h * t, t).cast<double>(), k.middleRows(h / g * t, t).cast<double>(),
        v.middleRows(h / g * t, t).cast<double>(), beta, true, window);
  return o;
}

}  // namespace

TEMPLATE_TEST_CASE("16-bit self-attention == the float mixer on the widened values, rounded "
                   "once; within its bound of the reference; any cut, any architecture",
                   "[half][self]", bf16, fp16) {
  using H = TestType;
  const Index hq = 4, hkv = 2, t = 150, dk = 40, dv = 24;
  const Inputs<H> in = inputs<H>(hq, hkv, t, dk, dv, 7);
  for (const Index window : {Index(0), Index(30)}) {
    SelfAttentionOptions opt;
    opt.beta = 0.3;
    opt.window = window;
    opt.chunk = 32;
    MultiHead<SelfAttention<float>> f(SelfAttention<float>(opt), 1, hq, hkv, dk, dv);
    const RowMatrix<float> of = f.forward(in.qf, in.kf, in.vf);
    const RowMatrix<H> rounded = to_half<H>(of);
    RowMatrix<H> first;
    for (const auto& cut : kCuts) {
      MultiHead<SelfAttention<H>> layer(SelfAttention<H>(opt), 1, hq, hkv, dk, dv);
      const RowMatrix<H> o = feed(layer, in.q, in.k, in.v, hq, hkv, t, cut);
      INFO("window " << window << ", pieces " << cut.size());
      if constexpr (native_widens_exactly<H>()) {
        CHECK(same_bits(o, rounded));
      } else {
        CHECK(relative_error(widened(o), of) < half_bound<H>());
      }
      if (first.size() == 0) first = o;
      CHECK(same_bits(o, first));
      CHECK(same_bits(as_eigen(layer.state(0, 1).keys()), to_half<H>(as_eigen(f.state(0, 1).keys()))));
    }
    CHECK(relative_error(widened(rounded),
                         self_reference(in.qf, in.kf, in.vf, hq, hkv, t, 0.3, window)) <
          half_bound<H>());
    // The portable kernels: the portable float mixer's bits, rounded.
    MultiHead<SelfAttention<float, arch::scalar>> fs(SelfAttention<float, arch::scalar>(opt), 1,
                                                      hq, hkv, dk, dv);
    MultiHead<SelfAttention<H, arch::scalar>> hs(SelfAttention<H, arch::scalar>(opt), 1, hq,
                                                  hkv, dk, dv);
    CHECK(same_bits(hs.forward(in.q, in.k, in.v), to_half<H>(fs.forward(in.qf, in.kf, in.vf))));
  }
}

TEMPLATE_TEST_CASE("16-bit linear attention == the float mixer on the widened values, rounded "
                   "once; its sums in float",
                   "[half][linear]", bf16, fp16) {
  using H = TestType;
  const Index hq = 2, hkv = 1, t = 100, dk = 20, dv = 18;
  const Inputs<H> in = inputs<H>(hq, hkv, t, dk, dv, 17);
  LinearAttentionOptions opt;
  opt.chunk = 16;
  opt.feature_map = kernels::FeatureMap::elu1;
  opt.normalize = true;
  opt.decay = 0.98;
  MultiHead<LinearAttention<float>> f(LinearAttention<float>(opt), 1, hq, hkv, dk, dv);
  const RowMatrix<H> rounded = to_half<H>(f.forward(in.qf, in.kf, in.vf));
  for (const auto& cut : kCuts) {
    MultiHead<LinearAttention<H>> layer(LinearAttention<H>(opt), 1, hq, hkv, dk, dv);
    CHECK(same_bits(feed(layer, in.q, in.k, in.v, hq, hkv, t, cut), rounded));
    CHECK(layer.state(0, 0).kv() == f.state(0, 0).kv());
    CHECK(layer.state(0, 0).k_sum() == f.state(0, 0).k_sum());
  }
}

TEMPLATE_TEST_CASE("16-bit OVQ-attention: the float dictionary of the widened stream bit for "
                   "bit, its read rows those means rounded; outputs within the bound",
                   "[half][ovq]", bf16, fp16) {
  using H = TestType;
  const Index hq = 2, hkv = 2, t = 300, dk = 24, dv = 16;
  const Inputs<H> in = inputs<H>(hq, hkv, t, dk, dv, 27, true);
  for (const bool renormalize : {false, true}) {
    OvqOptions opt;
    opt.capacity = 64;
    opt.chunk = 16;
    opt.beta = 3.0;
    opt.renormalize = renormalize;
    MultiHead<OvqAttention<float>> f(OvqAttention<float>(opt), 1, hq, hkv, dk, dv);
    const RowMatrix<float> of = f.forward(in.qf, in.kf, in.vf);
    RowMatrix<H> first;
    for (const auto& cut : kCuts) {
      MultiHead<OvqAttention<H>> layer(OvqAttention<H>(opt), 1, hq, hkv, dk, dv);
      const RowMatrix<H> o = feed(layer, in.q, in.k, in.v, hq, hkv, t, cut);
      for (Index h = 0; h < hkv; ++h) {
        const Dictionary<H>& d = layer.state(0, h).dictionary();
        const Dictionary<float>& df = f.state(0, h).dictionary();
        REQUIRE(d.size() == df.size());
        for (Index r = 0; r < d.size(); ++r) CHECK(d.count(r) == df.count(r));
        CHECK(as_eigen(d.mean_keys()) == as_eigen(df.keys()));
        CHECK(as_eigen(d.mean_values()) == as_eigen(df.values()));
        CHECK(same_bits(as_eigen(d.keys()), to_half<H>(as_eigen(df.keys()))));
        CHECK(same_bits(as_eigen(d.values()), to_half<H>(as_eigen(df.values()))));
      }
      CHECK(relative_error(widened(o), of) < half_bound<H>());
      if (first.size() == 0) first = o;
      CHECK(same_bits(o, first));
    }
  }
}

TEMPLATE_TEST_CASE("16-bit VQ-attention: the float counts and means of the widened stream, "
                   "outputs within the bound",
                   "[half][vq]", bf16, fp16) {
  using H = TestType;
  const Index hq = 2, hkv = 1, t = 120, dk = 16, dv = 12;
  const Inputs<H> in = inputs<H>(hq, hkv, t, dk, dv, 37);
  const RowMatrix<H> codebook = to_half<H>(random_matrix<float>(24, dk, 39));
  VqAttentionOptions opt;
  opt.chunk = 16;
  const VqAttention<float> fm(opt);
  MultiHead<VqAttention<float>> f(fm, 1, hq, {fm.make_state(widened(codebook), dv)});
  const RowMatrix<float> of = f.forward(in.qf, in.kf, in.vf);
  const VqAttention<H> hm(opt);
  MultiHead<VqAttention<H>> layer(hm, 1, hq, {hm.make_state(codebook, dv)});
  const RowMatrix<H> o = feed(layer, in.q, in.k, in.v, hq, hkv, t, {5, 1, 40});
  const Dictionary<H>& d = layer.state(0, 0).dictionary();
  const Dictionary<float>& df = f.state(0, 0).dictionary();
  for (Index r = 0; r < d.size(); ++r) CHECK(d.count(r) == df.count(r));
  CHECK(as_eigen(d.mean_values()) == as_eigen(df.values()));
  CHECK(relative_error(widened(o), of) < half_bound<H>());
}

TEST_CASE("16-bit running means keep moving where 16-bit rows would freeze", "[half][ovq]") {
  // One centroid; its keys' second entry 0.5 for 1000 tokens, then -0.25: after c tokens an
  // update moves the mean by 0.75 / c, below half a bf16 ulp of 0.5 (2^-9) from the start of
  // the second stretch.
  OvqOptions opt;
  opt.capacity = 1;
  opt.chunk = 1;
  const Index t = 4000, d = 4;
  RowMatrix<float> k(t, d), v(t, d), q = RowMatrix<float>::Zero(t, d);
  for (Index i = 0; i < t; ++i) {
    k.row(i) << 1.0f, (i < 1000 ? 0.5f : -0.25f), 0.0f, 0.125f;
    v.row(i) << float(i % 3), 1.0f, -1.0f, 0.0f;
  }
  const RowMatrix<bf16> kh = to_half<bf16>(k), vh = to_half<bf16>(v), qh = to_half<bf16>(q);
  MultiHead<OvqAttention<bf16>> layer(OvqAttention<bf16>(opt), 1, 1, 1, d, d);
  layer.forward(qh, kh, vh);
  MultiHead<OvqAttention<float>> f(OvqAttention<float>(opt), 1, 1, 1, d, d);
  f.forward(q, k, v);
  const Dictionary<bf16>& dh = layer.state(0, 0).dictionary();
  CHECK(as_eigen(dh.mean_keys()) == as_eigen(f.state(0, 0).dictionary().keys()));
  // The exact mean of the keys' second entry: (1000 0.5 - 3000 0.25) / 4000 = -0.0625.
  CHECK(std::abs(dh.mean_keys().row(0)[1] + 0.0625f) < 1e-5f);
  CHECK(std::abs(widen(dh.keys().row(0)[1]) + 0.0625f) < 1e-3f);
  // A mean kept in bf16 and updated by (k - D) / c from the same start never leaves 0.5
  // (every increment of the second stretch rounds away).
  bf16 frozen = kh(0, 1);
  for (Index i = 1; i < t; ++i)
    frozen = narrow<bf16>(widen(frozen) + (widen(kh(i, 1)) - widen(frozen)) / float(i + 1));
  CHECK(widen(frozen) == 0.5f);
}

TEMPLATE_TEST_CASE("16-bit states round-trip through state files bit for bit; the element type "
                   "is recorded and checked",
                   "[half][state]", bf16, fp16) {
  using H = TestType;
  using ovq::test::MessageHas;
  const Index t = 70, dk = 12, dv = 8;
  const Inputs<H> in = inputs<H>(1, 1, t, dk, dv, 47, true);
  OvqOptions opt;
  opt.capacity = 16;
  opt.chunk = 8;
  const OvqAttention<H> mixer(opt);
  auto state = mixer.make_state(dk, dv);
  mixer.forward(state, in.q, in.k, in.v);
  const std::vector<unsigned char> bytes = io::encode_state(mixer, state);
  const auto loaded = io::decode_state(mixer, bytes.data(), bytes.size());
  CHECK(loaded == state);
  CHECK_THROWS_MATCHES(io::decode_state(OvqAttention<float>(opt), bytes.data(), bytes.size()),
                       FormatError, MessageHas({"expected 4 bytes (float32", "the file's: ",
                                                element_name<H>()}));
  SelfAttentionOptions so;
  const SelfAttention<H> self(so);
  auto cache = self.make_state(dk, dv);
  self.forward(cache, in.q, in.k, in.v);
  const std::vector<unsigned char> self_bytes = io::encode_state(self, cache);
  CHECK(io::decode_state(self, self_bytes.data(), self_bytes.size()) == cache);
  LinearAttentionOptions lo;
  lo.chunk = 16;
  const LinearAttention<H> linear(lo);
  auto ls = linear.make_state(dk, dv);
  linear.forward(ls, in.q, in.k, in.v);
  const std::vector<unsigned char> linear_bytes = io::encode_state(linear, ls);
  CHECK(io::decode_state(linear, linear_bytes.data(), linear_bytes.size()) == ls);
  // VQ: a 16-bit codebook beside float mean values, a partial chunk pending (t = 70).
  VqAttentionOptions vo;
  vo.chunk = 16;
  const VqAttention<H> vq(vo);
  auto vs = vq.make_state(to_half<H>(random_matrix<float>(24, dk, 48)), dv);
  vq.forward(vs, in.q, in.k, in.v);
  REQUIRE(vs.pending() > 0);
  const std::vector<unsigned char> vq_bytes = io::encode_state(vq, vs);
  CHECK(io::decode_state(vq, vq_bytes.data(), vq_bytes.size()) == vs);
}

// One architecture's 16-bit self-attention against its float kernels on the widened values:
// grouped heads with tails of every vector width, then single heads wide enough for every P V
// block of a single row (dv = 182: 2 x 64 + 32 + 2 x 8 + 6 on AVX2), fed in pieces down to single
// steps.
template <class H, class Arch>
void check_architecture(const char* name) {
  INFO("architecture " << name);
  struct Shape {
    Index hq, hkv, dv;
    std::vector<Index> pieces;
  };
  for (const Shape& shape : {Shape{4, 1, 33, {}}, Shape{2, 2, 182, {1, 1, 7, 64, 1, 2}}}) {
    const Index t = 200, dk = 45;
    INFO("hq " << shape.hq << ", hkv " << shape.hkv << ", dv " << shape.dv);
    const Inputs<H> in = inputs<H>(shape.hq, shape.hkv, t, dk, shape.dv, 67);
    SelfAttentionOptions opt;
    opt.beta = 0.4;
    opt.chunk = 48;
    MultiHead<SelfAttention<float, Arch>> f(SelfAttention<float, Arch>(opt), 1, shape.hq,
                                            shape.hkv, dk, shape.dv);
    MultiHead<SelfAttention<H, Arch>> h(SelfAttention<H, Arch>(opt), 1, shape.hq, shape.hkv, dk,
                                        shape.dv);
    CHECK(same_bits(feed(h, in.q, in.k, in.v, shape.hq, shape.hkv, t, shape.pieces),
                    to_half<H>(f.forward(in.qf, in.kf, in.vf))));
  }
}

TEMPLATE_TEST_CASE("16-bit micro-kernels of every architecture widen their loads exactly: the "
                   "float kernels' bits on the widened values",
                   "[half][arch]", bf16, fp16) {
  using H = TestType;
  check_architecture<H, arch::scalar>("scalar");
#if defined(OVQ_ARCH_AVX2)
  check_architecture<H, arch::avx2>("avx2");
  check_architecture<H, ovq::test::emulated_avx512>("avx512 (emulated)");
#endif
#if defined(OVQ_ARCH_AVX512)
  check_architecture<H, arch::avx512>("avx512");
#endif
  if constexpr (std::is_same_v<H, fp16>) {
#if defined(OVQ_ARCH_AVX512BF16)
    check_architecture<H, arch::avx512bf16>("avx512bf16 (fp16: as avx512)");
#endif
  }
}

// The read holds its stacked queries in TileOps::Query (float where the kernels widen their
// operands as they load them): the scores of a 16-bit query and of its widening are the same
// bits, in every block shape, so widening once per tile changes nothing.
template <class H, class Arch>
void check_query_forms(const char* name) {
  INFO("architecture " << name);
  using Ops = kernels::TileOps<H, Arch>;
  using Query = typename Ops::Query;
  constexpr Index kTile = Ops::kKeyTile;
  const Index bq = 7, d = 45;  // every register block (6, 4, 2, 1 rows) and a vector tail
  const Inputs<H> in = inputs<H>(1, 1, std::max<Index>(bq, kTile), d, 1, 71);
  std::vector<Query> q_held(static_cast<std::size_t>(bq * d));
  kernels::copy_query(in.q.data(), bq * d, q_held.data());
  const H* keys[kTile];
  for (Index j = 0; j < kTile; ++j) keys[j] = in.k.data() + j * d;
  std::vector<float> from_elements(static_cast<std::size_t>(bq * kTile));
  std::vector<float> from_queries(from_elements.size());
  Ops::scores_rows(in.q.data(), d, bq, keys, d, 0.75f, from_elements.data());
  Ops::scores_rows(q_held.data(), d, bq, keys, d, 0.75f, from_queries.data());
  CHECK(std::memcmp(from_elements.data(), from_queries.data(),
                    from_elements.size() * sizeof(float)) == 0);
}

TEMPLATE_TEST_CASE("16-bit score kernels: a query held widened scores the same bits as the "
                   "query itself",
                   "[half][arch]", bf16, fp16) {
  using H = TestType;
  check_query_forms<H, arch::scalar>("scalar");
#if defined(OVQ_ARCH_AVX2)
  check_query_forms<H, arch::avx2>("avx2");
  check_query_forms<H, ovq::test::emulated_avx512>("avx512 (emulated)");
  if constexpr (std::is_same_v<H, bf16>) {
    check_query_forms<H, ovq::test::emulated_avx512bf16>("avx512bf16 (emulated)");
  }
#endif
#if defined(OVQ_ARCH_AVX512)
  check_query_forms<H, arch::avx512>("avx512");
#endif
#if defined(OVQ_ARCH_AVX512BF16)
  check_query_forms<H, arch::avx512bf16>("avx512bf16");
#endif
}

// bf16 self-attention (beta 0.4, chunks of 40) on the kernels of Arch, fed in pieces.
template <class Arch>
RowMatrix<bf16> bf16_self_run(const Inputs<bf16>& in, Index hq, Index hkv, Index t, Index window,
                              const std::vector<Index>& cut) {
  SelfAttentionOptions opt;
  opt.beta = 0.4;
  opt.chunk = 40;
  opt.window = window;
  MultiHead<SelfAttention<bf16, Arch>> layer(SelfAttention<bf16, Arch>(opt), 1, hq, hkv,
                                             in.q.cols(), in.v.cols());
  return feed(layer, in.q, in.k, in.v, hq, hkv, t, cut);
}

#if defined(OVQ_ARCH_AVX2)
// bf16 self-attention with the pair dot products of AVX512-BF16 (emulated, and the hardware's
// where the CPU has them): within the bf16 bound of the reference, the same bits however the
// stream is cut (one micro-kernel for every row), and the hardware gives the emulation's bits.
template <class Arch>
RowMatrix<bf16> pair_dot_run(const Inputs<bf16>& in, Index hq, Index hkv, Index t,
                             const std::vector<Index>& cut) {
  return bf16_self_run<Arch>(in, hq, hkv, t, 0, cut);
}

TEST_CASE("bf16 scores by AVX512-BF16 pair dot products: within the bf16 bound, any cut, the "
          "hardware == its emulation",
          "[half][arch][bf16dot]") {
  const Index hq = 4, hkv = 2, t = 130, dk = 70, dv = 24;  // 70 = 2 steps of 32 and a tail of 6
  const Inputs<bf16> in = inputs<bf16>(hq, hkv, t, dk, dv, 77);
  using Emulated = ovq::test::emulated_avx512bf16;
  const RowMatrix<bf16> whole = pair_dot_run<Emulated>(in, hq, hkv, t, {});
  CHECK(relative_error(widened(whole), self_reference(in.qf, in.kf, in.vf, hq, hkv, t, 0.4, 0)) <
        half_bound<bf16>());
  for (const auto& cut : kCuts) CHECK(same_bits(pair_dot_run<Emulated>(in, hq, hkv, t, cut), whole));
#if defined(OVQ_ARCH_AVX512BF16)
  CHECK(same_bits(pair_dot_run<arch::avx512bf16>(in, hq, hkv, t, {}), whole));
  CHECK(same_bits(pair_dot_run<arch::avx512bf16>(in, hq, hkv, t, {1, 1, 50, 3}), whole));
#endif
}
#endif

#if defined(OVQ_ARCH_AVX512BF16)
// The hardware's P V of a tile (Bf16PairValues: the few-rows kernels, with whole 32-column
// chunks split into even and odd columns and 16-column blocks after them, and the packed kernel
// of more rows) against its emulation, bit for bit, for widths around those chunks and blocks.
TEST_CASE("bf16 P V by AVX512-BF16 pair dot products: the hardware == its emulation, any rows "
          "and width",
          "[half][arch][bf16dot]") {
  constexpr Index kTile = 64;
  for (const Index bq : {Index(1), Index(2), Index(3), Index(4), Index(5), Index(8), Index(9),
                         Index(13)}) {
    for (const Index dv : {Index(1), Index(15), Index(16), Index(24), Index(32), Index(40),
                           Index(64), Index(96), Index(112), Index(128), Index(130)}) {
      INFO("bq " << bq << " dv " << dv);
      const auto seed = 900 + static_cast<std::uint64_t>(bq * 1000 + dv);
      const Inputs<bf16> in = inputs<bf16>(1, 1, kTile, 1, dv, seed);
      RowMatrix<float> p = random_matrix<float>(bq, kTile, seed + 1).cwiseAbs();
      p(0, 3) = 0.0f;  // masked slots weigh exact zeros
      const bf16* values[kTile];
      for (Index j = 0; j < kTile; ++j) values[j] = in.v.data() + ((j * 7) % kTile) * dv;
      const RowMatrix<float> acc0 = random_matrix<float>(bq, dv, seed + 2);
      RowMatrix<float> hardware = acc0, emulated = acc0;
      kernels::TileOps<bf16, arch::avx512bf16>::accumulate_tile(p.data(), bq, values, dv,
                                                                hardware.data(), dv,
                                                                kernels::NoPacing{});
      test::EmulatedBf16PairValues::accumulate_tile(p.data(), bq, values, dv, emulated.data(), dv,
                                                    kernels::NoPacing{});
      CHECK(std::memcmp(hardware.data(), emulated.data(), sizeof(float) * bq * dv) == 0);
    }
  }
}
#endif

// ---- bf16 reads on AMX tiles ----

// Whether this process runs the hardware's tile kernels.
bool hardware_tiles() {
#if defined(OVQ_ARCH_AMX)
  return kernels::amx::usable();
#else
  return false;
#endif
}

// The tile kernels' scores against the exact dot products: each 32-feature chunk rounds once
// (the emulation) or within the hardware's own order, so within `bound` of the sum of the
// products' magnitudes. And a row's scores are the same bits whatever else its call holds.
// spacing 0: the key rows in a scrambled order; s > 0: evenly spaced, s d elements apart (the
// few-rows kernels read those in place when d is a multiple of 32).
template <class Arch>
void check_tile_scores(Index bq, Index d, Index spacing, double bound, std::uint64_t seed) {
  using Ops = kernels::TileOps<bf16, Arch>;
  constexpr Index kTile = Ops::kKeyTile;
  INFO(Arch::kName << " bq " << bq << " d " << d << " spacing " << spacing);
  const Inputs<bf16> in = inputs<bf16>(1, 1, std::max(bq, kTile) * 2, d, 1, seed);
  const bf16* keys[kTile];
  for (Index j = 0; j < kTile; ++j)
    keys[j] = in.k.data() + (spacing == 0 ? (j * 7) % kTile : j * spacing) * d;
  const float beta = 0.75f;
  std::vector<float> s(static_cast<std::size_t>(bq * kTile)), one(kTile);
  Ops::scores_rows(in.q.data(), d, bq, keys, d, beta, s.data());
  double worst = 0;
  bool rows_alone = true;
  for (Index i = 0; i < bq; ++i) {
    Ops::scores_rows(in.q.data() + i * d, d, 1, keys, d, beta, one.data());
    rows_alone = rows_alone &&
                 std::memcmp(one.data(), s.data() + i * kTile, sizeof(float) * kTile) == 0;
    for (Index j = 0; j < kTile; ++j) {
      double exact = 0, magnitude = 0;
      for (Index f = 0; f < d; ++f) {
        const double x = static_cast<double>(in.qf(i, f)) * widen(keys[j][f]);
        exact += x;
        magnitude += std::abs(x);
      }
      worst = std::max(worst, std::abs(s[i * kTile + j] - beta * exact) / (beta * magnitude));
    }
  }
  CHECK(rows_alone);
  CHECK(worst < bound);
}

// acc += bf16(P) V against the same sums in double.
template <class Arch>
void check_tile_values(Index bq, Index dv, double bound, std::uint64_t seed) {
  using Ops = kernels::TileOps<bf16, Arch>;
  constexpr Index kTile = Ops::kKeyTile;
  INFO(Arch::kName << " bq " << bq << " dv " << dv);
  const Inputs<bf16> in = inputs<bf16>(1, 1, kTile, 1, dv, seed);
  const RowMatrix<float> p = random_matrix<float>(bq, kTile, seed + 5).cwiseAbs();
  const RowMatrix<float> acc0 = random_matrix<float>(bq, dv, seed + 6);
  const bf16* values[kTile];
  for (Index j = 0; j < kTile; ++j) values[j] = in.v.data() + ((j * 5) % kTile) * dv;
  RowMatrix<float> acc = acc0;
  Ops::accumulate_tile(p.data(), bq, values, dv, acc.data(), dv, kernels::NoPacing{});
  bool rows_alone = true;  // each row alone gives the same bits
  for (Index i = 0; i < bq; ++i) {
    RowMatrix<float> one = acc0.row(i);
    Ops::accumulate_tile(p.data() + i * kTile, 1, values, dv, one.data(), dv, kernels::NoPacing{});
    rows_alone = rows_alone &&
                 std::memcmp(one.data(), acc.data() + i * dv, sizeof(float) * dv) == 0;
  }
  CHECK(rows_alone);
  double worst = 0;
  for (Index i = 0; i < bq; ++i) {
    for (Index c = 0; c < dv; ++c) {
      double exact = acc0(i, c), magnitude = std::abs(acc0(i, c));
      for (Index j = 0; j < kTile; ++j) {
        const double x = static_cast<double>(widen(narrow<bf16>(p(i, j)))) * widen(values[j][c]);
        exact += x;
        magnitude += std::abs(x);
      }
      worst = std::max(worst, std::abs(acc(i, c) - exact) / magnitude);
    }
  }
  CHECK(worst < bound);
}

TEST_CASE("AMX tile kernels (emulated everywhere, and the hardware's): scores and P V within a "
          "rounding per 32-element chunk, a row's scores independent of its call",
          "[half][arch][amx]") {
  for (const Index bq : {Index(1), Index(5), Index(16), Index(37)}) {
    for (const Index d : {Index(7), Index(32), Index(45), Index(128)}) {
      for (const Index spacing : {Index(0), Index(1), Index(2)}) {
        const auto seed = 300 + static_cast<std::uint64_t>(bq * d + spacing);
        check_tile_scores<ovq::test::emulated_amx>(bq, d, spacing, 1e-6, seed);
        if (hardware_tiles()) {
#if defined(OVQ_ARCH_AMX)
          check_tile_scores<arch::amx>(bq, d, spacing, 1e-5, seed);
#endif
        }
      }
    }
    for (const Index dv : {Index(3), Index(16), Index(24), Index(80), Index(128)}) {
      const auto seed = 500 + static_cast<std::uint64_t>(bq * dv);
      check_tile_values<ovq::test::emulated_amx>(bq, dv, 1e-6, seed);
      if (hardware_tiles()) {
#if defined(OVQ_ARCH_AMX)
        check_tile_values<arch::amx>(bq, dv, 1e-5, seed);
#endif
      }
    }
  }
}

#if defined(OVQ_ARCH_AMX)
TEST_CASE("AMX operand packing: AVX-512 moves the portable packing's bits", "[half][arch][amx]") {
  using kernels::amx::Avx512Packing;
  using kernels::amx::PortablePacking;
  constexpr Index kTile = 64;
  for (const Index d : {Index(1), Index(7), Index(32), Index(45), Index(128)}) {
    INFO("d " << d);
    const Inputs<bf16> in = inputs<bf16>(1, 1, kTile, d, d, 800 + static_cast<std::uint64_t>(d));
    const bf16* rows_k[kTile];
    const bf16* rows_v[kTile];
    for (Index j = 0; j < kTile; ++j) {
      rows_k[j] = in.k.data() + ((j * 11) % kTile) * d;
      rows_v[j] = in.v.data() + ((j * 3) % kTile) * d;
    }
    const Index chunks = (d + 31) / 32, blocks = (d + 15) / 16;
    std::vector<std::uint32_t> a(static_cast<std::size_t>(chunks * kTile * 16), 1), b = a;
    PortablePacking::keys(rows_k, kTile, d, a.data());
    Avx512Packing::keys(rows_k, kTile, d, b.data());
    CHECK(a == b);
    std::vector<std::uint32_t> va(static_cast<std::size_t>(2 * blocks * 256), 1), vb = va;
    PortablePacking::values(rows_v, kTile, d, va.data());
    Avx512Packing::values(rows_v, kTile, d, vb.data());
    CHECK(va == vb);
    for (const Index bq : {Index(1), Index(5), Index(16)}) {
      std::vector<std::uint32_t> qa(static_cast<std::size_t>(chunks * 256), 7), qb = qa;
      PortablePacking::queries(in.q.data(), d, bq, d, qa.data());
      Avx512Packing::queries(in.q.data(), d, bq, d, qb.data());
      CHECK(qa == qb);
      const RowMatrix<float> block = random_matrix<float>(kTile, 16, 810);
      std::vector<float> sa(static_cast<std::size_t>(bq * kTile)), sb(sa.size());
      PortablePacking::scores_from_columns(block.data(), bq, kTile, 0.3f, sa.data());
      Avx512Packing::scores_from_columns(block.data(), bq, kTile, 0.3f, sb.data());
      CHECK(sa == sb);
    }
  }
  RowMatrix<float> p = random_matrix<float>(16, 64, 809).cwiseAbs();
  p(0, 3) = 1e-40f;  // denormal: 0 either way
  p(1, 5) = 0.0f;
  for (const Index rows : {Index(1), Index(9), Index(16)}) {
    std::vector<std::uint16_t> wa(16 * 64, 1), wb = wa;
    PortablePacking::weights(p.data(), rows, wa.data());
    Avx512Packing::weights(p.data(), rows, wb.data());
    CHECK(wa == wb);
  }
}
#endif

// bf16 self-attention on tiles (grouped heads, whole tiles of stacked rows and tails of
// features and columns): within the bf16 bound of the reference, the same bits however the
// stream is cut, and the hardware within a rounding of the emulation.

TEST_CASE("bf16 self-attention on AMX tiles: within the bf16 bound, any cut, the hardware "
          "within a rounding of its emulation",
          "[half][arch][amx]") {
  using Emulated = ovq::test::emulated_amx;
  const Index hq = 4, hkv = 2, t = 130;
  for (const auto& [dk, dv] : {std::pair<Index, Index>{70, 24}, std::pair<Index, Index>{64, 32},
                               std::pair<Index, Index>{32, 80}}) {
    for (const Index window : {Index(0), Index(50)}) {
      INFO("dk " << dk << " dv " << dv << " window " << window);
      const Inputs<bf16> in = inputs<bf16>(hq, hkv, t, dk, dv, 91 + static_cast<std::uint64_t>(dk));
      const RowMatrix<bf16> whole = bf16_self_run<Emulated>(in, hq, hkv, t, window, {});
      CHECK(relative_error(widened(whole),
                           self_reference(in.qf, in.kf, in.vf, hq, hkv, t, 0.4, window)) <
            half_bound<bf16>());
      for (const auto& cut : kCuts)
        CHECK(same_bits(bf16_self_run<Emulated>(in, hq, hkv, t, window, cut), whole));
#if defined(OVQ_ARCH_AMX)
      if (hardware_tiles()) {
        const RowMatrix<bf16> hardware = bf16_self_run<arch::amx>(in, hq, hkv, t, window, {});
        CHECK(relative_error(widened(hardware), widened(whole)) < 2e-3);
        for (const auto& cut : kCuts)
          CHECK(same_bits(bf16_self_run<arch::amx>(in, hq, hkv, t, window, cut), hardware));
      }
#endif
    }
  }
}

// bf16 OVQ-attention on tiles (the assignment's scores and the reads): the same bits however
// the stream is cut, outputs within the bf16 bound of the float mixer.
template <class Arch>
void check_ovq_on_tiles(const Inputs<bf16>& in, Index hq, Index hkv, Index t,
                        const RowMatrix<float>& of) {
  INFO(Arch::kName);
  OvqOptions opt;
  opt.capacity = 64;
  opt.chunk = 16;
  opt.beta = 3.0;
  RowMatrix<bf16> first;
  for (const auto& cut : kCuts) {
    MultiHead<OvqAttention<bf16, Arch>> layer(OvqAttention<bf16, Arch>(opt), 1, hq, hkv,
                                              in.q.cols(), in.v.cols());
    const RowMatrix<bf16> o = feed(layer, in.q, in.k, in.v, hq, hkv, t, cut);
    CHECK(relative_error(widened(o), of) < half_bound<bf16>());
    if (first.size() == 0) first = o;
    CHECK(same_bits(o, first));
  }
}

TEST_CASE("bf16 OVQ-attention on AMX tiles: any cut, within the bf16 bound", "[half][ovq][amx]") {
  const Index hq = 4, hkv = 2, t = 200, dk = 40, dv = 32;
  const Inputs<bf16> in = inputs<bf16>(hq, hkv, t, dk, dv, 29, true);
  OvqOptions opt;
  opt.capacity = 64;
  opt.chunk = 16;
  opt.beta = 3.0;
  MultiHead<OvqAttention<float>> f(OvqAttention<float>(opt), 1, hq, hkv, dk, dv);
  const RowMatrix<float> of = f.forward(in.qf, in.kf, in.vf);
  check_ovq_on_tiles<ovq::test::emulated_amx>(in, hq, hkv, t, of);
#if defined(OVQ_ARCH_AMX)
  if (hardware_tiles()) check_ovq_on_tiles<arch::amx>(in, hq, hkv, t, of);
#endif
}

TEMPLATE_TEST_CASE("16-bit inputs are checked like float ones: inf and NaN rejected, the state "
                   "unchanged",
                   "[half][errors]", bf16, fp16) {
  using H = TestType;
  using ovq::test::MessageHas;
  const Inputs<H> in = inputs<H>(1, 1, 10, 8, 8, 57);
  const SelfAttention<H> self;
  auto cache = self.make_state(8, 8);
  self.forward(cache, in.q, in.k, in.v);
  const auto before = cache;
  RowMatrix<H> bad = in.v;
  bad(3, 5) = H(std::numeric_limits<float>::infinity());
  CHECK_THROWS_MATCHES(self.forward(cache, in.q, in.k, bad), ArgumentError,
                       MessageHas({"V(3, 5)", "expected a finite value"}));
  CHECK(cache == before);
}

}  // namespace ovq_test_half
