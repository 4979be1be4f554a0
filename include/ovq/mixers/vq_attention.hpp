#pragma once
// VQ-attention (MATH.md section 3): causal self-attention over keys quantised to a fixed
// codebook C, computed in linear time.
//
//   z_j = argmin_s |k_j - C_s|^2 (ties: smallest s),  o_i = softmax_{j <= i}(beta q_i . C_{z_j}) v_j
//
// The past enters through its per-code counts c_s and mean values vbar_s (memory rows with bias
// log c_s); the current chunk is read with its quantised keys as local rows. The result does not
// depend on the chunk length. Cost per token: 2 S dk (quantise) + 2 (S + L/2)(dk + dv) (read).
#include <algorithm>
#include <vector>

#include "ovq/core/checks.hpp"
#include "ovq/kernels/assign.hpp"
#include "ovq/kernels/read.hpp"
#include "ovq/kernels/update.hpp"
#include "ovq/mixers/mixer_base.hpp"
#include "ovq/state/vq_state.hpp"

namespace ovq {

struct VqAttentionOptions {
  double beta = 1.0;
  Index chunk = 64;

  void validate(const char* where = "VqAttention") const {
    detail::check_positive_finite(where, "beta", beta);
    detail::check_positive(where, "chunk", chunk);
  }
};

template <class Scalar, class Arch = arch::native>
class VqAttention : public MixerBase<VqAttention<Scalar, Arch>, Scalar, VqState<Scalar>> {
 public:
  using arch_type = Arch;
  using State = VqState<Scalar>;
  using Options = VqAttentionOptions;

  explicit VqAttention(const Options& options = {}) : options_(options) {
    options_.validate();
    detail::check_scalar_range<Scalar>("VqAttention", "beta", options_.beta);
  }

  const Options& options() const { return options_; }

  // codebook: S x dk (S >= 1, finite); dv: value width.
  State make_state(const ConstMatrixRef<Scalar>& codebook, Index dv) const {
    detail::check_positive("VqAttention::make_state", "codebook rows", codebook.rows());
    return State(rows_view(codebook), dv);
  }

  void check_state(const char* where, const State& state) const {
    detail::require(state.key_dim() > 0, where, "state is empty, expected one from make_state");
  }

  void forward_unchecked(State& state, const ConstRowsView<Scalar>* q, Index heads,
                         ConstRowsView<Scalar> k, ConstRowsView<Scalar> v,
                         const RowsView<Scalar>* o) const {
    const Scalar beta = static_cast<Scalar>(options_.beta);
    Dictionary<Scalar>& dict = state.dictionary();
    const Index chunk = std::min(options_.chunk, std::max<Index>(k.rows, 1));
    std::vector<Scalar> best(static_cast<std::size_t>(chunk));
    std::vector<Index> code(static_cast<std::size_t>(chunk));
    RowMatrix<Scalar> quantised(chunk, state.key_dim());
    kernels::AssignmentGroups groups;
    for (Index c0 = 0; c0 < k.rows; c0 += chunk) {
      const Index len = std::min(chunk, k.rows - c0);
      const ConstRowsView<Scalar> k_chunk = k.middle_rows(c0, len);
      const ConstRowsView<Scalar> v_chunk = v.middle_rows(c0, len);
      kernels::assign_nearest<Scalar, Arch>(k_chunk, state.codebook(), state.neg_half_norms(),
                                            best.data(), code.data());
      for (Index i = 0; i < len; ++i) quantised.row(i) = as_eigen(state.codebook()).row(code[i]);

      const kernels::MemoryRows<Scalar> memory{dict.keys(), dict.values(), dict.log_counts()};
      const kernels::LocalRows<Scalar> local{
          {quantised.data(), len, state.key_dim(), state.key_dim()}, v_chunk};
      kernels::read<Scalar, Arch>(detail::slice_heads(q, heads, c0, len).data(), heads, memory,
                                  local, kernels::ReadMask{}, beta,
                                  detail::slice_heads(o, heads, c0, len).data());

      groups.build(code.data(), len, dict.size());
      kernels::scatter_mean_update<Scalar>(dict.values(), dict.counts(), groups, v_chunk,
                                           UpdateRate::adaptive());
      for (Index g = 0; g < groups.size(); ++g) {
        const Index r = groups.rows[static_cast<std::size_t>(g)];
        dict.set_count(r, dict.count(r) + groups.members(g));
      }
    }
  }

 private:
  Options options_;
};

}  // namespace ovq
