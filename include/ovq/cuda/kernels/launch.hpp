#pragma once
// Launch planning shared by the device mixers: head widths as compile-time constants, and the
// read's tile choice (prefill or decode), grid and workspace.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "ovq/core/error.hpp"
#include "ovq/cuda/block.hpp"
#include "ovq/cuda/kernels/decode.hpp"
#include "ovq/cuda/kernels/half.hpp"
#include "ovq/cuda/kernels/read.hpp"
#include "ovq/cuda/kernels/tensor_read.hpp"

namespace ovq::cuda::kernels {

// The widest head the CUDA kernels take (keys and values).
inline constexpr Index kMaxHeadWidth = 256;

// d -> the compile-time width its kernels run at: the next of 32, 64, 128, 256. Narrower heads
// are padded with zeros as they are loaded (an exact zero in every sum), so every width up to
// 256 runs on one of four instantiations.
inline int padded_width(Index d) { return d <= 32 ? 32 : d <= 64 ? 64 : d <= 128 ? 128 : 256; }

template <class F>
void dispatch_width(Index d, F&& f) {
  switch (padded_width(d)) {
    case 32: return f(std::integral_constant<int, 32>{});
    case 64: return f(std::integral_constant<int, 64>{});
    case 128: return f(std::integral_constant<int, 128>{});
    default: return f(std::integral_constant<int, 256>{});
  }
}

// Stacked rows of a prefill tile and of a decode tile. FP32 and DFMA (ReadProgram): float 64,
// double 32, half that at width 256, whose accumulators would not fit the registers; decode 8.
// Tensor cores (TensorReadProgram, 16-bit elements): 64 (32 at width 256, whose tiles would
// not fit an sm_80's shared memory) and 16 (one warp's mma rows).
template <class Stored, int kD>
inline constexpr int kPrefillRows =
    (is_half_bits_v<Stored> ? 64 : sizeof(Stored) == 4 ? 64 : 32) / (kD > 128 ? 2 : 1);
template <class Stored>
inline constexpr int kDecodeRows = is_half_bits_v<Stored> ? 16 : 8;

template <class Stored>
int prefill_rows(Index width) {
  return padded_width(width) > 128 ? kPrefillRows<Stored, 256> : kPrefillRows<Stored, 128>;
}

// How a read is launched. A read whose stacked rows (queries x group) fit one decode tile is a
// decode; any other read tiles its rows by prefill_rows. A decode always splits its merge blocks
// across thread blocks (grid.z), and so does a prefill of fewer tiles than fill the device
// (parallel_blocks, 0 if unknown): block z folds the tile's merge block z, and MergeProgram
// merges the partials from the workspace in order, the same bits as one block folding them all
// (loop mode).
struct ReadPlan {
  bool decode = false;
  int tiles = 1;
  int splits = 1;
  std::size_t workspace_scalars = 0;
  std::size_t arrival_counters = 0;  // a decode's: one per (state, tile)
};

// max_slots: an upper bound of the key slots the read can see (memory rows + local rows).
// Stored: the element of the rows read (float, double, or 16-bit bits). The workspace holds
// the split partial states, in the arithmetic's scalars (float for 16-bit elements).
template <class Stored>
ReadPlan plan_read(Index states, Index group, Index n_queries, Index width, Index max_slots,
                   Index parallel_blocks = 0) {
  ReadPlan plan;
  constexpr int kDecode = kDecodeRows<Stored>;
  plan.decode = n_queries * group <= kDecode;
  const int rows = plan.decode ? kDecode : prefill_rows<Stored>(width);
  const QueryTiling qt = QueryTiling::make(group, n_queries, rows);
  plan.tiles = static_cast<int>(qt.tiles());
  // Slots start at pad < kBlockKeys: the blocks a read touches (a split read: at least two, so
  // that its programs run in split mode).
  const Index blocks = std::max<Index>((max_slots + kBlockKeys - 1) / kBlockKeys + 1, 2);
  const bool small_grid = static_cast<Index>(plan.tiles) * states < parallel_blocks;
  if (plan.decode || (small_grid && max_slots > kBlockKeys)) {
    plan.splits = static_cast<int>(blocks);
    plan.workspace_scalars = static_cast<std::size_t>(states) * plan.tiles * plan.splits * rows *
                             (padded_width(width) + 2);
  }
  if (plan.decode) plan.arrival_counters = static_cast<std::size_t>(states) * plan.tiles;
  return plan;
}

// arrivals: a decode's per-(state, tile) arrival counters (plan.arrival_counters of them, all 0),
// with which its last blocks merge the tiles themselves; null: a MergeProgram launch merges.
template <class Backend, class Scalar, class Stored>
void launch_read(ReadParams<Scalar, Stored> p, const ReadPlan& plan, Scalar* workspace,
                 typename Backend::Stream stream, std::int64_t* arrivals = nullptr) {
  if (p.n_queries == 0 || p.states == 0) return;
  p.arrivals = plan.decode ? arrivals : nullptr;
  // The decode programs fold one merge block a block: they run split only.
  ovq::detail::require(!plan.decode || plan.splits > 1, "launch_read", "a decode plan has ",
                       plan.splits, " splits, expected at least 2");
  p.tiles = plan.tiles;
  p.splits = plan.splits;
  p.partials = workspace;
  dispatch_width(std::max(p.dk, p.dv), [&](auto width) {
    constexpr int kD = decltype(width)::value;
    const int states = static_cast<int>(p.states);
    const Grid grid{plan.tiles, states, plan.splits}, merge{plan.tiles, states, 1};
    constexpr int kDecode = kDecodeRows<Stored>;
    constexpr int kPrefill = kPrefillRows<Stored, kD>;
    if constexpr (is_half_bits_v<Stored>) {
      if (plan.decode) {
        if constexpr (kD <= 128) {
          Backend::template launch<TensorDecodeProgram<Stored, kD>>(grid, p, stream);
          if (p.arrivals == nullptr)
            Backend::template launch<MergeProgram<Scalar, kD, kDecode, Stored>>(merge, p, stream);
        } else {
          Backend::template launch<TensorReadProgram<Stored, kD, kDecode>>(grid, p, stream);
          Backend::template launch<MergeProgram<Scalar, kD, kDecode, Stored>>(merge, p, stream);
        }
      } else {
        Backend::template launch<TensorReadProgram<Stored, kD, kPrefill>>(grid, p, stream);
        if (plan.splits > 1)
          Backend::template launch<MergeProgram<Scalar, kD, kPrefill, Stored>>(merge, p, stream);
      }
    } else if (plan.decode) {
      Backend::template launch<DecodeReadProgram<Scalar, kD, kDecode>>(grid, p, stream);
      if (p.arrivals == nullptr)
        Backend::template launch<MergeProgram<Scalar, kD, kDecode>>(merge, p, stream);
    } else {
      Backend::template launch<ReadProgram<Scalar, kD, kPrefill>>(grid, p, stream);
      if (plan.splits > 1)
        Backend::template launch<MergeProgram<Scalar, kD, kPrefill>>(merge, p, stream);
    }
  });
}

}  // namespace ovq::cuda::kernels
