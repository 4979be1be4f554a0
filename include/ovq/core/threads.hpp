#pragma once
// Threading rules. ovq parallelises with OpenMP only when the consumer compiles with it, and
// only at one level: over states (MultiHead) or over query tiles (the read), never both, and
// never through Eigen, whose own parallel products would nest inside ours or, on small tiles,
// spend more on waking threads than on the product.
#include "ovq/config.hpp"

namespace ovq::detail {

// While alive, Eigen products issued by this thread run on one thread (Eigen asks OpenMP for
// its thread count, and this sets the calling thread's count only). A consumer that called
// Eigen::setNbThreads() explicitly keeps its own choice.
class SerialEigenScope {
 public:
  SerialEigenScope() {
#if defined(OVQ_HAS_OPENMP)
    saved_ = omp_get_max_threads();
    omp_set_num_threads(1);
#endif
  }
  ~SerialEigenScope() {
#if defined(OVQ_HAS_OPENMP)
    omp_set_num_threads(saved_);
#endif
  }
  SerialEigenScope(const SerialEigenScope&) = delete;
  SerialEigenScope& operator=(const SerialEigenScope&) = delete;

 private:
  [[maybe_unused]] int saved_ = 1;  // read only with OpenMP
};

// Whether a parallel loop over `work_flops` of work may start a thread team here: not inside
// another parallel region, and only for work large enough to pay for waking the threads.
inline bool worth_parallel(double work_flops) {
#if defined(OVQ_HAS_OPENMP)
  return !omp_in_parallel() && omp_get_max_threads() > 1 && work_flops >= 4.0e6;
#else
  (void)work_flops;
  return false;
#endif
}

}  // namespace ovq::detail
