#pragma once
// ovq on NVIDIA GPUs: the four mixers with the CPU's options, mathematics and states, over
// device memory batched over (batch x key/value heads). Compile with nvcc.
//
//   #include <ovq/cuda.cuh>
//
//   ovq::cuda::OvqAttention<float> mixer(options);            // the CPU's OvqOptions
//   auto state = mixer.make_state(batch * kv_heads, dk, dv, stream);
//   mixer.forward(state, q, k, v, o, stream);                  // HeadsView<float> of device rows
//   mixer.step(state, q1, k1, v1, o1, stream);                 // capturable in a CUDA graph
//   auto host = state.to_host(stream);                         // the CPU's OvqState per head
//
// Every call runs a few kernels on the given stream and returns without synchronising; shapes
// and options are checked on the host first (ovq::ArgumentError, as on the CPU), values on the
// device (a bad call changes nothing and is reported by the next synchronize()); CUDA failures
// throw ovq::cuda::CudaError. docs/cuda.md has the details.
#if !defined(__CUDACC__)
#error "<ovq/cuda.cuh> is the CUDA API: compile with nvcc (the CPU API is <ovq/ovq.hpp>)"
#endif

// Eigen (the CPU states of to_host/from_host) stays host code in CUDA translation units: include
// <ovq/cuda.cuh> before any Eigen header, or define EIGEN_NO_CUDA yourself (else nvcc warns about
// Eigen's device annotations).
#if !defined(EIGEN_NO_CUDA)
#define EIGEN_NO_CUDA
#endif

#include "ovq/ovq.hpp"
#include "ovq/cuda/device.cuh"
#include "ovq/cuda/linear_attention.hpp"
#include "ovq/cuda/ovq_attention.hpp"
#include "ovq/cuda/self_attention.hpp"
#include "ovq/cuda/vq_attention.hpp"

namespace ovq::cuda {

// The four mixers on the GPU, for float, double, ovq::bf16 and ovq::fp16 (16-bit queries, keys,
// values and states; the softmax reads on tensor cores).
template <class Scalar>
using SelfAttention = BasicSelfAttention<Scalar, Device>;
template <class Scalar>
using LinearAttention = BasicLinearAttention<Scalar, Device>;
template <class Scalar>
using VqAttention = BasicVqAttention<Scalar, Device>;
template <class Scalar>
using OvqAttention = BasicOvqAttention<Scalar, Device>;

}  // namespace ovq::cuda
