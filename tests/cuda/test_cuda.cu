// The CUDA mixers on a GPU: each against its host emulation bit for bit (the emulation is the
// same block programs run on the host, tests/test_cuda_emulated.cpp checks it against the
// references), against the double references and the CPU mixers by normalised error, run twice
// for the same bits, and a decode step captured in a CUDA graph and replayed.
//
// Without a GPU the binary prints why and exits with 77, which CTest reports as skipped.
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

#define CATCH_CONFIG_RUNNER
#include "ovq/cuda.cuh"
#include "ovq/cuda/emulator.hpp"
#include "support/catch.hpp"
#include "support/cuda_harness.hpp"
#include "support/fixtures.hpp"

// The GPU's conversion instructions against the integer conversions the emulation uses, over
// every float (narrow and, for finite floats, the packed pairs, both 16-bit types) and every fp16
// (widen): mismatches counted, the smallest mismatching pattern of each kind kept.
namespace conversion_check {

struct ConversionMismatches {
  // narrow to bf16, to fp16, widen fp16, narrow_finite_pair to bf16, to fp16 (f, -f)
  unsigned long long count[5];
  unsigned int first[5];
};

template <class Bits>
__device__ bool pair_differs(float f) {
  using namespace ovq::cuda::kernels;
  if ((bits_of(f) & 0x7f800000u) == 0x7f800000u) return false;  // finite values only
  const std::uint32_t expected = pack_pair(narrow_by_integers<Bits>(f).bits,
                                           narrow_by_integers<Bits>(-f).bits);
  return narrow_finite_pair<Bits>(f, -f) != expected;
}

__global__ void compare_conversions(ConversionMismatches* out) {
  using namespace ovq::cuda::kernels;
  const std::uint64_t stride = static_cast<std::uint64_t>(gridDim.x) * blockDim.x;
  unsigned long long count[5] = {0, 0, 0, 0, 0};  // this thread's, added once at the end
  unsigned int first[5] = {0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu};
  for (std::uint64_t i = static_cast<std::uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       i < (std::uint64_t{1} << 32); i += stride) {
    const auto b = static_cast<std::uint32_t>(i);
    const float f = float_from_bits(b);
    const bool miss[5] = {
        narrow<ovq::cuda::Bf16Bits>(f).bits != narrow_by_integers<ovq::cuda::Bf16Bits>(f).bits,
        narrow<ovq::cuda::Fp16Bits>(f).bits != narrow_by_integers<ovq::cuda::Fp16Bits>(f).bits,
        b < 65536u && bits_of(widen(ovq::cuda::Fp16Bits{static_cast<std::uint16_t>(b)})) !=
                          bits_of(widen_by_integers(
                              ovq::cuda::Fp16Bits{static_cast<std::uint16_t>(b)})),
        pair_differs<ovq::cuda::Bf16Bits>(f), pair_differs<ovq::cuda::Fp16Bits>(f)};
    for (int k = 0; k < 5; ++k)
      if (miss[k]) {
        ++count[k];
        if (b < first[k]) first[k] = b;
      }
  }
  for (int k = 0; k < 5; ++k)
    if (count[k] != 0) {
      atomicAdd(&out->count[k], count[k]);
      atomicMin(&out->first[k], first[k]);
    }
}

}  // namespace conversion_check

namespace {

using namespace ovq;
using cuda::Device;
using cuda::Emulator;
using ovq::test::DeviceRows;
using ovq::test::random_matrix;
using ovq::test::relative_error;

// Normalised error bound of a float GPU read against the double reference.
constexpr double kFloatBound = 1e-5;

template <class S>
bool same_bits(const RowMatrix<S>& a, const RowMatrix<S>& b) {
  return a.rows() == b.rows() && a.cols() == b.cols() &&
         std::memcmp(a.data(), b.data(), sizeof(S) * static_cast<std::size_t>(a.size())) == 0;
}

template <class S>
struct Inputs {
  Index heads, group, t, dk, dv;
  RowMatrix<S> q, k, v;
};

template <class S>
Inputs<S> inputs(Index heads, Index group, Index t, Index dk, Index dv, std::uint64_t seed,
                 bool unit_keys) {
  Inputs<S> in{heads, group, t, dk, dv, random_matrix<S>(heads * group * t, dk, seed),
               random_matrix<S>(heads * t, dk, seed + 1), random_matrix<S>(heads * t, dv, seed + 2)};
  if (unit_keys) {
    in.k.rowwise().normalize();
    in.q.rowwise().normalize();
  }
  return in;
}

// One backend's outputs and host states for the stream fed in `pieces`.
template <class Backend, class Mixer, class S, class MakeState>
std::pair<RowMatrix<S>, std::vector<typename Mixer::State::HostState>> run_on(
    const Mixer& mixer, MakeState make_state, const Inputs<S>& in, const std::vector<Index>& pieces,
    typename Backend::Stream stream) {
  using Rows = DeviceRows<S, Backend>;
  const Rows q(in.q, in.heads * in.group, stream), k(in.k, in.heads, stream),
      v(in.v, in.heads, stream), o(in.heads * in.group, in.t, in.dv, stream);
  auto state = make_state(mixer, stream);
  ovq::test::feed_pieces(mixer, state, q, k, v, o, pieces, stream);
  return {o.download(stream), state.to_host(stream)};
}

template <class S>
RowMatrix<double> as_double(const RowMatrix<S>& m) {
  return m.unaryExpr([](S x) { return static_cast<double>(widen(x)); });
}

// The GPU run against the emulated run (bit for bit, or for 16-bit elements, whose tensor-core
// sums round in the hardware's own order, within emulation_bound) and against `expected`
// (normalised error); twice on the GPU for the same bits. head_betas: one per query head of
// the batch of 1 (the in.heads key/value heads' query heads), or none.
template <template <class, class> class Mixer, class S, class MakeState>
void check_against_emulation(const typename Mixer<S, Device>::Options& options, MakeState make,
                             const Inputs<S>& in, const std::vector<Index>& pieces,
                             const RowMatrix<S>& expected, double bound,
                             double emulation_bound = 0.0,
                             const std::vector<double>& head_betas = {}) {
  Mixer<S, Device> gpu(options);
  Mixer<S, Emulator> emulated(options);
  if constexpr (!std::is_same_v<Mixer<S, Device>, cuda::BasicLinearAttention<S, Device>>) {
    if (!head_betas.empty()) {
      gpu.set_head_betas(head_betas, in.heads);
      emulated.set_head_betas(head_betas, in.heads);
    }
  }
  cudaStream_t stream;
  REQUIRE(cudaStreamCreate(&stream) == cudaSuccess);
  const auto on_gpu = run_on<Device>(gpu, make, in, pieces, stream);
  const auto again = run_on<Device>(gpu, make, in, pieces, stream);
  const auto on_host = run_on<Emulator>(emulated, make, in, pieces, nullptr);
  cudaStreamDestroy(stream);
  CHECK(same_bits(on_gpu.first, again.first));
  if (emulation_bound == 0.0) {
    CHECK(same_bits(on_gpu.first, on_host.first));
  } else {
    CHECK(relative_error(as_double(on_gpu.first), as_double(on_host.first)) < emulation_bound);
  }
  for (std::size_t h = 0; h < on_gpu.second.size(); ++h) CHECK(on_gpu.second[h] == on_host.second[h]);
  CHECK(relative_error(as_double(on_gpu.first), as_double(expected)) < bound);
}

template <class H>
Inputs<H> half_inputs(Index heads, Index group, Index t, Index dk, Index dv, std::uint64_t seed,
                      bool unit_keys = false) {
  const Inputs<float> f = inputs<float>(heads, group, t, dk, dv, seed, unit_keys);
  const auto narrowed = [](const RowMatrix<float>& m) {
    return RowMatrix<H>(m.unaryExpr([](float x) { return narrow<H>(x); }));
  };
  return {heads, group, t, dk, dv, narrowed(f.q), narrowed(f.k), narrowed(f.v)};
}

const std::vector<std::vector<Index>> kCuts = {{}, {100, 1, 1, 1, 300}};

TEMPLATE_TEST_CASE("GPU self-attention == its emulation, the CPU mixer and the reference",
                   "[gpu][self]", float, double) {
  using S = TestType;
  for (const Index window : {Index(0), Index(300)}) {
    SelfAttentionOptions opt;
    opt.beta = 0.2;
    opt.window = window;
    const Inputs<S> in = inputs<S>(2, 4, 700, 64, 48, 3, false);
    MultiHead<SelfAttention<S>> cpu(SelfAttention<S>(opt), 1, 8, 2, 64, 48);
    const RowMatrix<S> expected = cpu.forward(in.q, in.k, in.v);
    auto make = [](const auto& m, auto stream) { return m.make_state(2, 64, 48, stream); };
    for (const auto& cut : kCuts)
      check_against_emulation<cuda::BasicSelfAttention, S>(
          opt, make, in, cut, expected, std::is_same_v<S, float> ? kFloatBound : 1e-11);
  }
}

TEMPLATE_TEST_CASE("GPU 16-bit self-attention on tensor cores == its emulation, the CPU's 16-bit "
                   "mixer, and itself however the stream is cut",
                   "[gpu][self][half]", bf16, fp16) {
  using H = TestType;
  const double cpu_bound = std::is_same_v<H, bf16> ? 1.5e-2 : 3e-3;
  const double emulation_bound = std::is_same_v<H, bf16> ? 5e-3 : 1e-3;
  for (const Index window : {Index(0), Index(300)}) {
    SelfAttentionOptions opt;
    opt.beta = 0.2;
    opt.window = window;
    const Inputs<H> in = half_inputs<H>(2, 4, 700, 128, 128, 3);
    MultiHead<SelfAttention<H>> cpu(SelfAttention<H>(opt), 1, 8, 2, 128, 128);
    const RowMatrix<H> expected = cpu.forward(in.q, in.k, in.v);
    auto make = [](const auto& m, auto stream) { return m.make_state(2, 128, 128, stream); };
    for (const auto& cut : kCuts)
      check_against_emulation<cuda::BasicSelfAttention, H>(opt, make, in, cut, expected,
                                                           cpu_bound, emulation_bound);
    // Prefill tiles (64 rows) and decode tiles (16 rows, split over merge blocks) give a row
    // the same bits on the GPU too.
    const cuda::SelfAttention<H> gpu(opt);
    cudaStream_t stream;
    REQUIRE(cudaStreamCreate(&stream) == cudaSuccess);
    const auto whole = run_on<Device>(gpu, make, in, {}, stream);
    const auto stepped = run_on<Device>(gpu, make, in, std::vector<Index>(in.t, 1), stream);
    cudaStreamDestroy(stream);
    CHECK(same_bits(whole.first, stepped.first));
  }
}

TEMPLATE_TEST_CASE("GPU OVQ-attention == its emulation and the CPU mixer", "[gpu][ovq]", float,
                   double) {
  using S = TestType;
  OvqOptions opt;
  opt.capacity = 256;
  opt.chunk = 64;
  opt.beta = 4.0;
  const Inputs<S> in = inputs<S>(2, 2, 900, 64, 64, 5, true);
  MultiHead<OvqAttention<S, arch::scalar>> cpu(OvqAttention<S, arch::scalar>(opt), 1, 4, 2, 64,
                                                64);
  const RowMatrix<S> expected = cpu.forward(in.q, in.k, in.v);
  auto make = [](const auto& m, auto stream) { return m.make_state(2, 64, 64, stream); };
  for (const auto& cut : kCuts)
    check_against_emulation<cuda::BasicOvqAttention, S>(opt, make, in, cut, expected,
                                                        std::is_same_v<S, float> ? 1e-5 : 1e-11);
}

TEMPLATE_TEST_CASE("GPU 16-bit OVQ-attention == its emulation (the dictionary bit for bit) and "
                   "the CPU's 16-bit mixer",
                   "[gpu][ovq][half]", bf16, fp16) {
  using H = TestType;
  OvqOptions opt;
  opt.capacity = 256;
  opt.chunk = 64;
  opt.beta = 4.0;
  const Inputs<H> in = half_inputs<H>(2, 2, 900, 128, 128, 5, true);
  MultiHead<OvqAttention<H, arch::scalar>> cpu(OvqAttention<H, arch::scalar>(opt), 1, 4, 2, 128,
                                                128);
  const RowMatrix<H> expected = cpu.forward(in.q, in.k, in.v);
  auto make = [](const auto& m, auto stream) { return m.make_state(2, 128, 128, stream); };
  for (const auto& cut : kCuts)
    check_against_emulation<cuda::BasicOvqAttention, H>(
        opt, make, in, cut, expected, std::is_same_v<H, bf16> ? 1.5e-2 : 3e-3,
        std::is_same_v<H, bf16> ? 5e-3 : 1e-3);
}

TEMPLATE_TEST_CASE("GPU VQ-attention == its emulation and the CPU mixer", "[gpu][vq]", float,
                   double) {
  using S = TestType;
  VqAttentionOptions opt;
  opt.chunk = 64;
  const RowMatrix<S> codebook = random_matrix<S>(128, 32, 7);
  const Inputs<S> in = inputs<S>(2, 2, 600, 32, 40, 9, false);
  const VqAttention<S, arch::scalar> host(opt);
  MultiHead<VqAttention<S, arch::scalar>> cpu(
      host, 1, 4, std::vector<VqState<S>>(2, host.make_state(codebook, 40)));
  const RowMatrix<S> expected = cpu.forward(in.q, in.k, in.v);
  auto make = [&](const auto& m, auto stream) { return m.make_state(2, codebook, 40, stream); };
  for (const auto& cut : kCuts)
    check_against_emulation<cuda::BasicVqAttention, S>(opt, make, in, cut, expected,
                                                       std::is_same_v<S, float> ? 1e-5 : 1e-11);
}

TEMPLATE_TEST_CASE("GPU 16-bit VQ-attention == its emulation (counts and means bit for bit) and "
                   "the CPU's 16-bit mixer",
                   "[gpu][vq][half]", bf16, fp16) {
  using H = TestType;
  VqAttentionOptions opt;
  opt.chunk = 64;
  opt.beta = 0.5;
  const Inputs<H> in = half_inputs<H>(2, 2, 700, 128, 128, 9);
  const RowMatrix<H> codebook = half_inputs<H>(1, 1, 300, 128, 1, 10).k;
  const VqAttention<H, arch::scalar> host(opt);
  MultiHead<VqAttention<H, arch::scalar>> cpu(
      host, 1, 4, std::vector<VqState<H>>(2, host.make_state(codebook, 128)));
  const RowMatrix<H> expected = cpu.forward(in.q, in.k, in.v);
  auto make = [&](const auto& m, auto stream) { return m.make_state(2, codebook, 128, stream); };
  for (const auto& cut : kCuts)
    check_against_emulation<cuda::BasicVqAttention, H>(
        opt, make, in, cut, expected, std::is_same_v<H, bf16> ? 1.5e-2 : 3e-3,
        std::is_same_v<H, bf16> ? 5e-3 : 1e-3);
}

TEMPLATE_TEST_CASE("GPU linear attention == its emulation and the CPU mixer", "[gpu][linear]",
                   float, double) {
  using S = TestType;
  LinearAttentionOptions opt;
  opt.chunk = 64;
  opt.feature_map = kernels::FeatureMap::elu1;
  opt.normalize = true;
  opt.decay = 0.99;
  const Inputs<S> in = inputs<S>(2, 2, 500, 64, 64, 11, false);
  MultiHead<LinearAttention<S>> cpu(LinearAttention<S>(opt), 1, 4, 2, 64, 64);
  const RowMatrix<S> expected = cpu.forward(in.q, in.k, in.v);
  auto make = [](const auto& m, auto stream) { return m.make_state(2, 64, 64, stream); };
  for (const auto& cut : kCuts)
    check_against_emulation<cuda::BasicLinearAttention, S>(
        opt, make, in, cut, expected, std::is_same_v<S, float> ? 1e-5 : 1e-11);
}

// Small shapes of every mixer, for compute-sanitizer (scripts/gpu-check runs "[sanitize]" under
// memcheck and racecheck): partial tiles, a window's ring, a trailing partial chunk, steps.
TEMPLATE_TEST_CASE("GPU 16-bit linear attention == its emulation and the CPU's 16-bit mixer",
                   "[gpu][linear][half]", bf16, fp16) {
  using H = TestType;
  LinearAttentionOptions opt;
  opt.chunk = 64;
  opt.feature_map = kernels::FeatureMap::elu1;
  opt.normalize = true;
  const Inputs<H> in = half_inputs<H>(2, 2, 700, 128, 128, 13);
  MultiHead<LinearAttention<H>> cpu(LinearAttention<H>(opt), 1, 4, 2, 128, 128);
  const RowMatrix<H> expected = cpu.forward(in.q, in.k, in.v);
  auto make = [](const auto& m, auto stream) { return m.make_state(2, 128, 128, stream); };
  // FP32 FMA on both sides, in the same order: the same bits as the emulation.
  for (const auto& cut : kCuts)
    check_against_emulation<cuda::BasicLinearAttention, H>(
        opt, make, in, cut, expected, std::is_same_v<H, bf16> ? 1.5e-2 : 3e-3);
}

TEST_CASE("GPU mixers on small shapes == their emulation", "[gpu][sanitize]") {
  using S = float;
  const Inputs<S> in = inputs<S>(2, 3, 77, 24, 40, 17, true);
  const std::vector<Index> cut = {30, 1, 1, 20};
  {
    SelfAttentionOptions opt;
    opt.window = 20;
    opt.chunk = 16;
    MultiHead<SelfAttention<S>> cpu(SelfAttention<S>(opt), 1, 6, 2, 24, 40);
    auto make = [](const auto& m, auto stream) { return m.make_state(2, 24, 40, stream); };
    check_against_emulation<cuda::BasicSelfAttention, S>(opt, make, in, cut,
                                                         cpu.forward(in.q, in.k, in.v), 2e-5);
  }
  {
    OvqOptions opt;
    opt.capacity = 16;
    opt.chunk = 8;
    opt.seeding = Seeding::random(3);
    opt.renormalize = true;
    MultiHead<OvqAttention<S, arch::scalar>> cpu(OvqAttention<S, arch::scalar>(opt), 1, 6, 2, 24,
                                                  40);
    auto make = [](const auto& m, auto stream) { return m.make_state(2, 24, 40, stream); };
    check_against_emulation<cuda::BasicOvqAttention, S>(opt, make, in, cut,
                                                        cpu.forward(in.q, in.k, in.v), 2e-5);
  }
  {
    // The public implementation's reading: lowest-similarity seeding, unit-norm keys,
    // saturating growth, unit-norm values or the delta rule; and the read without the count
    // bias.
    for (OvqOptions opt : {OvqOptions::kvm(), OvqOptions::kvm_delta()}) {
      opt.capacity = 16;
      opt.chunk = 8;
      opt.count_bias = false;
      MultiHead<OvqAttention<S, arch::scalar>> cpu(OvqAttention<S, arch::scalar>(opt), 1, 6, 2,
                                                    24, 40);
      auto make = [](const auto& m, auto stream) { return m.make_state(2, 24, 40, stream); };
      check_against_emulation<cuda::BasicOvqAttention, S>(opt, make, in, cut,
                                                          cpu.forward(in.q, in.k, in.v), 2e-5);
    }
  }
  {
    VqAttentionOptions opt;
    opt.chunk = 8;
    const RowMatrix<S> codebook = random_matrix<S>(20, 24, 19);
    const VqAttention<S, arch::scalar> host(opt);
    MultiHead<VqAttention<S, arch::scalar>> cpu(
        host, 1, 6, std::vector<VqState<S>>(2, host.make_state(codebook, 40)));
    auto make = [&](const auto& m, auto stream) { return m.make_state(2, codebook, 40, stream); };
    check_against_emulation<cuda::BasicVqAttention, S>(opt, make, in, cut,
                                                       cpu.forward(in.q, in.k, in.v), 2e-5);
  }
  {
    SelfAttentionOptions opt;
    opt.window = 20;
    opt.chunk = 16;
    const Inputs<bf16> h = half_inputs<bf16>(2, 3, 77, 24, 40, 17);
    MultiHead<SelfAttention<bf16>> cpu(SelfAttention<bf16>(opt), 1, 6, 2, 24, 40);
    auto make = [](const auto& m, auto stream) { return m.make_state(2, 24, 40, stream); };
    check_against_emulation<cuda::BasicSelfAttention, bf16>(opt, make, h, cut,
                                                            cpu.forward(h.q, h.k, h.v), 1.5e-2,
                                                            5e-3);
  }
  {
    LinearAttentionOptions opt;
    opt.chunk = 8;
    opt.feature_map = kernels::FeatureMap::elu1;
    MultiHead<LinearAttention<S>> cpu(LinearAttention<S>(opt), 1, 6, 2, 24, 40);
    auto make = [](const auto& m, auto stream) { return m.make_state(2, 24, 40, stream); };
    check_against_emulation<cuda::BasicLinearAttention, S>(opt, make, in, cut,
                                                           cpu.forward(in.q, in.k, in.v), 2e-5);
  }
}

// One backend's log-sum-exp for the stream in one forward call.
template <class Backend, class Mixer, class S, class MakeState>
RowMatrix<compute_t<S>> lse_on(const Mixer& mixer, MakeState make_state, const Inputs<S>& in,
                               typename Backend::Stream stream) {
  using Rows = DeviceRows<S, Backend>;
  const Rows q(in.q, in.heads * in.group, stream), k(in.k, in.heads, stream),
      v(in.v, in.heads, stream), o(in.heads * in.group, in.t, in.dv, stream);
  const DeviceRows<compute_t<S>, Backend> lse(in.heads * in.group, in.t, 1, stream);
  auto state = make_state(mixer, stream);
  mixer.forward(state, q.view(), k.view(), v.view(), o.view(), lse.view(), stream);
  return lse.download(stream);
}

TEMPLATE_TEST_CASE("GPU log-sum-exp output == its emulation", "[gpu][lse]", float, bf16) {
  using S = TestType;
  const Inputs<S> in = [] {
    if constexpr (is_half_v<S>) {
      return half_inputs<S>(2, 2, 700, 128, 128, 15, true);
    } else {
      return inputs<S>(2, 2, 700, 128, 128, 15, true);
    }
  }();
  cudaStream_t stream;
  REQUIRE(cudaStreamCreate(&stream) == cudaSuccess);
  const double bound = is_half_v<S> ? 1e-3 : 1e-6;
  {
    const SelfAttentionOptions opt{};
    auto make = [](const auto& m, auto st) { return m.make_state(2, 128, 128, st); };
    const auto gpu = lse_on<Device>(cuda::BasicSelfAttention<S, Device>(opt), make, in, stream);
    const auto host = lse_on<Emulator>(cuda::BasicSelfAttention<S, Emulator>(opt), make, in, nullptr);
    CHECK(relative_error(gpu, host) < bound);
  }
  {
    OvqOptions opt;
    opt.capacity = 256;
    opt.chunk = 64;
    auto make = [](const auto& m, auto st) { return m.make_state(2, 128, 128, st); };
    const auto gpu = lse_on<Device>(cuda::BasicOvqAttention<S, Device>(opt), make, in, stream);
    const auto host = lse_on<Emulator>(cuda::BasicOvqAttention<S, Emulator>(opt), make, in, nullptr);
    CHECK(relative_error(gpu, host) < bound);
  }
  cudaStreamDestroy(stream);
}

TEMPLATE_TEST_CASE("GPU head betas == their emulation and the CPU layer's: self and OVQ (the "
                   "delta rule in float)",
                   "[gpu][head_betas]", float, bf16) {
  using S = TestType;
  const bool half = is_half_v<S>;
  const double cpu_bound = half ? 1.5e-2 : kFloatBound, emulation_bound = half ? 5e-3 : 0.0;
  const Inputs<S> in = [] {
    if constexpr (is_half_v<S>) {
      return half_inputs<S>(2, 4, 700, 128, 128, 17, true);
    } else {
      return inputs<S>(2, 4, 700, 128, 128, 17, true);
    }
  }();
  auto make = [](const auto& m, auto stream) { return m.make_state(2, 128, 128, stream); };
  {
    SelfAttentionOptions opt;
    const std::vector<double> betas = {2.0, 4.0, 6.0, 8.0, 3.0, 5.0, 7.0, 9.0};
    MultiHead<SelfAttention<S>> cpu(SelfAttention<S>(opt), 1, 8, 2, 128, 128);
    cpu.set_head_betas(betas);
    const RowMatrix<S> expected = cpu.forward(in.q, in.k, in.v);
    for (const auto& cut : kCuts)
      check_against_emulation<cuda::BasicSelfAttention, S>(opt, make, in, cut, expected,
                                                           cpu_bound, emulation_bound, betas);
  }
  {
    // 16-bit: the running-mean update, as the delta rule's tensor-core predictions round in
    // the hardware's order and its value means would differ from the emulation's.
    OvqOptions opt = half ? OvqOptions::kvm() : OvqOptions::kvm_delta();
    opt.capacity = 256;
    opt.chunk = 64;
    const std::vector<double> betas = {3.0, 3.0, 3.0, 3.0, 6.0, 6.0, 6.0, 6.0};
    MultiHead<OvqAttention<S, arch::scalar>> cpu(OvqAttention<S, arch::scalar>(opt), 1, 8, 2, 128,
                                                  128);
    cpu.set_head_betas(betas);
    const RowMatrix<S> expected = cpu.forward(in.q, in.k, in.v);
    // The delta rule's predictions are reads: equal to the CPU's to rounding only.
    for (const auto& cut : kCuts)
      check_against_emulation<cuda::BasicOvqAttention, S>(
          opt, make, in, cut, expected, half ? cpu_bound : 1e-4, emulation_bound, betas);
  }
}

TEST_CASE("GPU conversion instructions == the emulation's integer conversions, every float",
          "[gpu][convert]") {
  using conversion_check::ConversionMismatches;
  ConversionMismatches* d = nullptr;
  REQUIRE(cudaMalloc(&d, sizeof(ConversionMismatches)) == cudaSuccess);
  ConversionMismatches h{};
  for (unsigned int& f : h.first) f = 0xffffffffu;
  REQUIRE(cudaMemcpy(d, &h, sizeof h, cudaMemcpyHostToDevice) == cudaSuccess);
  conversion_check::compare_conversions<<<1024, 256>>>(d);
  REQUIRE(cudaGetLastError() == cudaSuccess);
  REQUIRE(cudaMemcpy(&h, d, sizeof h, cudaMemcpyDeviceToHost) == cudaSuccess);
  cudaFree(d);
  for (int k = 0; k < 5; ++k) {
    INFO("conversion " << k << " (bf16, fp16, widen fp16, bf16 pair, fp16 pair): first mismatch "
                       << "at bits " << std::hex
                       << h.first[k]);
    CHECK(h.count[k] == 0);
  }
}

TEST_CASE("GPU decode step captured in a CUDA graph and replayed == steps from the host",
          "[gpu][graph]") {
  using S = float;
  const Index heads = 4, group = 4, dk = 128, dv = 128, prompt = 1000, steps = 150;
  OvqOptions opt;
  opt.capacity = 512;
  opt.chunk = 64;
  opt.beta = 4.0;
  const Inputs<S> in = inputs<S>(heads, group, prompt + steps, dk, dv, 13, true);
  const cuda::OvqAttention<S> mixer(opt);
  cudaStream_t stream;
  REQUIRE(cudaStreamCreate(&stream) == cudaSuccess);
  using Rows = DeviceRows<S, Device>;
  const Rows q(in.q, heads * group, stream), k(in.k, heads, stream), v(in.v, heads, stream);
  const Rows o_host(heads * group, in.t, dv, stream), o_graph(heads * group, in.t, dv, stream);

  auto host_state = mixer.make_state(heads, dk, dv, stream);
  ovq::test::feed_pieces(mixer, host_state, q, k, v, o_host, std::vector<Index>{prompt},
                         stream);
  for (Index i = prompt; i < in.t; ++i)
    mixer.step(host_state, q.view().middle_rows(i, 1), k.view().middle_rows(i, 1),
               v.view().middle_rows(i, 1), o_host.view().middle_rows(i, 1), stream);

  // The graph reads one token from fixed buffers, which the host refills between replays.
  auto state = mixer.make_state(heads, dk, dv, stream);
  ovq::test::feed_pieces(mixer, state, q, k, v, o_graph, std::vector<Index>{prompt}, stream);
  mixer.reserve(state, heads * group, stream);
  const Rows q1(heads * group, 1, dk, stream), k1(heads, 1, dk, stream), v1(heads, 1, dv, stream),
      o1(heads * group, 1, dv, stream);
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  REQUIRE(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal) == cudaSuccess);
  mixer.step(state, q1.view(), k1.view(), v1.view(), o1.view(), stream);
  REQUIRE(cudaStreamEndCapture(stream, &graph) == cudaSuccess);
  REQUIRE(cudaGraphInstantiate(&exec, graph, 0) == cudaSuccess);
  auto copy_rows = [&](cuda::HeadsView<S> to, cuda::HeadsView<S> from) {
    for (Index h = 0; h < from.heads; ++h)
      REQUIRE(cudaMemcpyAsync(to.row(h, 0), from.row(h, 0), sizeof(S) * from.cols,
                              cudaMemcpyDeviceToDevice, stream) == cudaSuccess);
  };
  for (Index i = prompt; i < in.t; ++i) {
    copy_rows(q1.view(), q.view().middle_rows(i, 1));
    copy_rows(k1.view(), k.view().middle_rows(i, 1));
    copy_rows(v1.view(), v.view().middle_rows(i, 1));
    REQUIRE(cudaGraphLaunch(exec, stream) == cudaSuccess);
    copy_rows(o_graph.view().middle_rows(i, 1), o1.view());
  }
  REQUIRE(cudaStreamSynchronize(stream) == cudaSuccess);
  CHECK(same_bits(o_graph.download(stream), o_host.download(stream)));
  const auto a = state.to_host(stream), b = host_state.to_host(stream);
  for (Index h = 0; h < heads; ++h) CHECK(a[h] == b[h]);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

}  // namespace

int main(int argc, char* argv[]) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("SKIP: no CUDA device: the GPU tests did not run\n");
    return 77;
  }
  cudaDeviceProp prop;
  cudaGetDeviceProperties(&prop, 0);
  std::printf("GPU: %s (sm_%d%d)\n", prop.name, prop.major, prop.minor);
  return Catch::Session().run(argc, argv);
}
