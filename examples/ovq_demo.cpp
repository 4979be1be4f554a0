// ovq_demo: in-context recall with the four mixers, at two context lengths.
//
// Task (examples/recall_task.hpp, fixed before looking at any result):
//   dk = dv = 64, one head, float. The context is a stream of T tokens:
//     - filler: unit keys near one of 4 shared random directions (noise 0.3, cosine ~0.96 to
//       its direction), random unit values, as filler text whose keys crowd a few directions;
//     - M random "facts" at random positions: random unit keys (redrawn while their cosine with
//       a filler direction or an earlier fact exceeds 0.5), random unit values.
//   Then Q queries: each a noisy copy of a fact key (noise 0.25, cosine ~0.97), renormalised.
//   Logit scale beta = 25 (what a trained layer uses with unit keys), so attention is sharp.
//   A query is right when its output is nearest, by cosine, to its fact's value among all M
//   fact values (chance: 1/M).
//
// Mixers: causal self-attention (the reference, exact); linear attention (elu+1 feature map,
// normalised); VQ-attention with a codebook of S codes fitted by k-means (k-means++ then 8 Lloyd
// iterations) on the keys of a calibration stream drawn from the same generator with another
// seed (so its codebook has never seen this stream's facts, as a codebook trained offline);
// OVQ-attention with capacity N (chunk L = 64, dirichlet growth, spread seeding, adaptive rate).
// S = N in {256, 1024}.
//
// Reading the queries: the context goes through forward(); the state is then kept as a
// snapshot and the queries are read through copies of it, so that no query is absorbed and no
// query sees another's answer. A query token still has to be fed as a token (key, value): it is
// fed with key -q and value 0. A zero value adds only to a softmax (or linear attention's)
// normaliser, never to the numerator, so it does not change the output's direction, which is
// all the accuracy looks at; key -q gives it a negligible weight besides (logit -beta). Queries
// go in blocks read by one forward() on one copy of the snapshot: within a block, all reads
// happen before the mixer writes anything that could mix values (VQ and OVQ write their
// dictionaries only once a chunk is complete, after its reads), so a block of 64 queries costs
// one state copy instead of 64. OVQ blocks are L - pending tokens, so that the block ends at
// most at the chunk boundary (a write there happens after all reads and is then discarded).
//
// Columns: recall (%), state bytes (state.bytes() after the context), state as % of the
// self-attention key/value cache at that T, and wall time of context forward + query reads (ms;
// VQ's codebook fit is offline work and reported separately).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include <ovq/ovq.hpp>

#include "recall_task.hpp"

namespace {

using Scalar = float;
using Mat = ovq::RowMatrix<Scalar>;
using ovq::Index;

constexpr Index kDim = 64;
constexpr double kBeta = 25.0;
constexpr Index kChunk = 64;      // OVQ chunk L, and the query block size
constexpr int kKmeansIters = 8;

double now_ms() {
  using clock = std::chrono::steady_clock;
  return std::chrono::duration<double, std::milli>(clock::now().time_since_epoch()).count();
}

// ---------------------------------------------------------------------------------------------
// k-means for the VQ codebook: k-means++ seeding, then Lloyd iterations (Euclidean distance,
// as VQ-attention quantises). An emptied code is re-seeded on the point farthest from its code.
Mat kmeans(const Mat& x, Index codes, int iterations, std::uint64_t seed) {
  const Index n = x.rows();
  codes = std::min(codes, n);
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> uniform(0.0, 1.0);
  const Eigen::VectorXf xnorm = x.rowwise().squaredNorm();

  Mat c(codes, x.cols());
  Eigen::VectorXd d2(n);
  const Index first = static_cast<Index>(rng() % static_cast<std::uint64_t>(n));
  c.row(0) = x.row(first);
  for (Index i = 0; i < n; ++i) d2[i] = (x.row(i) - c.row(0)).squaredNorm();
  for (Index s = 1; s < codes; ++s) {
    const double total = d2.sum();
    Index pick = n - 1;
    if (total > 0) {
      double r = uniform(rng) * total;
      for (Index i = 0; i < n; ++i) {
        r -= d2[i];
        if (r < 0) {
          pick = i;
          break;
        }
      }
    } else {
      pick = static_cast<Index>(rng() % static_cast<std::uint64_t>(n));
    }
    c.row(s) = x.row(pick);
    // |x_i - c_s|^2 for every i, with one matrix-vector product.
    const Eigen::VectorXf dots = x * c.row(s).transpose();
    const float cn = c.row(s).squaredNorm();
    for (Index i = 0; i < n; ++i)
      d2[i] = std::min<double>(d2[i], std::max(0.0f, xnorm[i] - 2.0f * dots[i] + cn));
  }

  std::vector<Index> assign(static_cast<std::size_t>(n));
  Eigen::VectorXf dist(n);
  for (int it = 0; it < iterations; ++it) {
    // |x - c|^2 = |x|^2 - 2 x.c + |c|^2, with one GEMM.
    const Mat dots = x * c.transpose();
    const Eigen::RowVectorXf cnorm = c.rowwise().squaredNorm().transpose();
    for (Index i = 0; i < n; ++i) {
      Index best = 0;
      float best_d = std::numeric_limits<float>::infinity();
      for (Index s = 0; s < codes; ++s) {
        const float d = cnorm[s] - 2.0f * dots(i, s);
        if (d < best_d) {
          best_d = d;
          best = s;
        }
      }
      assign[static_cast<std::size_t>(i)] = best;
      dist[i] = best_d + xnorm[i];
    }
    Mat sum = Mat::Zero(codes, x.cols());
    std::vector<Index> count(static_cast<std::size_t>(codes), 0);
    for (Index i = 0; i < n; ++i) {
      sum.row(assign[static_cast<std::size_t>(i)]) += x.row(i);
      ++count[static_cast<std::size_t>(assign[static_cast<std::size_t>(i)])];
    }
    for (Index s = 0; s < codes; ++s) {
      if (count[static_cast<std::size_t>(s)] > 0) {
        c.row(s) = sum.row(s) / static_cast<float>(count[static_cast<std::size_t>(s)]);
      } else {
        Index far = 0;
        dist.maxCoeff(&far);
        c.row(s) = x.row(far);
        dist[far] = 0;
      }
    }
  }
  return c;
}

// ---------------------------------------------------------------------------------------------
struct Result {
  std::string name;
  Index context = 0;
  double recall = 0;       // fraction
  std::size_t bytes = 0;   // state after the context
  double ms = 0;           // context forward + query reads
};

// How many queries one copy of the snapshot can read (see the comment at the top).
template <class State>
Index query_block(const State&) {
  return kChunk;
}
Index query_block(const ovq::OvqState<Scalar>& s) {
  return s.chunk() - s.pending();
}

template <class Mixer>
Result run(const std::string& name, const Mixer& mixer, typename Mixer::State state,
           const recall::Task<Scalar>& task) {
  Result res;
  res.name = name;
  res.context = task.keys.rows();
  const Index Q = task.queries.rows();
  const Index dv = task.values.cols();
  Mat out(Q, dv);

  const double t0 = now_ms();
  // Context: each token's query is its own key (its output is not used here).
  mixer.forward(state, task.keys, task.keys, task.values);
  res.bytes = state.bytes();

  const Index block = std::max<Index>(query_block(state), 1);
  const Mat neg_q = -task.queries;
  const Mat zero_v = Mat::Zero(std::min(block, Q), dv);
  for (Index q0 = 0; q0 < Q; q0 += block) {
    const Index len = std::min(block, Q - q0);
    typename Mixer::State copy = state;
    mixer.forward(copy, task.queries.middleRows(q0, len), neg_q.middleRows(q0, len),
                  zero_v.topRows(len), out.middleRows(q0, len));
  }
  res.ms = now_ms() - t0;
  res.recall = recall::accuracy(task, out);
  return res;
}

void usage(const char* argv0) {
  std::printf(
      "usage: %s [--quick] [--seed S] [--help]\n"
      "  In-context recall of M key/value facts hidden among filler tokens, read back by noisy\n"
      "  queries, for self-attention, linear attention, VQ-attention and OVQ-attention.\n"
      "  --quick   smaller run: T in {1024, 4096}, M = 64, Q = 128 (default T in {2048, 8192},\n"
      "            M = 128, Q = 256)\n"
      "  --seed S  task seed (default 1); the VQ calibration stream uses another seed\n"
      "  --help    this text\n",
      argv0);
}

std::string percent(double x, int decimals = 1) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.*f", decimals, 100.0 * x);
  return buf;
}

}  // namespace

int main(int argc, char** argv) {
  // One head, one thread: the mixers' kernels multiply small tiles (32 x 128 and the like), and
  // with OpenMP Eigen would fork a thread team for each of them, which costs far more than it
  // saves (and much more again when the cores are shared with other work). MultiHead, which
  // parallelises over heads, gets the same effect because Eigen stays serial inside a parallel
  // region.
  Eigen::setNbThreads(1);

  bool quick = false;
  std::uint64_t seed = 1;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--help" || a == "-h") {
      usage(argv[0]);
      return 0;
    } else if (a == "--quick") {
      quick = true;
    } else if (a == "--seed" && i + 1 < argc) {
      char* end = nullptr;
      const char* s = argv[++i];
      seed = std::strtoull(s, &end, 10);
      if (end == s || *end != '\0') {
        std::fprintf(stderr, "ovq_demo: --seed expects a non-negative integer, got '%s'\n", s);
        return 2;
      }
    } else {
      std::fprintf(stderr, "ovq_demo: unknown argument '%s'\n", a.c_str());
      usage(argv[0]);
      return 2;
    }
  }

  const std::vector<Index> contexts = quick ? std::vector<Index>{1024, 4096}
                                            : std::vector<Index>{2048, 8192};
  const Index facts = quick ? 64 : 128;
  const Index queries = quick ? 128 : 256;
  const std::vector<Index> capacities = {256, 1024};

  recall::TaskConfig base;
  base.key_dim = kDim;
  base.value_dim = kDim;
  base.facts = facts;
  base.queries = queries;
  base.seed = seed;

  std::printf("ovq_demo: in-context recall (seed %llu%s)\n",
              static_cast<unsigned long long>(seed), quick ? ", quick" : "");
  std::printf(
      "  stream of T tokens: filler keys near %td shared directions (noise %.2f), random values;\n"
      "  M = %td facts (random unit keys and values) at random positions; then Q = %td queries,\n"
      "  noisy fact keys (noise %.2f). dk = dv = %td, unit keys, beta = %g, one head, float.\n"
      "  Right = output nearest (cosine) to the queried fact's value among the M (chance %.1f%%).\n"
      "  Queries are read through copies of the post-context state (never absorbed).\n"
      "  VQ: k-means codebook (S codes) from a calibration stream of another seed; OVQ: capacity\n"
      "  N, chunk L = %td, dirichlet growth, spread seeding, adaptive rate. S = N.\n"
      "  ms: context forward + query reads, one thread.\n\n",
      base.directions, base.distractor_noise, facts, queries, base.query_noise, kDim, kBeta,
      100.0 / static_cast<double>(facts), kChunk);

  std::vector<Result> results;
  std::vector<std::pair<Index, double>> fit_ms;  // (T, total k-means ms)
  const double start = now_ms();

  for (const Index T : contexts) {
    recall::TaskConfig cfg = base;
    cfg.context = T;
    const recall::Task<Scalar> task = recall::make_task<Scalar>(cfg);
    recall::TaskConfig cal_cfg = cfg;
    cal_cfg.seed = seed ^ 0x9e3779b97f4a7c15ULL;  // another stream from the same generator
    const recall::Task<Scalar> calibration = recall::make_task<Scalar>(cal_cfg);

    {
      ovq::SelfAttentionOptions o;
      o.beta = kBeta;
      const ovq::SelfAttention<Scalar> m(o);
      results.push_back(run("self-attention", m, m.make_state(kDim, kDim), task));
    }
    {
      ovq::LinearAttentionOptions o;
      o.feature_map = ovq::FeatureMap::elu1;
      o.normalize = true;
      const ovq::LinearAttention<Scalar> m(o);
      results.push_back(run("linear attention", m, m.make_state(kDim, kDim), task));
    }
    double fit = 0;
    for (const Index S : capacities) {
      const double f0 = now_ms();
      const Mat codebook = kmeans(calibration.keys, S, kKmeansIters, cal_cfg.seed + 17);
      fit += now_ms() - f0;
      ovq::VqAttentionOptions o;
      o.beta = kBeta;
      const ovq::VqAttention<Scalar> m(o);
      results.push_back(
          run("VQ S=" + std::to_string(S), m, m.make_state(codebook, kDim), task));
    }
    fit_ms.emplace_back(T, fit);
    for (const Index N : capacities) {
      ovq::OvqOptions o;
      o.capacity = N;
      o.chunk = kChunk;
      o.beta = kBeta;
      const ovq::OvqAttention<Scalar> m(o);
      results.push_back(run("OVQ N=" + std::to_string(N), m, m.make_state(kDim, kDim), task));
    }
  }
  const double total = now_ms() - start;

  auto kv_bytes = [](Index T) {
    return static_cast<double>(T) * static_cast<double>(2 * kDim) * sizeof(Scalar);
  };
  std::printf("%-18s %6s %8s %12s %9s %10s\n", "mixer", "T", "recall%", "state bytes",
              "% of KV", "ms");
  std::printf("%-18s %6s %8s %12s %9s %10s\n", "------------------", "------", "-------",
              "-----------", "--------", "---------");
  Index last_t = -1;
  for (const Result& r : results) {
    if (last_t >= 0 && r.context != last_t) std::printf("\n");
    last_t = r.context;
    std::printf("%-18s %6td %8s %12zu %9s %10.1f\n", r.name.c_str(), r.context,
                percent(r.recall).c_str(), r.bytes,
                percent(static_cast<double>(r.bytes) / kv_bytes(r.context)).c_str(), r.ms);
  }
  std::printf("\n");
  for (const auto& [T, ms] : fit_ms)
    std::printf("VQ codebook fits (k-means, both S) at T=%td: %.1f ms, not in the table.\n", T, ms);

  // Conclusions, from the measured numbers, at the longest context.
  const Index T = contexts.back();
  auto find = [&](const std::string& name) -> const Result& {
    for (const Result& r : results)
      if (r.context == T && r.name == name) return r;
    std::abort();
  };
  const Result& sa = find("self-attention");
  const Result& lin = find("linear attention");
  std::string line;
  for (const Index N : capacities) {
    const Result& o = find("OVQ N=" + std::to_string(N));
    char buf[160];
    std::snprintf(buf, sizeof buf, "%sN=%td %s%% (%+.1f points, %.1fx the state)",
                  line.empty() ? "" : "; ", N, percent(o.recall).c_str(),
                  100.0 * (o.recall - lin.recall),
                  static_cast<double>(o.bytes) / static_cast<double>(lin.bytes));
    line += buf;
  }
  std::printf("\nAt T=%td, OVQ over linear attention (%s%%, %zu B): %s.\n", T,
              percent(lin.recall).c_str(), lin.bytes, line.c_str());
  line.clear();
  for (const Index N : capacities) {
    const Result& o = find("OVQ N=" + std::to_string(N));
    char buf[160];
    std::snprintf(buf, sizeof buf, "%sN=%td %+.1f points with %s%% of the cache in %.2fx the time",
                  line.empty() ? "" : "; ", N, 100.0 * (o.recall - sa.recall),
                  percent(static_cast<double>(o.bytes) / static_cast<double>(sa.bytes)).c_str(),
                  o.ms / sa.ms);
    line += buf;
  }
  std::printf("OVQ against self-attention (%s%%, %zu B, %.1f ms): %s.\n",
              percent(sa.recall).c_str(), sa.bytes, sa.ms, line.c_str());
  std::printf("\nTotal %.1f s.\n", total / 1000.0);
  return 0;
}
