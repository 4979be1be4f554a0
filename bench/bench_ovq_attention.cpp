// OVQ-attention (MATH.md 4), default options (dirichlet growth with alpha = N, spread seeding,
// adaptive rate): prefill and decode through MultiHead, batch 1.
//
//   BM_OVQ_prefill/T:<T>/N:2048/L:128/d:<d>/H:8        T = 512 ... 65536, d = 64, 128
//   BM_OVQ_prefill/T:<T>/N:2048/L:128/d:128/H:2        T = 16384, 32768, 65536
//   BM_OVQ_prefill/T:16384/N:<N>/L:<L>/d:128/H:8       N = 512, 2048, 8192 x L = 64, 128, 256
//   BM_OVQ_prefill/T:4096/N:2048/L:128/d:128/Hq:32/Hkv:8
//   BM_OVQ_prefill_full/T:<T>/N:2048/L:128/d:128/H:<H> T = 16384, 65536, H = 2, 8
//   BM_OVQ_decode/ctx:<C>/N:<N>/d:128/H:8              C = 1k ... 64k, N = 512, 2048, 8192 (L 128)
//   BM_OVQ_decode/ctx:<C>/N:2048/d:128/Hq:32/Hkv:8
//   BM_OVQ_decode_full/ctx:<C>/N:2048/d:128/H:8        C = 4096, 65536 (L 128)
//
// BM_OVQ_prefill and BM_OVQ_decode start from empty states, so their dictionary is still
// growing: the dirichlet schedule holds G(16384) = 1821 of 2048 rows, and far fewer at 4k. The
// _full cases measure OVQ at capacity: their starting state is a context absorbed (untimed, with
// generated inputs) by a mixer with the same capacity, chunk and beta but linear growth at one
// centroid per token, which fills the dictionary after N tokens; the timed mixer has the default
// options, and its growth opens nothing from a full dictionary, so n = N throughout.
//   prefill_full: the context is 2 N tokens; every iteration runs the T tokens from a fresh copy
//                 of it (the copy is untimed).
//   decode_full:  the context is C tokens, so t = C as in a real stream at that context.
//
// FLOPs count the reads, the assignment and the seeding, with dictionary sizes simulated through
// the growth schedule (flops::ovq_stream), or fixed at N for the _full cases
// (flops::ovq_stream_full: no seeding). Decode amortises the chunk writes: the states are put
// back to the context every 2 L steps, so each timed stretch holds exactly two writes per head.
#include <stdexcept>

#include "bench_common.hpp"

namespace {

using namespace ovq_bench;
using Mixer = ovq::OvqAttention<float>;

ovq::OvqOptions options(Index capacity, Index chunk) {
  ovq::OvqOptions opt;
  opt.capacity = capacity;
  opt.chunk = chunk;
  return opt;
}

// Reports the dictionary size n reached, and warns when it is not the one the FLOP count assumed
// (the growth schedule alone sets it, so a difference means the count no longer fits the kernel).
void note_dictionary(benchmark::State& st, const std::string& name, const Mixer::State& state,
                     Index modelled) {
  const Index n = state.dictionary().size();
  st.counters["n"] = static_cast<double>(n);
  if (n != modelled) {
    std::fprintf(stderr, "ovq bench: %s: dictionary holds %lld rows, the FLOP count assumed %lld\n",
                 name.c_str(), static_cast<long long>(n), static_cast<long long>(modelled));
  }
}

void prefill_case(Index tokens, Index capacity, Index chunk, Index d, Index hq, Index hkv) {
  const std::string name = case_name(
      "BM_OVQ_prefill", {{"T", tokens}, {"N", capacity}, {"L", chunk}, {"d", d}}, hq, hkv);
  add_case(name, [=](benchmark::State& st) {
    const ovq::OvqOptions opt = options(capacity, chunk);
    ovq::MultiHead<Mixer> layer(Mixer(opt), 1, hq, hkv, d, d);
    const double work = flops::ovq_stream(opt, 0, tokens).total(d, d, hq, hkv);
    run_prefill(st, layer, tokens, work);
    note_dictionary(st, name, layer.states().front(), flops::ovq_size_after(opt, tokens));
  });
}

// Options of the mixer that writes the _full cases' contexts: the timed mixer's, with linear
// growth at one centroid per token (full after N tokens).
ovq::OvqOptions filling(const ovq::OvqOptions& opt) {
  ovq::OvqOptions fill = opt;
  fill.growth = ovq::Growth::linear(1.0);
  return fill;
}

// kv-head states after a context of ctx tokens written by the filling mixer (cached, extended in
// place by a longer context of the same key). Throws if the dictionary is not full.
template <class M = Mixer>
const ovq::MultiHead<M>& full_context(const ovq::OvqOptions& opt, Index ctx, Index d,
                                      Index hkv) {
  const M fill(filling(opt));
  const auto& context = absorbed_context<M>(
      "ovq-full/N:" + std::to_string(opt.capacity) + "/L:" + std::to_string(opt.chunk) +
          "/d:" + std::to_string(d) + "/Hkv:" + std::to_string(hkv),
      ctx, [&] { return ovq::MultiHead<M>(fill, 1, hkv, hkv, d, d); });
  for (const typename M::State& s : context.states()) {
    if (s.dictionary().size() != opt.capacity || s.tokens() != ctx) {
      throw std::runtime_error("warm-up context: dictionary " +
                               std::to_string(s.dictionary().size()) + " of " +
                               std::to_string(opt.capacity) + " rows after " +
                               std::to_string(s.tokens()) + " tokens, expected full after " +
                               std::to_string(ctx));
    }
  }
  return context;
}

// Prefill of T tokens from a state whose dictionary is already full (a 2 N-token context).
void prefill_full_case(Index tokens, Index capacity, Index chunk, Index d, Index hq, Index hkv) {
  const std::string name = case_name(
      "BM_OVQ_prefill_full", {{"T", tokens}, {"N", capacity}, {"L", chunk}, {"d", d}}, hq, hkv);
  add_case(name, [=](benchmark::State& st) {
    const ovq::OvqOptions opt = options(capacity, chunk);
    const Index warm = 2 * capacity;  // a multiple of L: the prefill starts on a chunk boundary
    const std::vector<Mixer::State> start = full_context(opt, warm, d, hkv).states();
    ovq::MultiHead<Mixer> layer(Mixer(opt), 1, hq, start);
    const double work = flops::ovq_stream_full(opt, warm, tokens).total(d, d, hq, hkv);
    run_prefill(st, layer, tokens, work, &start);
    note_dictionary(st, name, layer.states().front(), capacity);
  });
}

void decode_case(Index ctx, Index capacity, Index d, Index hq, Index hkv) {
  constexpr Index kChunk = 128;
  const std::string name =
      case_name("BM_OVQ_decode", {{"ctx", ctx}, {"N", capacity}, {"d", d}}, hq, hkv);
  add_case(name, [=](benchmark::State& st) {
    const ovq::OvqOptions opt = options(capacity, kChunk);
    const Mixer mixer(opt);
    const auto& context = absorbed_context<Mixer>(
        "ovq/N:" + std::to_string(capacity) + "/d:" + std::to_string(d) +
            "/Hkv:" + std::to_string(hkv),
        ctx, [&] { return ovq::MultiHead<Mixer>(mixer, 1, hkv, hkv, d, d); });
    const Index restore = 2 * kChunk;
    const double per_step = flops::ovq_stream(opt, ctx, restore).total(d, d, hq, hkv) / restore;
    run_decode(st, mixer, context, hq, restore, per_step);
    note_dictionary(st, name, context.states().front(), flops::ovq_size_after(opt, ctx));
  });
}

// Decode at context ctx with the dictionary at capacity (the context written by the filling
// mixer, t = ctx). A step reads the N dictionary rows of every kv head (the rows the reads see:
// 16-bit ones for a 16-bit element).
template <class Element = float>
void decode_full_case(Index ctx, Index capacity, Index d, Index hq, Index hkv) {
  using M = ovq::OvqAttention<Element>;
  constexpr Index kChunk = 128;
  const std::string name =
      case_name("BM_OVQ_decode_full", {{"ctx", ctx}, {"N", capacity}, {"d", d}}, hq, hkv) +
      element_arg<Element>();
  add_case(name, [=](benchmark::State& st) {
    const ovq::OvqOptions opt = options(capacity, kChunk);
    const M mixer(opt);
    const auto& context = full_context<M>(opt, ctx, d, hkv);
    const Index restore = 2 * kChunk;
    const double per_step =
        flops::ovq_stream_full(opt, ctx, restore).total(d, d, hq, hkv) / restore;
    const double bytes = static_cast<double>(hkv * capacity * 2 * d) * sizeof(Element);
    run_decode(st, mixer, context, hq, restore, per_step, bytes);
    st.counters["n"] = static_cast<double>(context.states().front().dictionary().size());
  });
}

void register_cases() {
  for (Index d : {64, 128}) {
    for (Index t = 512; t <= 65536; t *= 2) prefill_case(t, 2048, 128, d, 8, 8);
  }
  // Fewer heads at the longest T: the quick suite's long-stream points, and the same heads as
  // self-attention there.
  for (Index t : {16384, 32768, 65536}) prefill_case(t, 2048, 128, 128, 2, 2);
  for (Index capacity : {512, 2048, 8192}) {
    for (Index chunk : {64, 128, 256}) {
      if (capacity == 2048 && chunk == 128) continue;  // in the T sweep
      prefill_case(16384, capacity, chunk, 128, 8, 8);
    }
  }
  prefill_case(4096, 2048, 128, 128, 32, 8);
  // At capacity; the same heads in a row share the warm-up context.
  for (Index h : {2, 8}) {
    for (Index t : {16384, 65536}) prefill_full_case(t, 2048, 128, 128, h, h);
  }
  for (Index capacity : {512, 2048, 8192}) {
    for (Index ctx : {1024, 4096, 16384, 65536}) {
      decode_case(ctx, capacity, 128, 8, 8);
      if (capacity == 2048 && (ctx == 4096 || ctx == 65536)) decode_case(ctx, capacity, 128, 32, 8);
    }
  }
  for (Index ctx : {4096, 65536}) decode_full_case(ctx, 2048, 128, 8, 8);
  decode_full_case<ovq::bf16>(65536, 2048, 128, 8, 8);
}

}  // namespace

int main(int argc, char** argv) { return ovq_bench::run_main(argc, argv, register_cases); }
