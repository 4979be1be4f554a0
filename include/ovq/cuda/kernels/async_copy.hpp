#pragma once
// Copies from device memory into shared memory that proceed while the block computes
// (cp.async, sm_80 and later), and the 16-byte vector loads of shared memory the kernels'
// inner loops use.
//
// A thread issues copies, commits them as one group (commit_async), and later waits until at
// most N of its groups are still in flight (wait_async<N>); the barrier that ends the phase then
// makes every thread's copies visible to the block. A program issues copies only into shared
// memory that no thread reads or writes until the phase after the matching wait, and from memory
// no kernel writes meanwhile. The emulation holds it to that: a copy poisons its destination
// when issued and lands at the barrier after its wait (block.hpp).
//
// Why: a tile staged by plain loads waits for each thread's loads in turn (a few in flight per
// thread, each a full trip to device memory); staged by cp.async, every piece of the tile is in
// flight at once, and the next tile's pieces load while this one is computed.
#include <cmath>
#include <cstring>

#include "ovq/config.hpp"
#include "ovq/core/views.hpp"
#include "ovq/cuda/block.hpp"

namespace ovq::cuda::kernels {

#if defined(OVQ_DEVICE_PASS) && __CUDA_ARCH__ >= 800
#define OVQ_CUDA_ASYNC_COPY 1
#endif

// 16 bytes from src to dst (both 16-byte aligned; dst in shared memory).
OVQ_HOST_DEVICE inline void copy16_async(void* dst, const void* src) {
#if defined(OVQ_CUDA_ASYNC_COPY)
  const auto to = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(to), "l"(src) : "memory");
#elif defined(OVQ_DEVICE_PASS)
  *static_cast<uint4*>(dst) = *static_cast<const uint4*>(src);
#else
  emulated_copy_async(dst, src, 16);
#endif
}

// One element (4 or 8 bytes asynchronously; a 16-bit element is copied at once).
template <class E>
OVQ_HOST_DEVICE inline void copy_element_async(E* dst, const E* src) {
#if defined(OVQ_CUDA_ASYNC_COPY)
  if constexpr (sizeof(E) == 4 || sizeof(E) == 8) {
    const auto to = static_cast<unsigned>(__cvta_generic_to_shared(dst));
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2;\n" ::"r"(to), "l"(src),
                 "n"(static_cast<int>(sizeof(E)))
                 : "memory");
    return;
  }
#elif !defined(OVQ_DEVICE_PASS)
  if constexpr (sizeof(E) == 4 || sizeof(E) == 8) {
    emulated_copy_async(dst, src, sizeof(E));
    return;
  }
#endif
  *dst = *src;
}

// The copies this thread issued since its last commit, as one group.
OVQ_HOST_DEVICE inline void commit_async() {
#if defined(OVQ_CUDA_ASYNC_COPY)
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#elif !defined(OVQ_DEVICE_PASS)
  emulated_commit_async();
#endif
}

// Waits until at most N of this thread's committed groups are in flight.
template <int N>
OVQ_HOST_DEVICE inline void wait_async() {
#if defined(OVQ_CUDA_ASYNC_COPY)
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
#elif !defined(OVQ_DEVICE_PASS)
  emulated_wait_async(N);
#endif
}

// Entries [c, c + 16 / sizeof(E)) of a row of d entries into dst (16-byte aligned shared
// memory), zeros past d or for no row (row null): one 16-byte copy where `aligned` says every
// row starts at a 16-byte boundary and holds whole pieces, else element by element.
template <class E>
OVQ_HOST_DEVICE inline void copy_piece_async(E* dst, const E* row, Index c, Index d,
                                             bool aligned) {
  constexpr int kN = static_cast<int>(16 / sizeof(E));
  if (row != nullptr && aligned && c + kN <= d) {
    copy16_async(dst, row + c);
    return;
  }
  OVQ_DEVICE_UNROLL
  for (int i = 0; i < kN; ++i) {
    if (row != nullptr && c + i < d) {
      copy_element_async(dst + i, row + c + i);
    } else {
      dst[i] = E{};
    }
  }
}

// A load of device memory that another block of the same launch wrote (and fenced): from L2,
// past this multiprocessor's L1.
template <class T>
OVQ_HOST_DEVICE inline T load_coherent(const T* p) {
#if defined(OVQ_DEVICE_PASS)
  return __ldcg(p);
#else
  return *p;
#endif
}

// kN consecutive entries of shared memory at src (aligned to their size, 8 or 16 bytes) into
// registers: one vector load on a GPU.
template <int kN, class S>
OVQ_HOST_DEVICE inline void load_vector(const S* src, S (&dst)[kN]) {
#if defined(OVQ_DEVICE_PASS)
  if constexpr (sizeof(S) * kN == 16) {
    const uint4 v = *reinterpret_cast<const uint4*>(src);
    std::memcpy(dst, &v, 16);
  } else if constexpr (sizeof(S) * kN == 8) {
    const uint2 v = *reinterpret_cast<const uint2*>(src);
    std::memcpy(dst, &v, 8);
  } else {
    OVQ_DEVICE_UNROLL
    for (int i = 0; i < kN; ++i) dst[i] = src[i];
  }
#else
  for (int i = 0; i < kN; ++i) dst[i] = src[i];
#endif
}

// A thread's block of dot products: dot[i][j] = one FMA chain over the kD features, in order,
// of the rows a + i a_step and b + j b_step (shared memory, 16-byte aligned, read 16 bytes at a
// time): the scores of a read or an assignment, whatever the tiling.
template <int kD, int kA, int kB, class S>
OVQ_HOST_DEVICE inline void dot_block(const S* a, int a_step, const S* b, int b_step,
                                      S (&dot)[kA][kB]) {
  constexpr int kVec = static_cast<int>(16 / sizeof(S));
  OVQ_DEVICE_UNROLL
  for (int i = 0; i < kA; ++i)
    OVQ_DEVICE_UNROLL
    for (int j = 0; j < kB; ++j) dot[i][j] = S(0);
  for (int c = 0; c < kD; c += kVec) {
    S x[kA][kVec], y[kB][kVec];
    OVQ_DEVICE_UNROLL
    for (int i = 0; i < kA; ++i) load_vector(a + i * a_step + c, x[i]);
    OVQ_DEVICE_UNROLL
    for (int j = 0; j < kB; ++j) load_vector(b + j * b_step + c, y[j]);
    OVQ_DEVICE_UNROLL
    for (int f = 0; f < kVec; ++f)
      OVQ_DEVICE_UNROLL
      for (int i = 0; i < kA; ++i)
        OVQ_DEVICE_UNROLL
        for (int j = 0; j < kB; ++j) dot[i][j] = std::fma(x[i][f], y[j][f], dot[i][j]);
  }
}

}  // namespace ovq::cuda::kernels
