#pragma once
// Running the study's settings: every mixer of a setting sees exactly the same stream.
//
// A setting is one stream (recall: T, M, seed; in-context learning: T, F, seed) and the mixers to
// run on it. run_settings() generates the streams, fits the VQ codebooks (on calibration streams
// of the same generator, another seed) and runs every (stream, mixer) pair, independent jobs
// spread over OpenMP threads (largest first), each job single-threaded. It returns one Point per
// pair, in the order of the settings and their mixers.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#if defined(_OPENMP)
#include <omp.h>
#endif

#include <ovq/fit/kmeans.hpp>

#include "icl.hpp"
#include "mixers.hpp"
#include "recall.hpp"

namespace study {

enum class TaskKind { recall, icl };

inline constexpr Index kDim = 64;                  // dk = dv
inline constexpr Index kCalibrationTokens = 16384;  // VQ codebook fits
inline constexpr Index kCalibrationFacts = 128;     // recall calibration streams
inline constexpr Index kKmeansIterations = 20;

struct Setting {
  std::string experiment;
  TaskKind task = TaskKind::recall;
  Index context = 0;  // T
  Index items = 0;    // M facts (recall) or F functions (icl)
  Index queries = 0;  // Q
  std::uint64_t seed = 1;
  std::vector<MixerSpec> mixers;
  // VQ only: fit the codebook on this stream's own keys instead of a calibration stream (a
  // reference that no causal layer could use).
  bool vq_on_stream = false;
  // icl only: add the point "oracle: region mean" (icl::region_mean_oracle), state bytes 0.
  bool oracle = false;
  // icl only: task I-b, the examples grouped by function (icl::TaskConfig::blocked). The stream
  // holds the same examples as the interleaved one of the same seed, and the VQ codebooks are
  // shared with it (k-means does not see the order).
  bool blocked = false;
};

struct Point {
  std::string experiment;
  TaskKind task = TaskKind::recall;
  Index context = 0;
  Index items = 0;
  std::uint64_t seed = 0;
  std::string mixer;
  Family family = Family::self;
  Index size = 0;
  std::size_t bytes = 0;
  double sa_bytes = 0.0;  // self-attention's cache at this T
  double score = 0.0;     // recall: accuracy; icl: NMSE
  double learnt = 0.0;    // icl: fraction of functions learnt
  double ms = 0.0;
};

inline recall::TaskConfig recall_config(Index T, Index M, Index Q, std::uint64_t seed) {
  recall::TaskConfig c;
  c.key_dim = kDim;
  c.value_dim = kDim;
  c.context = T;
  c.facts = M;
  c.queries = Q;
  c.world_seed = seed;
  c.seed = tasks::derive_seed(seed, 1000003ULL * static_cast<std::uint64_t>(T) +
                                        static_cast<std::uint64_t>(M));
  return c;
}

inline icl::TaskConfig icl_config(Index T, Index F, Index Q, std::uint64_t seed,
                                  bool blocked = false) {
  icl::TaskConfig c;
  c.blocked = blocked;
  c.key_dim = kDim;
  c.value_dim = kDim;
  c.context = T;
  c.functions = F;
  c.queries = Q;
  c.seed = tasks::derive_seed(seed, 2000003ULL * static_cast<std::uint64_t>(T) +
                                        static_cast<std::uint64_t>(F));
  return c;
}

// Calibration streams: same generator (recall: same world), another stream seed.
inline Mat calibration_keys(TaskKind task, Index items, std::uint64_t seed) {
  const std::uint64_t cal = tasks::derive_seed(seed, 0xca11b ^ static_cast<std::uint64_t>(items));
  if (task == TaskKind::recall) {
    recall::TaskConfig c = recall_config(kCalibrationTokens, kCalibrationFacts, 0, seed);
    c.seed = cal;
    return recall::make_task<Scalar>(c).keys;
  }
  icl::TaskConfig c = icl_config(kCalibrationTokens, items, 0, seed);
  c.seed = cal;
  return icl::make_task<Scalar>(c).keys;
}

inline ovq::KMeansOptions kmeans_options() {
  ovq::KMeansOptions o;
  o.max_iterations = kKmeansIterations;
  o.tolerance = 1e-4;
  o.seed = 17;
  return o;
}

struct RunOptions {
  int threads = 0;       // 0: OpenMP's default
  bool progress = false;  // one line per finished job on stderr
};

namespace detail {

struct Stream {
  std::unique_ptr<recall::Task<Scalar>> recall;
  std::unique_ptr<icl::Task<Scalar>> icl;
  const Mat& keys() const { return recall ? recall->keys : icl->keys; }
  const Mat& values() const { return recall ? recall->values : icl->values; }
  const Mat& queries() const { return recall ? recall->queries : icl->queries; }
};

inline double job_cost(const Setting& s, const MixerSpec& m) {
  const double T = static_cast<double>(s.context);
  switch (m.family) {
    case Family::vq: return T * static_cast<double>(m.size) * 1.5 + 2e4 * s.queries;
    case Family::ovq: return T * static_cast<double>(m.size) * 1.2;
    case Family::linear: return T * 200.0;
    default: return T * 100.0 + T * static_cast<double>(s.queries);
  }
}

template <class F>
void parallel_for(Index n, int threads, F&& body) {
  std::vector<std::string> errors(static_cast<std::size_t>(n));
#if defined(_OPENMP)
  const int nt = threads > 0 ? threads : omp_get_max_threads();
#pragma omp parallel for schedule(dynamic, 1) num_threads(nt)
#else
  (void)threads;
#endif
  for (Index i = 0; i < n; ++i) {
    try {
      body(i);
    } catch (const std::exception& e) {
      errors[static_cast<std::size_t>(i)] = e.what();
    }
  }
  for (const std::string& e : errors)
    if (!e.empty()) throw std::runtime_error(e);
}

}  // namespace detail

inline std::vector<Point> run_settings(const std::vector<Setting>& settings,
                                       const RunOptions& options = {}) {
  const Index ns = static_cast<Index>(settings.size());
  // 1. Streams.
  std::vector<detail::Stream> streams(settings.size());
  detail::parallel_for(ns, options.threads, [&](Index i) {
    const Setting& s = settings[static_cast<std::size_t>(i)];
    detail::Stream& st = streams[static_cast<std::size_t>(i)];
    if (s.task == TaskKind::recall) {
      st.recall = std::make_unique<recall::Task<Scalar>>(
          recall::make_task<Scalar>(recall_config(s.context, s.items, s.queries, s.seed)));
    } else {
      st.icl = std::make_unique<icl::Task<Scalar>>(
          icl::make_task<Scalar>(icl_config(s.context, s.items, s.queries, s.seed, s.blocked)));
    }
  });

  // 2. Codebooks, one per (task, items, seed, size) or, fitted on the stream, per (setting, size).
  using Key = std::tuple<int, Index, std::uint64_t, Index, Index>;  // (task, items, seed, S, setting)
  std::map<Key, Mat> codebooks;
  std::vector<Key> keys;
  for (Index i = 0; i < ns; ++i) {
    const Setting& s = settings[static_cast<std::size_t>(i)];
    for (const MixerSpec& m : s.mixers) {
      if (m.family != Family::vq) continue;
      const Key k{static_cast<int>(s.task), s.task == TaskKind::icl ? s.items : 0,
                  s.seed, m.size, s.vq_on_stream ? i : -1};
      if (codebooks.emplace(k, Mat()).second) keys.push_back(k);
    }
  }
  std::sort(keys.begin(), keys.end(),
            [](const Key& a, const Key& b) { return std::get<3>(a) > std::get<3>(b); });
  detail::parallel_for(static_cast<Index>(keys.size()), options.threads, [&](Index j) {
    const Key& k = keys[static_cast<std::size_t>(j)];
    const Index setting = std::get<4>(k);
    const Mat cal = setting >= 0 ? streams[static_cast<std::size_t>(setting)].keys()
                                 : calibration_keys(static_cast<TaskKind>(std::get<0>(k)),
                                                    std::get<1>(k), std::get<2>(k));
    Mat cb = ovq::fit_codebook<Scalar>(cal, std::get<3>(k), kmeans_options());
    codebooks.at(k) = std::move(cb);  // distinct keys: no two threads touch one entry
  });

  // 3. Jobs.
  struct Job {
    Index setting, mixer;
    double cost;
  };
  std::vector<Job> jobs;
  std::vector<std::vector<Point>> points(settings.size());
  for (Index i = 0; i < ns; ++i) {
    const Setting& s = settings[static_cast<std::size_t>(i)];
    points[static_cast<std::size_t>(i)].resize(s.mixers.size());
    for (Index m = 0; m < static_cast<Index>(s.mixers.size()); ++m)
      jobs.push_back({i, m, detail::job_cost(s, s.mixers[static_cast<std::size_t>(m)])});
  }
  std::stable_sort(jobs.begin(), jobs.end(),
                   [](const Job& a, const Job& b) { return a.cost > b.cost; });
  detail::parallel_for(static_cast<Index>(jobs.size()), options.threads, [&](Index j) {
    const Job& job = jobs[static_cast<std::size_t>(j)];
    const Setting& s = settings[static_cast<std::size_t>(job.setting)];
    const MixerSpec& m = s.mixers[static_cast<std::size_t>(job.mixer)];
    const detail::Stream& st = streams[static_cast<std::size_t>(job.setting)];
    const Mat* cb = nullptr;
    if (m.family == Family::vq)
      cb = &codebooks.at(Key{static_cast<int>(s.task), s.task == TaskKind::icl ? s.items : 0,
                             s.seed, m.size, s.vq_on_stream ? job.setting : -1});
    const Outcome out = run(m, st.keys(), st.values(), st.queries(), cb);
    Point p;
    p.experiment = s.experiment;
    p.task = s.task;
    p.context = s.context;
    p.items = s.items;
    p.seed = s.seed;
    p.mixer = m.name;
    p.family = m.family;
    p.size = m.size;
    p.bytes = out.bytes;
    p.sa_bytes = self_attention_bytes(s.context, kDim, kDim);
    p.ms = out.ms;
    if (s.task == TaskKind::recall) {
      p.score = recall::accuracy(*st.recall, out.outputs);
    } else {
      const icl::Score sc = icl::score(*st.icl, out.outputs);
      p.score = sc.nmse;
      p.learnt = sc.learnt;
    }
    points[static_cast<std::size_t>(job.setting)][static_cast<std::size_t>(job.mixer)] = p;
    if (options.progress) {
#if defined(_OPENMP)
#pragma omp critical(study_progress)
#endif
      std::fprintf(stderr, "  %-10s T=%-6td %s=%-4td seed %llu  %-22s %8.0f ms\n",
                   s.experiment.c_str(), s.context, s.task == TaskKind::recall ? "M" : "F",
                   s.items, static_cast<unsigned long long>(s.seed), m.name.c_str(), out.ms);
    }
  });

  std::vector<Point> all;
  for (Index i = 0; i < ns; ++i) {
    const auto& v = points[static_cast<std::size_t>(i)];
    all.insert(all.end(), v.begin(), v.end());
    const Setting& s = settings[static_cast<std::size_t>(i)];
    if (!s.oracle || s.task != TaskKind::icl) continue;
    const icl::Task<Scalar>& task = *streams[static_cast<std::size_t>(i)].icl;
    const icl::Score sc = icl::score(task, icl::region_mean_oracle(task));
    Point p;
    p.experiment = s.experiment;
    p.task = s.task;
    p.context = s.context;
    p.items = s.items;
    p.seed = s.seed;
    p.mixer = "oracle: region mean";
    p.family = Family::reference;
    p.sa_bytes = self_attention_bytes(s.context, kDim, kDim);
    p.score = sc.nmse;
    p.learnt = sc.learnt;
    all.push_back(p);
  }
  return all;
}

}  // namespace study
