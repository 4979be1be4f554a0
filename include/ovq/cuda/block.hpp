#pragma once
// How ovq's CUDA kernels are written: as block programs, one text that runs on a GPU and, in the
// tests, in a host emulation (so that wrong indexing fails on a machine without a GPU).
//
// A program is a struct with
//   static constexpr int kThreads;                      threads per block
//   using Params = ...;                                 plain pointers, strides and sizes
//   static std::size_t shared_bytes(const Params&);     dynamic shared memory per block
//   template <class Block>
//   OVQ_HOST_DEVICE static void run(Block&, const Params&, BlockIndex);
// run() is the code of one thread block, written as phases: block.each(f) runs f(t) for every
// thread t of the block, then the block waits at a barrier (__syncthreads). Code between phases
// is block-uniform: it computes the same values in every thread (on a GPU every thread runs
// it, in the emulation it runs once) and writes no memory. Per-thread state lives in a
// Block::PerThread<T> (one T in registers on a GPU, kThreads of them in the emulation);
// block.shared() is the block's shared memory. block.last_to_arrive(counter, blocks), called in
// block-uniform code, tells the last block of a launch to finish (an integer atomic in device
// memory), which may then act on every block's results (a device-wide step without a launch).
//
// The emulation runs each phase's threads one after the other. That computes what a GPU
// computes because no phase reads what another thread of the block writes in the same phase:
// the programs keep to that rule, and threads only exchange values through shared memory across
// a barrier. Device-wide ordering comes from kernel boundaries only (no atomics, no grid sync).
#include <cstddef>
#include <cstdint>
#include <new>
#include <vector>

#include "ovq/config.hpp"

namespace ovq::cuda {

struct Grid {
  int x = 1, y = 1, z = 1;
};
struct BlockIndex {
  int x = 0, y = 0, z = 0;
};

// ---- host emulation ----

// (Written as host and device code, though it only ever runs on the host: nvcc checks that the
// host-and-device block programs call nothing host-only, whichever block they are given.)
template <class T, int kThreads>
class EmulatedPerThread {
 public:
  OVQ_HOST_DEVICE EmulatedPerThread() : values_(new T[kThreads]()) {}
  OVQ_HOST_DEVICE ~EmulatedPerThread() { delete[] values_; }
  EmulatedPerThread(const EmulatedPerThread&) = delete;
  EmulatedPerThread& operator=(const EmulatedPerThread&) = delete;

  OVQ_HOST_DEVICE T& operator[](int t) { return values_[t]; }

 private:
  T* values_;
};

template <int kThreads>
class EmulatedBlock {
 public:
  template <class T>
  using PerThread = EmulatedPerThread<T, kThreads>;

  OVQ_HOST_DEVICE explicit EmulatedBlock(void* shared) : shared_(shared) {}
  OVQ_HOST_DEVICE void* shared() const { return shared_; }

  template <class F>
  OVQ_HOST_DEVICE void each(F&& f) {
    for (int t = 0; t < kThreads; ++t) f(t);
  }

  // Whether this block is the last of `blocks` to arrive at *arrivals (block-uniform code,
  // after a phase; 0 between launches: the last block sets it back). The blocks run in turn.
  OVQ_HOST_DEVICE bool last_to_arrive(std::int64_t* arrivals, std::int64_t blocks) {
    if (++*arrivals < blocks) return false;
    *arrivals = 0;
    return true;
  }

 private:
  void* shared_;
};

// Runs program P over `grid` on the host, block after block, with `params` pointing to host
// memory. Shared memory is poisoned (all bytes 0xff: NaN in every float and double) before
// each block, so that a program reading shared memory it did not write fails its tests.
template <class P>
void emulate(Grid grid, const typename P::Params& params) {
  const std::size_t bytes = P::shared_bytes(params);
  std::vector<std::max_align_t> storage(bytes / sizeof(std::max_align_t) + 1);
  for (int z = 0; z < grid.z; ++z)
    for (int y = 0; y < grid.y; ++y)
      for (int x = 0; x < grid.x; ++x) {
        unsigned char* raw = reinterpret_cast<unsigned char*>(storage.data());
        for (std::size_t b = 0; b < bytes; ++b) raw[b] = 0xff;
        EmulatedBlock<P::kThreads> block(storage.data());
        P::run(block, params, BlockIndex{x, y, z});
      }
}

// ---- GPU ----

#if defined(__CUDACC__)

template <class T>
struct DevicePerThread {
  T value;
  __device__ __forceinline__ T& operator[](int) { return value; }
};

template <int kThreads>
class DeviceBlock {
 public:
  template <class T>
  using PerThread = DevicePerThread<T>;

  __device__ explicit DeviceBlock(void* shared) : shared_(shared) {}
  __device__ void* shared() const { return shared_; }

  template <class F>
  __device__ __forceinline__ void each(F&& f) {
    f(static_cast<int>(threadIdx.x));
    __syncthreads();
  }

  // Whether this block is the last of `blocks` to arrive (an integer atomic: the blocks finish
  // in any order, and the one that finishes last sees every other's writes, fenced before its
  // arrival).
  // (The barrier orders the block's writes before thread 0's fence, which releases them with
  // its arrival; the last block's thread 0 fences again before the block reads.)
  __device__ bool last_to_arrive(std::int64_t* arrivals, std::int64_t blocks) {
    __shared__ int last;
    __syncthreads();
    if (threadIdx.x == 0) {
      __threadfence();
      const auto before = static_cast<std::int64_t>(
          atomicAdd(reinterpret_cast<unsigned long long*>(arrivals), 1ull));
      last = before + 1 == blocks ? 1 : 0;
      if (last) {
        *arrivals = 0;
        __threadfence();
      }
    }
    __syncthreads();
    return last != 0;
  }

 private:
  void* shared_;
};

#endif

}  // namespace ovq::cuda
