#pragma once
// What every device state shares: its counters in device memory (counters.hpp), the host's copy
// of them, and its scratch workspace.
//
// The host's copy (counters()) is what the host plans launches with; kernels always use the
// device's. The host advances its copy with every call it makes. A call made while the stream
// is being captured into a CUDA graph marks the copy stale (each replay advances the device
// state alone), and the next call from the host reads the device's back first: a synchronising
// copy, the only one a state makes outside to_host() and synchronize().
#include <cstddef>
#include <string>

#include "ovq/core/error.hpp"
#include "ovq/cuda/buffer.hpp"
#include "ovq/cuda/counters.hpp"

namespace ovq::cuda {

template <class Backend>
class StateBase {
 public:
  using Stream = typename Backend::Stream;

  // The counters as the host last saw or set them (see the header).
  const StateCounters& counters() const { return host_; }
  StateCounters* device_counters() const { return device_.data(); }
  bool stale() const { return stale_; }
  // The split decode reads' arrival counters in device memory (0 between launches), and how many.
  const std::int64_t* arrival_counters() const { return arrivals_.data(); }
  std::size_t arrival_count() const { return arrivals_.size(); }

  // Waits for the state's work on `stream`, reads the device's counters, and reports a call
  // that could not be carried out: it throws ovq::ArgumentError naming why, and clears the
  // fault (that call, and every call since, left the state as it was).
  void synchronize(Stream stream) {
    StateCounters seen;
    Backend::copy(&seen, device_.data(), sizeof seen, stream);
    Backend::synchronize(stream);
    host_ = seen;
    stale_ = false;
    if (seen.fault == kFaultNone) return;
    StateCounters cleared = seen;
    cleared.fault = kFaultNone;
    upload(cleared, stream);
    throw ArgumentError(fault_message(seen.fault));
  }

 protected:
  explicit StateBase(Stream stream) : device_(1, stream) { upload(StateCounters{}, stream); }
  StateBase(StateBase&&) noexcept = default;
  StateBase& operator=(StateBase&&) noexcept = default;

  // Before a call from the host: fresh counters (see the header). Inside a capture nothing can
  // be read back: the host's counters are then those of the calls it captured.
  void begin_call(Stream stream) {
    if (stale_ && !Backend::capturing(stream)) synchronize(stream);
  }
  // After a call's launches: the host's counters as the call leaves them.
  void end_call(const StateCounters& after, Stream stream) {
    host_ = after;
    if (Backend::capturing(stream)) stale_ = true;
  }
  // (A copy from pageable host memory has read its source when it returns.)
  void upload(const StateCounters& c, Stream stream) {
    host_ = c;
    Backend::copy(device_.data(), &host_, sizeof host_, stream);
  }

  // Scratch of at least `count` scalars of type T, grown (stream-ordered) when needed. Inside a
  // graph capture it cannot grow: size it with reserve() before capturing.
  template <class T>
  T* workspace(std::size_t count, Stream stream, const char* where) {
    const std::size_t bytes = count * sizeof(T);
    if (workspace_.size() < bytes) {
      ovq::detail::require(!Backend::capturing(stream), where, "the state's workspace holds ",
                           workspace_.size(), " bytes, expected ", bytes,
                           ": reserve the state before capturing a graph");
      workspace_ = DeviceBuffer<unsigned char, Backend>(bytes, stream);
    }
    return reinterpret_cast<T*>(workspace_.data());
  }
  std::size_t workspace_bytes() const { return workspace_.size(); }

  // At least `count` arrival counters, all 0 (the split decode reads' per-tile counters, which
  // their last blocks set back to 0), grown and zeroed when needed; inside a graph capture they
  // cannot grow: reserve() sizes them.
  std::int64_t* arrivals(std::size_t count, Stream stream, const char* where) {
    if (arrivals_.size() < count) {
      ovq::detail::require(!Backend::capturing(stream), where, "the state holds ",
                           arrivals_.size(), " arrival counters, expected ", count,
                           ": reserve the state before capturing a graph");
      arrivals_ = DeviceBuffer<std::int64_t, Backend>(count, stream);
      Backend::zero(arrivals_.data(), arrivals_.bytes(), stream);
    }
    return arrivals_.data();
  }

 private:
  static std::string fault_message(std::int64_t fault) {
    std::string why;
    if (fault & kFaultNonFinite) why += "an entry of Q, K or V was not finite";
    if (fault & kFaultCapacity) {
      if (!why.empty()) why += "; ";
      why += "the state had no room for a row (a replayed step past its reserved capacity)";
    }
    return "cuda state: a call since the last check could not be carried out (" + why +
           ", expected finite inputs within the state's capacity); that call and every call "
           "after it left the state as it was";
  }

  DeviceBuffer<StateCounters, Backend> device_;
  StateCounters host_{};
  bool stale_ = false;
  DeviceBuffer<unsigned char, Backend> workspace_;
  DeviceBuffer<std::int64_t, Backend> arrivals_;
};

}  // namespace ovq::cuda
