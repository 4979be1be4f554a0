// Linear attention (MATH.md 2), unnormalised, identity feature map, no decay, in chunked GEMM
// form: prefill and decode through MultiHead, batch 1.
//
//   BM_LinearAttention_prefill/T:<T>/L:<chunk>/d:<d>/H:8        T = 512 ... 65536, chunk 64
//   BM_LinearAttention_prefill/T:<T>/L:<chunk>/d:128/H:8        chunk = 32, 64, 128
//   BM_LinearAttention_prefill/T:4096/L:64/d:128/Hq:32/Hkv:8    grouped queries
//   BM_LinearAttention_decode/ctx:<C>/d:128/H:8                 C = 1k ... 64k (constant cost)
#include "bench_common.hpp"

namespace {

using namespace ovq_bench;
using Mixer = ovq::LinearAttention<float>;

Mixer make_mixer(Index chunk) {
  ovq::LinearAttentionOptions opt;
  opt.chunk = chunk;
  return Mixer(opt);
}

void prefill_case(Index tokens, Index chunk, Index d, Index hq, Index hkv) {
  add_case(
      case_name("BM_LinearAttention_prefill", {{"T", tokens}, {"L", chunk}, {"d", d}}, hq, hkv),
      [=](benchmark::State& st) {
        ovq::MultiHead<Mixer> layer(make_mixer(chunk), 1, hq, hkv, d, d);
        run_prefill(st, layer, tokens, flops::linear_chunked(tokens, chunk, d, d, hq, hkv));
      });
}

void decode_case(Index ctx, Index d, Index hq, Index hkv) {
  add_case(case_name("BM_LinearAttention_decode", {{"ctx", ctx}, {"d", d}}, hq, hkv),
           [=](benchmark::State& st) {
             const Mixer mixer = make_mixer(64);
             const auto& context = absorbed_context<Mixer>(
                 "linear/d:" + std::to_string(d) + "/Hkv:" + std::to_string(hkv), ctx,
                 [&] { return ovq::MultiHead<Mixer>(mixer, 1, hkv, hkv, d, d); });
             // A step is a chunk of one token; the state never grows, nothing to restore.
             run_decode(st, mixer, context, hq, -1, flops::linear_chunked(1, 1, d, d, hq, hkv));
           });
}

void register_cases() {
  for (Index d : {64, 128}) {
    for (Index t = 512; t <= 65536; t *= 2) prefill_case(t, 64, d, 8, 8);
  }
  for (Index t : {2048, 16384}) {
    for (Index chunk : {32, 128}) prefill_case(t, chunk, 128, 8, 8);
  }
  prefill_case(4096, 64, 128, 32, 8);
  for (Index ctx : {1024, 4096, 16384, 65536}) decode_case(ctx, 128, 8, 8);
}

}  // namespace

int main(int argc, char** argv) { return ovq_bench::run_main(argc, argv, register_cases); }
