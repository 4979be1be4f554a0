#pragma once
// Self-attention on a device (MATH.md section 1): the CPU mixer's options and mathematics, over
// a KV cache in device memory batched over (batch x key/value heads).
//
// KvCacheState: per head, the keys and values of past tokens, all of them (capacity grown by
// the host as needed, or reserved) or, with a window W, the last W - 1 in a ring. Rows sit at
// absolute stream positions (ring slot = position mod W - 1), so the read tiles them on those
// positions as the CPU does and any cut of the stream gives the same bits.
// BasicSelfAttention<Element, Backend>: forward / step / absorb as on the CPU, each call a few
// kernels on one stream (finiteness check, per piece of `chunk` tokens a read then an append),
// never synchronising. Element: float and double (reads on FP32 FMA and DFMA), ovq::bf16 and
// ovq::fp16 (16-bit queries, keys, values, cache and outputs; reads on tensor cores with the
// softmax and sums in float, as the CPU's 16-bit mixers compute in float).
#include <algorithm>
#include <cstdint>
#include <vector>

#include "ovq/cuda/buffer.hpp"
#include "ovq/cuda/checks.hpp"
#include "ovq/cuda/elements.hpp"
#include "ovq/cuda/kernels/launch.hpp"
#include "ovq/cuda/kernels/read.hpp"
#include "ovq/cuda/kernels/rows.hpp"
#include "ovq/cuda/mixer_base.hpp"
#include "ovq/cuda/mixer_support.hpp"
#include "ovq/cuda/state_base.hpp"
#include "ovq/cuda/views.hpp"
#include "ovq/mixers/self_attention.hpp"
#include "ovq/state/kv_cache.hpp"

namespace ovq::cuda {

template <class Scalar, class Backend>
class KvCacheState : public StateBase<Backend> {
  using Base = StateBase<Backend>;

 public:
  using Stream = typename Backend::Stream;
  using scalar_type = Scalar;  // the element type (16-bit: the cache's rows are 16-bit)
  using HostState = KvCache<Scalar>;
  static constexpr Index kKeepAll = KvCache<Scalar>::kKeepAll;

  // `heads` caches of dk- and dv-wide rows; keep_rows as KvCache's (kKeepAll, or W - 1 for a
  // window W); room for `reserve_rows` rows per head without growing (a window's ring is fixed).
  KvCacheState(Index heads, Index dk, Index dv, Index keep_rows, Index reserve_rows, Stream stream)
      : Base(stream), heads_(heads), dk_(dk), dv_(dv), keep_(keep_rows) {
    const char* where = "cuda::KvCacheState";
    ovq::detail::check_positive(where, "heads", heads);
    detail::check_widths(where, dk, dv);
    ovq::detail::require(keep_rows >= kKeepAll, where, "keep_rows = ", keep_rows,
                         ", expected >= 0 or kKeepAll");
    allocate(keep_ >= 0 ? keep_ : std::max<Index>(reserve_rows, 16), stream);
  }

  Index heads() const { return heads_; }
  Index key_dim() const { return dk_; }
  Index value_dim() const { return dv_; }
  Index keep_rows() const { return keep_; }
  // Rows each head holds without growing.
  Index capacity() const { return capacity_; }
  // Ring length of a windowed cache, 0 for a cache that keeps every row.
  Index ring() const { return keep_ >= 0 ? keep_ : 0; }
  std::int64_t tokens() const { return this->counters().tokens; }
  Index size() const { return static_cast<Index>(this->counters().size); }

  // heads x capacity rows; a windowed cache's row of position p is at slot p mod ring().
  HeadsView<Scalar> keys() const { return contiguous_heads(keys_.data(), heads_, capacity_, dk_); }
  HeadsView<Scalar> values() const {
    return contiguous_heads(values_.data(), heads_, capacity_, dv_);
  }

  // Payload bytes held: the rows of every head's capacity.
  std::size_t bytes() const {
    return static_cast<std::size_t>(heads_ * capacity_ * (dk_ + dv_)) * sizeof(Scalar);
  }

  // Room for `rows` rows per head (a cache that keeps every row; a window's ring is fixed), and
  // scratch for a decode step over them: what a captured step needs.
  void reserve(Index rows, Stream stream) {
    this->begin_call(stream);
    if (keep_ < 0 && rows > capacity_) grow(rows, stream);
  }

  void reset(Stream stream) { this->upload(StateCounters{}, stream); }

  // The host's states, one per head (synchronises the stream).
  std::vector<HostState> to_host(Stream stream) {
    this->synchronize(stream);
    const Index n = size();
    std::vector<Scalar> k(static_cast<std::size_t>(heads_ * capacity_ * dk_));
    std::vector<Scalar> v(static_cast<std::size_t>(heads_ * capacity_ * dv_));
    Backend::copy(k.data(), keys_.data(), k.size() * sizeof(Scalar), stream);
    Backend::copy(v.data(), values_.data(), v.size() * sizeof(Scalar), stream);
    Backend::synchronize(stream);
    std::vector<HostState> out;
    RowMatrix<Scalar> hk(n, dk_), hv(n, dv_);
    const std::int64_t origin = tokens() - n;
    for (Index h = 0; h < heads_; ++h) {
      for (Index r = 0; r < n; ++r) {
        const Index slot = keep_ >= 0 ? static_cast<Index>((origin + r) % keep_) : r;
        std::copy_n(k.data() + (h * capacity_ + slot) * dk_, dk_, hk.row(r).data());
        std::copy_n(v.data() + (h * capacity_ + slot) * dv_, dv_, hv.row(r).data());
      }
      out.emplace_back(dk_, dv_, keep_);
      out.back().assign(rows_view(hk), rows_view(hv), tokens());
    }
    return out;
  }

  // Replaces the state with the host's (one per head, all with this state's shape and the same
  // token count and rows, as the heads of one stream have).
  void from_host(const std::vector<HostState>& caches, Stream stream) {
    const char* where = "cuda::KvCacheState::from_host";
    ovq::detail::require(static_cast<Index>(caches.size()) == heads_, where, "got ",
                         caches.size(), " states, expected ", heads_, " (one per head)");
    for (const HostState& c : caches) {
      ovq::detail::require(c.key_dim() == dk_ && c.value_dim() == dv_ && c.keep_rows() == keep_,
                           where, "a state has (dk, dv, keep_rows) = (", c.key_dim(), ", ",
                           c.value_dim(), ", ", c.keep_rows(), "), expected (", dk_, ", ", dv_,
                           ", ", keep_, ")");
      ovq::detail::require(c.tokens() == caches[0].tokens() && c.size() == caches[0].size(),
                           where, "states hold different token counts, expected one stream");
    }
    const Index n = caches.empty() ? 0 : caches[0].size();
    const std::int64_t t = caches.empty() ? 0 : caches[0].tokens();
    if (keep_ < 0 && n > capacity_) grow(n, stream);
    std::vector<Scalar> k(static_cast<std::size_t>(heads_ * capacity_ * dk_), Scalar(0));
    std::vector<Scalar> v(static_cast<std::size_t>(heads_ * capacity_ * dv_), Scalar(0));
    for (Index h = 0; h < heads_; ++h) {
      const HostState& c = caches[static_cast<std::size_t>(h)];
      for (Index r = 0; r < n; ++r) {
        const Index slot = keep_ >= 0 ? static_cast<Index>((t - n + r) % keep_) : r;
        std::copy_n(c.keys().row(r), dk_, k.data() + (h * capacity_ + slot) * dk_);
        std::copy_n(c.values().row(r), dv_, v.data() + (h * capacity_ + slot) * dv_);
      }
    }
    Backend::copy(keys_.data(), k.data(), k.size() * sizeof(Scalar), stream);
    Backend::copy(values_.data(), v.data(), v.size() * sizeof(Scalar), stream);
    StateCounters c;
    c.tokens = t;
    c.size = n;
    this->upload(c, stream);
    Backend::synchronize(stream);  // the host vectors are the copies' sources
  }

 private:
  template <class S, class B>
  friend class BasicSelfAttention;

  void allocate(Index rows, Stream stream) {
    capacity_ = rows;
    keys_ = DeviceBuffer<Scalar, Backend>(static_cast<std::size_t>(heads_ * rows * dk_), stream);
    values_ = DeviceBuffer<Scalar, Backend>(static_cast<std::size_t>(heads_ * rows * dv_), stream);
  }

  // A larger buffer, the rows held copied head by head (stream-ordered).
  void grow(Index rows, Stream stream) {
    const Index old_capacity = capacity_;
    DeviceBuffer<Scalar, Backend> old_k = std::move(keys_), old_v = std::move(values_);
    allocate(std::max(rows, old_capacity + old_capacity / 2), stream);
    const Index held = size();
    for (Index h = 0; h < heads_; ++h) {
      Backend::copy(keys_.data() + h * capacity_ * dk_, old_k.data() + h * old_capacity * dk_,
                    static_cast<std::size_t>(held * dk_) * sizeof(Scalar), stream);
      Backend::copy(values_.data() + h * capacity_ * dv_, old_v.data() + h * old_capacity * dv_,
                    static_cast<std::size_t>(held * dv_) * sizeof(Scalar), stream);
    }
  }

  Index heads_ = 0, dk_ = 0, dv_ = 0, keep_ = kKeepAll, capacity_ = 0;
  DeviceBuffer<Scalar, Backend> keys_, values_;
};

template <class Scalar, class Backend>
class BasicSelfAttention
    : public DeviceMixerBase<BasicSelfAttention<Scalar, Backend>, Scalar, Backend,
                             KvCacheState<Scalar, Backend>, SelfAttentionOptions> {
  using Base = DeviceMixerBase<BasicSelfAttention, Scalar, Backend, KvCacheState<Scalar, Backend>,
                               SelfAttentionOptions>;
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

  explicit BasicSelfAttention(const Options& options = {})
      : Base(options, "cuda::SelfAttention") {}

  // `heads` = batch x key/value heads; reserve_tokens: rows to hold before growing.
  State make_state(Index heads, Index dk, Index dv, Stream stream = {},
                   Index reserve_tokens = 0) const {
    return State(heads, dk, dv, keep_rows(), reserve_tokens, stream);
  }

  void check_state(const char* where, const State& state) const {
    ovq::detail::require(state.keep_rows() == keep_rows(), where, "state keeps ",
                         state.keep_rows(), " rows, expected ", keep_rows(), " (window ",
                         options_.window, ")");
  }

  // Everything a step of `query_heads` heads needs up to `tokens` tokens in the cache, allocated
  // now: a step captured in a CUDA graph cannot allocate.
  void reserve(State& state, Index query_heads, Index tokens, Stream stream = {}) const {
    check_state("reserve", state);
    detail::check_query_heads("reserve", query_heads, state.heads());
    state.reserve(tokens, stream);
    const kernels::ReadPlan plan = read_plan(state, query_heads / state.heads(), 1, 0, true);
    state.template workspace<Compute>(plan.workspace_scalars, stream, "reserve");
    state.arrivals(plan.arrival_counters, stream, "reserve");
  }

 private:
  // The read of n positions over a cache of `rows` rows; a captured read may be replayed over a
  // fuller cache, so it is planned for the capacity.
  kernels::ReadPlan read_plan(const State& st, Index group, Index n, Index rows,
                              bool capturing) const {
    const Index memory = capturing ? (st.keep_ >= 0 ? st.keep_ : st.capacity_) : rows;
    return kernels::plan_read<Stored>(st.heads(), group, n,
                                      std::max(st.key_dim(), st.value_dim()), memory + n,
                                      Backend::parallel_blocks());
  }

  Index keep_rows() const { return options_.window > 0 ? options_.window - 1 : State::kKeepAll; }

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
    if (st.keep_ < 0 && after.size + n > st.capacity_) {
      ovq::detail::require(!capturing, where, "the cache holds ", st.capacity_,
                           " rows per head, expected room for ", after.size + n,
                           ": reserve the state before capturing a graph");
      st.grow(after.size + n, stream);
    }
    // Values first: a bad entry leaves the state as it was. A call of one small piece (a decode
    // step) reads first, then checks and appends in one launch (the read changes no state; its
    // outputs are not defined when the check fails).
    const ConstHeadsView<Stored> q_stored = q != nullptr ? stored(*q) : ConstHeadsView<Stored>{};
    const Index piece = options_.causal ? options_.chunk : n;
    const bool small = n <= piece && st.keep_ != 0 &&
                       detail::small_call(n, st.heads(), q != nullptr ? q->heads : 0);
    if (!small)
      detail::launch_finite_check<Backend>(st.device_counters(),
                                           q != nullptr ? &q_stored : nullptr, stored(k),
                                           stored(v), stream);

    for (Index c0 = 0; c0 < n; c0 += piece) {
      const Index len = std::min(piece, n - c0);
      if (q != nullptr)
        read(st, q->middle_rows(c0, len), k.middle_rows(c0, len), v.middle_rows(c0, len),
             o->middle_rows(c0, len),
             lse != nullptr ? lse->middle_rows(c0, len) : HeadsView<Compute>{},
             static_cast<Index>(after.size), capturing, where, stream);
      if (small) {
        detail::launch_check_copy<Backend>(st.device_counters(),
                                           q != nullptr ? &q_stored : nullptr, stored(k),
                                           stored(v), append_copy(st), append_count(st, n),
                                           stream);
      } else {
        append(st, k.middle_rows(c0, len), v.middle_rows(c0, len), stream);
      }
      after.tokens += len;
      after.size = st.keep_ >= 0 ? std::min<std::int64_t>(after.size + len, st.keep_)
                                 : after.size + len;
    }
    st.end_call(after, stream);
  }

  void read(State& st, ConstHeadsView<Scalar> q, ConstHeadsView<Scalar> k,
            ConstHeadsView<Scalar> v, HeadsView<Scalar> o, HeadsView<Compute> lse, Index rows,
            bool capturing, const char* where, Stream stream) const {
    kernels::ReadParams<Compute, Stored> p = detail::read_params<Compute>(
        stored(q), stored(o), st.heads(), st.key_dim(), st.value_dim(), options_.beta,
        st.device_counters());
    p.head_betas = head_betas_.template for_queries<Compute>();
    p.causal = options_.causal;
    p.window = options_.window;
    p.source = kernels::ReadSource::cache;
    p.memory_keys = {stored(st.keys()).data, st.capacity_ * st.dk_, st.dk_};
    p.memory_values = {stored(st.values()).data, st.capacity_ * st.dv_, st.dv_};
    p.ring = st.ring();
    p.local_keys = {stored(k).data, k.head_stride, k.row_stride};
    p.local_values = {stored(v).data, v.head_stride, v.row_stride};
    p.aligned_rows = detail::aligned_read_rows(p);
    p.lse = {lse.data, lse.head_stride, lse.row_stride};
    const kernels::ReadPlan plan = read_plan(st, p.group, p.n_queries, rows, capturing);
    Compute* ws = st.template workspace<Compute>(plan.workspace_scalars, stream, where);
    kernels::launch_read<Backend>(p, plan, ws, stream,
                                  st.arrivals(plan.arrival_counters, stream, where));
  }

  // Rows into the cache (its ring, or after its rows), and the counters' append of n rows.
  kernels::CopyRowsParams<Stored> append_copy(const State& st) const {
    kernels::CopyRowsParams<Stored> c;
    c.dst[0] = stored(st.keys());
    c.dst[1] = stored(st.values());
    c.counters = st.device_counters();
    c.ring = st.ring();
    c.limit = st.capacity_;
    return c;
  }
  kernels::CounterParams append_count(const State& st, Index n) const {
    kernels::CounterParams u;
    u.counters = st.device_counters();
    u.op = kernels::CounterOp::append;
    u.n = n;
    u.keep = st.keep_;
    u.limit = st.capacity_;
    return u;
  }

  void append(State& st, ConstHeadsView<Scalar> k, ConstHeadsView<Scalar> v, Stream stream) const {
    kernels::CopyRowsParams<Stored> c = append_copy(st);
    c.src[0] = stored(k);
    c.src[1] = stored(v);
    if (st.keep_ != 0)
      Backend::template launch<kernels::CopyRowsProgram<Stored>>(
          Grid{static_cast<int>(k.rows), static_cast<int>(st.heads()), 1}, c, stream);
    Backend::template launch<kernels::CounterProgram>(Grid{}, append_count(st, k.rows), stream);
  }
};

}  // namespace ovq::cuda
