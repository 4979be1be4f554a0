#pragma once
// The mixer fuzz targets' driver and oracle (fuzz_mixers.cpp: float and double;
// fuzz_mixers_half.cpp: bf16 and fp16): the public mixer API (forward, step, forward_heads,
// absorb; MultiHead forward, step, absorb) driven by fuzz bytes.
//
// The bytes choose the mixer (self, linear, vq, ovq), dk and dv (1..16), the options (chunk and
// capacity edge cases, tiny and huge beta, decay, eps, window, feature map, growth, seeding and
// update rate, some of them invalid), then a few calls with T in 0..130 tokens, inputs mixing
// ordinary values with 0, -0, denormals, 1e-30, 1e30, the largest finite values, NaN and
// infinities (each as the element type rounds it), and now and then a wrong shape.
//
// Oracle, for every call:
//   - it returns, or it throws ovq::ArgumentError (nothing else);
//   - if it throws, the state is unchanged: equal by operator== and bitwise (same encoded bytes);
//   - a wrong shape or a non-finite input must throw;
//   - if it returns, every output is finite (outputs are pre-filled with NaN, so an output left
//     unwritten is caught too): finite inputs give finite outputs or an ArgumentError.
// And after the calls: the state saves and loads back (ovq::io::encode_state / decode_state) to
// an equal state with the same bytes, and both continue with bitwise equal outputs and states.
//
// A non-finite-output finding names its class (beta, logits, values, linear, normalizer, other:
// see overflow_class) with rough magnitude bounds.
//
// Environment: OVQ_FUZZ_TRACE=1 prints what each input does (for writing up a finding);
// OVQ_FUZZ_SKIP=class,... leaves non-finite outputs of the listed classes unreported, to explore
// past a known class while it is being fixed, or to leave out a class documented as expected
// behaviour (.ci/run does so for the classes docs/math.md documents; scripts/fuzz sets nothing).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "fuzz_options.hpp"
#include "fuzz_support.hpp"
#include "ovq/io/state_file.hpp"
#include "ovq/ovq.hpp"

namespace {

using namespace ovq;
using fuzz::Input;
using fuzz::Trace;
using fuzz::describe;
using fuzz::tokens_to_boundary;

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr double kInf = std::numeric_limits<double>::infinity();

// ---- values ---------------------------------------------------------------------------------

template <class S>
S special_value(Input& in) {
  using L = std::numeric_limits<S>;
  switch (in.byte() % 20) {
    case 0: return S(0);
    case 1: return -S(0);
    case 2: return L::denorm_min();
    case 3: return S(-37) * L::denorm_min();
    case 4: return L::min();
    case 5: return S(1e-30);
    case 6: return S(1e30);
    case 7: return S(-1e30);
    case 8: return L::max();
    case 9: return L::lowest();
    case 10: return S(0.5) * L::max();
    case 11: return L::quiet_NaN();
    case 12: return L::infinity();
    case 13: return -L::infinity();
    case 14: return S(1);
    case 15: return S(-1);
    case 16: return S(1e-8);
    case 17: return S(1e8);
    case 18: return -L::quiet_NaN();
    default:
      if constexpr (sizeof(S) == 2) {
        return in.f16_bits<S>();
      } else if constexpr (sizeof(S) == 4) {
        return in.f32_bits();
      } else {
        return in.f64_bits();
      }
  }
}

// Entries of m, in one of a few patterns chosen by the input.
template <class S>
void fill(RowMatrix<S>& m, Input& in) {
  static const double kScales[] = {1.0, 0.25, 4.0, 1e-3, 1e3, 1e-20, 1e20, 1e-30, 1e30, 1e-40, 1e300};
  const Index rows = m.rows(), cols = m.cols();
  const unsigned mode = in.byte() % 8;
  auto uniform = [&](double scale) {
    for (Index i = 0; i < rows; ++i)
      for (Index j = 0; j < cols; ++j) m(i, j) = static_cast<S>(scale * in.uniform());
  };
  switch (mode) {
    case 3:  // entry by entry from the bytes, then ordinary values when they run out
      for (Index i = 0; i < rows; ++i)
        for (Index j = 0; j < cols; ++j)
          m(i, j) = in.remaining() > 0 ? special_value<S>(in) : static_cast<S>(in.uniform());
      break;
    case 4:
      m.setZero();
      break;
    case 5:
      m.setConstant(special_value<S>(in));
      break;
    case 6: {  // ordinary values with a few special ones
      uniform(in.pick(kScales));
      const int k = 1 + in.byte() % 4;
      for (int s = 0; s < k && rows > 0 && cols > 0; ++s) {
        const Index i = in.range(0, rows - 1);
        const Index j = in.range(0, cols - 1);
        m(i, j) = special_value<S>(in);
      }
      break;
    }
    case 7:  // unit rows (what VQ and OVQ expect of keys)
      uniform(in.pick(kScales));
      for (Index i = 0; i < rows; ++i) {
        if constexpr (sizeof(S) >= 4) {
          const S norm = m.row(i).norm();
          if (norm > S(0) && std::isfinite(norm)) m.row(i) /= norm;
        } else {  // a 16-bit row: normalised in double, then rounded
          const double norm = m.row(i).template cast<double>().norm();
          if (norm > 0 && std::isfinite(norm))
            m.row(i) = (m.row(i).template cast<double>() / norm).template cast<S>();
        }
      }
      break;
    default:
      uniform(in.pick(kScales));
      break;
  }
}

template <class S>
RowMatrix<S> matrix(Index rows, Index cols, Input& in) {
  RowMatrix<S> m(rows, cols);
  fill(m, in);
  return m;
}

template <class S>
bool all_finite(const RowMatrix<S>& m) {
  return m.allFinite();
}

template <class S>
double max_abs(const RowMatrix<S>& m) {
  double best = 0;
  for (Index i = 0; i < m.size(); ++i) {
    const double a = std::abs(static_cast<double>(m.data()[i]));
    if (std::isnan(a)) return a;
    if (a > best) best = a;
  }
  return best;
}

// Why outputs may overflow, as rough bounds over everything the state has seen: the largest
// |q|, |k| (codebook rows included) and |v| entries, and the rows written. Used to name the class
// of a non-finite-output finding in its report.
struct Magnitudes {
  double q = 0, k = 0, v = 0;
  Index rows = 0;

  void add(double max_q, double max_k, double max_v, Index new_rows) {
    q = std::max(q, max_q);
    k = std::max(k, max_k);
    v = std::max(v, max_v);
    rows += new_rows;
  }
};

// The class of a non-finite output:
//   beta        beta is finite as a double but not in the compute type (the element, or float
//               for 16-bit elements)
//   logits      |beta q . k| or |q . k| can exceed the largest number of the compute type
//               (softmax mixers)
//   values      the sum of |v| over the rows seen can exceed the largest element (softmax mixers)
//   linear      |beta phi(q) S| or |phi(q) . phi(k)| can exceed it (linear attention)
//   normalizer  normalised linear attention otherwise (a denominator near or at 0)
//   other       none of these: always worth a look
// (and "state": a finite stream left non-finite numbers in the state, which then fails to load)
template <class S>
std::string overflow_class(const Magnitudes& m, double beta, Index dk, bool linear,
                           bool normalize, std::string* hint) {
  using Compute = compute_t<S>;
  const double big = static_cast<double>(std::numeric_limits<S>::max());
  const double big_compute = static_cast<double>(std::numeric_limits<Compute>::max());
  const double beta_s = static_cast<double>(static_cast<Compute>(beta));
  const double d = static_cast<double>(dk), rows = static_cast<double>(std::max<Index>(m.rows, 1));
  // The kernels form q . k before scaling by beta, so q . k itself must not overflow either.
  const double logit = std::max(beta_s, 1.0) * m.q * m.k * d;
  const double value_sum = m.v * rows;
  // phi(x) <= |x| + 1 for every feature map. The chunked form also forms phi(Q) phi(K)^T on its
  // own before multiplying by V, so that product must not overflow either.
  const double linear_qk = std::max(beta_s, 1.0) * (m.q + 1) * (m.k + 1) * d;
  const double linear_out = linear_qk * std::max(m.v, 1.0) * rows;
  *hint = detail::concat("\n-- bounds: beta as the scalar type = ", beta_s,
                         "; |beta q.k| <= ", logit, "; sum |v| <= ", value_sum,
                         "; |beta phi(q) S| <= ", linear_out, "; largest element = ", big,
                         "; largest compute number = ", big_compute);
  // Normalised linear attention ignores beta.
  if (!(beta_s <= big_compute) && !normalize) return "beta";
  if (linear) {
    if (!(linear_out <= big)) return "linear";
    return normalize ? "normalizer" : "other";
  }
  if (!(logit <= big_compute)) return "logits";
  if (!(value_sum <= big)) return "values";
  return "other";
}

template <class Options>
bool is_normalized(const Options&) {
  return false;
}
bool is_normalized(const LinearAttentionOptions& o) { return o.normalize; }
template <class Options>
bool is_linear(const Options&) {
  return false;
}
bool is_linear(const LinearAttentionOptions&) { return true; }

// OVQ_FUZZ_SKIP=class,class,... is for exploring while a class of findings is known and being
// fixed: a non-finite output of a listed class (see overflow_class; "other" cannot be listed) is
// then not reported, so that the fuzzer can look for other problems. It also leaves out classes
// documented as expected behaviour: .ci/run lists those of docs/math.md. Unset (scripts/fuzz's
// default, and the CTest replays), every non-finite output from finite inputs is a finding.
bool skipped(const std::string& cls) {
  static const std::string list = [] {
    const char* v = std::getenv("OVQ_FUZZ_SKIP");
    return v == nullptr ? std::string() : "," + std::string(v) + ",";
  }();
  return cls != "other" && list.find("," + cls + ",") != std::string::npos;
}

// Why a state reached by successful calls does not load back: "state" where the loader found a
// non-finite number in it (the sums of an overflowed linear state), "other" for any other
// refusal (a state the loader should take: always worth a look).
std::string load_failure_class(const Error& e) {
  return std::string(e.what()).find("expected a finite value") != std::string::npos ? "state"
                                                                                      : "other";
}

template <class S, class Options>
void check_outputs(const RowMatrix<S>& o, const char* op, const Magnitudes& seen,
                   const Options& options, Index dk, const Trace& trace) {
  if (all_finite(o)) return;
  std::string hint;
  const std::string cls = overflow_class<S>(seen, options.beta, dk, is_linear(options),
                                            is_normalized(options), &hint);
  if (skipped(cls)) return;
  OVQ_FUZZ_CHECK(false, op, " returned a non-finite output from finite inputs (class: ", cls,
                 ")", trace.str(), hint);
}

// ---- options ------------------------------------------------------------------------------

// Edge values and invalid ones, which the mixers must refuse with an ArgumentError.
const fuzz::OptionTables& option_tables() {
  static const fuzz::OptionTables tables{
      {1.0, 0.5, 0.125, 2.0, 8.0, 1e-3, 1e3, 1e-30, 1e30, 1e-300, 4.9e-324, 1e300, 3.4e38, 3.5e38,
       1e10, 0.0, -1.0, kNaN, kInf},
      {64, 1, 2, 3, 4, 5, 7, 8, 16, 17, 32, 33, 63, 65, 100, 1000, 0, -1},
      {0, 1, 2, 3, 4, 7, 8, 16, 63, 64, 65, -1},
      {1.0, 0.5, 0.9, 0.99, 1e-3, 1e-30, 1e-300, 4.9e-324, 0.0, 1.5, kNaN},
      {1e-6, 0.0, 1.0, 1e-3, 1e-30, 1e-300, 1e30, -1.0},
      {kernels::FeatureMap::identity, kernels::FeatureMap::elu1, kernels::FeatureMap::relu},
      {16, 1, 2, 3, 4, 5, 8, 64, 1000, 0},
      {0.0, 1.0, 0.5, 2.0, 1e-300, 4.9e-324, 1e300, 1e9, -1.0, kNaN},
      {1.0, 0.5, 0.25, 2.0, 1e-300, 1e300, 1e-9, 0.0, kInf},
      {1.0, 0.5, 0.1, 0.01, 1e-300, 4.9e-324, 0.0, 1.5}};
  return tables;
}

Index pick_tokens(Input& in, Index chunk, Index to_boundary) {
  constexpr Index kMaxTokens = 130;
  Index t;
  switch (in.byte() % 8) {
    case 1: t = to_boundary; break;
    case 2: t = to_boundary - 1; break;
    case 3: t = to_boundary + 1; break;
    case 4: t = chunk + to_boundary; break;
    case 5: t = 0; break;
    case 6: t = 1; break;
    default: t = in.range(0, 64); break;
  }
  return std::clamp<Index>(t, 0, kMaxTokens);
}

// ---- one state ----------------------------------------------------------------------------

// Bitwise, through the encoded bytes: a linear state whose sums overflowed (the documented
// class) holds NaN, and NaN != NaN would make two identical states differ under ==.
template <class Mixer>
bool same_state(const Mixer& mixer, const typename Mixer::State& a,
                const typename Mixer::State& b) {
  return io::encode_state(mixer, a) == io::encode_state(mixer, b);
}

template <class Mixer>
class SingleRun {
 public:
  using S = typename Mixer::scalar_type;
  using State = typename Mixer::State;

  SingleRun(const Mixer& mixer, Input& in, Trace& trace, Magnitudes& seen)
      : mixer_(mixer), in_(in), trace_(trace), seen_(&seen) {}

  void run(State& state) {
    const int calls = 1 + in_.byte() % 6;
    for (int c = 0; c < calls; ++c) call(state);
    check_save_load(state);
  }

 private:
  enum Op { kForward, kStep, kAbsorb, kHeads };

  // A wrong shape: 1 + which argument is off.
  int pick_bad() { return in_.rarely(12) ? 1 + in_.byte() % 7 : 0; }

  void call(State& state) {
    const Index dk = state.key_dim(), dv = state.value_dim();
    const Op op = static_cast<Op>(in_.byte() % 4);
    const Index chunk = mixer_.options().chunk;
    const Index t =
        op == kStep ? 1 : pick_tokens(in_, chunk, tokens_to_boundary(state, chunk, chunk));
    const int heads = op == kHeads ? 1 + in_.byte() % 3 : 1;
    const int bad = pick_bad();

    // Shapes, one of them off by one when `bad` says so.
    const Index q_rows = t + (bad == 4), q_cols = dk + (bad == 1);
    const Index k_cols = dk + (bad == 2);
    const Index v_rows = t + (bad == 5), v_cols = dv + (bad == 3);
    const Index o_rows = t + (bad == 6), o_cols = dv + (bad == 7);
    // Absorb has no Q and O; step's vectors have one row whatever `bad` says about rows.
    const bool shape_is_bad =
        op == kAbsorb ? (bad == 2 || bad == 3 || bad == 5)
                      : (op == kStep ? (bad == 1 || bad == 2 || bad == 3 || bad == 7) : bad != 0);

    std::vector<RowMatrix<S>> q;
    for (int h = 0; h < heads; ++h)
      q.push_back(matrix<S>(op == kStep ? 1 : q_rows, q_cols, in_));
    const RowMatrix<S> k = matrix<S>(op == kStep ? 1 : t, k_cols, in_);
    const RowMatrix<S> v = matrix<S>(op == kStep ? 1 : v_rows, v_cols, in_);
    std::vector<RowMatrix<S>> o;
    for (int h = 0; h < heads; ++h) {
      o.emplace_back(op == kStep ? 1 : o_rows, o_cols);
      o.back().setConstant(std::numeric_limits<S>::quiet_NaN());
    }

    bool inputs_finite = all_finite(k) && all_finite(v);
    if (op != kAbsorb)
      for (const auto& m : q) inputs_finite = inputs_finite && all_finite(m);
    const double largest = std::max(max_abs(k), max_abs(v));
    static const char* const kOpName[] = {"forward", "step", "absorb", "forward_heads"};
    trace_.add(kOpName[op], " T=", t, " heads=", heads, " bad_shape=", shape_is_bad ? bad : 0,
               " inputs_finite=", inputs_finite, " max|K|,|V|=", largest,
               op == kAbsorb ? "" : " max|Q|=", op == kAbsorb ? 0.0 : max_abs(q[0]));

    const std::vector<unsigned char> bytes_before = io::encode_state(mixer_, state);
    bool threw = false;
    std::string error;
    try {
      switch (op) {
        case kForward:
          mixer_.forward(state, q[0], k, v, o[0]);
          break;
        case kStep: {
          const RowVector<S> qv = q[0].row(0), kv = k.row(0), vv = v.row(0);
          RowVector<S> ov = o[0].row(0);
          mixer_.step(state, qv, kv, vv, ov);
          o[0].row(0) = ov;
          break;
        }
        case kAbsorb:
          mixer_.absorb(state, k, v);
          break;
        case kHeads: {
          std::vector<ConstRowsView<S>> qv;
          std::vector<RowsView<S>> ov;
          for (int h = 0; h < heads; ++h) {
            qv.push_back(rows_view(q[h]));
            ov.push_back(rows_view(o[h]));
          }
          mixer_.forward_heads(state, qv.data(), heads, rows_view(k), rows_view(v), ov.data());
          break;
        }
      }
    } catch (const ArgumentError& e) {
      threw = true;
      error = e.what();
    } catch (const std::exception& e) {
      OVQ_FUZZ_CHECK(false, kOpName[op], " threw something other than ovq::ArgumentError: ",
                     e.what(), trace_.str());
    }

    if (threw) {
      trace_.add("  -> ArgumentError: ", error);
      // Bitwise, through the encoded bytes: a state whose sums overflowed (linear attention's
      // documented class) holds NaN, and NaN != NaN would report an untouched state as changed.
      OVQ_FUZZ_CHECK(io::encode_state(mixer_, state) == bytes_before, kOpName[op],
                     " threw but changed the state's bytes: ", error, trace_.str());
      return;
    }
    OVQ_FUZZ_CHECK(!shape_is_bad, kOpName[op], " accepted a wrong shape", trace_.str());
    OVQ_FUZZ_CHECK(inputs_finite, kOpName[op], " accepted a non-finite input", trace_.str());
    double largest_q = 0;
    if (op != kAbsorb)
      for (const auto& m : q) largest_q = std::max(largest_q, max_abs(m));
    seen_->add(largest_q, max_abs(k), max_abs(v), t);
    if (op == kAbsorb) return;
    for (int h = 0; h < heads; ++h)
      check_outputs(o[h], kOpName[op], *seen_, mixer_.options(), dk, trace_);
  }

  // The state saves, loads back equal, and both copies go on identically.
  void check_save_load(State& state) {
    const std::vector<unsigned char> bytes = io::encode_state(mixer_, state);
    State loaded;
    try {
      loaded = io::decode_state(mixer_, bytes.data(), bytes.size());
    } catch (const Error& e) {
      // A finite stream must not leave non-finite numbers in the state (class "state").
      const std::string cls = load_failure_class(e);
      if (skipped(cls)) return;
      OVQ_FUZZ_CHECK(false, "a state reached by successful calls does not load back (class: ",
                     cls, "): ", e.what(), trace_.str());
    }
    OVQ_FUZZ_CHECK(same_state(mixer_, loaded, state), "the loaded state differs from the saved one",
                   trace_.str());
    OVQ_FUZZ_CHECK(io::encode_state(mixer_, loaded) == bytes,
                   "the loaded state encodes to different bytes", trace_.str());

    const Index t = in_.range(0, 2 * mixer_.options().chunk > 64 ? 64 : 2 * mixer_.options().chunk);
    const RowMatrix<S> q = matrix<S>(t, state.key_dim(), in_);
    const RowMatrix<S> k = matrix<S>(t, state.key_dim(), in_);
    const RowMatrix<S> v = matrix<S>(t, state.value_dim(), in_);
    RowMatrix<S> o1(t, state.value_dim()), o2(t, state.value_dim());
    bool threw1 = false, threw2 = false;
    try {
      mixer_.forward(state, q, k, v, o1);
    } catch (const ArgumentError&) {
      threw1 = true;
    }
    try {
      mixer_.forward(loaded, q, k, v, o2);
    } catch (const ArgumentError&) {
      threw2 = true;
    }
    trace_.add("forward on the saved and on the loaded state, T=", t, " threw=", threw1);
    OVQ_FUZZ_CHECK(threw1 == threw2, "the saved and the loaded state disagree on throwing",
                   trace_.str());
    if (threw1) return;
    OVQ_FUZZ_CHECK(o1.size() == 0 ||
                       std::memcmp(o1.data(), o2.data(), sizeof(S) * o1.size()) == 0,
                   "the loaded state continues with different outputs", trace_.str());
    OVQ_FUZZ_CHECK(same_state(mixer_, loaded, state), "the loaded state continues to a different state",
                   trace_.str());
  }

  const Mixer& mixer_;
  Input& in_;
  Trace& trace_;
  Magnitudes* seen_;
};

// ---- a multi-head layer ---------------------------------------------------------------------

template <class Mixer>
class MultiRun {
 public:
  using S = typename Mixer::scalar_type;
  using State = typename Mixer::State;
  using Layer = MultiHead<Mixer>;

  MultiRun(Input& in, Trace& trace, Magnitudes& seen) : in_(in), trace_(trace), seen_(&seen) {}

  void run(Layer& layer) {
    const int calls = 1 + in_.byte() % 5;
    for (int c = 0; c < calls; ++c) call(layer);
    const std::vector<unsigned char> bytes = io::encode_state(layer);
    Layer loaded = layer;
    loaded.reset();
    try {
      io::decode_state(loaded, bytes.data(), bytes.size());
    } catch (const Error& e) {
      const std::string cls = load_failure_class(e);
      if (skipped(cls)) return;
      OVQ_FUZZ_CHECK(false, "a layer reached by successful calls does not load back (class: ",
                     cls, "): ", e.what(), trace_.str());
    }
    OVQ_FUZZ_CHECK(loaded.states() == layer.states(), "the loaded layer differs", trace_.str());
    OVQ_FUZZ_CHECK(io::encode_state(loaded) == bytes, "the loaded layer encodes differently",
                   trace_.str());
  }

 private:
  void call(Layer& layer) {
    enum Op { kForward, kStep, kAbsorb };
    const Index b = layer.batch(), hq = layer.query_heads(), hkv = layer.kv_heads();
    const Index dk = layer.key_dim(), dv = layer.value_dim();
    const Op op = static_cast<Op>(in_.byte() % 3);
    const Index chunk = layer.mixer().options().chunk;
    const Index t = op == kStep ? 1
                                : pick_tokens(in_, chunk,
                                              tokens_to_boundary(layer.state(0, 0), chunk, chunk));
    const int bad = in_.rarely(12) ? 1 + in_.byte() % 5 : 0;
    const Index q_rows = b * hq * t + (bad == 1), k_rows = b * hkv * t + (bad == 2);
    const Index v_rows = b * hkv * t + (bad == 3), k_cols = dk + (bad == 4);
    const Index o_cols = dv + (bad == 5);
    const bool shape_is_bad = op == kAbsorb ? (bad == 2 || bad == 3 || bad == 4) : bad != 0;

    const RowMatrix<S> q = matrix<S>(q_rows, dk, in_);
    const RowMatrix<S> k = matrix<S>(k_rows, k_cols, in_);
    const RowMatrix<S> v = matrix<S>(v_rows, dv, in_);
    RowMatrix<S> o(q_rows, o_cols);
    o.setConstant(std::numeric_limits<S>::quiet_NaN());
    const bool inputs_finite = all_finite(k) && all_finite(v) && (op == kAbsorb || all_finite(q));
    static const char* const kOpName[] = {"MultiHead::forward", "MultiHead::step",
                                          "MultiHead::absorb"};
    trace_.add(kOpName[op], " T=", t, " bad_shape=", shape_is_bad ? bad : 0,
               " inputs_finite=", inputs_finite, " max|K|,|V|=", std::max(max_abs(k), max_abs(v)));

    const std::vector<unsigned char> bytes_before = io::encode_state(layer);
    bool threw = false;
    std::string error;
    try {
      switch (op) {
        case kForward: layer.forward(q, k, v, o); break;
        case kStep: layer.step(q, k, v, o); break;
        case kAbsorb: layer.absorb(k, v); break;
      }
    } catch (const ArgumentError& e) {
      threw = true;
      error = e.what();
    } catch (const std::exception& e) {
      OVQ_FUZZ_CHECK(false, kOpName[op], " threw something other than ovq::ArgumentError: ",
                     e.what(), trace_.str());
    }
    if (threw) {
      trace_.add("  -> ArgumentError: ", error);
      // Bitwise, through the encoded bytes (NaN != NaN in a state whose sums overflowed).
      OVQ_FUZZ_CHECK(io::encode_state(layer) == bytes_before, kOpName[op],
                     " threw but changed the states' bytes: ", error, trace_.str());
      return;
    }
    OVQ_FUZZ_CHECK(!shape_is_bad, kOpName[op], " accepted a wrong shape", trace_.str());
    OVQ_FUZZ_CHECK(inputs_finite, kOpName[op], " accepted a non-finite input", trace_.str());
    seen_->add(op == kAbsorb ? 0.0 : max_abs(q), max_abs(k), max_abs(v), t);
    if (op != kAbsorb) check_outputs(o, kOpName[op], *seen_, layer.mixer().options(), dk, trace_);
  }

  Input& in_;
  Trace& trace_;
  Magnitudes* seen_;
};

// ---- dispatch -------------------------------------------------------------------------------

template <class Mixer>
void run_mixer(const Mixer& mixer, typename Mixer::State state, bool multi, Input& in,
               Trace& trace, Magnitudes seen = {}) {
  if (!multi) {
    SingleRun<Mixer>(mixer, in, trace, seen).run(state);
    return;
  }
  const Index batch = 1 + in.byte() % 2;
  const Index kv_heads = 1 + in.byte() % 2;
  const Index query_heads = kv_heads * (1 + in.byte() % 3) + (in.rarely(16) ? 1 : 0);
  trace.add("MultiHead batch=", batch, " query_heads=", query_heads, " kv_heads=", kv_heads);
  try {
    MultiHead<Mixer> layer(mixer, batch, query_heads,
                           std::vector<typename Mixer::State>(kv_heads, state));
    MultiRun<Mixer>(in, trace, seen).run(layer);
  } catch (const ArgumentError& e) {
    OVQ_FUZZ_CHECK(query_heads % kv_heads != 0, "MultiHead rejected valid heads: ", e.what(),
                   trace.str());
  }
}

// The mixer, or nothing after the ArgumentError of invalid options.
template <class Mixer, class Options>
std::optional<Mixer> make_mixer(const Options& options, Trace& trace) {
  trace.add("options: ", describe(options));
  try {
    return Mixer(options);
  } catch (const ArgumentError& e) {
    trace.add("  -> ArgumentError: ", e.what());
    return std::nullopt;
  }
}

template <class Mixer, class Options>
void run_kind(const Options& options, Index dk, Index dv, bool multi, Input& in, Trace& trace) {
  const std::optional<Mixer> mixer = make_mixer<Mixer>(options, trace);
  if (mixer) run_mixer(*mixer, mixer->make_state(dk, dv), multi, in, trace);
}

template <class S, class Arch>
void run_vq(const VqAttentionOptions& options, Index dk, Index dv, bool multi, Input& in,
            Trace& trace) {
  const std::optional<VqAttention<S, Arch>> mixer =
      make_mixer<VqAttention<S, Arch>>(options, trace);
  const Index codes = 1 + in.byte() % 16;
  const RowMatrix<S> codebook = matrix<S>(codes, dk, in);
  const bool finite = all_finite(codebook);
  trace.add("codebook ", codes, " x ", dk, " finite=", finite, " max|C|=", max_abs(codebook));
  if (!mixer) return;
  std::optional<VqState<S>> state;
  try {
    state = mixer->make_state(codebook, dv);
  } catch (const ArgumentError& e) {
    trace.add("  -> ArgumentError: ", e.what());
    OVQ_FUZZ_CHECK(!finite, "make_state rejected a finite codebook: ", e.what(), trace.str());
    return;
  }
  OVQ_FUZZ_CHECK(finite, "make_state accepted a non-finite codebook", trace.str());
  Magnitudes seen;
  seen.add(0, max_abs(codebook), 0, 0);  // the codebook rows are the keys read
  run_mixer(*mixer, *state, multi, in, trace, seen);
}

// One mixer of element S on kernels Arch, chosen and driven by the bytes.
template <class S, class Arch = arch::native>
void run_scalar(Input& in, Trace& trace) {
  const unsigned kind = in.byte() % 4;
  const bool multi = in.rarely(4);
  const Index dk = 1 + in.byte() % 16;
  const Index dv = 1 + in.byte() % 16;
  static const char* const kKind[] = {"self", "linear", "vq", "ovq"};
  trace.add(kKind[kind], " ", element_name<S>(), " (", Arch::kName, ") dk=", dk, " dv=", dv,
            multi ? " multi-head" : "");
  switch (kind) {
    case 0:
      run_kind<SelfAttention<S, Arch>>(fuzz::self_options(in, option_tables()), dk, dv, multi, in,
                                       trace);
      break;
    case 1:
      run_kind<LinearAttention<S, Arch>>(fuzz::linear_options(in, option_tables()), dk, dv,
                                         multi, in, trace);
      break;
    case 2: run_vq<S, Arch>(fuzz::vq_options(in, option_tables()), dk, dv, multi, in, trace); break;
    default:
      run_kind<OvqAttention<S, Arch>>(fuzz::ovq_options(in, option_tables()), dk, dv, multi, in,
                                      trace);
      break;
  }
}

}  // namespace
