#pragma once
// The one dispatch point between the CPU mixers and the kernels. A mixer names its
// architecture tag (arch::scalar, arch::avx2, arch::avx512, arch::native) once, as
// Executor<Scalar, Arch>, and calls only what this offers; the per-architecture micro-kernels
// (TileOps) stay behind it. The CUDA mixers (ovq/cuda.cuh) are the other executor of the same
// contracts: the read (kernels/read_contract.hpp) and the write phases (kernels/seed.hpp,
// kernels/update.hpp).
#include <cstdint>
#include <vector>

#include "ovq/core/types.hpp"
#include "ovq/kernels/assign.hpp"
#include "ovq/kernels/linear_chunk.hpp"
#include "ovq/kernels/ovq_write.hpp"
#include "ovq/kernels/read.hpp"
#include "ovq/kernels/vq_write.hpp"

namespace ovq::kernels {

// Element: what the mixer's inputs, outputs and states hold (float, double, bf16, fp16); its
// compute type (Compute) is what it computes in.
template <class Element, class Arch>
struct Executor {
  using arch_type = Arch;
  using Compute = compute_t<Element>;

  // The fused read (kernels/read_tiles.hpp) of `heads` stacked query heads, with each query's
  // log-sum-exp where lse is not null. head_betas (one per head, or null: beta for all): each
  // run of consecutive heads with the same beta is read as one stack of its own.
  static void read(const ConstRowsView<Element>* q, Index heads,
                   const MemoryRows<Element>& memory, const LocalRows<Element>& local,
                   const ReadMask& mask, Compute beta, const RowsView<Element>* o,
                   Compute* const* lse = nullptr, const Compute* head_betas = nullptr) {
    if (head_betas == nullptr) {
      kernels::read<Element, Arch>(q, heads, memory, local, mask, beta, o, lse);
      return;
    }
    for (Index first = 0, last = 0; first < heads; first = last) {
      while (last < heads && head_betas[last] == head_betas[first]) ++last;
      kernels::read<Element, Arch>(q + first, last - first, memory, local, mask,
                                   head_betas[first], o + first,
                                   lse == nullptr ? nullptr : lse + first);
    }
  }

  // Nearest centroid of each row of x (kernels/assign.hpp).
  static void assign_nearest(ConstRowsView<Element> x, ConstRowsView<Element> centroids,
                             const Compute* offset, Compute* best, Index* arg) {
    kernels::assign_nearest<Element, Arch>(x, centroids, offset, best, arg);
  }

  // One complete chunk into an OVQ dictionary (kernels/ovq_write.hpp).
  static void ovq_write(Dictionary<Element>& dict, std::int64_t absorbed,
                        ConstRowsView<Element> k, ConstRowsView<Element> v,
                        const OvqWriteParams& params) {
    kernels::ovq_write_chunk<Element, Arch>(dict, absorbed, k, v, params);
  }

  // One complete chunk into a VQ state's counts and means (kernels/vq_write.hpp).
  static void vq_write(Dictionary<Element>& dict, const Index* codes,
                       ConstRowsView<Element> values, AssignmentGroups& groups) {
    kernels::vq_write_chunk<Element>(dict, codes, values, groups);
  }

  // Linear attention's chunk keys, read and write (kernels/linear_chunk.hpp), in the compute
  // type.
  static void pack_linear_keys(ConstRowsView<Compute> phi_k, AlignedVector<Compute>& panels) {
    kernels::pack_linear_keys<Compute, Arch>(phi_k, panels);
  }
  static void linear_read(const ConstRowsView<Element>* q, Index heads, Index first,
                          FeatureMap map, const Compute* key_panels,
                          ConstRowsView<Element> values, const RowMatrix<Compute>& kv,
                          const RowVector<Compute>& k_sum, const std::vector<Compute>& powers,
                          const LinearChunkParams<Compute>& p, const RowsView<Element>* o) {
    kernels::linear_chunk_read<Element, Arch>(q, heads, first, map, key_panels, values, kv,
                                              k_sum, powers, p, o);
  }
  static void linear_write(const RowMatrix<Compute>& phi_k, ConstRowsView<Element> v,
                           RowMatrix<Compute>& kv, RowVector<Compute>& k_sum,
                           const std::vector<Compute>& powers) {
    kernels::linear_chunk_write(phi_k, v, kv, k_sum, powers);
  }
};

}  // namespace ovq::kernels
