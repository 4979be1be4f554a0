// attend: run one of ovq's sequence mixers over Q, K, V read from .npy files and write O.
//
//   attend MIXER --q Q.npy --k K.npy --v V.npy --out O.npy [options]     (attend --help)
//
// The arrays go through ovq::MultiHead<Mixer> with a batch of one: a C-order (H, T, d) array is
// exactly the (H T) x d row-major block the layer expects, so inputs are used as read. The whole
// run is instantiated for the inputs' scalar type, so float32 inputs are computed and written in
// float32 and float64 ones in float64.
//
// --save-state / --load-state save and restore the layer's states in the library's state-file
// format (ovq/io/state_file.hpp), so that a stream cut anywhere can be continued by a new process.
//
// Exit status: 0 on success, 2 when the command line itself is wrong (nothing has been read),
// 1 for everything found later (files, shapes, values the library rejects, memory). Every failure
// prints exactly one line on stderr, starting with "attend: ".
#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <fstream>
#include <initializer_list>
#include <iostream>
#include <iterator>
#include <map>
#include <new>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "ovq/io/npy.hpp"
#include "ovq/io/state_file.hpp"
#include "ovq/ovq.hpp"
#if defined(OVQ_ATTEND_CUDA)
#include "attend_cuda.hpp"
#endif

namespace {

using ovq::Index;
using ovq::RowMatrix;

constexpr int kExitRuntime = 1;
constexpr int kExitUsage = 2;

const char kHelp[] = R"(usage: attend MIXER --q Q.npy --k K.npy --v V.npy --out O.npy [options]

Runs a sequence mixer of the ovq library over queries, keys and values stored as
.npy files and writes the output O.

MIXER
  self      softmax self-attention (causal, sliding window or non-causal)
  linear    linear attention (feature map, optional normaliser and decay)
  vq        VQ-attention over a fixed codebook (--codebook is required)
  ovq       OVQ-attention with an online dictionary

Arrays
  Little-endian float16, float32 or float64, C order, shaped (T, d) for one head or
  (H, T, d) for H heads. Q is (Hq, T, dk), K is (Hkv, T, dk), V is (Hkv, T, dv);
  K and V may have fewer heads than Q (grouped queries): Hq must be a multiple
  of Hkv, and query head h reads key/value head h / (Hq / Hkv). Q, K, V (and the
  codebook) must all have the same dtype; the computation runs in that precision
  (float16: 16-bit keys, values and states, computed in float) and O is written in
  it, shaped like Q with dv columns: (T, dv) or (Hq, T, dv). --storage picks another
  element type, converting the inputs as they are read.

Options for every mixer
  --q, --k, --v PATH    input arrays (required)
  --out PATH            output array (required)
  --beta B              logit scale (default 1; ignored by normalised linear attention)
  --chunk L             chunk length (default: the library's, 256 for self, 64 otherwise)
  --stream              feed the tokens one by one through the step API
  --split a,b,...       feed the sequence as consecutive forward calls of these
                        lengths (integers >= 0 that must add up to T)
  --threads N           run key/value heads on at most N threads (0: OpenMP's default)
  --head-betas B,...    self, vq, ovq: one logit scale per query head (Hq numbers) in
                        place of --beta; under --value-update delta the query heads of
                        one key/value head must share theirs
  --storage T           the element type of the run: f16, bf16, f32 or f64 (default:
                        the inputs' dtype). The inputs are rounded to it (float64 to a
                        16-bit type through float32); O is written in it, except for bf16,
                        which NumPy does not have: O is then written as float32 (the bf16
                        outputs, exactly)
  --device cpu|cuda     where to compute (default cpu). cuda: the library's CUDA mixers
                        on the first GPU, the same options, states and mathematics (only
                        in an attend built with CUDA: ovq configured with OVQ_ENABLE_CUDA)
  --load-state F        before the run, restore the state of every key/value head
                        from the state file F (written by --save-state) and continue
                        that stream: the mixer, its options, the dtype, the head counts,
                        dk and dv must be the ones F was saved with (vq: and the
                        codebook); anything else is refused, naming what differs
  --save-state F        after the run, save the state of every key/value head to the
                        state file F (versioned and checksummed; F is replaced
                        atomically, so a failed save leaves an existing F intact).
                        A prefix run with --save-state followed by a run of the rest
                        with --load-state gives, bit for bit, the outputs and the
                        state of one run with --split cut at the same point.
  --help                print this text and exit

self
  --window W            sliding window: a token sees itself and the W - 1 before it
  --noncausal           every query sees every key (not with --stream or --split,
                        since a call cannot see keys that were not fed yet)

linear
  --feature-map identity|elu1|relu   feature map phi (default identity)
  --normalize           divide by z . phi(q) + 1e-6
  --decay G             decay gamma in (0, 1] (default 1: none)

vq
  --codebook C.npy      codebook, (S, dk) shared by every key/value head or
                        (Hkv, S, dk) with one codebook per key/value head

ovq
  --preset NAME         start from a preset; the options below override it:
                          default    docs/math.md's reading (the defaults below)
                          kvm        the public OVQ implementation's reading: --growth
                                     saturating --seeding lowest_similarity
                                     --renormalize --renormalize-values
                          kvm-delta  kvm with --value-update delta (keys renormalised,
                                     values not)
  --capacity N          maximum number of centroids (default 1024)
  --growth dirichlet|linear|saturating  dictionary growth schedule (default dirichlet;
                        saturating: floor(N t / (N + t)))
  --alpha A             dirichlet concentration (default: the capacity)
  --rate R              linear growth: centroids per token (default 1)
  --seeding spread|random|lowest_similarity  how new centroids are picked (default spread;
                        lowest_similarity: assigned first, the least similar keys seed)
  --seed S              random seeding: generator seed (default 0)
  --lr adaptive|constant     centroid update rate (default adaptive: running mean)
  --eta E               constant update rate, in (0, 1] (required with --lr constant)
  --renormalize         keep key centroids at unit norm
  --renormalize-values  keep value centroids at unit norm (not with --value-update delta)
  --no-count-bias       read the centroids without the log-count bias (counts then set
                        the update rates only)
  --value-update mean|delta  value rows: running mean of their members (default), or
                        delta rule: moved by the members' residuals against the read
                        of the dictionary before the chunk with the key as the query

vq and ovq
  --state-out P         write the final state of every key/value head: its active
                        dictionary rows and their counts, and a summary.
                        One key/value head (Hkv = 1):
                          P.dk.npy      (n, dk) key rows (vq: the codebook)
                          P.dv.npy      (n, dv) value rows (vq: mean value per code)
                          P.counts.npy  (n,) counts, written as float64 (exact up
                                        to 2^53; .npy output here is float only)
                          P.json        {"mixer", "dtype", "kv_heads": 1,
                                         "n", "t", "pending"} with integers
                        Several key/value heads: one set P.h<i>.dk.npy, P.h<i>.dv.npy,
                        P.h<i>.counts.npy per head i, and one P.json in which "n",
                        "t" and "pending" are arrays with one entry per head.
                        n: active rows; t: tokens absorbed into the dictionary
                        (the counts add up to t); pending: tokens of the current,
                        incomplete chunk, not yet in the counts.

Options take their value as the next argument or as --name=value. Numbers must be
complete decimal numbers; their ranges are checked by the library.

Exit status: 0 success, 2 bad command line, 1 any other error (files, shapes,
values rejected by the library, memory). Errors are reported as one line on
stderr starting with "attend: ".
)";

// The command line is wrong (exit 2).
class UsageError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// The inputs do not fit together (exit 1).
class InputError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

enum class MixerKind { self, linear, vq, ovq };

constexpr unsigned kSelf = 1u << 0;
constexpr unsigned kLinear = 1u << 1;
constexpr unsigned kVq = 1u << 2;
constexpr unsigned kOvq = 1u << 3;
constexpr unsigned kAll = kSelf | kLinear | kVq | kOvq;

unsigned mixer_bit(MixerKind m) {
  switch (m) {
    case MixerKind::self: return kSelf;
    case MixerKind::linear: return kLinear;
    case MixerKind::vq: return kVq;
    case MixerKind::ovq: return kOvq;
  }
  return 0;
}

const char* mixer_name(MixerKind m) {
  switch (m) {
    case MixerKind::self: return "self";
    case MixerKind::linear: return "linear";
    case MixerKind::vq: return "vq";
    case MixerKind::ovq: return "ovq";
  }
  return "?";
}

std::string mixers_of(unsigned mask) {
  std::string s;
  for (MixerKind m : {MixerKind::self, MixerKind::linear, MixerKind::vq, MixerKind::ovq}) {
    if (mask & mixer_bit(m)) s += (s.empty() ? "" : ", ") + std::string(mixer_name(m));
  }
  return s;
}

struct OptionSpec {
  const char* name;
  bool takes_value;
  unsigned mixers;
};

const OptionSpec kOptions[] = {
    {"--q", true, kAll},
    {"--k", true, kAll},
    {"--v", true, kAll},
    {"--out", true, kAll},
    {"--beta", true, kAll},
    {"--chunk", true, kAll},
    {"--stream", false, kAll},
    {"--split", true, kAll},
    {"--threads", true, kAll},
    {"--device", true, kAll},
    {"--storage", true, kAll},
    {"--load-state", true, kAll},
    {"--save-state", true, kAll},
    {"--head-betas", true, kSelf | kVq | kOvq},
    {"--window", true, kSelf},
    {"--noncausal", false, kSelf},
    {"--feature-map", true, kLinear},
    {"--normalize", false, kLinear},
    {"--decay", true, kLinear},
    {"--codebook", true, kVq},
    {"--capacity", true, kOvq},
    {"--growth", true, kOvq},
    {"--alpha", true, kOvq},
    {"--rate", true, kOvq},
    {"--seeding", true, kOvq},
    {"--seed", true, kOvq},
    {"--lr", true, kOvq},
    {"--eta", true, kOvq},
    {"--renormalize", false, kOvq},
    {"--preset", true, kOvq},
    {"--renormalize-values", false, kOvq},
    {"--no-count-bias", false, kOvq},
    {"--value-update", true, kOvq},
    {"--state-out", true, kVq | kOvq},
};

const OptionSpec* find_option(const std::string& name) {
  for (const OptionSpec& o : kOptions)
    if (name == o.name) return &o;
  return nullptr;
}

// ---- strict number parsing --------------------------------------------------------------------

void check_number_text(const std::string& opt, const std::string& text, const char* kind) {
  if (text.empty() || std::isspace(static_cast<unsigned char>(text[0]))) {
    throw UsageError(opt + ": '" + text + "' is not " + kind);
  }
}

std::int64_t parse_int(const std::string& opt, const std::string& text) {
  check_number_text(opt, text, "an integer");
  errno = 0;
  char* end = nullptr;
  const long long v = std::strtoll(text.c_str(), &end, 10);
  if (end == text.c_str() || *end != '\0') {
    throw UsageError(opt + ": '" + text + "' is not an integer");
  }
  if (errno == ERANGE) throw UsageError(opt + ": '" + text + "' is out of range");
  return static_cast<std::int64_t>(v);
}

std::uint64_t parse_uint(const std::string& opt, const std::string& text) {
  check_number_text(opt, text, "a non-negative integer");
  if (text[0] == '-') throw UsageError(opt + ": '" + text + "' is not a non-negative integer");
  errno = 0;
  char* end = nullptr;
  const unsigned long long v = std::strtoull(text.c_str(), &end, 10);
  if (end == text.c_str() || *end != '\0') {
    throw UsageError(opt + ": '" + text + "' is not a non-negative integer");
  }
  if (errno == ERANGE) throw UsageError(opt + ": '" + text + "' is out of range");
  return static_cast<std::uint64_t>(v);
}

double parse_double(const std::string& opt, const std::string& text) {
  check_number_text(opt, text, "a number");
  errno = 0;
  char* end = nullptr;
  const double v = std::strtod(text.c_str(), &end);
  if (end == text.c_str() || *end != '\0') {
    throw UsageError(opt + ": '" + text + "' is not a number");
  }
  if (errno == ERANGE) throw UsageError(opt + ": '" + text + "' is out of range");
  return v;
}

// The comma-separated items of an option's value; an empty item is a usage error.
std::vector<std::string> comma_items(const std::string& opt, const std::string& text) {
  std::vector<std::string> items;
  std::size_t start = 0;
  for (;;) {
    const std::size_t comma = text.find(',', start);
    items.push_back(
        text.substr(start, comma == std::string::npos ? std::string::npos : comma - start));
    if (items.back().empty()) throw UsageError(opt + ": '" + text + "' has an empty entry");
    if (comma == std::string::npos) return items;
    start = comma + 1;
  }
}

std::vector<std::int64_t> parse_split(const std::string& opt, const std::string& text) {
  std::vector<std::int64_t> lengths;
  for (const std::string& item : comma_items(opt, text)) {
    const std::int64_t len = parse_int(opt, item);
    if (len < 0) throw UsageError(opt + ": length " + item + " is negative, expected >= 0");
    lengths.push_back(len);
  }
  return lengths;
}

std::vector<double> parse_double_list(const std::string& opt, const std::string& text) {
  std::vector<double> values;
  for (const std::string& item : comma_items(opt, text)) values.push_back(parse_double(opt, item));
  return values;
}

template <class T>
T parse_choice(const std::string& opt, const std::string& text,
               std::initializer_list<std::pair<const char*, T>> choices) {
  std::string names;
  for (const auto& c : choices) {
    if (text == c.first) return c.second;
    names += (names.empty() ? "" : ", ") + std::string(c.first);
  }
  throw UsageError(opt + ": '" + text + "' is not one of " + names);
}

// ---- the command line -------------------------------------------------------------------------

struct Config {
  MixerKind mixer = MixerKind::self;
  std::string q_path, k_path, v_path, out_path;
  bool stream = false;
  std::optional<std::vector<std::int64_t>> split;
  std::optional<int> threads;
  bool cuda = false;
  std::optional<std::string> storage;  // f16, bf16, f32, f64
  std::string codebook_path;
  std::optional<std::string> state_out;
  std::optional<std::string> load_state;
  std::optional<std::string> save_state;
  std::vector<double> head_betas;  // empty: --beta for every head

  ovq::SelfAttentionOptions self;
  ovq::LinearAttentionOptions linear;
  ovq::VqAttentionOptions vq;
  ovq::OvqOptions ovq;
};

// Returns nullopt when help was requested.
std::optional<Config> parse_command_line(int argc, char** argv) {
  std::optional<std::string> mixer_word;
  std::map<std::string, std::string> given;  // option -> value ("" for flags)

  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--help" || arg == "-h") return std::nullopt;
    if (arg.size() > 1 && arg[0] == '-') {
      const std::size_t eq = arg.find('=');
      const std::string name = arg.substr(0, eq);
      const OptionSpec* spec = find_option(name);
      if (spec == nullptr) throw UsageError("unknown option '" + name + "'");
      std::string value;
      if (spec->takes_value) {
        if (eq != std::string::npos) {
          value = arg.substr(eq + 1);
        } else if (i + 1 < argc) {
          value = argv[++i];
        } else {
          throw UsageError(name + " needs a value");
        }
      } else if (eq != std::string::npos) {
        throw UsageError(name + " takes no value");
      }
      if (!given.emplace(name, value).second) throw UsageError(name + " given more than once");
    } else {
      if (mixer_word) {
        throw UsageError("unexpected argument '" + arg + "' (the mixer is already '" +
                         *mixer_word + "')");
      }
      mixer_word = arg;
    }
  }

  if (!mixer_word) throw UsageError("missing MIXER (self, linear, vq or ovq)");
  Config cfg;
  cfg.mixer = parse_choice<MixerKind>("MIXER", *mixer_word,
                                      {{"self", MixerKind::self},
                                       {"linear", MixerKind::linear},
                                       {"vq", MixerKind::vq},
                                       {"ovq", MixerKind::ovq}});
  const unsigned bit = mixer_bit(cfg.mixer);
  for (const auto& [name, value] : given) {
    const OptionSpec* spec = find_option(name);
    if (!(spec->mixers & bit)) {
      throw UsageError(name + " does not apply to mixer '" + mixer_name(cfg.mixer) +
                       "' (only to " + mixers_of(spec->mixers) + ")");
    }
  }

  auto has = [&](const char* name) { return given.count(name) != 0; };
  auto value = [&](const char* name) -> const std::string& { return given.at(name); };
  auto required = [&](const char* name) -> const std::string& {
    if (!has(name)) throw UsageError(std::string("missing ") + name);
    if (value(name).empty()) throw UsageError(std::string(name) + ": empty path");
    return value(name);
  };

  cfg.q_path = required("--q");
  cfg.k_path = required("--k");
  cfg.v_path = required("--v");
  cfg.out_path = required("--out");

  cfg.stream = has("--stream");
  if (has("--split")) cfg.split = parse_split("--split", value("--split"));
  if (cfg.stream && cfg.split) throw UsageError("--stream and --split exclude each other");
  if (has("--threads")) {
    const std::int64_t n = parse_int("--threads", value("--threads"));
    if (n < 0 || n > 1000000) {
      throw UsageError("--threads: " + value("--threads") + " is out of range, expected >= 0");
    }
    cfg.threads = static_cast<int>(n);
  }
  if (has("--device")) {
    cfg.cuda = parse_choice<bool>("--device", value("--device"), {{"cpu", false}, {"cuda", true}});
#if !defined(OVQ_ATTEND_CUDA)
    if (cfg.cuda)
      throw UsageError("--device cuda: this attend was built without CUDA (configure ovq with "
                       "-DOVQ_ENABLE_CUDA=ON where nvcc is installed)");
#endif
  }
  if (has("--head-betas")) {
    cfg.head_betas = parse_double_list("--head-betas", value("--head-betas"));
  }
  if (has("--storage")) {
    cfg.storage = parse_choice<std::string>(
        "--storage", value("--storage"), {{"f16", "f16"}, {"bf16", "bf16"}, {"f32", "f32"}, {"f64", "f64"}});
  }
  if (has("--state-out")) {
    if (value("--state-out").empty()) throw UsageError("--state-out: empty path");
    cfg.state_out = value("--state-out");
  }
  if (has("--load-state")) {
    if (value("--load-state").empty()) throw UsageError("--load-state: empty path");
    cfg.load_state = value("--load-state");
  }
  if (has("--save-state")) {
    if (value("--save-state").empty()) throw UsageError("--save-state: empty path");
    cfg.save_state = value("--save-state");
  }

  std::optional<double> beta;
  std::optional<Index> chunk;
  if (has("--beta")) beta = parse_double("--beta", value("--beta"));
  if (has("--chunk")) chunk = static_cast<Index>(parse_int("--chunk", value("--chunk")));

  switch (cfg.mixer) {
    case MixerKind::self: {
      ovq::SelfAttentionOptions& o = cfg.self;
      if (beta) o.beta = *beta;
      if (chunk) o.chunk = *chunk;
      if (has("--window")) o.window = static_cast<Index>(parse_int("--window", value("--window")));
      if (has("--noncausal")) {
        o.causal = false;
        if (cfg.stream || cfg.split) {
          throw UsageError(
              "--noncausal cannot be combined with --stream or --split (a call cannot see keys "
              "that were not fed yet)");
        }
      }
      o.validate();
      break;
    }
    case MixerKind::linear: {
      ovq::LinearAttentionOptions& o = cfg.linear;
      if (beta) o.beta = *beta;
      if (chunk) o.chunk = *chunk;
      if (has("--feature-map")) {
        o.feature_map = parse_choice<ovq::FeatureMap>(
            "--feature-map", value("--feature-map"),
            {{"identity", ovq::FeatureMap::identity},
             {"elu1", ovq::FeatureMap::elu1},
             {"relu", ovq::FeatureMap::relu}});
      }
      o.normalize = has("--normalize");
      if (has("--decay")) o.decay = parse_double("--decay", value("--decay"));
      o.validate();
      break;
    }
    case MixerKind::vq: {
      ovq::VqAttentionOptions& o = cfg.vq;
      if (beta) o.beta = *beta;
      if (chunk) o.chunk = *chunk;
      cfg.codebook_path = required("--codebook");
      o.validate();
      break;
    }
    case MixerKind::ovq: {
      ovq::OvqOptions& o = cfg.ovq;
      if (has("--preset")) {
        // The library's presets, by name (a name it does not have is a usage error).
        const std::string name = value("--preset");
        std::string names;
        for (const char* known : ovq::OvqOptions::kPresetNames)
          names += (names.empty() ? "" : ", ") + std::string(known);
        const auto& all = ovq::OvqOptions::kPresetNames;
        if (std::find(std::begin(all), std::end(all), name) == std::end(all))
          throw UsageError("--preset: '" + name + "' is not one of " + names);
        o = ovq::OvqOptions::preset(name);
      }
      if (beta) o.beta = *beta;
      if (chunk) o.chunk = *chunk;
      if (has("--capacity")) {
        o.capacity = static_cast<Index>(parse_int("--capacity", value("--capacity")));
      }
      // Policies not given keep the preset's (the defaults without --preset).
      enum class GrowthKind { dirichlet, linear, saturating };
      const GrowthKind preset_growth =
          o.growth.kind == ovq::Growth::Kind::saturating ? GrowthKind::saturating
          : o.growth.kind == ovq::Growth::Kind::linear   ? GrowthKind::linear
                                                         : GrowthKind::dirichlet;
      const GrowthKind growth =
          has("--growth") ? parse_choice<GrowthKind>("--growth", value("--growth"),
                                                     {{"dirichlet", GrowthKind::dirichlet},
                                                      {"linear", GrowthKind::linear},
                                                      {"saturating", GrowthKind::saturating}})
                          : preset_growth;
      if (growth == GrowthKind::saturating) {
        if (has("--rate") || has("--alpha"))
          throw UsageError("--rate and --alpha do not apply to --growth saturating");
        o.growth = ovq::Growth::saturating();
      } else if (growth == GrowthKind::dirichlet) {
        if (has("--rate")) throw UsageError("--rate applies to --growth linear only");
        o.growth = ovq::Growth::dirichlet(has("--alpha") ? parse_double("--alpha", value("--alpha"))
                                                         : 0.0);
      } else {
        if (has("--alpha")) throw UsageError("--alpha applies to --growth dirichlet only");
        o.growth = ovq::Growth::linear(has("--rate") ? parse_double("--rate", value("--rate"))
                                                     : 1.0);
      }
      enum class SeedingKind { spread, random, lowest_similarity };
      const SeedingKind preset_seeding =
          o.seeding.kind == ovq::Seeding::Kind::lowest_similarity ? SeedingKind::lowest_similarity
          : o.seeding.kind == ovq::Seeding::Kind::random          ? SeedingKind::random
                                                                  : SeedingKind::spread;
      const SeedingKind seeding =
          has("--seeding") ? parse_choice<SeedingKind>("--seeding", value("--seeding"),
                                                       {{"spread", SeedingKind::spread},
                                                        {"random", SeedingKind::random},
                                                        {"lowest_similarity",
                                                         SeedingKind::lowest_similarity}})
                           : preset_seeding;
      if (seeding != SeedingKind::random && has("--seed"))
        throw UsageError("--seed applies to --seeding random only");
      if (seeding == SeedingKind::spread) {
        o.seeding = ovq::Seeding::spread();
      } else if (seeding == SeedingKind::lowest_similarity) {
        o.seeding = ovq::Seeding::lowest_similarity();
      } else {
        o.seeding = ovq::Seeding::random(has("--seed") ? parse_uint("--seed", value("--seed")) : 0);
      }
      enum class RateKind { adaptive, constant };
      const RateKind lr =
          has("--lr") ? parse_choice<RateKind>("--lr", value("--lr"),
                                               {{"adaptive", RateKind::adaptive},
                                                {"constant", RateKind::constant}})
                      : RateKind::adaptive;
      if (lr == RateKind::adaptive) {
        if (has("--eta")) throw UsageError("--eta applies to --lr constant only");
        o.rate = ovq::UpdateRate::adaptive();
      } else {
        if (!has("--eta")) throw UsageError("--lr constant needs --eta");
        o.rate = ovq::UpdateRate::constant(parse_double("--eta", value("--eta")));
      }
      if (has("--renormalize")) o.renormalize = true;
      if (has("--renormalize-values")) o.renormalize_values = true;
      if (has("--no-count-bias")) o.count_bias = false;
      if (has("--value-update")) {
        o.value_update = parse_choice<ovq::ValueUpdate>("--value-update", value("--value-update"),
                                                        {{"mean", ovq::ValueUpdate::mean},
                                                         {"delta", ovq::ValueUpdate::delta}});
      }
      o.validate();
      break;
    }
  }
  return cfg;
}

// ---- inputs -----------------------------------------------------------------------------------

std::string shape_text(const std::vector<std::int64_t>& shape) {
  std::string s = "(";
  for (std::size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + (shape.size() == 1 ? ",)" : ")");
}

const char* dtype_name(ovq::io::DType d) {
  return d == ovq::io::DType::f32 ? "float32" : d == ovq::io::DType::f64 ? "float64" : "float16";
}

// An input array seen as heads x rows x cols.
struct Array3 {
  std::string label;  // "Q (q.npy)"
  ovq::io::NpyArray npy;
  Index heads = 1, rows = 0, cols = 0;
};

Array3 load(const char* name, const std::string& path, const char* expected) {
  Array3 a;
  a.label = std::string(name) + " ('" + path + "')";
  a.npy = ovq::io::read_npy(path);
  const std::vector<std::int64_t>& s = a.npy.shape;
  if (s.size() == 2) {
    a.heads = 1;
    a.rows = s[0];
    a.cols = s[1];
  } else if (s.size() == 3) {
    a.heads = s[0];
    a.rows = s[1];
    a.cols = s[2];
  } else {
    throw InputError(a.label + " has shape " + shape_text(s) + ", expected " + expected);
  }
  if (a.heads < 1) throw InputError(a.label + " has shape " + shape_text(s) + ", expected >= 1 head");
  if (a.cols < 1) {
    throw InputError(a.label + " has shape " + shape_text(s) + ", expected >= 1 column");
  }
  return a;
}

// Problem sizes, checked once for all modes.
struct Dims {
  Index hq = 1, hkv = 1, tokens = 0, dk = 0, dv = 0;
};

Dims check_inputs(const Array3& q, const Array3& k, const Array3& v) {
  if (k.npy.dtype != q.npy.dtype || v.npy.dtype != q.npy.dtype) {
    throw InputError(std::string("Q, K and V must have the same dtype, got ") +
                     dtype_name(q.npy.dtype) + ", " + dtype_name(k.npy.dtype) + ", " +
                     dtype_name(v.npy.dtype));
  }
  Dims d;
  d.hq = q.heads;
  d.hkv = k.heads;
  d.tokens = q.rows;
  d.dk = q.cols;
  d.dv = v.cols;
  if (k.rows != d.tokens || v.rows != d.tokens) {
    throw InputError("Q, K and V must have the same number of tokens T, got " +
                     std::to_string(q.rows) + ", " + std::to_string(k.rows) + ", " +
                     std::to_string(v.rows));
  }
  if (k.cols != d.dk) {
    throw InputError("K has dk = " + std::to_string(k.cols) + " columns, Q has " +
                     std::to_string(d.dk) + "; they must match");
  }
  if (v.heads != k.heads) {
    throw InputError("V has " + std::to_string(v.heads) + " heads, K has " +
                     std::to_string(k.heads) + "; they must match");
  }
  if (d.hq % d.hkv != 0) {
    throw InputError("Q has " + std::to_string(d.hq) + " heads, expected a multiple of the " +
                     std::to_string(d.hkv) + " key/value heads of K and V");
  }
  return d;
}

template <class Scalar>
using ConstMap = Eigen::Map<const RowMatrix<Scalar>>;

// ---- feeding the layer ------------------------------------------------------------------------

// Copies tokens [t0, t0 + len) of every head of a (heads * tokens) x cols block into a
// (heads * len) x cols block, and back.
template <class Scalar>
void gather(const ConstMap<Scalar>& src, Index heads, Index tokens, Index t0, Index len,
            RowMatrix<Scalar>& dst) {
  dst.resize(heads * len, src.cols());
  for (Index h = 0; h < heads; ++h) dst.middleRows(h * len, len) = src.middleRows(h * tokens + t0, len);
}

template <class Scalar>
void scatter(const RowMatrix<Scalar>& src, Index heads, Index tokens, Index t0, Index len,
             RowMatrix<Scalar>& dst) {
  for (Index h = 0; h < heads; ++h) dst.middleRows(h * tokens + t0, len) = src.middleRows(h * len, len);
}

template <class Mixer>
RowMatrix<typename Mixer::scalar_type> drive(ovq::MultiHead<Mixer>& layer, const Config& cfg,
                                             const Dims& d,
                                             const ConstMap<typename Mixer::scalar_type>& q,
                                             const ConstMap<typename Mixer::scalar_type>& k,
                                             const ConstMap<typename Mixer::scalar_type>& v) {
  using Scalar = typename Mixer::scalar_type;
  if (cfg.threads) layer.set_threads(static_cast<int>(std::min<Index>(*cfg.threads, d.hkv)));
  RowMatrix<Scalar> o(d.hq * d.tokens, d.dv);
  if (!cfg.stream && !cfg.split && !cfg.cuda) {
    layer.forward(q, k, v, o);
    return o;
  }
  std::vector<std::int64_t> lengths;
  if (!cfg.stream && !cfg.split) {
    lengths.assign(1, d.tokens);
  } else if (cfg.stream) {
    lengths.assign(static_cast<std::size_t>(d.tokens), 1);
  } else {
    lengths = *cfg.split;
    std::int64_t total = 0;
    for (std::int64_t len : lengths) {
      if (len > d.tokens - total) {
        throw InputError("--split lengths add up to more than T = " + std::to_string(d.tokens));
      }
      total += len;
    }
    if (total != d.tokens) {
      throw InputError("--split lengths add up to " + std::to_string(total) + ", expected T = " +
                       std::to_string(d.tokens));
    }
  }
#if defined(OVQ_ATTEND_CUDA)
  if (cfg.cuda) {
    attend_cuda::Problem<Scalar> p;
    p.hq = d.hq;
    p.hkv = d.hkv;
    p.tokens = d.tokens;
    p.dk = d.dk;
    p.dv = d.dv;
    p.q = q.data();
    p.k = k.data();
    p.v = v.data();
    p.lengths = lengths;
    p.steps = cfg.stream;
    p.head_betas = layer.head_betas();
    return attend_cuda::run(layer.mixer().options(), layer.states(), p);
  }
#endif
  RowMatrix<Scalar> qp, kp, vp, op;
  Index t0 = 0;
  for (std::int64_t len : lengths) {
    gather(q, d.hq, d.tokens, t0, len, qp);
    gather(k, d.hkv, d.tokens, t0, len, kp);
    gather(v, d.hkv, d.tokens, t0, len, vp);
    op.resize(d.hq * len, d.dv);
    if (cfg.stream) {
      layer.step(qp, kp, vp, op);
    } else {
      layer.forward(qp, kp, vp, op);
    }
    scatter(op, d.hq, d.tokens, t0, len, o);
    t0 += len;
  }
  return o;
}

// ---- state output -----------------------------------------------------------------------------

struct HeadSummary {
  Index n = 0;
  std::int64_t t = 0;
  std::int64_t pending = 0;
};

template <class Scalar>
HeadSummary summary(const ovq::VqState<Scalar>& s) {
  return {s.dictionary().size(), s.absorbed(), s.pending()};
}

template <class Scalar>
HeadSummary summary(const ovq::OvqState<Scalar>& s) {
  return {s.dictionary().size(), s.absorbed(), s.pending()};
}

// An array of a run's elements as .npy: in their own dtype, except bf16, which NumPy does not
// have: written as float32 (exactly).
template <class T>
void write_array(const std::string& path, const T* data, const std::vector<std::int64_t>& shape) {
  if constexpr (std::is_same_v<T, ovq::bf16>) {
    std::int64_t count = 1;
    for (std::int64_t s : shape) count *= s;
    std::vector<float> wide(static_cast<std::size_t>(count));
    for (std::size_t i = 0; i < wide.size(); ++i) wide[i] = ovq::widen(data[i]);
    ovq::io::write_npy<float>(path, wide.data(), shape);
  } else {
    ovq::io::write_npy<T>(path, data, shape);
  }
}

void write_text_file(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) throw ovq::IoError("cannot open '" + path + "' for writing");
  out << text;
  out.close();
  if (!out) throw ovq::IoError("cannot write '" + path + "'");
}

template <class Mixer>
void write_state(const ovq::MultiHead<Mixer>& layer, const std::string& prefix,
                 MixerKind mixer) {
  using Scalar = typename Mixer::scalar_type;
  const Index heads = layer.kv_heads();
  std::vector<HeadSummary> sums;
  for (Index h = 0; h < heads; ++h) {
    const auto& state = layer.state(0, h);
    const ovq::Dictionary<Scalar>& dict = state.dictionary();
    const HeadSummary s = summary(state);
    sums.push_back(s);
    const std::string base = heads == 1 ? prefix : prefix + ".h" + std::to_string(h);
    const auto n = static_cast<std::int64_t>(s.n);
    // Active rows are contiguous at the top of the dictionary (stride = width).
    // The rows' running means (in float for a 16-bit run, where the reads see them rounded).
    write_array(base + ".dk.npy", dict.mean_keys().data, {n, dict.key_dim()});
    write_array(base + ".dv.npy", dict.mean_values().data, {n, dict.value_dim()});
    std::vector<double> counts(static_cast<std::size_t>(n));
    for (Index r = 0; r < s.n; ++r) counts[static_cast<std::size_t>(r)] = static_cast<double>(dict.count(r));
    ovq::io::write_npy<double>(base + ".counts.npy", counts.data(), {n});
  }
  auto field = [&](auto get) {
    if (heads == 1) return std::to_string(get(sums[0]));
    std::string s = "[";
    for (std::size_t h = 0; h < sums.size(); ++h) s += (h ? ", " : "") + std::to_string(get(sums[h]));
    return s + "]";
  };
  std::ostringstream json;
  json << "{\"mixer\": \"" << mixer_name(mixer) << "\", \"dtype\": \""
       << ovq::element_name<Scalar>() << "\", \"kv_heads\": " << heads
       << ", \"n\": " << field([](const HeadSummary& s) { return static_cast<std::int64_t>(s.n); })
       << ", \"t\": " << field([](const HeadSummary& s) { return s.t; })
       << ", \"pending\": " << field([](const HeadSummary& s) { return s.pending; }) << "}\n";
  write_text_file(prefix + ".json", json.str());
}

// ---- state files -------------------------------------------------------------------------------

// Replaces the layer's states with those saved in `path`; the layer is unchanged on failure.
template <class Mixer>
void load_layer_state(ovq::MultiHead<Mixer>& layer, const std::string& path) {
  try {
    ovq::io::load_state(path, layer);
  } catch (const ovq::FormatError& e) {
    throw ovq::FormatError("--load-state '" + path + "': " + e.what());
  }
}

// VQ: the codebooks come from the state file; they must be the ones given with --codebook.
template <class Scalar>
void check_loaded_codebooks(const ovq::MultiHead<ovq::VqAttention<Scalar>>& loaded,
                            const std::vector<typename ovq::VqAttention<Scalar>::State>& given,
                            const Config& cfg) {
  for (Index h = 0; h < loaded.kv_heads(); ++h) {
    const auto& a = loaded.state(0, h);
    const auto& b = given[static_cast<std::size_t>(h)];
    const bool same = a.codebook_size() == b.codebook_size() && a.key_dim() == b.key_dim() &&
                      ovq::as_eigen(a.codebook()) == ovq::as_eigen(b.codebook());
    if (!same) {
      throw InputError("--load-state '" + *cfg.load_state + "': key/value head " +
                       std::to_string(h) + " was saved with another codebook than --codebook '" +
                       cfg.codebook_path + "'");
    }
  }
}

// ---- one run, for one scalar type -------------------------------------------------------------

template <class Scalar, class Mixer>
void finish(ovq::MultiHead<Mixer>& layer, const Config& cfg, const Dims& d, const Array3& qa,
            const std::vector<Scalar>& q, const std::vector<Scalar>& k,
            const std::vector<Scalar>& v) {
  const ConstMap<Scalar> qm(q.data(), d.hq * d.tokens, d.dk);
  const ConstMap<Scalar> km(k.data(), d.hkv * d.tokens, d.dk);
  const ConstMap<Scalar> vm(v.data(), d.hkv * d.tokens, d.dv);
  const RowMatrix<Scalar> o = drive(layer, cfg, d, qm, km, vm);

  if (cfg.save_state) ovq::io::save_state(*cfg.save_state, layer);
  if constexpr (std::is_same_v<Mixer, ovq::VqAttention<Scalar>> ||
                std::is_same_v<Mixer, ovq::OvqAttention<Scalar>>) {
    if (cfg.state_out) write_state(layer, *cfg.state_out, cfg.mixer);
  }
  std::vector<std::int64_t> shape = qa.npy.shape;
  shape.back() = d.dv;
  write_array(cfg.out_path, o.data(), shape);
}

template <class Scalar>
void run(const Config& cfg, const Array3& qa, const Array3& ka, const Array3& va, const Dims& d) {
  const std::vector<Scalar> q = qa.npy.to_vector<Scalar>();
  const std::vector<Scalar> k = ka.npy.to_vector<Scalar>();
  const std::vector<Scalar> v = va.npy.to_vector<Scalar>();
  switch (cfg.mixer) {
    case MixerKind::self: {
      ovq::MultiHead<ovq::SelfAttention<Scalar>> layer(ovq::SelfAttention<Scalar>(cfg.self), 1,
                                                       d.hq, d.hkv, d.dk, d.dv);
      if (!cfg.head_betas.empty()) layer.set_head_betas(cfg.head_betas);
      if (cfg.load_state) load_layer_state(layer, *cfg.load_state);
      finish(layer, cfg, d, qa, q, k, v);
      break;
    }
    case MixerKind::linear: {
      // No chunk is ever longer than the longest call, so capping the chunk length there changes
      // nothing in the result. It keeps LinearAttention from sizing per-call scratch by an
      // arbitrarily large --chunk: that allocation happens inside the layer's OpenMP region, where
      // a std::bad_alloc cannot be caught and would abort the process.
      // With a state file the chunk length is part of the state's options and must be the same
      // in every run of a stream, whatever its call lengths, so it is kept as given (the library
      // sizes its scratch by the call, not by the option).
      ovq::LinearAttentionOptions options = cfg.linear;
      if (!cfg.load_state && !cfg.save_state) {
        Index longest = d.tokens;
        if (cfg.stream) longest = 1;
        if (cfg.split) longest = *std::max_element(cfg.split->begin(), cfg.split->end());
        options.chunk = std::min(options.chunk, std::max<Index>(longest, 1));
      }
      ovq::MultiHead<ovq::LinearAttention<Scalar>> layer(ovq::LinearAttention<Scalar>(options), 1,
                                                         d.hq, d.hkv, d.dk, d.dv);
      if (cfg.load_state) load_layer_state(layer, *cfg.load_state);
      finish(layer, cfg, d, qa, q, k, v);
      break;
    }
    case MixerKind::vq: {
      const Array3 cb = load("codebook", cfg.codebook_path, "(S, dk) or (Hkv, S, dk)");
      if (cb.npy.dtype != qa.npy.dtype && !cfg.storage) {
        throw InputError(cb.label + " is " + dtype_name(cb.npy.dtype) + ", expected " +
                         dtype_name(qa.npy.dtype) + " like Q, K and V");
      }
      if (cb.npy.shape.size() == 3 && cb.heads != d.hkv) {
        throw InputError(cb.label + " has " + std::to_string(cb.heads) +
                         " codebooks, expected one per key/value head (" +
                         std::to_string(d.hkv) + ") or a single (S, dk) codebook");
      }
      if (cb.cols != d.dk) {
        throw InputError(cb.label + " has " + std::to_string(cb.cols) +
                         " columns, expected dk = " + std::to_string(d.dk));
      }
      if (cb.rows < 1) throw InputError(cb.label + " has no codes, expected S >= 1");
      const std::vector<Scalar> c = cb.npy.to_vector<Scalar>();
      const ovq::VqAttention<Scalar> mixer(cfg.vq);
      std::vector<typename ovq::VqAttention<Scalar>::State> states;
      for (Index h = 0; h < d.hkv; ++h) {
        const Index which = cb.npy.shape.size() == 3 ? h : 0;
        const ConstMap<Scalar> book(c.data() + which * cb.rows * cb.cols, cb.rows, cb.cols);
        states.push_back(mixer.make_state(book, d.dv));
      }
      ovq::MultiHead<ovq::VqAttention<Scalar>> layer(mixer, 1, d.hq, states);
      if (!cfg.head_betas.empty()) layer.set_head_betas(cfg.head_betas);
      if (cfg.load_state) {
        load_layer_state(layer, *cfg.load_state);
        check_loaded_codebooks(layer, states, cfg);
      }
      finish(layer, cfg, d, qa, q, k, v);
      break;
    }
    case MixerKind::ovq: {
      ovq::MultiHead<ovq::OvqAttention<Scalar>> layer(ovq::OvqAttention<Scalar>(cfg.ovq), 1,
                                                      d.hq, d.hkv, d.dk, d.dv);
      if (!cfg.head_betas.empty()) layer.set_head_betas(cfg.head_betas);
      if (cfg.load_state) load_layer_state(layer, *cfg.load_state);
      finish(layer, cfg, d, qa, q, k, v);
      break;
    }
  }
}

int attend(int argc, char** argv) {
  const std::optional<Config> parsed = parse_command_line(argc, argv);
  if (!parsed) {
    std::cout << kHelp;
    std::cout.flush();
    return std::cout ? 0 : kExitRuntime;
  }
  const Config& cfg = *parsed;
  const Array3 q = load("Q", cfg.q_path, "(T, dk) or (Hq, T, dk)");
  const Array3 k = load("K", cfg.k_path, "(T, dk) or (Hkv, T, dk)");
  const Array3 v = load("V", cfg.v_path, "(T, dv) or (Hkv, T, dv)");
  const Dims d = check_inputs(q, k, v);
  std::string element = cfg.storage.value_or(q.npy.dtype == ovq::io::DType::f32   ? "f32"
                                             : q.npy.dtype == ovq::io::DType::f64 ? "f64"
                                                                                  : "f16");
  if (element == "f32") {
    run<float>(cfg, q, k, v, d);
  } else if (element == "f64") {
    run<double>(cfg, q, k, v, d);
  } else if (element == "f16") {
    run<ovq::fp16>(cfg, q, k, v, d);
  } else {
    run<ovq::bf16>(cfg, q, k, v, d);
  }
  return 0;
}

// One line on stderr, whatever the message holds.
void report(const std::string& message) {
  std::string line = "attend: " + message;
  for (char& c : line)
    if (c == '\n' || c == '\r') c = ' ';
  std::fprintf(stderr, "%s\n", line.c_str());
  std::fflush(stderr);
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return attend(argc, argv);
  } catch (const UsageError& e) {
    report(std::string(e.what()) + " (see attend --help)");
    return kExitUsage;
  } catch (const ovq::Error& e) {
    // The library's own message: it names the argument at fault and what it expected.
    report(e.what());
    return kExitRuntime;
  } catch (const std::bad_alloc&) {
    report("out of memory");
    return kExitRuntime;
  } catch (const std::exception& e) {
    report(e.what());
    return kExitRuntime;
  } catch (...) {
    report("unknown error");
    return kExitRuntime;
  }
}
