#pragma once
// What linear attention remembers, in chunks of L tokens at fixed stream positions (tokens
// [0, L), [L, 2L), ... of the stream this state has seen):
//
//   S = sum_j gamma^(t-1-j) phi(k_j) v_j^T (dk x dv) and z = sum_j gamma^(t-1-j) phi(k_j) (dk),
//       over the t tokens of every complete chunk (t, absorbed(), is a multiple of L for a state
//       that saw its stream from the start);
//   the pending rows: the raw keys and values of the current, not yet complete chunk (< L rows).
//
// A chunk is folded into (S, z) only once it is complete, so every sum is formed from the same
// rows in the same order however the stream was split into calls. Memory: dk (dv + 1) +
// L (dk + dv) scalars, whatever the stream length.
#include <algorithm>
#include <cstdint>

#include "ovq/core/checks.hpp"
#include "ovq/core/types.hpp"

namespace ovq {

template <class Scalar>
class LinearState {
  static_assert(is_supported_scalar_v<Scalar>, "ovq states hold float or double");

 public:
  using scalar_type = Scalar;

  LinearState() = default;
  LinearState(Index dk, Index dv, Index chunk)
      : kv_(detail::positive("LinearState", "dk", dk), detail::positive("LinearState", "dv", dv)),
        k_sum_(dk),
        pending_keys_(detail::positive("LinearState", "chunk", chunk), dk),
        pending_values_(chunk, dv) {
    reset();
  }

  Index key_dim() const { return kv_.rows(); }
  Index value_dim() const { return kv_.cols(); }
  Index chunk() const { return pending_keys_.rows(); }

  // Tokens folded into S and z.
  std::int64_t absorbed() const { return absorbed_; }
  // Tokens seen: absorbed plus pending.
  std::int64_t tokens() const { return absorbed_ + pending_; }
  Index pending() const { return pending_; }
  // The raw keys (before the feature map) and values of the current chunk.
  ConstRowsView<Scalar> pending_keys() const {
    return {pending_keys_.data(), pending_, key_dim(), key_dim()};
  }
  ConstRowsView<Scalar> pending_values() const {
    return {pending_values_.data(), pending_, value_dim(), value_dim()};
  }

  const RowMatrix<Scalar>& kv() const { return kv_; }       // S, dk x dv (complete chunks)
  const RowVector<Scalar>& k_sum() const { return k_sum_; }  // z, dk (complete chunks)
  RowMatrix<Scalar>& kv() { return kv_; }
  RowVector<Scalar>& k_sum() { return k_sum_; }
  // All chunk() rows of the pending buffer (rows [pending(), chunk) hold stale values): once the
  // buffer is full, the complete chunk itself.
  const RowMatrix<Scalar>& pending_key_buffer() const { return pending_keys_; }
  const RowMatrix<Scalar>& pending_value_buffer() const { return pending_values_; }

  // Appends rows to the pending buffer, at most chunk() - pending() of them.
  void push_pending(ConstRowsView<Scalar> k, ConstRowsView<Scalar> v) {
    const char* where = "LinearState::push_pending";
    detail::require(k.rows <= chunk() - pending_, where, "K has ", k.rows,
                    " rows, expected at most ", chunk() - pending_, " (free pending rows)");
    detail::check_cols(where, "K", k.cols, key_dim(), "the state's dk");
    detail::check_shape(where, "V", v.rows, v.cols, k.rows, value_dim());
    for (Index i = 0; i < k.rows; ++i, ++pending_) {
      std::copy(k.row(i), k.row(i) + key_dim(), pending_keys_.row(pending_).data());
      std::copy(v.row(i), v.row(i) + value_dim(), pending_values_.row(pending_).data());
    }
  }
  // After the full chunk was folded into (S, z).
  void complete_chunk() {
    absorbed_ += pending_;
    pending_ = 0;
  }
  // Restores the token count and the pending rows exactly (loading a saved state); S and z are
  // set through kv() and k_sum().
  void restore(std::int64_t absorbed, ConstRowsView<Scalar> k, ConstRowsView<Scalar> v) {
    detail::require(absorbed >= 0, "LinearState::restore", "t = ", absorbed, ", expected >= 0");
    detail::require(k.rows < chunk(), "LinearState::restore", "pending rows = ", k.rows,
                    ", expected < chunk = ", chunk());
    absorbed_ = absorbed;
    pending_ = 0;
    push_pending(k, v);
  }

  std::size_t bytes() const {
    return static_cast<std::size_t>(kv_.size() + k_sum_.size() + pending_keys_.size() +
                                    pending_values_.size()) *
           sizeof(Scalar);
  }

  void reset() {
    kv_.setZero();
    k_sum_.setZero();
    pending_keys_.setZero();
    pending_values_.setZero();
    absorbed_ = 0;
    pending_ = 0;
  }

  friend bool operator==(const LinearState& a, const LinearState& b) {
    return a.key_dim() == b.key_dim() && a.value_dim() == b.value_dim() &&
           a.chunk() == b.chunk() && a.absorbed_ == b.absorbed_ && a.pending_ == b.pending_ &&
           a.kv_ == b.kv_ && a.k_sum_ == b.k_sum_ &&
           as_eigen(a.pending_keys()) == as_eigen(b.pending_keys()) &&
           as_eigen(a.pending_values()) == as_eigen(b.pending_values());
  }
  friend bool operator!=(const LinearState& a, const LinearState& b) { return !(a == b); }

 private:
  RowMatrix<Scalar> kv_;              // dk x dv
  RowVector<Scalar> k_sum_;           // dk
  RowMatrix<Scalar> pending_keys_;    // chunk x dk, rows [0, pending) in use
  RowMatrix<Scalar> pending_values_;  // chunk x dv
  std::int64_t absorbed_ = 0;
  Index pending_ = 0;
};

}  // namespace ovq
