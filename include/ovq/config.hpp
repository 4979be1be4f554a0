#pragma once
// The only file that reads compiler and ISA macros. Everything else tests OVQ_* macros.
//
//   OVQ_ARCH_AVX512 / OVQ_ARCH_AVX2 / OVQ_ARCH_NEON   what the host compiler targets
//   OVQ_ARCH_AVX512BF16                               AVX-512 with bf16 dot products (x86)
//   OVQ_ARCH_AMX                                      and AMX-BF16 tiles (x86, Linux)
//   OVQ_PREFER_AMX                                    define to make arch::amx the native one
//   OVQ_ARCH_F16C                                     half-float conversions (x86)
//   OVQ_DONT_VECTORIZE                                define to force the portable kernels
//   OVQ_HOST_DEVICE                                   marks math shared by host and CUDA code
//   OVQ_DEVICE_PASS                                   nvcc is compiling for the GPU
//   OVQ_HAS_FMA                                       a fused multiply-add is one instruction
//   OVQ_HAS_OPENMP                                    the consumer compiles with OpenMP
//   OVQ_HAS_HUGE_PAGE_ADVICE                          madvise(MADV_HUGEPAGE) (Linux)
//   OVQ_NO_HUGE_PAGES                                 define to leave large buffers on small pages
//   OVQ_UNROLL                                        unroll the next (fixed-count) loop fully
//   OVQ_DEVICE_UNROLL                                 the same, in the device pass only
//
// nvcc compiles a .cu file twice, once for the host and once for the device (__CUDA_ARCH__).
// The host pass sees the host compiler's ISA macros (-Xcompiler -march=native defines
// __AVX512F__ in both passes), so the ISA macros and the host compilers' pragmas are only ever
// set outside the device pass: device code never sees an x86 intrinsic or a GCC pragma.

#if defined(__CUDA_ARCH__)
#define OVQ_DEVICE_PASS 1
#endif

#if !defined(OVQ_DONT_VECTORIZE) && !defined(OVQ_DEVICE_PASS)
#if defined(__AVX512F__)
#define OVQ_ARCH_AVX512 1
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define OVQ_ARCH_AVX512BF16 1
// Tile registers are handed out by the operating system (Linux: arch_prctl); not through nvcc,
// whose host pass need not accept the tile instructions.
// (GCC spells the macros __AMX_TILE__ and __AMX_BF16__, Clang __AMXTILE__ and __AMXBF16__.)
#if (defined(__AMX_TILE__) || defined(__AMXTILE__)) && \
    (defined(__AMX_BF16__) || defined(__AMXBF16__)) && defined(__linux__) && !defined(__CUDACC__)
#define OVQ_ARCH_AMX 1
#endif
#endif
#endif
#if defined(__AVX2__) && defined(__FMA__)
#define OVQ_ARCH_AVX2 1
#endif
#if defined(__F16C__)
#define OVQ_ARCH_F16C 1
#endif
#if defined(__ARM_NEON)
#define OVQ_ARCH_NEON 1
#endif
#endif

// Every GPU has fused multiply-adds; a host has them where the compiler targets FMA.
#if defined(OVQ_DEVICE_PASS) || defined(__FMA__)
#define OVQ_HAS_FMA 1
#endif

// Large state buffers ask Linux for transparent huge pages (core/row_buffer.hpp); define
// OVQ_NO_HUGE_PAGES to keep ordinary pages.
#if defined(__linux__) && !defined(OVQ_NO_HUGE_PAGES)
#define OVQ_HAS_HUGE_PAGE_ADVICE 1
#endif

#if defined(__CUDACC__)
#define OVQ_HOST_DEVICE __host__ __device__
#else
#define OVQ_HOST_DEVICE
#endif

#if defined(_OPENMP) && !defined(OVQ_DEVICE_PASS)
#define OVQ_HAS_OPENMP 1
#include <omp.h>
#endif

#if defined(__GNUC__) || defined(__clang__) || defined(__CUDACC__)
#define OVQ_RESTRICT __restrict__
#else
#define OVQ_RESTRICT
#endif

// Register blocks are arrays of vectors indexed by loops with compile-time counts. They only
// stay in registers once those loops are unrolled, which GCC does at -O3 but not at -O2 (the
// arrays then live on the stack and every FMA goes through memory). The micro-kernels ask for
// it, so that a consumer's -O2 build gets the same code as -O3. The device pass has nvcc's own
// pragma; the host pass of nvcc has none (its front end rejects GCC's spelling and forwards
// nvcc's to GCC, which rejects that), so host code in a .cu file needs -O3 for its register blocks.
// In-register shuffles of a whole register block (a transpose) are inlined whatever the
// compiler's size heuristics say: called out of line, the block goes through the stack. And a
// register block that needs every register is kept out of line: inlined into a caller with
// values of its own live, its accumulators spill.
#if defined(__GNUC__) || defined(__clang__)
#define OVQ_ALWAYS_INLINE inline __attribute__((always_inline))
#define OVQ_NOINLINE __attribute__((noinline))
#else
#define OVQ_ALWAYS_INLINE inline
#define OVQ_NOINLINE
#endif

#if defined(OVQ_DEVICE_PASS)
#define OVQ_UNROLL _Pragma("unroll")
#elif defined(__CUDACC__)
#define OVQ_UNROLL
#elif defined(__clang__)
#define OVQ_UNROLL _Pragma("unroll")
#elif defined(__GNUC__)
#define OVQ_UNROLL _Pragma("GCC unroll 16")
#else
#define OVQ_UNROLL
#endif

// The CUDA kernels' loops over register fragments unroll in the device pass only. Their host
// emulation (the tests) runs them as written: unrolled, an emulated warp-wide mma is larger than
// a host compiler will unroll, and clang says so once per loop and instantiation.
#if defined(OVQ_DEVICE_PASS)
#define OVQ_DEVICE_UNROLL _Pragma("unroll")
#else
#define OVQ_DEVICE_UNROLL
#endif
