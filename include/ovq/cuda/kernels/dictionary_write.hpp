#pragma once
// The dictionary writes on a GPU, one thread block per state, once its chunk of L rows is
// complete: OVQ's grow, seed, group and update (MATH.md section 4, the CPU's
// kernels/ovq_write.hpp), and VQ's group and update of the mean values (section 3). The
// assignment to the centroids that existed before the chunk comes from AssignProgram.
//
//   grow    m = the growth schedule's entry for this chunk (computed on the host from t: see
//           GrowthSchedule), 0 when the schedule has none
//   seed    spread: m times the unpicked chunk row with the smallest similarity to its nearest
//           centroid so far (ties: smallest row; a NaN similarity is never smaller, as on the
//           CPU), opened as centroid n + step, its scores against every chunk row folded into
//           (nearest, assigned); random: the rows draw_seed_rows draws from (seed, chunk index),
//           the same rows as on the CPU; lowest similarity: the same picks as spread without
//           the fold (the m keys least similar to their nearest old row, NaNs last), each
//           assigned alone to its new row; into an empty dictionary key 0 opens row 0 first,
//           takes every key, and its similarity to each ranks the others
//   group   the chunk rows sorted by centroid, each centroid's members in increasing row order
//           (a stable rank: O(L^2 / threads)); each group's end marked at its start
//   update  each touched centroid's keys (OVQ) and values: running mean (or constant rate) of
//           its members, summed in double in member order (the delta rule: a value row that
//           existed before the chunk by its members' residuals against the prediction yhat,
//           read before this program); then the counts; then (options) unit-norm keys and
//           values
//   publish (16-bit chunks) every row the chunk changed, the touched centroids and the opened
//           rows, rounded from its float mean into the 16-bit read rows (the CPU's
//           Dictionary::publish); the rows it did not change hold their rounded means already
// Every step reads only what an earlier phase wrote, and nothing is accumulated with atomics:
// the same bits on every run and in the emulation. A score of a new centroid is the
// assignment's FMA chain (AssignProgram), so a row's centroid does not depend on whether it was
// opened in this chunk. Cost: 2 L m dk (seeding) + L^2 / 256 (group) + O((L + m) (dk + dv)).
// The chunk's keys are staged in shared memory, widened, when they fit (staged_keys_max): each
// seed's scores read every one of them; a seed's pick is a scan by 32 threads, then a merge.
//
// Input: the chunk's element. With 16-bit chunks the dictionary rows written here are the
// float running means (16-bit rows widened, as on the CPU), and the publish step rounds the
// changed ones into the 16-bit rows the reads stream (state/dictionary_rows.hpp), OVQ's keys and
// values or VQ's values.
#include <cfloat>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "ovq/config.hpp"
#include "ovq/core/exact_math.hpp"
#include "ovq/cuda/block.hpp"
#include "ovq/cuda/counters.hpp"
#include "ovq/cuda/kernels/async_copy.hpp"
#include "ovq/cuda/kernels/half.hpp"
#include "ovq/cuda/kernels/read.hpp"
#include "ovq/cuda/kernels/rows.hpp"
#include "ovq/kernels/seed.hpp"
#include "ovq/kernels/update.hpp"
#include "ovq/state/dictionary_rows.hpp"

namespace ovq::cuda::kernels {

template <class Scalar, class Input = Scalar>
struct DictionaryWriteParams {
  HeadRows<Input> keys, values;  // the chunk: L rows of each state
  Index chunk = 0;                // L
  Index dk = 0, dv = 0;
  // Capacity rows of each state (VQ: no keys, the codebook is fixed).
  MutableHeadRows<Scalar> dict_keys, dict_values;
  std::int64_t* counts = nullptr;                  // state s, row r: counts[s * capacity + r]
  Scalar* log_counts = nullptr;
  Index capacity = 0;
  StateCounters* counters = nullptr;
  bool ovq = true;  // false: VQ (keys fixed, values only, assignments given)
  // OVQ: entries (chunk index, m) in increasing chunk order; the counters' schedule is the next.
  const std::int64_t* schedule = nullptr;
  Index schedule_entries = 0;
  bool spread = true;  // seeding: spread, else random (or lowest similarity)
  bool lowest_similarity = false;
  std::uint64_t seed = 0;
  bool adaptive = true;  // rate: running mean, else constant eta
  double eta = 0.0;
  bool renormalize = false;
  bool renormalize_values = false;
  // The delta rule: per state L rows of dv, the read of the dictionary before the chunk with
  // each chunk key as the query.
  bool delta = false;
  const Input* yhat = nullptr;
  // Per state, L entries each: (nearest, assigned) from AssignProgram (VQ: the codes in
  // `assigned`), then scratch.
  Scalar* nearest = nullptr;
  Index* assigned = nullptr;
  unsigned char* picked = nullptr;
  Index* order = nullptr;
  Index* group_end = nullptr;  // per sorted position: its group's end at a group's start, else -1
  Index* draws = nullptr;
  std::int64_t* opened = nullptr;  // written by state 0: rows opened, schedule entries used
  // 16-bit chunks: the read rows (capacity rows of each state; VQ: values only) the publish
  // step rounds the changed means into; data null: none (float and double).
  MutableHeadRows<Input> read_keys, read_values;
  // The chunk's keys are staged in shared memory, widened, when they take at most this many
  // bytes (0: never; the tests compare the two paths).
  std::size_t staged_keys_max = 96 * 1024;
  // complete: the last of the `states` blocks to finish completes the chunk in the counters
  // (CounterOp::complete with `opened`), in place of a CounterProgram launch after this one.
  bool complete = false;
  Index states = 1;
};

// The delta rule's new value held within the element's finite range, as the CPU write holds it
// (kernels/update.hpp, delta_limit).
template <class Scalar, class Input>
OVQ_HOST_DEVICE double delta_limit_of(double x) {
  double limit = DBL_MAX;
  if constexpr (is_half_bits_v<Input>) {
    limit = static_cast<double>(largest_finite_of<Input>());
  } else if constexpr (std::is_same_v<Scalar, float>) {
    limit = static_cast<double>(FLT_MAX);
  }
  return x < -limit ? -limit : (x > limit ? limit : x);
}

template <class Scalar, class Input = Scalar>
struct DictionaryWriteProgram {
  using Params = DictionaryWriteParams<Scalar, Input>;
  static constexpr int kThreads = 256;
  // The seeding's pick: kPickers threads scan the chunk's rows (each its rows in increasing
  // order), then one merges their partials.
  static constexpr int kPickers = 32;
  // The chunk's keys, widened, are staged in shared memory when they take at most
  // p.staged_keys_max bytes: spread seeding scores every chunk key against each new centroid,
  // m times per chunk.
  OVQ_HOST_DEVICE static bool stages_keys(const Params& p) {
    return p.ovq && static_cast<std::size_t>(p.chunk) * static_cast<std::size_t>(p.dk + 1) *
                            sizeof(Scalar) <= p.staged_keys_max;
  }
  // Shared: the staged keys (row stride dk + 1, so that 32 threads' rows at one feature fall in
  // 32 banks), the pickers' partials (best value; first unpicked row, best row) and the pick.
  OVQ_HOST_DEVICE static std::size_t keys_bytes(const Params& p) {
    return stages_keys(p) ? static_cast<std::size_t>(p.chunk) * static_cast<std::size_t>(p.dk + 1) *
                                sizeof(Scalar)
                          : 0;
  }
  OVQ_HOST_DEVICE static std::size_t partials_offset(const Params& p) {
    const std::size_t end = keys_bytes(p) + kPickers * sizeof(Scalar);
    return (end + sizeof(Index) - 1) / sizeof(Index) * sizeof(Index);
  }
  static std::size_t shared_bytes(const Params& p) {
    return partials_offset(p) + (2 * kPickers + 1) * sizeof(Index);
  }

  template <class Block>
  OVQ_HOST_DEVICE static void run(Block& block, const Params& p, BlockIndex index) {
    const StateCounters& c = *p.counters;
    if (c.fault != 0 || c.pending != p.chunk) return;
    const Index s = index.y;
    const Index L = p.chunk;
    const Index n0 = static_cast<Index>(c.size);
    Index m = 0, advance = 0;
    if (p.ovq && c.schedule < p.schedule_entries &&
        p.schedule[2 * c.schedule] == c.absorbed / p.chunk) {
      m = static_cast<Index>(p.schedule[2 * c.schedule + 1]);
      advance = 1;
    }
    // State s's L entries of each array (VQ has no nearest or draws).
    auto row_of = [&](auto* base) { return base != nullptr ? base + s * L : base; };
    Scalar* nearest = row_of(p.nearest);
    Index* assigned = row_of(p.assigned);
    unsigned char* picked = row_of(p.picked);
    Index* order = row_of(p.order);
    Index* group_end = row_of(p.group_end);
    Index* draws = row_of(p.draws);
    Scalar* keys = p.dict_keys.data != nullptr ? p.dict_keys.row(s, 0) : nullptr;
    const DictionaryRows<Scalar> dict = dictionary_rows<Scalar>(
        {keys, p.capacity, p.dk, p.dict_keys.row_stride},
        {p.dict_values.data + s * p.dict_values.head_stride, p.capacity, p.dv,
         p.dict_values.row_stride},
        p.counts + s * p.capacity, p.log_counts + s * p.capacity);
    unsigned char* raw = static_cast<unsigned char*>(block.shared());
    const bool staged = stages_keys(p);
    const Index key_stride = p.dk + 1;
    Scalar* staged_keys = reinterpret_cast<Scalar*>(raw);
    Scalar* value_part = reinterpret_cast<Scalar*>(raw + keys_bytes(p));
    Index* first_part = reinterpret_cast<Index*>(raw + partials_offset(p));
    Index* best_part = first_part + kPickers;
    Index* pick = best_part + kPickers;
    // Chunk key i, feature col, widened.
    auto chunk_key = [&](Index i, Index col) {
      return staged ? staged_keys[i * key_stride + col] : compute_of(p.keys.row(s, i)[col]);
    };
    // The score of chunk key i against chunk key j: the assignment's FMA chain.
    auto score = [&](Index i, Index j) {
      Scalar dot = Scalar(0);
      if (staged) {
        const Scalar* a = staged_keys + i * key_stride;
        const Scalar* b = staged_keys + j * key_stride;
        for (Index col = 0; col < p.dk; ++col) dot = std::fma(a[col], b[col], dot);
      } else {
        const Input* a = p.keys.row(s, i);
        const Input* b = p.keys.row(s, j);
        for (Index col = 0; col < p.dk; ++col)
          dot = std::fma(compute_of(a[col]), compute_of(b[col]), dot);
      }
      return dot;
    };

    block.each([&](int t) {
      if (staged) {
        // 32-bit indices (staged chunks are small): a 64-bit division is a long sequence on a GPU.
        const int dk = static_cast<int>(p.dk), entries = static_cast<int>(L) * dk;
        for (int e = t; e < entries; e += kThreads) {
          const int i = e / dk, col = e - i * dk;
          if constexpr (std::is_same_v<Input, Scalar>) {
            copy_element_async(staged_keys + i * key_stride + col, p.keys.row(s, i) + col);
          } else {
            staged_keys[i * key_stride + col] = compute_of(p.keys.row(s, i)[col]);
          }
        }
        commit_async();
      }
      if (s == 0 && t == 0 && p.opened != nullptr) {
        p.opened[0] = m;
        p.opened[1] = advance;
      }
      for (Index i = t; i < L; i += kThreads) picked[i] = 0;
      if (!p.spread && !p.lowest_similarity && t == 0 && m > 0)
        ovq::kernels::draw_seed_rows(p.seed, c.absorbed / L, L, m, draws);
      wait_async<0>();
    });
    // Lowest similarity into an empty dictionary: key 0 opens row 0 and takes every key.
    Index first_row = n0, seeds = m;
    if (p.lowest_similarity && n0 == 0 && m > 0) {
      block.each([&](int t) {
        const Input* v = p.values.row(s, 0);
        for (Index col = t; col < p.dk; col += kThreads) dict.keys.row(0)[col] = chunk_key(0, col);
        for (Index col = t; col < p.dv; col += kThreads)
          dict.values.row(0)[col] = compute_of(v[col]);
        if (t == 0) {
          set_count(dict, 0, 0);
          picked[0] = 1;
        }
      });
      block.each([&](int t) {
        for (Index i = t; i < L; i += kThreads) {
          nearest[i] = score(i, 0);
          assigned[i] = 0;
        }
      });
      first_row = 1;
      seeds = m - 1;
    }
    for (Index step = 0; step < seeds; ++step) {
      const Index r = first_row + step;
      if (p.spread || p.lowest_similarity) {
        block.each([&](int t) {
          if (t >= kPickers) return;
          Index first = -1, best = -1;
          Scalar value = Scalar(0);
          for (Index i = t; i < L; i += kPickers) {
            if (picked[i]) continue;
            if (first < 0) first = i;
            const Scalar x = nearest[i];
            if (x != x) continue;
            if (best < 0 || x < value) {
              best = i;
              value = x;
            }
          }
          first_part[t] = first;
          best_part[t] = best;
          value_part[t] = value;
        });
        block.each([&](int t) {
          if (t != 0) return;
          Index first = -1, best = -1;
          Scalar value = Scalar(0);
          for (int u = 0; u < kPickers; ++u) {
            const Index f = first_part[u], b = best_part[u];
            if (f >= 0 && (first < 0 || f < first)) first = f;
            if (b >= 0 && (best < 0 || value_part[u] < value ||
                           (value_part[u] == value && b < best))) {
              best = b;
              value = value_part[u];
            }
          }
          const Scalar x = nearest[first];
          if (p.lowest_similarity) {
            pick[0] = best >= 0 ? best : first;  // NaNs last, in row order
          } else {
            pick[0] = x != x ? first : best;  // a NaN first row is never replaced (CPU scan)
          }
          picked[pick[0]] = 1;
        });
      } else {
        block.each([&](int t) {
          if (t == 0) pick[0] = draws[step];
        });
      }
      // Open centroid r on the picked row, then fold its scores into every row (lowest
      // similarity: assign the picked row alone to it).
      block.each([&](int t) {
        const Index row = pick[0];
        const Input* v = p.values.row(s, row);
        for (Index col = t; col < p.dk; col += kThreads)
          dict.keys.row(r)[col] = chunk_key(row, col);
        for (Index col = t; col < p.dv; col += kThreads)
          dict.values.row(r)[col] = compute_of(v[col]);
        if (t == 0) {
          set_count(dict, r, 0);
          if (p.lowest_similarity) assigned[row] = r;
        }
      });
      if (p.lowest_similarity) continue;
      block.each([&](int t) {
        const Index row = pick[0];
        for (Index i = t; i < L; i += kThreads) {
          const Scalar dot = score(i, row);
          if (dot > nearest[i] || assigned[i] < 0) {
            nearest[i] = dot;
            assigned[i] = r;
          }
        }
      });
    }
    // Group: row i goes to position rank(i) = #{j : a_j < a_i} + #{j < i : a_j = a_i}.
    block.each([&](int t) {
      for (Index i = t; i < L; i += kThreads) {
        const Index a = assigned[i];
        Index rank = 0;
        for (Index j = 0; j < L; ++j) {
          const Index b = assigned[j];
          rank += (b < a || (b == a && j < i)) ? 1 : 0;
        }
        order[rank] = i;
      }
    });
    // Each group's end (one past its last member) at its first position, -1 elsewhere: a group
    // starts where the centroid changes.
    block.each([&](int t) {
      for (Index q = t; q < L; q += kThreads) {
        const Index r = assigned[order[q]];
        if (q > 0 && assigned[order[q - 1]] == r) {
          group_end[q] = -1;
          continue;
        }
        Index q_end = q + 1;
        while (q_end < L && assigned[order[q_end]] == r) ++q_end;
        group_end[q] = q_end;
      }
    });
    // Update the rows of every touched centroid: the groups in turn (every thread walks the
    // same positions), their columns across the threads.
    const Index width = (p.ovq ? p.dk : 0) + p.dv;
    block.each([&](int t) {
      for (Index q = 0; q < L; ++q) {
        const Index q_end = group_end[q];
        if (q_end < 0) continue;
        const Index r = assigned[order[q]];
        for (Index col = t; col < width; col += kThreads) {
          const bool key = p.ovq && col < p.dk;
          const Index cc = key ? col : col - (p.ovq ? p.dk : 0);
          // Rows that existed before the chunk predict their members' values (the delta rule).
          const bool residual = !key && p.delta && r < n0;
          double sum = 0.0;
          for (Index u = q; u < q_end; ++u) {
            const double x = key ? static_cast<double>(chunk_key(order[u], cc))
                                 : static_cast<double>(compute_of(p.values.row(s, order[u])[cc]));
            if (residual) {
              const Input* predicted = p.yhat + (s * L + order[u]) * p.dv;
              sum = sum + (x - static_cast<double>(compute_of(predicted[cc])));
            } else {
              sum = sum + x;
            }
          }
          Scalar* target = key ? dict.keys.row(r) + cc : dict.values.row(r) + cc;
          const double cnt = static_cast<double>(q_end - q);
          const double old = static_cast<double>(*target);
          if (residual) {
            const double factor = p.adaptive
                                      ? 1.0 / static_cast<double>(dict.counts[r] + (q_end - q))
                                      : p.eta / cnt;
            *target = static_cast<Scalar>(
                delta_limit_of<Scalar, Input>(old + ovq::detail::mul_rn(sum, factor)));
          } else if (p.adaptive) {
            const double inv_total = 1.0 / static_cast<double>(dict.counts[r] + (q_end - q));
            *target = static_cast<Scalar>(
                old + ovq::detail::mul_rn(sum - ovq::detail::mul_rn(cnt, old), inv_total));
          } else {
            const double inv_cnt = 1.0 / cnt;
            *target = static_cast<Scalar>(
                ovq::detail::mul_rn(1.0 - p.eta, old) +
                ovq::detail::mul_rn(p.eta, ovq::detail::mul_rn(sum, inv_cnt)));
          }
        }
      }
    });
    // Counts (the updates above read them from before), then unit-norm keys.
    block.each([&](int t) {
      for (Index q = t; q < L; q += kThreads) {
        const Index q_end = group_end[q];
        if (q_end < 0) continue;
        const Index r = assigned[order[q]];
        set_count(dict, r, dict.counts[r] + (q_end - q));
        if (p.ovq && p.renormalize) ovq::kernels::renormalize_row(dict.keys.row(r), p.dk);
        if (p.ovq && p.renormalize_values)
          ovq::kernels::renormalize_row(dict.values.row(r), p.dv);
      }
    });
    if constexpr (is_half_bits_v<Input>) {
      if (p.read_values.data != nullptr)
        publish(block, p, s, dict, assigned, order, group_end, n0, m);
    }
    if (p.complete && block.last_to_arrive(&p.counters->arrivals, p.states)) {
      block.each([&](int t) {
        if (t != 0) return;
        CounterParams u;
        u.counters = p.counters;
        u.op = CounterOp::complete;
        u.limit = L;
        u.opened = p.opened;
        apply_counter_op(u);
      });
    }
  }

  // Slots [0, L): the first member of each touched centroid that existed before the chunk;
  // slots [L, L + m): the opened rows n0 ... n0 + m - 1 (touched or not: a seed can lose its
  // key to an older row). Each slot's key row (OVQ) and value row, rounded.
  template <class Block>
  OVQ_HOST_DEVICE static void publish(Block& block, const Params& p, Index s,
                                      const DictionaryRows<Scalar>& dict, const Index* assigned,
                                      const Index* order, const Index* group_end, Index n0,
                                      Index m) {
    const Index L = p.chunk;
    const Index dk = p.ovq ? p.dk : 0;
    const Index width = dk + p.dv;
    block.each([&](int t) {
      for (Index slot = 0; slot < L + m; ++slot) {
        Index r = n0 + (slot - L);
        if (slot < L) {
          if (group_end[slot] < 0) continue;
          r = assigned[order[slot]];
          if (r >= n0) continue;
        }
        for (Index col = t; col < width; col += kThreads) {
          if (col < dk) {
            p.read_keys.row(s, r)[col] = narrow<Input>(dict.keys.row(r)[col]);
          } else {
            p.read_values.row(s, r)[col - dk] = narrow<Input>(dict.values.row(r)[col - dk]);
          }
        }
      }
    });
  }
};

}  // namespace ovq::cuda::kernels
