#pragma once
// One logit scale per query head on a device mixer (self, VQ and OVQ attention), as
// MultiHead::set_head_betas on the CPU: Hq betas for the query heads of one batch entry, which
// read kv_heads key/value heads (Hq = kv_heads x group). A call's heads are batch x Hq query heads
// over batch x kv_heads states, so the same Hq betas serve every batch entry.
#include <vector>

#include "ovq/core/checks.hpp"
#include "ovq/cuda/kernels/read.hpp"

namespace ovq::cuda::detail {

class HeadBetaTable {
 public:
  HeadBetaTable() = default;

  // betas: Hq entries, each finite, > 0 and in Scalar's range; kv_heads divides Hq. Where the
  // mixer's write reads with beta (OVQ's delta rule), the query heads of a key/value head share
  // theirs. Empty betas: no table (the options' beta for every head).
  template <class Scalar>
  static HeadBetaTable make(const char* where, const std::vector<double>& betas, Index kv_heads,
                            bool shared_by_group) {
    HeadBetaTable t;
    if (betas.empty()) return t;
    const Index hq = static_cast<Index>(betas.size());
    ovq::detail::require(hq <= kMax, where, "betas has ", hq, " entries, expected at most ", kMax,
                         " query heads on CUDA");
    ovq::detail::require(kv_heads >= 1 && hq % kv_heads == 0, where, "kv_heads = ", kv_heads,
                         ", expected a divisor of the ", hq, " query heads (one beta each)");
    ovq::detail::check_head_betas<Scalar>(where, betas, hq / kv_heads, shared_by_group);
    t.betas_ = betas;
    t.kv_heads_ = kv_heads;
    return t;
  }

  bool empty() const { return betas_.empty(); }
  const std::vector<double>& betas() const { return betas_; }

  // A call over `states` states (batch x kv_heads) with `query_heads` query heads (batch x Hq;
  // < 0: a call without queries).
  void check_call(const char* where, Index states, Index query_heads) const {
    if (empty()) return;
    const Index hq = static_cast<Index>(betas_.size());
    ovq::detail::require(states % kv_heads_ == 0, where, "the state has ", states,
                         " heads, expected a multiple of the head betas' ", kv_heads_,
                         " key/value heads (batch x kv_heads)");
    if (query_heads < 0) return;
    const Index want = states / kv_heads_ * hq;
    ovq::detail::require(query_heads == want, where, "Q has ", query_heads, " heads, expected ",
                         want, " (batch x the head betas' ", hq, " query heads)");
  }

  // The scales of a read whose query heads are the call's (batch x Hq).
  template <class Scalar>
  kernels::HeadBetas<Scalar> for_queries() const {
    kernels::HeadBetas<Scalar> out;
    for (const double b : betas_) out.values[out.count++] = static_cast<Scalar>(b);
    return out;
  }
  // The scales of a read with one query head per state (the delta rule's prediction): each
  // key/value head's group's beta.
  template <class Scalar>
  kernels::HeadBetas<Scalar> for_states() const {
    kernels::HeadBetas<Scalar> out;
    if (empty()) return out;
    const std::size_t group = betas_.size() / static_cast<std::size_t>(kv_heads_);
    for (std::size_t h = 0; h < betas_.size(); h += group)
      out.values[out.count++] = static_cast<Scalar>(betas_[h]);
    return out;
  }

 private:
  static constexpr Index kMax = kernels::HeadBetas<float>::kMax;
  std::vector<double> betas_;
  Index kv_heads_ = 1;
};

}  // namespace ovq::cuda::detail
