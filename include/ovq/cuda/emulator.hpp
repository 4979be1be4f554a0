#pragma once
// A GPU emulated on the host, as a backend of the device states and mixers (ovq/cuda/*.hpp):
// "device" memory is host memory, a stream is a tag, a launch runs the block program block by
// block on the calling thread (block.hpp). Everything a device mixer does (its kernels, its
// counters, its buffers) runs here the same way as on a GPU and gives the same bits, so the
// tests check the CUDA path on machines without one, and on a machine with one they compare
// the two. Slow (every thread of every block in turn): for tests, small shapes.
#include <cstddef>
#include <cstring>
#include <new>

#include "ovq/core/views.hpp"
#include "ovq/cuda/block.hpp"

namespace ovq::cuda {

// A stream of the emulator: only whether it pretends to be capturing a CUDA graph, so that tests
// run the launches a captured call makes (worst-case sizes, decisions taken on the device) and
// see the host's counters go stale as after graph replays.
struct EmulatedStream {
  bool capturing = false;
};

struct Emulator {
  using Stream = EmulatedStream*;
  static constexpr const char* kName = "emulator";

  // Fresh memory is poisoned (every byte 0xff: NaN in every float and double, -1 in integers),
  // so that a kernel reading memory nothing wrote fails its tests.
  static void* allocate(std::size_t bytes, Stream) {
    if (bytes == 0) return nullptr;
    void* p = ::operator new(bytes, std::align_val_t{256});
    std::memset(p, 0xff, bytes);
    return p;
  }
  static void release(void* p, Stream) noexcept {
    if (p != nullptr) ::operator delete(p, std::align_val_t{256});
  }
  static void copy(void* dst, const void* src, std::size_t bytes, Stream) {
    if (bytes > 0) std::memmove(dst, src, bytes);
  }
  static void zero(void* dst, std::size_t bytes, Stream) {
    if (bytes > 0) std::memset(dst, 0, bytes);
  }
  template <class Program>
  static void launch(Grid grid, const typename Program::Params& params, Stream) {
    if (grid.x > 0 && grid.y > 0 && grid.z > 0) emulate<Program>(grid, params);
  }
  // A small GPU's worth of blocks, so that the tests run both launch modes of the reads.
  static Index parallel_blocks() { return 8; }
  static void synchronize(Stream) {}
  static bool capturing(Stream stream) { return stream != nullptr && stream->capturing; }
};

}  // namespace ovq::cuda
