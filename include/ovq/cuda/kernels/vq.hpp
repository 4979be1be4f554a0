#pragma once
// VQ-attention's rows on a GPU (MATH.md section 3): a call's keys are assigned to their codes
// against the fixed codebook in one parallel pass (AssignProgram, offset -|C_s|^2 / 2), then
// VqPushProgram appends the codes, their codebook rows (the quantised keys the chunk's queries
// read) and the values to the pending chunk.
#include <cstdint>

#include "ovq/config.hpp"
#include "ovq/cuda/block.hpp"
#include "ovq/cuda/counters.hpp"
#include "ovq/cuda/kernels/read.hpp"

namespace ovq::cuda::kernels {

template <class Scalar>
struct VqPushParams {
  const Index* codes = nullptr;  // state s, row i: codes[s * rows + i] (AssignProgram's arg)
  Index rows = 0;
  HeadRows<Scalar> values;        // the call's values
  HeadRows<Scalar> codebook;      // state s, code c
  Index* pending_codes = nullptr;  // state s, row i: pending_codes[s * chunk + i]
  MutableHeadRows<Scalar> pending_keys, pending_values;
  Index chunk = 0;
  Index dk = 0, dv = 0;
  const StateCounters* counters = nullptr;
};

// Block (i, s): row i of state s.
template <class Scalar>
struct VqPushProgram {
  using Params = VqPushParams<Scalar>;
  static constexpr int kThreads = 128;
  static std::size_t shared_bytes(const Params&) { return 0; }

  template <class Block>
  OVQ_HOST_DEVICE static void run(Block& block, const Params& p, BlockIndex index) {
    const StateCounters& c = *p.counters;
    if (c.fault != 0 || c.pending + p.rows > p.chunk) return;
    const Index i = index.x, s = index.y;
    const Index slot = static_cast<Index>(c.pending) + i;
    const Index code = p.codes[s * p.rows + i];
    block.each([&](int t) {
      if (t == 0) p.pending_codes[s * p.chunk + slot] = code;
      const Scalar* key = p.codebook.row(s, code);
      const Scalar* value = p.values.row(s, i);
      Scalar* kd = p.pending_keys.row(s, slot);
      Scalar* vd = p.pending_values.row(s, slot);
      for (Index col = t; col < p.dk; col += kThreads) kd[col] = key[col];
      for (Index col = t; col < p.dv; col += kThreads) vd[col] = value[col];
    });
  }
};

}  // namespace ovq::cuda::kernels
