// ovq::fit_codebook / fit_kmeans: recovers well-separated clusters, is deterministic, re-seeds
// empty clusters, and validates its arguments.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "ovq/fit/kmeans.hpp"
#include "support/catch.hpp"
#include "support/fixtures.hpp"

// Everything below lives in this file's own namespace, so the suite can be built as one
// unity source without the files' helpers colliding.
namespace ovq_test_kmeans {

namespace {

using ovq::Index;
template <class S>
using Mat = ovq::RowMatrix<S>;

// `clusters` centers spread far apart (norm 10), `per` points each at distance about 0.1.
template <class S>
Mat<S> clustered(Index clusters, Index per, Index dim, std::uint64_t seed, Mat<double>& centers) {
  centers = ovq::test::random_unit_rows<double>(clusters, dim, seed) * 10.0;
  const Mat<double> noise = ovq::test::random_matrix<double>(clusters * per, dim, seed + 1,
                                                             0.1 / std::sqrt(double(dim)));
  Mat<S> x(clusters * per, dim);
  // Interleaved, so that no cluster sits in one block of rows.
  for (Index i = 0; i < clusters * per; ++i)
    x.row(i) = (centers.row(i % clusters) + noise.row(i)).template cast<S>();
  return x;
}

template <class S>
void check_recovers() {
  Mat<double> centers;
  const Index clusters = 6, per = 50, dim = 8;
  const Mat<S> x = clustered<S>(clusters, per, dim, 42, centers);
  const ovq::KMeansResult<S> r = ovq::fit_kmeans<S>(x, clusters);
  REQUIRE(r.centroids.rows() == clusters);
  REQUIRE(r.centroids.cols() == dim);
  REQUIRE(r.converged);
  // One-to-one: every true center has exactly one centroid within 0.1.
  std::vector<int> matched(static_cast<std::size_t>(clusters), 0);
  for (Index c = 0; c < clusters; ++c) {
    int near = 0;
    for (Index s = 0; s < clusters; ++s) {
      const double d = (r.centroids.row(s).template cast<double>() - centers.row(c)).norm();
      if (d < 0.1) {
        ++near;
        ++matched[static_cast<std::size_t>(s)];
      }
    }
    CHECK(near == 1);
  }
  for (int m : matched) CHECK(m == 1);
  // Points of one true cluster share one assignment, different clusters different ones.
  for (Index i = 0; i < x.rows(); ++i)
    CHECK(r.assignment[static_cast<std::size_t>(i)] ==
          r.assignment[static_cast<std::size_t>(i % clusters)]);
  // Inertia: about n * 0.01 (squared noise radius), far below the spread of the centers.
  CHECK(r.inertia < 0.05 * double(x.rows()));
  CHECK(r.inertia >= 0.0);
}

}  // namespace

TEST_CASE("fit_kmeans recovers well-separated clusters", "[kmeans]") {
  check_recovers<float>();
  check_recovers<double>();
}

TEST_CASE("fit_codebook is deterministic for a seed", "[kmeans]") {
  Mat<double> centers;
  const Mat<float> x = ovq::test::random_matrix<float>(500, 16, 7);
  ovq::KMeansOptions o;
  o.seed = 3;
  const Mat<float> a = ovq::fit_codebook<float>(x, 20, o);
  const Mat<float> b = ovq::fit_codebook<float>(x, 20, o);
  CHECK(a == b);
  o.seed = 4;
  const Mat<float> c = ovq::fit_codebook<float>(x, 20, o);
  CHECK(c.rows() == 20);
  CHECK(c.allFinite());
  CHECK(a != c);  // another seed, another k-means++ start (with probability one here)
}

TEST_CASE("fit_kmeans iterations never increase the inertia", "[kmeans]") {
  const Mat<double> x = ovq::test::random_matrix<double>(400, 8, 11);
  ovq::KMeansOptions o;
  o.max_iterations = 0;
  const auto init = ovq::fit_kmeans<double>(x, 16, o);
  CHECK(init.iterations == 0);
  // k-means++ alone: every centroid is a row of x.
  for (Index s = 0; s < 16; ++s) {
    bool is_row = false;
    for (Index i = 0; i < x.rows() && !is_row; ++i) is_row = x.row(i) == init.centroids.row(s);
    CHECK(is_row);
  }
  double previous = init.inertia;
  for (Index it = 1; it <= 6; ++it) {
    o.max_iterations = it;
    o.tolerance = 0.0;
    const auto r = ovq::fit_kmeans<double>(x, 16, o);
    CHECK(r.inertia <= previous * (1 + 1e-12));
    previous = r.inertia;
  }
  // The inertia reported is that of the returned centroids and assignment.
  o.max_iterations = 25;
  const auto r = ovq::fit_kmeans<double>(x, 16, o);
  double inertia = 0.0;
  for (Index i = 0; i < x.rows(); ++i) {
    const Index a = r.assignment[static_cast<std::size_t>(i)];
    inertia += (x.row(i) - r.centroids.row(a)).squaredNorm();
    for (Index s = 0; s < 16; ++s)
      CHECK((x.row(i) - r.centroids.row(a)).squaredNorm() <=
            (x.row(i) - r.centroids.row(s)).squaredNorm() + 1e-9);
  }
  CHECK(std::abs(inertia - r.inertia) <= 1e-9 * std::max(1.0, inertia));
}

TEST_CASE("fit_kmeans handles fewer distinct rows than centroids", "[kmeans]") {
  // Rows 0..2 coincide: k-means++ runs out of distance and takes unused rows, one centroid is
  // left empty by the tie rule and is re-seeded; everything stays finite, inertia 0.
  Mat<double> x(4, 2);
  x << 0, 0, 0, 0, 0, 0, 10, 10;
  const auto r = ovq::fit_kmeans<double>(x, 3);
  REQUIRE(r.centroids.rows() == 3);
  CHECK(r.centroids.allFinite());
  CHECK(r.inertia == 0.0);
  for (Index s = 0; s < 3; ++s) {
    const bool zero = r.centroids.row(s).norm() == 0.0;
    const bool ten = (r.centroids.row(s).array() == 10.0).all();
    CHECK((zero || ten));
  }
  // size == rows: every row becomes a centroid.
  Mat<double> y(3, 2);
  y << 1, 0, 0, 1, -1, 0;
  const auto all = ovq::fit_kmeans<double>(y, 3);
  CHECK(all.inertia == 0.0);
  // One row, one centroid.
  const Mat<float> one = Mat<float>::Constant(1, 5, 2.0f);
  CHECK(ovq::fit_codebook<float>(one, 1) == one);
}

TEST_CASE("fit_codebook rejects bad arguments", "[kmeans][errors]") {
  const Mat<float> x = ovq::test::random_matrix<float>(10, 4, 1);
  CHECK_THROWS_AS(ovq::fit_codebook<float>(x, 0), ovq::ArgumentError);
  CHECK_THROWS_AS(ovq::fit_codebook<float>(x, -3), ovq::ArgumentError);
  CHECK_THROWS_AS(ovq::fit_codebook<float>(x, 11), ovq::ArgumentError);
  const Mat<float> empty(0, 4);
  CHECK_THROWS_AS(ovq::fit_codebook<float>(empty, 1), ovq::ArgumentError);
  Mat<float> bad = x;
  bad(3, 2) = std::numeric_limits<float>::quiet_NaN();
  CHECK_THROWS_AS(ovq::fit_codebook<float>(bad, 2), ovq::ArgumentError);
  bad(3, 2) = std::numeric_limits<float>::infinity();
  CHECK_THROWS_AS(ovq::fit_codebook<float>(bad, 2), ovq::ArgumentError);
  ovq::KMeansOptions o;
  o.max_iterations = -1;
  CHECK_THROWS_AS(ovq::fit_codebook<float>(x, 2, o), ovq::ArgumentError);
  o = {};
  o.tolerance = -1e-3;
  CHECK_THROWS_AS(ovq::fit_codebook<float>(x, 2, o), ovq::ArgumentError);
  o.tolerance = std::numeric_limits<double>::quiet_NaN();
  CHECK_THROWS_AS(ovq::fit_codebook<float>(x, 2, o), ovq::ArgumentError);
  // The message names the argument.
  try {
    ovq::fit_codebook<float>(x, 11);
    FAIL("no exception");
  } catch (const ovq::ArgumentError& e) {
    CHECK(std::string(e.what()).find("size") != std::string::npos);
  }
}

TEST_CASE("a fitted codebook drives VQ-attention", "[kmeans]") {
  Mat<double> centers;
  const Mat<float> keys = clustered<float>(4, 32, 8, 5, centers);
  const Mat<float> codebook = ovq::fit_codebook<float>(keys, 4);
  ovq::VqAttention<float> vq;
  auto state = vq.make_state(codebook, 3);
  const Mat<float> v = ovq::test::random_matrix<float>(keys.rows(), 3, 9);
  vq.absorb(state, keys, v);
  // Each code collected exactly one cluster: 32 keys each.
  for (Index s = 0; s < 4; ++s) CHECK(state.dictionary().count(s) == 32);
}

}  // namespace ovq_test_kmeans
