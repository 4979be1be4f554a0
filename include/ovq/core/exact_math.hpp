#pragma once
// Arithmetic that rounds the same way on the host and on a GPU, for the code both run (the CUDA
// kernels, their host emulation, the softmax merge).
//
// nvcc contracts a * b + c into one fused multiply-add in device code unless told otherwise
// (--fmad=true is its default), and GCC does the same on the host (-ffp-contract=fast). So a
// product that feeds a sum is written with mul_rn: an explicit, separately rounded product on
// the device (__fmul_rn, which nvcc never contracts) and a plain one on the host (ovq's own
// targets compile with -ffp-contract=off). Fused operations are written with std::fma.
//
// exp_nonpositive(x), x <= 0: 2^n e^r, n = round(x / ln 2), r = x - n ln 2 (ln 2 split in two so
// that n ln2_hi is exact), e^r by a polynomial, all in fused multiply-adds: the same bits on
// every device and in the emulation (CUDA's expf and the host's std::exp differ in the last
// bit). Relative error about 2e-7 (float, degree 6) and 1e-16 (double, degree 13); exactly 0 for
// x below the smallest normal's exponent, and for -inf.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "ovq/config.hpp"

namespace ovq::detail {

OVQ_HOST_DEVICE inline float mul_rn(float a, float b) {
#if defined(OVQ_DEVICE_PASS)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
OVQ_HOST_DEVICE inline double mul_rn(double a, double b) {
#if defined(OVQ_DEVICE_PASS)
  return __dmul_rn(a, b);
#else
  return a * b;
#endif
}

// Round to the nearest integer, ties to even (both the device's rint and the host's).
OVQ_HOST_DEVICE inline float round_even(float x) { return std::nearbyint(x); }
OVQ_HOST_DEVICE inline double round_even(double x) { return std::nearbyint(x); }

// exp_nonpositive for x in [-87.3, 0].
OVQ_HOST_DEVICE inline float exp_in_range(float x) {
  const float n = round_even(mul_rn(x, 1.44269504088896341f));
  float r = std::fma(n, -0.693359375f, x);  // ln 2 = 0.693359375 - 2.12194440e-4: n hi exact
  r = std::fma(n, 2.12194440e-4f, r);
  float p = 1.0f / 720.0f;
  p = std::fma(p, r, 1.0f / 120.0f);
  p = std::fma(p, r, 1.0f / 24.0f);
  p = std::fma(p, r, 1.0f / 6.0f);
  p = std::fma(p, r, 0.5f);
  p = std::fma(p, r, 1.0f);
  p = std::fma(p, r, 1.0f);
  // 2^n for integral n in [-126, 0]: the exponent field.
  const std::uint32_t bits = static_cast<std::uint32_t>(static_cast<std::int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return mul_rn(p, scale);
}

OVQ_HOST_DEVICE inline float exp_nonpositive(float x) {
  if (!(x >= -87.3f)) return 0.0f;  // below the normal range, -inf, or NaN
  return exp_in_range(x);
}

OVQ_HOST_DEVICE inline double exp_nonpositive(double x) {
  if (!(x >= -708.0)) return 0.0;
  const double n = round_even(mul_rn(x, 1.4426950408889634074));
  // ln 2 = hi + lo, hi with 32 significant bits so that n hi is exact for |n| < 2^20.
  double r = std::fma(n, -6.93147180369123816490e-01, x);
  r = std::fma(n, -1.90821492927058770002e-10, r);
  // e^r, |r| <= ln2 / 2, by its Taylor series to r^13 (truncation below 1e-17 relative).
  double p = 1.0 / 6227020800.0;
  p = std::fma(p, r, 1.0 / 479001600.0);
  p = std::fma(p, r, 1.0 / 39916800.0);
  p = std::fma(p, r, 1.0 / 3628800.0);
  p = std::fma(p, r, 1.0 / 362880.0);
  p = std::fma(p, r, 1.0 / 40320.0);
  p = std::fma(p, r, 1.0 / 5040.0);
  p = std::fma(p, r, 1.0 / 720.0);
  p = std::fma(p, r, 1.0 / 120.0);
  p = std::fma(p, r, 1.0 / 24.0);
  p = std::fma(p, r, 1.0 / 6.0);
  p = std::fma(p, r, 0.5);
  p = std::fma(p, r, 1.0);
  p = std::fma(p, r, 1.0);
  const std::uint64_t bits = static_cast<std::uint64_t>(static_cast<std::int64_t>(n) + 1023) << 52;
  double scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return mul_rn(p, scale);
}

// A softmax weight exp(x - m), x <= m (the reads' logits are finite and m is their maximum),
// with 0 where no logit has been seen (m = -inf): the bits of exp_nonpositive(x - m). On the
// device in float without a branch (a weight per score is the reads' largest non-FMA work): the
// polynomial runs on an argument inside its range and the result is selected.
template <class Scalar>
OVQ_HOST_DEVICE Scalar softmax_weight(Scalar x, Scalar m) {
#if defined(OVQ_DEVICE_PASS)
  if constexpr (std::is_same_v<Scalar, float>) {
    const float d = x - m;  // NaN or +inf where m = -inf
    const bool in_range = m != -INFINITY && d >= -87.3f;
    const float w = exp_in_range(in_range ? d : 0.0f);
    return in_range ? w : 0.0f;
  } else {
    return m == -Scalar(INFINITY) ? Scalar(0) : exp_nonpositive(x - m);
  }
#else
  return m == -Scalar(INFINITY) ? Scalar(0) : exp_nonpositive(x - m);
#endif
}

}  // namespace ovq::detail
