// soak: streams a long synthetic sequence through OVQ-attention in float (or bf16, fp16) and in
// double, side by side, and checks the invariants of the state as it goes.
//
//   soak [--tokens N] [--dk D] [--dv D] [--capacity N] [--chunk L] [--beta B]
//        [--check-every M] [--bound X] [--storage f32|bf16|f16] [--rows-bound X] [--seed S]
//
// The stream is generated on the fly, in double, from a seeded generator, and the float run sees
// the same numbers rounded to float. With --storage bf16 or f16 both runs see them rounded to
// that type (exactly representable in double), so that the two differ by their arithmetic only. Keys are unit vectors around a fixed set of cluster centres
// (plus a share of uniformly random "novel" keys); values follow their key's cluster. Most of
// the stream goes through absorb(); every M tokens (default 10^6) a block of L queries goes
// through forward() instead, and the checks run:
//
//   - counts: every count >= 0 and the counts add up to t exactly, t = the tokens written
//     (a multiple of L), pending = the rest, n <= N;
//   - finiteness: every centroid (keys and values), every pending row, every output;
//   - ranges: key centroids are means of unit vectors (norm <= 1), value centroids and outputs
//     are convex combinations of values (inside the values' per-column range);
//   - float against double, on what a read returns rather than row by row. The two runs can
//     assign a token to different centroids where two of them are nearly tied (float and double
//     round the scores differently), and from then on their dictionaries differ row by row
//     while describing the same stream. What matters is the read, so the distance is
//         probe = max over P probe queries p of |o_f(p) - o_d(p)| / v_rms,
//     o(p) the dictionary read sum_r c_r e^{beta p.Dk_r} Dv_r / sum_r c_r e^{beta p.Dk_r}
//     evaluated in double from each run's dictionary, v_rms the RMS norm of the value rows; and
//         output = max over the rows of a forward block of |o_f - o_d| / v_rms,
//     the mixers' own outputs on the same queries. Both must stay <= --bound, default 1e-3.
//     Why that bound: were the assignments identical, the float dictionary would differ from
//     the double one by rounding only (a running mean keeps a relative error of a few float
//     ulps, ~1e-6 after the e^{beta p.k} weighting). Assignments differ only on near-ties, where
//     the two candidate centroids are about equally close to the token, so moving the token
//     from one to the other changes what a read returns by far less than the token's own
//     weight 1/c. Measured with the defaults: 3e-5 up to 2 10^7 tokens, then a slow rise to
//     1e-4 at 8 10^7 and 3e-4 at 10^8, as the counts of nearly every row come to differ (with
//     --capacity 16 it stays at 3e-5 over 3 10^7 tokens, at as many tokens per centroid, so the
//     rise follows the diverging assignments rather than the float resolution of large counts).
//     1e-3 keeps a margin of 3 over 10^8 tokens, and is still orders of magnitude below what a
//     real fault does (a lost count, a centroid left behind or a NaN moves a read by O(1)).
//     Longer streams may need a looser bound; the soak prints the trend.
//   - 16-bit storage (--storage bf16 or f16): the running means stay in float and only the
//     reads' rows are 16-bit, republished from them. The probe distance above is evaluated on
//     the float means, so it measures their drift with the float run's bound: were they kept in
//     16 bits, a mean whose count is in the hundreds would stop moving (its increments
//     (k - D) / c are below half an ulp of D) and the distance would grow with the stream. The
//     16-bit rows must equal the means rounded to 16 bits, bit for bit, and the reads from them
//     (rows probe) and the outputs must stay within --rows-bound, by default 8 beta u (u the
//     type's unit roundoff: 2^-9 for bf16, 2^-12 for fp16; the scores' error is at most about
//     beta u per unit key and query, the values' u, and the rounding of inputs and outputs adds
//     a few u more).
//     The row-by-row distance max_r |D_f[r] - D_d[r]| / |D_d[r]| and the number of rows whose
//     counts agree are reported for information only.
//
// Exit status: 0 when every check passed, 1 on the first violation (reported on stderr),
// 2 for a bad command line.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "ovq/ovq.hpp"

namespace {

using ovq::Index;
template <class S>
using Mat = ovq::RowMatrix<S>;
using MatD = ovq::RowMatrix<double>;
using Clock = std::chrono::steady_clock;

const char kUsage[] =
    "usage: soak [--tokens N] [--dk D] [--dv D] [--capacity N] [--chunk L] [--beta B]\n"
    "            [--check-every M] [--bound X] [--storage f32|bf16|f16] [--rows-bound X]\n"
    "            [--seed S]\n"
    "Streams N tokens (default 1000000) through OVQ-attention in float (or bf16, fp16) and\n"
    "double and checks the state's invariants every M tokens (default 1000000).\n"
    "Exit 0: pass, 1: a check failed.\n";

struct Config {
  std::int64_t tokens = 1000000;
  Index dk = 8;
  Index dv = 8;
  Index capacity = 64;
  Index chunk = 64;
  double beta = 8.0;
  std::int64_t check_every = 1000000;
  double bound = 1e-3;
  std::string storage = "f32";
  double rows_bound = -1.0;  // < 0: 8 beta u of the storage type
  std::uint64_t seed = 1;
};

[[noreturn]] void usage_error(const std::string& what) {
  std::fprintf(stderr, "soak: %s\n%s", what.c_str(), kUsage);
  std::exit(2);
}

double parse_number(const std::string& name, const std::string& text) {
  char* end = nullptr;
  const double v = std::strtod(text.c_str(), &end);
  if (text.empty() || end != text.c_str() + text.size() || !std::isfinite(v))
    usage_error(name + ": '" + text + "' is not a number");
  return v;
}

std::int64_t parse_count(const std::string& name, const std::string& text, double min) {
  const double v = parse_number(name, text);  // accepts 1e8
  if (v < min || v > 9.0e18 || v != std::floor(v))
    usage_error(name + ": '" + text +
                "' is not an integer >= " + std::to_string(static_cast<long long>(min)));
  return static_cast<std::int64_t>(v);
}

Config parse(int argc, char** argv) {
  Config c;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--help" || arg == "-h") {
      std::fputs(kUsage, stdout);
      std::exit(0);
    }
    if (i + 1 >= argc) usage_error("unknown argument or missing value: '" + arg + "'");
    const std::string value = argv[++i];
    if (arg == "--tokens")
      c.tokens = parse_count(arg, value, 1);
    else if (arg == "--dk")
      c.dk = parse_count(arg, value, 1);
    else if (arg == "--dv")
      c.dv = parse_count(arg, value, 1);
    else if (arg == "--capacity")
      c.capacity = parse_count(arg, value, 1);
    else if (arg == "--chunk")
      c.chunk = parse_count(arg, value, 1);
    else if (arg == "--beta")
      c.beta = parse_number(arg, value);
    else if (arg == "--check-every")
      c.check_every = parse_count(arg, value, 1);
    else if (arg == "--bound")
      c.bound = parse_number(arg, value);
    else if (arg == "--storage") {
      if (value != "f32" && value != "bf16" && value != "f16")
        usage_error("--storage: '" + value + "', expected f32, bf16 or f16");
      c.storage = value;
    } else if (arg == "--rows-bound")
      c.rows_bound = parse_number(arg, value);
    else if (arg == "--seed")
      c.seed = static_cast<std::uint64_t>(parse_count(arg, value, 0));
    else
      usage_error("unknown option '" + arg + "'");
  }
  return c;
}

// xoshiro256**, seeded through splitmix64: fast, and the same sequence everywhere.
class Rng {
 public:
  explicit Rng(std::uint64_t seed) {
    for (auto& w : s_) w = ovq::detail::splitmix64(seed);
  }
  std::uint64_t next() {
    const std::uint64_t result = rotl(s_[1] * 5, 7) * 9;
    const std::uint64_t t = s_[1] << 17;
    s_[2] ^= s_[0];
    s_[3] ^= s_[1];
    s_[1] ^= s_[2];
    s_[0] ^= s_[3];
    s_[2] ^= t;
    s_[3] = rotl(s_[3], 45);
    return result;
  }
  double uniform() { return static_cast<double>(next() >> 11) * 0x1.0p-53; }  // [0, 1)
  double symmetric() { return 2.0 * uniform() - 1.0; }                        // [-1, 1)
  // Approximately normal (sum of four uniforms), cheap and bounded.
  double bell() { return (uniform() + uniform() + uniform() + uniform() - 2.0) * 1.7320508; }

 private:
  static std::uint64_t rotl(std::uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }
  std::uint64_t s_[4];
};

void normalize_row(double* x, Index d) {
  double n = 0.0;
  for (Index j = 0; j < d; ++j) n += x[j] * x[j];
  n = std::sqrt(n);
  if (n > 0.0)
    for (Index j = 0; j < d; ++j) x[j] /= n;
}

// The synthetic stream: clusters with uneven popularity, plus novel keys.
class Stream {
 public:
  Stream(const Config& c) : dk_(c.dk), dv_(c.dv), rng_(c.seed) {
    const Index clusters = std::max<Index>(4, c.capacity / 2);
    centres_k_.resize(clusters, dk_);
    centres_v_.resize(clusters, dv_);
    Rng setup(c.seed ^ 0x5eedULL);
    for (Index r = 0; r < clusters; ++r) {
      for (Index j = 0; j < dk_; ++j) centres_k_(r, j) = setup.bell();
      normalize_row(centres_k_.row(r).data(), dk_);
      for (Index j = 0; j < dv_; ++j) centres_v_(r, j) = setup.bell();
    }
    // Popularity ~ 1 / (rank + 1): cumulative weights for sampling.
    double total = 0.0;
    for (Index r = 0; r < clusters; ++r)
      cumulative_.push_back(total += 1.0 / static_cast<double>(r + 1));
    for (double& w : cumulative_) w /= total;
  }

  Index clusters() const { return centres_k_.rows(); }
  const MatD& centre_keys() const { return centres_k_; }

  // The next `rows` tokens: K (unit rows) and V, and Q (unit rows near the same clusters).
  void next(Index rows, MatD& k, MatD& v, MatD* q) {
    k.resize(rows, dk_);
    v.resize(rows, dv_);
    if (q != nullptr) q->resize(rows, dk_);
    for (Index i = 0; i < rows; ++i) {
      if (rng_.uniform() < kNovel) {
        for (Index j = 0; j < dk_; ++j) k(i, j) = rng_.bell();
        for (Index j = 0; j < dv_; ++j) v(i, j) = rng_.bell();
      } else {
        const Index c = pick();
        for (Index j = 0; j < dk_; ++j) k(i, j) = centres_k_(c, j) + kKeyNoise * rng_.symmetric();
        for (Index j = 0; j < dv_; ++j) v(i, j) = centres_v_(c, j) + kValueNoise * rng_.symmetric();
      }
      normalize_row(k.row(i).data(), dk_);
      if (q != nullptr) {
        const Index c = pick();
        for (Index j = 0; j < dk_; ++j)
          (*q)(i, j) = centres_k_(c, j) + kKeyNoise * rng_.symmetric();
        normalize_row(q->row(i).data(), dk_);
      }
      for (Index j = 0; j < dv_; ++j) {
        lo_[static_cast<std::size_t>(j)] = std::min(lo_[static_cast<std::size_t>(j)], v(i, j));
        hi_[static_cast<std::size_t>(j)] = std::max(hi_[static_cast<std::size_t>(j)], v(i, j));
        sum_sq_ += v(i, j) * v(i, j);
      }
      ++count_;
    }
  }

  // Per-column range of every value so far, and the RMS norm of the value rows.
  double lo(Index j) const { return lo_[static_cast<std::size_t>(j)]; }
  double hi(Index j) const { return hi_[static_cast<std::size_t>(j)]; }
  double v_rms() const {
    return count_ > 0 ? std::sqrt(sum_sq_ / static_cast<double>(count_)) : 1.0;
  }

 private:
  static constexpr double kNovel = 0.05;
  static constexpr double kKeyNoise = 0.35;
  static constexpr double kValueNoise = 0.25;

  Index pick() {
    const double u = rng_.uniform();
    return static_cast<Index>(std::lower_bound(cumulative_.begin(), cumulative_.end() - 1, u) -
                              cumulative_.begin());
  }

  Index dk_, dv_;
  Rng rng_;
  MatD centres_k_, centres_v_;
  std::vector<double> cumulative_;
  std::vector<double> lo_ =
      std::vector<double>(static_cast<std::size_t>(dv_), std::numeric_limits<double>::infinity());
  std::vector<double> hi_ =
      std::vector<double>(static_cast<std::size_t>(dv_), -std::numeric_limits<double>::infinity());
  double sum_sq_ = 0.0;
  std::int64_t count_ = 0;
};

template <class T>
double to_double(T x) {
  if constexpr (ovq::is_half_v<T>)
    return static_cast<double>(ovq::widen(x));
  else
    return static_cast<double>(x);
}

template <class T>
MatD to_double(const ovq::ConstRowsView<T>& rows) {
  MatD out(rows.rows, rows.cols);
  for (Index i = 0; i < rows.rows; ++i)
    for (Index j = 0; j < rows.cols; ++j) out(i, j) = to_double(rows.row(i)[j]);
  return out;
}

// Half the distance from 1 to the next representable number.
template <class T>
constexpr double unit_roundoff() {
  if constexpr (std::is_same_v<T, ovq::bf16>)
    return 0x1.0p-9;
  else if constexpr (std::is_same_v<T, ovq::fp16>)
    return 0x1.0p-12;
  else
    return std::numeric_limits<T>::epsilon() / 2.0;
}

// The read of every probe from a dictionary's rows (keys, values) and counts, in double:
// sum_r c_r e^{beta p.Dk_r} Dv_r / (same weights).
template <class S, class T>
MatD dictionary_read(const ovq::Dictionary<S>& d, const ovq::ConstRowsView<T>& key_rows,
                     const ovq::ConstRowsView<T>& value_rows, const MatD& probes, double beta) {
  const Index n = d.size();
  const MatD keys = to_double(key_rows);
  const MatD values = to_double(value_rows);
  MatD out = MatD::Zero(probes.rows(), d.value_dim());
  std::vector<double> logit(static_cast<std::size_t>(n));
  for (Index p = 0; p < probes.rows(); ++p) {
    double m = -std::numeric_limits<double>::infinity();
    for (Index r = 0; r < n; ++r) {
      const double c = static_cast<double>(d.count(r));
      logit[static_cast<std::size_t>(r)] = c > 0
                                               ? beta * probes.row(p).dot(keys.row(r)) + std::log(c)
                                               : -std::numeric_limits<double>::infinity();
      m = std::max(m, logit[static_cast<std::size_t>(r)]);
    }
    double l = 0.0;
    for (Index r = 0; r < n; ++r) {
      const double w = std::exp(logit[static_cast<std::size_t>(r)] - m);
      if (w == 0.0) continue;
      l += w;
      out.row(p) += w * values.row(r);
    }
    if (l > 0.0) out.row(p) /= l;
  }
  return out;
}

double max_row_distance(const MatD& a, const MatD& b) {
  double worst = 0.0;
  for (Index i = 0; i < a.rows(); ++i) worst = std::max(worst, (a.row(i) - b.row(i)).norm());
  return worst;
}

// The first violation found, or "".
struct Checker {
  std::string failure;
  void require(bool ok, const std::string& what) {
    if (!ok && failure.empty()) failure = what;
  }
};

// The running means (float or double) are checked against the stream; 16-bit rows must be the
// means rounded to 16 bits.
template <class S>
void check_state(Checker& ck, const char* name, const ovq::OvqState<S>& s, std::int64_t fed,
                 const Stream& stream, Index chunk) {
  const std::string tag = std::string(name) + ": ";
  const auto& d = s.dictionary();
  ck.require(s.absorbed() == fed - fed % chunk && s.pending() == fed % chunk,
             tag + "t = " + std::to_string(s.absorbed()) + ", pending = " +
                 std::to_string(s.pending()) + " after " + std::to_string(fed) + " tokens");
  ck.require(d.size() <= d.capacity(), tag + "n > capacity");
  std::int64_t total = 0;
  for (Index r = 0; r < d.size(); ++r) {
    ck.require(d.count(r) >= 0, tag + "negative count in row " + std::to_string(r));
    total += d.count(r);
  }
  ck.require(total == s.absorbed(), tag + "counts sum to " + std::to_string(total) +
                                        ", expected t = " + std::to_string(s.absorbed()));
  const MatD keys = to_double(d.mean_keys());
  const MatD values = to_double(d.mean_values());
  ck.require(keys.allFinite() && values.allFinite(), tag + "a centroid is not finite");
  ck.require(to_double(s.pending_keys()).allFinite() && to_double(s.pending_values()).allFinite(),
             tag + "a pending row is not finite");
  for (Index r = 0; r < d.size(); ++r) {
    const double norm = keys.row(r).norm();
    ck.require(norm <= 1.0 + 1e-4, tag + "key centroid " + std::to_string(r) + " has norm " +
                                       std::to_string(norm) + " > 1");
    for (Index j = 0; j < d.value_dim(); ++j) {
      const double x = values(r, j);
      const double pad = 1e-5 * std::max(std::abs(stream.lo(j)), std::abs(stream.hi(j)));
      ck.require(x >= stream.lo(j) - pad && x <= stream.hi(j) + pad,
                 tag + "value centroid " + std::to_string(r) + " leaves the values' range");
    }
  }
  if constexpr (ovq::is_half_v<S>) {
    auto same = [&](const ovq::ConstRowsView<S>& rows, const ovq::ConstRowsView<float>& means) {
      for (Index r = 0; r < rows.rows; ++r)
        for (Index j = 0; j < rows.cols; ++j)
          if (ovq::widen(rows.row(r)[j]) != ovq::widen(ovq::narrow<S>(means.row(r)[j])))
            return false;
      return true;
    };
    ck.require(same(d.keys(), d.mean_keys()) && same(d.values(), d.mean_values()),
               tag + "a 16-bit row is not its running mean rounded to 16 bits");
  }
}

template <class S>
void check_outputs(Checker& ck, const char* name, const Mat<S>& o, const Stream& stream) {
  for (Index i = 0; i < o.rows(); ++i)
    for (Index j = 0; j < o.cols(); ++j) {
      const double x = to_double(o(i, j));
      ck.require(std::isfinite(x), std::string(name) + ": an output is not finite");
      // A 16-bit output is the float one rounded: it may pass the range by half an ulp.
      const double ulp = ovq::is_half_v<S> ? 2.0 * unit_roundoff<S>() : 0.0;
      const double pad = (1e-5 + ulp) * std::max(std::abs(stream.lo(j)), std::abs(stream.hi(j)));
      ck.require(x >= stream.lo(j) - pad && x <= stream.hi(j) + pad,
                 std::string(name) + ": an output leaves the values' range");
    }
}

template <class E>
Mat<E> rounded(const MatD& x) {
  if constexpr (ovq::is_half_v<E>)
    return x.cast<float>().cast<E>();
  else
    return x.cast<E>();
}

template <class E>
MatD as_double(const Mat<E>& x) {
  return to_double(ovq::ConstRowsView<E>{x.data(), x.rows(), x.cols(), x.cols()});
}

// E: the storage of the run checked against double (float, bf16 or fp16).
template <class E>
int soak(const Config& cfg) {
  ovq::OvqOptions opt;
  opt.capacity = cfg.capacity;
  opt.chunk = cfg.chunk;
  opt.beta = cfg.beta;
  constexpr bool kHalf = ovq::is_half_v<E>;
  const double rows_bound = cfg.rows_bound >= 0.0 ? cfg.rows_bound
                                                  : 8.0 * cfg.beta * unit_roundoff<E>();
  const ovq::OvqAttention<E> mixer_f(opt);
  const ovq::OvqAttention<double> mixer_d(opt);
  auto state_f = mixer_f.make_state(cfg.dk, cfg.dv);
  auto state_d = mixer_d.make_state(cfg.dk, cfg.dv);
  Stream stream(cfg);

  // Probes: half near the cluster centres, half anywhere on the sphere.
  const Index n_probes = 256;
  MatD probes(n_probes, cfg.dk);
  {
    Rng prng(cfg.seed ^ 0x9e3779b97f4a7c15ULL);
    for (Index p = 0; p < n_probes; ++p) {
      const bool near = p % 2 == 0;
      const Index c =
          static_cast<Index>(prng.next() % static_cast<std::uint64_t>(stream.clusters()));
      for (Index j = 0; j < cfg.dk; ++j)
        probes(p, j) = near ? stream.centre_keys()(c, j) + 0.2 * prng.symmetric() : prng.bell();
      normalize_row(probes.row(p).data(), cfg.dk);
    }
  }

  std::printf(
      "soak: OVQ %s vs double, %lld tokens, dk %lld, dv %lld, capacity %lld, chunk %lld, "
      "beta %g, %lld clusters, checks every %lld tokens, bound %g",
      ovq::element_name<E>(), static_cast<long long>(cfg.tokens), static_cast<long long>(cfg.dk),
      static_cast<long long>(cfg.dv), static_cast<long long>(cfg.capacity),
      static_cast<long long>(cfg.chunk), cfg.beta, static_cast<long long>(stream.clusters()),
      static_cast<long long>(cfg.check_every), cfg.bound);
  if (kHalf) std::printf(", 16-bit rows bound %g", rows_bound);
  std::printf("\n%12s %6s %6s %11s %11s %11s %11s%s\n", "tokens", "n_f", "n_d", "probe", "output",
              "row_dist", "same_count", kHalf ? "  rows_probe" : "");
  std::fflush(stdout);

  const Index block = cfg.chunk * std::max<Index>(1, 4096 / cfg.chunk);
  MatD k, v, q;
  Mat<E> kf, vf, qf;
  double t_gen = 0.0, t_float = 0.0, t_double = 0.0, t_check = 0.0;
  double worst_probe = 0.0, worst_rows_probe = 0.0, worst_output = 0.0, last_row_dist = 0.0;
  Index last_same = 0;
  std::int64_t fed = 0;
  std::int64_t next_check = std::min(cfg.check_every, cfg.tokens);
  Checker ck;
  const auto start = Clock::now();
  auto seconds_since = [](Clock::time_point t0) {
    return std::chrono::duration<double>(Clock::now() - t0).count();
  };

  while (fed < cfg.tokens && ck.failure.empty()) {
    // Up to the next check: absorbed in blocks, the last chunk-sized piece read by forward.
    const bool at_check = fed + block >= next_check;
    const Index len = static_cast<Index>(std::min<std::int64_t>(block, next_check - fed));
    const Index read = at_check ? std::min<Index>(len, cfg.chunk) : 0;
    const Index absorbed = len - read;

    auto t0 = Clock::now();
    if (absorbed > 0) {
      stream.next(absorbed, k, v, nullptr);
      kf = rounded<E>(k);
      vf = rounded<E>(v);
      if constexpr (kHalf) k = as_double(kf), v = as_double(vf);
      t_gen += seconds_since(t0);
      t0 = Clock::now();
      mixer_f.absorb(state_f, kf, vf);
      t_float += seconds_since(t0);
      t0 = Clock::now();
      mixer_d.absorb(state_d, k, v);
      t_double += seconds_since(t0);
      fed += absorbed;
    }
    if (read == 0) continue;

    t0 = Clock::now();
    stream.next(read, k, v, &q);
    kf = rounded<E>(k);
    vf = rounded<E>(v);
    qf = rounded<E>(q);
    if constexpr (kHalf) k = as_double(kf), v = as_double(vf), q = as_double(qf);
    t_gen += seconds_since(t0);
    t0 = Clock::now();
    const Mat<E> o_f = mixer_f.forward(state_f, qf, kf, vf);
    t_float += seconds_since(t0);
    t0 = Clock::now();
    const MatD o_d = mixer_d.forward(state_d, q, k, v);
    t_double += seconds_since(t0);
    fed += read;

    t0 = Clock::now();
    const char* name = ovq::element_name<E>();
    check_state(ck, name, state_f, fed, stream, cfg.chunk);
    check_state(ck, "double", state_d, fed, stream, cfg.chunk);
    check_outputs(ck, name, o_f, stream);
    check_outputs(ck, "double", o_d, stream);
    const double scale = stream.v_rms();
    const auto& df = state_f.dictionary();
    const auto& dd = state_d.dictionary();
    const MatD read_d = dictionary_read(dd, dd.keys(), dd.values(), probes, cfg.beta);
    // The running means' read (float means for every E), and for 16-bit storage the read of the
    // rows the kernels stream.
    const double probe =
        max_row_distance(dictionary_read(df, df.mean_keys(), df.mean_values(), probes, cfg.beta),
                         read_d) /
        scale;
    const double rows_probe =
        kHalf ? max_row_distance(dictionary_read(df, df.keys(), df.values(), probes, cfg.beta),
                                 read_d) /
                    scale
              : probe;
    const double output = max_row_distance(as_double(o_f), o_d) / scale;
    const double output_bound = kHalf ? rows_bound : cfg.bound;
    worst_probe = std::max(worst_probe, probe);
    worst_rows_probe = std::max(worst_rows_probe, rows_probe);
    worst_output = std::max(worst_output, output);
    ck.require(probe <= cfg.bound, std::string(name) + " and double dictionary reads differ by " +
                                       std::to_string(probe) + " > bound");
    ck.require(!kHalf || rows_probe <= rows_bound, std::string(name) + " rows' and double reads differ by " +
                                             std::to_string(rows_probe) + " > rows bound");
    ck.require(output <= output_bound, std::string(name) + " and double outputs differ by " +
                                           std::to_string(output) + " > bound");
    // Row by row (for information): rows whose counts agree, and the largest relative distance
    // between matching rows.
    last_same = 0;
    last_row_dist = 0.0;
    const MatD fk = to_double(df.mean_keys()), fv = to_double(df.mean_values());
    for (Index r = 0; r < std::min(df.size(), dd.size()); ++r) {
      if (df.count(r) == dd.count(r)) ++last_same;
      Eigen::RowVectorXd a(cfg.dk + cfg.dv), b(cfg.dk + cfg.dv);
      a << fk.row(r), fv.row(r);
      b << ovq::row_map(dd.keys(), r), ovq::row_map(dd.values(), r);
      last_row_dist = std::max(last_row_dist, (a - b).norm() / std::max(b.norm(), 1e-300));
    }
    t_check += seconds_since(t0);
    std::printf("%12lld %6lld %6lld %11.3e %11.3e %11.3e %6lld/%-4lld",
                static_cast<long long>(fed), static_cast<long long>(df.size()),
                static_cast<long long>(dd.size()), probe, output, last_row_dist,
                static_cast<long long>(last_same),
                static_cast<long long>(std::min(df.size(), dd.size())));
    if (kHalf) std::printf(" %11.3e", rows_probe);
    std::printf("\n");
    std::fflush(stdout);
    next_check = std::min(next_check + cfg.check_every, cfg.tokens);
  }

  const double wall = seconds_since(start);
  std::printf(
      "soak: %lld tokens in %.1f s: %.3g tokens/s overall; %s %.3g tokens/s, double "
      "%.3g tokens/s (mixer time only); generation %.1f s, checks %.1f s\n",
      static_cast<long long>(fed), wall, static_cast<double>(fed) / wall, ovq::element_name<E>(),
      static_cast<double>(fed) / std::max(t_float, 1e-9),
      static_cast<double>(fed) / std::max(t_double, 1e-9), t_gen, t_check);
  std::printf(
      "soak: t = %lld (%s), %lld (double); n = %lld / %lld; worst probe distance %.3e, "
      "worst output distance %.3e (bound %g); last row-by-row distance %.3e with %lld rows "
      "of equal counts\n",
      static_cast<long long>(state_f.absorbed()), ovq::element_name<E>(),
      static_cast<long long>(state_d.absorbed()),
      static_cast<long long>(state_f.dictionary().size()), static_cast<long long>(cfg.capacity),
      worst_probe, worst_output, kHalf ? rows_bound : cfg.bound, last_row_dist,
      static_cast<long long>(last_same));
  if (kHalf)
    std::printf("soak: worst 16-bit rows' probe distance %.3e (rows bound %g)\n", worst_rows_probe,
                rows_bound);
  if (!ck.failure.empty()) {
    std::fprintf(stderr, "soak: FAIL after %lld tokens: %s\n", static_cast<long long>(fed),
                 ck.failure.c_str());
    return 1;
  }
  std::printf("soak: PASS\n");
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const Config cfg = parse(argc, argv);
    if (cfg.storage == "bf16") return soak<ovq::bf16>(cfg);
    if (cfg.storage == "f16") return soak<ovq::fp16>(cfg);
    return soak<float>(cfg);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "soak: FAIL: %s\n", e.what());
    return 1;
  }
}
