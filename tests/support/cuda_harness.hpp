#pragma once
// Running the device mixers from tests, on any backend (the host emulation here, the GPU in
// tests/cuda): host matrices in the multi-head layout of ovq::MultiHead ((heads x T) x d, head
// after head) in and out of device memory, and a stream fed to a mixer in pieces.
#include <algorithm>
#include <limits>
#include <vector>

#include "ovq/cuda/buffer.hpp"
#include "ovq/cuda/views.hpp"
#include "ovq/ovq.hpp"

namespace ovq::test {

template <class Scalar, class Backend>
class DeviceRows {
 public:
  using Stream = typename Backend::Stream;

  // host: (heads x rows) x cols, head after head.
  DeviceRows(const RowMatrix<Scalar>& host, Index heads, Stream stream)
      : heads_(heads), rows_(host.rows() / heads), cols_(host.cols()),
        buffer_(static_cast<std::size_t>(host.size()), stream) {
    Backend::copy(buffer_.data(), host.data(), buffer_.bytes(), stream);
  }
  // A buffer of `heads` x rows x cols, every entry NaN (an output no kernel wrote stays NaN).
  DeviceRows(Index heads, Index rows, Index cols, Stream stream)
      : heads_(heads), rows_(rows), cols_(cols),
        buffer_(static_cast<std::size_t>(heads * rows * cols), stream) {
    RowMatrix<Scalar> poison(heads * rows, cols);
    poison.setConstant(std::numeric_limits<Scalar>::quiet_NaN());
    Backend::copy(buffer_.data(), poison.data(), buffer_.bytes(), stream);
    Backend::synchronize(stream);
  }

  cuda::HeadsView<Scalar> view() const {
    return cuda::contiguous_heads(buffer_.data(), heads_, rows_, cols_);
  }
  RowMatrix<Scalar> download(Stream stream) const {
    RowMatrix<Scalar> host(heads_ * rows_, cols_);
    Backend::copy(host.data(), buffer_.data(), buffer_.bytes(), stream);
    Backend::synchronize(stream);
    return host;
  }

 private:
  Index heads_, rows_, cols_;
  cuda::DeviceBuffer<Scalar, Backend> buffer_;
};

// Feeds tokens [0, T) of q, k, v to `mixer` in pieces of the given lengths (a piece of 1 goes
// through step(), longer ones through forward(); the last piece takes what is left) and writes
// every output into o.
template <class Mixer, class State, class Scalar, class Backend>
void feed_pieces(const Mixer& mixer, State& state, const DeviceRows<Scalar, Backend>& q,
                 const DeviceRows<Scalar, Backend>& k, const DeviceRows<Scalar, Backend>& v,
                 const DeviceRows<Scalar, Backend>& o, const std::vector<Index>& pieces,
                 typename Backend::Stream stream) {
  const Index t = k.view().rows;
  Index pos = 0;
  for (std::size_t i = 0; pos < t; ++i) {
    const Index take = i < pieces.size() ? std::min(pieces[i], t - pos) : t - pos;
    auto qv = q.view().middle_rows(pos, take);
    auto kv = k.view().middle_rows(pos, take);
    auto vv = v.view().middle_rows(pos, take);
    auto ov = o.view().middle_rows(pos, take);
    if (take == 1) {
      mixer.step(state, qv, kv, vv, ov, stream);
    } else {
      mixer.forward(state, qv, kv, vv, ov, stream);
    }
    pos += take;
  }
}

}  // namespace ovq::test
