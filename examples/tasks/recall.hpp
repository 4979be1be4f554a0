#pragma once
// A synthetic in-context recall task: M key/value "facts" hidden in a stream of filler tokens,
// then queried with noisy copies of their keys. Used by examples/ovq_demo.cpp (and by tests).
//
// Stream (the context), T tokens, dk-dimensional keys and dv-dimensional values:
//   - filler ("distractor") tokens: key = normalise(u_c + distractor_noise * g / sqrt(dk)) with
//     u_c one of `directions` shared random unit directions (c uniform), g ~ N(0, I); value a
//     random unit vector. Like filler text, most keys fall near a few directions.
//   - M fact tokens at M distinct random positions: key a random unit vector, value a random unit
//     vector. A candidate fact key is redrawn while its cosine with a distractor direction or an
//     earlier fact key exceeds max_fact_cosine, so that every fact is answerable in principle.
// Queries, Q of them, read after the context: fact f uniform in [0, M),
//   query = normalise(fact_key[f] + query_noise * g / sqrt(dk)); the right answer is value[f].
//
// Reproducible: one std::mt19937_64 seeded with `seed`, std::normal_distribution<double> for
// every Gaussian draw (same sequence for the same seed and standard library); integer draws use
// the generator's raw output. Everything is generated in double and rounded once to Scalar.
#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <numeric>
#include <random>
#include <stdexcept>
#include <vector>

namespace recall {

using Index = std::ptrdiff_t;

template <class Scalar>
using Rows = Eigen::Matrix<Scalar, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

struct TaskConfig {
  Index key_dim = 64;           // dk
  Index value_dim = 64;         // dv
  Index context = 2048;         // T, tokens in the stream, facts included
  Index facts = 128;            // M
  Index queries = 256;          // Q
  Index directions = 4;         // shared distractor directions
  double distractor_noise = 0.3;
  double query_noise = 0.25;
  double max_fact_cosine = 0.5;
  std::uint64_t seed = 1;

  void validate() const {
    if (key_dim < 2 || value_dim < 1 || context < 1 || facts < 1 || queries < 0 ||
        directions < 1)
      throw std::invalid_argument("recall::TaskConfig: sizes out of range");
    if (facts > context)
      throw std::invalid_argument("recall::TaskConfig: more facts than context tokens");
    if (!(distractor_noise >= 0) || !(query_noise >= 0) || !(max_fact_cosine > 0))
      throw std::invalid_argument("recall::TaskConfig: noise/cosine out of range");
  }
};

template <class Scalar = float>
struct Task {
  TaskConfig config;
  Rows<Scalar> keys;                // T x dk, the context's keys (unit rows)
  Rows<Scalar> values;              // T x dv
  std::vector<Index> fact_position;  // M, the stream position of fact f (random order)
  Rows<Scalar> fact_keys;           // M x dk
  Rows<Scalar> fact_values;         // M x dv
  Rows<Scalar> queries;             // Q x dk (unit rows)
  std::vector<Index> query_fact;    // Q, the fact each query asks for
};

namespace detail {

class Draw {
 public:
  explicit Draw(std::uint64_t seed) : rng_(seed) {}

  // Uniform in [0, n), n >= 1 (rejection sampling on the raw 64-bit output: no modulo bias).
  Index below(Index n) {
    const std::uint64_t un = static_cast<std::uint64_t>(n);
    const std::uint64_t limit = std::numeric_limits<std::uint64_t>::max() -
                                std::numeric_limits<std::uint64_t>::max() % un;
    std::uint64_t x;
    do x = rng_();
    while (x >= limit);
    return static_cast<Index>(x % un);
  }

  Eigen::VectorXd gaussian(Index d) {
    Eigen::VectorXd g(d);
    for (Index i = 0; i < d; ++i) g[i] = normal_(rng_);
    return g;
  }

  Eigen::VectorXd unit(Index d) {
    Eigen::VectorXd g = gaussian(d);
    return g / g.norm();
  }

  // normalise(center + noise * g / sqrt(d))
  Eigen::VectorXd near(const Eigen::VectorXd& center, double noise) {
    const Index d = center.size();
    Eigen::VectorXd x = center + (noise / std::sqrt(static_cast<double>(d))) * gaussian(d);
    return x / x.norm();
  }

 private:
  std::mt19937_64 rng_;
  std::normal_distribution<double> normal_{0.0, 1.0};
};

}  // namespace detail

template <class Scalar = float>
Task<Scalar> make_task(const TaskConfig& cfg) {
  cfg.validate();
  detail::Draw draw(cfg.seed);
  const Index dk = cfg.key_dim, dv = cfg.value_dim, T = cfg.context, M = cfg.facts;

  std::vector<Eigen::VectorXd> dirs;
  for (Index c = 0; c < cfg.directions; ++c) dirs.push_back(draw.unit(dk));

  Task<Scalar> task;
  task.config = cfg;
  task.keys.resize(T, dk);
  task.values.resize(T, dv);
  task.fact_keys.resize(M, dk);
  task.fact_values.resize(M, dv);

  // Filler everywhere first; facts overwrite their positions below.
  for (Index t = 0; t < T; ++t) {
    const Index c = draw.below(cfg.directions);
    task.keys.row(t) = draw.near(dirs[static_cast<std::size_t>(c)], cfg.distractor_noise)
                           .transpose()
                           .template cast<Scalar>();
    task.values.row(t) = draw.unit(dv).transpose().template cast<Scalar>();
  }

  // Fact keys: random unit vectors, redrawn while too close to a direction or an earlier fact.
  std::vector<Eigen::VectorXd> fkeys;
  for (Index f = 0; f < M; ++f) {
    for (int attempt = 0;; ++attempt) {
      if (attempt > 10000)
        throw std::runtime_error("recall::make_task: cannot place distinct fact keys; lower "
                                 "facts or raise max_fact_cosine");
      Eigen::VectorXd k = draw.unit(dk);
      bool ok = true;
      for (const auto& u : dirs) ok = ok && std::abs(k.dot(u)) <= cfg.max_fact_cosine;
      for (const auto& o : fkeys) ok = ok && k.dot(o) <= cfg.max_fact_cosine;
      if (ok) {
        fkeys.push_back(k);
        break;
      }
    }
    task.fact_keys.row(f) = fkeys.back().transpose().template cast<Scalar>();
    task.fact_values.row(f) = draw.unit(dv).transpose().template cast<Scalar>();
  }

  // M distinct positions: partial Fisher-Yates over [0, T).
  std::vector<Index> pos(static_cast<std::size_t>(T));
  std::iota(pos.begin(), pos.end(), Index(0));
  for (Index f = 0; f < M; ++f) {
    const Index j = f + draw.below(T - f);
    std::swap(pos[static_cast<std::size_t>(f)], pos[static_cast<std::size_t>(j)]);
  }
  task.fact_position.assign(pos.begin(), pos.begin() + M);
  for (Index f = 0; f < M; ++f) {
    const Index p = task.fact_position[static_cast<std::size_t>(f)];
    task.keys.row(p) = task.fact_keys.row(f);
    task.values.row(p) = task.fact_values.row(f);
  }

  task.queries.resize(cfg.queries, dk);
  task.query_fact.resize(static_cast<std::size_t>(cfg.queries));
  for (Index i = 0; i < cfg.queries; ++i) {
    const Index f = draw.below(M);
    task.query_fact[static_cast<std::size_t>(i)] = f;
    task.queries.row(i) =
        draw.near(fkeys[static_cast<std::size_t>(f)], cfg.query_noise).transpose().template cast<Scalar>();
  }
  return task;
}

// Index of the fact value nearest (by cosine) to `out`; -1 for a zero or non-finite output.
template <class Scalar, class Row>
Index nearest_fact(const Task<Scalar>& task, const Row& out) {
  const double norm = out.template cast<double>().norm();
  if (!(norm > 0) || !std::isfinite(norm)) return -1;
  Index best = -1;
  double best_cos = -std::numeric_limits<double>::infinity();
  for (Index f = 0; f < task.fact_values.rows(); ++f) {
    const double c = task.fact_values.row(f).template cast<double>().dot(
                         out.template cast<double>()) /
                     (task.fact_values.row(f).template cast<double>().norm() * norm);
    if (c > best_cos) {
      best_cos = c;
      best = f;
    }
  }
  return best;
}

// Fraction of queries whose output row (outputs: Q x dv) is nearest to the right fact value.
template <class Scalar>
double accuracy(const Task<Scalar>& task, const Rows<Scalar>& outputs) {
  const Index Q = task.queries.rows();
  if (Q == 0) return 0.0;
  Index right = 0;
  for (Index i = 0; i < Q; ++i)
    right += nearest_fact(task, outputs.row(i)) == task.query_fact[static_cast<std::size_t>(i)];
  return static_cast<double>(right) / static_cast<double>(Q);
}

}  // namespace recall
