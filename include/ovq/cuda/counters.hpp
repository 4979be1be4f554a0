#pragma once
// The bookkeeping of a device state, kept in device memory next to its rows: every kernel reads
// the sizes it works on from here, and the kernels that change a state update it. So a captured
// CUDA graph (a decode step replayed many times) always works on the state as it is now, not as
// it was when captured. One record per batched state: all its heads advance together.
#include <cstdint>

#include "ovq/config.hpp"

namespace ovq::cuda {

struct StateCounters {
  std::int64_t tokens = 0;    // tokens seen by the state
  std::int64_t absorbed = 0;  // tokens folded into its summary (complete chunks); cache: 0
  std::int64_t size = 0;      // rows held: cache rows, dictionary rows n
  std::int64_t pending = 0;   // rows of the current, incomplete chunk
  std::int64_t schedule = 0;  // OVQ: the next entry of its growth schedule
  std::int64_t fault = 0;     // Fault bits: a call that could not be carried out changed nothing
  std::int64_t arrivals = 0;  // blocks of a chunk write done so far (0 between launches)
};

// Why a call left its state as it was (reported by the host at the next synchronising call).
enum Fault : std::int64_t {
  kFaultNone = 0,
  kFaultNonFinite = 1,  // a K or V entry (or Q) was not finite
  kFaultCapacity = 2,   // a KV cache had no room left for the step's row
};

}  // namespace ovq::cuda
