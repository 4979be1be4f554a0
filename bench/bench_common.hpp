#pragma once
// What every ovq benchmark binary shares: threads, the in-process sgemm reference, seeded inputs,
// FLOP counts, counters, and the prefill/decode drivers around MultiHead (batch 1).
//
// Each binary registers BM_Peak_sgemm first and BM_Peak_sgemm/at:end last (Google Benchmark
// runs benchmarks in registration order), so every run carries its own reference rate: Eigen's
// fp32 GEMM on this machine, with the same threads, in the same process. Kernel benchmarks report
//   GFLOPS        FLOPs the mathematics needs (causal half only; formulas in namespace flops) / s
//   frac_sgemm    GFLOPS / the best BM_Peak_sgemm rate of this process so far (measured lazily,
//                 once, when a filter left BM_Peak_sgemm out); scripts/bench's report divides
//                 by the best of the whole process instead, the end measurement included
//   sgemm_GFLOPS  that reference rate
//   bytes_state   MultiHead::bytes() after the run: what the streaming state holds
//   tokens_per_s  tokens of one head stream per second (decode: steps per second)
//   threads       the thread count used
// Threads: --threads=N (or --threads N) on the command line, else OVQ_BENCH_THREADS, else
// OpenMP's default (all cores, or OMP_NUM_THREADS). It sets OpenMP's default, Eigen's GEMM
// threads and MultiHead::set_threads alike. Without OpenMP everything runs on one thread.
// --thread-counts=A,B,... instead registers every case once per count, named
// <case>/nthreads:<count> and run on that many threads, so that one process can compare thread
// counts (scripts/bench's thread scaling interleaves their repetitions at random).
//
// Names carry Google Benchmark style arguments, so a result is found by mixer, phase and shape:
//   BM_<Mixer>_prefill/T:<tokens>/<mixer parameters>/d:<head dim>/H:<heads>       (Hq = Hkv)
//   BM_<Mixer>_prefill/T:<tokens>/.../d:<d>/Hq:<query heads>/Hkv:<kv heads>      (grouped)
//   BM_<Mixer>_decode/ctx:<context>/.../d:<d>/H:<heads>
//   BM_OVQ_prefill_full/..., BM_OVQ_decode_full/...: OVQ from a dictionary already at capacity
// Google Benchmark appends "/real_time" (every case uses real time).
#include <benchmark/benchmark.h>

#include <Eigen/Core>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <functional>
#include <iterator>
#include <map>
#include <memory>
#include <optional>
#include <ovq/ovq.hpp>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace ovq_bench {

using ovq::Index;
using Matrix = ovq::RowMatrix<float>;

// ---------------------------------------------------------------------------------------------
// Threads
// ---------------------------------------------------------------------------------------------

inline int& configured_threads() {
  static int threads = 1;
  return threads;
}

inline void apply_threads(int threads) {
#if defined(OVQ_HAS_OPENMP)
  threads = std::max(threads, 1);
  omp_set_num_threads(threads);
  Eigen::setNbThreads(threads);
#else
  threads = 1;  // nothing would run in parallel
#endif
  configured_threads() = threads;
}

inline int default_threads() {
#if defined(OVQ_HAS_OPENMP)
  return omp_get_max_threads();
#else
  return 1;
#endif
}

// The thread counts of --thread-counts; empty: every case runs on configured_threads() and keeps
// its plain name.
inline std::vector<int>& compared_thread_counts() {
  static std::vector<int> counts;
  return counts;
}

// "1,2" -> {1, 2}. Throws std::invalid_argument naming the flag unless every count is a whole
// number from 1 to 1024 and no count repeats.
inline std::vector<int> parse_thread_counts(const char* text) {
  std::vector<int> counts;
  const char* p = text;
  while (true) {
    char* end = nullptr;
    const long count = std::strtol(p, &end, 10);
    if (end == p || count < 1 || count > 1024 || (*end != ',' && *end != '\0'))
      throw std::invalid_argument(std::string("--thread-counts: expected a comma-separated "
                                              "list of thread counts from 1 to 1024, got \"") +
                                  text + "\"");
    if (std::find(counts.begin(), counts.end(), static_cast<int>(count)) != counts.end())
      throw std::invalid_argument(std::string("--thread-counts: ") + std::to_string(count) +
                                  " appears twice in \"" + text + "\"");
#if !defined(OVQ_HAS_OPENMP)
    // Without OpenMP every case runs on one thread: a larger count would only mislabel it.
    if (count > 1)
      throw std::invalid_argument(std::string("--thread-counts: this binary was built without "
                                              "OpenMP, so the only count is 1, got \"") +
                                  text + "\"");
#endif
    counts.push_back(static_cast<int>(count));
    if (*end == '\0') break;
    p = end + 1;
  }
  return counts;
}

// Takes --threads=N / --threads N out of argv (Google Benchmark rejects unknown flags).
inline int parse_threads(int& argc, char** argv) {
  int threads = 0;
  if (const char* env = std::getenv("OVQ_BENCH_THREADS"); env != nullptr && *env != '\0')
    threads = std::atoi(env);
  int out = 1;
  for (int i = 1; i < argc; ++i) {
    if (std::strncmp(argv[i], "--threads=", 10) == 0) {
      threads = std::atoi(argv[i] + 10);
    } else if (std::strcmp(argv[i], "--threads") == 0 && i + 1 < argc) {
      threads = std::atoi(argv[++i]);
    } else {
      argv[out++] = argv[i];
    }
  }
  argc = out;
  argv[argc] = nullptr;
  return threads > 0 ? threads : default_threads();
}

// Takes --thread-counts=A,B,... out of argv into compared_thread_counts() (the kernel binaries;
// the streaming memory check has one thread count).
inline void parse_compared_thread_counts(int& argc, char** argv) {
  int out = 1;
  for (int i = 1; i < argc; ++i) {
    if (std::strncmp(argv[i], "--thread-counts=", 16) == 0) {
      compared_thread_counts() = parse_thread_counts(argv[i] + 16);
    } else {
      argv[out++] = argv[i];
    }
  }
  argc = out;
  argv[argc] = nullptr;
}

// Runs one case on `threads` threads and puts the process's count back afterwards.
class ScopedThreads {
 public:
  explicit ScopedThreads(int threads) : saved_(configured_threads()) { apply_threads(threads); }
  ~ScopedThreads() { apply_threads(saved_); }
  ScopedThreads(const ScopedThreads&) = delete;
  ScopedThreads& operator=(const ScopedThreads&) = delete;

 private:
  int saved_;
};

// ---------------------------------------------------------------------------------------------
// Seeded inputs
// ---------------------------------------------------------------------------------------------

// splitmix64: fast enough to fill a gigabyte of inputs in well under a second.
class Rng {
 public:
  explicit Rng(std::uint64_t seed) : state_(seed) {}
  std::uint64_t next() {
    std::uint64_t z = (state_ += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
  }
  // Uniform in [-1, 1).
  float uniform() { return static_cast<float>(next() >> 40) * (2.0f / 16777216.0f) - 1.0f; }

 private:
  std::uint64_t state_;
};

inline std::uint64_t mix_seed(std::uint64_t a, std::uint64_t b, std::uint64_t c = 0) {
  Rng r(a * 0x9e3779b97f4a7c15ULL ^ (b + 0x632be59bd9b4e019ULL) ^ (c << 17));
  return r.next();
}

// Rows uniform in [-1, 1)^d; with unit_rows, scaled to unit norm (VQ and OVQ assume normalised
// queries and keys, which the layer would do; the values stay as drawn).
inline void fill_rows(Eigen::Ref<Matrix> m, std::uint64_t seed, bool unit_rows) {
  Rng rng(seed);
  for (Index i = 0; i < m.rows(); ++i) {
    float* row = m.row(i).data();
    for (Index j = 0; j < m.cols(); ++j) row[j] = rng.uniform();
    if (unit_rows) m.row(i).normalize();
  }
}

template <class Element = float>
struct Inputs {
  ovq::RowMatrix<Element> q;  // (Hq T) x d
  ovq::RowMatrix<Element> k;  // (Hkv T) x d
  ovq::RowMatrix<Element> v;  // (Hkv T) x d
};

// A float matrix in another element type (to nearest).
template <class Element>
ovq::RowMatrix<Element> as_element(const Matrix& m) {
  if constexpr (std::is_same_v<Element, float>) {
    return m;
  } else {
    return m.unaryExpr([](float x) { return ovq::narrow<Element>(x); });
  }
}

// Prefill inputs, generated outside any timed region (the same values for every element type,
// rounded to it). One set is kept at a time per element type: consecutive cases share shapes,
// and the largest set is about 1 GiB.
template <class Element = float>
inline const Inputs<Element>& prefill_inputs(Index tokens, Index hq, Index hkv, Index d) {
  static std::unique_ptr<Inputs<Element>> cached;
  static std::vector<Index> cached_key;
  const std::vector<Index> key{tokens, hq, hkv, d};
  if (!cached || cached_key != key) {
    cached.reset();
    Matrix q(hq * tokens, d), k(hkv * tokens, d), v(hkv * tokens, d);
    fill_rows(q, mix_seed(1, static_cast<std::uint64_t>(tokens), 1), true);
    fill_rows(k, mix_seed(1, static_cast<std::uint64_t>(tokens), 2), true);
    fill_rows(v, mix_seed(1, static_cast<std::uint64_t>(tokens), 3), false);
    cached = std::make_unique<Inputs<Element>>(
        Inputs<Element>{as_element<Element>(q), as_element<Element>(k), as_element<Element>(v)});
    cached_key = key;
  }
  return *cached;
}

// ---------------------------------------------------------------------------------------------
// The reference: Eigen fp32 GEMM
// ---------------------------------------------------------------------------------------------

inline constexpr Index kSgemmSize = 2048;

inline double sgemm_flops() {
  const double n = static_cast<double>(kSgemmSize);
  return 2.0 * n * n * n;
}

// The best sgemm rate measured so far on the current thread count (0 until one is measured):
// with --thread-counts a process measures one per count, and each case divides by its own.
inline double& sgemm_gflops() {
  static std::map<int, double> rate_by_threads;
  return rate_by_threads[configured_threads()];
}

struct SgemmOperands {
  Eigen::MatrixXf a, b, c;
  SgemmOperands()
      : a(Eigen::MatrixXf::Random(kSgemmSize, kSgemmSize)),
        b(Eigen::MatrixXf::Random(kSgemmSize, kSgemmSize)),
        c(Eigen::MatrixXf::Zero(kSgemmSize, kSgemmSize)) {}
  void multiply() { c.noalias() = a * b; }
};

inline SgemmOperands& sgemm_operands() {
  static SgemmOperands operands;
  return operands;
}

using Clock = std::chrono::steady_clock;

inline double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// The rate kernel benchmarks divide by: BM_Peak_sgemm's, or measured here once when no
// BM_Peak_sgemm has run on this thread count yet (the filter left it out, or random
// interleaving ran a case first; untimed: this runs after a benchmark's timed loop).
inline double reference_gflops() {
  if (sgemm_gflops() > 0.0) return sgemm_gflops();
  SgemmOperands& op = sgemm_operands();
  op.multiply();  // warm-up: threads started, pages touched
  constexpr int kRepeats = 3;
  const Clock::time_point t0 = Clock::now();
  for (int i = 0; i < kRepeats; ++i) {
    op.multiply();
    benchmark::DoNotOptimize(op.c.data());
  }
  sgemm_gflops() = sgemm_flops() * kRepeats / seconds_since(t0) / 1e9;
  std::fprintf(stderr,
               "ovq bench: no BM_Peak_sgemm result yet on %d thread(s); measured sgemm once: "
               "%.1f GFLOPS\n",
               configured_threads(), sgemm_gflops());
  return sgemm_gflops();
}

// C (n x n) = A B, n = kSgemmSize, fp32, Eigen with this run's thread count. 2 n^3 flops.
inline void BM_Peak_sgemm(benchmark::State& st) {
  SgemmOperands& op = sgemm_operands();
  op.multiply();  // warm-up, untimed
  const Clock::time_point t0 = Clock::now();
  for (auto _ : st) {
    op.multiply();
    benchmark::DoNotOptimize(op.c.data());
    benchmark::ClobberMemory();
  }
  const double seconds = seconds_since(t0);
  // The runner calls this function more than once (while it sizes the run, and once per
  // repetition): the reference is the best rate of them all, so that a call slowed down by
  // another process on the machine cannot inflate the frac_sgemm of the kernels measured after.
  if (seconds > 0.0)
    sgemm_gflops() = std::max(sgemm_gflops(),
                              sgemm_flops() * static_cast<double>(st.iterations()) / seconds / 1e9);
  st.counters["GFLOPS"] =
      benchmark::Counter(sgemm_flops() / 1e9, benchmark::Counter::kIsIterationInvariantRate);
  st.counters["n"] = static_cast<double>(kSgemmSize);
  st.counters["threads"] = configured_threads();
}

// ---------------------------------------------------------------------------------------------
// The machine's own ceilings, on this run's threads, in this process
// ---------------------------------------------------------------------------------------------
//
//   BM_Peak_fma        fp32 fused multiply-adds, independent chains of full vectors a thread
//                      (kPeakChains: more than the FMA pipes' latency times their throughput,
//                      and all in registers): the arithmetic ceiling of every float kernel
//   BM_Peak_bf16dot    AVX512-BF16 pair dot products (vdpbf16ps, 32 multiply-adds a vector) in
//                      the same chains, where the CPU has them: the ceiling of bf16 scores
//   BM_Peak_read       reading a buffer far larger than the caches (1 GiB, on huge pages like a
//                      KV cache), every thread its share, summing it: the ceiling of a decode
//                      step, which streams its state
// Like BM_Peak_sgemm, each runs first and last, and a case divides by the best so far on its
// thread count (frac_peak, frac_bf16_peak, frac_bandwidth in report()).

enum class Ceiling { fma, bf16dot, read };

inline double& ceiling(Ceiling which) {
  static std::map<std::pair<int, int>, double> rates;  // (ceiling, threads) -> GFLOPS or GB/s
  return rates[{static_cast<int>(which), configured_threads()}];
}

#if defined(OVQ_ARCH_AVX512)
using PeakVector = ovq::kernels::simd::F32x16;
#elif defined(OVQ_ARCH_AVX2)
using PeakVector = ovq::kernels::simd::F32x8;
#endif

// One thread's chains: kPeakChains independent accumulators, `iterations` FMAs each. Returns the
// flops. AVX2 has 16 vector registers: 16 chains and their two operands would not fit, and the
// chain kept on the stack would run at the speed of a store and a load.
#if defined(OVQ_ARCH_AVX512) || defined(OVQ_ARCH_AVX2)
inline constexpr int kPeakChains = PeakVector::kWidth == 16 ? 16 : 12;
#endif
inline double fma_chains(std::int64_t iterations, float* sink) {
#if defined(OVQ_ARCH_AVX512) || defined(OVQ_ARCH_AVX2)
  using V = PeakVector;
  typename V::reg a[kPeakChains];
  for (int i = 0; i < kPeakChains; ++i) a[i] = V::set1(1.0f + 1e-3f * static_cast<float>(i));
  const typename V::reg b = V::set1(0.9999999f), c = V::set1(1e-7f);
  for (std::int64_t it = 0; it < iterations; ++it) {
    OVQ_UNROLL
    for (int i = 0; i < kPeakChains; ++i) a[i] = V::fmadd(a[i], b, c);
  }
  typename V::reg total = a[0];
  for (int i = 1; i < kPeakChains; ++i) total = V::add(total, a[i]);
  *sink = V::reduce_add(total);
  return 2.0 * kPeakChains * static_cast<double>(V::kWidth) * static_cast<double>(iterations);
#else
  float a[16];
  for (int i = 0; i < 16; ++i) a[i] = 1.0f + 1e-3f * static_cast<float>(i);
  for (std::int64_t it = 0; it < iterations; ++it)
    for (int i = 0; i < 16; ++i) a[i] = std::fma(a[i], 0.9999999f, 1e-7f);
  float total = 0;
  for (float x : a) total += x;
  *sink = total;
  return 2.0 * 16.0 * static_cast<double>(iterations);
#endif
}

#if defined(OVQ_ARCH_AVX512BF16)
inline double bf16dot_chains(std::int64_t iterations, float* sink) {
  __m512 a[16];
  for (int i = 0; i < 16; ++i) a[i] = _mm512_set1_ps(1.0f + 1e-3f * static_cast<float>(i));
  const __m512bh x = (__m512bh)_mm512_set1_epi16(0x3f80);  // 1.0 in bf16
  const __m512bh y = (__m512bh)_mm512_set1_epi16(0x3380);  // 2^-24 in bf16
  for (std::int64_t it = 0; it < iterations; ++it) {
    OVQ_UNROLL
    for (int i = 0; i < 16; ++i) a[i] = _mm512_dpbf16_ps(a[i], x, y);
  }
  __m512 total = a[0];
  for (int i = 1; i < 16; ++i) total = _mm512_add_ps(total, a[i]);
  *sink = _mm512_reduce_add_ps(total);
  return 2.0 * 16.0 * 32.0 * static_cast<double>(iterations);
}
#endif

// Runs `chains` on every thread at once; returns the flops of all of them.
template <class Chains>
double run_on_threads(Chains chains, std::int64_t iterations) {
  double flops = 0.0;
  float sink = 0.0f;
#if defined(OVQ_HAS_OPENMP)
#pragma omp parallel num_threads(configured_threads()) reduction(+ : flops)
  {
    float mine = 0.0f;
    flops += chains(iterations, &mine);
#pragma omp critical(ovq_bench_sink)
    sink += mine;
  }
#else
  flops = chains(iterations, &sink);
#endif
  benchmark::DoNotOptimize(sink);
  return flops;
}

template <class Chains>
void peak_flops_case(benchmark::State& st, Chains chains, Ceiling which) {
  constexpr std::int64_t kIterations = std::int64_t(1) << 22;
  run_on_threads(chains, kIterations / 16);  // warm-up: the thread team started
  double flops = 0.0;
  const Clock::time_point t0 = Clock::now();
  for (auto _ : st) flops += run_on_threads(chains, kIterations);
  const double seconds = seconds_since(t0);
  if (seconds > 0.0) ceiling(which) = std::max(ceiling(which), flops / seconds / 1e9);
  st.counters["GFLOPS"] = benchmark::Counter(flops / 1e9, benchmark::Counter::kIsRate);
  st.counters["threads"] = configured_threads();
}

inline void BM_Peak_fma(benchmark::State& st) { peak_flops_case(st, fma_chains, Ceiling::fma); }

#if defined(OVQ_ARCH_AVX512BF16)
inline void BM_Peak_bf16dot(benchmark::State& st) {
  peak_flops_case(st, bf16dot_chains, Ceiling::bf16dot);
}
#endif

// 1 GiB of floats, touched before timing; every thread sums its contiguous share.
inline void BM_Peak_read(benchmark::State& st) {
  // On huge pages, as the KV caches the decode cases stream (core/row_buffer.hpp).
  static const ovq::RowBuffer<float> buffer = [] {
    ovq::RowBuffer<float> b(Index(1) << 22, 64);
    std::fill(b.data(), b.data() + b.rows() * b.cols(), 1.0f);
    return b;
  }();
  const Index n = buffer.rows() * buffer.cols();
  auto read_all = [&] {
    double total = 0.0;
#if defined(OVQ_HAS_OPENMP)
#pragma omp parallel for num_threads(configured_threads()) schedule(static) reduction(+ : total)
#endif
    for (Index block = 0; block < 64; ++block) {
      const float* p = buffer.data() + block * (n / 64);
#if defined(OVQ_ARCH_AVX512) || defined(OVQ_ARCH_AVX2)
      using V = PeakVector;
      typename V::reg acc[8];
      for (auto& a : acc) a = V::zero();
      for (Index i = 0; i < n / 64; i += 8 * V::kWidth)
        for (int u = 0; u < 8; ++u) acc[u] = V::add(acc[u], V::load(p + i + u * V::kWidth));
      for (int u = 1; u < 8; ++u) acc[0] = V::add(acc[0], acc[u]);
      total += V::reduce_add(acc[0]);
#else
      float s = 0.0f;
      for (Index i = 0; i < n / 64; ++i) s += p[i];
      total += s;
#endif
    }
    benchmark::DoNotOptimize(total);
  };
  read_all();  // warm-up
  const Clock::time_point t0 = Clock::now();
  for (auto _ : st) read_all();
  const double seconds = seconds_since(t0);
  const double bytes = static_cast<double>(st.iterations()) * static_cast<double>(n) * sizeof(float);
  if (seconds > 0.0) ceiling(Ceiling::read) = std::max(ceiling(Ceiling::read), bytes / seconds / 1e9);
  st.counters["GBps"] =
      benchmark::Counter(static_cast<double>(n) * sizeof(float) / 1e9,
                         benchmark::Counter::kIsIterationInvariantRate);
  st.counters["threads"] = configured_threads();
}

// ---------------------------------------------------------------------------------------------
// FLOPs the mathematics needs (MATH.md), per mixer. "Needed": the causal half of a score matrix
// only; multiply and add count 2. Helpers return totals over all heads; dk = dv = d here.
// ---------------------------------------------------------------------------------------------
namespace flops {

// MATH.md 1, causal self-attention: query i reads the C cached rows and the i + 1 rows of its
// own call up to itself, each a dot over dk and an axpy over dv:
//   prefill of T tokens from an empty cache: 2 * T (T + 1) / 2 * (dk + dv) per query head.
inline double self_prefill(Index tokens, Index dk, Index dv, Index hq) {
  const double t = static_cast<double>(tokens);
  return static_cast<double>(hq) * 2.0 * (t * (t + 1.0) / 2.0) * static_cast<double>(dk + dv);
}
//   decode step over a cache of C rows: 2 (C + 1) (dk + dv) per query head.
inline double self_decode(double cache_rows, Index dk, Index dv, Index hq) {
  return static_cast<double>(hq) * 2.0 * (cache_rows + 1.0) * static_cast<double>(dk + dv);
}

// MATH.md 2, linear attention in chunked GEMM form, chunk of Lc tokens (unnormalised):
//   per query head:  A = phi(Q) phi(K)^T, causal half   Lc (Lc + 1) / 2 * 2 dk
//                    A V, causal half                   Lc (Lc + 1) / 2 * 2 dv
//                    phi(Q) S_prev                      2 Lc dk dv
//   per kv head:     S += phi(K)^T V, z += sum phi(K)   2 Lc dk dv + 2 Lc dk
// A decode step is the chunk Lc = 1.
inline double linear_chunked(Index tokens, Index chunk, Index dk, Index dv, Index hq, Index hkv) {
  double per_q = 0.0, per_kv = 0.0;
  for (Index c0 = 0; c0 < tokens; c0 += chunk) {
    const double lc = static_cast<double>(std::min(chunk, tokens - c0));
    per_q +=
        lc * (lc + 1.0) * static_cast<double>(dk + dv) + 2.0 * lc * static_cast<double>(dk * dv);
    per_kv += 2.0 * lc * static_cast<double>(dk * dv) + 2.0 * lc * static_cast<double>(dk);
  }
  return static_cast<double>(hq) * per_q + static_cast<double>(hkv) * per_kv;
}

// MATH.md 3, VQ-attention with S codes and chunk L: per kv head and token, quantising the key
// against every code, 2 S dk; per query head and token, reading the S codes as memory and the
// quantised chunk rows up to itself, 2 (S + p + 1)(dk + dv) at chunk position p. A decode step
// is one token at p = 0 (each step is its own chunk).
inline double vq(Index tokens, Index chunk, Index codes, Index dk, Index dv, Index hq, Index hkv) {
  double read_rows = 0.0;
  for (Index t = 0; t < tokens; ++t) read_rows += static_cast<double>(codes + (t % chunk) + 1);
  return static_cast<double>(hq) * 2.0 * read_rows * static_cast<double>(dk + dv) +
         static_cast<double>(hkv) * 2.0 * static_cast<double>(tokens) *
             static_cast<double>(codes * dk);
}

// MATH.md 4, OVQ-attention. Work of a stream of tokens [t_begin, t_begin + tokens), simulated
// through the growth schedule (dictionary sizes are set by the schedule, not the data):
//   read   per query head, token at chunk position p, dictionary of n rows:
//          2 (n + p + 1)(dk + dv)
//   assign per kv head and completed chunk: the chunk's L keys against the n old centroids,
//          2 L n dk (the same scores seed the spread-maximising choice)
//   seed   per kv head and new centroid: its key against the L chunk keys, 2 L dk
// The sparse update, O(L (dk + dv)) per chunk, is not counted (under 0.1%).
struct OvqWork {
  double read_rows = 0.0;  // sum over tokens of the rows each reads
  double scored = 0.0;     // sum over chunks of L * n (assignment dots)
  double seeded = 0.0;     // sum over chunks of L * m (seeding dots)

  double total(Index dk, Index dv, Index hq, Index hkv) const {
    return static_cast<double>(hq) * 2.0 * read_rows * static_cast<double>(dk + dv) +
           static_cast<double>(hkv) * 2.0 * (scored + seeded) * static_cast<double>(dk);
  }
};

// m of MATH.md 4 step 1 for t absorbed tokens, n active centroids.
inline Index ovq_new_centroids(const ovq::OvqOptions& opt, std::int64_t t, Index n) {
  const Index target = opt.growth.target(t + opt.chunk, opt.capacity);
  Index m = std::clamp<Index>(target - n, 0, opt.chunk);
  if (n == 0) m = std::max<Index>(m, 1);
  return std::min(m, opt.capacity - n);
}

inline OvqWork ovq_stream(const ovq::OvqOptions& opt, std::int64_t t_begin, std::int64_t tokens) {
  const Index chunk = opt.chunk;
  Index n = 0;
  std::int64_t t = 0;
  // Fast-forward to the chunk holding t_begin.
  for (; t + chunk <= t_begin; t += chunk) n += ovq_new_centroids(opt, t, n);
  OvqWork work;
  for (std::int64_t pos = t_begin; pos < t_begin + tokens; ++pos) {
    const Index p = static_cast<Index>(pos - t);
    work.read_rows += static_cast<double>(n + p + 1);
    if (p == chunk - 1) {
      const Index m = ovq_new_centroids(opt, t, n);
      work.scored += static_cast<double>(chunk) * static_cast<double>(n);
      work.seeded += static_cast<double>(chunk) * static_cast<double>(m);
      n += m;
      t += chunk;
    }
  }
  return work;
}

// The same work for a stream whose dictionary is already at capacity when it starts (and so
// stays there: the growth opens nothing once n = N): every token reads N memory rows plus its
// chunk's local rows, every completed chunk is assigned against the N centroids, nothing is
// seeded. Chunks start at multiples of L from the beginning of the stream, as in the state.
inline OvqWork ovq_stream_full(const ovq::OvqOptions& opt, std::int64_t t_begin,
                               std::int64_t tokens) {
  const Index chunk = opt.chunk;
  const double n = static_cast<double>(opt.capacity);
  OvqWork work;
  for (std::int64_t pos = t_begin; pos < t_begin + tokens; ++pos) {
    const Index p = static_cast<Index>(pos % chunk);
    work.read_rows += n + static_cast<double>(p + 1);
    if (p == chunk - 1) work.scored += static_cast<double>(chunk) * n;
  }
  return work;
}

// Dictionary size after t tokens (whole chunks absorbed).
inline Index ovq_size_after(const ovq::OvqOptions& opt, std::int64_t tokens) {
  Index n = 0;
  for (std::int64_t t = 0; t + opt.chunk <= tokens; t += opt.chunk)
    n += ovq_new_centroids(opt, t, n);
  return n;
}

}  // namespace flops

// ---------------------------------------------------------------------------------------------
// Counters and names
// ---------------------------------------------------------------------------------------------

// read_bytes: what an iteration must read from memory (decode: the state), or < 0 (prefill).
// bf16_scores: the case's scores run on bf16 pair dot products (frac_bf16_peak).
inline void report(benchmark::State& st, double flops_per_iteration, double state_bytes,
                   double tokens_per_iteration, double read_bytes = -1.0,
                   bool bf16_scores = false) {
  using benchmark::Counter;
  const double ref = reference_gflops();
  st.counters["GFLOPS"] = Counter(flops_per_iteration / 1e9, Counter::kIsIterationInvariantRate);
  st.counters["frac_sgemm"] =
      Counter(flops_per_iteration / 1e9 / ref, Counter::kIsIterationInvariantRate);
  st.counters["sgemm_GFLOPS"] = ref;
  if (read_bytes < 0.0 && ceiling(Ceiling::fma) > 0.0)
    st.counters["frac_peak"] = Counter(flops_per_iteration / 1e9 / ceiling(Ceiling::fma),
                                       Counter::kIsIterationInvariantRate);
  if (read_bytes < 0.0 && bf16_scores && ceiling(Ceiling::bf16dot) > 0.0)
    st.counters["frac_bf16_peak"] = Counter(flops_per_iteration / 1e9 / ceiling(Ceiling::bf16dot),
                                            Counter::kIsIterationInvariantRate);
  if (read_bytes >= 0.0) {
    st.counters["read_GBps"] = Counter(read_bytes / 1e9, Counter::kIsIterationInvariantRate);
    if (ceiling(Ceiling::read) > 0.0)
      st.counters["frac_bandwidth"] = Counter(read_bytes / 1e9 / ceiling(Ceiling::read),
                                              Counter::kIsIterationInvariantRate);
  }
  st.counters["tokens_per_s"] = Counter(tokens_per_iteration, Counter::kIsIterationInvariantRate);
  if (state_bytes >= 0.0)
    st.counters["bytes_state"] = Counter(state_bytes, Counter::kDefaults, Counter::kIs1024);
  st.counters["threads"] = configured_threads();
}

// "/elem:bf16" or "/elem:fp16" for the 16-bit cases ("" for float, whose names predate them).
template <class Element>
std::string element_arg() {
  if constexpr (std::is_same_v<Element, ovq::bf16>) return "/elem:bf16";
  if constexpr (std::is_same_v<Element, ovq::fp16>) return "/elem:fp16";
  return "";
}

inline std::string heads_arg(Index hq, Index hkv) {
  if (hq == hkv) return "H:" + std::to_string(hq);
  return "Hq:" + std::to_string(hq) + "/Hkv:" + std::to_string(hkv);
}

// base + "/name:value" for each argument.
inline std::string case_name(const std::string& base,
                             const std::vector<std::pair<std::string, Index>>& args, Index hq,
                             Index hkv) {
  std::string name = base;
  for (const auto& [key, value] : args) name += "/" + key + ":" + std::to_string(value);
  return name + "/" + heads_arg(hq, hkv);
}

// Registers one case: milliseconds, real time. Errors thrown by the library end the case with a
// message instead of the whole run. With --thread-counts, one case per count instead, named
// name + "/nthreads:<count>" and run on that many threads.
inline void add_case(const std::string& name, std::function<void(benchmark::State&)> fn) {
  auto guarded = [](std::function<void(benchmark::State&)> body, int threads) {
    return [body = std::move(body), threads](benchmark::State& st) {
      try {
        std::optional<ScopedThreads> scope;  // empty: the process's thread count
        if (threads > 0) scope.emplace(threads);
        body(st);
      } catch (const std::exception& e) {
        st.SkipWithError(e.what());
      }
    };
  };
  auto add = [](const std::string& full_name, std::function<void(benchmark::State&)> run) {
    benchmark::RegisterBenchmark(full_name.c_str(), std::move(run))
        ->Unit(benchmark::kMillisecond)
        ->UseRealTime();
  };
  if (compared_thread_counts().empty()) {
    add(name, guarded(std::move(fn), 0));
    return;
  }
  for (const int threads : compared_thread_counts())
    add(name + "/nthreads:" + std::to_string(threads), guarded(fn, threads));
}

// ---------------------------------------------------------------------------------------------
// Drivers
// ---------------------------------------------------------------------------------------------

// Calls of at most this many FLOPs get one untimed warm-up call first (run_prefill).
inline constexpr double kWarmUpFlops = 100e9;

// Whether the native kernels score Element by bf16 pair dot products.
template <class Element>
constexpr bool bf16_scores() {
  return std::is_same_v<Element, ovq::bf16> &&
         std::is_same_v<ovq::arch::native, ovq::arch::avx512bf16>;
}

// Prefill: one forward over T tokens of every head per iteration, from empty states, or from a
// copy of `start` (one state per kv head) when given. The reset or copy is untimed; inputs and
// outputs exist (and are touched) before the timed loop.
//
// A call of at most kWarmUpFlops is made once, untimed, before the timed loop: such a case may
// time only one or two calls, and a process's first call also faults in its fresh state memory.
// Longer cases are timed from their first call, where that cost is a small share.
template <class Mixer>
void run_prefill(benchmark::State& st, ovq::MultiHead<Mixer>& layer, Index tokens,
                 double flops_per_iteration,
                 const std::vector<typename Mixer::State>* start = nullptr) {
  using Element = typename Mixer::scalar_type;
  const Index hq = layer.query_heads();
  const Index hkv = layer.kv_heads();
  const Index d = layer.key_dim();
  const Inputs<Element>& in = prefill_inputs<Element>(tokens, hq, hkv, d);
  ovq::RowMatrix<Element> o = ovq::RowMatrix<Element>::Zero(hq * tokens, layer.value_dim());
  layer.set_threads(configured_threads());
  auto restart = [&] {
    if (start != nullptr) {
      layer.states() = *start;
    } else {
      layer.reset();
    }
  };
  if (flops_per_iteration <= kWarmUpFlops) {
    restart();
    layer.forward(in.q, in.k, in.v, o);
  }
  for (auto _ : st) {
    st.PauseTiming();
    restart();
    st.ResumeTiming();
    layer.forward(in.q, in.k, in.v, o);
    benchmark::DoNotOptimize(o.data());
    benchmark::ClobberMemory();
  }
  report(st, flops_per_iteration, static_cast<double>(layer.bytes()), static_cast<double>(tokens),
         -1.0, bf16_scores<Element>());
}

inline constexpr Index kContextBlock = 1024;

// The state of kv heads after absorbing a context of ctx tokens (MultiHead::absorb: written,
// never read). Context tokens come in blocks generated from (key, block) seeds, so a longer
// context extends a shorter one. Every (key, ctx) asked for is kept for the whole process, so
// cases may run in any order (--benchmark_enable_random_interleaving) and each context is still
// absorbed once: a new one starts from a copy of the longest shorter context of its key. The
// most a binary keeps is self-attention's four caches of 1k to 64k tokens (8 kv heads, d = 128,
// with their spare rows); with the timed copy of the 64k one, the decode cases of
// bench_self_attention peak at about 2 GB resident.
template <class Mixer>
const ovq::MultiHead<Mixer>& absorbed_context(const std::string& key, Index ctx,
                                              const std::function<ovq::MultiHead<Mixer>()>& make) {
  static std::map<std::pair<std::string, Index>, std::unique_ptr<ovq::MultiHead<Mixer>>> cache;
  auto found = cache.find({key, ctx});
  if (found != cache.end()) return *found->second;
  // The longest context of this key shorter than ctx, if any: the map orders a key's contexts
  // by length, so it is the entry just before the place of (key, ctx).
  const auto next = cache.lower_bound({key, ctx});
  auto shorter = next == cache.begin() ? cache.end() : std::prev(next);
  if (shorter != cache.end() && shorter->first.first != key) shorter = cache.end();
  const bool extend = shorter != cache.end();
  auto layer = extend ? std::make_unique<ovq::MultiHead<Mixer>>(*shorter->second)
                      : std::make_unique<ovq::MultiHead<Mixer>>(make());
  const Index start = extend ? shorter->first.second : 0;
  layer->set_threads(configured_threads());
  const Index hkv = layer->kv_heads();
  Matrix k(hkv * kContextBlock, layer->key_dim());
  Matrix v(hkv * kContextBlock, layer->value_dim());
  for (Index t0 = start; t0 < ctx; t0 += kContextBlock) {
    const Index len = std::min(kContextBlock, ctx - t0);
    const auto block = static_cast<std::uint64_t>(t0 / kContextBlock);
    for (Index h = 0; h < hkv; ++h) {
      fill_rows(k.middleRows(h * len, len), mix_seed(7, block, 2 * h), true);
      fill_rows(v.middleRows(h * len, len), mix_seed(7, block, 2 * h + 1), false);
    }
    using Element = typename Mixer::scalar_type;
    layer->absorb(as_element<Element>(k.topRows(hkv * len)), as_element<Element>(v.topRows(hkv * len)));
  }
  return *cache.emplace(std::make_pair(key, ctx), std::move(layer)).first->second;
}

// Decode: one MultiHead::step (one token for every head) per iteration, on a copy of the
// absorbed context. Every `restore_every` steps the states are put back to the context
// (untimed), so the context stays within restore_every tokens of ctx: that matters for
// self-attention, whose cache grows by a row per step; restore_every <= 0 never restores
// (fixed-size states). Tokens cycle through a pool made before the timed loop.
// read_bytes_per_step: what a step must read from memory (its state), for frac_bandwidth.
template <class Mixer>
void run_decode(benchmark::State& st, const Mixer& mixer, const ovq::MultiHead<Mixer>& context,
                Index hq, Index restore_every, double flops_per_step,
                double read_bytes_per_step = 0.0) {
  using Element = typename Mixer::scalar_type;
  ovq::MultiHead<Mixer> layer(mixer, 1, hq, context.states());
  layer.set_threads(configured_threads());
  const Index hkv = layer.kv_heads();
  const Index dk = layer.key_dim();
  const Index dv = layer.value_dim();
  constexpr Index kPool = 64;
  Matrix qf(kPool * hq, dk), kf(kPool * hkv, dk), vf(kPool * hkv, dv);
  fill_rows(qf, mix_seed(9, 1), true);
  fill_rows(kf, mix_seed(9, 2), true);
  fill_rows(vf, mix_seed(9, 3), false);
  const ovq::RowMatrix<Element> q = as_element<Element>(qf), k = as_element<Element>(kf),
                                v = as_element<Element>(vf);
  ovq::RowMatrix<Element> o = ovq::RowMatrix<Element>::Zero(hq, dv);
  Index since_restore = 0;
  Index j = 0;
  for (auto _ : st) {
    if (restore_every > 0 && since_restore == restore_every) {
      st.PauseTiming();
      layer.states() = context.states();
      since_restore = 0;
      st.ResumeTiming();
    }
    layer.step(q.middleRows(j * hq, hq), k.middleRows(j * hkv, hkv), v.middleRows(j * hkv, hkv), o);
    benchmark::DoNotOptimize(o.data());
    benchmark::ClobberMemory();
    ++since_restore;
    j = (j + 1) % kPool;
  }
  report(st, flops_per_step, static_cast<double>(layer.bytes()), 1.0, read_bytes_per_step);
}

// ---------------------------------------------------------------------------------------------
// main
// ---------------------------------------------------------------------------------------------

inline int run_main(int argc, char** argv, const std::function<void()>& register_cases) {
  apply_threads(parse_threads(argc, argv));
  try {
    parse_compared_thread_counts(argc, argv);
  } catch (const std::invalid_argument& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 2;
  }
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::AddCustomContext("ovq_version", std::to_string(OVQ_VERSION_MAJOR) + "." +
                                                 std::to_string(OVQ_VERSION_MINOR) + "." +
                                                 std::to_string(OVQ_VERSION_PATCH));
  benchmark::AddCustomContext("ovq_threads", std::to_string(configured_threads()));
#if defined(OVQ_HAS_OPENMP)
  benchmark::AddCustomContext("ovq_openmp", "yes");
#else
  benchmark::AddCustomContext("ovq_openmp", "no");
#endif
#if defined(OVQ_ARCH_AVX512BF16)
  benchmark::AddCustomContext("ovq_arch", "avx512bf16");
#elif defined(OVQ_ARCH_AVX512)
  benchmark::AddCustomContext("ovq_arch", "avx512");
#elif defined(OVQ_ARCH_AVX2)
  benchmark::AddCustomContext("ovq_arch", "avx2");
#elif defined(OVQ_ARCH_NEON)
  benchmark::AddCustomContext("ovq_arch", "neon");
#else
  benchmark::AddCustomContext("ovq_arch", "portable");
#endif
  benchmark::AddCustomContext("eigen_simd", Eigen::SimdInstructionSetsInUse());
  // First, so that every later case divides by this run's own rates.
  add_case("BM_Peak_sgemm", BM_Peak_sgemm);
  add_case("BM_Peak_fma", BM_Peak_fma);
#if defined(OVQ_ARCH_AVX512BF16)
  add_case("BM_Peak_bf16dot", BM_Peak_bf16dot);
#endif
  add_case("BM_Peak_read", BM_Peak_read);
  register_cases();
  // Last, so that the process's reference is the best of a measurement before its cases and one
  // after them: a binary that measured its first sgemm while another tenant held the cores (its
  // frac_sgemm then above 1, for a kernel of the same work as Eigen's) is not left with that
  // reference alone. The in-process counters divide by the best rate so far; the report divides
  // every case by the best of both (scripts/lib/plot_bench.py).
  add_case("BM_Peak_sgemm/at:end", BM_Peak_sgemm);
  add_case("BM_Peak_fma/at:end", BM_Peak_fma);
#if defined(OVQ_ARCH_AVX512BF16)
  add_case("BM_Peak_bf16dot/at:end", BM_Peak_bf16dot);
#endif
  add_case("BM_Peak_read/at:end", BM_Peak_read);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}

}  // namespace ovq_bench
