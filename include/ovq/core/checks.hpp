#pragma once
// Argument checks shared by every public entry point. Each one throws ovq::ArgumentError whose
// message names the entry point, the argument and what was expected. They run before any state
// is touched, which is what makes a failed call leave the state exactly as it was.
#include <cmath>

#include "ovq/core/error.hpp"
#include "ovq/core/types.hpp"

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

// Every entry must be finite: a NaN or infinity in Q, K or V would poison a state for good.
template <class Scalar>
void check_finite(const char* where, const char* name, ConstRowsView<Scalar> m) {
  for (Index i = 0; i < m.rows; ++i) {
    const Scalar* r = m.row(i);
    for (Index j = 0; j < m.cols; ++j) {
      if (!std::isfinite(r[j])) {
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
template <class Scalar>
void check_scalar_range(const char* where, const char* name, double value) {
  const auto s = static_cast<Scalar>(value);
  if (!std::isfinite(s) || (value > 0.0 && !(s > Scalar(0)))) {
    throw ArgumentError(concat(where, ": ", name, " = ", value, ", expected a value that the ",
                               sizeof(Scalar) == 4 ? "float" : "double",
                               " scalar type represents (finite and not rounded to 0)"));
  }
}

// The same check, returning the value: for member initialisers, so that no storage is sized
// from a bad value before the check runs.
inline Index positive(const char* where, const char* name, Index value) {
  check_positive(where, name, value);
  return value;
}

}  // namespace ovq::detail
