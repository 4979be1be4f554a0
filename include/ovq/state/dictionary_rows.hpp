#pragma once
// The storage of a dictionary (VQ's codebook with its mean values, OVQ's online centroids) as
// plain views, in host or device memory: what the write phases (kernels/seed.hpp,
// kernels/update.hpp) and the CUDA write kernels work on. No Eigen.
#include <cmath>
#include <cstdint>

#include "ovq/config.hpp"
#include "ovq/core/views.hpp"

namespace ovq {

template <class Scalar>
struct DictionaryRows {
  RowsView<Scalar> keys;            // capacity x dk (D_k, or the codebook)
  RowsView<Scalar> values;          // capacity x dv (D_v, or the mean values)
  std::int64_t* counts = nullptr;   // capacity
  Scalar* log_counts = nullptr;     // capacity: the read bias, -inf for a count of 0
};

// log(c) of the exact integer, in double, then rounded once to Scalar; -inf for 0.
template <class Scalar>
OVQ_HOST_DEVICE Scalar log_count(std::int64_t c) {
  return c > 0 ? static_cast<Scalar>(std::log(static_cast<double>(c))) : -Scalar(INFINITY);
}

template <class Scalar>
OVQ_HOST_DEVICE void set_count(const DictionaryRows<Scalar>& d, Index r, std::int64_t c) {
  d.counts[r] = c;
  d.log_counts[r] = log_count<Scalar>(c);
}

}  // namespace ovq
