#pragma once
// The rows of the current, not yet complete chunk, which linear, VQ and OVQ attention hold in
// their states: chunks sit at fixed stream positions and are written only once complete, so a
// state does not depend on how the stream was split into calls. Memory: chunk (dk + dv) scalars,
// allocated once.
#include <algorithm>
#include <cstddef>

#include "ovq/core/checks.hpp"
#include "ovq/core/types.hpp"

namespace ovq {

template <class Scalar>
class PendingRows {
 public:
  PendingRows() = default;
  // `owner` names the state in error messages.
  PendingRows(const char* owner, Index chunk, Index dk, Index dv)
      : keys_(detail::positive(owner, "chunk", chunk), detail::positive(owner, "dk", dk)),
        values_(chunk, detail::positive(owner, "dv", dv)) {
    keys_.setZero();
    values_.setZero();
  }

  Index chunk() const { return keys_.rows(); }
  Index size() const { return size_; }
  Index free_rows() const { return chunk() - size_; }

  ConstRowsView<Scalar> keys() const { return {keys_.data(), size_, keys_.cols(), keys_.cols()}; }
  ConstRowsView<Scalar> values() const {
    return {values_.data(), size_, values_.cols(), values_.cols()};
  }

  // Appends k (n x dk) and v (n x dv), n <= free_rows(). Checked before anything changes;
  // `where` names the caller in the error.
  void append(const char* where, ConstRowsView<Scalar> k, ConstRowsView<Scalar> v) {
    check(where, k, v, free_rows());
    for (Index i = 0; i < k.rows; ++i) append_row(k.row(i), v.row(i));
  }
  // Replaces the rows with k and v (n < chunk(): a complete chunk is never left pending).
  void assign(const char* where, ConstRowsView<Scalar> k, ConstRowsView<Scalar> v) {
    check(where, k, v, chunk() - 1);
    size_ = 0;
    for (Index i = 0; i < k.rows; ++i) append_row(k.row(i), v.row(i));
  }
  // One row of dk and one of dv scalars; the caller made sure a row is free.
  void append_row(const Scalar* key, const Scalar* value) {
    std::copy(key, key + keys_.cols(), keys_.row(size_).data());
    std::copy(value, value + values_.cols(), values_.row(size_).data());
    ++size_;
  }

  void clear() { size_ = 0; }
  // Forgets the rows and zeroes the buffers.
  void reset() {
    keys_.setZero();
    values_.setZero();
    size_ = 0;
  }

  std::size_t bytes() const {
    return static_cast<std::size_t>(keys_.size() + values_.size()) * sizeof(Scalar);
  }

  // Same chunk length and the same rows in use (stale rows past size() are not compared).
  friend bool operator==(const PendingRows& a, const PendingRows& b) {
    return a.chunk() == b.chunk() && a.size_ == b.size_ &&
           as_eigen(a.keys()) == as_eigen(b.keys()) && as_eigen(a.values()) == as_eigen(b.values());
  }
  friend bool operator!=(const PendingRows& a, const PendingRows& b) { return !(a == b); }

 private:
  void check(const char* where, ConstRowsView<Scalar> k, ConstRowsView<Scalar> v,
             Index max_rows) const {
    detail::require(k.rows <= max_rows, where, "K has ", k.rows, " rows, expected at most ",
                    max_rows, " (free pending rows)");
    detail::check_cols(where, "K", k.cols, keys_.cols(), "the state's dk");
    detail::check_shape(where, "V", v.rows, v.cols, k.rows, values_.cols());
  }

  RowMatrix<Scalar> keys_;    // chunk x dk, rows [0, size) in use
  RowMatrix<Scalar> values_;  // chunk x dv
  Index size_ = 0;
};

}  // namespace ovq
