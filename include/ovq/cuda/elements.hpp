#pragma once
// The element types of the device mixers: the CPU's (float, double, ovq::bf16, ovq::fp16), and
// what their kernels store for each (the same, or the 16-bit bits of kernels/half.hpp: Eigen's
// 16-bit types are host code). A view of ovq::bf16 rows and one of Bf16Bits rows are the same
// bytes.
#include <type_traits>

#include "ovq/core/types.hpp"
#include "ovq/cuda/kernels/half.hpp"
#include "ovq/cuda/views.hpp"

namespace ovq::cuda {

template <class Element>
struct DeviceElement {
  using type = Element;
};
template <>
struct DeviceElement<bf16> {
  using type = Bf16Bits;
};
template <>
struct DeviceElement<fp16> {
  using type = Fp16Bits;
};
template <class Element>
using device_element_t = typename DeviceElement<Element>::type;

static_assert(sizeof(bf16) == sizeof(Bf16Bits) && sizeof(fp16) == sizeof(Fp16Bits) &&
                  std::is_trivially_copyable_v<bf16> && std::is_trivially_copyable_v<fp16>,
              "a 16-bit element is its 16 bits");

// The same rows seen with the kernels' element type.
template <class Element>
HeadsView<device_element_t<Element>> stored(HeadsView<Element> x) {
  return {reinterpret_cast<device_element_t<Element>*>(x.data), x.heads, x.rows, x.cols,
          x.head_stride, x.row_stride};
}
template <class Element>
HeadsView<const device_element_t<Element>> stored(HeadsView<const Element> x) {
  return {reinterpret_cast<const device_element_t<Element>*>(x.data), x.heads, x.rows, x.cols,
          x.head_stride, x.row_stride};
}

}  // namespace ovq::cuda
