// The optimised kernels against the portable ones, scalar and native architecture in the same
// binary, and both against plain double formulas.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <limits>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "support/catch.hpp"
#include "support/emulated_avx512.hpp"
#include "support/fixtures.hpp"

// ovq_tests_avx512 compiles this file for AVX-512 so that arch::native is arch::avx512.
#if defined(OVQ_EXPECT_AVX512) && !defined(OVQ_ARCH_AVX512)
#error "ovq_tests_avx512 is compiled without AVX-512F: the AVX-512 kernels would go untested"
#endif

// Everything below lives in this file's own namespace, so the suite can be built as one
// unity source without the files' helpers colliding.
namespace ovq_test_kernels {

using namespace ovq;
using ovq::test::random_matrix;
using ovq::test::relative_error;

namespace {

// Plain double formula of the fused read for one head (header of kernels/read.hpp).
RowMatrix<double> read_formula(const RowMatrix<double>& q, const RowMatrix<double>& km,
                               const RowMatrix<double>& vm, const std::vector<double>& bias,
                               const RowMatrix<double>& kl, const RowMatrix<double>& vl,
                               const kernels::ReadMask& mask, double beta) {
  const Index nm = km.rows();
  RowMatrix<double> o(q.rows(), vl.cols());
  for (Index i = 0; i < q.rows(); ++i) {
    const Index p = mask.query_offset + i;
    std::vector<double> logits;
    std::vector<Eigen::VectorXd> values;
    for (Index r = 0; r < nm; ++r) {
      if (mask.causal && mask.window > 0 && r - nm <= p - mask.window) continue;
      const double b = bias.empty() ? 0.0 : bias[static_cast<std::size_t>(r)];
      logits.push_back(beta * q.row(i).dot(km.row(r)) + b);
      values.push_back(vm.row(r).transpose());
    }
    for (Index j = 0; j < kl.rows(); ++j) {
      if (mask.causal && j > p) continue;
      if (mask.causal && mask.window > 0 && j <= p - mask.window) continue;
      logits.push_back(beta * q.row(i).dot(kl.row(j)));
      values.push_back(vl.row(j).transpose());
    }
    o.row(i) = ref::softmax_read(logits, values, vl.cols()).transpose();
  }
  return o;
}

template <class Scalar, class Arch>
std::vector<RowMatrix<Scalar>> run_read(const std::vector<RowMatrix<Scalar>>& q,
                                        const RowMatrix<Scalar>& km, const RowMatrix<Scalar>& vm,
                                        const std::vector<Scalar>& bias,
                                        const RowMatrix<Scalar>& kl, const RowMatrix<Scalar>& vl,
                                        const kernels::ReadMask& mask, Scalar beta) {
  std::vector<RowMatrix<Scalar>> o;
  std::vector<ConstRowsView<Scalar>> qv;
  std::vector<RowsView<Scalar>> ov;
  for (const auto& m : q) o.emplace_back(m.rows(), vl.cols());
  for (std::size_t h = 0; h < q.size(); ++h) {
    qv.push_back(rows_view(q[h]));
    ov.push_back(rows_view(o[h]));
  }
  const kernels::MemoryRows<Scalar> memory{rows_view(km), rows_view(vm),
                                           bias.empty() ? nullptr : bias.data()};
  const kernels::LocalRows<Scalar> local{rows_view(kl), rows_view(vl)};
  kernels::read<Scalar, Arch>(qv.data(), static_cast<Index>(q.size()), memory, local, mask, beta,
                              ov.data());
  return o;
}

struct ReadCase {
  Index heads, n_queries, n_memory, n_local, dk, dv, offset, window;
  bool causal, bias;
};

// A case's inputs, from a seed: random rows, and a log-count-like bias with removed rows.
template <class Scalar>
struct ReadInputs {
  std::vector<RowMatrix<Scalar>> q;
  RowMatrix<Scalar> km, vm, kl, vl;
  std::vector<Scalar> bias;
  std::vector<double> bias_d;
  kernels::ReadMask mask;
  Scalar beta = Scalar(0.8);

  ReadInputs(const ReadCase& c, std::uint64_t seed)
      : km(random_matrix<Scalar>(c.n_memory, c.dk, seed + 1)),
        vm(random_matrix<Scalar>(c.n_memory, c.dv, seed + 2)),
        kl(random_matrix<Scalar>(c.n_local, c.dk, seed + 3)),
        vl(random_matrix<Scalar>(c.n_local, c.dv, seed + 4)),
        mask{c.causal, c.offset, c.window} {
    for (Index h = 0; h < c.heads; ++h)
      q.push_back(random_matrix<Scalar>(c.n_queries, c.dk, seed + 10 + h, 0.5));
    if (c.bias) {
      for (Index r = 0; r < c.n_memory; ++r) {
        // Every seventh row removed (count 0), the others log-count-like.
        const double b =
            r % 7 == 3 ? -std::numeric_limits<double>::infinity() : std::log(1.0 + r % 5);
        bias.push_back(static_cast<Scalar>(b));
        bias_d.push_back(b);
      }
    }
  }
  template <class Arch>
  std::vector<RowMatrix<Scalar>> read() const {
    return run_read<Scalar, Arch>(q, km, vm, bias, kl, vl, mask, beta);
  }
};

template <class Scalar, class Arch>
void check_read_case(const ReadCase& c, std::uint64_t seed) {
  const ReadInputs<Scalar> in(c, seed);
  const auto fast = in.template read<Arch>();
  const auto portable = in.template read<arch::scalar>();
  for (Index h = 0; h < c.heads; ++h) {
    const RowMatrix<double> want =
        read_formula(in.q[h].template cast<double>(), in.km.template cast<double>(),
                     in.vm.template cast<double>(), in.bias_d, in.kl.template cast<double>(),
                     in.vl.template cast<double>(), in.mask, double(in.beta));
    INFO("heads " << c.heads << " Tq " << c.n_queries << " Nm " << c.n_memory << " Nl "
                  << c.n_local << " dk " << c.dk << " dv " << c.dv << " offset " << c.offset
                  << " window " << c.window << " causal " << c.causal);
    CHECK(relative_error(fast[h], want) < 10 * test::tolerance<Scalar>());
    CHECK(relative_error(portable[h], want) < 10 * test::tolerance<Scalar>());
    CHECK(relative_error(fast[h], portable[h]) < 10 * test::tolerance<Scalar>());
  }
}

const std::vector<ReadCase> kReadCases = {
    // heads Tq  Nm   Nl  dk  dv off win causal bias
    {1, 1, 0, 1, 8, 8, 0, 0, true, false},      // a single token
    {1, 5, 0, 5, 16, 12, 0, 0, true, false},    // few queries: unpacked path
    {1, 40, 0, 40, 32, 32, 0, 0, true, false},  // packed path, one partial key tile
    {1, 150, 0, 150, 64, 48, 0, 0, true, false},
    {1, 70, 130, 70, 17, 33, 0, 0, true, true},     // memory with bias, odd widths
    {1, 30, 200, 64, 64, 64, 34, 0, true, true},    // queries at an offset into the chunk
    {1, 100, 80, 100, 24, 8, 0, 50, true, false},   // window reaching into memory
    {1, 100, 80, 100, 24, 8, 0, 1, true, false},    // window 1: only the token itself
    {1, 60, 50, 60, 16, 20, 0, 0, false, false},    // non-causal
    {4, 33, 90, 33, 32, 16, 0, 0, true, true},      // grouped heads stacked in one tile
    {3, 1, 5000, 1, 64, 64, 0, 0, true, true},      // decode over a long memory
    {8, 2, 300, 7, 16, 16, 5, 0, true, true},       // decode, several heads, offset
    {20, 9, 70, 9, 8, 8, 0, 0, true, false},        // more heads than a tile holds rows
    {2, 21, 100, 21, 29, 27, 0, 0, true, true},     // features past the last of 8 and 16 lanes
};

}  // namespace

TEMPLATE_TEST_CASE("read kernel: native architecture == portable == formula", "[kernels][read]",
                   float, double) {
  std::uint64_t seed = 100;
  for (const ReadCase& c : kReadCases) check_read_case<TestType, arch::native>(c, seed += 50);
}

#if defined(OVQ_ARCH_AVX2)
TEST_CASE("read kernel: AVX2 micro-kernels == formula", "[kernels][read]") {
  std::uint64_t seed = 900;
  for (const ReadCase& c : kReadCases) check_read_case<float, arch::avx2>(c, seed += 50);
}

// The AVX-512 kernels' 16-lane template, run on any AVX2 CPU (support/emulated_avx512.hpp).
TEST_CASE("read kernel: AVX-512 micro-kernels (emulated) == portable == formula",
          "[kernels][read][avx512]") {
  std::uint64_t seed = 1900;
  for (const ReadCase& c : kReadCases) check_read_case<float, test::emulated_avx512>(c, seed += 50);
}
#endif

namespace {

// Reads keys at absolute positions [0, n): the first `boundary` as memory (a key/value cache
// starting at `origin`), the rest as local rows; queries are the positions [first, first + count)
// of the local part, in one call. Returns count x dv for one head.
template <class Scalar, class Arch>
RowMatrix<Scalar> read_positions(const RowMatrix<Scalar>& q, const RowMatrix<Scalar>& k,
                                 const RowMatrix<Scalar>& v, Index origin, Index boundary,
                                 Index first, Index count, Index window) {
  const Index n = k.rows();
  const RowMatrix<Scalar> qs = q.middleRows(first, count);
  RowMatrix<Scalar> o(count, v.cols());
  const RowMatrix<Scalar> km = k.topRows(boundary), vm = v.topRows(boundary);
  const RowMatrix<Scalar> kl = k.bottomRows(n - boundary), vl = v.bottomRows(n - boundary);
  const kernels::MemoryRows<Scalar> memory{rows_view(km), rows_view(vm), nullptr, origin};
  const kernels::LocalRows<Scalar> local{rows_view(kl), rows_view(vl)};
  const kernels::ReadMask mask{true, first - boundary, window};
  kernels::read<Scalar, Arch>(rows_view(qs), memory, local, mask, Scalar(0.7), rows_view(o));
  return o;
}

// A query's output is the same bits whether it is read alone (decode), with others (prefill),
// with the stream cut elsewhere (memory/local boundary moved), on one thread or several.
template <class Scalar, class Arch>
void check_read_cut_invariance(Index n, Index d, Index window, Index origin, std::uint64_t seed) {
  const auto q = random_matrix<Scalar>(n, d, seed, 0.6);
  const auto k = random_matrix<Scalar>(n, d, seed + 1);
  const auto v = random_matrix<Scalar>(n, d, seed + 2);
  const Index boundary = n / 3;
  // Reference: the last two thirds of the positions in one call.
  const RowMatrix<Scalar> whole =
      read_positions<Scalar, Arch>(q, k, v, origin, boundary, boundary, n - boundary, window);
  INFO("n " << n << " d " << d << " window " << window << " origin " << origin);
  for (Index cut : {boundary, boundary + 1, boundary + 31, boundary + 64, n - 1}) {
    if (cut >= n) continue;
    // Cut at `cut`: the part before it is memory; every remaining query alone, then all at once.
    for (Index i = cut; i < n; i += std::max<Index>(1, (n - cut) / 7)) {
      const RowMatrix<Scalar> alone = read_positions<Scalar, Arch>(q, k, v, origin, cut, i, 1, window);
      CAPTURE(cut, i);
      CHECK(alone.row(0) == whole.row(i - boundary));
    }
    const RowMatrix<Scalar> rest =
        read_positions<Scalar, Arch>(q, k, v, origin, cut, cut, n - cut, window);
    CAPTURE(cut);
    CHECK(rest == whole.bottomRows(n - cut));
  }
#if defined(OVQ_HAS_OPENMP)
  const int threads = omp_get_max_threads();
  omp_set_num_threads(1);
  const RowMatrix<Scalar> one_thread =
      read_positions<Scalar, Arch>(q, k, v, origin, boundary, boundary, n - boundary, window);
  const RowMatrix<Scalar> last_alone =
      read_positions<Scalar, Arch>(q, k, v, origin, boundary, n - 1, 1, window);
  omp_set_num_threads(threads);
  CHECK(one_thread == whole);
  CHECK(last_alone.row(0) == whole.row(n - 1 - boundary));
#endif
}

}  // namespace

TEMPLATE_TEST_CASE("read kernel: a query's output does not depend on its call, cut or threads",
                   "[kernels][read][cut]", float, double) {
  for (Index window : {0, 1, 50, 700}) {
    check_read_cut_invariance<TestType, arch::native>(2600, 64, window, 0, 7 + window);
    check_read_cut_invariance<TestType, arch::native>(300, 24, window, 1000 + 13, 8 + window);
    check_read_cut_invariance<TestType, arch::native>(200, 13, window, 77, 10 + window);
    check_read_cut_invariance<TestType, arch::scalar>(400, 16, window, 5, 9 + window);
  }
}

#if defined(OVQ_ARCH_AVX2)
TEST_CASE("read kernel: AVX-512 micro-kernels (emulated): a query's output does not depend on "
          "its call, cut or threads",
          "[kernels][read][cut][avx512]") {
  for (Index window : {0, 1, 50, 700}) {
    check_read_cut_invariance<float, test::emulated_avx512>(2600, 64, window, 0, 27 + window);
    // d = 24 and 13: feature tails of 8 and 13 lanes on 16-lane vectors.
    check_read_cut_invariance<float, test::emulated_avx512>(300, 24, window, 1013, 28 + window);
    check_read_cut_invariance<float, test::emulated_avx512>(200, 13, window, 77, 30 + window);
  }
}
#endif

namespace {

// A pacing hook (TileOps, NoPacing) that adds up what a micro-kernel call reports.
struct FlopCounter {
  Index* total;
  Index* largest;
  void advance(Index flops) const {
    *total += flops;
    *largest = std::max(*largest, flops);
  }
};

// P V reports at least every few keys of a register block: the SIMD blocks at most 4096 flops
// at a time whatever dv (AVX-512: 4 rows x 4 vectors x 8 keys); the portable kernel one key of
// one row, 2 dv flops, which is under that bound for every dv tested here (up to 200).
constexpr Index kMaxPacingStep = 4096;

// The read's score micro-kernel (TileOps::scores_rows) on its own: a query row's scores are the
// same bits in every block shape (rows in pairs or alone, any number of rows, any position among
// them), for widths with and without a vector tail, and close to the double formula. The
// pieces are scored with a pacing hook, which changes no bit and hears of every flop.
template <class Scalar, class Arch>
void check_scores_rows(Index d, std::uint64_t seed) {
  using Ops = kernels::TileOps<Scalar, Arch>;
  constexpr Index kTile = Ops::kKeyTile;
  const Index bq = 7;
  const Scalar beta = Scalar(0.75);
  const RowMatrix<Scalar> q = random_matrix<Scalar>(bq, d, seed, 0.5);
  const RowMatrix<Scalar> k = random_matrix<Scalar>(kTile, d, seed + 1);
  const Scalar* keys[kTile];
  for (Index j = 0; j < kTile; ++j) keys[j] = k.data() + j * d;
  std::vector<Scalar> all(static_cast<std::size_t>(bq * kTile));
  Ops::scores_rows(q.data(), d, bq, keys, d, beta, all.data());
  INFO(Arch::kName << " d " << d);
  Index differ = 0;
  for (Index rows = 1; rows <= bq; ++rows) {
    for (Index i0 = 0; i0 + rows <= bq; ++i0) {
      std::vector<Scalar> part(static_cast<std::size_t>(rows * kTile));
      Index flops = 0, largest = 0;
      Ops::scores_rows(q.data() + i0 * d, d, rows, keys, d, beta, part.data(),
                       FlopCounter{&flops, &largest});
      CHECK(flops == 2 * rows * kTile * d);
      CHECK(largest <= 32 * d);  // a block of at most 6 rows x 2 keys, or 4 x 4
      for (Index x = 0; x < rows * kTile; ++x)
        differ += part[static_cast<std::size_t>(x)] != all[static_cast<std::size_t>(i0 * kTile + x)];
    }
  }
  CHECK(differ == 0);
  double worst = 0;
  for (Index i = 0; i < bq; ++i) {
    for (Index j = 0; j < kTile; ++j) {
      double want = 0, scale = 0;
      for (Index c = 0; c < d; ++c) {
        want += double(q(i, c)) * double(k(j, c));
        scale += std::abs(double(q(i, c)) * double(k(j, c)));
      }
      want *= double(beta);
      scale *= double(beta);
      const double got = double(all[static_cast<std::size_t>(i * kTile + j)]);
      worst = std::max(worst, std::abs(got - want) / (scale + 1e-30));
    }
  }
  CHECK(worst < 10 * test::tolerance<Scalar>());
}

// Many rows score a tile from a packed panel of its keys (lanes_panel: scores_rows from
// kPanelMinRows rows, and scores_rows_packed from pack_keys for any number), a few from the key
// rows in place (dot_products and reduce8): the same lanes and the same tree, so the same bits.
// Each row of a 39-row call (blocks of 4, 2 and 1 rows), and of packed calls of 1 to 5 rows,
// against the row alone in place, feature tails included, queries as elements or in the
// kernels' query type, with an infinity in one key (NaN and infinite scores, which must come
// out alike).
template <class Element, class Arch>
void check_panel_scores_match_rows(Index d, std::uint64_t seed) {
  using Ops = kernels::TileOps<Element, Arch>;
  constexpr Index kTile = Ops::kKeyTile;
  const Index bq = 39;
  REQUIRE(bq >= Ops::kPanelMinRows);  // scores_rows takes the panel path
  const RowMatrix<float> qf = random_matrix<float>(bq, d, seed, 0.5);
  const RowMatrix<float> kf = random_matrix<float>(kTile, d, seed + 1);
  std::vector<Element> q(static_cast<std::size_t>(bq * d)), k(static_cast<std::size_t>(kTile * d));
  std::vector<typename Ops::Query> q_held(q.size());
  for (Index x = 0; x < bq * d; ++x) {
    q[static_cast<std::size_t>(x)] = narrow<Element>(qf.data()[x]);
    q_held[static_cast<std::size_t>(x)] =
        static_cast<typename Ops::Query>(widen(q[static_cast<std::size_t>(x)]));
  }
  for (Index x = 0; x < kTile * d; ++x) k[static_cast<std::size_t>(x)] = narrow<Element>(kf.data()[x]);
  k[static_cast<std::size_t>(5 * d + d / 2)] = narrow<Element>(std::numeric_limits<float>::infinity());
  const Element* keys[kTile];
  for (Index j = 0; j < kTile; ++j) keys[j] = k.data() + j * d;
  std::vector<float> alone(static_cast<std::size_t>(bq * kTile));
  Index non_finite = 0;
  for (Index i = 0; i < bq; ++i) {
    Ops::scores_rows(q.data() + i * d, d, 1, keys, d, 0.75f, alone.data() + i * kTile);
    for (Index j = 0; j < kTile; ++j) non_finite += !std::isfinite(alone[static_cast<std::size_t>(i * kTile + j)]);
  }
  CHECK(non_finite == bq);  // key 5's column
  std::vector<float> packed(static_cast<std::size_t>(Ops::packed_key_words(d)));
  Ops::pack_keys(keys, d, packed.data());
  INFO(Arch::kName << " d " << d);
  const auto differ = [&](const std::vector<float>& got, Index rows) {
    return std::memcmp(got.data(), alone.data(), static_cast<std::size_t>(rows * kTile) * sizeof(float)) != 0;
  };
  std::vector<float> got(alone.size());
  Ops::scores_rows(q.data(), d, bq, keys, d, 0.75f, got.data());
  CHECK(!differ(got, bq));
  Ops::scores_rows(q_held.data(), d, bq, keys, d, 0.75f, got.data());
  CHECK(!differ(got, bq));
  for (Index rows : {bq, Index(1), Index(2), Index(3), Index(4), Index(5)}) {
    Ops::scores_rows_packed(q_held.data(), d, rows, keys, packed.data(), d, 0.75f, got.data());
    CHECK(!differ(got, rows));
  }
}

template <class Element>
void check_panel_scores_every_arch(Index d) {
  const std::uint64_t seed = 300 + static_cast<std::uint64_t>(d);
#if defined(OVQ_ARCH_AVX2)
  check_panel_scores_match_rows<Element, arch::avx2>(d, seed);
  check_panel_scores_match_rows<Element, test::emulated_avx512>(d, seed);
#endif
#if defined(OVQ_ARCH_AVX512)
  check_panel_scores_match_rows<Element, arch::avx512>(d, seed);
#endif
  if constexpr (std::is_same_v<Element, bf16>) {  // pair dot products
#if defined(OVQ_ARCH_AVX2)
    check_panel_scores_match_rows<Element, test::emulated_avx512bf16>(d, seed);
#endif
#if defined(OVQ_ARCH_AVX512BF16)
    check_panel_scores_match_rows<Element, arch::avx512bf16>(d, seed);
#endif
  }
  (void)seed;
}

}  // namespace

TEMPLATE_TEST_CASE("read kernel: a row's scores do not depend on the rows scored with it",
                   "[kernels][read][cut]", float, double) {
  for (Index d : {1, 5, 8, 13, 16, 17, 24, 64, 67, 128}) {
    check_scores_rows<TestType, arch::native>(d, 40 + static_cast<std::uint64_t>(d));
    check_scores_rows<TestType, arch::scalar>(d, 60 + static_cast<std::uint64_t>(d));
#if defined(OVQ_ARCH_AVX2)
    check_scores_rows<TestType, arch::avx2>(d, 80 + static_cast<std::uint64_t>(d));
    check_scores_rows<TestType, test::emulated_avx512>(d, 100 + static_cast<std::uint64_t>(d));
#endif
  }
}

TEST_CASE("read kernel: scores from a packed panel are the in-place scores bit for bit",
          "[kernels][read][simd]") {
  for (Index d : {1, 5, 8, 13, 16, 17, 24, 64, 67, 128}) {
    check_panel_scores_every_arch<float>(d);
    check_panel_scores_every_arch<bf16>(d);
    check_panel_scores_every_arch<fp16>(d);
  }
}

// accumulate over rows [i0, i0 + rows) of a 7-row tile gives the bits of the whole tile's call
// (6-row blocks, 4-row blocks on AVX2, pairs and single rows, single rows in runs of keys), a
// call with per-row factors those of scale() then accumulate, and P V within rounding.
// The pieces run with a pacing hook, as in check_scores_rows. Values are Elements (16-bit ones
// widened by the kernels), weights and accumulators their compute type.
template <class Element, class Arch>
void check_accumulate_rows(Index dv, Index bk, std::uint64_t seed) {
  using Scalar = compute_t<Element>;
  using Ops = kernels::TileOps<Element, Arch>;
  constexpr Index kTile = Ops::kKeyTile;
  const Index bq = 7;
  const RowMatrix<Scalar> p = random_matrix<Scalar>(bq, kTile, seed, 0.5);
  const RowMatrix<Element> v = random_matrix<Scalar>(bk, dv, seed + 1).template cast<Element>();
  const RowMatrix<Scalar> start = random_matrix<Scalar>(bq, dv, seed + 2);
  RowMatrix<Scalar> all = start;
  Ops::accumulate(p.data(), bq, bk, v.data(), dv, dv, all.data(), dv);
  INFO(Arch::kName << " dv " << dv << " bk " << bk);
  Index differ = 0;
  for (Index rows = 1; rows <= bq; ++rows) {
    for (Index i0 = 0; i0 + rows <= bq; ++i0) {
      RowMatrix<Scalar> part = start.middleRows(i0, rows);
      Index flops = 0, largest = 0;
      Ops::accumulate(p.data() + i0 * kTile, rows, bk, v.data(), dv, dv, part.data(), dv,
                      FlopCounter{&flops, &largest});
      CHECK(flops == 2 * rows * bk * dv);
      CHECK(largest <= kMaxPacingStep);
      for (Index i = 0; i < rows; ++i)
        for (Index c = 0; c < dv; ++c) differ += part(i, c) != all(i0 + i, c);
    }
  }
  CHECK(differ == 0);
  // With per-row factors (the read's rescaling of its running averages, zero and one among
  // them): the bits of a pass of scale() over each row, then accumulate.
  RowVector<Scalar> keep = p.col(0).transpose().array() + Scalar(0.25);
  keep(1) = Scalar(1);
  keep(4) = Scalar(0);
  RowMatrix<Scalar> kept = start, scaled = start;
  Ops::accumulate(p.data(), bq, bk, v.data(), dv, dv, kept.data(), dv, kernels::NoPacing{},
                  keep.data());
  for (Index i = 0; i < bq; ++i) Ops::scale(scaled.row(i).data(), dv, keep(i));
  Ops::accumulate(p.data(), bq, bk, v.data(), dv, dv, scaled.data(), dv);
  Index differ_kept = 0;
  for (Index i = 0; i < bq; ++i)
    for (Index c = 0; c < dv; ++c) differ_kept += kept(i, c) != scaled(i, c);
  CHECK(differ_kept == 0);
  double worst = 0;
  for (Index i = 0; i < bq; ++i) {
    for (Index c = 0; c < dv; ++c) {
      double want = double(start(i, c)), scale = std::abs(want);
      for (Index j = 0; j < bk; ++j) {
        const double term = double(p(i, j)) * double(widen(v(j, c)));
        want += term;
        scale += std::abs(term);
      }
      worst = std::max(worst, std::abs(double(all(i, c)) - want) / (scale + 1e-30));
    }
  }
  CHECK(worst < 10 * test::tolerance<Scalar>());
}

#if defined(OVQ_ARCH_AVX2)
// reduce8's first level has two forms (across the 128-bit lanes, or each vector's halves added
// as 128-bit vectors); the build takes one by its tuning target. Both must add the same pairs,
// operands in the same order, so that scores have the same bits either way: checked on random
// values, signed zeros, infinities, NaNs and subnormals, and reduce8 against its tree by hand.
TEST_CASE("read kernel: both forms of reduce8's first level give the same bits",
          "[kernels][read]") {
  using kernels::simd::reduce8_level1_across;
  using kernels::simd::reduce8_level1_halves;
  constexpr float kInf = std::numeric_limits<float>::infinity();
  const auto noise = random_matrix<float>(64, 8, 97, 1e3);
  std::vector<float> x(noise.data(), noise.data() + noise.size());
  const float specials[] = {-0.0f, kInf, -kInf, std::numeric_limits<float>::quiet_NaN(),
                            std::numeric_limits<float>::denorm_min(),
                            std::numeric_limits<float>::max()};
  for (std::size_t i = 0; i < std::size(specials); ++i) x[7 * i + 3] = specials[i];
  Index differ = 0, wrong_tree = 0;
  for (Index a = 0; a + 1 < 64; ++a) {
    const __m256 va = _mm256_loadu_ps(&x[static_cast<std::size_t>(8 * a)]);
    const __m256 vb = _mm256_loadu_ps(&x[static_cast<std::size_t>(8 * a + 8)]);
    float across[8], halves[8];
    _mm256_storeu_ps(across, reduce8_level1_across(va, vb));
    _mm256_storeu_ps(halves, reduce8_level1_halves(va, vb));
    differ += std::memcmp(across, halves, sizeof(across)) != 0;
  }
  for (Index a = 0; a + 8 <= 64; a += 8) {
    __m256 in[8];
    for (int v = 0; v < 8; ++v) in[v] = _mm256_loadu_ps(&x[static_cast<std::size_t>(8 * (a + v))]);
    float got[8];
    _mm256_storeu_ps(got, kernels::simd::reduce8(in));
    for (int v = 0; v < 8; ++v) {
      const float* e = &x[static_cast<std::size_t>(8 * (a + v))];
      const float want = ((e[0] + e[4]) + (e[2] + e[6])) + ((e[1] + e[5]) + (e[3] + e[7]));
      wrong_tree += std::memcmp(&got[v], &want, sizeof(float)) != 0 &&
                    !(std::isnan(got[v]) && std::isnan(want));
    }
  }
  CHECK(differ == 0);
  CHECK(wrong_tree == 0);
}
#endif

TEMPLATE_TEST_CASE("read kernel: a row's P V does not depend on the rows accumulated with it",
                   "[kernels][read][cut]", float, double, bf16, fp16) {
  std::uint64_t seed = 300;
  for (Index dv : {1, 5, 8, 13, 64, 67, 128, 200}) {
    for (Index bk : {1, 3, 4, 5, 9, 32, 64}) {
      // Each architecture up to its own key tile (the keys of one tile).
      auto check = [&](auto arch_tag) {
        using Arch = decltype(arch_tag);
        if (bk <= kernels::TileOps<TestType, Arch>::kKeyTile)
          check_accumulate_rows<TestType, Arch>(dv, bk, seed++);
      };
      check(arch::native{});
      check(arch::scalar{});
#if defined(OVQ_ARCH_AVX2)
      check(arch::avx2{});
      check(test::emulated_avx512{});
#endif
    }
  }
}

// The softmax bookkeeping of one score row: the SIMD mask_max and scale against the portable
// ones, bit for bit, on every visible range and on scores that overflowed (+-inf) or are NaN.
template <class Arch>
void check_row_bookkeeping() {
  using Ops = kernels::TileOps<float, Arch>;
  using Portable = kernels::TileOps<float, arch::scalar>;
  constexpr Index kTile = Ops::kKeyTile;
  constexpr float kInf = std::numeric_limits<float>::infinity();
  const auto noise = random_matrix<float>(1, kTile, 91, 3.0);
  std::vector<float> scores(noise.data(), noise.data() + kTile);
  scores[1] = kInf;
  scores[2] = -kInf;
  scores[kTile / 2] = std::numeric_limits<float>::quiet_NaN();
  scores[kTile - 1] = 1e30f;
  Index differ = 0, wrong_max = 0;
  for (Index lo = 0; lo <= kTile; ++lo) {
    for (Index hi = lo; hi <= kTile; ++hi) {
      std::vector<float> simd = scores, portable = scores;
      const float got = Ops::mask_max(simd.data(), lo, hi);
      // The portable kernel's tile may be longer: the slots past kTile are not visible.
      portable.resize(static_cast<std::size_t>(Portable::kKeyTile), 0.0f);
      const float want = Portable::mask_max(portable.data(), lo, hi);
      wrong_max += !(got == want);
      for (Index j = 0; j < kTile; ++j)
        differ += std::memcmp(&simd[static_cast<std::size_t>(j)],
                              &portable[static_cast<std::size_t>(j)], sizeof(float)) != 0;
    }
  }
  INFO(Arch::kName);
  CHECK(differ == 0);
  CHECK(wrong_max == 0);
  // The visible slots are finite (NaN and -inf saturate to -max, +inf to +max), the rest -inf.
  std::vector<float> row = scores;
  CHECK(Ops::mask_max(row.data(), 1, kTile) == std::numeric_limits<float>::max());
  CHECK(row[0] == -kInf);
  CHECK(row[2] == -std::numeric_limits<float>::max());
  CHECK(row[static_cast<std::size_t>(kTile / 2)] == -std::numeric_limits<float>::max());
  CHECK(Ops::mask_max(row.data(), 3, 3) == -kInf);
  for (Index n : {Index(1), Index(7), Index(8), Index(13), Index(16), Index(67), Index(128)}) {
    std::vector<float> x(noise.data(), noise.data() + std::min(n, kTile));
    x.resize(static_cast<std::size_t>(n), 2.5f);
    std::vector<float> y = x;
    Ops::scale(x.data(), n, 0.37f);
    Portable::scale(y.data(), n, 0.37f);
    CAPTURE(n);
    CHECK(x == y);
  }
}

TEST_CASE("read kernel: masking, saturation and rescaling of a score row == portable",
          "[kernels][read]") {
  check_row_bookkeeping<arch::native>();
#if defined(OVQ_ARCH_AVX2)
  check_row_bookkeeping<arch::avx2>();
  check_row_bookkeeping<test::emulated_avx512>();
#endif
}

TEMPLATE_TEST_CASE("read kernel: a long decode split across threads == the prefill's rows",
                   "[kernels][read][cut]", float, double) {
  // 20000 keys x 2 x 128 flops: enough work for the decode path to split the memory's merge
  // blocks across threads; the prefill of the last 150 positions splits query tiles instead.
  const Index n = 20000, d = 64, tail = 150;
  const auto q = random_matrix<TestType>(n, d, 31, 0.3);
  const auto k = random_matrix<TestType>(n, d, 32);
  const auto v = random_matrix<TestType>(n, d, 33);
  const RowMatrix<TestType> prefill =
      read_positions<TestType, arch::native>(q, k, v, 0, n - tail, n - tail, tail, 0);
  for (Index i : {n - tail, n - tail + 77, n - 1}) {
    const RowMatrix<TestType> alone =
        read_positions<TestType, arch::native>(q, k, v, 0, i, i, 1, 0);
    CAPTURE(i);
    CHECK(alone.row(0) == prefill.row(i - (n - tail)));
  }
}

TEMPLATE_TEST_CASE("read kernel: a grouped decode over a long memory == each head alone",
                   "[kernels][read]", float, double) {
  // 2100 memory rows of 128 + 128 scalars (2.1 MB in float) read by 2 to 8 stacked rows: the
  // read prefetches its stream (read_detail::kPrefetchMinBytes; from 2 float rows, 4 double
  // ones), which a single float head does not. Keys and values are strided views into wider
  // matrices (the prefetch walks rows, not one block). Stacking changes no bit of a row, so the
  // group must equal its heads read alone.
  const Index n_memory = 2100, d = 128, pad = 8;
  STATIC_REQUIRE(kernels::read_detail::kPrefetchMinRows<float> == 2);
  STATIC_REQUIRE(kernels::read_detail::kPrefetchMinRows<double> == 4);
  REQUIRE(static_cast<double>(n_memory) * 2 * d * sizeof(float) >=
          kernels::read_detail::kPrefetchMinBytes);
  const auto km = random_matrix<TestType>(n_memory, d + pad, 41);
  const auto vm = random_matrix<TestType>(n_memory, d + pad, 42);
  const auto kl = random_matrix<TestType>(2, d, 43);
  const auto vl = random_matrix<TestType>(2, d, 44);
  std::vector<TestType> bias;
  for (Index r = 0; r < n_memory; ++r) bias.push_back(static_cast<TestType>(std::log(1.0 + r % 3)));
  const kernels::MemoryRows<TestType> memory{{km.data() + pad / 2, n_memory, d, d + pad},
                                             {vm.data() + pad, n_memory, d, d + pad},
                                             bias.data()};
  const kernels::LocalRows<TestType> local{rows_view(kl), rows_view(vl)};
  const TestType beta = TestType(0.1);
  for (Index heads : {2, 4, 8}) {
    for (Index n_queries : {Index(1), Index(2)}) {
      if (heads * n_queries > kernels::read_detail::kPrefetchMaxRows) continue;
      const kernels::ReadMask mask{true, 2 - n_queries, 0};
      std::vector<RowMatrix<TestType>> q, grouped, alone;
      for (Index h = 0; h < heads; ++h) {
        q.push_back(random_matrix<TestType>(n_queries, d, 50 + h, 0.5));
        grouped.emplace_back(n_queries, d);
        alone.emplace_back(n_queries, d);
      }
      std::vector<ConstRowsView<TestType>> qv;
      std::vector<RowsView<TestType>> ov;
      for (Index h = 0; h < heads; ++h) {
        qv.push_back(rows_view(q[h]));
        ov.push_back(rows_view(grouped[h]));
      }
      kernels::read<TestType>(qv.data(), heads, memory, local, mask, beta, ov.data());
      for (Index h = 0; h < heads; ++h) {
        kernels::read<TestType>(rows_view(q[h]), memory, local, mask, beta, rows_view(alone[h]));
        CAPTURE(heads, n_queries, h);
        CHECK(grouped[h] == alone[h]);
      }
      // And against the formula (one head is enough: the others are equal to theirs alone).
      std::vector<double> bias_d(bias.begin(), bias.end());
      const RowMatrix<double> want = read_formula(
          q[0].template cast<double>(),
          km.leftCols(d + pad / 2).rightCols(d).template cast<double>(),
          vm.rightCols(d).template cast<double>(), bias_d, kl.template cast<double>(),
          vl.template cast<double>(), mask, 0.1);
      CHECK(relative_error(grouped[0], want) < 10 * test::tolerance<TestType>());
    }
  }
}

TEMPLATE_TEST_CASE("read kernel: a 16-bit decode row over a long memory (prefetched) == its row in "
                   "a prefill tile (not prefetched)",
                   "[kernels][read][half]", bf16, fp16) {
  // 4200 memory rows of 128 + 128 16-bit elements (2.15 MB): a single 16-bit row prefetches its
  // stream (read_detail::kPrefetchMinRows), 9 rows in one tile do not (kPrefetchMaxRows). A
  // row's bits do not depend on its tile, so each decode row must equal its row of the prefill.
  const Index boundary = 4200, count = 9, n = boundary + count, d = 128;
  STATIC_REQUIRE(kernels::read_detail::kPrefetchMinRows<TestType> == 1);
  STATIC_REQUIRE(count > kernels::read_detail::kPrefetchMaxRows);
  REQUIRE(static_cast<double>(boundary) * 2 * d * sizeof(TestType) >=
          kernels::read_detail::kPrefetchMinBytes);
  const auto q = random_matrix<TestType>(n, d, 61, 0.3);
  const auto k = random_matrix<TestType>(n, d, 62);
  const auto v = random_matrix<TestType>(n, d, 63);
  const auto check = [&](auto arch) {
    using Arch = decltype(arch);
    INFO(Arch::kName);
    const RowMatrix<TestType> prefill =
        read_positions<TestType, Arch>(q, k, v, 0, boundary, boundary, count, 0);
    for (Index i = boundary; i < n; i += 4) {
      const RowMatrix<TestType> alone = read_positions<TestType, Arch>(q, k, v, 0, i, i, 1, 0);
      CAPTURE(i);
      CHECK(alone.row(0) == prefill.row(i - boundary));
    }
  };
  check(arch::native{});
#if defined(OVQ_ARCH_AMX)
  if constexpr (std::is_same_v<TestType, bf16>) check(arch::amx{});
#endif
}

// Records the cache lines a TileStream asks for, in order.
struct RecordedPrefetch {
  static inline std::vector<std::uintptr_t> lines;
  static void line(const void* address) {
    lines.push_back(reinterpret_cast<std::uintptr_t>(address));
  }
};

TEST_CASE("read kernel: the tile stream asks for every line of its rows once, paced by flops",
          "[kernels][read]") {
  // Keys of 37 floats (148 bytes) 50 apart and values of 16 floats 21 apart, from addresses off
  // the cache lines: a row covers 3 to 4 lines, or 1 to 2.
  using Stream = kernels::read_detail::TileStream<float, RecordedPrefetch>;
  std::vector<float> keys(40 * 50), values(40 * 21);
  const kernels::MemoryRows<float> memory{
      {keys.data() + 3, 39, 37, 50}, {values.data() + 1, 39, 16, 21}, nullptr};
  // The lines of rows [first, last): the keys' rows, then the values', each row's lines in order.
  auto lines_of = [&](Index first, Index last) {
    std::vector<std::uintptr_t> want;
    for (const ConstRowsView<float>& rows : {memory.keys, memory.values}) {
      for (Index r = first; r < last; ++r) {
        const auto begin = reinterpret_cast<std::uintptr_t>(rows.row(r));
        const std::uintptr_t end = begin + static_cast<std::uintptr_t>(rows.cols) * sizeof(float);
        for (std::uintptr_t a = begin; a < end; a = (a / 64 + 1) * 64) want.push_back(a / 64 * 64);
      }
    }
    return want;
  };
  Stream stream;
  const Index flops = 1000;
  const std::pair<Index, Index> ranges[] = {{5, 37}, {0, 1}, {38, 39}};
  for (const auto& [first, last] : ranges) {
    RecordedPrefetch::lines.clear();
    stream.start(memory, first, last, flops);
    const std::vector<std::uintptr_t> want = lines_of(first, last);
    REQUIRE(stream.lines() == static_cast<Index>(want.size()));
    CHECK(RecordedPrefetch::lines.empty());
    // In proportion to the flops reported, never ahead of them.
    Index done = 0, wrong = 0;
    for (Index step : {1, 7, 90, 2, 300, 100, 250, 249}) {
      stream.advance(step);
      done += step;
      wrong += stream.issued() != stream.lines() * done / flops;
      wrong += static_cast<Index>(RecordedPrefetch::lines.size()) != stream.issued();
    }
    CAPTURE(first, last);
    CHECK(wrong == 0);
    CHECK(stream.issued() < stream.lines());  // 999 of 1000 flops
    stream.advance(5);                        // past the end: everything, once
    CHECK(RecordedPrefetch::lines == want);
    stream.advance(100);
    stream.finish();
    CHECK(RecordedPrefetch::lines == want);
  }
  // finish() sends what the flops have not; an empty range sends nothing.
  RecordedPrefetch::lines.clear();
  stream.start(memory, 10, 20, flops);
  stream.advance(400);
  stream.finish();
  CHECK(RecordedPrefetch::lines == lines_of(10, 20));
  RecordedPrefetch::lines.clear();
  stream.start(memory, 39, 39, flops);
  stream.advance(flops);
  stream.finish();
  CHECK(stream.lines() == 0);
  CHECK(RecordedPrefetch::lines.empty());
}

TEMPLATE_TEST_CASE("read kernel: rows at any address give the same bits; scratch is aligned",
                   "[kernels][read]", float, double) {
  // The kernels' scratch (stacked queries, scores, accumulators) is aligned for speed
  // (AlignedVector); the caller's rows are read with unaligned loads wherever they start. Copies
  // of the same rows one scalar past an aligned address, with a row stride of d + 1 (so that
  // the rows start at several offsets modulo the vector width, none of them aligned), must give
  // the aligned rows' bits.
  const Index n = 300, boundary = 200, d = 37, dv = 21;
  const auto q = random_matrix<TestType>(n, d, 61, 0.5);
  const auto k = random_matrix<TestType>(n, d, 62);
  const auto v = random_matrix<TestType>(n, dv, 63);
  // rows x cols of m into storage at data + 1, stride cols + 1.
  auto shifted = [](const RowMatrix<TestType>& m, AlignedVector<TestType>& storage) {
    storage.assign(static_cast<std::size_t>(m.rows() * (m.cols() + 1) + 1), TestType(0));
    TestType* data = storage.data() + 1;
    for (Index i = 0; i < m.rows(); ++i)
      std::copy(m.row(i).data(), m.row(i).data() + m.cols(), data + i * (m.cols() + 1));
    return RowsView<TestType>{data, m.rows(), m.cols(), m.cols() + 1};
  };
  AlignedVector<TestType> q_store, k_store, v_store;
  const RowsView<TestType> qs = shifted(q, q_store), ks = shifted(k, k_store),
                           vs = shifted(v, v_store);
  auto read_rows = [&](ConstRowsView<TestType> qv, ConstRowsView<TestType> kv,
                       ConstRowsView<TestType> vv, Index first, Index count) {
    RowMatrix<TestType> o(count, dv);
    const kernels::MemoryRows<TestType> memory{kv.middle_rows(0, boundary),
                                               vv.middle_rows(0, boundary), nullptr, 0};
    const kernels::LocalRows<TestType> local{kv.middle_rows(boundary, n - boundary),
                                             vv.middle_rows(boundary, n - boundary)};
    const kernels::ReadMask mask{true, first - boundary, 0};
    kernels::read<TestType>(qv.middle_rows(first, count), memory, local, mask, TestType(0.4),
                            rows_view(o));
    return o;
  };
  // A prefill of the local rows, and a single-row decode at the end.
  for (const auto& [first, count] : {std::pair<Index, Index>{boundary, n - boundary}, {n - 1, 1}}) {
    CAPTURE(first, count);
    CHECK(read_rows(qs, ks, vs, first, count) ==
          read_rows(rows_view(q), rows_view(k), rows_view(v), first, count));
  }
  // The scratch starts on Eigen's widest vector for any shape (that is its point).
  for (Index rows : {1, 4, 64})
    for (Index width : {Index(1), d, Index(128)}) {
      kernels::read_detail::TileBuffers<TestType, TestType> buf(rows, width, width, 32);
      CAPTURE(rows, width);
      CHECK(reinterpret_cast<std::uintptr_t>(buf.q.data()) % EIGEN_MAX_ALIGN_BYTES == 0);
      CHECK(reinterpret_cast<std::uintptr_t>(buf.scores.data()) % EIGEN_MAX_ALIGN_BYTES == 0);
      CHECK(reinterpret_cast<std::uintptr_t>(buf.acc.data()) % EIGEN_MAX_ALIGN_BYTES == 0);
    }
}

TEST_CASE("read kernel: huge logits stay finite and pick the maximum", "[kernels][read]") {
  // beta q . k spans thousands: exp of the differences underflows to exactly 0 everywhere but
  // at the maximum, without NaN.
  const auto q = random_matrix<float>(20, 16, 1, 50.0);
  const auto k = random_matrix<float>(20, 16, 2, 50.0);
  const auto v = random_matrix<float>(20, 4, 3);
  const auto o = run_read<float, arch::native>({q}, RowMatrix<float>(0, 16), RowMatrix<float>(0, 4),
                                               {}, k, v, kernels::ReadMask{}, 1.0f);
  for (Index i = 0; i < 20; ++i) {
    Index best = 0;
    for (Index j = 1; j <= i; ++j)
      if (q.row(i).dot(k.row(j)) > q.row(i).dot(k.row(best))) best = j;
    CHECK((o[0].row(i) - v.row(best)).norm() < 1e-4f);
  }
}

TEMPLATE_TEST_CASE("assign_nearest: native == portable == formula", "[kernels][assign]", float,
                   double) {
  for (Index n : {1, 7, 64, 65, 300}) {
    for (Index d : {3, 16, 40}) {
      const auto x = random_matrix<TestType>(45, d, 7 * n + d);
      const auto c = random_matrix<TestType>(n, d, 11 * n + d);
      std::vector<TestType> offset(static_cast<std::size_t>(n));
      for (Index r = 0; r < n; ++r) offset[r] = TestType(-0.5) * c.row(r).squaredNorm();
      std::vector<TestType> best_fast(45), best_port(45);
      std::vector<Index> arg_fast(45), arg_port(45);
      kernels::assign_nearest<TestType, arch::native>(rows_view(x), rows_view(c), offset.data(),
                                                      best_fast.data(), arg_fast.data());
      kernels::assign_nearest<TestType, arch::scalar>(rows_view(x), rows_view(c), offset.data(),
                                                      best_port.data(), arg_port.data());
      const std::vector<Index> nearest =
          ref::quantise(x.template cast<double>(), c.template cast<double>());
      for (Index i = 0; i < 45; ++i) {
        INFO("n " << n << " d " << d << " row " << i);
        CHECK(arg_fast[i] == nearest[i]);
        CHECK(arg_port[i] == nearest[i]);
        CHECK(std::abs(best_fast[i] - best_port[i]) <= 1e-4 * (1 + std::abs(best_port[i])));
      }
#if defined(OVQ_ARCH_AVX2)
      // The AVX-512 kernels' 16-lane template (emulated), whose centroid tiles hold 64 rows.
      kernels::assign_nearest<TestType, test::emulated_avx512>(
          rows_view(x), rows_view(c), offset.data(), best_fast.data(), arg_fast.data());
      for (Index i = 0; i < 45; ++i) {
        INFO("emulated AVX-512: n " << n << " d " << d << " row " << i);
        CHECK(arg_fast[i] == nearest[i]);
        CHECK(std::abs(best_fast[i] - best_port[i]) <= 1e-4 * (1 + std::abs(best_port[i])));
      }
#endif
    }
  }
}

TEST_CASE("assign_nearest: ties go to the smallest index, no centroid gives -1", "[kernels][assign]") {
  RowMatrix<float> c(4, 2);
  c << 1, 0, 0, 1, 1, 0, 0, 1;  // rows 0/2 and 1/3 identical
  RowMatrix<float> x(3, 2);
  x << 2, 0, 0, 3, 1, 1;        // the last is tied between all four
  std::vector<float> best(3);
  std::vector<Index> arg(3);
  kernels::assign_nearest<float>(rows_view(x), rows_view(c), nullptr, best.data(), arg.data());
  CHECK(arg == std::vector<Index>{0, 1, 0});
  kernels::assign_nearest<float>(rows_view(x), rows_view(c.topRows(0)), nullptr, best.data(),
                                 arg.data());
  CHECK(arg == std::vector<Index>{-1, -1, -1});
  CHECK(best[0] == -std::numeric_limits<float>::infinity());
}

namespace {

// Special values for any_greater: NaN, both infinities, both zeros, the largest finite value,
// and ordinary ones.
std::vector<float> special_scores() {
  const float inf = std::numeric_limits<float>::infinity();
  const float big = std::numeric_limits<float>::max();
  return {std::numeric_limits<float>::quiet_NaN(), inf, -inf, 0.0f, -0.0f, big, -big,
          1.5f, -2.25f, 0.75f, 3.0f};
}

template <class Arch>
void check_any_greater() {
  using Ops = kernels::TileOps<float, Arch>;
  const std::vector<float> values = special_scores();
  const auto nv = static_cast<Index>(values.size());
  std::uint64_t state = 12345;
  for (Index n : {1, 3, 8, 15, 16, 17, 33, 64}) {
    for (int trial = 0; trial < 60; ++trial) {
      std::vector<float> s(static_cast<std::size_t>(n)), o(static_cast<std::size_t>(n));
      for (Index j = 0; j < n; ++j) {
        s[j] = values[ovq::detail::splitmix64(state) % nv];
        o[j] = values[ovq::detail::splitmix64(state) % nv];
      }
      // Mostly NaN or -inf rows too, so that "nothing greater" is often the answer.
      if (trial % 3 == 0)
        for (Index j = 0; j < n; ++j)
          if (ovq::detail::splitmix64(state) % 4 != 0) s[j] = trial % 2 ? -values[1] : values[0];
      for (float t : values) {
        const float* const offsets[] = {nullptr, o.data()};
        for (const float* offset : offsets) {
          bool want = false;
          for (Index j = 0; j < n; ++j)
            want = want || (offset != nullptr ? s[j] + offset[j] : s[j]) > t;
          INFO(Arch::kName << " n " << n << " trial " << trial << " threshold " << t
                           << (offset ? " with offsets" : ""));
          CHECK(Ops::any_greater(s.data(), offset, n, t) == want);
        }
      }
    }
  }
}

// assign_nearest against the argmax of the same architecture's scores, every tile scanned:
// skipping the tiles that any_greater rules out must change no bit of best and no index.
template <class Arch>
void check_assign_skips_exactly(Index n, Index d, bool with_offset, bool duplicates,
                                std::uint64_t seed) {
  using Ops = kernels::TileOps<float, Arch>;
  constexpr Index kTile = Ops::kKeyTile;
  const Index rows = 40;
  const auto x = random_matrix<float>(rows, d, seed);
  auto c = random_matrix<float>(n, d, seed + 1);
  if (duplicates)  // every centroid repeated later on: ties across tiles
    for (Index r = n / 2; r < n; ++r) c.row(r) = c.row(r - n / 2);
  std::vector<float> offset(static_cast<std::size_t>(n));
  for (Index r = 0; r < n; ++r) offset[r] = -0.5f * c.row(r).squaredNorm();
  const float* off = with_offset ? offset.data() : nullptr;
  std::vector<float> best(static_cast<std::size_t>(rows));
  std::vector<Index> arg(static_cast<std::size_t>(rows));
  kernels::assign_nearest<float, Arch>(rows_view(x), rows_view(c), off, best.data(), arg.data());
  std::vector<float> scores(static_cast<std::size_t>(kTile));
  for (Index i = 0; i < rows; ++i) {
    float b = -std::numeric_limits<float>::infinity();
    Index a = -1;
    for (Index r0 = 0; r0 < n; r0 += kTile) {
      const float* keys[kTile];
      for (Index j = 0; j < kTile; ++j) keys[j] = c.row(r0 + j < n ? r0 + j : r0).data();
      Ops::scores_rows(x.row(i).data(), d, 1, keys, d, 1.0f, scores.data());
      for (Index j = 0; j < std::min(kTile, n - r0); ++j) {
        const float v = off != nullptr ? scores[j] + off[r0 + j] : scores[j];
        if (v > b || a < 0) {
          b = v;
          a = r0 + j;
        }
      }
    }
    INFO(Arch::kName << " n " << n << " d " << d << " row " << i);
    CHECK(arg[i] == a);
    CHECK(std::memcmp(&best[i], &b, sizeof b) == 0);
  }
}

}  // namespace

TEST_CASE("any_greater: every architecture answers as the definition, NaN and infinities included",
          "[kernels][assign]") {
  check_any_greater<arch::scalar>();
  check_any_greater<arch::native>();
#if defined(OVQ_ARCH_AVX2)
  check_any_greater<test::emulated_avx512>();
#endif
}

TEST_CASE("assign_nearest: tiles skipped by any_greater leave best and arg bit for bit",
          "[kernels][assign]") {
  std::uint64_t seed = 900;
  for (Index n : {1, 63, 64, 130, 700}) {
    for (Index d : {5, 32}) {
      for (bool with_offset : {false, true}) {
        for (bool duplicates : {false, true}) {
          check_assign_skips_exactly<arch::scalar>(n, d, with_offset, duplicates, seed);
          check_assign_skips_exactly<arch::native>(n, d, with_offset, duplicates, seed);
#if defined(OVQ_ARCH_AVX2)
          check_assign_skips_exactly<test::emulated_avx512>(n, d, with_offset, duplicates, seed);
#endif
          seed += 3;
        }
      }
    }
  }
}

namespace {

// One float forward of a fresh state over t seeded tokens, with Mixer<float, Arch>.
template <template <class, class> class Mixer, class Arch, class Options, class MakeState>
RowMatrix<float> seeded_forward(const Options& options, MakeState make_state, Index t, Index dk,
                                Index dv, std::uint64_t seed) {
  const auto q = random_matrix<float>(t, dk, seed, 0.5);
  const auto k = random_matrix<float>(t, dk, seed + 1, 0.5);
  const auto v = random_matrix<float>(t, dv, seed + 2);
  Mixer<float, Arch> mixer(options);
  auto state = make_state(mixer);
  return mixer.forward(state, q, k, v);
}

template <template <class, class> class Mixer, class Options, class MakeState>
void compare_architectures(const Options& options, MakeState make_state, Index t, Index dk,
                           Index dv, std::uint64_t seed) {
  const RowMatrix<float> o_port =
      seeded_forward<Mixer, arch::scalar>(options, make_state, t, dk, dv, seed);
  auto check = [&](auto arch_tag) {
    using Arch = decltype(arch_tag);
    const RowMatrix<float> o_fast =
        seeded_forward<Mixer, Arch>(options, make_state, t, dk, dv, seed);
    INFO(Arch::kName);
    CHECK(relative_error(o_fast, o_port) < 1e-5);
  };
  check(arch::native{});
#if defined(OVQ_ARCH_AVX2)
  check(test::emulated_avx512{});
#endif
}

}  // namespace

TEST_CASE("mixers: native architecture == portable architecture", "[kernels][arch]") {
  // dk = 29: a tail of 5 features on 8 lanes, 13 on 16.
  for (const auto& shape : {std::tuple<Index, Index, Index>{1, 24, 40}, {63, 24, 40},
                            {200, 24, 40}, {513, 24, 40}, {200, 29, 19}}) {
    const Index t = std::get<0>(shape), dk = std::get<1>(shape), dv = std::get<2>(shape);
    SelfAttentionOptions so;
    compare_architectures<SelfAttention>(so, [&](auto& m) { return m.make_state(dk, dv); }, t, dk,
                                         dv, 10 + t);
    so.window = 37;
    compare_architectures<SelfAttention>(so, [&](auto& m) { return m.make_state(dk, dv); }, t, dk,
                                         dv, 20 + t);
    LinearAttentionOptions lo;
    lo.feature_map = FeatureMap::elu1;
    lo.normalize = true;
    compare_architectures<LinearAttention>(lo, [&](auto& m) { return m.make_state(dk, dv); }, t,
                                           dk, dv, 30 + t);
    const auto codebook = random_matrix<float>(50, dk, 5, 0.5);
    compare_architectures<VqAttention>(VqAttentionOptions{},
                                       [&](auto& m) { return m.make_state(codebook, dv); }, t, dk,
                                       dv, 40 + t);
    OvqOptions oo;
    oo.capacity = 96;
    oo.chunk = 32;
    compare_architectures<OvqAttention>(oo, [&](auto& m) { return m.make_state(dk, dv); }, t, dk,
                                        dv, 50 + t);
  }
}

#if defined(OVQ_ARCH_AVX512)
namespace {

// Entries whose bits differ (so -0 against +0 and NaN payloads count).
template <class A, class B>
Index differing_bits(const A& a, const B& b) {
  Index n = 0;
  for (Index i = 0; i < static_cast<Index>(a.size()); ++i)
    n += std::memcmp(&a.data()[i], &b.data()[i], sizeof(a.data()[0])) != 0;
  return n;
}

template <template <class, class> class Mixer, class Options, class MakeState>
void check_mixer_emulation_bits(const Options& options, MakeState make_state, Index t, Index dk,
                                Index dv, std::uint64_t seed) {
  CAPTURE(t);
  CHECK(differing_bits(
            seeded_forward<Mixer, arch::avx512>(options, make_state, t, dk, dv, seed),
            seeded_forward<Mixer, test::emulated_avx512>(options, make_state, t, dk, dv, seed)) ==
        0);
}

}  // namespace

// Only in ovq_tests_avx512, on a CPU with AVX-512: the emulation the AVX2 builds test must give
// the hardware kernels' bits, or those tests would vouch for some other code.
TEST_CASE("AVX-512 kernels give the bits of their emulation on AVX2", "[kernels][avx512]") {
  using Hardware = kernels::TileOps<float, arch::avx512>;
  using Emulated = kernels::TileOps<float, test::emulated_avx512>;
  constexpr Index kTile = Hardware::kKeyTile;
  STATIC_REQUIRE(Emulated::kKeyTile == kTile);
  const Index bq = 7;
  for (Index d : {1, 5, 13, 16, 24, 67, 128}) {
    CAPTURE(d);
    const RowMatrix<float> q = random_matrix<float>(bq, d, 3000 + d, 0.5);
    const RowMatrix<float> k = random_matrix<float>(kTile, d, 3100 + d, 4.0);
    const float* keys[kTile];
    for (Index j = 0; j < kTile; ++j) keys[j] = k.data() + j * d;
    std::vector<float> s_hw(static_cast<std::size_t>(bq * kTile)), s_em = s_hw;
    Hardware::scores_rows(q.data(), d, bq, keys, d, 0.9f, s_hw.data());
    Emulated::scores_rows(q.data(), d, bq, keys, d, 0.9f, s_em.data());
    CHECK(differing_bits(s_hw, s_em) == 0);
    // One score row's softmax bookkeeping, then P V into an accumulator of width d.
    for (Index r = 0; r < bq; ++r) {
      float* row_hw = s_hw.data() + r * kTile;
      float* row_em = s_em.data() + r * kTile;
      const float m_hw = Hardware::mask_max(row_hw, r, kTile - r);
      const float m_em = Emulated::mask_max(row_em, r, kTile - r);
      CHECK(std::memcmp(&m_hw, &m_em, sizeof(float)) == 0);
      const float sum_hw = Hardware::exp_sum(row_hw, m_hw);
      const float sum_em = Emulated::exp_sum(row_em, m_em);
      CHECK(std::memcmp(&sum_hw, &sum_em, sizeof(float)) == 0);
    }
    CHECK(differing_bits(s_hw, s_em) == 0);
    const RowMatrix<float> v = random_matrix<float>(kTile, d, 3200 + d);
    RowMatrix<float> acc_hw = random_matrix<float>(bq, d, 3300 + d), acc_em = acc_hw;
    for (Index bk : {Index(1), Index(5), kTile}) {
      Hardware::accumulate(s_hw.data(), bq, bk, v.data(), d, d, acc_hw.data(), d);
      Emulated::accumulate(s_em.data(), bq, bk, v.data(), d, d, acc_em.data(), d);
    }
    CHECK(differing_bits(acc_hw, acc_em) == 0);
  }
  std::uint64_t seed = 3400;
  for (const ReadCase& c : kReadCases) {
    const ReadInputs<float> in(c, seed += 50);
    const auto o_hw = in.read<arch::avx512>();
    const auto o_em = in.read<test::emulated_avx512>();
    for (Index h = 0; h < c.heads; ++h) {
      CAPTURE(c.heads, c.n_queries, c.n_memory, c.n_local, c.dk, c.dv, h);
      const auto head = static_cast<std::size_t>(h);
      CHECK(differing_bits(o_hw[head], o_em[head]) == 0);
    }
  }
  const Index dk = 24, dv = 40;
  for (Index t : {1, 200, 513}) {
    const auto fresh_state = [&](auto& m) { return m.make_state(dk, dv); };
    check_mixer_emulation_bits<SelfAttention>(SelfAttentionOptions{}, fresh_state, t, dk, dv,
                                              3500 + t);
    LinearAttentionOptions lo;
    lo.feature_map = FeatureMap::elu1;
    lo.normalize = true;
    check_mixer_emulation_bits<LinearAttention>(lo, fresh_state, t, dk, dv, 3600 + t);
    const auto codebook = random_matrix<float>(50, dk, 6, 0.5);
    check_mixer_emulation_bits<VqAttention>(
        VqAttentionOptions{}, [&](auto& m) { return m.make_state(codebook, dv); }, t, dk, dv,
        3700 + t);
    OvqOptions oo;
    oo.capacity = 96;
    oo.chunk = 32;
    check_mixer_emulation_bits<OvqAttention>(oo, fresh_state, t, dk, dv, 3800 + t);
  }
}
#endif

TEST_CASE("online softmax: merging two halves equals one pass", "[kernels][softmax]") {
  const auto s = random_matrix<double>(1, 40, 3, 3.0);
  const auto v = random_matrix<double>(40, 5, 4);
  // o is kept as the running softmax average (online_softmax.hpp).
  auto fold = [&](Index b, Index e, double* o, SoftmaxStats<double>& st) {
    for (Index j = b; j < e; ++j) {
      const double m = std::max(st.m, s(0, j));
      const double a = std::exp(st.m - m) * st.l, w = std::exp(s(0, j) - m);
      for (Index c = 0; c < 5; ++c) o[c] = (o[c] * a + w * v(j, c)) / (a + w);
      st.l = a + w;
      st.m = m;
    }
  };
  double o_all[5] = {}, o_a[5] = {}, o_b[5] = {};
  SoftmaxStats<double> all, a, b;
  fold(0, 40, o_all, all);
  fold(0, 17, o_a, a);
  fold(17, 40, o_b, b);
  merge_softmax(o_a, a, o_b, b, 5);
  CHECK(a.l == Approx(all.l));
  for (int c = 0; c < 5; ++c) CHECK(o_a[c] == Approx(o_all[c]));
  SoftmaxStats<double> empty;
  double o_e[5] = {};
  merge_softmax(o_e, empty, o_all, all, 5);  // merging into an empty state copies
  CHECK(empty.l == all.l);
}

}  // namespace ovq_test_kernels
