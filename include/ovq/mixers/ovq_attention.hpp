#pragma once
// OVQ-attention (MATH.md section 4): attention over an online dictionary learnt during the
// forward pass by sparse k-means, plus the raw rows of the current chunk.
//
// Every token reads the dictionary as it was before its chunk (memory rows, bias log count, or
// 0 without the count bias)
// and the raw rows of its chunk up to itself (local rows). Once a chunk of L tokens is complete
// it is written into the dictionary (grow, seed, assign, update). Tokens are fed through a
// pending buffer, so forward calls of any lengths and token-by-token steps give the same result.
// Cost per token: 2 (n + L/2)(dk + dv) (read) + 2 n dk + O(dk + dv) (write), n <= N.
#include <algorithm>
#include <string>

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
  bool renormalize = false;         // unit-norm key rows after each update
  bool renormalize_values = false;  // unit-norm value rows after each update (mean values only)
  bool count_bias = true;           // rows read with bias log c (false: counts set rates only)
  ValueUpdate value_update = ValueUpdate::mean;

  // The presets (attend ovq --preset NAME): "default" (docs/math.md's reading, these defaults),
  // "kvm" (the public OVQ implementation's reading: saturating growth, lowest-similarity seeding,
  // unit-norm key and value rows) and "kvm-delta" (the same with the delta-rule value update,
  // which renormalises the key rows only). Capacity, chunk and beta keep their defaults.
  static OvqOptions kvm() {
    OvqOptions o;
    o.growth = Growth::saturating();
    o.seeding = Seeding::lowest_similarity();
    o.renormalize = true;
    o.renormalize_values = true;
    return o;
  }
  static OvqOptions kvm_delta() {
    OvqOptions o = kvm();
    o.renormalize_values = false;
    o.value_update = ValueUpdate::delta;
    return o;
  }
  static constexpr const char* kPresetNames[] = {"default", "kvm", "kvm-delta"};
  static OvqOptions preset(const std::string& name) {
    if (name == "default") return {};
    if (name == "kvm") return kvm();
    if (name == "kvm-delta") return kvm_delta();
    throw ArgumentError(detail::concat("OvqOptions::preset: name = '", name,
                                       "', expected default, kvm or kvm-delta"));
  }

  void validate(const char* where = "OvqAttention") const {
    detail::check_positive(where, "capacity", capacity);
    detail::check_chunk(where, chunk);
    detail::check_positive_finite(where, "beta", beta);
    growth.validate(where);
    rate.validate(where);
    detail::require(!(renormalize_values && value_update == ValueUpdate::delta), where,
                    "renormalize_values = true with value_update = delta, expected false (delta "
                    "rows hold residual corrections, not unit directions)");
  }
};

template <class Scalar, class Arch = arch::native>
class OvqAttention : public MixerBase<OvqAttention<Scalar, Arch>, Scalar, OvqState<Scalar>> {
 public:
  using arch_type = Arch;
  using State = OvqState<Scalar>;
  static constexpr bool kHasLogSumExp = true;
  static constexpr bool kHasHeadBetas = true;  // forward_unchecked takes one beta per head
  // Whether the write reads with beta (the delta rule's prediction): with one beta per head, a
  // state's query heads must then share one (the write reads with the first head's).
  bool write_uses_beta() const { return options_.value_update == ValueUpdate::delta; }
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
                         compute_t<Scalar>* const* lse = nullptr,
                         const compute_t<Scalar>* head_betas = nullptr) const {
    const compute_t<Scalar> beta = static_cast<compute_t<Scalar>>(options_.beta);
    const kernels::OvqWriteParams write{options_.growth,     options_.seeding,
                                        options_.rate,       options_.renormalize,
                                        options_.renormalize_values, options_.count_bias,
                                        options_.value_update,
                                        head_betas == nullptr ? options_.beta
                                                              : static_cast<double>(head_betas[0])};
    const Index chunk = options_.chunk;
    for (Index pos = 0; pos < k.rows;) {
      const Index offset = state.pending();
      const Index len = std::min(chunk - offset, k.rows - pos);
      state.push_pending(k.middle_rows(pos, len), v.middle_rows(pos, len));

      detail::read_dictionary_and_chunk<Scalar, Arch>(state.dictionary(), state.pending_keys(),
                                                      state.pending_values(), offset, q, heads,
                                                      pos, len, beta, o, lse,
                                                      options_.count_bias, head_betas);

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
