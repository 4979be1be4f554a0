#pragma once
// Argument checks shared by every public entry point. Each one throws ovq::ArgumentError whose
// message names the entry point, the argument and what was expected. They run before any state
// is touched, which is what makes a failed call leave the state exactly as it was.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "ovq/core/error.hpp"
#include "ovq/core/types.hpp"

#if defined(OVQ_ARCH_AVX2)
#include <immintrin.h>
#endif

namespace ovq::detail {

inline void check_shape(const char* where, const char* name, Index rows, Index cols,
                        Index want_rows, Index want_cols) {
  if (rows != want_rows || cols != want_cols) {
    throw ArgumentError(concat(where, ": ", name, " has shape (", rows, ", ", cols,
                               "), expected (", want_rows, ", ", want_cols, ")"));
  }
}

inline void check_cols(const char* where, const char* name, Index cols, Index want_cols,
                       const char* what_cols) {
  if (cols != want_cols) {
    throw ArgumentError(concat(where, ": ", name, " has ", cols, " columns, expected ", want_cols,
                               " (", what_cols, ")"));
  }
}

inline void check_rows(const char* where, const char* name, Index rows, Index want_rows,
                       const char* what_rows) {
  if (rows != want_rows) {
    throw ArgumentError(concat(where, ": ", name, " has ", rows, " rows, expected ", want_rows,
                               " (", what_rows, ")"));
  }
}

// A value is finite unless its exponent bits are all ones (inf, NaN). Tested on the bits, so
// that the answer holds under -ffinite-math-only too.
template <class Scalar, class = void>
struct FloatBits;
template <class Scalar>
struct FloatBits<Scalar, std::enable_if_t<std::is_floating_point_v<Scalar>>> {
  static_assert(sizeof(Scalar) == 4 || sizeof(Scalar) == 8, "float or double");
  using Bits = std::conditional_t<sizeof(Scalar) == 4, std::uint32_t, std::uint64_t>;
  static constexpr Bits kExponent =
      sizeof(Scalar) == 4 ? Bits(0x7f800000u) : Bits(0x7ff0000000000000ull);
  static bool not_finite(Scalar x) {
    Bits bits;
    std::memcpy(&bits, &x, sizeof bits);
    return (bits & kExponent) == kExponent;
  }
};
template <class Scalar>
struct FloatBits<Scalar, std::enable_if_t<is_half_v<Scalar>>> {
  using Bits = std::uint16_t;
  static constexpr Bits kExponent = std::is_same_v<Scalar, bf16> ? Bits(0x7f80) : Bits(0x7c00);
  static bool not_finite(Scalar x) {
    Bits bits;
    std::memcpy(&bits, &x, sizeof bits);
    return (bits & kExponent) == kExponent;
  }
};

// Whether x[0, n) are all finite, without a branch per entry (a vector of exponent fields at a
// time on AVX2, 16-bit elements included): every call checks all of its inputs once, so this is
// on every call's path. Reference: all_finite_reference.
template <class Scalar>
bool all_finite(const Scalar* x, Index n) {
  using F = FloatBits<Scalar>;
  Index j = 0;
  bool any_bad = false;
#if defined(OVQ_ARCH_AVX2)
  constexpr Index kLanes = 32 / sizeof(Scalar);
  const auto exponent_is_full = [](__m256i bits) {
    if constexpr (sizeof(Scalar) == 2) {
      const __m256i e = _mm256_set1_epi16(static_cast<short>(F::kExponent));
      return _mm256_cmpeq_epi16(_mm256_and_si256(bits, e), e);
    } else if constexpr (sizeof(Scalar) == 4) {
      const __m256i e = _mm256_set1_epi32(static_cast<int>(F::kExponent));
      return _mm256_cmpeq_epi32(_mm256_and_si256(bits, e), e);
    } else {
      const __m256i e = _mm256_set1_epi64x(static_cast<long long>(F::kExponent));
      return _mm256_cmpeq_epi64(_mm256_and_si256(bits, e), e);
    }
  };
  __m256i bad = _mm256_setzero_si256();
  for (; j + kLanes <= n; j += kLanes)
    bad = _mm256_or_si256(
        bad, exponent_is_full(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + j))));
  any_bad = !_mm256_testz_si256(bad, bad);
#endif
  for (; j < n; ++j) any_bad |= F::not_finite(x[j]);
  return !any_bad;
}

template <class Scalar>
bool all_finite_reference(const Scalar* x, Index n) {
  for (Index j = 0; j < n; ++j)
    if (!std::isfinite(x[j])) return false;
  return true;
}

// Every entry must be finite: a NaN or infinity in Q, K or V would poison a state for good.
// The message names the first one (row-major).
template <class Scalar>
void check_finite(const char* where, const char* name, ConstRowsView<Scalar> m) {
  for (Index i = 0; i < m.rows; ++i) {
    const Scalar* r = m.row(i);
    if (all_finite(r, m.cols)) continue;
    for (Index j = 0; j < m.cols; ++j) {
      if (FloatBits<Scalar>::not_finite(r[j])) {
        throw ArgumentError(concat(where, ": ", name, "(", i, ", ", j, ") = ", r[j],
                                   ", expected a finite value"));
      }
    }
  }
}

inline void check_positive_finite(const char* where, const char* name, double value) {
  if (!(std::isfinite(value) && value > 0.0)) {
    throw ArgumentError(concat(where, ": ", name, " = ", value, ", expected a finite value > 0"));
  }
}

inline void check_positive(const char* where, const char* name, Index value) {
  if (value <= 0) {
    throw ArgumentError(concat(where, ": ", name, " = ", value, ", expected >= 1"));
  }
}

// Chunk lengths of the mixers whose states keep the current chunk (linear, VQ, OVQ): a chunk is
// a unit of work held in memory, so it is bounded, and a state never sizes a buffer from an
// unchecked option.
inline constexpr Index kMaxChunk = Index(1) << 20;

inline void check_chunk(const char* where, Index chunk) {
  require(chunk >= 1 && chunk <= kMaxChunk, where, "chunk = ", chunk, ", expected 1 ... ",
          kMaxChunk);
}

// A real option (beta, eps) must survive the conversion to the mixer's scalar type: neither
// overflow to infinity nor round to 0.
// (For a 16-bit element the option is applied in float, its compute type.)
template <class Element>
void check_scalar_range(const char* where, const char* name, double value) {
  using Scalar = compute_t<Element>;
  const auto s = static_cast<Scalar>(value);
  if (!std::isfinite(s) || (value > 0.0 && !(s > Scalar(0)))) {
    throw ArgumentError(concat(where, ": ", name, " = ", value, ", expected a value that the ",
                               sizeof(Scalar) == 4 ? "float" : "double",
                               " scalar type represents (finite and not rounded to 0)"));
  }
}

// One beta per query head, query heads in groups of `group` per key/value head: each finite,
// > 0 and in Element's range; with shared_by_group (a write that reads with beta: OVQ's delta
// rule) equal within each group.
template <class Element>
void check_head_betas(const char* where, const std::vector<double>& betas, Index group,
                      bool shared_by_group) {
  for (std::size_t h = 0; h < betas.size(); ++h) {
    const double b = betas[h];
    const std::string name = concat("betas[", h, "]");
    check_positive_finite(where, name.c_str(), b);
    check_scalar_range<Element>(where, name.c_str(), b);
    const std::size_t first = h - h % static_cast<std::size_t>(group);
    require(!shared_by_group || b == betas[first], where, name, " = ", b, ", expected ",
            betas[first], " (betas[", first,
            "]: the query heads of a key/value head share the beta its write reads with)");
  }
}

// The same check, returning the value: for member initialisers, so that no storage is sized
// from a bad value before the check runs.
inline Index positive(const char* where, const char* name, Index value) {
  check_positive(where, name, value);
  return value;
}

}  // namespace ovq::detail
