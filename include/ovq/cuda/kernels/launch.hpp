#pragma once
// Launch planning shared by the device mixers: head widths as compile-time constants, and the
// read's tile choice (prefill or decode), grid and workspace.
#include <algorithm>
#include <cstddef>
#include <type_traits>

#include "ovq/core/error.hpp"
#include "ovq/cuda/block.hpp"
#include "ovq/cuda/kernels/read.hpp"

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

// Stacked rows of a prefill tile (float 64, double 32; half that at width 256, whose
// accumulators would not fit the registers) and of a decode tile.
template <class Scalar, int kD>
inline constexpr int kPrefillRows = (sizeof(Scalar) == 4 ? 64 : 32) / (kD > 128 ? 2 : 1);
inline constexpr int kDecodeRows = 8;

// How a read is launched. A read whose stacked rows (queries x group) fit one decode tile is a
// decode: its merge blocks are split across thread blocks (grid.z) and merged by MergeProgram
// from the workspace; any other read folds every block in its own thread block.
struct ReadPlan {
  bool decode = false;
  int tiles = 1;
  int splits = 1;
  std::size_t workspace_scalars = 0;
};

// max_slots: an upper bound of the key slots the read can see (memory rows + local rows).
inline ReadPlan plan_read(Index states, Index group, Index n_queries, Index width,
                          Index max_slots, bool double_precision) {
  ReadPlan plan;
  const int narrow = double_precision ? kPrefillRows<double, 128> : kPrefillRows<float, 128>;
  const int rows = padded_width(width) > 128 ? narrow / 2 : narrow;
  plan.decode = n_queries * group <= kDecodeRows;
  const QueryTiling qt = QueryTiling::make(group, n_queries, plan.decode ? kDecodeRows : rows);
  plan.tiles = static_cast<int>(qt.tiles());
  if (plan.decode) {
    // Slots start at pad < kBlockKeys: the blocks a read touches.
    plan.splits = static_cast<int>((max_slots + kBlockKeys - 1) / kBlockKeys + 1);
    plan.workspace_scalars = static_cast<std::size_t>(states) * plan.tiles * plan.splits *
                             kDecodeRows * (padded_width(width) + 2);
  }
  return plan;
}

template <class Backend, class Scalar>
void launch_read(ReadParams<Scalar> p, const ReadPlan& plan, Scalar* workspace,
                 typename Backend::Stream stream) {
  if (p.n_queries == 0 || p.states == 0) return;
  p.tiles = plan.tiles;
  p.splits = plan.decode ? plan.splits : 1;
  p.partials = workspace;
  dispatch_width(std::max(p.dk, p.dv), [&](auto width) {
    constexpr int kD = decltype(width)::value;
    const int states = static_cast<int>(p.states);
    if (plan.decode) {
      Backend::template launch<ReadProgram<Scalar, kD, kDecodeRows>>(
          Grid{plan.tiles, states, plan.splits}, p, stream);
      Backend::template launch<MergeProgram<Scalar, kD, kDecodeRows>>(
          Grid{plan.tiles, states, 1}, p, stream);
    } else {
      Backend::template launch<ReadProgram<Scalar, kD, kPrefillRows<Scalar, kD>>>(
          Grid{plan.tiles, states, 1}, p, stream);
    }
  });
}

}  // namespace ovq::cuda::kernels
