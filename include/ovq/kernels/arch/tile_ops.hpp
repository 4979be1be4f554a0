#pragma once
// The micro-kernels of the fused read, per architecture. The tile loop (kernels/read.hpp) is
// written once; only these inner operations differ.
//
//   scores_rows    S[i][j] = beta q_i . K[j]        q: bq x d (row-major), K: kKeyTile key rows
//   mask_max       one score row: slots outside [lo, hi) -> -inf, visible ones saturated to the
//                  finite range (NaN -> -max), returns the largest visible score
//   exp_sum        s[j] = exp(s[j] - m) over one score row (kKeyTile entries), returns sum_j s[j]
//   scale          x[c] *= f over n entries (exact: each product rounds once, in any order)
//   accumulate     acc[i][:] += sum_j P[i][j] V[j][:]    P: bq x kKeyTile, V: bk x dv (acc[i]
//                  first multiplied by keep[i] where factors are given)
//   any_greater    whether s[j] (+ o[j]) > t for some j < n: lets the assignment's argmax skip
//                  a score row that cannot change its running best (exact: a NaN never wins)
// and, for linear attention's chunk products, which score many rows against the same keys:
//   scores_packed  S[i][j] = beta q_i . K[j]        K^T panel (d x kKeyTile, key fastest), from
//                                                   pack_key_panels
// and, where the kernels have them (packs_keys_v), for callers that score many rows against the
// same key tiles: pack_keys (one tile, once) and scores_rows_packed (scores_rows from it).
//
// The read's scores (scores_rows) are each computed from q_i and K[j] alone, by the same
// operations whatever the number of query rows and whichever block a score falls in: a query's
// scores do not depend on what else is in its tile, which is what makes a read independent of
// how the stream was cut into calls. Portable: one chain over the features in order. SIMD: W
// lanes, lane l summing the features k = l (mod W) in order (fused), the lanes then added by one
// fixed tree. A few rows (a decode step, which scores each key once) read the key rows in place
// and add each score's lanes by shuffles; many rows score from the tile transposed (keys along
// the lanes: lane l's sums for W keys are one vector, and the tree adds whole vectors), the same
// operations on the same values. (AMX tiles, amx.hpp: two operand layouts, for few rows and for
// many, that give each score the same products and so the same bits.) scores_packed is one chain
// per score in feature order (bitwise the portable scores_rows).
// scores_rows takes its queries in TileOps::Query (float for every kernel that widens its
// operands before multiplying, so the read widens a 16-bit query once per tile) or in the element.
// scores_rows and accumulate take a pacing hook (NoPacing below by default), through which a
// decode issues its prefetches between register blocks.
// TileOps<Scalar, arch::scalar> is plain C++ and always available. The SIMD versions (float,
// AVX-512 and AVX2+FMA) share one register-blocked template over a small vector wrapper.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "ovq/core/types.hpp"
#include "ovq/kernels/arch/arch.hpp"

#if defined(OVQ_ARCH_AVX512) || defined(OVQ_ARCH_AVX2)
#include <immintrin.h>
#endif

namespace ovq::kernels {

template <class Scalar, class Arch>
struct TileOps;

// The micro-kernels' pacing hook: `advance(flops)` runs before each register block (a score
// block, or a few keys of a P V block) with the flops that block is about to spend; over one
// call they add up to the call's cost. A decode streaming its memory rows
// (read_detail::TileStream) issues the next tile's prefetches through it, a few cache lines at
// a time, spread over this tile's arithmetic. NoPacing does nothing.
struct NoPacing {
  void advance(Index /*flops*/) const {}
};

// A scope whose kernel calls share their set-up: Ops::Session where the kernels have one (AMX:
// the tile configuration, loaded once for the scope), nothing otherwise.
template <class Ops, class = void>
struct TileSession {};
template <class Ops>
struct TileSession<Ops, std::void_t<typename Ops::Session>> : Ops::Session {};

// Kernels that can score from packed keys (SIMD lane sums from key panels, AMX tiles): a caller
// that scores many rows against the same keys (a read of several query tiles, an assignment)
// packs every key tile once (Ops::pack_keys, into Ops::PackedWords) and scores from the packed
// copy (Ops::scores_rows_packed, the same bits as Ops::scores_rows).
template <class Ops, class = void>
inline constexpr bool packs_keys_v = false;
template <class Ops>
inline constexpr bool packs_keys_v<Ops, std::void_t<decltype(&Ops::packs_keys)>> = true;
// Kernels whose P V takes the tile's values packed (AMX tiles): such a caller packs every tile's
// values once too (Ops::pack_values) and accumulates from the copy
// (Ops::accumulate_tile_packed, the same bits as Ops::accumulate_tile).
template <class Ops, class = void>
inline constexpr bool packs_values_v = false;
template <class Ops>
inline constexpr bool packs_values_v<Ops, std::void_t<decltype(&Ops::packs_values)>> = true;
template <class Ops, class = void>
struct packed_word {
  using type = std::uint32_t;  // unused: nothing is packed
};
template <class Ops>
struct packed_word<Ops, std::void_t<typename Ops::PackedWord>> {
  using type = typename Ops::PackedWord;
};
template <class Ops>
using packed_word_t = typename packed_word<Ops>::type;

// a * b + c, rounded the same way in every compiled copy of a kernel: one fused operation where
// the target has FMA, two roundings where it has none. Left to the compiler, GCC's default
// -ffp-contract=fast may fuse one inlined copy and not another, and then a query read in a
// different call shape (decode vs prefill) would get different bits.
template <class Scalar>
inline Scalar fused_multiply_add(Scalar a, Scalar b, Scalar c) {
#if defined(OVQ_HAS_FMA)
  return std::fma(a, b, c);
#else
  const Scalar product = a * b;
  return product + c;
#endif
}

// A query row in the micro-kernels' query type (TileOps::Query): the element itself, or its
// compute type (the exact widening). Cost: n copies.
template <class Element, class Query>
inline void copy_query(const Element* x, Index n, Query* out) {
  static_assert(std::is_same_v<Query, Element> || std::is_same_v<Query, compute_t<Element>>,
                "a query row is held in its element or its compute type");
  if constexpr (std::is_same_v<Query, Element>) {
    std::copy(x, x + n, out);
  } else {
    for (Index c = 0; c < n; ++c) out[c] = widen(x[c]);
  }
}

// For the users of scores_packed: K (n x d) -> panels of kTile keys, each d x kTile (key index
// fastest), zero-padded. Cost: n d copies.
template <class Scalar, Index kTile>
void pack_key_panels(ConstRowsView<Scalar> keys, AlignedVector<Scalar>& panels) {
  const Index tiles = (keys.rows + kTile - 1) / kTile;
  const Index d = keys.cols;
  panels.assign(static_cast<std::size_t>(tiles * d * kTile), Scalar(0));
  for (Index t = 0; t < tiles; ++t) {
    Scalar* panel = panels.data() + t * d * kTile;
    const Index bk = std::min(kTile, keys.rows - t * kTile);
    for (Index j = 0; j < bk; ++j) {
      const Scalar* row = keys.row(t * kTile + j);
      for (Index k = 0; k < d; ++k) panel[k * kTile + j] = row[k];
    }
  }
}

// ---- portable ----

// Elements are widened to their compute type as they are read (exact), so a 16-bit kernel
// computes what the compute type's kernel computes on the widened values.
template <class Element>
struct TileOps<Element, arch::scalar> {
  using Compute = compute_t<Element>;
  static constexpr Index kKeyTile = 64;
  // P V by accumulate() over each segment of a tile (see accumulate_tile below for the other way).
  static constexpr bool kPairedValues = false;
  // What the read holds its stacked queries in (Query below): widened once per tile.
  using Query = Compute;

  // Cost: 2 bq kKeyTile d flops.
  static void scores_packed(const Compute* q, Index q_stride, Index bq, const Compute* panel,
                            Index d, Compute beta, Compute* s) {
    for (Index i = 0; i < bq; ++i) {
      Compute* row = s + i * kKeyTile;
      std::fill(row, row + kKeyTile, Compute(0));
      const Compute* qi = q + i * q_stride;
      for (Index k = 0; k < d; ++k) {
        const Compute a = qi[k];
        const Compute* p = panel + k * kKeyTile;
        for (Index j = 0; j < kKeyTile; ++j) row[j] = fused_multiply_add(a, p[j], row[j]);
      }
      for (Index j = 0; j < kKeyTile; ++j) row[j] *= beta;
    }
  }

  // keys[j] (d entries each, all non-null); q holds Elements or Queries (the same values).
  // Cost: 2 bq kKeyTile d flops.
  template <class Q, class Pacing = NoPacing>
  static void scores_rows(const Q* q, Index q_stride, Index bq, const Element* const* keys,
                          Index d, Compute beta, Compute* s, Pacing pacing = {}) {
    for (Index i = 0; i < bq; ++i) {
      const Q* qi = q + i * q_stride;
      for (Index j = 0; j < kKeyTile; ++j) {
        pacing.advance(2 * d);
        const Element* kj = keys[j];
        Compute dot = Compute(0);
        for (Index k = 0; k < d; ++k) dot = fused_multiply_add(widen(qi[k]), widen(kj[k]), dot);
        s[i * kKeyTile + j] = dot * beta;
      }
    }
  }

  static Compute mask_max(Compute* s, Index lo, Index hi) {
    constexpr Compute kMax = std::numeric_limits<Compute>::max();
    Compute largest = -std::numeric_limits<Compute>::infinity();
    for (Index j = 0; j < kKeyTile; ++j) {
      Compute x = s[j];
      if (!(x >= -kMax)) x = -kMax;  // -inf from overflow, or NaN
      if (x > kMax) x = kMax;
      if (j < lo || j >= hi) x = -std::numeric_limits<Compute>::infinity();
      s[j] = x;
      largest = std::max(largest, x);
    }
    return largest;
  }

  static void scale(Compute* x, Index n, Compute f) {
    for (Index c = 0; c < n; ++c) x[c] *= f;
  }

  // offset may be null (no offset). Cost: n compares (and n adds with an offset).
  static bool any_greater(const Compute* s, const Compute* offset, Index n, Compute threshold) {
    for (Index j = 0; j < n; ++j)
      if ((offset != nullptr ? s[j] + offset[j] : s[j]) > threshold) return true;
    return false;
  }

  static Compute exp_sum(Compute* s, Compute m) {
    Compute sum = Compute(0);
    for (Index j = 0; j < kKeyTile; ++j) {
      s[j] = std::exp(s[j] - m);
      sum += s[j];
    }
    return sum;
  }

  // keep: null, or one factor a row by which its accumulator is first multiplied (the read's
  // rescaling of its running averages; the SIMD kernels apply it to the registers they load).
  // Cost: 2 bq bk dv flops (and bq dv products by keep).
  template <class Pacing = NoPacing>
  static void accumulate(const Compute* p, Index bq, Index bk, const Element* v, Index v_stride,
                         Index dv, Compute* acc, Index acc_stride, Pacing pacing = {},
                         const Compute* keep = nullptr) {
    for (Index i = 0; i < bq; ++i) {
      Compute* a = acc + i * acc_stride;
      if (keep != nullptr) scale(a, dv, keep[i]);
      for (Index j = 0; j < bk; ++j) {
        pacing.advance(2 * dv);
        const Compute w = p[i * kKeyTile + j];
        if (w == Compute(0)) continue;
        const Element* vj = v + j * v_stride;
        for (Index c = 0; c < dv; ++c) a[c] = fused_multiply_add(w, widen(vj[c]), a[c]);
      }
    }
  }
};

// Double precision runs the portable micro-kernels on every architecture (the compiler still
// vectorises their inner loops).
template <>
struct TileOps<double, arch::avx512> : TileOps<double, arch::scalar> {};
template <>
struct TileOps<double, arch::avx2> : TileOps<double, arch::scalar> {};

// ---- SIMD (float) ----

#if defined(OVQ_ARCH_AVX512) || defined(OVQ_ARCH_AVX2)
namespace simd {

// The largest and the sum of 8 lanes, by one fixed tree: halves, then pairs, then the last two.
// The 16-lane versions fold their halves first and use the same trees, so their order is ovq's,
// not the compiler's (_mm512_reduce_add_ps is a sequence each compiler picks).
inline float reduce_max8(__m256 a) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}
inline float reduce_add8(__m256 a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// p[0..n) of 16-bit elements, zeros above, in a buffer of N (a tail load that reads nothing past
// p + n).
template <class H, int N>
struct FirstOf {
  H data[N];
};
template <class H, int N>
inline FirstOf<H, N> first_of(const H* p, Index n) {
  FirstOf<H, N> out;
  // Raw bytes: H is a 16-bit element (Eigen's half types are not trivially constructible).
  std::memset(static_cast<void*>(out.data), 0, sizeof out.data);
  std::memcpy(static_cast<void*>(out.data), p, static_cast<std::size_t>(n) * sizeof(H));
  return out;
}

#if defined(OVQ_ARCH_AVX512)
struct F32x16 {
  using reg = __m512;
  static constexpr Index kWidth = 16;
  static reg zero() { return _mm512_setzero_ps(); }
  static reg set1(float x) { return _mm512_set1_ps(x); }
  static reg load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, reg a) { _mm512_storeu_ps(p, a); }
  static reg fmadd(reg a, reg b, reg c) { return _mm512_fmadd_ps(a, b, c); }
  static reg mul(reg a, reg b) { return _mm512_mul_ps(a, b); }
  static reg add(reg a, reg b) { return _mm512_add_ps(a, b); }
  static reg sub(reg a, reg b) { return _mm512_sub_ps(a, b); }
  static reg max(reg a, reg b) { return _mm512_max_ps(a, b); }
  static reg min(reg a, reg b) { return _mm512_min_ps(a, b); }
  // Lane l against lane l + 8 (the pairs fold_to_8 adds), then reduce_max8's tree.
  static float reduce_max(reg a) {
    return reduce_max8(_mm256_max_ps(_mm512_castps512_ps256(a), upper_half(a)));
  }
  // 0, 1, ..., 15
  static reg iota() {
    return _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  }
  // lo <= i < hi ? x : other
  static reg select_between(reg i, reg lo, reg hi, reg x, reg other) {
    const __mmask16 in =
        _mm512_cmp_ps_mask(i, lo, _CMP_GE_OQ) & _mm512_cmp_ps_mask(i, hi, _CMP_LT_OQ);
    return _mm512_mask_blend_ps(in, other, x);
  }
  static float reduce_add(reg a) { return reduce_add8(fold_to_8(a)); }
  static reg round(reg a) {
    return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }
  // 2^n for integral-valued n in [-126, 127].
  static reg pow2(reg n) {
    const __m512i e = _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127));
    return _mm512_castsi512_ps(_mm512_slli_epi32(e, 23));
  }
  // x < lo ? 0 : y
  static reg zero_below(reg x, float lo, reg y) {
    const __mmask16 keep = _mm512_cmp_ps_mask(x, set1(lo), _CMP_GE_OQ);
    return _mm512_maskz_mov_ps(keep, y);
  }
  // p[0..n), 0 < n < 16, zeros above; reads nothing past p + n.
  static reg load_first(const float* p, Index n) {
    return _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << n) - 1u), p);
  }
  // 16-bit elements, widened (exact): bf16 is the upper half of a float, fp16 converts.
  static reg load(const bf16* p) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  static reg load(const fp16* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  template <class H>
  static reg load_first(const H* p, Index n) {
    return load(first_of<H, 16>(p, n).data);
  }
  // r[i] lane j -> r[j] lane i (a 16 x 16 block transposed): 32-bit then 64-bit interleaves
  // within each group of four rows, then twice 128-bit interleaves across the groups, each step
  // in place on four vectors (so the block needs 16 registers and a few). Cost: 64 shuffles.
  static OVQ_ALWAYS_INLINE void transpose(reg r[16]) {
    OVQ_UNROLL
    for (int g = 0; g < 16; g += 4) {  // then r[g + x] block b: rows g .. g + 3 of column 4b + x
      const reg t0 = _mm512_unpacklo_ps(r[g], r[g + 1]);  // block b: [a4b b4b a4b+1 b4b+1]
      const reg t1 = _mm512_unpackhi_ps(r[g], r[g + 1]);  // [a4b+2 b4b+2 a4b+3 b4b+3]
      const reg t2 = _mm512_unpacklo_ps(r[g + 2], r[g + 3]);
      const reg t3 = _mm512_unpackhi_ps(r[g + 2], r[g + 3]);
      r[g] = _mm512_shuffle_ps(t0, t2, 0x44);
      r[g + 1] = _mm512_shuffle_ps(t0, t2, 0xEE);
      r[g + 2] = _mm512_shuffle_ps(t1, t3, 0x44);
      r[g + 3] = _mm512_shuffle_ps(t1, t3, 0xEE);
    }
    OVQ_UNROLL
    for (int x = 0; x < 4; ++x) {  // column 4b + x: block b of r[x], r[4 + x], r[8 + x], r[12 + x]
      const reg lo01 = _mm512_shuffle_f32x4(r[x], r[4 + x], 0x44);
      const reg hi01 = _mm512_shuffle_f32x4(r[x], r[4 + x], 0xEE);
      const reg lo23 = _mm512_shuffle_f32x4(r[8 + x], r[12 + x], 0x44);
      const reg hi23 = _mm512_shuffle_f32x4(r[8 + x], r[12 + x], 0xEE);
      r[x] = _mm512_shuffle_f32x4(lo01, lo23, 0x88);
      r[4 + x] = _mm512_shuffle_f32x4(lo01, lo23, 0xDD);
      r[8 + x] = _mm512_shuffle_f32x4(hi01, hi23, 0x88);
      r[12 + x] = _mm512_shuffle_f32x4(hi01, hi23, 0xDD);
    }
  }
  // Lane l + lane l + 8: the first step of the lane sum (then reduce8's tree).
  static __m256 fold_to_8(reg a) { return _mm256_add_ps(_mm512_castps512_ps256(a), upper_half(a)); }
  // Lanes 8 ... 15 (AVX-512F has no 32-bit-lane extract of a half; the 64-bit one moves the
  // same bits).
  static __m256 upper_half(reg a) {
    return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1));
  }
};
#endif

#if defined(OVQ_ARCH_AVX2)
struct F32x8 {
  using reg = __m256;
  static constexpr Index kWidth = 8;
  static reg zero() { return _mm256_setzero_ps(); }
  static reg set1(float x) { return _mm256_set1_ps(x); }
  static reg load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, reg a) { _mm256_storeu_ps(p, a); }
  static reg fmadd(reg a, reg b, reg c) { return _mm256_fmadd_ps(a, b, c); }
  static reg mul(reg a, reg b) { return _mm256_mul_ps(a, b); }
  static reg add(reg a, reg b) { return _mm256_add_ps(a, b); }
  static reg sub(reg a, reg b) { return _mm256_sub_ps(a, b); }
  static reg max(reg a, reg b) { return _mm256_max_ps(a, b); }
  static reg min(reg a, reg b) { return _mm256_min_ps(a, b); }
  static float reduce_max(reg a) { return reduce_max8(a); }
  static reg iota() { return _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7); }
  static reg select_between(reg i, reg lo, reg hi, reg x, reg other) {
    const reg in =
        _mm256_and_ps(_mm256_cmp_ps(i, lo, _CMP_GE_OQ), _mm256_cmp_ps(i, hi, _CMP_LT_OQ));
    return _mm256_blendv_ps(other, x, in);
  }
  static float reduce_add(reg a) { return reduce_add8(a); }
  static reg round(reg a) { return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static reg pow2(reg n) {
    const __m256i e = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
    return _mm256_castsi256_ps(_mm256_slli_epi32(e, 23));
  }
  static reg zero_below(reg x, float lo, reg y) {
    return _mm256_and_ps(_mm256_cmp_ps(x, set1(lo), _CMP_GE_OQ), y);
  }
  // p[0..n), 0 < n < 8, zeros above; reads nothing past p + n.
  static reg load_first(const float* p, Index n) {
    alignas(32) static constexpr int kMask[16] = {-1, -1, -1, -1, -1, -1, -1, -1,
                                                  0,  0,  0,  0,  0,  0,  0,  0};
    return _mm256_maskload_ps(p, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(kMask + 8 - n)));
  }
  static __m256 fold_to_8(reg a) { return a; }
  // r[i] lane j -> r[j] lane i (an 8 x 8 block transposed): 32-bit then 64-bit interleaves
  // within each group of four rows, then 128-bit ones across the two groups, in place.
  // Cost: 24 shuffles.
  static OVQ_ALWAYS_INLINE void transpose(reg r[8]) {
    OVQ_UNROLL
    for (int g = 0; g < 8; g += 4) {  // then r[g + x] half h: rows g .. g + 3 of column 4h + x
      const reg t0 = _mm256_unpacklo_ps(r[g], r[g + 1]);
      const reg t1 = _mm256_unpackhi_ps(r[g], r[g + 1]);
      const reg t2 = _mm256_unpacklo_ps(r[g + 2], r[g + 3]);
      const reg t3 = _mm256_unpackhi_ps(r[g + 2], r[g + 3]);
      r[g] = _mm256_shuffle_ps(t0, t2, 0x44);
      r[g + 1] = _mm256_shuffle_ps(t0, t2, 0xEE);
      r[g + 2] = _mm256_shuffle_ps(t1, t3, 0x44);
      r[g + 3] = _mm256_shuffle_ps(t1, t3, 0xEE);
    }
    OVQ_UNROLL
    for (int x = 0; x < 4; ++x) {
      const reg lo = _mm256_permute2f128_ps(r[x], r[4 + x], 0x20);
      r[4 + x] = _mm256_permute2f128_ps(r[x], r[4 + x], 0x31);
      r[x] = lo;
    }
  }
  static reg load(const bf16* p) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  static reg load(const fp16* p) {
#if defined(OVQ_ARCH_F16C)
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
    alignas(32) float wide[8];
    for (int i = 0; i < 8; ++i) wide[i] = widen(p[i]);
    return _mm256_load_ps(wide);
#endif
  }
  template <class H>
  static reg load_first(const H* p, Index n) {
    return load(first_of<H, 8>(p, n).data);
  }
};
#endif

#if defined(OVQ_ARCH_AVX2)
// 16 bf16 values as two float vectors, widened by one load and two integer operations: the even
// columns (2l in lane l) by a shift, the odd ones (2l + 1) by a mask. Widening 8 at a time in
// column order takes a zero-extending load and a shift per 8. P V accumulators of 16 columns
// held in this order are moved from and to the accumulator rows by even_odd_load and
// even_odd_store, once per block: about as much work as widening 4 keys the other way saves.
inline void widen_even_odd(const bf16* p, __m256& even, __m256& odd) {
  const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  even = _mm256_castsi256_ps(_mm256_slli_epi32(x, 16));
  odd = _mm256_castsi256_ps(_mm256_and_si256(x, _mm256_set1_epi32(-65536)));  // 0xffff0000
}
// The shuffles below leave columns [0 2 8 10 | 4 6 12 14] (and the odd ones alike); swapping the
// middle 64-bit pairs puts them in order, and undoes itself on the way back.
constexpr int kSwapMiddlePairs = _MM_SHUFFLE(3, 1, 2, 0);
inline void even_odd_load(const float* row, __m256& even, __m256& odd) {
  const __m256 a = _mm256_loadu_ps(row), b = _mm256_loadu_ps(row + 8);
  even = _mm256_castpd_ps(_mm256_permute4x64_pd(
      _mm256_castps_pd(_mm256_shuffle_ps(a, b, _MM_SHUFFLE(2, 0, 2, 0))), kSwapMiddlePairs));
  odd = _mm256_castpd_ps(_mm256_permute4x64_pd(
      _mm256_castps_pd(_mm256_shuffle_ps(a, b, _MM_SHUFFLE(3, 1, 3, 1))), kSwapMiddlePairs));
}
inline void even_odd_store(float* row, __m256 even, __m256 odd) {
  const auto in_order = [](__m256 x) {
    return _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(x), kSwapMiddlePairs));
  };
  const __m256 e = in_order(even), o = in_order(odd);
  _mm256_storeu_ps(row, _mm256_unpacklo_ps(e, o));
  _mm256_storeu_ps(row + 8, _mm256_unpackhi_ps(e, o));
}
#endif

// The lane sums of eight 8-lane vectors, one per output lane: out[a] = ((x0 + x4) + (x2 + x6)) +
// ((x1 + x5) + (x3 + x7)) for x = in[a]. Every output is this one tree, whichever position its
// vector had among the eight (float addition is commutative, so each sum's operands are the
// same pairs in every position).
// The tree's three levels, which a caller may also apply as its vectors become ready (the same
// operations, so the same bits): level 1 on vectors (0, 1), (2, 3), (4, 5), (6, 7), level 2 on
// the pairs of level 1's results, level 3 on level 2's two results.
//
// Level 1, [a0+a4 a1+a5 a2+a6 a3+a7 | b0+b4 ... b3+b7], in two forms that add the same pairs:
// across the 128-bit lanes (two lane permutes and one 256-bit add), or each vector's halves added
// as 128-bit vectors, then joined. Zen 1 runs 256-bit operations as two 128-bit halves and a
// lane-crossing vperm2f128 as 8 micro-ops, so code tuned for it takes the second form.
inline __m256 reduce8_level1_across(__m256 a, __m256 b) {
  return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}
inline __m256 reduce8_level1_halves(__m256 a, __m256 b) {
  const __m128 a_sum = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  const __m128 b_sum = _mm_add_ps(_mm256_castps256_ps128(b), _mm256_extractf128_ps(b, 1));
  return _mm256_insertf128_ps(_mm256_castps128_ps256(a_sum), b_sum, 1);
}
inline __m256 reduce8_level1(__m256 a, __m256 b) {
#if defined(__tune_znver1__)
  return reduce8_level1_halves(a, b);
#else
  return reduce8_level1_across(a, b);
#endif
}
// [(x0+x4)+(x2+x6), (x1+x5)+(x3+x7)] for in[0], in[2] | in[1], in[3] (and in[4..7])
inline __m256 reduce8_level2(__m256 t0, __m256 t1) {
  return _mm256_add_ps(_mm256_shuffle_ps(t0, t1, _MM_SHUFFLE(1, 0, 1, 0)),
                       _mm256_shuffle_ps(t0, t1, _MM_SHUFFLE(3, 2, 3, 2)));
}
// Sums of in[0], in[2], in[4], in[6] | in[1], in[3], in[5], in[7], then in order.
inline __m256 reduce8_level3(__m256 s0, __m256 s1) {
  const __m256 r = _mm256_add_ps(_mm256_shuffle_ps(s0, s1, _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm256_shuffle_ps(s0, s1, _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm256_permutevar8x32_ps(r, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}
inline __m256 reduce8(const __m256 in[8]) {
  return reduce8_level3(
      reduce8_level2(reduce8_level1(in[0], in[1]), reduce8_level1(in[2], in[3])),
      reduce8_level2(reduce8_level1(in[4], in[5]), reduce8_level1(in[6], in[7])));
}

// The lane sums of four 8-lane vectors, [sum x0, sum x1, sum x2, sum x3], by reduce8's tree:
// the same pairs added in the same order, so a score has the same bits whichever of the two sums
// it, for half of reduce8's work (a 6 x 2 block's last four scores).
inline __m128 reduce4(__m256 x0, __m256 x1, __m256 x2, __m256 x3) {
  // [(a0+a4)+(a2+a6), (a1+a5)+(a3+a7)] for x0, x1 | for x2, x3
  const __m256 s = reduce8_level2(reduce8_level1(x0, x2), reduce8_level1(x1, x3));
  const __m128 lo = _mm256_castps256_ps128(s), hi = _mm256_extractf128_ps(s, 1);
  return _mm_add_ps(_mm_shuffle_ps(lo, hi, _MM_SHUFFLE(2, 0, 2, 0)),
                    _mm_shuffle_ps(lo, hi, _MM_SHUFFLE(3, 1, 3, 1)));
}

// Keeps a loaded operand in a register: left alone, GCC folds a query row's load into each of
// the FMAs that use it, loading it once per key of the block (14 loads for the 12 FMAs of a
// 6 x 2 block instead of 8, more than the load ports sustain). Other operand types (the test
// emulation's vectors) are left to the compiler.
template <class X>
inline void in_register(X& /*x*/) {}
inline void in_register(__m256& x) { asm("" : "+v"(x)); }
#if defined(OVQ_ARCH_AVX512)
inline void in_register(__m512& x) { asm("" : "+v"(x)); }
#endif
#if defined(OVQ_ARCH_AVX512BF16)
inline void in_register(__m512bh& x) { asm("" : "+v"(x)); }
#endif

// exp(x) for x <= 0 (the only case a max-subtracted softmax needs): 2^n e^r with
// n = round(x / ln 2), r = x - n ln 2 in [-ln2/2, ln2/2], e^r by a degree-6 polynomial
// (relative error ~2e-7). x below -87.3 (including -inf) gives exactly 0.
template <class V>
typename V::reg exp_nonpositive(typename V::reg x) {
  const typename V::reg lo_clamp = V::set1(-87.3f);
  const typename V::reg xc = V::max(x, lo_clamp);
  const typename V::reg n = V::round(V::mul(xc, V::set1(1.44269504088896341f)));
  typename V::reg r = V::fmadd(n, V::set1(-0.693359375f), xc);  // ln2 split hi/lo: exact n*hi
  r = V::fmadd(n, V::set1(2.12194440e-4f), r);
  typename V::reg p = V::set1(1.0f / 720.0f);
  p = V::fmadd(p, r, V::set1(1.0f / 120.0f));
  p = V::fmadd(p, r, V::set1(1.0f / 24.0f));
  p = V::fmadd(p, r, V::set1(1.0f / 6.0f));
  p = V::fmadd(p, r, V::set1(0.5f));
  p = V::fmadd(p, r, V::set1(1.0f));
  p = V::fmadd(p, r, V::set1(1.0f));
  return V::zero_below(x, -87.3f, V::mul(p, V::pow2(n)));
}

// How a score's lanes accumulate over the features. FmaDot: W features a step, one fused
// multiply-add each, on the elements widened to float (every element type). Bf16PairDot
// (AVX512-BF16, bf16 only): 2W features a step, lane l taking the pair (2l, 2l + 1) of each step
// by one vdpbf16ps (both products exact in float, added to the lane in turn, odd element
// first), twice the rate of FmaDot.
template <class V, class E>
struct FmaDot {
  static constexpr Index kStep = V::kWidth;
  using Operand = typename V::reg;
  // Queries held in float: a 16-bit key is widened as it is loaded, a query once per tile.
  using Query = float;
  template <class H>
  static Operand load(const H* p) { return V::load(p); }
  template <class H>
  static Operand load_first(const H* p, Index n) { return V::load_first(p, n); }
  static typename V::reg madd(Operand q, Operand k, typename V::reg acc) {
    return V::fmadd(q, k, acc);
  }

  // The same sums with the keys along the lanes (SimdTileOps::lanes_panel): lane l of a step's
  // words is one key's feature of that step's lane (one feature per lane here), the query's
  // feature broadcast to every lane. *_first: features from n (or d) on are zeros.
  static constexpr Index kLaneFeatures = 1;
  using reg = typename V::reg;
  template <class H>
  static reg key_words(const H* p) { return V::load(p); }
  template <class H>
  static reg key_words_first(const H* p, Index n) { return V::load_first(p, n); }
  template <class Q>
  static reg query_words(const Q* q, Index k) { return V::set1(widen(q[k])); }
  template <class Q>
  static reg query_words_first(const Q* q, Index k, Index d) {
    return k < d ? query_words(q, k) : V::zero();
  }
  static reg madd_words(reg q, reg k, reg acc) { return V::fmadd(q, k, acc); }
};

#if defined(OVQ_ARCH_AVX512BF16)
struct Bf16PairDot {
  static constexpr Index kStep = 32;
  using Operand = __m512bh;
  using Query = bf16;  // vdpbf16ps takes both operands in bf16
  static Operand load(const bf16* p) {
    return (__m512bh)_mm512_loadu_si512(reinterpret_cast<const void*>(p));
  }
  static Operand load_first(const bf16* p, Index n) {
    return (__m512bh)_mm512_maskz_loadu_epi16(static_cast<__mmask32>((1ull << n) - 1ull), p);
  }
  static __m512 madd(Operand q, Operand k, __m512 acc) { return _mm512_dpbf16_ps(acc, q, k); }

  // Keys along the lanes (FmaDot's words): a word is a pair of bf16 features (2l, 2l + 1), the
  // query's pair broadcast. The bits move through float registers untouched.
  static constexpr Index kLaneFeatures = 2;
  using reg = __m512;
  static reg key_words(const bf16* p) { return _mm512_castsi512_ps((__m512i)load(p)); }
  static reg key_words_first(const bf16* p, Index n) {
    return _mm512_castsi512_ps((__m512i)load_first(p, n));
  }
  static reg query_words(const bf16* q, Index k) {
    std::uint32_t pair;
    std::memcpy(&pair, q + k, sizeof pair);
    return _mm512_castsi512_ps(_mm512_set1_epi32(static_cast<int>(pair)));
  }
  static reg query_words_first(const bf16* q, Index k, Index d) {
    bf16 pair[2] = {k < d ? q[k] : bf16(0.0f), k + 1 < d ? q[k + 1] : bf16(0.0f)};
    return query_words(pair, 0);
  }
  static reg madd_words(reg q, reg k, reg acc) {
    return _mm512_dpbf16_ps(acc, (__m512bh)_mm512_castps_si512(q), (__m512bh)_mm512_castps_si512(k));
  }
};
#endif

#if defined(OVQ_ARCH_AVX512BF16)
// P V of a whole key tile by pair dot products (AVX512-BF16, bf16 values): the weights rounded to
// bf16, and for every output entry, pair after pair of the tile's slots (2m, 2m + 1), in order:
// acc += P[2m+1] V[2m+1] then += P[2m] V[2m], one vdpbf16ps for 16 entries of up to four rows.
// Pairs are the tile's slots, not its segments (memory rows, local rows), so a split that moves
// with the cut of the stream changes no sum. Value pairs are interleaved into the layout
// vdpbf16ps reads (pairs x 16 columns).
// Shapes: p (bq x kTile), v[kTile] (dv entries each; an empty slot's weight is 0), acc (bq x dv).
// Cost: 2 bq kTile dv flops at the pair rate, and kTile dv / 16 shuffles per call.
struct Bf16PairValues {
  static constexpr Index kTile = 64;
  static constexpr Index kPairs = kTile / 2;

  // Output lane l (32 bits): row 2m's column l in its low half, row 2m + 1's in its high half.
  static __m512i interleave(const bf16* even, const bf16* odd, __mmask16 mask) {
    alignas(64) static constexpr short kInterleave[32] = {
        0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
        8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
    const __m256i e = _mm256_maskz_loadu_epi16(mask, even);
    const __m256i o = _mm256_maskz_loadu_epi16(mask, odd);
    return _mm512_permutexvar_epi16(_mm512_load_si512(kInterleave),
                                    _mm512_inserti64x4(_mm512_castsi256_si512(e), o, 1));
  }
  static __mmask16 column_mask(Index dv, Index block) {
    const Index cols = std::min<Index>(16, dv - 16 * block);
    return static_cast<__mmask16>((1u << cols) - 1u);
  }

  // Up to kDirectRows rows (a decode step, grouped queries included) interleave each value pair
  // in registers as they use it; more rows share one interleaved copy of the tile. The same
  // instructions on the same operands in the same order either way: the same bits.
  static constexpr Index kDirectRows = 8;
  template <class Pacing>
  static void accumulate_tile(const float* p, Index bq, const bf16* const* v, Index dv,
                              float* acc, Index acc_stride, Pacing pacing) {
    const Index blocks = (dv + 15) / 16;
    thread_local AlignedVector<std::uint32_t> packed, weights;
    weights.resize(static_cast<std::size_t>(bq * kPairs));
    for (Index i = 0; i < bq; ++i) {
      for (Index h = 0; h < 2; ++h) {
        const float* row = p + i * kTile + 32 * h;
        const __m512bh pairs =
            _mm512_cvtne2ps_pbh(_mm512_loadu_ps(row + 16), _mm512_loadu_ps(row));
        _mm512_storeu_si512(weights.data() + i * kPairs + 16 * h, (__m512i)pairs);
      }
    }
    const std::uint32_t* w = weights.data();
    if (bq <= kDirectRows) {
      Index i = 0;
      for (; i + 4 <= bq; i += 4)
        rows_direct<4>(w + i * kPairs, v, blocks, dv, acc + i * acc_stride, acc_stride, pacing);
      if (bq - i == 3) rows_direct<3>(w + i * kPairs, v, blocks, dv, acc + i * acc_stride, acc_stride, pacing);
      if (bq - i == 2) rows_direct<2>(w + i * kPairs, v, blocks, dv, acc + i * acc_stride, acc_stride, pacing);
      if (bq - i == 1) rows_direct<1>(w + i * kPairs, v, blocks, dv, acc + i * acc_stride, acc_stride, pacing);
      return;
    }
    packed.resize(static_cast<std::size_t>(kPairs * blocks * 16));
    for (Index m = 0; m < kPairs; ++m)
      for (Index b = 0; b < blocks; ++b)
        _mm512_store_si512(packed.data() + (m * blocks + b) * 16,
                           interleave(v[2 * m] + 16 * b, v[2 * m + 1] + 16 * b, column_mask(dv, b)));
    Index i = 0;
    for (; i + 4 <= bq; i += 4)
      rows<4>(w + i * kPairs, packed.data(), blocks, dv, acc + i * acc_stride, acc_stride, pacing);
    for (; i + 2 <= bq; i += 2)
      rows<2>(w + i * kPairs, packed.data(), blocks, dv, acc + i * acc_stride, acc_stride, pacing);
    for (; i < bq; ++i)
      rows<1>(w + i * kPairs, packed.data(), blocks, dv, acc + i * acc_stride, acc_stride, pacing);
  }

  // R <= 4 rows: whole chunks of 32 columns in groups held in registers (direct_even_odd: 4
  // chunks, 2 for three or four rows), then the last one or two 16-column blocks (direct), pair
  // after pair, so that each value row is read whole, in address order (as a decode step
  // streams it).
  template <int R, class Pacing>
  static void rows_direct(const std::uint32_t* w, const bf16* const* v, Index blocks, Index dv,
                          float* acc, Index acc_stride, Pacing pacing) {
    constexpr int kChunks = R <= 2 ? 4 : 2;
    Index b = 0;
    for (; 16 * (b + 2 * kChunks) <= dv; b += 2 * kChunks)
      direct_even_odd<R, kChunks>(w, v, b, acc, acc_stride, pacing);
    for (; 16 * (b + 2) <= dv; b += 2) direct_even_odd<R, 1>(w, v, b, acc, acc_stride, pacing);
    for (; b + 2 <= blocks; b += 2) direct<R, 2>(w, v, b, dv, acc, acc_stride, pacing);
    for (; b < blocks; ++b) direct<R, 1>(w, v, b, dv, acc, acc_stride, pacing);
  }

  // Rows 0 ... R - 1's weights of pair m (P[2m] low, P[2m + 1] high), broadcast.
  template <int R>
  static OVQ_ALWAYS_INLINE void pair_weights(const std::uint32_t* w, Index m,
                                             __m512bh (&weight)[R]) {
    OVQ_UNROLL
    for (int r = 0; r < R; ++r)
      weight[r] = (__m512bh)_mm512_set1_epi32(static_cast<int>(w[r * kPairs + m]));
  }

  template <int R, int G, class Pacing>
  static void direct(const std::uint32_t* w, const bf16* const* v, Index b0, Index dv,
                     float* acc, Index acc_stride, Pacing pacing) {
    __mmask16 mask[G];
    __m512 a[R][G];
    OVQ_UNROLL
    for (int g = 0; g < G; ++g) {
      mask[g] = column_mask(dv, b0 + g);
      OVQ_UNROLL
      for (int r = 0; r < R; ++r)
        a[r][g] = _mm512_maskz_loadu_ps(mask[g], acc + r * acc_stride + 16 * (b0 + g));
    }
    for (Index m = 0; m < kPairs; ++m) {
      if (m % 2 == 0) pacing.advance(2 * 2 * R * G * 16 * 2);
      __m512bh weight[R];
      pair_weights<R>(w, m, weight);
      OVQ_UNROLL
      for (int g = 0; g < G; ++g) {
        const Index col = 16 * (b0 + g);
        const __m512i vv = interleave(v[2 * m] + col, v[2 * m + 1] + col, mask[g]);
        OVQ_UNROLL
        for (int r = 0; r < R; ++r) a[r][g] = _mm512_dpbf16_ps(a[r][g], weight[r], (__m512bh)vv);
      }
    }
    OVQ_UNROLL
    for (int g = 0; g < G; ++g)
      OVQ_UNROLL
      for (int r = 0; r < R; ++r)
        _mm512_mask_storeu_ps(acc + r * acc_stride + 16 * (b0 + g), mask[g], a[r][g]);
  }

  // direct() over G whole chunks of 32 columns from column 16 b0, without the interleaving
  // shuffles: a chunk of value row 2m loads as 16 words (columns 2l, 2l + 1 in word l), and one
  // shift and one word blend per row pair make the pairs of its even columns, and of its odd
  // columns, each in the word layout vdpbf16ps reads (row 2m low, row 2m + 1 high). The
  // accumulators hold even and odd columns apart (split as loaded, merged as stored). Every
  // entry is the same vdpbf16ps chain on the same operands as in direct(): the same bits.
  // Cost: per pair and chunk, two loads, two shifts, two blends and 2 R vdpbf16ps.
  template <int R, int G, class Pacing>
  static void direct_even_odd(const std::uint32_t* w, const bf16* const* v, Index b0,
                              float* acc, Index acc_stride, Pacing pacing) {
    const __m512i even_of = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26,
                                              28, 30);
    const __m512i odd_of = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27,
                                             29, 31);
    __m512 even[R][G], odd[R][G];
    OVQ_UNROLL
    for (int r = 0; r < R; ++r)
      OVQ_UNROLL
      for (int g = 0; g < G; ++g) {
        const float* a = acc + r * acc_stride + 16 * b0 + 32 * g;
        const __m512 lo = _mm512_loadu_ps(a), hi = _mm512_loadu_ps(a + 16);
        even[r][g] = _mm512_permutex2var_ps(lo, even_of, hi);
        odd[r][g] = _mm512_permutex2var_ps(lo, odd_of, hi);
      }
    constexpr __mmask32 kHighWords = 0xAAAAAAAAu;
    for (Index m = 0; m < kPairs; ++m) {
      if (m % 2 == 0) pacing.advance(2 * 2 * R * G * 32 * 2);
      __m512bh weight[R];
      pair_weights<R>(w, m, weight);
      OVQ_UNROLL
      for (int g = 0; g < G; ++g) {
        const Index col = 16 * b0 + 32 * g;
        const __m512i e = _mm512_loadu_si512(reinterpret_cast<const void*>(v[2 * m] + col));
        const __m512i o = _mm512_loadu_si512(reinterpret_cast<const void*>(v[2 * m + 1] + col));
        const __m512i even_pairs = _mm512_mask_blend_epi16(kHighWords, e, _mm512_slli_epi32(o, 16));
        const __m512i odd_pairs = _mm512_mask_blend_epi16(kHighWords, _mm512_srli_epi32(e, 16), o);
        OVQ_UNROLL
        for (int r = 0; r < R; ++r) {
          even[r][g] = _mm512_dpbf16_ps(even[r][g], weight[r], (__m512bh)even_pairs);
          odd[r][g] = _mm512_dpbf16_ps(odd[r][g], weight[r], (__m512bh)odd_pairs);
        }
      }
    }
    const __m512i low_of = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7,
                                             23);
    const __m512i high_of = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14,
                                              30, 15, 31);
    OVQ_UNROLL
    for (int r = 0; r < R; ++r)
      OVQ_UNROLL
      for (int g = 0; g < G; ++g) {
        float* a = acc + r * acc_stride + 16 * b0 + 32 * g;
        _mm512_storeu_ps(a, _mm512_permutex2var_ps(even[r][g], low_of, odd[r][g]));
        _mm512_storeu_ps(a + 16, _mm512_permutex2var_ps(even[r][g], high_of, odd[r][g]));
      }
  }

  // R rows x column blocks of 4 vectors (then single vectors): 16 accumulators at most.
  template <int R, class Pacing>
  static void rows(const std::uint32_t* w, const std::uint32_t* packed, Index blocks, Index dv,
                   float* acc, Index acc_stride, Pacing pacing) {
    Index b = 0;
    for (; b + 4 <= blocks; b += 4) block<R, 4>(w, packed, blocks, b, dv, acc, acc_stride, pacing);
    for (; b < blocks; ++b) block<R, 1>(w, packed, blocks, b, dv, acc, acc_stride, pacing);
  }

  template <int R, int C, class Pacing>
  static void block(const std::uint32_t* w, const std::uint32_t* packed, Index blocks, Index b0,
                    Index dv, float* acc, Index acc_stride, Pacing pacing) {
    __mmask16 mask[C];
    __m512 a[R][C];
    OVQ_UNROLL
    for (int c = 0; c < C; ++c) {
      mask[c] = column_mask(dv, b0 + c);
      OVQ_UNROLL
      for (int r = 0; r < R; ++r)
        a[r][c] = _mm512_maskz_loadu_ps(mask[c], acc + r * acc_stride + 16 * (b0 + c));
    }
    for (Index m = 0; m < kPairs; ++m) {
      if (m % 2 == 0) pacing.advance(2 * 2 * R * C * 16 * 2);
      __m512i vv[C];
      OVQ_UNROLL
      for (int c = 0; c < C; ++c) vv[c] = _mm512_load_si512(packed + (m * blocks + b0 + c) * 16);
      OVQ_UNROLL
      for (int r = 0; r < R; ++r) {
        const __m512bh weight = (__m512bh)_mm512_set1_epi32(static_cast<int>(w[r * kPairs + m]));
        OVQ_UNROLL
        for (int c = 0; c < C; ++c) a[r][c] = _mm512_dpbf16_ps(a[r][c], weight, (__m512bh)vv[c]);
      }
    }
    OVQ_UNROLL
    for (int c = 0; c < C; ++c)
      OVQ_UNROLL
      for (int r = 0; r < R; ++r)
        _mm512_mask_storeu_ps(acc + r * acc_stride + 16 * (b0 + c), mask[c], a[r][c]);
  }
};
#endif

// E: the element of Q, K and V (float, or a 16-bit type widened to float as it is loaded: the
// same float computation on the widened values); Dot: how scores accumulate (above).
template <class V, class E = float, class Dot = FmaDot<V, E>>
struct SimdTileOps {
  using Compute = float;
  static constexpr bool kPairedValues = false;
  // What the read holds its stacked queries in (Dot::Query).
  using Query = typename Dot::Query;
  static constexpr Index W = V::kWidth;
  static constexpr Index kKeyTile = 4 * W;  // one score row is 4 vectors
  using reg = typename V::reg;

  // Register block of scores_packed: R query rows x 4 vectors of keys from a panel (d x
  // kKeyTile, key fastest), each lane one score's chain over the features in order (the portable
  // kernel's operations). Cost 2 R kKeyTile d flops.
  template <int R>
  static void scores_block(const float* q, Index q_stride, const float* panel, Index d,
                           float beta, float* s) {
    reg acc[R][4];
    OVQ_UNROLL
    for (int i = 0; i < R; ++i)
      OVQ_UNROLL
      for (int c = 0; c < 4; ++c) acc[i][c] = V::zero();
    for (Index k = 0; k < d; ++k) {
      const float* p = panel + k * kKeyTile;
      const reg k0 = V::load(p), k1 = V::load(p + W), k2 = V::load(p + 2 * W),
                k3 = V::load(p + 3 * W);
      OVQ_UNROLL
      for (int i = 0; i < R; ++i) {
        const reg a = V::set1(q[i * q_stride + k]);
        acc[i][0] = V::fmadd(a, k0, acc[i][0]);
        acc[i][1] = V::fmadd(a, k1, acc[i][1]);
        acc[i][2] = V::fmadd(a, k2, acc[i][2]);
        acc[i][3] = V::fmadd(a, k3, acc[i][3]);
      }
    }
    const reg b = V::set1(beta);
    OVQ_UNROLL
    for (int i = 0; i < R; ++i)
      OVQ_UNROLL
      for (int c = 0; c < 4; ++c) V::store(s + i * kKeyTile + c * W, V::mul(acc[i][c], b));
  }

  // Rows per score block: 6 x 4 vectors on AVX-512 (24 chains of its 32 registers), 2 x 4 on
  // AVX2 (8 chains, + 4 keys + 1 query of 16 registers); then 4, 2 and single rows.
  static constexpr int kScoreRows = W == 16 ? 6 : 2;

  static void scores_packed(const float* q, Index q_stride, Index bq, const float* panel,
                            Index d, float beta, float* s) {
    Index i = 0;
    for (; i + kScoreRows <= bq; i += kScoreRows)
      scores_block<kScoreRows>(q + i * q_stride, q_stride, panel, d, beta, s + i * kKeyTile);
    if constexpr (kScoreRows > 4)
      for (; i + 4 <= bq; i += 4)
        scores_block<4>(q + i * q_stride, q_stride, panel, d, beta, s + i * kKeyTile);
    for (; i + 2 <= bq; i += 2)
      scores_block<2>(q + i * q_stride, q_stride, panel, d, beta, s + i * kKeyTile);
    for (; i < bq; ++i) scores_block<1>(q + i * q_stride, q_stride, panel, d, beta, s + i * kKeyTile);
  }

  // The panel of a key tile for lanes_panel: keys[j] (kKeyTile rows of d elements) -> rows of
  // kKeyTile words (key fastest; Dot::key_words: floats, widened, or bf16 pairs), one per lane
  // and step of Dot::kStep features: lane m's words of steps 0, 1, ... in consecutive rows, in
  // the order its chain reads them. W x W blocks of words are transposed in registers (the last
  // step's zero-filled past d, stored whole); the pacing hook runs before each block with the
  // scores' flops of bq rows over it.
  // Cost: kKeyTile d loads and stores, kKeyTile d / W transposes' shuffles (log2 W each).
  static Index panel_steps(Index d) { return (d + Dot::kStep - 1) / Dot::kStep; }
  static Index panel_floats(Index d) { return W * panel_steps(d) * kKeyTile; }

  template <class Pacing>
  static void pack_tile(const E* const* keys, Index d, Index bq, float* panel, Pacing& pacing) {
    constexpr Index kStep = Dot::kStep;
    const Index d_main = d - d % kStep;
    const Index steps = panel_steps(d);
    for (Index c = 0; c < kKeyTile; c += W) {
      reg r[W];
      for (Index k = 0; k < d_main; k += kStep) {
        pacing.advance(2 * bq * W * kStep);
        OVQ_UNROLL
        for (Index j = 0; j < W; ++j) r[j] = Dot::key_words(keys[c + j] + k);
        V::transpose(r);
        OVQ_UNROLL
        for (Index f = 0; f < W; ++f) V::store(panel + (f * steps + k / kStep) * kKeyTile + c, r[f]);
      }
      if (d_main < d) {
        pacing.advance(2 * bq * W * (d - d_main));
        for (Index j = 0; j < W; ++j) r[j] = Dot::key_words_first(keys[c + j] + d_main, d - d_main);
        V::transpose(r);
        for (Index f = 0; f < W; ++f)
          V::store(panel + (f * steps + d_main / kStep) * kKeyTile + c, r[f]);
      }
    }
  }

  // The lane sums of dot_products and reduce8's tree (below), computed from a panel of the keys
  // (pack_tile) where many rows share a tile: lane l's chain for W keys at once is one
  // accumulator (the keys along the lanes), and the tree adds whole accumulators, so no shuffle
  // is spent per score. The same operations on the same values as dot_products, padding
  // features past d included (exact zeros, multiplied in as there): the same bits.
  // Rows from which scores_rows packs its tile: below, the packing's transposes cost more than
  // the lane sums' shuffles it saves. (A read of many rows, and an assignment, pack every key
  // tile once: pack_keys, scores_rows_packed.)
  static constexpr Index kPanelMinRows = 32;
  // Register block: R rows x C vectors of keys, N = R C accumulators, one lane's chain at a
  // time. AVX-512: 4 x 4, a whole tile for four rows, 16 chains + 4 keys of 32 registers. AVX2:
  // 4 x 2, 8 chains + 2 keys + 1 query of 16, the 8-chain shape whose tree keeps the fewest
  // held sums on the stack (10 or 12 chains spill more than they gain).
  static constexpr int kPanelRows = 4, kPanelCols = W == 16 ? 4 : 2;

  // acc[r C + c] = Dot::madd_words(q_r's words at feature k, key words of row), R rows x C key
  // vectors. Checked: features from d on read as zeros (the last step).
  template <int R, int C, bool kChecked, class Q>
  static OVQ_ALWAYS_INLINE void panel_step(const Q* q, Index q_stride, const float* row,
                                           Index k, Index d, reg* acc) {
    reg kv[C];
    OVQ_UNROLL
    for (int c = 0; c < C; ++c) {
      kv[c] = V::load(row + c * W);
      if constexpr (R > 1) in_register(kv[c]);
    }
    OVQ_UNROLL
    for (int r = 0; r < R; ++r) {
      const reg qv = kChecked ? Dot::query_words_first(q + r * q_stride, k, d)
                              : Dot::query_words(q + r * q_stride, k);
      OVQ_UNROLL
      for (int c = 0; c < C; ++c) acc[r * C + c] = Dot::madd_words(qv, kv[c], acc[r * C + c]);
    }
  }

  // Lane m's chains over the steps for R rows x C key vectors; the last step is checked against
  // d (a padded feature adds 0 * 0, as in dot_products). Cost 2 R C W kStep ceil(d / kStep) / W
  // flops.
  template <int R, int C, class Q>
  static OVQ_ALWAYS_INLINE void lane_chains(const Q* q, Index q_stride, const float* panel,
                                            Index d, Index m, reg* acc) {
    OVQ_UNROLL
    for (int x = 0; x < R * C; ++x) acc[x] = V::zero();
    const Index steps = panel_steps(d);
    const float* row = panel + m * steps * kKeyTile;  // lane m's first row
    Index k = m * Dot::kLaneFeatures;                 // its first feature
    for (Index step = 0; step + 1 < steps; ++step, k += Dot::kStep, row += kKeyTile)
      panel_step<R, C, false>(q, q_stride, row, k, d, acc);
    if (k + Dot::kLaneFeatures <= d)
      panel_step<R, C, false>(q, q_stride, row, k, d, acc);
    else
      panel_step<R, C, true>(q, q_stride, row, k, d, acc);
  }

  // reduce8's tree over whole accumulators: with x_m = lane m + lane m + 8 (fold_to_8; on 8
  // lanes x_m is lane m), ((x0 + x4) + (x2 + x6)) + ((x1 + x5) + (x3 + x7)), then times beta.
  // The leaves go in the tree's order (leaf t is lane bit_reverse(t)), each level holding one
  // pending left operand, as a binary counter carries: leaf t closes the levels of its trailing
  // one bits, left + right.
  template <int R, int C, class Q>
  OVQ_NOINLINE static void lanes_block(const Q* q, Index q_stride, const float* panel, Index d,
                                       Index c0, float beta, float* s) {
    constexpr int N = R * C;
    constexpr int kLevels = W == 16 ? 4 : 3;
    const float* tile = panel + c0;
    reg held[kLevels][N];
    reg acc[N];
    OVQ_UNROLL
    for (int t = 0; t < W; ++t) {
      int lane = 0;
      for (int b = 0; b < kLevels; ++b) lane |= ((t >> b) & 1) << (kLevels - 1 - b);
      lane_chains<R, C>(q, q_stride, tile, d, lane, acc);
      int level = 0;
      for (; (t >> level) & 1; ++level) {
        OVQ_UNROLL
        for (int x = 0; x < N; ++x) acc[x] = V::add(held[level][x], acc[x]);
      }
      if (level < kLevels) {
        OVQ_UNROLL
        for (int x = 0; x < N; ++x) held[level][x] = acc[x];
      }
    }
    const reg b = V::set1(beta);
    OVQ_UNROLL
    for (int r = 0; r < R; ++r)
      OVQ_UNROLL
      for (int c = 0; c < C; ++c) V::store(s + r * kKeyTile + c0 + c * W, V::mul(acc[r * C + c], b));
  }

  // All bq rows against a panel by lanes_block (4, 2 or 1 rows at a time), the pacing hook told
  // of each block's flops. Cost 2 bq kKeyTile d flops (and the padding's).
  template <class Q, class Pacing>
  static void lanes_panel(const Q* q, Index q_stride, Index bq, const float* panel, Index d,
                          float beta, float* s, Pacing& pacing) {
    constexpr int R = kPanelRows, C = kPanelCols;
    Index i = 0;
    const auto rows = [&](auto block_rows) {
      constexpr int B = decltype(block_rows)::value;
      for (Index c0 = 0; c0 < kKeyTile; c0 += C * W) {
        pacing.advance(2 * B * C * W * d);
        lanes_block<B, C>(q + i * q_stride, q_stride, panel, d, c0, beta, s + i * kKeyTile);
      }
      i += B;
    };
    while (i + R <= bq) rows(std::integral_constant<int, R>{});
    if constexpr (R > 2)
      while (i + 2 <= bq) rows(std::integral_constant<int, 2>{});
    while (i < bq) rows(std::integral_constant<int, 1>{});
  }

  // Keys packed once for many calls (a read's query tiles, read_tiles.hpp; an assignment's row
  // blocks, assign.hpp): the panels of lanes_panel, which scores_rows_packed reads (the same
  // bits as scores_rows).
  using PackedWord = float;
  static bool packs_keys() { return true; }
  static Index packed_key_words(Index d) { return panel_floats(d); }
  static void pack_keys(const E* const* keys, Index d, float* out) {
    NoPacing none;
    pack_tile(keys, d, 0, out, none);
  }
  template <class Q, class Pacing = NoPacing>
  static void scores_rows_packed(const Q* q, Index q_stride, Index bq, const E* const* keys,
                                 const float* packed, Index d, float beta, float* s,
                                 Pacing pacing = {}) {
    (void)keys;
    lanes_panel(q, q_stride, bq, packed, d, beta, s, pacing);
  }

  // The R C partial dot products of R query rows x C keys, W lanes each: lane l of product
  // r C + c sums q_r[k] K[c][k] over its features of each step of Dot::kStep (FmaDot: k = l
  // mod W), in order. Cost 2 R C d flops. Returned by value, so that the accumulators are
  // locals nothing the loop reads can alias; inlined into the block loops, where a call per
  // block of a few rows (a decode step) kept its products from overlapping the previous block's
  // reductions.
  template <int N>
  struct Products {
    reg at[N];
  };

  template <int R, int C, class Q>
  static OVQ_ALWAYS_INLINE Products<R * C> dot_products(const Q* q, Index q_stride,
                                                        const E* const* keys, Index d) {
    const E* key[C];
    OVQ_UNROLL
    for (int c = 0; c < C; ++c) key[c] = keys[c];
    Products<R * C> products;
    reg* acc = products.at;
    OVQ_UNROLL
    for (int a = 0; a < R * C; ++a) acc[a] = V::zero();
    constexpr Index kStep = Dot::kStep;
    const Index d_main = d - d % kStep;
    for (Index k = 0; k < d_main; k += kStep) {
      typename Dot::Operand kv[C];
      OVQ_UNROLL
      for (int c = 0; c < C; ++c) kv[c] = Dot::load(key[c] + k);
      OVQ_UNROLL
      for (int r = 0; r < R; ++r) {
        typename Dot::Operand qv = Dot::load(q + r * q_stride + k);
        if constexpr (C > 1) in_register(qv);
        OVQ_UNROLL
        for (int c = 0; c < C; ++c) acc[r * C + c] = Dot::madd(qv, kv[c], acc[r * C + c]);
      }
    }
    if (d_main < d) {  // the last d % kStep features, zeros above: adds exact zeros to lanes
      typename Dot::Operand kv[C];
      OVQ_UNROLL
      for (int c = 0; c < C; ++c) kv[c] = Dot::load_first(key[c] + d_main, d - d_main);
      OVQ_UNROLL
      for (int r = 0; r < R; ++r) {
        const typename Dot::Operand qv = Dot::load_first(q + r * q_stride + d_main, d - d_main);
        OVQ_UNROLL
        for (int c = 0; c < C; ++c) acc[r * C + c] = Dot::madd(qv, kv[c], acc[r * C + c]);
      }
    }
    return products;
  }

  // Scores kFirst ... kFirst + 7 of a block, scaled by beta: lane x is product kFirst + x's lane
  // sum by reduce8's tree.
  template <int N, int kFirst = 0>
  static __m256 reduce_first8(const Products<N>& products, float beta) {
    static_assert(N >= kFirst + 8, "a block of at least eight products from kFirst");
    __m256 folded[8];
    OVQ_UNROLL
    for (int x = 0; x < 8; ++x) folded[x] = V::fold_to_8(products.at[kFirst + x]);
    return _mm256_mul_ps(reduce8(folded), _mm256_set1_ps(beta));
  }

  // Scores 8 ... 11 of a block of 12, scaled by beta, by reduce4 (the same tree).
  static __m128 reduce_last4(const Products<12>& products, float beta) {
    const auto fold = [&](int x) { return V::fold_to_8(products.at[8 + x]); };
    return _mm_mul_ps(reduce4(fold(0), fold(1), fold(2), fold(3)), _mm_set1_ps(beta));
  }

  // From kPanelMinRows rows, the tile transposed into a thread_local panel and
  // lanes_panel; otherwise scores_lanes. The same bits either way.
  // q holds Es or Querys (the same values; Querys save widening a 16-bit query for every key).
  // Cost: 2 bq kKeyTile d flops.
  template <class Q, class Pacing = NoPacing>
  static void scores_rows(const Q* q, Index q_stride, Index bq, const E* const* keys,
                          Index d, float beta, float* s, Pacing pacing = {}) {
    if (bq >= kPanelMinRows) {
      thread_local AlignedVector<float> panel;
      panel.resize(static_cast<std::size_t>(panel_floats(d)));
      pack_tile(keys, d, bq, panel.data(), pacing);
      NoPacing packed;  // the pacing heard of the scores' flops while the tile was packed
      return lanes_panel(q, q_stride, bq, panel.data(), d, beta, s, packed);
    }
    scores_lanes(q, q_stride, bq, keys, d, beta, s, pacing);
  }

  // The key rows in place: rows in blocks of 6 x 2 keys, then 4 x 4 (AVX-512) or 4 x 2, then
  // pairs in blocks of 2 x 4, a last odd row in blocks of 1 x 8 keys (16-bit keys) or key by key
  // (float keys: eight single products, then one reduce8), the query held in registers where d
  // is 2, 4 or 8 steps: the same lanes and the same tree for every score, whatever its block.
  // Six rows give 12 independent FMA chains, enough to fill both FMA pipes (2 keys + 1 query row
  // + 12 accumulators fit AVX2's 16 registers). A single row is a decode step, streaming its
  // keys from memory: float keys one after the other, in address order, which is what the
  // hardware prefetcher follows; 16-bit keys, which the read prefetches itself from one row
  // (KeyAxis::prefetch) and widens as they are loaded, eight at a time, eight FMA chains (one
  // key's chain alone waits on the FMA latency at every step, and a loop over d keeps the
  // processor from overlapping the next key's).
  template <class Q, class Pacing>
  static void scores_lanes(const Q* q, Index q_stride, Index bq, const E* const* keys,
                           Index d, float beta, float* s, Pacing pacing) {
    Index i = 0;
    for (; i + 6 <= bq; i += 6) {
      for (Index c = 0; c < kKeyTile; c += 2) {
        pacing.advance(2 * 6 * 2 * d);
        const auto acc = dot_products<6, 2>(q + i * q_stride, q_stride, keys + c, d);
        // Lanes 2 r and 2 r + 1: row i + r's scores of keys c and c + 1 (rows 0-3 in the first
        // eight, 4-5 in the last four), stored 64 bits at a time straight from the registers
        // (a round trip through a stack array would add a store and a load per score).
        const __m256 first = reduce_first8(acc, beta);
        const __m128 row_pairs[3] = {_mm256_castps256_ps128(first),
                                     _mm256_extractf128_ps(first, 1),
                                     reduce_last4(acc, beta)};
        OVQ_UNROLL
        for (int r = 0; r < 6; r += 2) {
          _mm_storel_pi(reinterpret_cast<__m64*>(s + (i + r) * kKeyTile + c), row_pairs[r / 2]);
          _mm_storeh_pi(reinterpret_cast<__m64*>(s + (i + r + 1) * kKeyTile + c), row_pairs[r / 2]);
        }
      }
    }
    // Four rows (a grouped-query decode step of 4 query heads): each key loaded once for all
    // four, where two pairs would load it twice. On AVX-512, blocks of 4 x 4 (16 chains and 4
    // keys of its 32 registers: a block's loop and its reductions amortised over twice the
    // scores), each row's four scores stored whole.
    if constexpr (W == 16) {
      for (; i + 4 <= bq; i += 4) {
        for (Index c = 0; c < kKeyTile; c += 4) {
          pacing.advance(2 * 4 * 4 * d);
          const auto acc = dot_products<4, 4>(q + i * q_stride, q_stride, keys + c, d);
          const __m256 first = reduce_first8<16, 0>(acc, beta);   // rows i, i + 1
          const __m256 second = reduce_first8<16, 8>(acc, beta);  // rows i + 2, i + 3
          _mm_storeu_ps(s + i * kKeyTile + c, _mm256_castps256_ps128(first));
          _mm_storeu_ps(s + (i + 1) * kKeyTile + c, _mm256_extractf128_ps(first, 1));
          _mm_storeu_ps(s + (i + 2) * kKeyTile + c, _mm256_castps256_ps128(second));
          _mm_storeu_ps(s + (i + 3) * kKeyTile + c, _mm256_extractf128_ps(second, 1));
        }
      }
    }
    for (; i + 4 <= bq; i += 4) {
      for (Index c = 0; c < kKeyTile; c += 2) {
        pacing.advance(2 * 4 * 2 * d);
        const auto acc = dot_products<4, 2>(q + i * q_stride, q_stride, keys + c, d);
        const __m256 x = reduce_first8(acc, beta);  // rows i .. i + 3, keys c, c + 1
        const __m128 lo = _mm256_castps256_ps128(x), hi = _mm256_extractf128_ps(x, 1);
        _mm_storel_pi(reinterpret_cast<__m64*>(s + i * kKeyTile + c), lo);
        _mm_storeh_pi(reinterpret_cast<__m64*>(s + (i + 1) * kKeyTile + c), lo);
        _mm_storel_pi(reinterpret_cast<__m64*>(s + (i + 2) * kKeyTile + c), hi);
        _mm_storeh_pi(reinterpret_cast<__m64*>(s + (i + 3) * kKeyTile + c), hi);
      }
    }
    for (; i + 2 <= bq; i += 2) {
      for (Index c = 0; c < kKeyTile; c += 4) {
        pacing.advance(2 * 2 * 4 * d);
        const auto acc = dot_products<2, 4>(q + i * q_stride, q_stride, keys + c, d);
        const __m256 x = reduce_first8(acc, beta);
        _mm_storeu_ps(s + i * kKeyTile + c, _mm256_castps256_ps128(x));
        _mm_storeu_ps(s + (i + 1) * kKeyTile + c, _mm256_extractf128_ps(x, 1));
      }
    }
    for (; i < bq; ++i) {
      const Q* row = q + i * q_stride;
      float* out = s + i * kKeyTile;
      if (d % Dot::kStep == 0) {
        switch (d / Dot::kStep) {
          case 2: scores_row_held<2>(row, keys, beta, out, pacing); continue;
          case 4: scores_row_held<4>(row, keys, beta, out, pacing); continue;
          case 8:
            if constexpr (W == 16) {
              scores_row_held<8>(row, keys, beta, out, pacing);
              continue;
            }
            break;
          default: break;
        }
      }
      for (Index c = 0; c < kKeyTile; c += 8) {
        pacing.advance(2 * 8 * d);
        if constexpr (std::is_same_v<E, float>) {
          const auto product = [&](int j) {
            return V::fold_to_8(dot_products<1, 1>(row, q_stride, keys + c + j, d).at[0]);
          };
          _mm256_storeu_ps(out + c, _mm256_mul_ps(eight_sums(product), _mm256_set1_ps(beta)));
        } else {
          const auto acc = dot_products<1, 8>(row, q_stride, keys + c, d);
          _mm256_storeu_ps(out + c, reduce_first8(acc, beta));
        }
      }
    }
  }

  // The lane sums of eight products, product(0) ... product(7) (each folded to 8 lanes), by
  // reduce8's tree applied as they come (the same operations as reduce_first8): two partial
  // sums stay live instead of eight products. Eight do not fit in registers beside a dot
  // product's own, and the compiler would keep every accumulator, the running one included, on
  // the stack (a store and a load in each step's dependency chain). Product j is asked for
  // before product j + 1, so that keys are read in address order.
  template <class Product>
  static OVQ_ALWAYS_INLINE __m256 eight_sums(const Product& product) {
    const auto quarter = [&](int j) {
      const __m256 a = product(j);
      return reduce8_level1(a, product(j + 1));
    };
    const auto half = [&](int j) {
      const __m256 a = quarter(j);
      return reduce8_level2(a, quarter(j + 2));
    };
    const __m256 first = half(0);
    return reduce8_level3(first, half(4));
  }

  // One query row of N Dot::kSteps (d = N kStep) against a key tile, the query held in
  // registers (a decode step: loaded once per tile, not once per key; the loop over a key's
  // features unrolled). The same operations in the same order as dot_products<1, 1>: the same
  // bits. Cost: 2 kKeyTile d flops.
  template <int N, class Q, class Pacing>
  static void scores_row_held(const Q* q, const E* const* keys, float beta, float* s,
                              Pacing& pacing) {
    constexpr Index kStep = Dot::kStep;
    typename Dot::Operand qv[N];
    OVQ_UNROLL
    for (int n = 0; n < N; ++n) qv[n] = Dot::load(q + n * kStep);
    for (Index c = 0; c < kKeyTile; c += 8) {
      pacing.advance(2 * 8 * N * kStep);
      const auto product = [&](int j) {
        const E* key = keys[c + j];
        reg acc = V::zero();
        OVQ_UNROLL
        for (int n = 0; n < N; ++n) acc = Dot::madd(qv[n], Dot::load(key + n * kStep), acc);
        return V::fold_to_8(acc);
      };
      _mm256_storeu_ps(s + c, _mm256_mul_ps(eight_sums(product), _mm256_set1_ps(beta)));
    }
  }

  // Slot indices are compared as floats (exact: kKeyTile is far below 2^24).
  static float mask_max(float* s, Index lo, Index hi) {
    const reg lo_v = V::set1(static_cast<float>(lo)), hi_v = V::set1(static_cast<float>(hi));
    const reg neg_inf = V::set1(-std::numeric_limits<float>::infinity());
    const reg lowest = V::set1(-std::numeric_limits<float>::max());
    const reg highest = V::set1(std::numeric_limits<float>::max());
    const bool masked = lo > 0 || hi < kKeyTile;  // most tiles: every slot seen, no mask
    reg slot = V::iota();
    reg largest = neg_inf;
    OVQ_UNROLL
    for (Index j = 0; j < kKeyTile; j += W) {
      // max(x, lowest) is `lowest` for a NaN x (the second operand wins), as in the portable code.
      const reg x = V::min(V::max(V::load(s + j), lowest), highest);
      const reg kept = masked ? V::select_between(slot, lo_v, hi_v, x, neg_inf) : x;
      V::store(s + j, kept);
      largest = V::max(largest, kept);
      slot = V::add(slot, V::set1(static_cast<float>(W)));
    }
    return V::reduce_max(largest);
  }

  // The largest score, NaNs left out (V::max(x, m) keeps m when x is NaN), against the
  // threshold: true exactly when some score is greater, as in the portable loop (a zero's sign
  // cannot change the answer). offset may be null. Cost: n compares.
  static bool any_greater(const float* s, const float* offset, Index n, float threshold) {
    const float kNegInf = -std::numeric_limits<float>::infinity();
    reg largest = V::set1(kNegInf);
    const Index n_main = n - n % W;
    for (Index j = 0; j < n_main; j += W) {
      const reg x =
          offset != nullptr ? V::add(V::load(s + j), V::load(offset + j)) : V::load(s + j);
      largest = V::max(x, largest);
    }
    float m = V::reduce_max(largest);
    for (Index j = n_main; j < n; ++j) {
      const float x = offset != nullptr ? s[j] + offset[j] : s[j];
      if (x > m) m = x;
    }
    return m > threshold;
  }

  static void scale(float* x, Index n, float f) {
    const reg fv = V::set1(f);
    const Index n_main = n - n % W;
    for (Index c = 0; c < n_main; c += W) V::store(x + c, V::mul(V::load(x + c), fv));
    for (Index c = n_main; c < n; ++c) x[c] *= f;
  }

  static float exp_sum(float* s, float m) {
    const reg mv = V::set1(m);
    reg sum = V::zero();
    for (Index j = 0; j < kKeyTile; j += W) {
      const reg e = exp_nonpositive<V>(V::sub(V::load(s + j), mv));
      V::store(s + j, e);
      sum = V::add(sum, e);
    }
    return V::reduce_add(sum);
  }

  // Keys between two calls of the pacing hook in a P V block. A prefetching hook is a call, around
  // which the block's accumulators go to the stack and back, so it is not called for every key.
  static constexpr Index kPacingKeys = 8;
  // Keys from which a bf16 P V block on AVX2 widens its values 16 at a time.
  static constexpr Index kEvenOddMinKeys = 8;

  // a[i][c] *= keep[i]: scale()'s products (one rounding each), on the loaded registers.
  template <int R, int C>
  static OVQ_ALWAYS_INLINE void rescale(reg (&a)[R][C], const float* keep) {
    OVQ_UNROLL
    for (int i = 0; i < R; ++i) {
      const reg f = V::set1(keep[i]);
      OVQ_UNROLL
      for (int c = 0; c < C; ++c) a[i][c] = V::mul(a[i][c], f);
    }
  }

  // Register block: R rows x C vectors of acc, each row multiplied by keep[i] as it is loaded
  // where keep is given (accumulate). Cost 2 R bk (C W) flops.
  template <int R, int C, class Pacing>
  static void accumulate_block(const float* p, Index bk, const E* v, Index v_stride,
                               float* acc, Index acc_stride, Pacing pacing, const float* keep) {
#if defined(OVQ_ARCH_AVX2)
    // bf16 values on AVX2 widen 16 columns at a time, in blocks of an even number of vectors
    // over enough keys to repay the accumulators' reordering (not a decode step's runs).
    if constexpr (std::is_same_v<E, bf16> && std::is_same_v<V, F32x8> && C % 2 == 0) {
      if (bk >= kEvenOddMinKeys)
        return accumulate_block_even_odd<R, C / 2>(p, bk, v, v_stride, acc, acc_stride, pacing,
                                                   keep);
    }
#endif
    reg a[R][C];
    OVQ_UNROLL
    for (int i = 0; i < R; ++i)
      OVQ_UNROLL
      for (int c = 0; c < C; ++c) a[i][c] = V::load(acc + i * acc_stride + c * W);
    if (keep != nullptr) rescale<R, C>(a, keep);
    for (Index j = 0; j < bk; ++j) {
      if (j % kPacingKeys == 0) pacing.advance(2 * R * C * W * std::min(kPacingKeys, bk - j));
      reg vv[C];
      OVQ_UNROLL
      for (int c = 0; c < C; ++c) {
        vv[c] = V::load(v + j * v_stride + c * W);
        // Loaded once for the R rows: left to itself, the compiler folds the load into each
        // row's FMA, R loads of every value vector, and the loads then bound the block.
        if constexpr (R > 1) in_register(vv[c]);
      }
      OVQ_UNROLL
      for (int i = 0; i < R; ++i) {
        const reg w = V::set1(p[i * kKeyTile + j]);
        OVQ_UNROLL
        for (int c = 0; c < C; ++c) a[i][c] = V::fmadd(w, vv[c], a[i][c]);
      }
    }
    OVQ_UNROLL
    for (int i = 0; i < R; ++i)
      OVQ_UNROLL
      for (int c = 0; c < C; ++c) V::store(acc + i * acc_stride + c * W, a[i][c]);
  }

#if defined(OVQ_ARCH_AVX2)
  // accumulate_block for bf16 values on AVX2: R rows x G groups of 16 columns, each group's
  // even and odd columns in two accumulators. Every column is the same chain over the keys as in
  // accumulate_block (only the lane that holds it differs): the same bits.
  template <int R, int G, class Pacing>
  static void accumulate_block_even_odd(const float* p, Index bk, const E* v, Index v_stride,
                                        float* acc, Index acc_stride, Pacing pacing,
                                        const float* keep) {
    reg a[R][2 * G];
    OVQ_UNROLL
    for (int i = 0; i < R; ++i)
      OVQ_UNROLL
      for (int g = 0; g < G; ++g)
        even_odd_load(acc + i * acc_stride + 16 * g, a[i][2 * g], a[i][2 * g + 1]);
    if (keep != nullptr) rescale<R, 2 * G>(a, keep);
    for (Index j = 0; j < bk; ++j) {
      if (j % kPacingKeys == 0) pacing.advance(2 * R * 16 * G * std::min(kPacingKeys, bk - j));
      reg vv[2 * G];
      OVQ_UNROLL
      for (int g = 0; g < G; ++g)
        widen_even_odd(v + j * v_stride + 16 * g, vv[2 * g], vv[2 * g + 1]);
      OVQ_UNROLL
      for (int i = 0; i < R; ++i) {
        const reg w = V::set1(p[i * kKeyTile + j]);
        OVQ_UNROLL
        for (int c = 0; c < 2 * G; ++c) a[i][c] = V::fmadd(w, vv[c], a[i][c]);
      }
    }
    OVQ_UNROLL
    for (int i = 0; i < R; ++i)
      OVQ_UNROLL
      for (int g = 0; g < G; ++g)
        even_odd_store(acc + i * acc_stride + 16 * g, a[i][2 * g], a[i][2 * g + 1]);
  }
#endif

  // Rows per block: 6 x 2 vectors on AVX2 (12 chains, + 2 values + 1 weight in 16 registers),
  // 4 x 4 on AVX-512 (16 chains of its 32 registers); then 4 x 2 on AVX2 (a grouped-query decode
  // step's four query heads: each value row read once for all four, where two pairs would read
  // it twice), then pairs, then single rows.
  static constexpr int kAccRows = W == 16 ? 4 : 6;
  static constexpr int kRegisters = W == 16 ? 32 : 16;
  // Vectors of acc per block for R rows: as many independent FMA chains as the registers hold
  // beside the block's values and its weight (each column's chain is the same whatever the block
  // width, so any split gives the same bits). A single row takes its values as the FMAs' memory
  // operands, so its eight hold no register.
  static constexpr int accumulate_columns(int rows) {
    if (rows == 1) return 8;
    for (int c = 4; c > 1; c /= 2)
      if (rows * c + c + 1 <= kRegisters) return c;
    return 1;
  }

  // Keys per run for a single row wider than one column block (a decode step: each value row is
  // read once, from memory): the keys go in short runs, every column of a run done before the
  // next. Column block by column block over the whole tile would read the rows in slices (256
  // bytes of every 512 on AVX2 at dv = 128), which the hardware prefetcher follows badly. Each
  // column is still one chain over the keys in order: the same bits.
  static constexpr Index kDecodeRun = 4;

  template <int R, class Pacing>
  static void accumulate_rows(const float* p, Index bk, const E* v, Index v_stride, Index dv,
                              float* acc, Index acc_stride, Pacing pacing, const float* keep) {
    constexpr int kCols = accumulate_columns(R);
    if constexpr (R == 1) {
      if (bk > kDecodeRun && dv > kCols * W) {
        for (Index j = 0; j < bk; j += kDecodeRun)  // the first run rescales
          accumulate_rows<R>(p + j, std::min(kDecodeRun, bk - j), v + j * v_stride, v_stride, dv,
                             acc, acc_stride, pacing, j == 0 ? keep : nullptr);
        return;
      }
    }
    Index c = 0;
    for (; c + kCols * W <= dv; c += kCols * W)
      accumulate_block<R, kCols>(p, bk, v + c, v_stride, acc + c, acc_stride, pacing, keep);
    if constexpr (kCols > 4)
      for (; c + 4 * W <= dv; c += 4 * W)
        accumulate_block<R, 4>(p, bk, v + c, v_stride, acc + c, acc_stride, pacing, keep);
    for (; c + W <= dv; c += W)
      accumulate_block<R, 1>(p, bk, v + c, v_stride, acc + c, acc_stride, pacing, keep);
    for (; c < dv; ++c) {  // columns past the last full vector: the same chain as the vectors
      pacing.advance(2 * R * bk);
      OVQ_UNROLL
      for (int i = 0; i < R; ++i) {
        float a = acc[i * acc_stride + c];
        if (keep != nullptr) a *= keep[i];
        for (Index j = 0; j < bk; ++j)
          a = fused_multiply_add(p[i * kKeyTile + j], widen(v[j * v_stride + c]), a);
        acc[i * acc_stride + c] = a;
      }
    }
  }

  // keep: null, or a factor a row (the portable accumulate's).
  template <class Pacing = NoPacing>
  static void accumulate(const float* p, Index bq, Index bk, const E* v, Index v_stride,
                         Index dv, float* acc, Index acc_stride, Pacing pacing = {},
                         const float* keep = nullptr) {
    Index i = 0;
    const auto rows_keep = [&] { return keep != nullptr ? keep + i : nullptr; };
    for (; i + kAccRows <= bq; i += kAccRows)
      accumulate_rows<kAccRows>(p + i * kKeyTile, bk, v, v_stride, dv, acc + i * acc_stride,
                                acc_stride, pacing, rows_keep());
    if constexpr (kAccRows > 4)
      for (; i + 4 <= bq; i += 4)
        accumulate_rows<4>(p + i * kKeyTile, bk, v, v_stride, dv, acc + i * acc_stride,
                           acc_stride, pacing, rows_keep());
    for (; i + 2 <= bq; i += 2)
      accumulate_rows<2>(p + i * kKeyTile, bk, v, v_stride, dv, acc + i * acc_stride, acc_stride,
                         pacing, rows_keep());
    for (; i < bq; ++i)
      accumulate_rows<1>(p + i * kKeyTile, bk, v, v_stride, dv, acc + i * acc_stride, acc_stride,
                         pacing, rows_keep());
  }
};

}  // namespace simd
#endif

#if defined(OVQ_ARCH_AVX512)
template <>
struct TileOps<float, arch::avx512> : simd::SimdTileOps<simd::F32x16> {};
template <>
struct TileOps<bf16, arch::avx512> : simd::SimdTileOps<simd::F32x16, bf16> {};
template <>
struct TileOps<fp16, arch::avx512> : simd::SimdTileOps<simd::F32x16, fp16> {};
// AVX512-BF16: bf16 scores by pair dot products; everything else as on AVX-512.
template <class Element>
struct TileOps<Element, arch::avx512bf16> : TileOps<Element, arch::avx512> {};
#if defined(OVQ_ARCH_AVX512BF16)
template <>
struct TileOps<bf16, arch::avx512bf16>
    : simd::SimdTileOps<simd::F32x16, bf16, simd::Bf16PairDot>, simd::Bf16PairValues {
  static constexpr bool kPairedValues = true;
  using simd::Bf16PairValues::accumulate_tile;
};
#endif
#endif
#if defined(OVQ_ARCH_AVX2)
template <>
struct TileOps<float, arch::avx2> : simd::SimdTileOps<simd::F32x8> {};
template <>
struct TileOps<bf16, arch::avx2> : simd::SimdTileOps<simd::F32x8, bf16> {};
template <>
struct TileOps<fp16, arch::avx2> : simd::SimdTileOps<simd::F32x8, fp16> {};
#endif

}  // namespace ovq::kernels

// AMX tiles for bf16 reads (arch::amx), and the tile kernels the tests emulate everywhere.
#include "ovq/kernels/arch/amx.hpp"
