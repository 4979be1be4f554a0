#pragma once
// The small programs every device mixer uses around its read and write: the finiteness check of
// a call's inputs, copies of a call's rows into a state (a KV cache's ring, a pending chunk),
// and the updates of a state's counters. Each is a block program (block.hpp).
//
// Ordering: a call's kernels run in stream order. The copies read the counters as the call
// found them; only the counter updates (CounterProgram, one thread) change them, after every
// kernel that reads them. A state with a fault set is left alone by every program that would
// change it, so a call whose input was bad changes nothing.
#include <cstdint>
#include <cstring>

#include "ovq/config.hpp"
#include "ovq/cuda/block.hpp"
#include "ovq/cuda/counters.hpp"
#include "ovq/cuda/kernels/half.hpp"
#include "ovq/cuda/views.hpp"

namespace ovq::cuda::kernels {

// Sets fault bits (an integer atomic: blocks of one launch may report at once).
OVQ_HOST_DEVICE inline void raise_fault(StateCounters* c, std::int64_t bits) {
#if defined(OVQ_DEVICE_PASS)
  atomicOr(reinterpret_cast<unsigned long long*>(&c->fault), static_cast<unsigned long long>(bits));
#else
  c->fault |= bits;
#endif
}

// Whether x is finite, from its exponent bits (the answer does not depend on fast-math flags).
template <class Scalar>
OVQ_HOST_DEVICE bool finite_bits(Scalar x) {
  if constexpr (sizeof(Scalar) == 4) {
    std::uint32_t b;
    std::memcpy(&b, &x, sizeof b);
    return (b & 0x7f800000u) != 0x7f800000u;
  } else {
    std::uint64_t b;
    std::memcpy(&b, &x, sizeof b);
    return (b & 0x7ff0000000000000ull) != 0x7ff0000000000000ull;
  }
}

// ---- the finiteness check: up to three inputs (Q, K, V), every entry ----

template <class Scalar>
struct CheckFiniteParams {
  ConstHeadsView<Scalar> inputs[3];
  int count = 0;
  StateCounters* counters = nullptr;
};

// Block (x): rows x, x + grid.x, ... of each input (head-major). 128 threads over the columns.
template <class Scalar>
struct CheckFiniteProgram {
  using Params = CheckFiniteParams<Scalar>;
  static constexpr int kThreads = 128;
  static constexpr int kBlocks = 64;
  static std::size_t shared_bytes(const Params&) { return 0; }

  template <class Block>
  OVQ_HOST_DEVICE static void run(Block& block, const Params& p, BlockIndex index) {
    block.each([&](int t) {
      bool ok = true;
      for (int a = 0; a < p.count; ++a) {
        const ConstHeadsView<Scalar>& in = p.inputs[a];
        const Index rows = in.heads * in.rows;
        for (Index r = index.x; r < rows; r += kBlocks) {
          const Scalar* row = in.row(r / in.rows, r % in.rows);
          for (Index c = t; c < in.cols; c += kThreads) ok = ok && finite_bits(row[c]);
        }
      }
      if (!ok) raise_fault(p.counters, kFaultNonFinite);
    });
  }
};

// ---- copies of a call's rows into a state ----

// Rows [0, n) of src (states x n x d) into dst, row i of state s to dst.row(s, slot(i)):
//   ring == 0:  slot = base + i,              base = counters->size  (a cache without window)
//               or counters->pending          (a pending chunk)
//   ring > 0:   slot = (tokens + i) % ring,   only the last `ring` rows of the call
// Nothing is copied if the state has a fault, or if the rows would not fit (`limit` rows).
template <class Scalar>
struct CopyRowsParams {
  ConstHeadsView<Scalar> src[2];  // keys, values
  HeadsView<Scalar> dst[2];
  const StateCounters* counters = nullptr;
  bool to_pending = false;  // base: counters->pending (else counters->size)
  Index ring = 0;
  Index limit = 0;  // rows dst holds per state
};

// The state row that row i of the call goes to, or -1 when it is not copied (the state has a
// fault, the rows would not fit, or a later row of the same call takes its ring slot).
template <class Scalar>
OVQ_HOST_DEVICE Index copy_slot(const CopyRowsParams<Scalar>& p, const StateCounters& c, Index i) {
  const Index n = p.src[0].rows;
  if (c.fault != 0) return -1;
  if (p.ring > 0) {
    if (i < n - p.ring) return -1;  // overwritten by a later row of the same call
    return static_cast<Index>((c.tokens + i) % p.ring);
  }
  const Index base = static_cast<Index>(p.to_pending ? c.pending : c.size);
  if (base + n > p.limit) return -1;
  return base + i;
}

template <class Scalar>
struct CopyRowsProgram {
  using Params = CopyRowsParams<Scalar>;
  static constexpr int kThreads = 128;
  static std::size_t shared_bytes(const Params&) { return 0; }

  // Block (i, s): row i of state s, keys and values.
  template <class Block>
  OVQ_HOST_DEVICE static void run(Block& block, const Params& p, BlockIndex index) {
    const Index i = index.x, s = index.y;
    const Index slot = copy_slot(p, *p.counters, i);
    if (slot < 0) return;
    block.each([&](int t) {
      for (int a = 0; a < 2; ++a) {
        const Scalar* from = p.src[a].row(s, i);
        Scalar* to = p.dst[a].row(s, slot);
        for (Index col = t; col < p.src[a].cols; col += kThreads) to[col] = from[col];
      }
    });
  }
};

// ---- counter updates (one thread) ----

enum class CounterOp : int {
  append,       // a KV cache took n rows: tokens += n, size = min(size + n, keep) (keep < 0: all);
                // without a window, more than `limit` rows is a capacity fault
  push,         // a pending chunk took n rows (pending + n <= limit): tokens += n, pending += n
  complete,     // a full chunk was written: absorbed += pending, pending = 0, size += grown,
                // schedule += advance; only if pending == limit
};

struct CounterParams {
  StateCounters* counters = nullptr;
  CounterOp op = CounterOp::append;
  Index n = 0;
  Index keep = -1;
  Index limit = 0;
  // complete: how many rows the write opened and whether it used a schedule entry, read from
  // device memory (the write computed them) when given, else n and 0.
  const std::int64_t* opened = nullptr;
};

// The counter update itself (one thread).
OVQ_HOST_DEVICE inline void apply_counter_op(const CounterParams& p) {
  StateCounters& c = *p.counters;
  if (c.fault != 0) return;
  switch (p.op) {
    case CounterOp::append: {
      if (p.keep < 0 && c.size + p.n > p.limit) {
        c.fault |= kFaultCapacity;
        return;
      }
      c.tokens += p.n;
      c.size += p.n;
      if (p.keep >= 0 && c.size > p.keep) c.size = p.keep;
      break;
    }
    case CounterOp::push: {
      if (c.pending + p.n > p.limit) {
        c.fault |= kFaultCapacity;
        return;
      }
      c.tokens += p.n;
      c.pending += p.n;
      break;
    }
    case CounterOp::complete: {
      if (c.pending != p.limit) return;
      c.absorbed += c.pending;
      c.pending = 0;
      if (p.opened != nullptr) {
        // Written by another block of the same launch when a write completes its own chunk.
        const volatile std::int64_t* opened = p.opened;
        c.size += opened[0];
        c.schedule += opened[1];
      }
      break;
    }
  }
}

struct CounterProgram {
  using Params = CounterParams;
  static constexpr int kThreads = 1;
  static std::size_t shared_bytes(const Params&) { return 0; }

  template <class Block>
  OVQ_HOST_DEVICE static void run(Block& block, const Params& p, BlockIndex) {
    block.each([&](int) { apply_counter_op(p); });
  }
};

// ---- a small call's check, copy and counter update in one block ----

// The three launches of a call with a few rows a head (a decode step) as one block: Q, K and V
// finite, else the fault and nothing else (CheckFiniteProgram); then K's and V's rows into the
// state (CopyRowsProgram) and the counters' update (CounterProgram: push or append). The same
// effects as the three in turn, for two launches less.
template <class Scalar>
struct CheckCopyParams {
  CheckFiniteParams<Scalar> check;
  CopyRowsParams<Scalar> copy;
  CounterParams count;
};

template <class Scalar>
struct CheckCopyProgram {
  using Params = CheckCopyParams<Scalar>;
  static constexpr int kThreads = 256;
  // The calls it takes: at most this many rows (heads x rows per head) in each input.
  static constexpr Index kMaxRows = 256;
  static std::size_t shared_bytes(const Params&) { return sizeof(int); }

  template <class Block>
  OVQ_HOST_DEVICE static void run(Block& block, const Params& p, BlockIndex) {
    int* bad = static_cast<int*>(block.shared());
    block.each([&](int t) {
      if (t == 0) *bad = 0;
    });
    // Every entry of every input, 32-bit indices (a small call).
    block.each([&](int t) {
      bool ok = true;
      for (int a = 0; a < p.check.count; ++a) {
        const ConstHeadsView<Scalar>& in = p.check.inputs[a];
        const int cols = static_cast<int>(in.cols), rows = static_cast<int>(in.rows);
        const int entries = static_cast<int>(in.heads) * rows * cols;
        for (int e = t; e < entries; e += kThreads) {
          const int r = e / cols;
          ok = ok && finite_bits(in.row(r / rows, r % rows)[e - r * cols]);
        }
      }
      if (!ok) *bad = 1;
    });
    if (*bad != 0) {
      block.each([&](int t) {
        if (t == 0) raise_fault(p.check.counters, kFaultNonFinite);
      });
      return;
    }
    block.each([&](int t) {
      const StateCounters& c = *p.copy.counters;
      for (int a = 0; a < 2; ++a) {
        const ConstHeadsView<Scalar>& from = p.copy.src[a];
        const int cols = static_cast<int>(from.cols), rows = static_cast<int>(from.rows);
        const int entries = static_cast<int>(from.heads) * rows * cols;
        for (int e = t; e < entries; e += kThreads) {
          const int r = e / cols, col = e - r * cols;
          const Index slot = copy_slot(p.copy, c, r % rows);
          if (slot >= 0) p.copy.dst[a].row(r / rows, slot)[col] = from.row(r / rows, r % rows)[col];
        }
      }
    });
    block.each([&](int t) {
      if (t == 0) apply_counter_op(p.count);
    });
  }
};

}  // namespace ovq::cuda::kernels
