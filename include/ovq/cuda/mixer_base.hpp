#pragma once
// What every device mixer offers on top of its own run(), written once (the CPU's MixerBase,
// mixers/mixer_base.hpp, for device views batched over heads):
//
//   forward(state, Q, K, V, O)      Q: (heads g, T, dk), K: (heads, T, dk), V: (heads, T, dv),
//                                   O: (heads g, T, dv) written; continues from the state
//   forward(state, Q, K, V, O, lse) also each query's log-sum-exp (lse: (heads g, T, 1) in the
//                                   compute type): log sum_j exp(s_ij) over the logits (bias
//                                   included) query i saw, -inf where it saw none, as on the
//                                   CPU (softmax mixers: self, VQ, OVQ)
//   step(state, q, k, v, o)         one token per head (T = 1)
//   absorb(state, K, V)             writes K and V into the state without reading
//   set_head_betas(betas, kv_heads) one logit scale per query head (softmax mixers)
//
// each one call of the mixer's run() on one stream, never synchronising. A mixer (Derived)
// provides:
//   void run(const char* where, State&, const ConstHeadsView<S>* q, ConstHeadsView<S> k,
//            ConstHeadsView<S> v, const HeadsView<S>* o, Stream
//            [, const HeadsView<compute_t<S>>* lse]) const;   // lse where kHasLogSumExp
//   static constexpr bool kHasLogSumExp;
// and checks every argument in run() before anything is launched. A mixer whose write reads
// with beta (OVQ's delta rule) also hides the base's write_uses_beta() (false) behind its own,
// so that the query heads of one key/value head must share their beta.
#include <string>
#include <vector>

#include "ovq/core/checks.hpp"
#include "ovq/cuda/head_betas.hpp"
#include "ovq/cuda/views.hpp"

namespace ovq::cuda {

template <class Derived, class Scalar, class Backend, class StateT, class OptionsT>
class DeviceMixerBase {
 public:
  using Options = OptionsT;
  using State = StateT;
  using Stream = typename Backend::Stream;
  using scalar_type = Scalar;
  using Compute = compute_t<Scalar>;

  const Options& options() const { return options_; }

  void forward(State& state, ConstHeadsView<Scalar> q, ConstHeadsView<Scalar> k,
               ConstHeadsView<Scalar> v, HeadsView<Scalar> o, Stream stream = {}) const {
    self().run("forward", state, &q, k, v, &o, stream);
  }
  void forward(State& state, ConstHeadsView<Scalar> q, ConstHeadsView<Scalar> k,
               ConstHeadsView<Scalar> v, HeadsView<Scalar> o, HeadsView<Compute> lse,
               Stream stream = {}) const {
    static_assert(Derived::kHasLogSumExp, "this mixer has no softmax, so no log-sum-exp output");
    self().run("forward", state, &q, k, v, &o, stream, &lse);
  }
  void step(State& state, ConstHeadsView<Scalar> q, ConstHeadsView<Scalar> k,
            ConstHeadsView<Scalar> v, HeadsView<Scalar> o, Stream stream = {}) const {
    ovq::detail::check_rows("step", "K", k.rows, 1, "one token per step");
    self().run("step", state, &q, k, v, &o, stream);
  }
  void absorb(State& state, ConstHeadsView<Scalar> k, ConstHeadsView<Scalar> v,
              Stream stream = {}) const {
    self().run("absorb", state, nullptr, k, v, nullptr, stream);
  }

  // One beta per query head in place of the options' beta (head_betas.hpp; the CPU's
  // MultiHead::set_head_betas): betas for the Hq query heads of one batch entry, which read
  // kv_heads key/value heads; calls then have batch x Hq query heads over batch x kv_heads
  // states. Empty betas: the options' beta for every head. A captured graph keeps the betas it
  // was captured with (they travel by value in the kernels' parameters).
  void set_head_betas(const std::vector<double>& betas, Index kv_heads) {
    static_assert(Derived::kHasLogSumExp, "this mixer has no softmax, so no logit scale per head");
    const std::string where = std::string(name_) + "::set_head_betas";
    head_betas_ = detail::HeadBetaTable::make<Scalar>(where.c_str(), betas, kv_heads,
                                                      self().write_uses_beta());
  }
  const std::vector<double>& head_betas() const { return head_betas_.betas(); }

 protected:
  // The options, validated as the CPU mixer's, with a beta the element type can hold.
  // name: the mixer's, in its errors ("cuda::SelfAttention").
  DeviceMixerBase(const Options& options, const char* name) : options_(options), name_(name) {
    options_.validate(name);
    ovq::detail::check_scalar_range<Scalar>(name, "beta", options_.beta);
  }

  // Whether the mixer's write reads with beta, so that the query heads of a key/value head must
  // share theirs (OVQ's delta rule overrides this).
  bool write_uses_beta() const { return false; }

  Options options_;
  detail::HeadBetaTable head_betas_;  // empty: the options' beta for every head

 private:
  const Derived& self() const { return static_cast<const Derived&>(*this); }

  const char* name_;
};

}  // namespace ovq::cuda
