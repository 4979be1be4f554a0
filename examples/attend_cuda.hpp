#pragma once
// attend --device cuda: the same runs as on the CPU, on a GPU (attend_cuda.cu, compiled when ovq
// is configured with OVQ_ENABLE_CUDA). The CPU layer keeps the states: they go to the GPU before
// the run and come back after it, so --load-state, --save-state and --state-out work alike.
#include <cstdint>
#include <vector>

#include "ovq/ovq.hpp"

namespace attend_cuda {

// One run: q (Hq, T, dk), k (Hkv, T, dk), v (Hkv, T, dv), row-major host arrays, fed as calls of
// `lengths` tokens (steps where `steps`); returns O (Hq T) x dv and updates the states.
template <class Scalar>
struct Problem {
  ovq::Index hq = 0, hkv = 0, tokens = 0, dk = 0, dv = 0;
  const Scalar *q = nullptr, *k = nullptr, *v = nullptr;
  std::vector<std::int64_t> lengths;
  bool steps = false;
  std::vector<double> head_betas;  // one per query head (self, VQ, OVQ), or none
};

// Self-attention for float, double, ovq::bf16 and ovq::fp16; the others for float and double.
template <class Scalar>
ovq::RowMatrix<Scalar> run(const ovq::SelfAttentionOptions& options,
                           std::vector<ovq::KvCache<Scalar>>& states, const Problem<Scalar>& p);
template <class Scalar>
ovq::RowMatrix<Scalar> run(const ovq::LinearAttentionOptions& options,
                           std::vector<ovq::LinearState<Scalar>>& states, const Problem<Scalar>& p);
template <class Scalar>
ovq::RowMatrix<Scalar> run(const ovq::VqAttentionOptions& options,
                           std::vector<ovq::VqState<Scalar>>& states, const Problem<Scalar>& p);
template <class Scalar>
ovq::RowMatrix<Scalar> run(const ovq::OvqOptions& options, std::vector<ovq::OvqState<Scalar>>& states,
                           const Problem<Scalar>& p);

}  // namespace attend_cuda
