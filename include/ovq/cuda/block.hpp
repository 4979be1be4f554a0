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
//
// So that a program breaking the rule fails its tests here rather than racing on a GPU, the
// emulation can run a launch's blocks and each phase's threads last to first
// (set_emulation_order; a GPU runs them in any order, so the bits must not change), and its
// asynchronous copies (async_copy.hpp) land as late as a GPU may land them: at the barrier that
// ends the phase of their wait, their destination poisoned until then.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <deque>
#include <memory>
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

// The order in which the emulation runs a launch's blocks and each phase's threads (forward:
// first to last).
enum class EmulationOrder { forward, reverse };

inline EmulationOrder& emulation_order_setting() {
  static EmulationOrder order = EmulationOrder::forward;
  return order;
}
inline EmulationOrder emulation_order() { return emulation_order_setting(); }
// For the tests: every later launch of the emulation runs in `order`.
inline void set_emulation_order(EmulationOrder order) { emulation_order_setting() = order; }

// The asynchronous copies of one emulated block: a copy poisons its destination (every byte
// 0xff) when issued and lands at the end of the phase in which its thread waits for it, the
// latest a GPU may make it visible to the block; a copy never waited for never lands. So a
// thread that reads a destination before the barrier after the wait reads NaN or -1, where a
// GPU might read stale data.
class EmulatedAsyncCopies {
 public:
  explicit EmulatedAsyncCopies(int threads) : open_(threads), committed_(threads) {}

  void set_thread(int t) { thread_ = t; }
  void issue(void* dst, const void* src, std::size_t bytes) {
    std::memset(dst, 0xff, bytes);
    open_[thread_].push_back(Copy{dst, src, bytes});
  }
  void commit() {
    committed_[thread_].push_back(std::move(open_[thread_]));
    open_[thread_].clear();
  }
  // The thread's committed groups but the `in_flight` latest land at the end of the phase.
  void wait(int in_flight) {
    auto& groups = committed_[thread_];
    while (groups.size() > static_cast<std::size_t>(in_flight)) {
      landing_.insert(landing_.end(), groups.front().begin(), groups.front().end());
      groups.pop_front();
    }
  }
  // At a barrier.
  void land() {
    for (const Copy& c : landing_) std::memcpy(c.dst, c.src, c.bytes);
    landing_.clear();
  }

 private:
  struct Copy {
    void* dst;
    const void* src;
    std::size_t bytes;
  };
  int thread_ = 0;
  std::vector<std::vector<Copy>> open_;             // per thread: issued since its last commit
  std::vector<std::deque<std::vector<Copy>>> committed_;  // per thread: its groups in flight
  std::vector<Copy> landing_;                       // waited for in this phase
};

// The copies of the block the calling host thread is emulating (null outside a launch).
inline EmulatedAsyncCopies*& emulated_async_copies() {
  thread_local EmulatedAsyncCopies* copies = nullptr;
  return copies;
}

// Makes `copies` the calling thread's for its lifetime.
class EmulatedCopiesScope {
 public:
  explicit EmulatedCopiesScope(EmulatedAsyncCopies* copies) : outer_(emulated_async_copies()) {
    emulated_async_copies() = copies;
  }
  ~EmulatedCopiesScope() { emulated_async_copies() = outer_; }
  EmulatedCopiesScope(const EmulatedCopiesScope&) = delete;
  EmulatedCopiesScope& operator=(const EmulatedCopiesScope&) = delete;

 private:
  EmulatedAsyncCopies* outer_;
};

// async_copy.hpp's operations in the emulation; outside a launch a copy is done at once.
inline void emulated_copy_async(void* dst, const void* src, std::size_t bytes) {
  if (EmulatedAsyncCopies* copies = emulated_async_copies()) {
    copies->issue(dst, src, bytes);
  } else {
    std::memcpy(dst, src, bytes);
  }
}
inline void emulated_commit_async() {
  if (EmulatedAsyncCopies* copies = emulated_async_copies()) copies->commit();
}
inline void emulated_wait_async(int in_flight) {
  if (EmulatedAsyncCopies* copies = emulated_async_copies()) copies->wait(in_flight);
}

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

  OVQ_HOST_DEVICE EmulatedBlock(void* shared, bool reverse, EmulatedAsyncCopies* copies)
      : shared_(shared), reverse_(reverse), copies_(copies) {}
  OVQ_HOST_DEVICE void* shared() const { return shared_; }

  template <class F>
  OVQ_HOST_DEVICE void each(F&& f) {
#if defined(OVQ_DEVICE_PASS)
    for (int t = 0; t < kThreads; ++t) f(t);
#else
    for (int i = 0; i < kThreads; ++i) {
      const int t = reverse_ ? kThreads - 1 - i : i;
      copies_->set_thread(t);
      f(t);
    }
    copies_->land();  // the barrier
#endif
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
  bool reverse_;
  EmulatedAsyncCopies* copies_;
};

// The emulation's shared memory: aligned as a GPU's for its 16-byte loads.
constexpr std::size_t kEmulatedSharedAlignment = 16;
struct EmulatedSharedRelease {
  void operator()(unsigned char* p) const {
    ::operator delete(p, std::align_val_t{kEmulatedSharedAlignment});
  }
};

// Runs program P over `grid` on the host, block after block (in emulation_order()), with
// `params` pointing to host memory. Shared memory is poisoned (all bytes 0xff: NaN in every
// float and double) before each block, so that a program reading shared memory it did not write
// fails its tests.
template <class P>
void emulate(Grid grid, const typename P::Params& params) {
  const std::size_t bytes = P::shared_bytes(params);
  // Exactly `bytes` (at least one), so that AddressSanitizer reports a program writing or
  // reading past its shared memory.
  const std::unique_ptr<unsigned char, EmulatedSharedRelease> storage(static_cast<unsigned char*>(
      ::operator new(bytes > 0 ? bytes : 1, std::align_val_t{kEmulatedSharedAlignment})));
  const bool reverse = emulation_order() == EmulationOrder::reverse;
  const long long blocks = static_cast<long long>(grid.x) * grid.y * grid.z;
  for (long long i = 0; i < blocks; ++i) {
    const long long b = reverse ? blocks - 1 - i : i;
    const BlockIndex index{static_cast<int>(b % grid.x), static_cast<int>(b / grid.x % grid.y),
                           static_cast<int>(b / grid.x / grid.y)};
    std::memset(storage.get(), 0xff, bytes);
    EmulatedAsyncCopies copies(P::kThreads);
    const EmulatedCopiesScope scope(&copies);
    EmulatedBlock<P::kThreads> block(storage.get(), reverse, &copies);
    P::run(block, params, index);
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
