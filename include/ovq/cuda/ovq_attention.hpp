#pragma once
// OVQ-attention on a device (MATH.md section 4): the CPU mixer's options and mathematics, over
// online dictionaries in device memory batched over (batch x key/value heads).
//
// OvqDeviceState: per head D_k (N x dk), D_v (N x dv), 64-bit counts and their logs (the read
// bias), the pending chunk (L rows); shared by the heads, the counters (t, n, pending) and the
// growth schedule (schedule.hpp). All heads of a state see the same stream positions, so they
// grow alike.
// BasicOvqAttention<Scalar, Backend>: forward / step / absorb. Per piece of the stream (up to
// the end of the current chunk): the rows join the pending chunk, the queries read the
// dictionary (bias log c) and the chunk's raw rows; a complete chunk is written: assignment to
// the old centroids (AssignProgram), seeding, grouping and the sparse update
// (DictionaryWriteProgram), the counters (CounterProgram). A step's kernels are the same
// whatever the position, and the write's decide on the device whether the chunk is complete, so
// a step can be captured in a CUDA graph and replayed.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "ovq/cuda/buffer.hpp"
#include "ovq/cuda/checks.hpp"
#include "ovq/cuda/elements.hpp"
#include "ovq/cuda/kernels/assign.hpp"
#include "ovq/cuda/kernels/dictionary_write.hpp"
#include "ovq/cuda/kernels/launch.hpp"
#include "ovq/cuda/kernels/read.hpp"
#include "ovq/cuda/kernels/rows.hpp"
#include "ovq/cuda/mixer_base.hpp"
#include "ovq/cuda/mixer_support.hpp"
#include "ovq/cuda/schedule.hpp"
#include "ovq/cuda/state_base.hpp"
#include "ovq/cuda/views.hpp"
#include "ovq/cuda/workspace.hpp"
#include "ovq/mixers/ovq_attention.hpp"
#include "ovq/state/ovq_state.hpp"

namespace ovq::cuda {

template <class Element, class Backend>
class OvqDeviceState : public StateBase<Backend> {
  using Base = StateBase<Backend>;
  using Stored = device_element_t<Element>;  // what the kernels store
  using Compute = compute_t<Element>;        // what they compute in

 public:
  using Stream = typename Backend::Stream;
  using scalar_type = Element;
  using HostState = OvqState<Element>;
  // 16-bit elements: the running means are float rows of their own, and the reads stream their
  // 16-bit rounding (as the CPU's Dictionary<bf16>); float and double: one set of rows.
  static constexpr bool kSeparateMeans = is_half_v<Element>;

  OvqDeviceState(Index heads, Index capacity, Index chunk, Index dk, Index dv, Growth growth,
                 Stream stream)
      : Base(stream), heads_(heads), capacity_(capacity), chunk_(chunk), dk_(dk), dv_(dv),
        growth_(growth) {
    const char* where = "cuda::OvqState";
    ovq::detail::check_positive(where, "heads", heads);
    ovq::detail::check_positive(where, "capacity", capacity);
    detail::check_device_chunk(where, chunk);
    detail::check_widths(where, dk, dv);
    const auto rows = static_cast<std::size_t>(heads * capacity);
    const auto pending = static_cast<std::size_t>(heads * chunk);
    mean_keys_ = DeviceBuffer<Compute, Backend>(rows * dk, stream);
    mean_values_ = DeviceBuffer<Compute, Backend>(rows * dv, stream);
    if constexpr (kSeparateMeans) {
      keys_ = DeviceBuffer<Stored, Backend>(rows * dk, stream);
      values_ = DeviceBuffer<Stored, Backend>(rows * dv, stream);
    }
    counts_ = DeviceBuffer<std::int64_t, Backend>(rows, stream);
    log_counts_ = DeviceBuffer<Compute, Backend>(rows, stream);
    pending_keys_ = DeviceBuffer<Stored, Backend>(pending * dk, stream);
    pending_values_ = DeviceBuffer<Stored, Backend>(pending * dv, stream);
    plan_schedule(0, 0, stream);
  }

  Index heads() const { return heads_; }
  Index capacity() const { return capacity_; }
  Index chunk() const { return chunk_; }
  Index key_dim() const { return dk_; }
  Index value_dim() const { return dv_; }
  // As the host last saw them (see StateBase).
  std::int64_t absorbed() const { return this->counters().absorbed; }
  std::int64_t tokens() const { return this->counters().tokens; }
  Index size() const { return static_cast<Index>(this->counters().size); }
  Index pending() const { return static_cast<Index>(this->counters().pending); }

  // heads x capacity rows (rows [0, size()) active) as the reads see them; heads x chunk
  // pending rows.
  HeadsView<Element> keys() const { return element_heads(read_keys(), dk_); }
  HeadsView<Element> values() const { return element_heads(read_values(), dv_); }
  // The running means (the same rows as keys() and values() for float and double).
  HeadsView<Compute> mean_keys() const {
    return contiguous_heads(mean_keys_.data(), heads_, capacity_, dk_);
  }
  HeadsView<Compute> mean_values() const {
    return contiguous_heads(mean_values_.data(), heads_, capacity_, dv_);
  }
  HeadsView<Element> pending_keys() const {
    return contiguous_heads(reinterpret_cast<Element*>(pending_keys_.data()), heads_, chunk_, dk_);
  }
  HeadsView<Element> pending_values() const {
    return contiguous_heads(reinterpret_cast<Element*>(pending_values_.data()), heads_, chunk_,
                            dv_);
  }
  std::int64_t* counts() const { return counts_.data(); }
  Compute* log_counts() const { return log_counts_.data(); }

  // Payload bytes, as the CPU state counts them (full capacity and chunk, whatever is active).
  std::size_t bytes() const {
    const auto width = static_cast<std::size_t>(dk_ + dv_);
    return static_cast<std::size_t>(heads_) *
           (static_cast<std::size_t>(capacity_) *
                (width * sizeof(Element) + (kSeparateMeans ? width * sizeof(Compute) : 0) +
                 sizeof(Compute) + sizeof(std::int64_t)) +
            static_cast<std::size_t>(chunk_) * width * sizeof(Element));
  }

  void reset(Stream stream) {
    this->upload(StateCounters{}, stream);
    plan_schedule(0, 0, stream);
  }

  // The host's states, one per head (synchronises the stream).
  std::vector<HostState> to_host(Stream stream) {
    this->synchronize(stream);
    const Index n = size(), p = pending();
    const auto rows = static_cast<std::size_t>(heads_ * capacity_);
    std::vector<Compute> k(rows * dk_), v(rows * dv_);
    std::vector<std::int64_t> cnt(rows);
    std::vector<Element> pk(static_cast<std::size_t>(heads_ * chunk_ * dk_)),
        pv(static_cast<std::size_t>(heads_ * chunk_ * dv_));
    Backend::copy(k.data(), mean_keys_.data(), k.size() * sizeof(Compute), stream);
    Backend::copy(v.data(), mean_values_.data(), v.size() * sizeof(Compute), stream);
    Backend::copy(cnt.data(), counts_.data(), cnt.size() * sizeof(std::int64_t), stream);
    Backend::copy(pk.data(), pending_keys_.data(), pk.size() * sizeof(Element), stream);
    Backend::copy(pv.data(), pending_values_.data(), pv.size() * sizeof(Element), stream);
    Backend::synchronize(stream);
    std::vector<HostState> out;
    for (Index h = 0; h < heads_; ++h) {
      out.emplace_back(capacity_, chunk_, dk_, dv_);
      Dictionary<Element>& d = out.back().dictionary();
      // The means, and (16-bit) the read rows rounded from them: the rows the device holds.
      for (Index r = 0; r < n; ++r)
        d.push_means(k.data() + (h * capacity_ + r) * dk_, v.data() + (h * capacity_ + r) * dv_,
                     cnt[static_cast<std::size_t>(h * capacity_ + r)]);
      out.back().restore(absorbed(), {pk.data() + h * chunk_ * dk_, p, dk_, dk_},
                         {pv.data() + h * chunk_ * dv_, p, dv_, dv_});
    }
    return out;
  }

  // Replaces the state with the host's: one per head, each of this state's shape, all at the
  // same stream position with the same dictionary size (as the heads of one stream are).
  void from_host(const std::vector<HostState>& states, Stream stream) {
    const char* where = "cuda::OvqState::from_host";
    ovq::detail::require(static_cast<Index>(states.size()) == heads_, where, "got ",
                         states.size(), " states, expected ", heads_, " (one per head)");
    for (const HostState& st : states) {
      ovq::detail::require(st.capacity() == capacity_ && st.chunk() == chunk_ &&
                               st.key_dim() == dk_ && st.value_dim() == dv_,
                           where, "a state has (N, L, dk, dv) = (", st.capacity(), ", ",
                           st.chunk(), ", ", st.key_dim(), ", ", st.value_dim(), "), expected (",
                           capacity_, ", ", chunk_, ", ", dk_, ", ", dv_, ")");
      ovq::detail::require(st.absorbed() == states[0].absorbed() &&
                               st.pending() == states[0].pending() &&
                               st.dictionary().size() == states[0].dictionary().size(),
                           where, "states differ in (t, pending, n), expected one stream");
    }
    const Index n = states[0].dictionary().size(), p = states[0].pending();
    const auto rows = static_cast<std::size_t>(heads_ * capacity_);
    std::vector<Compute> mk(rows * dk_, Compute(0)), mv(rows * dv_, Compute(0)), logc(rows);
    std::vector<Element> k(kSeparateMeans ? rows * dk_ : 0, Element(0)),
        v(kSeparateMeans ? rows * dv_ : 0, Element(0));
    std::vector<std::int64_t> cnt(rows, 0);
    std::vector<Element> pk(static_cast<std::size_t>(heads_ * chunk_ * dk_), Element(0)),
        pv(static_cast<std::size_t>(heads_ * chunk_ * dv_), Element(0));
    for (Index h = 0; h < heads_; ++h) {
      const HostState& st = states[static_cast<std::size_t>(h)];
      const Dictionary<Element>& d = st.dictionary();
      for (Index r = 0; r < n; ++r) {
        std::copy_n(d.mean_keys().row(r), dk_, mk.data() + (h * capacity_ + r) * dk_);
        std::copy_n(d.mean_values().row(r), dv_, mv.data() + (h * capacity_ + r) * dv_);
        if constexpr (kSeparateMeans) {
          std::copy_n(d.keys().row(r), dk_, k.data() + (h * capacity_ + r) * dk_);
          std::copy_n(d.values().row(r), dv_, v.data() + (h * capacity_ + r) * dv_);
        }
        cnt[static_cast<std::size_t>(h * capacity_ + r)] = d.count(r);
      }
      for (Index r = 0; r < capacity_; ++r)
        logc[static_cast<std::size_t>(h * capacity_ + r)] = d.log_counts()[r];
      for (Index i = 0; i < p; ++i) {
        std::copy_n(st.pending_keys().row(i), dk_, pk.data() + (h * chunk_ + i) * dk_);
        std::copy_n(st.pending_values().row(i), dv_, pv.data() + (h * chunk_ + i) * dv_);
      }
    }
    Backend::copy(mean_keys_.data(), mk.data(), mk.size() * sizeof(Compute), stream);
    Backend::copy(mean_values_.data(), mv.data(), mv.size() * sizeof(Compute), stream);
    if constexpr (kSeparateMeans) {
      Backend::copy(keys_.data(), k.data(), k.size() * sizeof(Element), stream);
      Backend::copy(values_.data(), v.data(), v.size() * sizeof(Element), stream);
    }
    Backend::copy(counts_.data(), cnt.data(), cnt.size() * sizeof(std::int64_t), stream);
    Backend::copy(log_counts_.data(), logc.data(), logc.size() * sizeof(Compute), stream);
    Backend::copy(pending_keys_.data(), pk.data(), pk.size() * sizeof(Element), stream);
    Backend::copy(pending_values_.data(), pv.data(), pv.size() * sizeof(Element), stream);
    StateCounters c;
    c.absorbed = states[0].absorbed();
    c.tokens = states[0].tokens();
    c.size = n;
    c.pending = p;
    this->upload(c, stream);
    plan_schedule(c.absorbed, n, stream);
    Backend::synchronize(stream);  // the host vectors are the copies' sources
  }

  const std::vector<std::int64_t>& schedule() const { return schedule_host_; }
  const std::int64_t* device_schedule() const { return schedule_.data(); }

 private:
  template <class S, class B>
  friend class BasicOvqAttention;

  // The rows the reads stream: the 16-bit rows, or the means themselves.
  Stored* read_keys() const {
    if constexpr (kSeparateMeans) return keys_.data(); else return mean_keys_.data();
  }
  Stored* read_values() const {
    if constexpr (kSeparateMeans) return values_.data(); else return mean_values_.data();
  }
  HeadsView<Element> element_heads(Stored* rows, Index d) const {
    return contiguous_heads(reinterpret_cast<Element*>(rows), heads_, capacity_, d);
  }

  // The growth schedule from (t, n); the counters' next entry is its first.
  void plan_schedule(std::int64_t t, Index n, Stream stream) {
    schedule_host_ = growth_schedule(growth_, capacity_, chunk_, t, n);
    schedule_ = DeviceBuffer<std::int64_t, Backend>(std::max<std::size_t>(schedule_host_.size(), 2),
                                                    stream);
    Backend::copy(schedule_.data(), schedule_host_.data(),
                  schedule_host_.size() * sizeof(std::int64_t), stream);
  }
  // The counters after the complete chunk they are at is written, as the device's write and
  // CounterProgram leave them.
  void complete_on_host(StateCounters& c) const {
    const std::int64_t chunk_index = c.absorbed / chunk_;
    const auto entry = static_cast<std::size_t>(2 * c.schedule);
    if (entry < schedule_host_.size() && schedule_host_[entry] == chunk_index) {
      c.size += schedule_host_[entry + 1];
      c.schedule += 1;
    }
    c.absorbed += chunk_;
    c.pending = 0;
  }

  Index heads_, capacity_, chunk_, dk_, dv_;
  Growth growth_;
  DeviceBuffer<Compute, Backend> mean_keys_, mean_values_, log_counts_;
  DeviceBuffer<Stored, Backend> keys_, values_;  // 16-bit elements only
  DeviceBuffer<Stored, Backend> pending_keys_, pending_values_;
  DeviceBuffer<std::int64_t, Backend> counts_, schedule_;
  std::vector<std::int64_t> schedule_host_;
};

template <class Scalar, class Backend>
class BasicOvqAttention
    : public DeviceMixerBase<BasicOvqAttention<Scalar, Backend>, Scalar, Backend,
                             OvqDeviceState<Scalar, Backend>, OvqOptions> {
  using Base = DeviceMixerBase<BasicOvqAttention, Scalar, Backend, OvqDeviceState<Scalar, Backend>,
                               OvqOptions>;
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

  explicit BasicOvqAttention(const Options& options = {}) : Base(options, "cuda::OvqAttention") {
    detail::check_device_chunk("cuda::OvqAttention", options_.chunk);
  }

  // `heads` = batch x key/value heads.
  State make_state(Index heads, Index dk, Index dv, Stream stream = {}) const {
    return State(heads, options_.capacity, options_.chunk, dk, dv, options_.growth, stream);
  }

  void check_state(const char* where, const State& state) const {
    ovq::detail::require(state.capacity() == options_.capacity, where, "state capacity = ",
                         state.capacity(), ", expected ", options_.capacity, " (the mixer's)");
    ovq::detail::require(state.chunk() == options_.chunk, where, "state chunk = ", state.chunk(),
                         ", expected ", options_.chunk, " (the mixer's)");
  }

  // Everything a step of `query_heads` heads needs, allocated now: a step captured in a CUDA
  // graph cannot allocate.
  void reserve(State& state, Index query_heads, Stream stream = {}) const {
    check_state("reserve", state);
    detail::check_query_heads("reserve", query_heads, state.heads());
    const kernels::ReadPlan plan =
        step_plan(state, query_heads / state.heads(), 1, state.capacity(), state.chunk());
    const WriteWorkspace w = layout(state, plan);
    state.template workspace<unsigned char>(w.layout.bytes(), stream, "reserve");
    state.arrivals(std::max(plan.arrival_counters, w.prediction.arrival_counters), stream,
                   "reserve");
  }

 private:
  // The delta rule's write predicts each key with the read, so set_head_betas keeps one beta per
  // key/value head's group.
  bool write_uses_beta() const { return options_.value_update == ValueUpdate::delta; }

  kernels::ReadPlan step_plan(const State& st, Index group, Index n, Index memory,
                              Index local) const {
    return kernels::plan_read<Stored>(st.heads(), group, n,
                                      std::max(st.key_dim(), st.value_dim()), memory + local,
                                      Backend::parallel_blocks());
  }

  struct WriteWorkspace {
    detail::WorkspaceLayout layout;
    detail::AssignWorkspace<Compute> assign;  // best: each key's nearest score
    std::size_t draws, opened, partials, yhat, prediction_partials;
    kernels::ReadPlan prediction;  // the delta rule's read (none without it)
  };
  // assign_splits: the centroid ranges of the chunk write's assignment (launch_assign).
  WriteWorkspace layout(const State& st, const kernels::ReadPlan& plan,
                        int assign_splits = 1) const {
    const std::size_t read_scalars = plan.workspace_scalars;
    WriteWorkspace w;
    const auto rows = static_cast<std::size_t>(st.heads() * st.chunk());
    w.assign = detail::AssignWorkspace<Compute>::add(w.layout, rows, assign_splits);
    w.draws = w.layout.template add<Index>(rows);
    w.opened = w.layout.template add<std::int64_t>(2);
    w.partials = w.layout.template add<Compute>(read_scalars);
    const bool delta = options_.value_update == ValueUpdate::delta;
    if (delta) w.prediction = step_plan(st, 1, st.chunk(), st.capacity(), 0);
    w.yhat = w.layout.template add<Stored>(delta ? rows * static_cast<std::size_t>(st.value_dim())
                                                 : 0);
    w.prediction_partials = w.layout.template add<Compute>(w.prediction.workspace_scalars);
    return w;
  }

  void run(const char* where, State& st, const ConstHeadsView<Scalar>* q,
           ConstHeadsView<Scalar> k, ConstHeadsView<Scalar> v, const HeadsView<Scalar>* o,
           Stream stream, const HeadsView<Compute>* lse = nullptr) const {
    check_state(where, st);
    detail::check_call(where, st.heads(), st.key_dim(), st.value_dim(), q, k, v, o);
    if (lse != nullptr) detail::check_lse(where, *lse, *q);
    head_betas_.check_call(where, st.heads(), q != nullptr ? q->heads : -1);
    st.begin_call(stream);
    const Index n = k.rows;
    if (n == 0) return;
    const bool capturing = Backend::capturing(stream);
    StateCounters after = st.counters();
    const Index chunk = st.chunk();
    // Values first: a bad entry leaves the state as it was. A call of one small piece (a decode
    // step) checks and pushes in one launch.
    const ConstHeadsView<Stored> q_stored = q != nullptr ? stored(*q) : ConstHeadsView<Stored>{};
    const bool small = n <= chunk - static_cast<Index>(after.pending) &&
                       detail::small_call(n, st.heads(), q != nullptr ? q->heads : 0);
    if (!small)
      detail::launch_finite_check<Backend>(st.device_counters(),
                                           q != nullptr ? &q_stored : nullptr, stored(k),
                                           stored(v), stream);

    for (Index pos = 0; pos < n;) {
      const Index offset = static_cast<Index>(after.pending);
      const Index len = std::min(chunk - offset, n - pos);
      if (small) {
        detail::launch_check_push<Backend>(st.device_counters(),
                                           q != nullptr ? &q_stored : nullptr, stored(k),
                                           stored(v), stored(st.pending_keys()),
                                           stored(st.pending_values()), chunk, stream);
      } else {
        detail::launch_push<Backend>(st.device_counters(), stored(k.middle_rows(pos, len)),
                                     stored(v.middle_rows(pos, len)), stored(st.pending_keys()),
                                     stored(st.pending_values()), chunk, stream);
      }
      after.pending += len;
      after.tokens += len;
      // A captured step must work at any position: its read is planned for a full dictionary
      // and chunk, and its write is always launched (it runs only on a complete chunk).
      const Index memory = capturing ? st.capacity() : static_cast<Index>(after.size);
      const Index local = capturing ? chunk : static_cast<Index>(after.pending);
      kernels::ReadPlan plan;
      if (q != nullptr) plan = step_plan(st, q->heads / st.heads(), len, memory, local);
      // A chunk completed here is assigned to the dictionary as it is now (after.size rows).
      const int assign_splits = kernels::assign_splits(
          st.chunk(), st.heads(), static_cast<Index>(after.size), Backend::parallel_blocks(), 32,
          64, capturing);
      const WriteWorkspace w = layout(st, plan, assign_splits);
      void* ws = st.template workspace<unsigned char>(w.layout.bytes(), stream, where);
      if (q != nullptr)
        read(st, q->middle_rows(pos, len), o->middle_rows(pos, len),
             lse != nullptr ? lse->middle_rows(pos, len) : HeadsView<Compute>{}, plan,
             detail::WorkspaceLayout::at<Compute>(ws, w.partials), stream);
      if (after.pending == chunk || capturing) {
        write(st, w, ws, stream);
        if (after.pending == chunk) st.complete_on_host(after);
      }
      pos += len;
    }
    st.end_call(after, stream);
  }

  // The dictionary as a read's memory rows (bias log c), 16-bit rows loaded 16 bytes at a time
  // where they allow it.
  void set_dictionary(const State& st, kernels::ReadParams<Compute, Stored>& p) const {
    p.memory_keys = {st.read_keys(), st.capacity() * st.key_dim(), st.key_dim()};
    p.memory_values = {st.read_values(), st.capacity() * st.value_dim(), st.value_dim()};
    p.bias = {st.log_counts_.data(), st.capacity(), 1};
    p.count_bias = options_.count_bias;
  }

  void read(State& st, ConstHeadsView<Scalar> q, HeadsView<Scalar> o, HeadsView<Compute> lse,
            const kernels::ReadPlan& plan, Compute* partials, Stream stream) const {
    kernels::ReadParams<Compute, Stored> p = detail::read_params<Compute>(
        stored(q), stored(o), st.heads(), st.key_dim(), st.value_dim(), options_.beta,
        st.device_counters());
    p.head_betas = head_betas_.template for_queries<Compute>();
    p.source = kernels::ReadSource::dictionary;
    set_dictionary(st, p);
    p.local_keys = {st.pending_keys_.data(), st.chunk() * st.key_dim(), st.key_dim()};
    p.local_values = {st.pending_values_.data(), st.chunk() * st.value_dim(), st.value_dim()};
    p.aligned_rows = detail::aligned_read_rows(p);
    p.lse = {lse.data, lse.head_stride, lse.row_stride};
    kernels::launch_read<Backend>(p, plan, partials, stream,
                                  st.arrivals(plan.arrival_counters, stream, "read"));
  }

  void write(State& st, const WriteWorkspace& w, void* ws, Stream stream) const {
    using detail::WorkspaceLayout;
    const int heads = static_cast<int>(st.heads());
    Stored* yhat = WorkspaceLayout::at<Stored>(ws, w.yhat);
    const bool delta = options_.value_update == ValueUpdate::delta;
    const kernels::HeadRows<Stored> chunk_keys{st.pending_keys_.data(), st.chunk() * st.key_dim(),
                                               st.key_dim()};
    if (delta) {
      // The prediction of every chunk key by the dictionary before the chunk (its read rows, as
      // on the CPU): a read with the pending keys as queries and no local rows, only once the
      // chunk is complete.
      const Index L = st.chunk(), dk = st.key_dim(), dv = st.value_dim();
      const ConstHeadsView<Stored> keys{st.pending_keys_.data(), st.heads(), L, dk, L * dk, dk};
      const HeadsView<Stored> out{yhat, st.heads(), L, dv, L * dv, dv};
      kernels::ReadParams<Compute, Stored> p = detail::read_params<Compute>(
          keys, out, st.heads(), st.key_dim(), st.value_dim(), options_.beta,
          st.device_counters());
      p.head_betas = head_betas_.template for_states<Compute>();
      p.source = kernels::ReadSource::dictionary_rows;
      p.causal = false;
      set_dictionary(st, p);
      p.only_if_pending = st.chunk();
      p.aligned_rows = detail::aligned_read_rows(p);
      kernels::launch_read<Backend>(
          p, w.prediction, WorkspaceLayout::at<Compute>(ws, w.prediction_partials), stream,
          st.arrivals(w.prediction.arrival_counters, stream, "write"));
    }
    std::int64_t* opened = WorkspaceLayout::at<std::int64_t>(ws, w.opened);

    // Assignment, seeding and the update work on the running means (16-bit chunk rows widened).
    kernels::AssignParams<Compute, Stored> a;
    a.x = chunk_keys;
    a.rows = st.chunk();
    a.d = st.key_dim();
    a.centroids = {st.mean_keys_.data(), st.capacity() * st.key_dim(), st.key_dim()};
    a.counters = st.device_counters();
    a.complete_chunk = st.chunk();
    w.assign.set_assign(a, ws);
    kernels::launch_assign<Backend>(a, st.heads(), stream);

    kernels::DictionaryWriteParams<Compute, Stored> d;
    d.keys = chunk_keys;
    d.values = {st.pending_values_.data(), st.chunk() * st.value_dim(), st.value_dim()};
    d.chunk = st.chunk();
    d.dk = st.key_dim();
    d.dv = st.value_dim();
    d.dict_keys = {st.mean_keys_.data(), st.capacity() * st.key_dim(), st.key_dim()};
    d.dict_values = {st.mean_values_.data(), st.capacity() * st.value_dim(), st.value_dim()};
    d.counts = st.counts_.data();
    d.log_counts = st.log_counts_.data();
    d.capacity = st.capacity();
    d.counters = st.device_counters();
    d.ovq = true;
    d.schedule = st.device_schedule();
    d.schedule_entries = static_cast<Index>(st.schedule().size() / 2);
    d.spread = options_.seeding.kind == Seeding::Kind::spread;
    d.lowest_similarity = options_.seeding.kind == Seeding::Kind::lowest_similarity;
    d.seed = options_.seeding.seed;
    d.adaptive = options_.rate.kind == UpdateRate::Kind::adaptive;
    d.eta = options_.rate.eta;
    d.renormalize = options_.renormalize;
    d.renormalize_values = options_.renormalize_values;
    d.delta = delta;
    d.yhat = yhat;
    d.nearest = a.best;
    d.assigned = a.arg;
    w.assign.set_grouping(d, ws);
    d.draws = WorkspaceLayout::at<Index>(ws, w.draws);
    d.opened = opened;
    if constexpr (State::kSeparateMeans) {
      d.read_keys = {st.keys_.data(), st.capacity() * st.key_dim(), st.key_dim()};
      d.read_values = {st.values_.data(), st.capacity() * st.value_dim(), st.value_dim()};
    }
    // The write's last block completes the chunk in the counters.
    d.complete = true;
    d.states = st.heads();
    Backend::template launch<kernels::DictionaryWriteProgram<Compute, Stored>>(Grid{1, heads, 1},
                                                                                d, stream);
  }
};

}  // namespace ovq::cuda
