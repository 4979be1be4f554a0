#pragma once
// What self-attention remembers: the keys and values of past tokens, all of them or, with a
// sliding window W, the last W - 1 (the most a future query can still see).
//
// Rows are kept contiguous and oldest first, so the cache is directly the memory block of the
// fused read. Memory: rows (dk + dv) scalars, growing with the stream unless windowed; a
// windowed cache allocates a quarter more than its rows (plus 16), so that dropping its oldest
// rows moves the kept ones only once per that many appended rows (amortised O(dk + dv) per
// token, not O(W (dk + dv))). Its rows live in RowBuffers: a long cache on huge pages, which a
// decode step streams with fewer TLB misses (core/row_buffer.hpp).
#include <algorithm>
#include <cstdint>
#include <utility>

#include "ovq/core/checks.hpp"
#include "ovq/core/row_buffer.hpp"
#include "ovq/core/types.hpp"

namespace ovq {

template <class Scalar>
class KvCache {
  static_assert(is_element_v<Scalar>, "ovq states hold float, double, bf16 or fp16");

 public:
  using scalar_type = Scalar;

  KvCache() = default;
  static constexpr Index kKeepAll = -1;

  // keep_rows: kKeepAll keeps every row, otherwise only the newest keep_rows rows (maybe 0).
  KvCache(Index dk, Index dv, Index keep_rows = kKeepAll)
      : dk_(dk), dv_(dv), keep_rows_(keep_rows) {
    detail::check_positive("KvCache", "dk", dk);
    detail::check_positive("KvCache", "dv", dv);
    detail::require(keep_rows >= kKeepAll, "KvCache", "keep_rows = ", keep_rows,
                    ", expected >= 0 or kKeepAll");
    keys_ = RowBuffer<Scalar>(dk);
    values_ = RowBuffer<Scalar>(dv);
  }

  Index key_dim() const { return dk_; }
  Index value_dim() const { return dv_; }
  Index size() const { return size_; }
  Index keep_rows() const { return keep_rows_; }
  // Rows allocated: a windowed cache holding keep_rows > 0 rows has keep_rows + keep_rows / 4 +
  // 16.
  Index capacity() const { return keys_.rows(); }
  // Tokens appended since the last reset (a windowed cache forgets rows, not this count).
  std::int64_t tokens() const { return tokens_; }

  ConstRowsView<Scalar> keys() const {
    return {keys_.data() + begin_ * dk_, size_, dk_, dk_};
  }
  ConstRowsView<Scalar> values() const {
    return {values_.data() + begin_ * dv_, size_, dv_, dv_};
  }

  // Payload bytes held (the rows kept), which is what the cache costs.
  std::size_t bytes() const { return static_cast<std::size_t>(size_ * (dk_ + dv_)) * sizeof(Scalar); }

  void reset() {
    begin_ = 0;
    size_ = 0;
    tokens_ = 0;
  }

  // Appends rows (k: n x dk, v: n x dv), dropping the oldest beyond keep_rows.
  // Amortised O(n (dk + dv)), windowed or not.
  void append(ConstRowsView<Scalar> k, ConstRowsView<Scalar> v) {
    const Index n = k.rows;
    tokens_ += n;
    Index first = 0;  // first input row that survives
    if (keep_rows_ >= 0 && n >= keep_rows_) {
      first = n - keep_rows_;
      begin_ = 0;
      size_ = 0;
    } else if (keep_rows_ >= 0 && size_ + n > keep_rows_) {
      const Index drop = size_ + n - keep_rows_;
      begin_ += drop;
      size_ -= drop;
    }
    make_room(n - first);
    for (Index i = first; i < n; ++i, ++size_) {
      std::copy(k.row(i), k.row(i) + dk_, keys_.row(begin_ + size_));
      std::copy(v.row(i), v.row(i) + dv_, values_.row(begin_ + size_));
    }
  }

  // Restores the exact rows (used when loading a saved state).
  void assign(ConstRowsView<Scalar> k, ConstRowsView<Scalar> v, std::int64_t tokens) {
    begin_ = 0;
    size_ = 0;
    append(k, v);
    tokens_ = tokens;
  }

  friend bool operator==(const KvCache& a, const KvCache& b) {
    return a.dk_ == b.dk_ && a.dv_ == b.dv_ && a.keep_rows_ == b.keep_rows_ &&
           a.size_ == b.size_ && a.tokens_ == b.tokens_ &&
           as_eigen(a.keys()) == as_eigen(b.keys()) && as_eigen(a.values()) == as_eigen(b.values());
  }

 private:
  // Rows a windowed cache allocates beyond keep_rows: its kept rows move to the front once per
  // that many appended rows.
  Index slack() const { return keep_rows_ / 4 + 16; }

  // Rows to allocate for `rows` rows in use: geometric growth, and for a windowed cache at most
  // keep_rows + slack(), all of it once the window is full (so that it drops rows with room to
  // spare).
  Index wanted_capacity(Index rows) const {
    if (keep_rows_ >= 0 && rows >= keep_rows_) return keep_rows_ > 0 ? keep_rows_ + slack() : 0;
    if (rows <= keys_.rows()) return keys_.rows();
    const Index grown = std::max<Index>(rows, keys_.rows() + keys_.rows() / 2 + 16);
    return keep_rows_ >= 0 ? std::min(grown, keep_rows_ + slack()) : grown;
  }

  // Room for n more rows after the kept ones: the kept rows move to the front of the buffer
  // when its end is reached, and the buffer grows when they fill it.
  void make_room(Index n) {
    const Index capacity = wanted_capacity(size_ + n);
    if (capacity == keys_.rows() && begin_ + size_ + n <= capacity) return;
    if (begin_ > 0) {  // the destination starts before the source: a forward copy is safe
      std::copy(keys_.data() + begin_ * dk_, keys_.data() + (begin_ + size_) * dk_, keys_.data());
      std::copy(values_.data() + begin_ * dv_, values_.data() + (begin_ + size_) * dv_,
                values_.data());
      begin_ = 0;
    }
    if (capacity != keys_.rows()) {  // keeps rows [0, size); both allocated before either moves
      RowBuffer<Scalar> keys = keys_.resized(capacity, size_);
      RowBuffer<Scalar> values = values_.resized(capacity, size_);
      keys_ = std::move(keys);
      values_ = std::move(values);
    }
  }

  Index dk_ = 0;
  Index dv_ = 0;
  Index keep_rows_ = 0;
  Index begin_ = 0;  // the first row in use
  Index size_ = 0;
  std::int64_t tokens_ = 0;
  RowBuffer<Scalar> keys_;    // capacity x dk, rows [begin, begin + size) in use
  RowBuffer<Scalar> values_;  // capacity x dv
};

}  // namespace ovq
