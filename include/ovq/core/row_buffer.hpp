#pragma once
// Owned storage of a state's rows (a KV cache, a dictionary): `rows` rows of `cols` elements, row
// i at data() + i * cols, the contents of rows never written left undefined (as Eigen's
// conservativeResize leaves them).
//
// A buffer of 2 MiB or more starts on a 2 MiB boundary and, on Linux, is marked for transparent
// huge pages (madvise MADV_HUGEPAGE): its whole 2 MiB pages can be huge ones, and a tail past
// the last whole page keeps small pages (rounding it up would add up to 2 MiB of memory). Where
// THP is set to "madvise" (a common default), memory that does not ask gets 4 KiB pages, and a
// decode step, which streams the whole cache, then takes a TLB miss every 4 KiB and the hardware
// prefetchers stop at every 4 KiB boundary. The advice costs nothing where THP is off or
// "always"; the kernel may still decline it. Smaller buffers are aligned to a cache line.
// OVQ_NO_HUGE_PAGES turns the advice off.
#include <cstddef>
#include <cstring>
#include <limits>
#include <new>
#include <type_traits>
#include <utility>

#include "ovq/config.hpp"
#include "ovq/core/views.hpp"

#if defined(OVQ_HAS_HUGE_PAGE_ADVICE)
#include <sys/mman.h>
#endif

namespace ovq {

template <class T>
class RowBuffer {
  static_assert(std::is_trivially_copyable_v<T>, "RowBuffer holds plain elements");

 public:
  static constexpr std::size_t kHugePage = std::size_t{2} << 20;
  static constexpr std::size_t kCacheLine = 64;

  RowBuffer() = default;
  explicit RowBuffer(Index cols) : cols_(cols) {}
  RowBuffer(Index rows, Index cols) : cols_(cols) { allocate(rows); }
  ~RowBuffer() { release(); }

  RowBuffer(const RowBuffer& other) : cols_(other.cols_) {
    allocate(other.rows_);
    if (data_ != nullptr) std::memcpy(data_, other.data_, other.used_bytes());
  }
  // Into the buffer already held when it is the same size (as Eigen's matrices do): a state put
  // back to a saved copy over and over keeps its pages, faulted in once.
  RowBuffer& operator=(const RowBuffer& other) {
    if (this == &other) return *this;
    if (data_ != nullptr && rows_ * cols_ == other.rows_ * other.cols_) {
      std::memcpy(data_, other.data_, other.used_bytes());
      rows_ = other.rows_;
      cols_ = other.cols_;
    } else {
      *this = RowBuffer(other);
    }
    return *this;
  }
  RowBuffer(RowBuffer&& other) noexcept { swap(other); }
  RowBuffer& operator=(RowBuffer&& other) noexcept {
    RowBuffer gone(std::move(other));
    swap(gone);
    return *this;
  }

  Index rows() const { return rows_; }
  Index cols() const { return cols_; }
  T* data() { return data_; }
  const T* data() const { return data_; }
  T* row(Index i) { return data_ + i * cols_; }
  const T* row(Index i) const { return data_ + i * cols_; }
  // Whether the buffer starts on a huge-page boundary (it has kHugePage bytes or more).
  bool huge() const { return alignment_ == kHugePage; }

  // A buffer of `rows` rows holding this one's first `keep` rows (keep <= min(rows, rows())).
  // Allocates before anything changes: if it throws, this buffer is as it was.
  RowBuffer resized(Index rows, Index keep) const {
    RowBuffer grown(rows, cols_);
    if (keep > 0)
      std::memcpy(grown.data_, data_, static_cast<std::size_t>(keep * cols_) * sizeof(T));
    return grown;
  }

 private:
  std::size_t used_bytes() const { return static_cast<std::size_t>(rows_ * cols_) * sizeof(T); }

  // Throws std::bad_alloc (as Eigen does) for a size past what a pointer can address.
  void allocate(Index rows) {
    constexpr Index kMostElements = std::numeric_limits<Index>::max() / Index(sizeof(T));
    if (rows < 0 || cols_ < 0 || (cols_ > 0 && rows > kMostElements / cols_))
      throw std::bad_alloc();
    const std::size_t wanted = static_cast<std::size_t>(rows * cols_) * sizeof(T);
    rows_ = rows;
    if (wanted == 0) return;
    alignment_ = wanted >= kHugePage ? kHugePage : kCacheLine;
    void* p = ::operator new(wanted, std::align_val_t{alignment_});
#if defined(OVQ_HAS_HUGE_PAGE_ADVICE)
    // Advice only: a kernel without THP refuses it, and the buffer works the same.
    if (huge()) (void)::madvise(p, wanted, MADV_HUGEPAGE);
#endif
    data_ = static_cast<T*>(p);
  }
  void release() {
    if (data_ != nullptr) ::operator delete(data_, std::align_val_t{alignment_});
    data_ = nullptr;
  }
  void swap(RowBuffer& other) noexcept {
    std::swap(data_, other.data_);
    std::swap(rows_, other.rows_);
    std::swap(cols_, other.cols_);
    std::swap(alignment_, other.alignment_);
  }

  T* data_ = nullptr;
  Index rows_ = 0;
  Index cols_ = 0;
  std::size_t alignment_ = kCacheLine;
};

}  // namespace ovq
