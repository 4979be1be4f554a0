#pragma once
// Carving one workspace allocation into the arrays of a call (each 256-byte aligned).
#include <cstddef>

#include "ovq/core/views.hpp"

namespace ovq::cuda::detail {

class WorkspaceLayout {
 public:
  // Reserves `count` entries of T; returns their byte offset.
  template <class T>
  std::size_t add(std::size_t count) {
    const std::size_t offset = (bytes_ + 255) / 256 * 256;
    bytes_ = offset + count * sizeof(T);
    return offset;
  }
  std::size_t bytes() const { return bytes_; }

  template <class T>
  static T* at(void* base, std::size_t offset) {
    return reinterpret_cast<T*>(static_cast<unsigned char*>(base) + offset);
  }

 private:
  std::size_t bytes_ = 0;
};

// A chunk's assignment and the dictionary write's grouping of it (VQ and OVQ), over `rows`
// pending rows (heads x chunk): each row's best score and centroid, the partial bests of a
// split assignment (`splits` centroid ranges a row; none unsplit), and the grouping's scratch.
template <class Compute>
struct AssignWorkspace {
  std::size_t best = 0, arg = 0, part_best = 0, part_arg = 0, part_nan = 0, picked = 0,
              order = 0, group_end = 0;
  int splits = 1;

  static AssignWorkspace add(WorkspaceLayout& layout, std::size_t rows, int splits) {
    AssignWorkspace w;
    w.splits = splits;
    const std::size_t parts = splits > 1 ? rows * static_cast<std::size_t>(splits) : 0;
    w.best = layout.add<Compute>(rows);
    w.arg = layout.add<Index>(rows);
    w.part_best = layout.add<Compute>(parts);
    w.part_arg = layout.add<Index>(parts);
    w.part_nan = layout.add<unsigned char>(parts);
    w.picked = layout.add<unsigned char>(rows);
    w.order = layout.add<Index>(rows);
    w.group_end = layout.add<Index>(rows);
    return w;
  }
  // The assignment's outputs and scratch in its parameters (kernels::AssignParams).
  template <class Params>
  void set_assign(Params& a, void* ws) const {
    a.best = WorkspaceLayout::at<Compute>(ws, best);
    a.arg = WorkspaceLayout::at<Index>(ws, arg);
    a.splits = splits;
    a.part_best = WorkspaceLayout::at<Compute>(ws, part_best);
    a.part_arg = WorkspaceLayout::at<Index>(ws, part_arg);
    a.part_nan = WorkspaceLayout::at<unsigned char>(ws, part_nan);
  }
  // The grouping's scratch in the write's parameters (kernels::DictionaryWriteParams).
  template <class Params>
  void set_grouping(Params& d, void* ws) const {
    d.picked = WorkspaceLayout::at<unsigned char>(ws, picked);
    d.order = WorkspaceLayout::at<Index>(ws, order);
    d.group_end = WorkspaceLayout::at<Index>(ws, group_end);
  }
};

}  // namespace ovq::cuda::detail
