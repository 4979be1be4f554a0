#pragma once
// Linear attention (MATH.md section 2) with feature map phi and scalar decay gamma:
//
//   S_i = gamma S_{i-1} + phi(k_i) v_i^T,  z_i = gamma z_{i-1} + phi(k_i)
//   o_i = beta S_i^T phi(q_i)                          (unnormalised)
//   o_i = S_i^T phi(q_i) / (z_i . phi(q_i) + eps)      (normalised; beta cancels)
//
// Computed chunk by chunk in GEMM form (kernels/linear_chunk.hpp); the chunk length changes
// nothing but rounding. State: LinearState (S, z), of constant size.
#include <algorithm>

#include "ovq/core/checks.hpp"
#include "ovq/kernels/linear_chunk.hpp"
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
    detail::check_positive(where, "chunk", chunk);
  }
};

template <class Scalar, class Arch = arch::native>
class LinearAttention
    : public MixerBase<LinearAttention<Scalar, Arch>, Scalar, LinearState<Scalar>> {
 public:
  using arch_type = Arch;
  using State = LinearState<Scalar>;
  using Options = LinearAttentionOptions;

  explicit LinearAttention(const Options& options = {}) : options_(options) {
    options_.validate();
    detail::check_scalar_range<Scalar>("LinearAttention", "beta", options_.beta);
    if (options_.normalize)  // eps must not round to 0 where it was meant to guard a division
      detail::check_scalar_range<Scalar>("LinearAttention", "eps", options_.eps);
  }

  const Options& options() const { return options_; }

  State make_state(Index dk, Index dv) const { return State(dk, dv); }

  void check_state(const char* where, const State& state) const {
    detail::require(state.key_dim() > 0, where, "state is empty, expected one from make_state");
  }

  void forward_unchecked(State& state, const ConstRowsView<Scalar>* q, Index heads,
                         ConstRowsView<Scalar> k, ConstRowsView<Scalar> v,
                         const RowsView<Scalar>* o) const {
    const kernels::LinearChunkParams<Scalar> params{
        static_cast<Scalar>(options_.beta), static_cast<Scalar>(options_.decay),
        options_.normalize, static_cast<Scalar>(options_.eps)};
    // Powers up to the longest chunk this call can form (the option may exceed the call).
    const std::vector<Scalar> powers =
        kernels::decay_powers(params.decay, std::min(options_.chunk, std::max<Index>(k.rows, 1)));
    RowMatrix<Scalar> phi_q, phi_k;
    for (Index c0 = 0; c0 < k.rows; c0 += options_.chunk) {
      const Index len = std::min(options_.chunk, k.rows - c0);
      kernels::feature_map_rows(options_.feature_map, k.middle_rows(c0, len), phi_k);
      const ConstRowsView<Scalar> v_chunk = v.middle_rows(c0, len);
      for (Index h = 0; h < heads; ++h) {
        kernels::feature_map_rows(options_.feature_map, q[h].middle_rows(c0, len), phi_q);
        kernels::linear_chunk_read(phi_q, phi_k, v_chunk, state.kv(), state.k_sum(), powers,
                                   params, o[h].middle_rows(c0, len));
      }
      kernels::linear_chunk_write(phi_k, v_chunk, state.kv(), state.k_sum(), powers);
      state.add_tokens(len);
    }
  }

 private:
  Options options_;
};

}  // namespace ovq
