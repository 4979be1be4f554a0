// Argument checking of every public entry point.
//
// A bad argument must throw ovq::ArgumentError (an ovq::Error) whose message names the argument
// and what was expected, and the call must leave every state exactly as it was: each check below
// copies the state first and compares it (bitwise, through operator==) after the throw. States
// are "warm" (they already hold tokens, and the OVQ ones a partly filled pending buffer), so that
// a call that wrote anything before throwing would be seen.
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <sstream>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "support/catch.hpp"
#include "support/fixtures.hpp"
#include "support/matchers.hpp"

// Everything below lives in this file's own namespace, so the suite can be built as one
// unity source without the files' helpers colliding.
namespace ovq_test_errors {

namespace {

using ovq::Index;
template <class S>
using Mat = ovq::RowMatrix<S>;
template <class S>
using Vec = ovq::RowVector<S>;

using ovq::test::MessageHas;

// The call throws ovq::ArgumentError and its message contains every piece.
#define CHECK_ARG_ERROR(expr, ...) \
  CHECK_THROWS_MATCHES(expr, ovq::ArgumentError, MessageHas({__VA_ARGS__}))

template <class... Parts>
std::string str(const Parts&... parts) {
  std::ostringstream out;
  (out << ... << parts);
  return out.str();
}

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr double kInf = std::numeric_limits<double>::infinity();

// ---------------------------------------------------------------------------------------------
// One struct per mixer configuration: how to build the mixer and a state for it.
// ---------------------------------------------------------------------------------------------

template <class S>
struct SelfCase {
  using Scalar = S;
  using Mixer = ovq::SelfAttention<S>;
  using State = typename Mixer::State;
  static Mixer mixer() {
    ovq::SelfAttentionOptions o;
    o.beta = 0.5;
    o.chunk = 3;
    return Mixer(o);
  }
  static State state(const Mixer& m, Index dk, Index dv, std::uint64_t = 0) {
    return m.make_state(dk, dv);
  }
};

template <class S>
struct WindowCase {
  using Scalar = S;
  using Mixer = ovq::SelfAttention<S>;
  using State = typename Mixer::State;
  static Mixer mixer() {
    ovq::SelfAttentionOptions o;
    o.window = 4;
    o.chunk = 2;
    return Mixer(o);
  }
  static State state(const Mixer& m, Index dk, Index dv, std::uint64_t = 0) {
    return m.make_state(dk, dv);
  }
};

template <class S>
struct LinearCase {
  using Scalar = S;
  using Mixer = ovq::LinearAttention<S>;
  using State = typename Mixer::State;
  static Mixer mixer() {
    ovq::LinearAttentionOptions o;
    o.feature_map = ovq::FeatureMap::elu1;
    o.normalize = true;
    o.decay = 0.9;
    o.chunk = 3;
    return Mixer(o);
  }
  static State state(const Mixer& m, Index dk, Index dv, std::uint64_t = 0) {
    return m.make_state(dk, dv);
  }
};

template <class S>
struct VqCase {
  using Scalar = S;
  using Mixer = ovq::VqAttention<S>;
  using State = typename Mixer::State;
  static Mixer mixer() {
    ovq::VqAttentionOptions o;
    o.chunk = 3;
    return Mixer(o);
  }
  // A codebook of 6 codes of width dk; `seed` picks a different codebook per key/value head.
  static State state(const Mixer& m, Index dk, Index dv, std::uint64_t seed = 0) {
    return m.make_state(ovq::test::random_matrix<S>(6, dk, 900 + seed), dv);
  }
};

template <class S>
struct OvqCase {
  using Scalar = S;
  using Mixer = ovq::OvqAttention<S>;
  using State = typename Mixer::State;
  static Mixer mixer() {
    ovq::OvqOptions o;
    o.capacity = 8;
    o.chunk = 3;
    return Mixer(o);
  }
  static State state(const Mixer& m, Index dk, Index dv, std::uint64_t = 0) {
    return m.make_state(dk, dv);
  }
};

// A multi-head layer over Case's mixer, with a state per key/value head from Case::state.
template <class Case>
ovq::MultiHead<typename Case::Mixer> make_multi(const typename Case::Mixer& mixer, Index batch,
                                                Index hq, Index hkv, Index dk, Index dv) {
  std::vector<typename Case::State> states;
  for (Index h = 0; h < hkv; ++h)
    states.push_back(Case::state(mixer, dk, dv, static_cast<std::uint64_t>(h)));
  return ovq::MultiHead<typename Case::Mixer>(mixer, batch, hq, std::move(states));
}

// Q, K, V of T tokens and an output of the right shape.
template <class S>
struct Inputs {
  Mat<S> q, k, v, o;
  Inputs(Index t, Index dk, Index dv, std::uint64_t seed)
      : q(ovq::test::random_unit_rows<S>(t, dk, seed)),
        k(ovq::test::random_unit_rows<S>(t, dk, seed + 1)),
        v(ovq::test::random_matrix<S>(t, dv, seed + 2)),
        o(Mat<S>::Zero(t, dv)) {}
};

template <class S>
Mat<S> with_value(Mat<S> m, Index i, Index j, double value) {
  m(i, j) = static_cast<S>(value);
  return m;
}

}  // namespace

TEST_CASE("errors: ArgumentError is an ovq::Error", "[errors]") {
  STATIC_REQUIRE(std::is_base_of_v<ovq::Error, ovq::ArgumentError>);
  STATIC_REQUIRE(std::is_base_of_v<std::runtime_error, ovq::Error>);
  CHECK_THROWS_AS(ovq::OvqAttention<float>([] {
                    ovq::OvqOptions o;
                    o.capacity = 0;
                    return o;
                  }()),
                  ovq::Error);
}

// ---------------------------------------------------------------------------------------------
// forward / step of a single mixer
// ---------------------------------------------------------------------------------------------

TEMPLATE_TEST_CASE("errors: forward rejects shape mismatches and keeps the state", "[errors]",
                   SelfCase<double>, WindowCase<float>, LinearCase<double>, VqCase<double>,
                   VqCase<float>, OvqCase<double>, OvqCase<float>) {
  using S = typename TestType::Scalar;
  const Index dk = 4, dv = 3, t = 5;
  const auto mixer = TestType::mixer();
  auto state = TestType::state(mixer, dk, dv);
  // Warm up: 7 tokens (the OVQ state then holds 2 chunks and 1 pending row).
  const Inputs<S> warm(7, dk, dv, 11);
  mixer.forward(state, warm.q, warm.k, warm.v);
  const auto before = state;

  Inputs<S> in(t, dk, dv, 21);
  // Sanity: the well-formed call is accepted (on a copy).
  {
    auto copy = state;
    CHECK_NOTHROW(mixer.forward(copy, in.q, in.k, in.v, in.o));
  }

  SECTION("Q rows differ from K rows") {
    const Mat<S> q = in.q.topRows(t - 1);
    Mat<S> o(t - 1, dv);
    CHECK_ARG_ERROR(mixer.forward(state, q, in.k, in.v, o), "forward", "Q has 4 rows",
                    "expected 5", "rows of K");
  }
  SECTION("V rows differ from K rows") {
    const Mat<S> v = ovq::test::random_matrix<S>(t + 1, dv, 5);
    CHECK_ARG_ERROR(mixer.forward(state, in.q, in.k, v, in.o), "V has 6 rows", "expected 5",
                    "rows of K");
  }
  SECTION("K rows differ from Q and V rows") {
    const Mat<S> k = ovq::test::random_unit_rows<S>(t + 2, dk, 6);
    CHECK_ARG_ERROR(mixer.forward(state, in.q, k, in.v, in.o), "rows of K", "expected 7");
  }
  SECTION("O has the wrong number of rows") {
    Mat<S> o(t + 1, dv);
    CHECK_ARG_ERROR(mixer.forward(state, in.q, in.k, in.v, o), "O has shape (6, 3)",
                    "expected (5, 3)");
  }
  SECTION("O has the wrong number of columns") {
    Mat<S> o(t, dv - 1);
    CHECK_ARG_ERROR(mixer.forward(state, in.q, in.k, in.v, o), "O has shape (5, 2)",
                    "expected (5, 3)");
  }
  SECTION("Q width differs from the state's dk") {
    const Mat<S> q = ovq::test::random_matrix<S>(t, dk + 1, 7);
    CHECK_ARG_ERROR(mixer.forward(state, q, in.k, in.v, in.o), "Q has 5 columns", "expected 4",
                    "dk");
  }
  SECTION("K width differs from the state's dk (Q too)") {
    const Mat<S> q = ovq::test::random_matrix<S>(t, dk - 1, 7);
    const Mat<S> k = ovq::test::random_matrix<S>(t, dk - 1, 8);
    CHECK_ARG_ERROR(mixer.forward(state, q, k, in.v, in.o), "K has 3 columns", "expected 4",
                    "dk");
  }
  SECTION("V width differs from the state's dv (O too)") {
    const Mat<S> v = ovq::test::random_matrix<S>(t, dv + 2, 9);
    Mat<S> o(t, dv + 2);
    CHECK_ARG_ERROR(mixer.forward(state, in.q, in.k, v, o), "V has 5 columns", "expected 3",
                    "dv");
  }
  SECTION("the returning overload checks the same") {
    const Mat<S> v = ovq::test::random_matrix<S>(t, dv + 2, 9);
    CHECK_ARG_ERROR(mixer.forward(state, in.q, in.k, v), "V has 5 columns", "dv");
  }
  CHECK(state == before);
}

TEMPLATE_TEST_CASE("errors: NaN or infinity anywhere in Q, K or V is rejected, state kept",
                   "[errors]", SelfCase<double>, WindowCase<double>, LinearCase<float>,
                   VqCase<double>, OvqCase<double>, OvqCase<float>) {
  using S = typename TestType::Scalar;
  const Index dk = 4, dv = 3, t = 7;
  const auto mixer = TestType::mixer();
  auto state = TestType::state(mixer, dk, dv);
  const Inputs<S> warm(4, dk, dv, 31);
  mixer.forward(state, warm.q, warm.k, warm.v);
  const auto before = state;
  Inputs<S> in(t, dk, dv, 41);

  struct Pos {
    Index i, j;
  };
  for (double bad : {kNaN, kInf, -kInf}) {
    for (const char* name : {"Q", "K", "V"}) {
      const Index cols = std::string(name) == "V" ? dv : dk;
      // First element, middle, the very last element, and the first element of the last row.
      for (Pos p : {Pos{0, 0}, Pos{t / 2, 1}, Pos{t - 1, cols - 1}, Pos{t - 1, 0}}) {
        CAPTURE(bad, name, p.i, p.j);
        const std::string where = str(name, "(", p.i, ", ", p.j, ")");
        if (std::string(name) == "Q") {
          CHECK_ARG_ERROR(mixer.forward(state, with_value(in.q, p.i, p.j, bad), in.k, in.v, in.o),
                          where, "finite");
        } else if (std::string(name) == "K") {
          CHECK_ARG_ERROR(mixer.forward(state, in.q, with_value(in.k, p.i, p.j, bad), in.v, in.o),
                          where, "finite");
        } else {
          CHECK_ARG_ERROR(mixer.forward(state, in.q, in.k, with_value(in.v, p.i, p.j, bad), in.o),
                          where, "finite");
        }
        REQUIRE(state == before);
      }
    }
  }
  // A non-finite entry in a later chunk of the same call: nothing of the earlier, clean chunks
  // may have been absorbed.
  const Inputs<S> longer(20, dk, dv, 43);
  Mat<S> o(20, dv);
  CHECK_ARG_ERROR(mixer.forward(state, longer.q, with_value(longer.k, 19, dk - 1, kNaN), longer.v,
                                o),
                  "K(19, 3)", "finite");
  CHECK(state == before);
}

// The branch-free finiteness test (a vector at a time on AVX2: 4 doubles, 8 floats, 16 16-bit
// elements; a scalar tail) against std::isfinite: every length up to 40, every start alignment,
// every position of one special value; and check_finite names the first non-finite entry when a
// row holds two.
TEMPLATE_TEST_CASE("errors: the finiteness check agrees with std::isfinite everywhere",
                   "[errors]", float, double, ovq::bf16, ovq::fp16) {
  using S = TestType;
  const S specials[] = {std::numeric_limits<S>::infinity(), -std::numeric_limits<S>::infinity(),
                        std::numeric_limits<S>::quiet_NaN(), -std::numeric_limits<S>::quiet_NaN(),
                        std::numeric_limits<S>::signaling_NaN(), std::numeric_limits<S>::max(),
                        std::numeric_limits<S>::lowest(), std::numeric_limits<S>::denorm_min(),
                        S(-0.0), S(1.5)};
  std::vector<S> buffer(48);
  Index disagree = 0, checked = 0;
  for (Index offset = 0; offset < 8; ++offset) {
    for (Index n = 0; n + offset <= 48 && n <= 40; ++n) {
      S* x = buffer.data() + offset;
      for (Index j = 0; j < n; ++j) x[j] = S(0.25) * S(j % 7) - S(1);
      disagree += ovq::detail::all_finite(x, n) != ovq::detail::all_finite_reference(x, n);
      for (Index at = 0; at < n; ++at) {
        for (S special : specials) {
          const S kept = x[at];
          x[at] = special;
          disagree += ovq::detail::all_finite(x, n) != ovq::detail::all_finite_reference(x, n);
          ++checked;
          x[at] = kept;
        }
      }
    }
  }
  CAPTURE(checked);
  CHECK(checked > 10000);
  CHECK(disagree == 0);

  Mat<S> m = Mat<S>::Constant(3, 21, S(0.5));
  m(1, 17) = std::numeric_limits<S>::quiet_NaN();
  m(1, 9) = -std::numeric_limits<S>::infinity();
  m(2, 0) = std::numeric_limits<S>::infinity();
  CHECK_ARG_ERROR(ovq::detail::check_finite<S>("here", "X", ovq::rows_view(m)), "here",
                  "X(1, 9)", "finite");
}

TEMPLATE_TEST_CASE("errors: step rejects mismatched vector sizes and non-finite values",
                   "[errors]", SelfCase<double>, WindowCase<double>, LinearCase<double>,
                   VqCase<float>, OvqCase<double>) {
  using S = typename TestType::Scalar;
  const Index dk = 4, dv = 3;
  const auto mixer = TestType::mixer();
  auto state = TestType::state(mixer, dk, dv);
  const Inputs<S> warm(5, dk, dv, 51);
  mixer.forward(state, warm.q, warm.k, warm.v);
  const auto before = state;

  const Vec<S> q = ovq::test::random_unit_rows<S>(1, dk, 52);
  const Vec<S> k = ovq::test::random_unit_rows<S>(1, dk, 53);
  const Vec<S> v = ovq::test::random_matrix<S>(1, dv, 54);
  Vec<S> o(dv);
  {
    auto copy = state;
    CHECK_NOTHROW(mixer.step(copy, q, k, v, o));
  }

  SECTION("q too long") {
    const Vec<S> q5 = ovq::test::random_matrix<S>(1, dk + 1, 55);
    CHECK_ARG_ERROR(mixer.step(state, q5, k, v, o), "step", "Q has 5 columns", "expected 4");
  }
  SECTION("k too short") {
    const Vec<S> k3 = ovq::test::random_matrix<S>(1, dk - 1, 56);
    CHECK_ARG_ERROR(mixer.step(state, q, k3, v, o), "step", "K has 3 columns", "expected 4");
  }
  SECTION("v of the wrong size") {
    const Vec<S> v4 = ovq::test::random_matrix<S>(1, dv + 1, 57);
    CHECK_ARG_ERROR(mixer.step(state, q, k, v4, o), "step", "V has 4 columns", "expected 3");
    CHECK_ARG_ERROR(mixer.step(state, q, k, v4), "step", "V has 4 columns");
  }
  SECTION("o of the wrong size") {
    Vec<S> o2(dv - 1);
    CHECK_ARG_ERROR(mixer.step(state, q, k, v, o2), "step", "O has shape (1, 2)",
                    "expected (1, 3)");
  }
  SECTION("q, k and v of size 0") {
    const Vec<S> e(0);
    CHECK_ARG_ERROR(mixer.step(state, e, k, v, o), "step", "Q has 0 columns");
    CHECK_ARG_ERROR(mixer.step(state, q, e, v, o), "step", "K has 0 columns");
    CHECK_ARG_ERROR(mixer.step(state, q, k, e, o), "step", "V has 0 columns");
  }
  SECTION("non-finite values") {
    CHECK_ARG_ERROR(mixer.step(state, q, Vec<S>(with_value<S>(k, 0, dk - 1, kNaN)), v, o),
                    "step", "K(0, 3)", "finite");
    CHECK_ARG_ERROR(mixer.step(state, Vec<S>(with_value<S>(q, 0, 0, kInf)), k, v, o), "Q(0, 0)",
                    "finite");
    CHECK_ARG_ERROR(mixer.step(state, q, k, Vec<S>(with_value<S>(v, 0, 2, -kInf)), o),
                    "V(0, 2)", "finite");
  }
  CHECK(state == before);
}

TEMPLATE_TEST_CASE("errors: absorb and forward_heads check like forward", "[errors]",
                   SelfCase<double>, WindowCase<double>, LinearCase<float>, VqCase<double>,
                   OvqCase<double>, OvqCase<float>) {
  using S = typename TestType::Scalar;
  const Index dk = 4, dv = 3, t = 5;
  const auto mixer = TestType::mixer();
  auto state = TestType::state(mixer, dk, dv);
  const Inputs<S> warm(7, dk, dv, 56);
  mixer.forward(state, warm.q, warm.k, warm.v);
  const auto before = state;
  Inputs<S> in(t, dk, dv, 57);
  {
    auto copy = state;
    CHECK_NOTHROW(mixer.absorb(copy, in.k, in.v));
  }

  SECTION("absorb: K width") {
    const Mat<S> k = ovq::test::random_matrix<S>(t, dk + 1, 58);
    CHECK_ARG_ERROR(mixer.absorb(state, k, in.v), "absorb", "K has 5 columns", "expected 4",
                    "dk");
  }
  SECTION("absorb: V width") {
    const Mat<S> v = ovq::test::random_matrix<S>(t, dv - 1, 59);
    CHECK_ARG_ERROR(mixer.absorb(state, in.k, v), "absorb", "V has 2 columns", "expected 3",
                    "dv");
  }
  SECTION("absorb: V rows differ from K rows") {
    const Mat<S> v = ovq::test::random_matrix<S>(t - 2, dv, 60);
    CHECK_ARG_ERROR(mixer.absorb(state, in.k, v), "absorb", "V has 3 rows", "expected 5",
                    "rows of K");
  }
  SECTION("absorb: non-finite K or V, the last element included") {
    CHECK_ARG_ERROR(mixer.absorb(state, with_value(in.k, t - 1, dk - 1, kNaN), in.v), "absorb",
                    "K(4, 3)", "finite");
    CHECK_ARG_ERROR(mixer.absorb(state, in.k, with_value(in.v, t - 1, dv - 1, kInf)), "absorb",
                    "V(4, 2)", "finite");
    CHECK_ARG_ERROR(mixer.absorb(state, with_value(in.k, 2, 0, -kInf), in.v), "K(2, 0)",
                    "finite");
  }
  SECTION("absorb: empty state") {
    typename TestType::State empty;
    CHECK_ARG_ERROR(mixer.absorb(empty, in.k, in.v), "absorb", "state is empty");
  }
  SECTION("forward_heads: 0 query heads") {
    const ovq::ConstRowsView<S> k = ovq::rows_view(in.k);
    const ovq::ConstRowsView<S> v = ovq::rows_view(in.v);
    CHECK_ARG_ERROR(mixer.forward_heads(state, nullptr, 0, k, v, nullptr), "query heads = 0",
                    "expected >= 1");
  }
  SECTION("forward_heads: NaN in the second of two query heads") {
    const Mat<S> q2 = with_value(in.q, t - 1, dk - 1, kNaN);
    Mat<S> o2(t, dv);
    const ovq::ConstRowsView<S> qs[2] = {ovq::rows_view(in.q), ovq::rows_view(q2)};
    const ovq::RowsView<S> os[2] = {ovq::rows_view(in.o), ovq::rows_view(o2)};
    CHECK_ARG_ERROR(mixer.forward_heads(state, qs, 2, ovq::rows_view(in.k), ovq::rows_view(in.v),
                                        os),
                    "Q(4, 3)", "finite");
  }
  SECTION("forward_heads: the second head's O of the wrong shape") {
    Mat<S> o2(t, dv + 1);
    const ovq::ConstRowsView<S> qs[2] = {ovq::rows_view(in.q), ovq::rows_view(in.q)};
    const ovq::RowsView<S> os[2] = {ovq::rows_view(in.o), ovq::rows_view(o2)};
    CHECK_ARG_ERROR(mixer.forward_heads(state, qs, 2, ovq::rows_view(in.k), ovq::rows_view(in.v),
                                        os),
                    "O has shape (5, 4)", "expected (5, 3)");
  }
  CHECK(state == before);
}

TEMPLATE_TEST_CASE("errors: a default-constructed (empty) state is rejected", "[errors]",
                   SelfCase<double>, WindowCase<double>, LinearCase<double>, VqCase<double>,
                   OvqCase<float>) {
  using S = typename TestType::Scalar;
  const auto mixer = TestType::mixer();
  typename TestType::State empty;
  const auto before = empty;
  const Inputs<S> in(3, 2, 2, 61);
  Mat<S> o(3, 2);
  CHECK_ARG_ERROR(mixer.forward(empty, in.q, in.k, in.v, o), "forward", "state is empty",
                  "make_state");
  CHECK_ARG_ERROR(mixer.step(empty, Vec<S>(in.q.row(0)), Vec<S>(in.k.row(0)), Vec<S>(in.v.row(0))),
                  "step", "state is empty");
  // Even an input of 0 tokens needs a real state.
  const Mat<S> none(0, 2);
  Mat<S> o0(0, 2);
  CHECK_ARG_ERROR(mixer.forward(empty, none, none, none, o0), "state is empty");
  CHECK(empty == before);
}

TEMPLATE_TEST_CASE("errors: an input of 0 tokens is accepted and changes nothing", "[errors]",
                   SelfCase<double>, WindowCase<double>, LinearCase<double>, VqCase<double>,
                   OvqCase<double>) {
  using S = typename TestType::Scalar;
  const auto mixer = TestType::mixer();
  auto state = TestType::state(mixer, 2, 3);
  const Inputs<S> warm(4, 2, 3, 62);
  mixer.forward(state, warm.q, warm.k, warm.v);
  const auto before = state;
  const Mat<S> q(0, 2), k(0, 2), v(0, 3);
  Mat<S> o(0, 3);
  CHECK_NOTHROW(mixer.forward(state, q, k, v, o));
  CHECK(state == before);
}

TEMPLATE_TEST_CASE("errors: make_state rejects dimensions of 0", "[errors]", SelfCase<double>,
                   WindowCase<float>, LinearCase<double>, OvqCase<double>, OvqCase<float>) {
  const auto mixer = TestType::mixer();
  CHECK_ARG_ERROR(mixer.make_state(0, 3), "dk = 0", "expected >= 1");
  CHECK_ARG_ERROR(mixer.make_state(3, 0), "dv = 0", "expected >= 1");
}

// Negative dimensions reach Eigen's matrix constructors before ovq's own check in several
// states (Dictionary, OvqState, LinearState). Without NDEBUG, Eigen's assertion aborts the
// whole test run, so these run only in builds with NDEBUG (CMake Release / RelWithDebInfo).
TEMPLATE_TEST_CASE("errors: make_state rejects negative dimensions", "[errors]",
                   SelfCase<double>, LinearCase<double>, OvqCase<double>) {
#if defined(NDEBUG)
  const auto mixer = TestType::mixer();
  CHECK_ARG_ERROR(mixer.make_state(-1, 3), "dk = -1", "expected >= 1");
  CHECK_ARG_ERROR(mixer.make_state(3, -2), "dv = -2", "expected >= 1");
#else
  WARN("skipped: negative dimensions are only probed in builds with NDEBUG");
#endif
}

// ---------------------------------------------------------------------------------------------
// Options, validated by the mixer constructors
// ---------------------------------------------------------------------------------------------

TEST_CASE("errors: SelfAttentionOptions are validated by the constructor", "[errors]") {
  using M = ovq::SelfAttention<double>;
  auto with = [](auto edit) {
    ovq::SelfAttentionOptions o;
    edit(o);
    return o;
  };
  for (ovq::Index chunk : {ovq::Index(0), ovq::Index(-1)}) {
    CHECK_ARG_ERROR(M(with([&](auto& o) { o.chunk = chunk; })), "SelfAttention",
                    str("chunk = ", chunk), "expected >= 1");
  }
  for (double beta : {kNaN, kInf, -kInf, 0.0, -1.0}) {
    CAPTURE(beta);
    CHECK_ARG_ERROR(M(with([&](auto& o) { o.beta = beta; })), "SelfAttention", "beta",
                    "expected a finite value > 0");
  }
  CHECK_ARG_ERROR(M(with([](auto& o) { o.window = -1; })), "window = -1", "expected >= 0");
  CHECK_ARG_ERROR(M(with([](auto& o) {
                    o.causal = false;
                    o.window = 4;
                  })),
                  "window = 4", "non-causal");
  CHECK_NOTHROW(M(with([](auto& o) { o.window = 1; })));
  CHECK_NOTHROW(M(with([](auto& o) { o.causal = false; })));
}

TEST_CASE("errors: LinearAttentionOptions are validated by the constructor", "[errors]") {
  using M = ovq::LinearAttention<float>;
  auto with = [](auto edit) {
    ovq::LinearAttentionOptions o;
    edit(o);
    return o;
  };
  // Too large a chunk is refused before anything is sized from it.
  for (ovq::Index chunk : {ovq::Index(0), ovq::Index(-3), ovq::detail::kMaxChunk + 1,
                           std::numeric_limits<ovq::Index>::max()}) {
    CHECK_ARG_ERROR(M(with([&](auto& o) { o.chunk = chunk; })), "LinearAttention",
                    str("chunk = ", chunk), str("expected 1 ... ", ovq::detail::kMaxChunk));
  }
  for (double beta : {kNaN, kInf, 0.0, -1.0}) {
    CAPTURE(beta);
    CHECK_ARG_ERROR(M(with([&](auto& o) { o.beta = beta; })), "LinearAttention", "beta",
                    "expected a finite value > 0");
  }
  for (double decay : {0.0, -0.5, 1.0000001, 2.0, kNaN, kInf, -kInf}) {
    CAPTURE(decay);
    CHECK_ARG_ERROR(M(with([&](auto& o) { o.decay = decay; })), "LinearAttention", "decay",
                    "(0, 1]");
  }
  for (double eps : {-1e-9, kNaN, kInf}) {
    CAPTURE(eps);
    CHECK_ARG_ERROR(M(with([&](auto& o) { o.eps = eps; })), "eps", "expected a finite value >= 0");
  }
  CHECK_NOTHROW(M(with([](auto& o) { o.decay = 1.0; })));
  CHECK_NOTHROW(M(with([](auto& o) { o.decay = 1e-300; })));
  CHECK_NOTHROW(M(with([](auto& o) { o.eps = 0.0; })));
}

TEST_CASE("errors: VqAttentionOptions are validated by the constructor", "[errors]") {
  using M = ovq::VqAttention<double>;
  auto with = [](auto edit) {
    ovq::VqAttentionOptions o;
    edit(o);
    return o;
  };
  for (ovq::Index chunk : {ovq::Index(0), ovq::detail::kMaxChunk + 1}) {
    CHECK_ARG_ERROR(M(with([&](auto& o) { o.chunk = chunk; })), "VqAttention",
                    str("chunk = ", chunk), str("expected 1 ... ", ovq::detail::kMaxChunk));
  }
  for (double beta : {kNaN, kInf, 0.0, -1.0}) {
    CAPTURE(beta);
    CHECK_ARG_ERROR(M(with([&](auto& o) { o.beta = beta; })), "VqAttention", "beta",
                    "expected a finite value > 0");
  }
}

TEST_CASE("errors: OvqOptions are validated by the constructor", "[errors]") {
  using M = ovq::OvqAttention<double>;
  auto with = [](auto edit) {
    ovq::OvqOptions o;
    edit(o);
    return o;
  };
  for (ovq::Index n : {ovq::Index(0), ovq::Index(-4)}) {
    CHECK_ARG_ERROR(M(with([&](auto& o) { o.capacity = n; })), "OvqAttention",
                    str("capacity = ", n), "expected >= 1");
    CHECK_ARG_ERROR(M(with([&](auto& o) { o.chunk = n; })), "OvqAttention",
                    str("chunk = ", n), str("expected 1 ... ", ovq::detail::kMaxChunk));
  }
  CHECK_ARG_ERROR(M(with([](auto& o) { o.chunk = ovq::detail::kMaxChunk + 1; })), "OvqAttention",
                  str("chunk = ", ovq::detail::kMaxChunk + 1), "expected 1 ...");
  for (double beta : {kNaN, kInf, -kInf, 0.0, -1.0}) {
    CAPTURE(beta);
    CHECK_ARG_ERROR(M(with([&](auto& o) { o.beta = beta; })), "OvqAttention", "beta",
                    "expected a finite value > 0");
  }
  for (double alpha : {-1.0, -1e-300, kNaN, kInf, -kInf}) {
    CAPTURE(alpha);
    CHECK_ARG_ERROR(M(with([&](auto& o) { o.growth = ovq::Growth::dirichlet(alpha); })),
                    "OvqAttention", "growth alpha", "expected");
  }
  for (double rate : {0.0, -1.0, kNaN, kInf}) {
    CAPTURE(rate);
    CHECK_ARG_ERROR(M(with([&](auto& o) { o.growth = ovq::Growth::linear(rate); })),
                    "OvqAttention", "growth rate", "expected a finite value > 0");
  }
  for (double eta : {0.0, -0.25, 1.5, 1.0000001, kNaN, kInf}) {
    CAPTURE(eta);
    CHECK_ARG_ERROR(M(with([&](auto& o) { o.rate = ovq::UpdateRate::constant(eta); })),
                    "OvqAttention", "eta", "(0, 1]");
  }
  CHECK_NOTHROW(M(with([](auto& o) { o.rate = ovq::UpdateRate::constant(1.0); })));
  CHECK_NOTHROW(M(with([](auto& o) { o.growth = ovq::Growth::dirichlet(0.0); })));
  CHECK_NOTHROW(M(with([](auto& o) { o.growth = ovq::Growth::linear(0.01); })));
  CHECK_NOTHROW(M(with([](auto& o) { o.capacity = 1; o.chunk = 1; })));
}

// ---------------------------------------------------------------------------------------------
// States from another configuration
// ---------------------------------------------------------------------------------------------

TEST_CASE("errors: an OVQ state of another capacity or chunk length is rejected", "[errors]") {
  ovq::OvqOptions o16;
  o16.capacity = 16;
  o16.chunk = 4;
  ovq::OvqOptions o32 = o16;
  o32.capacity = 32;
  ovq::OvqOptions o16c8 = o16;
  o16c8.chunk = 8;
  const ovq::OvqAttention<double> m16(o16), m32(o32), m16c8(o16c8);

  auto state = m16.make_state(4, 2);
  const Inputs<double> warm(6, 4, 2, 71);
  m16.forward(state, warm.q, warm.k, warm.v);  // 1 chunk absorbed, 2 rows pending
  const auto before = state;
  Inputs<double> in(5, 4, 2, 72);

  CHECK_ARG_ERROR(m32.forward(state, in.q, in.k, in.v, in.o), "forward", "capacity = 16",
                  "expected 32");
  CHECK_ARG_ERROR(m32.step(state, Vec<double>(in.q.row(0)), Vec<double>(in.k.row(0)),
                           Vec<double>(in.v.row(0))),
                  "step", "capacity = 16", "expected 32");
  CHECK_ARG_ERROR(m16c8.forward(state, in.q, in.k, in.v, in.o), "chunk = 4", "expected 8");
  CHECK(state == before);
}

// Linear and VQ states hold the pending rows of a chunk of the mixer's length: a mixer of another
// chunk length must not continue them.
template <class Mixer, class State>
void check_chunk_mismatch(const Mixer& other, State& state, Index other_chunk) {
  using S = typename Mixer::scalar_type;
  const auto before = state;
  const std::string got = str("state chunk = ", state.chunk());
  const std::string want = str("expected ", other_chunk, " (the mixer's)");
  Inputs<S> in(5, state.key_dim(), state.value_dim(), 74);
  CHECK_ARG_ERROR(other.forward(state, in.q, in.k, in.v, in.o), "forward", got, want);
  CHECK_ARG_ERROR(other.step(state, Vec<S>(in.q.row(0)), Vec<S>(in.k.row(0)), Vec<S>(in.v.row(0))),
                  "step", got, want);
  CHECK_ARG_ERROR(other.absorb(state, in.k, in.v), "absorb", got, want);
  const ovq::ConstRowsView<S> qs[1] = {ovq::rows_view(in.q)};
  const ovq::RowsView<S> os[1] = {ovq::rows_view(in.o)};
  CHECK_ARG_ERROR(other.forward_heads(state, qs, 1, ovq::rows_view(in.k), ovq::rows_view(in.v), os),
                  got, want);
  CHECK_ARG_ERROR(ovq::MultiHead<Mixer>(other, 1, 2, std::vector<State>{state}), "MultiHead", got,
                  want);
  CHECK(state == before);
}

TEST_CASE("errors: a linear or VQ state of another chunk length is rejected, state kept",
          "[errors]") {
  const Inputs<double> warm(7, 4, 3, 73);
  {
    INFO("linear attention");
    ovq::LinearAttentionOptions o;
    o.chunk = 4;
    const ovq::LinearAttention<double> m4(o);
    o.chunk = 8;
    const ovq::LinearAttention<double> m8(o);
    auto state = m4.make_state(4, 3);
    m4.forward(state, warm.q, warm.k, warm.v);  // 1 chunk absorbed, 3 rows pending
    REQUIRE(state.pending() == 3);
    check_chunk_mismatch(m8, state, 8);
    CHECK_ARG_ERROR(m8.sums(state), "sums", "state chunk = 4", "expected 8");
    // A chunk of 1 keeps nothing pending, but is still another state.
    o.chunk = 1;
    const ovq::LinearAttention<double> m1(o);
    auto state1 = m1.make_state(4, 3);
    m1.forward(state1, warm.q, warm.k, warm.v);
    check_chunk_mismatch(m4, state1, 4);
    CHECK_ARG_ERROR(ovq::LinearAttention<float>(o).make_state(4, 0), "dv = 0");
  }
  {
    INFO("VQ-attention");
    const ovq::VqAttention<double> m4(ovq::VqAttentionOptions{1.0, 4});
    const ovq::VqAttention<double> m3(ovq::VqAttentionOptions{1.0, 3});
    auto state = m4.make_state(ovq::test::random_matrix<double>(5, 4, 75), 3);
    m4.forward(state, warm.q, warm.k, warm.v);
    REQUIRE(state.pending() == 3);
    check_chunk_mismatch(m3, state, 3);
  }
  {
    INFO("the states' own constructors check the chunk");
    CHECK_ARG_ERROR(ovq::LinearState<double>(4, 3, 0), "LinearState", "chunk = 0", "expected >= 1");
    const Mat<double> codebook = ovq::test::random_matrix<double>(5, 4, 76);
    CHECK_ARG_ERROR(ovq::VqState<double>(ovq::rows_view(codebook), 3, 0), "VqState", "chunk = 0",
                    "expected >= 1");
  }
}

TEST_CASE("errors: a self-attention state of a window mixer is rejected by another", "[errors]") {
  ovq::SelfAttentionOptions win;
  win.window = 4;
  ovq::SelfAttentionOptions win8 = win;
  win8.window = 8;
  const ovq::SelfAttention<double> windowed(win), windowed8(win8), full{};
  const Inputs<double> warm(6, 3, 2, 81);
  Inputs<double> in(2, 3, 2, 82);

  auto wstate = windowed.make_state(3, 2);
  windowed.forward(wstate, warm.q, warm.k, warm.v);
  const auto wbefore = wstate;
  CHECK_ARG_ERROR(full.forward(wstate, in.q, in.k, in.v, in.o), "state keeps 3 rows",
                  "expected -1");
  CHECK_ARG_ERROR(windowed8.forward(wstate, in.q, in.k, in.v, in.o), "state keeps 3 rows",
                  "expected 7", "window 8");
  CHECK(wstate == wbefore);

  auto fstate = full.make_state(3, 2);
  full.forward(fstate, warm.q, warm.k, warm.v);
  const auto fbefore = fstate;
  CHECK_ARG_ERROR(windowed.forward(fstate, in.q, in.k, in.v, in.o), "state keeps -1 rows",
                  "expected 3", "window 4");
  CHECK_ARG_ERROR(windowed.step(fstate, Vec<double>(in.q.row(0)), Vec<double>(in.k.row(0)),
                                Vec<double>(in.v.row(0))),
                  "step", "state keeps -1 rows");
  CHECK(fstate == fbefore);
}

TEST_CASE("errors: VQ codebook checks", "[errors]") {
  const ovq::VqAttention<double> mixer{};
  SECTION("a codebook of width 5 cannot quantise keys of width 8") {
    auto state = mixer.make_state(ovq::test::random_matrix<double>(4, 5, 91), 3);
    const Inputs<double> warm(3, 5, 3, 92);
    mixer.forward(state, warm.q, warm.k, warm.v);
    const auto before = state;
    Inputs<double> in(6, 8, 3, 93);
    CHECK_ARG_ERROR(mixer.forward(state, in.q, in.k, in.v, in.o), "has 8 columns", "expected 5",
                    "dk");
    // Q of the codebook's width, K of width 8: the message is about K.
    const Mat<double> q5 = ovq::test::random_matrix<double>(6, 5, 94);
    CHECK_ARG_ERROR(mixer.forward(state, q5, in.k, in.v, in.o), "K has 8 columns", "expected 5",
                    "dk");
    CHECK(state == before);
  }
  SECTION("make_state") {
    CHECK_ARG_ERROR(mixer.make_state(Mat<double>(0, 4), 3), "codebook rows = 0",
                    "expected >= 1");
    CHECK_ARG_ERROR(mixer.make_state(ovq::test::random_matrix<double>(4, 4, 95), 0), "dv = 0",
                    "expected >= 1");
    CHECK_ARG_ERROR(mixer.make_state(Mat<double>(3, 0), 2), "dk = 0", "expected >= 1");
    for (double bad : {kNaN, kInf, -kInf}) {
      CHECK_ARG_ERROR(
          mixer.make_state(with_value(ovq::test::random_matrix<double>(4, 4, 96), 3, 3, bad), 2),
          "codebook(3, 3)", "finite");
    }
#if defined(NDEBUG)
    // Negative dv: see "make_state rejects negative dimensions".
    CHECK_ARG_ERROR(mixer.make_state(ovq::test::random_matrix<double>(4, 4, 95), -1), "dv = -1",
                    "expected >= 1");
#endif
  }
}

// ---------------------------------------------------------------------------------------------
// MultiHead
// ---------------------------------------------------------------------------------------------

TEMPLATE_TEST_CASE("errors: MultiHead construction", "[errors]", SelfCase<double>,
                   LinearCase<double>, VqCase<double>, OvqCase<float>) {
  using Mixer = typename TestType::Mixer;
  using MH = ovq::MultiHead<Mixer>;
  const Mixer mixer = TestType::mixer();
  using StateVec = std::vector<typename TestType::State>;
  auto states = [&](Index n) {
    StateVec v;
    for (Index h = 0; h < n; ++h) v.push_back(TestType::state(mixer, 4, 3, h));
    return v;
  };

  CHECK_ARG_ERROR(MH(mixer, 1, 3, states(2)), "query_heads = 3",
                  "expected a multiple of kv_heads = 2");
  CHECK_ARG_ERROR(MH(mixer, 2, 4, states(3)), "query_heads = 4", "kv_heads = 3");
  CHECK_ARG_ERROR(MH(mixer, 0, 2, states(1)), "batch = 0", "expected >= 1");
  CHECK_ARG_ERROR(MH(mixer, 1, 0, states(1)), "query_heads = 0", "expected >= 1");
  CHECK_ARG_ERROR(MH(mixer, 1, 2, StateVec{}), "kv_heads = 0", "expected >= 1");
  CHECK_ARG_ERROR(MH(mixer, 1, 2, StateVec(2)), "MultiHead", "state is empty");

  // Key/value head states of different widths.
  {
    StateVec mixed = states(1);
    mixed.push_back(TestType::state(mixer, 5, 3, 1));
    CHECK_ARG_ERROR(MH(mixer, 1, 2, mixed), "MultiHead", "different (dk, dv)");
  }
  {
    StateVec mixed = states(1);
    mixed.push_back(TestType::state(mixer, 4, 2, 1));
    CHECK_ARG_ERROR(MH(mixer, 1, 2, mixed), "MultiHead", "different (dk, dv)");
  }
  CHECK_NOTHROW(MH(mixer, 2, 4, states(2)));
}

TEMPLATE_TEST_CASE("errors: MultiHead dims constructor", "[errors]", SelfCase<double>,
                   WindowCase<double>, LinearCase<double>, OvqCase<double>) {
  using MH = ovq::MultiHead<typename TestType::Mixer>;
  const auto mixer = TestType::mixer();
  CHECK_ARG_ERROR(MH(mixer, 2, 6, 4, 8, 8), "query_heads = 6", "kv_heads = 4");
  CHECK_ARG_ERROR(MH(mixer, 2, 4, 0, 8, 8), "kv_heads = 0");
  CHECK_ARG_ERROR(MH(mixer, -1, 4, 2, 8, 8), "batch = -1");
  CHECK_ARG_ERROR(MH(mixer, 1, 4, 2, 0, 8), "dk = 0");
  CHECK_ARG_ERROR(MH(mixer, 1, 4, 2, 8, 0), "dv = 0");
  CHECK_NOTHROW(MH(mixer, 1, 4, 2, 8, 8));
}

TEST_CASE("errors: MultiHead with an OVQ state of another capacity is rejected", "[errors]") {
  ovq::OvqOptions o16;
  o16.capacity = 16;
  ovq::OvqOptions o32 = o16;
  o32.capacity = 32;
  const ovq::OvqAttention<double> m16(o16), m32(o32);
  std::vector<ovq::OvqState<double>> states{m32.make_state(4, 2), m16.make_state(4, 2)};
  CHECK_ARG_ERROR(ovq::MultiHead<ovq::OvqAttention<double>>(m32, 1, 2, states), "MultiHead",
                  "capacity = 16", "expected 32");
}

TEST_CASE("errors: MultiHead of VQ heads whose codebooks have different widths", "[errors]") {
  const ovq::VqAttention<double> mixer{};
  std::vector<ovq::VqState<double>> states{
      mixer.make_state(ovq::test::random_matrix<double>(4, 8, 101), 3),
      mixer.make_state(ovq::test::random_matrix<double>(4, 5, 102), 3)};
  CHECK_ARG_ERROR(ovq::MultiHead<ovq::VqAttention<double>>(mixer, 1, 2, states), "MultiHead",
                  "dk");
}

TEMPLATE_TEST_CASE("errors: a failing MultiHead call leaves all its states unchanged", "[errors]",
                   SelfCase<double>, WindowCase<float>, LinearCase<double>, VqCase<double>,
                   OvqCase<double>, OvqCase<float>) {
  using S = typename TestType::Scalar;
  const Index batch = 2, hq = 4, hkv = 2, dk = 4, dv = 3, t = 5;
  auto mh = make_multi<TestType>(TestType::mixer(), batch, hq, hkv, dk, dv);
  // Warm every state (7 tokens per head).
  {
    const Mat<S> q = ovq::test::random_unit_rows<S>(batch * hq * 7, dk, 111);
    const Mat<S> k = ovq::test::random_unit_rows<S>(batch * hkv * 7, dk, 112);
    const Mat<S> v = ovq::test::random_matrix<S>(batch * hkv * 7, dv, 113);
    mh.forward(q, k, v);
  }
  const auto before = mh.states();
  REQUIRE(before.size() == static_cast<std::size_t>(batch * hkv));

  const Mat<S> q = ovq::test::random_unit_rows<S>(batch * hq * t, dk, 121);
  const Mat<S> k = ovq::test::random_unit_rows<S>(batch * hkv * t, dk, 122);
  const Mat<S> v = ovq::test::random_matrix<S>(batch * hkv * t, dv, 123);
  Mat<S> o(batch * hq * t, dv);
  {
    auto copy = mh;
    CHECK_NOTHROW(copy.forward(q, k, v, o));
  }

  SECTION("NaN in the last element of the last head's K") {
    CHECK_ARG_ERROR(mh.forward(q, with_value(k, k.rows() - 1, dk - 1, kNaN), v, o), "K(4, 3)",
                    "finite");
  }
  SECTION("infinity in the first row of the last head's K") {
    CHECK_ARG_ERROR(mh.forward(q, with_value(k, (batch * hkv - 1) * t, 0, kInf), v, o), "K(0, 0)",
                    "finite");
  }
  SECTION("NaN in a middle query head (earlier heads fine)") {
    // Query head 5 = batch 1, head 1: reads state (1, 0), after states (0, 0) and (0, 1).
    CHECK_ARG_ERROR(mh.forward(with_value(q, 5 * t + 2, 1, kNaN), k, v, o), "Q(2, 1)", "finite");
  }
  SECTION("infinity in the last element of V") {
    CHECK_ARG_ERROR(mh.forward(q, k, with_value(v, v.rows() - 1, dv - 1, -kInf), o), "V(4, 2)",
                    "finite");
  }
  SECTION("NaN in a middle key/value head") {
    CHECK_ARG_ERROR(mh.forward(q, k, with_value(v, 2 * t + 3, 0, kNaN), o), "V(3, 0)", "finite");
  }
  SECTION("NaN in two key/value heads, checked on 1 to 4 threads: the first head's error") {
    // States 1 and 3 are bad (local rows 1 and 2); with several threads the states' checks run
    // in parallel, and the error must still be state 1's, as in state order.
    const Mat<S> k2 = with_value(with_value(k, t + 1, 0, kNaN), 3 * t + 2, 0, kInf);
    for (int threads : {1, 2, 4}) {
      CAPTURE(threads);
      mh.set_threads(threads);
      CHECK_ARG_ERROR(mh.forward(q, k2, v, o), "K(1, 0)", "finite");
      CHECK_ARG_ERROR(mh.absorb(k2, v), "absorb", "K(1, 0)", "finite");
    }
  }
  SECTION("Q of the wrong width") {
    const Mat<S> q5 = ovq::test::random_matrix<S>(q.rows(), dk + 1, 124);
    CHECK_ARG_ERROR(mh.forward(q5, k, v, o), "forward", "Q has 5 columns", "expected 4");
  }
  SECTION("Q rows not a multiple of batch * query heads") {
    const Mat<S> q1 = q.topRows(q.rows() - 1);
    Mat<S> o1(q1.rows(), dv);
    CHECK_ARG_ERROR(mh.forward(q1, k, v, o1), "Q has 39 rows",
                    "multiple of batch * query heads = 8");
  }
  SECTION("K of another number of tokens than Q") {
    const Mat<S> k6 = ovq::test::random_unit_rows<S>(batch * hkv * (t + 1), dk, 125);
    CHECK_ARG_ERROR(mh.forward(q, k6, v, o), "K has shape (24, 4)", "expected (20, 4)");
  }
  SECTION("K of the wrong width") {
    const Mat<S> k3 = ovq::test::random_unit_rows<S>(k.rows(), dk - 1, 126);
    CHECK_ARG_ERROR(mh.forward(q, k3, v, o), "K has shape (20, 3)", "expected (20, 4)");
  }
  SECTION("V of the wrong shape") {
    const Mat<S> v4 = ovq::test::random_matrix<S>(v.rows(), dv + 1, 127);
    CHECK_ARG_ERROR(mh.forward(q, k, v4, o), "V has shape (20, 4)", "expected (20, 3)");
    const Mat<S> vr = ovq::test::random_matrix<S>(v.rows() + 4, dv, 128);
    CHECK_ARG_ERROR(mh.forward(q, k, vr, o), "V has shape (24, 3)", "expected (20, 3)");
  }
  SECTION("O of the wrong shape") {
    Mat<S> o2(o.rows(), dv + 1);
    CHECK_ARG_ERROR(mh.forward(q, k, v, o2), "O has shape (40, 4)", "expected (40, 3)");
    Mat<S> o3(o.rows() - 8, dv);
    CHECK_ARG_ERROR(mh.forward(q, k, v, o3), "O has shape (32, 3)", "expected (40, 3)");
  }
  SECTION("step with mismatched sizes") {
    const Mat<S> q1 = ovq::test::random_unit_rows<S>(batch * hq, dk, 131);
    const Mat<S> k1 = ovq::test::random_unit_rows<S>(batch * hkv, dk, 132);
    const Mat<S> v1 = ovq::test::random_matrix<S>(batch * hkv, dv, 133);
    Mat<S> o1(batch * hq, dv);
    {
      auto copy = mh;
      CHECK_NOTHROW(copy.step(q1, k1, v1, o1));
    }
    // Two tokens per head is not a step.
    const Mat<S> q2 = ovq::test::random_unit_rows<S>(2 * batch * hq, dk, 134);
    Mat<S> o2(2 * batch * hq, dv);
    CHECK_ARG_ERROR(mh.step(q2, k1, v1, o2), "step", "Q has 16 rows", "expected 8",
                    "batch * query heads");
    const Mat<S> k2 = ovq::test::random_unit_rows<S>(batch * hkv + 1, dk, 135);
    CHECK_ARG_ERROR(mh.step(q1, k2, v1, o1), "step", "K has shape (5, 4)", "expected (4, 4)");
    const Mat<S> v2 = ovq::test::random_matrix<S>(batch * hkv, dv - 1, 136);
    CHECK_ARG_ERROR(mh.step(q1, k1, v2, o1), "step", "V has shape (4, 2)", "expected (4, 3)");
    Mat<S> o3(batch * hq, dv + 1);
    CHECK_ARG_ERROR(mh.step(q1, k1, v1, o3), "step", "O has shape (8, 4)", "expected (8, 3)");
    CHECK_ARG_ERROR(mh.step(q1, with_value(k1, batch * hkv - 1, dk - 1, kNaN), v1, o1), "step",
                    "K(0, 3)", "finite");
  }
  SECTION("absorb with mismatched or non-finite input") {
    {
      auto copy = mh;
      CHECK_NOTHROW(copy.absorb(k, v));
    }
    const Mat<S> k1 = k.topRows(k.rows() - 1);
    CHECK_ARG_ERROR(mh.absorb(k1, v), "absorb", "K has 19 rows",
                    "multiple of batch * kv heads = 4");
    const Mat<S> k3 = ovq::test::random_unit_rows<S>(k.rows(), dk - 1, 137);
    CHECK_ARG_ERROR(mh.absorb(k3, v), "absorb", "K has shape (20, 3)", "expected (20, 4)");
    const Mat<S> v4 = ovq::test::random_matrix<S>(v.rows() + 4, dv, 138);
    CHECK_ARG_ERROR(mh.absorb(k, v4), "absorb", "V has shape (24, 3)", "expected (20, 3)");
    CHECK_ARG_ERROR(mh.absorb(with_value(k, k.rows() - 1, dk - 1, kNaN), v), "absorb", "K(4, 3)",
                    "finite");
    CHECK_ARG_ERROR(mh.absorb(k, with_value(v, 2 * t, 1, kInf)), "absorb", "V(0, 1)", "finite");
  }
  SECTION("state index out of range") {
    CHECK_ARG_ERROR(mh.state(batch, 0), "MultiHead::state", "expected b < 2");
    CHECK_ARG_ERROR(mh.state(0, hkv), "MultiHead::state", "kv_head < 2");
    CHECK_ARG_ERROR(mh.state(-1, 0), "MultiHead::state");
  }
  // Every state, bitwise.
  const auto& after = mh.states();
  REQUIRE(after.size() == before.size());
  for (std::size_t s = 0; s < after.size(); ++s) {
    CAPTURE(s);
    CHECK(after[s] == before[s]);
  }
}

TEST_CASE("errors: a MultiHead with one misconfigured state changes none of them", "[errors]") {
  // The bad state is the last one, so a layer that ran the heads before checking them all
  // would have already written the first three.
  ovq::OvqOptions opt;
  opt.capacity = 8;
  opt.chunk = 2;
  ovq::OvqOptions other = opt;
  other.capacity = 16;
  const ovq::OvqAttention<double> mixer(opt), mixer16(other);
  ovq::MultiHead<ovq::OvqAttention<double>> mh(mixer, 2, 2, 2, 4, 3);
  mh.state(1, 1) = mixer16.make_state(4, 3);
  const auto before = mh.states();
  const Mat<double> q = ovq::test::random_unit_rows<double>(2 * 2 * 3, 4, 141);
  const Mat<double> k = ovq::test::random_unit_rows<double>(2 * 2 * 3, 4, 142);
  const Mat<double> v = ovq::test::random_matrix<double>(2 * 2 * 3, 3, 143);
  CHECK_ARG_ERROR(mh.forward(q, k, v), "capacity = 16", "expected 8");
  CHECK_ARG_ERROR(mh.absorb(k, v), "absorb", "capacity = 16", "expected 8");
  CHECK(mh.states() == before);

  // A state of another width swapped in.
  mh.state(1, 1) = mixer.make_state(5, 3);
  const auto before2 = mh.states();
  CHECK_ARG_ERROR(mh.forward(q, k, v), "K has 4 columns", "expected 5", "dk");
  CHECK(mh.states() == before2);
}

}  // namespace ovq_test_errors
