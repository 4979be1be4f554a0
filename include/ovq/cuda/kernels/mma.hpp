#pragma once
// One warp's tensor-core product D = A B + C of a 16 x 16 (A) by 16 x 8 (B) tile of 16-bit
// elements into a 16 x 8 float tile: PTX mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16}
// (sm_80 and later), and its host emulation.
//
// Fragments (PTX ISA, "Matrix Fragments for mma.m16n8k16"): lane l, g = l / 4, u = l % 4 holds
//   A: a[0] = (A[g][2u], A[g][2u+1]), a[1] = rows g + 8, a[2] = columns + 8, a[3] = both + 8
//      (each register two elements, the lower column in the lower half);
//   B: b[0] = (B[2u][g], B[2u+1][g]), b[1] = rows + 8;
//   C, D: c[0], c[1] = C[g][2u], C[g][2u+1]; c[2], c[3] = the same columns of row g + 8.
// The loaders below build a lane's fragment from a tile in shared memory.
//
// mma(lane, load_a, load_b, c): load_a(l, a) and load_b(l, b) write lane l's fragments. On a
// GPU every lane loads its own and the warp issues the instruction. In the emulation
// (block.hpp: one thread after another) the lane calls both loaders for all 32 lanes, decodes
// the fragments by the layout above and computes its own four entries, each an FMA chain over
// k in order from c, so a loader with a wrong index fails on the host. The tensor cores sum in
// their own order: GPU and emulation agree to float rounding, not bit for bit; each is
// deterministic.
#include <cstdint>
#include <type_traits>

#include "ovq/config.hpp"
#include "ovq/cuda/kernels/half.hpp"

namespace ovq::cuda::kernels {

struct MmaA {
  std::uint32_t r[4];
};
struct MmaB {
  std::uint32_t r[2];
};

OVQ_HOST_DEVICE inline std::uint32_t pack_pair(std::uint16_t lo, std::uint16_t hi) {
  return static_cast<std::uint32_t>(lo) | (static_cast<std::uint32_t>(hi) << 16);
}

// A 16 x 16 tile of A, row-major at `a` with a row stride of `lda` elements.
template <class Bits>
OVQ_HOST_DEVICE MmaA mma_load_a(const Bits* a, int lda, int lane) {
  const int g = lane >> 2, u = lane & 3;
  MmaA f;
  OVQ_DEVICE_UNROLL
  for (int i = 0; i < 4; ++i) {
    const int row = g + ((i & 1) ? 8 : 0), col = 2 * u + ((i & 2) ? 8 : 0);
    const Bits* x = a + row * lda + col;
    f.r[i] = pack_pair(x[0].bits, x[1].bits);
  }
  return f;
}

// A 16 x 8 tile of B given by its transpose: B[k][n] = bt[n * ldb + k] (keys, for Q K^T).
template <class Bits>
OVQ_HOST_DEVICE MmaB mma_load_b_transposed(const Bits* bt, int ldb, int lane) {
  const int g = lane >> 2, u = lane & 3;
  MmaB f;
  OVQ_DEVICE_UNROLL
  for (int i = 0; i < 2; ++i) {
    const Bits* x = bt + g * ldb + 2 * u + (i ? 8 : 0);
    f.r[i] = pack_pair(x[0].bits, x[1].bits);
  }
  return f;
}

// A 16 x 8 tile of B, row-major: B[k][n] = b[k * ldb + n] (values, for P V).
template <class Bits>
OVQ_HOST_DEVICE MmaB mma_load_b(const Bits* b, int ldb, int lane) {
  const int g = lane >> 2, u = lane & 3;
  MmaB f;
  OVQ_DEVICE_UNROLL
  for (int i = 0; i < 2; ++i) {
    const int k = 2 * u + (i ? 8 : 0);
    f.r[i] = pack_pair(b[k * ldb + g].bits, b[(k + 1) * ldb + g].bits);
  }
  return f;
}

// The element (row, col) of A, and (k, n) of B, in lane fragments `a` / `b` of all 32 lanes.
template <class Bits>
OVQ_HOST_DEVICE float mma_a_entry(const MmaA* a, int row, int col) {
  const int g = row & 7, u = (col & 7) >> 1;
  const int i = (row >= 8 ? 1 : 0) + (col >= 8 ? 2 : 0);
  const std::uint32_t r = a[4 * g + u].r[i];
  return widen(Bits{static_cast<std::uint16_t>((col & 1) ? r >> 16 : r & 0xffffu)});
}
template <class Bits>
OVQ_HOST_DEVICE float mma_b_entry(const MmaB* b, int k, int n) {
  const int u = (k & 7) >> 1;
  const std::uint32_t r = b[4 * n + u].r[k >= 8 ? 1 : 0];
  return widen(Bits{static_cast<std::uint16_t>((k & 1) ? r >> 16 : r & 0xffffu)});
}

// Four 8 x 8 tiles of 16-bit elements from shared memory in one instruction (PTX
// ldmatrix.sync.aligned.m8n8.x4[.trans].shared.b16): lane 8 i + r gives the address of row r of
// tile i (16 bytes at a 16-byte boundary), and lane l receives in register i the entries
// (l / 4, 2 (l % 4)) and (l / 4, 2 (l % 4) + 1) of tile i, with kTrans those of its transpose,
// (2 (l % 4), l / 4) and (2 (l % 4) + 1, l / 4): fragments in the layout above. row_at(i, r) is
// the address of row r of tile i; the emulation reads the same entries from it one by one.
struct MmaX4 {
  std::uint32_t r[4];
};

template <bool kTrans, class Bits, class RowAt>
OVQ_HOST_DEVICE MmaX4 ldmatrix_x4(RowAt&& row_at, int lane) {
  MmaX4 f;
#if defined(OVQ_DEVICE_PASS)
  const auto address =
      static_cast<unsigned>(__cvta_generic_to_shared(row_at(lane >> 3, lane & 7)));
  if constexpr (kTrans) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(f.r[0]), "=r"(f.r[1]), "=r"(f.r[2]), "=r"(f.r[3])
                 : "r"(address));
  } else {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(f.r[0]), "=r"(f.r[1]), "=r"(f.r[2]), "=r"(f.r[3])
                 : "r"(address));
  }
#else
  const int g = lane >> 2, u = lane & 3;
  for (int i = 0; i < 4; ++i) {
    if constexpr (kTrans) {
      f.r[i] = pack_pair(row_at(i, 2 * u)[g].bits, row_at(i, 2 * u + 1)[g].bits);
    } else {
      const Bits* x = row_at(i, g) + 2 * u;
      f.r[i] = pack_pair(x[0].bits, x[1].bits);
    }
  }
#endif
  return f;
}

// The A fragment of a 16 x 16 tile, row-major at `a` (lda elements a row, every row 16-byte
// aligned), in one ldmatrix: tiles (rows 0-7, 8-15) x (columns 0-7, 8-15) in a's register order.
template <class Bits>
OVQ_HOST_DEVICE MmaA mma_ldmatrix_a(const Bits* a, int lda, int lane) {
  const MmaX4 x = ldmatrix_x4<false, Bits>(
      [&](int i, int r) { return a + ((i & 1) * 8 + r) * lda + (i >> 1) * 8; }, lane);
  return MmaA{{x.r[0], x.r[1], x.r[2], x.r[3]}};
}

// The B fragments of two adjacent 16 x 8 tiles (columns n0 .. n0 + 15) in one ldmatrix, each
// MmaB one tile:
//   keys:   B given by its transpose, bt[n * ldb + k] (key rows, for Q K^T);
//   values: B row-major, b[k * ldb + n] (value rows, for P V).
struct MmaB2 {
  MmaB tile[2];
};
template <class Bits>
OVQ_HOST_DEVICE MmaB2 mma_ldmatrix_b_transposed(const Bits* bt, int ldb, int lane) {
  const MmaX4 x = ldmatrix_x4<false, Bits>(
      [&](int i, int r) { return bt + ((i >> 1) * 8 + r) * ldb + (i & 1) * 8; }, lane);
  return MmaB2{{MmaB{{x.r[0], x.r[1]}}, MmaB{{x.r[2], x.r[3]}}}};
}
template <class Bits>
OVQ_HOST_DEVICE MmaB2 mma_ldmatrix_b(const Bits* b, int ldb, int lane) {
  const MmaX4 x = ldmatrix_x4<true, Bits>(
      [&](int i, int r) { return b + ((i & 1) * 8 + r) * ldb + (i >> 1) * 8; }, lane);
  return MmaB2{{MmaB{{x.r[0], x.r[1]}}, MmaB{{x.r[2], x.r[3]}}}};
}

// The fragments a lane loads for mma: on a GPU each lane loads its own, once (load(lane)), and
// every call of the result returns them; in the emulation, where mma asks for every lane's,
// each call loads lane l's (load(l)).
template <class Load>
OVQ_HOST_DEVICE auto lane_fragments(int lane, Load load) {
#if defined(OVQ_DEVICE_PASS)
  const auto own = load(lane);
  return [own](int) { return own; };
#else
  (void)lane;
  return [load](int l) { return load(l); };
#endif
}

template <class Bits, class LoadA, class LoadB>
OVQ_HOST_DEVICE void mma(int lane, LoadA&& load_a, LoadB&& load_b, float c[4]) {
  static_assert(is_half_bits_v<Bits>, "tensor-core tiles are bf16 or fp16");
#if defined(OVQ_DEVICE_PASS)
  const MmaA a = load_a(lane);
  const MmaB b = load_b(lane);
  if constexpr (std::is_same_v<Bits, Bf16Bits>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a.r[0]), "r"(a.r[1]), "r"(a.r[2]), "r"(a.r[3]), "r"(b.r[0]), "r"(b.r[1]));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a.r[0]), "r"(a.r[1]), "r"(a.r[2]), "r"(a.r[3]), "r"(b.r[0]), "r"(b.r[1]));
  }
#else
  MmaA a[32];
  MmaB b[32];
  for (int l = 0; l < 32; ++l) {
    a[l] = load_a(l);
    b[l] = load_b(l);
  }
  const int g = lane >> 2, u = lane & 3;
  for (int i = 0; i < 4; ++i) {
    const int row = g + (i >= 2 ? 8 : 0), col = 2 * u + (i & 1);
    float acc = c[i];
    for (int k = 0; k < 16; ++k)
      acc = std::fma(mma_a_entry<Bits>(a, row, k), mma_b_entry<Bits>(b, k, col), acc);
    c[i] = acc;
  }
#endif
}

}  // namespace ovq::cuda::kernels
