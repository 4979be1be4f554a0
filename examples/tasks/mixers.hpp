#pragma once
// The mixers of the study (docs/study.md), as plain configurations, and the one way every mixer
// is run on a stream: absorb the context, then read the queries from the resulting state.
//
// Reading the queries. absorb(state, K, V) writes the context without computing its outputs, so
// self-attention's cost is T appends plus Q x T at the end, not T^2. The queries are then read as
// the Q query heads of ONE extra token (forward_heads: every head reads the same state, which is
// written once): each query sees exactly the post-context state plus that token. The token's
// value is 0, so it adds nothing to any numerator; its key is chosen so that it adds (almost)
// nothing to a normaliser either:
//   - softmax mixers (self-attention, sliding window, OVQ): key 0, logit 0 against the queries'
//     best logits of 20 and more (beta 25, unit keys): a relative change below 1e-8;
//   - linear attention: key -30 (every entry): phi = 0 for relu, about 1e-13 for elu+1, and an
//     unnormalised map has no normaliser (identity's numerator gets phi(k) 0^T = 0);
//   - VQ-attention quantises the token's key, so no key is invisible to every query at once:
//     each query is read alone, on a copy of the state, as one token with key -q (quantised to
//     the code nearest -q, far from q) and value 0.
// No query is ever written into a state that another query reads.
#include <chrono>
#include <cstddef>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <ovq/ovq.hpp>

#include "common.hpp"

namespace study {

using Scalar = float;
using Mat = ovq::RowMatrix<Scalar>;
using ovq::Index;

enum class Family { self, window, linear, vq, ovq, reference };

inline const char* family_name(Family f) {
  switch (f) {
    case Family::self: return "self-attention";
    case Family::window: return "sliding window";
    case Family::linear: return "linear attention";
    case Family::vq: return "VQ-attention";
    case Family::ovq: return "OVQ-attention";
    case Family::reference: return "reference";
  }
  return "?";
}

struct MixerSpec {
  std::string name;  // unique label
  Family family = Family::self;
  Index size = 0;    // W (window), S (VQ codebook), N (OVQ capacity); 0 otherwise
  ovq::SelfAttentionOptions self;
  ovq::LinearAttentionOptions linear;
  ovq::VqAttentionOptions vq;
  ovq::OvqOptions ovq;
};

inline constexpr double kBeta = 25.0;
inline constexpr double kLinearDecay = 0.999;
inline constexpr Index kOvqChunk = 64;

inline MixerSpec self_attention() {
  MixerSpec s;
  s.name = "self-attention";
  s.family = Family::self;
  s.self.beta = kBeta;
  return s;
}

inline MixerSpec sliding_window(Index window) {
  MixerSpec s = self_attention();
  s.name = "window W=" + std::to_string(window);
  s.family = Family::window;
  s.size = window;
  s.self.window = window;
  return s;
}

// identity: unnormalised; elu+1 and relu: normalised. decay: gamma = kLinearDecay, else 1.
inline MixerSpec linear_attention(ovq::FeatureMap map, bool decay) {
  MixerSpec s;
  s.family = Family::linear;
  s.linear.feature_map = map;
  s.linear.normalize = map != ovq::FeatureMap::identity;
  s.linear.decay = decay ? kLinearDecay : 1.0;
  const char* m = map == ovq::FeatureMap::identity ? "identity"
                  : map == ovq::FeatureMap::elu1   ? "elu+1"
                                                   : "relu";
  s.name = std::string("linear ") + m + (decay ? " decay" : "");
  return s;
}

inline std::vector<MixerSpec> linear_family() {
  std::vector<MixerSpec> out;
  for (const auto map : {ovq::FeatureMap::identity, ovq::FeatureMap::elu1, ovq::FeatureMap::relu})
    for (const bool decay : {false, true}) out.push_back(linear_attention(map, decay));
  return out;
}

inline MixerSpec vq_attention(Index codes) {
  MixerSpec s;
  s.name = "VQ S=" + std::to_string(codes);
  s.family = Family::vq;
  s.size = codes;
  s.vq.beta = kBeta;
  return s;
}

inline MixerSpec ovq_attention(Index capacity) {
  MixerSpec s;
  s.name = "OVQ N=" + std::to_string(capacity);
  s.family = Family::ovq;
  s.size = capacity;
  s.ovq.capacity = capacity;
  s.ovq.chunk = kOvqChunk;
  s.ovq.beta = kBeta;
  return s;
}

struct Outcome {
  Mat outputs;            // Q x dv
  std::size_t bytes = 0;  // state.bytes() after the context
  double ms = 0.0;        // absorb + reads (a VQ codebook fit is not included)
};

inline double now_ms() {
  using clock = std::chrono::steady_clock;
  return std::chrono::duration<double, std::milli>(clock::now().time_since_epoch()).count();
}

namespace detail {

template <class Mixer>
Outcome absorb_and_read(const Mixer& mixer, typename Mixer::State state, const Mat& keys,
                        const Mat& values, const Mat& queries, Scalar token_key) {
  const double t0 = now_ms();
  Outcome out;
  mixer.absorb(state, keys, values);
  out.bytes = state.bytes();
  const Index Q = queries.rows(), dk = queries.cols(), dv = values.cols();
  out.outputs.resize(Q, dv);
  if (Q > 0) {
    std::vector<ovq::ConstRowsView<Scalar>> q(static_cast<std::size_t>(Q));
    std::vector<ovq::RowsView<Scalar>> o(static_cast<std::size_t>(Q));
    for (Index i = 0; i < Q; ++i) {
      q[static_cast<std::size_t>(i)] = {queries.row(i).data(), 1, dk, dk};
      o[static_cast<std::size_t>(i)] = {out.outputs.row(i).data(), 1, dv, dv};
    }
    const ovq::RowVector<Scalar> k = ovq::RowVector<Scalar>::Constant(dk, token_key);
    const ovq::RowVector<Scalar> v = ovq::RowVector<Scalar>::Zero(dv);
    mixer.forward_heads(state, q.data(), Q, {k.data(), 1, dk, dk}, {v.data(), 1, dv, dv},
                        o.data());
  }
  out.ms = now_ms() - t0;
  return out;
}

template <class Mixer>
Outcome absorb_and_read_each(const Mixer& mixer, typename Mixer::State state, const Mat& keys,
                             const Mat& values, const Mat& queries) {
  const double t0 = now_ms();
  Outcome out;
  mixer.absorb(state, keys, values);
  out.bytes = state.bytes();
  const Index Q = queries.rows(), dv = values.cols();
  out.outputs.resize(Q, dv);
  const Mat zero = Mat::Zero(1, dv);
  for (Index i = 0; i < Q; ++i) {
    typename Mixer::State copy = state;
    const Mat neg = -queries.row(i);
    mixer.forward(copy, queries.row(i), neg, zero, out.outputs.row(i));
  }
  out.ms = now_ms() - t0;
  return out;
}

}  // namespace detail

// Runs one mixer on one stream. codebook (S x dk): required for VQ, ignored otherwise.
inline Outcome run(const MixerSpec& spec, const Mat& keys, const Mat& values, const Mat& queries,
                   const Mat* codebook = nullptr) {
  const Index dk = keys.cols(), dv = values.cols();
  switch (spec.family) {
    case Family::self:
    case Family::window: {
      const ovq::SelfAttention<Scalar> m(spec.self);
      return detail::absorb_and_read(m, m.make_state(dk, dv), keys, values, queries, Scalar(0));
    }
    case Family::linear: {
      const ovq::LinearAttention<Scalar> m(spec.linear);
      return detail::absorb_and_read(m, m.make_state(dk, dv), keys, values, queries,
                                     Scalar(-30));
    }
    case Family::vq: {
      if (codebook == nullptr) throw std::invalid_argument("study::run: VQ needs a codebook");
      const ovq::VqAttention<Scalar> m(spec.vq);
      return detail::absorb_and_read_each(m, m.make_state(*codebook, dv), keys, values, queries);
    }
    case Family::ovq: {
      const ovq::OvqAttention<Scalar> m(spec.ovq);
      return detail::absorb_and_read(m, m.make_state(dk, dv), keys, values, queries, Scalar(0));
    }
    case Family::reference: break;
  }
  throw std::logic_error("study::run: not a mixer family");
}

// Bytes of self-attention's key/value cache after T tokens (what state fractions refer to).
inline double self_attention_bytes(Index T, Index dk, Index dv) {
  return static_cast<double>(T) * static_cast<double>(dk + dv) * sizeof(Scalar);
}

}  // namespace study
