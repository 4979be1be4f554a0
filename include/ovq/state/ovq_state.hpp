#pragma once
// What OVQ-attention remembers (MATH.md section 4): the online dictionary (D_k, D_v, counts),
// the number t of tokens absorbed into it, and the pending buffer holding the raw rows of the
// current, not yet complete chunk. Memory: N (dk + dv) + L (dk + dv) scalars and N counts,
// fixed when the state is made, whatever the stream length.
#include <cstdint>

#include "ovq/core/checks.hpp"
#include "ovq/core/types.hpp"
#include "ovq/state/dictionary.hpp"
#include "ovq/state/pending_rows.hpp"

namespace ovq {

template <class Scalar>
class OvqState {
  static_assert(is_element_v<Scalar>, "ovq states hold float, double, bf16 or fp16");

 public:
  using scalar_type = Scalar;

  OvqState() = default;
  OvqState(Index capacity, Index chunk, Index dk, Index dv)
      : dictionary_(capacity, dk, dv), pending_("OvqState", chunk, dk, dv) {}

  Index key_dim() const { return dictionary_.key_dim(); }
  Index value_dim() const { return dictionary_.value_dim(); }
  Index capacity() const { return dictionary_.capacity(); }
  Index chunk() const { return pending_.chunk(); }

  const Dictionary<Scalar>& dictionary() const { return dictionary_; }
  Dictionary<Scalar>& dictionary() { return dictionary_; }
  // Tokens absorbed into the dictionary (a multiple of the chunk length).
  std::int64_t absorbed() const { return absorbed_; }
  // Tokens seen: absorbed plus pending.
  std::int64_t tokens() const { return absorbed_ + pending(); }
  Index pending() const { return pending_.size(); }
  ConstRowsView<Scalar> pending_keys() const { return pending_.keys(); }
  ConstRowsView<Scalar> pending_values() const { return pending_.values(); }

  // Appends rows to the pending buffer, at most chunk() - pending() of them.
  void push_pending(ConstRowsView<Scalar> k, ConstRowsView<Scalar> v) {
    pending_.append("OvqState::push_pending", k, v);
  }
  // After a full chunk was written into the dictionary.
  void complete_chunk() {
    absorbed_ += pending();
    pending_.clear();
  }
  // Restores t and the pending rows exactly (loading a saved state).
  void restore(std::int64_t absorbed, ConstRowsView<Scalar> k, ConstRowsView<Scalar> v) {
    const char* where = "OvqState::restore";
    detail::require(absorbed >= 0 && absorbed % chunk() == 0, where, "t = ", absorbed,
                    ", expected a multiple of the chunk ", chunk(), " >= 0");
    detail::require(k.rows < chunk(), where, "pending rows = ", k.rows, ", expected < chunk = ",
                    chunk());
    pending_.assign(where, k, v);
    absorbed_ = absorbed;
  }

  std::size_t bytes() const { return dictionary_.bytes() + pending_.bytes(); }

  void reset() {
    dictionary_.clear();
    absorbed_ = 0;
    pending_.clear();
  }

  friend bool operator==(const OvqState& a, const OvqState& b) {
    return a.dictionary_ == b.dictionary_ && a.absorbed_ == b.absorbed_ &&
           a.pending_ == b.pending_;
  }
  friend bool operator!=(const OvqState& a, const OvqState& b) { return !(a == b); }

 private:
  Dictionary<Scalar> dictionary_;
  PendingRows<Scalar> pending_;  // the current chunk's raw rows
  std::int64_t absorbed_ = 0;    // t
};

}  // namespace ovq
