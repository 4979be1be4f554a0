// Fuzz target: the public mixer API on 16-bit mixers (fuzz_mixers.hpp: the driver and the
// oracle): bf16 and fp16 inputs, caches, dictionaries and codebooks, computed in float. The first
// four bytes seed the value stream; the next one picks the element (low bit: bf16) and, for bf16
// where the compiler targets AMX, the kernels (bit 1: arch::amx, whose tiles are used where the
// process may use them); the rest is read as by fuzz_mixers.
#include "fuzz_mixers.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  Input in(data, size);
  in.seed_stream(size);
  Trace trace;
  const std::uint8_t element = in.byte();
  if ((element & 1u) == 0) {
    run_scalar<fp16>(in, trace);
  } else if constexpr (arch::is_available_v<arch::amx>) {
    if ((element & 2u) != 0) {
      run_scalar<bf16, arch::amx>(in, trace);
    } else {
      run_scalar<bf16>(in, trace);
    }
  } else {
    run_scalar<bf16>(in, trace);
  }
  return 0;
}
