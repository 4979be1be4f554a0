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
#include "ovq/state/pending_rows.hpp"

namespace ovq {

template <class Scalar>
class VqState {
  static_assert(is_element_v<Scalar>, "ovq states hold float, double, bf16 or fp16");

 public:
  using scalar_type = Scalar;
  using Compute = compute_t<Scalar>;

  VqState() = default;
  // codebook: S x dk, finite; chunk: L, the tokens per write.
  VqState(ConstRowsView<Scalar> codebook, Index dv, Index chunk)
      : dictionary_(detail::positive("VqState", "codebook rows", codebook.rows),
                    detail::positive("VqState", "dk", codebook.cols),
                    detail::positive("VqState", "dv", dv)),
        neg_half_norms_(codebook.rows),
        pending_codes_(static_cast<std::size_t>(detail::positive("VqState", "chunk", chunk)), 0),
        pending_("VqState", chunk, codebook.cols, dv) {
    detail::check_finite<Scalar>("VqState", "codebook", codebook);
    RowVector<Scalar> zero = RowVector<Scalar>::Zero(dv);
    RowVector<Compute> code(codebook.cols);  // a code widened (itself for float and double)
    for (Index s = 0; s < codebook.rows; ++s) {
      dictionary_.push(codebook.row(s), zero.data(), 0);
      for (Index c = 0; c < codebook.cols; ++c) code[c] = widen(codebook.row(s)[c]);
      neg_half_norms_[s] = Compute(-0.5) * code.squaredNorm();
    }
  }

  Index key_dim() const { return dictionary_.key_dim(); }
  Index value_dim() const { return dictionary_.value_dim(); }
  Index codebook_size() const { return dictionary_.capacity(); }
  Index chunk() const { return pending_.chunk(); }
  ConstRowsView<Scalar> codebook() const { return dictionary_.keys(); }
  // -|C_s|^2 / 2: the offset turning the inner-product argmax into the nearest code.
  const Compute* neg_half_norms() const { return neg_half_norms_.data(); }

  // Counts and mean values of the complete chunks.
  const Dictionary<Scalar>& dictionary() const { return dictionary_; }
  Dictionary<Scalar>& dictionary() { return dictionary_; }
  // Tokens written into the counts (the sum of the counts).
  std::int64_t absorbed() const { return dictionary_.total_count(); }
  // Tokens seen: absorbed plus pending.
  std::int64_t tokens() const { return absorbed() + pending(); }

  Index pending() const { return pending_.size(); }
  // The codes, quantised keys (codebook rows) and values of the current chunk's rows.
  const Index* pending_codes() const { return pending_codes_.data(); }
  ConstRowsView<Scalar> pending_keys() const { return pending_.keys(); }
  ConstRowsView<Scalar> pending_values() const { return pending_.values(); }

  // Appends rows (their codes and values) to the pending buffer, at most chunk() - pending().
  void push_pending(const Index* codes, ConstRowsView<Scalar> v) {
    check_rows("VqState::push_pending", codes, v, pending_.free_rows());
    append(codes, v);
  }
  // After the full chunk was written into the counts and means.
  void complete_chunk() { pending_.clear(); }
  // Replaces the pending rows (loading a saved state): fewer than chunk() of them. Checked
  // before anything changes.
  void restore_pending(const Index* codes, ConstRowsView<Scalar> v) {
    const char* where = "VqState::restore_pending";
    detail::require(v.rows < chunk(), where, "pending rows = ", v.rows, ", expected < chunk = ",
                    chunk());
    check_rows(where, codes, v, chunk());
    pending_.clear();
    append(codes, v);
  }

  std::size_t bytes() const {
    return dictionary_.bytes() + static_cast<std::size_t>(neg_half_norms_.size()) * sizeof(Compute) +
           pending_.bytes() + pending_codes_.size() * sizeof(Index);
  }

  // Forgets the stream; the codebook stays.
  void reset() {
    for (Index s = 0; s < dictionary_.size(); ++s) dictionary_.set_count(s, 0);
    Dictionary<Scalar>& d = dictionary_;
    const DictionaryRows<Scalar> rows = d.rows();
    for (Index s = 0; s < d.size(); ++s) {
      std::fill(rows.mean_values.row(s), rows.mean_values.row(s) + d.value_dim(), Compute(0));
      d.publish(s);
    }
    pending_.clear();
  }

  friend bool operator==(const VqState& a, const VqState& b) {
    // The pending keys are the codebook rows of the pending codes: comparing them adds nothing.
    return a.dictionary_ == b.dictionary_ && a.pending_ == b.pending_ &&
           std::equal(a.pending_codes_.begin(), a.pending_codes_.begin() + a.pending(),
                      b.pending_codes_.begin());
  }
  friend bool operator!=(const VqState& a, const VqState& b) { return !(a == b); }

 private:
  void check_rows(const char* where, const Index* codes, ConstRowsView<Scalar> v,
                  Index free_rows) const {
    detail::require(v.rows <= free_rows, where, "V has ", v.rows, " rows, expected at most ",
                    free_rows, " (free pending rows)");
    detail::check_cols(where, "V", v.cols, value_dim(), "the state's dv");
    for (Index i = 0; i < v.rows; ++i) {
      detail::require(codes[i] >= 0 && codes[i] < codebook_size(), where, "code ", i, " = ",
                      codes[i], ", expected a value in [0, ", codebook_size(), ")");
    }
  }
  void append(const Index* codes, ConstRowsView<Scalar> v) {
    for (Index i = 0; i < v.rows; ++i) {
      pending_codes_[static_cast<std::size_t>(pending())] = codes[i];
      pending_.append_row(dictionary_.keys().row(codes[i]), v.row(i));
    }
  }

  Dictionary<Scalar> dictionary_;  // keys: the codebook; values: mean value per code
  RowVector<Compute> neg_half_norms_;
  std::vector<Index> pending_codes_;  // chunk entries, [0, pending) in use
  PendingRows<Scalar> pending_;       // the codebook rows of the pending codes, and the values
};

}  // namespace ovq
