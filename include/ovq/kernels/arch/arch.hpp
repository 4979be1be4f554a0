#pragma once
// Architecture tags. Kernels are templated on one of them, so a single binary can hold (and a
// test can compare) the portable version and the SIMD version of the same kernel.
//
//   arch::scalar   plain C++ loops, always available: the reference the others are tested against
//   arch::avx2     AVX2 + FMA, 8 floats per vector
//   arch::avx512   AVX-512F, 16 floats per vector
//   arch::native   the best one the compiler targets (config.hpp), the default everywhere
#include "ovq/config.hpp"

namespace ovq::arch {

struct scalar {
  static constexpr const char* kName = "scalar";
};
struct avx2 {
  static constexpr const char* kName = "avx2";
};
struct avx512 {
  static constexpr const char* kName = "avx512";
};

#if defined(OVQ_ARCH_AVX512)
using native = avx512;
#elif defined(OVQ_ARCH_AVX2)
using native = avx2;
#else
using native = scalar;
#endif

// Whether the compiler targets `Arch`, i.e. whether its kernels can be instantiated here.
template <class Arch>
inline constexpr bool is_available_v = true;
#if !defined(OVQ_ARCH_AVX512)
template <>
inline constexpr bool is_available_v<avx512> = false;
#endif
#if !defined(OVQ_ARCH_AVX2)
template <>
inline constexpr bool is_available_v<avx2> = false;
#endif

}  // namespace ovq::arch
