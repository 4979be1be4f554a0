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
// Grouped queries: `heads` query heads that read the same memory are stacked into one tile
// (row (i, h) at position i), so every key/value tile is loaded once for the whole group.
//
// Shapes: q[h] (Tq x dk), Km (Nm x dk), Vm (Nm x dv), bias (Nm), Kl (Nl x dk), Vl (Nl x dv),
// o[h] (Tq x dv). Cost: 2 heads Tq (Nm' + Nl') (dk + dv) flops, Nm' and Nl' the visible rows
// (the causal half only: tiles no query of a tile sees are skipped), plus O((Nm + Nl) dk) to pack
// the keys when there are enough queries to reuse them.
#include <algorithm>
#include <cmath>
#include <limits>
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
// Below this many stacked query rows, packing K^T would cost as much as the reads it serves.
inline constexpr Index kPackMinRows = 8;

// K (n x d) -> panels of kTile keys, each d x kTile (key index fastest), zero-padded.
template <class Scalar, Index kTile>
void pack_key_panels(ConstRowsView<Scalar> keys, std::vector<Scalar>& panels) {
  const Index tiles = (keys.rows + kTile - 1) / kTile;
  const Index d = keys.cols;
  panels.assign(static_cast<std::size_t>(tiles * d * kTile), Scalar(0));
  for (Index t = 0; t < tiles; ++t) {
    Scalar* panel = panels.data() + t * d * kTile;
    const Index bk = std::min(kTile, keys.rows - t * kTile);
    for (Index j = 0; j < bk; ++j) {
      const Scalar* row = keys.row(t * kTile + j);
      for (Index k = 0; k < d; ++k) panel[k * kTile + j] = row[k];
    }
  }
}

// A block of keys with its values, bias and visible range per query position.
template <class Scalar>
struct KeyBlock {
  ConstRowsView<Scalar> keys, values;
  const Scalar* bias;
  const Scalar* panels;  // packed keys, or nullptr
  Index first_offset;    // first visible row of position p is p + first_offset (window), or 0
  bool windowed;
  Index last_offset;     // last visible row of position p is p + last_offset (causal), or n - 1
  bool causal;

  Index first(Index p) const { return windowed ? std::max<Index>(p + first_offset, 0) : 0; }
  Index last(Index p) const {
    return causal ? std::min<Index>(p + last_offset, keys.rows - 1) : keys.rows - 1;
  }
};

// Per-thread tile state.
template <class Scalar>
struct TileBuffers {
  std::vector<Scalar> q, scores, acc;
  std::vector<SoftmaxStats<Scalar>> stats;

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

// Folds key rows [k0, k0 + bk) of `block` into the tile of stacked rows [0, bq); stacked row r
// is at position p0 + r / heads. Cost: 2 bq bk (dk + dv) flops + bq bk exps.
//
// Logits are saturated to the finite range (an overflowing product of finite inputs, or the
// NaN of inf - inf inside one, becomes +-max), and the accumulator holds the softmax average so
// far, not the sum: outputs are finite for every finite input.
template <class Scalar, class Ops>
void fold_key_tile(const KeyBlock<Scalar>& block, Index k0, Index p0, Index heads, Index bq,
                   Index dk, Index dv, Scalar beta, TileBuffers<Scalar>& buf) {
  constexpr Index kTile = Ops::kKeyTile;
  constexpr Scalar kNegInf = -std::numeric_limits<Scalar>::infinity();
  constexpr Scalar kMax = std::numeric_limits<Scalar>::max();
  const Index bk = std::min(kTile, block.keys.rows - k0);
  Scalar* s = buf.scores.data();
  if (block.panels != nullptr) {
    Ops::scores_packed(buf.q.data(), dk, bq, block.panels + (k0 / kTile) * dk * kTile, dk, beta,
                       s);
  } else {
    Ops::scores_rows(buf.q.data(), dk, bq, block.keys.row(k0), block.keys.stride, bk, dk, beta,
                     s);
  }
  for (Index r = 0; r < bq; ++r) {
    Scalar* row = s + r * kTile;
    const Index p = p0 + r / heads;
    const Index lo = std::clamp<Index>(block.first(p) - k0, 0, bk);
    const Index hi = std::clamp<Index>(block.last(p) - k0 + 1, lo, bk);  // exclusive
    std::fill(row, row + lo, kNegInf);
    std::fill(row + hi, row + bk, kNegInf);
    if (block.bias != nullptr)
      for (Index j = lo; j < hi; ++j) row[j] += block.bias[k0 + j];
    Scalar tile_max = kNegInf;
    for (Index j = lo; j < hi; ++j) {
      Scalar x = row[j];
      if (!(x >= -kMax)) x = -kMax;  // -inf from overflow, or NaN
      if (x > kMax) x = kMax;
      row[j] = x;
      tile_max = std::max(tile_max, x);
    }
    SoftmaxStats<Scalar>& st = buf.stats[static_cast<std::size_t>(r)];
    const Scalar m_new = std::max(st.m, tile_max);
    if (m_new == kNegInf) {  // nothing visible so far: this tile adds nothing to row r
      std::fill(row, row + bk, Scalar(0));
      continue;
    }
    const Scalar sum = Ops::exp_sum(row, bk, m_new);
    // New average = old average * (l_old rescaled / l_new) + (P / l_new) V.
    const Scalar l_kept = st.m == m_new ? st.l : st.l * std::exp(st.m - m_new);
    const Scalar l_new = l_kept + sum;
    const Scalar keep = l_kept / l_new;
    const Scalar inv = Scalar(1) / l_new;
    if (keep != Scalar(1)) {
      Scalar* acc = buf.acc.data() + r * dv;
      for (Index c = 0; c < dv; ++c) acc[c] *= keep;
    }
    for (Index j = 0; j < bk; ++j) row[j] *= inv;
    st.l = l_new;
    st.m = m_new;
  }
  Ops::accumulate(s, bq, bk, block.values.row(k0), block.values.stride, dv, buf.acc.data(), dv);
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
  if (heads <= 0) return;
  const Index n_pos = q[0].rows;
  const Index dk = q[0].cols;
  const Index dv = o[0].cols;
  const Index n_memory = memory.keys.rows;
  const Index n_local = local.keys.rows;
  const Index window = mask.causal ? mask.window : 0;
  if (n_pos == 0) return;

  // Key blocks in position terms: memory row r is at r - Nm, local row j at j, query i at
  // query_offset + i; "p" below is the query's local position.
  KeyBlock<Scalar> mem{memory.keys, memory.values, memory.bias, nullptr,
                       n_memory - window + 1, window > 0, 0, false};
  KeyBlock<Scalar> loc{local.keys, local.values, nullptr, nullptr,
                       -window + 1, window > 0, 0, mask.causal};

  const Index positions_per_tile = std::max<Index>(1, kStackedRows / heads);
  const Index stacked = n_pos * heads;
  const Index last_position = mask.query_offset + n_pos - 1;
  const Index local_used = mask.causal ? std::min(n_local, last_position + 1) : n_local;
  thread_local std::vector<Scalar> mem_panels, loc_panels;
  if (stacked >= kPackMinRows) {
    pack_key_panels<Scalar, kTile>(memory.keys, mem_panels);
    pack_key_panels<Scalar, kTile>(local.keys.middle_rows(0, local_used), loc_panels);
    mem.panels = mem_panels.data();
    loc.panels = loc_panels.data();
  }

  const Index n_tiles = (n_pos + positions_per_tile - 1) / positions_per_tile;
  const Index tile_rows = positions_per_tile * heads;

  // The key tiles query tile `tile` must visit, memory first. Tiles no row of the query tile
  // sees are skipped whole: that is where causal and windowed reads save their masked part.
  struct KeyTile {
    const KeyBlock<Scalar>* block;
    Index k0;
  };
  auto key_tiles = [&](Index tile, std::vector<KeyTile>& out) {
    out.clear();
    const Index i0 = tile * positions_per_tile;
    const Index np = std::min(positions_per_tile, n_pos - i0);
    const Index p0 = mask.query_offset + i0;
    for (Index k0 = (mem.first(p0) / kTile) * kTile; k0 < n_memory; k0 += kTile)
      out.push_back({&mem, k0});
    const Index loc_end = loc.last(p0 + np - 1) + 1;
    for (Index k0 = (loc.first(p0) / kTile) * kTile; k0 < loc_end; k0 += kTile)
      out.push_back({&loc, k0});
  };
  auto load_queries = [&](Index tile, TileBuffers<Scalar>& buf) {
    const Index i0 = tile * positions_per_tile;
    const Index np = std::min(positions_per_tile, n_pos - i0);
    for (Index i = 0; i < np; ++i)
      for (Index h = 0; h < heads; ++h)
        std::copy(q[h].row(i0 + i), q[h].row(i0 + i) + dk, buf.q.data() + (i * heads + h) * dk);
    buf.clear_state(np * heads, dv);
  };
  auto fold = [&](Index tile, const KeyTile* first, const KeyTile* last, TileBuffers<Scalar>& buf) {
    const Index i0 = tile * positions_per_tile;
    const Index bq = std::min(positions_per_tile, n_pos - i0) * heads;
    for (const KeyTile* kt = first; kt != last; ++kt)
      fold_key_tile<Scalar, Ops>(*kt->block, kt->k0, mask.query_offset + i0, heads, bq, dk, dv,
                                 beta, buf);
  };
  auto store = [&](Index tile, const TileBuffers<Scalar>& buf) {
    const Index i0 = tile * positions_per_tile;
    const Index np = std::min(positions_per_tile, n_pos - i0);
    for (Index i = 0; i < np; ++i) {
      for (Index h = 0; h < heads; ++h) {
        const Index r = i * heads + h;
        // The accumulator already is the average (zero when no row was visible). An average of
        // values never exceeds the largest of them; only rounding can push one near the largest
        // finite scalar past it, so that is clamped back.
        constexpr Scalar kMaxValue = std::numeric_limits<Scalar>::max();
        const Scalar* acc = buf.acc.data() + r * dv;
        Scalar* out = o[h].row(i0 + i);
        for (Index c = 0; c < dv; ++c) out[c] = std::clamp(acc[c], -kMaxValue, kMaxValue);
      }
    }
  };

#if defined(OVQ_HAS_OPENMP)
  const double work = 2.0 * static_cast<double>(stacked) *
                      static_cast<double>(n_memory + local_used) * static_cast<double>(dk + dv);
  if (detail::worth_parallel(work)) {
    if (n_tiles > 1) {
      // Prefill: query tiles in parallel.
#pragma omp parallel
      {
        TileBuffers<Scalar> buf(tile_rows, dk, dv, kTile);
        std::vector<KeyTile> tiles;
#pragma omp for schedule(dynamic, 1)
        for (Index t = 0; t < n_tiles; ++t) {
          key_tiles(t, tiles);
          load_queries(t, buf);
          fold(t, tiles.data(), tiles.data() + tiles.size(), buf);
          store(t, buf);
        }
      }
      return;
    }
    // Decode (one query tile over a long memory): split the key tiles across threads, each
    // keeping its own (o, m, l), then merge them.
    std::vector<KeyTile> tiles;
    key_tiles(0, tiles);
    const Index n_key_tiles = static_cast<Index>(tiles.size());
    const int threads = static_cast<int>(std::min<Index>(omp_get_max_threads(), n_key_tiles));
    if (threads > 1) {
      std::vector<TileBuffers<Scalar>> parts;
      parts.reserve(static_cast<std::size_t>(threads));
      for (int t = 0; t < threads; ++t) parts.emplace_back(tile_rows, dk, dv, kTile);
#pragma omp parallel for num_threads(threads) schedule(static, 1)
      for (int t = 0; t < threads; ++t) {
        const Index begin = n_key_tiles * t / threads;
        const Index end = n_key_tiles * (t + 1) / threads;
        load_queries(0, parts[static_cast<std::size_t>(t)]);
        fold(0, tiles.data() + begin, tiles.data() + end, parts[static_cast<std::size_t>(t)]);
      }
      const Index bq = std::min(positions_per_tile, n_pos) * heads;
      for (int t = 1; t < threads; ++t)
        for (Index r = 0; r < bq; ++r)
          merge_softmax(parts[0].acc.data() + r * dv, parts[0].stats[static_cast<std::size_t>(r)],
                        parts[static_cast<std::size_t>(t)].acc.data() + r * dv,
                        parts[static_cast<std::size_t>(t)].stats[static_cast<std::size_t>(r)], dv);
      store(0, parts[0]);
      return;
    }
  }
#endif
  TileBuffers<Scalar> buf(tile_rows, dk, dv, kTile);
  std::vector<KeyTile> tiles;
  for (Index t = 0; t < n_tiles; ++t) {
    key_tiles(t, tiles);
    load_queries(t, buf);
    fold(t, tiles.data(), tiles.data() + tiles.size(), buf);
    store(t, buf);
  }
}

// One query head.
template <class Scalar, class Arch = arch::native>
void read(ConstRowsView<Scalar> q, const MemoryRows<Scalar>& memory, const LocalRows<Scalar>& local,
          const ReadMask& mask, Scalar beta, RowsView<Scalar> o) {
  read<Scalar, Arch>(&q, 1, memory, local, mask, beta, &o);
}

}  // namespace ovq::kernels
