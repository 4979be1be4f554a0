// attend --device cuda (attend_cuda.hpp): one run on the GPU, states in and out.
// <ovq/cuda.cuh> first: it keeps Eigen host-only (EIGEN_NO_CUDA) in this translation unit.
#include "ovq/cuda.cuh"
// (separated, so that include sorting keeps the order)
#include "attend_cuda.hpp"

namespace attend_cuda {

namespace {

using ovq::Index;
using ovq::RowMatrix;

template <class Scalar>
class Uploaded {
 public:
  Uploaded(const Scalar* host, Index heads, Index rows, Index cols, cudaStream_t stream)
      : buffer_(static_cast<std::size_t>(heads * rows * cols), stream), heads_(heads),
        rows_(rows), cols_(cols) {
    if (host != nullptr) ovq::cuda::Device::copy(buffer_.data(), host, buffer_.bytes(), stream);
  }
  ovq::cuda::HeadsView<Scalar> view() const {
    return ovq::cuda::contiguous_heads(buffer_.data(), heads_, rows_, cols_);
  }
  const ovq::cuda::DeviceBuffer<Scalar, ovq::cuda::Device>& buffer() const { return buffer_; }

 private:
  ovq::cuda::DeviceBuffer<Scalar, ovq::cuda::Device> buffer_;
  Index heads_, rows_, cols_;
};

// Feeds the problem's calls to the device mixer; the states go in before and come back after.
template <class Mixer, class HostState, class Scalar, class MakeState>
RowMatrix<Scalar> drive(const Mixer& mixer, std::vector<HostState>& states,
                        const Problem<Scalar>& p, MakeState make_state) {
  int devices = 0;
  const cudaError_t found = cudaGetDeviceCount(&devices);
  if (found != cudaSuccess || devices == 0)
    throw ovq::cuda::CudaError("--device cuda: no CUDA device: cudaGetDeviceCount",
                               found != cudaSuccess ? found : cudaErrorNoDevice);
  cudaStream_t stream = nullptr;
  ovq::cuda::check_cuda(cudaStreamCreate(&stream), "cudaStreamCreate");
  struct StreamGuard {
    cudaStream_t s;
    ~StreamGuard() { cudaStreamDestroy(s); }
  } guard{stream};
  auto state = make_state(stream);
  const Uploaded<Scalar> q(p.q, p.hq, p.tokens, p.dk, stream), k(p.k, p.hkv, p.tokens, p.dk, stream),
      v(p.v, p.hkv, p.tokens, p.dv, stream), o(nullptr, p.hq, p.tokens, p.dv, stream);
  Index t0 = 0;
  for (const std::int64_t len : p.lengths) {
    const auto qv = q.view().middle_rows(t0, len), kv = k.view().middle_rows(t0, len),
               vv = v.view().middle_rows(t0, len), ov = o.view().middle_rows(t0, len);
    if (p.steps) {
      mixer.step(state, qv, kv, vv, ov, stream);
    } else {
      mixer.forward(state, qv, kv, vv, ov, stream);
    }
    t0 += len;
  }
  RowMatrix<Scalar> out(p.hq * p.tokens, p.dv);
  ovq::cuda::Device::copy(out.data(), o.buffer().data(), o.buffer().bytes(), stream);
  states = state.to_host(stream);  // synchronises: the output has arrived too
  return out;
}

}  // namespace

template <class Scalar>
RowMatrix<Scalar> run(const ovq::SelfAttentionOptions& options,
                      std::vector<ovq::KvCache<Scalar>>& states, const Problem<Scalar>& p) {
  ovq::cuda::SelfAttention<Scalar> mixer(options);
  mixer.set_head_betas(p.head_betas, p.hkv);
  return drive(mixer, states, p, [&](cudaStream_t stream) {
    auto s = mixer.make_state(p.hkv, p.dk, p.dv, stream, states[0].size() + p.tokens);
    s.from_host(states, stream);
    return s;
  });
}

template <class Scalar>
RowMatrix<Scalar> run(const ovq::LinearAttentionOptions& options,
                      std::vector<ovq::LinearState<Scalar>>& states, const Problem<Scalar>& p) {
  const ovq::cuda::LinearAttention<Scalar> mixer(options);
  return drive(mixer, states, p, [&](cudaStream_t stream) {
    auto s = mixer.make_state(p.hkv, p.dk, p.dv, stream);
    s.from_host(states, stream);
    return s;
  });
}

template <class Scalar>
RowMatrix<Scalar> run(const ovq::VqAttentionOptions& options,
                      std::vector<ovq::VqState<Scalar>>& states, const Problem<Scalar>& p) {
  ovq::cuda::VqAttention<Scalar> mixer(options);
  mixer.set_head_betas(p.head_betas, p.hkv);
  return drive(mixer, states, p, [&](cudaStream_t stream) {
    return typename ovq::cuda::VqAttention<Scalar>::State(states, stream);
  });
}

template <class Scalar>
RowMatrix<Scalar> run(const ovq::OvqOptions& options, std::vector<ovq::OvqState<Scalar>>& states,
                      const Problem<Scalar>& p) {
  ovq::cuda::OvqAttention<Scalar> mixer(options);
  mixer.set_head_betas(p.head_betas, p.hkv);
  return drive(mixer, states, p, [&](cudaStream_t stream) {
    auto s = mixer.make_state(p.hkv, p.dk, p.dv, stream);
    s.from_host(states, stream);
    return s;
  });
}

template RowMatrix<float> run(const ovq::SelfAttentionOptions&, std::vector<ovq::KvCache<float>>&,
                              const Problem<float>&);
template RowMatrix<double> run(const ovq::SelfAttentionOptions&, std::vector<ovq::KvCache<double>>&,
                               const Problem<double>&);
template RowMatrix<ovq::bf16> run(const ovq::SelfAttentionOptions&,
                                  std::vector<ovq::KvCache<ovq::bf16>>&, const Problem<ovq::bf16>&);
template RowMatrix<ovq::fp16> run(const ovq::SelfAttentionOptions&,
                                  std::vector<ovq::KvCache<ovq::fp16>>&, const Problem<ovq::fp16>&);
template RowMatrix<float> run(const ovq::LinearAttentionOptions&,
                              std::vector<ovq::LinearState<float>>&, const Problem<float>&);
template RowMatrix<double> run(const ovq::LinearAttentionOptions&,
                               std::vector<ovq::LinearState<double>>&, const Problem<double>&);
template RowMatrix<ovq::bf16> run(const ovq::LinearAttentionOptions&,
                                  std::vector<ovq::LinearState<ovq::bf16>>&,
                                  const Problem<ovq::bf16>&);
template RowMatrix<ovq::fp16> run(const ovq::LinearAttentionOptions&,
                                  std::vector<ovq::LinearState<ovq::fp16>>&,
                                  const Problem<ovq::fp16>&);
template RowMatrix<float> run(const ovq::VqAttentionOptions&, std::vector<ovq::VqState<float>>&,
                              const Problem<float>&);
template RowMatrix<double> run(const ovq::VqAttentionOptions&, std::vector<ovq::VqState<double>>&,
                               const Problem<double>&);
template RowMatrix<ovq::bf16> run(const ovq::VqAttentionOptions&,
                                  std::vector<ovq::VqState<ovq::bf16>>&, const Problem<ovq::bf16>&);
template RowMatrix<ovq::fp16> run(const ovq::VqAttentionOptions&,
                                  std::vector<ovq::VqState<ovq::fp16>>&, const Problem<ovq::fp16>&);
template RowMatrix<float> run(const ovq::OvqOptions&, std::vector<ovq::OvqState<float>>&,
                              const Problem<float>&);
template RowMatrix<double> run(const ovq::OvqOptions&, std::vector<ovq::OvqState<double>>&,
                               const Problem<double>&);
template RowMatrix<ovq::bf16> run(const ovq::OvqOptions&, std::vector<ovq::OvqState<ovq::bf16>>&,
                                  const Problem<ovq::bf16>&);
template RowMatrix<ovq::fp16> run(const ovq::OvqOptions&, std::vector<ovq::OvqState<ovq::fp16>>&,
                                  const Problem<ovq::fp16>&);

}  // namespace attend_cuda
