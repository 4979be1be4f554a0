#pragma once
// What VQ-attention remembers: a fixed codebook C (S x dk), and per code the count of keys
// quantised to it and the mean of their values. Memory: S (dk + dv + 2) scalars + S counts.
#include <cstdint>

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
  // codebook: S x dk, finite.
  VqState(ConstRowsView<Scalar> codebook, Index dv)
      : dictionary_(detail::positive("VqState", "codebook rows", codebook.rows),
                    detail::positive("VqState", "dk", codebook.cols),
                    detail::positive("VqState", "dv", dv)),
        neg_half_norms_(codebook.rows) {
    detail::check_finite<Scalar>("VqState", "codebook", codebook);
    RowVector<Scalar> zero = RowVector<Scalar>::Zero(dv);
    for (Index s = 0; s < codebook.rows; ++s) {
      dictionary_.push(codebook.row(s), zero.data(), 0);
      neg_half_norms_[s] = Scalar(-0.5) * row_map(codebook, s).squaredNorm();
    }
  }

  Index key_dim() const { return dictionary_.key_dim(); }
  Index value_dim() const { return dictionary_.value_dim(); }
  Index codebook_size() const { return dictionary_.capacity(); }
  ConstRowsView<Scalar> codebook() const { return dictionary_.keys(); }
  // -|C_s|^2 / 2: the offset turning the inner-product argmax into the nearest code.
  const Scalar* neg_half_norms() const { return neg_half_norms_.data(); }

  const Dictionary<Scalar>& dictionary() const { return dictionary_; }
  Dictionary<Scalar>& dictionary() { return dictionary_; }
  std::int64_t tokens() const { return dictionary_.total_count(); }

  std::size_t bytes() const {
    return dictionary_.bytes() + static_cast<std::size_t>(neg_half_norms_.size()) * sizeof(Scalar);
  }

  // Forgets the stream; the codebook stays.
  void reset() {
    for (Index s = 0; s < dictionary_.size(); ++s) dictionary_.set_count(s, 0);
    as_eigen(dictionary_.values()).setZero();
  }

  friend bool operator==(const VqState& a, const VqState& b) {
    return a.dictionary_ == b.dictionary_;
  }

 private:
  Dictionary<Scalar> dictionary_;  // keys: the codebook; values: mean value per code
  RowVector<Scalar> neg_half_norms_;
};

}  // namespace ovq
