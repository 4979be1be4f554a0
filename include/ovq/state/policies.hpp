#pragma once
// The choices the OVQ paper leaves open, as small option structs (the paper's ablations):
// how the dictionary grows, how new centroids are seeded, and the centroid update rate.
#include <algorithm>
#include <cmath>
#include <cstdint>

#include "ovq/core/checks.hpp"
#include "ovq/core/random.hpp"
#include "ovq/core/types.hpp"

namespace ovq {

// Target dictionary size G(t) after t absorbed tokens, evaluated in double precision.
struct Growth {
  enum class Kind { dirichlet, linear, saturating };
  Kind kind = Kind::dirichlet;
  double alpha = 0.0;  // dirichlet concentration; 0 means "use the capacity N"
  double rate = 1.0;   // linear: centroids per token

  // G(t) = ceil(N (1 - (1 + t / alpha)^(-alpha / N))): almost one centroid per token early on,
  // then a plateau at N, like the tables of a Chinese restaurant process.
  static Growth dirichlet(double alpha = 0.0) { return {Kind::dirichlet, alpha, 1.0}; }
  // G(t) = ceil(rate t).
  static Growth linear(double rate = 1.0) { return {Kind::linear, 0.0, rate}; }
  // G(t) = floor(N t / (N + t)): dirichlet with alpha = N rounded down, so it never quite reaches
  // N (the schedule of the public OVQ implementation, docs/math.md).
  static Growth saturating() { return {Kind::saturating, 0.0, 1.0}; }

  void validate(const char* where) const {
    if (kind == Kind::dirichlet) {
      detail::require(std::isfinite(alpha) && alpha >= 0.0, where, "growth alpha = ", alpha,
                      ", expected a finite value > 0 (or 0 for the capacity)");
    } else if (kind == Kind::linear) {
      detail::check_positive_finite(where, "growth rate", rate);
    }
  }

  // min(N, G(t)) for capacity N.
  Index target(std::int64_t t, Index capacity) const {
    if (kind == Kind::saturating) {
      // floor(N t / (N + t)) = N - ceil(N^2 / (N + t)), exact in 64-bit integers (N < 2^31).
      if (t <= 0) return 0;
      const std::int64_t n = capacity, den = n + t;
      return static_cast<Index>(n - (n * n + den - 1) / den);
    }
    const double n_cap = static_cast<double>(capacity);
    const double td = static_cast<double>(t);
    double g;
    if (kind == Kind::dirichlet) {
      const double a = alpha > 0.0 ? alpha : n_cap;
      // Literally MATH.md's formula, so that the integers match any reading of it (a
      // rearranged form can round across an integer where the exact value is one, e.g. N = L).
      g = std::ceil(n_cap * (1.0 - std::pow(1.0 + td / a, -a / n_cap)));
    } else {
      g = std::ceil(rate * td);
    }
    if (!(g < n_cap)) return capacity;
    return g > 0.0 ? static_cast<Index>(g) : 0;
  }
};

// How the m new centroids of a chunk are chosen among its keys.
struct Seeding {
  enum class Kind { spread, random, lowest_similarity };
  Kind kind = Kind::spread;
  std::uint64_t seed = 0;

  // Greedy spread-maximising: repeatedly the chunk key least similar to every centroid so far.
  static Seeding spread() { return {Kind::spread, 0}; }
  // Distinct chunk rows drawn by a generator seeded with (seed, chunk index).
  static Seeding random(std::uint64_t seed) { return {Kind::random, seed}; }
  // Assignment before seeding (the public OVQ implementation's reading, docs/math.md): every
  // chunk key is assigned to its nearest old row; the m keys least similar to their nearest
  // (ties: the first key) then open rows of their own, alone. Into an empty dictionary key 0
  // opens row 0 and takes every key but the m - 1 least similar to it, which open the others.
  static Seeding lowest_similarity() { return {Kind::lowest_similarity, 0}; }
};

// How an assigned centroid moves towards the mean of its new members.
struct UpdateRate {
  enum class Kind { adaptive, constant };
  Kind kind = Kind::adaptive;
  double eta = 0.0;

  // Running mean, rate cnt / (c + cnt): batch k-means' Newton step.
  static UpdateRate adaptive() { return {Kind::adaptive, 0.0}; }
  // D = (1 - eta) D + eta mean(new members).
  static UpdateRate constant(double eta) { return {Kind::constant, eta}; }

  void validate(const char* where) const {
    if (kind == Kind::constant) {
      detail::require(std::isfinite(eta) && eta > 0.0 && eta <= 1.0, where, "update eta = ", eta,
                      ", expected a value in (0, 1]");
    }
  }
};

// What an assigned value row moves towards (MATH.md section 4, docs/math.md "Two readings").
//   mean:  the running mean of its members' values (the same rule as the key rows);
//   delta: its members' residuals against the dictionary's own prediction, D_v[r] += rate *
//          sum_{a_i = r} (v_i - yhat_i), yhat_i the read of the dictionary before the chunk with
//          the query k_i (no local rows). A row opened in the chunk predicts nothing yet: it takes
//          the mean of its members (its seed alone under lowest-similarity seeding).
enum class ValueUpdate { mean, delta };

}  // namespace ovq
