#pragma once
// The VQ write: one complete chunk's codes and values into the per-code counts and mean values
// (MATH.md section 3), as the group and update phases of kernels/update.hpp. The codebook (the
// dictionary's keys) never changes.
// Shapes: codes (L), V (L x dv). Cost: O(L dv).
#include "ovq/kernels/update.hpp"
#include "ovq/state/dictionary.hpp"

namespace ovq::kernels {

// `groups` is scratch (kept by the caller to reuse its storage).
template <class Element>
void vq_write_chunk(Dictionary<Element>& dict, const Index* codes, ConstRowsView<Element> values,
                    AssignmentGroups& groups) {
  const DictionaryRows<Element> rows = dict.rows();
  groups.build(codes, values.rows, dict.size());
  scatter_mean_update<Element>(rows.mean_values, dict.counts(), groups, values,
                               UpdateRate::adaptive());
  add_group_counts(rows, groups);
  publish_groups(rows, groups);
}

}  // namespace ovq::kernels
