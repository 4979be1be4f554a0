#pragma once
// Views of batched tensors in device memory: heads x rows x cols, row-major within a head,
// like a (B, H, T, d) PyTorch tensor seen as (B H) heads (head_stride T d, row_stride d).
// Nothing here owns memory; the mixers read and write through them in place.
#include <type_traits>

#include "ovq/config.hpp"
#include "ovq/core/views.hpp"

namespace ovq::cuda {

template <class Scalar>
struct HeadsView {
  Scalar* data = nullptr;
  Index heads = 0;
  Index rows = 0;  // tokens per head
  Index cols = 0;
  Index head_stride = 0;
  Index row_stride = 0;

  OVQ_HOST_DEVICE Scalar* row(Index h, Index r) const {
    return data + h * head_stride + r * row_stride;
  }
  // Rows [first, first + count) of every head.
  OVQ_HOST_DEVICE HeadsView middle_rows(Index first, Index count) const {
    return {data + first * row_stride, heads, count, cols, head_stride, row_stride};
  }
  // The same rows as read-only (a view of mutable rows only: a const view already is one).
  template <class S = Scalar, class = std::enable_if_t<!std::is_const_v<S>>>
  OVQ_HOST_DEVICE operator HeadsView<const S>() const {
    return {data, heads, rows, cols, head_stride, row_stride};
  }
};

template <class Scalar>
using ConstHeadsView = HeadsView<const Scalar>;

// A contiguous (heads, rows, cols) tensor.
template <class Scalar>
HeadsView<Scalar> contiguous_heads(Scalar* data, Index heads, Index rows, Index cols) {
  return {data, heads, rows, cols, rows * cols, cols};
}

}  // namespace ovq::cuda
