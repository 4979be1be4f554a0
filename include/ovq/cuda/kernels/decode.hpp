#pragma once
// The split decode read in float or double: ReadProgram's arithmetic (read.hpp), bit for bit,
// with the block's threads spread over the rows a decode tile really holds.
//
//   DecodeReadProgram<Scalar, kD, kRows>   block (tile, state, z): merge block z of a query tile
//                                          of kRows stacked rows (a decode: a group's query
//                                          heads at a few positions), its partial (o, m, l) per
//                                          row into the workspace (split mode only); the tile's
//                                          last block to finish merges them (MergeProgram's
//                                          merge_if_last) when the plan gives arrival counters.
//
// A decode tile's valid rows are a prefix of its kRows (often one: a query head at one
// position). ReadProgram's layout gives each row 16 threads whether it is valid or not, and
// each thread a long chain per key tile; here all 128 threads work on the valid rows, so a tile
// takes a few short chains. Per key tile of kKeyTile slots (ReadTraits):
//   scores   thread t scores key t % kKeyTile for rows t / kKeyTile + kRowSets i: one FMA chain
//            over the features (16 bytes of Q and K per load), times beta, bias, saturation,
//            mask; into S (rows x keys) in shared memory;
//   weights  thread t = (row t / 16, group t % 16): the row's tile maximum, the exponentials of
//            its slots g + 16 j and their sum in order (the contract's partial sums);
//   update   the same threads: the row's 16 partial sums in order, the online-softmax update
//            (every thread of a row holds the row's (m, l) and computes the same), P / l into
//            shared memory (transposed), the factor that rescales the row's accumulators;
//   P V      thread t: output column t % kD (and + 128 at width 256) of rows t / kD + ...: the
//            accumulators rescaled, then one FMA chain over the tile's slots in order.
// Keys and values are staged asynchronously as in ReadProgram (values while the scores are
// computed, the next tile's keys while the weights and P V are).
// Shapes: Q (kRows x kD), K (kKeyTile x kD), V (kKeyTile x kD), S and P^T (kRows x kKeyTile)
// and kRows x 17 scalars (partial sums, rescale factors) in shared memory (width 128, float:
// 74 KiB); registers: each thread's accumulators (kRows kD / 128, at least 2). Cost: as
// ReadProgram, on the valid rows only.
#include <cfloat>
#include <cmath>

#include "ovq/config.hpp"
#include "ovq/core/exact_math.hpp"
#include "ovq/core/online_softmax.hpp"
#include "ovq/cuda/block.hpp"
#include "ovq/cuda/kernels/async_copy.hpp"
#include "ovq/cuda/kernels/half.hpp"
#include "ovq/cuda/kernels/mma.hpp"
#include "ovq/cuda/kernels/read.hpp"
#include "ovq/cuda/kernels/tensor_read.hpp"

namespace ovq::cuda::kernels {

template <class Scalar, int kD, int kRows>
struct DecodeReadProgram {
  using Traits = ReadTraits<Scalar, kD, kRows>;
  using Params = ReadParams<Scalar>;
  static constexpr int kThreads = 128;
  static constexpr int kGroups = 16;  // the contract's row-sum groups (ReadProgram's threads)
  static_assert(kRows * kGroups == kThreads, "one thread per (row, group)");
  static constexpr int kTile = Traits::kKeyTile;
  static constexpr int kKPT = kTile / kGroups;  // slots of a group in a tile
  static constexpr int kVec = Traits::kVec;
  // Scores: key t % kTile, rows t / kTile + kRowSets i.
  static constexpr int kRowSets = kThreads / kTile;
  static_assert(kThreads % kTile == 0 && kRows % kRowSets == 0, "scores cover the tile");
  static constexpr int kScoreRows = kRows / kRowSets;
  // P V: columns t % kColThreads + kColThreads c, rows t / kColThreads + kRowStride i.
  static constexpr int kColThreads = kD < kThreads ? kD : kThreads;
  static constexpr int kCols = kD / kColThreads;
  static constexpr int kRowStride = kThreads / kColThreads;
  static_assert(kRows % kRowStride == 0, "P V covers the rows");
  static constexpr int kOutRows = kRows / kRowStride;
  // Shared memory, in scalars (Q and K rows padded by a piece, as ReadProgram's).
  static constexpr int kStride = kD + kVec;
  static constexpr int kQ = 0;
  static constexpr int kK = kQ + kRows * kStride;
  static constexpr int kV = kK + kTile * kStride;
  static constexpr int kS = kV + kTile * kD;       // S: row r, slot j at r kTile + j
  static constexpr int kP = kS + kRows * kTile;    // P^T: slot j, row r at j kRows + r
  static constexpr int kSum = kP + kTile * kRows;  // partial sums: row r, group g
  static constexpr int kKeep = kSum + kRows * kGroups;
  static constexpr int kShared = kKeep + kRows;

  static std::size_t shared_bytes(const Params&) {
    return static_cast<std::size_t>(kShared) * sizeof(Scalar);
  }

  struct Thread {
    Scalar acc[kOutRows][kCols];  // P V: the current merge block's average
    SoftmaxStats<Scalar> st;      // weights, update: the row's state
    Scalar m_new;
    Scalar e[kKPT];               // weights: the group's exponentials
    Scalar beta[kScoreRows];      // scores: each row's logit scale
  };

  template <class Block>
  OVQ_HOST_DEVICE static void run(Block& block, const Params& p, BlockIndex index) {
    if (p.skipped()) return;
    Scalar* sh = static_cast<Scalar*>(block.shared());
    const Index s = index.y;
    const Index tile = index.x;
    const ReadExtent ext = p.extent();
    const QueryTiling qt = QueryTiling::make(p.group, p.n_queries, kRows);
    const TileSweep sw = tile_sweep(p, ext, qt, tile, kRows, kTile, index.z);
    // The valid rows are a prefix of the tile's (a decode reads one position per head tile, or
    // a group smaller than the tile at a few positions).
    int rows = 0;
    while (rows < kRows && row_place(p, qt, tile, rows).valid) ++rows;
    const Index first = sw.first_block <= sw.last_block ? sw.first_tile(sw.first_block) : -1;

    typename Block::template PerThread<Thread> th;
    block.each([&](int t) {
      stage_queries<kThreads, kD, kRows>(t, p, qt, tile, s, sh + kQ, kStride);
      if (first >= 0)
        stage_key_tile<kThreads, kD>(t, p, ext, sw.axis, s, first * kTile, kTile, false,
                                     sh + kK, kStride);
      commit_async();
      Thread& me = th[t];
      OVQ_DEVICE_UNROLL
      for (int i = 0; i < kScoreRows; ++i)
        me.beta[i] = p.beta_of(s, row_place(p, qt, tile, t / kTile + kRowSets * i).head);
      me.st = SoftmaxStats<Scalar>{};
      OVQ_DEVICE_UNROLL
      for (int i = 0; i < kOutRows; ++i)
        OVQ_DEVICE_UNROLL
        for (int c = 0; c < kCols; ++c) me.acc[i][c] = Scalar(0);
      wait_async<0>();
    });
    for (Index b = sw.first_block; b <= sw.last_block; ++b)
      for (Index t = sw.first_tile(b); t <= sw.last_tile(b); ++t)
        fold_tile(block, p, ext, sw.axis, qt, tile, s, rows, t, sw.next_tile(b, t), sh, th);
    write_partial(block, p, tile, s, index.z, rows, th);
    MergeProgram<Scalar, kD, kRows>::merge_if_last(block, p, tile, s, kThreads);
  }

  // Folds key tile t, whose keys are staged, into the valid rows' state; stages its values and
  // the keys of tile `next` (-1: none).
  template <class Block, class Th>
  OVQ_HOST_DEVICE static void fold_tile(Block& block, const Params& p, const ReadExtent& ext,
                                        const KeyAxisGeometry& axis, const QueryTiling& qt,
                                        Index tile, Index s, int rows, Index t, Index next,
                                        Scalar* sh, Th& th) {
    const Index x0 = t * kTile;
    const TileWindow biased = bias_window(p, axis, x0, kTile);
    // 1. The tile's values start loading. Scores into S.
    block.each([&](int tid) {
      stage_key_tile<kThreads, kD>(tid, p, ext, axis, s, x0, kTile, true, sh + kV, kD);
      commit_async();
      const Thread& me = th[tid];
      const int j = tid % kTile;
      const Scalar* k = sh + kK + j * kStride;
      OVQ_DEVICE_UNROLL
      for (int i = 0; i < kScoreRows; ++i) {
        const int r = tid / kTile + kRowSets * i;
        if (r >= rows) break;
        Scalar dot[1][1];
        dot_block<kD>(sh + kQ + r * kStride, 0, k, 0, dot);
        Scalar x = tile_logit(p, axis, biased, s, x0, j, dot[0][0], me.beta[i]);
        if (!seen_window(ext, axis, row_place(p, qt, tile, r), x0, kTile).holds(j))
          x = -Scalar(INFINITY);
        sh[kS + r * kTile + j] = x;
      }
    });
    // 2. The next tile's keys start loading. Each row's maximum; each group's exponentials and
    //    their sum.
    block.each([&](int tid) {
      if (next >= 0)
        stage_key_tile<kThreads, kD>(tid, p, ext, axis, s, next * kTile, kTile, false, sh + kK,
                                     kStride);
      commit_async();
      const int r = tid / kGroups, g = tid % kGroups;
      if (r >= rows) return;
      Thread& me = th[tid];
      const Scalar* row = sh + kS + r * kTile;
      Scalar tile_max = -Scalar(INFINITY);
      for (int j = 0; j < kTile; j += kVec) {
        Scalar x[kVec];
        load_vector(row + j, x);
        OVQ_DEVICE_UNROLL
        for (int f = 0; f < kVec; ++f)
          if (x[f] > tile_max) tile_max = x[f];
      }
      const Scalar m_new = me.st.m > tile_max ? me.st.m : tile_max;
      me.m_new = m_new;
      Scalar sum = Scalar(0);
      OVQ_DEVICE_UNROLL
      for (int j = 0; j < kKPT; ++j) {
        const Scalar e = ovq::detail::softmax_weight(row[g + kGroups * j], m_new);
        me.e[j] = e;
        sum = sum + e;
      }
      sh[kSum + r * kGroups + g] = sum;
    });
    // 3. The row sums; the online-softmax update; P / l into P^T; the rows' rescale factors.
    //    The tile's values have landed at the end.
    block.each([&](int tid) {
      const int r = tid / kGroups, g = tid % kGroups;
      if (r < rows) {
        Thread& me = th[tid];
        const Scalar m_new = me.m_new;
        Scalar inv = Scalar(0), keep = Scalar(1);
        if (m_new != -Scalar(INFINITY)) {
          Scalar sum = Scalar(0);
          for (int u = 0; u < kGroups; ++u) sum = sum + sh[kSum + r * kGroups + u];
          SoftmaxStats<Scalar>& st = me.st;
          const Scalar l_kept =
              st.m == m_new
                  ? st.l
                  : ovq::detail::mul_rn(st.l, ovq::detail::exp_nonpositive(st.m - m_new));
          const Scalar l_new = l_kept + sum;
          keep = l_kept / l_new;
          inv = Scalar(1) / l_new;
          st.l = l_new;
          st.m = m_new;
        }
        OVQ_DEVICE_UNROLL
        for (int j = 0; j < kKPT; ++j)
          sh[kP + (g + kGroups * j) * kRows + r] = ovq::detail::mul_rn(me.e[j], inv);
        if (g == 0) sh[kKeep + r] = keep;
      }
      wait_async<1>();
    });
    // 4. P V: the accumulators rescaled, then one FMA chain per entry over the tile's slots.
    //    The next tile's keys have landed at the end.
    block.each([&](int tid) {
      Thread& me = th[tid];
      const int c0 = tid % kColThreads, r0 = tid / kColThreads;
      OVQ_DEVICE_UNROLL
      for (int i = 0; i < kOutRows; ++i) {
        const int r = r0 + kRowStride * i;
        if (r >= rows) break;
        const Scalar keep = sh[kKeep + r];
        if (keep != Scalar(1)) {
          // keep = 0: the old rows vanish next to the new maximum (assigned, not multiplied,
          // so that an average that rounded to inf leaves no 0 * inf).
          OVQ_DEVICE_UNROLL
          for (int c = 0; c < kCols; ++c)
            me.acc[i][c] =
                keep == Scalar(0) ? Scalar(0) : ovq::detail::mul_rn(me.acc[i][c], keep);
        }
      }
      for (int j = 0; j < kTile; ++j) {
        const Scalar* v = sh + kV + j * kD + c0;
        const Scalar* w = sh + kP + j * kRows + r0;
        OVQ_DEVICE_UNROLL
        for (int i = 0; i < kOutRows; ++i) {
          if (r0 + kRowStride * i >= rows) break;
          const Scalar wi = w[kRowStride * i];
          OVQ_DEVICE_UNROLL
          for (int c = 0; c < kCols; ++c)
            me.acc[i][c] = std::fma(wi, v[kColThreads * c], me.acc[i][c]);
        }
      }
      wait_async<0>();
    });
  }

  // This block's state, in MergeProgram's layout (empty if it had no merge block to fold): each
  // row's (m, l) from its first update thread, the averages from the P V threads.
  template <class Block, class Th>
  OVQ_HOST_DEVICE static void write_partial(Block& block, const Params& p, Index tile, Index s,
                                            Index z, int rows, Th& th) {
    block.each([&](int tid) {
      Thread& me = th[tid];
      auto partial = [&](int r) {
        return p.partials + (((s * p.tiles + tile) * p.splits + z) * kRows + r) * (kD + 2);
      };
      if (tid / kGroups < rows && tid % kGroups == 0) {
        Scalar* out = partial(tid / kGroups);
        out[kD] = me.st.m;
        out[kD + 1] = me.st.l;
      }
      const int c0 = tid % kColThreads, r0 = tid / kColThreads;
      OVQ_DEVICE_UNROLL
      for (int i = 0; i < kOutRows; ++i) {
        const int r = r0 + kRowStride * i;
        if (r >= rows) break;
        Scalar* out = partial(r);
        OVQ_DEVICE_UNROLL
        for (int c = 0; c < kCols; ++c) out[c0 + kColThreads * c] = me.acc[i][c];
      }
    });
  }
};

// The split decode read on tensor cores, up to width 128: TensorReadProgram's arithmetic
// (tensor_read.hpp) for one tile of 16 stacked rows, bit for bit, with four warps instead of one.
//
//   TensorDecodeProgram<Bits, kD>   block (tile, state, z): merge block z of a tile of 16 rows,
//                                   its partial (o, m, l) per row into the workspace (split
//                                   mode only), merged as DecodeReadProgram's.
//
// TensorReadProgram gives a tile of 16 rows one warp, which then computes every tile's S, P and
// P V alone. Here warp w computes S for keys [16 w, 16 w + 16) of each key tile and P V for its
// quarter of the output columns; every tensor-core product has the operands and the order it
// has in one warp, so the entries are the same. The one order that spans the warps, each row's
// sum of its rounded weights, is taken as one warp takes it: lane u's partial over the keys
// 8 n + 2 u + e (n, then e, in order), then the four partials in order, here by one thread per
// (row, u) from P in shared memory. Per key tile:
//   S        warp w's two column tiles (Q fragments in registers, K by ldmatrix); beta, bias,
//            saturation, mask; the lanes' maxima into shared memory;
//   P        each row's maximum, P = exp(S - m) rounded to 16 bits into shared memory;
//   sums     thread (row, u): the row's partial sum of lane u, in the one-warp order;
//   P V      the online-softmax update of each lane's two rows (every warp's lanes hold and
//            compute the same), O rescaled, O += P V over the warp's columns (P and V by
//            ldmatrix).
// Keys and values are staged asynchronously as in TensorReadProgram. Shapes: Q (16 x kD), K and
// V (64 x kD), P (16 x 64) as 16-bit rows padded by 8, then 16 x 20 floats (width 128: 42 KiB);
// registers per lane: O (kD / 8 floats), S (8 floats), Q fragments (kD / 4 words).
template <class Bits, int kD>
struct TensorDecodeProgram {
  static_assert(kD <= 128, "width 256 decodes with TensorReadProgram's two warps a row tile");
  using Params = ReadParams<float, Bits>;
  static constexpr int kRows = 16;
  static constexpr int kWarps = 4;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kTile = 64;                // keys per tile (TensorReadProgram's)
  static constexpr int kS = kTile / 8 / kWarps;   // column tiles of S per warp
  static constexpr int kO = kD / 8 / kWarps;      // column tiles of O per warp
  static constexpr int kQSteps = kD / 16;
  static constexpr int kPSteps = kTile / 16;
  static_assert(kS == 2, "two S column tiles a warp: one ldmatrix of keys");
  // Shared memory: the halves as TensorReadProgram lays out a tile of 16 rows (Q, K, V, P), then
  // floats.
  using Layout = TensorReadTraits<Bits, kD, kRows>;
  static_assert(Layout::kKeyTile == kTile, "TensorReadProgram's key tiles");
  static constexpr int kStride = Layout::kStride;
  static constexpr int kPStride = Layout::kPStride;
  static constexpr int kQ = Layout::kQ;
  static constexpr int kK = Layout::kK;
  static constexpr int kV = Layout::kV;
  static constexpr int kP = Layout::kP;
  static constexpr int kHalves = Layout::kHalves;
  static constexpr int kRedMax = 0;                       // row r, lane slot 4 w + u
  static constexpr int kRedSum = kRedMax + kRows * 16;    // row r, lane u
  static constexpr int kFloats = kRedSum + kRows * 4;

  static std::size_t shared_bytes(const Params&) {
    return static_cast<std::size_t>(kHalves) * sizeof(Bits) +
           static_cast<std::size_t>(kFloats) * sizeof(float);
  }

  // One lane: rows g and g + 8 (g = lane / 4), in the C-fragment layout.
  struct Thread {
    float o[kO][4];                 // unnormalised sums of the current merge block
    float s[kS][4];                 // this tile's scores over the warp's keys
    MmaA q[kQSteps];                // the lane's Q fragments
    SoftmaxStats<float> st[2];
    float m_new[2];
    float beta[2];
  };

  OVQ_HOST_DEVICE static int warp(int tid) { return tid / 32; }
  OVQ_HOST_DEVICE static int entry_row(int tid, int i) {
    return ((tid % 32) >> 2) + (i >= 2 ? 8 : 0);
  }
  OVQ_HOST_DEVICE static int entry_col(int tid, int i) { return 2 * ((tid % 32) & 3) + (i & 1); }

  template <class Block>
  OVQ_HOST_DEVICE static void run(Block& block, const Params& p, BlockIndex index) {
    if (p.skipped()) return;
    Bits* halves = static_cast<Bits*>(block.shared());
    float* floats = reinterpret_cast<float*>(halves + kHalves);
    const Index s = index.y;
    const Index tile = index.x;
    const ReadExtent ext = p.extent();
    const QueryTiling qt = QueryTiling::make(p.group, p.n_queries, kRows);
    const TileSweep sw = tile_sweep(p, ext, qt, tile, kRows, kTile, index.z);
    const Index first = sw.first_block <= sw.last_block ? sw.first_tile(sw.first_block) : -1;

    typename Block::template PerThread<Thread> th;
    block.each([&](int t) {
      stage_queries<kThreads, kD, kRows>(t, p, qt, tile, s, halves + kQ, kStride);
      if (first >= 0)
        stage_key_tile<kThreads, kD>(t, p, ext, sw.axis, s, first * kTile, kTile, false,
                                     halves + kK, kStride);
      commit_async();
      Thread& me = th[t];
      OVQ_DEVICE_UNROLL
      for (int h = 0; h < 2; ++h) {
        me.beta[h] = p.beta_of(s, row_place(p, qt, tile, entry_row(t, 2 * h)).head);
        me.st[h] = SoftmaxStats<float>{};
      }
      OVQ_DEVICE_UNROLL
      for (int n = 0; n < kO; ++n)
        OVQ_DEVICE_UNROLL
        for (int i = 0; i < 4; ++i) me.o[n][i] = 0.0f;
      wait_async<0>();
    });
    block.each([&](int t) {
      OVQ_DEVICE_UNROLL
      for (int f = 0; f < kQSteps; ++f)
        th[t].q[f] = mma_ldmatrix_a(halves + kQ + 16 * f, kStride, t % 32);
    });
    for (Index b = sw.first_block; b <= sw.last_block; ++b)
      for (Index t = sw.first_tile(b); t <= sw.last_tile(b); ++t)
        fold_tile(block, p, ext, sw.axis, qt, tile, s, t, sw.next_tile(b, t), halves, floats, th);
    write_partial(block, p, tile, s, index.z, th);
    MergeProgram<float, kD, kRows, Bits>::merge_if_last(block, p, tile, s, kThreads);
  }

  template <class Block, class Th>
  OVQ_HOST_DEVICE static void fold_tile(Block& block, const Params& p, const ReadExtent& ext,
                                        const KeyAxisGeometry& axis, const QueryTiling& qt,
                                        Index tile, Index s, Index t, Index next, Bits* halves,
                                        float* floats, Th& th) {
    const Index x0 = t * kTile;
    const TileWindow biased = bias_window(p, axis, x0, kTile);
    // 1. The tile's values start loading. S over the warp's keys; each lane's maxima.
    block.each([&](int tid) {
      stage_key_tile<kThreads, kD>(tid, p, ext, axis, s, x0, kTile, true, halves + kV, kStride);
      commit_async();
      Thread& me = th[tid];
      const int lane = tid % 32, warp0 = tid - lane, key0 = 16 * warp(tid);
      const Bits* k = halves + kK + key0 * kStride;
      OVQ_DEVICE_UNROLL
      for (int n = 0; n < kS; ++n)
        OVQ_DEVICE_UNROLL
        for (int i = 0; i < 4; ++i) me.s[n][i] = 0.0f;
      OVQ_DEVICE_UNROLL
      for (int f = 0; f < kQSteps; ++f) {
        const auto a = lane_fragments(lane, [&](int l) { return th[warp0 + l].q[f]; });
        const auto b = lane_fragments(
            lane, [&](int l) { return mma_ldmatrix_b_transposed(k + 16 * f, kStride, l); });
        mma<Bits>(lane, a, [&](int l) { return b(l).tile[0]; }, me.s[0]);
        mma<Bits>(lane, a, [&](int l) { return b(l).tile[1]; }, me.s[1]);
      }
      OVQ_DEVICE_UNROLL
      for (int h = 0; h < 2; ++h) {
        const int r = entry_row(tid, 2 * h);
        const TileWindow seen = seen_window(ext, axis, row_place(p, qt, tile, r), x0, kTile);
        const float largest =
            fragment_logits(p, axis, biased, seen, s, x0, key0, lane, h, me.beta[h], me.s);
        floats[kRedMax + r * 16 + 4 * warp(tid) + (tid & 3)] = largest;
      }
    });
    // 2. The next tile's keys start loading. Each row's maximum; P = exp(S - m) rounded into
    //    shared memory.
    block.each([&](int tid) {
      if (next >= 0)
        stage_key_tile<kThreads, kD>(tid, p, ext, axis, s, next * kTile, kTile, false,
                                     halves + kK, kStride);
      commit_async();
      Thread& me = th[tid];
      const int key0 = 16 * warp(tid);
      OVQ_DEVICE_UNROLL
      for (int h = 0; h < 2; ++h) {
        const int r = entry_row(tid, 2 * h);
        float tile_max = -INFINITY;
        for (int u = 0; u < 16; ++u) {
          const float x = floats[kRedMax + r * 16 + u];
          if (x > tile_max) tile_max = x;
        }
        const float m_new = me.st[h].m > tile_max ? me.st[h].m : tile_max;
        me.m_new[h] = m_new;
        OVQ_DEVICE_UNROLL
        for (int n = 0; n < 2; ++n)
          OVQ_DEVICE_UNROLL
          for (int e = 0; e < 2; ++e) {
            const float w = ovq::detail::softmax_weight(me.s[n][2 * h + e], m_new);
            halves[kP + r * kPStride + key0 + 8 * n + entry_col(tid, e)] = narrow_finite<Bits>(w);
          }
      }
    });
    // 3. Each row's partial sums of its rounded weights, in one warp's order: thread (row, u)
    //    adds the weights of keys 8 n + 2 u + e. The tile's values have landed at the end.
    block.each([&](int tid) {
      if (tid < 4 * kRows) {
        const int r = tid / 4, u = tid % 4;
        const Bits* w = halves + kP + r * kPStride + 2 * u;
        float sum = 0.0f;
        OVQ_DEVICE_UNROLL
        for (int n = 0; n < kTile / 8; ++n)
          OVQ_DEVICE_UNROLL
          for (int e = 0; e < 2; ++e) sum = sum + widen(w[8 * n + e]);
        floats[kRedSum + r * 4 + u] = sum;
      }
      wait_async<1>();
    });
    // 4. The online-softmax update of each lane's rows (O rescaled); O += P V over the warp's
    //    columns. The next tile's keys have landed at the end.
    block.each([&](int tid) {
      Thread& me = th[tid];
      const int lane = tid % 32;
      OVQ_DEVICE_UNROLL
      for (int h = 0; h < 2; ++h) {
        const int r = entry_row(tid, 2 * h);
        float sum = 0.0f;
        for (int u = 0; u < 4; ++u) sum = sum + floats[kRedSum + r * 4 + u];
        update_row(me.st[h], me.m_new[h], sum, me.o, h);
      }
      const int col0 = warp(tid) * (kD / kWarps);
      OVQ_DEVICE_UNROLL
      for (int j = 0; j < kPSteps; ++j) {
        const auto a = lane_fragments(
            lane, [&](int l) { return mma_ldmatrix_a(halves + kP + 16 * j, kPStride, l); });
        if constexpr (kO % 2 == 0) {
          OVQ_DEVICE_UNROLL
          for (int n = 0; n < kO; n += 2) {
            const Bits* v = halves + kV + 16 * j * kStride + col0 + 8 * n;
            const auto b =
                lane_fragments(lane, [&](int l) { return mma_ldmatrix_b(v, kStride, l); });
            mma<Bits>(lane, a, [&](int l) { return b(l).tile[0]; }, me.o[n]);
            mma<Bits>(lane, a, [&](int l) { return b(l).tile[1]; }, me.o[n + 1]);
          }
        } else {
          OVQ_DEVICE_UNROLL
          for (int n = 0; n < kO; ++n) {
            const Bits* v = halves + kV + 16 * j * kStride + col0 + 8 * n;
            mma<Bits>(lane, a, [&](int l) { return mma_load_b(v, kStride, l); }, me.o[n]);
          }
        }
      }
      wait_async<0>();
    });
  }

  // This block's state, in MergeProgram's layout: each lane's averages of its O entries, and
  // (warp 0's lanes u = 0) its rows' (m, l).
  template <class Block, class Th>
  OVQ_HOST_DEVICE static void write_partial(Block& block, const Params& p, Index tile, Index s,
                                            Index z, Th& th) {
    block.each([&](int tid) {
      const Thread& me = th[tid];
      const int col0 = warp(tid) * (kD / kWarps);
      OVQ_DEVICE_UNROLL
      for (int h = 0; h < 2; ++h) {
        const Index r = entry_row(tid, 2 * h);
        float* out = p.partials + (((s * p.tiles + tile) * p.splits + z) * kRows + r) * (kD + 2);
        const SoftmaxStats<float>& st = me.st[h];
        OVQ_DEVICE_UNROLL
        for (int n = 0; n < kO; ++n)
          OVQ_DEVICE_UNROLL
          for (int e = 0; e < 2; ++e)
            out[col0 + 8 * n + entry_col(tid, e)] =
                st.l > 0.0f ? me.o[n][2 * h + e] / st.l : 0.0f;
        if (tid < 32 && (tid & 3) == 0) {
          out[kD] = st.m;
          out[kD + 1] = st.l;
        }
      }
    });
  }
};

}  // namespace ovq::cuda::kernels
