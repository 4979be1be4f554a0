// Distinct states used from several threads at once (docs/threads.md): one const mixer shared by
// every thread, each thread with its own state (or its own MultiHead layer) running forward,
// step, absorb, encode/decode and save/load. Every thread's outputs and final state must equal,
// bit for bit, what the same work gives on one thread. Also: several threads reading one const
// state at once (copying it, encoding it, saving it), and several threads saving to one path.
//
// scripts/test also builds this file alone with ThreadSanitizer (build/tsan, without OpenMP),
// which turns any data race in these uses into a failure.
#include <atomic>
#include <cstdint>
#include <exception>
#include <filesystem>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "ovq/io/state_file.hpp"
#include "support/catch.hpp"
#include "support/fixtures.hpp"

#if defined(__unix__) || defined(__APPLE__)
#include <unistd.h>
#endif

// Everything below lives in this file's own namespace, so the suite can be built as one
// unity source without the files' helpers colliding.
namespace ovq_test_concurrency {

namespace {

using ovq::Index;
using ovq::RowMatrix;
using Bytes = std::vector<unsigned char>;

constexpr int kThreads = 4;
constexpr Index kDk = 8;
constexpr Index kDv = 6;
constexpr Index kTokens = 40;

// A scratch directory for this test, removed at the end of each test case.
class ScratchDir {
 public:
  explicit ScratchDir(const std::string& name) {
#if defined(__unix__) || defined(__APPLE__)
    const long pid = static_cast<long>(::getpid());
#else
    const long pid = 0;
#endif
    path_ = std::filesystem::temp_directory_path() /
            ("ovq_concurrency_" + std::to_string(pid) + "_" + name);
    std::filesystem::remove_all(path_);
    std::filesystem::create_directories(path_);
  }
  ~ScratchDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  std::string file(const std::string& name) const { return (path_ / name).string(); }
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};

// Runs body(i) on kThreads threads that start together; rethrows the first exception.
void run_threads(const std::function<void(int)>& body) {
  std::atomic<int> ready{0};
  std::vector<std::exception_ptr> errors(kThreads);
  std::vector<std::thread> threads;
  for (int i = 0; i < kThreads; ++i) {
    threads.emplace_back([&, i] {
      ready.fetch_add(1);
      while (ready.load() < kThreads) std::this_thread::yield();
      try {
        body(i);
      } catch (...) {
        errors[static_cast<std::size_t>(i)] = std::current_exception();
      }
    });
  }
  for (std::thread& t : threads) t.join();
  for (const std::exception_ptr& e : errors)
    if (e) std::rethrow_exception(e);
}

template <class S>
struct Inputs {
  RowMatrix<S> q, k, v;
  explicit Inputs(std::uint64_t seed)
      : q(ovq::test::random_unit_rows<S>(kTokens, kDk, seed)),
        k(ovq::test::random_unit_rows<S>(kTokens, kDk, seed + 1)),
        v(ovq::test::random_matrix<S>(kTokens, kDv, seed + 2)) {}
};

template <class Mixer>
struct Run {
  RowMatrix<typename Mixer::scalar_type> outputs;
  Bytes state;
};

// One stream through one state: a forward piece, token steps, encode/decode, absorb, save/load
// through `path`, then another forward piece. Rows absorbed have no output (left at 0).
template <class Mixer>
Run<Mixer> stream(const Mixer& mixer, typename Mixer::State state, const Inputs<typename Mixer::scalar_type>& in,
                  const std::string& path) {
  using S = typename Mixer::scalar_type;
  Run<Mixer> run;
  run.outputs = RowMatrix<S>::Zero(kTokens, kDv);
  auto& o = run.outputs;
  mixer.forward(state, in.q.topRows(13), in.k.topRows(13), in.v.topRows(13), o.topRows(13));
  for (Index i = 13; i < 20; ++i) {
    ovq::RowVector<S> out(kDv);
    mixer.step(state, in.q.row(i), in.k.row(i), in.v.row(i), out);
    o.row(i) = out;
  }
  const Bytes bytes = ovq::io::encode_state(mixer, state);
  state = ovq::io::decode_state(mixer, bytes.data(), bytes.size());
  mixer.absorb(state, in.k.middleRows(20, 6), in.v.middleRows(20, 6));
  ovq::io::save_state(path, mixer, state);
  state = ovq::io::load_state(path, mixer);
  mixer.forward(state, in.q.middleRows(26, 14), in.k.middleRows(26, 14), in.v.middleRows(26, 14),
                o.middleRows(26, 14));
  run.state = ovq::io::encode_state(mixer, state);
  return run;
}

// Each thread streams its own inputs through its own state, several rounds; the shared mixer is
// only read. Results must equal the single-threaded ones exactly.
template <class Mixer>
void check_distinct_states(const Mixer& mixer, const typename Mixer::State& fresh,
                           const std::string& name) {
  using S = typename Mixer::scalar_type;
  ScratchDir dir(name);
  std::vector<Inputs<S>> inputs;
  std::vector<Run<Mixer>> serial;
  for (int i = 0; i < kThreads; ++i) {
    inputs.emplace_back(1000 + 10 * static_cast<std::uint64_t>(i));
    serial.push_back(stream(mixer, fresh, inputs.back(), dir.file("serial.state")));
  }
  constexpr int kRounds = 3;
  std::vector<std::vector<Run<Mixer>>> threaded(kThreads);
  run_threads([&](int i) {
    const std::string path = dir.file("thread" + std::to_string(i) + ".state");
    for (int r = 0; r < kRounds; ++r)
      threaded[static_cast<std::size_t>(i)].push_back(
          stream(mixer, fresh, inputs[static_cast<std::size_t>(i)], path));
  });
  for (int i = 0; i < kThreads; ++i) {
    for (const Run<Mixer>& run : threaded[static_cast<std::size_t>(i)]) {
      CHECK(run.outputs == serial[static_cast<std::size_t>(i)].outputs);
      CHECK(run.state == serial[static_cast<std::size_t>(i)].state);
    }
  }
  // Different inputs really gave different results (the comparison above is not vacuous).
  CHECK(serial[0].state != serial[1].state);
}

// Threads read one const state at once: copy it and continue the copy, encode it, compare it,
// save it (each to its own file). Every continuation equals the single-threaded one.
template <class Mixer>
void check_shared_const_state(const Mixer& mixer, typename Mixer::State prefix,
                              const std::string& name) {
  using S = typename Mixer::scalar_type;
  ScratchDir dir(name);
  const Inputs<S> warmup(77);
  mixer.forward(prefix, warmup.q, warmup.k, warmup.v);
  const typename Mixer::State& shared = prefix;
  const Bytes shared_bytes = ovq::io::encode_state(mixer, shared);

  std::vector<Inputs<S>> inputs;
  std::vector<RowMatrix<S>> serial;
  for (int i = 0; i < kThreads; ++i) {
    inputs.emplace_back(2000 + 10 * static_cast<std::uint64_t>(i));
    typename Mixer::State copy = shared;
    serial.push_back(mixer.forward(copy, inputs.back().q, inputs.back().k, inputs.back().v));
  }
  std::vector<RowMatrix<S>> outputs(kThreads);
  std::vector<Bytes> encoded(kThreads), loaded(kThreads);
  std::vector<char> equal(kThreads, 0);
  run_threads([&](int i) {
    const auto u = static_cast<std::size_t>(i);
    typename Mixer::State copy = shared;
    equal[u] = copy == shared;
    encoded[u] = ovq::io::encode_state(mixer, shared);
    const std::string path = dir.file("shared" + std::to_string(i) + ".state");
    ovq::io::save_state(path, mixer, shared);
    loaded[u] = ovq::io::encode_state(mixer, ovq::io::load_state(path, mixer));
    outputs[u] = mixer.forward(copy, inputs[u].q, inputs[u].k, inputs[u].v);
  });
  CHECK(ovq::io::encode_state(mixer, shared) == shared_bytes);  // nobody wrote it
  for (int i = 0; i < kThreads; ++i) {
    const auto u = static_cast<std::size_t>(i);
    CHECK(equal[u]);
    CHECK(encoded[u] == shared_bytes);
    CHECK(loaded[u] == shared_bytes);
    CHECK(outputs[u] == serial[u]);
  }
}

// Each thread owns a MultiHead layer (a mixer plus its states) and streams through it.
template <class Mixer>
Bytes layer_stream(ovq::MultiHead<Mixer> layer, std::uint64_t seed, RowMatrix<typename Mixer::scalar_type>& out) {
  using S = typename Mixer::scalar_type;
  const Index bq = layer.batch() * layer.query_heads();
  const Index bkv = layer.batch() * layer.kv_heads();
  constexpr Index t = 9;
  const RowMatrix<S> q = ovq::test::random_unit_rows<S>(bq * t, kDk, seed);
  const RowMatrix<S> k = ovq::test::random_unit_rows<S>(bkv * t, kDk, seed + 1);
  const RowMatrix<S> v = ovq::test::random_matrix<S>(bkv * t, kDv, seed + 2);
  out = layer.forward(q, k, v);
  RowMatrix<S> o1(bq, kDv);
  layer.step(q.topRows(bq), k.topRows(bkv), v.topRows(bkv), o1);
  layer.absorb(k, v);
  const Bytes bytes = ovq::io::encode_state(layer);
  ovq::io::decode_state(layer, bytes.data(), bytes.size());
  const RowMatrix<S> o2 = layer.forward(q, k, v);
  out.conservativeResize(out.rows() + bq + o2.rows(), kDv);
  out.middleRows(bq * t, bq) = o1;
  out.bottomRows(o2.rows()) = o2;
  return ovq::io::encode_state(layer);
}

template <class Mixer>
void check_layers(const ovq::MultiHead<Mixer>& prototype) {
  using S = typename Mixer::scalar_type;
  std::vector<RowMatrix<S>> serial_out(kThreads), out(kThreads);
  std::vector<Bytes> serial_state(kThreads), state(kThreads);
  for (int i = 0; i < kThreads; ++i) {
    const auto u = static_cast<std::size_t>(i);
    serial_state[u] = layer_stream(prototype, 3000 + 10 * static_cast<std::uint64_t>(i), serial_out[u]);
  }
  run_threads([&](int i) {
    const auto u = static_cast<std::size_t>(i);
    state[u] = layer_stream(prototype, 3000 + 10 * static_cast<std::uint64_t>(i), out[u]);
  });
  for (std::size_t u = 0; u < kThreads; ++u) {
    CHECK(out[u] == serial_out[u]);
    CHECK(state[u] == serial_state[u]);
  }
}

ovq::OvqOptions ovq_options() {
  ovq::OvqOptions o;
  o.capacity = 8;
  o.chunk = 5;
  return o;
}

}  // namespace

TEST_CASE("threads: distinct states with one shared mixer give the single-threaded results",
          "[concurrency]") {
  SECTION("self-attention, sliding window") {
    ovq::SelfAttentionOptions o;
    o.window = 7;
    o.chunk = 4;
    const ovq::SelfAttention<float> mixer(o);
    check_distinct_states(mixer, mixer.make_state(kDk, kDv), "self");
  }
  SECTION("linear attention") {
    ovq::LinearAttentionOptions o;
    o.feature_map = ovq::kernels::FeatureMap::elu1;
    o.normalize = true;
    o.decay = 0.95;
    o.chunk = 8;
    const ovq::LinearAttention<float> mixer(o);
    check_distinct_states(mixer, mixer.make_state(kDk, kDv), "linear");
  }
  SECTION("VQ-attention") {
    const ovq::VqAttention<float> mixer;
    check_distinct_states(mixer,
                          mixer.make_state(ovq::test::random_unit_rows<float>(16, kDk, 5), kDv),
                          "vq");
  }
  SECTION("OVQ-attention, float and double") {
    const ovq::OvqAttention<float> mixer(ovq_options());
    check_distinct_states(mixer, mixer.make_state(kDk, kDv), "ovq_f32");
    const ovq::OvqAttention<double> mixer64(ovq_options());
    check_distinct_states(mixer64, mixer64.make_state(kDk, kDv), "ovq_f64");
  }
}

TEST_CASE("threads: one const state read by several threads at once", "[concurrency]") {
  const ovq::OvqAttention<float> ovq_mixer(ovq_options());
  check_shared_const_state(ovq_mixer, ovq_mixer.make_state(kDk, kDv), "shared_ovq");
  const ovq::SelfAttention<float> self_mixer;
  check_shared_const_state(self_mixer, self_mixer.make_state(kDk, kDv), "shared_self");
}

TEST_CASE("threads: one MultiHead layer per thread", "[concurrency]") {
  check_layers(ovq::MultiHead<ovq::OvqAttention<float>>(ovq::OvqAttention<float>(ovq_options()),
                                                        2, 4, 2, kDk, kDv));
  check_layers(ovq::MultiHead<ovq::SelfAttention<double>>(ovq::SelfAttention<double>(), 1, 2, 1,
                                                          kDk, kDv));
}

TEST_CASE("threads: concurrent save_state to one path leaves one complete file", "[concurrency]") {
  const ovq::OvqAttention<float> mixer(ovq_options());
  ScratchDir dir("same_path");
  const std::string path = dir.file("state.bin");
  std::vector<Bytes> candidates;
  std::vector<ovq::OvqState<float>> states;
  for (int i = 0; i < kThreads; ++i) {
    states.push_back(mixer.make_state(kDk, kDv));
    const Inputs<float> in(4000 + 10 * static_cast<std::uint64_t>(i));
    mixer.forward(states.back(), in.q, in.k, in.v);
    candidates.push_back(ovq::io::encode_state(mixer, states.back()));
  }
  run_threads([&](int i) {
    for (int r = 0; r < 5; ++r)
      ovq::io::save_state(path, mixer, states[static_cast<std::size_t>(i)]);
  });
  const Bytes loaded = ovq::io::encode_state(mixer, ovq::io::load_state(path, mixer));
  bool is_one_of_them = false;
  for (const Bytes& c : candidates) is_one_of_them = is_one_of_them || c == loaded;
  CHECK(is_one_of_them);
  // Every temporary file was renamed into place: only the state file is left.
  int files = 0;
  for (const auto& entry : std::filesystem::directory_iterator(dir.path())) {
    (void)entry;
    ++files;
  }
  CHECK(files == 1);
}

}  // namespace ovq_test_concurrency
