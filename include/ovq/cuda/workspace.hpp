#pragma once
// Carving one workspace allocation into the arrays of a call (each 256-byte aligned).
#include <cstddef>

namespace ovq::cuda::detail {

class WorkspaceLayout {
 public:
  // Reserves `count` entries of T; returns their byte offset.
  template <class T>
  std::size_t add(std::size_t count) {
    const std::size_t offset = (bytes_ + 255) / 256 * 256;
    bytes_ = offset + count * sizeof(T);
    return offset;
  }
  std::size_t bytes() const { return bytes_; }

  template <class T>
  static T* at(void* base, std::size_t offset) {
    return reinterpret_cast<T*>(static_cast<unsigned char*>(base) + offset);
  }

 private:
  std::size_t bytes_ = 0;
};

}  // namespace ovq::cuda::detail
