// State files (include/ovq/io/state_file.hpp): round trips, streams cut and resumed, and the
// rejection of every kind of bad file.
//
// What is checked:
//   - round trip: decode(encode(state)) == state and re-encodes to the same bytes, for every mixer
//     (self, windowed self, linear, VQ, two OVQ configurations) in float and double, for an empty
//     state, one token, a chunk minus one (OVQ: pending rows), one chunk, a few chunks and a long
//     stream (OVQ: full dictionary); the loaded state then continues exactly like the original.
//     The same for a multi-head layer (batch 2, Hq 4, Hkv 2), through memory and through files.
//   - cut, save, load, continue: a stream cut at 1, L - 1, L, L + 1, mid-chunk and random
//     positions, saved, loaded by a new mixer and continued gives bitwise the outputs and the final
//     state of the same cut without saving, and of the uncut stream (linear and VQ attention:
//     bitwise; self-attention and OVQ: to rounding for now).
//   - version 1 files (before linear and VQ states kept pending rows) still load, as states with
//     nothing pending.
//   - rejection, each with ovq::FormatError naming the failing check: every truncation, every
//     single-byte corruption, bad magic, another format version, byte order, mixer kind,
//     container, scalar type, every option, multi-head shapes, size fields far beyond the file
//     (no allocation from them), counts that do not sum to t, pending >= chunk, another chunk,
//     pending codes outside the codebook, negative counts, NaN payloads, trailing bytes; a failed
//     multi-head load leaves the layer unchanged.
//   - files: ovq::IoError for a missing file or an unwritable target, and saving is atomic: a
//     failed save leaves the previous file intact and no temporary file behind.
//
// Header fields are patched in place; where the checksum would hide the check under test, the
// CRC-32 is recomputed here (IEEE 802.3, reflected polynomial 0xEDB88320, written independently
// of the library's table version).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <initializer_list>
#include <iterator>
#include <limits>
#include <new>
#include <random>
#include <sstream>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "ovq/io/state_file.hpp"
#include "support/catch.hpp"
#include "support/fixtures.hpp"
#include "support/matchers.hpp"

#if defined(__unix__) || defined(__APPLE__)
#include <sys/resource.h>
#include <unistd.h>

#include <csignal>
#define OVQ_TEST_POSIX 1
#endif

// Everything below lives in this file's own namespace, so the suite can be built as one
// unity source without the files' helpers colliding.
namespace ovq_test_state_file {

namespace {

namespace fs = std::filesystem;
using ovq::Index;
using Bytes = std::vector<unsigned char>;
template <class S>
using Mat = ovq::RowMatrix<S>;

using ovq::test::MessageHas;

#define CHECK_FORMAT_ERROR(expr, ...) \
  CHECK_THROWS_MATCHES(expr, ovq::FormatError, MessageHas({__VA_ARGS__}))
#define CHECK_IO_ERROR(expr, ...) \
  CHECK_THROWS_MATCHES(expr, ovq::IoError, MessageHas({__VA_ARGS__}))

// ---------------------------------------------------------------------------------------------
// Bytes: little-endian fields and the CRC-32.
// ---------------------------------------------------------------------------------------------

std::uint32_t crc32(const unsigned char* data, std::size_t n) {
  std::uint32_t c = 0xFFFFFFFFu;
  for (std::size_t i = 0; i < n; ++i) {
    c ^= data[i];
    for (int b = 0; b < 8; ++b) c = (c >> 1) ^ (0xEDB88320u & (0u - (c & 1u)));
  }
  return ~c;
}

template <class T>
void poke(Bytes& b, std::size_t offset, T value) {
  static_assert(std::is_arithmetic_v<T>, "plain values only");
  std::uint64_t bits = 0;
  if constexpr (std::is_floating_point_v<T>) {
    using U = std::conditional_t<sizeof(T) == 4, std::uint32_t, std::uint64_t>;
    U u;
    std::memcpy(&u, &value, sizeof(T));
    bits = u;
  } else {
    bits = static_cast<std::uint64_t>(value);
  }
  REQUIRE(offset + sizeof(T) <= b.size());
  for (std::size_t i = 0; i < sizeof(T); ++i)
    b[offset + i] = static_cast<unsigned char>(bits >> (8 * i));
}

template <class T>
T peek(const Bytes& b, std::size_t offset) {
  REQUIRE(offset + sizeof(T) <= b.size());
  std::uint64_t bits = 0;
  for (std::size_t i = 0; i < sizeof(T); ++i) bits |= std::uint64_t(b[offset + i]) << (8 * i);
  if constexpr (std::is_floating_point_v<T>) {
    using U = std::conditional_t<sizeof(T) == 4, std::uint32_t, std::uint64_t>;
    const U u = static_cast<U>(bits);
    T value;
    std::memcpy(&value, &u, sizeof(T));
    return value;
  } else {
    return static_cast<T>(bits);
  }
}

// Recomputes the trailing CRC-32 after a patch, so that the check under test is the one hit.
void fix_crc(Bytes& b) {
  REQUIRE(b.size() >= 4);
  poke<std::uint32_t>(b, b.size() - 4, crc32(b.data(), b.size() - 4));
}

// The documented layout (see the table at the top of state_file.hpp).
constexpr std::size_t kHeader = 36;
constexpr std::size_t kVersionAt = 8;
constexpr std::size_t kByteOrderAt = 12;
constexpr std::size_t kKindAt = 16;
constexpr std::size_t kContainerAt = 20;
constexpr std::size_t kScalarAt = 24;
constexpr std::size_t kPayloadSizeAt = 28;

// Bytes of each options block: reals f64, integers 64-bit, enums and bools u32.
constexpr std::size_t options_bytes(const ovq::SelfAttentionOptions&) { return 8 + 4 + 8 + 8; }
constexpr std::size_t options_bytes(const ovq::LinearAttentionOptions&) {
  return 8 + 4 + 4 + 8 + 8 + 8;
}
constexpr std::size_t options_bytes(const ovq::VqAttentionOptions&) { return 8 + 8; }
constexpr std::size_t options_bytes(const ovq::OvqOptions&) {
  return 8 + 8 + 8 + 4 + 8 + 8 + 4 + 8 + 4 + 8 + 4 + 4 + 4 + 4;
}
// The OVQ options added by format version 3 (renormalize values, count bias, value update).
constexpr std::size_t kOvqOptionsSince3 = 4 + 4 + 4;

// Offsets of the fields of an OVQ payload (one state) in an encoded file.
struct OvqLayout {
  std::size_t options, capacity, chunk, dk, dv, n, t, pending, keys, values, counts, pkeys, pvalues;
};

template <class S>
OvqLayout ovq_layout(const ovq::OvqOptions& o, Index dk, Index dv, Index n, Index pending) {
  OvqLayout l{};
  l.options = kHeader;
  l.capacity = kHeader + options_bytes(o);
  l.chunk = l.capacity + 8;
  l.dk = l.chunk + 8;
  l.dv = l.dk + 8;
  l.n = l.dv + 8;
  l.t = l.n + 8;
  l.pending = l.t + 8;
  l.keys = l.pending + 8;
  l.values = l.keys + static_cast<std::size_t>(n * dk) * sizeof(S);
  l.counts = l.values + static_cast<std::size_t>(n * dv) * sizeof(S);
  l.pkeys = l.counts + static_cast<std::size_t>(n) * 8;
  l.pvalues = l.pkeys + static_cast<std::size_t>(pending * dk) * sizeof(S);
  return l;
}

// ---------------------------------------------------------------------------------------------
// Mixer configurations.
// ---------------------------------------------------------------------------------------------

template <class S>
struct SelfCase {
  using Scalar = S;
  using Mixer = ovq::SelfAttention<S>;
  using State = typename Mixer::State;
  static constexpr const char* name = "self";
  static constexpr Index chunk = 5;
  static Mixer mixer() {
    ovq::SelfAttentionOptions o;
    o.beta = 0.75;
    o.chunk = chunk;
    return Mixer(o);
  }
  static State state(const Mixer& m, Index dk, Index dv, std::uint64_t = 0) {
    return m.make_state(dk, dv);
  }
};

template <class S>
struct WindowCase {
  using Scalar = S;
  using Mixer = ovq::SelfAttention<S>;
  using State = typename Mixer::State;
  static constexpr const char* name = "self, window 7";
  static constexpr Index chunk = 4;
  static Mixer mixer() {
    ovq::SelfAttentionOptions o;
    o.window = 7;
    o.chunk = chunk;
    return Mixer(o);
  }
  static State state(const Mixer& m, Index dk, Index dv, std::uint64_t = 0) {
    return m.make_state(dk, dv);
  }
};

template <class S>
struct LinearCase {
  using Scalar = S;
  using Mixer = ovq::LinearAttention<S>;
  using State = typename Mixer::State;
  static constexpr const char* name = "linear";
  static constexpr Index chunk = 5;
  static Mixer mixer() {
    ovq::LinearAttentionOptions o;
    o.feature_map = ovq::FeatureMap::elu1;
    o.normalize = true;
    o.decay = 0.9;
    o.chunk = chunk;
    return Mixer(o);
  }
  static State state(const Mixer& m, Index dk, Index dv, std::uint64_t = 0) {
    return m.make_state(dk, dv);
  }
};

template <class S>
struct VqCase {
  using Scalar = S;
  using Mixer = ovq::VqAttention<S>;
  using State = typename Mixer::State;
  static constexpr const char* name = "vq";
  static constexpr Index chunk = 5;
  static Mixer mixer() {
    ovq::VqAttentionOptions o;
    o.beta = 1.5;
    o.chunk = chunk;
    return Mixer(o);
  }
  // A codebook of 6 codes; `seed` picks another codebook (one per key/value head).
  static State state(const Mixer& m, Index dk, Index dv, std::uint64_t seed = 0) {
    return m.make_state(ovq::test::random_unit_rows<S>(6, dk, 700 + seed), dv);
  }
};

template <class S>
struct OvqCase {
  using Scalar = S;
  using Mixer = ovq::OvqAttention<S>;
  using State = typename Mixer::State;
  static constexpr const char* name = "ovq";
  static constexpr Index chunk = 8;
  static ovq::OvqOptions options() {
    ovq::OvqOptions o;
    o.capacity = 6;
    o.chunk = chunk;
    o.beta = 2.0;
    return o;
  }
  static Mixer mixer() { return Mixer(options()); }
  static State state(const Mixer& m, Index dk, Index dv, std::uint64_t = 0) {
    return m.make_state(dk, dv);
  }
};

// Every other OVQ option: linear growth, random seeding, constant rate, renormalised keys.
template <class S>
struct OvqAltCase {
  using Scalar = S;
  using Mixer = ovq::OvqAttention<S>;
  using State = typename Mixer::State;
  static constexpr const char* name = "ovq (linear growth, random seeding, constant rate)";
  static constexpr Index chunk = 4;
  static ovq::OvqOptions options() {
    ovq::OvqOptions o;
    o.capacity = 9;
    o.chunk = chunk;
    o.growth = ovq::Growth::linear(0.5);
    o.seeding = ovq::Seeding::random(1234);
    o.rate = ovq::UpdateRate::constant(0.25);
    o.renormalize = true;
    return o;
  }
  static Mixer mixer() { return Mixer(options()); }
  static State state(const Mixer& m, Index dk, Index dv, std::uint64_t = 0) {
    return m.make_state(dk, dv);
  }
};

// An OVQ file of one state as versions 1 and 2 wrote it: without the options version 3 added.
Bytes ovq_file_before_version3(const Bytes& file, std::uint32_t version) {
  const std::size_t end = kHeader + options_bytes(ovq::OvqOptions{});
  Bytes b(file.begin(), file.begin() + static_cast<std::ptrdiff_t>(end - kOvqOptionsSince3));
  std::copy(file.begin() + static_cast<std::ptrdiff_t>(end), file.end(), std::back_inserter(b));
  poke<std::uint32_t>(b, kVersionAt, version);
  poke<std::uint64_t>(b, kPayloadSizeAt, b.size() - kHeader - 4);
  fix_crc(b);
  return b;
}

// The second reading (docs/math.md): the kvm-delta preset without the count bias.
template <class S>
struct OvqKvmCase {
  using Scalar = S;
  using Mixer = ovq::OvqAttention<S>;
  using State = typename Mixer::State;
  static constexpr const char* name = "ovq (kvm-delta preset, no count bias)";
  static constexpr Index chunk = 4;
  static ovq::OvqOptions options() {
    ovq::OvqOptions o = ovq::OvqOptions::kvm_delta();
    o.capacity = 7;
    o.chunk = chunk;
    o.beta = 1.5;
    o.count_bias = false;
    return o;
  }
  static Mixer mixer() { return Mixer(options()); }
  static State state(const Mixer& m, Index dk, Index dv, std::uint64_t = 0) {
    return m.make_state(dk, dv);
  }
};

#define ALL_CASES                                                                              \
  SelfCase<float>, SelfCase<double>, WindowCase<float>, WindowCase<double>, LinearCase<float>, \
      LinearCase<double>, VqCase<float>, VqCase<double>, OvqCase<float>, OvqCase<double>,      \
      OvqAltCase<float>, OvqAltCase<double>, OvqKvmCase<float>, OvqKvmCase<double>

// Q, K, V of T tokens: unit queries and keys (what VQ and OVQ assume), Gaussian values.
template <class S>
struct Inputs {
  Mat<S> q, k, v;
  Inputs(Index t, Index dk, Index dv, std::uint64_t seed)
      : q(ovq::test::random_unit_rows<S>(t, dk, seed)),
        k(ovq::test::random_unit_rows<S>(t, dk, seed + 1)),
        v(ovq::test::random_matrix<S>(t, dv, seed + 2)) {}
  Index tokens() const { return q.rows(); }
};

// Feeds tokens [first, first + count) and returns their outputs.
template <class Mixer, class S>
Mat<S> feed(const Mixer& mixer, typename Mixer::State& state, const Inputs<S>& in, Index first,
            Index count) {
  return mixer.forward(state, in.q.middleRows(first, count), in.k.middleRows(first, count),
                       in.v.middleRows(first, count));
}

// Bitwise equality of two matrices (Eigen's == compares the entries exactly).
template <class S>
bool same_bits(const Mat<S>& a, const Mat<S>& b) {
  return a.rows() == b.rows() && a.cols() == b.cols() &&
         std::memcmp(a.data(), b.data(), static_cast<std::size_t>(a.size()) * sizeof(S)) == 0;
}

template <class S>
double max_abs_diff(const Mat<S>& a, const Mat<S>& b) {
  if (a.rows() != b.rows() || a.cols() != b.cols()) return std::numeric_limits<double>::infinity();
  if (a.size() == 0) return 0.0;
  return (a.template cast<double>() - b.template cast<double>()).cwiseAbs().maxCoeff();
}

template <class Case>
ovq::MultiHead<typename Case::Mixer> make_layer(Index batch, Index hq, Index hkv, Index dk,
                                                Index dv) {
  const typename Case::Mixer mixer = Case::mixer();
  std::vector<typename Case::State> states;
  for (Index h = 0; h < hkv; ++h)
    states.push_back(Case::state(mixer, dk, dv, static_cast<std::uint64_t>(h)));
  return ovq::MultiHead<typename Case::Mixer>(mixer, batch, hq, std::move(states));
}

inline ovq::OvqOptions OvqOptions_kvm_small() {
  ovq::OvqOptions o = ovq::OvqOptions::kvm();
  o.capacity = 6;
  o.chunk = 4;
  return o;
}

template <class Mixer>
bool same_states(const ovq::MultiHead<Mixer>& a, const ovq::MultiHead<Mixer>& b) {
  if (a.states().size() != b.states().size()) return false;
  for (std::size_t i = 0; i < a.states().size(); ++i)
    if (!(a.states()[i] == b.states()[i])) return false;
  return true;
}

// A fresh, empty directory below the system's temporary directory, removed with its contents.
class TempDir {
 public:
  TempDir() {
    static int counter = 0;
#if defined(OVQ_TEST_POSIX)
    const long pid = static_cast<long>(::getpid());
#else
    const long pid = 0;
#endif
    for (;;) {
      path_ = fs::temp_directory_path() /
              ("ovq_state_file_test." + std::to_string(pid) + "." + std::to_string(counter++));
      if (fs::create_directory(path_)) break;
    }
  }
  ~TempDir() {
    std::error_code ec;
    fs::permissions(path_, fs::perms::owner_all, fs::perm_options::add, ec);
    fs::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  std::string file(const std::string& name) const { return (path_ / name).string(); }
  const fs::path& path() const { return path_; }

  // Names of every entry in the directory.
  std::vector<std::string> entries() const {
    std::vector<std::string> out;
    for (const auto& e : fs::directory_iterator(path_)) out.push_back(e.path().filename().string());
    std::sort(out.begin(), out.end());
    return out;
  }

 private:
  fs::path path_;
};

Bytes file_bytes(const std::string& path) { return ovq::io::read_file(path, "test"); }

// ---------------------------------------------------------------------------------------------
// Round trips.
// ---------------------------------------------------------------------------------------------

TEMPLATE_TEST_CASE(
    "state file: bitwise round trip of every mixer's state, then identical "
    "continuation",
    "[io][state]", ALL_CASES) {
  using S = typename TestType::Scalar;
  const Index dk = 4, dv = 3, L = TestType::chunk;
  const auto mixer = TestType::mixer();
  const Inputs<S> in(14 * L + 7, dk, dv, 11);

  for (const Index tokens : {Index(0), Index(1), L - 1, L, 2 * L + 2, 14 * L}) {
    CAPTURE(TestType::name, tokens);
    auto state = TestType::state(mixer, dk, dv);
    if (tokens > 0) feed(mixer, state, in, 0, tokens);

    if constexpr (std::is_same_v<typename TestType::State, ovq::OvqState<S>>) {
      // The scenarios are what they claim: pending rows mid-chunk, a full dictionary at the end.
      CHECK(state.pending() == tokens % L);
      // (saturating growth never reaches N)
      if (tokens == 14 * L && mixer.options().growth.kind != ovq::Growth::Kind::saturating)
        CHECK(state.dictionary().full());
    }
    if constexpr (std::is_same_v<typename TestType::State, ovq::LinearState<S>> ||
                  std::is_same_v<typename TestType::State, ovq::VqState<S>>) {
      CHECK(state.pending() == tokens % L);  // pending rows mid-chunk
    }

    const Bytes bytes = ovq::io::encode_state(mixer, state);
    auto loaded = ovq::io::decode_state(mixer, bytes.data(), bytes.size());
    CHECK(loaded == state);
    CHECK(ovq::io::encode_state(mixer, loaded) == bytes);

    // The loaded state behaves like the original, to the last bit.
    const Mat<S> o_original = feed(mixer, state, in, tokens, 7);
    const Mat<S> o_loaded = feed(mixer, loaded, in, tokens, 7);
    CHECK(same_bits(o_original, o_loaded));
    CHECK(loaded == state);
    CHECK(ovq::io::encode_state(mixer, loaded) == ovq::io::encode_state(mixer, state));
  }
}

TEMPLATE_TEST_CASE("state file: save_state / load_state round trip through a file", "[io][state]",
                   ALL_CASES) {
  using S = typename TestType::Scalar;
  const Index dk = 3, dv = 2, L = TestType::chunk;
  const auto mixer = TestType::mixer();
  const Inputs<S> in(3 * L + 2, dk, dv, 21);
  auto state = TestType::state(mixer, dk, dv);
  feed(mixer, state, in, 0, in.tokens());

  TempDir dir;
  const std::string path = dir.file("state.ovqs");
  ovq::io::save_state(path, mixer, state);
  CHECK(file_bytes(path) == ovq::io::encode_state(mixer, state));
  const auto loaded = ovq::io::load_state(path, TestType::mixer());
  CHECK(loaded == state);
  // Saving again over the file replaces it; only the file itself is left in the directory.
  ovq::io::save_state(path, mixer, loaded);
  CHECK(file_bytes(path) == ovq::io::encode_state(mixer, state));
  CHECK(dir.entries() == std::vector<std::string>{"state.ovqs"});
}

TEMPLATE_TEST_CASE("state file: multi-head layer round trip (batch 2, Hq 4, Hkv 2)",
                   "[io][state][multihead]", ALL_CASES) {
  using S = typename TestType::Scalar;
  const Index batch = 2, hq = 4, hkv = 2, dk = 4, dv = 3, L = TestType::chunk;
  const Index t1 = 2 * L + 1, t2 = L + 3;
  auto layer = make_layer<TestType>(batch, hq, hkv, dk, dv);
  const Mat<S> q = ovq::test::random_unit_rows<S>(batch * hq * (t1 + t2), dk, 31);
  const Mat<S> k = ovq::test::random_unit_rows<S>(batch * hkv * (t1 + t2), dk, 32);
  const Mat<S> v = ovq::test::random_matrix<S>(batch * hkv * (t1 + t2), dv, 33);
  // (B H T) x d blocks of T tokens per head, for the two parts of the stream.
  auto part = [&](const Mat<S>& m, Index heads, Index first, Index count) {
    Mat<S> out(batch * heads * count, m.cols());
    const Index total = t1 + t2;
    for (Index h = 0; h < batch * heads; ++h)
      out.middleRows(h * count, count) = m.middleRows(h * total + first, count);
    return out;
  };
  layer.forward(part(q, hq, 0, t1), part(k, hkv, 0, t1), part(v, hkv, 0, t1));

  const Bytes bytes = ovq::io::encode_state(layer);
  auto loaded = make_layer<TestType>(batch, hq, hkv, dk, dv);
  ovq::io::decode_state(loaded, bytes.data(), bytes.size());
  CHECK(same_states(loaded, layer));
  CHECK(ovq::io::encode_state(loaded) == bytes);

  TempDir dir;
  ovq::io::save_state(dir.file("layer.ovqs"), layer);
  auto from_file = make_layer<TestType>(batch, hq, hkv, dk, dv);
  ovq::io::load_state(dir.file("layer.ovqs"), from_file);
  CHECK(same_states(from_file, layer));

  const Mat<S> o_original =
      layer.forward(part(q, hq, t1, t2), part(k, hkv, t1, t2), part(v, hkv, t1, t2));
  const Mat<S> o_loaded =
      loaded.forward(part(q, hq, t1, t2), part(k, hkv, t1, t2), part(v, hkv, t1, t2));
  CHECK(same_bits(o_original, o_loaded));
  CHECK(same_states(loaded, layer));
}

// ---------------------------------------------------------------------------------------------
// A stream cut anywhere, saved, loaded and continued.
// ---------------------------------------------------------------------------------------------

// 1, L - 1, L, L + 1, mid-chunk, the last token, and random positions.
std::vector<Index> cut_points(Index tokens, Index chunk) {
  std::vector<Index> cuts = {
      1, chunk - 1, chunk, chunk + 1, chunk + chunk / 2, 2 * chunk + 1, tokens - 1};
  std::mt19937_64 gen(4242);
  std::uniform_int_distribution<Index> pick(1, tokens - 1);
  for (int i = 0; i < 4; ++i) cuts.push_back(pick(gen));
  std::sort(cuts.begin(), cuts.end());
  cuts.erase(std::unique(cuts.begin(), cuts.end()), cuts.end());
  cuts.erase(
      std::remove_if(cuts.begin(), cuts.end(), [&](Index c) { return c < 1 || c >= tokens; }),
      cuts.end());
  return cuts;
}

// One stream cut at `cut`: the first part through one state, saved; the rest through the state
// loaded by a new mixer (what a new process would do).
template <class Case, class S = typename Case::Scalar>
std::pair<Mat<S>, Bytes> resumed_run(const Inputs<S>& in, Index dk, Index dv, Index cut,
                                     bool through_file) {
  Mat<S> o(in.tokens(), dv);
  Bytes saved;
  {
    const auto mixer = Case::mixer();
    auto state = Case::state(mixer, dk, dv);
    o.topRows(cut) = feed(mixer, state, in, 0, cut);
    saved = ovq::io::encode_state(mixer, state);
  }
  const auto mixer = Case::mixer();
  auto state = [&] {
    if (!through_file) return ovq::io::decode_state(mixer, saved.data(), saved.size());
    TempDir dir;
    ovq::io::write_file_atomic(dir.file("cut.ovqs"), saved, "test");
    return ovq::io::load_state(dir.file("cut.ovqs"), mixer);
  }();
  o.bottomRows(in.tokens() - cut) = feed(mixer, state, in, cut, in.tokens() - cut);
  return {o, ovq::io::encode_state(mixer, state)};
}

TEMPLATE_TEST_CASE("state file: cut, save, load and continue == the same cut without saving",
                   "[io][state][resume]", ALL_CASES) {
  using S = typename TestType::Scalar;
  const Index dk = 8, dv = 5, L = TestType::chunk;
  const Inputs<S> in(5 * L + 3, dk, dv, 41);
  const auto mixer = TestType::mixer();
  for (const Index cut : cut_points(in.tokens(), L)) {
    CAPTURE(TestType::name, cut);
    auto state = TestType::state(mixer, dk, dv);
    Mat<S> o(in.tokens(), dv);
    o.topRows(cut) = feed(mixer, state, in, 0, cut);
    o.bottomRows(in.tokens() - cut) = feed(mixer, state, in, cut, in.tokens() - cut);
    const auto [o_resumed, final_state] = resumed_run<TestType>(in, dk, dv, cut, cut == L + 1);
    CHECK(same_bits(o_resumed, o));
    CHECK(final_state == ovq::io::encode_state(mixer, state));
  }
}

// Cutting the stream anywhere, saving, loading and continuing gives the uncut stream's outputs
// and final state bit for bit, for every mixer: chunks sit at fixed stream positions, keys are
// tiled on absolute positions and every output is computed in an order that does not depend on
// the calls (docs/math.md, "Same bits however the stream is cut"). (That save and load
// themselves change nothing is the exact test above.)
TEMPLATE_TEST_CASE("state file: cut anywhere, save, load and continue == the uncut stream",
                   "[io][state][resume][cut]", ALL_CASES) {
  using S = typename TestType::Scalar;
  const Index dk = 8, dv = 5, L = TestType::chunk;
  const Inputs<S> in(5 * L + 3, dk, dv, 41);
  const auto mixer = TestType::mixer();
  auto uncut_state = TestType::state(mixer, dk, dv);
  const Mat<S> uncut = feed(mixer, uncut_state, in, 0, in.tokens());
  const Bytes uncut_bytes = ovq::io::encode_state(mixer, uncut_state);
  for (const Index cut : cut_points(in.tokens(), L)) {
    const auto [o, final_bytes] = resumed_run<TestType>(in, dk, dv, cut, false);
    CAPTURE(TestType::name, cut, max_abs_diff(o, uncut));
    CHECK(same_bits(o, uncut));
    CHECK(final_bytes == uncut_bytes);
  }
}

// ---------------------------------------------------------------------------------------------
// Rejection of bad files.
// ---------------------------------------------------------------------------------------------

// A small OVQ file: a state with at least two centroids, their counts and two pending rows.
template <class S>
struct SmallOvq {
  static constexpr Index dk = 2, dv = 2;
  ovq::OvqAttention<S> mixer{OvqCase<S>::options()};
  ovq::OvqState<S> state = mixer.make_state(dk, dv);
  Bytes bytes;
  OvqLayout at{};
  SmallOvq() {
    const Inputs<S> in(2 * OvqCase<S>::chunk + 2, dk, dv, 51);
    feed(mixer, state, in, 0, in.tokens());
    bytes = ovq::io::encode_state(mixer, state);
    at = ovq_layout<S>(mixer.options(), dk, dv, state.dictionary().size(), state.pending());
    // The layout is what the format documents.
    REQUIRE(state.dictionary().size() >= 2);
    REQUIRE(state.pending() == 2);
    REQUIRE(peek<std::int64_t>(bytes, at.n) == state.dictionary().size());
    REQUIRE(peek<std::int64_t>(bytes, at.t) == state.absorbed());
    REQUIRE(peek<std::int64_t>(bytes, at.pending) == state.pending());
    REQUIRE(peek<std::int64_t>(bytes, at.counts) == state.dictionary().count(0));
    REQUIRE(peek<S>(bytes, at.keys) == ovq::as_eigen(state.dictionary().keys())(0, 0));
    REQUIRE(at.pvalues + static_cast<std::size_t>(state.pending() * dv) * sizeof(S) + 4 ==
            bytes.size());
  }
  ovq::OvqState<S> decode(const Bytes& b) const {
    return ovq::io::decode_state(mixer, b.data(), b.size());
  }
  ovq::OvqState<S> decode(const Bytes& b, std::size_t size) const {
    return ovq::io::decode_state(mixer, b.data(), size);
  }
};

TEST_CASE("state file: the CRC-32 here is the standard one and matches the file's", "[io][state]") {
  const char* check = "123456789";
  CHECK(crc32(reinterpret_cast<const unsigned char*>(check), 9) == 0xCBF43926u);
  const SmallOvq<float> f;
  CHECK(peek<std::uint32_t>(f.bytes, f.bytes.size() - 4) ==
        crc32(f.bytes.data(), f.bytes.size() - 4));
  CHECK(peek<std::uint32_t>(f.bytes, kVersionAt) == ovq::io::kStateFormatVersion);
  CHECK(peek<std::uint64_t>(f.bytes, kPayloadSizeAt) == f.bytes.size() - kHeader - 4);
}

TEMPLATE_TEST_CASE("state file: every truncation is rejected as truncated", "[io][state]", float,
                   double) {
  const SmallOvq<TestType> f;
  for (std::size_t size = 0; size < f.bytes.size(); ++size) {
    CAPTURE(size);
    CHECK_FORMAT_ERROR(f.decode(f.bytes, size), "truncated");
  }
  // And a multi-head file.
  auto layer = make_layer<VqCase<TestType>>(1, 2, 1, 2, 2);
  const Bytes mh = ovq::io::encode_state(layer);
  for (std::size_t size = 0; size < mh.size(); ++size) {
    CAPTURE(size);
    CHECK_FORMAT_ERROR(ovq::io::decode_state(layer, mh.data(), size), "truncated");
  }
  // One byte too many is "extended": the payload size no longer matches.
  Bytes longer = f.bytes;
  longer.push_back(0);
  CHECK_FORMAT_ERROR(f.decode(longer), "payload size");
}

// Which check a corruption of byte `i` must hit: header fields are checked one by one, then the
// checksum covers everything.
const char* check_for_byte(std::size_t i) {
  if (i < 8) return "magic";
  if (i < 12) return "format version";
  if (i < 16) return "byte order";
  if (i < 20) return "mixer kind";
  if (i < 24) return "container";
  if (i < 28) return "scalar type";
  if (i < 36) return "payload size";
  return "checksum";
}

TEMPLATE_TEST_CASE("state file: every single-byte corruption is detected", "[io][state]", float,
                   double) {
  const SmallOvq<TestType> f;
  for (std::size_t i = 0; i < f.bytes.size(); ++i) {
    for (const unsigned char flip : {0x01, 0x80, 0xFF}) {
      Bytes b = f.bytes;
      b[i] ^= flip;
      CAPTURE(i, int(flip));
      // Version 3 with its low bit flipped is version 2, which is read: the checksum fails.
      const bool older_version = i == kVersionAt && flip == 0x01;
      CHECK_FORMAT_ERROR(f.decode(b), older_version ? "checksum" : check_for_byte(i));
    }
  }
}

TEST_CASE("state file: bad magic, version, byte order, kind, container and scalar type",
          "[io][state]") {
  const SmallOvq<float> f;

  Bytes b = f.bytes;
  std::memcpy(b.data(), "OVQSTATF", 8);
  CHECK_FORMAT_ERROR(f.decode(b), "bad magic");
  std::memcpy(b.data(), "\x93NUMPY\x01\x00", 8);
  CHECK_FORMAT_ERROR(f.decode(b), "bad magic");

  // Another version, with a valid checksum, so that the version check itself is what fails.
  for (const std::uint32_t version : {0u, 4u, 0xFFFFFFFFu}) {
    b = f.bytes;
    poke<std::uint32_t>(b, kVersionAt, version);
    fix_crc(b);
    CHECK_FORMAT_ERROR(f.decode(b), "format version " + std::to_string(version), "expected 1 to 3");
  }

  b = f.bytes;
  poke<std::uint32_t>(b, kByteOrderAt, 0x04030201u);  // the tag of a big-endian writer
  fix_crc(b);
  CHECK_FORMAT_ERROR(f.decode(b), "byte order");

  // Mixer kind: an OVQ file read by each other mixer, and by OVQ after patching the kind.
  CHECK_FORMAT_ERROR(
      ovq::io::decode_state(SelfCase<float>::mixer(), f.bytes.data(), f.bytes.size()),
      "mixer kind 4, expected 1");
  CHECK_FORMAT_ERROR(
      ovq::io::decode_state(LinearCase<float>::mixer(), f.bytes.data(), f.bytes.size()),
      "mixer kind 4, expected 2");
  CHECK_FORMAT_ERROR(ovq::io::decode_state(VqCase<float>::mixer(), f.bytes.data(), f.bytes.size()),
                     "mixer kind 4, expected 3");
  b = f.bytes;
  poke<std::uint32_t>(b, kKindAt, 9);
  fix_crc(b);
  CHECK_FORMAT_ERROR(f.decode(b), "mixer kind 9, expected 4");

  // Container: a single state is not a layer, and a layer is not a single state.
  auto layer = make_layer<OvqCase<float>>(1, 1, 1, 2, 2);
  CHECK_FORMAT_ERROR(ovq::io::decode_state(layer, f.bytes.data(), f.bytes.size()),
                     "container 0, expected 1");
  const Bytes mh = ovq::io::encode_state(layer);
  CHECK_FORMAT_ERROR(f.decode(mh), "container 1, expected 0");
  b = f.bytes;
  poke<std::uint32_t>(b, kContainerAt, 7);
  fix_crc(b);
  CHECK_FORMAT_ERROR(f.decode(b), "container 7");

  // Scalar type: float saved, double loaded and the other way round, and a patched size.
  const SmallOvq<double> d;
  CHECK_FORMAT_ERROR(ovq::io::decode_state(d.mixer, f.bytes.data(), f.bytes.size()),
                     "scalar type of 4 bytes, expected 8");
  CHECK_FORMAT_ERROR(ovq::io::decode_state(f.mixer, d.bytes.data(), d.bytes.size()),
                     "scalar type of 8 bytes, expected 4");
  b = f.bytes;
  poke<std::uint32_t>(b, kScalarAt, 2);
  fix_crc(b);
  CHECK_FORMAT_ERROR(f.decode(b), "scalar type of 2 bytes");
  auto layer_d = make_layer<OvqCase<double>>(1, 1, 1, 2, 2);
  CHECK_FORMAT_ERROR(ovq::io::decode_state(layer_d, mh.data(), mh.size()),
                     "scalar type of 4 bytes, expected 8");

  // A payload size that disagrees with the file, checksum fixed.
  b = f.bytes;
  poke<std::uint64_t>(b, kPayloadSizeAt, peek<std::uint64_t>(b, kPayloadSizeAt) - 1);
  fix_crc(b);
  CHECK_FORMAT_ERROR(f.decode(b), "payload size");
  b = f.bytes;
  poke<std::uint64_t>(b, kPayloadSizeAt, std::numeric_limits<std::uint64_t>::max());
  fix_crc(b);
  CHECK_FORMAT_ERROR(f.decode(b), "payload size");
}

// Saves `state` with `saver` and loads it with `loader`: must fail naming the option.
template <class Mixer>
void check_option_mismatch(const Mixer& saver, const Mixer& loader,
                           const typename Mixer::State& state, const std::string& option) {
  const Bytes b = ovq::io::encode_state(saver, state);
  CAPTURE(option);
  CHECK_FORMAT_ERROR(ovq::io::decode_state(loader, b.data(), b.size()), "option '" + option + "'",
                     "(the loading mixer's)");
}

TEST_CASE("state file: every option is checked against the loading mixer's", "[io][state]") {
  using S = double;
  const Index dk = 2, dv = 2;
  const Inputs<S> in(7, dk, dv, 61);

  {
    const ovq::SelfAttentionOptions base = SelfCase<S>::mixer().options();
    const ovq::SelfAttention<S> saver(base);
    auto state = saver.make_state(dk, dv);
    feed(saver, state, in, 0, 7);
    auto o = base;
    o.beta = 0.5;
    check_option_mismatch(saver, ovq::SelfAttention<S>(o), state, "beta");
    o = base;
    o.beta = std::nextafter(base.beta, 1.0);  // one ulp: reals are compared bitwise
    check_option_mismatch(saver, ovq::SelfAttention<S>(o), state, "beta");
    o = base;
    o.causal = false;
    check_option_mismatch(saver, ovq::SelfAttention<S>(o), state, "causal");
    o = base;
    o.chunk = base.chunk + 1;
    check_option_mismatch(saver, ovq::SelfAttention<S>(o), state, "chunk");
    o = base;
    o.window = 3;
    check_option_mismatch(saver, ovq::SelfAttention<S>(o), state, "window");
  }
  {
    const ovq::SelfAttentionOptions base = WindowCase<S>::mixer().options();
    const ovq::SelfAttention<S> saver(base);
    auto state = saver.make_state(dk, dv);
    feed(saver, state, in, 0, 7);
    auto o = base;
    o.window = base.window + 1;
    check_option_mismatch(saver, ovq::SelfAttention<S>(o), state, "window");
  }
  {
    const ovq::LinearAttentionOptions base = LinearCase<S>::mixer().options();
    const ovq::LinearAttention<S> saver(base);
    auto state = saver.make_state(dk, dv);
    feed(saver, state, in, 0, 7);
    auto o = base;
    o.beta = 2.0;
    check_option_mismatch(saver, ovq::LinearAttention<S>(o), state, "beta");
    o = base;
    o.feature_map = ovq::FeatureMap::relu;
    check_option_mismatch(saver, ovq::LinearAttention<S>(o), state, "feature_map");
    o = base;
    o.normalize = false;
    check_option_mismatch(saver, ovq::LinearAttention<S>(o), state, "normalize");
    o = base;
    o.decay = 0.95;
    check_option_mismatch(saver, ovq::LinearAttention<S>(o), state, "decay");
    o = base;
    o.eps = 1e-3;
    check_option_mismatch(saver, ovq::LinearAttention<S>(o), state, "eps");
    o = base;
    o.chunk = 64;
    check_option_mismatch(saver, ovq::LinearAttention<S>(o), state, "chunk");
  }
  {
    const ovq::VqAttention<S> saver = VqCase<S>::mixer();
    auto state = VqCase<S>::state(saver, dk, dv);
    feed(saver, state, in, 0, 7);
    auto o = saver.options();
    o.beta = 1.0;
    check_option_mismatch(saver, ovq::VqAttention<S>(o), state, "beta");
    o = saver.options();
    o.chunk = 9;
    check_option_mismatch(saver, ovq::VqAttention<S>(o), state, "chunk");
  }
  {
    const ovq::OvqOptions base = OvqCase<S>::options();
    const ovq::OvqAttention<S> saver(base);
    auto state = saver.make_state(dk, dv);
    feed(saver, state, in, 0, 7);
    auto check = [&](const ovq::OvqOptions& o, const char* name) {
      check_option_mismatch(saver, ovq::OvqAttention<S>(o), state, name);
    };
    auto o = base;
    o.capacity = base.capacity + 1;
    check(o, "capacity");
    o = base;
    o.chunk = base.chunk + 1;
    check(o, "chunk");
    o = base;
    o.beta = 1.0;
    check(o, "beta");
    o = base;
    o.growth = ovq::Growth::linear(1.0);
    check(o, "growth");
    o = base;
    o.growth = ovq::Growth::dirichlet(3.0);
    check(o, "growth alpha");
    o = base;
    o.seeding = ovq::Seeding::random(0);
    check(o, "seeding");
    o = base;
    o.rate = ovq::UpdateRate::constant(0.5);
    check(o, "update rate");
    o = base;
    o.renormalize = true;
    check(o, "renormalize");
  }
  {
    // The fields only the alternative configuration sets: growth rate, seed and eta.
    const ovq::OvqOptions base = OvqAltCase<S>::options();
    const ovq::OvqAttention<S> saver(base);
    auto state = saver.make_state(dk, dv);
    feed(saver, state, in, 0, 7);
    auto o = base;
    o.growth = ovq::Growth::linear(0.75);
    check_option_mismatch(saver, ovq::OvqAttention<S>(o), state, "growth rate");
    o = base;
    o.seeding = ovq::Seeding::random(4321);
    check_option_mismatch(saver, ovq::OvqAttention<S>(o), state, "seed");
    o = base;
    o.rate = ovq::UpdateRate::constant(0.3);
    check_option_mismatch(saver, ovq::OvqAttention<S>(o), state, "eta");
  }
  {
    // The fields of format version 3.
    const ovq::OvqOptions base = OvqOptions_kvm_small();
    const ovq::OvqAttention<S> saver(base);
    auto state = saver.make_state(dk, dv);
    feed(saver, state, in, 0, 7);
    auto o = base;
    o.renormalize_values = false;
    check_option_mismatch(saver, ovq::OvqAttention<S>(o), state, "renormalize values");
    o = base;
    o.count_bias = false;
    check_option_mismatch(saver, ovq::OvqAttention<S>(o), state, "count bias");
    o = base;
    o.renormalize_values = false;
    o.value_update = ovq::ValueUpdate::delta;
    check_option_mismatch(saver, ovq::OvqAttention<S>(o), state, "renormalize values");
    const ovq::OvqAttention<S> delta_saver(o);
    auto delta_state = delta_saver.make_state(dk, dv);
    feed(delta_saver, delta_state, in, 0, 7);
    auto mean = o;
    mean.value_update = ovq::ValueUpdate::mean;
    check_option_mismatch(delta_saver, ovq::OvqAttention<S>(mean), delta_state, "value update");
  }
}

TEMPLATE_TEST_CASE("state file: version 2 files load with the options version 3 added at their "
                   "defaults",
                   "[io][state]", float, double) {
  using S = TestType;
  const SmallOvq<S> f;
  const Bytes v2 = ovq_file_before_version3(f.bytes, 2);
  REQUIRE(v2.size() == f.bytes.size() - kOvqOptionsSince3);
  CHECK((f.decode(v2) == f.state));
  CHECK(ovq::io::encode_state(f.mixer, f.decode(v2)) == f.bytes);  // written back as version 3
  // A loading mixer with another value of a version-3 option: the file means the default.
  ovq::OvqOptions o = f.mixer.options();
  o.count_bias = false;
  CHECK_FORMAT_ERROR(ovq::io::decode_state(ovq::OvqAttention<S>(o), v2.data(), v2.size()),
                     "option 'count bias' = 1 (the default of older files), expected 0");
  // A multi-head file of version 2 has no head betas.
  auto layer = make_layer<OvqCase<S>>(2, 4, 2, 3, 2);
  const Inputs<S> in(9, 3, 2, 61);
  layer.forward(in.q.topRows(2 * 4 * 1), in.k.topRows(2 * 2 * 1), in.v.topRows(2 * 2 * 1));
  const Bytes mh3 = ovq::io::encode_state(layer);
  const std::size_t betas_at = kHeader + options_bytes(ovq::OvqOptions{}) + 3 * 8;
  REQUIRE(peek<std::int64_t>(mh3, betas_at) == 0);
  Bytes mh2(mh3.begin(), mh3.begin() + static_cast<std::ptrdiff_t>(betas_at));
  mh2.insert(mh2.end(), mh3.begin() + static_cast<std::ptrdiff_t>(betas_at + 8), mh3.end());
  mh2 = ovq_file_before_version3(mh2, 2);
  auto loaded = make_layer<OvqCase<S>>(2, 4, 2, 3, 2);
  ovq::io::decode_state(loaded, mh2.data(), mh2.size());
  CHECK(same_states(loaded, layer));
  auto with_betas = make_layer<OvqCase<S>>(2, 4, 2, 3, 2);
  with_betas.set_head_betas({1.0, 2.0, 3.0, 4.0});
  CHECK_THROWS_MATCHES(ovq::io::decode_state(with_betas, mh2.data(), mh2.size()), ovq::FormatError,
                       MessageHas({"head betas: 0, expected 4"}));
}

TEST_CASE("state file: a multi-head layer's head betas are stored and must match",
          "[io][state][multihead]") {
  auto layer = make_layer<OvqCase<float>>(1, 4, 2, 3, 2);
  layer.set_head_betas({0.5, 1.0, 2.0, 4.0});
  const Bytes b = ovq::io::encode_state(layer);
  auto same = make_layer<OvqCase<float>>(1, 4, 2, 3, 2);
  same.set_head_betas({0.5, 1.0, 2.0, 4.0});
  CHECK_NOTHROW(ovq::io::decode_state(same, b.data(), b.size()));
  auto other = make_layer<OvqCase<float>>(1, 4, 2, 3, 2);
  other.set_head_betas({0.5, 1.0, 2.0, 3.0});
  const auto before = other.states();
  CHECK_THROWS_MATCHES(ovq::io::decode_state(other, b.data(), b.size()), ovq::FormatError,
                       MessageHas({"head beta 3 = 4, expected 3"}));
  CHECK(other.states() == before);
  auto none = make_layer<OvqCase<float>>(1, 4, 2, 3, 2);
  CHECK_THROWS_MATCHES(ovq::io::decode_state(none, b.data(), b.size()), ovq::FormatError,
                       MessageHas({"head betas: 4, expected 0"}));
}

TEST_CASE("state file: a multi-head file of another shape is rejected", "[io][state][multihead]") {
  using Case = OvqCase<float>;
  auto layer = make_layer<Case>(2, 4, 2, 3, 2);
  const Bytes b = ovq::io::encode_state(layer);
  auto check_shape = [&](Index batch, Index hq, Index hkv, Index dk, Index dv,
                         std::initializer_list<std::string> pieces) {
    auto other = make_layer<Case>(batch, hq, hkv, dk, dv);
    const auto before = other.states();
    CAPTURE(batch, hq, hkv, dk, dv);
    CHECK_THROWS_MATCHES(ovq::io::decode_state(other, b.data(), b.size()), ovq::FormatError,
                         MessageHas(pieces));
    CHECK(other.states() == before);
  };
  check_shape(1, 4, 2, 3, 2, {"(batch, query heads, kv heads) = (2, 4, 2)", "expected (1, 4, 2)"});
  check_shape(2, 2, 2, 3, 2, {"(batch, query heads, kv heads) = (2, 4, 2)", "expected (2, 2, 2)"});
  check_shape(2, 4, 1, 3, 2, {"(batch, query heads, kv heads) = (2, 4, 2)", "expected (2, 4, 1)"});
  check_shape(2, 4, 4, 3, 2, {"(batch, query heads, kv heads) = (2, 4, 2)", "expected (2, 4, 4)"});
  check_shape(2, 4, 2, 4, 2, {"(dk, dv) = (3, 2)", "expected (4, 2)"});
  check_shape(2, 4, 2, 3, 5, {"(dk, dv) = (3, 2)", "expected (3, 5)"});
}

TEMPLATE_TEST_CASE(
    "state file: size fields far beyond the file fail as truncated, without "
    "allocating",
    "[io][state]", float, double) {
  using S = TestType;
  constexpr std::int64_t kBig = (std::int64_t(1) << 31) - 1;
  constexpr std::int64_t kMax = std::int64_t(1) << 31;  // the largest dimension the format allows

  // OVQ: capacity, n and t of 2^31 - 1 centroids (options and state agree, as does a loading
  // mixer of that capacity: constructing one allocates nothing). The dictionary would take
  // 2^31 (dk + dv) scalars; the file has a few hundred bytes.
  {
    const SmallOvq<S> f;
    Bytes b = f.bytes;
    poke<std::int64_t>(b, f.at.options, kBig);  // option 'capacity'
    poke<std::int64_t>(b, f.at.capacity, kBig);
    poke<std::int64_t>(b, f.at.n, kBig);
    fix_crc(b);
    ovq::OvqOptions o = f.mixer.options();
    o.capacity = kBig;
    const ovq::OvqAttention<S> huge(o);
    CHECK_FORMAT_ERROR(ovq::io::decode_state(huge, b.data(), b.size()), "truncated");
    // The same n against the real capacity fails on n itself.
    b = f.bytes;
    poke<std::int64_t>(b, f.at.n, kBig);
    fix_crc(b);
    CHECK_FORMAT_ERROR(f.decode(b), "n = 2147483647, expected <= capacity = 6");
    // dk or dv of 2^31 - 1 with the real n.
    b = f.bytes;
    poke<std::int64_t>(b, f.at.dk, kBig);
    fix_crc(b);
    CHECK_FORMAT_ERROR(f.decode(b), "truncated");
    b = f.bytes;
    poke<std::int64_t>(b, f.at.dv, kBig);
    fix_crc(b);
    CHECK_FORMAT_ERROR(f.decode(b), "truncated");
    // Beyond the largest dimension allowed.
    b = f.bytes;
    poke<std::int64_t>(b, f.at.dk, kMax + 1);
    fix_crc(b);
    CHECK_FORMAT_ERROR(f.decode(b), "dk = 2147483649", "expected a value in [1, 2147483648]");
    b = f.bytes;
    poke<std::int64_t>(b, f.at.dv, -1);
    fix_crc(b);
    CHECK_FORMAT_ERROR(f.decode(b), "dv = -1");
    // n, dk and dv at the largest dimension allowed: the byte count 2^31 (2^31 + 2^31) s
    // exceeds 64 bits, so it must not wrap around to a small number that passes.
    b = f.bytes;
    poke<std::int64_t>(b, f.at.options, kMax);
    poke<std::int64_t>(b, f.at.capacity, kMax);
    poke<std::int64_t>(b, f.at.n, kMax);
    poke<std::int64_t>(b, f.at.dk, kMax);
    poke<std::int64_t>(b, f.at.dv, kMax);
    fix_crc(b);
    o.capacity = kMax;
    const ovq::OvqAttention<S> widest(o);
    CHECK_FORMAT_ERROR(ovq::io::decode_state(widest, b.data(), b.size()), "truncated");
  }

  // Self-attention: a cache of 2^31 - 1 rows, and rows x dk at the largest dimensions.
  {
    const Index dk = 2, dv = 2;
    const auto mixer = SelfCase<S>::mixer();
    auto state = mixer.make_state(dk, dv);
    feed(mixer, state, Inputs<S>(3, dk, dv, 71), 0, 3);
    const Bytes good = ovq::io::encode_state(mixer, state);
    const std::size_t at = kHeader + options_bytes(mixer.options());  // dk, dv, keep, tokens, rows
    REQUIRE(peek<std::int64_t>(good, at + 32) == 3);
    Bytes b = good;
    poke<std::int64_t>(b, at + 24, kBig);  // tokens
    poke<std::int64_t>(b, at + 32, kBig);  // rows
    fix_crc(b);
    CHECK_FORMAT_ERROR(ovq::io::decode_state(mixer, b.data(), b.size()), "truncated");
    b = good;
    poke<std::int64_t>(b, at, kMax);       // dk
    poke<std::int64_t>(b, at + 24, kMax);  // tokens
    poke<std::int64_t>(b, at + 32, kMax);  // rows: rows dk s bytes exceeds 64 bits
    fix_crc(b);
    CHECK_FORMAT_ERROR(ovq::io::decode_state(mixer, b.data(), b.size()), "truncated");
  }

  // Linear attention: S of dk x dv at the largest dimensions.
  {
    const Index dk = 2, dv = 2;
    const auto mixer = LinearCase<S>::mixer();
    auto state = mixer.make_state(dk, dv);
    const Bytes good = ovq::io::encode_state(mixer, state);
    const std::size_t at = kHeader + options_bytes(mixer.options());  // dk, dv, chunk, t, pending
    Bytes b = good;
    poke<std::int64_t>(b, at, kBig);
    fix_crc(b);
    CHECK_FORMAT_ERROR(ovq::io::decode_state(mixer, b.data(), b.size()), "truncated");
    b = good;
    poke<std::int64_t>(b, at, kMax);
    poke<std::int64_t>(b, at + 8, kMax - 1);  // dk (dv + 1) s bytes exceeds 64 bits
    fix_crc(b);
    CHECK_FORMAT_ERROR(ovq::io::decode_state(mixer, b.data(), b.size()), "truncated");
    // A head wider than the loader's bound: the pending buffer (chunk x dk) is sized by the
    // mixer, not by the rows in the file, so the width is refused by name even though S is there.
    const Bytes wide = ovq::io::encode_state(mixer, mixer.make_state(65537, 1));
    CHECK_FORMAT_ERROR(ovq::io::decode_state(mixer, wide.data(), wide.size()),
                       "(dk, dv) = (65537, 1)", "expected at most 65536");
  }

  // VQ: a codebook of 2^31 - 1 codes, and codes x dk at the largest dimensions.
  {
    const Index dk = 2, dv = 2;
    const auto mixer = VqCase<S>::mixer();
    const auto state = VqCase<S>::state(mixer, dk, dv);
    const Bytes good = ovq::io::encode_state(mixer, state);
    const std::size_t at = kHeader + options_bytes(mixer.options());  // codes, dk, dv, chunk, pending
    Bytes b = good;
    poke<std::int64_t>(b, at, kBig);
    fix_crc(b);
    CHECK_FORMAT_ERROR(ovq::io::decode_state(mixer, b.data(), b.size()), "truncated");
    b = good;
    poke<std::int64_t>(b, at, kMax);
    poke<std::int64_t>(b, at + 8, kMax);
    fix_crc(b);
    CHECK_FORMAT_ERROR(ovq::io::decode_state(mixer, b.data(), b.size()), "truncated");
  }
}

TEMPLATE_TEST_CASE("state file: OVQ state invariants are checked", "[io][state]", float, double) {
  using S = TestType;
  const SmallOvq<S> f;
  const auto& d = f.state.dictionary();
  const std::int64_t t = f.state.absorbed();
  REQUIRE(d.count(0) > 0);

  Bytes b = f.bytes;
  poke<std::int64_t>(b, f.at.counts, d.count(0) - 1);  // counts sum to t - 1
  fix_crc(b);
  CHECK_FORMAT_ERROR(f.decode(b), "counts sum to " + std::to_string(t - 1),
                     "expected t = " + std::to_string(t));

  b = f.bytes;
  poke<std::int64_t>(b, f.at.counts + 8, d.count(1) + 1);  // counts sum past t
  fix_crc(b);
  CHECK_FORMAT_ERROR(f.decode(b), "counts sum past t");

  b = f.bytes;
  poke<std::int64_t>(b, f.at.counts, std::numeric_limits<std::int64_t>::max());
  fix_crc(b);
  CHECK_FORMAT_ERROR(f.decode(b), "counts sum past t");

  b = f.bytes;
  poke<std::int64_t>(b, f.at.counts, -1);
  fix_crc(b);
  CHECK_FORMAT_ERROR(f.decode(b), "count = -1, expected >= 0");

  b = f.bytes;
  poke<std::int64_t>(b, f.at.pending, OvqCase<S>::chunk);
  fix_crc(b);
  const std::string chunk = std::to_string(OvqCase<S>::chunk);
  CHECK_FORMAT_ERROR(f.decode(b), "pending = " + chunk + ", expected < chunk = " + chunk);

  b = f.bytes;
  poke<std::int64_t>(b, f.at.pending, -1);
  fix_crc(b);
  CHECK_FORMAT_ERROR(f.decode(b), "pending = -1");

  b = f.bytes;
  poke<std::int64_t>(b, f.at.t, t + 1);
  fix_crc(b);
  CHECK_FORMAT_ERROR(f.decode(b), "t = " + std::to_string(t + 1), "multiple of the chunk");

  b = f.bytes;
  poke<std::int64_t>(b, f.at.t, -OvqCase<S>::chunk);
  fix_crc(b);
  CHECK_FORMAT_ERROR(f.decode(b), "t = -" + chunk);

  b = f.bytes;
  poke<std::int64_t>(b, f.at.t, 0);
  fix_crc(b);
  CHECK_FORMAT_ERROR(f.decode(b), "expected n = 0 exactly when t = 0");

  b = f.bytes;
  poke<std::int64_t>(b, f.at.n, f.mixer.options().capacity + 1);
  fix_crc(b);
  CHECK_FORMAT_ERROR(f.decode(b), "expected <= capacity");

  b = f.bytes;
  poke<std::int64_t>(b, f.at.capacity, 7);
  fix_crc(b);
  CHECK_FORMAT_ERROR(f.decode(b), "(capacity, chunk) = (7, " + chunk + ")");

  b = f.bytes;
  poke<std::int64_t>(b, f.at.chunk, OvqCase<S>::chunk + 1);
  fix_crc(b);
  CHECK_FORMAT_ERROR(f.decode(b),
                     "(capacity, chunk) = (6, " + std::to_string(OvqCase<S>::chunk + 1) + ")");
}

TEMPLATE_TEST_CASE("state file: linear and VQ state invariants are checked", "[io][state]", float,
                   double) {
  using S = TestType;
  const Index dk = 3, dv = 2;
  const Inputs<S> in(2 * 5 + 3, dk, dv, 85);  // two chunks of 5, three rows pending
  const std::string chunk = "5";
  {
    INFO("linear");
    const auto mixer = LinearCase<S>::mixer();
    auto state = mixer.make_state(dk, dv);
    feed(mixer, state, in, 0, in.tokens());
    REQUIRE(state.pending() == 3);
    const Bytes good = ovq::io::encode_state(mixer, state);
    // dk, dv, chunk, t, pending
    const std::size_t at = kHeader + options_bytes(mixer.options());
    REQUIRE(peek<std::int64_t>(good, at + 16) == 5);
    REQUIRE(peek<std::int64_t>(good, at + 24) == 10);
    REQUIRE(peek<std::int64_t>(good, at + 32) == 3);
    auto patched = [&](std::size_t offset, std::int64_t value) {
      Bytes b = good;
      poke<std::int64_t>(b, offset, value);
      fix_crc(b);
      return b;
    };
    auto decode = [&](const Bytes& b) { return ovq::io::decode_state(mixer, b.data(), b.size()); };
    CHECK_FORMAT_ERROR(decode(patched(at + 16, 6)), "chunk = 6", "expected 5 (the loading mixer's)");
    CHECK_FORMAT_ERROR(decode(patched(at + 16, 0)), "chunk = 0");
    CHECK_FORMAT_ERROR(decode(patched(at + 32, 5)), "pending = 5, expected < chunk = 5");
    CHECK_FORMAT_ERROR(decode(patched(at + 32, -1)), "pending = -1");
    CHECK_FORMAT_ERROR(decode(patched(at + 32, 4)), "truncated");  // one row more than the file
    CHECK_FORMAT_ERROR(decode(patched(at + 24, -5)), "t = -5");
    CHECK_FORMAT_ERROR(decode(patched(at + 24, std::numeric_limits<std::int64_t>::max())), "t = ");
    CHECK_FORMAT_ERROR(decode(patched(at + 24, std::int64_t(1) << 62)), "t + pending = ");
    // t need not be a multiple of the chunk (a version-1 state continued), but it is restored.
    const auto loaded = decode(patched(at + 24, 11));
    CHECK(loaded.absorbed() == 11);
    CHECK(loaded.tokens() == 14);
  }
  {
    INFO("vq");
    const auto mixer = VqCase<S>::mixer();
    auto state = VqCase<S>::state(mixer, dk, dv);
    feed(mixer, state, in, 0, in.tokens());
    REQUIRE(state.pending() == 3);
    const Bytes good = ovq::io::encode_state(mixer, state);
    // codes (6), dk, dv, chunk, pending, codebook, mean values, counts, pending codes, values
    const std::size_t at = kHeader + options_bytes(mixer.options());
    REQUIRE(peek<std::int64_t>(good, at) == 6);
    REQUIRE(peek<std::int64_t>(good, at + 24) == 5);
    REQUIRE(peek<std::int64_t>(good, at + 32) == 3);
    const std::size_t counts = at + 40 + static_cast<std::size_t>(6 * (dk + dv)) * sizeof(S);
    const std::size_t codes = counts + 6 * 8;
    REQUIRE(peek<std::int64_t>(good, codes) == state.pending_codes()[0]);
    auto patched = [&](std::size_t offset, std::int64_t value) {
      Bytes b = good;
      poke<std::int64_t>(b, offset, value);
      fix_crc(b);
      return b;
    };
    auto decode = [&](const Bytes& b) { return ovq::io::decode_state(mixer, b.data(), b.size()); };
    CHECK_FORMAT_ERROR(decode(patched(at + 24, 4)), "chunk = 4", "expected 5 (the loading mixer's)");
    CHECK_FORMAT_ERROR(decode(patched(at + 32, 5)), "pending = 5, expected < chunk = 5");
    CHECK_FORMAT_ERROR(decode(patched(at + 32, -2)), "pending = -2");
    CHECK_FORMAT_ERROR(decode(patched(codes + 8, 6)), "pending code 1 = 6",
                       "expected a value in [0, 6)");
    CHECK_FORMAT_ERROR(decode(patched(codes, -1)), "pending code 0 = -1");
    // Counts that sum to 2^62 - 1, with 3 rows pending: the tokens would pass 2^62.
    const std::int64_t others = 10 - state.dictionary().count(0);
    CHECK_FORMAT_ERROR(decode(patched(counts, (std::int64_t(1) << 62) - 1 - others)),
                       "counts + pending sum past");
    // Nothing pending: the pending rows are left over.
    CHECK_FORMAT_ERROR(decode(patched(at + 32, 0)), "unexpected bytes after the last state");
  }
}

// A version-1 file: the header of `file` with version 1, then `payload` (options included).
Bytes version1_file(const Bytes& file, const Bytes& payload) {
  Bytes b(kHeader + payload.size() + 4);
  std::copy(file.begin(), file.begin() + kHeader, b.begin());
  std::copy(payload.begin(), payload.end(), b.begin() + kHeader);
  poke<std::uint32_t>(b, kVersionAt, 1);
  poke<std::uint64_t>(b, kPayloadSizeAt, payload.size());
  fix_crc(b);
  return b;
}

// Little-endian fields appended to a byte vector.
template <class T>
void append(Bytes& b, T value) {
  b.resize(b.size() + sizeof(T));
  poke<T>(b, b.size() - sizeof(T), value);
}
template <class S>
void append_rows(Bytes& b, const Mat<S>& m) {
  for (Index i = 0; i < m.rows(); ++i)
    for (Index j = 0; j < m.cols(); ++j) append<S>(b, m(i, j));
}

TEMPLATE_TEST_CASE("state file: version 1 files still load", "[io][state]", float, double) {
  using S = TestType;
  const Index dk = 3, dv = 2;
  const Inputs<S> in(40, dk, dv, 87);
  {
    INFO("self-attention and OVQ: the payload is the same in both versions");
    const auto self = SelfCase<S>::mixer();
    auto cache = self.make_state(dk, dv);
    feed(self, cache, in, 0, 7);
    Bytes b = ovq::io::encode_state(self, cache);
    poke<std::uint32_t>(b, kVersionAt, 1);
    fix_crc(b);
    CHECK((ovq::io::decode_state(self, b.data(), b.size()) == cache));
    const SmallOvq<S> f;
    b = ovq_file_before_version3(f.bytes, 1);
    CHECK((f.decode(b) == f.state));
  }
  {
    INFO("linear: dk, dv, tokens, S, z; loaded with nothing pending");
    const auto mixer = LinearCase<S>::mixer();  // chunk 5
    auto state = mixer.make_state(dk, dv);
    feed(mixer, state, in, 0, 10);
    REQUIRE(state.pending() == 0);
    const Bytes v2 = ovq::io::encode_state(mixer, state);
    Bytes payload(v2.begin() + kHeader, v2.begin() + kHeader + options_bytes(mixer.options()));
    append<std::int64_t>(payload, dk);
    append<std::int64_t>(payload, dv);
    append<std::int64_t>(payload, 10);
    append_rows<S>(payload, state.kv());
    append_rows<S>(payload, state.k_sum());
    const Bytes v1 = version1_file(v2, payload);
    auto loaded = ovq::io::decode_state(mixer, v1.data(), v1.size());
    CHECK((loaded == state));
    CHECK(ovq::io::encode_state(mixer, loaded) == v2);  // written back as version 2
    // A version-1 state of 7 tokens (all folded in): its next chunk ends 5 tokens later.
    Bytes odd = payload;
    poke<std::int64_t>(odd, odd.size() - static_cast<std::size_t>(dk * (dv + 1)) * sizeof(S) - 8, 7);
    const Bytes v1_odd = version1_file(v2, odd);
    auto continued = ovq::io::decode_state(mixer, v1_odd.data(), v1_odd.size());
    CHECK(continued.absorbed() == 7);
    CHECK(continued.pending() == 0);
    feed(mixer, continued, in, 10, 4);
    CHECK(continued.pending() == 4);
    feed(mixer, continued, in, 14, 1);
    CHECK(continued.pending() == 0);
    CHECK(continued.absorbed() == 12);
    // The version-1 checks: a bad token count, S past the file.
    Bytes bad = odd;
    poke<std::int64_t>(bad, bad.size() - static_cast<std::size_t>(dk * (dv + 1)) * sizeof(S) - 8, -1);
    const Bytes v1_bad = version1_file(v2, bad);
    CHECK_FORMAT_ERROR(ovq::io::decode_state(mixer, v1_bad.data(), v1_bad.size()), "tokens = -1");
    const Bytes v1_short = version1_file(v2, Bytes(payload.begin(), payload.end() - 1));
    CHECK_FORMAT_ERROR(ovq::io::decode_state(mixer, v1_short.data(), v1_short.size()), "truncated");
  }
  {
    INFO("VQ: codes, dk, dv, codebook, mean values, counts; loaded with nothing pending");
    const auto mixer = VqCase<S>::mixer();  // chunk 5
    auto state = VqCase<S>::state(mixer, dk, dv);
    feed(mixer, state, in, 0, 15);
    REQUIRE(state.pending() == 0);
    const Bytes v2 = ovq::io::encode_state(mixer, state);
    Bytes payload(v2.begin() + kHeader, v2.begin() + kHeader + options_bytes(mixer.options()));
    append<std::int64_t>(payload, state.codebook_size());
    append<std::int64_t>(payload, dk);
    append<std::int64_t>(payload, dv);
    append_rows<S>(payload, Mat<S>(ovq::as_eigen(state.codebook())));
    append_rows<S>(payload, Mat<S>(ovq::as_eigen(state.dictionary().values())));
    for (Index c = 0; c < state.codebook_size(); ++c)
      append<std::int64_t>(payload, state.dictionary().count(c));
    const Bytes v1 = version1_file(v2, payload);
    auto loaded = ovq::io::decode_state(mixer, v1.data(), v1.size());
    CHECK((loaded == state));
    CHECK(ovq::io::encode_state(mixer, loaded) == v2);
    // Both continue alike.
    const Mat<S> a = feed(mixer, loaded, in, 15, 8);
    const Mat<S> b = feed(mixer, state, in, 15, 8);
    CHECK(same_bits(a, b));
    CHECK((loaded == state));
    Bytes bad = payload;
    poke<std::int64_t>(bad, bad.size() - 8, -4);
    const Bytes v1_bad = version1_file(v2, bad);
    CHECK_FORMAT_ERROR(ovq::io::decode_state(mixer, v1_bad.data(), v1_bad.size()), "count = -4");
  }
}

TEMPLATE_TEST_CASE("state file: a NaN or infinity anywhere in a payload is rejected", "[io][state]",
                   float, double) {
  using S = TestType;
  const S nan = std::numeric_limits<S>::quiet_NaN();
  const S inf = std::numeric_limits<S>::infinity();
  const SmallOvq<S> f;
  const Index dk = f.dk, dv = f.dv;
  struct Spot {
    std::size_t at;
    const char* name;
  };
  const std::size_t last_key = f.at.keys + static_cast<std::size_t>(2 * dk - 1) * sizeof(S);
  for (const Spot spot :
       {Spot{f.at.keys, "D_k(0, 0)"}, Spot{last_key, "D_k(1, 1)"},
        Spot{f.at.values + sizeof(S), "D_v(0, 1)"}, Spot{f.at.pkeys, "pending keys(0, 0)"},
        Spot{f.at.pvalues + static_cast<std::size_t>(dv) * sizeof(S), "pending values(1, 0)"}}) {
    for (const S bad : {nan, inf, -inf}) {
      Bytes b = f.bytes;
      poke<S>(b, spot.at, bad);
      fix_crc(b);
      CAPTURE(spot.name, bad);
      CHECK_FORMAT_ERROR(f.decode(b), spot.name, "expected a finite value");
    }
  }
  // A NaN option never equals the loading mixer's.
  Bytes b = f.bytes;
  poke<double>(b, kHeader + 16, std::numeric_limits<double>::quiet_NaN());  // beta
  fix_crc(b);
  CHECK_FORMAT_ERROR(f.decode(b), "option 'beta'");

  // The other mixers' payloads.
  const Index d2 = 2;
  const Inputs<S> in(4, d2, d2, 81);
  {
    const auto mixer = SelfCase<S>::mixer();
    auto state = mixer.make_state(d2, d2);
    feed(mixer, state, in, 0, 4);
    b = ovq::io::encode_state(mixer, state);
    // dk, dv, keep, tokens, rows, then the keys.
    poke<S>(b, kHeader + options_bytes(mixer.options()) + 40 + sizeof(S), nan);
    fix_crc(b);
    CHECK_FORMAT_ERROR(ovq::io::decode_state(mixer, b.data(), b.size()), "keys(0, 1)",
                       "expected a finite value");
  }
  {
    const auto mixer = LinearCase<S>::mixer();
    auto state = mixer.make_state(d2, d2);
    feed(mixer, state, in, 0, 4);
    b = ovq::io::encode_state(mixer, state);
    // dk, dv, chunk, t, pending, then S (dk x dv), z, the pending keys and values (4 tokens
    // with a chunk of 5: 4 rows).
    REQUIRE(state.pending() == 4);
    const std::size_t s_at = kHeader + options_bytes(mixer.options()) + 40;
    poke<S>(b, s_at, inf);
    fix_crc(b);
    CHECK_FORMAT_ERROR(ovq::io::decode_state(mixer, b.data(), b.size()), "S(0, 0)",
                       "expected a finite value");
    b = ovq::io::encode_state(mixer, state);
    poke<S>(b, s_at + static_cast<std::size_t>(d2 * d2 + 1) * sizeof(S), nan);
    fix_crc(b);
    CHECK_FORMAT_ERROR(ovq::io::decode_state(mixer, b.data(), b.size()), "z(0, 1)",
                       "expected a finite value");
    const std::size_t pk_at = s_at + static_cast<std::size_t>(d2 * d2 + d2) * sizeof(S);
    b = ovq::io::encode_state(mixer, state);
    poke<S>(b, pk_at + static_cast<std::size_t>(2 * d2 + 1) * sizeof(S), -inf);
    fix_crc(b);
    CHECK_FORMAT_ERROR(ovq::io::decode_state(mixer, b.data(), b.size()), "pending keys(2, 1)",
                       "expected a finite value");
    b = ovq::io::encode_state(mixer, state);
    poke<S>(b, b.size() - 4 - sizeof(S), nan);
    fix_crc(b);
    CHECK_FORMAT_ERROR(ovq::io::decode_state(mixer, b.data(), b.size()), "pending values(3, 1)",
                       "expected a finite value");
  }
  {
    const auto mixer = VqCase<S>::mixer();
    auto state = VqCase<S>::state(mixer, d2, d2);
    feed(mixer, state, in, 0, 4);
    b = ovq::io::encode_state(mixer, state);
    // codes, dk, dv, chunk, pending, then the codebook (codes x dk), the mean values
    // (codes x dv), the counts, the pending codes and values (4 rows).
    REQUIRE(state.pending() == 4);
    const std::size_t c_at = kHeader + options_bytes(mixer.options()) + 40;
    poke<S>(b, c_at, nan);
    fix_crc(b);
    CHECK_FORMAT_ERROR(ovq::io::decode_state(mixer, b.data(), b.size()), "codebook(0, 0)",
                       "expected a finite value");
    b = ovq::io::encode_state(mixer, state);
    poke<S>(b, c_at + static_cast<std::size_t>(6 * d2) * sizeof(S), -inf);
    fix_crc(b);
    CHECK_FORMAT_ERROR(ovq::io::decode_state(mixer, b.data(), b.size()), "mean values(0, 0)",
                       "expected a finite value");
    b = ovq::io::encode_state(mixer, state);
    poke<std::int64_t>(b, c_at + static_cast<std::size_t>(6 * (d2 + d2)) * sizeof(S), -3);
    fix_crc(b);
    CHECK_FORMAT_ERROR(ovq::io::decode_state(mixer, b.data(), b.size()), "count = -3");
    b = ovq::io::encode_state(mixer, state);
    poke<S>(b, b.size() - 4 - sizeof(S), inf);
    fix_crc(b);
    CHECK_FORMAT_ERROR(ovq::io::decode_state(mixer, b.data(), b.size()), "pending values(3, 1)",
                       "expected a finite value");
  }
}

TEST_CASE("state file: bytes after the last state are rejected", "[io][state]") {
  const SmallOvq<float> f;
  Bytes b = f.bytes;
  b.insert(b.end() - 4, {0, 0, 0, 0, 0, 0, 0, 0});
  poke<std::uint64_t>(b, kPayloadSizeAt, b.size() - kHeader - 4);
  fix_crc(b);
  CHECK_FORMAT_ERROR(f.decode(b), "8 unexpected bytes after the last state");
}

TEMPLATE_TEST_CASE("state file: a failed multi-head load leaves the layer unchanged",
                   "[io][state][multihead]", OvqCase<float>, OvqCase<double>, VqCase<double>,
                   SelfCase<float>) {
  using S = typename TestType::Scalar;
  const Index batch = 2, hq = 2, hkv = 2, dk = 2, dv = 2, t = 7;
  auto source = make_layer<TestType>(batch, hq, hkv, dk, dv);
  source.forward(ovq::test::random_unit_rows<S>(batch * hq * t, dk, 91),
                 ovq::test::random_unit_rows<S>(batch * hkv * t, dk, 92),
                 ovq::test::random_matrix<S>(batch * hkv * t, dv, 93));
  const Bytes good = ovq::io::encode_state(source);

  auto target = make_layer<TestType>(batch, hq, hkv, dk, dv);
  target.forward(ovq::test::random_unit_rows<S>(batch * hq * 3, dk, 94),
                 ovq::test::random_unit_rows<S>(batch * hkv * 3, dk, 95),
                 ovq::test::random_matrix<S>(batch * hkv * 3, dv, 96));
  const auto before = target.states();
  REQUIRE(!same_states(target, source));

  // The last field of the last state is bad (a NaN in its last pending value): three states
  // decode before the failure.
  Bytes b = good;
  poke<S>(b, b.size() - 4 - sizeof(S), std::numeric_limits<S>::quiet_NaN());
  fix_crc(b);
  CHECK_THROWS_AS(ovq::io::decode_state(target, b.data(), b.size()), ovq::FormatError);
  CHECK(target.states() == before);

  CHECK_THROWS_AS(ovq::io::decode_state(target, good.data(), good.size() - 1), ovq::FormatError);
  CHECK(target.states() == before);

  TempDir dir;
  const std::string path = dir.file("bad.ovqs");
  ovq::io::write_file_atomic(path, b, "test");
  CHECK_THROWS_AS(ovq::io::load_state(path, target), ovq::FormatError);
  CHECK(target.states() == before);
  CHECK_THROWS_AS(ovq::io::load_state(dir.file("missing.ovqs"), target), ovq::IoError);
  CHECK(target.states() == before);

  // And the good file replaces every state.
  ovq::io::decode_state(target, good.data(), good.size());
  CHECK(same_states(target, source));
}

// ---------------------------------------------------------------------------------------------
// Files: I/O errors and atomic saves.
// ---------------------------------------------------------------------------------------------

TEST_CASE("state file: I/O errors are IoError", "[io][state]") {
  const SmallOvq<float> f;
  TempDir dir;
  CHECK_IO_ERROR(ovq::io::load_state(dir.file("missing.ovqs"), f.mixer), "load_state",
                 "cannot open", "missing.ovqs");
  CHECK_IO_ERROR(ovq::io::load_state(dir.path().string(), f.mixer), "load_state");
  CHECK_IO_ERROR(ovq::io::save_state(dir.file("no/such/dir/state.ovqs"), f.mixer, f.state),
                 "save_state", "cannot create temporary file");
  auto layer = make_layer<OvqCase<float>>(1, 1, 1, 2, 2);
  CHECK_IO_ERROR(ovq::io::save_state(dir.file("no/such/dir/layer.ovqs"), layer), "save_state");
  CHECK_IO_ERROR(ovq::io::load_state(dir.file("missing.ovqs"), layer), "load_state", "cannot open");
  CHECK(dir.entries().empty());
}

TEST_CASE("state file: a failed save leaves the previous file intact and no temporary file",
          "[io][state]") {
  const SmallOvq<float> f;
  auto other_state = f.state;
  f.mixer.forward(other_state, ovq::test::random_unit_rows<float>(9, 2, 101),
                  ovq::test::random_unit_rows<float>(9, 2, 102),
                  ovq::test::random_matrix<float>(9, 2, 103));
  const Bytes other = ovq::io::encode_state(f.mixer, other_state);
  REQUIRE(other != f.bytes);

  SECTION("the target is a directory: the rename fails") {
    TempDir dir;
    const std::string target = dir.file("state.ovqs");
    fs::create_directory(target);
    ovq::io::write_file_atomic(target + "/inside", f.bytes, "test");
    CHECK_IO_ERROR(ovq::io::save_state(target, f.mixer, other_state), "save_state", "rename");
    CHECK(fs::is_directory(target));
    CHECK(file_bytes(target + "/inside") == f.bytes);
    CHECK(dir.entries() == std::vector<std::string>{"state.ovqs"});
  }

#if defined(OVQ_TEST_POSIX)
  SECTION("the write fails part way (file size limit): the old file stays") {
    TempDir dir;
    const std::string target = dir.file("state.ovqs");
    ovq::io::save_state(target, f.mixer, f.state);
    REQUIRE(file_bytes(target) == f.bytes);
    // A big state, so that the write crosses the limit; SIGXFSZ ignored so that write() fails
    // with EFBIG instead of the process being killed.
    const auto big_mixer = ovq::OvqAttention<float>(OvqCase<float>::options());
    auto big = big_mixer.make_state(64, 64);
    big_mixer.absorb(big, ovq::test::random_unit_rows<float>(40, 64, 104),
                     ovq::test::random_matrix<float>(40, 64, 105));
    REQUIRE(ovq::io::encode_state(big_mixer, big).size() > 2048);
    rlimit old_limit{};
    REQUIRE(::getrlimit(RLIMIT_FSIZE, &old_limit) == 0);
    rlimit limit = old_limit;
    limit.rlim_cur = 1024;
    void (*old_handler)(int) = std::signal(SIGXFSZ, SIG_IGN);
    REQUIRE(::setrlimit(RLIMIT_FSIZE, &limit) == 0);
    bool threw_io = false;
    try {
      ovq::io::save_state(target, big_mixer, big);
    } catch (const ovq::IoError&) {
      threw_io = true;
    }
    ::setrlimit(RLIMIT_FSIZE, &old_limit);
    std::signal(SIGXFSZ, old_handler);
    CHECK(threw_io);
    CHECK(file_bytes(target) == f.bytes);
    CHECK(dir.entries() == std::vector<std::string>{"state.ovqs"});
    CHECK(ovq::io::load_state(target, f.mixer) == f.state);
  }

  SECTION("the directory is read-only: the temporary file cannot be created") {
    TempDir dir;
    const std::string target = dir.file("state.ovqs");
    ovq::io::save_state(target, f.mixer, f.state);
    fs::permissions(dir.path(), fs::perms::owner_read | fs::perms::owner_exec);
    // Privileged users write anyway; then there is no failure to simulate this way.
    const bool writable = ::access(dir.path().c_str(), W_OK) == 0;
    if (!writable) {
      CHECK_IO_ERROR(ovq::io::save_state(target, f.mixer, other_state), "save_state",
                     "cannot create temporary file");
      fs::permissions(dir.path(), fs::perms::owner_all);
      CHECK(file_bytes(target) == f.bytes);
      CHECK(dir.entries() == std::vector<std::string>{"state.ovqs"});
    } else {
      fs::permissions(dir.path(), fs::perms::owner_all);
      WARN("directory permissions do not apply to this user; read-only case not exercised");
    }
  }
#endif

  SECTION("a successful save replaces the file whole") {
    TempDir dir;
    const std::string target = dir.file("state.ovqs");
    ovq::io::save_state(target, f.mixer, f.state);
    ovq::io::save_state(target, f.mixer, other_state);
    CHECK(file_bytes(target) == other);
    CHECK(dir.entries() == std::vector<std::string>{"state.ovqs"});
  }
}

}  // namespace

}  // namespace ovq_test_state_file
