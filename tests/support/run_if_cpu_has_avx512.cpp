// Runs the program given on the command line when this CPU has the AVX-512 subsets that
// -march=x86-64-v4 lets the compiler use (F, CD, BW, DQ, VL); otherwise exits with 77, which
// CTest reports as skipped. This file is compiled for the baseline ISA, so the check itself runs
// anywhere, and the AVX-512 test binary is never started on a CPU that would fault on it.
#include <cstdio>

#include <unistd.h>

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s PROGRAM [ARGS...]\n", argv[0]);
    return 2;
  }
  __builtin_cpu_init();
  const bool has_avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512cd") &&
                          __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") &&
                          __builtin_cpu_supports("avx512vl");
  if (!has_avx512) {
    std::printf("skipped: this CPU lacks AVX-512 F/CD/BW/DQ/VL; %s was built, not run\n", argv[1]);
    return 77;
  }
  execv(argv[1], argv + 1);
  std::perror(argv[1]);
  return 2;
}
