#pragma once
// Linear attention on a device (MATH.md section 2): the CPU mixer's options and mathematics over
// states in device memory batched over (batch x key/value heads).
//
// LinearDeviceState: per head S (dk x dv) and z (dk) of the complete chunks, in the compute
// type (float for 16-bit elements, as the CPU's LinearState), and the pending chunk's raw rows
// (16-bit for 16-bit elements); shared, the decay powers g^i (i <= L).
// BasicLinearAttention<Scalar, Backend>: per piece of the stream (up to the end of the current
// chunk) the rows join the pending chunk, the queries read (S, z) and the chunk
// (LinearReadProgram), and a complete chunk is folded into (S, z) (LinearWriteProgram).
#include <algorithm>
#include <cstdint>
#include <vector>

#include "ovq/cuda/buffer.hpp"
#include "ovq/cuda/checks.hpp"
#include "ovq/cuda/elements.hpp"
#include "ovq/cuda/kernels/launch.hpp"
#include "ovq/cuda/kernels/linear.hpp"
#include "ovq/cuda/mixer_base.hpp"
#include "ovq/cuda/mixer_support.hpp"
#include "ovq/cuda/state_base.hpp"
#include "ovq/mixers/linear_attention.hpp"
#include "ovq/state/linear_state.hpp"

namespace ovq::cuda {

template <class Element, class Backend>
class LinearDeviceState : public StateBase<Backend> {
  using Base = StateBase<Backend>;
  using Stored = device_element_t<Element>;  // what the kernels store
  using Compute = compute_t<Element>;        // what they compute in

 public:
  using Stream = typename Backend::Stream;
  using scalar_type = Element;
  using HostState = LinearState<Element>;

  // powers: g^i for i in [0, chunk] (the mixer's).
  LinearDeviceState(Index heads, Index dk, Index dv, Index chunk,
                    const std::vector<Compute>& powers, Stream stream)
      : Base(stream), heads_(heads), dk_(dk), dv_(dv), chunk_(chunk) {
    const char* where = "cuda::LinearState";
    ovq::detail::check_positive(where, "heads", heads);
    detail::check_device_chunk(where, chunk);
    detail::check_widths(where, dk, dv);
    kv_ = DeviceBuffer<Compute, Backend>(static_cast<std::size_t>(heads * dk * dv), stream);
    k_sum_ = DeviceBuffer<Compute, Backend>(static_cast<std::size_t>(heads * dk), stream);
    pending_keys_ = DeviceBuffer<Stored, Backend>(static_cast<std::size_t>(heads * chunk * dk), stream);
    pending_values_ =
        DeviceBuffer<Stored, Backend>(static_cast<std::size_t>(heads * chunk * dv), stream);
    powers_ = DeviceBuffer<Compute, Backend>(powers.size(), stream);
    Backend::copy(powers_.data(), powers.data(), powers.size() * sizeof(Compute), stream);
    reset(stream);
  }

  Index heads() const { return heads_; }
  Index key_dim() const { return dk_; }
  Index value_dim() const { return dv_; }
  Index chunk() const { return chunk_; }
  std::int64_t absorbed() const { return this->counters().absorbed; }
  std::int64_t tokens() const { return this->counters().tokens; }
  Index pending() const { return static_cast<Index>(this->counters().pending); }

  // Payload bytes, as the CPU state counts them.
  std::size_t bytes() const {
    return static_cast<std::size_t>(heads_) *
           (static_cast<std::size_t>(dk_ * (dv_ + 1)) * sizeof(Compute) +
            static_cast<std::size_t>(chunk_ * (dk_ + dv_)) * sizeof(Element));
  }

  void reset(Stream stream) {
    Backend::zero(kv_.data(), kv_.bytes(), stream);
    Backend::zero(k_sum_.data(), k_sum_.bytes(), stream);
    this->upload(StateCounters{}, stream);
    Backend::synchronize(stream);
  }

  std::vector<HostState> to_host(Stream stream) {
    this->synchronize(stream);
    std::vector<Compute> kv(kv_.size()), z(k_sum_.size());
    std::vector<Element> pk(pending_keys_.size()), pv(pending_values_.size());
    Backend::copy(kv.data(), kv_.data(), kv_.bytes(), stream);
    Backend::copy(z.data(), k_sum_.data(), k_sum_.bytes(), stream);
    Backend::copy(pk.data(), pending_keys_.data(), pending_keys_.bytes(), stream);
    Backend::copy(pv.data(), pending_values_.data(), pending_values_.bytes(), stream);
    Backend::synchronize(stream);
    std::vector<HostState> out;
    const Index p = pending();
    for (Index h = 0; h < heads_; ++h) {
      out.emplace_back(dk_, dv_, chunk_);
      HostState& st = out.back();
      std::copy_n(kv.data() + h * dk_ * dv_, dk_ * dv_, st.kv().data());
      std::copy_n(z.data() + h * dk_, dk_, st.k_sum().data());
      st.restore(absorbed(), {pk.data() + h * chunk_ * dk_, p, dk_, dk_},
                 {pv.data() + h * chunk_ * dv_, p, dv_, dv_});
    }
    return out;
  }

  void from_host(const std::vector<HostState>& states, Stream stream) {
    const char* where = "cuda::LinearState::from_host";
    ovq::detail::require(static_cast<Index>(states.size()) == heads_, where, "got ",
                         states.size(), " states, expected ", heads_, " (one per head)");
    for (const HostState& st : states) {
      ovq::detail::require(st.key_dim() == dk_ && st.value_dim() == dv_ && st.chunk() == chunk_,
                           where, "a state has (dk, dv, L) = (", st.key_dim(), ", ",
                           st.value_dim(), ", ", st.chunk(), "), expected (", dk_, ", ", dv_,
                           ", ", chunk_, ")");
      ovq::detail::require(st.absorbed() == states[0].absorbed() &&
                               st.pending() == states[0].pending(),
                           where, "states differ in (t, pending), expected one stream");
    }
    std::vector<Compute> kv(kv_.size()), z(k_sum_.size());
    std::vector<Element> pk(pending_keys_.size(), Element(0)), pv(pending_values_.size(), Element(0));
    const Index p = states[0].pending();
    for (Index h = 0; h < heads_; ++h) {
      const HostState& st = states[static_cast<std::size_t>(h)];
      std::copy_n(st.kv().data(), dk_ * dv_, kv.data() + h * dk_ * dv_);
      std::copy_n(st.k_sum().data(), dk_, z.data() + h * dk_);
      for (Index i = 0; i < p; ++i) {
        std::copy_n(st.pending_keys().row(i), dk_, pk.data() + (h * chunk_ + i) * dk_);
        std::copy_n(st.pending_values().row(i), dv_, pv.data() + (h * chunk_ + i) * dv_);
      }
    }
    Backend::copy(kv_.data(), kv.data(), kv_.bytes(), stream);
    Backend::copy(k_sum_.data(), z.data(), k_sum_.bytes(), stream);
    Backend::copy(pending_keys_.data(), pk.data(), pending_keys_.bytes(), stream);
    Backend::copy(pending_values_.data(), pv.data(), pending_values_.bytes(), stream);
    StateCounters c;
    c.absorbed = states[0].absorbed();
    c.tokens = states[0].tokens();
    c.pending = p;
    this->upload(c, stream);
    Backend::synchronize(stream);
  }

 private:
  template <class S, class B>
  friend class BasicLinearAttention;

  Index heads_, dk_, dv_, chunk_;
  DeviceBuffer<Compute, Backend> kv_, k_sum_, powers_;
  DeviceBuffer<Stored, Backend> pending_keys_, pending_values_;
};

template <class Scalar, class Backend>
class BasicLinearAttention
    : public DeviceMixerBase<BasicLinearAttention<Scalar, Backend>, Scalar, Backend,
                             LinearDeviceState<Scalar, Backend>, LinearAttentionOptions> {
  using Base = DeviceMixerBase<BasicLinearAttention, Scalar, Backend,
                               LinearDeviceState<Scalar, Backend>, LinearAttentionOptions>;
  friend Base;
  using Stored = device_element_t<Scalar>;  // what the kernels store
  using Compute = compute_t<Scalar>;        // what they compute in
  using Base::options_;

 public:
  using typename Base::Options;
  using typename Base::State;
  using typename Base::Stream;
  static constexpr bool kHasLogSumExp = false;

  explicit BasicLinearAttention(const Options& options = {})
      : Base(options, "cuda::LinearAttention") {
    if (options_.normalize)
      ovq::detail::check_scalar_range<Scalar>("cuda::LinearAttention", "eps", options_.eps);
    detail::check_device_chunk("cuda::LinearAttention", options_.chunk);
    powers_ = ovq::kernels::decay_powers(static_cast<Compute>(options_.decay), options_.chunk);
  }

  State make_state(Index heads, Index dk, Index dv, Stream stream = {}) const {
    return State(heads, dk, dv, options_.chunk, powers_, stream);
  }

  void check_state(const char* where, const State& state) const {
    ovq::detail::require(state.chunk() == options_.chunk, where, "state chunk = ", state.chunk(),
                         ", expected ", options_.chunk, " (the mixer's)");
  }

  // As the other device mixers' (a linear state needs no workspace: nothing to allocate).
  void reserve(State& state, Index query_heads, Stream = {}) const {
    check_state("reserve", state);
    detail::check_query_heads("reserve", query_heads, state.heads());
  }

 private:
  void run(const char* where, State& st, const ConstHeadsView<Scalar>* q,
           ConstHeadsView<Scalar> k, ConstHeadsView<Scalar> v, const HeadsView<Scalar>* o,
           Stream stream) const {
    check_state(where, st);
    detail::check_call(where, st.heads(), st.key_dim(), st.value_dim(), q, k, v, o);
    st.begin_call(stream);
    const Index n = k.rows;
    if (n == 0) return;
    const bool capturing = Backend::capturing(stream);
    // Values first: a bad entry leaves the state as it was.
    const ConstHeadsView<Stored> q_stored = q != nullptr ? stored(*q) : ConstHeadsView<Stored>{};
    detail::launch_finite_check<Backend>(st.device_counters(), q != nullptr ? &q_stored : nullptr,
                                         stored(k), stored(v), stream);
    const Index chunk = st.chunk();
    StateCounters after = st.counters();
    kernels::LinearParams<Compute, Stored> p;
    p.keys = {st.pending_keys_.data(), chunk * st.key_dim(), st.key_dim()};
    p.values = {st.pending_values_.data(), chunk * st.value_dim(), st.value_dim()};
    p.kv = {st.kv_.data(), st.key_dim() * st.value_dim(), st.value_dim()};
    p.k_sum = {st.k_sum_.data(), st.key_dim(), 0};
    p.powers = st.powers_.data();
    p.chunk = chunk;
    p.dk = st.key_dim();
    p.dv = st.value_dim();
    p.map = options_.feature_map;
    p.normalize = options_.normalize;
    p.beta = static_cast<Compute>(options_.beta);
    p.eps = static_cast<Compute>(options_.eps);
    p.counters = st.device_counters();
    for (Index pos = 0; pos < n;) {
      const Index len = std::min(chunk - static_cast<Index>(after.pending), n - pos);
      detail::launch_push<Backend>(st.device_counters(), stored(k.middle_rows(pos, len)),
                                   stored(v.middle_rows(pos, len)), pending_view(st, true),
                                   pending_view(st, false), chunk, stream);
      after.pending += len;
      after.tokens += len;
      if (q != nullptr) {
        p.q = {q_stored.data + pos * q->row_stride, q->head_stride, q->row_stride};
        p.o = {stored(*o).data + pos * o->row_stride, o->head_stride, o->row_stride};
        p.group = q->heads / st.heads();
        p.n_queries = len;
        p.query_heads = q->heads;
        kernels::dispatch_width(std::max(st.key_dim(), st.value_dim()), [&](auto width) {
          using Read = kernels::LinearReadProgram<Compute, decltype(width)::value, Stored>;
          Backend::template launch<Read>(
              Grid{static_cast<int>((len + Read::kRows - 1) / Read::kRows),
                   static_cast<int>(q->heads), 1},
              p, stream);
        });
      }
      if (after.pending == chunk || capturing) {
        using Write = kernels::LinearWriteProgram<Compute, Stored>;
        const Index entries = st.key_dim() * (st.value_dim() + 1);
        Backend::template launch<Write>(
            Grid{static_cast<int>((entries + Write::kThreads - 1) / Write::kThreads),
                 static_cast<int>(st.heads()), 1},
            p, stream);
        detail::launch_counters<Backend>(st.device_counters(), kernels::CounterOp::complete, 0,
                                         chunk, nullptr, stream);
        if (after.pending == chunk) {
          after.absorbed += chunk;
          after.pending = 0;
        }
      }
      pos += len;
    }
    st.end_call(after, stream);
  }

  static HeadsView<Stored> pending_view(const State& st, bool keys) {
    return keys ? contiguous_heads(st.pending_keys_.data(), st.heads(), st.chunk(), st.key_dim())
                : contiguous_heads(st.pending_values_.data(), st.heads(), st.chunk(),
                                   st.value_dim());
  }

  std::vector<Compute> powers_;
};

}  // namespace ovq::cuda
