#pragma once
// The only file that reads compiler and ISA macros. Everything else tests OVQ_* macros.
//
//   OVQ_ARCH_AVX512 / OVQ_ARCH_AVX2 / OVQ_ARCH_NEON   what the compiler targets
//   OVQ_DONT_VECTORIZE                                define to force the portable kernels
//   OVQ_HOST_DEVICE                                   marks math shared by host and CUDA code
//   OVQ_HAS_OPENMP                                    the consumer compiles with OpenMP
//   OVQ_UNROLL                                        unroll the next (fixed-count) loop fully

#if !defined(OVQ_DONT_VECTORIZE)
#if defined(__AVX512F__)
#define OVQ_ARCH_AVX512 1
#endif
#if defined(__AVX2__) && defined(__FMA__)
#define OVQ_ARCH_AVX2 1
#endif
#if defined(__ARM_NEON)
#define OVQ_ARCH_NEON 1
#endif
#endif

#if defined(__CUDACC__)
#define OVQ_HOST_DEVICE __host__ __device__
#else
#define OVQ_HOST_DEVICE
#endif

#if defined(_OPENMP)
#define OVQ_HAS_OPENMP 1
#include <omp.h>
#endif

#if defined(__GNUC__) || defined(__clang__)
#define OVQ_RESTRICT __restrict__
#else
#define OVQ_RESTRICT
#endif

// Register blocks are arrays of vectors indexed by loops with compile-time counts. They only
// stay in registers once those loops are unrolled, which GCC does at -O3 but not at -O2 (the
// arrays then live on the stack and every FMA goes through memory, about 3x slower). The
// micro-kernels ask for it, so that a consumer's -O2 build gets the same code as -O3.
#if defined(__clang__)
#define OVQ_UNROLL _Pragma("unroll")
#elif defined(__GNUC__)
#define OVQ_UNROLL _Pragma("GCC unroll 16")
#else
#define OVQ_UNROLL
#endif
