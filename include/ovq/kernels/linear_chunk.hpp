#pragma once
// Linear attention over chunks of L tokens at fixed stream positions, carrying (S, z) across
// complete chunks.
//
// Read. Query row i of a chunk (chunk-local index, 0 <= i < L), with the chunk's rows j <= i
// known and (S, z) the sums of the chunks before it:
//   num_i = sum_{j <= i} (phi(q_i) . phi(k_j)) g^(i-j) v_j  +  (g^(i+1) phi(q_i)) S
//   den_i = sum_{j <= i} (phi(q_i) . phi(k_j)) g^(i-j)      +  (g^(i+1) phi(q_i)) . z
//   o_i = beta num_i  (unnormalised)     o_i = num_i / (den_i + eps)  (normalised; 0 if that is 0)
// Write, once the chunk holds its L rows: S = g^L S + phi(K)^T diag(g^(L-1-j)) V, z likewise.
// This equals the token recurrence S_i = g S_{i-1} + phi(k_i) v_i^T to rounding.
//
// Every output row is computed in an order that depends only on i and the chunk's rows, never on
// how many query rows the call has or where the call starts: the read runs on the tile
// micro-kernels (TileOps), whose per-row sums run in a fixed order, with key tiles aligned to the
// chunk's first row and query rows grouped by the key tile they fall in; (g^(i+1) phi(q_i)) S goes
// through the same accumulate kernel, S's rows taken as values in key tiles of dk. So a chunk
// read in one call, in uneven pieces or token by token gives the same bits. Two details keep it
// so. A row can meet extra zero weights past its own position in its last tile; they change
// nothing but the sign of a zero sum, and outputs are written as x + 0, which maps -0 to +0. And
// values and S are read at a width padded to a multiple of 16 columns (zeros, copied when dv is
// not such a multiple), so that accumulate never takes its column tail: a plain C++ loop that a
// compiler free to fuse multiply-adds (GCC's default -ffp-contract=fast) may round differently
// for different tile shapes. (The float SIMD read is then explicit intrinsics throughout; the
// portable kernels need -ffp-contract=off for the same guarantee, see README.) The write runs
// only on complete chunks, always of the same shape, so Eigen's product is the same computation
// every time.
//
// phi(q) . phi(k) is formed before it multiplies v: where that product alone exceeds the largest
// finite scalar (float: |phi(q)| |phi(k)| past ~3.4e38) the output is not finite, even if
// the recurrence's value q . (k v^T) would fit.
//
// Cost per head and chunk: 2 L^2 (dk + dv) / 2 (the causal half, tile-granular) + 2 L dk dv
// (the read of S) + 2 L dk dv once per chunk for the write.
#include <algorithm>
#include <cmath>
#include <vector>

#include "ovq/core/threads.hpp"
#include "ovq/core/types.hpp"
#include "ovq/kernels/arch/tile_ops.hpp"

namespace ovq::kernels {

enum class FeatureMap { identity, elu1, relu };

template <class Scalar>
Scalar apply_feature_map(FeatureMap map, Scalar x) {
  switch (map) {
    case FeatureMap::elu1:
      return x > Scalar(0) ? x + Scalar(1) : std::exp(x);
    case FeatureMap::relu:
      return x > Scalar(0) ? x : Scalar(0);
    case FeatureMap::identity:
    default:
      return x;
  }
}

// out[c] = phi(x[c]) for c in [0, n), in the compute type.
template <class Element>
void feature_map_row(FeatureMap map, const Element* x, Index n, compute_t<Element>* out) {
  for (Index c = 0; c < n; ++c) out[c] = apply_feature_map(map, widen(x[c]));
}

// out = phi(x), rows of x copied through the feature map. out is resized to x's shape.
template <class Element>
void feature_map_rows(FeatureMap map, ConstRowsView<Element> x,
                      RowMatrix<compute_t<Element>>& out) {
  out.resize(x.rows, x.cols);
  for (Index i = 0; i < x.rows; ++i) feature_map_row(map, x.row(i), x.cols, out.row(i).data());
}

template <class Scalar>
struct LinearChunkParams {
  Scalar beta = Scalar(1);
  Scalar decay = Scalar(1);
  bool normalize = false;
  Scalar eps = Scalar(1e-6);
};

// powers[i] = decay^i for i in [0, n], in double then rounded once.
template <class Scalar>
std::vector<Scalar> decay_powers(Scalar decay, Index n) {
  std::vector<Scalar> p(static_cast<std::size_t>(n) + 1);
  for (Index i = 0; i <= n; ++i)
    p[static_cast<std::size_t>(i)] =
        static_cast<Scalar>(std::pow(static_cast<double>(decay), static_cast<double>(i)));
  return p;
}

namespace linear_detail {

// Value widths are padded to a multiple of this (the widest SIMD vector, 16 floats).
inline constexpr Index kValuePad = 16;

// Per-thread scratch of the read: one query block (at most a key tile of rows), and the padded
// copies of V and S when dv is not a multiple of kValuePad.
template <class Scalar>
struct ReadBuffers {
  AlignedVector<Scalar> q, weights, scores, acc, den, values, kv;

  void reserve(Index tile, Index dk, Index dvp) {
    q.resize(static_cast<std::size_t>(tile * dk));
    weights.resize(static_cast<std::size_t>(tile * tile));
    scores.resize(static_cast<std::size_t>(tile * tile));
    acc.resize(static_cast<std::size_t>(tile * dvp));
    den.resize(static_cast<std::size_t>(tile));
  }
};

// rows x cols of `src` (row stride src_stride) into `dst` at width `width` >= cols, widened to
// the compute type, zero-padded.
template <class Element>
const compute_t<Element>* padded_copy(const Element* src, Index rows, Index cols,
                                      Index src_stride, Index width,
                                      AlignedVector<compute_t<Element>>& dst) {
  dst.assign(static_cast<std::size_t>(rows * width), compute_t<Element>(0));
  for (Index i = 0; i < rows; ++i)
    for (Index c = 0; c < cols; ++c) dst[static_cast<std::size_t>(i * width + c)] = widen(src[i * src_stride + c]);
  return dst.data();
}

}  // namespace linear_detail

// phi(k_j) of a chunk's rows (in the compute type) as linear_chunk_read takes them: panels of the
// architecture's key tile (pack_key_panels). Cost: L dk copies.
template <class Scalar, class Arch>
void pack_linear_keys(ConstRowsView<Scalar> phi_k, AlignedVector<Scalar>& panels) {
  pack_key_panels<Scalar, TileOps<Scalar, Arch>::kKeyTile>(phi_k, panels);
}

// Reads query rows [first, first + n) of a chunk (chunk-local positions) for `heads` query heads
// q[h] (n x dk) into o[h] (n x dv); the state is not changed.
//   key_panels  phi(k_j) for the chunk's rows j in [0, first + n), packed by
//               pack_linear_keys<Scalar, Arch> from the chunk's first row
//   values      v_j for j in [0, first + n)
//   kv, k_sum   S (dk x dv) and z (dk) of the chunks before this one
//   powers      g^i for i in [0, first + n]
// Element: what q, values and o hold; everything else is in its compute type (Scalar).
template <class Element, class Arch>
void linear_chunk_read(const ConstRowsView<Element>* q, Index heads, Index first, FeatureMap map,
                       const compute_t<Element>* key_panels, ConstRowsView<Element> values,
                       const RowMatrix<compute_t<Element>>& kv,
                       const RowVector<compute_t<Element>>& k_sum,
                       const std::vector<compute_t<Element>>& powers,
                       const LinearChunkParams<compute_t<Element>>& p, const RowsView<Element>* o) {
  using Scalar = compute_t<Element>;
  using Ops = TileOps<Scalar, Arch>;
  constexpr Index kTile = Ops::kKeyTile;
  if (heads <= 0 || q[0].rows == 0) return;
  const Index n = q[0].rows;
  const Index end = first + n;
  const Index dk = kv.rows();
  const Index dv = kv.cols();
  using linear_detail::kValuePad;
  const Index dvp = (dv + kValuePad - 1) / kValuePad * kValuePad;
  thread_local linear_detail::ReadBuffers<Scalar> buf;
  buf.reserve(kTile, dk, dvp);
  // V (rows [0, end)) and S at width dvp, in the compute type.
  const Scalar* vals = nullptr;
  Index vals_stride = dvp;
  const Scalar* kvp = kv.data();
  if constexpr (std::is_same_v<Element, Scalar>) {
    vals = values.data;
    vals_stride = values.stride;
  }
  if (dvp != dv || !std::is_same_v<Element, Scalar>) {
    vals = linear_detail::padded_copy(values.data, end, dv, values.stride, dvp, buf.values);
    vals_stride = dvp;
  }
  if (dvp != dv) kvp = linear_detail::padded_copy(kv.data(), dk, dv, dv, dvp, buf.kv);
  Scalar* qb = buf.q.data();
  Scalar* w = buf.weights.data();
  Scalar* s = buf.scores.data();
  Scalar* acc = buf.acc.data();
  Scalar* den = buf.den.data();
  const Scalar* z = k_sum.data();

  // Query blocks are the rows of one key tile: rows [r0, r1) all end in key tile b.
  for (Index b = first / kTile; b * kTile < end; ++b) {
    const Index r0 = std::max(first, b * kTile);
    const Index r1 = std::min(end, (b + 1) * kTile);
    const Index bq = r1 - r0;
    for (Index h = 0; h < heads; ++h) {
      for (Index r = 0; r < bq; ++r) feature_map_row(map, q[h].row(r0 - first + r), dk, qb + r * dk);
      std::fill(acc, acc + bq * dvp, Scalar(0));
      std::fill(den, den + bq, Scalar(0));

      // The chunks before: (g^(i+1) phi(q_i)) S, S's rows as values, in key tiles of dk.
      for (Index c0 = 0; c0 < dk; c0 += kTile) {
        const Index bc = std::min(kTile, dk - c0);
        for (Index r = 0; r < bq; ++r) {
          const Scalar g = powers[static_cast<std::size_t>(r0 + r + 1)];
          Scalar* wr = w + r * kTile;
          const Scalar* qr = qb + r * dk + c0;
          for (Index c = 0; c < bc; ++c) wr[c] = g * qr[c];
          if (p.normalize) {
            Scalar d = den[r];
            for (Index c = 0; c < bc; ++c) d += wr[c] * z[c0 + c];
            den[r] = d;
          }
        }
        Ops::accumulate(w, bq, bc, kvp + c0 * dvp, dvp, dvp, acc, dvp);
      }

      // This chunk: key tiles 0 .. b, the last one masked to j <= i and decayed by g^(i-j).
      for (Index t = 0; t <= b; ++t) {
        const Index k0 = t * kTile;
        const Index bk = std::min(kTile, r1 - k0);
        Ops::scores_packed(qb, dk, bq, key_panels + t * dk * kTile, dk, Scalar(1), s);
        for (Index r = 0; r < bq; ++r) {
          const Index i = r0 + r;
          Scalar* row = s + r * kTile;
          const Index visible = std::min(bk, i - k0 + 1);  // keys j <= i
          for (Index j = 0; j < visible; ++j) row[j] *= powers[static_cast<std::size_t>(i - k0 - j)];
          std::fill(row + visible, row + bk, Scalar(0));
          if (p.normalize) {
            Scalar d = den[r];
            for (Index j = 0; j < visible; ++j) d += row[j];
            den[r] = d;
          }
        }
        Ops::accumulate(s, bq, bk, vals + k0 * vals_stride, vals_stride, dvp, acc, dvp);
      }

      // Outputs, written as x + 0 so that a zero is always +0 (see the header).
      for (Index r = 0; r < bq; ++r) {
        Element* out = o[h].row(r0 - first + r);
        const Scalar* a = acc + r * dvp;
        if (!p.normalize) {
          for (Index c = 0; c < dv; ++c) out[c] = narrow<Element>(p.beta * a[c] + Scalar(0));
          continue;
        }
        // A zero normaliser (relu features that are all 0, eps = 0) means nothing was attended
        // to: the output is 0 rather than 0 / 0.
        const Scalar d = den[r] + p.eps;
        if (d == Scalar(0)) {
          std::fill(out, out + dv, Element(0));
        } else {
          for (Index c = 0; c < dv; ++c) out[c] = narrow<Element>(a[c] / d + Scalar(0));
        }
      }
    }
  }
}

// Folds a chunk of lc = phi_k.rows() rows into (S, z): S = g^lc S + phi(K)^T diag(g^(lc-1-j)) V,
// z likewise. The mixer calls it on complete chunks only (always L x dk by L x dv).
template <class Scalar, class Element>
void linear_chunk_write(const RowMatrix<Scalar>& phi_k, ConstRowsView<Element> v,
                        RowMatrix<Scalar>& kv, RowVector<Scalar>& k_sum,
                        const std::vector<Scalar>& powers) {
  const detail::SerialEigenScope serial;
  const Index lc = phi_k.rows();
  // w_j = g^(lc-1-j): how much of token j is left at the end of the chunk.
  Eigen::Matrix<Scalar, Eigen::Dynamic, 1> w(lc);
  for (Index j = 0; j < lc; ++j) w[j] = powers[static_cast<std::size_t>(lc - 1 - j)];
  const Scalar carry = powers[static_cast<std::size_t>(lc)];
  const RowMatrix<Scalar> wv = w.asDiagonal() * as_eigen(v).template cast<Scalar>();
  kv *= carry;
  kv.noalias() += phi_k.transpose() * wv;
  k_sum *= carry;
  k_sum.noalias() += w.transpose() * phi_k;
}

}  // namespace ovq::kernels
