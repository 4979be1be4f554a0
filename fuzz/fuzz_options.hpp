#pragma once
// The mixer fuzz targets' options from fuzz bytes: one decoder per mixer over value tables that
// each target gives (fuzz_mixers: edge and invalid values; fuzz_device_mixers: ordinary ones),
// and one line per mixer's options for the traces of what an input did.
#include <string>
#include <vector>

#include "fuzz_support.hpp"
#include "ovq/core/checks.hpp"
#include "ovq/ovq.hpp"

namespace ovq::fuzz {

// The values an option is picked from, each list's ordinary value first (once the bytes run out
// every pick is the first).
struct OptionTables {
  std::vector<double> beta;
  std::vector<Index> chunk;   // 64 first: then, on a set bit, any chunk in 1..70
  std::vector<Index> window;  // self-attention
  std::vector<double> decay, eps;
  std::vector<kernels::FeatureMap> feature_map;
  std::vector<Index> capacity;  // OVQ
  std::vector<double> alpha, growth_rate, eta;
};

template <class T>
T pick(Input& in, const std::vector<T>& values) {
  return values[in.byte() % values.size()];
}

inline Index pick_chunk(Input& in, const OptionTables& t) {
  const Index c = pick(in, t.chunk);
  return c == 64 && in.flag() ? in.range(1, 70) : c;
}

// (A window on a non-causal read is invalid: picked one time in eight.)
inline SelfAttentionOptions self_options(Input& in, const OptionTables& t) {
  SelfAttentionOptions o;
  o.beta = pick(in, t.beta);
  o.causal = !in.rarely(4);
  o.window = pick(in, t.window);
  if (!o.causal && !in.rarely(8)) o.window = 0;
  o.chunk = pick_chunk(in, t);
  return o;
}

inline LinearAttentionOptions linear_options(Input& in, const OptionTables& t) {
  LinearAttentionOptions o;
  o.beta = pick(in, t.beta);
  o.feature_map = pick(in, t.feature_map);
  o.normalize = in.flag();
  o.decay = pick(in, t.decay);
  o.eps = pick(in, t.eps);
  o.chunk = pick_chunk(in, t);
  return o;
}

inline VqAttentionOptions vq_options(Input& in, const OptionTables& t) {
  VqAttentionOptions o;
  o.beta = pick(in, t.beta);
  o.chunk = pick_chunk(in, t);
  return o;
}

inline OvqOptions ovq_options(Input& in, const OptionTables& t) {
  OvqOptions o;
  o.capacity = pick(in, t.capacity);
  o.chunk = pick_chunk(in, t);
  o.beta = pick(in, t.beta);
  o.growth = in.flag() ? Growth::linear(pick(in, t.growth_rate))
             : in.flag() ? Growth::saturating()
                         : Growth::dirichlet(pick(in, t.alpha));
  o.seeding = in.flag() ? Seeding::random(in.u64())
              : in.flag() ? Seeding::lowest_similarity()
                          : Seeding::spread();
  o.rate = in.flag() ? UpdateRate::constant(pick(in, t.eta)) : UpdateRate::adaptive();
  o.renormalize = in.flag();
  o.value_update = in.flag() ? ValueUpdate::delta : ValueUpdate::mean;
  o.renormalize_values = o.value_update == ValueUpdate::mean && in.flag();
  o.count_bias = !in.flag();
  return o;
}

inline std::string describe(const SelfAttentionOptions& o) {
  return detail::concat("beta=", o.beta, " causal=", o.causal, " window=", o.window,
                        " chunk=", o.chunk);
}
inline std::string describe(const LinearAttentionOptions& o) {
  return detail::concat("beta=", o.beta, " feature_map=", static_cast<int>(o.feature_map),
                        " normalize=", o.normalize, " decay=", o.decay, " eps=", o.eps,
                        " chunk=", o.chunk);
}
inline std::string describe(const VqAttentionOptions& o) {
  return detail::concat("beta=", o.beta, " chunk=", o.chunk);
}
inline std::string describe(const OvqOptions& o) {
  return detail::concat(
      "capacity=", o.capacity, " chunk=", o.chunk, " beta=", o.beta, " growth=",
      o.growth.kind == Growth::Kind::dirichlet ? "dirichlet"
      : o.growth.kind == Growth::Kind::linear  ? "linear"
                                               : "saturating",
      " alpha=", o.growth.alpha, " rate=", o.growth.rate, " seeding=",
      o.seeding.kind == Seeding::Kind::spread   ? "spread"
      : o.seeding.kind == Seeding::Kind::random ? "random"
                                                : "lowest_similarity",
      " seed=", o.seeding.seed,
      " update=", o.rate.kind == UpdateRate::Kind::adaptive ? "adaptive" : "constant",
      " eta=", o.rate.eta, " renormalize=", o.renormalize,
      " renormalize_values=", o.renormalize_values, " count_bias=", o.count_bias,
      " value_update=", o.value_update == ValueUpdate::delta ? "delta" : "mean");
}

}  // namespace ovq::fuzz
