// VQ-attention (MATH.md 3) over a fixed codebook of S unit rows (one per kv head, seeded):
// prefill and decode through MultiHead, batch 1.
//
//   BM_VQ_prefill/T:<T>/S:2048/L:128/d:<d>/H:8        T = 512 ... 65536, d = 64, 128
//   BM_VQ_prefill/T:16384/S:<S>/L:128/d:128/H:8       S = 512, 2048, 8192
//   BM_VQ_prefill/T:4096/S:2048/L:128/d:128/Hq:32/Hkv:8
//   BM_VQ_decode/ctx:<C>/S:2048/d:128/H:8             C = 1k ... 64k
#include "bench_common.hpp"

namespace {

using namespace ovq_bench;
using Mixer = ovq::VqAttention<float>;

Mixer make_mixer(Index chunk) {
  ovq::VqAttentionOptions opt;
  opt.chunk = chunk;
  return Mixer(opt);
}

std::vector<Mixer::State> codebooks(const Mixer& mixer, Index codes, Index hkv, Index d) {
  std::vector<Mixer::State> states;
  Matrix codebook(codes, d);
  for (Index h = 0; h < hkv; ++h) {
    fill_rows(codebook, mix_seed(5, static_cast<std::uint64_t>(codes), h), true);
    states.push_back(mixer.make_state(codebook, d));
  }
  return states;
}

void prefill_case(Index tokens, Index codes, Index chunk, Index d, Index hq, Index hkv) {
  add_case(
      case_name("BM_VQ_prefill", {{"T", tokens}, {"S", codes}, {"L", chunk}, {"d", d}}, hq, hkv),
      [=](benchmark::State& st) {
        const Mixer mixer = make_mixer(chunk);
        ovq::MultiHead<Mixer> layer(mixer, 1, hq, codebooks(mixer, codes, hkv, d));
        run_prefill(st, layer, tokens, flops::vq(tokens, chunk, codes, d, d, hq, hkv));
      });
}

void decode_case(Index ctx, Index codes, Index d, Index hq, Index hkv) {
  add_case(case_name("BM_VQ_decode", {{"ctx", ctx}, {"S", codes}, {"d", d}}, hq, hkv),
           [=](benchmark::State& st) {
             const Mixer mixer = make_mixer(128);
             const auto& context = absorbed_context<Mixer>(
                 "vq/S:" + std::to_string(codes) + "/d:" + std::to_string(d) +
                     "/Hkv:" + std::to_string(hkv),
                 ctx, [&] {
                   return ovq::MultiHead<Mixer>(mixer, 1, hkv, codebooks(mixer, codes, hkv, d));
                 });
             // Each step is its own chunk of one token; the state has a fixed size.
             run_decode(st, mixer, context, hq, -1, flops::vq(1, 1, codes, d, d, hq, hkv));
           });
}

void register_cases() {
  for (Index d : {64, 128}) {
    for (Index t = 512; t <= 65536; t *= 2) prefill_case(t, 2048, 128, d, 8, 8);
  }
  for (Index codes : {512, 8192}) prefill_case(16384, codes, 128, 128, 8, 8);
  prefill_case(4096, 2048, 128, 128, 32, 8);
  for (Index ctx : {1024, 4096, 16384, 65536}) decode_case(ctx, 2048, 128, 8, 8);
}

}  // namespace

int main(int argc, char** argv) { return ovq_bench::run_main(argc, argv, register_cases); }
