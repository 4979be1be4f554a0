// ovq_demo: the quick version of the study in docs/study.md.
//
//   ovq_demo [--seed S] [--threads N] [--help]
//
// In-context recall (task R: M = 64 facts among filler tokens, Q = 128 noisy queries) at
// T = 1k, 4k, 16k and 64k, and in-context learning of F = 64 linear functions (task I: T = 16k,
// Q = 512), for self-attention, a sliding window, two linear attentions, VQ-attention (codebook
// fitted by ovq::fit_codebook on a calibration stream) and OVQ-attention at a fixed capacity and
// at N = T/8 (a state of about 13% of self-attention's cache). Every mixer reads the same
// streams; the context is absorbed, then the queries are read from the state
// (examples/tasks/mixers.hpp explains how). One table: state bytes at 64k and as a % of
// self-attention's cache, recall at each T, ICL error (NMSE) and functions learnt, for task I
// and for task I-b (the same examples grouped by function; added after the first full run).
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "tasks/runner.hpp"

namespace {

using namespace study;

const std::vector<Index> kContexts = {1024, 4096, 16384, 65536};
constexpr Index kFacts = 64;
constexpr Index kQueries = 128;
constexpr Index kIclContext = 16384;
constexpr Index kFunctions = 64;
constexpr Index kIclQueries = 512;
const char* const kProportional = "OVQ N=T/8";

std::vector<MixerSpec> mixers(Index T) {
  std::vector<MixerSpec> m = {self_attention(), sliding_window(1024),
                              linear_attention(ovq::FeatureMap::identity, false),
                              linear_attention(ovq::FeatureMap::elu1, false), vq_attention(1024),
                              ovq_attention(1024)};
  MixerSpec p = ovq_attention(T / 8);
  p.name = kProportional;
  m.push_back(p);
  return m;
}

const Point* find(const std::vector<Point>& points, const std::string& experiment, Index T,
                  const std::string& mixer) {
  for (const Point& p : points)
    if (p.experiment == experiment && p.context == T && p.mixer == mixer) return &p;
  return nullptr;
}

std::string human_bytes(double b) {
  char buf[32];
  if (b < 1024.0 * 1024.0)
    std::snprintf(buf, sizeof buf, "%.1f KiB", b / 1024.0);
  else
    std::snprintf(buf, sizeof buf, "%.2f MiB", b / (1024.0 * 1024.0));
  return buf;
}

void usage(const char* argv0) {
  std::printf(
      "usage: %s [--seed S] [--threads N] [--help]\n"
      "  Quick version of the long-context study (docs/study.md): in-context recall at\n"
      "  T = 1k..64k and in-context learning of 64 linear functions, for self-attention,\n"
      "  a sliding window, linear attention, VQ-attention and OVQ-attention.\n"
      "  --seed S     stream seed (default 1)\n"
      "  --threads N  OpenMP threads over independent runs (default: all)\n"
      "  --help       this text\n",
      argv0);
}

}  // namespace

int main(int argc, char** argv) {
  std::uint64_t seed = 1;
  RunOptions options;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto number = [&](const char* what) -> unsigned long long {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "ovq_demo: %s needs a value\n", what);
        std::exit(2);
      }
      const char* s = argv[++i];
      char* end = nullptr;
      const unsigned long long v = std::strtoull(s, &end, 10);
      if (end == s || *end != '\0' || s[0] == '-') {
        std::fprintf(stderr, "ovq_demo: %s expects a non-negative integer, got '%s'\n", what, s);
        std::exit(2);
      }
      return v;
    };
    if (a == "--help" || a == "-h") {
      usage(argv[0]);
      return 0;
    } else if (a == "--seed") {
      seed = number("--seed");
    } else if (a == "--threads") {
      options.threads = static_cast<int>(number("--threads"));
    } else {
      std::fprintf(stderr, "ovq_demo: unknown argument '%s'\n", a.c_str());
      usage(argv[0]);
      return 2;
    }
  }

  std::printf(
      "ovq_demo: long-context recall and in-context learning (seed %llu; docs/study.md)\n"
      "  Recall: M = %td facts (distinct random keys and values) hidden among filler tokens whose\n"
      "  keys crowd 4 directions; Q = %td noisy queries of fact keys after the stream. Right =\n"
      "  output nearest (cosine) to the queried fact's value among the M (chance %.1f%%).\n"
      "  ICL: T = %s examples (x, A_f x) of F = %td random linear maps, each on its own region of\n"
      "  key space; Q = %td queries at new inputs. NMSE after the best output gain (0 exact, 1 no\n"
      "  information); a function is learnt when its NMSE < %.1f. ICL-b: the same examples grouped\n"
      "  by function (one block per function), so that the whole context must be kept.\n"
      "  dk = dv = %td, unit keys, beta = %g, one head, float. VQ: k-means codebook fitted on a\n"
      "  calibration stream; OVQ: chunk %td, dirichlet growth, spread seeding, adaptive rate.\n\n",
      static_cast<unsigned long long>(seed), kFacts, kQueries, 100.0 / kFacts,
      (std::to_string(kIclContext / 1024) + "k").c_str(), kFunctions, kIclQueries,
      icl::kLearntNmse, kDim, kBeta, kOvqChunk);
  std::fflush(stdout);

  std::vector<Setting> settings;
  for (const Index T : kContexts)
    settings.push_back({"recall", TaskKind::recall, T, kFacts, kQueries, seed, mixers(T)});
  for (const bool blocked : {false, true}) {
    Setting icl_setting{blocked ? "icl-b" : "icl", TaskKind::icl, kIclContext, kFunctions,
                        kIclQueries, seed, mixers(kIclContext)};
    icl_setting.oracle = true;
    icl_setting.blocked = blocked;
    settings.push_back(icl_setting);
  }

  const double start = now_ms();
  std::vector<Point> points;
  try {
    points = run_settings(settings, options);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ovq_demo: %s\n", e.what());
    return 1;
  }
  const double total = (now_ms() - start) / 1000.0;

  const Index Tmax = kContexts.back();
  std::printf("%-20s %11s %8s", "mixer", "state@64k", "% of SA");
  for (const Index T : kContexts) {
    const std::string h = "R@" + std::to_string(T / 1024) + "k";
    std::printf(" %7s", h.c_str());
  }
  std::printf(" %9s %7s %9s %7s\n", "ICL NMSE", "learnt", "ICL-b", "learnt");
  std::printf("%-20s %11s %8s", "--------------------", "-----------", "-------");
  for (std::size_t i = 0; i < kContexts.size(); ++i) std::printf(" %7s", "------");
  std::printf(" %9s %7s %9s %7s\n", "--------", "------", "--------", "------");
  const std::vector<MixerSpec> names = mixers(Tmax);
  std::vector<std::string> rows;
  for (const MixerSpec& m : names) rows.push_back(m.name);
  rows.push_back("oracle: region mean");
  for (const std::string& name : rows) {
    const Point* big = find(points, "recall", Tmax, name);
    if (big) {
      std::printf("%-20s %11s %7.1f%%", name.c_str(), human_bytes(static_cast<double>(big->bytes)).c_str(),
                  100.0 * static_cast<double>(big->bytes) / big->sa_bytes);
    } else {
      std::printf("%-20s %11s %8s", name.c_str(), "-", "-");
    }
    for (const Index T : kContexts) {
      const Point* p = find(points, "recall", T, name);
      if (p)
        std::printf(" %6.1f%%", 100.0 * p->score);
      else
        std::printf(" %7s", "-");
    }
    const Point* q = find(points, "icl", kIclContext, name);
    if (q)
      std::printf(" %9.3f %6.0f%%", q->score, 100.0 * q->learnt);
    else
      std::printf(" %9s %7s", "-", "-");
    const Point* b = find(points, "icl-b", kIclContext, name);
    if (b)
      std::printf(" %9.3f %6.0f%%\n", b->score, 100.0 * b->learnt);
    else
      std::printf(" %9s %7s\n", "-", "-");
  }
  std::printf(
      "\nOVQ N=T/8 has N = 128 .. 8192 over the recall columns (2048 for ICL at 16k). State as %%\n"
      "of self-attention's key/value cache at T = 64k (ICL at 16k: multiply by 4). Full study,\n"
      "three seeds, 1k..128k, ablations: scripts/study.\n");
  std::printf("Total %.1f s.\n", total);
  return 0;
}
