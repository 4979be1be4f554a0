#pragma once
// What linear attention remembers: S = sum_j gamma^(t-1-j) phi(k_j) v_j^T (dk x dv) and
// z = sum_j gamma^(t-1-j) phi(k_j) (dk). Memory: dk (dv + 1) scalars, whatever the stream length.
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
  LinearState(Index dk, Index dv)
      : kv_(detail::positive("LinearState", "dk", dk), detail::positive("LinearState", "dv", dv)),
        k_sum_(dk) {
    reset();
  }

  Index key_dim() const { return kv_.rows(); }
  Index value_dim() const { return kv_.cols(); }
  std::int64_t tokens() const { return tokens_; }

  const RowMatrix<Scalar>& kv() const { return kv_; }       // S, dk x dv
  const RowVector<Scalar>& k_sum() const { return k_sum_; }  // z, dk
  RowMatrix<Scalar>& kv() { return kv_; }
  RowVector<Scalar>& k_sum() { return k_sum_; }
  void add_tokens(std::int64_t n) { tokens_ += n; }
  void set_tokens(std::int64_t n) { tokens_ = n; }

  std::size_t bytes() const {
    return static_cast<std::size_t>(kv_.size() + k_sum_.size()) * sizeof(Scalar);
  }

  void reset() {
    kv_.setZero();
    k_sum_.setZero();
    tokens_ = 0;
  }

  friend bool operator==(const LinearState& a, const LinearState& b) {
    return a.tokens_ == b.tokens_ && a.kv_.rows() == b.kv_.rows() &&
           a.kv_.cols() == b.kv_.cols() && a.kv_ == b.kv_ && a.k_sum_ == b.k_sum_;
  }

 private:
  RowMatrix<Scalar> kv_;
  RowVector<Scalar> k_sum_;
  std::int64_t tokens_ = 0;
};

}  // namespace ovq
