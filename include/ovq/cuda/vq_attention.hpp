#pragma once
// VQ-attention on a device (MATH.md section 3): the CPU mixer's options and mathematics over
// states in device memory batched over (batch x key/value heads).
//
// VqDeviceState: per head the fixed codebook (S x dk) and its offsets -|C_s|^2 / 2 (taken from
// the CPU state the device state is made from, so both quantise alike), per-code counts, their
// logs and mean values, and the pending chunk (codes, their codebook rows, values).
// BasicVqAttention<Scalar, Backend>: per piece of the stream (up to the end of the current
// chunk) the keys are quantised in one parallel pass (AssignProgram), pushed with their values
// (VqPushProgram), the queries read codebook and chunk (bias log c), and a complete chunk is
// written into the counts and means (DictionaryWriteProgram, values only).
// Element: float, double, or ovq::bf16 / ovq::fp16 (16-bit inputs, codebook, pending chunk and
// value read rows, the mean values in float as on the CPU, the changed ones rounded into the
// read rows by each chunk's write; reads on tensor cores).
#include <algorithm>
#include <cstdint>
#include <vector>

#include "ovq/cuda/buffer.hpp"
#include "ovq/cuda/checks.hpp"
#include "ovq/cuda/elements.hpp"
#include "ovq/cuda/kernels/assign.hpp"
#include "ovq/cuda/kernels/dictionary_write.hpp"
#include "ovq/cuda/kernels/launch.hpp"
#include "ovq/cuda/kernels/vq.hpp"
#include "ovq/cuda/mixer_base.hpp"
#include "ovq/cuda/mixer_support.hpp"
#include "ovq/cuda/state_base.hpp"
#include "ovq/cuda/workspace.hpp"
#include "ovq/mixers/vq_attention.hpp"
#include "ovq/state/vq_state.hpp"

namespace ovq::cuda {

template <class Element, class Backend>
class VqDeviceState : public StateBase<Backend> {
  using Base = StateBase<Backend>;
  using Stored = device_element_t<Element>;  // what the kernels store
  using Compute = compute_t<Element>;        // what they compute in

 public:
  using Stream = typename Backend::Stream;
  using scalar_type = Element;
  using HostState = VqState<Element>;
  // 16-bit elements: the mean values are float rows of their own, and the reads stream their
  // 16-bit rounding (as the CPU's Dictionary<bf16>); float and double: one set of rows.
  static constexpr bool kSeparateMeans = is_half_v<Element>;

  // One head per host state, each with its codebook, counts, means and pending rows.
  VqDeviceState(const std::vector<HostState>& states, Stream stream) : Base(stream) {
    const char* where = "cuda::VqState";
    ovq::detail::require(!states.empty(), where, "no states, expected one per head");
    const HostState& first = states.front();
    heads_ = static_cast<Index>(states.size());
    codes_ = first.codebook_size();
    chunk_ = first.chunk();
    dk_ = first.key_dim();
    dv_ = first.value_dim();
    detail::check_device_chunk(where, chunk_);
    detail::check_widths(where, dk_, dv_);
    const auto rows = static_cast<std::size_t>(heads_ * codes_);
    const auto pending = static_cast<std::size_t>(heads_ * chunk_);
    codebook_ = DeviceBuffer<Stored, Backend>(rows * dk_, stream);
    offsets_ = DeviceBuffer<Compute, Backend>(rows, stream);
    mean_values_ = DeviceBuffer<Compute, Backend>(rows * dv_, stream);
    if constexpr (kSeparateMeans) values_ = DeviceBuffer<Stored, Backend>(rows * dv_, stream);
    counts_ = DeviceBuffer<std::int64_t, Backend>(rows, stream);
    log_counts_ = DeviceBuffer<Compute, Backend>(rows, stream);
    pending_codes_ = DeviceBuffer<Index, Backend>(pending, stream);
    pending_keys_ = DeviceBuffer<Stored, Backend>(pending * dk_, stream);
    pending_values_ = DeviceBuffer<Stored, Backend>(pending * dv_, stream);
    from_host(states, stream);
  }

  Index heads() const { return heads_; }
  Index codebook_size() const { return codes_; }
  Index chunk() const { return chunk_; }
  Index key_dim() const { return dk_; }
  Index value_dim() const { return dv_; }
  std::int64_t absorbed() const { return this->counters().absorbed; }
  std::int64_t tokens() const { return this->counters().tokens; }
  Index pending() const { return static_cast<Index>(this->counters().pending); }

  // Payload bytes, as the CPU state counts them.
  std::size_t bytes() const {
    const auto width = static_cast<std::size_t>(dk_ + dv_);
    return static_cast<std::size_t>(heads_) *
           (static_cast<std::size_t>(codes_) *
                (width * sizeof(Element) + (kSeparateMeans ? width * sizeof(Compute) : 0) +
                 2 * sizeof(Compute) + sizeof(std::int64_t)) +
            static_cast<std::size_t>(chunk_) * (width * sizeof(Element) + sizeof(Index)));
  }

  // Forgets the stream; the codebooks stay.
  void reset(Stream stream) {
    Backend::zero(mean_values_.data(), mean_values_.bytes(), stream);
    if constexpr (kSeparateMeans) Backend::zero(values_.data(), values_.bytes(), stream);
    Backend::zero(counts_.data(), counts_.bytes(), stream);
    std::vector<Compute> minus_inf(static_cast<std::size_t>(heads_ * codes_), -Compute(INFINITY));
    Backend::copy(log_counts_.data(), minus_inf.data(), log_counts_.bytes(), stream);
    StateCounters c;
    c.size = codes_;
    this->upload(c, stream);
    Backend::synchronize(stream);
  }

  // The host's states, one per head (synchronises the stream).
  std::vector<HostState> to_host(Stream stream) {
    this->synchronize(stream);
    const auto rows = static_cast<std::size_t>(heads_ * codes_);
    std::vector<Element> cb(rows * dk_);
    std::vector<Compute> v(rows * dv_);
    std::vector<std::int64_t> cnt(rows);
    std::vector<Index> pc(static_cast<std::size_t>(heads_ * chunk_));
    std::vector<Element> pv(static_cast<std::size_t>(heads_ * chunk_ * dv_));
    Backend::copy(cb.data(), codebook_.data(), cb.size() * sizeof(Element), stream);
    Backend::copy(v.data(), mean_values_.data(), v.size() * sizeof(Compute), stream);
    Backend::copy(cnt.data(), counts_.data(), cnt.size() * sizeof(std::int64_t), stream);
    Backend::copy(pc.data(), pending_codes_.data(), pc.size() * sizeof(Index), stream);
    Backend::copy(pv.data(), pending_values_.data(), pv.size() * sizeof(Element), stream);
    Backend::synchronize(stream);
    std::vector<HostState> out;
    const Index p = pending();
    for (Index h = 0; h < heads_; ++h) {
      out.emplace_back(ConstRowsView<Element>{cb.data() + h * codes_ * dk_, codes_, dk_, dk_},
                       dv_, chunk_);
      Dictionary<Element>& d = out.back().dictionary();
      const DictionaryRows<Element> rows = d.rows();
      // The means, and (16-bit) the read rows rounded from them: the rows the device holds.
      for (Index r = 0; r < codes_; ++r) {
        std::copy_n(v.data() + (h * codes_ + r) * dv_, dv_, rows.mean_values.row(r));
        d.publish(r);
        d.set_count(r, cnt[static_cast<std::size_t>(h * codes_ + r)]);
      }
      out.back().restore_pending(pc.data() + h * chunk_,
                                 {pv.data() + h * chunk_ * dv_, p, dv_, dv_});
    }
    return out;
  }

  // Replaces the state with the host's (one per head, each of this state's shape, all at the
  // same stream position).
  void from_host(const std::vector<HostState>& states, Stream stream) {
    const char* where = "cuda::VqState::from_host";
    ovq::detail::require(static_cast<Index>(states.size()) == heads_, where, "got ",
                         states.size(), " states, expected ", heads_, " (one per head)");
    for (const HostState& st : states) {
      ovq::detail::require(st.codebook_size() == codes_ && st.chunk() == chunk_ &&
                               st.key_dim() == dk_ && st.value_dim() == dv_,
                           where, "a state has (S, L, dk, dv) = (", st.codebook_size(), ", ",
                           st.chunk(), ", ", st.key_dim(), ", ", st.value_dim(), "), expected (",
                           codes_, ", ", chunk_, ", ", dk_, ", ", dv_, ")");
      ovq::detail::require(st.absorbed() == states[0].absorbed() &&
                               st.pending() == states[0].pending(),
                           where, "states differ in (t, pending), expected one stream");
    }
    const auto rows = static_cast<std::size_t>(heads_ * codes_);
    std::vector<Element> cb(rows * dk_), v(kSeparateMeans ? rows * dv_ : 0);
    std::vector<Compute> off(rows), mv(rows * dv_), logc(rows);
    std::vector<std::int64_t> cnt(rows);
    std::vector<Index> pc(static_cast<std::size_t>(heads_ * chunk_), 0);
    std::vector<Element> pk(static_cast<std::size_t>(heads_ * chunk_ * dk_), Element(0)),
        pv(static_cast<std::size_t>(heads_ * chunk_ * dv_), Element(0));
    const Index p = states[0].pending();
    for (Index h = 0; h < heads_; ++h) {
      const HostState& st = states[static_cast<std::size_t>(h)];
      const Dictionary<Element>& d = st.dictionary();
      for (Index r = 0; r < codes_; ++r) {
        const std::size_t at = static_cast<std::size_t>(h * codes_ + r);
        std::copy_n(st.codebook().row(r), dk_, cb.data() + at * dk_);
        std::copy_n(d.mean_values().row(r), dv_, mv.data() + at * dv_);
        if constexpr (kSeparateMeans) std::copy_n(d.values().row(r), dv_, v.data() + at * dv_);
        off[at] = st.neg_half_norms()[r];
        cnt[at] = d.count(r);
        logc[at] = d.log_counts()[r];
      }
      for (Index i = 0; i < p; ++i) {
        pc[static_cast<std::size_t>(h * chunk_ + i)] = st.pending_codes()[i];
        std::copy_n(st.pending_keys().row(i), dk_, pk.data() + (h * chunk_ + i) * dk_);
        std::copy_n(st.pending_values().row(i), dv_, pv.data() + (h * chunk_ + i) * dv_);
      }
    }
    Backend::copy(codebook_.data(), cb.data(), cb.size() * sizeof(Element), stream);
    Backend::copy(offsets_.data(), off.data(), off.size() * sizeof(Compute), stream);
    Backend::copy(mean_values_.data(), mv.data(), mv.size() * sizeof(Compute), stream);
    if constexpr (kSeparateMeans)
      Backend::copy(values_.data(), v.data(), v.size() * sizeof(Element), stream);
    Backend::copy(counts_.data(), cnt.data(), cnt.size() * sizeof(std::int64_t), stream);
    Backend::copy(log_counts_.data(), logc.data(), logc.size() * sizeof(Compute), stream);
    Backend::copy(pending_codes_.data(), pc.data(), pc.size() * sizeof(Index), stream);
    Backend::copy(pending_keys_.data(), pk.data(), pk.size() * sizeof(Element), stream);
    Backend::copy(pending_values_.data(), pv.data(), pv.size() * sizeof(Element), stream);
    StateCounters c;
    c.absorbed = states[0].absorbed();
    c.tokens = states[0].tokens();
    c.size = codes_;
    c.pending = p;
    this->upload(c, stream);
    Backend::synchronize(stream);  // the host vectors are the copies' sources
  }

 private:
  template <class S, class B>
  friend class BasicVqAttention;

  // The value rows the reads stream: the 16-bit rows, or the means themselves.
  Stored* read_values() const {
    if constexpr (kSeparateMeans) return values_.data(); else return mean_values_.data();
  }

  Index heads_ = 0, codes_ = 0, chunk_ = 0, dk_ = 0, dv_ = 0;
  DeviceBuffer<Stored, Backend> codebook_, values_, pending_keys_, pending_values_;
  DeviceBuffer<Compute, Backend> offsets_, mean_values_, log_counts_;
  DeviceBuffer<std::int64_t, Backend> counts_;
  DeviceBuffer<Index, Backend> pending_codes_;
};

template <class Scalar, class Backend>
class BasicVqAttention
    : public DeviceMixerBase<BasicVqAttention<Scalar, Backend>, Scalar, Backend,
                             VqDeviceState<Scalar, Backend>, VqAttentionOptions> {
  using Base = DeviceMixerBase<BasicVqAttention, Scalar, Backend, VqDeviceState<Scalar, Backend>,
                               VqAttentionOptions>;
  friend Base;
  using Stored = device_element_t<Scalar>;  // what the kernels store
  using Base::head_betas_;
  using Base::options_;

 public:
  using typename Base::Compute;  // what the kernels compute in
  using typename Base::Options;
  using typename Base::State;
  using typename Base::Stream;
  static constexpr bool kHasLogSumExp = true;

  explicit BasicVqAttention(const Options& options = {}) : Base(options, "cuda::VqAttention") {
    detail::check_device_chunk("cuda::VqAttention", options_.chunk);
  }

  // `heads` heads (batch x key/value heads) over one codebook (S x dk, finite).
  State make_state(Index heads, const ConstMatrixRef<Scalar>& codebook, Index dv,
                   Stream stream = {}) const {
    ovq::detail::check_positive("cuda::VqAttention::make_state", "heads", heads);
    const VqAttention<Scalar> host(options_);
    return State(std::vector<VqState<Scalar>>(static_cast<std::size_t>(heads),
                                              host.make_state(codebook, dv)),
                 stream);
  }

  void check_state(const char* where, const State& state) const {
    ovq::detail::require(state.chunk() == options_.chunk, where, "state chunk = ", state.chunk(),
                         ", expected ", options_.chunk, " (the mixer's)");
  }

  // Everything a step of `query_heads` heads needs, allocated now: a step captured in a CUDA
  // graph cannot allocate.
  void reserve(State& state, Index query_heads, Stream stream = {}) const {
    check_state("reserve", state);
    detail::check_query_heads("reserve", query_heads, state.heads());
    const kernels::ReadPlan plan = read_plan(state, query_heads / state.heads(), 1);
    const Workspace w = layout(state, plan);
    state.template workspace<unsigned char>(w.layout.bytes(), stream, "reserve");
    state.arrivals(plan.arrival_counters, stream, "reserve");
  }

 private:
  // The read of n positions over the codebook and a chunk (its size does not depend on where
  // in the chunk the read is).
  kernels::ReadPlan read_plan(const State& st, Index group, Index n) const {
    return kernels::plan_read<Stored>(st.heads(), group, n,
                                      std::max(st.key_dim(), st.value_dim()),
                                      st.codebook_size() + st.chunk(), Backend::parallel_blocks());
  }

  struct Workspace {
    detail::WorkspaceLayout layout;
    detail::AssignWorkspace<Compute> assign;
    std::size_t partials;
  };
  // assign_splits: the codebook ranges of a piece's assignment (launch_assign).
  Workspace layout(const State& st, const kernels::ReadPlan& plan, int assign_splits = 1) const {
    Workspace w;
    w.assign = detail::AssignWorkspace<Compute>::add(
        w.layout, static_cast<std::size_t>(st.heads() * st.chunk()), assign_splits);
    w.partials = w.layout.template add<Compute>(plan.workspace_scalars);
    return w;
  }

  void run(const char* where, State& st, const ConstHeadsView<Scalar>* q,
           ConstHeadsView<Scalar> k, ConstHeadsView<Scalar> v, const HeadsView<Scalar>* o,
           Stream stream, const HeadsView<Compute>* lse = nullptr) const {
    using detail::WorkspaceLayout;
    check_state(where, st);
    detail::check_call(where, st.heads(), st.key_dim(), st.value_dim(), q, k, v, o);
    if (lse != nullptr) detail::check_lse(where, *lse, *q);
    head_betas_.check_call(where, st.heads(), q != nullptr ? q->heads : -1);
    st.begin_call(stream);
    const Index n = k.rows;
    if (n == 0) return;
    const bool capturing = Backend::capturing(stream);
    // Values first: a bad entry leaves the state as it was.
    const ConstHeadsView<Stored> q_stored = q != nullptr ? stored(*q) : ConstHeadsView<Stored>{};
    detail::launch_finite_check<Backend>(st.device_counters(), q != nullptr ? &q_stored : nullptr,
                                         stored(k), stored(v), stream);
    const ConstHeadsView<Stored> k_stored = stored(k), v_stored = stored(v);
    const Index chunk = st.chunk();
    const int heads = static_cast<int>(st.heads());
    StateCounters after = st.counters();
    for (Index pos = 0; pos < n;) {
      const Index len = std::min(chunk - static_cast<Index>(after.pending), n - pos);
      kernels::ReadPlan plan;
      if (q != nullptr) plan = read_plan(st, q->heads / st.heads(), len);
      const Workspace w = layout(
          st, plan,
          kernels::assign_splits(len, st.heads(), st.codebook_size(), Backend::parallel_blocks(),
                                 32, 64, capturing));
      void* ws = st.template workspace<unsigned char>(w.layout.bytes(), stream, where);

      // Quantise the piece's keys, then push codes, codebook rows and values.
      kernels::AssignParams<Compute, Stored, Stored> a;
      a.x = {k_stored.data + pos * k.row_stride, k.head_stride, k.row_stride};
      a.rows = len;
      a.d = st.key_dim();
      a.centroids = {st.codebook_.data(), st.codebook_size() * st.key_dim(), st.key_dim()};
      a.offset = st.offsets_.data();
      a.offset_stride = st.codebook_size();
      a.fixed_count = st.codebook_size();
      w.assign.set_assign(a, ws);
      kernels::launch_assign<Backend>(a, st.heads(), stream);
      kernels::VqPushParams<Stored> push;
      push.codes = a.arg;
      push.rows = len;
      push.values = {v_stored.data + pos * v.row_stride, v.head_stride, v.row_stride};
      push.codebook = a.centroids;
      push.pending_codes = st.pending_codes_.data();
      push.pending_keys = {st.pending_keys_.data(), chunk * st.key_dim(), st.key_dim()};
      push.pending_values = {st.pending_values_.data(), chunk * st.value_dim(), st.value_dim()};
      push.chunk = chunk;
      push.dk = st.key_dim();
      push.dv = st.value_dim();
      push.counters = st.device_counters();
      Backend::template launch<kernels::VqPushProgram<Stored>>(Grid{static_cast<int>(len), heads, 1},
                                                               push, stream);
      detail::launch_counters<Backend>(st.device_counters(), kernels::CounterOp::push, len, chunk,
                                       nullptr, stream);
      after.pending += len;
      after.tokens += len;

      if (q != nullptr) {
        kernels::ReadParams<Compute, Stored> p = detail::read_params<Compute>(
            stored(q->middle_rows(pos, len)), stored(o->middle_rows(pos, len)), st.heads(),
            st.key_dim(), st.value_dim(), options_.beta, st.device_counters());
        p.head_betas = head_betas_.template for_queries<Compute>();
        p.source = kernels::ReadSource::dictionary;
        p.memory_keys = a.centroids;
        p.memory_values = {st.read_values(), st.codebook_size() * st.value_dim(), st.value_dim()};
        p.bias = {st.log_counts_.data(), st.codebook_size(), 1};
        p.local_keys = {st.pending_keys_.data(), chunk * st.key_dim(), st.key_dim()};
        p.local_values = pending_values(st);
        p.aligned_rows = detail::aligned_read_rows(p);
        if (lse != nullptr) p.lse = {lse->data + pos * lse->row_stride, lse->head_stride,
                                     lse->row_stride};
        kernels::launch_read<Backend>(p, plan, WorkspaceLayout::at<Compute>(ws, w.partials),
                                      stream, st.arrivals(plan.arrival_counters, stream, where));
      }
      if (after.pending == chunk || capturing) {
        kernels::DictionaryWriteParams<Compute, Stored> d;
        d.values = pending_values(st);
        d.keys = {st.pending_keys_.data(), chunk * st.key_dim(), st.key_dim()};
        d.chunk = chunk;
        d.dk = st.key_dim();
        d.dv = st.value_dim();
        d.dict_values = {st.mean_values_.data(), st.codebook_size() * st.value_dim(),
                         st.value_dim()};
        d.counts = st.counts_.data();
        d.log_counts = st.log_counts_.data();
        d.capacity = st.codebook_size();
        d.counters = st.device_counters();
        d.ovq = false;
        d.assigned = st.pending_codes_.data();
        w.assign.set_grouping(d, ws);
        if constexpr (State::kSeparateMeans)
          d.read_values = {st.values_.data(), st.codebook_size() * st.value_dim(), st.value_dim()};
        d.complete = true;  // the write's last block completes the chunk in the counters
        d.states = st.heads();
        Backend::template launch<kernels::DictionaryWriteProgram<Compute, Stored>>(
            Grid{1, heads, 1}, d, stream);
        if (after.pending == chunk) {
          after.absorbed += chunk;
          after.pending = 0;
        }
      }
      pos += len;
    }
    st.end_call(after, stream);
  }

  static kernels::HeadRows<Stored> pending_values(const State& st) {
    return {st.pending_values_.data(), st.chunk() * st.value_dim(), st.value_dim()};
  }
};

}  // namespace ovq::cuda
