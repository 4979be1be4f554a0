#pragma once
// Memory owned on a backend's device (a GPU, or the emulator's host memory), stream-ordered:
// allocated and released on the stream given at construction.
#include <cstddef>
#include <utility>

namespace ovq::cuda {

template <class T, class Backend>
class DeviceBuffer {
 public:
  using Stream = typename Backend::Stream;

  DeviceBuffer() = default;
  DeviceBuffer(std::size_t count, Stream stream)
      : data_(static_cast<T*>(Backend::allocate(count * sizeof(T), stream))),
        count_(count),
        stream_(stream) {}
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  DeviceBuffer(DeviceBuffer&& other) noexcept { swap(other); }
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept {
    DeviceBuffer(std::move(other)).swap(*this);
    return *this;
  }
  ~DeviceBuffer() { Backend::release(data_, stream_); }

  T* data() const { return data_; }
  std::size_t size() const { return count_; }
  std::size_t bytes() const { return count_ * sizeof(T); }
  Stream stream() const { return stream_; }

  void swap(DeviceBuffer& other) noexcept {
    std::swap(data_, other.data_);
    std::swap(count_, other.count_);
    std::swap(stream_, other.stream_);
  }

 private:
  T* data_ = nullptr;
  std::size_t count_ = 0;
  Stream stream_{};
};

}  // namespace ovq::cuda
