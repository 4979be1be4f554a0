#pragma once
// The generator behind random seeding, shared by the host and the CUDA write so that both draw
// the same rows.
#include <cstdint>

#include "ovq/config.hpp"

namespace ovq::detail {

// splitmix64: a small, well-mixed generator; state-free draws keep streaming == chunked.
OVQ_HOST_DEVICE inline std::uint64_t splitmix64(std::uint64_t& x) {
  std::uint64_t z = (x += 0x9e3779b97f4a7c15ULL);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

}  // namespace ovq::detail
