#pragma once
// The fused read: one online-softmax pass over memory rows (with a per-row bias) and then over
// the local rows of the current chunk, tile by tile, never forming a queries x keys matrix.
//
//   read_contract.hpp  what is read and which keys each query sees, shared with CUDA
//   tile_stream.hpp    the prefetch stream of grouped-query decode steps
//   read_tiles.hpp     the CPU tile loop: kernels::read<Scalar, Arch>
#include "ovq/kernels/read_contract.hpp"
#include "ovq/kernels/read_tiles.hpp"
#include "ovq/kernels/tile_stream.hpp"
