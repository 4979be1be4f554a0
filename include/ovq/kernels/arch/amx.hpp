#pragma once
// bf16 reads on AMX tiles (AMX-BF16): the two products of a key tile, scores and P V, as tile
// dot products; masking, softmax and scaling stay with the vector kernels of the base.
//
// A tile dot product (tdpbf16ps) adds to each float entry of C the 32 products of a row of A
// and a column of B (16 bf16 pairs), summed in the hardware's own order and rounded. An entry
// depends only on its row of A, its column of B and its old value, not on where it sits in the
// tile or how many rows the tile holds. So a score is computed from q_i and K[j] alone, 32
// features at a time in order, whatever the number of query rows: the read's cut invariance
// (tile_ops.hpp) holds on the hardware. The hardware's rounding of the 32-product sum is not
// specified; the tests' emulation (tests/support/emulated_amx.hpp) adds the products in double
// and rounds the sum to float, which the hardware agrees with to a rounding.
//
// Layouts (tiles of 16 rows x 64 bytes):
//   scores  more than 16 rows: C (16 query rows x 16 keys) = A (16 rows x 32 features: the
//           queries as they are) . B (16 feature pairs x 16 keys: the key rows transposed in
//           32-bit pairs, packed per call).
//           Up to 16 rows (a decode step): C (16 keys x 16 rows) = A (the key rows as they are)
//           . B (the queries transposed in pairs). The same products, so the same bits.
//   P V     C (16 rows x 16 value columns: the accumulator) += A (16 rows x 32 slots: the
//           weights rounded to bf16, as on AVX512-BF16) . B (16 slot pairs x 16 columns: value
//           rows interleaved in pairs, packed per call).
// A tail of features or columns is zero-padded; rows past bq reach only entries never read.
// Shapes as TileOps (tile_ops.hpp): q (bq x d), keys[kKeyTile] (d each), p (bq x kKeyTile),
// v[kKeyTile] (dv each), acc (bq x dv). Cost: 2 bq kKeyTile (d + dv) flops on the tile unit,
// kKeyTile (d + dv) element moves to pack.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#include "ovq/core/types.hpp"
#include "ovq/kernels/arch/arch.hpp"
#include "ovq/kernels/arch/tile_ops.hpp"

#if defined(OVQ_ARCH_AMX)
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace ovq::kernels::amx {

inline constexpr Index kTileRows = 16;   // rows of every tile
inline constexpr Index kTileBytes = 64;  // bytes of a tile row
inline constexpr Index kPairs = 16;      // bf16 pairs in a tile row: 32 features or slots
inline constexpr Index kChunk = 2 * kPairs;
inline constexpr Index kTileWords = kTileRows * kPairs;  // 32-bit words of a tile

inline std::uint16_t bits(const bf16& x) {
  std::uint16_t b;
  std::memcpy(&b, &x, sizeof b);
  return b;
}
inline std::uint32_t pair(std::uint16_t even, std::uint16_t odd) {
  return static_cast<std::uint32_t>(even) | static_cast<std::uint32_t>(odd) << 16;
}

#if defined(OVQ_ARCH_AMX)
// Whether this process may use the tile registers: the CPU has AMX-TILE and AMX-BF16 (CPUID
// leaf 7: EDX bits 24 and 22; a virtual machine may hide what the compiler was told), and Linux
// hands the registers out on request (arch_prctl ARCH_REQ_XCOMP_PERM for XTILEDATA), once for
// the whole process. Otherwise TileOps<bf16, arch::amx> computes with the AVX512-BF16 kernels
// for the life of the process.
inline bool usable() {
  static const bool granted = [] {
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    if (__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx) == 0) return false;
    if ((edx >> 24 & 1u) == 0 || (edx >> 22 & 1u) == 0) return false;
    constexpr long kRequestPermission = 0x1023;  // ARCH_REQ_XCOMP_PERM
    constexpr long kTileData = 18;               // XFEATURE_XTILEDATA
    return syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
  }();
  return granted;
}

// The hardware's tiles. Every tile is configured 16 x 64 bytes. A kernel call opens a session
// (begin/end): the outermost one loads the configuration and releases the tiles at its end, so
// the configuration is never assumed across code that is not ovq's (another library may load
// its own in between), and a caller that makes many calls in a row (the read's merge block:
// read_tiles.hpp, TileSession) loads it once for all of them. The other way round, a caller's
// own tile state does not survive an ovq call on the same thread: load it again after.
struct HardwareTiles {
  static int& depth() {
    thread_local int open = 0;
    return open;
  }
  static void begin() {
    struct alignas(64) Config {
      std::uint8_t palette, start_row, reserved[14];
      std::uint16_t colsb[16];
      std::uint8_t rows[16];
    };
    static const Config config = [] {
      Config c{};
      c.palette = 1;
      for (int t = 0; t < 8; ++t) {
        c.colsb[t] = static_cast<std::uint16_t>(kTileBytes);
        c.rows[t] = static_cast<std::uint8_t>(kTileRows);
      }
      return c;
    }();
    if (depth()++ == 0) _tile_loadconfig(&config);
  }
  static void end() {
    if (--depth() == 0) _tile_release();
  }
  // The tile instructions written out: the compilers' intrinsics take the tile number as a
  // macro argument (no template parameter), and their loads do not tell the compiler that they
  // read memory (the packed operands are written just before).
  template <int T>
  static void zero() {
    asm volatile("{tilezero\t%%tmm%c0|tilezero\ttmm%c0}" ::"i"(T));
  }
  template <int T>
  static void load(const void* p, Index stride_bytes) {
    asm volatile("{tileloadd\t(%0,%1,1), %%tmm%c2|tileloadd\ttmm%c2, [%0+%1*1]}"
                 :
                 : "r"(p), "r"(static_cast<long>(stride_bytes)), "i"(T)
                 : "memory");
  }
  template <int T>
  static void store(void* p, Index stride_bytes) {
    asm volatile("{tilestored\t%%tmm%c2, (%0,%1,1)|tilestored\t[%0+%1*1], tmm%c2}"
                 :
                 : "r"(p), "r"(static_cast<long>(stride_bytes)), "i"(T)
                 : "memory");
  }
  template <int C, int A, int B>
  static void dot() {
    asm volatile("{tdpbf16ps\t%%tmm%c2, %%tmm%c1, %%tmm%c0|tdpbf16ps\ttmm%c0, tmm%c1, tmm%c2}"
                 :
                 : "i"(C), "i"(A), "i"(B));
  }
};
#endif

// How the B operands and the weights are laid out for the tiles. PortablePacking is plain C++
// (the reference, and the emulation's); Avx512Packing moves the same bits with AVX-512.
//   keys     keys[j] features [32c, 32c + 32) -> out[(c groups + g) 256 + p 16 + (j - 16 g)]:
//            pair p of key j (g = j / 16), zero past d. 16 x 16 transposes of 32-bit pairs.
//   values   slots 2m, 2m + 1 of chunk h (slots [32h, 32h + 32)), columns [16b, 16b + 16) ->
//            out[(h blocks + b) 256 + m 16 + column], zero past dv.
//   queries  bq <= 16 query rows -> out[c 256 + p 16 + i]: pair p of chunk c of row i, zero past
//            d (columns past bq untouched).
//   scores_from_columns  S^T tiles (key j's scores in block[j 16 .. j 16 + 16)) -> s (bq x
//            key_tile), times beta.
//   weights  p (rows x 64 floats) -> out (16 x 64 bf16): rounded to nearest even, denormals
//            to 0 (the tiles read a denormal bf16 as 0 anyway), rows past `rows` zero.
struct PortablePacking {
  static void keys(const bf16* const* keys, Index key_tile, Index d, std::uint32_t* out) {
    const Index chunks = (d + kChunk - 1) / kChunk;
    const Index groups = key_tile / kTileRows;
    for (Index j = 0; j < key_tile; ++j) {
      const bf16* k = keys[j];
      const Index g = j / kTileRows, col = j % kTileRows;
      for (Index c = 0; c < chunks; ++c) {
        std::uint32_t* tile = out + (c * groups + g) * kTileWords;
        for (Index p = 0; p < kPairs; ++p) {
          const Index f = c * kChunk + 2 * p;
          const std::uint16_t even = f < d ? bits(k[f]) : 0;
          const std::uint16_t odd = f + 1 < d ? bits(k[f + 1]) : 0;
          tile[p * kTileRows + col] = pair(even, odd);
        }
      }
    }
  }
  static void values(const bf16* const* v, Index key_tile, Index dv, std::uint32_t* out) {
    const Index blocks = (dv + kTileRows - 1) / kTileRows;
    for (Index h = 0; h < key_tile / kChunk; ++h) {
      for (Index m = 0; m < kPairs; ++m) {
        const bf16* even = v[h * kChunk + 2 * m];
        const bf16* odd = v[h * kChunk + 2 * m + 1];
        for (Index b = 0; b < blocks; ++b) {
          std::uint32_t* row = out + ((h * blocks + b) * kPairs + m) * kTileRows;
          for (Index col = 0; col < kTileRows; ++col) {
            const Index c = b * kTileRows + col;
            row[col] = c < dv ? pair(bits(even[c]), bits(odd[c])) : 0;
          }
        }
      }
    }
  }
  static void queries(const bf16* q, Index q_stride, Index bq, Index d, std::uint32_t* out) {
    const Index chunks = (d + kChunk - 1) / kChunk;
    for (Index i = 0; i < bq; ++i) {
      const bf16* row = q + i * q_stride;
      for (Index f = 0; f < chunks * kChunk; f += 2) {
        const std::uint16_t even = f < d ? bits(row[f]) : 0;
        const std::uint16_t odd = f + 1 < d ? bits(row[f + 1]) : 0;
        out[(f / kChunk) * kTileWords + (f % kChunk) / 2 * kTileRows + i] = pair(even, odd);
      }
    }
  }
  static void scores_from_columns(const float* block, Index bq, Index key_tile, float beta,
                                  float* s) {
    for (Index i = 0; i < bq; ++i)
      for (Index j = 0; j < key_tile; ++j) s[i * key_tile + j] = block[j * kTileRows + i] * beta;
  }
  static void weights(const float* p, Index rows, std::uint16_t* out) {
    constexpr Index kSlots = 2 * kChunk;
    for (Index r = 0; r < kTileRows; ++r) {
      for (Index j = 0; j < kSlots; ++j) {
        float x = r < rows ? p[r * kSlots + j] : 0.0f;
        if (std::abs(x) < std::numeric_limits<float>::min()) x = std::copysign(0.0f, x);
        out[r * kSlots + j] = bits(bf16(x));
      }
    }
  }
};

#if defined(OVQ_ARCH_AMX)
struct Avx512Packing {
  // r[j] <- column j of the 16 x 16 matrix of 32-bit entries r: two rounds of unpacks within
  // 128-bit lanes, then two of lane shuffles. 64 shuffles.
  static void transpose16(__m512i r[16]) {
    __m512i a[16], b[16];
    for (int i = 0; i < 8; ++i) {
      a[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
      a[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; ++i) {  // b[4i + k], lane L: column 4L + k of rows 4i .. 4i + 3
      b[4 * i] = _mm512_unpacklo_epi64(a[4 * i], a[4 * i + 2]);
      b[4 * i + 1] = _mm512_unpackhi_epi64(a[4 * i], a[4 * i + 2]);
      b[4 * i + 2] = _mm512_unpacklo_epi64(a[4 * i + 1], a[4 * i + 3]);
      b[4 * i + 3] = _mm512_unpackhi_epi64(a[4 * i + 1], a[4 * i + 3]);
    }
    for (int k = 0; k < 4; ++k) {
      const __m512i low0 = _mm512_shuffle_i32x4(b[k], b[4 + k], 0x44);  // lanes 0, 1 of each
      const __m512i low1 = _mm512_shuffle_i32x4(b[8 + k], b[12 + k], 0x44);
      const __m512i high0 = _mm512_shuffle_i32x4(b[k], b[4 + k], 0xEE);  // lanes 2, 3
      const __m512i high1 = _mm512_shuffle_i32x4(b[8 + k], b[12 + k], 0xEE);
      r[k] = _mm512_shuffle_i32x4(low0, low1, 0x88);
      r[4 + k] = _mm512_shuffle_i32x4(low0, low1, 0xDD);
      r[8 + k] = _mm512_shuffle_i32x4(high0, high1, 0x88);
      r[12 + k] = _mm512_shuffle_i32x4(high0, high1, 0xDD);
    }
  }
  static void keys(const bf16* const* keys, Index key_tile, Index d, std::uint32_t* out) {
    const Index chunks = (d + kChunk - 1) / kChunk;
    const Index groups = key_tile / kTileRows;
    for (Index c = 0; c < chunks; ++c) {
      const Index width = std::min(kChunk, d - c * kChunk);
      const __mmask32 mask = width == kChunk ? ~__mmask32(0) : (__mmask32(1) << width) - 1;
      for (Index g = 0; g < groups; ++g) {
        __m512i r[16];
        for (int j = 0; j < 16; ++j)
          r[j] = _mm512_maskz_loadu_epi16(mask, keys[g * kTileRows + j] + c * kChunk);
        transpose16(r);
        std::uint32_t* tile = out + (c * groups + g) * kTileWords;
        for (int p = 0; p < 16; ++p) _mm512_storeu_si512(tile + p * kTileRows, r[p]);
      }
    }
  }
  // 32 columns of a slot pair at a time: two loads, two word interleaves (columns 0-15 and
  // 16-31 of the pair), two stores.
  static void values(const bf16* const* v, Index key_tile, Index dv, std::uint32_t* out) {
    alignas(64) static constexpr short kLow[32] = {
        0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
        8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
    alignas(64) static constexpr short kHigh[32] = {
        16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
        24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
    const __m512i low = _mm512_load_si512(kLow), high = _mm512_load_si512(kHigh);
    const Index blocks = (dv + kTileRows - 1) / kTileRows;
    for (Index h = 0; h < key_tile / kChunk; ++h) {
      for (Index m = 0; m < kPairs; ++m) {
        const bf16* even = v[h * kChunk + 2 * m];
        const bf16* odd = v[h * kChunk + 2 * m + 1];
        for (Index b = 0; b < blocks; b += 2) {
          const Index width = std::min<Index>(2 * kTileRows, dv - b * kTileRows);
          const __mmask32 mask =
              width == 2 * kTileRows ? ~__mmask32(0) : (__mmask32(1) << width) - 1;
          const __m512i e = _mm512_maskz_loadu_epi16(mask, even + b * kTileRows);
          const __m512i o = _mm512_maskz_loadu_epi16(mask, odd + b * kTileRows);
          std::uint32_t* row = out + ((h * blocks + b) * kPairs + m) * kTileRows;
          _mm512_storeu_si512(row, _mm512_permutex2var_epi16(e, low, o));
          if (b + 1 < blocks)
            _mm512_storeu_si512(row + kTileWords, _mm512_permutex2var_epi16(e, high, o));
        }
      }
    }
  }
  // Offsets of the 16 entries of a tile column, in 32-bit words (kTileRows = 16 a row).
  static __m512i down_a_column() {
    return _mm512_setr_epi32(0, 16, 32, 48, 64, 80, 96, 112, 128, 144, 160, 176, 192, 208, 224,
                             240);
  }
  // Each chunk of a row is one load and one scatter down column i.
  static void queries(const bf16* q, Index q_stride, Index bq, Index d, std::uint32_t* out) {
    const __m512i down = down_a_column();
    const Index chunks = (d + kChunk - 1) / kChunk;
    for (Index i = 0; i < bq; ++i) {
      for (Index c = 0; c < chunks; ++c) {
        const Index width = std::min(kChunk, d - c * kChunk);
        const __mmask32 mask = width == kChunk ? ~__mmask32(0) : (__mmask32(1) << width) - 1;
        const __m512i pairs = _mm512_maskz_loadu_epi16(mask, q + i * q_stride + c * kChunk);
        _mm512_i32scatter_epi32(out + c * kTileWords + i, down, pairs, 4);
      }
    }
  }
  // Row i of s, 16 keys at a time: one gather down column i of a tile.
  static void scores_from_columns(const float* block, Index bq, Index key_tile, float beta,
                                  float* s) {
    const __m512i down = down_a_column();
    const __m512 b = _mm512_set1_ps(beta);
    for (Index i = 0; i < bq; ++i)
      for (Index j = 0; j < key_tile; j += kTileRows)
        _mm512_storeu_ps(s + i * key_tile + j,
                         _mm512_mul_ps(_mm512_i32gather_ps(down, block + j * kTileRows + i, 4), b));
  }
  static void weights(const float* p, Index rows, std::uint16_t* out) {
    constexpr Index kSlots = 2 * kChunk;
    for (Index r = 0; r < kTileRows; ++r) {
      for (Index h = 0; h < kSlots; h += kChunk) {
        __m512i w = _mm512_setzero_si512();
        if (r < rows) {
          const float* row = p + r * kSlots + h;
          w = (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(row + 16), _mm512_loadu_ps(row));
        }
        _mm512_storeu_si512(out + r * kSlots + h, w);
      }
    }
  }
};
#endif

// The two products of a bf16 read on tiles. Tiles: HardwareTiles, or an emulation with the
// same interface. Base: the vector kernels for everything else (kKeyTile = 64). Packing: above.
template <class Tiles, class Base, class Packing = PortablePacking>
struct TileOps : Base {
  static constexpr Index kKeyTile = 64;
  static_assert(Base::kKeyTile == kKeyTile, "the base scores key tiles of 64 slots");
  static constexpr Index kGroups = kKeyTile / kTileRows;  // 16-key groups: one C tile each
  static constexpr bool kPairedValues = true;
  using Query = bf16;

  // Per-thread packing space, reused from call to call.
  struct Scratch {
    AlignedVector<std::uint32_t> keys, values;  // the B layouts
    AlignedVector<std::uint32_t> queries;       // queries transposed in pairs (few rows)
    AlignedVector<std::uint16_t> rows;          // zero-padded query rows, or bf16 weights
    AlignedVector<bf16> key_rows;               // zero-padded key rows (few rows)
    AlignedVector<float> acc_rows;              // accumulator rows, 16 x whole blocks
    alignas(64) float block[kTileRows * kKeyTile];  // a row group's scores, or S^T (few rows)
  };
  static Scratch& scratch() {
    thread_local Scratch s;
    return s;
  }

  // S[i][j] = beta q_i . K[j] for i < bq, j < kKeyTile (s row-major, kKeyTile a row).
  template <class Q, class Pacing = NoPacing>
  static void scores_rows(const Q* q, Index q_stride, Index bq, const bf16* const* keys, Index d,
                          float beta, float* s, Pacing pacing = {}) {
    static_assert(std::is_same_v<Q, bf16>, "tile products take their queries in bf16");
    if (bq <= kTileRows) return scores_few_rows(q, q_stride, bq, keys, d, beta, s, pacing);
    Scratch& w = scratch();
    w.keys.resize(static_cast<std::size_t>(packed_key_words(d)));
    Packing::keys(keys, kKeyTile, d, w.keys.data());
    scores_many_rows(q, q_stride, bq, w.keys.data(), d, beta, s, pacing);
  }

  // A read of many query tiles packs each key tile once (read_tiles.hpp): the words of one
  // packed tile, the packing, and the scores from it (the same bits as scores_rows).
  using PackedWord = std::uint32_t;
  static bool packs_keys() { return true; }
  static Index packed_key_words(Index d) {
    return (d + kChunk - 1) / kChunk * kGroups * kTileWords;
  }
  static void pack_keys(const bf16* const* keys, Index d, std::uint32_t* out) {
    Packing::keys(keys, kKeyTile, d, out);
  }
  template <class Pacing = NoPacing>
  static void scores_rows_packed(const bf16* q, Index q_stride, Index bq, const bf16* const* keys,
                                 const std::uint32_t* packed, Index d, float beta, float* s,
                                 Pacing pacing = {}) {
    if (bq <= kTileRows) return scores_few_rows(q, q_stride, bq, keys, d, beta, s, pacing);
    scores_many_rows(q, q_stride, bq, packed, d, beta, s, pacing);
  }

  // More than 16 rows: query rows (A, in place where whole) against packed keys (B).
  template <class Pacing>
  static void scores_many_rows(const bf16* q, Index q_stride, Index bq, const std::uint32_t* kt,
                               Index d, float beta, float* s, Pacing pacing) {
    const Index chunks = (d + kChunk - 1) / kChunk;
    Scratch& w = scratch();
    constexpr Index kScoreStride = kKeyTile * static_cast<Index>(sizeof(float));
    const Index width = chunks * kChunk;
    w.rows.resize(static_cast<std::size_t>(kTileRows * width));  // before the session: may throw
    const Session session;
    for (Index i0 = 0; i0 < bq; i0 += kTileRows) {
      const Index rows = std::min(kTileRows, bq - i0);
      const void* a = q + i0 * q_stride;
      Index a_stride = q_stride * static_cast<Index>(sizeof(bf16));
      if (rows < kTileRows || d % kChunk != 0) {  // a zero-padded copy of the rows
        std::fill(w.rows.begin(), w.rows.end(), std::uint16_t(0));
        for (Index r = 0; r < rows; ++r)
          for (Index f = 0; f < d; ++f) w.rows[r * width + f] = bits(q[(i0 + r) * q_stride + f]);
        a = w.rows.data();
        a_stride = width * static_cast<Index>(sizeof(std::uint16_t));
      }
      pacing.advance(2 * rows * kKeyTile * d);
      Tiles::template zero<0>();
      Tiles::template zero<1>();
      Tiles::template zero<2>();
      Tiles::template zero<3>();
      for (Index c = 0; c < chunks; ++c) {
        Tiles::template load<4>(static_cast<const char*>(a) + c * kTileBytes, a_stride);
        four_products<4, 5, 6, 7, 5>(kt + c * kGroups * kTileWords);
      }
      float* out = rows == kTileRows ? s + i0 * kKeyTile : w.block;
      Tiles::template store<0>(out, kScoreStride);
      Tiles::template store<1>(out + kTileRows, kScoreStride);
      Tiles::template store<2>(out + 2 * kTileRows, kScoreStride);
      Tiles::template store<3>(out + 3 * kTileRows, kScoreStride);
      if (out != s + i0 * kKeyTile) std::copy(out, out + rows * kKeyTile, s + i0 * kKeyTile);
      Base::scale(s + i0 * kKeyTile, rows * kKeyTile, beta);  // one rounding each, as dot * beta
    }
  }

  // Up to 16 rows (a decode step): the roles swap. The key rows are the A operand, read in
  // place where a group's 16 keys are evenly spaced (a stretch of a cache) and d is a multiple of
  // 32, and the queries, transposed in pairs, are B: only the queries are packed. Out comes S^T,
  // 16 keys x 16 rows a tile. Every entry is the sum of the same products as above (the tiles
  // are symmetric in A and B: tested on the hardware), so the same bits.
  template <class Pacing>
  static void scores_few_rows(const bf16* q, Index q_stride, Index bq, const bf16* const* keys,
                              Index d, float beta, float* s, Pacing pacing) {
    const Index chunks = (d + kChunk - 1) / kChunk;
    Scratch& w = scratch();
    // Columns past bq keep whatever an earlier call left there: they only reach entries of S^T
    // that are never read.
    w.queries.resize(static_cast<std::size_t>(chunks * kTileWords));
    Packing::queries(q, q_stride, bq, d, w.queries.data());
    // The A operand of each group: its key rows in place, or a zero-padded copy.
    const Index width = chunks * kChunk;
    const bf16* base[kGroups];
    Index stride_bytes[kGroups];
    w.key_rows.resize(static_cast<std::size_t>(kGroups * kTileRows * width));
    for (Index g = 0; g < kGroups; ++g) {
      const bf16* const* group = keys + g * kTileRows;
      // Evenly spaced, compared as addresses (the rows may lie in different arrays).
      const auto address = [&](Index j) { return reinterpret_cast<std::uintptr_t>(group[j]); };
      const std::uintptr_t step = address(1) - address(0);  // modulo 2^N: any spacing
      bool even = d % kChunk == 0;
      for (Index j = 2; j < kTileRows && even; ++j)
        even = address(j) == address(0) + static_cast<std::uintptr_t>(j) * step;
      if (even) {
        base[g] = group[0];
        stride_bytes[g] = static_cast<Index>(static_cast<std::intptr_t>(step));
        continue;
      }
      bf16* copy = w.key_rows.data() + g * kTileRows * width;
      for (Index j = 0; j < kTileRows; ++j) {
        std::copy(group[j], group[j] + d, copy + j * width);
        std::fill(copy + j * width + d, copy + (j + 1) * width, bf16(0.0f));
      }
      base[g] = copy;
      stride_bytes[g] = width * static_cast<Index>(sizeof(bf16));
    }
    {
      const Session session;
      few_rows_products(w.queries.data(), base, stride_bytes, chunks, bq, d, pacing);
    }
    Packing::scores_from_columns(w.block, bq, kKeyTile, beta, s);
  }

  // The tile part of scores_few_rows: S^T into w.block.
  template <class Pacing>
  static void few_rows_products(const std::uint32_t* queries, const bf16* const* base,
                                const Index* stride_bytes, Index chunks, Index bq, Index d,
                                Pacing pacing) {
    Scratch& w = scratch();
    Tiles::template zero<0>();
    Tiles::template zero<1>();
    Tiles::template zero<2>();
    Tiles::template zero<3>();
    for (Index c = 0; c < chunks; ++c) {
      pacing.advance(2 * bq * kKeyTile * std::min(kChunk, d - c * kChunk));
      Tiles::template load<4>(queries + c * kTileWords, kTileBytes);
      Tiles::template load<5>(base[0] + c * kChunk, stride_bytes[0]);
      Tiles::template dot<0, 5, 4>();
      Tiles::template load<6>(base[1] + c * kChunk, stride_bytes[1]);
      Tiles::template dot<1, 6, 4>();
      Tiles::template load<7>(base[2] + c * kChunk, stride_bytes[2]);
      Tiles::template dot<2, 7, 4>();
      Tiles::template load<5>(base[3] + c * kChunk, stride_bytes[3]);
      Tiles::template dot<3, 5, 4>();
    }
    constexpr Index kBlockStride = kTileRows * static_cast<Index>(sizeof(float));
    Tiles::template store<0>(w.block, kBlockStride);
    Tiles::template store<1>(w.block + kTileWords, kBlockStride);
    Tiles::template store<2>(w.block + 2 * kTileWords, kBlockStride);
    Tiles::template store<3>(w.block + 3 * kTileWords, kBlockStride);
  }

  // acc[i][:] += sum_j bf16(P[i][j]) V[j][:] over the tile's kKeyTile slots (an empty slot's
  // weight is 0).
  template <class Pacing = NoPacing>
  static void accumulate_tile(const float* p, Index bq, const bf16* const* v, Index dv,
                              float* acc, Index acc_stride, Pacing pacing = {}) {
    Scratch& w = scratch();
    w.values.resize(static_cast<std::size_t>(packed_value_words(dv)));
    Packing::values(v, kKeyTile, dv, w.values.data());
    accumulate_tile_packed(p, bq, w.values.data(), dv, acc, acc_stride, pacing);
  }

  // A read of many query tiles packs each tile's values once too (read_tiles.hpp): the words of
  // one packed tile, the packing, and accumulate_tile from it (the same bits).
  static constexpr Index kHalves = kKeyTile / kChunk;  // slot chunks of a tile
  static_assert(kHalves == 2, "two slot chunks a tile");
  static bool packs_values() { return true; }
  static Index packed_value_words(Index dv) {
    return kHalves * ((dv + kTileRows - 1) / kTileRows) * kTileWords;
  }
  static void pack_values(const bf16* const* v, Index dv, std::uint32_t* out) {
    Packing::values(v, kKeyTile, dv, out);
  }
  template <class Pacing = NoPacing>
  static void accumulate_tile_packed(const float* p, Index bq, const std::uint32_t* vt, Index dv,
                                     float* acc, Index acc_stride, Pacing pacing = {}) {
    const Index blocks = (dv + kTileRows - 1) / kTileRows;
    Scratch& w = scratch();
    w.rows.resize(static_cast<std::size_t>(kTileRows * kKeyTile));
    std::uint16_t* weights = w.rows.data();
    constexpr Index kWeightStride = kKeyTile * static_cast<Index>(sizeof(std::uint16_t));
    if (bq % kTileRows != 0 || dv % kTileRows != 0)  // before the session: may throw
      w.acc_rows.resize(static_cast<std::size_t>(kTileRows * blocks * kTileRows));
    const Session session;
    for (Index i0 = 0; i0 < bq; i0 += kTileRows) {
      const Index rows = std::min(kTileRows, bq - i0);
      Packing::weights(p + i0 * kKeyTile, rows, weights);
      Tiles::template load<4>(weights, kWeightStride);
      Tiles::template load<5>(weights + kChunk, kWeightStride);
      // The accumulator rows in place, or a copy of them 16 rows x whole blocks wide: its rows
      // past bq and columns past dv hold what an earlier call left there, and only reach
      // entries that are never copied back (weights past bq are 0, values past dv are 0).
      const bool direct = rows == kTileRows && dv % kTileRows == 0;
      float* c = acc + i0 * acc_stride;
      Index stride = acc_stride;
      if (!direct) {
        stride = blocks * kTileRows;
        for (Index r = 0; r < rows; ++r)
          std::copy(acc + (i0 + r) * acc_stride, acc + (i0 + r) * acc_stride + dv,
                    w.acc_rows.data() + r * stride);
        c = w.acc_rows.data();
      }
      const Index row_bytes = stride * static_cast<Index>(sizeof(float));
      Index b = 0;
      for (; b + 4 <= blocks; b += 4) {  // four accumulators in flight
        pacing.advance(2 * rows * kKeyTile * 4 * kTileRows);
        Tiles::template load<0>(c + b * kTileRows, row_bytes);
        Tiles::template load<1>(c + (b + 1) * kTileRows, row_bytes);
        Tiles::template load<2>(c + (b + 2) * kTileRows, row_bytes);
        Tiles::template load<3>(c + (b + 3) * kTileRows, row_bytes);
        // Slots 0-31 (weights in tile 4) of the four blocks, then slots 32-63 (tile 5).
        four_products<4, 6, 7, 6, 7>(vt + b * kTileWords);
        four_products<5, 6, 7, 6, 7>(vt + (blocks + b) * kTileWords);
        Tiles::template store<0>(c + b * kTileRows, row_bytes);
        Tiles::template store<1>(c + (b + 1) * kTileRows, row_bytes);
        Tiles::template store<2>(c + (b + 2) * kTileRows, row_bytes);
        Tiles::template store<3>(c + (b + 3) * kTileRows, row_bytes);
      }
      for (; b < blocks; ++b) {
        pacing.advance(2 * rows * kKeyTile * kTileRows);
        Tiles::template load<0>(c + b * kTileRows, row_bytes);
        Tiles::template load<6>(vt + b * kTileWords, kTileBytes);
        Tiles::template dot<0, 4, 6>();
        Tiles::template load<7>(vt + (blocks + b) * kTileWords, kTileBytes);
        Tiles::template dot<0, 5, 7>();
        Tiles::template store<0>(c + b * kTileRows, row_bytes);
      }
      if (!direct)
        for (Index r = 0; r < rows; ++r)
          std::copy(c + r * stride, c + r * stride + dv, acc + (i0 + r) * acc_stride);
    }
  }

  // Accumulator tiles 0-3 += tile A . the four B tiles stored one after the other from b, loaded
  // into tiles X, Y, Z, W in turn: consecutive products go to different accumulators, and a B
  // tile is reloaded at least two products after its last use.
  template <int A, int X, int Y, int Z, int W>
  static void four_products(const std::uint32_t* b) {
    Tiles::template load<X>(b, kTileBytes);
    Tiles::template dot<0, A, X>();
    Tiles::template load<Y>(b + kTileWords, kTileBytes);
    Tiles::template dot<1, A, Y>();
    Tiles::template load<Z>(b + 2 * kTileWords, kTileBytes);
    Tiles::template dot<2, A, Z>();
    Tiles::template load<W>(b + 3 * kTileWords, kTileBytes);
    Tiles::template dot<3, A, W>();
  }

  // Opens a tile session for the calls of a scope (HardwareTiles::begin).
  struct Session {
    Session() { Tiles::begin(); }
    ~Session() { Tiles::end(); }
    Session(const Session&) = delete;
    Session& operator=(const Session&) = delete;
  };
};

}  // namespace ovq::kernels::amx

namespace ovq::kernels {

#if defined(OVQ_ARCH_AMX)
// AMX: bf16 reads on tiles; every other element as AVX512-BF16.
template <class Element>
struct TileOps<Element, arch::amx> : TileOps<Element, arch::avx512bf16> {};

// The tile products where this process may use the tiles (amx::usable), AVX512-BF16's pair dot
// products where it may not: one choice for the life of the process, so every read of the
// process computes its scores the same way.
template <>
struct TileOps<bf16, arch::amx> : TileOps<bf16, arch::avx512bf16> {
  using Fallback = TileOps<bf16, arch::avx512bf16>;
  using Tiles = amx::TileOps<amx::HardwareTiles, Fallback, amx::Avx512Packing>;
  template <class Q, class Pacing = NoPacing>
  static void scores_rows(const Q* q, Index q_stride, Index bq, const bf16* const* keys, Index d,
                          float beta, float* s, Pacing pacing = {}) {
    if (amx::usable()) return Tiles::scores_rows(q, q_stride, bq, keys, d, beta, s, pacing);
    Fallback::scores_rows(q, q_stride, bq, keys, d, beta, s, pacing);
  }
  // Keys packed once per read (read_tiles.hpp), where the tiles are in use.
  using PackedWord = std::uint32_t;
  static bool packs_keys() { return amx::usable(); }
  static Index packed_key_words(Index d) { return Tiles::packed_key_words(d); }
  static void pack_keys(const bf16* const* keys, Index d, std::uint32_t* out) {
    Tiles::pack_keys(keys, d, out);
  }
  template <class Pacing = NoPacing>
  static void scores_rows_packed(const bf16* q, Index q_stride, Index bq, const bf16* const* keys,
                                 const std::uint32_t* packed, Index d, float beta, float* s,
                                 Pacing pacing = {}) {
    if (amx::usable())
      return Tiles::scores_rows_packed(q, q_stride, bq, keys, packed, d, beta, s, pacing);
    Fallback::scores_rows(q, q_stride, bq, keys, d, beta, s, pacing);
  }
  template <class Pacing = NoPacing>
  static void accumulate_tile(const float* p, Index bq, const bf16* const* v, Index dv,
                              float* acc, Index acc_stride, Pacing pacing = {}) {
    if (amx::usable()) return Tiles::accumulate_tile(p, bq, v, dv, acc, acc_stride, pacing);
    Fallback::accumulate_tile(p, bq, v, dv, acc, acc_stride, pacing);
  }
  // Values packed once per read too, where the tiles are in use (packs_values: only then does
  // a read call accumulate_tile_packed).
  static bool packs_values() { return amx::usable(); }
  static Index packed_value_words(Index dv) { return Tiles::packed_value_words(dv); }
  static void pack_values(const bf16* const* v, Index dv, std::uint32_t* out) {
    Tiles::pack_values(v, dv, out);
  }
  template <class Pacing = NoPacing>
  static void accumulate_tile_packed(const float* p, Index bq, const std::uint32_t* packed,
                                     Index dv, float* acc, Index acc_stride, Pacing pacing = {}) {
    Tiles::accumulate_tile_packed(p, bq, packed, dv, acc, acc_stride, pacing);
  }
  struct Session {
    Session() : open(amx::usable()) {
      if (open) amx::HardwareTiles::begin();
    }
    ~Session() {
      if (open) amx::HardwareTiles::end();
    }
    Session(const Session&) = delete;
    Session& operator=(const Session&) = delete;
    bool open;
  };
};
#endif

}  // namespace ovq::kernels
