#pragma once
// The fused read: one online-softmax pass over memory rows (with a per-row bias) and then over
// the local rows of the current chunk, tile by tile, never forming a queries x keys matrix.
//
//   o_i = softmax over [ memory r : beta q_i . Km[r] + bias[r] ] u [ local j visible to i :
//         beta q_i . Kl[j] ] of the matching values Vm[r] / Vl[j]
//
// Self-attention (memory = KV cache, no bias), VQ-attention (memory = codebook with mean values,
// bias = log count) and OVQ-attention (memory = online dictionary, bias = log count) all read
// through this one kernel.
//
// Positions: local row j is at position j, memory row r at position r - Nm (just before the
// chunk), query i at position query_offset + i. Causal: a query sees local rows at or before its
// position. Window W (causal only): it sees rows at positions > its position - W, memory included.
// A bias of -inf removes a memory row.
//
// Same bits however the stream was cut: the keys (memory rows, then local rows) are tiled on
// their absolute positions (MemoryRows::origin, the position of memory row 0), every score is
// computed by one micro-kernel whatever the number of queries, and key tiles are folded in
// blocks of kBlockKeys positions whose (o, m, l) states are merged in order. So a query's output
// depends only on the keys it sees, not on the other queries of its call, the number of threads
// or whether it came through forward() or step().
//
// Grouped queries: `heads` query heads that read the same memory are stacked into one tile
// (row (i, h) at position i), so every key/value tile is loaded once for the whole group.
//
// Shapes: q[h] (Tq x dk), Km (Nm x dk), Vm (Nm x dv), bias (Nm), Kl (Nl x dk), Vl (Nl x dv),
// o[h] (Tq x dv). Cost: 2 heads Tq (Nm' + Nl') (dk + dv) flops, Nm' and Nl' the visible rows
// (the causal half only: tiles no query of a tile sees are skipped). Keys and values are read in
// place (TileOps::scores_rows), nothing is packed.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "ovq/core/online_softmax.hpp"
#include "ovq/core/threads.hpp"
#include "ovq/core/types.hpp"
#include "ovq/kernels/arch/tile_ops.hpp"

namespace ovq::kernels {

template <class Scalar>
struct MemoryRows {
  ConstRowsView<Scalar> keys;    // Nm x dk
  ConstRowsView<Scalar> values;  // Nm x dv
  const Scalar* bias = nullptr;  // Nm entries, or nullptr for none
  // Absolute stream position of row 0 (a key/value cache), or 0 (a dictionary): key tiles are
  // aligned on absolute positions, so the tiling does not move when the stream is cut elsewhere.
  std::int64_t origin = 0;
};

template <class Scalar>
struct LocalRows {
  ConstRowsView<Scalar> keys;    // Nl x dk
  ConstRowsView<Scalar> values;  // Nl x dv
};

struct ReadMask {
  bool causal = true;
  Index query_offset = 0;  // local position of query row 0
  Index window = 0;        // 0: unbounded
};

namespace read_detail {

// Stacked query rows per tile: 64 rows of scores (16 KiB in float) and of the output
// accumulator stay in L1/L2 while the key tiles stream past.
inline constexpr Index kStackedRows = 64;
// Key positions per merge block (a multiple of every key tile). Blocks are folded separately
// and merged in order, in every path: that is what a decode splits across threads.
inline constexpr Index kBlockKeys = 1024;

// Grouped-query decode reads prefetch their stream (see KeyAxis::prefetch): 2 to 8 stacked rows
// per tile, over memory rows of at least 2 MiB (keys and values). A single row keeps the
// hardware prefetcher busy by itself (paced like a group, 8 heads of 4096 or 16384 keys: no
// gain measured), and rows already in a cache only pay for the instructions (with the earlier
// per-tile prefetch, a one-row read over 1024 keys per head, 8 heads in L3: 10% slower).
inline constexpr Index kPrefetchMinRows = 2;
inline constexpr Index kPrefetchMaxRows = 8;
inline constexpr double kPrefetchMinBytes = 2.0 * 1024.0 * 1024.0;

// Asks for one cache line (a hint: no fault, no effect on any result).
struct CachePrefetch {
  static void line(const void* address) {
#if defined(__GNUC__) || defined(__clang__)
    __builtin_prefetch(address, 0, 3);
#else
    (void)address;
#endif
  }
};

// The key rows, then the value rows, of the next key tile's memory rows, asked for while this
// tile is computed (see KeyAxis::prefetch). The cache lines go out through the micro-kernels'
// pacing hook (TileOps, NoPacing) in proportion to the flops done: after f of the tile's F
// flops, floor(L f / F) of its L lines have gone out. Issued in one burst, a tile's lines filled
// the core's miss buffers and stalled it until most of them had arrived, so the stream and the
// arithmetic took turns; paced, the stream keeps going while the tile is computed.
// Cost: one prefetch per cache line of the rows, O(1) per hook call, O(rows) per start.
template <class Scalar, class Prefetch = CachePrefetch>
class TileStream {
 public:
  static constexpr std::uintptr_t kLine = 64;

  // Memory rows [first, last) of `memory`, to be issued over `flops` flops.
  void start(const MemoryRows<Scalar>& memory, Index first, Index last, Index flops) {
    parts_[0] = memory.keys;
    parts_[1] = memory.values;
    first_ = first;
    last_ = last;
    flops_done_ = 0;
    flops_total_ = flops;
    issued_ = 0;
    total_ = 0;
    for (const ConstRowsView<Scalar>& rows : parts_)
      for (Index r = first; r < last; ++r) total_ += lines_of(rows, r);
    part_ = 0;
    row_ = first;
    if (first < last) enter_row();
  }
  // The hook: `flops` more flops are about to be spent.
  void advance(Index flops) {
    flops_done_ += flops;
    if (flops_done_ >= flops_total_) {
      issue_until(total_);
    } else {
      issue_until(static_cast<Index>(static_cast<std::int64_t>(total_) * flops_done_ /
                                     flops_total_));
    }
  }
  // Every line not yet issued.
  void finish() { issue_until(total_); }
  Index lines() const { return total_; }
  Index issued() const { return issued_; }

 private:
  static std::uintptr_t address(const Scalar* p) { return reinterpret_cast<std::uintptr_t>(p); }
  static std::uintptr_t bytes(const ConstRowsView<Scalar>& rows) {
    return static_cast<std::uintptr_t>(rows.cols) * sizeof(Scalar);
  }
  // From the line holding the row's first byte to the line holding its last.
  static Index lines_of(const ConstRowsView<Scalar>& rows, Index r) {
    const std::uintptr_t begin = address(rows.row(r));
    return static_cast<Index>((begin % kLine + bytes(rows) + kLine - 1) / kLine);
  }
  void enter_row() {
    const std::uintptr_t begin = address(parts_[part_].row(row_));
    line_ = begin - begin % kLine;
    row_end_ = begin + bytes(parts_[part_]);
  }
  void issue_until(Index due) {
    for (; issued_ < due; ++issued_) {
      Prefetch::line(reinterpret_cast<const void*>(line_));
      line_ += kLine;
      if (line_ >= row_end_) {  // the next row: the keys' rows, then the values'
        if (++row_ == last_) {
          row_ = first_;
          ++part_;
        }
        if (part_ < 2) enter_row();
      }
    }
  }

  ConstRowsView<Scalar> parts_[2];  // keys, values
  Index first_ = 0, last_ = 0;
  Index part_ = 0, row_ = 0;               // the row being issued
  std::uintptr_t line_ = 0, row_end_ = 0;  // its next line, its end
  Index issued_ = 0, total_ = 0;           // lines
  Index flops_done_ = 0, flops_total_ = 0;
};

// The pacing hook of a read that prefetches: the tile's stream (others pass NoPacing).
template <class Scalar>
struct StreamPacing {
  TileStream<Scalar>* stream;
  void advance(Index flops) const { stream->advance(flops); }
};

// The keys of one read on one axis: `pad` empty slots, the Nm memory rows, the Nl local rows.
// pad = origin mod kBlockKeys, so slot x of one read and slot x of another hold the same
// absolute position modulo kBlockKeys: tiles and blocks fall on the same positions.
template <class Scalar>
struct KeyAxis {
  MemoryRows<Scalar> memory;
  LocalRows<Scalar> local;  // only the rows some query can see
  Index pad = 0;
  Index window = 0;  // 0: none
  bool causal = true;
  // Set for a grouped-query decode (kPrefetchMinRows above): such a step reads every memory row
  // once, from L3 or DRAM, and the hardware prefetcher alone let the stream stall while a tile
  // was computed (on two threads, 4 rows a tile over 4096 keys took about the one-row read's
  // time plus the arithmetic's). Each tile asks for the next tile's memory rows, paced over its
  // own arithmetic (TileStream).
  bool prefetch = false;

  Index memory_begin() const { return pad; }
  Index local_begin() const { return pad + memory.keys.rows; }
  Index end() const { return local_begin() + local.keys.rows; }
  // Visible slots of the query at local position p: [first(p), last(p)].
  Index first(Index p) const {
    return window > 0 ? std::max<Index>(local_begin() + p - window + 1, pad) : pad;
  }
  Index last(Index p) const { return causal ? std::min(local_begin() + p, end() - 1) : end() - 1; }
  const Scalar* key(Index slot) const {
    if (slot < pad || slot >= end()) return nullptr;
    return slot < local_begin() ? memory.keys.row(slot - pad) : local.keys.row(slot - local_begin());
  }
};

// The key rows of tile `tile` (slots [tile kTile, tile kTile + kTile)). A slot past either end
// holds no key: it gets another key of the tile, whose score no query sees (the mask sets it to
// -inf), so the micro-kernel never branches. A visited tile always holds a key.
template <class Scalar, Index kTile>
void tile_keys(const KeyAxis<Scalar>& axis, Index tile, const Scalar* keys[kTile]) {
  const Scalar* any = nullptr;
  for (Index j = 0; j < kTile; ++j) {
    keys[j] = axis.key(tile * kTile + j);
    if (any == nullptr) any = keys[j];
  }
  for (Index j = 0; j < kTile; ++j)
    if (keys[j] == nullptr) keys[j] = any;
}

// Per-thread tile state.
template <class Scalar>
struct TileBuffers {
  AlignedVector<Scalar> q, scores, acc;
  std::vector<SoftmaxStats<Scalar>> stats;
  TileStream<Scalar> stream;

  TileBuffers(Index rows, Index dk, Index dv, Index key_tile)
      : q(static_cast<std::size_t>(rows * dk)),
        scores(static_cast<std::size_t>(rows * key_tile)),
        acc(static_cast<std::size_t>(rows * dv)),
        stats(static_cast<std::size_t>(rows)) {}

  void clear_state(Index rows, Index dv) {
    std::fill(acc.begin(), acc.begin() + rows * dv, Scalar(0));
    std::fill(stats.begin(), stats.begin() + rows, SoftmaxStats<Scalar>{});
  }
};

// Folds key tile `tile` of `axis` into the tile of stacked rows
// [0, bq); stacked row r is at position p0 + r / heads. Cost: 2 bq kTile (dk + dv) flops + bq
// kTile exps.
//
// Logits are saturated to the finite range (an overflowing product of finite inputs, or the
// NaN of inf - inf inside one, becomes +-max), and the accumulator holds the softmax average so
// far, not the sum: outputs are finite for every finite input. Slots a row does not see are
// -inf before the exponential, so they add exact zeros: a row's result does not depend on which
// other rows share its tile.
//
// Pacing: StreamPacing where axis.prefetch is set (the tile streams the next one), else
// NoPacing.
template <class Scalar, class Ops, class Pacing>
void fold_key_tile(const KeyAxis<Scalar>& axis, Index tile, Index p0, Index heads, Index bq,
                   Index dk, Index dv, Scalar beta, TileBuffers<Scalar>& buf, Pacing pacing) {
  constexpr bool kStream = std::is_same_v<Pacing, StreamPacing<Scalar>>;
  constexpr Index kTile = Ops::kKeyTile;
  constexpr Scalar kNegInf = -std::numeric_limits<Scalar>::infinity();
  const Index k0 = tile * kTile;
  const Index mem_lo = std::max(k0, axis.memory_begin()) - k0;  // memory slots of the tile
  const Index mem_hi = std::max(std::min(k0 + kTile, axis.local_begin()) - k0, mem_lo);
  Scalar* s = buf.scores.data();
  const Scalar* keys[kTile];
  tile_keys<Scalar, kTile>(axis, tile, keys);
  if constexpr (kStream) {  // the next tile's memory rows, over this tile's score and P V flops
    const Index next_lo = std::max(k0 + kTile, axis.memory_begin()) - axis.pad;
    const Index next_hi =
        std::max(std::min(k0 + 2 * kTile, axis.local_begin()) - axis.pad, next_lo);
    pacing.stream->start(axis.memory, next_lo, next_hi,
                         2 * bq * (kTile * dk + (mem_hi - mem_lo) * dv));
  }
  Ops::scores_rows(buf.q.data(), dk, bq, keys, dk, beta, s, pacing);
  for (Index r = 0; r < bq; ++r) {
    Scalar* row = s + r * kTile;
    const Index p = p0 + r / heads;
    const Index lo = std::clamp<Index>(axis.first(p) - k0, 0, kTile);
    const Index hi = std::clamp<Index>(axis.last(p) - k0 + 1, lo, kTile);  // exclusive
    if (axis.memory.bias != nullptr)
      for (Index j = std::max(lo, mem_lo); j < std::min(hi, mem_hi); ++j)
        row[j] += axis.memory.bias[k0 + j - axis.pad];
    const Scalar tile_max = Ops::mask_max(row, lo, hi);
    SoftmaxStats<Scalar>& st = buf.stats[static_cast<std::size_t>(r)];
    const Scalar m_new = std::max(st.m, tile_max);
    if (m_new == kNegInf) {  // nothing visible so far: this tile adds nothing to row r
      std::fill(row, row + kTile, Scalar(0));
      continue;
    }
    const Scalar sum = Ops::exp_sum(row, m_new);
    // New average = old average * (l_old rescaled / l_new) + (P / l_new) V.
    const Scalar l_kept = st.m == m_new ? st.l : st.l * std::exp(st.m - m_new);
    const Scalar l_new = l_kept + sum;
    const Scalar keep = l_kept / l_new;
    const Scalar inv = Scalar(1) / l_new;
    if (keep != Scalar(1)) {
      // keep = 0: the old rows vanish next to the new maximum. Assigned, not multiplied, so
      // that an average that rounded past the largest finite value (inf) leaves no 0 * inf.
      Scalar* acc = buf.acc.data() + r * dv;
      if (keep == Scalar(0)) {
        std::fill(acc, acc + dv, Scalar(0));
      } else {
        Ops::scale(acc, dv, keep);
      }
    }
    Ops::scale(row, kTile, inv);
    st.l = l_new;
    st.m = m_new;
  }
  // P V over the tile's memory slots, then its local slots (values live in two arrays; one
  // pass over j either way, so the split changes no sum).
  if (mem_hi > mem_lo)
    Ops::accumulate(s + mem_lo, bq, mem_hi - mem_lo, axis.memory.values.row(k0 + mem_lo - axis.pad),
                    axis.memory.values.stride, dv, buf.acc.data(), dv, pacing);
  if constexpr (kStream) pacing.stream->finish();
  const Index loc_lo = std::max(k0, axis.local_begin()) - k0;
  const Index loc_hi = std::max(std::min(k0 + kTile, axis.end()) - k0, loc_lo);
  if (loc_hi > loc_lo)
    Ops::accumulate(s + loc_lo, bq, loc_hi - loc_lo,
                    axis.local.values.row(k0 + loc_lo - axis.local_begin()),
                    axis.local.values.stride, dv, buf.acc.data(), dv);
}

}  // namespace read_detail

// See the header comment for the contract. q and o hold `heads` views each.
template <class Scalar, class Arch = arch::native>
void read(const ConstRowsView<Scalar>* q, Index heads, const MemoryRows<Scalar>& memory,
          const LocalRows<Scalar>& local, const ReadMask& mask, Scalar beta,
          const RowsView<Scalar>* o) {
  using namespace read_detail;
  using Ops = TileOps<Scalar, Arch>;
  constexpr Index kTile = Ops::kKeyTile;
  constexpr Index kTilesPerBlock = kBlockKeys / kTile;
  static_assert(kBlockKeys % kTile == 0, "merge blocks hold whole key tiles");
  if (heads <= 0) return;
  const Index n_pos = q[0].rows;
  const Index dk = q[0].cols;
  const Index dv = o[0].cols;
  if (n_pos == 0) return;

  const Index last_position = mask.query_offset + n_pos - 1;
  const Index local_used =
      mask.causal ? std::min(local.keys.rows, last_position + 1) : local.keys.rows;
  const auto block_keys = static_cast<std::int64_t>(kBlockKeys);
  KeyAxis<Scalar> axis{memory,
                       {local.keys.middle_rows(0, local_used), local.values.middle_rows(0, local_used)},
                       static_cast<Index>(((memory.origin % block_keys) + block_keys) % block_keys),
                       mask.causal ? mask.window : 0,
                       mask.causal};

  const Index positions_per_tile = std::max<Index>(1, kStackedRows / heads);
  const Index n_tiles = (n_pos + positions_per_tile - 1) / positions_per_tile;
  // Buffers sized for the rows a tile really holds: a decode step stacks `heads` rows, not 64
  // (zeroing two 64-row buffers took about a third of a one-row read over 256 keys).
  const Index tile_rows = std::min(positions_per_tile, n_pos) * heads;
  axis.prefetch = tile_rows >= kPrefetchMinRows && tile_rows <= kPrefetchMaxRows &&
                  static_cast<double>(memory.keys.rows) * static_cast<double>(dk + dv) *
                          sizeof(Scalar) >= kPrefetchMinBytes;

  // Key tiles [first, last] that query tile `tile` visits: tiles no row of it sees are skipped
  // whole (that is where causal and windowed reads save their masked part).
  struct TileRange {
    Index first, last;  // last < first: nothing visible
  };
  auto key_range = [&](Index tile) {
    const Index i0 = tile * positions_per_tile;
    const Index np = std::min(positions_per_tile, n_pos - i0);
    const Index p0 = mask.query_offset + i0;
    const Index first = axis.first(p0), last = axis.last(p0 + np - 1);
    if (last < first) return TileRange{0, -1};
    return TileRange{first / kTile, last / kTile};
  };

  auto load_queries = [&](Index tile, TileBuffers<Scalar>& buf) {
    const Index i0 = tile * positions_per_tile;
    const Index np = std::min(positions_per_tile, n_pos - i0);
    for (Index i = 0; i < np; ++i)
      for (Index h = 0; h < heads; ++h)
        std::copy(q[h].row(i0 + i), q[h].row(i0 + i) + dk, buf.q.data() + (i * heads + h) * dk);
  };
  // Folds key tiles [first, last] (all in one merge block) into buf, from an empty state.
  auto fold_block = [&](Index tile, Index first, Index last, TileBuffers<Scalar>& buf) {
    const Index i0 = tile * positions_per_tile;
    const Index bq = std::min(positions_per_tile, n_pos - i0) * heads;
    buf.clear_state(bq, dv);
    const Index p0 = mask.query_offset + i0;
    for (Index t = first; t <= last; ++t) {
      if (axis.prefetch) {
        fold_key_tile<Scalar, Ops>(axis, t, p0, heads, bq, dk, dv, beta, buf,
                                   StreamPacing<Scalar>{&buf.stream});
      } else {
        fold_key_tile<Scalar, Ops>(axis, t, p0, heads, bq, dk, dv, beta, buf, NoPacing{});
      }
    }
  };
  auto merge_rows = [&](Index bq, Scalar* acc, SoftmaxStats<Scalar>* stats, const Scalar* acc_b,
                        const SoftmaxStats<Scalar>* stats_b) {
    for (Index r = 0; r < bq; ++r) merge_softmax(acc + r * dv, stats[r], acc_b + r * dv, stats_b[r], dv);
  };
  // The whole read of one query tile: its merge blocks in order, each folded from scratch and
  // merged into the first.
  auto read_tile = [&](Index tile, TileBuffers<Scalar>& buf, TileBuffers<Scalar>& part) {
    load_queries(tile, buf);
    const Index bq = std::min(positions_per_tile, n_pos - tile * positions_per_tile) * heads;
    const TileRange range = key_range(tile);
    if (range.last < range.first) {
      buf.clear_state(bq, dv);
      return;
    }
    for (Index b = range.first / kTilesPerBlock; b <= range.last / kTilesPerBlock; ++b) {
      const Index first = std::max(range.first, b * kTilesPerBlock);
      const Index last = std::min(range.last, b * kTilesPerBlock + kTilesPerBlock - 1);
      if (b == range.first / kTilesPerBlock) {
        fold_block(tile, first, last, buf);
      } else {
        std::copy(buf.q.begin(), buf.q.begin() + bq * dk, part.q.begin());
        fold_block(tile, first, last, part);
        merge_rows(bq, buf.acc.data(), buf.stats.data(), part.acc.data(), part.stats.data());
      }
    }
  };
  auto store = [&](Index tile, const Scalar* acc_rows) {
    const Index i0 = tile * positions_per_tile;
    const Index np = std::min(positions_per_tile, n_pos - i0);
    for (Index i = 0; i < np; ++i) {
      for (Index h = 0; h < heads; ++h) {
        // The accumulator already is the average (zero when no row was visible). An average of
        // values never exceeds the largest of them; only rounding can push one near the largest
        // finite scalar past it, so that is clamped back.
        constexpr Scalar kMaxValue = std::numeric_limits<Scalar>::max();
        const Scalar* acc = acc_rows + (i * heads + h) * dv;
        Scalar* out = o[h].row(i0 + i);
        for (Index c = 0; c < dv; ++c) out[c] = std::clamp(acc[c], -kMaxValue, kMaxValue);
      }
    }
  };

#if defined(OVQ_HAS_OPENMP)
  const Index stacked = n_pos * heads;
  const double work = 2.0 * static_cast<double>(stacked) *
                      static_cast<double>(axis.end() - axis.pad) * static_cast<double>(dk + dv);
  const TileRange decode_range = key_range(0);
  const Index decode_blocks =
      n_tiles == 1 && decode_range.last >= decode_range.first
          ? decode_range.last / kTilesPerBlock - decode_range.first / kTilesPerBlock + 1
          : 0;
  if (detail::worth_parallel(work) && (n_tiles > 1 || decode_blocks > 1)) {
    if (n_tiles > 1) {
      // Prefill: query tiles in parallel.
#pragma omp parallel
      {
        TileBuffers<Scalar> buf(tile_rows, dk, dv, kTile), part(tile_rows, dk, dv, kTile);
#pragma omp for schedule(dynamic, 1)
        for (Index t = 0; t < n_tiles; ++t) {
          read_tile(t, buf, part);
          store(t, buf.acc.data());
        }
      }
      return;
    }
    // Decode (one query tile over a long memory): merge blocks in parallel, each from scratch,
    // then merged in order on this thread, exactly as read_tile merges them.
    const Index bq = stacked;
    const Index b0 = decode_range.first / kTilesPerBlock;
    AlignedVector<Scalar> block_acc(static_cast<std::size_t>(decode_blocks * bq * dv));
    std::vector<SoftmaxStats<Scalar>> block_stats(static_cast<std::size_t>(decode_blocks * bq));
#pragma omp parallel
    {
      TileBuffers<Scalar> buf(tile_rows, dk, dv, kTile);
      load_queries(0, buf);
#pragma omp for schedule(static)
      for (Index b = 0; b < decode_blocks; ++b) {
        const Index first = std::max(decode_range.first, (b0 + b) * kTilesPerBlock);
        const Index last = std::min(decode_range.last, (b0 + b + 1) * kTilesPerBlock - 1);
        fold_block(0, first, last, buf);
        std::copy(buf.acc.begin(), buf.acc.begin() + bq * dv, block_acc.begin() + b * bq * dv);
        std::copy(buf.stats.begin(), buf.stats.begin() + bq, block_stats.begin() + b * bq);
      }
    }
    for (Index b = 1; b < decode_blocks; ++b)
      merge_rows(bq, block_acc.data(), block_stats.data(), block_acc.data() + b * bq * dv,
                 block_stats.data() + b * bq);
    store(0, block_acc.data());
    return;
  }
#endif
  TileBuffers<Scalar> buf(tile_rows, dk, dv, kTile), part(tile_rows, dk, dv, kTile);
  for (Index t = 0; t < n_tiles; ++t) {
    read_tile(t, buf, part);
    store(t, buf.acc.data());
  }
}

// One query head.
template <class Scalar, class Arch = arch::native>
void read(ConstRowsView<Scalar> q, const MemoryRows<Scalar>& memory, const LocalRows<Scalar>& local,
          const ReadMask& mask, Scalar beta, RowsView<Scalar> o) {
  read<Scalar, Arch>(&q, 1, memory, local, mask, beta, &o);
}

}  // namespace ovq::kernels
