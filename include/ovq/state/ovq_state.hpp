#pragma once
// What OVQ-attention remembers (MATH.md section 4): the online dictionary (D_k, D_v, counts),
// the number t of tokens absorbed into it, and the pending buffer holding the raw rows of the
// current, not yet complete chunk. Memory: N (dk + dv) + L (dk + dv) scalars and N counts,
// fixed when the state is made, whatever the stream length.
#include <algorithm>
#include <cstdint>

#include "ovq/core/checks.hpp"
#include "ovq/core/types.hpp"
#include "ovq/state/dictionary.hpp"

namespace ovq {

template <class Scalar>
class OvqState {
  static_assert(is_supported_scalar_v<Scalar>, "ovq states hold float or double");

 public:
  using scalar_type = Scalar;

  OvqState() = default;
  OvqState(Index capacity, Index chunk, Index dk, Index dv)
      : dictionary_(capacity, dk, dv),
        pending_keys_(detail::positive("OvqState", "chunk", chunk), dk),
        pending_values_(chunk, dv) {
    pending_keys_.setZero();
    pending_values_.setZero();
  }

  Index key_dim() const { return dictionary_.key_dim(); }
  Index value_dim() const { return dictionary_.value_dim(); }
  Index capacity() const { return dictionary_.capacity(); }
  Index chunk() const { return pending_keys_.rows(); }

  const Dictionary<Scalar>& dictionary() const { return dictionary_; }
  Dictionary<Scalar>& dictionary() { return dictionary_; }
  // Tokens absorbed into the dictionary (a multiple of the chunk length).
  std::int64_t absorbed() const { return absorbed_; }
  // Tokens seen: absorbed plus pending.
  std::int64_t tokens() const { return absorbed_ + pending_; }
  Index pending() const { return pending_; }
  ConstRowsView<Scalar> pending_keys() const {
    return {pending_keys_.data(), pending_, key_dim(), key_dim()};
  }
  ConstRowsView<Scalar> pending_values() const {
    return {pending_values_.data(), pending_, value_dim(), value_dim()};
  }

  // Appends rows to the pending buffer, at most chunk() - pending() of them.
  void push_pending(ConstRowsView<Scalar> k, ConstRowsView<Scalar> v) {
    const char* where = "OvqState::push_pending";
    detail::require(k.rows <= chunk() - pending_, where, "K has ", k.rows,
                    " rows, expected at most ", chunk() - pending_, " (free pending rows)");
    detail::check_cols(where, "K", k.cols, key_dim(), "the state's dk");
    detail::check_shape(where, "V", v.rows, v.cols, k.rows, value_dim());
    for (Index i = 0; i < k.rows; ++i, ++pending_) {
      std::copy(k.row(i), k.row(i) + key_dim(), pending_keys_.row(pending_).data());
      std::copy(v.row(i), v.row(i) + value_dim(), pending_values_.row(pending_).data());
    }
  }
  // After a full chunk was written into the dictionary.
  void complete_chunk() {
    absorbed_ += pending_;
    pending_ = 0;
  }
  // Restores t and the pending rows exactly (loading a saved state).
  void restore(std::int64_t absorbed, ConstRowsView<Scalar> k, ConstRowsView<Scalar> v) {
    detail::require(absorbed >= 0 && absorbed % chunk() == 0, "OvqState::restore", "t = ",
                    absorbed, ", expected a multiple of the chunk ", chunk(), " >= 0");
    detail::require(k.rows < chunk(), "OvqState::restore", "pending rows = ", k.rows,
                    ", expected < chunk = ", chunk());
    absorbed_ = absorbed;
    pending_ = 0;
    push_pending(k, v);
  }

  std::size_t bytes() const {
    return dictionary_.bytes() +
           static_cast<std::size_t>(pending_keys_.size() + pending_values_.size()) *
               sizeof(Scalar);
  }

  void reset() {
    dictionary_.clear();
    absorbed_ = 0;
    pending_ = 0;
  }

  friend bool operator==(const OvqState& a, const OvqState& b) {
    return a.dictionary_ == b.dictionary_ && a.absorbed_ == b.absorbed_ &&
           a.chunk() == b.chunk() && a.pending_ == b.pending_ &&
           as_eigen(a.pending_keys()) == as_eigen(b.pending_keys()) &&
           as_eigen(a.pending_values()) == as_eigen(b.pending_values());
  }
  friend bool operator!=(const OvqState& a, const OvqState& b) { return !(a == b); }

 private:
  Dictionary<Scalar> dictionary_;
  RowMatrix<Scalar> pending_keys_;    // chunk x dk, rows [0, pending) in use
  RowMatrix<Scalar> pending_values_;  // chunk x dv
  std::int64_t absorbed_ = 0;         // t
  Index pending_ = 0;
};

}  // namespace ovq
