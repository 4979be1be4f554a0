#pragma once
// The non-owning row views every kernel works on, without Eigen: the same struct describes rows
// in host memory (CPU kernels) and in device memory (CUDA kernels).
//
// A view is a strided block of rows: row i starts at data + i * stride, and holds `cols` entries.
// Everything is row-major (tokens x features): a token is one contiguous row, as in NumPy and
// PyTorch.
#include <cstddef>
#include <type_traits>

#include "ovq/config.hpp"

namespace ovq {

using Index = std::ptrdiff_t;

template <class Scalar>
struct RowsView {
  Scalar* data = nullptr;
  Index rows = 0;
  Index cols = 0;
  Index stride = 0;

  OVQ_HOST_DEVICE Scalar* row(Index i) const { return data + i * stride; }
  OVQ_HOST_DEVICE RowsView middle_rows(Index first, Index count) const {
    return {data + first * stride, count, cols, stride};
  }
  // A view of the same rows as read-only (of mutable rows only: a const view already is one).
  template <class S = Scalar, class = std::enable_if_t<!std::is_const_v<S>>>
  OVQ_HOST_DEVICE operator RowsView<const S>() const {
    return {data, rows, cols, stride};
  }
};

template <class Scalar>
using ConstRowsView = RowsView<const Scalar>;

// The type an element is computed in: itself, except for the 16-bit elements, whose
// specialisations (float) are in core/types.hpp.
template <class Element>
struct ComputeOf {
  using type = Element;
};
template <class Element>
using compute_t = typename ComputeOf<Element>::type;

}  // namespace ovq
