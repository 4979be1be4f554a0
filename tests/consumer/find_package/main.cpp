// A consumer of the installed (or embedded) library: one OVQ head, prefill then decode, checked
// against the streaming identity (forward over the whole sequence == forward then step).
#include <ovq/ovq.hpp>

#include <cmath>
#include <cstdio>

int main() {
  using Matrix = ovq::RowMatrix<float>;
  const Matrix q = Matrix::Random(40, 8), k = Matrix::Random(40, 8), v = Matrix::Random(40, 4);
  ovq::OvqOptions options;
  options.capacity = 16;
  options.chunk = 8;
  const ovq::OvqAttention<float> mixer(options);

  auto whole = mixer.make_state(8, 4);
  const Matrix o = mixer.forward(whole, q, k, v);

  auto pieces = mixer.make_state(8, 4);
  mixer.forward(pieces, q.topRows(39), k.topRows(39), v.topRows(39));
  const ovq::RowVector<float> last = mixer.step(pieces, q.row(39), k.row(39), v.row(39));

  const float diff = (last - o.row(39)).norm();
  std::printf("ovq %d.%d.%d: step vs forward %.3g\n", ovq::kVersionMajor, ovq::kVersionMinor,
              ovq::kVersionPatch, static_cast<double>(diff));
  return std::isfinite(diff) && diff < 1e-5f && whole == pieces ? 0 : 1;
}
