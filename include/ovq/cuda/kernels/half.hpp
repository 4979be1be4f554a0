#pragma once
// The 16-bit elements as the CUDA kernels see them: raw bits (Bf16Bits, Fp16Bits). The host
// emulation widens and rounds them by integer arithmetic only (widen_by_integers,
// narrow_by_integers), whatever the compiler's flags; the GPU by its conversion instructions
// (cvt: IEEE round to nearest even, subnormals kept, overflow to inf), which give the same bits,
// and takes the integer path for NaNs and infinities (a GPU test compares the two paths over
// every float). The host API types them as the CPU does (ovq::bf16, ovq::fp16: same size, same
// bits); device_element_t maps one to the other.
//
//   widen(x)             exact (every bf16 and fp16 value is a float)
//   narrow<Bits>(f)      to nearest, ties to even; NaN stays NaN, overflow goes to inf (the
//                        kernels clamp outputs to largest_finite<Bits>() first)
//   narrow_finite<Bits>(f)  the same for a finite f, without narrow's NaN and inf check (a
//                        read's weights); narrow_finite_pair: two of them packed in 32 bits
//   compute_of(x)        what a kernel computes with: widen(x) for 16-bit bits, else x
//   element_of<Stored>(f)  a result as the element stored: narrow for 16-bit bits, else f
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "ovq/config.hpp"

namespace ovq::cuda {

struct Bf16Bits {
  std::uint16_t bits;
};
struct Fp16Bits {
  std::uint16_t bits;
};

template <class Stored>
inline constexpr bool is_half_bits_v =
    std::is_same_v<Stored, Bf16Bits> || std::is_same_v<Stored, Fp16Bits>;

namespace kernels {

OVQ_HOST_DEVICE inline float float_from_bits(std::uint32_t b) {
  float f;
  std::memcpy(&f, &b, sizeof f);
  return f;
}
OVQ_HOST_DEVICE inline std::uint32_t bits_of(float f) {
  std::uint32_t b;
  std::memcpy(&b, &f, sizeof b);
  return b;
}

OVQ_HOST_DEVICE inline float widen(Bf16Bits x) {
  return float_from_bits(static_cast<std::uint32_t>(x.bits) << 16);
}

OVQ_HOST_DEVICE inline float widen_by_integers(Fp16Bits x) {
  const std::uint32_t sign = static_cast<std::uint32_t>(x.bits & 0x8000u) << 16;
  std::uint32_t exponent = (x.bits >> 10) & 0x1fu;
  std::uint32_t mantissa = x.bits & 0x3ffu;
  if (exponent == 0x1f) return float_from_bits(sign | 0x7f800000u | (mantissa << 13));
  if (exponent == 0) {
    if (mantissa == 0) return float_from_bits(sign);
    // Subnormal: m 2^-24, normalised into float's exponent range.
    exponent = 1;
    while ((mantissa & 0x400u) == 0) {
      mantissa <<= 1;
      --exponent;
    }
    mantissa &= 0x3ffu;
  }
  return float_from_bits(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

OVQ_HOST_DEVICE inline float widen(Fp16Bits x) {
#if defined(OVQ_DEVICE_PASS)
  if ((x.bits & 0x7c00u) != 0x7c00u) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x.bits));
    return f;
  }
#endif
  return widen_by_integers(x);
}

template <class Bits>
OVQ_HOST_DEVICE Bits narrow_by_integers(float f);

template <>
OVQ_HOST_DEVICE inline Bf16Bits narrow_by_integers<Bf16Bits>(float f) {
  const std::uint32_t b = bits_of(f);
  if ((b & 0x7fffffffu) > 0x7f800000u) return {static_cast<std::uint16_t>((b >> 16) | 0x0040u)};
  const std::uint32_t rounded = b + 0x7fffu + ((b >> 16) & 1u);
  return {static_cast<std::uint16_t>(rounded >> 16)};
}

template <>
OVQ_HOST_DEVICE inline Fp16Bits narrow_by_integers<Fp16Bits>(float f) {
  const std::uint32_t b = bits_of(f);
  const std::uint16_t sign = static_cast<std::uint16_t>((b >> 16) & 0x8000u);
  const std::uint32_t a = b & 0x7fffffffu;
  if (a > 0x7f800000u) return {static_cast<std::uint16_t>(sign | 0x7e00u)};  // NaN
  if (a >= 0x477ff000u) return {static_cast<std::uint16_t>(sign | 0x7c00u)};  // >= 65520: inf
  const std::uint32_t exponent = a >> 23;
  std::uint32_t keep, rest, half;
  if (exponent >= 113) {  // a normal half: drop 13 of float's 23 mantissa bits
    keep = ((exponent - 112u) << 10) | ((a & 0x7fffffu) >> 13);
    rest = a & 0x1fffu;
    half = 0x1000u;
  } else {  // a subnormal half (or zero): the value in units of 2^-24
    const std::uint32_t shift = 126u - exponent;  // >= 14
    if (exponent == 0 || shift > 24) return {sign};
    const std::uint32_t m = (a & 0x7fffffu) | 0x800000u;
    keep = m >> shift;
    rest = m & ((1u << shift) - 1u);
    half = 1u << (shift - 1u);
  }
  if (rest > half || (rest == half && (keep & 1u) != 0)) ++keep;  // a carry moves the exponent
  return {static_cast<std::uint16_t>(sign | keep)};
}

// narrow for a finite f only (a read's weights, exp of a non-positive value): no NaN and inf
// check on the device.
template <class Bits>
OVQ_HOST_DEVICE Bits narrow_finite(float f) {
#if defined(OVQ_DEVICE_PASS)
  std::uint16_t h;
  if constexpr (std::is_same_v<Bits, Bf16Bits>) {
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
  } else {
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
  }
  return {h};
#else
  return narrow_by_integers<Bits>(f);
#endif
}

// Two finite values rounded as narrow_finite, packed with lo in the low 16 bits (a
// tensor-core fragment register's order): one instruction on the device.
template <class Bits>
OVQ_HOST_DEVICE std::uint32_t narrow_finite_pair(float lo, float hi) {
#if defined(OVQ_DEVICE_PASS)
  std::uint32_t packed;
  if constexpr (std::is_same_v<Bits, Bf16Bits>) {
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(packed) : "f"(hi), "f"(lo));
  } else {
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(packed) : "f"(hi), "f"(lo));
  }
  return packed;
#else
  return static_cast<std::uint32_t>(narrow_by_integers<Bits>(lo).bits) |
         (static_cast<std::uint32_t>(narrow_by_integers<Bits>(hi).bits) << 16);
#endif
}
// The element in the low (half 0) or high (half 1) 16 bits of a packed pair.
template <class Bits>
OVQ_HOST_DEVICE Bits pair_half(std::uint32_t packed, int half) {
  return {static_cast<std::uint16_t>(half == 0 ? packed & 0xffffu : packed >> 16)};
}

template <class Bits>
OVQ_HOST_DEVICE Bits narrow(float f) {
#if defined(OVQ_DEVICE_PASS)
  if ((bits_of(f) & 0x7f800000u) != 0x7f800000u) return narrow_finite<Bits>(f);
#endif
  return narrow_by_integers<Bits>(f);
}

// The largest finite value of a 16-bit element, as a float.
template <class Bits>
OVQ_HOST_DEVICE float largest_finite_of() {
  if constexpr (std::is_same_v<Bits, Bf16Bits>) {
    return float_from_bits(0x7f7f0000u);
  } else {
    return 65504.0f;
  }
}

// An element as the kernels compute with it: 16-bit bits widened to float, others as they are.
template <class Scalar>
OVQ_HOST_DEVICE Scalar compute_of(Scalar x) {
  return x;
}
OVQ_HOST_DEVICE inline float compute_of(Bf16Bits x) { return widen(x); }
OVQ_HOST_DEVICE inline float compute_of(Fp16Bits x) { return widen(x); }

// A computed value as an element: rounded to 16 bits (to nearest even, overflow to inf, as the
// CPU's narrow), or as it is.
template <class Stored, class Scalar>
OVQ_HOST_DEVICE Stored element_of(Scalar x) {
  if constexpr (is_half_bits_v<Stored>) {
    return narrow<Stored>(x);
  } else {
    return x;
  }
}

OVQ_HOST_DEVICE inline bool finite_bits(Bf16Bits x) { return (x.bits & 0x7f80u) != 0x7f80u; }
OVQ_HOST_DEVICE inline bool finite_bits(Fp16Bits x) { return (x.bits & 0x7c00u) != 0x7c00u; }

}  // namespace kernels

}  // namespace ovq::cuda
