#pragma once
// Architecture tags. Kernels are templated on one of them, so a single binary can hold (and a
// test can compare) the portable version and the SIMD version of the same kernel.
//
//   arch::scalar   plain C++ loops, always available: the reference the others are tested against
//   arch::avx2     AVX2 + FMA, 8 floats per vector
//   arch::avx512   AVX-512F, 16 floats per vector
//   arch::avx512bf16  AVX-512 with AVX512-BF16: bf16 scores by dot products of element pairs
//                  (vdpbf16ps, twice the FMA rate); every other element as arch::avx512
//   arch::amx      AVX512-BF16 with AMX-BF16 tiles: bf16 reads as tile products (scores and
//                  P V); every other element as arch::avx512bf16. Named explicitly, or native
//                  where OVQ_PREFER_AMX is defined: its bf16 prefill is several times faster, its
//                  single-row decode step slower (bench/README.md)
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
struct avx512bf16 {
  static constexpr const char* kName = "avx512bf16";
};
struct amx {
  static constexpr const char* kName = "amx";
};

#if defined(OVQ_ARCH_AMX) && defined(OVQ_PREFER_AMX)
using native = amx;
#elif defined(OVQ_ARCH_AVX512BF16)
using native = avx512bf16;
#elif defined(OVQ_ARCH_AVX512)
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
#if !defined(OVQ_ARCH_AVX512BF16)
template <>
inline constexpr bool is_available_v<avx512bf16> = false;
#endif
#if !defined(OVQ_ARCH_AMX)
template <>
inline constexpr bool is_available_v<amx> = false;
#endif
#if !defined(OVQ_ARCH_AVX2)
template <>
inline constexpr bool is_available_v<avx2> = false;
#endif

}  // namespace ovq::arch
