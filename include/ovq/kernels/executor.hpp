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

template <class Scalar, class Arch>
struct Executor {
  using arch_type = Arch;

  // The fused read (kernels/read_tiles.hpp) of `heads` stacked query heads.
  static void read(const ConstRowsView<Scalar>* q, Index heads, const MemoryRows<Scalar>& memory,
                   const LocalRows<Scalar>& local, const ReadMask& mask, Scalar beta,
                   const RowsView<Scalar>* o) {
    kernels::read<Scalar, Arch>(q, heads, memory, local, mask, beta, o);
  }

  // Nearest centroid of each row of x (kernels/assign.hpp).
  static void assign_nearest(ConstRowsView<Scalar> x, ConstRowsView<Scalar> centroids,
                             const Scalar* offset, Scalar* best, Index* arg) {
    kernels::assign_nearest<Scalar, Arch>(x, centroids, offset, best, arg);
  }

  // One complete chunk into an OVQ dictionary (kernels/ovq_write.hpp).
  static void ovq_write(Dictionary<Scalar>& dict, std::int64_t absorbed, ConstRowsView<Scalar> k,
                        ConstRowsView<Scalar> v, const OvqWriteParams& params) {
    kernels::ovq_write_chunk<Scalar, Arch>(dict, absorbed, k, v, params);
  }

  // One complete chunk into a VQ state's counts and means (kernels/vq_write.hpp).
  static void vq_write(Dictionary<Scalar>& dict, const Index* codes, ConstRowsView<Scalar> values,
                       AssignmentGroups& groups) {
    kernels::vq_write_chunk<Scalar>(dict, codes, values, groups);
  }

  // Linear attention's chunk keys, read and write (kernels/linear_chunk.hpp).
  static void pack_linear_keys(ConstRowsView<Scalar> phi_k, AlignedVector<Scalar>& panels) {
    kernels::pack_linear_keys<Scalar, Arch>(phi_k, panels);
  }
  static void linear_read(const ConstRowsView<Scalar>* q, Index heads, Index first,
                          FeatureMap map, const Scalar* key_panels, ConstRowsView<Scalar> values,
                          const RowMatrix<Scalar>& kv, const RowVector<Scalar>& k_sum,
                          const std::vector<Scalar>& powers, const LinearChunkParams<Scalar>& p,
                          const RowsView<Scalar>* o) {
    kernels::linear_chunk_read<Scalar, Arch>(q, heads, first, map, key_panels, values, kv, k_sum,
                                             powers, p, o);
  }
  static void linear_write(const RowMatrix<Scalar>& phi_k, ConstRowsView<Scalar> v,
                           RowMatrix<Scalar>& kv, RowVector<Scalar>& k_sum,
                           const std::vector<Scalar>& powers) {
    kernels::linear_chunk_write(phi_k, v, kv, k_sum, powers);
  }
};

}  // namespace ovq::kernels
