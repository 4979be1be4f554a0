#pragma once
// VQ-attention (MATH.md section 3): causal self-attention over keys quantised to a fixed
// codebook C, computed in linear time.
//
//   z_j = argmin_s |k_j - C_s|^2 (ties: smallest s),  o_i = softmax_{j <= i}(beta q_i . C_{z_j}) v_j
//
// Chunks of L tokens sit at fixed stream positions. Every token reads the past chunks through
// their per-code counts c_s and mean values vbar_s (memory rows with bias log c_s), as they were
// before its chunk, and the rows of its own chunk up to itself with their quantised keys (local
// rows, kept in the state's pending buffer). A chunk is written into the counts and means once it
// is complete. So forward calls of any lengths and token-by-token steps read the same rows and
// write the same chunks, and the result does not depend on the chunk length (to rounding).
// Cost per token: 2 S dk (quantise) + 2 (S + L/2)(dk + dv) (read).
#include <algorithm>
#include <vector>

#include "ovq/core/checks.hpp"
#include "ovq/kernels/executor.hpp"
#include "ovq/mixers/dictionary_read.hpp"
#include "ovq/mixers/mixer_base.hpp"
#include "ovq/state/vq_state.hpp"

namespace ovq {

struct VqAttentionOptions {
  double beta = 1.0;
  Index chunk = 64;

  void validate(const char* where = "VqAttention") const {
    detail::check_positive_finite(where, "beta", beta);
    detail::check_chunk(where, chunk);
  }
};

template <class Scalar, class Arch = arch::native>
class VqAttention : public MixerBase<VqAttention<Scalar, Arch>, Scalar, VqState<Scalar>> {
 public:
  using arch_type = Arch;
  using State = VqState<Scalar>;
  static constexpr bool kHasLogSumExp = true;
  static constexpr bool kHasHeadBetas = true;  // forward_unchecked takes one beta per head
  bool write_uses_beta() const { return false; }
  using Options = VqAttentionOptions;

  explicit VqAttention(const Options& options = {}) : options_(options) {
    options_.validate();
    detail::check_scalar_range<Scalar>("VqAttention", "beta", options_.beta);
  }

  const Options& options() const { return options_; }

  // codebook: S x dk (S >= 1, finite); dv: value width.
  State make_state(const ConstMatrixRef<Scalar>& codebook, Index dv) const {
    detail::check_positive("VqAttention::make_state", "codebook rows", codebook.rows());
    return State(rows_view(codebook), dv, options_.chunk);
  }

  void check_state(const char* where, const State& state) const {
    detail::require(state.key_dim() > 0, where, "state is empty, expected one from make_state");
    detail::require(state.chunk() == options_.chunk, where, "state chunk = ", state.chunk(),
                    ", expected ", options_.chunk, " (the mixer's)");
  }

  void forward_unchecked(State& state, const ConstRowsView<Scalar>* q, Index heads,
                         ConstRowsView<Scalar> k, ConstRowsView<Scalar> v,
                         const RowsView<Scalar>* o,
                         compute_t<Scalar>* const* lse = nullptr,
                         const compute_t<Scalar>* head_betas = nullptr) const {
    using Exec = kernels::Executor<Scalar, Arch>;
    const compute_t<Scalar> beta = static_cast<compute_t<Scalar>>(options_.beta);
    const Index chunk = options_.chunk;
    const Index most = std::min(chunk, k.rows);
    std::vector<compute_t<Scalar>> best(static_cast<std::size_t>(most));
    std::vector<Index> code(static_cast<std::size_t>(most));
    kernels::AssignmentGroups groups;
    for (Index pos = 0; pos < k.rows;) {
      const Index offset = state.pending();
      const Index len = std::min(chunk - offset, k.rows - pos);
      Exec::assign_nearest(k.middle_rows(pos, len), state.codebook(), state.neg_half_norms(),
                           best.data(), code.data());
      state.push_pending(code.data(), v.middle_rows(pos, len));

      detail::read_dictionary_and_chunk<Scalar, Arch>(state.dictionary(), state.pending_keys(),
                                                      state.pending_values(), offset, q, heads,
                                                      pos, len, beta, o, lse, true,
                                                      head_betas);

      if (state.pending() == chunk) {
        Exec::vq_write(state.dictionary(), state.pending_codes(), state.pending_values(), groups);
        state.complete_chunk();
      }
      pos += len;
    }
  }

 private:
  Options options_;
};

}  // namespace ovq
