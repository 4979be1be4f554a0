#pragma once
// The AVX-512 micro-kernels' template (SimdTileOps over 16 lanes) on an AVX2 machine, for tests.
//
// A 16-lane register is two 8-lane halves; every operation is the same IEEE operation on every
// lane as its AVX-512 counterpart in tile_ops.hpp (one rounding each, multiply-adds fused,
// maxima and minima with the same operand order, masked loads that read nothing past their
// end), and the reductions are ovq's fixed trees, which F32x16 also uses. So the kernels' 16-lane
// logic, which an AVX2 CPU cannot otherwise execute (64-key tiles, 6-row score blocks of four
// vectors, 4 x 4 P V blocks, tails of d mod 16 features), runs and is tested on every x86-64 CI
// machine, and where the CPU has AVX-512 a test checks that it gives the hardware kernels' bits.
#include <cmath>
#include <cstring>
#include <limits>

#include "ovq/kernels/arch/tile_ops.hpp"

#if defined(OVQ_ARCH_AVX2)

namespace ovq::test {

// Architecture tag: the AVX-512 kernels' template, emulated (float; double is portable as on
// every architecture).
struct emulated_avx512 {
  static constexpr const char* kName = "avx512-emulated";
};

struct F32x16OnAvx2 {
  struct reg {
    __m256 lo, hi;  // lanes 0-7, 8-15
  };
  using Half = kernels::simd::F32x8;
  static constexpr Index kWidth = 16;

  static reg zero() { return {Half::zero(), Half::zero()}; }
  static reg set1(float x) { return {Half::set1(x), Half::set1(x)}; }
  static reg load(const float* p) { return {Half::load(p), Half::load(p + 8)}; }
  static void store(float* p, reg a) {
    Half::store(p, a.lo);
    Half::store(p + 8, a.hi);
  }
  static reg fmadd(reg a, reg b, reg c) {
    return {Half::fmadd(a.lo, b.lo, c.lo), Half::fmadd(a.hi, b.hi, c.hi)};
  }
  static reg mul(reg a, reg b) { return {Half::mul(a.lo, b.lo), Half::mul(a.hi, b.hi)}; }
  static reg add(reg a, reg b) { return {Half::add(a.lo, b.lo), Half::add(a.hi, b.hi)}; }
  static reg sub(reg a, reg b) { return {Half::sub(a.lo, b.lo), Half::sub(a.hi, b.hi)}; }
  static reg max(reg a, reg b) { return {Half::max(a.lo, b.lo), Half::max(a.hi, b.hi)}; }
  static reg min(reg a, reg b) { return {Half::min(a.lo, b.lo), Half::min(a.hi, b.hi)}; }
  static float reduce_max(reg a) { return kernels::simd::reduce_max8(Half::max(a.lo, a.hi)); }
  static reg iota() { return {Half::iota(), Half::add(Half::iota(), Half::set1(8.0f))}; }
  static reg select_between(reg i, reg lo, reg hi, reg x, reg other) {
    return {Half::select_between(i.lo, lo.lo, hi.lo, x.lo, other.lo),
            Half::select_between(i.hi, lo.hi, hi.hi, x.hi, other.hi)};
  }
  static float reduce_add(reg a) { return kernels::simd::reduce_add8(fold_to_8(a)); }
  static reg round(reg a) { return {Half::round(a.lo), Half::round(a.hi)}; }
  static reg pow2(reg n) { return {Half::pow2(n.lo), Half::pow2(n.hi)}; }
  static reg zero_below(reg x, float lo, reg y) {
    return {Half::zero_below(x.lo, lo, y.lo), Half::zero_below(x.hi, lo, y.hi)};
  }
  // p[0..n), 0 < n < 16, zeros above; reads nothing past p + n.
  static reg load_first(const float* p, Index n) {
    if (n < 8) return {Half::load_first(p, n), Half::zero()};
    if (n == 8) return {Half::load(p), Half::zero()};
    return {Half::load(p), Half::load_first(p + 8, n - 8)};
  }
  static __m256 fold_to_8(reg a) { return Half::add(a.lo, a.hi); }
  // r[i] lane j -> r[j] lane i, as F32x16::transpose (moves only, no arithmetic).
  static void transpose(reg r[16]) {
    alignas(32) float lanes[16][16];
    for (int i = 0; i < 16; ++i) store(lanes[i], r[i]);
    for (int j = 0; j < 16; ++j) {
      alignas(32) float column[16];
      for (int i = 0; i < 16; ++i) column[i] = lanes[i][j];
      r[j] = load(column);
    }
  }
  // 16-bit elements, widened as F32x16 widens them.
  static reg load(const bf16* p) { return {Half::load(p), Half::load(p + 8)}; }
  static reg load(const fp16* p) { return {Half::load(p), Half::load(p + 8)}; }
  template <class H>
  static reg load_first(const H* p, Index n) {
    return load(kernels::simd::first_of<H, 16>(p, n).data);
  }
};

// vdpbf16ps (AVX512-BF16) in software, for CPUs without it: lane l of acc += q[2l+1] k[2l+1],
// then += q[2l] k[2l], each a product of two bf16 (exact in float) added with one rounding;
// denormal inputs count as 0 and denormal results become 0, as the instruction has it.
inline float flush_denormal(float x) {
  return std::abs(x) < std::numeric_limits<float>::min() ? std::copysign(0.0f, x) : x;
}
inline float dp_step(float acc, bf16 a, bf16 b) {
  return flush_denormal(std::fma(flush_denormal(widen(a)), flush_denormal(widen(b)), acc));
}
// vcvtne2ps2bf16: to nearest even, denormals in and out flushed to 0.
inline bf16 to_bf16_flushed(float x) { return narrow<bf16>(flush_denormal(x)); }

struct EmulatedBf16PairDot {
  static constexpr Index kStep = 32;
  using Query = bf16;
  struct Operand {
    bf16 x[32];
  };
  static Operand load(const bf16* p) {
    Operand o;
    std::memcpy(o.x, p, sizeof o.x);
    return o;
  }
  static Operand load_first(const bf16* p, Index n) {
    Operand o{};  // zeros past n
    std::memcpy(o.x, p, static_cast<std::size_t>(n) * sizeof(bf16));
    return o;
  }
  static F32x16OnAvx2::reg madd(const Operand& q, const Operand& k, F32x16OnAvx2::reg acc) {
    alignas(32) float lanes[16];
    F32x16OnAvx2::store(lanes, acc);
    for (int l = 0; l < 16; ++l) {
      lanes[l] = dp_step(lanes[l], q.x[2 * l + 1], k.x[2 * l + 1]);
      lanes[l] = dp_step(lanes[l], q.x[2 * l], k.x[2 * l]);
    }
    return F32x16OnAvx2::load(lanes);
  }

  // Keys along the lanes, as Bf16PairDot has them: a word (32 bits of a 16-lane register) is
  // the pair of bf16 features (2l, 2l + 1), moved as raw bits.
  static constexpr Index kLaneFeatures = 2;
  using reg = F32x16OnAvx2::reg;
  static reg words(const Operand& o) {
    alignas(32) float bits[16];
    std::memcpy(bits, o.x, sizeof bits);
    return F32x16OnAvx2::load(bits);
  }
  static Operand operand(reg w) {
    alignas(32) float bits[16];
    F32x16OnAvx2::store(bits, w);
    Operand o;
    std::memcpy(o.x, bits, sizeof o.x);
    return o;
  }
  static reg key_words(const bf16* p) { return words(load(p)); }
  static reg key_words_first(const bf16* p, Index n) { return words(load_first(p, n)); }
  static reg query_words_first(const bf16* q, Index k, Index d) {
    Operand o;
    for (int l = 0; l < 16; ++l) {
      o.x[2 * l] = k < d ? q[k] : bf16(0.0f);
      o.x[2 * l + 1] = k + 1 < d ? q[k + 1] : bf16(0.0f);
    }
    return words(o);
  }
  static reg query_words(const bf16* q, Index k) { return query_words_first(q, k, k + 2); }
  static reg madd_words(reg q, reg k, reg acc) { return madd(operand(q), operand(k), acc); }
};

// kernels::simd::Bf16PairValues in software: every output entry, pair after pair of the tile's
// slots, acc += P[2m+1] V[2m+1] then += P[2m] V[2m], the weights rounded to bf16.
struct EmulatedBf16PairValues {
  static constexpr Index kTile = 64;
  template <class Pacing>
  static void accumulate_tile(const float* p, Index bq, const bf16* const* v, Index dv,
                              float* acc, Index acc_stride, Pacing) {
    for (Index i = 0; i < bq; ++i) {
      bf16 w[kTile];
      for (Index j = 0; j < kTile; ++j) w[j] = to_bf16_flushed(p[i * kTile + j]);
      for (Index c = 0; c < dv; ++c) {
        float a = acc[i * acc_stride + c];
        for (Index m = 0; m < kTile / 2; ++m) {
          a = dp_step(a, w[2 * m + 1], v[2 * m + 1][c]);
          a = dp_step(a, w[2 * m], v[2 * m][c]);
        }
        acc[i * acc_stride + c] = a;
      }
    }
  }
};

// Architecture tag: AVX512-BF16's kernels, emulated (bf16 scores by EmulatedBf16PairDot; every
// other element as emulated_avx512).
struct emulated_avx512bf16 {
  static constexpr const char* kName = "avx512bf16-emulated";
};

}  // namespace ovq::test

namespace ovq::kernels {
template <>
struct TileOps<float, test::emulated_avx512> : simd::SimdTileOps<test::F32x16OnAvx2> {};
template <>
struct TileOps<double, test::emulated_avx512> : TileOps<double, arch::scalar> {};
template <>
struct TileOps<bf16, test::emulated_avx512> : simd::SimdTileOps<test::F32x16OnAvx2, bf16> {};
template <>
struct TileOps<fp16, test::emulated_avx512> : simd::SimdTileOps<test::F32x16OnAvx2, fp16> {};
template <class Element>
struct TileOps<Element, test::emulated_avx512bf16> : TileOps<Element, test::emulated_avx512> {};
template <>
struct TileOps<bf16, test::emulated_avx512bf16>
    : simd::SimdTileOps<test::F32x16OnAvx2, bf16, test::EmulatedBf16PairDot>,
      test::EmulatedBf16PairValues {
  static constexpr bool kPairedValues = true;
  using test::EmulatedBf16PairValues::accumulate_tile;
};
}  // namespace ovq::kernels

#endif
