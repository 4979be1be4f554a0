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
//
// each one call of the mixer's run() on one stream, never synchronising. A mixer (Derived)
// provides:
//   void run(const char* where, State&, const ConstHeadsView<S>* q, ConstHeadsView<S> k,
//            ConstHeadsView<S> v, const HeadsView<S>* o, Stream
//            [, const HeadsView<compute_t<S>>* lse]) const;   // lse where kHasLogSumExp
//   static constexpr bool kHasLogSumExp;
// and checks every argument in run() before anything is launched.
#include "ovq/core/checks.hpp"
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

 protected:
  // The options, validated as the CPU mixer's, with a beta the element type can hold.
  DeviceMixerBase(const Options& options, const char* where) : options_(options) {
    options_.validate(where);
    ovq::detail::check_scalar_range<Scalar>(where, "beta", options_.beta);
  }

  Options options_;

 private:
  const Derived& self() const { return static_cast<const Derived&>(*this); }
};

}  // namespace ovq::cuda
