#pragma once
// The micro-kernels of the fused read, per architecture. The tile loop (kernels/read.hpp) is
// written once; only these inner operations differ.
//
//   scores_packed  S[i][j] = beta q_i . K[j]        q: bq x d (row-major), K^T panel: d x kKeyTile
//   scores_rows    S[i][j] = beta q_i . K[j]        K: bk x d row-major (few queries: no packing)
//   exp_sum        s[j] = exp(s[j] - m), returns sum_j s[j]
//   accumulate     acc[i][:] += sum_j P[i][j] V[j][:]    P: bq x kKeyTile, V: bk x dv
//
// TileOps<Scalar, arch::scalar> is plain C++ and always available. The SIMD versions (float,
// AVX-512 and AVX2+FMA) share one register-blocked template over a small vector wrapper.
#include <algorithm>
#include <cmath>
#include <limits>

#include "ovq/core/types.hpp"
#include "ovq/kernels/arch/arch.hpp"

#if defined(OVQ_ARCH_AVX512) || defined(OVQ_ARCH_AVX2)
#include <immintrin.h>
#endif

namespace ovq::kernels {

template <class Scalar, class Arch>
struct TileOps;

// ---- portable ----

template <class Scalar>
struct TileOps<Scalar, arch::scalar> {
  static constexpr Index kKeyTile = 64;

  // Cost: 2 bq kKeyTile d flops.
  static void scores_packed(const Scalar* q, Index q_stride, Index bq, const Scalar* panel,
                            Index d, Scalar beta, Scalar* s) {
    for (Index i = 0; i < bq; ++i) {
      Scalar* row = s + i * kKeyTile;
      std::fill(row, row + kKeyTile, Scalar(0));
      const Scalar* qi = q + i * q_stride;
      for (Index k = 0; k < d; ++k) {
        const Scalar a = qi[k];
        const Scalar* p = panel + k * kKeyTile;
        for (Index j = 0; j < kKeyTile; ++j) row[j] += a * p[j];
      }
      for (Index j = 0; j < kKeyTile; ++j) row[j] *= beta;
    }
  }

  // Cost: 2 bq bk d flops.
  static void scores_rows(const Scalar* q, Index q_stride, Index bq, const Scalar* k,
                          Index k_stride, Index bk, Index d, Scalar beta, Scalar* s) {
    for (Index i = 0; i < bq; ++i) {
      for (Index j = 0; j < bk; ++j) {
        const Scalar* qi = q + i * q_stride;
        const Scalar* kj = k + j * k_stride;
        Scalar dot = Scalar(0);
        for (Index c = 0; c < d; ++c) dot += qi[c] * kj[c];
        s[i * kKeyTile + j] = beta * dot;
      }
    }
  }

  static Scalar exp_sum(Scalar* s, Index n, Scalar m) {
    Scalar sum = Scalar(0);
    for (Index j = 0; j < n; ++j) {
      s[j] = std::exp(s[j] - m);
      sum += s[j];
    }
    return sum;
  }

  // Cost: 2 bq bk dv flops.
  static void accumulate(const Scalar* p, Index bq, Index bk, const Scalar* v, Index v_stride,
                         Index dv, Scalar* acc, Index acc_stride) {
    for (Index i = 0; i < bq; ++i) {
      Scalar* a = acc + i * acc_stride;
      for (Index j = 0; j < bk; ++j) {
        const Scalar w = p[i * kKeyTile + j];
        if (w == Scalar(0)) continue;
        const Scalar* vj = v + j * v_stride;
        for (Index c = 0; c < dv; ++c) a[c] += w * vj[c];
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
  static float reduce_add(reg a) { return _mm512_reduce_add_ps(a); }
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
  static float reduce_add(reg a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  static reg round(reg a) { return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static reg pow2(reg n) {
    const __m256i e = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
    return _mm256_castsi256_ps(_mm256_slli_epi32(e, 23));
  }
  static reg zero_below(reg x, float lo, reg y) {
    return _mm256_and_ps(_mm256_cmp_ps(x, set1(lo), _CMP_GE_OQ), y);
  }
};
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

template <class V>
struct SimdTileOps {
  static constexpr Index W = V::kWidth;
  static constexpr Index kKeyTile = 4 * W;  // one score row is 4 vectors
  using reg = typename V::reg;

  // Register block: R query rows x 4 vectors of keys. Cost 2 R kKeyTile d flops.
  template <int R>
  static void scores_block(const float* q, Index q_stride, const float* panel, Index d,
                           float beta, float* s) {
    reg acc[R][4];
    for (int i = 0; i < R; ++i)
      for (int c = 0; c < 4; ++c) acc[i][c] = V::zero();
    for (Index k = 0; k < d; ++k) {
      const float* p = panel + k * kKeyTile;
      const reg k0 = V::load(p), k1 = V::load(p + W), k2 = V::load(p + 2 * W),
                k3 = V::load(p + 3 * W);
      for (int i = 0; i < R; ++i) {
        const reg a = V::set1(q[i * q_stride + k]);
        acc[i][0] = V::fmadd(a, k0, acc[i][0]);
        acc[i][1] = V::fmadd(a, k1, acc[i][1]);
        acc[i][2] = V::fmadd(a, k2, acc[i][2]);
        acc[i][3] = V::fmadd(a, k3, acc[i][3]);
      }
    }
    const reg b = V::set1(beta);
    for (int i = 0; i < R; ++i)
      for (int c = 0; c < 4; ++c) V::store(s + i * kKeyTile + c * W, V::mul(acc[i][c], b));
  }

  static constexpr int kScoreRows = W == 16 ? 6 : 2;

  static void scores_packed(const float* q, Index q_stride, Index bq, const float* panel,
                            Index d, float beta, float* s) {
    Index i = 0;
    for (; i + kScoreRows <= bq; i += kScoreRows)
      scores_block<kScoreRows>(q + i * q_stride, q_stride, panel, d, beta, s + i * kKeyTile);
    for (; i < bq; ++i) scores_block<1>(q + i * q_stride, q_stride, panel, d, beta, s + i * kKeyTile);
  }

  // Few queries over row-major keys: dot products along d, four keys at a time.
  static void scores_rows(const float* q, Index q_stride, Index bq, const float* k,
                          Index k_stride, Index bk, Index d, float beta, float* s) {
    const Index dv_main = d - d % W;
    for (Index i = 0; i < bq; ++i) {
      const float* qi = q + i * q_stride;
      for (Index j = 0; j < bk; ++j) {
        const float* kj = k + j * k_stride;
        reg acc = V::zero();
        for (Index c = 0; c < dv_main; c += W) acc = V::fmadd(V::load(qi + c), V::load(kj + c), acc);
        float dot = V::reduce_add(acc);
        for (Index c = dv_main; c < d; ++c) dot += qi[c] * kj[c];
        s[i * kKeyTile + j] = beta * dot;
      }
    }
  }

  static float exp_sum(float* s, Index n, float m) {
    const reg mv = V::set1(m);
    reg sum = V::zero();
    Index j = 0;
    for (; j + W <= n; j += W) {
      const reg e = exp_nonpositive<V>(V::sub(V::load(s + j), mv));
      V::store(s + j, e);
      sum = V::add(sum, e);
    }
    float total = V::reduce_add(sum);
    for (; j < n; ++j) {
      s[j] = std::exp(s[j] - m);
      total += s[j];
    }
    return total;
  }

  // Register block: R rows x C vectors of acc. Cost 2 R bk (C W) flops.
  template <int R, int C>
  static void accumulate_block(const float* p, Index bk, const float* v, Index v_stride,
                               float* acc, Index acc_stride) {
    reg a[R][C];
    for (int i = 0; i < R; ++i)
      for (int c = 0; c < C; ++c) a[i][c] = V::load(acc + i * acc_stride + c * W);
    for (Index j = 0; j < bk; ++j) {
      reg vv[C];
      for (int c = 0; c < C; ++c) vv[c] = V::load(v + j * v_stride + c * W);
      for (int i = 0; i < R; ++i) {
        const reg w = V::set1(p[i * kKeyTile + j]);
        for (int c = 0; c < C; ++c) a[i][c] = V::fmadd(w, vv[c], a[i][c]);
      }
    }
    for (int i = 0; i < R; ++i)
      for (int c = 0; c < C; ++c) V::store(acc + i * acc_stride + c * W, a[i][c]);
  }

  static constexpr int kAccRows = W == 16 ? 4 : 2;

  template <int R>
  static void accumulate_rows(const float* p, Index bk, const float* v, Index v_stride, Index dv,
                              float* acc, Index acc_stride) {
    Index c = 0;
    for (; c + 4 * W <= dv; c += 4 * W)
      accumulate_block<R, 4>(p, bk, v + c, v_stride, acc + c, acc_stride);
    for (; c + W <= dv; c += W) accumulate_block<R, 1>(p, bk, v + c, v_stride, acc + c, acc_stride);
    for (; c < dv; ++c) {  // columns past the last full vector
      for (int i = 0; i < R; ++i) {
        float sum = 0.0f;
        for (Index j = 0; j < bk; ++j) sum += p[i * kKeyTile + j] * v[j * v_stride + c];
        acc[i * acc_stride + c] += sum;
      }
    }
  }

  static void accumulate(const float* p, Index bq, Index bk, const float* v, Index v_stride,
                         Index dv, float* acc, Index acc_stride) {
    Index i = 0;
    for (; i + kAccRows <= bq; i += kAccRows)
      accumulate_rows<kAccRows>(p + i * kKeyTile, bk, v, v_stride, dv, acc + i * acc_stride,
                                acc_stride);
    for (; i < bq; ++i)
      accumulate_rows<1>(p + i * kKeyTile, bk, v, v_stride, dv, acc + i * acc_stride, acc_stride);
  }
};

}  // namespace simd
#endif

#if defined(OVQ_ARCH_AVX512)
template <>
struct TileOps<float, arch::avx512> : simd::SimdTileOps<simd::F32x16> {};
#endif
#if defined(OVQ_ARCH_AVX2)
template <>
struct TileOps<float, arch::avx2> : simd::SimdTileOps<simd::F32x8> {};
#endif

}  // namespace ovq::kernels
