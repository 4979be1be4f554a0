#pragma once
// Linear attention (MATH.md section 2) with feature map phi and scalar decay gamma:
//
//   S_i = gamma S_{i-1} + phi(k_i) v_i^T,  z_i = gamma z_{i-1} + phi(k_i)
//   o_i = beta S_i^T phi(q_i)                          (unnormalised)
//   o_i = S_i^T phi(q_i) / (z_i . phi(q_i) + eps)      (normalised; beta cancels)
//
// Computed in chunks of L tokens at fixed stream positions (kernels/linear_chunk.hpp): the rows
// of the current, incomplete chunk wait in the state and are folded into (S, z) once the chunk is
// complete. Every output is computed in the same order however the stream is split into calls, so
// one forward call, pieces of any lengths and token-by-token steps give the same bits; the chunk
// length changes nothing but rounding. State: LinearState (S, z and at most L pending rows), of
// constant size.
#include <algorithm>
#include <cmath>
#include <vector>

#include "ovq/core/checks.hpp"
#include "ovq/kernels/executor.hpp"
#include "ovq/mixers/mixer_base.hpp"
#include "ovq/state/linear_state.hpp"

namespace ovq {

using kernels::FeatureMap;

struct LinearAttentionOptions {
  double beta = 1.0;
  FeatureMap feature_map = FeatureMap::identity;
  bool normalize = false;
  double decay = 1.0;  // gamma in (0, 1]; 1: no decay
  double eps = 1e-6;   // added to the normaliser
  Index chunk = 64;

  void validate(const char* where = "LinearAttention") const {
    detail::check_positive_finite(where, "beta", beta);
    detail::require(std::isfinite(decay) && decay > 0.0 && decay <= 1.0, where, "decay = ", decay,
                    ", expected a value in (0, 1]");
    detail::require(std::isfinite(eps) && eps >= 0.0, where, "eps = ", eps,
                    ", expected a finite value >= 0");
    detail::check_chunk(where, chunk);
  }
};

template <class Scalar, class Arch = arch::native>
class LinearAttention
    : public MixerBase<LinearAttention<Scalar, Arch>, Scalar, LinearState<Scalar>> {
 public:
  using arch_type = Arch;
  using State = LinearState<Scalar>;
  using Options = LinearAttentionOptions;
  using Compute = compute_t<Scalar>;
  static constexpr bool kHasLogSumExp = false;  // no softmax
  static constexpr bool kHasHeadBetas = false;  // one beta (a scale of the unnormalised read)
  bool write_uses_beta() const { return false; }

  explicit LinearAttention(const Options& options = {}) : options_(options) {
    options_.validate();
    detail::check_scalar_range<Scalar>("LinearAttention", "beta", options_.beta);
    if (options_.normalize)  // eps must not round to 0 where it was meant to guard a division
      detail::check_scalar_range<Scalar>("LinearAttention", "eps", options_.eps);
    powers_ = kernels::decay_powers(static_cast<Compute>(options_.decay), options_.chunk);
  }

  const Options& options() const { return options_; }

  State make_state(Index dk, Index dv) const { return State(dk, dv, options_.chunk); }

  void check_state(const char* where, const State& state) const {
    detail::require(state.key_dim() > 0, where, "state is empty, expected one from make_state");
    detail::require(state.chunk() == options_.chunk, where, "state chunk = ", state.chunk(),
                    ", expected ", options_.chunk, " (the mixer's)");
  }

  // S and z over every token the state has seen, its pending rows included: the S_t and z_t of
  // the recurrence (MATH.md section 2). The state keeps the pending rows apart; this folds them
  // into a copy.
  struct Sums {
    RowMatrix<Compute> kv;     // S, dk x dv
    RowVector<Compute> k_sum;  // z, dk
  };
  Sums sums(const State& state) const {
    check_state("sums", state);
    Sums out{state.kv(), state.k_sum()};
    if (state.pending() > 0) {
      RowMatrix<Compute> phi_k;
      kernels::feature_map_rows(options_.feature_map, state.pending_keys(), phi_k);
      kernels::Executor<Scalar, Arch>::linear_write(phi_k, state.pending_values(), out.kv, out.k_sum,
                                                    powers_);
    }
    return out;
  }

  // Sequence parallelism: the state after the tokens of `prefix` followed by those summarised
  // in `summary` (a state that started empty and saw only those tokens):
  //   S = gamma^b S_prefix + S_summary,  z = gamma^b z_prefix + z_summary
  // over the b tokens the summary folded, with the summary's pending rows. The prefix must hold
  // no pending rows (its tokens a multiple of the chunk), so that the summary's chunks sit where
  // one run's would; the result then equals one run over both to rounding (the sums associate
  // differently). Cost: O(dk dv).
  State chain(const State& prefix, const State& summary) const {
    const char* where = "chain";
    check_state(where, prefix);
    check_state(where, summary);
    detail::require(prefix.key_dim() == summary.key_dim() &&
                        prefix.value_dim() == summary.value_dim(),
                    where, "summary has (dk, dv) = (", summary.key_dim(), ", ",
                    summary.value_dim(), "), expected the prefix's (", prefix.key_dim(), ", ",
                    prefix.value_dim(), ")");
    detail::require(prefix.pending() == 0, where, "prefix holds ", prefix.pending(),
                    " pending rows (t = ", prefix.tokens(), "), expected t a multiple of the chunk ",
                    options_.chunk);
    State out = summary;
    const Compute g = static_cast<Compute>(std::pow(options_.decay,
                                                    static_cast<double>(summary.absorbed())));
    out.kv() = g * prefix.kv() + summary.kv();
    out.k_sum() = g * prefix.k_sum() + summary.k_sum();
    out.restore(prefix.tokens() + summary.absorbed(), summary.pending_keys(),
                summary.pending_values());
    return out;
  }

  void forward_unchecked(State& state, const ConstRowsView<Scalar>* q, Index heads,
                         ConstRowsView<Scalar> k, ConstRowsView<Scalar> v,
                         const RowsView<Scalar>* o,
                         Compute* const* /*lse: none, see kHasLogSumExp*/ = nullptr,
                         const Compute* /*head_betas: none, see kHasHeadBetas*/ = nullptr) const {
    using Exec = kernels::Executor<Scalar, Arch>;
    const kernels::LinearChunkParams<Compute> params{
        static_cast<Compute>(options_.beta), static_cast<Compute>(options_.decay),
        options_.normalize, static_cast<Compute>(options_.eps)};
    const Index chunk = options_.chunk;
    const Index dk = state.key_dim();
    thread_local AlignedVector<Compute> panels;
    RowMatrix<Compute> phi_k;
    for (Index pos = 0; pos < k.rows;) {
      const Index offset = state.pending();
      const Index len = std::min(chunk - offset, k.rows - pos);
      state.push_pending(k.middle_rows(pos, len), v.middle_rows(pos, len));
      const bool complete = state.pending() == chunk;
      if (heads > 0 || complete)
        kernels::feature_map_rows(options_.feature_map, state.pending_keys(), phi_k);
      if (heads > 0) {
        Exec::pack_linear_keys({phi_k.data(), phi_k.rows(), dk, dk}, panels);
        Exec::linear_read(detail::slice_heads(q, heads, pos, len).data(), heads, offset,
                          options_.feature_map, panels.data(), state.pending_values(), state.kv(),
                          state.k_sum(), powers_, params,
                          detail::slice_heads(o, heads, pos, len).data());
      }
      if (complete) {
        Exec::linear_write(phi_k, state.pending_values(), state.kv(), state.k_sum(), powers_);
        state.complete_chunk();
      }
      pos += len;
    }
  }

 private:
  Options options_;
  std::vector<Compute> powers_;  // g^i for i in [0, L]
};

}  // namespace ovq
