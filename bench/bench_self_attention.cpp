// Causal self-attention (MATH.md 1): prefill and decode through MultiHead, batch 1.
//
//   BM_SelfAttention_prefill/T:<T>/d:<d>/H:<H>          T = 512 ... 65536, d = 64, 128;
//                                                       H = 8, and 2 from T = 32768 on
//   BM_SelfAttention_prefill/T:<T>/d:128/Hq:32/Hkv:8    grouped queries
//   BM_SelfAttention_decode/ctx:<C>/d:128/H:8           C = 1k ... 64k
//   BM_SelfAttention_decode/ctx:<C>/d:128/Hq:32/Hkv:8
//   BM_SelfAttention_decode_window/ctx:65536/window:4096/d:128/H:8
//                                                       sliding window: the cache holds W - 1
//                                                       rows, dropping its oldest at each step
//   .../elem:bf16, .../elem:fp16                        16-bit inputs and cache: prefill T = 4096
//                                                       d = 128 H = 8, decode C = 4k and 64k
//   .../elem:bf16/arch:amx                              the same bf16 cases on AMX tiles
//                                                       (arch::amx), where the compiler targets
//                                                       them and they are not already native
//
// Prefill is quadratic: T = 65536 at 8 heads needs 2 * 65536^2 / 2 * 256 * 8 = 4.4 TFLOP, so the
// longest cases run 2 heads (one per core of a 2-core machine; compare per head and token).
// Decode appends a row per step: the cache is put back to C rows every max(32, C / 32) steps,
// so it stays within 3% of C (and within 32 rows at C = 1k). A windowed cache keeps its size.
#include "bench_common.hpp"

namespace {

using namespace ovq_bench;

// "/arch:<name>" for kernels other than the native ones.
template <class Arch>
std::string arch_arg() {
  if constexpr (std::is_same_v<Arch, ovq::arch::native>) return "";
  return std::string("/arch:") + Arch::kName;
}

template <class Element = float, class Arch = ovq::arch::native>
void prefill_case(Index tokens, Index d, Index hq, Index hkv) {
  using Mixer = ovq::SelfAttention<Element, Arch>;
  add_case(case_name("BM_SelfAttention_prefill", {{"T", tokens}, {"d", d}}, hq, hkv) +
               element_arg<Element>() + arch_arg<Arch>(),
           [=](benchmark::State& st) {
             ovq::MultiHead<Mixer> layer(Mixer{}, 1, hq, hkv, d, d);
             run_prefill(st, layer, tokens, flops::self_prefill(tokens, d, d, hq));
           });
}

template <class Element = float, class Arch = ovq::arch::native>
void decode_case(Index ctx, Index d, Index hq, Index hkv) {
  using Mixer = ovq::SelfAttention<Element, Arch>;
  add_case(case_name("BM_SelfAttention_decode", {{"ctx", ctx}, {"d", d}}, hq, hkv) +
               element_arg<Element>() + arch_arg<Arch>(),
           [=](benchmark::State& st) {
             const Mixer mixer{};
             const auto& context = absorbed_context<Mixer>(
                 "self/d:" + std::to_string(d) + "/Hkv:" + std::to_string(hkv), ctx,
                 [&] { return ovq::MultiHead<Mixer>(mixer, 1, hkv, hkv, d, d); });
             const Index restore = std::max<Index>(32, ctx / 32);
             // The cache holds ctx ... ctx + restore - 1 rows: on average ctx + (restore - 1) / 2.
             const double rows = static_cast<double>(ctx) + static_cast<double>(restore - 1) / 2.0;
             // A step reads every cached key and value once.
             const double bytes = rows * static_cast<double>(hkv * 2 * d) * sizeof(Element);
             run_decode(st, mixer, context, hq, restore, flops::self_decode(rows, d, d, hq), bytes);
           });
}

// A sliding-window decode step after a long stream: it reads the W - 1 cached rows (and its
// own), like a full cache of W rows, and drops the oldest row.
void decode_window_case(Index ctx, Index window, Index d, Index h) {
  using Mixer = ovq::SelfAttention<float>;
  add_case(case_name("BM_SelfAttention_decode_window", {{"ctx", ctx}, {"window", window}, {"d", d}},
                     h, h),
           [=](benchmark::State& st) {
             ovq::SelfAttentionOptions options;
             options.window = window;
             const Mixer mixer(options);
             const auto& context = absorbed_context<Mixer>(
                 "self-window/W:" + std::to_string(window) + "/d:" + std::to_string(d) +
                     "/H:" + std::to_string(h),
                 ctx, [&] { return ovq::MultiHead<Mixer>(mixer, 1, h, h, d, d); });
             const double rows = static_cast<double>(window - 1);
             const double bytes = rows * static_cast<double>(h * 2 * d) * sizeof(float);
             run_decode(st, mixer, context, h, 0, flops::self_decode(rows, d, d, h), bytes);
           });
}

void register_cases() {
  for (Index d : {64, 128}) {
    for (Index t = 512; t <= 65536; t *= 2)
      prefill_case(t, d, t >= 32768 ? 2 : 8, t >= 32768 ? 2 : 8);
  }
  for (Index t : {1024, 4096}) prefill_case(t, 128, 32, 8);
  for (Index ctx : {1024, 4096, 16384, 65536}) {
    decode_case(ctx, 128, 8, 8);
    decode_case(ctx, 128, 32, 8);
  }
  decode_window_case(65536, 4096, 128, 8);
  prefill_case<ovq::bf16>(4096, 128, 8, 8);
  prefill_case<ovq::fp16>(4096, 128, 8, 8);
  for (Index ctx : {4096, 65536}) {
    decode_case<ovq::bf16>(ctx, 128, 8, 8);
    decode_case<ovq::fp16>(ctx, 128, 8, 8);
    decode_case<ovq::bf16>(ctx, 128, 32, 8);
  }
#if defined(OVQ_ARCH_AMX)
  if constexpr (!std::is_same_v<ovq::arch::native, ovq::arch::amx>) {
    prefill_case<ovq::bf16, ovq::arch::amx>(4096, 128, 8, 8);
    for (Index ctx : {4096, 65536}) {
      decode_case<ovq::bf16, ovq::arch::amx>(ctx, 128, 8, 8);
      decode_case<ovq::bf16, ovq::arch::amx>(ctx, 128, 32, 8);
    }
  }
#endif
}

}  // namespace

int main(int argc, char** argv) { return ovq_bench::run_main(argc, argv, register_cases); }
