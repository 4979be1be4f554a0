#pragma once
// The fused read on a GPU: the read contract (kernels/read_contract.hpp) executed
// FlashAttention-2 style, one thread block per tile of stacked query rows, on FP32 (float) or
// DFMA (double) arithmetic.
//
//   ReadProgram   one query tile: its query rows in shared memory, then key tile after key
//                 tile (keys and values staged in shared memory), an online softmax per row,
//                 merge blocks of kBlockKeys positions folded from scratch and merged in order.
//                 Loop mode (grid.z == 1): the block folds every merge block itself. Split mode
//                 (grid.z > 1, decode): block z folds merge block z of its tile only and writes
//                 its (o, m, l) to a workspace that MergeProgram then merges in order.
//   MergeProgram  the split mode's merge: per stacked row, the blocks' partial states in order.
//
// Tile shapes (ReadTraits): kRows stacked rows (query heads of a grouped-query group x
// positions) by key tiles of kKeyTile slots (64 float, 32 double; half that at width 256),
// features padded with zeros to the compile-time width kD (32, 64, 128 or 256). Thread t of
// kThreads owns the rows (t / 16) kRowsPerThread + i, the key slots t % 16 + 16 j of each tile
// and the output columns ReadTraits::column(t % 16, c) (runs of 16 bytes). Shared memory: Q
// (kRows x kD), K (kKeyTile x kD), V (kKeyTile x kD), P^T and two reduction arrays, Q and K
// read 16 bytes at a time; keys and values staged asynchronously one tile ahead
// (async_copy.hpp); registers: the rows' accumulators (kRowsPerThread x kD / 16), in loop mode
// twice (the merged blocks and the current one).
// Cost: 2 rows (Nm' + Nl') (kD + kD) flops for Nm' + Nl' visible key slots per row, tile-granular.
//
// Determinism: every per-element operation is fixed whatever the tile shape, the launch or the
// GPU: a score is one FMA chain over the features in order, times its query head's beta; a
// tile's row maximum is exact; its row sum adds each thread's keys in order, then the 16
// threads' partial sums in order; the P V accumulation is one FMA chain per output entry over
// the tile's slots in order; the exponentials are ovq's own (core/exact_math.hpp); merges use
// merge_weights/merge_entry.
// So prefill tiles (64 rows) and decode tiles (8 rows) give the same bits for a row, the
// emulation gives the GPU's bits, and a query's output does not depend on its call.
#include <cfloat>
#include <cmath>
#include <cstdint>

#include "ovq/config.hpp"
#include "ovq/core/exact_math.hpp"
#include "ovq/core/online_softmax.hpp"
#include "ovq/core/views.hpp"
#include "ovq/cuda/block.hpp"
#include "ovq/cuda/counters.hpp"
#include "ovq/cuda/kernels/async_copy.hpp"
#include "ovq/cuda/kernels/half.hpp"
#include "ovq/kernels/read_contract.hpp"

namespace ovq::cuda::kernels {

using ovq::kernels::KeyAxisGeometry;
using ovq::kernels::kBlockKeys;
using ovq::kernels::ReadMask;
using ovq::kernels::SlotRange;

// Rows of one kind (memory or local) of every state: state s, row r at
// data + s * head_stride + r * row_stride.
template <class Scalar>
struct HeadRows {
  const Scalar* data = nullptr;
  Index head_stride = 0;
  Index row_stride = 0;

  OVQ_HOST_DEVICE const Scalar* row(Index s, Index r) const {
    return data + s * head_stride + r * row_stride;
  }
};
template <class Scalar>
struct MutableHeadRows {
  Scalar* data = nullptr;
  Index head_stride = 0;
  Index row_stride = 0;

  OVQ_HOST_DEVICE Scalar* row(Index s, Index r) const {
    return data + s * head_stride + r * row_stride;
  }
};

// Where the memory rows and the local rows of a read come from, read off the state's counters
// at run time (so that a captured decode step reads the state as it is when replayed).
enum class ReadSource : int {
  cache,       // memory: the state's last `size` tokens (a ring of `ring` rows); local: the call's
               // rows, query 0 at local position 0
  dictionary,  // memory: dictionary rows [0, size) with bias; local: the pending rows, of which
               // the call's queries are the last n_queries
  fixed,       // the extent given in the parameters (no counters)
  dictionary_rows,  // memory: dictionary rows [0, size) with bias; no local rows (the OVQ delta
                    // rule's prediction, queries the pending keys)
};

struct ReadExtent {
  std::int64_t origin = 0;  // absolute position of memory row 0
  Index memory_rows = 0;
  Index local_rows = 0;
  Index query_offset = 0;
  Index ring_start = 0;  // ring slot of memory row 0
};

// One logit scale per query head in place of ReadParams::beta (count 0: none). Query head h of a
// launch (state s, group head g: h = s * group + g) scales by values[h % count], so `count`
// scales serve every batch entry. Held by value in the parameters: a captured launch keeps the
// scales it was captured with.
template <class Scalar>
struct HeadBetas {
  static constexpr Index kMax = 256;
  Scalar values[kMax] = {};
  Index count = 0;
};

// Scalar: the arithmetic (beta, bias, partial states); Stored: the element of queries, outputs,
// keys and values (Scalar itself, or a 16-bit element computed in float).
template <class Scalar, class Stored = Scalar>
struct ReadParams {
  using stored_type = Stored;
  // Query head g of state s, position i: q.row(s * group + g, i) (dk entries); o likewise (dv).
  HeadRows<Stored> q;
  MutableHeadRows<Stored> o;
  Index states = 0;
  Index group = 1;       // query heads per state
  Index n_queries = 0;   // positions per query head
  Index dk = 0, dv = 0;  // <= the program's kD
  Scalar beta = Scalar(1);
  HeadBetas<Scalar> head_betas;  // count > 0: these in place of beta
  bool causal = true;
  Index window = 0;
  ReadSource source = ReadSource::cache;
  const StateCounters* counters = nullptr;
  ReadExtent fixed_extent;  // source fixed
  HeadRows<Stored> memory_keys, memory_values;
  HeadRows<Scalar> bias;  // row_stride 1; data == nullptr: none
  // false: a log-count bias is read as 0 where the count is > 0 (log c >= 0) and stays -inf
  // where it is 0, OVQ's read without the count bias.
  bool count_bias = true;
  // >= 0: the read runs only while the state has exactly this many pending rows (a captured
  // step's write-time read, which must do nothing when its chunk is not complete).
  Index only_if_pending = -1;
  Index ring = 0;         // cache source: ring capacity (rows), 0 if none
  // 16-bit reads: every row of q, keys and values starts at a 16-byte boundary and dk, dv are
  // multiples of 8, so rows load in pieces of 8 elements (one 16-byte load).
  bool aligned_rows = false;
  HeadRows<Stored> local_keys, local_values;
  // Split mode: block z of (tile, state) writes rows x (kD + 2) scalars at
  // partials + (((s * tiles + tile) * grid_z + z) * kRows + r) * (kD + 2): the kD average
  // entries, then m and l.
  Scalar* partials = nullptr;
  // Each query's log-sum-exp (data null: none): query head g of state s, position i at
  // lse.row(s * group + g, i)[0].
  MutableHeadRows<Scalar> lse;
  int tiles = 1;   // query tiles per state (grid.x)
  int splits = 1;  // grid.z
  // Split decode: one arrival counter per (state, tile) (s * tiles + tile), 0 between launches:
  // the tile's last split block merges it (no MergeProgram launch). Null: MergeProgram merges.
  std::int64_t* arrivals = nullptr;

  // The logit scale of query head g of state s (in 32 bits: heads and counts are small, and a
  // 64-bit remainder is a long instruction sequence on a GPU).
  OVQ_HOST_DEVICE Scalar beta_of(Index s, Index g) const {
    if (head_betas.count == 0) return beta;
    const int head = static_cast<int>(s * group + g);
    return head_betas.values[head % static_cast<int>(head_betas.count)];
  }

  // Whether the launch has nothing to read: the state has a fault (a call since the host last
  // looked had a bad input, so the counters leave out the rows this call would have added and an
  // extent taken from them would index before its rows; such calls' outputs are undefined), or a
  // captured step's write-time read finds its chunk incomplete.
  OVQ_HOST_DEVICE bool skipped() const {
    if (counters == nullptr) return false;  // a fixed extent
    return counters->fault != 0 || (only_if_pending >= 0 && counters->pending != only_if_pending);
  }

  OVQ_HOST_DEVICE ReadExtent extent() const {
    ReadExtent e;
    if (source == ReadSource::fixed) {
      e = fixed_extent;
    } else if (source == ReadSource::dictionary_rows) {
      e.memory_rows = static_cast<Index>(counters->size);
    } else if (source == ReadSource::cache) {
      e.memory_rows = static_cast<Index>(counters->size);
      e.origin = counters->tokens - counters->size;
      e.local_rows = n_queries;
      e.query_offset = 0;
      e.ring_start = ring > 0 ? static_cast<Index>(e.origin % ring) : 0;
    } else {
      e.memory_rows = static_cast<Index>(counters->size);
      e.origin = 0;
      e.local_rows = static_cast<Index>(counters->pending);
      e.query_offset = e.local_rows - n_queries;
    }
    return e;
  }
};

template <class Scalar, int kD, int kRows>
struct ReadTraits {
  static_assert(kD % 16 == 0 && kD >= 16, "head widths are multiples of 16");
  static constexpr int kThreads = kRows >= 32 ? 256 : 128;
  // Key tiles: 64 slots in float, 32 in double, half that at width 256 (so that the tiles fit
  // an sm_80's shared memory).
  static constexpr int kKeyTile = (sizeof(Scalar) == 4 ? 64 : 32) / (kD > 128 ? 2 : 1);
  static constexpr int kGroups = 16;  // key groups per row group, and column groups
  static constexpr int kKeysPerThread = kKeyTile / kGroups;
  static constexpr int kRowGroups = kThreads / kGroups;
  static constexpr int kRowsPerThread = kRows / kRowGroups;
  static constexpr int kColsPerThread = kD / kGroups;
  static_assert(kRows % kRowGroups == 0, "rows divide among the row groups");
  static_assert(kBlockKeys % kKeyTile == 0, "merge blocks hold whole key tiles");
  // 16 bytes of scalars: a staged piece of a row, and a vector load of shared memory.
  static constexpr int kVec = static_cast<int>(16 / sizeof(Scalar));
  // A thread's output columns come in runs of kOutVec: column c of thread kg is
  // (c / kOutVec) (16 kOutVec) + kg kOutVec + c % kOutVec, so that the 16 threads of a row
  // group read 16 consecutive runs of a value row.
  static constexpr int kOutVec = kColsPerThread < kVec ? kColsPerThread : kVec;
  static_assert(kThreads % (kD / kVec) == 0, "staging passes cover whole rows");
  // Shared memory, in scalars. Rows of Q and K are padded by one piece, so that the 16-byte
  // loads of 8 consecutive keys at one feature fall in 8 different bank quads; P is stored
  // transposed (slot x row), padded by one scalar.
  static constexpr int kQStride = kD + kVec;
  static constexpr int kKStride = kD + kVec;
  static constexpr int kPStride = kRows + 1;
  static constexpr int kQ = 0;
  static constexpr int kK = kQ + kRows * kQStride;
  static constexpr int kV = kK + kKeyTile * kKStride;
  static constexpr int kP = kV + kKeyTile * kD;
  static constexpr int kRedMax = kP + kKeyTile * kPStride;
  static constexpr int kRedSum = kRedMax + kRows * kGroups;
  static constexpr int kShared = kRedSum + kRows * kGroups;

  OVQ_HOST_DEVICE static constexpr int column(int kg, int c) {
    return (c / kOutVec) * (kGroups * kOutVec) + kg * kOutVec + c % kOutVec;
  }
};

// The stacked rows of query tile `tile`: heads_per_tile heads of the group times
// positions_per_tile positions; stacked row r is head h0 + r % heads_per_tile at position
// p0 + r / heads_per_tile.
struct QueryTiling {
  Index heads_per_tile = 1;
  Index positions_per_tile = 1;
  Index head_tiles = 1;
  Index position_tiles = 1;

  OVQ_HOST_DEVICE static QueryTiling make(Index group, Index n_queries, Index rows) {
    QueryTiling t;
    t.heads_per_tile = group < rows ? group : rows;
    t.positions_per_tile = rows / t.heads_per_tile;
    t.head_tiles = (group + t.heads_per_tile - 1) / t.heads_per_tile;
    t.position_tiles = (n_queries + t.positions_per_tile - 1) / t.positions_per_tile;
    return t;
  }
  OVQ_HOST_DEVICE Index tiles() const { return head_tiles * position_tiles; }
};

// The row of a query tile a stacked row is: its query head and position, or invalid.
struct RowPlace {
  Index head = 0, position = 0;
  bool valid = false;
};
template <class Params>
OVQ_HOST_DEVICE RowPlace row_place(const Params& p, const QueryTiling& qt, Index tile, Index r) {
  const Index ht = tile % qt.head_tiles, pt = tile / qt.head_tiles;
  RowPlace out;
  out.head = ht * qt.heads_per_tile + r % qt.heads_per_tile;
  out.position = pt * qt.positions_per_tile + r / qt.heads_per_tile;
  out.valid = r / qt.heads_per_tile < qt.positions_per_tile && out.head < p.group &&
              out.position < p.n_queries;
  return out;
}

// The key row (or value row) behind slot x of the axis, or nullptr for an empty slot.
template <class Params>
OVQ_HOST_DEVICE const typename Params::stored_type* slot_row(const Params& p, const ReadExtent& ext,
                                                            const KeyAxisGeometry& axis, Index s,
                                                            Index x, bool values) {
  if (x < axis.pad || x >= axis.end()) return nullptr;
  if (x < axis.local_begin()) {
    Index r = x - axis.pad;
    if (p.ring > 0) r = (ext.ring_start + r) % p.ring;
    return values ? p.memory_values.row(s, r) : p.memory_keys.row(s, r);
  }
  const Index j = x - axis.local_begin();
  return values ? p.local_values.row(s, j) : p.local_keys.row(s, j);
}

// A query's log-sum-exp from its softmax statistics: m + log l over the logits it saw, -inf
// where it saw none (the CPU's, to rounding: the logarithm is taken in double and rounded once,
// so the GPU and the emulation agree but for the last bit of a double log).
template <class Scalar>
OVQ_HOST_DEVICE Scalar log_sum_exp(const SoftmaxStats<Scalar>& st) {
  if (st.empty()) return -Scalar(INFINITY);
  return st.m + static_cast<Scalar>(std::log(static_cast<double>(st.l)));
}

// An output entry: clamped to the element's finite range (an average of finite values only
// leaves it by rounding), then stored.
template <class Stored, class Scalar>
OVQ_HOST_DEVICE Stored output_entry(Scalar x) {
  if constexpr (is_half_bits_v<Stored>) {
    const float kMax = largest_finite_of<Stored>();
    return narrow<Stored>(x < -kMax ? -kMax : (x > kMax ? kMax : x));
  } else {
    const Scalar kMax = sizeof(Scalar) == 4 ? Scalar(FLT_MAX) : Scalar(DBL_MAX);
    return x < -kMax ? -kMax : (x > kMax ? kMax : x);
  }
}

// What one query tile of a read sweeps: the key axis of its state, and for each merge block it
// folds (split mode: block z of the visible ones only) the key tiles of kKeyTile slots its rows
// see, tile-granular.
struct TileSweep {
  KeyAxisGeometry axis;
  SlotRange slots;
  Index first_block = 0, last_block = -1;
  Index key_tile = 1, tiles_per_block = 1;

  OVQ_HOST_DEVICE Index first_tile(Index b) const {
    const Index lo = b * tiles_per_block, seen = slots.first / key_tile;
    return lo > seen ? lo : seen;
  }
  OVQ_HOST_DEVICE Index last_tile(Index b) const {
    const Index hi = (b + 1) * tiles_per_block - 1, seen = slots.last / key_tile;
    return hi < seen ? hi : seen;
  }
  // The tile folded after tile t of block b (the next block's first), or -1 after the last.
  OVQ_HOST_DEVICE Index next_tile(Index b, Index t) const {
    if (t < last_tile(b)) return t + 1;
    return b < last_block ? first_tile(b + 1) : -1;
  }
};

// A window of a key tile's slots [lo, hi], relative to the tile's first slot x0 and clamped to
// [-1, key_tile] (empty: lo > hi), so that a per-entry test is two 32-bit compares: the slots
// with a bias, or the slots a row sees.
struct TileWindow {
  int lo = 1, hi = 0;
  OVQ_HOST_DEVICE bool holds(int col) const { return col >= lo && col <= hi; }
  OVQ_HOST_DEVICE bool holds_all(int first, int last) const { return lo <= first && hi >= last; }
};
// The absolute slots [first, last] within tile x0.
OVQ_HOST_DEVICE inline TileWindow tile_window(Index first, Index last, Index x0, int key_tile) {
  const auto clamp = [&](Index slot) {
    const Index r = slot - x0;
    return r < -1 ? -1 : (r > key_tile ? key_tile : static_cast<int>(r));
  };
  return {clamp(first), clamp(last)};
}
// The slots of tile x0 with a bias: the memory rows, when the read has a bias.
template <class Params>
OVQ_HOST_DEVICE TileWindow bias_window(const Params& p, const KeyAxisGeometry& axis, Index x0,
                                       int key_tile) {
  if (p.bias.data == nullptr) return {};
  return tile_window(axis.memory_begin(), axis.local_begin() - 1, x0, key_tile);
}
// The slots of tile x0 a stacked row sees (none for a row that is no query).
OVQ_HOST_DEVICE inline TileWindow seen_window(const ReadExtent& ext, const KeyAxisGeometry& axis,
                                              const RowPlace& rp, Index x0, int key_tile) {
  if (!rp.valid) return {};
  const Index pos = ext.query_offset + rp.position;
  return tile_window(axis.first(pos), axis.last(pos), x0, key_tile);
}

// A logit saturated to the finite range: an overflowing product of finite inputs, or the NaN
// of inf - inf inside one, becomes +-max (NaN: -max).
template <class Scalar>
OVQ_HOST_DEVICE Scalar saturate_logit(Scalar x) {
  const Scalar kMax = sizeof(Scalar) == 4 ? Scalar(FLT_MAX) : Scalar(DBL_MAX);
  if (!(x >= -kMax)) return -kMax;
  return x > kMax ? kMax : x;
}
// The logit of slot col of tile x0 (before the mask), for every read program: the product
// times the row's beta, plus the slot's bias where it has one (without the count bias, a
// count's log reads as 0 and an empty row's -inf stays), saturated.
template <class Params, class Scalar>
OVQ_HOST_DEVICE Scalar tile_logit(const Params& p, const KeyAxisGeometry& axis,
                                  const TileWindow& biased, Index s, Index x0, int col,
                                  Scalar product, Scalar beta) {
  Scalar x = ovq::detail::mul_rn(product, beta);
  if (biased.holds(col)) {
    const Scalar b = p.bias.row(s, x0 + col - axis.pad)[0];
    x = x + (p.count_bias || !(b >= Scalar(0)) ? b : Scalar(0));
  }
  return saturate_logit(x);
}

// Issues the asynchronous copies (async_copy.hpp) of thread tid's pieces of key tile
// [x0, x0 + key_tile) of the axis, keys or values, into shared memory at dst (row stride
// `stride`; zeros for empty slots and past d): piece tid % (kD / kVec) of rows tid / (kD / kVec)
// + passes, so that one row's pointer serves several pieces.
template <int kThreads, int kD, class Params>
OVQ_HOST_DEVICE void stage_key_tile(int tid, const Params& p, const ReadExtent& ext,
                                    const KeyAxisGeometry& axis, Index s, Index x0, int key_tile,
                                    bool values, typename Params::stored_type* dst, int stride) {
  using Stored = typename Params::stored_type;
  constexpr int kVec = static_cast<int>(16 / sizeof(Stored));
  constexpr int kPieces = kD / kVec;
  constexpr int kRowsPerPass = kThreads / kPieces;
  const int c = (tid % kPieces) * kVec;
  const Index d = values ? p.dv : p.dk;
  // A tile of memory rows that does not wrap the ring, or of local rows, is rows one stride
  // apart: one address computation for the tile instead of a slot_row per row.
  const Index x_end = x0 + key_tile;
  const Stored* first = nullptr;
  Index row_stride = 0;
  if (x0 >= axis.memory_begin() && x_end <= axis.local_begin()) {
    Index r = x0 - axis.pad;
    if (p.ring > 0) r = (ext.ring_start + r) % p.ring;
    if (p.ring == 0 || r + key_tile <= p.ring) {
      const HeadRows<Stored>& rows = values ? p.memory_values : p.memory_keys;
      first = rows.row(s, r);
      row_stride = rows.row_stride;
    }
  } else if (x0 >= axis.local_begin() && x_end <= axis.end()) {
    const HeadRows<Stored>& rows = values ? p.local_values : p.local_keys;
    first = rows.row(s, x0 - axis.local_begin());
    row_stride = rows.row_stride;
  }
  for (int j = tid / kPieces; j < key_tile; j += kRowsPerPass) {
    const Stored* row =
        first != nullptr ? first + j * row_stride : slot_row(p, ext, axis, s, x0 + j, values);
    copy_piece_async(dst + j * stride + c, row, c, d, p.aligned_rows);
  }
}

// Issues thread tid's copies of the tile's query rows into shared memory at dst (row stride
// `stride`; zeros past dk and for rows that are no query).
template <int kThreads, int kD, int kRows, class Params>
OVQ_HOST_DEVICE void stage_queries(int tid, const Params& p, const QueryTiling& qt, Index tile,
                                   Index s, typename Params::stored_type* dst, int stride) {
  using Stored = typename Params::stored_type;
  constexpr int kVec = static_cast<int>(16 / sizeof(Stored));
  constexpr int kPieces = kD / kVec;
  const int c = (tid % kPieces) * kVec;
  for (int r = tid / kPieces; r < kRows; r += kThreads / kPieces) {
    const RowPlace rp = row_place(p, qt, tile, r);
    copy_piece_async(dst + r * stride + c,
                     rp.valid ? p.q.row(s * p.group + rp.head, rp.position) : nullptr, c, p.dk,
                     p.aligned_rows);
  }
}

template <class Params>
OVQ_HOST_DEVICE TileSweep tile_sweep(const Params& p, const ReadExtent& ext, const QueryTiling& qt,
                                     Index tile, int rows, int key_tile, Index z) {
  TileSweep sw;
  ReadMask mask;
  mask.causal = p.causal;
  mask.window = p.window;
  mask.query_offset = ext.query_offset;
  sw.axis = ovq::kernels::key_axis_geometry(ext.origin, ext.memory_rows, ext.local_rows, mask,
                                            p.n_queries);
  sw.key_tile = key_tile;
  sw.tiles_per_block = kBlockKeys / key_tile;
  // The positions of the tile's valid rows, and the slots they see.
  Index p_first = -1, p_last = -1;
  for (Index r = 0; r < rows; ++r) {
    const RowPlace rp = row_place(p, qt, tile, r);
    if (!rp.valid) continue;
    const Index pos = ext.query_offset + rp.position;
    if (p_first < 0 || pos < p_first) p_first = pos;
    if (pos > p_last) p_last = pos;
  }
  if (p_first >= 0) sw.slots = sw.axis.visible(p_first, p_last);
  if (sw.slots.empty()) return sw;
  const Index b_first = sw.slots.first / kBlockKeys, b_last = sw.slots.last / kBlockKeys;
  if (p.splits > 1) {
    sw.first_block = b_first + z;
    sw.last_block = sw.first_block <= b_last ? sw.first_block : sw.first_block - 1;
  } else {
    sw.first_block = b_first;
    sw.last_block = b_last;
  }
  return sw;
}

template <class Scalar, int kD, int kRows>
struct ReadProgram {
  using Traits = ReadTraits<Scalar, kD, kRows>;
  using Params = ReadParams<Scalar>;
  static constexpr int kThreads = Traits::kThreads;
  static constexpr int kRPT = Traits::kRowsPerThread;
  static constexpr int kKPT = Traits::kKeysPerThread;
  static constexpr int kCPT = Traits::kColsPerThread;
  static constexpr int kTile = Traits::kKeyTile;
  static constexpr int kGroups = Traits::kGroups;
  static constexpr int kVec = Traits::kVec;
  static constexpr int kOutVec = Traits::kOutVec;

  static std::size_t shared_bytes(const Params&) {
    return static_cast<std::size_t>(Traits::kShared) * sizeof(Scalar);
  }

  struct Thread {
    Scalar acc[kRPT][kCPT];  // the current merge block's average
    Scalar tot[kRPT][kCPT];  // loop mode: the merged blocks before it
    Scalar s[kRPT][kKPT];    // this tile's scores, then weights
    SoftmaxStats<Scalar> st[kRPT], st_tot[kRPT];
    Scalar m_new[kRPT];
    Scalar beta[kRPT];  // each row's logit scale
  };

  // The tiles' keys and values are staged asynchronously, one tile ahead: a tile's values load
  // while its scores are computed, the next tile's keys while its weights and P V are
  // (fold_tile says where each copy is issued and waited for).
  template <class Block>
  OVQ_HOST_DEVICE static void run(Block& block, const Params& p, BlockIndex index) {
    if (p.skipped()) return;
    Scalar* sh = static_cast<Scalar*>(block.shared());
    const Index s = index.y;
    const Index tile = index.x;
    const ReadExtent ext = p.extent();
    const QueryTiling qt = QueryTiling::make(p.group, p.n_queries, kRows);
    const bool split = p.splits > 1;
    const TileSweep sw = tile_sweep(p, ext, qt, tile, kRows, kTile, index.z);
    const Index first = sw.first_block <= sw.last_block ? sw.first_tile(sw.first_block) : -1;

    typename Block::template PerThread<Thread> th;
    load_queries(block, p, ext, sw.axis, qt, tile, s, first, sh, th);
    for (Index b = sw.first_block; b <= sw.last_block; ++b) {
      for (Index t = sw.first_tile(b); t <= sw.last_tile(b); ++t)
        fold_tile(block, p, ext, sw.axis, qt, tile, s, t, sw.next_tile(b, t), sh, th);
      if (!split) merge_block(block, th);
    }
    if (split) {
      write_partial(block, p, tile, s, index.z, th);
    } else {
      store(block, p, qt, tile, s, th);
    }
  }

  // Q rows and the first tile's keys (tile `first`, or none) into shared memory (zeros past dk
  // and for invalid rows); every accumulator to the empty state.
  template <class Block, class Th>
  OVQ_HOST_DEVICE static void load_queries(Block& block, const Params& p, const ReadExtent& ext,
                                           const KeyAxisGeometry& axis, const QueryTiling& qt,
                                           Index tile, Index s, Index first, Scalar* sh, Th& th) {
    block.each([&](int t) {
      stage_queries<kThreads, kD, kRows>(t, p, qt, tile, s, sh + Traits::kQ, Traits::kQStride);
      if (first >= 0)
        stage_key_tile<kThreads, kD>(t, p, ext, axis, s, first * kTile, kTile, false,
                                     sh + Traits::kK, Traits::kKStride);
      commit_async();
      Thread& me = th[t];
      OVQ_DEVICE_UNROLL
      for (int i = 0; i < kRPT; ++i) {
        me.beta[i] = p.beta_of(s, row_place(p, qt, tile, (t / kGroups) * kRPT + i).head);
        me.st[i] = SoftmaxStats<Scalar>{};
        me.st_tot[i] = SoftmaxStats<Scalar>{};
        OVQ_DEVICE_UNROLL
        for (int c = 0; c < kCPT; ++c) {
          me.acc[i][c] = Scalar(0);
          me.tot[i][c] = Scalar(0);
        }
      }
      wait_async<0>();
    });
  }

  // Folds key tile t (slots [t kTile, (t + 1) kTile)), whose keys are staged, into every row's
  // current block; stages its values, and the keys of tile `next` (-1: none).
  template <class Block, class Th>
  OVQ_HOST_DEVICE static void fold_tile(Block& block, const Params& p, const ReadExtent& ext,
                                        const KeyAxisGeometry& axis, const QueryTiling& qt,
                                        Index tile, Index s, Index t, Index next, Scalar* sh,
                                        Th& th) {
    const Index x0 = t * kTile;
    const TileWindow biased = bias_window(p, axis, x0, kTile);
    // 1. The tile's values start loading. Scores, bias, saturation, mask; each thread's
    //    maximum per row.
    block.each([&](int tid) {
      stage_key_tile<kThreads, kD>(tid, p, ext, axis, s, x0, kTile, true, sh + Traits::kV, kD);
      commit_async();
      Thread& me = th[tid];
      const int kg = tid % kGroups, rg = tid / kGroups;
      Scalar dot[kRPT][kKPT];
      dot_block<kD>(sh + Traits::kQ + rg * kRPT * Traits::kQStride, Traits::kQStride,
                    sh + Traits::kK + kg * Traits::kKStride, kGroups * Traits::kKStride, dot);
      OVQ_DEVICE_UNROLL
      for (int i = 0; i < kRPT; ++i) {
        const int r = rg * kRPT + i;
        const TileWindow seen = seen_window(ext, axis, row_place(p, qt, tile, r), x0, kTile);
        Scalar largest = -Scalar(INFINITY);
        OVQ_DEVICE_UNROLL
        for (int j = 0; j < kKPT; ++j) {
          const int col = kg + kGroups * j;
          Scalar x = tile_logit(p, axis, biased, s, x0, col, dot[i][j], me.beta[i]);
          if (!seen.holds(col)) x = -Scalar(INFINITY);
          me.s[i][j] = x;
          if (x > largest) largest = x;
        }
        sh[Traits::kRedMax + r * kGroups + kg] = largest;
      }
    });
    // 2. The next tile's keys start loading (this tile's are read). The row maxima;
    //    exponentials; each thread's sum per row.
    block.each([&](int tid) {
      if (next >= 0)
        stage_key_tile<kThreads, kD>(tid, p, ext, axis, s, next * kTile, kTile, false,
                                     sh + Traits::kK, Traits::kKStride);
      commit_async();
      Thread& me = th[tid];
      const int kg = tid % kGroups, rg = tid / kGroups;
      OVQ_DEVICE_UNROLL
      for (int i = 0; i < kRPT; ++i) {
        const int r = rg * kRPT + i;
        Scalar tile_max = -Scalar(INFINITY);
        for (int g = 0; g < kGroups; ++g) {
          const Scalar x = sh[Traits::kRedMax + r * kGroups + g];
          if (x > tile_max) tile_max = x;
        }
        const Scalar m_new = me.st[i].m > tile_max ? me.st[i].m : tile_max;
        me.m_new[i] = m_new;
        Scalar sum = Scalar(0);
        OVQ_DEVICE_UNROLL
        for (int j = 0; j < kKPT; ++j) {
          const Scalar e = ovq::detail::softmax_weight(me.s[i][j], m_new);
          me.s[i][j] = e;
          sum = sum + e;
        }
        sh[Traits::kRedSum + r * kGroups + kg] = sum;
      }
    });
    // 3. The row sums; the online-softmax update; P / l into shared memory (transposed). The
    //    tile's values have landed at the end.
    block.each([&](int tid) {
      Thread& me = th[tid];
      const int kg = tid % kGroups, rg = tid / kGroups;
      OVQ_DEVICE_UNROLL
      for (int i = 0; i < kRPT; ++i) {
        const int r = rg * kRPT + i;
        const Scalar m_new = me.m_new[i];
        Scalar inv = Scalar(0);
        if (m_new != -Scalar(INFINITY)) {
          Scalar sum = Scalar(0);
          for (int g = 0; g < kGroups; ++g) sum = sum + sh[Traits::kRedSum + r * kGroups + g];
          SoftmaxStats<Scalar>& st = me.st[i];
          const Scalar l_kept =
              st.m == m_new ? st.l
                            : ovq::detail::mul_rn(st.l, ovq::detail::exp_nonpositive(st.m - m_new));
          const Scalar l_new = l_kept + sum;
          const Scalar keep = l_kept / l_new;
          inv = Scalar(1) / l_new;
          if (keep != Scalar(1)) {
            // keep = 0: the old rows vanish next to the new maximum (assigned, not multiplied,
            // so that an average that rounded to inf leaves no 0 * inf).
            OVQ_DEVICE_UNROLL
            for (int c = 0; c < kCPT; ++c)
              me.acc[i][c] =
                  keep == Scalar(0) ? Scalar(0) : ovq::detail::mul_rn(me.acc[i][c], keep);
          }
          st.l = l_new;
          st.m = m_new;
        }
        OVQ_DEVICE_UNROLL
        for (int j = 0; j < kKPT; ++j)
          sh[Traits::kP + (kg + kGroups * j) * Traits::kPStride + r] =
              ovq::detail::mul_rn(me.s[i][j], inv);
      }
      wait_async<1>();
    });
    // 4. P V: each output entry one FMA chain over the tile's slots in order. The next tile's
    //    keys have landed at the end.
    block.each([&](int tid) {
      Thread& me = th[tid];
      const int kg = tid % kGroups, rg = tid / kGroups;
      for (int j = 0; j < kTile; ++j) {
        const Scalar* v = sh + Traits::kV + j * kD + kg * kOutVec;
        const Scalar* w = sh + Traits::kP + j * Traits::kPStride + rg * kRPT;
        Scalar wj[kRPT];
        OVQ_DEVICE_UNROLL
        for (int i = 0; i < kRPT; ++i) wj[i] = w[i];
        OVQ_DEVICE_UNROLL
        for (int run = 0; run < kCPT / kOutVec; ++run) {
          Scalar vv[kOutVec];
          load_vector(v + run * kGroups * kOutVec, vv);
          OVQ_DEVICE_UNROLL
          for (int i = 0; i < kRPT; ++i)
            OVQ_DEVICE_UNROLL
            for (int e = 0; e < kOutVec; ++e)
              me.acc[i][run * kOutVec + e] = std::fma(wj[i], vv[e], me.acc[i][run * kOutVec + e]);
        }
      }
      wait_async<0>();
    });
  }

  // Loop mode: the finished merge block into the merged result; the next block starts empty.
  template <class Block, class Th>
  OVQ_HOST_DEVICE static void merge_block(Block& block, Th& th) {
    block.each([&](int tid) {
      Thread& me = th[tid];
      OVQ_DEVICE_UNROLL
      for (int i = 0; i < kRPT; ++i) {
        const MergeWeights<Scalar> w = merge_weights<ExactExp>(me.st_tot[i], me.st[i]);
        OVQ_DEVICE_UNROLL
        for (int c = 0; c < kCPT; ++c) {
          me.tot[i][c] = merge_entry<true>(w, me.tot[i][c], me.acc[i][c]);
          me.acc[i][c] = Scalar(0);
        }
        me.st_tot[i] = w.stats;
        me.st[i] = SoftmaxStats<Scalar>{};
      }
    });
  }

  // The outputs: the merged average (0 where no key was visible), clamped to the finite range.
  template <class Block, class Th>
  OVQ_HOST_DEVICE static void store(Block& block, const Params& p, const QueryTiling& qt,
                                    Index tile, Index s, Th& th) {
    block.each([&](int tid) {
      Thread& me = th[tid];
      const int kg = tid % kGroups, rg = tid / kGroups;
      OVQ_DEVICE_UNROLL
      for (int i = 0; i < kRPT; ++i) {
        const RowPlace rp = row_place(p, qt, tile, rg * kRPT + i);
        if (!rp.valid) continue;
        Scalar* out = p.o.row(s * p.group + rp.head, rp.position);
        OVQ_DEVICE_UNROLL
        for (int c = 0; c < kCPT; ++c) {
          const Index col = Traits::column(kg, c);
          if (col < p.dv) out[col] = output_entry<Scalar>(me.tot[i][c]);
        }
        if (kg == 0 && p.lse.data != nullptr)
          p.lse.row(s * p.group + rp.head, rp.position)[0] = log_sum_exp(me.st_tot[i]);
      }
    });
  }

  // Split mode: this block's state (empty if it had no merge block to fold).
  template <class Block, class Th>
  OVQ_HOST_DEVICE static void write_partial(Block& block, const Params& p, Index tile, Index s,
                                            Index z, Th& th) {
    block.each([&](int tid) {
      Thread& me = th[tid];
      const int kg = tid % kGroups, rg = tid / kGroups;
      OVQ_DEVICE_UNROLL
      for (int i = 0; i < kRPT; ++i) {
        const Index r = rg * kRPT + i;
        Scalar* out = p.partials + (((s * p.tiles + tile) * p.splits + z) * kRows + r) * (kD + 2);
        OVQ_DEVICE_UNROLL
        for (int c = 0; c < kCPT; ++c) out[Traits::column(kg, c)] = me.acc[i][c];
        if (kg == 0) {
          out[kD] = me.st[i].m;
          out[kD + 1] = me.st[i].l;
        }
      }
    });
  }
};

// Split mode's merge: block (tile, state); thread t handles stacked row t / 16 and columns
// t % 16 + 16 c, merging the splits' partial states in increasing block order.
template <class Scalar, int kD, int kRows, class Stored = Scalar>
struct MergeProgram {
  using Params = ReadParams<Scalar, Stored>;
  static constexpr int kThreads = kRows * 16;
  static std::size_t shared_bytes(const Params&) { return 0; }

  template <class Block>
  OVQ_HOST_DEVICE static void run(Block& block, const Params& p, BlockIndex index) {
    if (p.skipped()) return;
    block.each([&](int tid) { merge_entries(p, index.x, index.y, tid); });
  }

  // Item i of kRows x 16: stacked row i / 16 of (tile, state s), its columns i % 16 + 16 c: the
  // splits' partials merged in order, then the outputs (and the log-sum-exp). A decode program
  // that merges its own tile (its last block to finish) reads partials other blocks wrote in
  // the same launch, past this multiprocessor's L1 (coherent loads).
  OVQ_HOST_DEVICE static void merge_entries(const Params& p, Index tile, Index s, int i) {
    const QueryTiling qt = QueryTiling::make(p.group, p.n_queries, kRows);
    const Index r = i / 16;
    const int kg = i % 16;
    const RowPlace rp = row_place(p, qt, tile, r);
    if (!rp.valid) return;
    Scalar o[kD / 16];
    OVQ_DEVICE_UNROLL
    for (int c = 0; c < kD / 16; ++c) o[c] = Scalar(0);
    SoftmaxStats<Scalar> st;
    for (int z = 0; z < p.splits; ++z) {
      const Scalar* part =
          p.partials + (((s * p.tiles + tile) * p.splits + z) * kRows + r) * (kD + 2);
      SoftmaxStats<Scalar> b;
      b.m = load_coherent(part + kD);
      b.l = load_coherent(part + kD + 1);
      const MergeWeights<Scalar> w = merge_weights<ExactExp>(st, b);
      OVQ_DEVICE_UNROLL
      for (int c = 0; c < kD / 16; ++c)
        o[c] = merge_entry<true>(w, o[c], load_coherent(part + kg + 16 * c));
      st = w.stats;
    }
    Stored* out = p.o.row(s * p.group + rp.head, rp.position);
    OVQ_DEVICE_UNROLL
    for (int c = 0; c < kD / 16; ++c) {
      const Index col = kg + 16 * c;
      if (col < p.dv) out[col] = output_entry<Stored>(o[c]);
    }
    if (kg == 0 && p.lse.data != nullptr)
      p.lse.row(s * p.group + rp.head, rp.position)[0] = log_sum_exp(st);
  }

  // A decode program's end: unless its plan merges in a MergeProgram launch (p.arrivals null),
  // the last of the tile's split blocks to finish merges the tile, with its kThreads threads.
  template <class Block>
  OVQ_HOST_DEVICE static void merge_if_last(Block& block, const Params& p, Index tile, Index s,
                                            int threads) {
    if (p.arrivals == nullptr) return;
    if (!block.last_to_arrive(p.arrivals + s * p.tiles + tile, p.splits)) return;
    block.each([&](int tid) {
      for (int i = tid; i < kThreads; i += threads) merge_entries(p, tile, s, i);
    });
  }
};

}  // namespace ovq::cuda::kernels
