// The study's task generators (examples/tasks/) and a small version of each task per mixer,
// with thresholds far from the measured values, so that a broken generator or mixer fails here.
#include <algorithm>
#include <cmath>
#include <set>
#include <vector>

#include "../examples/tasks/runner.hpp"
#include "support/catch.hpp"

// Everything below lives in this file's own namespace, so the suite can be built as one
// unity source without the files' helpers colliding.
namespace ovq_test_tasks {

namespace {

using study::Index;
using study::Mat;

recall::TaskConfig small_recall(Index T, Index M, Index Q, std::uint64_t seed) {
  recall::TaskConfig c;
  c.key_dim = 32;
  c.value_dim = 32;
  c.context = T;
  c.facts = M;
  c.queries = Q;
  c.world_seed = seed;
  c.seed = seed + 100;
  return c;
}

icl::TaskConfig small_icl(Index T, Index F, Index Q, std::uint64_t seed) {
  icl::TaskConfig c;
  c.key_dim = 32;
  c.value_dim = 32;
  c.context = T;
  c.functions = F;
  c.queries = Q;
  c.seed = seed;
  return c;
}

template <class Task>
double recall_of(const study::MixerSpec& spec, const Task& t, const Mat* codebook = nullptr) {
  return recall::accuracy(t, study::run(spec, t.keys, t.values, t.queries, codebook).outputs);
}

template <class Task>
icl::Score icl_of(const study::MixerSpec& spec, const Task& t, const Mat* codebook = nullptr) {
  return icl::score(t, study::run(spec, t.keys, t.values, t.queries, codebook).outputs);
}

}  // namespace

TEST_CASE("tasks::Draw is reproducible and well distributed", "[tasks]") {
  tasks::Draw a(5), b(5), c(6);
  double sum = 0, sum2 = 0;
  bool differs = false;
  for (int i = 0; i < 20000; ++i) {
    const double x = a.normal();
    CHECK(x == b.normal());
    differs = differs || x != c.normal();
    sum += x;
    sum2 += x * x;
  }
  CHECK(differs);
  CHECK(std::abs(sum / 20000) < 0.05);
  CHECK(std::abs(sum2 / 20000 - 1.0) < 0.05);
  std::vector<int> hist(7, 0);
  for (int i = 0; i < 7000; ++i) ++hist[static_cast<std::size_t>(a.below(7))];
  for (int h : hist) CHECK(std::abs(h - 1000) < 150);
  CHECK(tasks::derive_seed(1, 2) != tasks::derive_seed(1, 3));
  CHECK(tasks::derive_seed(1, 2) != tasks::derive_seed(2, 2));
}

TEST_CASE("recall generator: seeded, reproducible, as specified", "[tasks]") {
  const recall::TaskConfig cfg = small_recall(2048, 32, 64, 3);
  const auto t = recall::make_task<float>(cfg);
  const auto u = recall::make_task<float>(cfg);
  CHECK(t.keys == u.keys);
  CHECK(t.values == u.values);
  CHECK(t.queries == u.queries);
  CHECK(t.fact_position == u.fact_position);
  CHECK(t.query_fact == u.query_fact);

  REQUIRE(t.keys.rows() == 2048);
  REQUIRE(t.keys.cols() == 32);
  REQUIRE(t.values.rows() == 2048);
  REQUIRE(t.queries.rows() == 64);
  REQUIRE(t.fact_keys.rows() == 32);
  REQUIRE(t.directions.rows() == cfg.directions);
  for (Index i = 0; i < t.keys.rows(); ++i) CHECK(std::abs(t.keys.row(i).norm() - 1.0f) < 1e-5f);
  for (Index i = 0; i < t.queries.rows(); ++i)
    CHECK(std::abs(t.queries.row(i).norm() - 1.0f) < 1e-5f);

  // Facts sit at distinct positions with their keys and values.
  std::set<Index> pos(t.fact_position.begin(), t.fact_position.end());
  CHECK(pos.size() == 32);
  for (Index f = 0; f < 32; ++f) {
    const Index p = t.fact_position[static_cast<std::size_t>(f)];
    CHECK(t.keys.row(p) == t.fact_keys.row(f));
    CHECK(t.values.row(p) == t.fact_values.row(f));
    for (Index c = 0; c < cfg.directions; ++c)
      CHECK(std::abs(t.fact_keys.row(f).dot(t.directions.row(c))) <= 0.5f + 1e-5f);
    for (Index g = 0; g < f; ++g) CHECK(t.fact_keys.row(f).dot(t.fact_keys.row(g)) <= 0.5f + 1e-5f);
  }
  // Filler keys crowd the directions; queries are close to their facts.
  Index near = 0, filler = 0;
  for (Index i = 0; i < t.keys.rows(); ++i) {
    if (pos.count(i)) continue;
    ++filler;
    float best = -2;
    for (Index c = 0; c < cfg.directions; ++c) best = std::max(best, t.keys.row(i).dot(t.directions.row(c)));
    near += best > 0.85f;
  }
  CHECK(near == filler);
  for (Index i = 0; i < t.queries.rows(); ++i) {
    const Index f = t.query_fact[static_cast<std::size_t>(i)];
    CHECK(t.queries.row(i).dot(t.fact_keys.row(f)) > 0.85f);
  }

  // Another stream seed, same world: same directions, other stream.
  recall::TaskConfig other = cfg;
  other.seed += 1;
  const auto w = recall::make_task<float>(other);
  CHECK(w.directions == t.directions);
  CHECK(w.keys != t.keys);
  other.world_seed += 1;
  CHECK(recall::make_task<float>(other).directions != t.directions);

  // Scoring: the exact fact values score 100%, a zero output 0%.
  Mat exact(64, 32), zero = Mat::Zero(64, 32);
  for (Index i = 0; i < 64; ++i) exact.row(i) = t.fact_values.row(t.query_fact[static_cast<std::size_t>(i)]);
  CHECK(recall::accuracy(t, exact) == 1.0);
  CHECK(recall::accuracy(t, zero) == 0.0);

  recall::TaskConfig bad = cfg;
  bad.facts = 4096;
  CHECK_THROWS_AS(recall::make_task<float>(bad), std::invalid_argument);
}

TEST_CASE("icl generator: seeded, reproducible, as specified", "[tasks]") {
  const icl::TaskConfig cfg = small_icl(1024, 8, 64, 4);
  const auto t = icl::make_task<float>(cfg);
  const auto u = icl::make_task<float>(cfg);
  CHECK(t.keys == u.keys);
  CHECK(t.values == u.values);
  CHECK(t.queries == u.queries);
  CHECK(t.targets == u.targets);
  CHECK(icl::make_task<float>(small_icl(1024, 8, 64, 5)).keys != t.keys);

  REQUIRE(t.maps.size() == 8);
  REQUIRE(t.keys.rows() == 1024);
  REQUIRE(t.targets.rows() == 64);
  std::vector<Index> examples(8, 0);
  for (Index i = 0; i < t.keys.rows(); ++i) {
    const Index f = t.example_function[static_cast<std::size_t>(i)];
    ++examples[static_cast<std::size_t>(f)];
    CHECK(std::abs(t.keys.row(i).norm() - 1.0f) < 1e-5f);
    CHECK(t.keys.row(i).dot(t.centers.row(f)) > 0.6f);
    const Eigen::VectorXd y = t.maps[static_cast<std::size_t>(f)] *
                              t.keys.row(i).transpose().cast<double>();
    CHECK((t.values.row(i).transpose().cast<double>() - y).norm() < 1e-5);
  }
  for (Index n : examples) CHECK(n > 64);  // about 128 each
  for (Index i = 0; i < t.queries.rows(); ++i) {
    const Index f = t.query_function[static_cast<std::size_t>(i)];
    CHECK(f == i % 8);
    const Eigen::VectorXd y = t.maps[static_cast<std::size_t>(f)] *
                              t.queries.row(i).transpose().cast<double>();
    CHECK((t.targets.row(i).transpose() - y).norm() < 1e-9);
  }
  for (Index f = 0; f < 8; ++f)
    for (Index g = 0; g < f; ++g) CHECK(t.centers.row(f).dot(t.centers.row(g)) <= 0.5f + 1e-5f);

  // Scoring: exact targets give NMSE 0 and every function learnt; a zero output NMSE 1, none;
  // any output scale is forgiven by the gain.
  const Mat exact = t.targets.cast<float>();
  const icl::Score s0 = icl::score(t, exact);
  CHECK(s0.nmse < 1e-10);
  CHECK(s0.learnt == 1.0);
  CHECK(std::abs(s0.gain - 1.0) < 1e-6);
  const icl::Score s1 = icl::score(t, Mat::Zero(64, 32).eval());
  CHECK(s1.nmse == 1.0);
  CHECK(s1.learnt == 0.0);
  const Mat scaled = 7.0f * exact;
  CHECK(icl::score(t, scaled).nmse < 1e-10);
  // The region-mean reference knows the function, not the position inside the region.
  const icl::Score oracle = icl::score(t, icl::region_mean_oracle(t));
  CHECK(oracle.nmse > 0.1);
  CHECK(oracle.nmse < 0.35);
  CHECK(oracle.learnt == 1.0);
}

TEST_CASE("icl generator, blocked: the same examples grouped by function", "[tasks]") {
  icl::TaskConfig cfg = small_icl(1024, 8, 64, 4);
  const auto t = icl::make_task<float>(cfg);
  cfg.blocked = true;
  const auto b = icl::make_task<float>(cfg);
  CHECK(b.keys.rows() == t.keys.rows());
  CHECK(b.queries == t.queries);
  CHECK(b.targets == t.targets);
  CHECK(b.centers == t.centers);
  // One block per function: the function changes exactly F - 1 times along the stream.
  Index changes = 0;
  std::set<Index> seen = {b.example_function[0]};
  for (Index i = 1; i < b.keys.rows(); ++i) {
    const Index f = b.example_function[static_cast<std::size_t>(i)];
    if (f != b.example_function[static_cast<std::size_t>(i - 1)]) {
      ++changes;
      CHECK(seen.insert(f).second);  // never comes back
    }
  }
  CHECK(changes == 7);
  CHECK(b.example_function != t.example_function);
  // The same examples: within each function, the same rows in the same order.
  for (Index f = 0; f < 8; ++f) {
    std::vector<Index> rt, rb;
    for (Index i = 0; i < t.keys.rows(); ++i) {
      if (t.example_function[static_cast<std::size_t>(i)] == f) rt.push_back(i);
      if (b.example_function[static_cast<std::size_t>(i)] == f) rb.push_back(i);
    }
    REQUIRE(rt.size() == rb.size());
    for (std::size_t j = 0; j < rt.size(); ++j) {
      CHECK(t.keys.row(rt[j]) == b.keys.row(rb[j]));
      CHECK(t.values.row(rt[j]) == b.values.row(rb[j]));
    }
  }
  // Reproducible.
  CHECK(icl::make_task<float>(cfg).keys == b.keys);
}

TEST_CASE("the query read sees exactly the post-context state", "[tasks]") {
  // Self-attention's output for each query against the context alone, in double.
  const auto t = recall::make_task<float>(small_recall(1024, 16, 48, 6));
  const study::Outcome out = study::run(study::self_attention(), t.keys, t.values, t.queries);
  const Eigen::MatrixXd K = t.keys.cast<double>(), V = t.values.cast<double>();
  for (Index i = 0; i < t.queries.rows(); ++i) {
    Eigen::VectorXd logits = study::kBeta * (K * t.queries.row(i).transpose().cast<double>());
    logits.array() -= logits.maxCoeff();
    const Eigen::VectorXd w = logits.array().exp();
    const Eigen::RowVectorXd o = (w.transpose() * V) / w.sum();
    CHECK((out.outputs.row(i).cast<double>() - o).norm() <= 1e-5 * o.norm());
  }
  CHECK(out.bytes == static_cast<std::size_t>(1024 * 64 * sizeof(float)));

  // Linear attention (normalised relu): the same against its recurrence over the context alone.
  const study::MixerSpec lin = study::linear_attention(ovq::FeatureMap::relu, false);
  const study::Outcome lo = study::run(lin, t.keys, t.values, t.queries);
  const Eigen::MatrixXd PK = K.cwiseMax(0.0);
  const Eigen::MatrixXd S = PK.transpose() * V;
  const Eigen::VectorXd z = PK.colwise().sum().transpose();
  for (Index i = 0; i < t.queries.rows(); ++i) {
    const Eigen::VectorXd pq = t.queries.row(i).transpose().cast<double>().cwiseMax(0.0);
    const Eigen::RowVectorXd o = (S.transpose() * pq).transpose() / (z.dot(pq) + 1e-6);
    CHECK((lo.outputs.row(i).cast<double>() - o).norm() <= 1e-4 * o.norm());
  }

  // OVQ: reading all queries at once equals reading each alone through a copy of the state.
  const study::MixerSpec ovq_spec = study::ovq_attention(128);
  const study::Outcome oo = study::run(ovq_spec, t.keys, t.values, t.queries);
  const ovq::OvqAttention<float> m(ovq_spec.ovq);
  auto state = m.make_state(32, 32);
  m.absorb(state, t.keys, t.values);
  for (Index i = 0; i < t.queries.rows(); ++i) {
    auto copy = state;
    const Mat q = t.queries.row(i);
    const Mat k = Mat::Constant(1, 32, 0.0f), v = Mat::Zero(1, 32);
    const Mat o = m.forward(copy, q, k, v);
    CHECK((oo.outputs.row(i) - o.row(0)).norm() <= 1e-5f * o.norm());
  }
}

TEST_CASE("recall, small: self-attention is exact, linear attention is rank-limited", "[tasks]") {
  const auto easy = recall::make_task<float>(small_recall(512, 16, 128, 7));
  CHECK(recall_of(study::self_attention(), easy) == 1.0);

  // Facts only (T = M): identity linear attention stores M outer products in a 32 x 32 matrix.
  const auto few = recall::make_task<float>(small_recall(8, 8, 128, 8));
  const auto many = recall::make_task<float>(small_recall(512, 512, 128, 8));
  const study::MixerSpec lin = study::linear_attention(ovq::FeatureMap::identity, false);
  CHECK(recall_of(lin, few) >= 0.9);
  CHECK(recall_of(lin, many) <= 0.5);
  CHECK(recall_of(study::self_attention(), many) >= 0.9);

  // A sliding window forgets what left it: facts are spread over 4096 tokens, W = 128.
  const auto longer = recall::make_task<float>(small_recall(4096, 32, 128, 9));
  CHECK(recall_of(study::sliding_window(128), longer) <= 0.3);
  CHECK(recall_of(study::self_attention(), longer) >= 0.95);
}

TEST_CASE("recall, small: OVQ and VQ", "[tasks]") {
  const auto t = recall::make_task<float>(small_recall(2048, 16, 128, 10));
  // OVQ with room for every token and linear growth is self-attention (MATH.md sanity identity).
  study::MixerSpec full = study::ovq_attention(2048);
  full.ovq.growth = ovq::Growth::linear(1.0);
  CHECK(recall_of(full, t) == recall_of(study::self_attention(), t));
  // A dictionary of 1/8 of the stream still holds most of the 16 facts (0.85-1.0 over seeds
  // 7-12: late facts find fewer free centroids as growth plateaus).
  CHECK(recall_of(study::ovq_attention(256), t) >= 0.6);
  // VQ with one code per filler direction cannot tell the facts apart.
  const Mat few_codes = t.directions;
  CHECK(recall_of(study::vq_attention(4), t, &few_codes) <= 0.4);
  // VQ with a codebook holding every fact key exactly (and the directions) recalls them.
  Mat all(t.directions.rows() + t.fact_keys.rows(), 32);
  all << t.directions, t.fact_keys;
  CHECK(recall_of(study::vq_attention(all.rows()), t, &all) >= 0.9);
}

TEST_CASE("in-context learning, small", "[tasks]") {
  const auto t = icl::make_task<float>(small_icl(2048, 4, 256, 11));
  const icl::Score sa = icl_of(study::self_attention(), t);
  CHECK(sa.learnt == 1.0);
  CHECK(sa.nmse < 0.3);
  const icl::Score o = icl_of(study::ovq_attention(256), t);
  CHECK(o.learnt == 1.0);
  CHECK(o.nmse < 0.35);
  // Normalised elu+1 linear attention averages over all functions: with 16 functions it learns
  // few of them.
  const auto many = icl::make_task<float>(small_icl(4096, 16, 256, 12));
  const icl::Score lin = icl_of(study::linear_attention(ovq::FeatureMap::elu1, false), many);
  CHECK(lin.learnt <= 0.5);
  CHECK(lin.nmse > 0.5);
  CHECK(icl_of(study::self_attention(), many).learnt == 1.0);

  // Grouped by function (task I-b), a window of 512 tokens sees about 2 of 16 blocks of 256.
  icl::TaskConfig blocked = small_icl(4096, 16, 256, 12);
  blocked.blocked = true;
  const auto grouped = icl::make_task<float>(blocked);
  CHECK(icl_of(study::sliding_window(512), grouped).learnt <= 0.5);
  CHECK(icl_of(study::self_attention(), grouped).learnt == 1.0);
}

}  // namespace ovq_test_tasks
