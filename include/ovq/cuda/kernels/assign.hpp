#pragma once
// Nearest centroid on a GPU (the CPU's kernels/assign.hpp): every row of x against the n
// centroids of its state, scores fused with the argmax, no rows x n score matrix.
//
//   best[i] = max_r (x_i . C[r] + offset[r]),  arg[i] = the smallest r reaching it
//
// As on the CPU: the first centroid is taken whatever its score, then a centroid replaces the
// running best only with a strictly greater score, so a NaN score never wins (unless it is the
// first) and ties go to the smallest index. The same answer comes from a parallel reduction
// over (score, index) pairs ordered by score, then index, with NaNs left out, and the first
// centroid's NaN checked apart: that is what this computes, whatever the tiling.
// A score is one FMA chain over the features in order (as the read's, and as OVQ seeding's
// scores of new centroids: SeedUpdateProgram), plus the offset.
//
// Block (x, s): rows [32 x, 32 x + 32) of state s, centroid tiles staged in shared memory
// (asynchronously, the next while this one is scored).
// Thread t: rows (t / 16) 2 + i, centroids t % 16 + 16 j of each tile (64 centroids; 32 or 16
// for rows of more than 512 bytes). 256 threads.
// Shapes: x (states x L x d), C (states x capacity x d, rows [0, n) used), offset (states x
// capacity) or none, best and arg (states x L). Cost: 2 L n kD flops.
// Input, Centroid: the elements of x and C (16-bit bits are widened as they are staged: the
// scores are those of the widened rows, as the CPU's 16-bit mixers compute them).
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "ovq/config.hpp"
#include "ovq/cuda/block.hpp"
#include "ovq/cuda/counters.hpp"
#include "ovq/cuda/kernels/async_copy.hpp"
#include "ovq/cuda/kernels/half.hpp"
#include "ovq/cuda/kernels/read.hpp"

namespace ovq::cuda::kernels {

template <class Scalar, class Input = Scalar, class Centroid = Scalar>
struct AssignParams {
  HeadRows<Input> x;           // rows to assign
  Index rows = 0;              // L
  Index d = 0;                 // <= kD
  HeadRows<Centroid> centroids;  // rows [0, n) of each state
  const Scalar* offset = nullptr;  // state s, centroid r: offset[s * offset_stride + r]
  Index offset_stride = 0;
  // n: the counters' size (OVQ: the dictionary before the chunk) or a fixed count (VQ: the
  // codebook), and whether to run at all (a chunk write runs only on a complete chunk).
  const StateCounters* counters = nullptr;
  Index fixed_count = -1;      // >= 0: n, and no condition on the counters
  Index complete_chunk = 0;    // counters given: run only if pending == complete_chunk
  Scalar* best = nullptr;      // state s, row i: best[s * rows + i]
  Index* arg = nullptr;
};

// (score, index) with "greater": a larger score, or the same score at a smaller index; NaN
// scores are never taken (index -1: nothing yet).
template <class Scalar>
struct ArgBest {
  Scalar score = -Scalar(INFINITY);
  Index index = -1;

  OVQ_HOST_DEVICE void offer(Scalar s, Index r) {
    if (s != s) return;
    if (index < 0 || s > score || (s == score && r < index)) {
      score = s;
      index = r;
    }
  }
};

template <class Scalar, int kD, class Input = Scalar, class Centroid = Scalar>
struct AssignProgram {
  using Params = AssignParams<Scalar, Input, Centroid>;
  static constexpr int kThreads = 256;
  static constexpr int kRows = 32;
  // Centroids per tile: 64, fewer for wide rows, so that the two tile buffers and the rows fit
  // an sm_80's shared memory (the argmax does not depend on the tiling).
  static constexpr int kTile =
      kD * sizeof(Scalar) <= 512 ? 64 : (kD * sizeof(Scalar) <= 1024 ? 32 : 16);
  static constexpr int kGroups = 16;
  static constexpr int kRPT = kRows / (kThreads / kGroups);
  static constexpr int kKPT = kTile / kGroups;
  // 16 bytes of scalars: a vector load of shared memory; rows padded by one (ReadTraits).
  static constexpr int kVec = static_cast<int>(16 / sizeof(Scalar));
  static constexpr int kStride = kD + kVec;
  // Centroid tiles in the arithmetic's type are staged asynchronously, the next while this one
  // is scored (two buffers); 16-bit centroids (VQ's codebooks) are widened as they load.
  static constexpr bool kAsyncCentroids = std::is_same_v<Centroid, Scalar>;
  static constexpr int kBuffers = kAsyncCentroids ? 2 : 1;
  // Shared: x rows, centroid tiles, then per (row, group) partial (score, index), and the first
  // centroid's NaN flag per row.
  static constexpr std::size_t kXBytes = sizeof(Scalar) * kRows * kStride;
  static constexpr std::size_t kCBytes = sizeof(Scalar) * kTile * kStride;
  static constexpr std::size_t kPartBytes = (sizeof(Scalar) + sizeof(Index)) * kRows * kGroups;
  static std::size_t shared_bytes(const Params&) {
    return kXBytes + kBuffers * kCBytes + kPartBytes + kRows;
  }

  struct Thread {
    ArgBest<Scalar> best[kRPT];
    bool first_nan[kRPT];
  };

  // Centroids [r0, r0 + kTile) into a tile buffer (zeros past n and past d): thread t's pieces.
  OVQ_HOST_DEVICE static void stage_centroids(int t, const Params& p, Index s, Index r0, Index n,
                                              Scalar* cs, bool aligned) {
    if constexpr (kAsyncCentroids) {
      constexpr int kPieces = kD / kVec;
      const int c = (t % kPieces) * kVec;
      for (int j = t / kPieces; j < kTile; j += kThreads / kPieces)
        copy_piece_async(cs + j * kStride + c, r0 + j < n ? p.centroids.row(s, r0 + j) : nullptr,
                         c, p.d, aligned);
    } else {
      for (int e = t; e < kTile * kD; e += kThreads) {
        const Index j = e / kD, c = e % kD;
        Scalar v = Scalar(0);
        if (r0 + j < n && c < p.d) v = compute_of(p.centroids.row(s, r0 + j)[c]);
        cs[j * kStride + c] = v;
      }
    }
  }

  template <class Block>
  OVQ_HOST_DEVICE static void run(Block& block, const Params& p, BlockIndex index) {
    const Index s = index.y;
    const Index i0 = static_cast<Index>(index.x) * kRows;
    Index n = p.fixed_count;
    if (n < 0) {
      if (p.counters->fault != 0 || p.counters->pending != p.complete_chunk) return;
      n = static_cast<Index>(p.counters->size);
    }
    unsigned char* raw = static_cast<unsigned char*>(block.shared());
    Scalar* xs = reinterpret_cast<Scalar*>(raw);
    Scalar* tiles = reinterpret_cast<Scalar*>(raw + kXBytes);
    unsigned char* after_tiles = raw + kXBytes + kBuffers * kCBytes;
    Scalar* part_score = reinterpret_cast<Scalar*>(after_tiles);
    Index* part_index = reinterpret_cast<Index*>(after_tiles + sizeof(Scalar) * kRows * kGroups);
    unsigned char* nan_first = after_tiles + kPartBytes;
    // Whole 16-byte pieces from 16-byte boundaries: one copy per piece.
    constexpr Index kPiece = kVec;
    const bool aligned = reinterpret_cast<std::uintptr_t>(p.centroids.data) % 16 == 0 &&
                         p.centroids.head_stride % kPiece == 0 &&
                         p.centroids.row_stride % kPiece == 0 && p.d % kPiece == 0;
    typename Block::template PerThread<Thread> th;

    block.each([&](int t) {
      for (int e = t; e < kRows * kD; e += kThreads) {
        const Index r = e / kD, c = e % kD;
        Scalar v = Scalar(0);
        if (i0 + r < p.rows && c < p.d) v = compute_of(p.x.row(s, i0 + r)[c]);
        xs[r * kStride + c] = v;
      }
      if (n > 0) stage_centroids(t, p, s, 0, n, tiles, aligned);
      commit_async();
      Thread& me = th[t];
      OVQ_UNROLL
      for (int i = 0; i < kRPT; ++i) {
        me.best[i] = ArgBest<Scalar>{};
        me.first_nan[i] = false;
      }
      wait_async<0>();
    });
    for (Index r0 = 0, tile = 0; r0 < n; r0 += kTile, ++tile) {
      Scalar* cs = tiles + (tile % kBuffers) * (kCBytes / sizeof(Scalar));
      if constexpr (!kAsyncCentroids) {
        if (tile > 0) block.each([&](int t) { stage_centroids(t, p, s, r0, n, cs, aligned); });
      }
      block.each([&](int t) {
        // The next tile loads into the other buffer (scored in the phase before this one).
        if constexpr (kAsyncCentroids) {
          if (r0 + kTile < n)
            stage_centroids(t, p, s, r0 + kTile, n,
                            tiles + ((tile + 1) % kBuffers) * (kCBytes / sizeof(Scalar)), aligned);
          commit_async();
        }
        Thread& me = th[t];
        const int kg = t % kGroups, rg = t / kGroups;
        Scalar dot[kRPT][kKPT];
        OVQ_UNROLL
        for (int i = 0; i < kRPT; ++i)
          OVQ_UNROLL
          for (int j = 0; j < kKPT; ++j) dot[i][j] = Scalar(0);
        // Each score one FMA chain over the features in order, kVec per vector load.
        for (int f = 0; f < kD; f += kVec) {
          Scalar x[kRPT][kVec], c[kKPT][kVec];
          OVQ_UNROLL
          for (int i = 0; i < kRPT; ++i) load_vector(xs + (rg * kRPT + i) * kStride + f, x[i]);
          OVQ_UNROLL
          for (int j = 0; j < kKPT; ++j) load_vector(cs + (kg + kGroups * j) * kStride + f, c[j]);
          OVQ_UNROLL
          for (int e = 0; e < kVec; ++e)
            OVQ_UNROLL
            for (int i = 0; i < kRPT; ++i)
              OVQ_UNROLL
              for (int j = 0; j < kKPT; ++j) dot[i][j] = std::fma(x[i][e], c[j][e], dot[i][j]);
        }
        OVQ_UNROLL
        for (int i = 0; i < kRPT; ++i)
          OVQ_UNROLL
          for (int j = 0; j < kKPT; ++j) {
            const Index r = r0 + kg + kGroups * j;
            if (r >= n) continue;
            const Scalar score =
                p.offset != nullptr ? dot[i][j] + p.offset[s * p.offset_stride + r] : dot[i][j];
            if (r == 0 && score != score) me.first_nan[i] = true;
            me.best[i].offer(score, r);
          }
        if constexpr (kAsyncCentroids) wait_async<0>();
      });
    }
    block.each([&](int t) {
      Thread& me = th[t];
      const int kg = t % kGroups, rg = t / kGroups;
      OVQ_UNROLL
      for (int i = 0; i < kRPT; ++i) {
        const int row = rg * kRPT + i;
        part_score[row * kGroups + kg] = me.best[i].score;
        part_index[row * kGroups + kg] = me.best[i].index;
        if (kg == 0) nan_first[row] = me.first_nan[i] ? 1 : 0;
      }
    });
    block.each([&](int t) {
      if (t >= kRows || i0 + t >= p.rows) return;
      ArgBest<Scalar> b;
      for (int g = 0; g < kGroups; ++g)
        if (part_index[t * kGroups + g] >= 0)
          b.offer(part_score[t * kGroups + g], part_index[t * kGroups + g]);
      if (n > 0 && (nan_first[t] || b.index < 0)) {  // the first centroid's NaN stays
        b.score = Scalar(NAN);
        b.index = 0;
      }
      p.best[s * p.rows + i0 + t] = b.score;
      p.arg[s * p.rows + i0 + t] = b.index;
    });
  }
};

}  // namespace ovq::cuda::kernels
