// study: the long-context recall and in-context-learning study of docs/study.md.
//
//   study [--out DIR] [--seeds N] [--max-context T] [--only a,b,...] [--threads N] [--progress]
//
// Runs the experiments defined in docs/study.md (recall-T, recall-M, recall-state, icl-F and
// icl-F-blocked, ablation-recall, ablation-icl) over N seeds and writes into DIR (default
// study-results):
//   points.csv    one row per (experiment, stream, mixer, seed)
//   summary.csv   the mean over seeds (and min, max) per (experiment, stream, mixer)
//   results.md    the results section of docs/study.md: tables and the verdict per claim,
//                 decided by the rules written in docs/study.md before the first run.
// The figures are drawn from summary.csv by scripts/study.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "tasks/runner.hpp"

namespace {

using namespace study;

// ------------------------------------------------------------------------------------------
// The experiments (docs/study.md, "Experiments").

const std::vector<Index> kContexts = {1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072};
constexpr Index kFacts = 128;
constexpr Index kRecallQueries = 256;
constexpr Index kMContext = 32768;
const std::vector<Index> kFactCounts = {16, 64, 256, 1024};
constexpr Index kStateContext = 65536;
constexpr Index kIclContext = 32768;
const std::vector<Index> kFunctionCounts = {1, 2, 4, 8, 16, 32, 64, 128};
constexpr Index kIclQueries = 1024;
constexpr Index kAblationContext = 32768;
constexpr Index kAblationFunctions = 64;
constexpr Index kAblationCapacity = 4096;
constexpr double kConstantEta = 0.1;

const char* const kProportional = "OVQ N=T/8";

std::vector<MixerSpec> core_mixers(Index T, bool proportional, bool windows_small) {
  std::vector<MixerSpec> m = {self_attention()};
  if (windows_small) m.push_back(sliding_window(1024));
  m.push_back(sliding_window(4096));
  for (const MixerSpec& l : linear_family()) m.push_back(l);
  m.push_back(vq_attention(1024));
  m.push_back(vq_attention(4096));
  m.push_back(ovq_attention(1024));
  m.push_back(ovq_attention(4096));
  if (proportional) {
    MixerSpec p = ovq_attention(T / 8);
    p.name = kProportional;
    m.push_back(p);
  }
  return m;
}

std::vector<MixerSpec> ablation_mixers() {
  std::vector<MixerSpec> m;
  MixerSpec base = ovq_attention(kAblationCapacity);
  base.name = "OVQ default";
  m.push_back(base);
  MixerSpec v = base;
  v.name = "growth linear";
  v.ovq.growth = ovq::Growth::linear(1.0);
  m.push_back(v);
  v = base;
  v.name = "seeding random";
  v.ovq.seeding = ovq::Seeding::random(12345);
  m.push_back(v);
  v = base;
  v.name = "rate constant";
  v.ovq.rate = ovq::UpdateRate::constant(kConstantEta);
  m.push_back(v);
  v = base;
  v.name = "renormalise";
  v.ovq.renormalize = true;
  m.push_back(v);
  // The public implementation's reading (docs/math.md), at the same capacity, chunk and beta.
  for (const char* preset : {"kvm", "kvm-delta"}) {
    v = base;
    v.name = std::string("preset ") + preset;
    v.ovq = ovq::OvqOptions::preset(preset);
    v.ovq.capacity = base.ovq.capacity;
    v.ovq.chunk = base.ovq.chunk;
    v.ovq.beta = base.ovq.beta;
    m.push_back(v);
  }
  for (const Index n : {1024, 2048, 8192, 16384}) m.push_back(ovq_attention(n));
  MixerSpec vq = vq_attention(kAblationCapacity);
  vq.name = "VQ S=4096 fit on stream";
  m.push_back(vq);
  return m;
}

struct Experiment {
  std::string name;
  std::vector<Setting> settings;
};

std::vector<Experiment> experiments(const std::vector<std::uint64_t>& seeds, Index max_context) {
  std::vector<Experiment> out;
  Experiment e;

  e = {"recall-T", {}};
  for (const std::uint64_t seed : seeds)
    for (const Index T : kContexts) {
      if (T > max_context) continue;
      e.settings.push_back({e.name, TaskKind::recall, T, kFacts, kRecallQueries, seed,
                            core_mixers(T, true, true)});
    }
  out.push_back(e);

  e = {"recall-M", {}};
  for (const std::uint64_t seed : seeds)
    for (const Index M : kFactCounts)
      e.settings.push_back({e.name, TaskKind::recall, kMContext, M, kRecallQueries, seed,
                            core_mixers(kMContext, false, true)});
  out.push_back(e);

  e = {"recall-state", {}};
  if (kStateContext <= max_context) {
    for (const std::uint64_t seed : seeds) {
      std::vector<MixerSpec> m = {sliding_window(16384), vq_attention(256)};
      for (const Index n : {256, 512, 2048, 8192, 16384}) m.push_back(ovq_attention(n));
      e.settings.push_back(
          {e.name, TaskKind::recall, kStateContext, kFacts, kRecallQueries, seed, m});
    }
  }
  out.push_back(e);

  // Task I and, added after the first full run (docs/study.md), task I-b: the same examples
  // grouped by function. One group, so that both share their VQ codebook fits.
  e = {"icl-F", {}};
  for (const bool blocked : {false, true})
    for (const std::uint64_t seed : seeds)
      for (const Index F : kFunctionCounts) {
        Setting s{blocked ? "icl-F-blocked" : "icl-F", TaskKind::icl, kIclContext, F,
                  kIclQueries, seed, core_mixers(kIclContext, false, false)};
        s.oracle = true;
        s.blocked = blocked;
        e.settings.push_back(s);
      }
  out.push_back(e);

  e = {"ablation-recall", {}};
  for (const std::uint64_t seed : seeds) {
    Setting s{e.name, TaskKind::recall, kAblationContext, kFacts, kRecallQueries, seed,
              ablation_mixers()};
    s.vq_on_stream = true;
    e.settings.push_back(s);
  }
  out.push_back(e);

  e = {"ablation-icl", {}};
  for (const std::uint64_t seed : seeds) {
    Setting s{e.name, TaskKind::icl, kAblationContext, kAblationFunctions, kIclQueries, seed,
              ablation_mixers()};
    s.vq_on_stream = true;
    s.oracle = true;
    e.settings.push_back(s);
  }
  out.push_back(e);
  return out;
}

// ------------------------------------------------------------------------------------------
// Aggregation over seeds.

struct Summary {
  std::string experiment;
  TaskKind task = TaskKind::recall;
  Index context = 0, items = 0;
  std::string mixer;
  Family family = Family::self;
  Index size = 0;
  double bytes = 0, sa_bytes = 0;
  double score = 0, score_min = 0, score_max = 0, learnt = 0, ms = 0;
  int seeds = 0;
  double fraction() const { return bytes / sa_bytes; }
};

using SummaryKey = std::tuple<std::string, Index, Index, std::string>;

struct Results {
  std::vector<Summary> rows;  // in first-seen order
  std::map<SummaryKey, std::size_t> index;

  const Summary* find(const std::string& exp, Index T, Index items, const std::string& mixer) const {
    const auto it = index.find({exp, T, items, mixer});
    return it == index.end() ? nullptr : &rows[it->second];
  }
};

Results summarise(const std::vector<Point>& points) {
  Results r;
  for (const Point& p : points) {
    const SummaryKey k{p.experiment, p.context, p.items, p.mixer};
    auto it = r.index.find(k);
    if (it == r.index.end()) {
      Summary s;
      s.experiment = p.experiment;
      s.task = p.task;
      s.context = p.context;
      s.items = p.items;
      s.mixer = p.mixer;
      s.family = p.family;
      s.size = p.size;
      s.sa_bytes = p.sa_bytes;
      s.score_min = p.score;
      s.score_max = p.score;
      it = r.index.emplace(k, r.rows.size()).first;
      r.rows.push_back(s);
    }
    Summary& s = r.rows[it->second];
    s.bytes += static_cast<double>(p.bytes);
    s.score += p.score;
    s.learnt += p.learnt;
    s.ms += p.ms;
    s.score_min = std::min(s.score_min, p.score);
    s.score_max = std::max(s.score_max, p.score);
    ++s.seeds;
  }
  for (Summary& s : r.rows) {
    s.bytes /= s.seeds;
    s.score /= s.seeds;
    s.learnt /= s.seeds;
    s.ms /= s.seeds;
  }
  return r;
}

// ------------------------------------------------------------------------------------------
// Formatting.

std::string fmt(const char* f, double x) {
  char buf[64];
  std::snprintf(buf, sizeof buf, f, x);
  return buf;
}

std::string human_bytes(double b) {
  if (b <= 0) return "0";
  if (b < 1024.0) return fmt("%.0f B", b);
  if (b < 1024.0 * 1024.0) return fmt("%.1f KiB", b / 1024.0);
  return fmt("%.2f MiB", b / (1024.0 * 1024.0));
}

std::string short_t(Index T) {
  return T >= 1024 && T % 1024 == 0 ? std::to_string(T / 1024) + "k" : std::to_string(T);
}

std::string pct(double x) { return fmt("%.1f", 100.0 * x); }

const char* task_name(TaskKind t) { return t == TaskKind::recall ? "recall" : "icl"; }

void write_points_csv(const std::string& path, const std::vector<Point>& points) {
  std::ofstream f(path);
  f << "experiment,task,T,items,seed,mixer,family,size,state_bytes,sa_bytes,score,learnt,ms\n";
  for (const Point& p : points)
    f << p.experiment << ',' << task_name(p.task) << ',' << p.context << ',' << p.items << ','
      << p.seed << ',' << p.mixer << ',' << family_name(p.family) << ',' << p.size << ','
      << p.bytes << ',' << static_cast<long long>(p.sa_bytes) << ',' << fmt("%.6f", p.score)
      << ',' << fmt("%.6f", p.learnt) << ',' << fmt("%.1f", p.ms) << '\n';
  if (!f) throw std::runtime_error("cannot write " + path);
}

void write_summary_csv(const std::string& path, const Results& r) {
  std::ofstream f(path);
  f << "experiment,task,T,items,mixer,family,size,state_bytes,sa_bytes,state_fraction,score,"
       "score_min,score_max,learnt,ms,seeds\n";
  for (const Summary& s : r.rows)
    f << s.experiment << ',' << task_name(s.task) << ',' << s.context << ',' << s.items << ','
      << s.mixer << ',' << family_name(s.family) << ',' << s.size << ','
      << static_cast<long long>(s.bytes) << ',' << static_cast<long long>(s.sa_bytes) << ','
      << fmt("%.6f", s.fraction()) << ',' << fmt("%.6f", s.score) << ','
      << fmt("%.6f", s.score_min) << ',' << fmt("%.6f", s.score_max) << ','
      << fmt("%.6f", s.learnt) << ',' << fmt("%.1f", s.ms) << ',' << s.seeds << '\n';
  if (!f) throw std::runtime_error("cannot write " + path);
}

// Mixer names of an experiment in first-seen order.
std::vector<std::string> mixers_of(const Results& r, const std::string& exp) {
  std::vector<std::string> out;
  std::set<std::string> seen;
  for (const Summary& s : r.rows)
    if (s.experiment == exp && seen.insert(s.mixer).second) out.push_back(s.mixer);
  return out;
}

std::vector<Index> values_of(const Results& r, const std::string& exp, bool items) {
  std::set<Index> v;
  for (const Summary& s : r.rows)
    if (s.experiment == exp) v.insert(items ? s.items : s.context);
  return {v.begin(), v.end()};
}

// ------------------------------------------------------------------------------------------
// The verdicts, by the rules of docs/study.md ("Verdict rules"), written before the first run.

struct Verdicts {
  std::vector<std::string> lines;
  void add(const std::string& claim, const std::string& verdict, const std::string& numbers) {
    lines.push_back("- **" + claim + "**: " + verdict + ". " + numbers);
  }
};

void recall_verdicts(const Results& r, Verdicts& v) {
  // Claim 1: OVQ with a state of 10-25% of self-attention's cache matches (within 5 points) or
  // comes close (within 15 points) to self-attention at every T up to 64k.
  {
    std::string nums;
    double worst = -1e9;
    Index worst_t = 0;
    bool any = false;
    for (const Index T : values_of(r, "recall-T", false)) {
      const Summary* sa = r.find("recall-T", T, kFacts, "self-attention");
      const Summary* o = r.find("recall-T", T, kFacts, kProportional);
      if (!sa || !o) continue;
      nums += (nums.empty() ? "" : ", ") + short_t(T) + ": " + pct(o->score) + " vs " +
              pct(sa->score) + " (state " + fmt("%.0f%%", 100.0 * o->fraction()) + ")";
      if (T <= 65536) {
        any = true;
        const double gap = 100.0 * (sa->score - o->score);
        if (gap > worst) worst = gap, worst_t = T;
      }
    }
    std::string verdict = !any ? "not measured"
                          : worst <= 5.0  ? "holds (matches)"
                          : worst <= 15.0 ? "holds (comes close)"
                                          : "does not hold";
    if (any)
      nums = "Recall % of OVQ N=T/8 vs self-attention: " + nums + "; largest gap up to 64k: " +
             fmt("%.1f", worst) + " points at T=" + short_t(worst_t) + ".";
    v.add("Recall: OVQ matches self-attention up to 64k with 10-25% of its state", verdict, nums);
  }
  // Claim 2: at 64k, the best linear attention and the best VQ (S <= 4096) are each at least
  // 20 points below OVQ N=T/8.
  {
    const Index T = 65536;
    const Summary* o = r.find("recall-T", T, kFacts, kProportional);
    double best_lin = -1, best_vq = -1;
    std::string lin_name, vq_name;
    for (const Summary& s : r.rows) {
      if (s.experiment != "recall-T" || s.context != T) continue;
      if (s.family == Family::linear && s.score > best_lin) best_lin = s.score, lin_name = s.mixer;
      if (s.family == Family::vq && s.score > best_vq) best_vq = s.score, vq_name = s.mixer;
    }
    if (!o || best_lin < 0 || best_vq < 0) {
      v.add("Recall: linear attention and VQ-attention fall far behind", "not measured", "");
    } else {
      const double gl = 100.0 * (o->score - best_lin), gv = 100.0 * (o->score - best_vq);
      const std::string verdict = gl >= 20 && gv >= 20   ? "holds"
                                  : gl >= 20 || gv >= 20 ? "holds in part"
                                                         : "does not hold";
      v.add("Recall: linear attention and VQ-attention fall far behind", verdict,
            "At T=64k: OVQ N=T/8 " + pct(o->score) + "%, best linear (" + lin_name + ") " +
                pct(best_lin) + "%, best VQ (" + vq_name + ") " + pct(best_vq) + "%.");
    }
  }
  // Claim 3: a larger dictionary helps: over the N sweep at 64k, recall never drops by more than
  // 3 points from one N to the next and the largest N beats the smallest by at least 5 points.
  {
    const Index T = 65536;
    std::vector<std::pair<Index, double>> curve;
    for (const Summary& s : r.rows) {
      if (s.context != T || s.family != Family::ovq || s.items != kFacts) continue;
      if (s.experiment != "recall-state" && s.experiment != "recall-T") continue;
      if (s.mixer == kProportional) continue;
      curve.emplace_back(s.size, s.score);
    }
    std::sort(curve.begin(), curve.end());
    curve.erase(std::unique(curve.begin(), curve.end(),
                            [](auto& a, auto& b) { return a.first == b.first; }),
                curve.end());
    if (curve.size() < 2) {
      v.add("Recall: a larger dictionary at test time helps", "not measured", "");
    } else {
      bool monotone = true;
      std::string nums;
      for (std::size_t i = 0; i < curve.size(); ++i) {
        if (i > 0 && curve[i].second < curve[i - 1].second - 0.03) monotone = false;
        nums += (i ? ", " : "") + std::string("N=") + std::to_string(curve[i].first) + ": " +
                pct(curve[i].second);
      }
      const double gain = 100.0 * (curve.back().second - curve.front().second);
      const std::string verdict = monotone && gain >= 5 ? "holds"
                                  : gain >= 5           ? "holds, not monotonically"
                                                        : "does not hold";
      v.add("Recall: a larger dictionary at test time helps", verdict,
            "Recall % at T=64k: " + nums + ".");
    }
  }
}

void icl_verdicts(const Results& r, Verdicts& v, const std::string& exp,
                  const std::string& label) {
  // Claim 4: OVQ (N=4096, 13% of the cache at 32k) learns every function self-attention learns:
  // at every F, OVQ's learnt fraction >= self-attention's - 5 points, and >= 95% at F=128.
  {
    std::string nums;
    bool ok = true, any = false;
    double at128 = -1;
    for (const Index F : values_of(r, exp, true)) {
      const Summary* sa = r.find(exp, kIclContext, F, "self-attention");
      const Summary* o = r.find(exp, kIclContext, F, "OVQ N=4096");
      if (!sa || !o) continue;
      any = true;
      if (o->learnt < sa->learnt - 0.05) ok = false;
      if (F == 128) at128 = o->learnt;
      nums += (nums.empty() ? "" : ", ") + std::string("F=") + std::to_string(F) + ": " +
              pct(o->learnt) + "% (NMSE " + fmt("%.3f", o->score) + ") vs " + pct(sa->learnt) +
              "% (" + fmt("%.3f", sa->score) + ")";
    }
    const std::string verdict = !any                      ? "not measured"
                                : ok && at128 >= 0.95     ? "holds"
                                : ok                      ? "holds relative to self-attention"
                                                          : "does not hold";
    v.add("In-context learning" + label + ": OVQ learns all functions (F up to 128) like "
          "self-attention",
          verdict, "Functions learnt by OVQ N=4096 vs self-attention: " + nums + ".");
  }
  // Claim 5: linear attention and VQ do not: at F=128 the best of each learns <= 10% of the
  // functions (the paper: not even one).
  {
    const Index F = 128;
    double best_lin = -1, best_vq = -1;
    std::string lin_name, vq_name;
    double lin_nmse = 0, vq_nmse = 0;
    for (const Summary& s : r.rows) {
      if (s.experiment != exp || s.items != F) continue;
      if (s.family == Family::linear && s.learnt > best_lin)
        best_lin = s.learnt, lin_name = s.mixer, lin_nmse = s.score;
      if (s.family == Family::vq && s.learnt > best_vq)
        best_vq = s.learnt, vq_name = s.mixer, vq_nmse = s.score;
    }
    // The largest F at which each family still learns at least half of the functions.
    auto largest = [&](Family fam) {
      Index best = 0;
      for (const Summary& s : r.rows)
        if (s.experiment == exp && s.family == fam && s.learnt >= 0.5)
          best = std::max(best, s.items);
      return best;
    };
    if (best_lin < 0 || best_vq < 0) {
      v.add("In-context learning" + label + ": linear attention and VQ-attention do not learn "
            "them",
            "not measured", "");
    } else {
      const bool l = best_lin <= 0.10, q = best_vq <= 0.10;
      const std::string verdict = l && q ? "holds" : l || q ? "holds in part" : "does not hold";
      const Index ll = largest(Family::linear), lv = largest(Family::vq);
      v.add("In-context learning" + label + ": linear attention and VQ-attention do not learn "
            "them",
            verdict,
            "At F=128: best linear (" + lin_name + ") learns " + pct(best_lin) + "% (NMSE " +
                fmt("%.3f", lin_nmse) + "), best VQ (" + vq_name + ") " + pct(best_vq) +
                "% (NMSE " + fmt("%.3f", vq_nmse) + "). Largest F with at least half learnt: " +
                "linear " + (ll ? std::to_string(ll) : std::string("none")) + ", VQ " +
                (lv ? std::to_string(lv) : std::string("none")) + ".");
    }
  }
}

void ablation_verdicts(const Results& r, Verdicts& v) {
  // Claims 6-8: the default choice beats the alternative when recall is higher by >= 3 points or
  // ICL NMSE lower by >= 10% (relative), and loses by the same margins; else no difference.
  const Summary* rb = r.find("ablation-recall", kAblationContext, kFacts, "OVQ default");
  const Summary* ib = r.find("ablation-icl", kAblationContext, kAblationFunctions, "OVQ default");
  struct Claim {
    const char* claim;
    const char* variant;
  };
  for (const Claim c : {Claim{"Design: plateauing (Dirichlet) growth beats linear growth",
                              "growth linear"},
                        Claim{"Design: spread-maximising seeding beats random seeding",
                              "seeding random"},
                        Claim{"Design: the adaptive 1/count rate beats a constant rate",
                              "rate constant"},
                        Claim{"Design (no claim): renormalising key centroids", "renormalise"},
                        Claim{"Reading (no claim): the public implementation's (preset kvm)",
                              "preset kvm"},
                        Claim{"Reading (no claim): the same with the delta rule (preset kvm-delta)",
                              "preset kvm-delta"}}) {
    const Summary* rv = r.find("ablation-recall", kAblationContext, kFacts, c.variant);
    const Summary* iv = r.find("ablation-icl", kAblationContext, kAblationFunctions, c.variant);
    if (!rb || !ib || !rv || !iv) {
      v.add(c.claim, "not measured", "");
      continue;
    }
    const double dr = 100.0 * (rb->score - rv->score);  // > 0: default better
    const double di = (iv->score - ib->score) / std::max(iv->score, 1e-12);  // > 0: default better
    const int rw = dr >= 3 ? 1 : dr <= -3 ? -1 : 0;
    const int iw = di >= 0.10 ? 1 : di <= -0.10 ? -1 : 0;
    std::string verdict;
    const bool no_claim = std::string(c.claim).find("(no claim)") != std::string::npos;
    if (no_claim) {
      verdict = rw == 0 && iw == 0 ? "no difference" : "makes a difference (see numbers)";
    } else if (rw >= 0 && iw >= 0 && (rw + iw) > 0) {
      verdict = rw > 0 && iw > 0 ? "holds on both tasks" : "holds on one task, no difference on the other";
    } else if (rw <= 0 && iw <= 0 && (rw + iw) < 0) {
      verdict = "does not hold: the alternative is better";
    } else if (rw == 0 && iw == 0) {
      verdict = "does not hold: no difference beyond the margins";
    } else {
      verdict = "mixed: better on one task, worse on the other";
    }
    v.add(c.claim, verdict,
          std::string("Recall at T=32k (M=128): default ") + pct(rb->score) + "% vs " +
              c.variant + " " + pct(rv->score) + "%; ICL NMSE at F=64: default " +
              fmt("%.3f", ib->score) + " vs " + fmt("%.3f", iv->score) + " (learnt " +
              pct(ib->learnt) + "% vs " + pct(iv->learnt) + "%).");
  }
}

// ------------------------------------------------------------------------------------------
// The results section (markdown).

std::string state_cells(const Summary* s) {
  if (!s) return "| | ";
  return "| " + human_bytes(s->bytes) + " | " + fmt("%.1f%%", 100.0 * s->fraction()) + " ";
}

void table_recall_t(std::ostream& md, const Results& r) {
  const std::vector<Index> Ts = values_of(r, "recall-T", false);
  if (Ts.empty()) return;
  const Index Tref = std::find(Ts.begin(), Ts.end(), 65536) != Ts.end() ? 65536 : Ts.back();
  md << "### Recall against context length (M = " << kFacts << " facts, Q = " << kRecallQueries
     << " queries)\n\n";
  md << "Recall in %, mean over seeds. State at T = " << short_t(Tref)
     << ", and as a fraction of self-attention's key/value cache at that T (OVQ N=T/8: about 13% "
        "at every T).\n\n";
  md << "| mixer | state | % of SA |";
  for (const Index T : Ts) md << ' ' << short_t(T) << " |";
  md << "\n|---|---:|---:|";
  for (std::size_t i = 0; i < Ts.size(); ++i) md << "---:|";
  md << '\n';
  for (const std::string& m : mixers_of(r, "recall-T")) {
    md << "| " << m << ' ' << state_cells(r.find("recall-T", Tref, kFacts, m)) << '|';
    for (const Index T : Ts) {
      const Summary* s = r.find("recall-T", T, kFacts, m);
      md << ' ' << (s ? pct(s->score) : "") << " |";
    }
    md << '\n';
  }
  md << '\n';
}

void table_recall_m(std::ostream& md, const Results& r) {
  const std::vector<Index> Ms = values_of(r, "recall-M", true);
  if (Ms.empty()) return;
  md << "### Recall against the number of facts (T = " << short_t(kMContext) << ")\n\n";
  md << "| mixer | state | % of SA |";
  for (const Index M : Ms) md << " M=" << M << " |";
  md << "\n|---|---:|---:|";
  for (std::size_t i = 0; i < Ms.size(); ++i) md << "---:|";
  md << '\n';
  for (const std::string& m : mixers_of(r, "recall-M")) {
    md << "| " << m << ' ' << state_cells(r.find("recall-M", kMContext, Ms.front(), m)) << '|';
    for (const Index M : Ms) {
      const Summary* s = r.find("recall-M", kMContext, M, m);
      md << ' ' << (s ? pct(s->score) : "") << " |";
    }
    md << '\n';
  }
  md << '\n';
}

void table_recall_state(std::ostream& md, const Results& r) {
  std::vector<const Summary*> rows;
  for (const Summary& s : r.rows)
    if (s.context == kStateContext && s.items == kFacts &&
        (s.experiment == "recall-state" || s.experiment == "recall-T") &&
        s.mixer != kProportional)
      rows.push_back(&s);
  if (rows.empty()) return;
  std::stable_sort(rows.begin(), rows.end(), [](const Summary* a, const Summary* b) {
    if (a->family != b->family) return a->family < b->family;
    return a->bytes < b->bytes;
  });
  md << "### Recall against state size (T = " << short_t(kStateContext) << ", M = " << kFacts
     << ")\n\n";
  md << "| mixer | state | % of SA | recall % | min-max over seeds |\n|---|---:|---:|---:|---:|\n";
  for (const Summary* s : rows)
    md << "| " << s->mixer << ' ' << state_cells(s) << "| " << pct(s->score) << " | "
       << pct(s->score_min) << "-" << pct(s->score_max) << " |\n";
  md << '\n';
}

void table_icl(std::ostream& md, const Results& r, const std::string& exp,
               const std::string& task) {
  const std::vector<Index> Fs = values_of(r, exp, true);
  if (Fs.empty()) return;
  for (const bool learnt : {false, true}) {
    md << "### " << task
       << (learnt ? ": functions learnt (% of F with NMSE < 0.5)"
                  : ": error (NMSE after the best output gain)")
       << " (T = " << short_t(kIclContext) << ", Q = " << kIclQueries << ")\n\n";
    md << "| mixer | state | % of SA |";
    for (const Index F : Fs) md << " F=" << F << " |";
    md << "\n|---|---:|---:|";
    for (std::size_t i = 0; i < Fs.size(); ++i) md << "---:|";
    md << '\n';
    for (const std::string& m : mixers_of(r, exp)) {
      const Summary* first = r.find(exp, kIclContext, Fs.front(), m);
      md << "| " << m << ' '
         << (first && first->family == Family::reference ? std::string("| - | - ")
                                                         : state_cells(first))
         << '|';
      for (const Index F : Fs) {
        const Summary* s = r.find(exp, kIclContext, F, m);
        md << ' ' << (s ? (learnt ? pct(s->learnt) : fmt("%.3f", s->score)) : "") << " |";
      }
      md << '\n';
    }
    md << '\n';
  }
}

void table_ablations(std::ostream& md, const Results& r) {
  const std::vector<std::string> ms = mixers_of(r, "ablation-recall");
  if (ms.empty()) return;
  md << "### Ablations (T = " << short_t(kAblationContext) << "; OVQ N = " << kAblationCapacity
     << " unless named; recall with M = " << kFacts << ", ICL with F = " << kAblationFunctions
     << ")\n\n";
  md << "| variant | state | % of SA | recall % | recall min-max | ICL NMSE | NMSE min-max | ICL "
        "learnt % |\n|---|---:|---:|---:|---:|---:|---:|---:|\n";
  std::vector<std::string> names = ms;
  for (const std::string& m : mixers_of(r, "ablation-icl"))
    if (std::find(names.begin(), names.end(), m) == names.end()) names.push_back(m);
  for (const std::string& m : names) {
    const Summary* a = r.find("ablation-recall", kAblationContext, kFacts, m);
    const Summary* b = r.find("ablation-icl", kAblationContext, kAblationFunctions, m);
    const Summary* st = a ? a : b;
    md << "| " << m << ' '
       << (st && st->family == Family::reference ? std::string("| - | - ") : state_cells(st))
       << "| " << (a ? pct(a->score) : "") << " | "
       << (a ? pct(a->score_min) + "-" + pct(a->score_max) : "") << " | "
       << (b ? fmt("%.3f", b->score) : "") << " | "
       << (b ? fmt("%.3f", b->score_min) + "-" + fmt("%.3f", b->score_max) : "") << " | "
       << (b ? pct(b->learnt) : "") << " |\n";
  }
  md << '\n';
}

void write_markdown(const std::string& path, const Results& r, const std::string& run_line,
                    bool figures) {
  std::ofstream md(path);
  md << "<!-- Generated by scripts/study (examples/study.cpp); do not edit by hand. -->\n\n";
  md << run_line << "\n\n";
  Verdicts v;
  recall_verdicts(r, v);
  icl_verdicts(r, v, "icl-F", "");
  ablation_verdicts(r, v);
  if (!values_of(r, "icl-F-blocked", true).empty()) {
    v.lines.push_back("");
    v.lines.push_back(
        "Supplementary, post hoc (task I-b, added after the first full run; same rules 4 and 5):");
    v.lines.push_back("");
    icl_verdicts(r, v, "icl-F-blocked", " (I-b, post hoc)");
  }
  md << "### Verdict per claim\n\nDecided by the rules above from the numbers below.\n\n";
  for (const std::string& l : v.lines) md << l << '\n';
  md << '\n';
  if (figures) {
    md << "![Recall against context length](figures/recall_vs_T.png)\n\n";
    md << "![Recall against state bytes](figures/recall_vs_state.png)\n\n";
    md << "![Recall against the number of facts](figures/recall_vs_M.png)\n\n";
    md << "![In-context learning error against F](figures/icl_vs_F.png)\n\n";
    if (!values_of(r, "icl-F-blocked", true).empty())
      md << "![In-context learning, examples grouped by function](figures/icl_blocked_vs_F.png)"
            "\n\n";
    md << "![Ablations](figures/ablations.png)\n\n";
  }
  table_recall_t(md, r);
  table_recall_state(md, r);
  table_recall_m(md, r);
  table_icl(md, r, "icl-F", "In-context learning (task I)");
  table_icl(md, r, "icl-F-blocked", "In-context learning, examples grouped by function (task I-b, post hoc)");
  table_ablations(md, r);
  md << "Per-seed numbers: `docs/figures/study_points.csv`; means with min and max: "
        "`docs/figures/study_summary.csv`.\n";
  if (!md) throw std::runtime_error("cannot write " + path);
}

void usage() {
  std::printf(
      "usage: study [--out DIR] [--seeds N] [--max-context T] [--only a,b] [--threads N]\n"
      "             [--progress] [--no-figures]\n"
      "  Runs the recall and in-context-learning study of docs/study.md and writes\n"
      "  DIR/points.csv, DIR/summary.csv and DIR/results.md (default DIR: study-results).\n"
      "  --seeds N        seeds 1..N (default 3)\n"
      "  --max-context T  drop recall streams longer than T (default 131072)\n"
      "  --only LIST      experiments to run, comma-separated, among: recall-T, recall-M,\n"
      "                   recall-state, icl-F (tasks I and I-b), ablation-recall, ablation-icl\n"
      "  --threads N      OpenMP threads over independent runs (default: all)\n"
      "  --progress       one line per finished run on stderr\n"
      "  --no-figures     leave the figure links out of results.md\n");
}

long parse_long(const char* s, const char* what) {
  char* end = nullptr;
  const long v = std::strtol(s, &end, 10);
  if (end == s || *end != '\0' || v < 0) {
    std::fprintf(stderr, "study: %s expects a non-negative integer, got '%s'\n", what, s);
    std::exit(2);
  }
  return v;
}

}  // namespace

int main(int argc, char** argv) {
  std::string out_dir = "study-results";
  long n_seeds = 3, max_context = 131072;
  std::set<std::string> only;
  RunOptions run_options;
  bool figures = true;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> const char* {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "study: %s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--help" || a == "-h") {
      usage();
      return 0;
    } else if (a == "--out") {
      out_dir = next();
    } else if (a == "--seeds") {
      n_seeds = std::max(1L, parse_long(next(), "--seeds"));
    } else if (a == "--max-context") {
      max_context = parse_long(next(), "--max-context");
    } else if (a == "--threads") {
      run_options.threads = static_cast<int>(parse_long(next(), "--threads"));
    } else if (a == "--only") {
      std::stringstream ss(next());
      std::string item;
      while (std::getline(ss, item, ',')) only.insert(item);
    } else if (a == "--progress") {
      run_options.progress = true;
    } else if (a == "--no-figures") {
      figures = false;
    } else {
      std::fprintf(stderr, "study: unknown argument '%s'\n", a.c_str());
      usage();
      return 2;
    }
  }

  std::vector<std::uint64_t> seeds;
  for (long s = 1; s <= n_seeds; ++s) seeds.push_back(static_cast<std::uint64_t>(s));

  const double start = now_ms();
  std::vector<Point> points;
  std::string timings;
  for (const Experiment& e : experiments(seeds, max_context)) {
    if (!only.empty() && !only.count(e.name)) continue;
    if (e.settings.empty()) continue;
    const double t0 = now_ms();
    std::fprintf(stderr, "study: %s (%zu streams)...\n", e.name.c_str(), e.settings.size());
    const std::vector<Point> p = run_settings(e.settings, run_options);
    points.insert(points.end(), p.begin(), p.end());
    const double s = (now_ms() - t0) / 1000.0;
    std::fprintf(stderr, "study: %s done in %.1f s\n", e.name.c_str(), s);
    timings += (timings.empty() ? "" : ", ") + e.name + " " + fmt("%.0f s", s);
  }
  const double total = (now_ms() - start) / 1000.0;

  const std::string cmd = "mkdir -p '" + out_dir + "'";
  if (std::system(cmd.c_str()) != 0) {
    std::fprintf(stderr, "study: cannot create %s\n", out_dir.c_str());
    return 1;
  }
  const Results r = summarise(points);
  write_points_csv(out_dir + "/points.csv", points);
  write_summary_csv(out_dir + "/summary.csv", r);
  int threads = 1;
#if defined(_OPENMP)
  threads = run_options.threads > 0 ? run_options.threads : omp_get_max_threads();
#endif
  const std::string run_line = "Run: " + std::to_string(n_seeds) + " seed(s), " +
                               std::to_string(threads) + " thread(s), " + fmt("%.0f", total) +
                               " s in all (" + timings + ").";
  write_markdown(out_dir + "/results.md", r, run_line, figures);
  std::fprintf(stderr, "study: %zu runs in %.1f s; wrote %s/{points.csv,summary.csv,results.md}\n",
               points.size(), total, out_dir.c_str());
  return 0;
}
