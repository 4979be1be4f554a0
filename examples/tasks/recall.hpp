#pragma once
// In-context recall: M key/value "facts" hidden in a long stream of filler tokens, then queried
// with noisy copies of their keys (docs/study.md, task R).
//
// World (world_seed): `directions` shared random unit directions u_c. Filler keys crowd them, as
// the keys of filler text crowd a few directions. Streams of one world share the directions and
// differ in everything else, so a codebook fitted on one stream (calibration) has seen the
// filler distribution of another, but never its facts.
//
// Stream (seed), T tokens, dk-dimensional keys, dv-dimensional values:
//   - filler tokens: key = normalise(u_c + distractor_noise * g / sqrt(dk)), c uniform, g ~ N(0, I);
//     value a random unit vector;
//   - M fact tokens at M distinct uniform positions: key a random unit vector, redrawn while its
//     |cosine| with a direction, or its cosine with an earlier fact key, exceeds max_fact_cosine;
//     value a random unit vector.
// Queries, Q of them, read after the stream: fact f uniform in [0, M),
//   query = normalise(fact_key[f] + query_noise * g / sqrt(dk)); the answer is fact_value[f].
// Score: a query is right when its output is nearest, by cosine, to the right fact value among
// all M fact values (chance 1 / M).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <stdexcept>
#include <vector>

#include "common.hpp"

namespace recall {

using tasks::Index;
template <class Scalar>
using Rows = tasks::Rows<Scalar>;

struct TaskConfig {
  Index key_dim = 64;     // dk
  Index value_dim = 64;   // dv
  Index context = 2048;   // T, tokens in the stream, facts included
  Index facts = 128;      // M
  Index queries = 256;    // Q
  Index directions = 4;   // shared filler directions
  double distractor_noise = 0.3;
  double query_noise = 0.25;
  double max_fact_cosine = 0.5;
  std::uint64_t world_seed = 1;  // the filler directions
  std::uint64_t seed = 1;        // everything else

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
  Rows<Scalar> directions;           // directions x dk, the world's filler directions
  Rows<Scalar> keys;                 // T x dk, the stream's keys (unit rows)
  Rows<Scalar> values;               // T x dv
  std::vector<Index> fact_position;  // M, the stream position of fact f
  Rows<Scalar> fact_keys;            // M x dk
  Rows<Scalar> fact_values;          // M x dv
  Rows<Scalar> queries;              // Q x dk (unit rows)
  std::vector<Index> query_fact;     // Q, the fact each query asks for
};

template <class Scalar = float>
Task<Scalar> make_task(const TaskConfig& cfg) {
  cfg.validate();
  const Index dk = cfg.key_dim, dv = cfg.value_dim, T = cfg.context, M = cfg.facts;

  tasks::Draw world(tasks::derive_seed(cfg.world_seed, 0x77));
  std::vector<Eigen::VectorXd> dirs;
  for (Index c = 0; c < cfg.directions; ++c) dirs.push_back(world.unit(dk));

  tasks::Draw draw(tasks::derive_seed(cfg.seed, 0x5e));
  Task<Scalar> task;
  task.config = cfg;
  task.directions.resize(cfg.directions, dk);
  for (Index c = 0; c < cfg.directions; ++c)
    task.directions.row(c) = dirs[static_cast<std::size_t>(c)].transpose().template cast<Scalar>();
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
    task.queries.row(i) = draw.near(fkeys[static_cast<std::size_t>(f)], cfg.query_noise)
                              .transpose()
                              .template cast<Scalar>();
  }
  return task;
}

// Index of the fact value nearest (by cosine) to `out`; -1 for a zero or non-finite output.
template <class Scalar, class Row>
Index nearest_fact(const Task<Scalar>& task, const Row& out) {
  const Eigen::RowVectorXd o = out.template cast<double>();
  const double norm = o.norm();
  if (!(norm > 0) || !std::isfinite(norm)) return -1;
  Index best = -1;
  double best_cos = -std::numeric_limits<double>::infinity();
  for (Index f = 0; f < task.fact_values.rows(); ++f) {
    const Eigen::RowVectorXd v = task.fact_values.row(f).template cast<double>();
    const double c = v.dot(o) / (v.norm() * norm);
    if (c > best_cos) {
      best_cos = c;
      best = f;
    }
  }
  return best;
}

// Per query (outputs: Q x dv): 1 when the output is nearest to the right fact value.
template <class Scalar>
std::vector<char> correct(const Task<Scalar>& task, const Rows<Scalar>& outputs) {
  const Index Q = task.queries.rows();
  if (outputs.rows() != Q || outputs.cols() != task.fact_values.cols())
    throw std::invalid_argument("recall::correct: outputs shape");
  std::vector<char> right(static_cast<std::size_t>(Q));
  for (Index i = 0; i < Q; ++i)
    right[static_cast<std::size_t>(i)] =
        nearest_fact(task, outputs.row(i)) == task.query_fact[static_cast<std::size_t>(i)];
  return right;
}

// Fraction of queries answered right.
template <class Scalar>
double accuracy(const Task<Scalar>& task, const Rows<Scalar>& outputs) {
  const std::vector<char> right = correct(task, outputs);
  if (right.empty()) return 0.0;
  return static_cast<double>(std::count(right.begin(), right.end(), char(1))) /
         static_cast<double>(right.size());
}

}  // namespace recall
