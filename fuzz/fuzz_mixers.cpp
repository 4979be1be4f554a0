// Fuzz target: the public mixer API on float and double mixers (fuzz_mixers.hpp: the driver and
// the oracle). The first four bytes seed the value stream; the next one's low bit picks double.
#include "fuzz_mixers.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  Input in(data, size);
  in.seed_stream(size);
  Trace trace;
  if (in.flag()) {
    run_scalar<double>(in, trace);
  } else {
    run_scalar<float>(in, trace);
  }
  return 0;
}
