#pragma once
// What VQ-attention remembers: a fixed codebook C (S x dk); per code the count of keys quantised
// to it and the mean of their values, over the tokens of every complete chunk of L tokens (chunks
// at fixed stream positions); and the pending rows: the codes and values of the current, not yet
// complete chunk (< L rows), with their quantised keys for the read. A chunk is written into the
// counts and means only once it is complete, so the state does not depend on how the stream was
// split into calls. Memory: S (dk + dv + 2) scalars + S counts + L (dk + dv) scalars + L codes.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "ovq/core/checks.hpp"
#include "ovq/core/types.hpp"
#include "ovq/state/dictionary.hpp"

namespace ovq {

template <class Scalar>
class VqState {
  static_assert(is_supported_scalar_v<Scalar>, "ovq states hold float or double");

 public:
  using scalar_type = Scalar;

  VqState() = default;
  // codebook: S x dk, finite; chunk: L, the tokens per write.
  VqState(ConstRowsView<Scalar> codebook, Index dv, Index chunk)
      : dictionary_(detail::positive("VqState", "codebook rows", codebook.rows),
                    detail::positive("VqState", "dk", codebook.cols),
                    detail::positive("VqState", "dv", dv)),
        neg_half_norms_(codebook.rows),
        pending_codes_(static_cast<std::size_t>(detail::positive("VqState", "chunk", chunk)), 0),
        pending_keys_(chunk, codebook.cols),
        pending_values_(chunk, dv) {
    detail::check_finite<Scalar>("VqState", "codebook", codebook);
    RowVector<Scalar> zero = RowVector<Scalar>::Zero(dv);
    for (Index s = 0; s < codebook.rows; ++s) {
      dictionary_.push(codebook.row(s), zero.data(), 0);
      neg_half_norms_[s] = Scalar(-0.5) * row_map(codebook, s).squaredNorm();
    }
    pending_keys_.setZero();
    pending_values_.setZero();
  }

  Index key_dim() const { return dictionary_.key_dim(); }
  Index value_dim() const { return dictionary_.value_dim(); }
  Index codebook_size() const { return dictionary_.capacity(); }
  Index chunk() const { return pending_keys_.rows(); }
  ConstRowsView<Scalar> codebook() const { return dictionary_.keys(); }
  // -|C_s|^2 / 2: the offset turning the inner-product argmax into the nearest code.
  const Scalar* neg_half_norms() const { return neg_half_norms_.data(); }

  // Counts and mean values of the complete chunks.
  const Dictionary<Scalar>& dictionary() const { return dictionary_; }
  Dictionary<Scalar>& dictionary() { return dictionary_; }
  // Tokens written into the counts (the sum of the counts).
  std::int64_t absorbed() const { return dictionary_.total_count(); }
  // Tokens seen: absorbed plus pending.
  std::int64_t tokens() const { return absorbed() + pending_; }

  Index pending() const { return pending_; }
  // The codes, quantised keys (codebook rows) and values of the current chunk's rows.
  const Index* pending_codes() const { return pending_codes_.data(); }
  ConstRowsView<Scalar> pending_keys() const {
    return {pending_keys_.data(), pending_, key_dim(), key_dim()};
  }
  ConstRowsView<Scalar> pending_values() const {
    return {pending_values_.data(), pending_, value_dim(), value_dim()};
  }

  // Appends rows (their codes and values) to the pending buffer, at most chunk() - pending().
  void push_pending(const Index* codes, ConstRowsView<Scalar> v) {
    const char* where = "VqState::push_pending";
    detail::require(v.rows <= chunk() - pending_, where, "V has ", v.rows,
                    " rows, expected at most ", chunk() - pending_, " (free pending rows)");
    detail::check_cols(where, "V", v.cols, value_dim(), "the state's dv");
    for (Index i = 0; i < v.rows; ++i) {
      detail::require(codes[i] >= 0 && codes[i] < codebook_size(), where, "code ", i, " = ",
                      codes[i], ", expected a value in [0, ", codebook_size(), ")");
    }
    for (Index i = 0; i < v.rows; ++i, ++pending_) {
      pending_codes_[static_cast<std::size_t>(pending_)] = codes[i];
      const Scalar* key = dictionary_.keys().row(codes[i]);
      std::copy(key, key + key_dim(), pending_keys_.row(pending_).data());
      std::copy(v.row(i), v.row(i) + value_dim(), pending_values_.row(pending_).data());
    }
  }
  // After the full chunk was written into the counts and means.
  void complete_chunk() { pending_ = 0; }
  // Replaces the pending rows (loading a saved state): fewer than chunk() of them.
  void restore_pending(const Index* codes, ConstRowsView<Scalar> v) {
    detail::require(v.rows < chunk(), "VqState::restore_pending", "pending rows = ", v.rows,
                    ", expected < chunk = ", chunk());
    const Index kept = pending_;
    pending_ = 0;
    try {
      push_pending(codes, v);
    } catch (...) {
      pending_ = kept;
      throw;
    }
  }

  std::size_t bytes() const {
    return dictionary_.bytes() + static_cast<std::size_t>(neg_half_norms_.size()) * sizeof(Scalar) +
           static_cast<std::size_t>(pending_keys_.size() + pending_values_.size()) *
               sizeof(Scalar) +
           pending_codes_.size() * sizeof(Index);
  }

  // Forgets the stream; the codebook stays.
  void reset() {
    for (Index s = 0; s < dictionary_.size(); ++s) dictionary_.set_count(s, 0);
    as_eigen(dictionary_.values()).setZero();
    pending_ = 0;
  }

  friend bool operator==(const VqState& a, const VqState& b) {
    return a.dictionary_ == b.dictionary_ && a.chunk() == b.chunk() && a.pending_ == b.pending_ &&
           std::equal(a.pending_codes_.begin(), a.pending_codes_.begin() + a.pending_,
                      b.pending_codes_.begin()) &&
           as_eigen(a.pending_values()) == as_eigen(b.pending_values());
  }
  friend bool operator!=(const VqState& a, const VqState& b) { return !(a == b); }

 private:
  Dictionary<Scalar> dictionary_;  // keys: the codebook; values: mean value per code
  RowVector<Scalar> neg_half_norms_;
  std::vector<Index> pending_codes_;  // chunk entries, [0, pending) in use
  RowMatrix<Scalar> pending_keys_;    // chunk x dk: the codebook rows of the pending codes
  RowMatrix<Scalar> pending_values_;  // chunk x dv
  Index pending_ = 0;
};

}  // namespace ovq
