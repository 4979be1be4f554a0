// GPU benchmarks of the CUDA mixers against ceilings measured in the same run.
//
//   bench_cuda [--quick] [--json FILE] [--only TEXT]
//
// Ceilings: device copy bandwidth (a device-to-device copy of 2 GiB, bytes read and written),
// the FP32 FMA peak (a kernel of independent FMA chains), cuBLAS SGEMM and the bf16 GEMM
// (cublasGemmEx, fp32 accumulation; 8192^3). Cases, timed
// with CUDA events (median of the repetitions, after one untimed call), each reporting its rate
// and its fraction of the matching ceiling:
//   self_prefill_f32     causal self-attention prefill, T = 16384, d = 128, H = 32
//   self_prefill_bf16    the same in bf16 (tensor cores), against the bf16 GEMM
//   self_decode_f32      one decode step, 32 heads over a 128k-token cache (4 GiB of keys and
//                        values: every step streams them from device memory)
//   self_decode_bf16     the same over a bf16 cache (2 GiB)
//   ovq_prefill_f32      OVQ prefill T = 32768, N = 2048, L = 128, d = 128, H = 32, against
//                        self-attention prefill over the same T
//   ovq_prefill_bf16     the same in bf16 (16-bit dictionary reads on tensor cores), against
//                        bf16 self-attention prefill
//   ovq_decode_graph_f32 one OVQ decode step at capacity (N = 2048, d = 128, H = 32) replayed
//                        from a CUDA graph
//   ovq_decode_graph_bf16  the same over a bf16 dictionary
// with, for the OVQ cases, the writes' share of the prefill (the same stream absorbed, no
// reads) and a decode's median step (reads only) and slowest step (the chunk's write).
// --quick divides the lengths by 4 (a smoke run). Output: one table on stdout, and JSON lines.
#include <cublas_v2.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "ovq/cuda.cuh"

namespace {

using namespace ovq;

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "bench_cuda: %s: %s\n", what, cudaGetErrorString(e));
    std::exit(1);
  }
}

// Median time in ms of `reps` calls of f on `stream`, after one untimed call.
template <class F>
double time_ms(cudaStream_t stream, int reps, F&& f) {
  f();
  check(cudaStreamSynchronize(stream), "warm-up");
  std::vector<double> times;
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  for (int r = 0; r < reps; ++r) {
    cudaEventRecord(start, stream);
    f();
    cudaEventRecord(stop, stream);
    check(cudaEventSynchronize(stop), "timed call");
    float ms = 0;
    cudaEventElapsedTime(&ms, start, stop);
    times.push_back(ms);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

__global__ void fma_peak(float* out, int iters) {
  float a[8];
  for (int i = 0; i < 8; ++i) a[i] = threadIdx.x * 1e-7f + i;
  const float b = 1.000001f, c = 1e-7f;
  for (int it = 0; it < iters; ++it) {
#pragma unroll
    for (int i = 0; i < 8; ++i) a[i] = fmaf(a[i], b, c);
  }
  float s = 0;
  for (int i = 0; i < 8; ++i) s += a[i];
  if (s == 12345.0f) out[0] = s;  // keeps the chains alive
}

struct Row {
  std::string name, rate, ceiling;
  double ms, value, fraction;
};

template <class S>
cuda::HeadsView<S> heads(S* data, Index h, Index t, Index d) {
  return cuda::contiguous_heads(data, h, t, d);
}

template <class S>
S* device_random(std::size_t n, std::uint64_t seed) {
  std::vector<S> host(n);
  std::uint64_t x = seed;
  for (auto& v : host)
    v = static_cast<S>(static_cast<float>(static_cast<double>(ovq::detail::splitmix64(x) >> 11) *
                                              0x1p-53 -
                                          0.5));
  S* d = nullptr;
  check(cudaMalloc(&d, n * sizeof(S)), "cudaMalloc");
  check(cudaMemcpy(d, host.data(), n * sizeof(S), cudaMemcpyHostToDevice), "upload");
  return d;
}

}  // namespace

int main(int argc, char** argv) {
  bool quick = false;
  std::string json, only;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--quick") == 0) quick = true;
    else if (std::strcmp(argv[i], "--json") == 0 && i + 1 < argc) json = argv[++i];
    else if (std::strcmp(argv[i], "--only") == 0 && i + 1 < argc) only = argv[++i];
    else {
      std::fprintf(stderr, "usage: bench_cuda [--quick] [--json FILE] [--only TEXT]\n");
      return 2;
    }
  }
  // --only TEXT: the cases whose names contain TEXT (a profiler's run), no ceilings.
  auto selected = [&](const std::string& name) {
    return only.empty() || name.find(only) != std::string::npos;
  };
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("bench_cuda: no CUDA device\n");
    return 77;
  }
  cudaDeviceProp prop;
  cudaGetDeviceProperties(&prop, 0);
  cudaStream_t stream;
  check(cudaStreamCreate(&stream), "cudaStreamCreate");
  const Index scale = quick ? 4 : 1;
  // Each row is also printed as it is measured, so a run cut short still reports its rows.
  struct Rows : std::vector<Row> {
    void push_back(Row r) {
      std::printf("measured: %s: %.3f ms, %.3f %s\n", r.name.c_str(), r.ms, r.value,
                  r.rate.c_str());
      std::fflush(stdout);
      std::vector<Row>::push_back(std::move(r));
    }
  } rows;

  // ---- ceilings ----
  double copy_gbs = NAN, fma_tflops = NAN, hgemm_tflops = NAN;
  if (only.empty()) {
    const std::size_t copy_bytes = std::size_t(2) << 30;
    void *a = nullptr, *b = nullptr;
    check(cudaMalloc(&a, copy_bytes), "cudaMalloc");
    check(cudaMalloc(&b, copy_bytes), "cudaMalloc");
    const double copy_ms = time_ms(
        stream, 10, [&] { cudaMemcpyAsync(b, a, copy_bytes, cudaMemcpyDeviceToDevice, stream); });
    copy_gbs = 2.0 * copy_bytes / copy_ms / 1e6;
    cudaFree(a);
    cudaFree(b);
    rows.push_back({"ceiling: device copy", "GB/s", "-", copy_ms, copy_gbs, 1.0});

    float* sink = nullptr;
    check(cudaMalloc(&sink, sizeof(float)), "cudaMalloc");
    const int fma_blocks = prop.multiProcessorCount * 8, fma_threads = 256, fma_iters = 1 << 14;
    const double fma_ms = time_ms(stream, 5, [&] {
      fma_peak<<<fma_blocks, fma_threads, 0, stream>>>(sink, fma_iters);
    });
    fma_tflops = 2.0 * 8 * fma_iters * double(fma_blocks) * fma_threads / fma_ms / 1e9;
    rows.push_back({"ceiling: FP32 FMA", "TFLOP/s", "-", fma_ms, fma_tflops, 1.0});
    cudaFree(sink);

    cublasHandle_t blas;
    cublasCreate(&blas);
    cublasSetStream(blas, stream);
    const int n = 8192;
    float* ga = device_random<float>(std::size_t(n) * n, 1);
    float* gb = device_random<float>(std::size_t(n) * n, 2);
    float* gc = device_random<float>(std::size_t(n) * n, 3);
    const float one = 1, zero = 0;
    const double gemm_ms = time_ms(stream, 5, [&] {
      cublasSgemm(blas, CUBLAS_OP_N, CUBLAS_OP_N, n, n, n, &one, ga, n, gb, n, &zero, gc, n);
    });
    const double gemm_tflops = 2.0 * n * double(n) * n / gemm_ms / 1e9;
    rows.push_back({"ceiling: cuBLAS SGEMM", "TFLOP/s", "-", gemm_ms, gemm_tflops, 1.0});
    cudaFree(ga);
    cudaFree(gb);
    cudaFree(gc);
    bf16* ha = device_random<bf16>(std::size_t(n) * n, 4);
    bf16* hb = device_random<bf16>(std::size_t(n) * n, 5);
    float* hc = device_random<float>(std::size_t(n) * n, 6);
    const double hgemm_ms = time_ms(stream, 5, [&] {
      cublasGemmEx(blas, CUBLAS_OP_N, CUBLAS_OP_N, n, n, n, &one, ha, CUDA_R_16BF, n, hb,
                   CUDA_R_16BF, n, &zero, hc, CUDA_R_32F, n, CUBLAS_COMPUTE_32F,
                   CUBLAS_GEMM_DEFAULT);
    });
    hgemm_tflops = 2.0 * n * double(n) * n / hgemm_ms / 1e9;
    rows.push_back({"ceiling: cuBLAS bf16 GEMM", "TFLOP/s", "-", hgemm_ms, hgemm_tflops, 1.0});
    cudaFree(ha);
    cudaFree(hb);
    cudaFree(hc);
    cublasDestroy(blas);
  }

  const Index h = 32, d = 128;
  // ---- self-attention prefill (element type of `tag`) ----
  auto self_prefill = [&](Index t, double* ms_out, auto tag) {
    using E = decltype(tag);
    E* q = device_random<E>(std::size_t(h * t * d), 11);
    E* k = device_random<E>(std::size_t(h * t * d), 12);
    E* v = device_random<E>(std::size_t(h * t * d), 13);
    E* o = nullptr;
    cudaMalloc(&o, sizeof(E) * h * t * d);
    SelfAttentionOptions opt;
    opt.beta = 1.0 / std::sqrt(double(d));
    opt.chunk = t;  // one read over the whole prompt
    const cuda::SelfAttention<E> mixer(opt);
    const double ms = time_ms(stream, 3, [&] {
      auto state = mixer.make_state(h, d, d, stream, t);
      mixer.forward(state, heads<const E>(q, h, t, d), heads<const E>(k, h, t, d),
                    heads<const E>(v, h, t, d), heads(o, h, t, d), stream);
    });
    cudaFree(q);
    cudaFree(k);
    cudaFree(v);
    cudaFree(o);
    *ms_out = ms;
    return 2.0 * h * (double(t) * (t + 1) / 2) * (2 * d) / ms / 1e9;  // TFLOP/s, causal half
  };
  if (selected("self_prefill_f32")) {
    double self_ms = 0;
    const double self_tflops = self_prefill(16384 / scale, &self_ms, float{});
    rows.push_back({"self_prefill_f32 T=16384 d=128 H=32", "TFLOP/s", "FP32 FMA", self_ms,
                    self_tflops, self_tflops / fma_tflops});
  }
  if (selected("self_prefill_bf16")) {
    double half_ms = 0;
    const double half_tflops = self_prefill(16384 / scale, &half_ms, bf16{});
    rows.push_back({"self_prefill_bf16 T=16384 d=128 H=32", "TFLOP/s", "bf16 GEMM", half_ms,
                    half_tflops, half_tflops / hgemm_tflops});
  }

  // ---- self-attention decode over a long cache (element type of `tag`) ----
  auto self_decode = [&](const char* name, auto tag) {
    using E = decltype(tag);
    const Index ctx = 131072 / scale;
    SelfAttentionOptions opt;
    opt.beta = 1.0 / std::sqrt(double(d));
    const cuda::SelfAttention<E> mixer(opt);
    auto state = mixer.make_state(h, d, d, stream);
    mixer.reserve(state, h, ctx + 8, stream);
    E* k = device_random<E>(std::size_t(h * 4096 * d), 21);
    E* v = device_random<E>(std::size_t(h * 4096 * d), 22);
    for (Index filled = 0; filled < ctx; filled += 4096)
      mixer.absorb(state, heads<const E>(k, h, 4096, d), heads<const E>(v, h, 4096, d), stream);
    E* q1 = device_random<E>(std::size_t(h * d), 23);
    E* o1 = nullptr;
    cudaMalloc(&o1, sizeof(E) * h * d);
    // Steps read the cache; the cache grows by one row a step (timing 5 of them).
    const double ms = time_ms(stream, 5, [&] {
      mixer.step(state, heads<const E>(q1, h, 1, d), heads<const E>(k, h, 1, d),
                 heads<const E>(v, h, 1, d), heads(o1, h, 1, d), stream);
    });
    const double bytes = double(h) * ctx * 2 * d * sizeof(E);
    const double gbs = bytes / ms / 1e6;
    rows.push_back({name, "GB/s", "copy", ms, gbs, gbs / copy_gbs});
    cudaFree(k);
    cudaFree(v);
    cudaFree(q1);
    cudaFree(o1);
  };
  if (selected("self_decode_f32")) self_decode("self_decode_f32 ctx=128k H=32 d=128", float{});
  if (selected("self_decode_bf16")) self_decode("self_decode_bf16 ctx=128k H=32 d=128", bf16{});

  // ---- OVQ prefill against self-attention at the same T (element type of `tag`) ----
  auto ovq_prefill = [&](const char* name, auto tag) {
    using E = decltype(tag);
    const Index t = 32768 / scale;
    OvqOptions opt;
    opt.capacity = 2048;
    opt.chunk = 128;
    opt.beta = 8.0;
    const cuda::OvqAttention<E> mixer(opt);
    E* q = device_random<E>(std::size_t(h * t * d), 31);
    E* k = device_random<E>(std::size_t(h * t * d), 32);
    E* v = device_random<E>(std::size_t(h * t * d), 33);
    E* o = nullptr;
    cudaMalloc(&o, sizeof(E) * h * t * d);
    const double ms = time_ms(stream, 1, [&] {
      auto state = mixer.make_state(h, d, d, stream);
      mixer.forward(state, heads<const E>(q, h, t, d), heads<const E>(k, h, t, d),
                    heads<const E>(v, h, t, d), heads(o, h, t, d), stream);
    });
    // The same stream written only (no queries, so no reads): the dictionary writes' share.
    const double write_ms = time_ms(stream, 1, [&] {
      auto state = mixer.make_state(h, d, d, stream);
      mixer.absorb(state, heads<const E>(k, h, t, d), heads<const E>(v, h, t, d), stream);
    });
    cudaFree(q);
    cudaFree(k);
    cudaFree(v);
    cudaFree(o);
    double self_t_ms = 0;
    self_prefill(t, &self_t_ms, E{});
    rows.push_back({name, "x faster than self", "self", ms, self_t_ms / ms, self_t_ms / ms / 4.0});
    rows.push_back({std::string(name) + ": writes only (absorb)", "share of prefill", "-", write_ms,
                    write_ms / ms, write_ms / ms});
  };
  if (selected("ovq_prefill_f32")) ovq_prefill("ovq_prefill_f32 T=32768 N=2048 L=128 H=32", float{});
  if (selected("ovq_prefill_bf16"))
    ovq_prefill("ovq_prefill_bf16 T=32768 N=2048 L=128 H=32", bf16{});

  // ---- OVQ decode step at capacity, replayed from a CUDA graph (element type of `tag`) ----
  auto ovq_decode = [&](const char* name, auto tag) {
    using E = decltype(tag);
    OvqOptions opt;
    opt.capacity = 2048;
    opt.chunk = 128;
    opt.beta = 8.0;
    const cuda::OvqAttention<E> mixer(opt);
    auto state = mixer.make_state(h, d, d, stream);
    const Index fill = 65536 / scale;
    E* k = device_random<E>(std::size_t(h * 4096 * d), 41);
    E* v = device_random<E>(std::size_t(h * 4096 * d), 42);
    for (Index filled = 0; filled < fill; filled += 4096)
      mixer.absorb(state, heads<const E>(k, h, 4096, d), heads<const E>(v, h, 4096, d), stream);
    mixer.reserve(state, h, stream);
    E* q1 = device_random<E>(std::size_t(h * d), 43);
    E* o1 = nullptr;
    cudaMalloc(&o1, sizeof(E) * h * d);
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    check(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), "capture");
    mixer.step(state, heads<const E>(q1, h, 1, d), heads<const E>(k, h, 1, d),
               heads<const E>(v, h, 1, d), heads(o1, h, 1, d), stream);
    check(cudaStreamEndCapture(stream, &graph), "capture");
    check(cudaGraphInstantiate(&exec, graph, 0), "instantiate");
    const int replays = 256;  // two chunks' writes among them
    const double ms = time_ms(stream, 3, [&] {
      for (int r = 0; r < replays; ++r) cudaGraphLaunch(exec, stream);
    });
    const double us = ms * 1000.0 / replays;
    rows.push_back({name, "us per step", "20 us", ms, us, 20.0 / us});
    // Each replay timed alone: the median is a step that only reads, the slowest one writes
    // its chunk.
    std::vector<cudaEvent_t> marks(replays + 1);
    for (auto& e : marks) cudaEventCreate(&e);
    cudaEventRecord(marks[0], stream);
    for (int r = 0; r < replays; ++r) {
      cudaGraphLaunch(exec, stream);
      cudaEventRecord(marks[r + 1], stream);
    }
    check(cudaEventSynchronize(marks[replays]), "replays");
    std::vector<double> step_us(replays);
    for (int r = 0; r < replays; ++r) {
      float step_ms = 0;
      cudaEventElapsedTime(&step_ms, marks[r], marks[r + 1]);
      step_us[r] = step_ms * 1000.0;
    }
    for (auto& e : marks) cudaEventDestroy(e);
    std::sort(step_us.begin(), step_us.end());
    rows.push_back({std::string(name) + ": median step (read only)", "us", "-",
                    step_us[replays / 2] / 1000.0, step_us[replays / 2], 1.0});
    rows.push_back({std::string(name) + ": slowest step (chunk write)", "us", "-",
                    step_us.back() / 1000.0, step_us.back(), 1.0});
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
    cudaFree(k);
    cudaFree(v);
    cudaFree(q1);
    cudaFree(o1);
  };
  if (selected("ovq_decode_graph_f32")) ovq_decode("ovq_decode_graph_f32 N=2048 H=32 d=128", float{});
  if (selected("ovq_decode_graph_bf16"))
    ovq_decode("ovq_decode_graph_bf16 N=2048 H=32 d=128", bf16{});

  std::printf("GPU: %s, %d SMs%s\n\n", prop.name, prop.multiProcessorCount, quick ? " (quick)" : "");
  std::printf("| case | time (ms) | value | unit | of ceiling |\n|---|---|---|---|---|\n");
  for (const Row& r : rows)
    std::printf("| %s | %.3f | %.2f | %s | %.2f (%s) |\n", r.name.c_str(), r.ms, r.value,
                r.rate.c_str(), r.fraction, r.ceiling.c_str());
  if (!json.empty()) {
    std::ofstream out(json);
    for (const Row& r : rows)
      out << "{\"case\": \"" << r.name << "\", \"ms\": " << r.ms << ", \"value\": " << r.value
          << ", \"unit\": \"" << r.rate << "\", \"fraction\": " << r.fraction << ", \"ceiling\": \""
          << r.ceiling << "\"}\n";
  }
  cudaStreamDestroy(stream);
  return 0;
}
