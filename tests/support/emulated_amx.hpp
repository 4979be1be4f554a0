#pragma once
// The AMX tile kernels (kernels/arch/amx.hpp) on any CPU, for tests: the same packing, tile
// steps and tails, with the tiles in memory and tdpbf16ps in software. So the tile kernels'
// logic runs and is tested on every CI machine, and where the CPU has AMX a test compares the
// hardware with it.
//
// The software dot product adds each entry's 32 products (bf16 inputs, denormals read as 0)
// and its old value in double, then rounds to float (a denormal result becomes 0). The hardware
// sums in an order of its own: it agrees with this to a rounding, not to the bit.
//
// The emulated tiles also check how they are used: a tile operation outside a session
// (begin/end), or a session closed more often than opened, throws std::logic_error, which the
// hardware would answer with a fault or with tiles of the wrong shape.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <stdexcept>

#include "ovq/kernels/arch/tile_ops.hpp"

namespace ovq::test {

struct EmulatedTiles {
  static constexpr Index kRows = kernels::amx::kTileRows;
  static constexpr Index kBytes = kernels::amx::kTileBytes;
  struct Tile {
    unsigned char bytes[kRows * kBytes];
  };
  static Tile& tile(int t) {
    thread_local Tile tiles[8];
    return tiles[t];
  }
  static float bf16_value(const unsigned char* p) {
    std::uint16_t b;
    std::memcpy(&b, p, sizeof b);
    const std::uint32_t u = static_cast<std::uint32_t>(b) << 16;
    float x;
    std::memcpy(&x, &u, sizeof x);
    return std::abs(x) < std::numeric_limits<float>::min() ? 0.0f : x;
  }

  static int& depth() {
    thread_local int open = 0;
    return open;
  }
  static void begin() { ++depth(); }
  static void end() {
    if (--depth() < 0) throw std::logic_error("emulated tiles: a session closed twice");
  }
  static void in_session() {
    if (depth() <= 0) throw std::logic_error("emulated tiles: used outside a session");
  }
  template <int T>
  static void zero() {
    in_session();
    std::memset(tile(T).bytes, 0, sizeof(Tile));
  }
  template <int T>
  static void load(const void* p, Index stride_bytes) {
    in_session();
    for (Index r = 0; r < kRows; ++r)
      std::memcpy(tile(T).bytes + r * kBytes,
                  static_cast<const unsigned char*>(p) + r * stride_bytes, kBytes);
  }
  template <int T>
  static void store(void* p, Index stride_bytes) {
    in_session();
    for (Index r = 0; r < kRows; ++r)
      std::memcpy(static_cast<unsigned char*>(p) + r * stride_bytes, tile(T).bytes + r * kBytes,
                  kBytes);
  }
  // C (16 x 16 floats) += A (16 x 16 pairs) . B (16 pairs x 16 columns of pairs).
  template <int C, int A, int B>
  static void dot() {
    in_session();
    Tile& c = tile(C);
    const Tile& a = tile(A);
    const Tile& b = tile(B);
    for (Index m = 0; m < kRows; ++m) {
      for (Index n = 0; n < kRows; ++n) {
        double sum = 0;
        for (Index k = 0; k < 2 * kernels::amx::kPairs; ++k) {
          const double x = bf16_value(a.bytes + m * kBytes + 2 * k);
          const double y = bf16_value(b.bytes + (k / 2) * kBytes + 4 * n + 2 * (k % 2));
          sum += x * y;
        }
        float old;
        std::memcpy(&old, c.bytes + m * kBytes + 4 * n, sizeof old);
        float result = static_cast<float>(static_cast<double>(old) + sum);
        if (std::abs(result) < std::numeric_limits<float>::min())
          result = std::copysign(0.0f, result);
        std::memcpy(c.bytes + m * kBytes + 4 * n, &result, sizeof result);
      }
    }
  }
};

// Architecture tag: the AMX kernels for bf16 on EmulatedTiles, the portable kernels for the
// rest (they too score key tiles of 64 slots).
struct emulated_amx {
  static constexpr const char* kName = "amx-emulated";
};

}  // namespace ovq::test

namespace ovq::kernels {
template <class Element>
struct TileOps<Element, test::emulated_amx> : TileOps<Element, arch::scalar> {};
template <>
struct TileOps<bf16, test::emulated_amx>
    : amx::TileOps<test::EmulatedTiles, TileOps<bf16, arch::scalar>> {};
}  // namespace ovq::kernels
