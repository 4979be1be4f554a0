#pragma once
// The CPU executor of the read contract (kernels/read_contract.hpp): a tile loop over stacked
// query rows and key tiles, on the per-architecture micro-kernels (TileOps).
//
// Same bits however the stream was cut: keys (memory rows, then local rows) are tiled on their
// absolute positions, every score is computed by the same operations whatever the number of
// queries (one micro-kernel; on AMX tiles, two layouts of the same products), and key tiles are
// folded in merge blocks of kBlockKeys positions whose (o, m, l) states are merged in order. So
// a query's output depends only on the keys it sees, not on the other queries of its call, the
// number of threads or whether it came through forward() or step().
//
// Grouped queries: `heads` query heads that read the same memory are stacked into one tile
// (row (i, h) at position i), so every key/value tile is loaded once for the whole group.
//
// Shapes: q[h] (Tq x dk), Km (Nm x dk), Vm (Nm x dv), bias (Nm), Kl (Nl x dk), Vl (Nl x dv),
// o[h] (Tq x dv). Cost: 2 heads Tq (Nm' + Nl') (dk + dv) flops, Nm' and Nl' the visible rows
// (the causal half only: tiles no query of a tile sees are skipped). Values are read in place;
// keys too for a single query tile (TileOps::scores_rows), while a read of several query tiles
// packs each key tile once where the kernels score from a packed copy (packs_keys_v,
// tile_ops.hpp).
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
#include "ovq/kernels/read_contract.hpp"
#include "ovq/kernels/tile_stream.hpp"

namespace ovq::kernels {

namespace read_detail {

// Stacked query rows per tile: 64 rows of scores (16 KiB in float) and of the output
// accumulator stay in L1/L2 while the key tiles stream past.
inline constexpr Index kStackedRows = 64;
using kernels::kBlockKeys;

// The key axis of one read (the contract's geometry) with the rows behind its slots.
template <class Element>
struct KeyAxis : KeyAxisGeometry {
  MemoryRows<Element> memory;
  LocalRows<Element> local;  // only the rows some query can see
  // Set for a decode over a long memory with enough arithmetic per byte (kPrefetchMinRows):
  // such a step reads every memory row once, from L3 or DRAM, and the hardware prefetcher alone
  // lets the stream stall while a tile is computed. Each tile asks for the next tile's memory
  // rows, paced over its own arithmetic (TileStream).
  bool prefetch = false;

  const Element* key(Index slot) const {
    if (slot < pad || slot >= end()) return nullptr;
    return slot < local_begin() ? memory.keys.row(slot - pad) : local.keys.row(slot - local_begin());
  }
  const Element* value(Index slot) const {
    if (slot < pad || slot >= end()) return nullptr;
    return slot < local_begin() ? memory.values.row(slot - pad)
                                : local.values.row(slot - local_begin());
  }
};

// The key rows of tile `tile` (slots [tile kTile, tile kTile + kTile)). A slot past either end
// holds no key: it gets another key of the tile, whose score no query sees (the mask sets it to
// -inf), so the micro-kernel never branches. A visited tile always holds a key.
template <class Element, Index kTile>
void tile_keys(const KeyAxis<Element>& axis, Index tile, const Element* keys[kTile]) {
  const Index k0 = tile * kTile;
  if (k0 >= axis.memory_begin() && k0 + kTile <= axis.local_begin()) {  // memory rows only
    const Element* first = axis.memory.keys.row(k0 - axis.pad);
    for (Index j = 0; j < kTile; ++j) keys[j] = first + j * axis.memory.keys.stride;
    return;
  }
  const Element* any = nullptr;
  for (Index j = 0; j < kTile; ++j) {
    keys[j] = axis.key(k0 + j);
    if (any == nullptr) any = keys[j];
  }
  for (Index j = 0; j < kTile; ++j)
    if (keys[j] == nullptr) keys[j] = any;
}

// The value rows of the same slots, for micro-kernels that take the whole tile at once
// (TileOps::kPairedValues); an empty slot gets another value row of the tile (its weight is 0).
template <class Element, Index kTile>
void tile_values(const KeyAxis<Element>& axis, Index tile, const Element* values[kTile]) {
  const Element* any = nullptr;
  for (Index j = 0; j < kTile; ++j) {
    values[j] = axis.value(tile * kTile + j);
    if (any == nullptr) any = values[j];
  }
  for (Index j = 0; j < kTile; ++j)
    if (values[j] == nullptr) values[j] = any;
}

// Per-thread tile state. Query: what the micro-kernels take the stacked queries in
// (TileOps::Query; a 16-bit query is widened here once instead of once per key).
template <class Element, class Query>
struct TileBuffers {
  using Compute = compute_t<Element>;
  AlignedVector<Query> q;
  AlignedVector<Compute> scores, acc;
  // The softmax passes' per-row values; row_keep: the factor of each row's running average
  // (Ops::accumulate applies it as it loads the row; kernels of paired values take a pass).
  AlignedVector<Compute> row_max, row_sum, row_keep;
  std::vector<SoftmaxStats<Compute>> stats;
  TileStream<Element> stream;

  TileBuffers(Index rows, Index dk, Index dv, Index key_tile)
      : q(static_cast<std::size_t>(rows * dk)),
        scores(static_cast<std::size_t>(rows * key_tile)),
        acc(static_cast<std::size_t>(rows * dv)),
        row_max(static_cast<std::size_t>(rows)),
        row_sum(static_cast<std::size_t>(rows)),
        row_keep(static_cast<std::size_t>(rows)),
        stats(static_cast<std::size_t>(rows)) {}

  void clear_state(Index rows, Index dv) {
    std::fill(acc.begin(), acc.begin() + rows * dv, Compute(0));
    std::fill(stats.begin(), stats.begin() + rows, SoftmaxStats<Compute>{});
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
// packed: the tile's keys packed by Ops::pack_keys, or null; packed_values: its values packed by
// Ops::pack_values, or null.
template <class Element, class Ops, class Pacing>
void fold_key_tile(const KeyAxis<Element>& axis, Index tile, Index p0, Index heads, Index bq,
                   Index dk, Index dv, compute_t<Element> beta,
                   TileBuffers<Element, typename Ops::Query>& buf, Pacing pacing,
                   const packed_word_t<Ops>* packed, const packed_word_t<Ops>* packed_values) {
  using Compute = compute_t<Element>;
  constexpr bool kStream = std::is_same_v<Pacing, StreamPacing<Element>>;
  constexpr Index kTile = Ops::kKeyTile;
  constexpr Compute kNegInf = -std::numeric_limits<Compute>::infinity();
  const Index k0 = tile * kTile;
  const Index mem_lo = std::max(k0, axis.memory_begin()) - k0;  // memory slots of the tile
  const Index mem_hi = std::max(std::min(k0 + kTile, axis.local_begin()) - k0, mem_lo);
  Compute* s = buf.scores.data();
  const Element* keys[kTile];
  tile_keys<Element, kTile>(axis, tile, keys);
  if constexpr (kStream) {  // the next tile's memory rows, over this tile's score and P V flops
    const Index next_lo = std::max(k0 + kTile, axis.memory_begin()) - axis.pad;
    const Index next_hi =
        std::max(std::min(k0 + 2 * kTile, axis.local_begin()) - axis.pad, next_lo);
    pacing.stream->start(axis.memory, next_lo, next_hi,
                         2 * bq * (kTile * dk + (mem_hi - mem_lo) * dv));
  }
  bool scored = false;
  if constexpr (packs_keys_v<Ops>) {
    if (packed != nullptr) {
      Ops::scores_rows_packed(buf.q.data(), dk, bq, keys, packed, dk, beta, s, pacing);
      scored = true;
    }
  }
  if (!scored) Ops::scores_rows(buf.q.data(), dk, bq, keys, dk, beta, s, pacing);
  // The softmax of the tile in three passes over its rows, each row's steps in order: a row's
  // steps form one long dependency chain (maximum, exponentials, sums), and rows are
  // independent, so a pass lets the processor overlap the chains of several rows.
  Compute* const row_max = buf.row_max.data();
  Compute* const row_sum = buf.row_sum.data();
  Compute* const row_keep = buf.row_keep.data();
  for (Index r = 0; r < bq; ++r) {  // masked maximum (bias added)
    Compute* row = s + r * kTile;
    const Index p = p0 + r / heads;
    const Index lo = std::clamp<Index>(axis.first(p) - k0, 0, kTile);
    const Index hi = std::clamp<Index>(axis.last(p) - k0 + 1, lo, kTile);  // exclusive
    if (axis.memory.bias != nullptr)
      for (Index j = std::max(lo, mem_lo); j < std::min(hi, mem_hi); ++j)
        row[j] += axis.memory.bias[k0 + j - axis.pad];
    row_max[r] = std::max(buf.stats[static_cast<std::size_t>(r)].m, Ops::mask_max(row, lo, hi));
  }
  for (Index r = 0; r < bq; ++r)  // exponentials against the new maximum, and their sum
    if (row_max[r] != kNegInf) row_sum[r] = Ops::exp_sum(s + r * kTile, row_max[r]);
  for (Index r = 0; r < bq; ++r) {  // the running average and its weights
    Compute* row = s + r * kTile;
    SoftmaxStats<Compute>& st = buf.stats[static_cast<std::size_t>(r)];
    const Compute m_new = row_max[r];
    row_keep[r] = Compute(1);
    if (m_new == kNegInf) {  // nothing visible so far: this tile adds nothing to row r
      std::fill(row, row + kTile, Compute(0));
      continue;
    }
    // New average = old average * (l_old rescaled / l_new) + (P / l_new) V.
    const Compute l_kept = st.m == m_new ? st.l : st.l * std::exp(st.m - m_new);
    const Compute l_new = l_kept + row_sum[r];
    const Compute keep = l_kept / l_new;
    if (keep == Compute(0)) {
      // The old rows vanish next to the new maximum. Assigned, not multiplied, so that an
      // average that rounded past the largest finite value (inf) leaves no 0 * inf.
      Compute* acc = buf.acc.data() + r * dv;
      std::fill(acc, acc + dv, Compute(0));
    } else {
      row_keep[r] = keep;
    }
    Ops::scale(row, kTile, Compute(1) / l_new);
    st.l = l_new;
    st.m = m_new;
  }
  if constexpr (Ops::kPairedValues) {  // P V over the whole tile at once, in slot pairs
    for (Index r = 0; r < bq; ++r)  // the running averages, in a pass of their own
      if (row_keep[r] != Compute(1)) Ops::scale(buf.acc.data() + r * dv, dv, row_keep[r]);
    bool accumulated = false;
    if constexpr (packs_values_v<Ops>) {
      if (packed_values != nullptr) {
        Ops::accumulate_tile_packed(s, bq, packed_values, dv, buf.acc.data(), dv, pacing);
        accumulated = true;
      }
    }
    if (!accumulated) {
      const Element* values[kTile];
      tile_values<Element, kTile>(axis, tile, values);
      Ops::accumulate_tile(s, bq, values, dv, buf.acc.data(), dv, pacing);
    }
    if constexpr (kStream) pacing.stream->finish();
    return;
  }
  // P V over the tile's memory slots, then its local slots (values live in two arrays; one
  // pass over j either way, so the split changes no sum). The first call that runs (a visited
  // tile holds a key, so one does) rescales the running averages as it loads them (row_keep).
  const Compute* keep = row_keep;
  if (mem_hi > mem_lo) {
    Ops::accumulate(s + mem_lo, bq, mem_hi - mem_lo, axis.memory.values.row(k0 + mem_lo - axis.pad),
                    axis.memory.values.stride, dv, buf.acc.data(), dv, pacing, keep);
    keep = nullptr;
  }
  if constexpr (kStream) pacing.stream->finish();
  const Index loc_lo = std::max(k0, axis.local_begin()) - k0;
  const Index loc_hi = std::max(std::min(k0 + kTile, axis.end()) - k0, loc_lo);
  if (loc_hi > loc_lo)
    Ops::accumulate(s + loc_lo, bq, loc_hi - loc_lo,
                    axis.local.values.row(k0 + loc_lo - axis.local_begin()),
                    axis.local.values.stride, dv, buf.acc.data(), dv, NoPacing{}, keep);
}

// One read, as the steps of the tile loop: query tile t holds positions
// [t P, t P + P) (P = positions_per_tile) of every head, stacked; each tile folds its visible
// key tiles block by block and stores its rows. run() chooses how the tiles are shared out.
template <class Element, class Arch>
class TileReader {
 public:
  using Ops = TileOps<Element, Arch>;
  static constexpr Index kTile = Ops::kKeyTile;
  static constexpr Index kTilesPerBlock = kBlockKeys / kTile;
  static_assert(kBlockKeys % kTile == 0, "merge blocks hold whole key tiles");
  using Buffers = TileBuffers<Element, typename Ops::Query>;
  using Compute = compute_t<Element>;

  TileReader(const ConstRowsView<Element>* q, Index heads, const MemoryRows<Element>& memory,
             const LocalRows<Element>& local, const ReadMask& mask, Compute beta,
             const RowsView<Element>* o, Compute* const* lse)
      : q_(q), o_(o), lse_(lse), heads_(heads), n_pos_(q[0].rows), dk_(q[0].cols), dv_(o[0].cols),
        query_offset_(mask.query_offset), beta_(beta) {
    static_cast<KeyAxisGeometry&>(axis_) =
        key_axis_geometry(memory.origin, memory.keys.rows, local.keys.rows, mask, n_pos_);
    axis_.memory = memory;
    axis_.local = {local.keys.middle_rows(0, axis_.local_rows),
                   local.values.middle_rows(0, axis_.local_rows)};
    positions_per_tile_ = std::max<Index>(1, kStackedRows / heads);
    n_tiles_ = (n_pos_ + positions_per_tile_ - 1) / positions_per_tile_;
    // Buffers sized for the rows a tile really holds: a decode step stacks `heads` rows, not 64.
    tile_rows_ = std::min(positions_per_tile_, n_pos_) * heads;
    axis_.prefetch = tile_rows_ >= kPrefetchMinRows<Element> &&
                     tile_rows_ <= kPrefetchMaxRows &&
                     static_cast<double>(memory.keys.rows) * static_cast<double>(dk_ + dv_) *
                             sizeof(Element) >= kPrefetchMinBytes;
    if (n_tiles_ > 1 && axis_.end() > axis_.pad) pack_tiles();
  }

  void run() const {
#if defined(OVQ_HAS_OPENMP)
    if (detail::worth_parallel(work_flops())) {
      if (n_tiles_ > 1) return read_tiles_parallel();
      if (decode_blocks() > 1) return read_blocks_parallel();
    }
#endif
    read_serial();
  }

 private:
  // The read's flops, for the choice to run it on several threads.
  double work_flops() const {
    return 2.0 * static_cast<double>(n_pos_ * heads_) * static_cast<double>(axis_.end() - axis_.pad) *
           static_cast<double>(dk_ + dv_);
  }

  // Every key tile's keys (Ops::pack_keys) and values (Ops::pack_values) packed once, where the
  // kernels pack them.
  void pack_tiles() {
    if constexpr (packs_keys_v<Ops>) {
      if (Ops::packs_keys()) {
        packed_words_ = Ops::packed_key_words(dk_);
        pack_each_tile(packed_keys_, packed_words_, [&](Index t, packed_word_t<Ops>* out) {
          const Element* keys[kTile];
          tile_keys<Element, kTile>(axis_, t, keys);
          Ops::pack_keys(keys, dk_, out);
        });
      }
    }
    if constexpr (packs_values_v<Ops>) {
      if (Ops::packs_values()) {
        packed_value_words_ = Ops::packed_value_words(dv_);
        pack_each_tile(packed_values_, packed_value_words_, [&](Index t, packed_word_t<Ops>* out) {
          const Element* values[kTile];
          tile_values<Element, kTile>(axis_, t, values);
          Ops::pack_values(values, dv_, out);
        });
      }
    }
  }

  // `words` words a tile in `out`, tile t's written by pack(t, its words), on the threads the
  // read will run on.
  template <class Pack>
  void pack_each_tile(AlignedVector<packed_word_t<Ops>>& out, Index words, const Pack& pack) {
    const Index tiles = (axis_.end() + kTile - 1) / kTile;
    out.resize(static_cast<std::size_t>(tiles * words));
    const Index first = axis_.pad / kTile;
#if defined(OVQ_HAS_OPENMP)
    if (detail::worth_parallel(work_flops())) {
#pragma omp parallel for schedule(static)
      for (Index t = first; t < tiles; ++t) pack(t, out.data() + t * words);
      return;
    }
#endif
    for (Index t = first; t < tiles; ++t) pack(t, out.data() + t * words);
  }

  // Stacked rows of query tile `tile`.
  Index tile_rows(Index tile) const {
    return std::min(positions_per_tile_, n_pos_ - tile * positions_per_tile_) * heads_;
  }
  Index tile_position(Index tile) const { return query_offset_ + tile * positions_per_tile_; }

  // Key tiles that query tile `tile` visits: tiles no row of it sees are skipped whole (that is
  // where causal and windowed reads save their masked part).
  SlotRange key_tiles(Index tile) const {
    const Index p0 = tile_position(tile);
    const SlotRange slots = axis_.visible(p0, p0 + tile_rows(tile) / heads_ - 1);
    if (slots.empty()) return {};
    return {slots.first / kTile, slots.last / kTile};
  }

  // Merge blocks of a single query tile (a decode step), for splitting them across threads.
  Index decode_blocks() const {
    const SlotRange range = key_tiles(0);
    if (n_tiles_ != 1 || range.empty()) return 0;
    return range.last / kTilesPerBlock - range.first / kTilesPerBlock + 1;
  }

  void load_queries(Index tile, Buffers& buf) const {
    const Index i0 = tile * positions_per_tile_;
    const Index np = tile_rows(tile) / heads_;
    for (Index i = 0; i < np; ++i)
      for (Index h = 0; h < heads_; ++h)
        copy_query(q_[h].row(i0 + i), dk_, buf.q.data() + (i * heads_ + h) * dk_);
  }

  // Folds key tiles [first, last] (all in one merge block) into buf, from an empty state.
  void fold_block(Index tile, Index first, Index last, Buffers& buf) const {
    const Index bq = tile_rows(tile);
    buf.clear_state(bq, dv_);
    const Index p0 = tile_position(tile);
    [[maybe_unused]] const TileSession<Ops> session;
    for (Index t = first; t <= last; ++t) {
      const packed_word_t<Ops>* packed =
          packed_keys_.empty() ? nullptr : packed_keys_.data() + t * packed_words_;
      const packed_word_t<Ops>* packed_values =
          packed_values_.empty() ? nullptr : packed_values_.data() + t * packed_value_words_;
      if (axis_.prefetch) {
        fold_key_tile<Element, Ops>(axis_, t, p0, heads_, bq, dk_, dv_, beta_, buf,
                                   StreamPacing<Element>{&buf.stream}, packed, packed_values);
      } else {
        fold_key_tile<Element, Ops>(axis_, t, p0, heads_, bq, dk_, dv_, beta_, buf, NoPacing{},
                                   packed, packed_values);
      }
    }
  }

  void merge_rows(Index bq, Compute* acc, SoftmaxStats<Compute>* stats, const Compute* acc_b,
                  const SoftmaxStats<Compute>* stats_b) const {
    for (Index r = 0; r < bq; ++r)
      merge_softmax(acc + r * dv_, stats[r], acc_b + r * dv_, stats_b[r], dv_);
  }

  // The whole read of one query tile: its merge blocks in order, each folded from scratch and
  // merged into the first.
  void read_tile(Index tile, Buffers& buf, Buffers& part) const {
    load_queries(tile, buf);
    const Index bq = tile_rows(tile);
    const SlotRange range = key_tiles(tile);
    if (range.empty()) {
      buf.clear_state(bq, dv_);
      return;
    }
    for (Index b = range.first / kTilesPerBlock; b <= range.last / kTilesPerBlock; ++b) {
      const Index first = std::max(range.first, b * kTilesPerBlock);
      const Index last = std::min(range.last, b * kTilesPerBlock + kTilesPerBlock - 1);
      if (b == range.first / kTilesPerBlock) {
        fold_block(tile, first, last, buf);
      } else {
        std::copy(buf.q.begin(), buf.q.begin() + bq * dk_, part.q.begin());
        fold_block(tile, first, last, part);
        merge_rows(bq, buf.acc.data(), buf.stats.data(), part.acc.data(), part.stats.data());
      }
    }
  }

  void store(Index tile, const Compute* acc_rows, const SoftmaxStats<Compute>* stats) const {
    const Index i0 = tile * positions_per_tile_;
    const Index np = tile_rows(tile) / heads_;
    // The accumulator already is the average (zero when no row was visible). An average of
    // values never exceeds the largest of them; only rounding can push one near the largest
    // finite element past it, so that is clamped back (then rounded to the element).
    const Compute kMaxValue = largest_finite<Element>();
    for (Index i = 0; i < np; ++i) {
      for (Index h = 0; h < heads_; ++h) {
        const Compute* acc = acc_rows + (i * heads_ + h) * dv_;
        Element* out = o_[h].row(i0 + i);
        for (Index c = 0; c < dv_; ++c)
          out[c] = narrow<Element>(std::clamp(acc[c], -kMaxValue, kMaxValue));
      }
    }
    if (lse_ == nullptr) return;
    // log sum_j exp(s_ij) = m + log l; -inf for a query that saw no row (l = 0).
    for (Index i = 0; i < np; ++i) {
      for (Index h = 0; h < heads_; ++h) {
        const SoftmaxStats<Compute>& st = stats[i * heads_ + h];
        lse_[h][i0 + i] = st.empty() ? -std::numeric_limits<Compute>::infinity()
                                     : st.m + std::log(st.l);
      }
    }
  }

  void read_serial() const {
    Buffers buf(tile_rows_, dk_, dv_, kTile), part(tile_rows_, dk_, dv_, kTile);
    for (Index t = 0; t < n_tiles_; ++t) {
      read_tile(t, buf, part);
      store(t, buf.acc.data(), buf.stats.data());
    }
  }

#if defined(OVQ_HAS_OPENMP)
  // Prefill: query tiles in parallel.
  void read_tiles_parallel() const {
#pragma omp parallel
    {
      Buffers buf(tile_rows_, dk_, dv_, kTile), part(tile_rows_, dk_, dv_, kTile);
#pragma omp for schedule(dynamic, 1)
      for (Index t = 0; t < n_tiles_; ++t) {
        read_tile(t, buf, part);
        store(t, buf.acc.data(), buf.stats.data());
      }
    }
  }

  // Decode (one query tile over a long memory): merge blocks in parallel, each from scratch,
  // then merged in order on this thread, exactly as read_tile merges them.
  void read_blocks_parallel() const {
    const Index blocks = decode_blocks();
    const SlotRange range = key_tiles(0);
    const Index bq = tile_rows(0);
    const Index b0 = range.first / kTilesPerBlock;
    AlignedVector<Compute> block_acc(static_cast<std::size_t>(blocks * bq * dv_));
    std::vector<SoftmaxStats<Compute>> block_stats(static_cast<std::size_t>(blocks * bq));
#pragma omp parallel
    {
      Buffers buf(tile_rows_, dk_, dv_, kTile);
      load_queries(0, buf);
#pragma omp for schedule(static)
      for (Index b = 0; b < blocks; ++b) {
        const Index first = std::max(range.first, (b0 + b) * kTilesPerBlock);
        const Index last = std::min(range.last, (b0 + b + 1) * kTilesPerBlock - 1);
        fold_block(0, first, last, buf);
        std::copy(buf.acc.begin(), buf.acc.begin() + bq * dv_, block_acc.begin() + b * bq * dv_);
        std::copy(buf.stats.begin(), buf.stats.begin() + bq, block_stats.begin() + b * bq);
      }
    }
    for (Index b = 1; b < blocks; ++b)
      merge_rows(bq, block_acc.data(), block_stats.data(), block_acc.data() + b * bq * dv_,
                 block_stats.data() + b * bq);
    store(0, block_acc.data(), block_stats.data());
  }
#endif

  const ConstRowsView<Element>* q_;
  const RowsView<Element>* o_;
  Compute* const* lse_;  // null, or per head one log-sum-exp per query
  Index heads_, n_pos_, dk_, dv_, query_offset_;
  Compute beta_;
  KeyAxis<Element> axis_;
  Index positions_per_tile_ = 1, n_tiles_ = 0, tile_rows_ = 0;
  AlignedVector<packed_word_t<Ops>> packed_keys_;    // Ops::pack_keys of every tile, or empty
  AlignedVector<packed_word_t<Ops>> packed_values_;  // Ops::pack_values of every tile, or empty
  Index packed_words_ = 0, packed_value_words_ = 0;  // words per packed tile
};

}  // namespace read_detail

// The read of the contract on the CPU. q and o hold `heads` views each; lse, when not null,
// `heads` pointers to q[0].rows entries each: every query's log-sum-exp of the logits it saw
// (bias included; -inf where it saw none), what merging partial reads needs.
template <class Element, class Arch = arch::native>
void read(const ConstRowsView<Element>* q, Index heads, const MemoryRows<Element>& memory,
          const LocalRows<Element>& local, const ReadMask& mask, compute_t<Element> beta,
          const RowsView<Element>* o, compute_t<Element>* const* lse = nullptr) {
  if (heads <= 0 || q[0].rows == 0) return;
  read_detail::TileReader<Element, Arch>(q, heads, memory, local, mask, beta, o, lse).run();
}

// One query head.
template <class Element, class Arch = arch::native>
void read(ConstRowsView<Element> q, const MemoryRows<Element>& memory,
          const LocalRows<Element>& local, const ReadMask& mask, compute_t<Element> beta,
          RowsView<Element> o) {
  read<Element, Arch>(&q, 1, memory, local, mask, beta, &o);
}

}  // namespace ovq::kernels
