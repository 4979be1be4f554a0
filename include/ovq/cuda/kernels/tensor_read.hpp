#pragma once
// The fused read on tensor cores, for 16-bit queries, keys and values (bf16 or fp16): the read
// contract (kernels/read_contract.hpp) FlashAttention-2 style, as ReadProgram (read.hpp) runs it
// in float, with both products on mma.sync (kernels/mma.hpp) and the softmax in float.
//
//   TensorReadProgram<Bits, kD, kRows>   one tile of kRows stacked query rows (64 prefill, 32
//                                        at width 256; 16 decode), one warp per 16 rows (two
//                                        at width 256, each with half the keys of S and half
//                                        the columns of O); key tiles of 64 slots;
//                                        merge blocks of kBlockKeys positions folded from
//                                        scratch and merged in order, in the block (loop mode)
//                                        or by MergeProgram from a workspace (split mode,
//                                        grid.z > 1), as ReadProgram.
//
// Per key tile: K and V staged asynchronously into shared memory (the values while S is
// computed, the next tile's keys while P V is); S = Q K^T on tensor cores (kD / 16 steps of 8
// column tiles of 8 keys, split among the row's warps), times the query head's beta, saturated,
// masked; the row maxima through shared memory; P = exp(S - m) rounded to 16 bits (row sums
// add the rounded weights, so l is the sum of the weights the product uses); O += P V on tensor
// cores (64 / 16 steps of kD / 8 column tiles), O unnormalised in registers, rescaled when a
// row's maximum moves. A finished merge block's average O / l is merged into the block's
// running result in shared memory (loop mode) or written with (m, l) as a partial (split mode).
// Fragments of K and V (and of Q and P at width 256) load by ldmatrix, two column tiles at a
// time; up to width 128 a warp keeps its Q fragments in registers for the whole read and builds
// P's fragments in registers from S's.
//
// Shapes: Q (kRows x kD), K and V (64 x kD) and P (kRows x 64, width 256) as 16-bit rows padded
// by 8 elements (the 8 rows of an ldmatrix tile fall in different banks), then float: two
// reduction arrays (kRows x 4 per warp of a row) and, in loop mode, the running result (kRows x
// kD). At kD = 128, kRows = 64: 62 KiB; kD = 256, kRows = 32: 120 KiB. Registers per lane: O
// (64 floats), S (32 floats, 16 at width 256), Q and P fragments (kD / 4 and 16 words, up to
// width 128).
// Cost: 4 rows (visible slots, tile-granular) kD flops on tensor cores, O(rows slots) in float.
//
// Determinism: an entry of a tensor-core product depends on its row of A and column of B only,
// and every other operation is per row in a fixed order (a lane's entries of a row, then the
// lanes of the row in order), so a row's result does not depend on the tile it was read in:
// prefill (64 rows) and decode (16 rows) tiles give the same bits, on a GPU and in the
// emulation. The emulation's products sum in order and the tensor cores in theirs, so the two
// agree to rounding (kernels/mma.hpp).
#include <cfloat>
#include <cstdint>
#include <cstring>

#include "ovq/config.hpp"
#include "ovq/core/exact_math.hpp"
#include "ovq/core/online_softmax.hpp"
#include "ovq/cuda/block.hpp"
#include "ovq/cuda/kernels/async_copy.hpp"
#include "ovq/cuda/kernels/half.hpp"
#include "ovq/cuda/kernels/mma.hpp"
#include "ovq/cuda/kernels/read.hpp"

namespace ovq::cuda::kernels {

template <class Bits, int kD, int kRows>
struct TensorReadTraits {
  static_assert(kD % 16 == 0 && kRows % 16 == 0, "tiles of 16 x 16");
  // Warps per 16 rows: at width 256 two, so that O (kD / 2 floats a lane) fits the registers.
  static constexpr int kColGroups = kD > 128 ? 2 : 1;
  static constexpr int kWarps = kRows / 16 * kColGroups;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kKeyTile = 64;
  static constexpr int kWarpKeys = kKeyTile / kColGroups;  // keys of S per warp
  static constexpr int kWarpCols = kD / kColGroups;        // columns of O per warp
  static constexpr int kScoreTiles = kWarpKeys / 8;        // column tiles of S per warp
  static constexpr int kOutTiles = kWarpCols / 8;          // column tiles of O per warp
  static constexpr int kPartials = 4 * kColGroups;         // lanes of a row, per reduction
  // Shared memory: 16-bit elements first, then floats (at a 16-byte boundary).
  static constexpr int kStride = kD + 8;
  static constexpr int kPStride = kKeyTile + 8;
  static constexpr int kQ = 0;
  static constexpr int kK = kQ + kRows * kStride;
  static constexpr int kV = kK + kKeyTile * kStride;
  static constexpr int kP = kV + kKeyTile * kStride;
  static constexpr int kHalves = (kP + kRows * kPStride + 7) / 8 * 8;
  static constexpr int kRedMax = 0;  // in floats, after the halves
  static constexpr int kRedSum = kRedMax + kRows * kPartials;
  static constexpr int kTot = kRedSum + kRows * kPartials;
  static constexpr int kFloatsSplit = kTot;
  static constexpr int kFloatsLoop = kTot + kRows * kD;
};

// The logits of row half h of a lane's S fragments (its entries 2 h and 2 h + 1 of kS column
// tiles of 8 keys from slot key0 of tile x0), in place: tile_logit, then -inf where the row does
// not see the slot. Returns their maximum.
template <int kS, class Params>
OVQ_HOST_DEVICE float fragment_logits(const Params& p, const KeyAxisGeometry& axis,
                                      const TileWindow& biased, const TileWindow& seen, Index s,
                                      Index x0, int key0, int lane, int h, float beta,
                                      float (&frag)[kS][4]) {
  const bool whole = seen.holds_all(key0, key0 + 8 * kS - 1);
  float largest = -INFINITY;
  OVQ_DEVICE_UNROLL
  for (int n = 0; n < kS; ++n)
    OVQ_DEVICE_UNROLL
    for (int e = 0; e < 2; ++e) {
      const int col = key0 + 8 * n + 2 * (lane & 3) + e;
      float x = tile_logit(p, axis, biased, s, x0, col, frag[n][2 * h + e], beta);
      if (!whole && !seen.holds(col)) x = -INFINITY;
      frag[n][2 * h + e] = x;
      if (x > largest) largest = x;
    }
  return largest;
}

// A tensor-core read's online-softmax update of row half h of a lane (its entries 2 h and
// 2 h + 1 of each of the kO column tiles of O) once the tile's maximum m_new and the sum of its
// rounded weights are known: l and O rescaled when the maximum moved, then l grown by the sum.
// Nothing when the row has seen no logit (m_new = -inf).
template <int kO>
OVQ_HOST_DEVICE void update_row(SoftmaxStats<float>& st, float m_new, float sum,
                                float (&o)[kO][4], int h) {
  if (m_new == -INFINITY) return;
  if (st.m != m_new) {
    const float alpha = st.m == -INFINITY ? 0.0f : ovq::detail::exp_nonpositive(st.m - m_new);
    st.l = ovq::detail::mul_rn(st.l, alpha);
    // alpha = 0: the old rows vanish next to the new maximum (assigned, not multiplied, so that
    // a sum that rounded to inf leaves no 0 * inf).
    OVQ_DEVICE_UNROLL
    for (int n = 0; n < kO; ++n)
      OVQ_DEVICE_UNROLL
      for (int e = 0; e < 2; ++e)
        o[n][2 * h + e] = alpha == 0.0f ? 0.0f : ovq::detail::mul_rn(o[n][2 * h + e], alpha);
    st.m = m_new;
  }
  st.l = st.l + sum;
}

template <class Bits, int kD, int kRows>
struct TensorReadProgram {
  using Traits = TensorReadTraits<Bits, kD, kRows>;
  using Params = ReadParams<float, Bits>;
  static constexpr int kThreads = Traits::kThreads;
  static constexpr int kTile = Traits::kKeyTile;
  static constexpr int kS = Traits::kScoreTiles;
  static constexpr int kO = Traits::kOutTiles;
  static constexpr int kCG = Traits::kColGroups;
  static constexpr int kParts = Traits::kPartials;

  static std::size_t shared_bytes(const Params& p) {
    return static_cast<std::size_t>(Traits::kHalves) * sizeof(Bits) +
           static_cast<std::size_t>(p.splits > 1 ? Traits::kFloatsSplit : Traits::kFloatsLoop) *
               sizeof(float);
  }

  // Width up to 128 (one warp per 16 rows): the warp's Q fragments stay in registers for the
  // whole read, and P goes from S's registers straight into the A fragments of P V (the C and
  // A layouts hold the same entries: S tiles 2j and 2j + 1 are P's k-step j). Width 256 (two
  // warps share 16 rows, each with half the keys) exchanges P through shared memory.
  static constexpr bool kRegisterFragments = kCG == 1;
  static constexpr int kQSteps = kD / 16;       // k-steps of S
  static constexpr int kPSteps = kTile / 16;    // k-steps of P V
  static_assert(kS % 2 == 0 && kO % 2 == 0, "B fragments load two column tiles at a time");

  // One lane: rows g and g + 8 of its warp's 16 (g = lane / 4), in the C-fragment layout, for
  // the warp's keys of S and columns of O.
  struct Thread {
    float o[kO][4];  // unnormalised sums of the current merge block
    float s[kS][4];  // this tile's scores, then weights
    MmaA q[kRegisterFragments ? kQSteps : 1];  // the lane's Q fragments
    MmaA w[kRegisterFragments ? kPSteps : 1];  // the lane's P fragments (16-bit weights)
    SoftmaxStats<float> st[2], st_tot[2];
    float m_new[2];
    float beta[2];  // the logit scale of each of the lane's two rows
  };

  struct Shared {
    Bits* halves;
    float* floats;
  };

  // A thread's warp: its 16 rows (from row_base) and its column group (of S's keys and O's
  // columns); the stacked row (of the tile) of fragment entry i, its column within an 8-wide
  // tile, and the slot of its partial in a row's reductions.
  OVQ_HOST_DEVICE static int row_base(int tid) { return (tid / 32) / kCG * 16; }
  OVQ_HOST_DEVICE static int col_group(int tid) { return (tid / 32) % kCG; }
  OVQ_HOST_DEVICE static int entry_row(int tid, int i) {
    return row_base(tid) + ((tid % 32) >> 2) + (i >= 2 ? 8 : 0);
  }
  OVQ_HOST_DEVICE static int entry_col(int tid, int i) { return 2 * ((tid % 32) & 3) + (i & 1); }
  OVQ_HOST_DEVICE static int out_col(int tid, int n, int i) {
    return col_group(tid) * Traits::kWarpCols + 8 * n + entry_col(tid, i);
  }
  OVQ_HOST_DEVICE static int partial_slot(int tid) { return col_group(tid) * 4 + (tid & 3); }

  template <class Block>
  OVQ_HOST_DEVICE static void run(Block& block, const Params& p, BlockIndex index) {
    if (p.skipped()) return;
    Shared sh;
    sh.halves = static_cast<Bits*>(block.shared());
    sh.floats = reinterpret_cast<float*>(sh.halves + Traits::kHalves);
    const Index s = index.y;
    const Index tile = index.x;
    const ReadExtent ext = p.extent();
    const QueryTiling qt = QueryTiling::make(p.group, p.n_queries, kRows);
    const bool split = p.splits > 1;
    const TileSweep sw = tile_sweep(p, ext, qt, tile, kRows, kTile, index.z);

    const Index first = sw.first_block <= sw.last_block ? sw.first_tile(sw.first_block) : -1;

    typename Block::template PerThread<Thread> th;
    load_queries(block, p, ext, sw.axis, qt, tile, s, first, split, sh, th);
    for (Index b = sw.first_block; b <= sw.last_block; ++b) {
      for (Index t = sw.first_tile(b); t <= sw.last_tile(b); ++t)
        fold_tile(block, p, ext, sw.axis, qt, tile, s, t, sw.next_tile(b, t), sh, th);
      if (!split) merge_block(block, sh, th);
    }
    if (split) {
      write_partial(block, p, tile, s, index.z, th);
    } else {
      store(block, p, qt, tile, s, sh, th);
    }
  }

  // Q rows and the first tile's keys (tile `first`, or none) into shared memory (zeros past dk
  // and for invalid rows); accumulators empty; in loop mode each lane's entries of the running
  // result to 0; then (width up to 128) each lane's Q fragments into registers.
  template <class Block, class Th>
  OVQ_HOST_DEVICE static void load_queries(Block& block, const Params& p, const ReadExtent& ext,
                                           const KeyAxisGeometry& axis, const QueryTiling& qt,
                                           Index tile, Index s, Index first, bool split,
                                           const Shared& sh, Th& th) {
    block.each([&](int t) {
      stage_queries<kThreads, kD, kRows>(t, p, qt, tile, s, sh.halves + Traits::kQ,
                                         Traits::kStride);
      if (first >= 0)
        stage_key_tile<kThreads, kD>(t, p, ext, axis, s, first * kTile, kTile, false,
                                     sh.halves + Traits::kK, Traits::kStride);
      commit_async();
      Thread& me = th[t];
      OVQ_DEVICE_UNROLL
      for (int h = 0; h < 2; ++h) {
        me.beta[h] = p.beta_of(s, row_place(p, qt, tile, entry_row(t, 2 * h)).head);
        me.st[h] = SoftmaxStats<float>{};
        me.st_tot[h] = SoftmaxStats<float>{};
      }
      OVQ_DEVICE_UNROLL
      for (int n = 0; n < kO; ++n)
        OVQ_DEVICE_UNROLL
        for (int i = 0; i < 4; ++i) {
          me.o[n][i] = 0.0f;
          if (!split) sh.floats[Traits::kTot + entry_row(t, i) * kD + out_col(t, n, i)] = 0.0f;
        }
      wait_async<0>();
    });
    if constexpr (kRegisterFragments) {
      block.each([&](int t) {
        const Bits* q = sh.halves + Traits::kQ + row_base(t) * Traits::kStride;
        OVQ_DEVICE_UNROLL
        for (int f = 0; f < kQSteps; ++f)
          th[t].q[f] = mma_ldmatrix_a(q + 16 * f, Traits::kStride, t % 32);
      });
    }
  }

  // Folds key tile t (slots [t kTile, (t + 1) kTile)), whose keys are staged, into every row's
  // current block; stages its values, and the keys of tile `next` (-1: none), asynchronously:
  // the values load while S is computed, the next keys while P and P V are.
  template <class Block, class Th>
  OVQ_HOST_DEVICE static void fold_tile(Block& block, const Params& p, const ReadExtent& ext,
                                        const KeyAxisGeometry& axis, const QueryTiling& qt,
                                        Index tile, Index s, Index t, Index next, const Shared& sh,
                                        Th& th) {
    const Index x0 = t * kTile;
    const TileWindow biased = bias_window(p, axis, x0, kTile);
    // 1. The tile's values start loading. S = Q K^T; beta, bias, saturation, mask; each lane's
    //    maximum of its two rows.
    block.each([&](int tid) {
      stage_key_tile<kThreads, kD>(tid, p, ext, axis, s, x0, kTile, true, sh.halves + Traits::kV,
                                   Traits::kStride);
      commit_async();
      Thread& me = th[tid];
      const int lane = tid % 32, r0 = row_base(tid), key0 = col_group(tid) * Traits::kWarpKeys;
      const int warp0 = tid - lane;
      OVQ_DEVICE_UNROLL
      for (int n = 0; n < kS; ++n)
        OVQ_DEVICE_UNROLL
        for (int i = 0; i < 4; ++i) me.s[n][i] = 0.0f;
      OVQ_DEVICE_UNROLL
      for (int n = 0; n < kS; n += 2) {
        const Bits* k = sh.halves + Traits::kK + (key0 + 8 * n) * Traits::kStride;
        OVQ_DEVICE_UNROLL
        for (int f = 0; f < kQSteps; ++f) {
          const auto a = lane_fragments(lane, [&](int l) {
            if constexpr (kRegisterFragments) {
              return th[warp0 + l].q[f];
            } else {
              return mma_ldmatrix_a(sh.halves + Traits::kQ + r0 * Traits::kStride + 16 * f,
                                    Traits::kStride, l);
            }
          });
          const auto b = lane_fragments(lane, [&](int l) {
            return mma_ldmatrix_b_transposed(k + 16 * f, Traits::kStride, l);
          });
          mma<Bits>(lane, a, [&](int l) { return b(l).tile[0]; }, me.s[n]);
          mma<Bits>(lane, a, [&](int l) { return b(l).tile[1]; }, me.s[n + 1]);
        }
      }
      OVQ_DEVICE_UNROLL
      for (int h = 0; h < 2; ++h) {
        const int r = entry_row(tid, 2 * h);
        const TileWindow seen = seen_window(ext, axis, row_place(p, qt, tile, r), x0, kTile);
        const float largest =
            fragment_logits(p, axis, biased, seen, s, x0, key0, lane, h, me.beta[h], me.s);
        sh.floats[Traits::kRedMax + r * kParts + partial_slot(tid)] = largest;
      }
    });
    // 2. The next tile's keys start loading (this tile's are read). The row maxima;
    //    P = exp(S - m) rounded to 16 bits (into the lane's P fragments, or shared memory); each
    //    lane's sum of its rounded weights per row. The tile's values have landed at the end.
    block.each([&](int tid) {
      if (next >= 0)
        stage_key_tile<kThreads, kD>(tid, p, ext, axis, s, next * kTile, kTile, false,
                                     sh.halves + Traits::kK, Traits::kStride);
      commit_async();
      Thread& me = th[tid];
      const int key0 = col_group(tid) * Traits::kWarpKeys;
      std::uint32_t rounded[kS][2];  // row half h's two weights of column tile n, packed
      OVQ_DEVICE_UNROLL
      for (int h = 0; h < 2; ++h) {
        const int r = entry_row(tid, 2 * h);
        float tile_max = -INFINITY;
        for (int u = 0; u < kParts; ++u) {
          const float x = sh.floats[Traits::kRedMax + r * kParts + u];
          if (x > tile_max) tile_max = x;
        }
        const float m_new = me.st[h].m > tile_max ? me.st[h].m : tile_max;
        me.m_new[h] = m_new;
        float sum = 0.0f;
        OVQ_DEVICE_UNROLL
        for (int n = 0; n < kS; ++n) {
          float w[2];
          OVQ_DEVICE_UNROLL
          for (int e = 0; e < 2; ++e)
            w[e] = ovq::detail::softmax_weight(me.s[n][2 * h + e], m_new);
          rounded[n][h] = narrow_finite_pair<Bits>(w[0], w[1]);
          sum = sum + widen(pair_half<Bits>(rounded[n][h], 0));
          sum = sum + widen(pair_half<Bits>(rounded[n][h], 1));
        }
        sh.floats[Traits::kRedSum + r * kParts + partial_slot(tid)] = sum;
      }
      if constexpr (kRegisterFragments) {
        // S tiles 2j and 2j + 1 are the two column halves of P's k-step j.
        OVQ_DEVICE_UNROLL
        for (int j = 0; j < kPSteps; ++j) {
          me.w[j] = MmaA{{rounded[2 * j][0], rounded[2 * j][1], rounded[2 * j + 1][0],
                          rounded[2 * j + 1][1]}};
        }
      } else {
        OVQ_DEVICE_UNROLL
        for (int n = 0; n < kS; ++n)
          OVQ_DEVICE_UNROLL
          for (int i = 0; i < 4; ++i)
            sh.halves[Traits::kP + entry_row(tid, i) * Traits::kPStride + key0 + 8 * n +
                      entry_col(tid, i)] = pair_half<Bits>(rounded[n][i / 2], i % 2);
      }
      wait_async<1>();
    });
    // 3. The row sums; the online-softmax update (O rescaled); O += P V. The next tile's keys
    //    have landed at the end.
    block.each([&](int tid) {
      Thread& me = th[tid];
      const int lane = tid % 32, r0 = row_base(tid), warp0 = tid - lane;
      OVQ_DEVICE_UNROLL
      for (int h = 0; h < 2; ++h) {
        const int r = entry_row(tid, 2 * h);
        float sum = 0.0f;
        for (int u = 0; u < kParts; ++u) sum = sum + sh.floats[Traits::kRedSum + r * kParts + u];
        update_row(me.st[h], me.m_new[h], sum, me.o, h);
      }
      OVQ_DEVICE_UNROLL
      for (int j = 0; j < kPSteps; ++j) {
        const auto a = lane_fragments(lane, [&](int l) {
          if constexpr (kRegisterFragments) {
            return th[warp0 + l].w[j];
          } else {
            return mma_ldmatrix_a(sh.halves + Traits::kP + r0 * Traits::kPStride + 16 * j,
                                  Traits::kPStride, l);
          }
        });
        OVQ_DEVICE_UNROLL
        for (int n = 0; n < kO; n += 2) {
          const Bits* v = sh.halves + Traits::kV + 16 * j * Traits::kStride +
                          col_group(tid) * Traits::kWarpCols + 8 * n;
          const auto b =
              lane_fragments(lane, [&](int l) { return mma_ldmatrix_b(v, Traits::kStride, l); });
          mma<Bits>(lane, a, [&](int l) { return b(l).tile[0]; }, me.o[n]);
          mma<Bits>(lane, a, [&](int l) { return b(l).tile[1]; }, me.o[n + 1]);
        }
      }
      wait_async<0>();
    });
  }

  // A lane's entry of row half h of the current block as an average (0 for a row that saw
  // nothing).
  OVQ_HOST_DEVICE static float average(const Thread& me, int n, int i) {
    const SoftmaxStats<float>& st = me.st[i >= 2 ? 1 : 0];
    return st.l > 0.0f ? me.o[n][i] / st.l : 0.0f;
  }

  // Loop mode: the finished merge block into the running result; the next block starts empty.
  template <class Block, class Th>
  OVQ_HOST_DEVICE static void merge_block(Block& block, const Shared& sh, Th& th) {
    block.each([&](int tid) {
      Thread& me = th[tid];
      OVQ_DEVICE_UNROLL
      for (int h = 0; h < 2; ++h) {
        const MergeWeights<float> w = merge_weights<ExactExp>(me.st_tot[h], me.st[h]);
        OVQ_DEVICE_UNROLL
        for (int n = 0; n < kO; ++n)
          OVQ_DEVICE_UNROLL
          for (int e = 0; e < 2; ++e) {
            const int i = 2 * h + e;
            float& tot = sh.floats[Traits::kTot + entry_row(tid, i) * kD + out_col(tid, n, i)];
            tot = merge_entry<true>(w, tot, average(me, n, i));
          }
        me.st_tot[h] = w.stats;
      }
      OVQ_DEVICE_UNROLL
      for (int h = 0; h < 2; ++h) me.st[h] = SoftmaxStats<float>{};
      OVQ_DEVICE_UNROLL
      for (int n = 0; n < kO; ++n)
        OVQ_DEVICE_UNROLL
        for (int i = 0; i < 4; ++i) me.o[n][i] = 0.0f;
    });
  }

  // The outputs: the running result (0 where no key was visible), clamped and rounded.
  template <class Block, class Th>
  OVQ_HOST_DEVICE static void store(Block& block, const Params& p, const QueryTiling& qt,
                                    Index tile, Index s, const Shared& sh, Th& th) {
    block.each([&](int tid) {
      const Thread& me = th[tid];
      OVQ_DEVICE_UNROLL
      for (int i = 0; i < 4; i += 2) {
        const int r = entry_row(tid, i);
        const RowPlace rp = row_place(p, qt, tile, r);
        if (!rp.valid) continue;
        Bits* out = p.o.row(s * p.group + rp.head, rp.position);
        OVQ_DEVICE_UNROLL
        for (int n = 0; n < kO; ++n)
          OVQ_DEVICE_UNROLL
          for (int e = 0; e < 2; ++e) {
            const Index col = out_col(tid, n, e);
            if (col < p.dv)
              out[col] = output_entry<Bits>(sh.floats[Traits::kTot + r * kD + col]);
          }
        if (partial_slot(tid) == 0 && p.lse.data != nullptr)
          p.lse.row(s * p.group + rp.head, rp.position)[0] = log_sum_exp(me.st_tot[i / 2]);
      }
    });
  }

  // Split mode: this block's state, in MergeProgram's layout (kD averages, m, l per row).
  template <class Block, class Th>
  OVQ_HOST_DEVICE static void write_partial(Block& block, const Params& p, Index tile, Index s,
                                            Index z, Th& th) {
    block.each([&](int tid) {
      Thread& me = th[tid];
      OVQ_DEVICE_UNROLL
      for (int h = 0; h < 2; ++h) {
        const Index r = entry_row(tid, 2 * h);
        float* out = p.partials + (((s * p.tiles + tile) * p.splits + z) * kRows + r) * (kD + 2);
        OVQ_DEVICE_UNROLL
        for (int n = 0; n < kO; ++n)
          OVQ_DEVICE_UNROLL
          for (int e = 0; e < 2; ++e)
            out[out_col(tid, n, e)] = average(me, n, 2 * h + e);
        if (partial_slot(tid) == 0) {
          out[kD] = me.st[h].m;
          out[kD + 1] = me.st[h].l;
        }
      }
    });
  }
};

}  // namespace ovq::cuda::kernels
