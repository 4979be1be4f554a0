#pragma once
// Matrices and vectors of the public API, and the bridges between them and the row views the
// kernels work on (core/views.hpp).
//
// Everything is row-major (tokens x features): a token is one contiguous row, as in NumPy and
// PyTorch. Public entry points take Eigen::Ref, so a row-major Eigen matrix, a block of one, or an
// Eigen::Map over the caller's buffer is read in place, without a copy.
#include <Eigen/Core>
#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "ovq/config.hpp"
#include "ovq/core/views.hpp"

namespace ovq {

template <class Scalar>
using RowMatrix = Eigen::Matrix<Scalar, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
template <class Scalar>
using RowVector = Eigen::Matrix<Scalar, 1, Eigen::Dynamic>;

template <class Scalar>
using ConstMatrixRef = Eigen::Ref<const RowMatrix<Scalar>, 0, Eigen::OuterStride<>>;
template <class Scalar>
using MatrixRef = Eigen::Ref<RowMatrix<Scalar>, 0, Eigen::OuterStride<>>;
template <class Scalar>
using ConstVectorRef = Eigen::Ref<const RowVector<Scalar>>;
template <class Scalar>
using VectorRef = Eigen::Ref<RowVector<Scalar>>;

// Scratch storage of the SIMD kernels, aligned for Eigen's widest vector (EIGEN_MAX_ALIGN_BYTES:
// 32 bytes with AVX, 64 with AVX-512), as Eigen's own matrices are. std::vector's 16 bytes left
// it to the allocator whether a vector load from a row of the buffer straddled two cache lines:
// stacked query rows at an address 16 mod 32 made half the score block's query loads split
// loads, and the same kernel ran at different speeds from run to run.
template <class T>
using AlignedVector = std::vector<T, Eigen::aligned_allocator<T>>;

// ---- element types ----
//
// A mixer, its inputs, outputs and states are typed by their storage element: float, double, or
// a 16-bit type (bf16: bfloat16, 8 exponent bits like float and 8 significant bits; fp16: IEEE
// half, 5 exponent bits, 11 significant bits). A 16-bit element is computed in float: softmax,
// accumulation, linear attention's sums, the dictionaries' running means and the counts never
// round to 16 bits; only what is stored and read back is (keys, values, caches, dictionary rows
// as the reads see them, outputs).
using bf16 = Eigen::bfloat16;
using fp16 = Eigen::half;

template <class Scalar>
inline constexpr bool is_supported_scalar_v =
    std::is_same_v<Scalar, float> || std::is_same_v<Scalar, double>;

template <class Element>
inline constexpr bool is_half_v = std::is_same_v<Element, bf16> || std::is_same_v<Element, fp16>;

// The storage elements a mixer takes.
template <class Element>
inline constexpr bool is_element_v = is_supported_scalar_v<Element> || is_half_v<Element>;

// The 16-bit elements are computed in float (compute_t, core/views.hpp).
template <>
struct ComputeOf<bf16> {
  using type = float;
};
template <>
struct ComputeOf<fp16> {
  using type = float;
};

// An element widened to its compute type (exact), and a compute value rounded to an element
// (to nearest, ties to even).
template <class Element>
inline compute_t<Element> widen(Element x) {
  return static_cast<compute_t<Element>>(x);
}
template <class Element>
inline Element narrow(compute_t<Element> x) {
  return static_cast<Element>(x);
}

// The largest finite value of an element type, in its compute type.
template <class Element>
inline compute_t<Element> largest_finite() {
  return static_cast<compute_t<Element>>(Eigen::NumTraits<Element>::highest());
}

// The name of an element type in messages and files.
template <class Element>
constexpr const char* element_name() {
  if constexpr (std::is_same_v<Element, float>) return "float32";
  if constexpr (std::is_same_v<Element, double>) return "float64";
  if constexpr (std::is_same_v<Element, fp16>) return "float16";
  if constexpr (std::is_same_v<Element, bf16>) return "bfloat16";
  return "?";
}

template <class Derived>
auto rows_view(const Eigen::DenseBase<Derived>& m)
    -> ConstRowsView<typename Derived::Scalar> {
  static_assert(Derived::IsRowMajor || Derived::ColsAtCompileTime == 1 ||
                    Derived::RowsAtCompileTime == 1,
                "ovq works on row-major matrices");
  const auto& d = m.derived();
  return {d.data(), d.rows(), d.cols(), d.rows() > 1 ? d.outerStride() : d.cols()};
}

template <class Derived>
auto rows_view(Eigen::DenseBase<Derived>& m) -> RowsView<typename Derived::Scalar> {
  static_assert(Derived::IsRowMajor || Derived::ColsAtCompileTime == 1 ||
                    Derived::RowsAtCompileTime == 1,
                "ovq works on row-major matrices");
  auto& d = m.derived();
  return {d.data(), d.rows(), d.cols(), d.rows() > 1 ? d.outerStride() : d.cols()};
}

// Eigen views over a RowsView, for the tile-level GEMMs of the portable kernels.
template <class Scalar>
using StridedMap = Eigen::Map<RowMatrix<Scalar>, 0, Eigen::OuterStride<>>;
template <class Scalar>
using ConstStridedMap = Eigen::Map<const RowMatrix<Scalar>, 0, Eigen::OuterStride<>>;

template <class Scalar>
StridedMap<Scalar> as_eigen(const RowsView<Scalar>& v) {
  return StridedMap<Scalar>(v.data, v.rows, v.cols, Eigen::OuterStride<>(v.stride));
}
template <class Scalar>
ConstStridedMap<Scalar> as_eigen(const RowsView<const Scalar>& v) {
  return ConstStridedMap<Scalar>(v.data, v.rows, v.cols, Eigen::OuterStride<>(v.stride));
}

// Row i of a view as an Eigen row vector (for dot products and norms).
template <class Scalar>
Eigen::Map<const RowVector<Scalar>> row_map(const RowsView<const Scalar>& v, Index i) {
  return Eigen::Map<const RowVector<Scalar>>(v.row(i), v.cols);
}
template <class Scalar>
Eigen::Map<RowVector<Scalar>> row_map(const RowsView<Scalar>& v, Index i) {
  return Eigen::Map<RowVector<Scalar>>(v.row(i), v.cols);
}

}  // namespace ovq
