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
// Shapes: q (Tq x dk), Km (Nm x dk), Vm (Nm x dv), bias (Nm), Kl (Nl x dk), Vl (Nl x dv),
// o (Tq x dv). Cost: 2 Tq (Nm' + Nl') (dk + dv) flops, Nm' and Nl' the visible rows, and
// O(tile (dk + dv)) extra memory.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "ovq/core/online_softmax.hpp"
#include "ovq/core/types.hpp"

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

namespace detail {

inline constexpr Index kReadQueryTile = 32;
inline constexpr Index kReadKeyTile = 128;

template <class Scalar>
struct ReadTileBuffers {
  RowMatrix<Scalar> scores;  // query tile x key tile
  RowMatrix<Scalar> acc;     // query tile x dv, unnormalised output
  std::vector<SoftmaxStats<Scalar>> stats;

  ReadTileBuffers(Index dv)
      : scores(kReadQueryTile, kReadKeyTile), acc(kReadQueryTile, dv), stats(kReadQueryTile) {}
};

// Folds key rows [k0, k0 + bk) of (keys, values, bias) into the tile state of queries
// [q0, q0 + bq). Row i sees key r iff first_visible(i) <= r <= last_visible(i).
template <class Scalar, class First, class Last>
void fold_key_tile(ConstRowsView<Scalar> q, Index q0, Index bq, ConstRowsView<Scalar> keys,
                   ConstRowsView<Scalar> values, const Scalar* bias, Index k0, Index bk,
                   Scalar beta, First first_visible, Last last_visible,
                   ReadTileBuffers<Scalar>& buf) {
  constexpr Scalar kNegInf = -std::numeric_limits<Scalar>::infinity();
  auto s = buf.scores.topLeftCorner(bq, bk);
  s.noalias() = beta * (as_eigen(q.middle_rows(q0, bq)) *
                        as_eigen(keys.middle_rows(k0, bk)).transpose());
  for (Index i = 0; i < bq; ++i) {
    Scalar* row = &s(i, 0);
    const Index lo = std::max<Index>(first_visible(q0 + i) - k0, 0);
    const Index hi = std::min<Index>(last_visible(q0 + i) - k0, bk - 1);
    for (Index j = 0; j < std::min(lo, bk); ++j) row[j] = kNegInf;
    for (Index j = std::max<Index>(hi + 1, 0); j < bk; ++j) row[j] = kNegInf;
    if (bias != nullptr) {
      for (Index j = lo; j <= hi; ++j) row[j] += bias[k0 + j];
    }
    Scalar tile_max = kNegInf;
    for (Index j = 0; j < bk; ++j) tile_max = std::max(tile_max, row[j]);
    SoftmaxStats<Scalar>& st = buf.stats[i];
    const Scalar m_new = std::max(st.m, tile_max);
    if (m_new == kNegInf) {  // nothing visible yet: this tile adds nothing to row i
      for (Index j = 0; j < bk; ++j) row[j] = Scalar(0);
      continue;
    }
    const Scalar rescale = std::exp(st.m - m_new);
    Scalar sum = Scalar(0);
    for (Index j = 0; j < bk; ++j) {
      row[j] = std::exp(row[j] - m_new);
      sum += row[j];
    }
    st.l = st.l * rescale + sum;
    st.m = m_new;
    buf.acc.row(i) *= rescale;
  }
  buf.acc.topRows(bq).noalias() += s * as_eigen(values.middle_rows(k0, bk));
}

}  // namespace detail

// See the header comment for the contract.
template <class Scalar>
void read(ConstRowsView<Scalar> q, const MemoryRows<Scalar>& memory, const LocalRows<Scalar>& local,
          const ReadMask& mask, Scalar beta, RowsView<Scalar> o) {
  using detail::kReadKeyTile;
  using detail::kReadQueryTile;
  const Index n_queries = q.rows;
  const Index n_memory = memory.keys.rows;
  const Index n_local = local.keys.rows;
  const Index dv = o.cols;
  const Index window = mask.causal ? mask.window : 0;
  detail::ReadTileBuffers<Scalar> buf(dv);

  // Visible ranges, in each block's own row numbering (inclusive bounds).
  auto memory_first = [&](Index i) -> Index {
    return window > 0 ? n_memory + mask.query_offset + i - window + 1 : 0;
  };
  auto memory_last = [&](Index) -> Index { return n_memory - 1; };
  auto local_first = [&](Index i) -> Index {
    return window > 0 ? mask.query_offset + i - window + 1 : 0;
  };
  auto local_last = [&](Index i) -> Index {
    return mask.causal ? mask.query_offset + i : n_local - 1;
  };

  for (Index q0 = 0; q0 < n_queries; q0 += kReadQueryTile) {
    const Index bq = std::min(kReadQueryTile, n_queries - q0);
    buf.acc.topRows(bq).setZero();
    std::fill(buf.stats.begin(), buf.stats.end(), SoftmaxStats<Scalar>{});

    // Rows that no query of the tile sees are skipped whole: that is where causal and windowed
    // reads save their masked part.
    const Index mem_begin = std::max<Index>(memory_first(q0), 0);
    for (Index k0 = mem_begin; k0 < n_memory; k0 += kReadKeyTile) {
      detail::fold_key_tile(q, q0, bq, memory.keys, memory.values, memory.bias, k0,
                            std::min(kReadKeyTile, n_memory - k0), beta, memory_first,
                            memory_last, buf);
    }
    const Index loc_begin = std::max<Index>(local_first(q0), 0);
    const Index loc_end = std::min<Index>(local_last(q0 + bq - 1) + 1, n_local);
    for (Index k0 = loc_begin; k0 < loc_end; k0 += kReadKeyTile) {
      detail::fold_key_tile(q, q0, bq, local.keys, local.values,
                            static_cast<const Scalar*>(nullptr), k0,
                            std::min(kReadKeyTile, loc_end - k0), beta, local_first, local_last,
                            buf);
    }

    for (Index i = 0; i < bq; ++i) {
      Scalar* out = o.row(q0 + i);
      const SoftmaxStats<Scalar>& st = buf.stats[i];
      const Scalar inv = st.empty() ? Scalar(0) : Scalar(1) / st.l;
      for (Index d = 0; d < dv; ++d) out[d] = buf.acc(i, d) * inv;
    }
  }
}

}  // namespace ovq::kernels
