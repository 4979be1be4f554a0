// Fuzz target: the state-file loader (ovq::io::decode_state, for one state of each mixer kind in
// float, double, fp16 and bf16, and for a MultiHead layer).
//
// Input: either a state file as written by encode_state (it starts with "OVQSTATE") and is
// decoded as it is, or a control byte followed by such a file. Control bits:
//   bit 0      rewrite the payload size and the CRC-32 to match the bytes (so that mutations
//              reach the payload checks instead of stopping at the checksum)
//   bit 1      pick the decoder from bits 2..6 (kind, container, element) instead of the header,
//              to reach the kind / container / element mismatch checks: bits 2..3 the kind, bit 4
//              a layer, bit 5 double (bit 6 clear) or bf16 (bit 6 set: 16 bits, else fp16)
// The loading mixer takes the options stored in the file (when they are valid options with a
// capacity and chunk of at most 4096), so that the payload past the options is reached; the
// layer of a multi-head file takes its batch, heads, dk and dv likewise (up to 16 states, 64
// query heads, dk and dv up to 256).
//
// Oracle:
//   - decode_state returns or throws ovq::FormatError (nothing else, no crash, no UB, no
//     allocation beyond what the file's bytes justify: libFuzzer's -rss_limit_mb / malloc limit);
//   - a multi-head decode that throws leaves the layer unchanged;
//   - a decoded state encodes back to exactly the input bytes (an older file: to a version-3
//     file that decodes to the same state and encodes to itself);
//   - a decoded state can be used: a forward call that completes a chunk runs without a crash,
//     UB or an exception other than ovq::ArgumentError (which must leave the state unchanged).
//     Whether its outputs are finite is fuzz_mixers' business: a file may legitimately hold
//     values as large as FLT_MAX.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "fuzz_support.hpp"
#include "ovq/io/state_file.hpp"
#include "ovq/ovq.hpp"

namespace {

using namespace ovq;
using Bytes = std::vector<std::uint8_t>;
using fuzz::tokens_to_boundary;

constexpr std::size_t kHeader = 36;

// OVQ_FUZZ_TRACE=1: say what each input decoded to (for checking the seed corpus).
template <class... Parts>
void trace(const Parts&... parts) {
  static const bool on = [] {
    const char* v = std::getenv("OVQ_FUZZ_TRACE");
    return v != nullptr && v[0] == '1';
  }();
  if (on) std::fprintf(stderr, "  %s\n", detail::concat(parts...).c_str());
}

// Little-endian fields of the file, read without any check but the length.
class Fields {
 public:
  Fields(const Bytes& b, std::size_t pos) : b_(b), pos_(pos) {}
  bool ok() const { return ok_; }
  template <class T>
  T get() {
    T v{};
    if (pos_ + sizeof(T) > b_.size()) {
      ok_ = false;
      return v;
    }
    unsigned char raw[sizeof(T)];
    for (std::size_t i = 0; i < sizeof(T); ++i) raw[i] = b_[pos_ + i];  // little-endian hosts
    std::memcpy(&v, raw, sizeof(T));
    pos_ += sizeof(T);
    return v;
  }

 private:
  const Bytes& b_;
  std::size_t pos_;
  bool ok_ = true;
};

void fix_frame(Bytes& file) {
  if (file.size() < kHeader + 4) return;
  const std::uint64_t payload = file.size() - kHeader - 4;
  for (int i = 0; i < 8; ++i) file[28 + i] = static_cast<std::uint8_t>(payload >> (8 * i));
  const std::uint32_t crc = io::state_detail::crc32(file.data(), file.size() - 4);
  for (int i = 0; i < 4; ++i) file[file.size() - 4 + i] = static_cast<std::uint8_t>(crc >> (8 * i));
}

// ---- options as stored (see visit_options in ovq/io/state_file.hpp) ----

bool read_options(Fields& f, SelfAttentionOptions& o, std::uint32_t /*version*/) {
  o.beta = f.get<double>();
  const auto causal = f.get<std::uint32_t>();
  o.window = f.get<std::int64_t>();
  o.chunk = f.get<std::int64_t>();
  o.causal = causal != 0;
  return f.ok() && causal <= 1;
}

bool read_options(Fields& f, LinearAttentionOptions& o, std::uint32_t /*version*/) {
  o.beta = f.get<double>();
  const auto map = f.get<std::uint32_t>();
  const auto normalize = f.get<std::uint32_t>();
  o.decay = f.get<double>();
  o.eps = f.get<double>();
  o.chunk = f.get<std::int64_t>();
  o.feature_map = static_cast<kernels::FeatureMap>(map);
  o.normalize = normalize != 0;
  // The chunk sizes the state and the forward call that completes a chunk: modest ones only,
  // as for OVQ below.
  return f.ok() && map <= 2 && normalize <= 1 && o.chunk <= 4096;
}

bool read_options(Fields& f, VqAttentionOptions& o, std::uint32_t /*version*/) {
  o.beta = f.get<double>();
  o.chunk = f.get<std::int64_t>();
  return f.ok() && o.chunk <= 4096;  // modest chunks only, as for linear attention and OVQ
}

bool read_options(Fields& f, OvqOptions& o, std::uint32_t version) {
  o.capacity = f.get<std::int64_t>();
  o.chunk = f.get<std::int64_t>();
  o.beta = f.get<double>();
  const auto growth = f.get<std::uint32_t>();
  o.growth.alpha = f.get<double>();
  o.growth.rate = f.get<double>();
  const auto seeding = f.get<std::uint32_t>();
  o.seeding.seed = f.get<std::uint64_t>();
  const auto rate = f.get<std::uint32_t>();
  o.rate.eta = f.get<double>();
  const auto renormalize = f.get<std::uint32_t>();
  o.growth.kind = static_cast<Growth::Kind>(growth);
  o.seeding.kind = static_cast<Seeding::Kind>(seeding);
  o.rate.kind = static_cast<UpdateRate::Kind>(rate);
  o.renormalize = renormalize != 0;
  // Format version 3 added three fields (older files mean their defaults).
  std::uint32_t values = 0, bias = 1, update = 0;
  if (version >= 3) {
    values = f.get<std::uint32_t>();
    bias = f.get<std::uint32_t>();
    update = f.get<std::uint32_t>();
  }
  o.renormalize_values = values != 0;
  o.count_bias = bias != 0;
  o.value_update = static_cast<ValueUpdate>(update);
  // A mixer's capacity and chunk are the caller's choice (they size every state it makes);
  // the fuzzer only mirrors modest ones.
  return f.ok() && growth <= 2 && seeding <= 2 && rate <= 1 && renormalize <= 1 &&
         values <= 1 && bias <= 1 && update <= 1 && o.capacity <= 4096 && o.chunk <= 4096;
}

// dk and dv of the first state of a multi-head payload, and the VQ codebook size.
struct StateDims {
  std::int64_t dk = 4, dv = 4, codes = 4;
};
template <class S, class A>
StateDims read_dims(Fields& f, const SelfAttention<S, A>*) {
  StateDims d;
  d.dk = f.get<std::int64_t>();
  d.dv = f.get<std::int64_t>();
  return d;
}
template <class S, class A>
StateDims read_dims(Fields& f, const LinearAttention<S, A>*) {
  StateDims d;
  d.dk = f.get<std::int64_t>();
  d.dv = f.get<std::int64_t>();
  return d;
}
template <class S, class A>
StateDims read_dims(Fields& f, const VqAttention<S, A>*) {
  StateDims d;
  d.codes = f.get<std::int64_t>();
  d.dk = f.get<std::int64_t>();
  d.dv = f.get<std::int64_t>();
  return d;
}
template <class S, class A>
StateDims read_dims(Fields& f, const OvqAttention<S, A>*) {
  f.get<std::int64_t>();  // capacity
  f.get<std::int64_t>();  // chunk
  StateDims d;
  d.dk = f.get<std::int64_t>();
  d.dv = f.get<std::int64_t>();
  return d;
}

// ---- states ----

// The format version in a file's header (the bytes are at least a header long when they decode).
std::uint32_t file_version(const Bytes& file) {
  Fields f(file, 8);
  return f.get<std::uint32_t>();
}

template <class S>
RowMatrix<S> small_values(Index rows, Index cols, int salt) {
  RowMatrix<S> m(rows, cols);
  for (Index i = 0; i < rows; ++i)
    for (Index j = 0; j < cols; ++j)
      m(i, j) = static_cast<S>(0.125 * static_cast<double>((7 * i + 3 * j + salt) % 11 - 5));
  return m;
}

// The stream counters never go backwards (a wrapped 64-bit counter would; UBSan reports the
// overflow itself, this catches its effect in builds without it).
template <class S>
bool counters_grew(const KvCache<S>& before, const KvCache<S>& after) {
  return after.tokens() >= before.tokens();
}
template <class S>
bool counters_grew(const LinearState<S>& before, const LinearState<S>& after) {
  return after.tokens() >= before.tokens() && after.absorbed() >= before.absorbed();
}
template <class S>
bool counters_grew(const Dictionary<S>& before, const Dictionary<S>& after) {
  for (Index r = 0; r < after.size(); ++r)
    if (after.count(r) < (r < before.size() ? before.count(r) : 0)) return false;
  return true;
}
template <class S>
bool counters_grew(const VqState<S>& before, const VqState<S>& after) {
  return counters_grew(before.dictionary(), after.dictionary());
}
template <class S>
bool counters_grew(const OvqState<S>& before, const OvqState<S>& after) {
  return after.absorbed() >= before.absorbed() &&
         counters_grew(before.dictionary(), after.dictionary());
}

// Runs the mixer on a decoded state, far enough to write a chunk.
template <class Mixer>
void use_state(const Mixer& mixer, typename Mixer::State& state) {
  using S = typename Mixer::scalar_type;
  (void)state.tokens();
  (void)state.bytes();
  const Index dk = state.key_dim(), dv = state.value_dim();
  const Index chunk = mixer.options().chunk;
  const Index t = tokens_to_boundary(state, chunk, std::min<Index>(chunk, 16));
  if (t * (dk + dv) > (Index(1) << 18)) return;  // a legitimately large state: not worth the time
  const RowMatrix<S> q = small_values<S>(t, dk, 1), k = small_values<S>(t, dk, 2),
                     v = small_values<S>(t, dv, 3);
  RowMatrix<S> o(t, dv);
  const typename Mixer::State before = state;
  try {
    mixer.forward(state, q, k, v, o);
  } catch (const ArgumentError& e) {
    OVQ_FUZZ_CHECK(state == before, "forward on a loaded state threw but changed it: ", e.what());
    return;
  } catch (const std::exception& e) {
    OVQ_FUZZ_CHECK(false, "forward on a loaded state threw something other than "
                          "ovq::ArgumentError: ", e.what());
  }
  OVQ_FUZZ_CHECK(counters_grew(before, state),
                 "a stream counter of a loaded state went backwards (64-bit overflow)");
  (void)state.tokens();
}

template <class Mixer>
void check_single(const Mixer& mixer, const Bytes& file) {
  typename Mixer::State state;
  try {
    state = io::decode_state(mixer, file.data(), file.size());
  } catch (const FormatError& e) {
    trace("rejected: ", e.what());
    return;
  } catch (const std::exception& e) {
    OVQ_FUZZ_CHECK(false, "decode_state threw something other than ovq::FormatError: ",
                   e.what());
  }
  trace("decoded a state: dk=", state.key_dim(), " dv=", state.value_dim(),
        " tokens=", state.tokens());
  const Bytes encoded = io::encode_state(mixer, state);
  if (file_version(file) == io::kStateFormatVersion) {
    OVQ_FUZZ_CHECK(encoded == file, "a decoded state encodes to different bytes");
  } else {
    typename Mixer::State again;
    try {
      again = io::decode_state(mixer, encoded.data(), encoded.size());
    } catch (const std::exception& e) {
      OVQ_FUZZ_CHECK(false, "an older file, written back, does not decode: ", e.what());
    }
    OVQ_FUZZ_CHECK(again == state, "an older file, written back, decodes to another state");
    OVQ_FUZZ_CHECK(io::encode_state(mixer, again) == encoded,
                   "an older file, written back, encodes to different bytes");
  }
  use_state(mixer, state);
}

template <class Mixer>
void check_multi(MultiHead<Mixer>& layer, const Bytes& file) {
  using S = typename Mixer::scalar_type;
  const std::vector<typename Mixer::State> before = layer.states();
  const Bytes bytes_before = io::encode_state(layer);
  try {
    io::decode_state(layer, file.data(), file.size());
  } catch (const FormatError& e) {
    trace("rejected (multi-head): ", e.what());
    OVQ_FUZZ_CHECK(layer.states() == before, "a failed decode changed the layer: ", e.what());
    OVQ_FUZZ_CHECK(io::encode_state(layer) == bytes_before,
                   "a failed decode changed the layer's bytes: ", e.what());
    return;
  } catch (const std::exception& e) {
    OVQ_FUZZ_CHECK(false, "decode_state (MultiHead) threw something other than "
                          "ovq::FormatError: ", e.what());
  }
  trace("decoded a layer: ", layer.states().size(), " states, dk=", layer.key_dim(),
        " dv=", layer.value_dim());
  if (file_version(file) == io::kStateFormatVersion) {
    OVQ_FUZZ_CHECK(io::encode_state(layer) == file, "a decoded layer encodes to different bytes");
  } else {
    const Bytes encoded = io::encode_state(layer);
    const std::vector<typename Mixer::State> decoded = layer.states();
    try {
      io::decode_state(layer, encoded.data(), encoded.size());
    } catch (const std::exception& e) {
      OVQ_FUZZ_CHECK(false, "an older layer file, written back, does not decode: ", e.what());
    }
    OVQ_FUZZ_CHECK(layer.states() == decoded,
                   "an older layer file, written back, decodes to other states");
  }
  for (auto& state : layer.states()) (void)state.tokens();

  const Index t = tokens_to_boundary(layer.state(0, 0), layer.mixer().options().chunk,
                                     std::min<Index>(layer.mixer().options().chunk, 16));
  const Index rows_q = layer.batch() * layer.query_heads() * t;
  const Index rows_kv = layer.batch() * layer.kv_heads() * t;
  if (rows_q * (layer.key_dim() + layer.value_dim()) > (Index(1) << 18)) return;
  const RowMatrix<S> q = small_values<S>(rows_q, layer.key_dim(), 1);
  const RowMatrix<S> k = small_values<S>(rows_kv, layer.key_dim(), 2);
  const RowMatrix<S> v = small_values<S>(rows_kv, layer.value_dim(), 3);
  RowMatrix<S> o(rows_q, layer.value_dim());
  const std::vector<typename Mixer::State> loaded = layer.states();
  try {
    layer.forward(q, k, v, o);
  } catch (const ArgumentError& e) {
    OVQ_FUZZ_CHECK(layer.states() == loaded, "forward on a loaded layer threw but changed it: ",
                   e.what());
  } catch (const std::exception& e) {
    OVQ_FUZZ_CHECK(false, "forward on a loaded layer threw something other than "
                          "ovq::ArgumentError: ", e.what());
  }
}

template <class Mixer>
typename Mixer::State layer_state(const Mixer& mixer, const StateDims& d) {
  return mixer.make_state(d.dk, d.dv);
}
template <class S, class A>
VqState<S> layer_state(const VqAttention<S, A>& mixer, const StateDims& d) {
  return mixer.make_state(RowMatrix<S>::Zero(d.codes, d.dk), d.dv);
}

template <class Mixer>
void run(bool multi, const Bytes& file) {
  using Options = typename Mixer::Options;
  Fields f(file, kHeader);
  const std::uint32_t version = file.size() >= kHeader ? file_version(file) : 0;
  Options options;
  if (!read_options(f, options, version)) options = Options{};
  std::optional<Mixer> mixer;
  try {
    mixer.emplace(options);
  } catch (const ArgumentError&) {
    mixer.emplace(Options{});
  }
  if (!multi) {
    check_single(*mixer, file);
    return;
  }
  std::int64_t batch = f.get<std::int64_t>(), hq = f.get<std::int64_t>(),
               hkv = f.get<std::int64_t>();
  // Version 3: the layer's head betas (taken when they are a plausible list).
  std::vector<double> betas;
  if (version >= 3) {
    const std::int64_t n = f.get<std::int64_t>();
    for (std::int64_t i = 0; i < n && i < 64 && f.ok(); ++i) betas.push_back(f.get<double>());
    if (n != hq) betas.clear();
  }
  StateDims dims = read_dims(f, static_cast<const Mixer*>(nullptr));
  const bool plausible = f.ok() && batch >= 1 && batch <= 16 && hkv >= 1 && hkv <= 16 &&
                         batch * hkv <= 16 && hq >= 1 && hq <= 64 && hq % hkv == 0 &&
                         dims.dk >= 1 && dims.dk <= 256 &&
                         dims.dv >= 1 && dims.dv <= 256 && dims.codes >= 1 && dims.codes <= 256;
  if (!plausible) {
    batch = hq = hkv = 1;
    dims = StateDims{};
  }
  MultiHead<Mixer> layer(*mixer, batch, hq,
                         std::vector<typename Mixer::State>(static_cast<std::size_t>(hkv),
                                                            layer_state(*mixer, dims)));
  try {
    layer.set_head_betas(betas);
  } catch (const ArgumentError&) {
    // not betas this layer takes: the decode then refuses the file
  }
  check_multi(layer, file);
}

template <class S>
void run_scalar(std::uint32_t kind, bool multi, const Bytes& file) {
  switch (kind) {
    case 1: run<SelfAttention<S>>(multi, file); break;
    case 2: run<LinearAttention<S>>(multi, file); break;
    case 3: run<VqAttention<S>>(multi, file); break;
    default: run<OvqAttention<S>>(multi, file); break;
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  Bytes file;
  unsigned control = 0;
  if (size >= 8 && std::memcmp(data, "OVQSTATE", 8) == 0) {
    file.assign(data, data + size);
  } else {
    if (size == 0) return 0;
    control = data[0];
    file.assign(data + 1, data + size);
    if (control & 1u) fix_frame(file);
  }
  Fields header(file, 16);
  std::uint32_t kind = header.get<std::uint32_t>();
  std::uint32_t container = header.get<std::uint32_t>();
  std::uint32_t scalar = header.get<std::uint32_t>();
  if (control & 2u) {
    kind = 1 + (control >> 2) % 4;
    container = (control >> 4) & 1u;
    using io::state_detail::element_code;
    const bool bit5 = (control & 32u) != 0;
    scalar = (control & 64u) != 0 ? (bit5 ? element_code<bf16>() : element_code<fp16>())
                                  : (bit5 ? 8u : 4u);
  }
  kind = 1 + (kind + 3) % 4;  // 1..4 whatever the header says
  if (scalar == 8) {
    run_scalar<double>(kind, container != 0, file);
  } else if (scalar == io::state_detail::element_code<fp16>()) {
    run_scalar<fp16>(kind, container != 0, file);
  } else if (scalar == io::state_detail::element_code<bf16>()) {
    run_scalar<bf16>(kind, container != 0, file);
  } else {
    run_scalar<float>(kind, container != 0, file);
  }
  return 0;
}
