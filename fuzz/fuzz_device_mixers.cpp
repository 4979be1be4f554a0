// Fuzz target: the device mixers (ovq/cuda/*.hpp), run by the host emulation of a GPU
// (ovq/cuda/emulator.hpp: what a GPU computes, block by block), against the CPU's multi-head
// layer over the same heads. The bytes choose what the kernels tile differently from the CPU:
// widths 1 to 256 (padded to the kernels' 32, 64, 128 and 256) and past them, batches and grouped
// queries, device views at any strides (heads interleaved as in a (B, T, H, d) tensor, padded
// rows, 16-bit rows off their 16-byte alignment), calls of any length across chunks and merge
// blocks, forwards with their log-sum-exp, steps as a captured CUDA graph runs them, one beta per
// query head, states taken to the host and back, and now and then a wrong shape or a non-finite
// value.
//
// Bytes: four seed the value stream; then the element (float, double, bf16, fp16), the mixer,
// batch, heads and widths, the views' layouts, the options, and the calls.
//
// Oracle:
//   - the device refuses the options (an ArgumentError) the CPU refuses, and only those, and
//     head widths past 256 at make_state;
//   - a call of a wrong shape throws ovq::ArgumentError on the device and changes nothing;
//   - a call with a non-finite input (which the CPU refuses) runs on the device and faults: the
//     next state.synchronize() throws an ArgumentError and the state is as it was;
//   - otherwise the device and the CPU accept or refuse a call alike; the device writes every
//     output entry (outputs start as NaN) and nothing around its views, and its outputs and
//     log-sum-exps are within the element's bound of the CPU's;
//   - after the calls, the states (to_host) against the CPU's: self-attention's caches and VQ's
//     states equal; OVQ's dictionaries equal, the delta rule's value rows to the bound (float and
//     16-bit: the CPU's portable kernels form the device's scores, so every key goes to the same
//     row); linear attention's sums to the bound;
//   - the stream of the accepted calls, fed to a fresh device state as one forward, gives the
//     same bits: every read token's output (unless queries read later keys: non-causal
//     self-attention), and the state.
// Double OVQ-attention is left out: its updates sum in different widths on the two sides, so a
// near tie may send a key to another row, which is no defect.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "fuzz_options.hpp"
#include "fuzz_support.hpp"
#include "ovq/cuda/emulator.hpp"
#include "ovq/cuda/linear_attention.hpp"
#include "ovq/cuda/ovq_attention.hpp"
#include "ovq/cuda/self_attention.hpp"
#include "ovq/cuda/vq_attention.hpp"
#include "ovq/ovq.hpp"

namespace {

using namespace ovq;
using cuda::Emulator;
using fuzz::describe;
using fuzz::Input;
using fuzz::Trace;

// ---- bounds and comparisons -----------------------------------------------------------------

// Normalised error allowed between the device's outputs and the CPU's: a few times what the tests
// allow against the double references (the two sides sum in different orders, and the device
// rounds a 16-bit read's weights before P V), far below what a wrong index or mask gives.
template <class S>
constexpr double output_bound() {
  if constexpr (std::is_same_v<S, double>) {
    return 1e-10;
  } else if constexpr (std::is_same_v<S, float>) {
    return 1e-4;
  } else if constexpr (std::is_same_v<S, bf16>) {
    return 3e-2;
  } else {
    return 6e-3;
  }
}
// The same for sums kept in the compute type (linear attention's state, OVQ's delta-rule rows).
template <class S>
constexpr double state_bound() {
  return std::is_same_v<S, double> ? 1e-10 : 1e-4;
}

template <class S>
std::vector<double> as_doubles(const S* data, Index n) {
  std::vector<double> out(static_cast<std::size_t>(n));
  for (Index i = 0; i < n; ++i)
    out[static_cast<std::size_t>(i)] = static_cast<double>(widen(data[i]));
  return out;
}
template <class M>
std::vector<double> as_doubles(const M& m) {
  return as_doubles(m.data(), static_cast<Index>(m.size()));
}

// Normwise relative error of a against b (0 when both are 0); an entry that is not finite on
// either side must be the same on both.
double relative_error(const std::vector<double>& a, const std::vector<double>& b) {
  if (a.size() != b.size()) return std::numeric_limits<double>::infinity();
  double diff = 0, norm = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (!std::isfinite(a[i]) || !std::isfinite(b[i])) {
      if (!(a[i] == b[i])) return std::numeric_limits<double>::infinity();
      continue;
    }
    diff += (a[i] - b[i]) * (a[i] - b[i]);
    norm += b[i] * b[i];
  }
  return diff == 0 ? 0.0 : std::sqrt(diff / std::max(norm, 1e-300));
}

template <class S>
bool same_bits(const RowMatrix<S>& a, const RowMatrix<S>& b) {
  return a.rows() == b.rows() && a.cols() == b.cols() &&
         (a.size() == 0 ||
          std::memcmp(a.data(), b.data(), sizeof(S) * static_cast<std::size_t>(a.size())) == 0);
}

// ---- device tensors -------------------------------------------------------------------------

// How a call's Q, K, V or O sit in "device" memory (the emulation's device memory is host memory).
struct Layout {
  bool token_major = false;  // the heads of a token side by side, as in a (B, T, H, d) tensor
  Index pad = 0;             // entries after each row
  Index shift = 0;           // entries before the first (16-bit rows off their alignment)
};

Layout pick_layout(Input& in) {
  const unsigned b = in.byte();
  Layout l;
  l.token_major = (b & 1u) != 0;
  l.pad = (b & 2u) != 0 ? 1 + (b >> 4) % 8 : 0;
  l.shift = (b & 4u) != 0 ? 1 : 0;
  return l;
}

std::string describe(const Layout& l) {
  return detail::concat(l.token_major ? "token-major" : "head-major", " pad=", l.pad,
                        " shift=", l.shift);
}

// `heads` x `rows` x `cols` entries at a layout's strides in a host buffer standing for device
// memory, every other entry NaN: a kernel that reads past a row folds a NaN into its result, and
// one that writes past it is seen.
template <class S>
class DeviceTensor {
 public:
  DeviceTensor(Index heads, Index rows, Index cols, Layout layout)
      : heads_(heads), rows_(rows), cols_(cols), shift_(layout.shift) {
    const Index width = cols + layout.pad;
    row_stride_ = layout.token_major ? heads * width : width;
    head_stride_ = layout.token_major ? width : rows * width;
    data_.assign(static_cast<std::size_t>(shift_ + heads * rows * width + 1), poison());
  }

  static S poison() { return std::numeric_limits<S>::quiet_NaN(); }

  cuda::HeadsView<S> view() {
    return {data_.data() + shift_, heads_, rows_, cols_, head_stride_, row_stride_};
  }

  // m: (heads rows) x cols, head after head (the CPU layer's layout).
  void set(const RowMatrix<S>& m) {
    for (Index h = 0; h < heads_; ++h)
      for (Index r = 0; r < rows_; ++r)
        for (Index c = 0; c < cols_; ++c) data_[offset(h, r, c)] = m(h * rows_ + r, c);
  }
  RowMatrix<S> get() const {
    RowMatrix<S> m(heads_ * rows_, cols_);
    for (Index h = 0; h < heads_; ++h)
      for (Index r = 0; r < rows_; ++r)
        for (Index c = 0; c < cols_; ++c) m(h * rows_ + r, c) = data_[offset(h, r, c)];
    return m;
  }

  // Whether every entry (inside: of the view; otherwise: around it) still holds the poison's bits.
  bool poisoned(bool inside) const {
    std::vector<char> in_view(data_.size(), 0);
    for (Index h = 0; h < heads_; ++h)
      for (Index r = 0; r < rows_; ++r)
        for (Index c = 0; c < cols_; ++c) in_view[offset(h, r, c)] = 1;
    const S p = poison();
    for (std::size_t i = 0; i < data_.size(); ++i)
      if ((in_view[i] != 0) == inside && std::memcmp(&data_[i], &p, sizeof(S)) != 0) return false;
    return true;
  }

 private:
  std::size_t offset(Index h, Index r, Index c) const {
    return static_cast<std::size_t>(shift_ + h * head_stride_ + r * row_stride_ + c);
  }

  Index heads_, rows_, cols_, shift_, head_stride_ = 0, row_stride_ = 0;
  std::vector<S> data_;
};

// ---- values ---------------------------------------------------------------------------------

// Ordinary values (the bound compares roundings, not overflows: fuzz_mixers takes the extremes),
// in patterns that reach the kernels' special cases: repeated rows (ties in an assignment),
// zero rows, one row repeated throughout, unit rows (VQ and OVQ keys).
template <class S>
RowMatrix<S> values(Index rows, Index cols, Input& in, bool unit_rows) {
  static const double kScale[] = {1.0, 0.5, 2.0, 0.25};
  const double scale = in.pick(kScale);
  const unsigned pattern = in.byte() % 6;
  RowMatrix<double> m(rows, cols);
  for (Index i = 0; i < rows; ++i)
    for (Index j = 0; j < cols; ++j) m(i, j) = scale * in.uniform();
  for (Index i = 1; i < rows; ++i) {
    const std::uint64_t r = in.next();
    if ((pattern == 1 && r % 2 == 0) || pattern == 3) {
      const auto earlier = static_cast<Index>((r >> 8) % static_cast<std::uint64_t>(i));
      m.row(i) = m.row(pattern == 3 ? 0 : earlier);
    } else if (pattern == 2 && r % 4 == 0) {
      m.row(i).setZero();
    }
  }
  if (unit_rows) {
    for (Index i = 0; i < rows; ++i) {
      const double norm = m.row(i).norm();
      if (norm > 0) m.row(i) /= norm;
    }
  }
  return m.unaryExpr([](double x) {
    if constexpr (is_half_v<S>) {
      return narrow<S>(static_cast<float>(x));
    } else {
      return static_cast<S>(x);
    }
  });
}

// A non-finite value in place of one entry of m.
template <class S>
void spoil(RowMatrix<S>& m, Input& in) {
  if (m.size() == 0) return;
  const S bad[] = {std::numeric_limits<S>::quiet_NaN(), std::numeric_limits<S>::infinity(),
                   -std::numeric_limits<S>::infinity()};
  m.data()[in.range(0, m.size() - 1)] = in.pick(bad);
}

// ---- options --------------------------------------------------------------------------------

// Ordinary values (each list's first the default): the comparison is of roundings, and
// fuzz_mixers takes the invalid and extreme options.
const fuzz::OptionTables& option_tables() {
  static const fuzz::OptionTables tables{
      {1.0, 0.5, 2.0, 0.125, 0.3, 4.0},
      {64, 1, 2, 3, 4, 5, 7, 8, 16, 17, 32, 33, 63, 65, 100, 128},
      {0, 1, 2, 3, 7, 16, 64, 65},
      {1.0, 0.9, 0.5, 0.99},
      {1e-6, 1e-3},
      {kernels::FeatureMap::elu1, kernels::FeatureMap::relu, kernels::FeatureMap::identity},
      {16, 1, 2, 3, 5, 8, 40, 130},
      {1.0, 0.5, 2.0, 5.0},
      {0.5, 1.0, 2.0, 0.25},
      {0.5, 0.1, 1.0, 0.3}};
  return tables;
}

// Normalised linear attention with the identity map: its normaliser can cross 0, where any two
// roundings differ as much as they like.
bool normaliser_crosses_zero(const LinearAttentionOptions& o) {
  return o.normalize && o.feature_map == kernels::FeatureMap::identity;
}
template <class Options>
bool normaliser_crosses_zero(const Options&) {
  return false;
}

// Whether outputs are the same however the stream is cut: not where a query reads keys that come
// after it (self-attention without the causal mask).
bool cut_invariant(const SelfAttentionOptions& o) { return o.causal; }
template <class Options>
bool cut_invariant(const Options&) {
  return true;
}

bool is_delta(const OvqOptions& o) { return o.value_update == ValueUpdate::delta; }
template <class Options>
bool is_delta(const Options&) {
  return false;
}

// ---- one mixer on both sides ----------------------------------------------------------------

struct Heads {
  Index batch, kv_heads, group, dk, dv;
  Index query_heads() const { return kv_heads * group; }
};

template <class Mixer>
struct is_linear : std::false_type {};
template <class S, class A>
struct is_linear<LinearAttention<S, A>> : std::true_type {};
template <class Mixer>
struct is_self : std::false_type {};
template <class S, class A>
struct is_self<SelfAttention<S, A>> : std::true_type {};
template <class Mixer>
struct is_ovq : std::false_type {};
template <class S, class A>
struct is_ovq<OvqAttention<S, A>> : std::true_type {};

// The calls of one input on a CPU layer and on a device state, checked call by call.
template <class CpuMixer, class DeviceMixer>
class Differential {
 public:
  using S = typename CpuMixer::scalar_type;
  using Compute = compute_t<S>;
  using Layer = MultiHead<CpuMixer>;
  using DeviceState = typename DeviceMixer::State;
  using HostStates = std::vector<typename DeviceState::HostState>;
  static constexpr bool kLinear = is_linear<CpuMixer>::value;

  Differential(Layer& cpu, DeviceMixer& device, std::function<DeviceState()> make_state,
               const Heads& heads, Input& in, Trace& trace)
      : cpu_(cpu), device_(device), make_state_(std::move(make_state)), state_(make_state_()),
        heads_(heads), in_(in), trace_(trace) {
    for (Layout& l : layouts_) {
      l = pick_layout(in_);
      trace_.add("layout ", &l - layouts_, ": ", describe(l));
    }
  }

  void run() {
    const int calls = 1 + in_.byte() % 6;
    for (int c = 0; c < calls; ++c) {
      switch (in_.byte() % 8) {
        case 0: case 1: call(kForward); break;
        case 2: call(kLinear ? kForward : kForwardLse); break;
        case 3: case 4: call(kStep); break;
        case 5: call(kAbsorb); break;
        case 6: captured_steps(); break;
        default: host_round_trip(); break;
      }
    }
    check_states();
    check_one_forward();
  }

 private:
  enum Op { kForward, kForwardLse, kStep, kAbsorb };
  static constexpr const char* kOpName[] = {"forward", "forward (lse)", "step", "absorb"};

  // An accepted call's inputs and outputs, for the one-forward replay.
  struct Accepted {
    bool reads;
    RowMatrix<S> q, k, v, o;  // the CPU layer's layout; o: the device's outputs
  };

  struct Inputs {
    RowMatrix<S> q, k, v;
  };

  Index query_rows() const { return heads_.batch * heads_.query_heads(); }
  Index state_heads() const { return heads_.batch * heads_.kv_heads; }

  Index pick_tokens() {
    const Index chunk = cpu_.mixer().options().chunk;
    const Index to_boundary = fuzz::tokens_to_boundary(cpu_.state(0, 0), chunk, chunk);
    switch (in_.byte() % 16) {
      case 1: case 9: return to_boundary;
      case 2: return std::max<Index>(to_boundary - 1, 0);
      case 3: return to_boundary + 1;
      case 4: return std::min<Index>(chunk + to_boundary, 200);
      case 5: return 0;
      case 6: return 1;
      // Past a merge block of 1024 keys (self-attention reads its whole cache), in pieces and on
      // rows large and narrow enough for the emulation to get there in seconds (not in 16 bits,
      // whose tensor-core products the emulation takes lane by lane).
      case 15:
        return is_self<CpuMixer>::value && !is_half_v<S> && chunk >= 64 &&
                       std::max(heads_.dk, heads_.dv) <= 64 && in_.rarely(4)
                   ? in_.range(1000, 1100)
                   : 2;
      default: return in_.range(0, 64);
    }
  }

  Inputs inputs(Index t) {
    const bool unit_keys = !is_self<CpuMixer>::value && !kLinear && !in_.rarely(4);
    Inputs x;
    x.q = values<S>(query_rows() * t, heads_.dk, in_, false);
    x.k = values<S>(state_heads() * t, heads_.dk, in_, unit_keys);
    x.v = values<S>(state_heads() * t, heads_.dv, in_, false);
    return x;
  }

  // The CPU layer's call; whether it threw an ArgumentError.
  bool cpu_call(Op op, const Inputs& x, RowMatrix<S>& o, RowVector<Compute>& lse) {
    try {
      switch (op) {
        case kForward: cpu_.forward(x.q, x.k, x.v, o); break;
        case kForwardLse:
          if constexpr (!kLinear) cpu_.forward(x.q, x.k, x.v, o, lse);
          break;
        case kStep: cpu_.step(x.q, x.k, x.v, o); break;
        case kAbsorb: cpu_.absorb(x.k, x.v); break;
      }
    } catch (const ArgumentError& e) {
      trace_.add("  CPU -> ArgumentError: ", e.what());
      return true;
    }
    return false;
  }

  // The device's call on tensors of the chosen layouts; whether it threw an ArgumentError
  // (anything else is a finding).
  bool device_call(Op op, DeviceTensor<S>& q, DeviceTensor<S>& k, DeviceTensor<S>& v,
                   DeviceTensor<S>& o, DeviceTensor<Compute>& lse, cuda::EmulatedStream* stream,
                   std::string* error) {
    try {
      switch (op) {
        case kForward:
          device_.forward(state_, q.view(), k.view(), v.view(), o.view(), stream);
          break;
        case kForwardLse:
          if constexpr (!kLinear)
            device_.forward(state_, q.view(), k.view(), v.view(), o.view(), lse.view(), stream);
          break;
        case kStep: device_.step(state_, q.view(), k.view(), v.view(), o.view(), stream); break;
        case kAbsorb: device_.absorb(state_, k.view(), v.view(), stream); break;
      }
    } catch (const ArgumentError& e) {
      *error = e.what();
      trace_.add("  device -> ArgumentError: ", e.what());
      return true;
    } catch (const std::exception& e) {
      OVQ_FUZZ_CHECK(false, "the device's ", kOpName[op],
                     " threw something other than ovq::ArgumentError: ", e.what(), trace_.str());
    }
    return false;
  }

  HostStates host_states() { return state_.to_host(nullptr); }

  void call(Op op, cuda::EmulatedStream* stream = nullptr) {
    const Index t = op == kStep ? 1 : pick_tokens();
    const bool reads = op != kAbsorb;
    // A non-finite entry in Q, K or V, or a wrong shape (device only).
    const int fault = in_.rarely(12) ? 1 + in_.byte() % 3 : 0;
    const int bad = fault == 0 && in_.rarely(12) ? 1 + in_.byte() % 7 : 0;
    Inputs x = inputs(t);
    if (fault == 1 && reads) spoil(x.q, in_);
    if (fault == 2) spoil(x.k, in_);
    if (fault == 3) spoil(x.v, in_);
    const bool finite = x.k.allFinite() && x.v.allFinite() && (!reads || x.q.allFinite());
    trace_.add(kOpName[op], stream != nullptr ? " (captured)" : "", " T=", t,
               " finite=", finite, " bad_shape=", bad);

    DeviceTensor<S> q(query_rows(), t, heads_.dk, layouts_[0]);
    DeviceTensor<S> k(state_heads(), t, heads_.dk, layouts_[1]);
    DeviceTensor<S> v(state_heads(), t, heads_.dv, layouts_[2]);
    DeviceTensor<S> o(query_rows(), t, heads_.dv, layouts_[3]);
    DeviceTensor<Compute> lse(query_rows(), t, 1, Layout{});
    q.set(x.q);
    k.set(x.k);
    v.set(x.v);
    if (bad != 0) {
      wrong_shape(op, bad, q, k, v, o, lse, stream);
      return;
    }

    RowMatrix<S> cpu_o(query_rows() * t, heads_.dv);
    RowVector<Compute> cpu_lse(query_rows() * t);
    const HostStates before = host_states();
    const bool cpu_threw = cpu_call(op, x, cpu_o, cpu_lse);
    std::string error;
    const bool device_threw = device_call(op, q, k, v, o, lse, stream, &error);

    if (!finite) {
      OVQ_FUZZ_CHECK(cpu_threw, "the CPU layer's ", kOpName[op], " accepted a non-finite input",
                     trace_.str());
      OVQ_FUZZ_CHECK(!device_threw, "the device's ", kOpName[op],
                     " refused on the host what only the device can see: ", error, trace_.str());
      bool faulted = false;
      try {
        state_.synchronize(nullptr);
      } catch (const ArgumentError& e) {
        faulted = true;
        trace_.add("  synchronize -> ArgumentError: ", e.what());
      }
      OVQ_FUZZ_CHECK(faulted, "the device's ", kOpName[op],
                     " took a non-finite input without a fault", trace_.str());
      OVQ_FUZZ_CHECK(host_states() == before, "the device's faulted ", kOpName[op],
                     " changed the state", trace_.str());
      return;
    }
    OVQ_FUZZ_CHECK(cpu_threw == device_threw, "the CPU ", cpu_threw ? "refused" : "accepted",
                   " a ", kOpName[op], " the device ", device_threw ? "refused" : "accepted",
                   trace_.str());
    if (device_threw) {
      OVQ_FUZZ_CHECK(host_states() == before, "the device's refused ", kOpName[op],
                     " changed the state", trace_.str());
      return;
    }
    tokens_ += t;
    accepted_.push_back({reads, x.q, x.k, x.v, RowMatrix<S>()});
    if (!reads) return;
    OVQ_FUZZ_CHECK(o.poisoned(false), "the device's ", kOpName[op], " wrote around its output view",
                   trace_.str());
    RowMatrix<S> got = o.get();
    const double err = relative_error(as_doubles(got), as_doubles(cpu_o));
    trace_.add("  output error ", err);
    if (!normaliser_crosses_zero(cpu_.mixer().options())) {
      OVQ_FUZZ_CHECK(got.allFinite(), "the device's ", kOpName[op],
                     " left an output entry unwritten or not finite", trace_.str());
      OVQ_FUZZ_CHECK(err < output_bound<S>(), "the device's ", kOpName[op], " is ", err,
                     " from the CPU's outputs (bound ", output_bound<S>(), ")", trace_.str());
    }
    if (op == kForwardLse) {
      const double lse_err = relative_error(as_doubles(lse.get()), as_doubles(cpu_lse));
      OVQ_FUZZ_CHECK(lse_err < output_bound<S>(), "the device's log-sum-exp is ", lse_err,
                     " from the CPU's", trace_.str());
    }
    accepted_.back().o = std::move(got);
  }

  // One argument off: the device refuses before anything runs, and writes nothing.
  void wrong_shape(Op op, int bad, DeviceTensor<S>& q, DeviceTensor<S>& k, DeviceTensor<S>& v,
                   DeviceTensor<S>& o, DeviceTensor<Compute>& lse, cuda::EmulatedStream* stream) {
    const HostStates before = host_states();
    if (op == kAbsorb && (bad == 3 || bad == 4 || bad == 6)) bad = 1;
    if (bad == 6 && state_heads() == 1) bad = 4;  // any number of Q heads is a multiple of 1
    cuda::HeadsView<S> qv = q.view(), kv = k.view(), vv = v.view(), ov = o.view();
    switch (bad) {
      case 1: kv.cols += 1; break;
      case 2: vv.cols += 1; break;
      case 3: qv.cols += 1; break;
      case 4: ov.cols += 1; break;
      case 5: vv.rows += 1; break;
      case 6: qv.heads += 1; break;
      default: kv.heads = kv.heads > 1 ? kv.heads - 1 : kv.heads + 1; break;
    }
    bool threw = false;
    try {
      switch (op) {
        case kForward: device_.forward(state_, qv, kv, vv, ov, stream); break;
        case kForwardLse:
          if constexpr (!kLinear) device_.forward(state_, qv, kv, vv, ov, lse.view(), stream);
          break;
        case kStep: device_.step(state_, qv, kv, vv, ov, stream); break;
        case kAbsorb: device_.absorb(state_, kv, vv, stream); break;
      }
    } catch (const ArgumentError& e) {
      threw = true;
      trace_.add("  device -> ArgumentError: ", e.what());
    } catch (const std::exception& e) {
      OVQ_FUZZ_CHECK(false, "the device's ", kOpName[op],
                     " threw something other than ovq::ArgumentError: ", e.what(), trace_.str());
    }
    OVQ_FUZZ_CHECK(threw, "the device's ", kOpName[op], " accepted a wrong shape (", bad, ")",
                   trace_.str());
    OVQ_FUZZ_CHECK(o.poisoned(true) && o.poisoned(false), "the device's refused ", kOpName[op],
                   " wrote outputs", trace_.str());
    OVQ_FUZZ_CHECK(host_states() == before, "the device's refused ", kOpName[op],
                   " changed the state", trace_.str());
  }

  // Steps as a CUDA graph replays them: reserved first, the sizes read on the device.
  void captured_steps() {
    const int n = 1 + in_.byte() % 6;
    trace_.add("reserve for ", n, " captured steps");
    if constexpr (is_self<CpuMixer>::value) {
      device_.reserve(state_, query_rows(), tokens_ + n);
    } else {
      device_.reserve(state_, query_rows());
    }
    cuda::EmulatedStream capture{true};
    for (int i = 0; i < n; ++i) call(kStep, &capture);
  }

  // The state to the host and back: nothing changes.
  void host_round_trip() {
    const HostStates host = host_states();
    trace_.add("to_host, from_host");
    state_.from_host(host, nullptr);
    OVQ_FUZZ_CHECK(host_states() == host, "from_host(to_host()) changed the state", trace_.str());
  }

  // The device's states against the CPU layer's.
  void check_states() {
    const HostStates got = host_states();
    const auto& want = cpu_.states();
    OVQ_FUZZ_CHECK(got.size() == want.size(), "to_host gave ", got.size(), " states, expected ",
                   want.size(), trace_.str());
    for (std::size_t h = 0; h < got.size(); ++h) {
      OVQ_FUZZ_CHECK(got[h].tokens() == want[h].tokens(), "state ", h, " has seen ",
                     got[h].tokens(), " tokens, the CPU's ", want[h].tokens(), trace_.str());
      if constexpr (kLinear) {
        const double kv_err = relative_error(as_doubles(got[h].kv()), as_doubles(want[h].kv()));
        const double z_err =
            relative_error(as_doubles(got[h].k_sum()), as_doubles(want[h].k_sum()));
        OVQ_FUZZ_CHECK(kv_err < state_bound<S>() && z_err < state_bound<S>(), "state ", h,
                       ": S is ", kv_err, " and z ", z_err, " from the CPU's", trace_.str());
      } else if constexpr (is_ovq<CpuMixer>::value) {
        if (!is_delta(cpu_.mixer().options())) {
          OVQ_FUZZ_CHECK(got[h] == want[h], "OVQ state ", h, " differs from the CPU's",
                         trace_.str());
          continue;
        }
        // The delta rule's predictions are reads (of 16-bit rows, for a 16-bit element), equal
        // to the reads' rounding on the two sides; the assignments, counts and key rows do not
        // depend on them.
        const auto& d = got[h].dictionary();
        const auto& e = want[h].dictionary();
        OVQ_FUZZ_CHECK(d.size() == e.size(), "OVQ state ", h, " has ", d.size(),
                       " rows, the CPU's ", e.size(), trace_.str());
        for (Index r = 0; r < d.size(); ++r)
          OVQ_FUZZ_CHECK(d.count(r) == e.count(r), "OVQ state ", h, " row ", r, " counts ",
                         d.count(r), ", the CPU's ", e.count(r), trace_.str());
        OVQ_FUZZ_CHECK(as_eigen(d.mean_keys()) == as_eigen(e.mean_keys()), "OVQ state ", h,
                       ": key rows differ from the CPU's", trace_.str());
        const double err =
            relative_error(as_doubles(RowMatrix<Compute>(as_eigen(d.mean_values()))),
                           as_doubles(RowMatrix<Compute>(as_eigen(e.mean_values()))));
        OVQ_FUZZ_CHECK(err < output_bound<S>(), "OVQ state ", h, ": value rows are ", err,
                       " from the CPU's", trace_.str());
      } else if constexpr (is_self<CpuMixer>::value || !std::is_same_v<S, double>) {
        OVQ_FUZZ_CHECK(got[h] == want[h], "state ", h, " differs from the CPU's", trace_.str());
      }
      // (A double VQ state's mean values sum in other widths: its tokens are compared above.)
    }
  }

  // The accepted calls' tokens as one forward of a fresh state: the same bits.
  void check_one_forward() {
    Index t = 0;
    for (const Accepted& a : accepted_) t += a.k.rows() / state_heads();
    if (t == 0 || !cut_invariant(cpu_.mixer().options())) return;
    const auto stack = [&](auto member, Index heads) {
      const Index cols = (accepted_.front().*member).cols();
      RowMatrix<S> all(heads * t, cols);
      Index pos = 0;
      for (const Accepted& a : accepted_) {
        const RowMatrix<S>& m = a.*member;
        const Index n = m.rows() / heads;
        for (Index h = 0; h < heads; ++h) all.middleRows(h * t + pos, n) = m.middleRows(h * n, n);
        pos += n;
      }
      return all;
    };
    const RowMatrix<S> q = stack(&Accepted::q, query_rows());
    DeviceTensor<S> dq(query_rows(), t, heads_.dk, Layout{});
    DeviceTensor<S> dk(state_heads(), t, heads_.dk, Layout{});
    DeviceTensor<S> dv(state_heads(), t, heads_.dv, Layout{});
    DeviceTensor<S> dout(query_rows(), t, heads_.dv, Layout{});
    dq.set(q);
    dk.set(stack(&Accepted::k, state_heads()));
    dv.set(stack(&Accepted::v, state_heads()));
    DeviceState fresh = make_state_();
    trace_.add("one forward of the ", t, " accepted tokens");
    device_.forward(fresh, dq.view(), dk.view(), dv.view(), dout.view(), nullptr);
    const RowMatrix<S> got = dout.get();
    Index pos = 0;
    for (const Accepted& a : accepted_) {
      const Index n = a.k.rows() / state_heads();
      if (a.reads) {
        for (Index h = 0; h < query_rows(); ++h) {
          const RowMatrix<S> one = got.middleRows(h * t + pos, n);
          const RowMatrix<S> piece = a.o.middleRows(h * n, n);
          OVQ_FUZZ_CHECK(same_bits(one, piece), "one forward's outputs of tokens [", pos, ", ",
                         pos + n, ") of query head ", h, " differ from the calls'", trace_.str());
        }
      }
      pos += n;
    }
    OVQ_FUZZ_CHECK(fresh.to_host(nullptr) == host_states(),
                   "one forward's state differs from the calls'", trace_.str());
  }

  Layer& cpu_;
  DeviceMixer& device_;
  std::function<DeviceState()> make_state_;
  DeviceState state_;
  Heads heads_;
  Input& in_;
  Trace& trace_;
  Layout layouts_[4];  // Q, K, V, O
  Index tokens_ = 0;   // accepted so far
  std::vector<Accepted> accepted_;
};

// One beta per query head, on both sides or on neither.
template <class Layer, class DeviceMixer>
void maybe_head_betas(Layer& cpu, DeviceMixer& device, const Heads& heads, bool delta, Input& in,
                      Trace& trace) {
  if (!in.rarely(4)) return;
  static const double kBeta[] = {1.0, 0.5, 2.0, 0.25, 1.5};
  std::vector<double> betas(static_cast<std::size_t>(heads.query_heads()));
  const bool shared = delta && !in.rarely(4);  // the delta rule's groups share theirs
  for (Index h = 0; h < heads.query_heads(); ++h)
    betas[static_cast<std::size_t>(h)] =
        shared && h % heads.group != 0 ? betas[static_cast<std::size_t>(h - 1)] : in.pick(kBeta);
  trace.add("head betas", shared ? " (shared in groups)" : "");
  bool cpu_threw = false, device_threw = false;
  try {
    cpu.set_head_betas(betas);
  } catch (const ArgumentError& e) {
    cpu_threw = true;
    trace.add("  CPU -> ArgumentError: ", e.what());
  }
  try {
    device.set_head_betas(betas, heads.kv_heads);
  } catch (const ArgumentError& e) {
    device_threw = true;
    trace.add("  device -> ArgumentError: ", e.what());
  }
  OVQ_FUZZ_CHECK(cpu_threw == device_threw, "set_head_betas: the CPU ",
                 cpu_threw ? "refused" : "accepted", ", the device ",
                 device_threw ? "refused" : "accepted", trace.str());
}

// The device refuses widths past its kernels' (256), which the CPU takes: true if it did.
bool refused_width(const Heads& heads, const std::function<void()>& make, Trace& trace) {
  try {
    make();
  } catch (const ArgumentError& e) {
    trace.add("  device make_state -> ArgumentError: ", e.what());
    OVQ_FUZZ_CHECK(heads.dk > 256 || heads.dv > 256, "make_state refused dk = ", heads.dk,
                   ", dv = ", heads.dv, ": ", e.what(), trace.str());
    return true;
  }
  OVQ_FUZZ_CHECK(heads.dk <= 256 && heads.dv <= 256, "make_state took dk = ", heads.dk,
                 ", dv = ", heads.dv, " (the kernels go to 256)", trace.str());
  return false;
}

// Both mixers of the options or neither: the device validates them as the CPU does.
template <class CpuMixer, class DeviceMixer, class Options>
bool make_mixers(const Options& options, std::optional<CpuMixer>& cpu,
                 std::optional<DeviceMixer>& device, Trace& trace) {
  trace.add("options: ", describe(options));
  std::string cpu_error, device_error;
  try {
    cpu.emplace(options);
  } catch (const ArgumentError& e) {
    cpu_error = e.what();
  }
  try {
    device.emplace(options);
  } catch (const ArgumentError& e) {
    device_error = e.what();
  }
  OVQ_FUZZ_CHECK(cpu.has_value() == device.has_value(), "the options: CPU ",
                 cpu ? "accepted" : cpu_error, ", device ", device ? "accepted" : device_error,
                 trace.str());
  if (!cpu) trace.add("  -> ArgumentError: ", cpu_error);
  return cpu.has_value();
}

template <class CpuMixer, class DeviceMixer, class Options>
void run_kind(const Options& options, const Heads& heads, Input& in, Trace& trace) {
  std::optional<CpuMixer> host;
  std::optional<DeviceMixer> device;
  if (!make_mixers(options, host, device, trace)) return;
  MultiHead<CpuMixer> cpu(*host, heads.batch, heads.query_heads(), heads.kv_heads, heads.dk,
                          heads.dv);
  const Index states = heads.batch * heads.kv_heads;
  const auto make = [&] { return device->make_state(states, heads.dk, heads.dv); };
  if (refused_width(heads, [&] { make(); }, trace)) return;
  if constexpr (!is_linear<CpuMixer>::value)
    maybe_head_betas(cpu, *device, heads, is_delta(options), in, trace);
  Differential<CpuMixer, DeviceMixer>(cpu, *device, make, heads, in, trace).run();
}

template <class CpuMixer, class DeviceMixer>
void run_vq(const VqAttentionOptions& options, const Heads& heads, Input& in, Trace& trace) {
  using S = typename CpuMixer::scalar_type;
  std::optional<CpuMixer> host;
  std::optional<DeviceMixer> device;
  if (!make_mixers(options, host, device, trace)) return;
  const Index codes = 1 + in.byte() % 40;
  const RowMatrix<S> codebook = values<S>(codes, heads.dk, in, in.flag());
  trace.add("codebook of ", codes, " rows");
  MultiHead<CpuMixer> cpu(*host, heads.batch, heads.query_heads(),
                          std::vector<VqState<S>>(static_cast<std::size_t>(heads.kv_heads),
                                                  host->make_state(codebook, heads.dv)));
  const Index states = heads.batch * heads.kv_heads;
  const auto make = [&] { return device->make_state(states, codebook, heads.dv); };
  if (refused_width(heads, [&] { make(); }, trace)) return;
  maybe_head_betas(cpu, *device, heads, false, in, trace);
  Differential<CpuMixer, DeviceMixer>(cpu, *device, make, heads, in, trace).run();
}

Index pick_width(Input& in) {
  static const Index kWide[] = {32, 33, 63, 64, 65, 100, 128, 129, 200, 255, 256, 257};
  const unsigned b = in.byte();
  return b < 224 ? 1 + b % 40 : kWide[b % 12];
}

// One mixer of element S, chosen and driven by the bytes. The CPU's OVQ and VQ run on its
// portable kernels (arch::scalar), whose scores are the device's FMA chains.
template <class S>
void run_element(Input& in, Trace& trace) {
  const unsigned kind = in.byte() % 4;
  Heads heads{};
  heads.batch = 1 + in.byte() % 2;
  heads.kv_heads = 1 + in.byte() % 2;
  heads.group = 1 + in.byte() % 3;
  heads.dk = pick_width(in);
  heads.dv = pick_width(in);
  static const char* const kKind[] = {"self", "linear", "vq", "ovq"};
  trace.add(kKind[kind], " ", element_name<S>(), " batch=", heads.batch, " kv_heads=",
            heads.kv_heads, " group=", heads.group, " dk=", heads.dk, " dv=", heads.dv);
  switch (kind) {
    case 0:
      run_kind<SelfAttention<S>, cuda::BasicSelfAttention<S, Emulator>>(
          fuzz::self_options(in, option_tables()), heads, in, trace);
      break;
    case 1:
      run_kind<LinearAttention<S>, cuda::BasicLinearAttention<S, Emulator>>(
          fuzz::linear_options(in, option_tables()), heads, in, trace);
      break;
    case 2:
      run_vq<VqAttention<S, arch::scalar>, cuda::BasicVqAttention<S, Emulator>>(
          fuzz::vq_options(in, option_tables()), heads, in, trace);
      break;
    default:
      if constexpr (!std::is_same_v<S, double>) {
        run_kind<OvqAttention<S, arch::scalar>, cuda::BasicOvqAttention<S, Emulator>>(
            fuzz::ovq_options(in, option_tables()), heads, in, trace);
      }
      break;
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  Input in(data, size);
  in.seed_stream(size);
  Trace trace;
  switch (in.byte() % 4) {
    case 0: run_element<float>(in, trace); break;
    case 1: run_element<double>(in, trace); break;
    case 2: run_element<bf16>(in, trace); break;
    default: run_element<fp16>(in, trace); break;
  }
  return 0;
}
