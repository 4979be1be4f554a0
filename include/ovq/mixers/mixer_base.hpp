#pragma once
// What every mixer offers on top of its own chunk loop, written once:
//
//   forward(state, Q, K, V, O)      chunk-parallel, continues from the state
//   step(state, q, k, v, o)         one token, for decoding; same result as forward
//   forward_heads(state, ...)       several query heads sharing one key/value state (GQA)
//   absorb(state, K, V)             write only, no outputs (encoding a long context)
//   forward(state, Q, K, V, O, lse) also each query's log-sum-exp (softmax mixers: self, VQ,
//                                   OVQ), for merging partial reads (core/merge.hpp)
//
// A mixer (Derived) provides:
//   void check_state(const char* where, const State&) const;
//   void forward_unchecked(State&, const ConstRowsView<S>* q, Index heads,
//                          ConstRowsView<S> k, ConstRowsView<S> v, const RowsView<S>* o,
//                          compute_t<S>* const* lse, const compute_t<S>* head_betas) const;
//   static constexpr bool kHasLogSumExp;   // whether lse can be asked for
//   static constexpr bool kHasHeadBetas;   // whether head_betas (one beta per head) is read
// Every argument is checked here before the state is touched; forward_unchecked then cannot fail
// on input (only on memory exhaustion).
#include <vector>

#include "ovq/core/checks.hpp"
#include "ovq/core/types.hpp"
#include "ovq/kernels/arch/arch.hpp"

namespace ovq {

namespace detail {

// Rows [first, first + count) of each of `heads` views.
template <class View>
std::vector<View> slice_heads(const View* views, Index heads, Index first, Index count) {
  std::vector<View> out;
  out.reserve(static_cast<std::size_t>(heads));
  for (Index h = 0; h < heads; ++h) out.push_back(views[h].middle_rows(first, count));
  return out;
}

// Entries [first, ...) of each of `heads` per-head arrays.
template <class T>
std::vector<T*> offset_rows(T* const* rows, Index heads, Index first) {
  std::vector<T*> out(static_cast<std::size_t>(heads));
  for (Index h = 0; h < heads; ++h) out[static_cast<std::size_t>(h)] = rows[h] + first;
  return out;
}

}  // namespace detail

template <class Derived, class Scalar, class StateT>
class MixerBase {
  static_assert(is_element_v<Scalar>, "ovq mixers run on float, double, bf16 or fp16 elements");

 public:
  using scalar_type = Scalar;
  using State = StateT;
  using Compute = compute_t<Scalar>;

  // Q: T x dk, K: T x dk, V: T x dv, O: T x dv (written).
  void forward(State& state, const ConstMatrixRef<Scalar>& q, const ConstMatrixRef<Scalar>& k,
               const ConstMatrixRef<Scalar>& v, MatrixRef<Scalar> o) const {
    const ConstRowsView<Scalar> qv = rows_view(q);
    const RowsView<Scalar> ov = rows_view(o);
    forward_heads(state, &qv, 1, rows_view(k), rows_view(v), &ov);
  }

  RowMatrix<Scalar> forward(State& state, const ConstMatrixRef<Scalar>& q,
                            const ConstMatrixRef<Scalar>& k,
                            const ConstMatrixRef<Scalar>& v) const {
    RowMatrix<Scalar> o(q.rows(), v.cols());
    forward(state, q, k, v, o);
    return o;
  }

  // The same, and lse (T, written): lse_i = log sum_j exp(s_ij) over the logits s_ij (scale
  // beta, bias included) query i saw; -inf where it saw none. Softmax mixers only.
  void forward(State& state, const ConstMatrixRef<Scalar>& q, const ConstMatrixRef<Scalar>& k,
               const ConstMatrixRef<Scalar>& v, MatrixRef<Scalar> o,
               Eigen::Ref<RowVector<Compute>> lse) const {
    detail::require(lse.size() == q.rows(), "forward", "lse has ", lse.size(),
                    " entries, expected ", q.rows(), " (the rows of Q)");
    const ConstRowsView<Scalar> qv = rows_view(q);
    const RowsView<Scalar> ov = rows_view(o);
    Compute* const lse_rows = lse.data();
    forward_heads(state, &qv, 1, rows_view(k), rows_view(v), &ov, "forward", &lse_rows);
  }

  // One token: q (dk), k (dk), v (dv), o (dv, written).
  void step(State& state, const ConstVectorRef<Scalar>& q, const ConstVectorRef<Scalar>& k,
            const ConstVectorRef<Scalar>& v, VectorRef<Scalar> o) const {
    const ConstRowsView<Scalar> qv{q.data(), 1, q.size(), q.size()};
    const RowsView<Scalar> ov{o.data(), 1, o.size(), o.size()};
    forward_heads(state, &qv, 1, {k.data(), 1, k.size(), k.size()},
                  {v.data(), 1, v.size(), v.size()}, &ov, "step");
  }

  RowVector<Scalar> step(State& state, const ConstVectorRef<Scalar>& q,
                         const ConstVectorRef<Scalar>& k, const ConstVectorRef<Scalar>& v) const {
    RowVector<Scalar> o(v.size());
    step(state, q, k, v, o);
    return o;
  }

  // Writes K (T x dk) and V (T x dv) into the state without reading: the cost of encoding a
  // long context whose outputs nobody needs. The state ends exactly as after forward().
  void absorb(State& state, const ConstMatrixRef<Scalar>& k,
              const ConstMatrixRef<Scalar>& v) const {
    const ConstRowsView<Scalar> kv = rows_view(k);
    const ConstRowsView<Scalar> vv = rows_view(v);
    check_write("absorb", state, kv, vv);
    self().forward_unchecked(state, nullptr, 0, kv, vv, nullptr, nullptr);
  }

  // `heads` query heads read the same state: q[h] (T x dk) -> o[h] (T x dv); the state is
  // written once with k (T x dk), v (T x dv). lse: null, or `heads` pointers to T entries each
  // (each query's log-sum-exp, softmax mixers only).
  void forward_heads(State& state, const ConstRowsView<Scalar>* q, Index heads,
                     ConstRowsView<Scalar> k, ConstRowsView<Scalar> v, const RowsView<Scalar>* o,
                     const char* where = "forward", Compute* const* lse = nullptr) const {
    check_forward(where, state, q, heads, k, v, o, lse != nullptr);
    self().forward_unchecked(state, q, heads, k, v, o, lse);
  }

  // The checks of forward_heads alone, for callers (multi-head layers) that check every head
  // before running any.
  void check_forward(const char* where, const State& state, const ConstRowsView<Scalar>* q,
                     Index heads, ConstRowsView<Scalar> k, ConstRowsView<Scalar> v,
                     const RowsView<Scalar>* o, bool wants_lse = false) const {
    detail::require(!wants_lse || Derived::kHasLogSumExp, where,
                    "lse asked for, but linear attention has no softmax and so no log-sum-exp");
    detail::require(heads >= 1, where, "query heads = ", heads, ", expected >= 1");
    check_write(where, state, k, v);
    const Index dk = state.key_dim();
    const Index dv = state.value_dim();
    for (Index h = 0; h < heads; ++h) {
      detail::check_cols(where, "Q", q[h].cols, dk, "the state's dk");
      detail::check_rows(where, "Q", q[h].rows, k.rows, "the rows of K");
      detail::check_shape(where, "O", o[h].rows, o[h].cols, k.rows, dv);
    }
    for (Index h = 0; h < heads; ++h) detail::check_finite<Scalar>(where, "Q", q[h]);
  }

  // The checks of what is written into the state: K (T x dk) and V (T x dv), finite.
  void check_write(const char* where, const State& state, ConstRowsView<Scalar> k,
                   ConstRowsView<Scalar> v) const {
    self().check_state(where, state);
    detail::check_cols(where, "K", k.cols, state.key_dim(), "the state's dk");
    detail::check_cols(where, "V", v.cols, state.value_dim(), "the state's dv");
    detail::check_rows(where, "V", v.rows, k.rows, "the rows of K");
    detail::check_finite<Scalar>(where, "K", k);
    detail::check_finite<Scalar>(where, "V", v);
  }

 private:
  const Derived& self() const { return static_cast<const Derived&>(*this); }
};

}  // namespace ovq
