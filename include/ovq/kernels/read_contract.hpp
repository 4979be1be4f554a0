#pragma once
// The contract of the fused read, shared by every executor (the CPU tile loop and the CUDA
// kernels): what is read, which keys each query sees, and where the key axis is cut into the
// fixed merge blocks. No Eigen, and every function is OVQ_HOST_DEVICE.
//
//   o_i = softmax over [ memory r : beta q_i . Km[r] + bias[r] ] u [ local j visible to i :
//         beta q_i . Kl[j] ] of the matching values Vm[r] / Vl[j]
//
// Self-attention (memory = KV cache, no bias), VQ-attention (memory = codebook with mean values,
// bias = log count) and OVQ-attention (memory = online dictionary, bias = log count) all read
// through this one contract.
//
// Positions: local row j is at position j, memory row r at position r - Nm (just before the
// chunk), query i at position query_offset + i. Causal: a query sees local rows at or before its
// position. Window W (causal only): it sees rows at positions > its position - W, memory included.
// A bias of -inf removes a memory row.
//
// The key axis: slot x holds nothing for x < pad, memory row x - pad for x < pad + Nm, then local
// row x - pad - Nm. pad = origin mod kBlockKeys (origin: the absolute stream position of memory
// row 0), so slot x of one read and slot x of another hold the same absolute position modulo
// kBlockKeys: key tiles and merge blocks fall on the same positions however the stream was cut.
// Every executor folds the slots of one merge block [b kBlockKeys, (b + 1) kBlockKeys) from an
// empty (o, m, l) state and merges the blocks in increasing order.
#include <cstdint>

#include "ovq/config.hpp"
#include "ovq/core/views.hpp"

namespace ovq::kernels {

// Element: what the rows hold (float, double, or a 16-bit type computed in float).
template <class Element>
struct MemoryRows {
  ConstRowsView<Element> keys;    // Nm x dk
  ConstRowsView<Element> values;  // Nm x dv
  const compute_t<Element>* bias = nullptr;  // Nm entries (in the compute type), or nullptr
  // Absolute stream position of row 0 (a key/value cache), or 0 (a dictionary): key tiles are
  // aligned on absolute positions, so the tiling does not move when the stream is cut elsewhere.
  std::int64_t origin = 0;
};

template <class Element>
struct LocalRows {
  ConstRowsView<Element> keys;    // Nl x dk
  ConstRowsView<Element> values;  // Nl x dv
};

struct ReadMask {
  bool causal = true;
  Index query_offset = 0;  // local position of query row 0
  Index window = 0;        // 0: unbounded
};

// Key positions per merge block (a multiple of every executor's key tile).
inline constexpr Index kBlockKeys = 1024;

// Slots [first, last] of the key axis; last < first: none.
struct SlotRange {
  Index first = 0;
  Index last = -1;

  OVQ_HOST_DEVICE bool empty() const { return last < first; }
};

// The key axis of one read (see the header): which slots hold what, and which ones the query
// at local position p sees.
struct KeyAxisGeometry {
  Index pad = 0;          // empty slots before memory row 0
  Index memory_rows = 0;  // Nm
  Index local_rows = 0;   // the local rows some query of the read can see
  Index window = 0;       // 0: none (always 0 for non-causal reads)
  bool causal = true;

  OVQ_HOST_DEVICE Index memory_begin() const { return pad; }
  OVQ_HOST_DEVICE Index local_begin() const { return pad + memory_rows; }
  OVQ_HOST_DEVICE Index end() const { return local_begin() + local_rows; }
  // Visible slots of the query at local position p: [first(p), last(p)].
  OVQ_HOST_DEVICE Index first(Index p) const {
    if (window <= 0) return pad;
    const Index lo = local_begin() + p - window + 1;
    return lo > pad ? lo : pad;
  }
  OVQ_HOST_DEVICE Index last(Index p) const {
    if (!causal) return end() - 1;
    const Index hi = local_begin() + p;
    return hi < end() - 1 ? hi : end() - 1;
  }
  // The slots some query at positions [p_first, p_last] sees.
  OVQ_HOST_DEVICE SlotRange visible(Index p_first, Index p_last) const {
    return {first(p_first), last(p_last)};
  }
};

// The axis of a read of `n_queries` query positions over `memory_rows` memory rows (first at
// absolute position `origin`) and `local_rows` local rows. Local rows past the last query's
// position are dropped from a causal read: no query sees them.
OVQ_HOST_DEVICE inline KeyAxisGeometry key_axis_geometry(std::int64_t origin, Index memory_rows,
                                                         Index local_rows, const ReadMask& mask,
                                                         Index n_queries) {
  const std::int64_t block = kBlockKeys;
  KeyAxisGeometry g;
  g.pad = static_cast<Index>(((origin % block) + block) % block);
  g.memory_rows = memory_rows;
  const Index last_position = mask.query_offset + n_queries - 1;
  g.local_rows = mask.causal && local_rows > last_position + 1 ? last_position + 1 : local_rows;
  g.window = mask.causal ? mask.window : 0;
  g.causal = mask.causal;
  return g;
}

}  // namespace ovq::kernels
