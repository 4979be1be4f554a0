#pragma once
// OVQ-attention (MATH.md section 4): attention over an online dictionary learnt during the
// forward pass by sparse k-means, plus the raw rows of the current chunk.
//
// Every token reads the dictionary as it was before its chunk (memory rows, bias log count)
// and the raw rows of its chunk up to itself (local rows). Once a chunk of L tokens is complete
// it is written into the dictionary (grow, seed, assign, update). Tokens are fed through a
// pending buffer, so forward calls of any lengths and token-by-token steps give the same result.
// Cost per token: 2 (n + L/2)(dk + dv) (read) + 2 n dk + O(dk + dv) (write), n <= N.
#include <algorithm>

#include "ovq/core/checks.hpp"
#include "ovq/kernels/executor.hpp"
#include "ovq/mixers/dictionary_read.hpp"
#include "ovq/mixers/mixer_base.hpp"
#include "ovq/state/ovq_state.hpp"
#include "ovq/state/policies.hpp"

namespace ovq {

struct OvqOptions {
  Index capacity = 1024;  // N, maximum number of centroids
  Index chunk = 64;       // L, tokens per dictionary write
  double beta = 1.0;
  Growth growth = Growth::dirichlet();
  Seeding seeding = Seeding::spread();
  UpdateRate rate = UpdateRate::adaptive();
  bool renormalize = false;  // unit-norm key centroids after each update

  void validate(const char* where = "OvqAttention") const {
    detail::check_positive(where, "capacity", capacity);
    detail::check_chunk(where, chunk);
    detail::check_positive_finite(where, "beta", beta);
    growth.validate(where);
    rate.validate(where);
  }
};

template <class Scalar, class Arch = arch::native>
class OvqAttention : public MixerBase<OvqAttention<Scalar, Arch>, Scalar, OvqState<Scalar>> {
 public:
  using arch_type = Arch;
  using State = OvqState<Scalar>;
  static constexpr bool kHasLogSumExp = true;
  using Options = OvqOptions;

  explicit OvqAttention(const Options& options = {}) : options_(options) {
    options_.validate();
    detail::check_scalar_range<Scalar>("OvqAttention", "beta", options_.beta);
  }

  const Options& options() const { return options_; }

  State make_state(Index dk, Index dv) const {
    return State(options_.capacity, options_.chunk, dk, dv);
  }

  void check_state(const char* where, const State& state) const {
    detail::require(state.key_dim() > 0, where, "state is empty, expected one from make_state");
    detail::require(state.capacity() == options_.capacity, where, "state capacity = ",
                    state.capacity(), ", expected ", options_.capacity, " (the mixer's)");
    detail::require(state.chunk() == options_.chunk, where, "state chunk = ", state.chunk(),
                    ", expected ", options_.chunk, " (the mixer's)");
  }

  void forward_unchecked(State& state, const ConstRowsView<Scalar>* q, Index heads,
                         ConstRowsView<Scalar> k, ConstRowsView<Scalar> v,
                         const RowsView<Scalar>* o,
                         compute_t<Scalar>* const* lse = nullptr) const {
    const compute_t<Scalar> beta = static_cast<compute_t<Scalar>>(options_.beta);
    const kernels::OvqWriteParams write{options_.growth, options_.seeding, options_.rate,
                                        options_.renormalize};
    const Index chunk = options_.chunk;
    for (Index pos = 0; pos < k.rows;) {
      const Index offset = state.pending();
      const Index len = std::min(chunk - offset, k.rows - pos);
      state.push_pending(k.middle_rows(pos, len), v.middle_rows(pos, len));

      detail::read_dictionary_and_chunk<Scalar, Arch>(state.dictionary(), state.pending_keys(),
                                                      state.pending_values(), offset, q, heads,
                                                      pos, len, beta, o, lse);

      if (state.pending() == chunk) {
        kernels::Executor<Scalar, Arch>::ovq_write(state.dictionary(), state.absorbed(),
                                                   state.pending_keys(), state.pending_values(),
                                                   write);
        state.complete_chunk();
      }
      pos += len;
    }
  }

 private:
  Options options_;
};

}  // namespace ovq
