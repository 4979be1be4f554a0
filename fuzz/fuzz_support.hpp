#pragma once
// What the fuzz targets share: a reader that turns fuzz bytes into decisions, and the check that
// fails a run.
//
// A failed check prints "fuzz finding: ..." and aborts, which libFuzzer reports as a crash (with
// the input saved as an artifact) and which fails the corpus replay test.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <string>
#include <type_traits>
#include <utility>

#include "ovq/core/error.hpp"
#include "ovq/core/types.hpp"

namespace ovq::fuzz {

template <class State, class = void>
struct keeps_pending_rows : std::false_type {};
template <class State>
struct keeps_pending_rows<State, std::void_t<decltype(std::declval<const State&>().pending())>>
    : std::true_type {};

// Tokens that complete the current chunk of a state that keeps its rows pending (linear, VQ and
// OVQ attention); `otherwise` for one that keeps none (self-attention).
template <class State>
Index tokens_to_boundary(const State& state, Index chunk, Index otherwise) {
  if constexpr (keeps_pending_rows<State>::value) {
    return chunk - state.pending();
  } else {
    (void)state;
    return otherwise;
  }
}

[[noreturn]] inline void fail(const char* file, int line, const std::string& what) {
  std::fprintf(stderr, "%s:%d: fuzz finding: %s\n", file, line, what.c_str());
  std::fflush(stderr);
  std::abort();
}

// Checks `cond`; the message parts are streamed into the report.
#define OVQ_FUZZ_CHECK(cond, ...)                                                   \
  do {                                                                              \
    if (!(cond)) {                                                                  \
      ::ovq::fuzz::fail(__FILE__, __LINE__,                                         \
                        ::ovq::detail::concat("(" #cond ") ", __VA_ARGS__));        \
    }                                                                               \
  } while (0)

// Whether OVQ_FUZZ_TRACE=1 asks for what each input does as it runs.
inline bool trace_enabled() {
  static const bool on = [] {
    const char* v = std::getenv("OVQ_FUZZ_TRACE");
    return v != nullptr && v[0] == '1';
  }();
  return on;
}

// What the input has done so far, for the report of a finding.
class Trace {
 public:
  template <class... Parts>
  void add(const Parts&... parts) {
    (text_ << ... << parts);
    text_ << '\n';
    if (trace_enabled()) {
      std::ostringstream line;
      (line << ... << parts);
      std::fprintf(stderr, "  %s\n", line.str().c_str());
    }
  }
  std::string str() const { return "\n-- what the input did:\n" + text_.str(); }

 private:
  std::ostringstream text_;
};

// Decisions from fuzz bytes. Once the bytes run out every read returns 0, so option lists put
// their ordinary value first: a short input means a plain run. Bulk data (matrix entries) comes
// from a splitmix64 stream seeded by the input instead, so a few bytes still give rich values.
class Input {
 public:
  Input(const std::uint8_t* data, std::size_t size) : data_(data), size_(size) {}

  std::size_t remaining() const { return size_ - pos_; }

  std::uint8_t byte() { return pos_ < size_ ? data_[pos_++] : 0; }
  bool flag() { return (byte() & 1u) != 0; }
  // True with probability about 1/n (n in 1..256), and false once the bytes run out.
  bool rarely(unsigned n) { return pos_ < size_ && byte() % n == n - 1; }

  std::uint32_t u32() {
    std::uint32_t v = 0;
    for (int i = 0; i < 4; ++i) v |= std::uint32_t(byte()) << (8 * i);
    return v;
  }
  std::uint64_t u64() { return std::uint64_t(u32()) | (std::uint64_t(u32()) << 32); }
  double f64_bits() {
    const std::uint64_t u = u64();
    double d;
    std::memcpy(&d, &u, sizeof d);
    return d;
  }
  float f32_bits() {
    const std::uint32_t u = u32();
    float f;
    std::memcpy(&f, &u, sizeof f);
    return f;
  }

  // A 16-bit element (bf16, fp16) with the bits of the next two bytes.
  template <class H>
  H f16_bits() {
    static_assert(sizeof(H) == 2, "a 16-bit element");
    const auto u = static_cast<std::uint16_t>(byte() | byte() << 8);
    H h;
    std::memcpy(static_cast<void*>(&h), &u, sizeof h);
    return h;
  }

  // An integer in [lo, hi] (hi - lo < 2^32).
  std::int64_t range(std::int64_t lo, std::int64_t hi) {
    const std::uint64_t span = static_cast<std::uint64_t>(hi - lo) + 1;
    const std::uint64_t v = span <= 256 ? byte() : (span <= 65536 ? (byte() | (byte() << 8)) : u32());
    return lo + static_cast<std::int64_t>(v % span);
  }

  template <class T, std::size_t N>
  T pick(const T (&options)[N]) {
    return options[byte() % N];
  }

  // splitmix64 over a seed taken from the input.
  void seed_stream(std::uint64_t salt) { stream_ = u32() ^ (salt * 0x9e3779b97f4a7c15ULL); }
  std::uint64_t next() {
    std::uint64_t z = (stream_ += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
  }
  // Uniform in [-1, 1).
  double uniform() { return static_cast<double>(next() >> 11) * 0x1.0p-52 - 1.0; }

 private:
  const std::uint8_t* data_;
  std::size_t size_;
  std::size_t pos_ = 0;
  std::uint64_t stream_ = 0;
};

}  // namespace ovq::fuzz
