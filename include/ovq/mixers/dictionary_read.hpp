#pragma once
// The read of the two dictionary mixers, VQ- and OVQ-attention: rows [pos, pos + len) of every
// query head read the dictionary (memory rows, bias log count, or 0 without the count bias) and
// then the raw rows of the current chunk, causally, the first of them at chunk position `offset`.
#include <vector>

#include "ovq/core/types.hpp"
#include "ovq/kernels/executor.hpp"
#include "ovq/mixers/mixer_base.hpp"
#include "ovq/state/dictionary.hpp"

namespace ovq::detail {

template <class Scalar, class Arch>
void read_dictionary_and_chunk(const Dictionary<Scalar>& dict, ConstRowsView<Scalar> chunk_keys,
                               ConstRowsView<Scalar> chunk_values, Index offset,
                               const ConstRowsView<Scalar>* q, Index heads, Index pos, Index len,
                               compute_t<Scalar> beta, const RowsView<Scalar>* o,
                               compute_t<Scalar>* const* lse, bool count_bias = true,
                               const compute_t<Scalar>* head_betas = nullptr) {
  std::vector<compute_t<Scalar>> bias;
  const kernels::MemoryRows<Scalar> memory{dict.keys(), dict.values(),
                                           dict.read_bias(count_bias, bias)};
  const kernels::LocalRows<Scalar> local{chunk_keys, chunk_values};
  const kernels::ReadMask mask{true, offset, 0};
  const std::vector<compute_t<Scalar>*> lse_rows =
      lse == nullptr ? std::vector<compute_t<Scalar>*>() : offset_rows(lse, heads, pos);
  kernels::Executor<Scalar, Arch>::read(slice_heads(q, heads, pos, len).data(), heads, memory,
                                        local, mask, beta, slice_heads(o, heads, pos, len).data(),
                                        lse == nullptr ? nullptr : lse_rows.data(), head_betas);
}

}  // namespace ovq::detail
