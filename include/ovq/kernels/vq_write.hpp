#pragma once
// The VQ write: one complete chunk's codes and values into the per-code counts and mean values
// (MATH.md section 3), as the group and update phases of kernels/update.hpp. The codebook (the
// dictionary's keys) never changes.
// Shapes: codes (L), V (L x dv). Cost: O(L dv).
#include "ovq/kernels/update.hpp"
#include "ovq/state/dictionary.hpp"

namespace ovq::kernels {

// `groups` is scratch (kept by the caller to reuse its storage).
template <class Scalar>
void vq_write_chunk(Dictionary<Scalar>& dict, const Index* codes, ConstRowsView<Scalar> values,
                    AssignmentGroups& groups) {
  groups.build(codes, values.rows, dict.size());
  scatter_mean_update<Scalar>(dict.values(), dict.counts(), groups, values,
                              UpdateRate::adaptive());
  add_group_counts(dict.rows(), groups);
}

}  // namespace ovq::kernels
