// A signed overflow, for the sanitizer builds' test that UBSan's first finding stops the program
// (cmake/sanitizer_options.cpp): the test passes on UBSan's report and fails if this program
// gets past it.
#include <climits>
#include <cstdio>

int main(int argc, char**) {
  volatile int largest = INT_MAX;
  const int sum = largest + argc;  // argc >= 1: overflows
  std::printf("continued past the overflow: %d\n", sum);
  return 0;
}
