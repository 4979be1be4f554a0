// Writes the seed corpora of fuzz_state_file, fuzz_mixers, fuzz_mixers_half and
// fuzz_device_mixers (the .npy seeds come from NumPy: make_npy_corpus.py). Run by
// `scripts/fuzz corpus`:
//
//   ovq_fuzz_make_corpus OUT_DIR      writes OUT_DIR/fuzz_state_file/*, OUT_DIR/fuzz_mixers/*,
//                                     OUT_DIR/fuzz_mixers_half/*, OUT_DIR/fuzz_device_mixers/*
//
// State files: one state of each mixer kind, float, double, fp16 and bf16, alone and in a
// multi-head layer, after a few tokens (linear, VQ and OVQ states with a partial chunk pending),
// with options that differ from the defaults; and, in float and double, one state of each kind
// after whole chunks as a version-1 file (NAME_v1: the format before linear and VQ states kept
// pending rows, which loaders still read).
// Each is written as it is (NAME.state) and behind control byte 0x01 (NAME.fixed: fuzz_state_file
// then repairs the payload size and checksum of mutated copies).
// Mixer seeds: the first bytes fuzz_mixers and fuzz_mixers_half read (seed, element type, kind,
// multi-head, dk, dv), default options, then a short tail of calls and values.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <type_traits>
#include <vector>

#include "ovq/io/state_file.hpp"
#include "ovq/ovq.hpp"

namespace {

namespace fs = std::filesystem;
using namespace ovq;
using Bytes = std::vector<unsigned char>;

void write(const fs::path& path, const Bytes& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  if (!out) throw std::runtime_error("cannot write " + path.string());
}

template <class S>
RowMatrix<S> values(Index rows, Index cols, int salt) {
  RowMatrix<S> m(rows, cols);
  for (Index i = 0; i < rows; ++i)
    for (Index j = 0; j < cols; ++j)
      m(i, j) = static_cast<S>(std::sin(0.7 * static_cast<double>(i) + 1.3 * static_cast<double>(j) +
                                        static_cast<double>(salt)));
  return m;
}

void write_seed(const fs::path& dir, const std::string& file, const Bytes& bytes) {
  write(dir / (file + ".state"), bytes);
  Bytes fixed{0x01};
  fixed.insert(fixed.end(), bytes.begin(), bytes.end());
  write(dir / (file + ".fixed"), fixed);
}

// Version-1 state payloads: linear dk, dv, tokens, S, z; VQ codes, dk, dv, codebook, mean values,
// counts (nothing pending in either). Self-attention and OVQ payloads did not change.
template <class S>
bool put_version1(io::state_detail::Writer& w, const LinearState<S>& s) {
  w.put<std::int64_t>(s.key_dim());
  w.put<std::int64_t>(s.value_dim());
  w.put<std::int64_t>(s.tokens());
  w.put_rows(rows_view(s.kv()));
  w.put_rows(rows_view(s.k_sum()));
  return true;
}
template <class S>
bool put_version1(io::state_detail::Writer& w, const VqState<S>& s) {
  w.put<std::int64_t>(s.codebook_size());
  w.put<std::int64_t>(s.key_dim());
  w.put<std::int64_t>(s.value_dim());
  io::state_detail::put_dictionary_rows(w, s.dictionary().keys(), s.dictionary());
  return true;
}
template <class State>
bool put_version1(io::state_detail::Writer&, const State&) {
  return false;  // the version-3 payload is the version-1 payload
}

// The options as a version-1 or -2 file stores them: without the fields version 3 added.
template <class Options>
void put_options_before_version3(io::state_detail::Writer& w, const Options& options) {
  io::state_detail::visit_options(options, [&](const char*, auto v, std::uint32_t since = 1) {
    if (since < 3) w.put(io::state_detail::stored(v));
  });
}

// A state with nothing pending as a version-1 file.
template <class Mixer>
Bytes version1_file(const Mixer& mixer, const typename Mixer::State& state) {
  using namespace io::state_detail;
  const Bytes v3 = io::encode_state(mixer, state);
  Writer options;
  put_options(options, mixer.options());
  const std::size_t state_at = kHeaderSize + options.bytes().size();
  Writer w;
  for (std::size_t i = 0; i < kHeaderSize; ++i) w.put(v3[i]);
  put_options_before_version3(w, mixer.options());
  if (!put_version1(w, state))
    for (std::size_t i = state_at; i + 4 < v3.size(); ++i) w.put(v3[i]);
  Writer version;
  version.put<std::uint32_t>(1);
  std::copy(version.bytes().begin(), version.bytes().end(), w.bytes().begin() + 8);
  return finish(w);
}

// One state after `tokens` tokens, and a layer (batch 1, 2 query heads, 1 key/value head).
template <class Mixer>
void write_states(const fs::path& dir, const std::string& name, const Mixer& mixer,
                  typename Mixer::State state, Index tokens) {
  using S = typename Mixer::scalar_type;
  const Index dk = state.key_dim(), dv = state.value_dim();
  mixer.forward(state, values<S>(tokens, dk, 1), values<S>(tokens, dk, 2),
                values<S>(tokens, dv, 3));
  const std::string suffix = std::is_same_v<S, float>    ? "_f32"
                             : std::is_same_v<S, double> ? "_f64"
                             : std::is_same_v<S, fp16>   ? "_f16"
                                                         : "_bf16";
  const Bytes one = io::encode_state(mixer, state);

  MultiHead<Mixer> layer(mixer, 1, 2, std::vector<typename Mixer::State>(1, state));
  layer.reset();
  layer.forward(values<S>(2 * tokens, dk, 4), values<S>(tokens, dk, 5), values<S>(tokens, dv, 6));
  const Bytes multi = io::encode_state(layer);

  write_seed(dir, name + suffix, one);
  write_seed(dir, name + suffix + "_mh", multi);

  // Whole chunks only (nothing pending), as a version-1 file (which had no 16-bit elements).
  if constexpr (sizeof(S) < 4) return;
  typename Mixer::State whole = layer.state(0, 0);
  whole.reset();
  const Index chunks = 2 * mixer.options().chunk;
  mixer.forward(whole, values<S>(chunks, dk, 7), values<S>(chunks, dk, 8), values<S>(chunks, dv, 9));
  write_seed(dir, name + suffix + "_v1", version1_file(mixer, whole));
}

template <class S>
void write_state_corpus(const fs::path& dir) {
  SelfAttentionOptions self;
  self.beta = 0.5;
  self.window = 4;
  self.chunk = 3;
  const SelfAttention<S> self_mixer(self);
  write_states(dir, "self", self_mixer, self_mixer.make_state(3, 2), 7);

  LinearAttentionOptions linear;
  linear.feature_map = kernels::FeatureMap::elu1;
  linear.normalize = true;
  linear.decay = 0.9;
  linear.chunk = 4;
  const LinearAttention<S> linear_mixer(linear);
  write_states(dir, "linear", linear_mixer, linear_mixer.make_state(3, 2), 7);

  VqAttentionOptions vq;
  vq.beta = 2.0;
  vq.chunk = 4;
  const VqAttention<S> vq_mixer(vq);
  write_states(dir, "vq", vq_mixer, vq_mixer.make_state(values<S>(4, 3, 7), 2), 7);

  OvqOptions ovq;
  ovq.capacity = 4;
  ovq.chunk = 3;
  if (sizeof(S) == 8) {
    ovq.growth = Growth::linear(0.5);
    ovq.seeding = Seeding::random(42);
    ovq.rate = UpdateRate::constant(0.25);
    ovq.renormalize = true;
  } else {
    ovq.value_update = ValueUpdate::delta;
    ovq.count_bias = false;
  }
  const OvqAttention<S> ovq_mixer(ovq);
  write_states(dir, "ovq", ovq_mixer, ovq_mixer.make_state(3, 2), 8);
}

// Mixer seeds of fuzz_mixers (element byte 0: float, 1: double) or of fuzz_mixers_half (0:
// fp16, 1: bf16, 3: bf16 on AMX tiles): the same bytes after the element's.
struct ElementSeed {
  unsigned char byte;
  const char* name;
};
void write_mixer_corpus(const fs::path& dir, const std::vector<ElementSeed>& elements) {
  static const char* const kKind[] = {"self", "linear", "vq", "ovq"};
  for (const ElementSeed& element : elements) {
    for (int kind = 0; kind < 4; ++kind) {
      for (int multi = 0; multi < 2; ++multi) {
        // seed (4 bytes), element, kind, multi-head (3: yes), dk - 1, dv - 1
        Bytes b = {0x11, 0x22, 0x33, static_cast<unsigned char>(kind), element.byte,
                   static_cast<unsigned char>(kind),
                   static_cast<unsigned char>(multi ? 3 : 0), 3, 2};
        // Default options (every option list starts with its default), VQ codebook size 4.
        b.insert(b.end(), 10, 0);
        if (kind == 2) b.push_back(3);
        // Calls: 3 calls (forward, step, absorb) of a few tokens, ordinary values.
        const unsigned char calls[] = {2, 0, 0, 9, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                                       1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                                       2, 0, 5, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0};
        b.insert(b.end(), std::begin(calls), std::end(calls));
        write(dir / (std::string(kKind[kind]) + "_" + element.name + (multi ? "_mh" : "")), b);
      }
    }
  }
  // Values entry by entry from the bytes: special values in a small OVQ run.
  Bytes special = {7, 7, 7, 7, elements[0].byte, 3, 0, 1, 1, 1, 2, 0, 0, 0, 0, 0, 0, 0,
                   0, 1, 0, 6, 3};
  for (int i = 0; i < 24; ++i) special.push_back(static_cast<unsigned char>(i));
  write(dir / (std::string("ovq_") + elements[0].name + "_special_values"), special);
}

// Seeds of fuzz_device_mixers: each element (0: float, 1: double, 2: bf16, 3: fp16) and mixer
// kind (but double OVQ, which it leaves out) over 2 key/value heads of 2 query heads each, dk 16
// and dv 12, then bytes of a fixed generator, which choose options, layouts and a few calls.
void write_device_corpus(const fs::path& dir) {
  static const char* const kElement[] = {"f32", "f64", "bf16", "f16"};
  static const char* const kKind[] = {"self", "linear", "vq", "ovq"};
  std::uint32_t state = 12345;
  for (unsigned char element = 0; element < 4; ++element) {
    for (unsigned char kind = 0; kind < 4; ++kind) {
      if (element == 1 && kind == 3) continue;
      // seed (4 bytes), element, kind, batch - 1, key/value heads - 1, group - 1, dk - 1, dv - 1
      Bytes b = {0x21, 0x43, 0x65, kind, element, kind, 0, 1, 1, 15, 11};
      for (int i = 0; i < 120; ++i) {
        state = state * 1664525u + 1013904223u;
        b.push_back(static_cast<unsigned char>(state >> 24));
      }
      write(dir / (std::string(kKind[kind]) + "_" + kElement[element]), b);
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s OUT_DIR\n", argv[0]);
    return 2;
  }
  try {
    const fs::path out(argv[1]);
    fs::create_directories(out / "fuzz_state_file");
    fs::create_directories(out / "fuzz_mixers");
    write_state_corpus<float>(out / "fuzz_state_file");
    write_state_corpus<double>(out / "fuzz_state_file");
    write_state_corpus<fp16>(out / "fuzz_state_file");
    write_state_corpus<bf16>(out / "fuzz_state_file");
    write_mixer_corpus(out / "fuzz_mixers", {{0, "f32"}, {1, "f64"}});
    fs::create_directories(out / "fuzz_mixers_half");
    write_mixer_corpus(out / "fuzz_mixers_half", {{0, "f16"}, {1, "bf16"}, {3, "bf16_amx"}});
    fs::create_directories(out / "fuzz_device_mixers");
    write_device_corpus(out / "fuzz_device_mixers");
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ovq_fuzz_make_corpus: %s\n", e.what());
    return 1;
  }
  return 0;
}
