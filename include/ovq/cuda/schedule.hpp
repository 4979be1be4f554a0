#pragma once
// OVQ's growth on a device, planned on the host: how many rows each chunk opens depends only on
// (t, n) (MATH.md section 4, step 1), so the chunks that open rows, from a state's (t, n) until
// its dictionary is full, are listed once on the host, and a chunk write on the device looks up
// its entry (the state's counters point to the next one). Nothing is read back per chunk, and a
// captured decode step finds the right entry whenever it is replayed.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "ovq/kernels/seed.hpp"
#include "ovq/state/policies.hpp"

namespace ovq::cuda {

// Entries (chunk index, m), m > 0, in increasing chunk order: the chunk of stream tokens
// [c L, c L + L) opens m rows. At most `capacity` entries; found by bisection over the chunk
// index (the growth target never decreases), O(capacity log) evaluations of the schedule.
inline std::vector<std::int64_t> growth_schedule(const Growth& growth, Index capacity,
                                                 Index chunk, std::int64_t t, Index n) {
  std::vector<std::int64_t> entries;
  const std::int64_t last_chunk = (std::int64_t(1) << 62) / chunk - 1;  // t stays below 2^62
  auto opens = [&](std::int64_t c, Index size) {
    return ovq::kernels::centroids_to_open(growth, c * chunk, chunk, size, capacity);
  };
  std::int64_t c = t / chunk;
  while (n < capacity && c <= last_chunk) {
    if (opens(c, n) == 0) {
      // The first chunk after c that opens a row: double the step until one does, then bisect.
      std::int64_t lo = c, step = 1, hi = -1;
      while (hi < 0) {
        const std::int64_t probe = std::min(c + step, last_chunk);
        if (opens(probe, n) > 0) {
          hi = probe;
        } else {
          if (probe == last_chunk) return entries;
          lo = probe;
          step *= 2;
        }
      }
      while (hi - lo > 1) {
        const std::int64_t mid = lo + (hi - lo) / 2;
        (opens(mid, n) > 0 ? hi : lo) = mid;
      }
      c = hi;
    }
    const Index m = opens(c, n);
    entries.push_back(c);
    entries.push_back(m);
    n += m;
    ++c;
  }
  return entries;
}

}  // namespace ovq::cuda
