#pragma once
// Saving and loading mixer states: a versioned, checksummed binary format.
//
//   offset  size  field
//   0       8     magic "OVQSTATE"
//   8       4     format version (3; versions 1 and 2 are still read, see below)
//   12      4     byte-order tag 0x01020304, as written by the saving machine
//   16      4     mixer kind (1 self, 2 linear, 3 vq, 4 ovq)
//   20      4     container (0 one state, 1 multi-head layer)
//   24      4     element type: its size in bytes in the low byte (4 float32, 8 float64), the
//                 16-bit ones told apart in the next (258 float16, 514 bfloat16)
//   28      8     payload size P
//   36      P     payload: the mixer options, then (multi-head) batch, Hq, Hkv, the number of
//                 head betas (0 or Hq, i64) and the betas (f64 each), then each state
//   36 + P  4     CRC-32 of bytes [0, 36 + P)
//
// Everything is little-endian. Every option a state depends on is stored and must equal the
// loading mixer's, so a loaded state continues its stream exactly as if never saved. Loading
// checks each field, each size against the bytes left before allocating, every scalar for
// finiteness and every state invariant (counts sum to t, n <= N, pending < L, ...), and names
// the failing check in a FormatError. Saving is atomic (io/file.hpp).
//
// Payloads of one state (i64 integers, scalars of the file's type, rows one after the other;
// for the 16-bit types, what a state keeps in float, its sums and running means, is stored in
// float32, marked "compute" below):
//   self    dk, dv, keep_rows, tokens, rows; keys (rows x dk), values (rows x dv)
//   linear  dk, dv, chunk L, t, pending p; S (dk x dv, compute), z (dk, compute), pending keys
//           (p x dk, before the feature map), pending values (p x dv)  t: tokens folded into S, z
//   vq      codes S, dk, dv, chunk L, pending p; codebook (S x dk), mean values (S x dv,
//           compute), counts (S), pending codes (p), pending values (p x dv)
//   ovq     capacity, chunk L, dk, dv, n, t, pending p; D_k (n x dk, compute), D_v (n x dv,
//           compute), counts (n), pending keys (p x dk), pending values (p x dv)
//
// Version 2 (before OVQ's renormalize values, count bias and value update options, and the
// multi-head layer's head betas) is loaded as a file with those at their defaults (false, true,
// mean; no head betas); a loading mixer or layer set otherwise is refused, like any other option.
// Version 1 (before linear and VQ states kept the rows of their current chunk) is still loaded.
// Its self and ovq payloads are those of version 2. Its linear payload is dk, dv, tokens, S, z
// and its VQ payload codes, dk, dv, codebook, mean values, counts: a state that had folded every
// token in, loaded with no pending rows and the loading mixer's chunk length (which the options
// block checks), so its chunks are counted from the point it was saved at. Files are always
// written as version 3.
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "ovq/core/error.hpp"
#include "ovq/io/file.hpp"
#include "ovq/layers/multi_head.hpp"
#include "ovq/mixers/linear_attention.hpp"
#include "ovq/mixers/ovq_attention.hpp"
#include "ovq/mixers/self_attention.hpp"
#include "ovq/mixers/vq_attention.hpp"

namespace ovq::io {

inline constexpr std::uint32_t kStateFormatVersion = 3;
// The oldest version load_state and decode_state still read.
inline constexpr std::uint32_t kOldestStateFormatVersion = 1;

namespace state_detail {

inline constexpr char kMagic[8] = {'O', 'V', 'Q', 'S', 'T', 'A', 'T', 'E'};
inline constexpr std::size_t kHeaderSize = 36;
inline constexpr std::uint32_t kByteOrderTag = 0x01020304u;
// No state dimension comes near this; it keeps every size product far from overflow.
inline constexpr std::int64_t kMaxDim = std::int64_t(1) << 31;
// Token counts stay far below 2^63 so that continuing a loaded stream cannot overflow them.
inline constexpr std::int64_t kMaxTokens = std::int64_t(1) << 62;
// Head widths of a state whose storage is sized by the mixer (capacity x width) rather than by
// the rows in the file: a bound that no real head reaches, so a tiny file cannot demand a huge
// allocation.
inline constexpr std::int64_t kMaxWidth = std::int64_t(1) << 16;

// The header's element type field.
template <class Element>
constexpr std::uint32_t element_code() {
  if constexpr (std::is_same_v<Element, fp16>) return 2u | (1u << 8);
  if constexpr (std::is_same_v<Element, bf16>) return 2u | (2u << 8);
  return static_cast<std::uint32_t>(sizeof(Element));
}
inline std::string element_name_of(std::uint32_t code) {
  if (code == element_code<float>()) return "float32";
  if (code == element_code<double>()) return "float64";
  if (code == element_code<fp16>()) return "float16";
  if (code == element_code<bf16>()) return "bfloat16";
  return "no element type";
}

inline void check_tokens(const char* field, std::int64_t v) {
  if (v < 0 || v > kMaxTokens) {
    throw FormatError(detail::concat("state file: ", field, " = ", v, ", expected a value in [0, ",
                                     kMaxTokens, "]"));
  }
}

static_assert(std::numeric_limits<float>::is_iec559 && std::numeric_limits<double>::is_iec559,
              "state files store IEEE-754 scalars");

inline bool host_is_little_endian() {
  const std::uint32_t probe = 1;
  unsigned char first;
  std::memcpy(&first, &probe, 1);
  return first == 1;
}

inline std::uint32_t crc32(const unsigned char* data, std::size_t n) {
  static const std::array<std::uint32_t, 256> table = [] {
    std::array<std::uint32_t, 256> t{};
    for (std::uint32_t i = 0; i < 256; ++i) {
      std::uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1u) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
      t[i] = c;
    }
    return t;
  }();
  std::uint32_t c = 0xFFFFFFFFu;
  for (std::size_t i = 0; i < n; ++i) c = table[(c ^ data[i]) & 0xFFu] ^ (c >> 8);
  return c ^ 0xFFFFFFFFu;
}

class Writer {
 public:
  template <class T>
  void put(T value) {
    static_assert(std::is_arithmetic_v<T> || is_half_v<T>, "plain values only");
    unsigned char b[sizeof(T)];
    std::memcpy(b, &value, sizeof(T));
    if (!host_is_little_endian()) std::reverse(b, b + sizeof(T));
    bytes_.insert(bytes_.end(), b, b + sizeof(T));
  }
  template <class Scalar>
  void put_rows(ConstRowsView<Scalar> m) {
    for (Index i = 0; i < m.rows; ++i)
      for (Index j = 0; j < m.cols; ++j) put(m.row(i)[j]);
  }
  std::vector<unsigned char>& bytes() { return bytes_; }

 private:
  std::vector<unsigned char> bytes_;
};

class Reader {
 public:
  Reader(const unsigned char* data, std::size_t size) : data_(data), size_(size) {}

  std::size_t remaining() const { return size_ - pos_; }

  template <class T>
  T get(const char* field) {
    need(sizeof(T), field);
    unsigned char b[sizeof(T)];
    std::memcpy(b, data_ + pos_, sizeof(T));
    if (!host_is_little_endian()) std::reverse(b, b + sizeof(T));
    pos_ += sizeof(T);
    T value;
    std::memcpy(&value, b, sizeof(T));
    return value;
  }

  std::int64_t get_dim(const char* field, std::int64_t min) {
    const auto v = get<std::int64_t>(field);
    if (v < min || v > kMaxDim) {
      throw FormatError(detail::concat("state file: ", field, " = ", v, ", expected a value in [",
                                       min, ", ", kMaxDim, "]"));
    }
    return v;
  }

  // rows x cols finite scalars; the size is checked against the bytes left before allocating.
  template <class Scalar>
  RowMatrix<Scalar> get_rows(std::int64_t rows, std::int64_t cols, const char* field) {
    need_items(rows, cols, sizeof(Scalar), field);
    RowMatrix<Scalar> m(rows, cols);
    for (Index i = 0; i < rows; ++i) {
      for (Index j = 0; j < cols; ++j) {
        m(i, j) = get<Scalar>(field);
        if (detail::FloatBits<Scalar>::not_finite(m(i, j))) {
          throw FormatError(detail::concat("state file: ", field, "(", i, ", ", j, ") = ",
                                           m(i, j), ", expected a finite value"));
        }
      }
    }
    return m;
  }

  // a x b items of `size` bytes each, computed without wrapping around (dimensions up to 2^31
  // make a product past 64 bits).
  void need_items(std::int64_t a, std::int64_t b, std::size_t size, const char* field) const {
    const long double bytes = static_cast<long double>(a) * static_cast<long double>(b) *
                              static_cast<long double>(size);
    if (bytes > static_cast<long double>(remaining())) {
      throw FormatError(detail::concat("state file: truncated payload: ", field, " needs ", a,
                                       " x ", b, " x ", size, " bytes, ", remaining(), " left"));
    }
  }

  void need(std::size_t n, const char* field) const {
    if (n > remaining()) {
      throw FormatError(detail::concat("state file: truncated payload: ", field, " needs ", n,
                                       " bytes, ", remaining(), " left"));
    }
  }

 private:
  const unsigned char* data_;
  std::size_t size_;
  std::size_t pos_ = 0;
};

[[noreturn]] inline void invalid(const std::string& what) {
  throw FormatError("state file: " + what);
}

// Each options struct as a list of named fields: f(name, field, since) for every one of them,
// `since` the format version that added the field. Writing and checking-on-load both walk this
// list, so they can never disagree. O is the struct, const or not (the Python bindings read
// keyword arguments into the same fields).
template <class O, class Options>
using if_options_t = std::enable_if_t<std::is_same_v<std::remove_const_t<O>, Options>>;

template <class O, class F>
auto visit_options(O& o, F&& f) -> if_options_t<O, SelfAttentionOptions> {
  f("beta", o.beta);
  f("causal", o.causal);
  f("window", o.window);
  f("chunk", o.chunk);
}
template <class O, class F>
auto visit_options(O& o, F&& f) -> if_options_t<O, LinearAttentionOptions> {
  f("beta", o.beta);
  f("feature_map", o.feature_map);
  f("normalize", o.normalize);
  f("decay", o.decay);
  f("eps", o.eps);
  f("chunk", o.chunk);
}
template <class O, class F>
auto visit_options(O& o, F&& f) -> if_options_t<O, VqAttentionOptions> {
  f("beta", o.beta);
  f("chunk", o.chunk);
}
template <class O, class F>
auto visit_options(O& o, F&& f) -> if_options_t<O, OvqOptions> {
  f("capacity", o.capacity);
  f("chunk", o.chunk);
  f("beta", o.beta);
  f("growth", o.growth.kind);
  f("growth alpha", o.growth.alpha);
  f("growth rate", o.growth.rate);
  f("seeding", o.seeding.kind);
  f("seed", o.seeding.seed);
  f("update rate", o.rate.kind);
  f("eta", o.rate.eta);
  f("renormalize", o.renormalize);
  f("renormalize values", o.renormalize_values, 3u);
  f("count bias", o.count_bias, 3u);
  f("value update", o.value_update, 3u);
}

// Options are stored as fixed-width fields: enums and bools as u32, integers as i64/u64,
// reals as f64.
template <class T>
auto stored(T v) {
  if constexpr (std::is_enum_v<T> || std::is_same_v<T, bool>) {
    return static_cast<std::uint32_t>(v);
  } else if constexpr (std::is_same_v<T, std::uint64_t>) {
    return v;
  } else if constexpr (std::is_integral_v<T>) {
    return static_cast<std::int64_t>(v);
  } else {
    return static_cast<double>(v);
  }
}

template <class Options>
void put_options(Writer& w, const Options& options) {
  visit_options(options, [&](const char*, auto v, std::uint32_t = 1) { w.put(stored(v)); });
}

// A file of format `version` stores the fields added up to it; the others are taken at their
// defaults (a default-constructed Options).
template <class Options>
void check_options(Reader& r, const Options& expected, std::uint32_t version) {
  std::vector<std::vector<unsigned char>> defaults;
  const Options default_options{};
  visit_options(default_options, [&](const char*, auto v, std::uint32_t = 1) {
    const auto s = stored(v);
    const auto* p = reinterpret_cast<const unsigned char*>(&s);
    defaults.emplace_back(p, p + sizeof s);
  });
  std::size_t field = 0;
  visit_options(expected, [&](const char* name, auto v, std::uint32_t since = 1) {
    using S = decltype(stored(v));
    S got;
    if (since <= version) {
      got = r.get<S>(name);
    } else {
      std::memcpy(&got, defaults[field].data(), sizeof got);
    }
    ++field;
    // Bitwise for reals: the loaded state must continue exactly as the saved one would.
    if (std::memcmp(&got, &static_cast<const S&>(stored(v)), sizeof(S)) != 0) {
      invalid(detail::concat("option '", name, "' = ", got,
                             since <= version ? "" : " (the default of older files)",
                             ", expected ", stored(v), " (the loading mixer's)"));
    }
  });
}

template <class Mixer>
struct MixerKind;
template <class S, class A>
struct MixerKind<SelfAttention<S, A>> : std::integral_constant<std::uint32_t, 1> {};
template <class S, class A>
struct MixerKind<LinearAttention<S, A>> : std::integral_constant<std::uint32_t, 2> {};
template <class S, class A>
struct MixerKind<VqAttention<S, A>> : std::integral_constant<std::uint32_t, 3> {};
template <class S, class A>
struct MixerKind<OvqAttention<S, A>> : std::integral_constant<std::uint32_t, 4> {};

// ---- one state of each kind ----

template <class S, class A>
void put_state(Writer& w, const SelfAttention<S, A>&, const KvCache<S>& s) {
  w.put<std::int64_t>(s.key_dim());
  w.put<std::int64_t>(s.value_dim());
  w.put<std::int64_t>(s.keep_rows());
  w.put<std::int64_t>(s.tokens());
  w.put<std::int64_t>(s.size());
  w.put_rows(s.keys());
  w.put_rows(s.values());
}

// Self-attention and OVQ payloads are the same in versions 1 and 2.
template <class S, class A>
KvCache<S> get_state(Reader& r, const SelfAttention<S, A>& mixer, std::uint32_t) {
  const auto dk = r.get_dim("dk", 1);
  const auto dv = r.get_dim("dv", 1);
  const auto keep = r.get<std::int64_t>("keep_rows");
  const auto tokens = r.get<std::int64_t>("tokens");
  const auto size = r.get_dim("rows", 0);
  check_tokens("tokens", tokens);
  KvCache<S> state = mixer.make_state(dk, dv);
  if (keep != state.keep_rows())
    invalid(detail::concat("keep_rows = ", keep, ", expected ", state.keep_rows()));
  if (tokens < size) invalid(detail::concat("tokens = ", tokens, ", expected >= rows = ", size));
  if (keep >= 0 && size > keep)
    invalid(detail::concat("rows = ", size, ", expected <= keep_rows = ", keep));
  const RowMatrix<S> k = r.get_rows<S>(size, dk, "keys");
  const RowMatrix<S> v = r.get_rows<S>(size, dv, "values");
  state.assign(rows_view(k), rows_view(v), tokens);
  return state;
}

template <class S, class A>
void put_state(Writer& w, const LinearAttention<S, A>&, const LinearState<S>& s) {
  w.put<std::int64_t>(s.key_dim());
  w.put<std::int64_t>(s.value_dim());
  w.put<std::int64_t>(s.chunk());
  w.put<std::int64_t>(s.absorbed());
  w.put<std::int64_t>(s.pending());
  w.put_rows(rows_view(s.kv()));
  w.put_rows(rows_view(s.k_sum()));
  w.put_rows(s.pending_keys());
  w.put_rows(s.pending_values());
}

// The chunk length stored in a payload must be the loading mixer's, and pending < chunk.
inline void check_chunk(std::int64_t chunk, std::int64_t expected, std::int64_t pending) {
  if (chunk != expected)
    invalid(detail::concat("chunk = ", chunk, ", expected ", expected, " (the loading mixer's)"));
  if (pending >= chunk)
    invalid(detail::concat("pending = ", pending, ", expected < chunk = ", chunk));
}

// Widths of a state whose pending buffer (chunk x width) is sized by the mixer: see kMaxWidth.
inline void check_widths(std::int64_t dk, std::int64_t dv) {
  if (dk > kMaxWidth || dv > kMaxWidth)
    invalid(detail::concat("(dk, dv) = (", dk, ", ", dv, "), expected at most ", kMaxWidth,
                           " each (the loader's bound on head widths)"));
}

template <class S, class A>
LinearState<S> get_state(Reader& r, const LinearAttention<S, A>& mixer, std::uint32_t version) {
  const auto dk = r.get_dim("dk", 1);
  const auto dv = r.get_dim("dv", 1);
  std::int64_t chunk = mixer.options().chunk, t = 0, pending = 0;
  if (version == 1) {
    t = r.get<std::int64_t>("tokens");
    check_tokens("tokens", t);
  } else {
    chunk = r.get_dim("chunk", 1);
    t = r.get<std::int64_t>("t");
    pending = r.get_dim("pending", 0);
    check_chunk(chunk, mixer.options().chunk, pending);
    check_tokens("t", t);
    check_tokens("t + pending", t + pending);
  }
  using C = compute_t<S>;
  r.need_items(dk, dv + 1, sizeof(C), "S and z");
  check_widths(dk, dv);
  const RowMatrix<C> kv = r.get_rows<C>(dk, dv, "S");
  const RowMatrix<C> z = r.get_rows<C>(1, dk, "z");
  const RowMatrix<S> pk = r.get_rows<S>(pending, dk, "pending keys");
  const RowMatrix<S> pv = r.get_rows<S>(pending, dv, "pending values");
  LinearState<S> state = mixer.make_state(dk, dv);
  state.kv() = kv;
  state.k_sum() = z;
  state.restore(t, rows_view(pk), rows_view(pv));
  return state;
}

// keys: VQ's codebook (elements) or OVQ's D_k (running means); then the mean values and counts.
template <class Keys, class S>
void put_dictionary_rows(Writer& w, ConstRowsView<Keys> keys, const Dictionary<S>& d) {
  w.put_rows(keys);
  w.put_rows(d.mean_values());
  for (Index r = 0; r < d.size(); ++r) w.put<std::int64_t>(d.count(r));
}

template <class S, class A>
void put_state(Writer& w, const VqAttention<S, A>&, const VqState<S>& s) {
  w.put<std::int64_t>(s.codebook_size());
  w.put<std::int64_t>(s.key_dim());
  w.put<std::int64_t>(s.value_dim());
  w.put<std::int64_t>(s.chunk());
  w.put<std::int64_t>(s.pending());
  put_dictionary_rows(w, s.dictionary().keys(), s.dictionary());
  for (Index i = 0; i < s.pending(); ++i) w.put<std::int64_t>(s.pending_codes()[i]);
  w.put_rows(s.pending_values());
}

inline std::int64_t get_count(Reader& r) {
  const auto c = r.get<std::int64_t>("count");
  if (c < 0) invalid(detail::concat("count = ", c, ", expected >= 0"));
  return c;
}

template <class S, class A>
VqState<S> get_state(Reader& r, const VqAttention<S, A>& mixer, std::uint32_t version) {
  const auto codes = r.get_dim("codebook size", 1);
  const auto dk = r.get_dim("dk", 1);
  const auto dv = r.get_dim("dv", 1);
  std::int64_t pending = 0;
  if (version != 1) {
    const auto chunk = r.get_dim("chunk", 1);
    pending = r.get_dim("pending", 0);
    check_chunk(chunk, mixer.options().chunk, pending);
  }
  using C = compute_t<S>;
  r.need_items(codes, dk, sizeof(S), "codebook");
  check_widths(dk, dv);
  // The codebook in the element type, the mean values in the compute type (float for 16-bit
  // elements); dk and dv are bounded now, so the bytes a code cannot wrap.
  r.need_items(codes, dk * Index(sizeof(S)) + dv * Index(sizeof(C)), 1,
               "codebook and mean values");
  const RowMatrix<S> codebook = r.get_rows<S>(codes, dk, "codebook");
  const RowMatrix<C> values = r.get_rows<C>(codes, dv, "mean values");
  std::vector<std::int64_t> counts(static_cast<std::size_t>(codes));
  std::int64_t total = 0;
  for (std::int64_t& count : counts) {
    count = get_count(r);
    if (count > kMaxTokens - total) invalid(detail::concat("counts sum past ", kMaxTokens));
    total += count;
  }
  if (pending > kMaxTokens - total)
    invalid(detail::concat("counts + pending sum past ", kMaxTokens));
  r.need_items(pending, 8, 1, "pending codes");
  std::vector<Index> pending_codes(static_cast<std::size_t>(pending));
  for (Index i = 0; i < pending; ++i) {
    const auto c = r.get<std::int64_t>("pending code");
    if (c < 0 || c >= codes)
      invalid(detail::concat("pending code ", i, " = ", c, ", expected a value in [0, ", codes,
                             ") (the codebook size)"));
    pending_codes[static_cast<std::size_t>(i)] = static_cast<Index>(c);
  }
  const RowMatrix<S> pv = r.get_rows<S>(pending, dv, "pending values");
  VqState<S> state = mixer.make_state(codebook, dv);
  Dictionary<S>& d = state.dictionary();
  const DictionaryRows<S> rows = d.rows();
  for (Index c = 0; c < codes; ++c) {
    std::copy_n(values.row(c).data(), dv, rows.mean_values.row(c));
    d.publish(c);
    d.set_count(c, counts[static_cast<std::size_t>(c)]);
  }
  state.restore_pending(pending_codes.data(), rows_view(pv));
  return state;
}

template <class S, class A>
void put_state(Writer& w, const OvqAttention<S, A>&, const OvqState<S>& s) {
  const Dictionary<S>& d = s.dictionary();
  w.put<std::int64_t>(s.capacity());
  w.put<std::int64_t>(s.chunk());
  w.put<std::int64_t>(s.key_dim());
  w.put<std::int64_t>(s.value_dim());
  w.put<std::int64_t>(d.size());
  w.put<std::int64_t>(s.absorbed());
  w.put<std::int64_t>(s.pending());
  put_dictionary_rows(w, d.mean_keys(), d);
  w.put_rows(s.pending_keys());
  w.put_rows(s.pending_values());
}

template <class S, class A>
OvqState<S> get_state(Reader& r, const OvqAttention<S, A>& mixer, std::uint32_t) {
  const auto capacity = r.get_dim("capacity", 1);
  const auto chunk = r.get_dim("chunk", 1);
  const auto dk = r.get_dim("dk", 1);
  const auto dv = r.get_dim("dv", 1);
  const auto n = r.get_dim("n", 0);
  const auto t = r.get<std::int64_t>("t");
  const auto pending = r.get_dim("pending", 0);
  const OvqOptions& opt = mixer.options();
  if (capacity != opt.capacity || chunk != opt.chunk)
    invalid(detail::concat("(capacity, chunk) = (", capacity, ", ", chunk, "), expected (",
                           opt.capacity, ", ", opt.chunk, ")"));
  if (n > capacity) invalid(detail::concat("n = ", n, ", expected <= capacity = ", capacity));
  if (pending >= chunk)
    invalid(detail::concat("pending = ", pending, ", expected < chunk = ", chunk));
  check_tokens("t", t);
  if (t % chunk != 0)
    invalid(detail::concat("t = ", t, ", expected a multiple of the chunk ", chunk, " >= 0"));
  if ((t == 0) != (n == 0))
    invalid(detail::concat("n = ", n, " with t = ", t, ", expected n = 0 exactly when t = 0"));
  using C = compute_t<S>;
  r.need_items(n, dk + dv, sizeof(C), "dictionary");
  if (dk > kMaxWidth || dv > kMaxWidth)
    invalid(detail::concat("(dk, dv) = (", dk, ", ", dv, "), expected at most ", kMaxWidth,
                           " each (the loader's bound on head widths)"));
  const RowMatrix<C> keys = r.get_rows<C>(n, dk, "D_k");
  const RowMatrix<C> values = r.get_rows<C>(n, dv, "D_v");
  OvqState<S> state = mixer.make_state(dk, dv);
  std::int64_t total = 0;
  for (Index i = 0; i < n; ++i) {
    const std::int64_t c = get_count(r);
    if (c > t - total) invalid(detail::concat("counts sum past t = ", t));
    total += c;
    state.dictionary().push_means(keys.row(i).data(), values.row(i).data(), c);
  }
  if (total != t) invalid(detail::concat("counts sum to ", total, ", expected t = ", t));
  const RowMatrix<S> pk = r.get_rows<S>(pending, dk, "pending keys");
  const RowMatrix<S> pv = r.get_rows<S>(pending, dv, "pending values");
  state.restore(t, rows_view(pk), rows_view(pv));
  return state;
}

// ---- framing ----

inline void put_header(Writer& w, std::uint32_t kind, std::uint32_t container,
                       std::uint32_t scalar_size) {
  for (char c : kMagic) w.put(static_cast<unsigned char>(c));
  w.put(kStateFormatVersion);
  w.put(kByteOrderTag);
  w.put(kind);
  w.put(container);
  w.put(scalar_size);
  w.put<std::uint64_t>(0);  // payload size, patched by finish()
}

inline std::vector<unsigned char> finish(Writer& w) {
  std::vector<unsigned char>& b = w.bytes();
  const std::uint64_t payload = b.size() - kHeaderSize;
  Writer size_field;
  size_field.put(payload);
  std::copy(size_field.bytes().begin(), size_field.bytes().end(), b.begin() + 28);
  w.put(crc32(b.data(), b.size()));
  return b;
}

// Checks the frame and returns a reader over the payload; *version: the file's format version.
inline Reader open_frame(const unsigned char* data, std::size_t size, std::uint32_t kind,
                         std::uint32_t container, std::uint32_t scalar_size,
                         std::uint32_t* version_out) {
  if (data == nullptr && size != 0) invalid("no data");
  if (size < kHeaderSize + 4)
    invalid(detail::concat("truncated: ", size, " bytes, expected at least ", kHeaderSize + 4));
  if (std::memcmp(data, kMagic, sizeof kMagic) != 0) invalid("bad magic, expected \"OVQSTATE\"");
  Reader h(data + sizeof kMagic, kHeaderSize - sizeof kMagic);
  const auto version = h.get<std::uint32_t>("version");
  if (version < kOldestStateFormatVersion || version > kStateFormatVersion)
    invalid(detail::concat("format version ", version, ", expected ", kOldestStateFormatVersion,
                           " to ", kStateFormatVersion));
  *version_out = version;
  const auto order = h.get<std::uint32_t>("byte order");
  if (order != kByteOrderTag) invalid("byte order: written big-endian, expected little-endian");
  const auto got_kind = h.get<std::uint32_t>("kind");
  if (got_kind != kind)
    invalid(detail::concat("mixer kind ", got_kind, ", expected ", kind,
                           " (1 self, 2 linear, 3 vq, 4 ovq)"));
  const auto got_container = h.get<std::uint32_t>("container");
  if (got_container != container)
    invalid(detail::concat("container ", got_container, ", expected ", container,
                           " (0 one state, 1 multi-head layer)"));
  const auto got_scalar = h.get<std::uint32_t>("scalar size");
  if (got_scalar != scalar_size)
    invalid(detail::concat("scalar type of ", got_scalar & 0xffu, " bytes, expected ",
                           scalar_size & 0xffu, " bytes (", element_name_of(scalar_size),
                           "; the file's: ", element_name_of(got_scalar), ", code ", got_scalar,
                           ")"));
  const auto payload = h.get<std::uint64_t>("payload size");
  if (payload != size - kHeaderSize - 4)
    invalid(detail::concat("payload size ", payload, ", expected ", size - kHeaderSize - 4,
                           " (truncated or extended file)"));
  Reader tail(data + size - 4, 4);
  if (tail.get<std::uint32_t>("checksum") != crc32(data, size - 4))
    invalid("checksum mismatch: the file is corrupted");
  return Reader(data + kHeaderSize, static_cast<std::size_t>(payload));
}

inline void expect_end(const Reader& r) {
  if (r.remaining() != 0)
    invalid(detail::concat(r.remaining(), " unexpected bytes after the last state"));
}

}  // namespace state_detail

// ---- one state ----

template <class Mixer>
std::vector<unsigned char> encode_state(const Mixer& mixer, const typename Mixer::State& state) {
  using namespace state_detail;
  using S = typename Mixer::scalar_type;
  mixer.check_state("encode_state", state);
  Writer w;
  put_header(w, MixerKind<Mixer>::value, 0, element_code<S>());
  put_options(w, mixer.options());
  put_state(w, mixer, state);
  return finish(w);
}

template <class Mixer>
typename Mixer::State decode_state(const Mixer& mixer, const unsigned char* data, std::size_t size) {
  using namespace state_detail;
  using S = typename Mixer::scalar_type;
  std::uint32_t version = 0;
  Reader r = open_frame(data, size, MixerKind<Mixer>::value, 0, element_code<S>(), &version);
  check_options(r, mixer.options(), version);
  typename Mixer::State state = get_state(r, mixer, version);
  expect_end(r);
  return state;
}

template <class Mixer>
void save_state(const std::string& path, const Mixer& mixer, const typename Mixer::State& state) {
  write_file_atomic(path, encode_state(mixer, state), "save_state");
}

template <class Mixer>
typename Mixer::State load_state(const std::string& path, const Mixer& mixer) {
  const std::vector<unsigned char> bytes = read_file(path, "load_state");
  return decode_state(mixer, bytes.data(), bytes.size());
}

// ---- a multi-head layer: every (batch, key/value head) state ----

template <class Mixer>
std::vector<unsigned char> encode_state(const MultiHead<Mixer>& layer) {
  using namespace state_detail;
  using S = typename Mixer::scalar_type;
  Writer w;
  put_header(w, MixerKind<Mixer>::value, 1, element_code<S>());
  put_options(w, layer.mixer().options());
  w.put<std::int64_t>(layer.batch());
  w.put<std::int64_t>(layer.query_heads());
  w.put<std::int64_t>(layer.kv_heads());
  const std::vector<double> betas = layer.head_betas();
  w.put<std::int64_t>(static_cast<std::int64_t>(betas.size()));
  for (double b : betas) w.put(b);
  for (const auto& s : layer.states()) put_state(w, layer.mixer(), s);
  return finish(w);
}

// Replaces the layer's states; the layer is unchanged if anything fails.
template <class Mixer>
void decode_state(MultiHead<Mixer>& layer, const unsigned char* data, std::size_t size) {
  using namespace state_detail;
  using S = typename Mixer::scalar_type;
  std::uint32_t version = 0;
  Reader r = open_frame(data, size, MixerKind<Mixer>::value, 1, element_code<S>(), &version);
  check_options(r, layer.mixer().options(), version);
  const auto batch = r.get<std::int64_t>("batch");
  const auto hq = r.get<std::int64_t>("query heads");
  const auto hkv = r.get<std::int64_t>("kv heads");
  if (batch != layer.batch() || hq != layer.query_heads() || hkv != layer.kv_heads())
    invalid(detail::concat("(batch, query heads, kv heads) = (", batch, ", ", hq, ", ", hkv,
                           "), expected (", layer.batch(), ", ", layer.query_heads(), ", ",
                           layer.kv_heads(), ")"));
  const std::vector<double> want_betas = layer.head_betas();
  const auto n_betas = version >= 3 ? r.get<std::int64_t>("head betas") : std::int64_t(0);
  if (n_betas != static_cast<std::int64_t>(want_betas.size()))
    invalid(detail::concat("head betas: ", n_betas, ", expected ", want_betas.size(),
                           " (the loading layer's)"));
  for (std::size_t h = 0; h < want_betas.size(); ++h) {
    const auto b = r.get<double>("head beta");
    if (std::memcmp(&b, &want_betas[h], sizeof b) != 0)
      invalid(detail::concat("head beta ", h, " = ", b, ", expected ", want_betas[h],
                             " (the loading layer's)"));
  }
  std::vector<typename Mixer::State> states;
  for (std::size_t i = 0; i < layer.states().size(); ++i) {
    states.push_back(get_state(r, layer.mixer(), version));
    if (states.back().key_dim() != layer.key_dim() ||
        states.back().value_dim() != layer.value_dim())
      invalid(detail::concat("state ", i, " has (dk, dv) = (", states.back().key_dim(), ", ",
                             states.back().value_dim(), "), expected (", layer.key_dim(), ", ",
                             layer.value_dim(), ")"));
  }
  expect_end(r);
  layer.states().swap(states);
}

template <class Mixer>
void save_state(const std::string& path, const MultiHead<Mixer>& layer) {
  write_file_atomic(path, encode_state(layer), "save_state");
}

template <class Mixer>
void load_state(const std::string& path, MultiHead<Mixer>& layer) {
  const std::vector<unsigned char> bytes = read_file(path, "load_state");
  decode_state(layer, bytes.data(), bytes.size());
}

}  // namespace ovq::io
