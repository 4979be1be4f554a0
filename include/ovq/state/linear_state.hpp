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
#include <cstdint>

#include "ovq/core/checks.hpp"
#include "ovq/core/types.hpp"
#include "ovq/state/pending_rows.hpp"

namespace ovq {

template <class Scalar>
class LinearState {
  static_assert(is_element_v<Scalar>, "ovq states hold float, double, bf16 or fp16");

 public:
  using scalar_type = Scalar;
  using Compute = compute_t<Scalar>;

  LinearState() = default;
  LinearState(Index dk, Index dv, Index chunk)
      : kv_(detail::positive("LinearState", "dk", dk), detail::positive("LinearState", "dv", dv)),
        k_sum_(dk),
        pending_("LinearState", chunk, dk, dv) {
    reset();
  }

  Index key_dim() const { return kv_.rows(); }
  Index value_dim() const { return kv_.cols(); }
  Index chunk() const { return pending_.chunk(); }

  // Tokens folded into S and z.
  std::int64_t absorbed() const { return absorbed_; }
  // Tokens seen: absorbed plus pending.
  std::int64_t tokens() const { return absorbed_ + pending(); }
  Index pending() const { return pending_.size(); }
  // The raw keys (before the feature map) and values of the current chunk.
  ConstRowsView<Scalar> pending_keys() const { return pending_.keys(); }
  ConstRowsView<Scalar> pending_values() const { return pending_.values(); }

  // S and z are sums, kept in the compute type (float for 16-bit elements).
  const RowMatrix<Compute>& kv() const { return kv_; }       // S, dk x dv (complete chunks)
  const RowVector<Compute>& k_sum() const { return k_sum_; }  // z, dk (complete chunks)
  RowMatrix<Compute>& kv() { return kv_; }
  RowVector<Compute>& k_sum() { return k_sum_; }

  // Appends rows to the pending buffer, at most chunk() - pending() of them.
  void push_pending(ConstRowsView<Scalar> k, ConstRowsView<Scalar> v) {
    pending_.append("LinearState::push_pending", k, v);
  }
  // After the full chunk was folded into (S, z).
  void complete_chunk() {
    absorbed_ += pending();
    pending_.clear();
  }
  // Restores the token count and the pending rows exactly (loading a saved state); S and z are
  // set through kv() and k_sum().
  void restore(std::int64_t absorbed, ConstRowsView<Scalar> k, ConstRowsView<Scalar> v) {
    const char* where = "LinearState::restore";
    detail::require(absorbed >= 0, where, "t = ", absorbed, ", expected >= 0");
    detail::require(k.rows < chunk(), where, "pending rows = ", k.rows, ", expected < chunk = ",
                    chunk());
    pending_.assign(where, k, v);
    absorbed_ = absorbed;
  }

  std::size_t bytes() const {
    return static_cast<std::size_t>(kv_.size() + k_sum_.size()) * sizeof(Compute) +
           pending_.bytes();
  }

  void reset() {
    kv_.setZero();
    k_sum_.setZero();
    pending_.reset();
    absorbed_ = 0;
  }

  friend bool operator==(const LinearState& a, const LinearState& b) {
    return a.key_dim() == b.key_dim() && a.value_dim() == b.value_dim() &&
           a.absorbed_ == b.absorbed_ && a.kv_ == b.kv_ && a.k_sum_ == b.k_sum_ &&
           a.pending_ == b.pending_;
  }
  friend bool operator!=(const LinearState& a, const LinearState& b) { return !(a == b); }

 private:
  RowMatrix<Compute> kv_;        // dk x dv
  RowVector<Compute> k_sum_;     // dk
  PendingRows<Scalar> pending_;  // the current chunk's raw rows
  std::int64_t absorbed_ = 0;
};

}  // namespace ovq
