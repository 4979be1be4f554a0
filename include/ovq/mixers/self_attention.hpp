#pragma once
// Self-attention (MATH.md section 1): causal, sliding-window or non-causal softmax attention.
//
//   o_i = softmax_{j in A(i)} (beta q_i . k_j) v_j
//   causal A(i) = {j <= i}; window W: {i - W < j <= i}; non-causal: every key seen so far and
//   every key of the current call.
//
// State: the key/value cache (KvCache). Each call reads the cache as memory and the call's own
// rows as local rows through the fused read, then appends. Any chunk length, and any way of
// cutting the stream into calls (step() included), gives the same bits; `chunk` only bounds how
// many queries are read before their rows are appended. Each read packs the key (and, on AMX,
// value) tiles it scores once for all of its queries, so longer pieces pack the cache fewer times.
// Cost per call of T tokens over a cache of C rows: 2 T (C + T/2) (dk + dv) flops (causal).
#include <algorithm>

#include "ovq/core/checks.hpp"
#include "ovq/kernels/executor.hpp"
#include "ovq/mixers/mixer_base.hpp"
#include "ovq/state/kv_cache.hpp"

namespace ovq {

struct SelfAttentionOptions {
  double beta = 1.0;
  bool causal = true;
  Index window = 0;  // 0: unbounded; W >= 1: a token sees itself and the W - 1 before it
  Index chunk = 4096;

  void validate(const char* where = "SelfAttention") const {
    detail::check_positive_finite(where, "beta", beta);
    detail::require(window >= 0, where, "window = ", window, ", expected >= 0 (0: none)");
    detail::require(causal || window == 0, where, "window = ", window,
                    ", expected 0 for non-causal attention");
    detail::check_positive(where, "chunk", chunk);
  }
};

template <class Scalar, class Arch = arch::native>
class SelfAttention : public MixerBase<SelfAttention<Scalar, Arch>, Scalar, KvCache<Scalar>> {
 public:
  using arch_type = Arch;
  using State = KvCache<Scalar>;
  using Options = SelfAttentionOptions;
  static constexpr bool kHasLogSumExp = true;
  static constexpr bool kHasHeadBetas = true;  // forward_unchecked takes one beta per head
  bool write_uses_beta() const { return false; }

  explicit SelfAttention(const Options& options = {}) : options_(options) {
    options_.validate();
    detail::check_scalar_range<Scalar>("SelfAttention", "beta", options_.beta);
  }

  const Options& options() const { return options_; }

  State make_state(Index dk, Index dv) const {
    return State(dk, dv, options_.window > 0 ? options_.window - 1 : State::kKeepAll);
  }

  void check_state(const char* where, const State& state) const {
    detail::require(state.key_dim() > 0, where, "state is empty, expected one from make_state");
    const Index want = options_.window > 0 ? options_.window - 1 : State::kKeepAll;
    detail::require(state.keep_rows() == want, where, "state keeps ", state.keep_rows(),
                    " rows, expected ", want, " (window ", options_.window, ")");
  }

  void forward_unchecked(State& state, const ConstRowsView<Scalar>* q, Index heads,
                         ConstRowsView<Scalar> k, ConstRowsView<Scalar> v,
                         const RowsView<Scalar>* o,
                         compute_t<Scalar>* const* lse = nullptr,
                         const compute_t<Scalar>* head_betas = nullptr) const {
    const compute_t<Scalar> beta = static_cast<compute_t<Scalar>>(options_.beta);
    // Non-causal queries see every key of the call, so the call is read as one piece.
    const Index piece = options_.causal ? options_.chunk : std::max<Index>(k.rows, 1);
    for (Index c0 = 0; c0 < k.rows; c0 += piece) {
      const Index len = std::min(piece, k.rows - c0);
      // The cache's rows start at absolute position tokens - size: the read tiles keys on
      // absolute positions, so every cut of the stream gives the same bits.
      const kernels::MemoryRows<Scalar> memory{state.keys(), state.values(), nullptr,
                                               state.tokens() - state.size()};
      const kernels::LocalRows<Scalar> local{k.middle_rows(c0, len), v.middle_rows(c0, len)};
      const kernels::ReadMask mask{options_.causal, 0, options_.window};
      kernels::Executor<Scalar, Arch>::read(
          detail::slice_heads(q, heads, c0, len).data(), heads, memory, local, mask, beta,
          detail::slice_heads(o, heads, c0, len).data(),
          lse == nullptr ? nullptr : detail::offset_rows(lse, heads, c0).data(), head_betas);
      state.append(local.keys, local.values);
    }
  }

 private:
  Options options_;
};

}  // namespace ovq
