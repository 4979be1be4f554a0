// The OVQ state (MATH.md section 4, "Write") checked against values worked out by hand, on tiny
// inputs: dk = 2, axis-aligned or otherwise simple keys, capacity N and chunk length L of a few
// rows. Each scenario states its reasoning in comments: the growth target and m, the seeding
// order (s_i and the picks), the assignment a_i, and the updated rows, counts, t and pending
// rows after every chunk.
//
// Also: Growth::target against hand-computed values, 64-bit counts, reproducible random
// seeding, the sliding-window KvCache, and the VQ state's counts and per-code mean values.
#include <cmath>
#include <algorithm>
#include <cstdint>
#include <fstream>
#include <initializer_list>
#include <limits>
#include <random>
#include <sstream>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "support/catch.hpp"
#include "support/fixtures.hpp"

// Everything below lives in this file's own namespace, so the suite can be built as one
// unity source without the files' helpers colliding.
namespace ovq_test_ovq_state {

#if defined(OVQ_CATCH2_V3)
using Catch::Approx;
#endif

namespace {

using ovq::Index;
template <class S>
using Mat = ovq::RowMatrix<S>;
template <class S>
using Vec = ovq::RowVector<S>;

// Absolute tolerance for hand-computed values of order one.
template <class S>
constexpr double hand_tol() {
  return std::is_same_v<S, float> ? 2e-6 : 1e-12;
}

// A matrix from rows written inline: rows<S>({{1, 0}, {0, 1}}).
template <class S>
Mat<S> rows(std::initializer_list<std::initializer_list<double>> r) {
  const Index n = static_cast<Index>(r.size());
  const Index d = n > 0 ? static_cast<Index>(r.begin()->size()) : 0;
  Mat<S> m(n, d);
  Index i = 0;
  for (const auto& row : r) {
    Index j = 0;
    for (double x : row) m(i, j++) = static_cast<S>(x);
    ++i;
  }
  return m;
}

template <class S>
Mat<double> to_double(ovq::ConstRowsView<S> v) {
  return ovq::as_eigen(v).template cast<double>();
}

template <class S>
void check_matrix(const char* what, ovq::ConstRowsView<S> actual, const Mat<double>& expected) {
  INFO(what << ":\nactual\n" << to_double(actual) << "\nexpected\n" << expected);
  REQUIRE(actual.rows == expected.rows());
  REQUIRE(actual.cols == expected.cols());
  for (Index i = 0; i < expected.rows(); ++i)
    for (Index j = 0; j < expected.cols(); ++j) {
      CAPTURE(i, j);
      CHECK(static_cast<double>(actual.row(i)[j]) ==
            Approx(expected(i, j)).margin(hand_tol<S>()).epsilon(0));
    }
}

// The whole OVQ state: dictionary rows, counts, t, and the pending rows.
template <class S>
void check_ovq(const ovq::OvqState<S>& st, std::int64_t t, const std::vector<std::int64_t>& counts,
               const Mat<double>& dk, const Mat<double>& dv, const Mat<double>& pending_k,
               const Mat<double>& pending_v) {
  const ovq::Dictionary<S>& d = st.dictionary();
  CHECK(st.absorbed() == t);
  CHECK(st.pending() == pending_k.rows());
  CHECK(st.tokens() == t + pending_k.rows());
  REQUIRE(d.size() == static_cast<Index>(counts.size()));
  std::int64_t total = 0;
  for (Index r = 0; r < d.size(); ++r) {
    CAPTURE(r);
    CHECK(d.count(r) == counts[static_cast<std::size_t>(r)]);
    total += counts[static_cast<std::size_t>(r)];
  }
  CHECK(d.total_count() == total);
  CHECK(total == t);  // every absorbed token is counted exactly once
  check_matrix<S>("D_k", d.keys(), dk);
  check_matrix<S>("D_v", d.values(), dv);
  check_matrix<S>("pending keys", st.pending_keys(), pending_k);
  check_matrix<S>("pending values", st.pending_values(), pending_v);
}

template <class S>
void check_ovq(const ovq::OvqState<S>& st, std::int64_t t, const std::vector<std::int64_t>& counts,
               const Mat<double>& dk, const Mat<double>& dv) {
  check_ovq(st, t, counts, dk, dv, Mat<double>(0, dk.cols()), Mat<double>(0, dv.cols()));
}

// Feeds rows through forward (the queries do not affect the state; zeros).
template <class S>
void feed(const ovq::OvqAttention<S>& mixer, ovq::OvqState<S>& st, const Mat<S>& k,
          const Mat<S>& v) {
  const Mat<S> q = Mat<S>::Zero(k.rows(), k.cols());
  mixer.forward(st, q, k, v);
}

// Feeds rows one token at a time through step.
template <class S>
void feed_steps(const ovq::OvqAttention<S>& mixer, ovq::OvqState<S>& st, const Mat<S>& k,
                const Mat<S>& v) {
  const Vec<S> q = Vec<S>::Zero(k.cols());
  for (Index i = 0; i < k.rows(); ++i) mixer.step(st, q, Vec<S>(k.row(i)), Vec<S>(v.row(i)));
}

ovq::OvqOptions options(Index capacity, Index chunk, ovq::Growth growth) {
  ovq::OvqOptions o;
  o.capacity = capacity;
  o.chunk = chunk;
  o.growth = growth;
  return o;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Growth::target
// ---------------------------------------------------------------------------------------------

TEST_CASE("ovq state: dirichlet growth target with alpha = N, by hand", "[ovq][state]") {
  // alpha = N: G(t) = ceil(N (1 - (1 + t/N)^(-1))) = ceil(N t / (N + t)). N = 8:
  //   t = 0: 0                t = 1: 8/9 = 0.89 -> 1     t = 2: 16/10 = 1.6 -> 2
  //   t = 3: 24/11 = 2.18 -> 3  t = 4: 32/12 = 2.67 -> 3  t = 8: 64/16 = 4 -> 4
  //   t = 16: 128/24 = 5.33 -> 6  t = 40: 320/48 = 6.67 -> 7  t = 56: 448/64 = 7 -> 7
  //   t = 100: 800/108 = 7.41 -> 8  t = 1e12: just under 8 -> 8
  // (t = 8 and t = 56 land exactly on integers; their powers 2^-1 and 8^-1 are exact in binary.)
  const ovq::Growth g0 = ovq::Growth::dirichlet();      // alpha 0 means N
  const ovq::Growth g8 = ovq::Growth::dirichlet(8.0);  // the same, explicitly
  const std::int64_t ts[] = {0, 1, 2, 3, 4, 8, 16, 40, 56, 100, 1000000000000};
  const Index want[] = {0, 1, 2, 3, 3, 4, 6, 7, 7, 8, 8};
  for (std::size_t i = 0; i < std::size(ts); ++i) {
    CAPTURE(ts[i]);
    CHECK(g0.target(ts[i], 8) == want[i]);
    CHECK(g8.target(ts[i], 8) == want[i]);
  }
  // The growth plateaus at N, whatever t.
  CHECK(g0.target(std::numeric_limits<std::int64_t>::max() / 2, 8) == 8);
}

TEST_CASE("ovq state: dirichlet growth target with a custom alpha, by hand", "[ovq][state]") {
  // N = 4, alpha = 1: G(t) = ceil(4 (1 - (1 + t)^(-1/4)))
  //   t = 1: 2^-0.25 = 0.8409 -> 4 * 0.1591 = 0.64 -> 1
  //   t = 4: 5^-0.25 = 0.6687 -> 4 * 0.3313 = 1.33 -> 2
  //   t = 80: 81^-0.25 = 1/3 -> 2.67 -> 3
  //   t = 624: 625^-0.25 = 1/5 -> 3.2 -> 4
  const ovq::Growth a1 = ovq::Growth::dirichlet(1.0);
  CHECK(a1.target(0, 4) == 0);
  CHECK(a1.target(1, 4) == 1);
  CHECK(a1.target(4, 4) == 2);
  CHECK(a1.target(80, 4) == 3);
  CHECK(a1.target(624, 4) == 4);
  // N = 4, alpha = 2: G(t) = ceil(4 (1 - (1 + t/2)^(-1/2)))
  //   t = 2: 2^-0.5 = 0.7071 -> 1.17 -> 2;  t = 16: 9^-0.5 = 1/3 -> 2.67 -> 3;
  //   t = 48: 25^-0.5 = 1/5 -> 3.2 -> 4
  const ovq::Growth a2 = ovq::Growth::dirichlet(2.0);
  CHECK(a2.target(2, 4) == 2);
  CHECK(a2.target(16, 4) == 3);
  CHECK(a2.target(48, 4) == 4);
  // N = 4, alpha = 64 (faster early growth): G(t) = ceil(4 (1 - (1 + t/64)^(-16)))
  //   t = 1: 1.015625^-16 = 0.7803 -> 0.88 -> 1;  t = 4: 1.0625^-16 = 0.3791 -> 2.48 -> 3;
  //   t = 16: 1.25^-16 = 0.0281 -> 3.89 -> 4
  const ovq::Growth a64 = ovq::Growth::dirichlet(64.0);
  CHECK(a64.target(1, 4) == 1);
  CHECK(a64.target(4, 4) == 3);
  CHECK(a64.target(16, 4) == 4);
}

TEST_CASE("ovq state: linear growth target, by hand", "[ovq][state]") {
  // rate 1: G(t) = t, capped at N = 8.
  const ovq::Growth r1 = ovq::Growth::linear(1.0);
  CHECK(r1.target(0, 8) == 0);
  CHECK(r1.target(1, 8) == 1);
  CHECK(r1.target(5, 8) == 5);
  CHECK(r1.target(8, 8) == 8);
  CHECK(r1.target(9, 8) == 8);
  CHECK(r1.target(1000000000000, 8) == 8);
  // rate 0.5: G(t) = ceil(t / 2): 1 -> 1, 2 -> 1, 3 -> 2, 4 -> 2, 5 -> 3, 16 -> 8, 17 -> 9 -> 8.
  const ovq::Growth r05 = ovq::Growth::linear(0.5);
  CHECK(r05.target(0, 8) == 0);
  CHECK(r05.target(1, 8) == 1);
  CHECK(r05.target(2, 8) == 1);
  CHECK(r05.target(3, 8) == 2);
  CHECK(r05.target(4, 8) == 2);
  CHECK(r05.target(5, 8) == 3);
  CHECK(r05.target(16, 8) == 8);
  CHECK(r05.target(17, 8) == 8);
  CHECK(r05.target(100, 8) == 8);
}

// ---------------------------------------------------------------------------------------------
// Writes by hand
// ---------------------------------------------------------------------------------------------

TEMPLATE_TEST_CASE("ovq state: dirichlet growth, spread seeding, adaptive update, by hand",
                   "[ovq][state]", float, double) {
  using S = TestType;
  // N = 4, L = 2, dk = 2, dv = 1, alpha = N = 4: G(t) = ceil(4 t / (4 + t)).
  const ovq::OvqAttention<S> mixer(options(4, 2, ovq::Growth::dirichlet()));
  auto st = mixer.make_state(2, 1);
  check_ovq(st, 0, {}, Mat<double>(0, 2), Mat<double>(0, 1));

  // Chunk 1 (t = 0): k0 = (1, 0) v0 = 1, k1 = (0, 1) v1 = 2.
  //   target = G(2) = ceil(8/6 = 1.33) = 2, n = 0 -> m = 2.
  //   seed: s = (-inf, -inf) -> pick row 0 (tie: smallest i); s = (1, 0) -> pick row 1.
  //   D_k = [(1, 0), (0, 1)], D_v = [1, 2], counts 0.
  //   assign: k0 . D_k = (1, 0) -> 0;  k1 . D_k = (0, 1) -> 1.
  //   update (c = 0, one member each): D[r] = the member itself; counts (1, 1); t = 2.
  CHECK(mixer.options().growth.target(2, 4) == 2);
  feed(mixer, st, rows<S>({{1, 0}, {0, 1}}), rows<S>({{1}, {2}}));
  check_ovq(st, 2, {1, 1}, rows<double>({{1, 0}, {0, 1}}), rows<double>({{1}, {2}}));

  // Chunk 2 (t = 2): k2 = (1, 0) v2 = 3, k3 = (-1, 0) v3 = 4; fed token by token.
  //   After k2 alone: pending = [(1, 0)] / [3], the dictionary untouched.
  feed_steps(mixer, st, rows<S>({{1, 0}}), rows<S>({{3}}));
  check_ovq(st, 2, {1, 1}, rows<double>({{1, 0}, {0, 1}}), rows<double>({{1}, {2}}),
            rows<double>({{1, 0}}), rows<double>({{3}}));
  //   target = G(4) = ceil(16/8) = 2 = n -> m = 0 (no seeding).
  //   assign: k2 . D_k = (1, 0) -> 0;  k3 . D_k = (-1, 0) -> 1.
  //   update: D_k[0] = (1 * (1, 0) + (1, 0)) / 2 = (1, 0),    D_v[0] = (1 + 3) / 2 = 2
  //           D_k[1] = (1 * (0, 1) + (-1, 0)) / 2 = (-0.5, 0.5), D_v[1] = (2 + 4) / 2 = 3
  //   counts (2, 2); t = 4.
  CHECK(mixer.options().growth.target(4, 4) == 2);
  feed_steps(mixer, st, rows<S>({{-1, 0}}), rows<S>({{4}}));
  check_ovq(st, 4, {2, 2}, rows<double>({{1, 0}, {-0.5, 0.5}}), rows<double>({{2}, {3}}));

  // Chunk 3 (t = 4) and one more token: k4 = (0, -1) v4 = 5, k5 = (1, 0) v5 = 6, k6 = (0, 1) v6 = 7.
  //   target = G(6) = ceil(24/10 = 2.4) = 3, n = 2 -> m = 1.
  //   seed: s4 = max(k4 . (1, 0), k4 . (-0.5, 0.5)) = max(0, -0.5) = 0
  //         s5 = max(1, -0.5) = 1                  -> pick row 4 (s = 0): D_k[2] = (0, -1), D_v[2] = 5.
  //   assign: k4 . D_k = (0, -0.5, 1) -> 2;  k5 . D_k = (1, -0.5, 0) -> 0.
  //   update: D_k[0] = (2 (1, 0) + (1, 0)) / 3 = (1, 0),  D_v[0] = (2 * 2 + 6) / 3 = 10/3
  //           D_k[2] = (0, -1), D_v[2] = 5 (count 0 + 1);  row 1 untouched.
  //   counts (3, 2, 1), sum 6 = t. k6 stays pending.
  CHECK(mixer.options().growth.target(6, 4) == 3);
  feed(mixer, st, rows<S>({{0, -1}, {1, 0}, {0, 1}}), rows<S>({{5}, {6}, {7}}));
  check_ovq(st, 6, {3, 2, 1}, rows<double>({{1, 0}, {-0.5, 0.5}, {0, -1}}),
            rows<double>({{10.0 / 3.0}, {3}, {5}}), rows<double>({{0, 1}}), rows<double>({{7}}));

  // Chunk 4 (t = 6): k6 (pending) and k7 = (0, 1) v7 = 9.
  //   target = G(8) = ceil(32/12 = 2.67) = 3 = n -> m = 0.
  //   assign: (0, 1) . D_k = (0, 0.5, -1) -> 1 for both.
  //   update: D_k[1] = (2 (-0.5, 0.5) + 2 (0, 1)) / 4 = (-0.25, 0.75), D_v[1] = (2 * 3 + 7 + 9) / 4
  //           = 5.5; counts (3, 4, 1); t = 8.
  feed(mixer, st, rows<S>({{0, 1}}), rows<S>({{9}}));
  check_ovq(st, 8, {3, 4, 1}, rows<double>({{1, 0}, {-0.25, 0.75}, {0, -1}}),
            rows<double>({{10.0 / 3.0}, {5.5}, {5}}));
}

TEMPLATE_TEST_CASE("ovq state: linear growth up to a full dictionary, by hand", "[ovq][state]",
                   float, double) {
  using S = TestType;
  // N = 3, L = 2, dk = 2, dv = 2, linear rate 1: G(t) = t.
  const ovq::OvqAttention<S> mixer(options(3, 2, ovq::Growth::linear(1.0)));
  auto st = mixer.make_state(2, 2);

  // Chunk 1 (t = 0): k0 = (1, 0) v0 = (2, 0); k1 = (0, 1) v1 = (0, 2).
  //   target = min(3, G(2) = 2) = 2 -> m = 2: seeds row 0 (tie at -inf), then row 1.
  //   assign k0 -> 0, k1 -> 1; each centroid is its only member; counts (1, 1); t = 2.
  feed(mixer, st, rows<S>({{1, 0}, {0, 1}}), rows<S>({{2, 0}, {0, 2}}));
  check_ovq(st, 2, {1, 1}, rows<double>({{1, 0}, {0, 1}}), rows<double>({{2, 0}, {0, 2}}));

  // Chunk 2 (t = 2): k2 = (0.6, 0.8) v2 = (4, 4); k3 = (-0.8, 0.6) v3 = (8, 0).
  //   target = min(3, G(4) = 4) = 3 -> m = clamp(3 - 2, 0, 2) = 1.
  //   seed: s2 = max(0.6, 0.8) = 0.8, s3 = max(-0.8, 0.6) = 0.6 -> pick row 3:
  //         D_k[2] = (-0.8, 0.6), D_v[2] = (8, 0).
  //   assign: k2 . D_k = (0.6, 0.8, 0) -> 1;  k3 . D_k = (-0.8, 0.6, 1) -> 2.
  //   update: D_k[1] = ((0, 1) + (0.6, 0.8)) / 2 = (0.3, 0.9), D_v[1] = ((0, 2) + (4, 4)) / 2
  //           = (2, 3); D_k[2], D_v[2] unchanged (its own key, count 0 + 1).
  //   counts (1, 2, 1); t = 4; n = 3 = N.
  feed(mixer, st, rows<S>({{0.6, 0.8}, {-0.8, 0.6}}), rows<S>({{4, 4}, {8, 0}}));
  check_ovq(st, 4, {1, 2, 1}, rows<double>({{1, 0}, {0.3, 0.9}, {-0.8, 0.6}}),
            rows<double>({{2, 0}, {2, 3}, {8, 0}}));

  // Chunk 3 (t = 4), full: only assign + update, nothing opened, nothing evicted, even for a
  // key unlike every centroid. k4 = (0, -1) v4 = (0, 6); k5 = (-0.6, -0.8) v5 = (6, 6).
  //   target = min(3, 6) = 3 = n -> m = 0.
  //   assign: k4 . D_k = (0, -0.9, -0.6) -> 0;  k5 . D_k = (-0.6, -0.9, 0) -> 2.
  //   update: D_k[0] = ((1, 0) + (0, -1)) / 2 = (0.5, -0.5),  D_v[0] = ((2, 0) + (0, 6)) / 2 = (1, 3)
  //           D_k[2] = ((-0.8, 0.6) + (-0.6, -0.8)) / 2 = (-0.7, -0.1),
  //           D_v[2] = ((8, 0) + (6, 6)) / 2 = (7, 3);  row 1 untouched.
  //   counts (2, 2, 2); t = 6.
  feed(mixer, st, rows<S>({{0, -1}, {-0.6, -0.8}}), rows<S>({{0, 6}, {6, 6}}));
  check_ovq(st, 6, {2, 2, 2}, rows<double>({{0.5, -0.5}, {0.3, 0.9}, {-0.7, -0.1}}),
            rows<double>({{1, 3}, {2, 3}, {7, 3}}));

  // Chunk 4 (t = 6), still full: k6 = k7 = (0, 1), v6 = (2, 2), v7 = (4, 4).
  //   assign: (0, 1) . D_k = (-0.5, 0.9, -0.1) -> 1 for both.
  //   update: D_k[1] = (2 (0.3, 0.9) + 2 (0, 1)) / 4 = (0.15, 0.95),
  //           D_v[1] = (2 (2, 3) + (2, 2) + (4, 4)) / 4 = (2.5, 3);  counts (2, 4, 2); t = 8.
  feed(mixer, st, rows<S>({{0, 1}, {0, 1}}), rows<S>({{2, 2}, {4, 4}}));
  check_ovq(st, 8, {2, 4, 2}, rows<double>({{0.5, -0.5}, {0.15, 0.95}, {-0.7, -0.1}}),
            rows<double>({{1, 3}, {2.5, 3}, {7, 3}}));
}

TEMPLATE_TEST_CASE("ovq state: linear growth at rate 0.5, by hand", "[ovq][state]", float, double) {
  using S = TestType;
  // N = 4, L = 2, dk = 2, dv = 1, rate 0.5: G(t) = ceil(t / 2), i.e. one centroid per chunk.
  const ovq::OvqAttention<S> mixer(options(4, 2, ovq::Growth::linear(0.5)));
  auto st = mixer.make_state(2, 1);
  // Chunk 1 (t = 0): G(2) = 1 -> m = 1. k0 = (0, 1) v0 = 1, k1 = (1, 0) v1 = 3.
  //   seed row 0 (all s = -inf): D_k[0] = (0, 1). assign both to 0 (the only centroid).
  //   update: D_k[0] = ((0, 1) + (1, 0)) / 2 = (0.5, 0.5), D_v[0] = (1 + 3) / 2 = 2; count 2.
  feed(mixer, st, rows<S>({{0, 1}, {1, 0}}), rows<S>({{1}, {3}}));
  check_ovq(st, 2, {2}, rows<double>({{0.5, 0.5}}), rows<double>({{2}}));
  // Chunk 2 (t = 2): G(4) = 2 -> m = 1. k2 = (1, 0) v2 = 5, k3 = (-1, 0) v3 = 7.
  //   seed: s2 = 0.5, s3 = -0.5 -> pick row 3: D_k[1] = (-1, 0), D_v[1] = 7.
  //   assign: k2 . D_k = (0.5, -1) -> 0;  k3 . D_k = (-0.5, 1) -> 1.
  //   update: D_k[0] = (2 (0.5, 0.5) + (1, 0)) / 3 = (2/3, 1/3), D_v[0] = (2 * 2 + 5) / 3 = 3;
  //           D_k[1] = (-1, 0), D_v[1] = 7.  counts (3, 1); t = 4.
  feed(mixer, st, rows<S>({{1, 0}, {-1, 0}}), rows<S>({{5}, {7}}));
  check_ovq(st, 4, {3, 1}, rows<double>({{2.0 / 3.0, 1.0 / 3.0}, {-1, 0}}),
            rows<double>({{3}, {7}}));
}

TEMPLATE_TEST_CASE("ovq state: n == 0 opens at least one centroid", "[ovq][state]", float,
                   double) {
  using S = TestType;
  // Dirichlet growth with alpha = 1e20: in double, 1 + t / alpha == 1 for small t, so
  // G(t) = ceil(N (1 - 1^(-alpha / N))) = 0 (G is evaluated in double, as MATH.md says).
  // The target is 0, yet an empty dictionary must open m >= 1 centroid; a non-empty one none.
  const ovq::Growth growth = ovq::Growth::dirichlet(1e20);
  REQUIRE(growth.target(2, 4) == 0);
  REQUIRE(growth.target(4, 4) == 0);
  const ovq::OvqAttention<S> mixer(options(4, 2, growth));
  auto st = mixer.make_state(2, 1);
  // Chunk 1 (t = 0): m = max(clamp(0 - 0, 0, 2), 1) = 1. k0 = (0, 1) v0 = 1, k1 = (1, 0) v1 = 2.
  //   seed row 0: D_k[0] = (0, 1); assign both to 0.
  //   update: D_k[0] = ((0, 1) + (1, 0)) / 2 = (0.5, 0.5), D_v[0] = 1.5; count 2.
  feed(mixer, st, rows<S>({{0, 1}, {1, 0}}), rows<S>({{1}, {2}}));
  check_ovq(st, 2, {2}, rows<double>({{0.5, 0.5}}), rows<double>({{1.5}}));
  // Chunk 2 (t = 2): n = 1, target 0 -> m = clamp(-1, 0, 2) = 0. k2 = (-1, 0) v2 = 3,
  //   k3 = (1, 0) v3 = 4, both to 0.
  //   update: D_k[0] = (2 (0.5, 0.5) + (0, 0)) / 4 = (0.25, 0.25), D_v[0] = (2 * 1.5 + 7) / 4 = 2.5.
  feed(mixer, st, rows<S>({{-1, 0}, {1, 0}}), rows<S>({{3}, {4}}));
  check_ovq(st, 4, {4}, rows<double>({{0.25, 0.25}}), rows<double>({{2.5}}));
}

TEMPLATE_TEST_CASE("ovq state: spread seeding order, its tie rule, and the assignment tie rule",
                   "[ovq][state]", float, double) {
  using S = TestType;
  // N = 4, L = 4, dk = 2, dv = 1, linear rate 0.75: G(4) = ceil(3) = 3, so m = 3 in chunk 1.
  const ovq::OvqAttention<S> mixer(options(4, 4, ovq::Growth::linear(0.75)));
  auto st = mixer.make_state(2, 1);
  // Chunk 1 (t = 0): k0 = (1, 0), k1 = (0, 1), k2 = (0, -1), k3 = (-1, 0); v = 1, 2, 3, 4.
  //   s = (-inf, -inf, -inf, -inf)  -> pick 0 (tie: smallest i)
  //   s = max(s, k_i . k0) = (1, 0, 0, -1)  -> pick 3 (the least similar)
  //   s = max(s, k_i . k3) = (1, 0, 0, 1)   -> 1 and 2 tie at 0: pick 1 (smallest i)
  //   D_k = [k0, k3, k1] = [(1, 0), (-1, 0), (0, 1)], D_v = [1, 4, 2].
  //   assign: k0 . D_k = (1, -1, 0) -> 0
  //           k1 . D_k = (0, 0, 1)  -> 2
  //           k2 . D_k = (0, 0, -1) -> 0 and 1 tie at 0: r = 0 (smallest r)
  //           k3 . D_k = (-1, 1, 0) -> 1
  //   update: D_k[0] = (k0 + k2) / 2 = (0.5, -0.5), D_v[0] = (1 + 3) / 2 = 2; rows 1, 2 keep
  //           their seed. counts (2, 1, 1); t = 4.
  feed(mixer, st, rows<S>({{1, 0}, {0, 1}, {0, -1}, {-1, 0}}), rows<S>({{1}, {2}, {3}, {4}}));
  check_ovq(st, 4, {2, 1, 1}, rows<double>({{0.5, -0.5}, {-1, 0}, {0, 1}}),
            rows<double>({{2}, {4}, {2}}));

  // Chunk 2 (t = 4): G(8) = 6, min(N) = 4 -> m = 1.
  //   k4 = k6 = (0.6, 0.8), k5 = k7 = (0.8, 0.6); v = 5, 6, 7, 8.
  //   s4 = s6 = max(0.3 - 0.4, -0.6, 0.8) = 0.8;  s5 = s7 = max(0.4 - 0.3, -0.8, 0.6) = 0.6
  //   -> rows 5 and 7 tie at 0.6: pick 5. D_k[3] = (0.8, 0.6), D_v[3] = 6.
  //   assign: (0.6, 0.8) . D_k = (-0.1, -0.6, 0.8, 0.96) -> 3;  (0.8, 0.6) . D_k = (0.1, -0.8,
  //           0.6, 1) -> 3. All four rows to centroid 3 (count 0 before).
  //   update: D_k[3] = (2 (0.6, 0.8) + 2 (0.8, 0.6)) / 4 = (0.7, 0.7), D_v[3] = 26 / 4 = 6.5.
  //   counts (2, 1, 1, 4); t = 8.
  feed(mixer, st, rows<S>({{0.6, 0.8}, {0.8, 0.6}, {0.6, 0.8}, {0.8, 0.6}}),
       rows<S>({{5}, {6}, {7}, {8}}));
  check_ovq(st, 8, {2, 1, 1, 4}, rows<double>({{0.5, -0.5}, {-1, 0}, {0, 1}, {0.7, 0.7}}),
            rows<double>({{2}, {4}, {2}, {6.5}}));
}

TEMPLATE_TEST_CASE("ovq state: constant-rate update, by hand", "[ovq][state]", float, double) {
  using S = TestType;
  // N = 1, L = 2, dk = dv = 2, linear rate 1, eta = 0.5.
  ovq::OvqOptions opt = options(1, 2, ovq::Growth::linear(1.0));
  opt.rate = ovq::UpdateRate::constant(0.5);
  const ovq::OvqAttention<S> mixer(opt);
  auto st = mixer.make_state(2, 2);
  // Chunk 1: target = min(1, 2) = 1 -> m = 1: seed row 0, D_k[0] = (1, 0), D_v[0] = (1, 0).
  //   Both rows assigned to 0. Mean of members: keys (0.5, 0.5), values (0.5, 0.5).
  //   D = (1 - eta) D + eta mean: D_k[0] = 0.5 (1, 0) + 0.5 (0.5, 0.5) = (0.75, 0.25), and the
  //   same for D_v[0]. (The adaptive rate would give the mean, (0.5, 0.5).) count 2.
  feed(mixer, st, rows<S>({{1, 0}, {0, 1}}), rows<S>({{1, 0}, {0, 1}}));
  check_ovq(st, 2, {2}, rows<double>({{0.75, 0.25}}), rows<double>({{0.75, 0.25}}));
  // Chunk 2: k = (0, 1) twice, v = (4, 4), (0, 0). Full: assign both to 0.
  //   D_k[0] = 0.5 (0.75, 0.25) + 0.5 (0, 1) = (0.375, 0.625)
  //   D_v[0] = 0.5 (0.75, 0.25) + 0.5 (2, 2) = (1.375, 1.125)   (the rate ignores the count 2)
  feed(mixer, st, rows<S>({{0, 1}, {0, 1}}), rows<S>({{4, 4}, {0, 0}}));
  check_ovq(st, 4, {4}, rows<double>({{0.375, 0.625}}), rows<double>({{1.375, 1.125}}));
  // All these values are dyadic: the update is exact.
  CHECK(ovq::as_eigen(st.dictionary().keys())(0, 0) == S(0.375));
  CHECK(ovq::as_eigen(st.dictionary().values())(0, 1) == S(1.125));
}

TEMPLATE_TEST_CASE("ovq state: renormalisation of updated key centroids, by hand",
                   "[ovq][state]", float, double) {
  using S = TestType;
  // N = 1, L = 2, dk = 2, dv = 1, linear rate 1, adaptive rate.
  ovq::OvqOptions opt = options(1, 2, ovq::Growth::linear(1.0));
  opt.renormalize = true;
  const ovq::OvqAttention<S> mixer(opt);
  ovq::OvqOptions plain_opt = opt;
  plain_opt.renormalize = false;
  const ovq::OvqAttention<S> plain(plain_opt);
  auto st = mixer.make_state(2, 1);
  auto ref = plain.make_state(2, 1);
  const double h = 1.0 / std::sqrt(2.0);
  // Chunk 1: keys (1, 0), (0, 1), values 2, 4, both to centroid 0.
  //   mean (0.5, 0.5), renormalised: (1/sqrt 2, 1/sqrt 2). Values are not renormalised: 3.
  //   Without renormalisation: (0.5, 0.5).
  feed(mixer, st, rows<S>({{1, 0}, {0, 1}}), rows<S>({{2}, {4}}));
  feed(plain, ref, rows<S>({{1, 0}, {0, 1}}), rows<S>({{2}, {4}}));
  check_ovq(st, 2, {2}, rows<double>({{h, h}}), rows<double>({{3}}));
  check_ovq(ref, 2, {2}, rows<double>({{0.5, 0.5}}), rows<double>({{3}}));
  // Chunk 2: keys (1, 0) twice, values 6, 6.
  //   D_k[0] = (2 (h, h) + 2 (1, 0)) / 4 = ((1 + h) / 2, h / 2), direction atan(h / (1 + h))
  //   = atan(sqrt 2 - 1) = pi / 8, so renormalised: (cos pi/8, sin pi/8).
  //   D_v[0] = (2 * 3 + 12) / 4 = 4.5. Without renormalisation: (2 (0.5, 0.5) + (2, 0)) / 4
  //   = (0.75, 0.25).
  feed(mixer, st, rows<S>({{1, 0}, {1, 0}}), rows<S>({{6}, {6}}));
  feed(plain, ref, rows<S>({{1, 0}, {1, 0}}), rows<S>({{6}, {6}}));
  const double pi = std::acos(-1.0);
  check_ovq(st, 4, {4}, rows<double>({{std::cos(pi / 8), std::sin(pi / 8)}}),
            rows<double>({{4.5}}));
  check_ovq(ref, 4, {4}, rows<double>({{0.75, 0.25}}), rows<double>({{4.5}}));
}

// ---------------------------------------------------------------------------------------------
// Counts, random seeding
// ---------------------------------------------------------------------------------------------

TEMPLATE_TEST_CASE("ovq state: counts are 64-bit and a count near 2^40 stays exact",
                   "[ovq][state]", float, double) {
  using S = TestType;
  STATIC_REQUIRE(std::is_same_v<decltype(std::declval<ovq::Dictionary<S>>().count(0)),
                                std::int64_t>);
  STATIC_REQUIRE(std::is_same_v<decltype(std::declval<ovq::Dictionary<S>>().counts()),
                                const std::int64_t*>);
  STATIC_REQUIRE(std::is_same_v<decltype(std::declval<ovq::OvqState<S>>().absorbed()),
                                std::int64_t>);

  // N = 1, L = 2, dk = 2, dv = 1.
  const ovq::OvqAttention<S> mixer(options(1, 2, ovq::Growth::linear(1.0)));
  auto st = mixer.make_state(2, 1);
  feed(mixer, st, rows<S>({{1, 0}, {1, 0}}), rows<S>({{1}, {1}}));
  check_ovq(st, 2, {2}, rows<double>({{1, 0}}), rows<double>({{1}}));

  // 2^40 + 3 is not representable in float (24-bit significand), nor are the sums below.
  const std::int64_t big = (std::int64_t(1) << 40) + 3;
  st.dictionary().set_count(0, big);
  CHECK(st.dictionary().count(0) == big);
  CHECK(static_cast<double>(st.dictionary().log_counts()[0]) ==
        Approx(std::log(static_cast<double>(big))).epsilon(1e-6));
  // One more chunk, both rows to the only centroid: count = 2^40 + 5, exactly.
  //   D_k[0] = (c (1, 0) + (1, 0) + (0, 1)) / (c + 2) = (1 - 1/(c + 2), 1/(c + 2)).
  feed(mixer, st, rows<S>({{1, 0}, {0, 1}}), rows<S>({{1}, {1}}));
  CHECK(st.dictionary().count(0) == big + 2);
  CHECK(st.dictionary().total_count() == big + 2);
  CHECK(st.absorbed() == 4);
  const double inv = 1.0 / static_cast<double>(big + 2);
  const auto k = ovq::as_eigen(st.dictionary().keys());
  CHECK(static_cast<double>(k(0, 0)) == Approx(1.0 - inv).epsilon(1e-7));
  CHECK(static_cast<double>(k(0, 1)) == Approx(inv).epsilon(1e-5));
  CHECK(static_cast<double>(ovq::as_eigen(st.dictionary().values())(0, 0)) == Approx(1.0));

  // Steps of one token add up exactly as well.
  for (int i = 0; i < 6; ++i) feed_steps(mixer, st, rows<S>({{1, 0}}), rows<S>({{1}}));
  CHECK(st.dictionary().count(0) == big + 8);
  CHECK(st.absorbed() == 10);
}

TEMPLATE_TEST_CASE("ovq state: t near 2^40 is kept exactly and drives the growth",
                   "[ovq][state]", float, double) {
  using S = TestType;
  // N = 4, L = 2: restore t = 2^40 with nothing pending. G(2^40 + 2) rounds to N = 4, so the
  // first chunk opens m = clamp(4 - 0, 0, 2) = 2 centroids.
  const ovq::OvqAttention<S> mixer(options(4, 2, ovq::Growth::dirichlet()));
  auto st = mixer.make_state(2, 1);
  const std::int64_t t0 = std::int64_t(1) << 40;
  st.restore(t0, ovq::ConstRowsView<S>{nullptr, 0, 2, 2}, ovq::ConstRowsView<S>{nullptr, 0, 1, 1});
  CHECK(st.absorbed() == t0);
  feed(mixer, st, rows<S>({{1, 0}, {0, 1}, {0, -1}}), rows<S>({{1}, {2}, {3}}));
  CHECK(st.absorbed() == t0 + 2);
  CHECK(st.tokens() == t0 + 3);
  CHECK(st.dictionary().size() == 2);
  CHECK(st.dictionary().total_count() == 2);  // counts hold tokens absorbed since the restore
}

TEST_CASE("ovq state: random seeding is reproducible and depends on the seed", "[ovq][state]") {
  // N = 8, L = 8, dk = 3, dv = 2, dirichlet growth; 4 chunks of random unit keys.
  auto make = [](std::uint64_t seed) {
    ovq::OvqOptions o = options(8, 8, ovq::Growth::dirichlet());
    o.seeding = ovq::Seeding::random(seed);
    return ovq::OvqAttention<double>(o);
  };
  const Mat<double> k = ovq::test::random_unit_rows<double>(32, 3, 2024);
  const Mat<double> v = ovq::test::random_matrix<double>(32, 2, 2025);

  const auto m7 = make(7);
  auto a = m7.make_state(3, 2);
  auto b = m7.make_state(3, 2);
  feed(m7, a, k, v);
  feed(m7, b, k, v);
  CHECK(a == b);  // same seed, same stream: bitwise the same state
  CHECK(a.dictionary().total_count() == 32);

  // The draw depends only on the stream position: token-by-token steps, or pieces of other
  // sizes, give bitwise the same state.
  auto c = m7.make_state(3, 2);
  feed_steps(m7, c, k, v);
  CHECK(c == a);
  auto d = m7.make_state(3, 2);
  feed(m7, d, Mat<double>(k.topRows(5)), Mat<double>(v.topRows(5)));
  feed(m7, d, Mat<double>(k.bottomRows(27)), Mat<double>(v.bottomRows(27)));
  CHECK(d == a);

  // Another seed picks other rows.
  const auto m8 = make(8);
  auto e = m8.make_state(3, 2);
  feed(m8, e, k, v);
  CHECK(e.dictionary().total_count() == 32);
  CHECK(e != a);

  // The first chunk (t = 0) opens G(8) = ceil(64 / 16) = 4 centroids; each seed is one of the
  // chunk's rows, and the draws are distinct rows within the chunk.
  const std::vector<Index> r7 = ovq::kernels::random_seed_rows(7, 0, 8, 4);
  const std::vector<Index> r7b = ovq::kernels::random_seed_rows(7, 0, 8, 4);
  const std::vector<Index> r8 = ovq::kernels::random_seed_rows(8, 0, 8, 4);
  CHECK(r7 == r7b);
  CHECK(r7 != r8);
  for (const auto* rows_drawn : {&r7, &r8}) {
    REQUIRE(rows_drawn->size() == 4);
    for (std::size_t i = 0; i < rows_drawn->size(); ++i) {
      CHECK((*rows_drawn)[i] >= 0);
      CHECK((*rows_drawn)[i] < 8);
      for (std::size_t j = 0; j < i; ++j) CHECK((*rows_drawn)[i] != (*rows_drawn)[j]);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// The other states
// ---------------------------------------------------------------------------------------------

TEMPLATE_TEST_CASE("ovq state: the sliding-window KvCache keeps exactly the last W - 1 rows",
                   "[ovq][state]", float, double) {
  using S = TestType;
  const Mat<S> k = ovq::test::random_matrix<S>(12, 2, 301);
  const Mat<S> v = ovq::test::random_matrix<S>(12, 3, 302);
  const auto windowed = [](Index window, Index chunk) {
    ovq::SelfAttentionOptions opt;
    opt.window = window;
    opt.chunk = chunk;
    return ovq::SelfAttention<S>(opt);
  };
  for (Index window : {Index(1), Index(2), Index(4), Index(7)}) {
    CAPTURE(window);
    const ovq::SelfAttention<S> mixer = windowed(window, 2);
    auto st = mixer.make_state(2, 3);
    CHECK(st.keep_rows() == window - 1);
    // Pieces of 1, 5, 2, 1, 3 tokens: some shorter, some longer than the window.
    Index seen = 0;
    for (Index piece : {1, 5, 2, 1, 3}) {
      const Mat<S> q = Mat<S>::Zero(piece, 2);
      mixer.forward(st, q, Mat<S>(k.middleRows(seen, piece)), Mat<S>(v.middleRows(seen, piece)));
      seen += piece;
      CAPTURE(seen);
      const Index kept = std::min(seen, window - 1);
      CHECK(st.tokens() == seen);
      REQUIRE(st.size() == kept);
      // Bitwise the last `kept` rows, oldest first.
      CHECK(ovq::as_eigen(st.keys()) == k.middleRows(seen - kept, kept));
      CHECK(ovq::as_eigen(st.values()) == v.middleRows(seen - kept, kept));
    }
    // And by steps.
    auto st2 = mixer.make_state(2, 3);
    for (Index i = 0; i < 12; ++i)
      mixer.step(st2, Vec<S>::Zero(2), Vec<S>(k.row(i)), Vec<S>(v.row(i)));
    CHECK(st2 == st);
  }
  // Long streams: the kept rows move to the front of the buffer many times over (windows of
  // 2 to 71 tokens, pieces of 1 to 90 tokens); after every piece the cache holds exactly the last
  // rows, and reads them as its own history (the outputs of a cache rebuilt from them).
  const Index t = 600;
  const Mat<S> long_k = ovq::test::random_matrix<S>(t, 2, 303);
  const Mat<S> long_v = ovq::test::random_matrix<S>(t, 3, 304);
  const Mat<S> long_q = ovq::test::random_matrix<S>(t, 2, 305);
  std::mt19937 pieces_rng(306);
  for (Index window : {Index(2), Index(17), Index(33), Index(71)}) {
    CAPTURE(window);
    const ovq::SelfAttention<S> mixer = windowed(window, 8);
    auto st = mixer.make_state(2, 3);
    Index seen = 0;
    while (seen < t) {
      const Index piece = std::min<Index>(
          t - seen, std::uniform_int_distribution<Index>(1, pieces_rng() % 4 == 0 ? 90 : 3)(
                        pieces_rng));
      CAPTURE(seen, piece);
      // The same piece from a fresh cache holding the same rows: the same outputs, bitwise.
      auto rebuilt = mixer.make_state(2, 3);
      rebuilt.assign(st.keys(), st.values(), st.tokens());
      const Mat<S> q = long_q.middleRows(seen, piece);
      const Mat<S> k = long_k.middleRows(seen, piece);
      const Mat<S> v = long_v.middleRows(seen, piece);
      const Mat<S> o = mixer.forward(st, q, k, v);
      CHECK(mixer.forward(rebuilt, q, k, v) == o);
      seen += piece;
      const Index kept = std::min(seen, window - 1);
      REQUIRE(st.size() == kept);
      CHECK(st.tokens() == seen);
      CHECK(ovq::as_eigen(st.keys()) == long_k.middleRows(seen - kept, kept));
      CHECK(ovq::as_eigen(st.values()) == long_v.middleRows(seen - kept, kept));
      CHECK(st == rebuilt);
      // Once full, the cache keeps its slack: the kept rows move once per slack() tokens, not
      // at every step.
      if (kept == window - 1) CHECK(st.capacity() == kept + kept / 4 + 16);
    }
  }
  // Without a window every row is kept.
  const ovq::SelfAttention<S> full{};
  auto st = full.make_state(2, 3);
  full.forward(st, Mat<S>::Zero(12, 2), k, v);
  CHECK(st.size() == 12);
  CHECK(ovq::as_eigen(st.keys()) == k);
  CHECK(ovq::as_eigen(st.values()) == v);
}

// The flags Linux gives the mapping that holds `p` ("hg": advised to use huge pages), from
// /proc/self/smaps; empty where there is no such file.
std::string mapping_flags(const void* p) {
  std::ifstream smaps("/proc/self/smaps");
  const auto at = reinterpret_cast<std::uintptr_t>(p);
  bool inside = false;
  for (std::string line; std::getline(smaps, line);) {
    unsigned long long first = 0, last = 0;
    char dash = 0;
    std::istringstream fields(line);
    if (line.find(':') > line.find('-') && (fields >> std::hex >> first >> dash >> last) &&
        dash == '-') {
      inside = first <= at && at < last;
    } else if (inside && line.rfind("VmFlags:", 0) == 0) {
      return line;
    }
  }
  return {};
}

TEST_CASE("ovq state: a long KvCache keeps its rows in huge-page buffers, a short one in "
          "cache lines",
          "[ovq][state]") {
  using Buffer = ovq::RowBuffer<float>;
  // 10 x 16 floats: 640 bytes on a cache line; 5,000 x 128 floats (2.4 MiB): on a 2 MiB page.
  const Buffer small(10, 16);
  CHECK_FALSE(small.huge());
  CHECK(reinterpret_cast<std::uintptr_t>(small.data()) % Buffer::kCacheLine == 0);
  Buffer big(5000, 128);
  REQUIRE(big.huge());
  CHECK(reinterpret_cast<std::uintptr_t>(big.data()) % Buffer::kHugePage == 0);
  for (Index i = 0; i < 5000 * 128; ++i) big.data()[i] = static_cast<float>(i);
  // Resized, copied, moved: the rows asked for are kept, bit for bit.
  const Buffer grown = big.resized(8000, 5000);
  CHECK(grown.rows() == 8000);
  CHECK(std::equal(big.data(), big.data() + 5000 * 128, grown.data()));
  const Buffer shrunk = big.resized(3, 2);
  CHECK_FALSE(shrunk.huge());
  CHECK(std::equal(big.data(), big.data() + 2 * 128, shrunk.data()));
  Buffer copy(big);
  CHECK(copy.huge());
  CHECK(std::equal(big.data(), big.data() + 5000 * 128, copy.data()));
  const float* held = copy.data();
  const Buffer moved(std::move(copy));
  CHECK(moved.data() == held);
  CHECK(copy.data() == nullptr);  // NOLINT(bugprone-use-after-move): moved from, empty
  CHECK(copy.rows() == 0);        // NOLINT(bugprone-use-after-move)
#if defined(OVQ_HAS_HUGE_PAGE_ADVICE)
  // Where the kernel has transparent huge pages, the buffer's pages carry the advice.
  if (std::ifstream("/sys/kernel/mm/transparent_hugepage/enabled").good()) {
    CHECK(mapping_flags(big.data()).find(" hg") != std::string::npos);
    CHECK(mapping_flags(grown.data()).find(" hg") != std::string::npos);
  }
#endif

  // A cache that grows past 2 MiB (4,500 rows: 5,192 allocated, 2.5 MiB a side) moves to such a
  // buffer and keeps its rows in order.
  const Mat<float> k = ovq::test::random_matrix<float>(4500, 128, 311);
  const Mat<float> v = ovq::test::random_matrix<float>(4500, 128, 312);
  const ovq::SelfAttention<float> mixer{};
  auto st = mixer.make_state(128, 128);
  for (Index seen = 0; seen < 4500; seen += 500)
    mixer.absorb(st, Mat<float>(k.middleRows(seen, 500)), Mat<float>(v.middleRows(seen, 500)));
  REQUIRE(st.size() == 4500);
  CHECK(reinterpret_cast<std::uintptr_t>(st.keys().data) % Buffer::kHugePage == 0);
  CHECK(reinterpret_cast<std::uintptr_t>(st.values().data) % Buffer::kHugePage == 0);
  CHECK(ovq::as_eigen(st.keys()) == k);
  CHECK(ovq::as_eigen(st.values()) == v);
  const auto copied = st;
  CHECK(copied == st);

  // A size past what memory can address is refused before anything is allocated.
  const Index huge_rows = std::numeric_limits<Index>::max() / 64;
  CHECK_THROWS_AS(Buffer(huge_rows, 64), std::bad_alloc);
  CHECK_THROWS_AS(Buffer(-1, 64), std::bad_alloc);
}

TEMPLATE_TEST_CASE("ovq state: a dictionary keeps its rows and means in one allocation, on huge "
                   "pages from 2 MiB",
                   "[ovq][state]", float, ovq::bf16) {
  using E = TestType;
  using C = ovq::compute_t<E>;
  const auto at = [](const void* p) { return reinterpret_cast<std::uintptr_t>(p); };
  constexpr std::uintptr_t kHuge = ovq::RowBuffer<float>::kHugePage;
  // N = 2048, d = 128: 2 MiB of float rows (one huge page), or 1 MiB of bf16 rows and 2 MiB of
  // float means (the rows and the mean keys on the first huge page).
  ovq::Dictionary<E> dict(2048, 128, 128);
  const auto rows = dict.rows();
  CHECK(at(rows.keys.data) % kHuge == 0);
  CHECK(rows.values.data == rows.keys.data + 2048 * 128);
  CHECK(rows.mean_values.data == rows.mean_keys.data + 2048 * 128);
  if constexpr (std::is_same_v<E, float>) {
    CHECK(static_cast<const void*>(rows.mean_keys.data) == rows.keys.data);
  } else {
    CHECK(at(rows.mean_keys.data) == at(rows.values.data + 2048 * 128));
    CHECK(at(rows.mean_keys.data + 2048 * 128) <= at(rows.keys.data) + kHuge);
  }
#if defined(OVQ_HAS_HUGE_PAGE_ADVICE)
  if (std::ifstream("/sys/kernel/mm/transparent_hugepage/enabled").good())
    CHECK(mapping_flags(rows.keys.data).find(" hg") != std::string::npos);
#endif
  // Rows and means written through every accessor read back as written, copies included.
  const Mat<float> k = ovq::test::random_matrix<float>(3, 128, 321);
  const Mat<float> v = ovq::test::random_matrix<float>(3, 128, 322);
  for (Index r = 0; r < 3; ++r) {
    const Mat<E> kr = k.row(r).cast<E>(), vr = v.row(r).cast<E>();
    dict.push(kr.data(), vr.data(), r + 1);
  }
  const std::vector<C> mk(128, C(0.25)), mv(128, C(-0.5));
  dict.push_means(mk.data(), mv.data(), 7);
  REQUIRE(dict.size() == 4);
  for (Index r = 0; r < 3; ++r) {
    CHECK(ovq::as_eigen(dict.keys()).row(r) == k.row(r).cast<E>());
    CHECK(ovq::as_eigen(dict.values()).row(r) == v.row(r).cast<E>());
    CHECK(ovq::as_eigen(dict.mean_keys()).row(r) == k.row(r).cast<E>().template cast<C>());
    CHECK(ovq::as_eigen(dict.mean_values()).row(r) == v.row(r).cast<E>().template cast<C>());
    CHECK(dict.count(r) == r + 1);
  }
  CHECK(ovq::as_eigen(dict.keys()).row(3).template cast<C>().cwiseEqual(C(0.25)).all());
  CHECK(ovq::as_eigen(dict.values()).row(3).template cast<C>().cwiseEqual(C(-0.5)).all());
  const ovq::Dictionary<E> copy = dict;
  CHECK(copy == dict);
  CHECK(copy.keys().data != dict.keys().data);
  // Assigned over a dictionary of the same shape: into the buffer it holds; of another shape:
  // a new one. Moved: the rows go along, the source is left empty.
  ovq::Dictionary<E> same(2048, 128, 128);
  const E* held = same.keys().data;
  same = copy;
  CHECK(same == dict);
  CHECK(same.keys().data == held);
  ovq::Dictionary<E> other(5, 2, 3);
  other = copy;
  CHECK(other == dict);
  ovq::Dictionary<E> moved(std::move(other));
  CHECK(moved == dict);
  CHECK(other.capacity() == 0);  // NOLINT(bugprone-use-after-move): moved from, empty
  CHECK(other.size() == 0);      // NOLINT(bugprone-use-after-move)
  other = std::move(moved);
  CHECK(other == dict);
  CHECK(moved.capacity() == 0);  // NOLINT(bugprone-use-after-move)

  // Small and odd shapes (3 x (5 + 1) bf16 rows: 36 bytes): the means start on a cache line
  // past the rows, and rows and means written do not overlap.
  ovq::Dictionary<E> odd(3, 5, 1);
  const auto odd_rows = odd.rows();
  CHECK(at(odd_rows.keys.data) % 64 == 0);
  CHECK(at(odd_rows.mean_keys.data) % alignof(C) == 0);
  const Mat<float> odd_k = ovq::test::random_matrix<float>(3, 5, 323);
  const Mat<float> odd_v = ovq::test::random_matrix<float>(3, 1, 324);
  for (Index r = 0; r < 3; ++r) {
    const Mat<E> kr = odd_k.row(r).cast<E>(), vr = odd_v.row(r).cast<E>();
    odd.push(kr.data(), vr.data(), 1);
  }
  CHECK(ovq::as_eigen(odd.keys()) == odd_k.cast<E>());
  CHECK(ovq::as_eigen(odd.values()) == odd_v.cast<E>());
  CHECK(ovq::as_eigen(odd.mean_keys()) == odd_k.cast<E>().template cast<C>());
  CHECK(ovq::as_eigen(odd.mean_values()) == odd_v.cast<E>().template cast<C>());
  constexpr Index kMax = std::numeric_limits<Index>::max();
  CHECK_THROWS_AS(ovq::Dictionary<E>(kMax / 8, 128, 128), std::bad_alloc);
  CHECK_THROWS_AS(ovq::Dictionary<E>(1, kMax, kMax), std::bad_alloc);
  CHECK_THROWS_AS(ovq::Dictionary<E>(2, kMax / 8, kMax / 8), std::bad_alloc);
}

TEMPLATE_TEST_CASE("ovq state: VQ counts sum to the tokens of complete chunks and values are "
                   "per-code means",
                   "[ovq][state]", float, double) {
  using S = TestType;
  // Codebook of 5 codes in 2 dimensions; the last one is far from every key and stays unused.
  const Mat<S> codebook =
      rows<S>({{1, 0}, {0, 1}, {-1, 0}, {0, -1}, {50, 50}});
  ovq::VqAttentionOptions opt;
  opt.chunk = 4;
  const ovq::VqAttention<S> mixer(opt);
  auto st = mixer.make_state(codebook, 3);
  const Index t = 37;
  const Mat<S> k = ovq::test::random_matrix<S>(t, 2, 401);
  const Mat<S> v = ovq::test::random_matrix<S>(t, 3, 402);
  Index seen = 0;
  for (Index piece : {5, 1, 20, 11}) {
    mixer.forward(st, Mat<S>::Zero(piece, 2), Mat<S>(k.middleRows(seen, piece)),
                  Mat<S>(v.middleRows(seen, piece)));
    seen += piece;
  }
  REQUIRE(seen == t);

  // Independently: the nearest code by squared distance (ties: smallest s), then per-code
  // counts and mean values over the 9 complete chunks, in double; the last token is pending.
  const Index absorbed = t - t % opt.chunk;
  REQUIRE(st.pending() == t - absorbed);
  std::vector<std::int64_t> count(5, 0);
  Mat<double> sum = Mat<double>::Zero(5, 3);
  for (Index j = 0; j < t; ++j) {
    Index best = 0;
    double best_d = std::numeric_limits<double>::infinity();
    for (Index s = 0; s < 5; ++s) {
      double d = 0.0;
      for (Index c = 0; c < 2; ++c) {
        const double diff = static_cast<double>(k(j, c)) - static_cast<double>(codebook(s, c));
        d += diff * diff;
      }
      if (d < best_d) {
        best_d = d;
        best = s;
      }
    }
    if (j >= absorbed) {
      CHECK(st.pending_codes()[j - absorbed] == best);
      continue;
    }
    ++count[static_cast<std::size_t>(best)];
    sum.row(best) += v.row(j).template cast<double>();
  }
  REQUIRE(count[4] == 0);

  const ovq::Dictionary<S>& dict = st.dictionary();
  CHECK(dict.size() == 5);
  CHECK(st.tokens() == t);
  CHECK(dict.total_count() == absorbed);
  const auto values = ovq::as_eigen(dict.values());
  for (Index s = 0; s < 5; ++s) {
    CAPTURE(s);
    CHECK(dict.count(s) == count[static_cast<std::size_t>(s)]);
    for (Index c = 0; c < 3; ++c) {
      const double want =
          count[static_cast<std::size_t>(s)] > 0
              ? sum(s, c) / static_cast<double>(count[static_cast<std::size_t>(s)])
              : 0.0;
      CHECK(static_cast<double>(values(s, c)) ==
            Approx(want).margin(std::is_same_v<S, float> ? 1e-5 : 1e-12).epsilon(0));
    }
  }
  // The codebook itself never moves.
  CHECK(ovq::as_eigen(dict.keys()) == codebook);
}

}  // namespace ovq_test_ovq_state
