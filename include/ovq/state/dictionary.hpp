#pragma once
// A dictionary of centroids: what VQ-attention (fixed codebook keys, running-mean values) and
// OVQ-attention (online keys and values) remember.
//
// Rows [0, n) of D_k (capacity x dk) and D_v (capacity x dv) are active, each with a 64-bit count
// (streams of billions of tokens must not lose a token) and its log, the read bias
// (-inf for a count of 0, so that such a row contributes nothing).
// Memory: capacity (dk + dv + 1) scalars + capacity counts, fixed at construction.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "ovq/core/checks.hpp"
#include "ovq/core/types.hpp"
#include "ovq/state/dictionary_rows.hpp"

namespace ovq {

template <class Scalar>
class Dictionary {
  static_assert(is_supported_scalar_v<Scalar>, "ovq states hold float or double");

 public:
  using scalar_type = Scalar;

  Dictionary() = default;
  Dictionary(Index capacity, Index dk, Index dv)
      : keys_(detail::positive("Dictionary", "capacity", capacity),
              detail::positive("Dictionary", "dk", dk)),
        values_(capacity, detail::positive("Dictionary", "dv", dv)),
        counts_(static_cast<std::size_t>(capacity), 0),
        log_counts_(static_cast<std::size_t>(capacity), kNegInf) {
    keys_.setZero();
    values_.setZero();
  }

  Index capacity() const { return keys_.rows(); }
  Index size() const { return size_; }
  bool full() const { return size_ == capacity(); }
  Index key_dim() const { return keys_.cols(); }
  Index value_dim() const { return values_.cols(); }

  ConstRowsView<Scalar> keys() const { return {keys_.data(), size_, key_dim(), key_dim()}; }
  ConstRowsView<Scalar> values() const {
    return {values_.data(), size_, value_dim(), value_dim()};
  }
  RowsView<Scalar> keys() { return {keys_.data(), size_, key_dim(), key_dim()}; }
  RowsView<Scalar> values() { return {values_.data(), size_, value_dim(), value_dim()}; }

  const std::int64_t* counts() const { return counts_.data(); }
  std::int64_t count(Index r) const { return counts_[static_cast<std::size_t>(r)]; }
  // log(count) per active row, -inf where the count is 0: the read bias.
  const Scalar* log_counts() const { return log_counts_.data(); }

  std::int64_t total_count() const {
    std::int64_t total = 0;
    for (Index r = 0; r < size_; ++r) total += counts_[static_cast<std::size_t>(r)];
    return total;
  }

  void set_count(Index r, std::int64_t c) { ovq::set_count(rows(), r, c); }

  // Every row, active or not, as plain views: what the write phases work on. Rows they open
  // become active through set_size().
  DictionaryRows<Scalar> rows() {
    return {{keys_.data(), capacity(), key_dim(), key_dim()},
            {values_.data(), capacity(), value_dim(), value_dim()},
            counts_.data(),
            log_counts_.data()};
  }
  // Rows [0, n) are active (n <= capacity, rows [size(), n) written through rows()).
  void set_size(Index n) {
    detail::require(n >= 0 && n <= capacity(), "Dictionary::set_size", "n = ", n,
                    ", expected a value in [0, ", capacity(), "]");
    size_ = n;
  }

  // Opens row n with the given key and value and a count of `count`.
  void push(const Scalar* k, const Scalar* v, std::int64_t count = 0) {
    detail::require(size_ < capacity(), "Dictionary::push", "dictionary is full (capacity ",
                    capacity(), "), expected a free row");
    detail::require(count >= 0, "Dictionary::push", "count = ", count, ", expected >= 0");
    const Index r = size_++;
    std::copy(k, k + key_dim(), keys_.row(r).data());
    std::copy(v, v + value_dim(), values_.row(r).data());
    set_count(r, count);
  }

  void clear() {
    for (Index r = 0; r < size_; ++r) set_count(r, 0);
    size_ = 0;
  }

  // Payload bytes held: the full capacity, whatever is active (the dictionary never grows).
  std::size_t bytes() const {
    return static_cast<std::size_t>(capacity()) *
           (static_cast<std::size_t>(key_dim() + value_dim() + 1) * sizeof(Scalar) +
            sizeof(std::int64_t));
  }

  friend bool operator==(const Dictionary& a, const Dictionary& b) {
    if (a.capacity() != b.capacity() || a.key_dim() != b.key_dim() ||
        a.value_dim() != b.value_dim() || a.size_ != b.size_)
      return false;
    for (Index r = 0; r < a.size_; ++r)
      if (a.count(r) != b.count(r)) return false;
    return as_eigen(a.keys()) == as_eigen(b.keys()) &&
           as_eigen(a.values()) == as_eigen(b.values());
  }
  friend bool operator!=(const Dictionary& a, const Dictionary& b) { return !(a == b); }

 private:
  static constexpr Scalar kNegInf = -std::numeric_limits<Scalar>::infinity();

  RowMatrix<Scalar> keys_;    // capacity x dk
  RowMatrix<Scalar> values_;  // capacity x dv
  std::vector<std::int64_t> counts_;
  std::vector<Scalar> log_counts_;
  Index size_ = 0;
};

}  // namespace ovq
