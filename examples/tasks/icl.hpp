#pragma once
// In-context learning of many linear functions (docs/study.md, task I).
//
// Stream (seed), T example tokens, dk-dimensional inputs, dv-dimensional outputs:
//   - F functions, each with its own region of key space and its own linear map: a center c_f
//     (random unit vector, redrawn while its cosine with an earlier center exceeds
//     max_center_cosine) and A_f (dv x dk, entries N(0, 1 / dk), so |A_f x| is about 1);
//   - example token: f uniform in [0, F), x = normalise(c_f + region_noise * g / sqrt(dk)),
//     key x, value y = A_f x.
// Queries, Q of them, read after the stream: query i asks function f = i mod F (every function
// equally often) at a new input x' drawn like the examples; the target is A_f x'.
// Score (score()): one scalar gain a per mixer and stream, fitted in closed form on the queries
// (a = sum o.y / sum o.o, the best any output scale could do; it can only help), then
//   NMSE = sum_i |a o_i - y_i|^2 / sum_i |y_i|^2          (0: exact; 1: no information)
// and per function the same ratio over its queries; a function is "learnt" when its NMSE < 0.5.
// Reference: region_mean_oracle() predicts A_f xbar_f, xbar_f the mean input of the stream's
// examples of f: it knows the function but not the input's position inside the region.
//
// Blocked variant (task I-b, `blocked = true`): the same functions, examples and queries as the
// interleaved stream of the same seed, but the examples are presented function by function: F
// contiguous blocks, the functions in a random order (drawn after everything else), each block
// keeping its examples' original order. A layer must then keep every function over the whole
// context: a window of W tokens sees only the last functions.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <vector>

#include "common.hpp"

namespace icl {

using tasks::Index;
template <class Scalar>
using Rows = tasks::Rows<Scalar>;

inline constexpr double kLearntNmse = 0.5;

struct TaskConfig {
  Index key_dim = 64;    // dk
  Index value_dim = 64;  // dv
  Index context = 4096;  // T example tokens
  Index functions = 16;  // F
  Index queries = 1024;  // Q
  double region_noise = 0.5;
  double max_center_cosine = 0.5;
  bool blocked = false;  // task I-b: examples grouped by function
  std::uint64_t seed = 1;

  void validate() const {
    if (key_dim < 2 || value_dim < 1 || context < 1 || functions < 1 || queries < 0)
      throw std::invalid_argument("icl::TaskConfig: sizes out of range");
    if (!(region_noise >= 0) || !(max_center_cosine > 0))
      throw std::invalid_argument("icl::TaskConfig: noise/cosine out of range");
  }
};

template <class Scalar = float>
struct Task {
  TaskConfig config;
  Rows<Scalar> centers;               // F x dk
  std::vector<Eigen::MatrixXd> maps;  // F maps A_f, dv x dk
  Rows<Scalar> keys;                  // T x dk, the example inputs (unit rows)
  Rows<Scalar> values;                // T x dv, A_f x
  std::vector<Index> example_function;  // T
  Rows<Scalar> queries;               // Q x dk
  Rows<double> targets;               // Q x dv, A_f x' (exact, double)
  std::vector<Index> query_function;  // Q
};

template <class Scalar = float>
Task<Scalar> make_task(const TaskConfig& cfg) {
  cfg.validate();
  const Index dk = cfg.key_dim, dv = cfg.value_dim, T = cfg.context, F = cfg.functions;
  tasks::Draw draw(tasks::derive_seed(cfg.seed, 0x1c1));
  Task<Scalar> task;
  task.config = cfg;

  std::vector<Eigen::VectorXd> centers;
  for (Index f = 0; f < F; ++f) {
    for (int attempt = 0;; ++attempt) {
      if (attempt > 10000)
        throw std::runtime_error("icl::make_task: cannot place distinct region centers; lower "
                                 "functions or raise max_center_cosine");
      Eigen::VectorXd c = draw.unit(dk);
      bool ok = true;
      for (const auto& o : centers) ok = ok && c.dot(o) <= cfg.max_center_cosine;
      if (ok) {
        centers.push_back(c);
        break;
      }
    }
    Eigen::MatrixXd a(dv, dk);
    const double scale = 1.0 / std::sqrt(static_cast<double>(dk));
    for (Index r = 0; r < dv; ++r)
      for (Index c = 0; c < dk; ++c) a(r, c) = scale * draw.normal();
    task.maps.push_back(a);
  }
  task.centers.resize(F, dk);
  for (Index f = 0; f < F; ++f)
    task.centers.row(f) = centers[static_cast<std::size_t>(f)].transpose().template cast<Scalar>();

  task.keys.resize(T, dk);
  task.values.resize(T, dv);
  task.example_function.resize(static_cast<std::size_t>(T));
  for (Index t = 0; t < T; ++t) {
    const Index f = draw.below(F);
    const Eigen::VectorXd x = draw.near(centers[static_cast<std::size_t>(f)], cfg.region_noise);
    task.example_function[static_cast<std::size_t>(t)] = f;
    task.keys.row(t) = x.transpose().template cast<Scalar>();
    task.values.row(t) =
        (task.maps[static_cast<std::size_t>(f)] * x).transpose().template cast<Scalar>();
  }

  task.queries.resize(cfg.queries, dk);
  task.targets.resize(cfg.queries, dv);
  task.query_function.resize(static_cast<std::size_t>(cfg.queries));
  for (Index i = 0; i < cfg.queries; ++i) {
    const Index f = i % F;
    const Eigen::VectorXd x = draw.near(centers[static_cast<std::size_t>(f)], cfg.region_noise);
    task.query_function[static_cast<std::size_t>(i)] = f;
    // The target is computed from the input as the mixers see it (rounded to Scalar).
    const Eigen::VectorXd xs = x.cast<Scalar>().template cast<double>();
    task.queries.row(i) = xs.transpose().template cast<Scalar>();
    task.targets.row(i) = (task.maps[static_cast<std::size_t>(f)] * xs).transpose();
  }

  if (cfg.blocked) {
    // Rank of each function in the presentation order (Fisher-Yates), then a stable sort of the
    // examples by the rank of their function.
    std::vector<Index> order(static_cast<std::size_t>(F));
    for (Index f = 0; f < F; ++f) order[static_cast<std::size_t>(f)] = f;
    for (Index f = 0; f + 1 < F; ++f)
      std::swap(order[static_cast<std::size_t>(f)],
                order[static_cast<std::size_t>(f + draw.below(F - f))]);
    std::vector<Index> rank(static_cast<std::size_t>(F));
    for (Index r = 0; r < F; ++r) rank[static_cast<std::size_t>(order[static_cast<std::size_t>(r)])] = r;
    std::vector<Index> rows(static_cast<std::size_t>(T));
    for (Index t = 0; t < T; ++t) rows[static_cast<std::size_t>(t)] = t;
    std::stable_sort(rows.begin(), rows.end(), [&](Index a, Index b) {
      return rank[static_cast<std::size_t>(task.example_function[static_cast<std::size_t>(a)])] <
             rank[static_cast<std::size_t>(task.example_function[static_cast<std::size_t>(b)])];
    });
    Rows<Scalar> keys(T, dk), values(T, dv);
    std::vector<Index> fn(static_cast<std::size_t>(T));
    for (Index t = 0; t < T; ++t) {
      const Index src = rows[static_cast<std::size_t>(t)];
      keys.row(t) = task.keys.row(src);
      values.row(t) = task.values.row(src);
      fn[static_cast<std::size_t>(t)] = task.example_function[static_cast<std::size_t>(src)];
    }
    task.keys.swap(keys);
    task.values.swap(values);
    task.example_function.swap(fn);
  }
  return task;
}

struct Score {
  double nmse = 1.0;         // over all queries, after the gain
  double gain = 0.0;         // the fitted scalar a
  double learnt = 0.0;       // fraction of the F functions with NMSE < kLearntNmse
  std::vector<double> function_nmse;  // F (1 for a function without queries)
};

// outputs: Q x dv.
template <class Scalar, class Out>
Score score(const Task<Scalar>& task, const Out& outputs) {
  const Index Q = task.queries.rows();
  const Index F = task.config.functions;
  if (outputs.rows() != Q || outputs.cols() != task.targets.cols())
    throw std::invalid_argument("icl::score: outputs shape");
  const Rows<double> o = outputs.template cast<double>();
  Score s;
  double oy = 0.0, oo = 0.0;
  for (Index i = 0; i < Q; ++i) {
    if (!o.row(i).allFinite()) continue;
    oy += o.row(i).dot(task.targets.row(i));
    oo += o.row(i).squaredNorm();
  }
  s.gain = oo > 0.0 ? oy / oo : 0.0;
  std::vector<double> err(static_cast<std::size_t>(F), 0.0), norm(static_cast<std::size_t>(F), 0.0);
  double err_all = 0.0, norm_all = 0.0;
  for (Index i = 0; i < Q; ++i) {
    const auto f = static_cast<std::size_t>(task.query_function[static_cast<std::size_t>(i)]);
    const double y2 = task.targets.row(i).squaredNorm();
    const double e = o.row(i).allFinite() ? (s.gain * o.row(i) - task.targets.row(i)).squaredNorm()
                                          : y2;
    err[f] += e;
    norm[f] += y2;
    err_all += e;
    norm_all += y2;
  }
  s.nmse = norm_all > 0.0 ? err_all / norm_all : 1.0;
  s.function_nmse.resize(static_cast<std::size_t>(F));
  Index learnt = 0;
  for (std::size_t f = 0; f < err.size(); ++f) {
    s.function_nmse[f] = norm[f] > 0.0 ? err[f] / norm[f] : 1.0;
    learnt += s.function_nmse[f] < kLearntNmse;
  }
  s.learnt = static_cast<double>(learnt) / static_cast<double>(F);
  return s;
}

// The reference predictor A_f xbar_f (Q x dv), xbar_f the mean example input of function f
// (zero output for a function without examples).
template <class Scalar>
Rows<double> region_mean_oracle(const Task<Scalar>& task) {
  const Index F = task.config.functions, dk = task.config.key_dim;
  Rows<double> mean = Rows<double>::Zero(F, dk);
  std::vector<Index> count(static_cast<std::size_t>(F), 0);
  for (Index t = 0; t < task.keys.rows(); ++t) {
    const Index f = task.example_function[static_cast<std::size_t>(t)];
    mean.row(f) += task.keys.row(t).template cast<double>();
    ++count[static_cast<std::size_t>(f)];
  }
  Rows<double> out(task.queries.rows(), task.config.value_dim);
  for (Index i = 0; i < task.queries.rows(); ++i) {
    const Index f = task.query_function[static_cast<std::size_t>(i)];
    const Index c = count[static_cast<std::size_t>(f)];
    if (c == 0) {
      out.row(i).setZero();
      continue;
    }
    const Eigen::VectorXd xbar = mean.row(f).transpose() / static_cast<double>(c);
    out.row(i) = (task.maps[static_cast<std::size_t>(f)] * xbar).transpose();
  }
  return out;
}

}  // namespace icl
