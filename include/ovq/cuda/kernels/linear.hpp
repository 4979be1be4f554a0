#pragma once
// Linear attention on a GPU (MATH.md section 2, the CPU's kernels/linear_chunk.hpp): chunks of
// L tokens at fixed stream positions, (S, z) carried across complete chunks in the state's
// scalar type.
//
//   LinearReadProgram   query rows [first, first + n) of the current chunk (chunk-local i):
//                         num_i = sum_k (g^(i+1) phi(q_i))_k S[k] + sum_{j <= i} (phi(q_i) .
//                                 phi(k_j)) g^(i-j) v_j
//                         den_i likewise with z and 1; o_i = beta num_i, or num_i / (den_i + eps)
//                       Block (x, h): rows [16 x, 16 x + 16) of query head h; thread t: row t / 16,
//                       columns t % 16 + 16 c. Each num entry is one chain: the S part over k in
//                       order, then the chunk's rows j in order; each den one chain likewise (one
//                       thread per row). Cost per row: 2 dk dv + 2 (i + 1)(dk + dv).
//   LinearWriteProgram  S = g^L S + sum_j phi(k_j) (g^(L-1-j) v_j)^T, z = g^L z + sum_j
//                       g^(L-1-j) phi(k_j), each entry one chain over j in order; only on a
//                       complete chunk. Block (x, s): entries [256 x, 256 x + 256) of state s's
//                       dk x (dv + 1) (S and z). Cost: 2 L dk (dv + 1) per state.
// The feature maps are the CPU's, with ovq's own exponential (core/exact_math.hpp) for elu + 1,
// so the emulation gives the GPU's bits.
// Stored: the element of q, o and the chunk's rows (16-bit bits: widened as they load, outputs
// rounded once; (S, z) and every sum in float, on FP32 FMA, as the CPU's 16-bit mixer).
#include <cstdint>

#include "ovq/config.hpp"
#include "ovq/core/exact_math.hpp"
#include "ovq/cuda/block.hpp"
#include "ovq/cuda/counters.hpp"
#include "ovq/cuda/kernels/half.hpp"
#include "ovq/cuda/kernels/read.hpp"
#include "ovq/kernels/linear_chunk.hpp"

namespace ovq::cuda::kernels {

using ovq::kernels::FeatureMap;

template <class Scalar>
OVQ_HOST_DEVICE Scalar feature(FeatureMap map, Scalar x) {
  switch (map) {
    case FeatureMap::elu1:
      return x > Scalar(0) ? x + Scalar(1) : ovq::detail::exp_nonpositive(x);
    case FeatureMap::relu:
      return x > Scalar(0) ? x : Scalar(0);
    case FeatureMap::identity:
    default:
      return x;
  }
}

template <class Scalar, class Stored = Scalar>
struct LinearParams {
  HeadRows<Stored> q;         // query head h = s * group + g, its rows of this call
  MutableHeadRows<Stored> o;
  Index group = 1;
  Index n_queries = 0;
  Index query_heads = 0;
  Index dk = 0, dv = 0;
  HeadRows<Stored> keys, values;  // the pending chunk (raw keys) of each state
  MutableHeadRows<Scalar> kv;     // S: state s, row k (dk rows of dv)
  MutableHeadRows<Scalar> k_sum;  // z: state s (row_stride unused)
  const Scalar* powers = nullptr;  // g^i, i in [0, L]
  Index chunk = 0;
  FeatureMap map = FeatureMap::identity;
  bool normalize = false;
  Scalar beta = Scalar(1), eps = Scalar(0);
  StateCounters* counters = nullptr;
};

template <class Scalar, int kD, class Stored = Scalar>
struct LinearReadProgram {
  using Params = LinearParams<Scalar, Stored>;
  static constexpr int kThreads = 256;
  static constexpr int kRows = 16;
  static constexpr int kGroups = 16;
  static constexpr int kCPT = kD / kGroups;
  static constexpr int kTile = 64;
  static constexpr int kStride = kD + 1;
  // Shared: phi(q) rows, the decayed phi(q) g^(i+1), a key tile's phi(k) and values, scores.
  static constexpr int kQ = 0, kW = kQ + kRows * kStride, kK = kW + kRows * kStride,
                       kV = kK + kTile * kStride, kS = kV + kTile * kD,
                       kDen = kS + kRows * kTile, kShared = kDen + kRows;
  static std::size_t shared_bytes(const Params&) { return kShared * sizeof(Scalar); }

  struct Thread {
    Scalar acc[kCPT];
  };

  template <class Block>
  OVQ_HOST_DEVICE static void run(Block& block, const Params& p, BlockIndex index) {
    // A state with a fault did not take this call's rows into its chunk: nothing to read (the
    // call's outputs are undefined), and the chunk-local rows below would start before 0.
    if (p.counters->fault != 0) return;
    Scalar* sh = static_cast<Scalar*>(block.shared());
    const Index h = index.y, s = h / p.group;
    const Index r0 = static_cast<Index>(index.x) * kRows;
    const Index first = static_cast<Index>(p.counters->pending) - p.n_queries;  // chunk-local
    const Index rows = p.n_queries - r0 < kRows ? p.n_queries - r0 : kRows;
    const Index last = first + r0 + rows - 1;  // the tile's last chunk-local row
    typename Block::template PerThread<Thread> th;

    block.each([&](int t) {
      for (int e = t; e < kRows * kD; e += kThreads) {
        const Index r = e / kD, c = e % kD;
        Scalar x = Scalar(0);
        if (r < rows && c < p.dk) x = feature(p.map, compute_of(p.q.row(h, r0 + r)[c]));
        sh[kQ + r * kStride + c] = x;
        const Index i = first + r0 + r;
        sh[kW + r * kStride + c] = r < rows ? ovq::detail::mul_rn(p.powers[i + 1], x) : Scalar(0);
      }
    });
    // The chunks before: S part of num, z part of den.
    block.each([&](int t) {
      const int r = t / kGroups, kg = t % kGroups;
      Thread& me = th[t];
      OVQ_DEVICE_UNROLL
      for (int c = 0; c < kCPT; ++c) me.acc[c] = Scalar(0);
      if (r >= rows) return;
      const Scalar* w = sh + kW + r * kStride;
      const Scalar* kv = p.kv.row(s, 0);
      for (Index k = 0; k < p.dk; ++k) {
        OVQ_DEVICE_UNROLL
        for (int c = 0; c < kCPT; ++c) {
          const Index col = kg + kGroups * c;
          if (col < p.dv) me.acc[c] = std::fma(w[k], kv[k * p.kv.row_stride + col], me.acc[c]);
        }
      }
      if (kg == 0) {
        Scalar d = Scalar(0);
        const Scalar* z = p.k_sum.row(s, 0);
        for (Index k = 0; k < p.dk; ++k) d = d + ovq::detail::mul_rn(w[k], z[k]);
        sh[kDen + r] = d;
      }
    });
    // This chunk: key tiles of 64 rows, up to the tile's last row.
    for (Index k0 = 0; k0 <= last; k0 += kTile) {
      block.each([&](int t) {
        for (int e = t; e < kTile * kD; e += kThreads) {
          const Index j = e / kD, c = e % kD;
          const bool in = k0 + j <= last;
          sh[kK + j * kStride + c] =
              in && c < p.dk ? feature(p.map, compute_of(p.keys.row(s, k0 + j)[c])) : Scalar(0);
          sh[kV + j * kD + c] = in && c < p.dv ? compute_of(p.values.row(s, k0 + j)[c]) : Scalar(0);
        }
      });
      // Scores phi(q_i) . phi(k_j) g^(i-j) for j <= i, else 0.
      block.each([&](int t) {
        const int r = t / kGroups, kg = t % kGroups;
        const Index i = first + r0 + r;
        const Scalar* q = sh + kQ + r * kStride;
        for (int j = kg; j < kTile; j += kGroups) {
          Scalar x = Scalar(0);
          if (r < rows && k0 + j <= i) {
            const Scalar* k = sh + kK + j * kStride;
            for (Index c = 0; c < p.dk; ++c) x = std::fma(q[c], k[c], x);
            x = ovq::detail::mul_rn(x, p.powers[i - k0 - j]);
          }
          sh[kS + r * kTile + j] = x;
        }
      });
      block.each([&](int t) {
        const int r = t / kGroups, kg = t % kGroups;
        if (r >= rows) return;
        const Scalar* w = sh + kS + r * kTile;
        Thread& me = th[t];
        for (int j = 0; j < kTile; ++j) {
          OVQ_DEVICE_UNROLL
          for (int c = 0; c < kCPT; ++c)
            me.acc[c] = std::fma(w[j], sh[kV + j * kD + kg + kGroups * c], me.acc[c]);
        }
        if (kg == 0) {
          const Index i = first + r0 + r;
          Scalar d = sh[kDen + r];
          for (Index j = 0; j < kTile && k0 + j <= i; ++j) d = d + w[j];
          sh[kDen + r] = d;
        }
      });
    }
    // Outputs, written as x + 0 so that a zero is always +0 (as on the CPU).
    block.each([&](int t) {
      const int r = t / kGroups, kg = t % kGroups;
      if (r >= rows) return;
      Thread& me = th[t];
      Stored* out = p.o.row(h, r0 + r);
      const Scalar d = sh[kDen + r] + p.eps;
      OVQ_DEVICE_UNROLL
      for (int c = 0; c < kCPT; ++c) {
        const Index col = kg + kGroups * c;
        if (col >= p.dv) continue;
        const Scalar x = !p.normalize   ? ovq::detail::mul_rn(p.beta, me.acc[c]) + Scalar(0)
                         : d == Scalar(0) ? Scalar(0)
                                          : me.acc[c] / d + Scalar(0);
        out[col] = element_of<Stored>(x);
      }
    });
  }
};

template <class Scalar, class Stored = Scalar>
struct LinearWriteProgram {
  using Params = LinearParams<Scalar, Stored>;
  static constexpr int kThreads = 256;
  static std::size_t shared_bytes(const Params&) { return 0; }

  template <class Block>
  OVQ_HOST_DEVICE static void run(Block& block, const Params& p, BlockIndex index) {
    const StateCounters& c = *p.counters;
    if (c.fault != 0 || c.pending != p.chunk) return;
    const Index s = index.y;
    const Index L = p.chunk;
    const Scalar carry = p.powers[L];
    block.each([&](int t) {
      const Index e = static_cast<Index>(index.x) * kThreads + t;
      if (e >= p.dk * (p.dv + 1)) return;
      const Index k = e / (p.dv + 1), col = e % (p.dv + 1);
      Scalar* target = col < p.dv ? p.kv.row(s, k) + col : p.k_sum.row(s, 0) + k;
      Scalar acc = ovq::detail::mul_rn(carry, *target);
      for (Index j = 0; j < L; ++j) {
        const Scalar w = p.powers[L - 1 - j];
        const Scalar phi = feature(p.map, compute_of(p.keys.row(s, j)[k]));
        const Scalar u =
            col < p.dv ? ovq::detail::mul_rn(w, compute_of(p.values.row(s, j)[col])) : w;
        acc = std::fma(phi, u, acc);
      }
      *target = acc;
    });
  }
};

}  // namespace ovq::cuda::kernels
