#pragma once
// Batch x heads around a single-head mixer, with grouped-query attention.
//
// Layout (row-major, like a contiguous PyTorch tensor of shape (B, H, T, d)):
//   Q: (B * Hq * T) x dk, K: (B * Hkv * T) x dk, V: (B * Hkv * T) x dv, O: (B * Hq * T) x dv;
//   head h of batch b holds rows [(b H + h) T, (b H + h + 1) T).
// Query head h reads key/value head h / (Hq / Hkv); each (batch, key/value head) owns a state.
// Every head's input is checked before any state changes, so a failed call changes nothing.
// set_head_betas gives each query head a logit scale of its own in place of the mixer's beta
// (self, VQ and OVQ attention: a learnt per-head scale).
// With OpenMP (the consumer compiles with -fopenmp), states run in parallel.
#include <exception>
#include <utility>
#include <vector>

#include "ovq/core/checks.hpp"
#include "ovq/core/types.hpp"

namespace ovq {

template <class Mixer>
class MultiHead {
 public:
  using Scalar = typename Mixer::scalar_type;
  using State = typename Mixer::State;
  using Compute = compute_t<Scalar>;

  // One state per (batch, key/value head), each from mixer.make_state(dk, dv).
  MultiHead(Mixer mixer, Index batch, Index query_heads, Index kv_heads, Index dk, Index dv)
      : mixer_(std::move(mixer)) {
    check_heads(batch, query_heads, kv_heads);
    init(batch, query_heads,
         std::vector<State>(static_cast<std::size_t>(kv_heads), mixer_.make_state(dk, dv)));
  }

  // kv_head_states[h] is the initial state of key/value head h, copied for every batch entry
  // (for example one VQ codebook per key/value head).
  MultiHead(Mixer mixer, Index batch, Index query_heads, std::vector<State> kv_head_states)
      : mixer_(std::move(mixer)) {
    check_heads(batch, query_heads, static_cast<Index>(kv_head_states.size()));
    const char* where = "MultiHead";
    for (const State& s : kv_head_states) {
      mixer_.check_state(where, s);
      detail::require(s.key_dim() == kv_head_states[0].key_dim() &&
                          s.value_dim() == kv_head_states[0].value_dim(),
                      where, "kv_head_states have different (dk, dv), expected one shape");
    }
    init(batch, query_heads, std::move(kv_head_states));
  }

  const Mixer& mixer() const { return mixer_; }
  Index batch() const { return batch_; }
  Index query_heads() const { return query_heads_; }
  Index kv_heads() const { return kv_heads_; }
  Index key_dim() const { return states_.front().key_dim(); }
  Index value_dim() const { return states_.front().value_dim(); }

  State& state(Index b, Index kv_head) { return states_[index(b, kv_head)]; }
  const State& state(Index b, Index kv_head) const { return states_[index(b, kv_head)]; }
  const std::vector<State>& states() const { return states_; }
  std::vector<State>& states() { return states_; }

  std::size_t bytes() const {
    std::size_t total = 0;
    for (const State& s : states_) total += s.bytes();
    return total;
  }

  void reset() {
    for (State& s : states_) s.reset();
  }

  // One beta per query head (Hq entries, each finite and > 0) in place of the mixer's; empty:
  // the mixer's beta for every head. When the mixer's write reads with beta (OVQ's delta rule),
  // the query heads of one key/value head must share theirs.
  void set_head_betas(const std::vector<double>& betas) {
    const char* where = "MultiHead::set_head_betas";
    std::vector<Compute> scales;
    if (!betas.empty()) {
      detail::require(Mixer::kHasHeadBetas, where,
                      "the mixer has one beta for every head (linear attention), expected no "
                      "head betas");
      detail::require(static_cast<Index>(betas.size()) == query_heads_, where, "betas has ",
                      betas.size(), " entries, expected ", query_heads_, " (one per query head)");
      detail::check_head_betas<Scalar>(where, betas, query_heads_ / kv_heads_,
                                       mixer_.write_uses_beta());
      for (const double b : betas) scales.push_back(static_cast<Compute>(b));
    }
    head_betas_ = std::move(scales);
  }
  // The per-head betas as set (empty: none).
  std::vector<double> head_betas() const {
    return std::vector<double>(head_betas_.begin(), head_betas_.end());
  }

  // Threads used over states when built with OpenMP (0: OpenMP's default).
  void set_threads(int threads) { threads_ = threads; }

  void forward(const ConstMatrixRef<Scalar>& q, const ConstMatrixRef<Scalar>& k,
               const ConstMatrixRef<Scalar>& v, MatrixRef<Scalar> o) {
    run("forward", true, rows_view(q), rows_view(k), rows_view(v), rows_view(o));
  }

  RowMatrix<Scalar> forward(const ConstMatrixRef<Scalar>& q, const ConstMatrixRef<Scalar>& k,
                            const ConstMatrixRef<Scalar>& v) {
    RowMatrix<Scalar> o(q.rows(), v.cols());
    forward(q, k, v, o);
    return o;
  }

  // The same, and each query's log-sum-exp: lse (B Hq T entries, in the rows' order; softmax
  // mixers only).
  void forward(const ConstMatrixRef<Scalar>& q, const ConstMatrixRef<Scalar>& k,
               const ConstMatrixRef<Scalar>& v, MatrixRef<Scalar> o,
               Eigen::Ref<RowVector<Compute>> lse) {
    detail::require(lse.size() == q.rows(), "forward", "lse has ", lse.size(),
                    " entries, expected ", q.rows(), " (the rows of Q)");
    run("forward", true, rows_view(q), rows_view(k), rows_view(v), rows_view(o), lse.data());
  }

  // Writes K ((B Hkv T) x dk) and V ((B Hkv T) x dv) into every state without reading.
  void absorb(const ConstMatrixRef<Scalar>& k, const ConstMatrixRef<Scalar>& v) {
    run("absorb", false, {nullptr, 0, key_dim(), key_dim()}, rows_view(k), rows_view(v),
        {nullptr, 0, value_dim(), value_dim()});
  }

  // One token per head: q (B Hq x dk), k (B Hkv x dk), v (B Hkv x dv), o (B Hq x dv).
  void step(const ConstMatrixRef<Scalar>& q, const ConstMatrixRef<Scalar>& k,
            const ConstMatrixRef<Scalar>& v, MatrixRef<Scalar> o) {
    detail::check_rows("step", "Q", q.rows(), batch_ * query_heads_, "batch * query heads");
    run("step", true, rows_view(q), rows_view(k), rows_view(v), rows_view(o));
  }

 private:
  static void check_heads(Index batch, Index query_heads, Index kv_heads) {
    const char* where = "MultiHead";
    detail::check_positive(where, "batch", batch);
    detail::check_positive(where, "query_heads", query_heads);
    detail::check_positive(where, "kv_heads", kv_heads);
    detail::require(query_heads % kv_heads == 0, where, "query_heads = ", query_heads,
                    ", expected a multiple of kv_heads = ", kv_heads);
  }

  void init(Index batch, Index query_heads, std::vector<State> kv_head_states) {
    batch_ = batch;
    query_heads_ = query_heads;
    kv_heads_ = static_cast<Index>(kv_head_states.size());
    states_.clear();
    states_.reserve(static_cast<std::size_t>(batch * kv_heads_));
    for (Index b = 0; b < batch; ++b)
      for (const State& s : kv_head_states) states_.push_back(s);
  }

  std::size_t index(Index b, Index kv_head) const {
    detail::require(b >= 0 && b < batch_ && kv_head >= 0 && kv_head < kv_heads_, "MultiHead::state",
                    "(b, kv_head) = (", b, ", ", kv_head, "), expected b < ", batch_,
                    " and kv_head < ", kv_heads_);
    return static_cast<std::size_t>(b * kv_heads_ + kv_head);
  }

  // The query/output views of the group of query heads reading state (b, g).
  struct Group {
    std::vector<ConstRowsView<Scalar>> q;
    std::vector<RowsView<Scalar>> o;
    std::vector<Compute*> lse;  // empty, or one per query head
    const Compute* betas = nullptr;  // the group's head betas, or null
    ConstRowsView<Scalar> k, v;
  };

  // reads = false (absorb): the states are written, nothing is read, q and o are unused.
  void run(const char* where, bool reads, ConstRowsView<Scalar> q, ConstRowsView<Scalar> k,
           ConstRowsView<Scalar> v, RowsView<Scalar> o, Compute* lse = nullptr) {
    const Index dk = key_dim();
    const Index dv = value_dim();
    const Index group_size = reads ? query_heads_ / kv_heads_ : 0;
    Index tokens = 0;
    if (reads) {
      detail::check_cols(where, "Q", q.cols, dk, "dk");
      detail::require(q.rows % (batch_ * query_heads_) == 0, where, "Q has ", q.rows,
                      " rows, expected a multiple of batch * query heads = ",
                      batch_ * query_heads_);
      tokens = q.rows / (batch_ * query_heads_);
    } else {
      detail::require(k.rows % (batch_ * kv_heads_) == 0, where, "K has ", k.rows,
                      " rows, expected a multiple of batch * kv heads = ", batch_ * kv_heads_);
      tokens = k.rows / (batch_ * kv_heads_);
    }
    detail::check_shape(where, "K", k.rows, k.cols, batch_ * kv_heads_ * tokens, dk);
    detail::check_shape(where, "V", v.rows, v.cols, batch_ * kv_heads_ * tokens, dv);
    detail::check_shape(where, "O", o.rows, o.cols, q.rows, dv);

    const Index n_states = static_cast<Index>(states_.size());
    std::vector<Group> groups(static_cast<std::size_t>(n_states));
    for (Index s = 0; s < n_states; ++s) {
      const Index b = s / kv_heads_;
      const Index g = s % kv_heads_;
      Group& grp = groups[static_cast<std::size_t>(s)];
      grp.k = k.middle_rows(s * tokens, tokens);
      grp.v = v.middle_rows(s * tokens, tokens);
      for (Index j = 0; j < group_size; ++j) {
        const Index head = b * query_heads_ + g * group_size + j;
        grp.q.push_back(q.middle_rows(head * tokens, tokens));
        grp.o.push_back(o.middle_rows(head * tokens, tokens));
        if (lse != nullptr) grp.lse.push_back(lse + head * tokens);
      }
      // (An absorb reads no query heads, but the delta rule's write reads with its group's beta.)
      if (!head_betas_.empty())
        grp.betas = head_betas_.data() + g * (query_heads_ / kv_heads_);
    }
    // Every state's input is checked before any state changes (the mixers' checks only read).
    auto check_state = [&](Index s) {
      const Group& grp = groups[static_cast<std::size_t>(s)];
      if (reads) {
        mixer_.check_forward(where, states_[static_cast<std::size_t>(s)], grp.q.data(),
                             group_size, grp.k, grp.v, grp.o.data(), lse != nullptr);
      } else {
        mixer_.check_write(where, states_[static_cast<std::size_t>(s)], grp.k, grp.v);
      }
    };
    // An exception must not leave an OpenMP region: the first one is kept and rethrown after.
    // Only memory exhaustion can get here (inputs were all checked before).
    std::exception_ptr failure;
    auto run_state = [&](Index s) {
      try {
        Group& grp = groups[static_cast<std::size_t>(s)];
        mixer_.forward_unchecked(states_[static_cast<std::size_t>(s)], grp.q.data(), group_size,
                                 grp.k, grp.v, grp.o.data(),
                                 grp.lse.empty() ? nullptr : grp.lse.data(), grp.betas);
      } catch (...) {
#if defined(OVQ_HAS_OPENMP)
#pragma omp critical(ovq_multi_head_failure)
#endif
        if (!failure) failure = std::current_exception();
      }
    };
    bool parallel = false;
#if defined(OVQ_HAS_OPENMP)
    // States run in parallel when there are enough of them to share; otherwise they run in
    // turn and each read parallelises over its own query tiles.
    const int threads = threads_ > 0 ? threads_ : omp_get_max_threads();
    parallel = n_states >= threads && threads > 1 && !omp_in_parallel();
    if (parallel) {
      // The checks are shared out too, in the same team: scanning a long prefill's inputs is
      // memory-bound work that, done on one thread, left the other idle for about a tenth of a
      // two-thread linear-attention prefill (T = 4096, 8 heads). A bad input is reported as the
      // serial loop would report it: the first failing state's error, in state order.
      std::vector<std::exception_ptr> check_failures(static_cast<std::size_t>(n_states));
#pragma omp parallel num_threads(threads)
      {
#pragma omp for schedule(dynamic, 1)
        for (Index s = 0; s < n_states; ++s) {
          try {
            check_state(s);
          } catch (...) {
            check_failures[static_cast<std::size_t>(s)] = std::current_exception();
          }
        }
        // After the loop's barrier every thread sees every verdict: all run the states, or none.
        bool all_valid = true;
        for (const std::exception_ptr& e : check_failures) all_valid = all_valid && e == nullptr;
        if (all_valid) {
#pragma omp for schedule(dynamic, 1)
          for (Index s = 0; s < n_states; ++s) run_state(s);
        }
      }
      for (const std::exception_ptr& e : check_failures)
        if (e) std::rethrow_exception(e);
    }
#endif
    if (!parallel) {
      for (Index s = 0; s < n_states; ++s) check_state(s);
      for (Index s = 0; s < n_states; ++s) run_state(s);
    }
    if (failure) std::rethrow_exception(failure);
  }

  Mixer mixer_;
  Index batch_ = 0;
  Index query_heads_ = 0;
  Index kv_heads_ = 0;
  int threads_ = 0;
  std::vector<State> states_;
  std::vector<Compute> head_betas_;  // Hq entries, or empty
};

}  // namespace ovq
