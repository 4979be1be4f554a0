#pragma once
// A dictionary of centroids: what VQ-attention (fixed codebook keys, running-mean values) and
// OVQ-attention (online keys and values) remember.
//
// Rows [0, n) of D_k (capacity x dk) and D_v (capacity x dv) are active, each with a 64-bit count
// (streams of billions of tokens must not lose a token) and its log, the read bias
// (-inf for a count of 0, so that such a row contributes nothing). A dictionary of 16-bit
// elements also keeps the rows' running means in float (state/dictionary_rows.hpp).
// Memory: capacity (dk + dv) elements (+ capacity (dk + dv) floats for 16-bit elements) +
// capacity log counts and counts, fixed at construction.
//
// The rows live in one allocation: D_k's capacity rows, D_v's, then (16-bit elements) the float
// means of both. A decode step streams D_k and D_v whole, and a write the mean keys; from 2 MiB
// the allocation is on huge pages (core/row_buffer.hpp), which one dictionary of N = 2048,
// d = 128 fills in float, and whose first page holds a bf16 one's rows and its mean keys.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <new>
#include <utility>
#include <vector>

#include "ovq/core/checks.hpp"
#include "ovq/core/row_buffer.hpp"
#include "ovq/core/types.hpp"
#include "ovq/state/dictionary_rows.hpp"

namespace ovq {

template <class Element>
class Dictionary {
  static_assert(is_element_v<Element>, "ovq states hold float, double, bf16 or fp16");

 public:
  using scalar_type = Element;
  using Compute = compute_t<Element>;
  // Whether the running means are rows of their own (16-bit elements: state/dictionary_rows.hpp).
  static constexpr bool kSeparateMeans = DictionaryRows<Element>::kSeparateMeans;

  Dictionary() = default;
  Dictionary(Index capacity, Index dk, Index dv)
      : capacity_(detail::positive("Dictionary", "capacity", capacity)),
        dk_(detail::positive("Dictionary", "dk", dk)),
        dv_(detail::positive("Dictionary", "dv", dv)),
        storage_(1, storage_bytes(capacity, dk, dv)),
        counts_(static_cast<std::size_t>(capacity), 0),
        log_counts_(static_cast<std::size_t>(capacity), kNegInf) {
    std::fill(keys_data(), keys_data() + capacity * (dk + dv), Element(0));
    if constexpr (kSeparateMeans)
      std::fill(mean_keys_data(), mean_keys_data() + capacity * (dk + dv), Compute(0));
  }

  Dictionary(const Dictionary&) = default;
  // A moved-from dictionary is empty (capacity 0), as a moved-from Eigen matrix is.
  Dictionary(Dictionary&& other) noexcept { swap(other); }
  // All or nothing: a copy that fails to allocate leaves this dictionary as it was; one of the
  // same shape copies into the buffers already held (a state put back to a saved copy keeps
  // its pages).
  Dictionary& operator=(const Dictionary& other) {
    if (this == &other) return *this;
    if (storage_.cols() != other.storage_.cols() || counts_.size() != other.counts_.size()) {
      Dictionary copy(other);
      swap(copy);
      return *this;
    }
    storage_ = other.storage_;
    counts_ = other.counts_;
    log_counts_ = other.log_counts_;
    capacity_ = other.capacity_;
    dk_ = other.dk_;
    dv_ = other.dv_;
    size_ = other.size_;
    return *this;
  }
  Dictionary& operator=(Dictionary&& other) noexcept {
    Dictionary gone(std::move(other));
    swap(gone);
    return *this;
  }

  Index capacity() const { return capacity_; }
  Index size() const { return size_; }
  bool full() const { return size_ == capacity(); }
  Index key_dim() const { return dk_; }
  Index value_dim() const { return dv_; }

  // The active rows as the reads see them.
  ConstRowsView<Element> keys() const { return {keys_data(), size_, key_dim(), key_dim()}; }
  ConstRowsView<Element> values() const {
    return {values_data(), size_, value_dim(), value_dim()};
  }
  // The active rows' running means (the same rows as keys() and values() for float and double).
  ConstRowsView<Compute> mean_keys() const {
    return {mean_keys_data(), size_, key_dim(), key_dim()};
  }
  ConstRowsView<Compute> mean_values() const {
    return {mean_values_data(), size_, value_dim(), value_dim()};
  }

  const std::int64_t* counts() const { return counts_.data(); }
  std::int64_t count(Index r) const { return counts_[static_cast<std::size_t>(r)]; }
  // log(count) per active row, -inf where the count is 0: the read bias.
  const Compute* log_counts() const { return log_counts_.data(); }
  // The read bias: log_counts(), or without the count bias 0 where the count is > 0 (-inf where
  // it is 0, so that a row with no members still contributes nothing), written into storage.
  const Compute* read_bias(bool count_bias, std::vector<Compute>& storage) const {
    if (count_bias) return log_counts();
    storage.resize(static_cast<std::size_t>(size_));
    for (Index r = 0; r < size_; ++r)
      storage[static_cast<std::size_t>(r)] = count(r) > 0 ? Compute(0) : kNegInf;
    return storage.data();
  }

  std::int64_t total_count() const {
    std::int64_t total = 0;
    for (Index r = 0; r < size_; ++r) total += counts_[static_cast<std::size_t>(r)];
    return total;
  }

  void set_count(Index r, std::int64_t c) { ovq::set_count(rows(), r, c); }

  // Every row, active or not, as plain views: what the write phases work on. Rows they open
  // become active through set_size().
  DictionaryRows<Element> rows() {
    return {{keys_data(), capacity(), key_dim(), key_dim()},
            {values_data(), capacity(), value_dim(), value_dim()},
            {mean_keys_data(), capacity(), key_dim(), key_dim()},
            {mean_values_data(), capacity(), value_dim(), value_dim()},
            counts_.data(),
            log_counts_.data()};
  }
  // Rows [0, n) are active (n <= capacity, rows [size(), n) written through rows()).
  void set_size(Index n) {
    detail::require(n >= 0 && n <= capacity(), "Dictionary::set_size", "n = ", n,
                    ", expected a value in [0, ", capacity(), "]");
    size_ = n;
  }

  // Opens row n with the given key and value (its mean: the same, widened) and a count.
  void push(const Element* k, const Element* v, std::int64_t count = 0) {
    const Index r = open(count);
    std::copy(k, k + key_dim(), keys_data() + r * key_dim());
    std::copy(v, v + value_dim(), values_data() + r * value_dim());
    if constexpr (kSeparateMeans) {
      Compute* mk = mean_keys_data() + r * key_dim();
      Compute* mv = mean_values_data() + r * value_dim();
      for (Index c = 0; c < key_dim(); ++c) mk[c] = widen(k[c]);
      for (Index c = 0; c < value_dim(); ++c) mv[c] = widen(v[c]);
    }
  }
  // Opens row n with the given running means (the read rows: the means rounded) and a count.
  void push_means(const Compute* k, const Compute* v, std::int64_t count = 0) {
    const Index r = open(count);
    std::copy(k, k + key_dim(), mean_keys_data() + r * key_dim());
    std::copy(v, v + value_dim(), mean_values_data() + r * value_dim());
    publish(r);
  }
  // Row r as the reads see it, from its mean (nothing to do when they are the same rows).
  void publish(Index r) {
    if constexpr (kSeparateMeans) {
      const Compute* mk = mean_keys_data() + r * key_dim();
      const Compute* mv = mean_values_data() + r * value_dim();
      Element* k = keys_data() + r * key_dim();
      Element* v = values_data() + r * value_dim();
      for (Index c = 0; c < key_dim(); ++c) k[c] = narrow<Element>(mk[c]);
      for (Index c = 0; c < value_dim(); ++c) v[c] = narrow<Element>(mv[c]);
    }
  }

  void clear() {
    for (Index r = 0; r < size_; ++r) set_count(r, 0);
    size_ = 0;
  }

  // Payload bytes held: the full capacity, whatever is active (the dictionary never grows).
  std::size_t bytes() const {
    const std::size_t width = static_cast<std::size_t>(key_dim() + value_dim());
    return static_cast<std::size_t>(capacity()) *
           (width * sizeof(Element) + (kSeparateMeans ? width * sizeof(Compute) : 0) +
            sizeof(Compute) + sizeof(std::int64_t));
  }

  friend bool operator==(const Dictionary& a, const Dictionary& b) {
    if (a.capacity() != b.capacity() || a.key_dim() != b.key_dim() ||
        a.value_dim() != b.value_dim() || a.size_ != b.size_)
      return false;
    for (Index r = 0; r < a.size_; ++r)
      if (a.count(r) != b.count(r)) return false;
    return as_eigen(a.mean_keys()) == as_eigen(b.mean_keys()) &&
           as_eigen(a.mean_values()) == as_eigen(b.mean_values()) &&
           as_eigen(a.keys()) == as_eigen(b.keys()) && as_eigen(a.values()) == as_eigen(b.values());
  }
  friend bool operator!=(const Dictionary& a, const Dictionary& b) { return !(a == b); }

 private:
  static constexpr Compute kNegInf = -std::numeric_limits<Compute>::infinity();

  Index open(std::int64_t count) {
    detail::require(size_ < capacity(), "Dictionary::push", "dictionary is full (capacity ",
                    capacity(), "), expected a free row");
    detail::require(count >= 0, "Dictionary::push", "count = ", count, ", expected >= 0");
    const Index r = size_++;
    set_count(r, count);
    return r;
  }
  void swap(Dictionary& other) noexcept {
    std::swap(capacity_, other.capacity_);
    std::swap(dk_, other.dk_);
    std::swap(dv_, other.dv_);
    std::swap(storage_, other.storage_);
    counts_.swap(other.counts_);
    log_counts_.swap(other.log_counts_);
    std::swap(size_, other.size_);
  }
  // Where the means start (16-bit elements): past the rows, on a cache line.
  static Index means_offset(Index capacity, Index dk, Index dv) {
    const Index row_bytes = capacity * (dk + dv) * Index(sizeof(Element));
    return (row_bytes + 63) / 64 * 64;
  }
  // Throws std::bad_alloc (as an Eigen matrix of that size would) past what memory can address.
  static Index storage_bytes(Index capacity, Index dk, Index dv) {
    constexpr Index kMost = std::numeric_limits<Index>::max() / 4;
    const Index per_row = Index(sizeof(Element)) + (kSeparateMeans ? Index(sizeof(Compute)) : 0);
    if (dk > kMost || dv > kMost || capacity > kMost / (dk + dv) / per_row)
      throw std::bad_alloc();
    if constexpr (kSeparateMeans)
      return means_offset(capacity, dk, dv) + capacity * (dk + dv) * Index(sizeof(Compute));
    return capacity * (dk + dv) * Index(sizeof(Element));
  }
  Element* keys_data() { return reinterpret_cast<Element*>(storage_.data()); }
  const Element* keys_data() const { return reinterpret_cast<const Element*>(storage_.data()); }
  Element* values_data() { return keys_data() + capacity_ * dk_; }
  const Element* values_data() const { return keys_data() + capacity_ * dk_; }
  Compute* mean_keys_data() {
    if constexpr (kSeparateMeans) {
      return reinterpret_cast<Compute*>(storage_.data() + means_offset(capacity_, dk_, dv_));
    } else {
      return keys_data();
    }
  }
  const Compute* mean_keys_data() const {
    if constexpr (kSeparateMeans) {
      return reinterpret_cast<const Compute*>(storage_.data() + means_offset(capacity_, dk_, dv_));
    } else {
      return keys_data();
    }
  }
  Compute* mean_values_data() { return mean_keys_data() + capacity_ * dk_; }
  const Compute* mean_values_data() const { return mean_keys_data() + capacity_ * dk_; }

  Index capacity_ = 0, dk_ = 0, dv_ = 0;
  // D_k (capacity x dk), D_v (capacity x dv), then for 16-bit elements the means of both in
  // Compute (from means_offset), as bytes: elements of two types in one allocation.
  RowBuffer<unsigned char> storage_;
  std::vector<std::int64_t> counts_;
  std::vector<Compute> log_counts_;
  Index size_ = 0;
};

}  // namespace ovq
