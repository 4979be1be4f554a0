#pragma once
// The storage of a dictionary (VQ's codebook with its mean values, OVQ's online centroids) as
// plain views, in host or device memory: what the write phases (kernels/seed.hpp,
// kernels/update.hpp) and the CUDA write kernels work on. No Eigen.
//
// A dictionary of 16-bit elements keeps its running means in float (mean_keys, mean_values)
// apart from the 16-bit rows the reads stream (keys, values): once a count is in the hundreds an
// update (x - D) / c is smaller than half a 16-bit ulp of D, so rounding the means themselves
// would freeze them. The read rows are the means rounded, refreshed whenever a mean changes.
// For float and double the two are the same rows.
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "ovq/config.hpp"
#include "ovq/core/views.hpp"

namespace ovq {

template <class Element>
struct DictionaryRows {
  using Compute = compute_t<Element>;
  static constexpr bool kSeparateMeans = !std::is_same_v<Element, Compute>;

  RowsView<Element> keys;            // capacity x dk: what the reads see (D_k, or the codebook)
  RowsView<Element> values;          // capacity x dv (D_v, or the mean values)
  RowsView<Compute> mean_keys;       // capacity x dk: the running means (= keys when not separate)
  RowsView<Compute> mean_values;     // capacity x dv
  std::int64_t* counts = nullptr;    // capacity
  Compute* log_counts = nullptr;     // capacity: the read bias, -inf for a count of 0
};

// The rows of a dictionary of float or double elements: the means are the rows.
template <class Scalar>
OVQ_HOST_DEVICE DictionaryRows<Scalar> dictionary_rows(RowsView<Scalar> keys,
                                                       RowsView<Scalar> values,
                                                       std::int64_t* counts, Scalar* log_counts) {
  return {keys, values, keys, values, counts, log_counts};
}

// log(c) of the exact integer, in double, then rounded once to Scalar; -inf for 0.
template <class Scalar>
OVQ_HOST_DEVICE Scalar log_count(std::int64_t c) {
  return c > 0 ? static_cast<Scalar>(std::log(static_cast<double>(c))) : -Scalar(INFINITY);
}

template <class Element>
OVQ_HOST_DEVICE void set_count(const DictionaryRows<Element>& d, Index r, std::int64_t c) {
  d.counts[r] = c;
  d.log_counts[r] = log_count<compute_t<Element>>(c);
}

}  // namespace ovq
