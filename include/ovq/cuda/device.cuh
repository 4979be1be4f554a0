#pragma once
// The GPU backend of the device states and mixers: memory from the stream-ordered allocator,
// copies and kernels on the caller's stream, never a synchronisation outside synchronize().
// Every CUDA failure becomes an ovq::cuda::CudaError naming the call and the CUDA error.
#if !defined(__CUDACC__)
#error "ovq/cuda/device.cuh is CUDA code: compile it with nvcc (the CPU API is <ovq/ovq.hpp>)"
#endif

#include <cuda_runtime.h>

#include <atomic>
#include <cstddef>
#include <mutex>
#include <string>

#include "ovq/core/error.hpp"
#include "ovq/core/views.hpp"
#include "ovq/cuda/block.hpp"

namespace ovq::cuda {

// A CUDA call failed: what() names the call and the CUDA error.
class CudaError : public Error {
 public:
  CudaError(const char* call, cudaError_t code)
      : Error(std::string(call) + ": " + cudaGetErrorName(code) + " (" + cudaGetErrorString(code) +
              ")"),
        code_(code) {}
  cudaError_t code() const { return code_; }

 private:
  cudaError_t code_;
};

inline void check_cuda(cudaError_t code, const char* call) {
  if (code != cudaSuccess) throw CudaError(call, code);
}

// One thread block of program P (block.hpp), with P::shared_bytes of dynamic shared memory.
template <class P>
__global__ void __launch_bounds__(P::kThreads, 1) run_program(const typename P::Params params) {
  extern __shared__ __align__(16) unsigned char shared[];
  DeviceBlock<P::kThreads> block(shared);
  P::run(block, params,
         BlockIndex{static_cast<int>(blockIdx.x), static_cast<int>(blockIdx.y),
                    static_cast<int>(blockIdx.z)});
}

struct Device {
  using Stream = cudaStream_t;

  // Past 48 KiB of shared memory a kernel must opt in, on each device, to the most it launches
  // with (a program's size can depend on its parameters): the largest so far is remembered per
  // device, and the runtime is called (under a lock, so the attribute only grows) only when a
  // launch needs more.
  template <class P>
  static void opt_in(std::size_t shared) {
    static constexpr int kDevices = 64;
    static std::atomic<std::size_t> opted[kDevices] = {};
    static std::mutex lock;
    int device = 0;
    check_cuda(cudaGetDevice(&device), "cudaGetDevice");
    const auto set = [&] {
      int limit = 0;
      check_cuda(cudaDeviceGetAttribute(&limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, device),
                 "cudaDeviceGetAttribute(MaxSharedMemoryPerBlockOptin)");
      cudaFuncAttributes attributes{};
      check_cuda(cudaFuncGetAttributes(&attributes, run_program<P>), "cudaFuncGetAttributes");
      limit -= static_cast<int>(attributes.sharedSizeBytes);  // the static part (block.hpp's)
      if (shared > static_cast<std::size_t>(limit))
        throw Error(ovq::detail::concat(
            "cuda: a kernel needs ", shared, " bytes of shared memory a block, device ", device,
            " allows ", limit, " (every kernel fits sm_80 and sm_90; narrower heads, or float or "
            "16-bit elements in place of double, need less)"));
      check_cuda(cudaFuncSetAttribute(run_program<P>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      static_cast<int>(shared)),
                 "cudaFuncSetAttribute(MaxDynamicSharedMemorySize)");
    };
    if (device < 0 || device >= kDevices) return set();  // past the table: every time
    if (shared <= opted[device].load(std::memory_order_acquire)) return;
    const std::lock_guard<std::mutex> guard(lock);
    if (shared <= opted[device].load(std::memory_order_relaxed)) return;
    set();
    opted[device].store(shared, std::memory_order_release);
  }

  // The thread blocks that fill the current device: its multiprocessor count (remembered per
  // device). The read plans split the merge blocks of a prefill with fewer tiles than this.
  static Index parallel_blocks() {
    static constexpr int kDevices = 64;
    static std::atomic<int> known[kDevices] = {};
    int device = 0;
    check_cuda(cudaGetDevice(&device), "cudaGetDevice");
    const bool listed = device >= 0 && device < kDevices;
    int count = listed ? known[device].load(std::memory_order_relaxed) : 0;
    if (count == 0) {
      check_cuda(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device),
                 "cudaDeviceGetAttribute(MultiProcessorCount)");
      if (listed) known[device].store(count, std::memory_order_relaxed);
    }
    return count;
  }

  static void* allocate(std::size_t bytes, Stream stream) {
    if (bytes == 0) return nullptr;
    void* p = nullptr;
    check_cuda(cudaMallocAsync(&p, bytes, stream), "cudaMallocAsync");
    return p;
  }
  static void release(void* p, Stream stream) noexcept {
    if (p != nullptr) (void)cudaFreeAsync(p, stream);
  }
  static void copy(void* dst, const void* src, std::size_t bytes, Stream stream) {
    if (bytes > 0)
      check_cuda(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, stream), "cudaMemcpyAsync");
  }
  static void zero(void* dst, std::size_t bytes, Stream stream) {
    if (bytes > 0) check_cuda(cudaMemsetAsync(dst, 0, bytes, stream), "cudaMemsetAsync");
  }
  template <class P>
  static void launch(Grid grid, const typename P::Params& params, Stream stream) {
    if (grid.x <= 0 || grid.y <= 0 || grid.z <= 0) return;
    const std::size_t shared = P::shared_bytes(params);
    if (shared > 48 * 1024) opt_in<P>(shared);
    run_program<P><<<dim3(grid.x, grid.y, grid.z), P::kThreads, shared, stream>>>(params);
    check_cuda(cudaGetLastError(), "kernel launch");
  }
  static void synchronize(Stream stream) {
    check_cuda(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
  }
  static bool capturing(Stream stream) {
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    check_cuda(cudaStreamIsCapturing(stream, &status), "cudaStreamIsCapturing");
    return status == cudaStreamCaptureStatusActive;
  }
};

}  // namespace ovq::cuda
