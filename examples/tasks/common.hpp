#pragma once
// What the synthetic task generators share: a seeded source of draws that gives the same
// numbers on every platform, and row-major matrices.
//
// Reproducibility: one std::mt19937_64 per stream (its output sequence is fixed by the C++
// standard). Gaussian draws use the Box-Muller transform on 53-bit uniforms built from the raw
// output, not std::normal_distribution (whose algorithm differs between standard libraries), and
// integer draws reject the biased tail of the raw output. Everything is drawn in double and
// rounded once to the task's scalar type.
#include <Eigen/Core>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <random>
#include <stdexcept>

namespace tasks {

using Index = std::ptrdiff_t;

template <class Scalar>
using Rows = Eigen::Matrix<Scalar, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

// Derives independent seeds from one (splitmix64 finaliser over seed and tag).
inline std::uint64_t derive_seed(std::uint64_t seed, std::uint64_t tag) {
  std::uint64_t z = seed + 0x9e3779b97f4a7c15ULL * (tag + 1);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

class Draw {
 public:
  explicit Draw(std::uint64_t seed) : rng_(seed) {}

  // Uniform in [0, n), n >= 1, without modulo bias.
  Index below(Index n) {
    if (n < 1) throw std::invalid_argument("tasks::Draw::below: n < 1");
    const std::uint64_t un = static_cast<std::uint64_t>(n);
    const std::uint64_t limit = std::numeric_limits<std::uint64_t>::max() -
                                std::numeric_limits<std::uint64_t>::max() % un;
    std::uint64_t x;
    do x = rng_();
    while (x >= limit);
    return static_cast<Index>(x % un);
  }

  // Uniform in (0, 1): 53 random bits, never 0.
  double uniform() { return (static_cast<double>(rng_() >> 11) + 0.5) * 0x1.0p-53; }

  double normal() {
    if (have_spare_) {
      have_spare_ = false;
      return spare_;
    }
    const double r = std::sqrt(-2.0 * std::log(uniform()));
    const double a = 2.0 * 3.14159265358979323846 * uniform();
    spare_ = r * std::sin(a);
    have_spare_ = true;
    return r * std::cos(a);
  }

  Eigen::VectorXd gaussian(Index d) {
    Eigen::VectorXd g(d);
    for (Index i = 0; i < d; ++i) g[i] = normal();
    return g;
  }

  // A uniformly random unit vector.
  Eigen::VectorXd unit(Index d) {
    Eigen::VectorXd g = gaussian(d);
    return g / g.norm();
  }

  // normalise(center + noise * g / sqrt(d)), g ~ N(0, I): a unit vector whose cosine with a unit
  // center is about 1 / sqrt(1 + noise^2).
  Eigen::VectorXd near(const Eigen::VectorXd& center, double noise) {
    const Index d = center.size();
    Eigen::VectorXd x = center + (noise / std::sqrt(static_cast<double>(d))) * gaussian(d);
    return x / x.norm();
  }

 private:
  std::mt19937_64 rng_;
  double spare_ = 0.0;
  bool have_spare_ = false;
};

}  // namespace tasks
