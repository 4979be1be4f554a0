// The CUDA path on the host: every device kernel (block program) and every device mixer run in
// the emulator (ovq/cuda/emulator.hpp), which computes what a GPU computes, against the double
// references, the CPU mixers, and themselves (prefill tiles == decode tiles, stream cuts,
// graph-capture launches), and the 16-bit path (the kernels' conversions against Eigen's, the
// tensor-core tile product against the PTX fragment layout, the tensor-core read, the 16-bit
// device self-attention against the CPU's). On a machine with a GPU, tests/cuda compares the GPU
// with the same emulation.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <utility>
#include <vector>

#include "ovq/cuda/elements.hpp"
#include "ovq/cuda/emulator.hpp"
#include "ovq/cuda/kernels/half.hpp"
#include "ovq/cuda/kernels/launch.hpp"
#include "ovq/cuda/kernels/mma.hpp"
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

// OVQ_EMULATION_ORDER=reverse runs the emulation's blocks and threads last to first, so that a
// kernel whose bits depend on that order (a phase reading what another thread writes in it)
// fails the same checks (tests/CMakeLists.txt runs the [cuda] cases so a second time). Any
// other value than forward or reverse stops the binary, so a misspelt one cannot make that second
// run repeat the first.
[[maybe_unused]] const bool kOrderFromEnvironment = [] {
  const char* order = std::getenv("OVQ_EMULATION_ORDER");
  if (order == nullptr || std::strcmp(order, "forward") == 0) return true;
  if (std::strcmp(order, "reverse") == 0) {
    cuda::set_emulation_order(cuda::EmulationOrder::reverse);
    return true;
  }
  std::fprintf(stderr, "OVQ_EMULATION_ORDER = '%s', expected forward or reverse\n", order);
  std::exit(2);
}();

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

// How emulated_read launches: prefill tiles folding every merge block themselves, prefill
// tiles split over merge blocks, decode tiles (always split).
enum class ReadLaunch { prefill_loop, prefill_split, decode };

// One state's read through ReadProgram, or TensorReadProgram for a 16-bit element, on the
// emulator, launched as `how` says.
template <class S>
RowMatrix<S> emulated_read(const ReadCase& c, const RowMatrix<S>& q, const RowMatrix<S>& km,
                           const RowMatrix<S>& vm, const std::vector<compute_t<S>>& bias,
                           const RowMatrix<S>& kl, const RowMatrix<S>& vl, compute_t<S> beta,
                           ReadLaunch how) {
  using C = compute_t<S>;
  using Stored = cuda::device_element_t<S>;
  const auto rows = [](const RowMatrix<S>& m) { return reinterpret_cast<const Stored*>(m.data()); };
  cuda::kernels::ReadParams<C, Stored> p;
  p.source = cuda::kernels::ReadSource::fixed;
  p.fixed_extent.origin = c.origin;
  p.fixed_extent.memory_rows = c.memory;
  p.fixed_extent.local_rows = c.local;
  p.fixed_extent.query_offset = c.local - c.queries;
  RowMatrix<S> o(c.group * c.queries, c.dv);
  o.setConstant(std::numeric_limits<S>::quiet_NaN());
  p.q = {rows(q), c.queries * c.dk, c.dk};
  p.o = {reinterpret_cast<Stored*>(o.data()), c.queries * c.dv, c.dv};
  p.states = 1;
  p.group = c.group;
  p.n_queries = c.queries;
  p.dk = c.dk;
  p.dv = c.dv;
  p.beta = beta;
  p.causal = c.causal;
  p.window = c.window;
  p.memory_keys = {rows(km), 0, c.dk};
  p.memory_values = {rows(vm), 0, c.dv};
  if (c.bias) p.bias = {bias.data(), 0, 1};
  p.local_keys = {rows(kl), 0, c.dk};
  p.local_values = {rows(vl), 0, c.dv};
  if constexpr (is_half_v<S>) {
    p.aligned_rows = cuda::detail::aligned_rows(p.q, c.dk) &&
                     cuda::detail::aligned_rows(p.memory_keys, c.dk) &&
                     cuda::detail::aligned_rows(p.memory_values, c.dv) &&
                     cuda::detail::aligned_rows(p.local_keys, c.dk) &&
                     cuda::detail::aligned_rows(p.local_values, c.dv);
  }
  const Index width = std::max(c.dk, c.dv);
  // The tiling and split asked for, whatever plan_read would choose.
  cuda::kernels::ReadPlan plan;
  plan.decode = how == ReadLaunch::decode;
  const Index tile_rows = plan.decode ? cuda::kernels::kDecodeRows<Stored>
                                      : cuda::kernels::prefill_rows<Stored>(width);
  plan.tiles =
      static_cast<int>(cuda::kernels::QueryTiling::make(c.group, c.queries, tile_rows).tiles());
  if (how != ReadLaunch::prefill_loop) {
    plan.splits = static_cast<int>((c.memory + c.local) / kernels::kBlockKeys + 2);
    plan.workspace_scalars = static_cast<std::size_t>(plan.tiles * plan.splits) *
                             static_cast<std::size_t>(tile_rows) *
                             static_cast<std::size_t>(cuda::kernels::padded_width(width) + 2);
  }
  std::vector<C> workspace(plan.workspace_scalars);
  cuda::kernels::launch_read<Emulator>(p, plan, workspace.data(), nullptr);
  return o;
}

// Random rows of element S (a 16-bit element: float rows rounded).
template <class S>
RowMatrix<S> random_rows(Index rows, Index cols, std::uint64_t seed, double scale = 1.0) {
  if constexpr (is_half_v<S>) {
    return random_matrix<float>(rows, cols, seed, scale).unaryExpr([](float x) {
      return narrow<S>(x);
    });
  } else {
    return random_matrix<S>(rows, cols, seed, scale);
  }
}
template <class S>
RowMatrix<double> as_double(const RowMatrix<S>& m) {
  return m.unaryExpr([](S x) { return static_cast<double>(widen(x)); });
}

// Normalised error a read may have against the contract in double on its own inputs: float
// and double rounding, or (16-bit) the weights and the outputs rounded to 16 bits.
template <class S>
double read_tolerance() {
  if constexpr (std::is_same_v<S, bf16>) {
    return 1e-2;
  } else if constexpr (std::is_same_v<S, fp16>) {
    return 2e-3;
  } else {
    return tolerance<S>();
  }
}

template <class S>
void check_read_case(const ReadCase& c, std::uint64_t seed) {
  using C = compute_t<S>;
  const RowMatrix<S> q = random_rows<S>(c.group * c.queries, c.dk, seed, 0.5);
  const RowMatrix<S> km = random_rows<S>(c.memory, c.dk, seed + 1, 0.5);
  const RowMatrix<S> vm = random_rows<S>(c.memory, c.dv, seed + 2);
  const RowMatrix<S> kl = random_rows<S>(c.local, c.dk, seed + 3, 0.5);
  const RowMatrix<S> vl = random_rows<S>(c.local, c.dv, seed + 4);
  std::vector<C> bias(static_cast<std::size_t>(c.memory));
  std::mt19937_64 gen(seed + 5);
  for (C& b : bias) b = (gen() % 7 == 0) ? -std::numeric_limits<C>::infinity() : C(gen() % 5);
  const C beta = C(0.7);
  const RowMatrix<S> prefill =
      emulated_read(c, q, km, vm, bias, kl, vl, beta, ReadLaunch::prefill_loop);
  const RowMatrix<S> split =
      emulated_read(c, q, km, vm, bias, kl, vl, beta, ReadLaunch::prefill_split);
  const RowMatrix<S> decode = emulated_read(c, q, km, vm, bias, kl, vl, beta, ReadLaunch::decode);
  INFO("dk " << c.dk << " dv " << c.dv << " memory " << c.memory << " local " << c.local
             << " queries " << c.queries << " group " << c.group << " origin " << c.origin
             << " causal " << c.causal << " window " << c.window << " bias " << c.bias);
  CHECK(same_bits(prefill, split));
  CHECK(same_bits(prefill, decode));

  const kernels::ReadMask mask{c.causal, c.local - c.queries, c.window};
  std::vector<double> bias_d(bias.begin(), bias.end());
  if (!c.bias) bias_d.clear();
  RowMatrix<double> expected(c.group * c.queries, c.dv);
  const RowMatrix<double> qd = as_double(q);
  for (Index h = 0; h < c.group; ++h) {
    const RowMatrix<double> qh = qd.middleRows(h * c.queries, c.queries);
    for (Index i = 0; i < c.queries; ++i)
      expected.row(h * c.queries + i) =
          read_row(qh, i, as_double(km), as_double(vm), bias_d, as_double(kl), as_double(vl),
                   mask, beta)
              .transpose();
  }
  const double error = relative_error(as_double(prefill), expected);
  CHECK(error < read_tolerance<S>());
}

TEMPLATE_TEST_CASE("cuda read program (emulated): prefill tiles, folding their merge blocks or "
                   "split over them, == decode tiles == the contract",
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

TEMPLATE_TEST_CASE("cuda tensor-core read (emulated): 16-bit rows, prefill tiles (folding or "
                   "split) == decode tiles == the contract within 16-bit rounding",
                   "[cuda][read][half]", bf16, fp16) {
  using S = TestType;
  std::uint64_t seed = 400;
  // As the float cases: every compile-time width, merge blocks, windows, bias, grouped queries
  // (more heads than a decode tile of 16 rows), non-causal reads; no prefill tile is full.
  const std::vector<ReadCase> cases = {
      {16, 16, 0, 9, 9, 1, 0, true, 0, false},       {5, 7, 70, 20, 3, 3, 0, true, 0, true},
      {24, 40, 1100, 30, 30, 1, 0, true, 0, false},  {33, 64, 300, 12, 1, 20, 5, true, 0, true},
      {64, 24, 1500, 5, 2, 10, 1000, true, 0, false}, {100, 130, 200, 70, 70, 2, 0, true, 0, true},
      {200, 256, 90, 17, 4, 1, 0, true, 0, false},   {32, 32, 2100, 3, 1, 4, 2047, true, 0, false},
      {16, 16, 400, 80, 80, 1, 123, true, 64, false}, {20, 20, 0, 40, 40, 2, 0, false, 0, false},
      {128, 128, 150, 33, 33, 1, 0, false, 0, true}, {16, 48, 700, 64, 16, 1, 3000, true, 300, true},
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
  if constexpr (is_half_v<S>) {
    // The float stream rounded (unit keys: normalised, then rounded).
    const Stream3<float> f = make_stream<float>(heads, group, t, dk, dv, seed, unit_keys);
    const auto round = [](const RowMatrix<float>& m) -> RowMatrix<S> {
      return m.unaryExpr([](float x) { return narrow<S>(x); });
    };
    return {heads, group, t, dk, dv, round(f.q), round(f.k), round(f.v)};
  }
  Stream3<S> s{heads, group, t, dk, dv, random_rows<S>(heads * group * t, dk, seed),
               random_rows<S>(heads * t, dk, seed + 1), random_rows<S>(heads * t, dv, seed + 2)};
  if constexpr (!is_half_v<S>) {
    if (unit_keys) s.k.rowwise().normalize();
  }
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

// The write's two ways to read the chunk's keys: staged in shared memory (when they fit) and
// from the chunk itself, over one chunk that opens rows, for every seeding and both rates.
TEST_CASE("cuda dictionary write (emulated): keys staged in shared memory == keys read from the "
          "chunk, bit for bit",
          "[cuda][ovq]") {
  using S = float;
  namespace k = cuda::kernels;
  const Index states = 2, L = 24, dk = 20, dv = 12, capacity = 64, n0 = 10, m = 6;
  const std::int64_t chunk_index = 5;
  for (int seeding = 0; seeding < 3; ++seeding)
    for (const bool adaptive : {true, false}) {
      INFO("seeding " << seeding << ", adaptive " << adaptive);
      const RowMatrix<S> keys = random_matrix<S>(states * L, dk, 1 + seeding);
      const RowMatrix<S> values = random_matrix<S>(states * L, dv, 2 + seeding);
      RowMatrix<S> dict_k0 = RowMatrix<S>::Zero(states * capacity, dk);
      RowMatrix<S> dict_v0 = RowMatrix<S>::Zero(states * capacity, dv);
      std::vector<std::int64_t> counts0(static_cast<std::size_t>(states * capacity), 0);
      std::vector<S> logc0(counts0.size(), -std::numeric_limits<S>::infinity());
      std::vector<S> nearest0(static_cast<std::size_t>(states * L));
      std::vector<Index> assigned0(nearest0.size());
      std::mt19937_64 gen(7 + static_cast<std::uint64_t>(seeding));
      for (Index h = 0; h < states; ++h) {
        dict_k0.middleRows(h * capacity, n0) = random_matrix<S>(n0, dk, 30 + h);
        dict_v0.middleRows(h * capacity, n0) = random_matrix<S>(n0, dv, 40 + h);
        for (Index r = 0; r < n0; ++r) {
          const auto at = static_cast<std::size_t>(h * capacity + r);
          counts0[at] = 1 + static_cast<std::int64_t>(gen() % 9);
          logc0[at] = static_cast<S>(std::log(static_cast<double>(counts0[at])));
        }
      }
      for (std::size_t i = 0; i < nearest0.size(); ++i) {
        nearest0[i] = static_cast<S>(static_cast<double>(gen() % 1000) / 1000.0);
        assigned0[i] = static_cast<Index>(gen() % static_cast<std::uint64_t>(n0));
      }
      const std::vector<std::int64_t> schedule = {chunk_index, m};
      struct Result {
        RowMatrix<S> dict_k, dict_v;
        std::vector<std::int64_t> counts;
        std::vector<S> logc;
        std::vector<Index> assigned, order;
      };
      auto write = [&](std::size_t staged_keys_max) {
        Result out{dict_k0, dict_v0, counts0, logc0, assigned0, {}};
        std::vector<S> nearest = nearest0;
        std::vector<unsigned char> picked(nearest.size());
        std::vector<Index> group_end(nearest.size()), draws(nearest.size());
        out.order.resize(nearest.size());
        std::int64_t opened[2] = {0, 0};
        cuda::StateCounters c;
        c.absorbed = chunk_index * L;
        c.tokens = c.absorbed + L;
        c.size = n0;
        c.pending = L;
        k::DictionaryWriteParams<S> p;
        p.keys = {keys.data(), L * dk, dk};
        p.values = {values.data(), L * dv, dv};
        p.chunk = L;
        p.dk = dk;
        p.dv = dv;
        p.dict_keys = {out.dict_k.data(), capacity * dk, dk};
        p.dict_values = {out.dict_v.data(), capacity * dv, dv};
        p.counts = out.counts.data();
        p.log_counts = out.logc.data();
        p.capacity = capacity;
        p.counters = &c;
        p.schedule = schedule.data();
        p.schedule_entries = 1;
        p.spread = seeding == 0;
        p.lowest_similarity = seeding == 2;
        p.seed = 11;
        p.adaptive = adaptive;
        p.eta = 0.3;
        p.nearest = nearest.data();
        p.assigned = out.assigned.data();
        p.picked = picked.data();
        p.order = out.order.data();
        p.group_end = group_end.data();
        p.draws = draws.data();
        p.opened = opened;
        p.staged_keys_max = staged_keys_max;
        REQUIRE(k::DictionaryWriteProgram<S>::stages_keys(p) == (staged_keys_max > 0));
        cuda::emulate<k::DictionaryWriteProgram<S>>(cuda::Grid{1, static_cast<int>(states), 1}, p);
        CHECK(opened[0] == m);
        return out;
      };
      const Result staged = write(std::size_t(1) << 20), direct = write(0);
      CHECK(same_bits(staged.dict_k, direct.dict_k));
      CHECK(same_bits(staged.dict_v, direct.dict_v));
      CHECK(staged.counts == direct.counts);
      CHECK(std::memcmp(staged.logc.data(), direct.logc.data(),
                        sizeof(S) * staged.logc.size()) == 0);
      CHECK(staged.assigned == direct.assigned);
      CHECK(staged.order == direct.order);
      // The write did something: m rows opened in each state, every chunk row counted.
      for (Index h = 0; h < states; ++h) {
        std::int64_t total = 0, total0 = 0;
        for (Index r = 0; r < capacity; ++r) {
          total += staged.counts[static_cast<std::size_t>(h * capacity + r)];
          total0 += counts0[static_cast<std::size_t>(h * capacity + r)];
        }
        CHECK(total == total0 + L);
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
                       MessageHas({"chunk = 5000", "expected 1 ... 4096"}));
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

// Views of a (B, T, H, d) tensor (a projection's output, not transposed): the heads of a token
// side by side, so the head stride is smaller than the row stride.
TEST_CASE("cuda mixers (emulated): views with the heads of a token side by side give the "
          "contiguous views' bits; an output whose entries overlap is refused",
          "[cuda][errors]") {
  using S = float;
  using ovq::test::MessageHas;
  const Index heads = 2, group = 2, hq = heads * group, t = 30, dk = 8, dv = 12;
  const Stream3<S> in = make_stream<S>(heads, group, t, dk, dv, 131);
  const cuda::BasicSelfAttention<S, Emulator> mixer(SelfAttentionOptions{});
  const auto contiguous = run_device(mixer, mixer.make_state(heads, dk, dv), in, {});
  // (h t) x d, head after head <-> t x (h d), token after token.
  const auto interleave = [t](const RowMatrix<S>& m, Index h) {
    RowMatrix<S> out(t, h * m.cols());
    for (Index i = 0; i < h; ++i)
      for (Index r = 0; r < t; ++r) out.block(r, i * m.cols(), 1, m.cols()) = m.row(i * t + r);
    return out;
  };
  const auto deinterleave = [&](const RowMatrix<S>& m, Index h) {
    const Index d = m.cols() / h;
    RowMatrix<S> out(h * t, d);
    for (Index i = 0; i < h; ++i)
      for (Index r = 0; r < t; ++r) out.row(i * t + r) = m.block(r, i * d, 1, d);
    return out;
  };
  // The emulation's device memory is host memory: views of the host matrices.
  const auto token_major = [&](RowMatrix<S>& m, Index h) {
    const Index d = m.cols() / h;
    return cuda::HeadsView<S>{m.data(), h, t, d, d, h * d};
  };
  RowMatrix<S> q = interleave(in.q, hq), k = interleave(in.k, heads), v = interleave(in.v, heads);
  RowMatrix<S> o(t, hq * dv);
  o.setConstant(std::numeric_limits<S>::quiet_NaN());
  auto state = mixer.make_state(heads, dk, dv);
  mixer.forward(state, token_major(q, hq), token_major(k, heads), token_major(v, heads),
                token_major(o, hq));
  CHECK(same_bits(deinterleave(o, hq), contiguous.o));

  // Heads one column closer than a row's width, or rows closer than the heads' span.
  auto heads_overlap = token_major(o, hq);
  heads_overlap.head_stride = dv - 1;
  CHECK_THROWS_MATCHES(mixer.forward(state, token_major(q, hq), token_major(k, heads),
                                     token_major(v, heads), heads_overlap),
                       ArgumentError,
                       MessageHas({"O has head stride 11", "expected >= its 12 columns"}));
  auto rows_overlap = token_major(o, hq);
  rows_overlap.row_stride = (hq - 1) * dv;
  CHECK_THROWS_MATCHES(mixer.forward(state, token_major(q, hq), token_major(k, heads),
                                     token_major(v, heads), rows_overlap),
                       ArgumentError,
                       MessageHas({"O has row stride 36", "expected >= 48", "its 4 heads"}));
  CHECK(state.to_host(nullptr)[0].tokens() == t);
}

// A bad value faults the state before the call's reads, which then read nothing: the counters
// leave out the rows the call would have added, so an extent taken from them would start before
// the chunk (the AddressSanitizer build sees any such read). Every mixer, over calls longer than
// the rows its state holds: each faults, and leaves the state as it was.
TEMPLATE_TEST_CASE("cuda mixers (emulated): a call with a bad value reads nothing and changes "
                   "nothing, whatever its length",
                   "[cuda][errors]", float, bf16) {
  using S = TestType;
  const Index heads = 2, group = 2, dk = 16, dv = 8, t = 40;
  const Stream3<S> in = make_stream<S>(heads, group, t, dk, dv, 141, true);
  RowMatrix<S> bad_v = in.v;
  bad_v(t + 10, 1) = std::numeric_limits<S>::quiet_NaN();  // head 1, token 10
  const auto check = [&](const auto& mixer, auto state) {
    const Rows<S> q(in.q, heads * group, nullptr), k(in.k, heads, nullptr),
        v(in.v, heads, nullptr), v_bad(bad_v, heads, nullptr), o(heads * group, t, dv, nullptr);
    mixer.forward(state, q.view().middle_rows(0, 5), k.view().middle_rows(0, 5),
                  v.view().middle_rows(0, 5), o.view().middle_rows(0, 5));
    const auto before = state.to_host(nullptr);
    for (const Index n : {Index(1), Index(20), Index(35)}) {
      const auto call = [&](const auto& vv) {
        if (n == 1) {
          mixer.step(state, q.view().middle_rows(10, 1), k.view().middle_rows(10, 1),
                     vv.view().middle_rows(10, 1), o.view().middle_rows(10, 1));
        } else {
          mixer.forward(state, q.view().middle_rows(5, n), k.view().middle_rows(5, n),
                        vv.view().middle_rows(5, n), o.view().middle_rows(5, n));
        }
      };
      call(v_bad);
      CHECK_THROWS_AS(state.synchronize(nullptr), ArgumentError);
      CHECK(state.to_host(nullptr) == before);
    }
  };
  LinearAttentionOptions linear;
  linear.chunk = 16;
  linear.decay = 0.9;
  const cuda::BasicLinearAttention<S, Emulator> linear_mixer(linear);
  check(linear_mixer, linear_mixer.make_state(heads, dk, dv));
  OvqOptions ovq;
  ovq.chunk = 16;
  ovq.capacity = 24;
  const cuda::BasicOvqAttention<S, Emulator> ovq_mixer(ovq);
  check(ovq_mixer, ovq_mixer.make_state(heads, dk, dv));
  VqAttentionOptions vq;
  vq.chunk = 16;
  const cuda::BasicVqAttention<S, Emulator> vq_mixer(vq);
  check(vq_mixer, vq_mixer.make_state(heads, random_rows<S>(12, dk, 143), dv));
  const cuda::BasicSelfAttention<S, Emulator> self_mixer(SelfAttentionOptions{});
  check(self_mixer, self_mixer.make_state(heads, dk, dv));
}

// A small call (a decode step's few rows) checks, copies and counts in one launch
// (CheckCopyProgram), a larger one in three: the same outputs and states, and a bad value
// anywhere in a small call faults and changes nothing.
TEST_CASE("cuda small calls (emulated): one launch checks, copies and counts as three do",
          "[cuda][errors]") {
  using S = float;
  using ovq::test::MessageHas;
  const Index heads = 2, group = 2, dk = 8, dv = 8, t = 300;  // one call of 600 rows: not small
  const Stream3<S> in = make_stream<S>(heads, group, t, dk, dv, 77, true);
  OvqOptions ovq_options;
  ovq_options.capacity = 32;
  ovq_options.chunk = 16;
  const cuda::BasicOvqAttention<S, Emulator> ovq_mixer(ovq_options);
  SelfAttentionOptions self_options;
  self_options.chunk = 400;
  const cuda::BasicSelfAttention<S, Emulator> self_mixer(self_options);
  auto check = [&](const auto& mixer, auto make) {
    const auto stepped = run_device(mixer, make(), in, std::vector<Index>(t, 1));
    const auto whole = run_device(mixer, make(), in, {});
    CHECK(same_bits(stepped.o, whole.o));
    for (Index h = 0; h < heads; ++h) CHECK(stepped.states[h] == whole.states[h]);
    {
      // Every arrival counter is back at 0 after steps (the decode reads' tiles, and the
      // dictionary writes' in the state's counters).
      auto state = make();
      const Rows<S> q(in.q, heads * group, nullptr), k(in.k, heads, nullptr),
          v(in.v, heads, nullptr), o(heads * group, t, dv, nullptr);
      ovq::test::feed_pieces(mixer, state, q, k, v, o, std::vector<Index>(40, 1), nullptr);
      state.synchronize(nullptr);
      CHECK(state.counters().arrivals == 0);
      REQUIRE(state.arrival_count() > 0);
      for (std::size_t i = 0; i < state.arrival_count(); ++i)
        CHECK(state.arrival_counters()[i] == 0);
    }
    // A NaN in Q, K or V of a step (the last head, token 20).
    for (int which = 0; which < 3; ++which) {
      INFO("NaN in " << "QKV"[which]);
      auto state = make();
      const Rows<S> q(in.q, heads * group, nullptr), k(in.k, heads, nullptr),
          v(in.v, heads, nullptr), o(heads * group, t, dv, nullptr);
      mixer.forward(state, q.view().middle_rows(0, 20), k.view().middle_rows(0, 20),
                    v.view().middle_rows(0, 20), o.view().middle_rows(0, 20));
      const auto before = state.to_host(nullptr);
      RowMatrix<S> bad = which == 0 ? in.q : (which == 1 ? in.k : in.v);
      const Index bad_heads = which == 0 ? heads * group : heads;
      bad((bad_heads - 1) * t + 20, 3) = std::numeric_limits<S>::quiet_NaN();
      const Rows<S> b(bad, bad_heads, nullptr);
      mixer.step(state, (which == 0 ? b : q).view().middle_rows(20, 1),
                 (which == 1 ? b : k).view().middle_rows(20, 1),
                 (which == 2 ? b : v).view().middle_rows(20, 1), o.view().middle_rows(20, 1));
      CHECK_THROWS_MATCHES(state.synchronize(nullptr), ArgumentError,
                           MessageHas({"not finite"}));
      const auto after = state.to_host(nullptr);
      for (Index h = 0; h < heads; ++h) CHECK(after[h] == before[h]);
    }
  };
  check(ovq_mixer, [&] { return ovq_mixer.make_state(heads, dk, dv); });
  check(self_mixer, [&] { return self_mixer.make_state(heads, dk, dv); });
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

template <class H>
using BitsOf = cuda::device_element_t<H>;

template <class H>
std::uint16_t bits(H x) {
  std::uint16_t b;
  std::memcpy(&b, &x, sizeof b);
  return b;
}
template <class H>
H from_bits(std::uint16_t b) {
  H x;
  std::memcpy(static_cast<void*>(&x), &b, sizeof b);
  return x;
}

// ---------------------------------------------------------------------------------------------
// Conversions
// ---------------------------------------------------------------------------------------------

TEMPLATE_TEST_CASE("cuda 16-bit conversions == Eigen's: every value widened, floats rounded to "
                   "nearest even",
                   "[cuda][half]", bf16, fp16) {
  using H = TestType;
  using B = BitsOf<H>;
  for (std::uint32_t b = 0; b < 65536; ++b) {
    const float mine = cuda::kernels::widen(B{static_cast<std::uint16_t>(b)});
    const float eigen = static_cast<float>(from_bits<H>(static_cast<std::uint16_t>(b)));
    if (std::isnan(eigen)) {
      CHECK(std::isnan(mine));
    } else if (cuda::kernels::bits_of(mine) != cuda::kernels::bits_of(eigen)) {
      FAIL_CHECK("widen " << b << ": " << mine << " != " << eigen);
    }
  }
  // Floats around every 16-bit value: the value, the midpoints to its neighbours (ties) and
  // one float either side of them, plus random floats of every magnitude.
  std::vector<float> probes;
  for (std::uint32_t b = 0; b < 65536; b += 3) {
    const float x = static_cast<float>(from_bits<H>(static_cast<std::uint16_t>(b)));
    const float y = static_cast<float>(from_bits<H>(static_cast<std::uint16_t>(b + 1)));
    if (!std::isfinite(x) || !std::isfinite(y)) continue;
    const float mid = static_cast<float>((static_cast<double>(x) + y) / 2);
    probes.insert(probes.end(), {x, mid, std::nextafter(mid, -INFINITY), std::nextafter(mid, INFINITY)});
  }
  std::mt19937 gen(5);
  for (int i = 0; i < 200000; ++i) probes.push_back(cuda::kernels::float_from_bits(gen()));
  probes.insert(probes.end(), {0.0f, -0.0f, INFINITY, -INFINITY, 65504.0f, 65519.99f, 65520.0f,
                               std::numeric_limits<float>::denorm_min(), 3e38f, -3.4e38f});
  std::size_t wrong = 0;
  for (const float x : probes) {
    const std::uint16_t mine = cuda::kernels::narrow<B>(x).bits;
    if (std::isnan(x)) {
      CHECK(std::isnan(cuda::kernels::widen(B{mine})));
      continue;
    }
    if (mine != bits(static_cast<H>(x))) {
      if (++wrong <= 5) FAIL_CHECK("narrow " << x << ": " << mine << " != " << bits(static_cast<H>(x)));
    }
  }
  CHECK(wrong == 0);
  CHECK(cuda::kernels::largest_finite_of<B>() == widen(Eigen::NumTraits<H>::highest()));
}

// ---------------------------------------------------------------------------------------------
// The tensor-core tile product
// ---------------------------------------------------------------------------------------------

// D = A B + C for one warp, every lane's entries gathered by the C layout (lane l holds rows
// l / 4 and l / 4 + 8, columns 2 (l % 4) and + 1), B given row-major or as its transpose.
template <class B>
RowMatrix<float> warp_product(const std::vector<B>& a, int lda, const std::vector<B>& b, int ldb,
                              bool transposed, const RowMatrix<float>& c) {
  RowMatrix<float> d(16, 8);
  for (int lane = 0; lane < 32; ++lane) {
    float acc[4];
    for (int i = 0; i < 4; ++i) acc[i] = c(lane / 4 + (i >= 2 ? 8 : 0), 2 * (lane % 4) + (i & 1));
    cuda::kernels::mma<B>(
        lane, [&](int l) { return cuda::kernels::mma_load_a(a.data(), lda, l); },
        [&](int l) {
          return transposed ? cuda::kernels::mma_load_b_transposed(b.data(), ldb, l)
                            : cuda::kernels::mma_load_b(b.data(), ldb, l);
        },
        acc);
    for (int i = 0; i < 4; ++i) d(lane / 4 + (i >= 2 ? 8 : 0), 2 * (lane % 4) + (i & 1)) = acc[i];
  }
  return d;
}

TEMPLATE_TEST_CASE("cuda tensor-core tile product (emulated): the fragment loaders read A, B and "
                   "B^T as the PTX layout places them",
                   "[cuda][half][mma]", bf16, fp16) {
  using H = TestType;
  using B = BitsOf<H>;
  for (std::uint64_t seed = 1; seed <= 20; ++seed) {
    // Strides past the tile, so that a loader reading the wrong row or column reads other
    // values.
    const int lda = 16 + static_cast<int>(seed % 5), ldb = 8 + static_cast<int>(seed % 7),
              ldt = 16 + static_cast<int>(seed % 3);
    const RowMatrix<H> a = random_rows<H>(16, lda, seed);
    const RowMatrix<H> b = random_rows<H>(16, ldb, seed + 100);
    const RowMatrix<float> c = random_matrix<float>(16, 8, seed + 200);
    std::vector<B> a_bits(static_cast<std::size_t>(a.size())), b_bits(static_cast<std::size_t>(b.size())),
        bt_bits(static_cast<std::size_t>(8 * ldt));
    std::memcpy(a_bits.data(), a.data(), sizeof(H) * a_bits.size());
    std::memcpy(b_bits.data(), b.data(), sizeof(H) * b_bits.size());
    for (int k = 0; k < 16; ++k)
      for (int n = 0; n < 8; ++n) bt_bits[static_cast<std::size_t>(n * ldt + k)] = b_bits[k * ldb + n];
    const RowMatrix<double> ad = a.leftCols(16).unaryExpr([](H x) { return double(widen(x)); });
    const RowMatrix<double> bd = b.leftCols(8).unaryExpr([](H x) { return double(widen(x)); });
    const RowMatrix<double> expected = ad * bd + c.cast<double>();
    const RowMatrix<float> direct = warp_product(a_bits, lda, b_bits, ldb, false, c);
    const RowMatrix<float> via_transpose = warp_product(a_bits, lda, bt_bits, ldt, true, c);
    INFO("seed " << seed);
    // Products of 16-bit values are exact in float: only the 16 additions round.
    CHECK((direct.cast<double>() - expected).cwiseAbs().maxCoeff() < 1e-5);
    CHECK(same_bits(direct, via_transpose));
  }
}

TEMPLATE_TEST_CASE("cuda ldmatrix loaders (emulated, by the PTX ldmatrix layout) give the scalar "
                   "loaders' fragments: A, two tiles of B^T, two tiles of B",
                   "[cuda][half][mma]", bf16, fp16) {
  using H = TestType;
  using B = BitsOf<H>;
  namespace k = cuda::kernels;
  for (std::uint64_t seed = 1; seed <= 5; ++seed) {
    const int ld = 24 + 8 * static_cast<int>(seed % 3);  // rows of 16-byte pieces, as staged
    const RowMatrix<H> m = random_rows<H>(16, ld, seed);
    std::vector<B> bits(static_cast<std::size_t>(m.size()));
    std::memcpy(bits.data(), m.data(), sizeof(H) * bits.size());
    const B* x = bits.data();
    for (int lane = 0; lane < 32; ++lane) {
      INFO("seed " << seed << ", lane " << lane);
      const k::MmaA a = k::mma_ldmatrix_a(x, ld, lane), a_ref = k::mma_load_a(x, ld, lane);
      for (int i = 0; i < 4; ++i) CHECK(a.r[i] == a_ref.r[i]);
      const k::MmaB2 bt = k::mma_ldmatrix_b_transposed(x, ld, lane);
      const k::MmaB2 b = k::mma_ldmatrix_b(x, ld, lane);
      for (int t = 0; t < 2; ++t) {
        const k::MmaB bt_ref = k::mma_load_b_transposed(x + 8 * t * ld, ld, lane);
        const k::MmaB b_ref = k::mma_load_b(x + 8 * t, ld, lane);
        for (int i = 0; i < 2; ++i) {
          CHECK(bt.tile[t].r[i] == bt_ref.r[i]);
          CHECK(b.tile[t].r[i] == b_ref.r[i]);
        }
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// The 16-bit device self-attention against the CPU's
// ---------------------------------------------------------------------------------------------

// Normalised error between two 16-bit reads of the same 16-bit inputs, each within its bound of
// the exact read (the CPU: 16-bit outputs; the GPU: also 16-bit weights).
template <class H>
constexpr double mixer_bound() {
  return std::is_same_v<H, bf16> ? 1.5e-2 : 3e-3;
}

TEMPLATE_TEST_CASE("cuda 16-bit self-attention (emulated) == the CPU's 16-bit mixer, any cut of "
                   "the stream; the cache holds the same 16-bit rows",
                   "[cuda][half][mixers][self]", bf16, fp16) {
  using H = TestType;
  struct Case {
    bool causal;
    Index window, chunk, dk, dv, group;
  };
  const std::vector<std::vector<Index>> cuts = {{}, {37, 1, 1, 1, 60}, {1, 1, 5, 16, 16, 3}};
  for (const Case& c : {Case{true, 0, 64, 16, 20, 3}, Case{true, 40, 32, 64, 64, 1},
                        Case{true, 1, 16, 8, 8, 2}, Case{false, 0, 64, 12, 36, 1},
                        Case{true, 0, 128, 128, 128, 8}}) {
    SelfAttentionOptions opt;
    opt.beta = 0.3;
    opt.causal = c.causal;
    opt.window = c.window;
    opt.chunk = c.chunk;
    const Index heads = 2, t = c.causal ? 150 : 40;
    const Stream3<H> in = make_stream<H>(heads, c.group, t, c.dk, c.dv, 17);
    MultiHead<SelfAttention<H>> cpu(SelfAttention<H>(opt), 1, heads * c.group, heads, c.dk, c.dv);
    const RowMatrix<H> expected = cpu.forward(in.q, in.k, in.v);
    const cuda::BasicSelfAttention<H, Emulator> mixer(opt);
    RowMatrix<H> first;
    for (const auto& cut : c.causal ? cuts : std::vector<std::vector<Index>>{{}}) {
      const auto got = run_device(mixer, mixer.make_state(heads, c.dk, c.dv), in, cut);
      INFO("window " << c.window << " causal " << c.causal << " dk " << c.dk << " group "
                     << c.group << " pieces " << cut.size());
      CHECK(relative_error(as_double(got.o), as_double(expected)) < mixer_bound<H>());
      for (Index h = 0; h < heads; ++h) CHECK(got.states[h] == cpu.state(0, h));
      if (first.size() == 0) first = got.o;
      CHECK(same_bits(got.o, first));
    }
  }
}

TEMPLATE_TEST_CASE("cuda 16-bit self-attention (emulated): captured steps == host-planned steps; "
                   "states to and from the host; bad values change nothing",
                   "[cuda][half][capture]", bf16, fp16) {
  using H = TestType;
  const Index dk = 32, dv = 32, t = 40, heads = 2, group = 4;
  const Stream3<H> in = make_stream<H>(heads, group, t, dk, dv, 29);
  const cuda::BasicSelfAttention<H, Emulator> mixer(SelfAttentionOptions{});
  cuda::EmulatedStream capture{true};
  const auto planned =
      run_device(mixer, mixer.make_state(heads, dk, dv), in, std::vector<Index>(t, 1));
  auto reserved = mixer.make_state(heads, dk, dv);
  mixer.reserve(reserved, heads * group, t);
  const auto captured =
      run_device(mixer, std::move(reserved), in, std::vector<Index>(t, 1), &capture);
  CHECK(same_bits(planned.o, captured.o));
  CHECK(planned.states[1] == captured.states[1]);

  // The first half's state through the host, then the second half: the same outputs.
  const Index half = t / 2;
  const auto rows = [&](const RowMatrix<H>& m, Index per_head_heads, Index first, Index count) {
    RowMatrix<H> out(per_head_heads * count, m.cols());
    for (Index h = 0; h < per_head_heads; ++h)
      out.middleRows(h * count, count) = m.middleRows(h * t + first, count);
    return out;
  };
  const Stream3<H> a{heads, group, half, dk, dv, rows(in.q, heads * group, 0, half),
                        rows(in.k, heads, 0, half), rows(in.v, heads, 0, half)};
  const Stream3<H> b{heads, group, t - half, dk, dv, rows(in.q, heads * group, half, t - half),
                        rows(in.k, heads, half, t - half), rows(in.v, heads, half, t - half)};
  const auto first = run_device(mixer, mixer.make_state(heads, dk, dv), a, {});
  auto resumed = mixer.make_state(heads, dk, dv);
  resumed.from_host(first.states, nullptr);
  const auto second = run_device(mixer, std::move(resumed), b, {});
  const auto whole = run_device(mixer, mixer.make_state(heads, dk, dv), in, {});
  CHECK(same_bits(rows(whole.o, heads * group, half, t - half), second.o));
  CHECK(whole.states[0] == second.states[0]);

  // A NaN in K: the device faults, the state is as it was, synchronize() names it.
  auto state = mixer.make_state(heads, dk, dv);
  const Rows<H> q(a.q, heads * group, nullptr), v(a.v, heads, nullptr);
  RowMatrix<H> bad_k = a.k;
  bad_k(3, 5) = from_bits<H>(std::is_same_v<H, bf16> ? 0x7fc0 : 0x7e00);
  const Rows<H> k(bad_k, heads, nullptr);
  const Rows<H> o(heads * group, half, dv, nullptr);
  mixer.forward(state, q.view(), k.view(), v.view(), o.view(), nullptr);
  CHECK_THROWS_MATCHES(state.synchronize(nullptr), ArgumentError,
                       ovq::test::MessageHas({"not finite"}));
  CHECK(state.tokens() == 0);
  CHECK(state.to_host(nullptr)[0] == KvCache<H>(dk, dv));
}

// The CPU's 16-bit OVQ state after the same stream: the float running means, the counts, and
// the 16-bit read rows rounded from the means, bit for bit (the same assignments: both sides
// score the widened keys against the float means with one FMA chain per score). With the delta
// rule the predictions are 16-bit reads, equal only to rounding on the two sides: then the
// counts and keys exactly, the values to the reads' rounding.
template <class H>
void check_ovq_half_state(const OvqState<H>& got, const OvqState<H>& want, bool delta) {
  CHECK(got.absorbed() == want.absorbed());
  CHECK(got.dictionary().size() == want.dictionary().size());
  if (!delta) {
    CHECK(got == want);
    return;
  }
  const Dictionary<H>& d = got.dictionary();
  for (Index r = 0; r < d.size(); ++r) CHECK(d.count(r) == want.dictionary().count(r));
  CHECK(as_eigen(d.mean_keys()) == as_eigen(want.dictionary().mean_keys()));
  CHECK(relative_error(as_eigen(d.mean_values()), as_eigen(want.dictionary().mean_values())) <
        mixer_bound<H>());
}

TEMPLATE_TEST_CASE("cuda 16-bit OVQ-attention (emulated) == the CPU's 16-bit mixer: outputs, "
                   "and float means and 16-bit rows bit for bit, any cut of the stream",
                   "[cuda][half][mixers][ovq]", bf16, fp16) {
  using H = TestType;
  struct Case {
    OvqOptions opt;
    Index dk, dv, group;
  };
  const auto with = [](OvqOptions o, Index capacity, Index chunk) {
    o.beta = 2.0;
    o.capacity = capacity;
    o.chunk = chunk;
    return o;
  };
  OvqOptions random = with(OvqOptions{}, 40, 8);
  random.growth = Growth::dirichlet(5.0);
  random.seeding = Seeding::random(9);
  random.renormalize = true;
  OvqOptions constant = with(OvqOptions{}, 30, 12);
  constant.growth = Growth::linear(0.5);
  constant.rate = UpdateRate::constant(0.3);
  OvqOptions spread_delta = with(OvqOptions{}, 30, 4);
  spread_delta.rate = UpdateRate::constant(0.3);
  spread_delta.value_update = ValueUpdate::delta;
  OvqOptions kvm_delta_no_bias = with(OvqOptions::kvm_delta(), 40, 8);
  kvm_delta_no_bias.count_bias = false;
  for (const Case& c : {Case{with(OvqOptions{}, 48, 16), 32, 16, 2},
                        Case{random, 20, 12, 1},
                        Case{constant, 64, 64, 4},
                        Case{with(OvqOptions::kvm(), 48, 16), 32, 32, 2},
                        Case{with(OvqOptions::kvm_delta(), 48, 16), 32, 16, 2},
                        Case{kvm_delta_no_bias, 24, 24, 1},
                        Case{spread_delta, 16, 16, 2}}) {
    const Index heads = 2;
    const bool delta = c.opt.value_update == ValueUpdate::delta;
    const Stream3<H> in = make_stream<H>(heads, c.group, 130, c.dk, c.dv, 11, true);
    MultiHead<OvqAttention<H, arch::scalar>> cpu(OvqAttention<H, arch::scalar>(c.opt), 1,
                                                  heads * c.group, heads, c.dk, c.dv);
    const RowMatrix<H> expected = cpu.forward(in.q, in.k, in.v);
    const cuda::BasicOvqAttention<H, Emulator> mixer(c.opt);
    RowMatrix<H> first;
    for (const auto& cut : kCuts) {
      const auto got = run_device(mixer, mixer.make_state(heads, c.dk, c.dv), in, cut);
      INFO("capacity " << c.opt.capacity << " chunk " << c.opt.chunk << " dk " << c.dk
                       << " delta " << delta << " pieces " << cut.size());
      CHECK(relative_error(as_double(got.o), as_double(expected)) < mixer_bound<H>());
      for (Index h = 0; h < heads; ++h) check_ovq_half_state(got.states[h], cpu.state(0, h), delta);
      if (first.size() == 0) first = got.o;
      CHECK(same_bits(got.o, first));
    }
  }
}

TEMPLATE_TEST_CASE("cuda 16-bit OVQ-attention (emulated): captured steps == host-planned steps; "
                   "a state through the host continues as on the device",
                   "[cuda][half][capture][ovq]", bf16, fp16) {
  using H = TestType;
  const Index dk = 32, dv = 16, t = 45, heads = 2, group = 2;
  OvqOptions opt = OvqOptions::kvm_delta();
  opt.capacity = 24;
  opt.chunk = 8;
  const Stream3<H> in = make_stream<H>(heads, group, t, dk, dv, 37, true);
  const cuda::BasicOvqAttention<H, Emulator> mixer(opt);
  cuda::EmulatedStream capture{true};
  const auto planned =
      run_device(mixer, mixer.make_state(heads, dk, dv), in, std::vector<Index>(t, 1));
  auto reserved = mixer.make_state(heads, dk, dv);
  mixer.reserve(reserved, heads * group);
  const auto captured =
      run_device(mixer, std::move(reserved), in, std::vector<Index>(t, 1), &capture);
  CHECK(same_bits(planned.o, captured.o));
  CHECK(planned.states[1] == captured.states[1]);

  // 29 tokens (3 chunks and 5 pending rows), the state to the host and back, then the rest.
  const Index half = 29;
  const auto rows = [&](const RowMatrix<H>& m, Index m_heads, Index from, Index count) {
    RowMatrix<H> out(m_heads * count, m.cols());
    for (Index h = 0; h < m_heads; ++h)
      out.middleRows(h * count, count) = m.middleRows(h * t + from, count);
    return out;
  };
  const Stream3<H> a{heads, group, half, dk, dv, rows(in.q, heads * group, 0, half),
                     rows(in.k, heads, 0, half), rows(in.v, heads, 0, half)};
  const Stream3<H> b{heads, group, t - half, dk, dv, rows(in.q, heads * group, half, t - half),
                     rows(in.k, heads, half, t - half), rows(in.v, heads, half, t - half)};
  const auto before = run_device(mixer, mixer.make_state(heads, dk, dv), a, {});
  CHECK(before.states[0].pending() == 5);
  auto resumed = mixer.make_state(heads, dk, dv);
  resumed.from_host(before.states, nullptr);
  CHECK(resumed.to_host(nullptr)[1] == before.states[1]);
  const auto after = run_device(mixer, std::move(resumed), b, {});
  CHECK(same_bits(rows(planned.o, heads * group, half, t - half), after.o));
  CHECK(planned.states[0] == after.states[0]);
}

TEMPLATE_TEST_CASE("cuda 16-bit VQ-attention (emulated) == the CPU's 16-bit mixer: outputs, and "
                   "codes, counts, float means and 16-bit rows bit for bit; captured steps too",
                   "[cuda][half][mixers][vq]", bf16, fp16) {
  using H = TestType;
  struct Case {
    Index chunk, codes, dk, dv, group;
  };
  for (const Case& c : {Case{16, 40, 24, 16, 2}, Case{8, 20, 64, 64, 4}, Case{4, 7, 20, 12, 1}}) {
    VqAttentionOptions opt;
    opt.beta = 0.5;
    opt.chunk = c.chunk;
    const Index heads = 2;
    const RowMatrix<H> codebook = random_rows<H>(c.codes, c.dk, 21);
    const Stream3<H> in = make_stream<H>(heads, c.group, 120, c.dk, c.dv, 23);
    const VqAttention<H, arch::scalar> host(opt);
    MultiHead<VqAttention<H, arch::scalar>> cpu(
        host, 1, heads * c.group, std::vector<VqState<H>>(heads, host.make_state(codebook, c.dv)));
    const RowMatrix<H> expected = cpu.forward(in.q, in.k, in.v);
    const cuda::BasicVqAttention<H, Emulator> mixer(opt);
    RowMatrix<H> first;
    for (const auto& cut : kCuts) {
      const auto got = run_device(mixer, mixer.make_state(heads, codebook, c.dv), in, cut);
      INFO("chunk " << c.chunk << " dk " << c.dk << " pieces " << cut.size());
      CHECK(relative_error(as_double(got.o), as_double(expected)) < mixer_bound<H>());
      for (Index h = 0; h < heads; ++h) CHECK(got.states[h] == cpu.state(0, h));
      if (first.size() == 0) first = got.o;
      CHECK(same_bits(got.o, first));
    }
    cuda::EmulatedStream capture{true};
    auto reserved = mixer.make_state(heads, codebook, c.dv);
    mixer.reserve(reserved, heads * c.group);
    const auto captured =
        run_device(mixer, std::move(reserved), in, std::vector<Index>(in.t, 1), &capture);
    CHECK(same_bits(captured.o, first));
    CHECK(captured.states[1] == cpu.state(0, 1));
  }
}

TEMPLATE_TEST_CASE("cuda 16-bit linear attention (emulated) == the CPU's 16-bit mixer, any cut "
                   "of the stream; (S, z) in float",
                   "[cuda][half][mixers][linear]", bf16, fp16) {
  using H = TestType;
  struct Case {
    kernels::FeatureMap map;
    bool normalize;
    Index dk, dv, group;
  };
  // (The identity map's normaliser can cross 0: it is left to the float test.)
  for (const Case& c : {Case{kernels::FeatureMap::identity, false, 20, 18, 2},
                        Case{kernels::FeatureMap::elu1, true, 64, 64, 4},
                        Case{kernels::FeatureMap::relu, false, 32, 16, 1},
                        Case{kernels::FeatureMap::elu1, false, 16, 24, 2}}) {
    LinearAttentionOptions opt;
    opt.beta = 0.5;
    opt.chunk = 16;
    opt.feature_map = c.map;
    opt.normalize = c.normalize;
    opt.decay = 0.97;
    const Index heads = 2;
    const Stream3<H> in = make_stream<H>(heads, c.group, 120, c.dk, c.dv, 31);
    MultiHead<LinearAttention<H>> cpu(LinearAttention<H>(opt), 1, heads * c.group, heads, c.dk,
                                      c.dv);
    const RowMatrix<H> expected = cpu.forward(in.q, in.k, in.v);
    const cuda::BasicLinearAttention<H, Emulator> mixer(opt);
    RowMatrix<H> first;
    for (const auto& cut : kCuts) {
      const auto got = run_device(mixer, mixer.make_state(heads, c.dk, c.dv), in, cut);
      INFO("map " << int(c.map) << " normalize " << c.normalize << " pieces " << cut.size());
      CHECK(relative_error(as_double(got.o), as_double(expected)) < mixer_bound<H>());
      for (Index h = 0; h < heads; ++h) {
        const LinearState<H>& want = cpu.state(0, h);
        CHECK(got.states[h].absorbed() == want.absorbed());
        CHECK(relative_error(got.states[h].kv(), want.kv()) < 1e-5);
        CHECK(relative_error(got.states[h].k_sum(), want.k_sum()) < 1e-5);
        CHECK(as_eigen(got.states[h].pending_keys()) == as_eigen(want.pending_keys()));
      }
      if (first.size() == 0) first = got.o;
      CHECK(same_bits(got.o, first));
    }
  }
}

// The device mixer over the stream in forward pieces with the log-sum-exp asked for: the outputs
// and the lse (heads g x T, as the CPU's rows).
template <class Mixer, class S, class State>
std::pair<RowMatrix<S>, RowMatrix<compute_t<S>>> run_device_lse(const Mixer& mixer, State state,
                                                               const Stream3<S>& in,
                                                               const std::vector<Index>& pieces) {
  using C = compute_t<S>;
  const Index hq = in.heads * in.group;
  const Rows<S> q(in.q, hq, nullptr), k(in.k, in.heads, nullptr), v(in.v, in.heads, nullptr);
  const Rows<S> o(hq, in.t, in.dv, nullptr);
  const DeviceRows<C, Emulator> lse(hq, in.t, 1, nullptr);
  Index pos = 0;
  for (std::size_t i = 0; pos < in.t; ++i) {
    const Index take = i < pieces.size() ? std::min(pieces[i], in.t - pos) : in.t - pos;
    mixer.forward(state, q.view().middle_rows(pos, take), k.view().middle_rows(pos, take),
                  v.view().middle_rows(pos, take), o.view().middle_rows(pos, take),
                  lse.view().middle_rows(pos, take), nullptr);
    pos += take;
  }
  return {o.download(nullptr), lse.download(nullptr)};
}

template <class S>
double lse_error(const RowMatrix<compute_t<S>>& got, const RowVector<compute_t<S>>& want) {
  const RowVector<compute_t<S>> flat =
      Eigen::Map<const RowVector<compute_t<S>>>(got.data(), got.size());
  return relative_error(flat, want);
}

TEMPLATE_TEST_CASE("cuda log-sum-exp output (emulated) == the CPU's: self, VQ and OVQ reads, "
                   "prefill and decode tiles, any cut of the stream",
                   "[cuda][mixers][lse]", float, bf16) {
  using S = TestType;
  using C = compute_t<S>;
  const double bound = is_half_v<S> ? mixer_bound<S>() : tolerance<float>();
  const Index heads = 2, group = 2, t = 100, dk = 32, dv = 16;
  // The CPU layer's outputs and lse against the device mixer's, in forward pieces of each cut.
  const auto check = [&](auto& cpu, const auto& mixer, auto make_state, const Stream3<S>& in) {
    RowMatrix<S> o(in.q.rows(), dv);
    RowVector<C> want(in.q.rows());
    cpu.forward(in.q, in.k, in.v, o, want);
    for (const auto& cut : std::vector<std::vector<Index>>{{}, {37, 1, 1, 1, 60}}) {
      const auto got = run_device_lse(mixer, make_state(), in, cut);
      CHECK(lse_error<S>(got.second, want) < bound);
      CHECK(relative_error(as_double(got.first), as_double(o)) < bound);
    }
  };
  {
    SelfAttentionOptions opt;
    opt.beta = 0.3;
    opt.chunk = 32;
    MultiHead<SelfAttention<S>> cpu(SelfAttention<S>(opt), 1, heads * group, heads, dk, dv);
    const cuda::BasicSelfAttention<S, Emulator> mixer(opt);
    check(cpu, mixer, [&] { return mixer.make_state(heads, dk, dv); },
          make_stream<S>(heads, group, t, dk, dv, 91));
  }
  {
    VqAttentionOptions opt;
    opt.beta = 0.5;
    opt.chunk = 16;
    const RowMatrix<S> codebook = random_rows<S>(20, dk, 93);
    const VqAttention<S, arch::scalar> host(opt);
    MultiHead<VqAttention<S, arch::scalar>> cpu(
        host, 1, heads * group, std::vector<VqState<S>>(heads, host.make_state(codebook, dv)));
    const cuda::BasicVqAttention<S, Emulator> mixer(opt);
    check(cpu, mixer, [&] { return mixer.make_state(heads, codebook, dv); },
          make_stream<S>(heads, group, t, dk, dv, 95));
  }
  {
    OvqOptions opt;
    opt.beta = 2.0;
    opt.capacity = 48;
    opt.chunk = 16;
    const Stream3<S> in = make_stream<S>(heads, group, t, dk, dv, 97, true);
    MultiHead<OvqAttention<S, arch::scalar>> cpu(OvqAttention<S, arch::scalar>(opt), 1,
                                                  heads * group, heads, dk, dv);
    const cuda::BasicOvqAttention<S, Emulator> mixer(opt);
    check(cpu, mixer, [&] { return mixer.make_state(heads, dk, dv); }, in);
    // A lse view of the wrong shape is refused before anything runs.
    auto state = mixer.make_state(heads, dk, dv);
    const Rows<S> q(in.q, heads * group, nullptr), k(in.k, heads, nullptr),
        v(in.v, heads, nullptr), out(heads * group, t, dv, nullptr);
    const DeviceRows<C, Emulator> short_lse(heads * group, t - 1, 1, nullptr);
    CHECK_THROWS_MATCHES(mixer.forward(state, q.view(), k.view(), v.view(), out.view(),
                                       short_lse.view(), nullptr),
                         ArgumentError,
                         ovq::test::MessageHas({"lse has shape", "one entry per query"}));
    CHECK(state.tokens() == 0);
  }
}

// ---------------------------------------------------------------------------------------------
// One beta per query head
// ---------------------------------------------------------------------------------------------

TEMPLATE_TEST_CASE("cuda head betas (emulated) == the CPU layer's: self, VQ and OVQ (with the "
                   "delta rule) over a batch of 2, any cut of the stream",
                   "[cuda][mixers][head_betas]", float, bf16) {
  using S = TestType;
  const double bound = is_half_v<S> ? mixer_bound<S>() : tolerance<S>();
  const Index batch = 2, hq = 4, hkv = 2, t = 90, dk = 32, dv = 16;
  const Index states = batch * hkv;
  // The CPU layer with `betas` against the device mixer with the same, over every cut; without
  // them the device's outputs are far from the layer's (the betas are read).
  const auto check = [&](auto& cpu, auto mixer, auto make_state, const Stream3<S>& in,
                         const std::vector<double>& betas, auto check_state) {
    const RowMatrix<S> plain = run_device(mixer, make_state(mixer), in, {}).o;
    cpu.set_head_betas(betas);
    mixer.set_head_betas(betas, hkv);
    CHECK(mixer.head_betas() == betas);
    const RowMatrix<S> expected = run_cpu(cpu, in);
    CHECK(relative_error(as_double(plain), as_double(expected)) > 10 * bound);
    for (const auto& cut : kCuts) {
      const auto got = run_device(mixer, make_state(mixer), in, cut);
      INFO("pieces " << cut.size());
      CHECK(relative_error(as_double(got.o), as_double(expected)) < bound);
      for (Index s = 0; s < states; ++s) check_state(got.states[s], cpu.state(s / hkv, s % hkv));
    }
    // absorb writes what forward wrote (the delta rule's write reads with the betas too).
    auto written = make_state(mixer);
    const Rows<S> k(in.k, states, nullptr), v(in.v, states, nullptr);
    mixer.absorb(written, k.view(), v.view(), nullptr);
    const auto host = written.to_host(nullptr);
    for (Index s = 0; s < states; ++s) check_state(host[s], cpu.state(s / hkv, s % hkv));
  };
  const std::vector<double> betas = {0.3, 1.1, 0.6, 1.7};
  const auto equal = [](const auto& got, const auto& want) { CHECK(got == want); };
  {
    SelfAttentionOptions opt;
    opt.chunk = 32;
    MultiHead<SelfAttention<S>> cpu(SelfAttention<S>(opt), batch, hq, hkv, dk, dv);
    check(cpu, cuda::BasicSelfAttention<S, Emulator>(opt),
          [&](const auto& m) { return m.make_state(states, dk, dv); },
          make_stream<S>(states, hq / hkv, t, dk, dv, 201), betas, equal);
  }
  {
    VqAttentionOptions opt;
    opt.chunk = 16;
    const RowMatrix<S> codebook = random_rows<S>(24, dk, 203);
    const VqAttention<S, arch::scalar> host(opt);
    MultiHead<VqAttention<S, arch::scalar>> cpu(
        host, batch, hq, std::vector<VqState<S>>(hkv, host.make_state(codebook, dv)));
    check(cpu, cuda::BasicVqAttention<S, Emulator>(opt),
          [&](const auto& m) { return m.make_state(states, codebook, dv); },
          make_stream<S>(states, hq / hkv, t, dk, dv, 205), betas,
          [](const VqState<S>& got, const VqState<S>& want) {
            CHECK(got.absorbed() == want.absorbed());
            if constexpr (!is_half_v<S>) CHECK(got == want);
          });
  }
  for (const ValueUpdate update : {ValueUpdate::mean, ValueUpdate::delta}) {
    OvqOptions opt;
    opt.beta = 2.0;
    opt.capacity = 40;
    opt.chunk = 8;
    opt.value_update = update;
    const bool delta = update == ValueUpdate::delta;
    // The delta rule's write reads with the beta its key/value head's query heads share.
    const std::vector<double> ovq_betas =
        delta ? std::vector<double>{0.7, 0.7, 3.1, 3.1} : std::vector<double>{0.9, 3.3, 1.4, 4.0};
    MultiHead<OvqAttention<S, arch::scalar>> cpu(OvqAttention<S, arch::scalar>(opt), batch, hq,
                                                  hkv, dk, dv);
    INFO("delta " << delta);
    check(cpu, cuda::BasicOvqAttention<S, Emulator>(opt),
          [&](const auto& m) { return m.make_state(states, dk, dv); },
          make_stream<S>(states, hq / hkv, t, dk, dv, 207, true), ovq_betas,
          [&](const OvqState<S>& got, const OvqState<S>& want) {
            if constexpr (is_half_v<S>) {
              check_ovq_half_state(got, want, delta);
            } else if (!delta) {
              CHECK(got == want);
            } else {
              const Dictionary<S>& d = got.dictionary();
              REQUIRE(d.size() == want.dictionary().size());
              for (Index r = 0; r < d.size(); ++r)
                CHECK(d.count(r) == want.dictionary().count(r));
              CHECK(relative_error(as_eigen(d.values()), as_eigen(want.dictionary().values())) <
                    bound);
            }
          });
  }
}

TEST_CASE("cuda head betas (emulated): bad betas and calls that do not match them throw an "
          "ArgumentError naming them, before anything runs",
          "[cuda][errors][head_betas]") {
  using S = float;
  using ovq::test::MessageHas;
  cuda::BasicSelfAttention<S, Emulator> self;
  CHECK_THROWS_MATCHES(self.set_head_betas({1.0, 2.0, 3.0}, 2), ArgumentError,
                       MessageHas({"cuda::SelfAttention::set_head_betas", "kv_heads = 2",
                                   "divisor of the 3"}));
  CHECK_THROWS_MATCHES(self.set_head_betas({1.0, -1.0}, 1), ArgumentError,
                       MessageHas({"betas[1]"}));
  CHECK_THROWS_MATCHES(self.set_head_betas(std::vector<double>(257, 1.0), 1), ArgumentError,
                       MessageHas({"257 entries", "at most 256"}));
  CHECK(self.head_betas().empty());  // a refused table leaves none
  OvqOptions delta;
  delta.value_update = ValueUpdate::delta;
  cuda::BasicOvqAttention<S, Emulator> ovq(delta);
  CHECK_THROWS_MATCHES(ovq.set_head_betas({1.0, 2.0, 1.0, 1.0}, 2), ArgumentError,
                       MessageHas({"betas[1] = 2", "share"}));
  CHECK_NOTHROW(ovq.set_head_betas({1.0, 1.0, 2.0, 2.0}, 2));
  // Without the delta rule the write does not read, so a group's heads may differ.
  cuda::BasicOvqAttention<S, Emulator> ovq_mean;
  CHECK_NOTHROW(ovq_mean.set_head_betas({1.0, 2.0, 1.0, 1.0}, 2));
  cuda::BasicVqAttention<S, Emulator> vq;
  CHECK_THROWS_MATCHES(vq.set_head_betas({1.0, 2.0, 3.0}, 2), ArgumentError,
                       MessageHas({"cuda::VqAttention::set_head_betas", "kv_heads = 2"}));
  CHECK_NOTHROW(vq.set_head_betas({1.0, 2.0, 1.0, 1.0}, 2));

  // Four query heads over two key/value heads: a call must have batch x 4 query heads over
  // batch x 2 states.
  self.set_head_betas({0.5, 1.0, 1.5, 2.0}, 2);
  CHECK_THROWS_AS(self.set_head_betas({0.5, 0.0}, 1), ArgumentError);
  CHECK(self.head_betas() == std::vector<double>{0.5, 1.0, 1.5, 2.0});  // kept
  const Index dk = 8, dv = 8, t = 6;
  const Stream3<S> in = make_stream<S>(3, 4, t, dk, dv, 209);
  const Rows<S> q(in.q, 12, nullptr), k(in.k, 3, nullptr), v(in.v, 3, nullptr),
      o(12, t, dv, nullptr);
  auto odd = self.make_state(3, dk, dv);
  CHECK_THROWS_MATCHES(self.forward(odd, q.view(), k.view(), v.view(), o.view()), ArgumentError,
                       MessageHas({"the state has 3 heads", "multiple of the head betas' 2"}));
  CHECK(odd.tokens() == 0);
  auto two = self.make_state(2, dk, dv);
  auto q8 = q.view();
  q8.heads = 8;  // 2 states x 4 query heads each: twice the table's group
  auto k2 = k.view(), v2 = v.view(), o8 = o.view();
  k2.heads = v2.heads = 2;
  o8.heads = 8;
  CHECK_THROWS_MATCHES(self.forward(two, q8, k2, v2, o8), ArgumentError,
                       MessageHas({"Q has 8 heads", "expected 4"}));
  CHECK(two.tokens() == 0);
  self.set_head_betas({}, 1);
  CHECK(self.head_betas().empty());
}

// ---------------------------------------------------------------------------------------------
// The emulation's own checks: block and thread order, asynchronous copies
// ---------------------------------------------------------------------------------------------

// Runs the emulation in `order` for its lifetime.
class ScopedEmulationOrder {
 public:
  explicit ScopedEmulationOrder(cuda::EmulationOrder order) : saved_(cuda::emulation_order()) {
    cuda::set_emulation_order(order);
  }
  ~ScopedEmulationOrder() { cuda::set_emulation_order(saved_); }
  ScopedEmulationOrder(const ScopedEmulationOrder&) = delete;
  ScopedEmulationOrder& operator=(const ScopedEmulationOrder&) = delete;

 private:
  cuda::EmulationOrder saved_;
};

// A program that breaks block.hpp's rule: thread t reads, in the phase in which thread t - 1
// writes it, thread t - 1's slot of shared memory. Each block's last arrival names itself.
struct SamePhaseReadProgram {
  static constexpr int kThreads = 4;
  struct Params {
    int* seen;              // kThreads per block
    std::int64_t* arrivals;
    int* last_block;
    std::int64_t blocks;
  };
  static std::size_t shared_bytes(const Params&) { return kThreads * sizeof(int); }
  template <class Block>
  static void run(Block& block, const Params& p, cuda::BlockIndex index) {
    int* slot = static_cast<int*>(block.shared());
    block.each([&](int t) { slot[t] = 0; });
    block.each([&](int t) {
      slot[t] = t + 1;
      p.seen[index.x * kThreads + t] = t > 0 ? slot[t - 1] : -1;
    });
    if (block.last_to_arrive(p.arrivals, p.blocks))
      block.each([&](int t) {
        if (t == 0) *p.last_block = index.x;
      });
  }
};

// Asynchronous copies into shared memory: each thread copies src[t] and, as a second group,
// src[kThreads + t]; it waits for the first group, then for both, and the block reads the
// destinations before and after each barrier.
struct AsyncCopyProgram {
  static constexpr int kThreads = 3;
  struct Params {
    const float* src;  // 2 kThreads
    float* read;       // 4 x 2 kThreads: (at the first wait, after it, after the second wait's
                       // phase, after its barrier) x slots
  };
  static std::size_t shared_bytes(const Params&) { return 2 * kThreads * sizeof(float); }
  template <class Block>
  static void run(Block& block, const Params& p, cuda::BlockIndex) {
    float* sh = static_cast<float*>(block.shared());
    constexpr int n = 2 * kThreads;
    const auto read_all = [&](int at, int t) {
      for (int i = t; i < n; i += kThreads) p.read[at * n + i] = sh[i];
    };
    block.each([&](int t) {
      cuda::kernels::copy_element_async(sh + t, p.src + t);
      cuda::kernels::commit_async();
      cuda::kernels::copy_element_async(sh + kThreads + t, p.src + kThreads + t);
      cuda::kernels::commit_async();
      cuda::kernels::wait_async<1>();
      read_all(0, t);
    });
    block.each([&](int t) {
      read_all(1, t);
      cuda::kernels::wait_async<0>();
      read_all(2, t);
    });
    block.each([&](int t) { read_all(3, t); });
  }
};

TEST_CASE("cuda emulation: a phase that reads another thread's write of the same phase gives "
          "other bits in reverse order; blocks arrive last to first",
          "[cuda][emulation]") {
  constexpr int kBlocks = 3, kThreads = SamePhaseReadProgram::kThreads;
  const auto run = [&](cuda::EmulationOrder order) {
    const ScopedEmulationOrder scoped(order);
    std::vector<int> seen(kBlocks * kThreads, 99);
    std::int64_t arrivals = 0;
    int last = -1;
    cuda::emulate<SamePhaseReadProgram>(cuda::Grid{kBlocks, 1, 1},
                                        {seen.data(), &arrivals, &last, kBlocks});
    CHECK(arrivals == 0);
    return std::make_pair(seen, last);
  };
  const auto [forward, forward_last] = run(cuda::EmulationOrder::forward);
  const auto [reverse, reverse_last] = run(cuda::EmulationOrder::reverse);
  for (int b = 0; b < kBlocks; ++b)
    for (int t = 1; t < kThreads; ++t) {
      CHECK(forward[b * kThreads + t] == t);  // thread t - 1 ran first
      CHECK(reverse[b * kThreads + t] == 0);  // thread t - 1 had not run yet
    }
  CHECK(forward_last == kBlocks - 1);
  CHECK(reverse_last == 0);
}

TEST_CASE("cuda emulation: an asynchronous copy's destination holds poison until the barrier "
          "after its wait, then the source",
          "[cuda][emulation]") {
  constexpr int n = 2 * AsyncCopyProgram::kThreads, first = AsyncCopyProgram::kThreads;
  std::vector<float> src(n);
  for (int i = 0; i < n; ++i) src[static_cast<std::size_t>(i)] = 1.5f + static_cast<float>(i);
  for (const auto order : {cuda::EmulationOrder::forward, cuda::EmulationOrder::reverse}) {
    const ScopedEmulationOrder scoped(order);
    std::vector<float> read(4 * n, 0.0f);
    cuda::emulate<AsyncCopyProgram>(cuda::Grid{}, {src.data(), read.data()});
    const auto at = [&](int phase, int i) { return read[static_cast<std::size_t>(phase * n + i)]; };
    for (int i = 0; i < n; ++i) {
      INFO("slot " << i << ", reverse " << (order == cuda::EmulationOrder::reverse));
      CHECK(std::isnan(at(0, i)));  // nothing lands before a barrier
      const float landed = src[static_cast<std::size_t>(i)];
      if (i < first) {  // the first group, waited for in the first phase
        CHECK(at(1, i) == landed);
        CHECK(at(2, i) == landed);
      } else {  // the second, in flight, then waited for in the second phase
        CHECK(std::isnan(at(1, i)));
        CHECK(std::isnan(at(2, i)));  // not even for the thread that waited
      }
      CHECK(at(3, i) == landed);
    }
  }
  // Outside a launch a copy is done at once.
  float x = 0.0f;
  const float y = 2.5f;
  cuda::kernels::copy_element_async(&x, &y);
  CHECK(x == y);
}

// Every mixer over a stream with prefill pieces and decode steps (split decode reads over more
// than a merge block), with blocks and threads run first to last and last to first.
template <class Mixer, class S, class MakeState>
void check_same_bits_in_both_orders(const Mixer& mixer, MakeState make_state,
                                    const Stream3<S>& in, const std::vector<Index>& cut) {
  const auto run = [&](cuda::EmulationOrder order) {
    const ScopedEmulationOrder scoped(order);
    return run_device(mixer, make_state(), in, cut);
  };
  const auto forward = run(cuda::EmulationOrder::forward);
  const auto reverse = run(cuda::EmulationOrder::reverse);
  CHECK(same_bits(forward.o, reverse.o));
  REQUIRE(forward.states.size() == reverse.states.size());
  for (std::size_t h = 0; h < forward.states.size(); ++h)
    CHECK(forward.states[h] == reverse.states[h]);
}

TEMPLATE_TEST_CASE("cuda mixers (emulated): the same bits with blocks and threads run last to "
                   "first",
                   "[cuda][emulation][mixers]", float, bf16) {
  using S = TestType;
  const Index heads = 2, dk = 16, dv = 24;
  // Past one merge block of memory, then steps: the decode reads split.
  const Index t = 1100;
  std::vector<Index> cut = {1, 37, 1040};
  while (std::accumulate(cut.begin(), cut.end(), Index(0)) < t) cut.push_back(1);
  {
    SelfAttentionOptions opt;
    opt.beta = 0.3;
    opt.chunk = 64;
    const Stream3<S> in = make_stream<S>(heads, 4, t, dk, dv, 301);
    const cuda::BasicSelfAttention<S, Emulator> mixer(opt);
    check_same_bits_in_both_orders(mixer, [&] { return mixer.make_state(heads, dk, dv); }, in,
                                   cut);
  }
  const Index short_t = 90;
  const std::vector<Index> short_cut = {1, 40, 30, 1, 1, 1, 1, 15};
  {
    OvqOptions opt;
    opt.beta = 2.0;
    opt.capacity = 40;
    opt.chunk = 8;
    const Stream3<S> in = make_stream<S>(heads, 2, short_t, dk, dv, 311, true);
    const cuda::BasicOvqAttention<S, Emulator> mixer(opt);
    check_same_bits_in_both_orders(mixer, [&] { return mixer.make_state(heads, dk, dv); }, in,
                                   short_cut);
  }
  {
    VqAttentionOptions opt;
    opt.beta = 0.5;
    opt.chunk = 16;
    const RowMatrix<S> codebook = random_rows<S>(40, dk, 321);
    const Stream3<S> in = make_stream<S>(heads, 2, short_t, dk, dv, 331);
    const cuda::BasicVqAttention<S, Emulator> mixer(opt);
    check_same_bits_in_both_orders(mixer, [&] { return mixer.make_state(heads, codebook, dv); },
                                   in, short_cut);
  }
  {
    LinearAttentionOptions opt;
    opt.chunk = 16;
    opt.normalize = true;
    opt.feature_map = kernels::FeatureMap::elu1;
    const Stream3<S> in = make_stream<S>(heads, 2, short_t, dk, dv, 341);
    const cuda::BasicLinearAttention<S, Emulator> mixer(opt);
    check_same_bits_in_both_orders(mixer, [&] { return mixer.make_state(heads, dk, dv); }, in,
                                   short_cut);
  }
}

}  // namespace

}  // namespace ovq_test_cuda_emulated
