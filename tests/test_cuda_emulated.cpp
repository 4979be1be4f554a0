// The CUDA path on the host: every device kernel (block program) and every device mixer run in
// the emulator (ovq/cuda/emulator.hpp), which computes what a GPU computes, against the double
// references, the CPU mixers, and themselves (prefill tiles == decode tiles, stream cuts,
// graph-capture launches). On a machine with a GPU, tests/cuda compares the GPU with the same
// emulation bit for bit.
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "ovq/cuda/emulator.hpp"
#include "ovq/cuda/kernels/launch.hpp"
#include "ovq/cuda/linear_attention.hpp"
#include "ovq/cuda/ovq_attention.hpp"
#include "ovq/cuda/schedule.hpp"
#include "ovq/cuda/self_attention.hpp"
#include "ovq/cuda/vq_attention.hpp"
#include "support/catch.hpp"
#include "support/cuda_harness.hpp"
#include "support/fixtures.hpp"
#include "support/matchers.hpp"

namespace ovq_test_cuda_emulated {

namespace {

using namespace ovq;
using cuda::Emulator;
using ovq::test::DeviceRows;
using ovq::test::random_matrix;
using ovq::test::relative_error;
using ovq::test::tolerance;

template <class S>
using Rows = DeviceRows<S, Emulator>;

template <class S>
bool same_bits(const RowMatrix<S>& a, const RowMatrix<S>& b) {
  return a.rows() == b.rows() && a.cols() == b.cols() &&
         std::memcmp(a.data(), b.data(), sizeof(S) * static_cast<std::size_t>(a.size())) == 0;
}

// ---------------------------------------------------------------------------------------------
// The read program against the contract's formula
// ---------------------------------------------------------------------------------------------

// The contract (kernels/read_contract.hpp) for one query row, in double.
Eigen::VectorXd read_row(const RowMatrix<double>& q, Index i, const RowMatrix<double>& km,
                         const RowMatrix<double>& vm, const std::vector<double>& bias,
                         const RowMatrix<double>& kl, const RowMatrix<double>& vl,
                         const kernels::ReadMask& mask, double beta) {
  const Index nm = km.rows();
  const Index p = mask.query_offset + i;
  std::vector<double> logits;
  std::vector<Eigen::VectorXd> values;
  for (Index r = 0; r < nm; ++r) {
    if (mask.causal && mask.window > 0 && r - nm <= p - mask.window) continue;
    logits.push_back(beta * q.row(i).dot(km.row(r)) + (bias.empty() ? 0.0 : bias[r]));
    values.push_back(vm.row(r).transpose());
  }
  for (Index j = 0; j < kl.rows(); ++j) {
    if (mask.causal && (j > p || (mask.window > 0 && j <= p - mask.window))) continue;
    logits.push_back(beta * q.row(i).dot(kl.row(j)));
    values.push_back(vl.row(j).transpose());
  }
  return ref::softmax_read(logits, values, vl.cols());
}

struct ReadCase {
  Index dk, dv, memory, local, queries, group;
  std::int64_t origin;
  bool causal;
  Index window;
  bool bias;
};

// One state's read through ReadProgram (prefill tiles, or decode tiles split over merge
// blocks), on the emulator.
template <class S>
RowMatrix<S> emulated_read(const ReadCase& c, const RowMatrix<S>& q, const RowMatrix<S>& km,
                           const RowMatrix<S>& vm, const std::vector<S>& bias,
                           const RowMatrix<S>& kl, const RowMatrix<S>& vl, S beta, bool decode) {
  cuda::kernels::ReadParams<S> p;
  p.source = cuda::kernels::ReadSource::fixed;
  p.fixed_extent.origin = c.origin;
  p.fixed_extent.memory_rows = c.memory;
  p.fixed_extent.local_rows = c.local;
  p.fixed_extent.query_offset = c.local - c.queries;
  RowMatrix<S> o(c.group * c.queries, c.dv);
  o.setConstant(std::numeric_limits<S>::quiet_NaN());
  p.q = {q.data(), c.queries * c.dk, c.dk};
  p.o = {o.data(), c.queries * c.dv, c.dv};
  p.states = 1;
  p.group = c.group;
  p.n_queries = c.queries;
  p.dk = c.dk;
  p.dv = c.dv;
  p.beta = beta;
  p.causal = c.causal;
  p.window = c.window;
  p.memory_keys = {km.data(), 0, c.dk};
  p.memory_values = {vm.data(), 0, c.dv};
  if (c.bias) p.bias = {bias.data(), 0, 1};
  p.local_keys = {kl.data(), 0, c.dk};
  p.local_values = {vl.data(), 0, c.dv};
  cuda::kernels::ReadPlan plan = cuda::kernels::plan_read(
      1, c.group, c.queries, std::max(c.dk, c.dv), c.memory + c.local, sizeof(S) == 8);
  if (decode != plan.decode) {
    // Force the other tiling: a decode plan for a read that would be a prefill and back.
    plan.decode = decode;
    const Index rows = decode ? cuda::kernels::kDecodeRows
                              : (cuda::kernels::padded_width(std::max(c.dk, c.dv)) > 128 ? 1 : 2) *
                                    (sizeof(S) == 4 ? 32 : 16);
    plan.tiles = static_cast<int>(
        cuda::kernels::QueryTiling::make(c.group, c.queries, rows).tiles());
    plan.splits = static_cast<int>((c.memory + c.local) / kernels::kBlockKeys + 2);
    plan.workspace_scalars = static_cast<std::size_t>(plan.tiles * plan.splits) *
                             cuda::kernels::kDecodeRows *
                             (cuda::kernels::padded_width(std::max(c.dk, c.dv)) + 2);
  }
  std::vector<S> workspace(plan.workspace_scalars);
  cuda::kernels::launch_read<Emulator>(p, plan, workspace.data(), nullptr);
  return o;
}

template <class S>
void check_read_case(const ReadCase& c, std::uint64_t seed) {
  const RowMatrix<S> q = random_matrix<S>(c.group * c.queries, c.dk, seed, 0.5);
  const RowMatrix<S> km = random_matrix<S>(c.memory, c.dk, seed + 1, 0.5);
  const RowMatrix<S> vm = random_matrix<S>(c.memory, c.dv, seed + 2);
  const RowMatrix<S> kl = random_matrix<S>(c.local, c.dk, seed + 3, 0.5);
  const RowMatrix<S> vl = random_matrix<S>(c.local, c.dv, seed + 4);
  std::vector<S> bias(static_cast<std::size_t>(c.memory));
  std::mt19937_64 gen(seed + 5);
  for (S& b : bias) b = (gen() % 7 == 0) ? -std::numeric_limits<S>::infinity() : S(gen() % 5);
  const S beta = S(0.7);
  const RowMatrix<S> prefill = emulated_read(c, q, km, vm, bias, kl, vl, beta, false);
  const RowMatrix<S> decode = emulated_read(c, q, km, vm, bias, kl, vl, beta, true);
  INFO("dk " << c.dk << " dv " << c.dv << " memory " << c.memory << " local " << c.local
             << " queries " << c.queries << " group " << c.group << " origin " << c.origin
             << " causal " << c.causal << " window " << c.window << " bias " << c.bias);
  CHECK(same_bits(prefill, decode));

  const kernels::ReadMask mask{c.causal, c.local - c.queries, c.window};
  std::vector<double> bias_d(bias.begin(), bias.end());
  if (!c.bias) bias_d.clear();
  RowMatrix<double> expected(c.group * c.queries, c.dv);
  const RowMatrix<double> qd = q.template cast<double>();
  for (Index h = 0; h < c.group; ++h) {
    const RowMatrix<double> qh = qd.middleRows(h * c.queries, c.queries);
    for (Index i = 0; i < c.queries; ++i)
      expected.row(h * c.queries + i) =
          read_row(qh, i, km.template cast<double>(), vm.template cast<double>(), bias_d,
                   kl.template cast<double>(), vl.template cast<double>(), mask, beta)
              .transpose();
  }
  CHECK(relative_error(prefill, expected) < tolerance<S>());
}

TEMPLATE_TEST_CASE("cuda read program (emulated): prefill tiles == decode tiles == the contract",
                   "[cuda][read]", float, double) {
  using S = TestType;
  std::uint64_t seed = 100;
  // Widths around every compile-time width, memory around the merge blocks, windows, bias,
  // grouped queries (more heads than a decode tile: split over head tiles), non-causal reads.
  const std::vector<ReadCase> cases = {
      {16, 16, 0, 9, 9, 1, 0, true, 0, false},        {5, 7, 70, 20, 3, 3, 0, true, 0, true},
      {24, 40, 1100, 30, 30, 1, 0, true, 0, false},   {33, 64, 300, 12, 1, 8, 5, true, 0, true},
      {64, 24, 1500, 5, 2, 10, 1000, true, 0, false}, {100, 130, 200, 70, 70, 2, 0, true, 0, true},
      {200, 256, 90, 17, 4, 1, 0, true, 0, false},    {32, 32, 2100, 3, 1, 4, 2047, true, 0, false},
      {16, 16, 400, 80, 80, 1, 123, true, 64, false}, {20, 20, 0, 40, 40, 2, 0, false, 0, false},
      {48, 16, 120, 33, 33, 1, 0, false, 0, true},    {16, 48, 700, 64, 16, 1, 3000, true, 300, true},
  };
  for (const ReadCase& c : cases) check_read_case<S>(c, seed += 10);
}

TEMPLATE_TEST_CASE("cuda exponential: ovq's own exp is accurate, exact at 0 and 0 far below",
                   "[cuda][exp]", float, double) {
  using S = TestType;
  const double bound = std::is_same_v<S, float> ? 4e-7 : 4e-16;
  const double lowest = std::is_same_v<S, float> ? -87.0 : -707.0;
  double worst = 0.0;
  for (int i = 0; i <= 20000; ++i) {
    const S x = static_cast<S>(lowest * i / 20000.0);
    const double exact = std::exp(static_cast<double>(x));
    const double got = ovq::detail::exp_nonpositive(x);
    worst = std::max(worst, std::abs(got - exact) / exact);
  }
  CHECK(worst < bound);
  CHECK(ovq::detail::exp_nonpositive(S(0)) == S(1));
  CHECK(ovq::detail::exp_nonpositive(-std::numeric_limits<S>::infinity()) == S(0));
  CHECK(ovq::detail::exp_nonpositive(std::numeric_limits<S>::quiet_NaN()) == S(0));
  CHECK(ovq::detail::exp_nonpositive(S(lowest * 1.1)) == S(0));
}

// ---------------------------------------------------------------------------------------------
// The device mixers against the CPU mixers
// ---------------------------------------------------------------------------------------------

// Host inputs of a multi-head stream, and the device copies of them.
template <class S>
struct Stream3 {
  Index heads, group, t, dk, dv;
  RowMatrix<S> q, k, v;
};

template <class S>
Stream3<S> make_stream(Index heads, Index group, Index t, Index dk, Index dv, std::uint64_t seed,
                       bool unit_keys = false) {
  Stream3<S> s{heads, group, t, dk, dv, random_matrix<S>(heads * group * t, dk, seed),
               random_matrix<S>(heads * t, dk, seed + 1), random_matrix<S>(heads * t, dv, seed + 2)};
  if (unit_keys) s.k.rowwise().normalize();
  return s;
}

// The device mixer over the stream in pieces; the outputs and the states' host copies.
template <class Mixer, class S>
struct DeviceRun {
  RowMatrix<S> o;
  std::vector<typename Mixer::State::HostState> states;
};

template <class Mixer, class S, class State>
DeviceRun<Mixer, S> run_device(const Mixer& mixer, State state, const Stream3<S>& in,
                               const std::vector<Index>& pieces,
                               cuda::EmulatedStream* stream = nullptr) {
  const Rows<S> q(in.q, in.heads * in.group, nullptr), k(in.k, in.heads, nullptr),
      v(in.v, in.heads, nullptr);
  const Rows<S> o(in.heads * in.group, in.t, in.dv, nullptr);
  ovq::test::feed_pieces(mixer, state, q, k, v, o, pieces, stream);
  return {o.download(nullptr), state.to_host(nullptr)};
}

template <class CpuMixer, class S>
RowMatrix<S> run_cpu(MultiHead<CpuMixer>& layer, const Stream3<S>& in) {
  return layer.forward(in.q, in.k, in.v);
}

const std::vector<std::vector<Index>> kCuts = {{}, {37, 1, 1, 1, 60}, {1, 1, 5, 16, 16, 3}};

TEMPLATE_TEST_CASE("cuda self-attention (emulated) == the CPU mixer, any cut of the stream",
                   "[cuda][mixers][self]", float, double) {
  using S = TestType;
  struct Case {
    bool causal;
    Index window, chunk, dk, dv;
  };
  for (const Case& c : {Case{true, 0, 64, 16, 20}, Case{true, 40, 32, 24, 24},
                        Case{true, 1, 16, 8, 8}, Case{false, 0, 64, 12, 36}}) {
    SelfAttentionOptions opt;
    opt.beta = 0.3;
    opt.causal = c.causal;
    opt.window = c.window;
    opt.chunk = c.chunk;
    const Stream3<S> in = make_stream<S>(2, 3, c.causal ? 150 : 40, c.dk, c.dv, 7);
    MultiHead<SelfAttention<S>> cpu(SelfAttention<S>(opt), 1, 6, 2, c.dk, c.dv);
    const RowMatrix<S> expected = run_cpu(cpu, in);
    const cuda::BasicSelfAttention<S, Emulator> mixer(opt);
    RowMatrix<S> first;
    for (const auto& cut : c.causal ? kCuts : std::vector<std::vector<Index>>{{}}) {
      const auto got = run_device(mixer, mixer.make_state(2, c.dk, c.dv), in, cut);
      INFO("window " << c.window << " causal " << c.causal << " pieces " << cut.size());
      CHECK(relative_error(got.o, expected) < tolerance<S>());
      for (Index h = 0; h < 2; ++h) CHECK(got.states[h] == cpu.state(0, h));
      if (first.size() == 0) first = got.o;
      CHECK(same_bits(got.o, first));
    }
  }
}

TEMPLATE_TEST_CASE("cuda OVQ-attention (emulated) == the CPU mixer: outputs, and the dictionary "
                   "bit for bit in float",
                   "[cuda][mixers][ovq]", float, double) {
  using S = TestType;
  struct Case {
    Growth growth;
    Seeding seeding;
    UpdateRate rate;
    bool renormalize;
    Index capacity, chunk;
    bool renormalize_values = false, count_bias = true;
    ValueUpdate value_update = ValueUpdate::mean;
  };
  for (const Case& c :
       {Case{Growth::dirichlet(), Seeding::spread(), UpdateRate::adaptive(), false, 48, 16},
        Case{Growth::dirichlet(5.0), Seeding::random(9), UpdateRate::adaptive(), true, 40, 8},
        Case{Growth::linear(0.5), Seeding::spread(), UpdateRate::constant(0.3), false, 30, 12},
        Case{Growth::linear(1.0), Seeding::spread(), UpdateRate::adaptive(), true, 200, 16},
        Case{Growth::dirichlet(), Seeding::spread(), UpdateRate::adaptive(), true, 48, 16, true,
             false},
        Case{Growth::saturating(), Seeding::random(3), UpdateRate::constant(0.3), false, 40, 8,
             true, true},
        Case{Growth::linear(0.5), Seeding::spread(), UpdateRate::adaptive(), false, 30, 12,
             false, false},
        // Lowest-similarity seeding: the kvm preset, and with linear growth (several rows a
        // chunk, an empty dictionary opening L rows at once) and a constant rate.
        Case{Growth::saturating(), Seeding::lowest_similarity(), UpdateRate::adaptive(), true, 48,
             16, true, true},
        Case{Growth::linear(1.0), Seeding::lowest_similarity(), UpdateRate::constant(0.3), false,
             60, 8, false, false},
        Case{Growth::dirichlet(2.0), Seeding::lowest_similarity(), UpdateRate::adaptive(), true,
             24, 12, false, true},
        // The delta rule: the kvm-delta preset (with and without the count bias), and with spread
        // seeding, a constant rate and chunks of 4 (a decode-sized prediction read).
        Case{Growth::saturating(), Seeding::lowest_similarity(), UpdateRate::adaptive(), true, 48,
             16, false, true, ValueUpdate::delta},
        Case{Growth::saturating(), Seeding::lowest_similarity(), UpdateRate::adaptive(), true, 40,
             8, false, false, ValueUpdate::delta},
        Case{Growth::dirichlet(), Seeding::spread(), UpdateRate::constant(0.3), false, 30, 4,
             false, true, ValueUpdate::delta}}) {
    OvqOptions opt;
    opt.beta = 2.0;
    opt.capacity = c.capacity;
    opt.chunk = c.chunk;
    opt.growth = c.growth;
    opt.seeding = c.seeding;
    opt.rate = c.rate;
    opt.renormalize = c.renormalize;
    opt.renormalize_values = c.renormalize_values;
    opt.count_bias = c.count_bias;
    opt.value_update = c.value_update;
    const bool delta = c.value_update == ValueUpdate::delta;
    const Index dk = 20, dv = 12;
    const Stream3<S> in = make_stream<S>(2, 2, 130, dk, dv, 11, true);
    // The CPU's portable scores are one FMA chain per score, as the GPU's: the same
    // assignments, so a float dictionary is the same bits (a double one differs only in the
    // width of the update's sums).
    MultiHead<OvqAttention<S, arch::scalar>> cpu(OvqAttention<S, arch::scalar>(opt), 1, 4, 2,
                                                  dk, dv);
    const RowMatrix<S> expected = run_cpu(cpu, in);
    const cuda::BasicOvqAttention<S, Emulator> mixer(opt);
    RowMatrix<S> first;
    for (const auto& cut : kCuts) {
      const auto got = run_device(mixer, mixer.make_state(2, dk, dv), in, cut);
      INFO("capacity " << c.capacity << " chunk " << c.chunk << " pieces " << cut.size());
      CHECK(relative_error(got.o, expected) < tolerance<S>());
      for (Index h = 0; h < 2; ++h) {
        const OvqState<S>& want = cpu.state(0, h);
        CHECK(got.states[h].dictionary().size() == want.dictionary().size());
        CHECK(got.states[h].absorbed() == want.absorbed());
        if (std::is_same_v<S, float> && !delta) {
          CHECK(got.states[h] == want);
        } else {
          // The delta rule's predictions are reads, equal only to rounding on the two sides; the
          // assignments, counts and key rows do not depend on them.
          const Dictionary<S>& d = got.states[h].dictionary();
          for (Index r = 0; r < d.size(); ++r) CHECK(d.count(r) == want.dictionary().count(r));
          CHECK(relative_error(as_eigen(d.keys()), as_eigen(want.dictionary().keys())) <
                (std::is_same_v<S, float> ? 1e-6 : 1e-12));
          CHECK(relative_error(as_eigen(d.values()), as_eigen(want.dictionary().values())) <
                tolerance<S>());
        }
      }
      if (first.size() == 0) first = got.o;
      CHECK(same_bits(got.o, first));
    }
  }
}

TEMPLATE_TEST_CASE("cuda VQ-attention (emulated) == the CPU mixer; the counts and means bit for "
                   "bit in float",
                   "[cuda][mixers][vq]", float, double) {
  using S = TestType;
  VqAttentionOptions opt;
  opt.beta = 0.5;
  opt.chunk = 16;
  const Index dk = 24, dv = 16;
  const RowMatrix<S> codebook = random_matrix<S>(40, dk, 21);
  const Stream3<S> in = make_stream<S>(2, 2, 120, dk, dv, 23);
  const VqAttention<S, arch::scalar> host(opt);
  MultiHead<VqAttention<S, arch::scalar>> cpu(
      host, 1, 4, std::vector<VqState<S>>(2, host.make_state(codebook, dv)));
  const RowMatrix<S> expected = run_cpu(cpu, in);
  const cuda::BasicVqAttention<S, Emulator> mixer(opt);
  RowMatrix<S> first;
  for (const auto& cut : kCuts) {
    const auto got = run_device(mixer, mixer.make_state(2, codebook, dv), in, cut);
    CHECK(relative_error(got.o, expected) < tolerance<S>());
    for (Index h = 0; h < 2; ++h) {
      if constexpr (std::is_same_v<S, float>) {
        CHECK(got.states[h] == cpu.state(0, h));
      } else {
        CHECK(got.states[h].absorbed() == cpu.state(0, h).absorbed());
      }
    }
    if (first.size() == 0) first = got.o;
    CHECK(same_bits(got.o, first));
  }
}

TEMPLATE_TEST_CASE("cuda linear attention (emulated) == the CPU mixer, any cut of the stream",
                   "[cuda][mixers][linear]", float, double) {
  using S = TestType;
  for (const auto map : {kernels::FeatureMap::identity, kernels::FeatureMap::elu1,
                         kernels::FeatureMap::relu}) {
    for (const bool normalize : {false, true}) {
      LinearAttentionOptions opt;
      opt.beta = 0.5;
      opt.chunk = 16;
      opt.feature_map = map;
      opt.normalize = normalize;
      opt.decay = 0.97;
      const Index dk = 20, dv = 18;
      // Positive features keep a normalised read well conditioned (the identity map's
      // normaliser can cross 0).
      const Stream3<S> in = make_stream<S>(2, 2, 120, dk, dv, 31);
      MultiHead<LinearAttention<S>> cpu(LinearAttention<S>(opt), 1, 4, 2, dk, dv);
      const RowMatrix<S> expected = run_cpu(cpu, in);
      const cuda::BasicLinearAttention<S, Emulator> mixer(opt);
      RowMatrix<S> first;
      for (const auto& cut : kCuts) {
        const auto got = run_device(mixer, mixer.make_state(2, dk, dv), in, cut);
        INFO("map " << int(map) << " normalize " << normalize);
        const double tol =
            normalize && map == kernels::FeatureMap::identity ? 1e3 * tolerance<S>() : tolerance<S>();
        CHECK(relative_error(got.o, expected) < tol);
        for (Index h = 0; h < 2; ++h) {
          CHECK(got.states[h].absorbed() == cpu.state(0, h).absorbed());
          CHECK(relative_error(got.states[h].kv(), cpu.state(0, h).kv()) < tolerance<S>());
        }
        if (first.size() == 0) first = got.o;
        CHECK(same_bits(got.o, first));
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Host states, graph capture, the growth schedule
// ---------------------------------------------------------------------------------------------

TEST_CASE("cuda states (emulated): from_host, continue, to_host == the CPU continuing",
          "[cuda][state]") {
  using S = float;
  OvqOptions opt;
  opt.capacity = 32;
  opt.chunk = 8;
  opt.beta = 1.5;
  const Index dk = 16, dv = 8;
  const Stream3<S> first = make_stream<S>(2, 1, 45, dk, dv, 41, true);
  const Stream3<S> second = make_stream<S>(2, 1, 60, dk, dv, 51, true);
  MultiHead<OvqAttention<S, arch::scalar>> cpu(OvqAttention<S, arch::scalar>(opt), 1, 2, 2, dk,
                                                dv);
  cpu.forward(first.q, first.k, first.v);  // 45 tokens: 5 chunks and 5 pending rows
  const cuda::BasicOvqAttention<S, Emulator> mixer(opt);
  auto state = mixer.make_state(2, dk, dv);
  state.from_host(cpu.states(), nullptr);
  CHECK(state.absorbed() == 40);
  CHECK(state.pending() == 5);
  const RowMatrix<S> expected = cpu.forward(second.q, second.k, second.v);
  const auto got = run_device(mixer, std::move(state), second, {7, 1, 30});
  CHECK(relative_error(got.o, expected) < tolerance<S>());
  CHECK(got.states[0] == cpu.state(0, 0));
  CHECK(got.states[1] == cpu.state(0, 1));
}

TEMPLATE_TEST_CASE("cuda steps under graph capture (emulated): device-side decisions give the "
                   "host-planned results, and the host's counters refresh",
                   "[cuda][capture]", float, double) {
  using S = TestType;
  const Index dk = 16, dv = 16, t = 40;
  cuda::EmulatedStream capture{true};
  {
    OvqOptions opt;
    opt.capacity = 24;
    opt.chunk = 8;
    const Stream3<S> in = make_stream<S>(2, 2, t, dk, dv, 61, true);
    const cuda::BasicOvqAttention<S, Emulator> mixer(opt);
    const auto planned = run_device(mixer, mixer.make_state(2, dk, dv), in, std::vector<Index>(t, 1));
    auto state = mixer.make_state(2, dk, dv);
    mixer.reserve(state, 4);
    const auto captured = run_device(mixer, std::move(state), in, std::vector<Index>(t, 1), &capture);
    CHECK(same_bits(planned.o, captured.o));
    CHECK(planned.states[1] == captured.states[1]);
  }
  {
    SelfAttentionOptions opt;
    const Stream3<S> in = make_stream<S>(2, 4, t, dk, dv, 71);
    const cuda::BasicSelfAttention<S, Emulator> mixer(opt);
    auto state = mixer.make_state(2, dk, dv);
    mixer.reserve(state, 8, t);
    const auto planned = run_device(mixer, mixer.make_state(2, dk, dv), in, std::vector<Index>(t, 1));
    const auto captured = run_device(mixer, std::move(state), in, std::vector<Index>(t, 1), &capture);
    CHECK(same_bits(planned.o, captured.o));
    CHECK(planned.states[0] == captured.states[0]);
  }
  {
    LinearAttentionOptions opt;
    opt.chunk = 8;
    const Stream3<S> in = make_stream<S>(2, 1, t, dk, dv, 81);
    const cuda::BasicLinearAttention<S, Emulator> mixer(opt);
    const auto planned = run_device(mixer, mixer.make_state(2, dk, dv), in, std::vector<Index>(t, 1));
    const auto captured =
        run_device(mixer, mixer.make_state(2, dk, dv), in, std::vector<Index>(t, 1), &capture);
    CHECK(same_bits(planned.o, captured.o));
    CHECK(planned.states[0] == captured.states[0]);
  }
  {
    VqAttentionOptions opt;
    opt.chunk = 8;
    const RowMatrix<S> codebook = random_matrix<S>(12, dk, 91);
    const Stream3<S> in = make_stream<S>(2, 1, t, dk, dv, 93);
    const cuda::BasicVqAttention<S, Emulator> mixer(opt);
    const auto planned =
        run_device(mixer, mixer.make_state(2, codebook, dv), in, std::vector<Index>(t, 1));
    auto state = mixer.make_state(2, codebook, dv);
    mixer.reserve(state, 2);
    const auto captured = run_device(mixer, std::move(state), in, std::vector<Index>(t, 1), &capture);
    CHECK(same_bits(planned.o, captured.o));
    CHECK(planned.states[0] == captured.states[0]);
  }
}

TEST_CASE("cuda growth schedule == the CPU's chunk-by-chunk growth, from any (t, n)",
          "[cuda][schedule]") {
  struct Case {
    Growth growth;
    Index capacity, chunk;
    std::int64_t t;
    Index n;
  };
  for (const Case& c : {Case{Growth::dirichlet(), 64, 8, 0, 0}, Case{Growth::dirichlet(), 300, 16, 0, 0},
                        Case{Growth::dirichlet(3.0), 50, 4, 40, 20},
                        Case{Growth::dirichlet(500.0), 40, 32, 0, 0}, Case{Growth::linear(1.0), 100, 8, 0, 0},
                        Case{Growth::linear(0.01), 20, 8, 80, 1}, Case{Growth::dirichlet(), 64, 64, 640, 3},
                        Case{Growth::saturating(), 100, 8, 0, 0}, Case{Growth::saturating(), 1, 1, 0, 0}}) {
    // The schedule to its end (some growths fill up only after astronomically many chunks)
    // against the CPU's growth over its first 10^5 chunks.
    constexpr std::int64_t kChunks = 100000;
    std::vector<std::int64_t> entries =
        cuda::growth_schedule(c.growth, c.capacity, c.chunk, c.t, c.n);
    std::size_t within = 0;
    while (within < entries.size() && entries[within] < kChunks) within += 2;
    entries.resize(within);
    std::vector<std::int64_t> expected;
    Index n = c.n;
    for (std::int64_t chunk = c.t / c.chunk; n < c.capacity && chunk < kChunks; ++chunk) {
      const Index m = kernels::centroids_to_open(c.growth, chunk * c.chunk, c.chunk, n, c.capacity);
      if (m > 0) {
        expected.push_back(chunk);
        expected.push_back(m);
      }
      n += m;
    }
    INFO("capacity " << c.capacity << " chunk " << c.chunk << " t " << c.t << " n " << c.n);
    CHECK(entries == expected);
  }
}

// ---------------------------------------------------------------------------------------------
// Errors
// ---------------------------------------------------------------------------------------------

TEST_CASE("cuda mixers (emulated): bad shapes throw the CPU's ArgumentError before anything "
          "runs; bad values fault on the device and change nothing",
          "[cuda][errors]") {
  using S = float;
  using ovq::test::MessageHas;
  const Index dk = 8, dv = 8, t = 20;
  const cuda::BasicOvqAttention<S, Emulator> mixer(OvqOptions{});
  auto state = mixer.make_state(2, dk, dv);
  const Stream3<S> in = make_stream<S>(2, 2, t, dk, dv, 101, true);
  const Rows<S> q(in.q, 4, nullptr), k(in.k, 2, nullptr), v(in.v, 2, nullptr),
      o(4, t, dv, nullptr);
  auto wrong_k = k.view();
  wrong_k.cols = 7;
  CHECK_THROWS_MATCHES(mixer.forward(state, q.view(), wrong_k, v.view(), o.view()),
                       ArgumentError, MessageHas({"forward", "K", "7 columns", "expected 8"}));
  auto three_heads = q.view();
  three_heads.heads = 3;
  CHECK_THROWS_MATCHES(mixer.forward(state, three_heads, k.view(), v.view(), o.view()),
                       ArgumentError, MessageHas({"Q has 3 heads", "multiple of the 2"}));
  CHECK_THROWS_MATCHES(mixer.step(state, q.view(), k.view(), v.view(), o.view()), ArgumentError,
                       MessageHas({"step", "K has 20 rows", "expected 1"}));
  OvqOptions long_chunk;
  long_chunk.chunk = 5000;
  using Ovq = cuda::BasicOvqAttention<S, Emulator>;
  CHECK_THROWS_MATCHES(Ovq(long_chunk), ArgumentError,
                       MessageHas({"chunk = 5000", "at most 4096"}));
  CHECK_NOTHROW(Ovq(OvqOptions::kvm()));
  CHECK_NOTHROW(Ovq(OvqOptions::kvm_delta()));
  CHECK_THROWS_MATCHES(mixer.make_state(2, 300, 8), ArgumentError, MessageHas({"dk = 300"}));

  // A NaN in V: the call runs, changes nothing, and the next synchronize reports it.
  mixer.forward(state, q.view().middle_rows(0, 10), k.view().middle_rows(0, 10),
                v.view().middle_rows(0, 10), o.view().middle_rows(0, 10));
  const auto before = state.to_host(nullptr);
  RowMatrix<S> bad_v = in.v;
  bad_v(t + 13, 2) = std::numeric_limits<S>::quiet_NaN();  // head 1, token 13
  const Rows<S> v_bad(bad_v, 2, nullptr);
  mixer.forward(state, q.view().middle_rows(10, 10), k.view().middle_rows(10, 10),
                v_bad.view().middle_rows(10, 10), o.view().middle_rows(10, 10));
  CHECK_THROWS_MATCHES(state.synchronize(nullptr), ArgumentError,
                       MessageHas({"not finite", "left the state as it was"}));
  const auto after = state.to_host(nullptr);
  CHECK(after[0] == before[0]);
  CHECK(after[1] == before[1]);
  // The fault is cleared: the state goes on.
  mixer.forward(state, q.view().middle_rows(10, 10), k.view().middle_rows(10, 10),
                v.view().middle_rows(10, 10), o.view().middle_rows(10, 10));
  CHECK(state.to_host(nullptr)[0].tokens() == 20);
}

TEST_CASE("cuda KV cache (emulated): a captured step past the reserved capacity faults and "
          "changes nothing; reserve() makes room",
          "[cuda][errors][capture]") {
  using S = float;
  using ovq::test::MessageHas;
  const Index dk = 8, dv = 8, t = 24;
  const cuda::BasicSelfAttention<S, Emulator> mixer(SelfAttentionOptions{});
  const Stream3<S> in = make_stream<S>(1, 1, t, dk, dv, 111);
  const Rows<S> q(in.q, 1, nullptr), k(in.k, 1, nullptr), v(in.v, 1, nullptr), o(1, t, dv, nullptr);
  auto state = mixer.make_state(1, dk, dv);
  mixer.reserve(state, 1, 16);
  CHECK(state.capacity() == 16);
  cuda::EmulatedStream capture{true};
  for (Index i = 0; i < t; ++i) {
    if (i == 16) {
      // Past the capacity, a capture cannot grow the cache: the host refuses.
      CHECK_THROWS_MATCHES(mixer.step(state, q.view().middle_rows(i, 1), k.view().middle_rows(i, 1),
                                      v.view().middle_rows(i, 1), o.view().middle_rows(i, 1),
                                      &capture),
                           ArgumentError, MessageHas({"reserve the state before capturing"}));
      mixer.reserve(state, 1, t);
    }
    mixer.step(state, q.view().middle_rows(i, 1), k.view().middle_rows(i, 1),
               v.view().middle_rows(i, 1), o.view().middle_rows(i, 1), &capture);
  }
  CHECK(state.stale());
  const auto host = state.to_host(nullptr);
  CHECK_FALSE(state.stale());
  CHECK(host[0].size() == t);
  MultiHead<SelfAttention<S>> cpu(SelfAttention<S>(SelfAttentionOptions{}), 1, 1, 1, dk, dv);
  cpu.forward(in.q, in.k, in.v);
  CHECK(host[0] == cpu.state(0, 0));
}

}  // namespace

}  // namespace ovq_test_cuda_emulated
