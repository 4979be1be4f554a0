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
// Block (x, s, z): rows [32 x, 32 x + 32) of state s against every centroid, or in split mode
// (launch_assign: when rows x states blocks would not fill the device) centroid range z, whose
// partial argmax AssignMergeProgram merges; centroid tiles staged in shared memory
// (asynchronously, the next while this one is scored).
// Thread t: rows (t / 16) 2 + i, centroids t % 16 + 16 j of each tile (64 centroids; 32 or 16
// for rows of more than 512 bytes). 256 threads.
// Shapes: x (states x L x d), C (states x capacity x d, rows [0, n) used), offset (states x
// capacity) or none, best and arg (states x L). Cost: 2 L n kD flops.
// Input, Centroid: the elements of x and C (16-bit bits are widened as they are staged: the
// scores are those of the widened rows, as the CPU's 16-bit mixers compute them).
#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "ovq/config.hpp"
#include "ovq/cuda/block.hpp"
#include "ovq/cuda/counters.hpp"
#include "ovq/cuda/kernels/async_copy.hpp"
#include "ovq/cuda/kernels/half.hpp"
#include "ovq/cuda/kernels/launch.hpp"
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
  // Split mode (splits > 1, grid.z = splits): block z scores centroid range z (whole tiles) and
  // writes each row's partial (score, index, and whether centroid 0 scored NaN) at
  // (s * rows + i) * splits + z; AssignMergeProgram merges them into best and arg.
  int splits = 1;
  Scalar* part_best = nullptr;
  Index* part_arg = nullptr;
  unsigned char* part_nan = nullptr;
};

// The centroid count n of an assignment, or -1 when it must not run (a chunk write whose chunk
// is not complete, or a state with a fault).
template <class Params>
OVQ_HOST_DEVICE Index assign_count(const Params& p) {
  if (p.fixed_count >= 0) return p.fixed_count;
  if (p.counters->fault != 0 || p.counters->pending != p.complete_chunk) return -1;
  return static_cast<Index>(p.counters->size);
}

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
    const Index n = assign_count(p);
    if (n < 0) return;
    // This block's centroids [r_begin, r_end): all of them, or split range index.z.
    Index r_begin = 0, r_end = n;
    if (p.splits > 1) {
      const Index span = ((n + p.splits - 1) / p.splits + kTile - 1) / kTile * kTile;
      r_begin = span * index.z < n ? span * index.z : n;
      r_end = r_begin + span < n ? r_begin + span : n;
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
      if (r_begin < r_end) stage_centroids(t, p, s, r_begin, r_end, tiles, aligned);
      commit_async();
      Thread& me = th[t];
      OVQ_DEVICE_UNROLL
      for (int i = 0; i < kRPT; ++i) {
        me.best[i] = ArgBest<Scalar>{};
        me.first_nan[i] = false;
      }
      wait_async<0>();
    });
    for (Index r0 = r_begin, tile = 0; r0 < r_end; r0 += kTile, ++tile) {
      Scalar* cs = tiles + (tile % kBuffers) * (kCBytes / sizeof(Scalar));
      if constexpr (!kAsyncCentroids) {
        if (tile > 0) block.each([&](int t) { stage_centroids(t, p, s, r0, r_end, cs, aligned); });
      }
      block.each([&](int t) {
        // The next tile loads into the other buffer (scored in the phase before this one).
        if constexpr (kAsyncCentroids) {
          if (r0 + kTile < r_end)
            stage_centroids(t, p, s, r0 + kTile, r_end,
                            tiles + ((tile + 1) % kBuffers) * (kCBytes / sizeof(Scalar)), aligned);
          commit_async();
        }
        Thread& me = th[t];
        const int kg = t % kGroups, rg = t / kGroups;
        Scalar dot[kRPT][kKPT];
        dot_block<kD>(xs + rg * kRPT * kStride, kStride, cs + kg * kStride, kGroups * kStride,
                      dot);
        OVQ_DEVICE_UNROLL
        for (int i = 0; i < kRPT; ++i)
          OVQ_DEVICE_UNROLL
          for (int j = 0; j < kKPT; ++j) {
            const Index r = r0 + kg + kGroups * j;
            if (r >= r_end) continue;
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
      OVQ_DEVICE_UNROLL
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
      const Index row = s * p.rows + i0 + t;
      if (p.splits > 1) {
        const Index at = row * p.splits + index.z;
        p.part_best[at] = b.score;
        p.part_arg[at] = b.index;
        p.part_nan[at] = nan_first[t];
        return;
      }
      if (n > 0 && (nan_first[t] || b.index < 0)) {  // the first centroid's NaN stays
        b.score = Scalar(NAN);
        b.index = 0;
      }
      p.best[row] = b.score;
      p.arg[row] = b.index;
    });
  }
};

// Split mode's merge: block (x, s), thread t: row 256 x + t of state s, its ranges' partials
// merged (the argmax does not depend on the order), then the first centroid's NaN rule.
template <class Scalar, class Input = Scalar, class Centroid = Scalar>
struct AssignMergeProgram {
  using Params = AssignParams<Scalar, Input, Centroid>;
  static constexpr int kThreads = 256;
  static std::size_t shared_bytes(const Params&) { return 0; }

  template <class Block>
  OVQ_HOST_DEVICE static void run(Block& block, const Params& p, BlockIndex index) {
    const Index n = assign_count(p);
    if (n < 0) return;
    const Index s = index.y;
    block.each([&](int t) {
      const Index i = static_cast<Index>(index.x) * kThreads + t;
      if (i >= p.rows) return;
      const Index row = s * p.rows + i;
      ArgBest<Scalar> b;
      for (Index z = 0; z < p.splits; ++z)
        if (p.part_arg[row * p.splits + z] >= 0)
          b.offer(p.part_best[row * p.splits + z], p.part_arg[row * p.splits + z]);
      if (n > 0 && (p.part_nan[row * p.splits] != 0 || b.index < 0)) {
        b.score = Scalar(NAN);
        b.index = 0;
      }
      p.best[row] = b.score;
      p.arg[row] = b.index;
    });
  }
};

// How many centroid ranges an assignment of `rows` rows per state over n centroids splits into:
// enough blocks to fill the device (parallel_blocks), at most a range per tile of kTile; one
// under graph capture (a captured step launches one kernel, whatever n is when replayed).
inline int assign_splits(Index rows, Index states, Index n, Index parallel_blocks, int kRows,
                         int kTile, bool capturing) {
  if (capturing || n <= kTile) return 1;
  const Index blocks = (rows + kRows - 1) / kRows * states;
  const Index wanted = blocks > 0 ? parallel_blocks / blocks : 1;
  const Index most = (n + kTile - 1) / kTile;
  return static_cast<int>(std::max<Index>(1, std::min(wanted, most)));
}

// An assignment of p.rows rows per state: AssignProgram (grid.z = p.splits), and with split
// ranges the merge.
template <class Backend, class Scalar, class Input, class Centroid>
void launch_assign(const AssignParams<Scalar, Input, Centroid>& p, Index states,
                   typename Backend::Stream stream) {
  const int heads = static_cast<int>(states);
  dispatch_width(p.d, [&](auto width) {
    using Assign = AssignProgram<Scalar, decltype(width)::value, Input, Centroid>;
    Backend::template launch<Assign>(
        Grid{static_cast<int>((p.rows + Assign::kRows - 1) / Assign::kRows), heads, p.splits}, p,
        stream);
  });
  if (p.splits > 1) {
    using Merge = AssignMergeProgram<Scalar, Input, Centroid>;
    Backend::template launch<Merge>(
        Grid{static_cast<int>((p.rows + Merge::kThreads - 1) / Merge::kThreads), heads, 1}, p,
        stream);
  }
}

}  // namespace ovq::cuda::kernels
