#pragma once
// The prefetch stream of the CPU read: while a key tile is computed, the next tile's memory rows
// are asked for, a few cache lines at a time, paced by the micro-kernels' flops (TileOps'
// pacing hook). Used by decode steps over a long memory (KeyAxis::prefetch).
// A hint only: no fault, no effect on any result.
#include <cstdint>

#include "ovq/core/views.hpp"
#include "ovq/kernels/read_contract.hpp"

namespace ovq::kernels::read_detail {

// A decode step over memory rows of at least 2 MiB (keys and values) prefetches its stream
// (KeyAxis::prefetch) where its arithmetic reaches one flop per streamed byte (2 flops per
// element per stacked row): from 2 stacked float rows, 1 row of 16-bit elements (widened or
// paired before their products), 4 of double; up to 8 rows. With less arithmetic per byte the
// hardware prefetcher keeps up alone (one float row), with more rows the tile's arithmetic hides
// the loads, and rows already in a cache would only pay for the instructions. (A single bf16 row
// on AMX tiles needs it most: a tile load waits for all of its 16 rows.)
template <class Element>
inline constexpr Index kPrefetchMinRows = Index(sizeof(Element)) / 2;
inline constexpr Index kPrefetchMaxRows = 8;
inline constexpr double kPrefetchMinBytes = 2.0 * 1024.0 * 1024.0;

// Asks for one cache line into the outer caches (L2 on x86: prefetcht2), not L1 (a hint: no
// fault, no effect on any result): a prefetch into L1 holds one of the core's few L1 miss buffers
// until its line arrives, so a long stream of them fills those buffers and stalls the core's own
// loads behind them; L2 has many more.
struct CachePrefetch {
  static void line(const void* address) {
#if defined(__GNUC__) || defined(__clang__)
    __builtin_prefetch(address, 0, 1);
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

}  // namespace ovq::kernels::read_detail
