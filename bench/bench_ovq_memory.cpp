// Streaming memory check for OVQ-attention: 256k tokens fed through a MultiHead layer piece by
// piece, inputs generated on the fly into the same buffers, so that anything that grows with the
// stream shows up in the process's resident memory.
//
// At 16k, 64k and 256k tokens it records VmHWM (peak resident) and VmRSS from /proc/self/status,
// the state's bytes (MultiHead::bytes()) and the dictionary size. It exits with status 1 when the
// peak resident memory at 256k exceeds the one at 16k by more than the tolerance, or when the
// state bytes differ (the dictionary is allocated at its capacity N up front, so it must not).
//
//   bench_ovq_memory [--tokens=262144] [--heads=4] [--d=64] [--capacity=2048] [--chunk=128]
//                    [--piece=2048] [--tolerance-kib=1024] [--threads=N] [--out=FILE.json]
#include <fstream>
#include <iostream>
#include <sstream>

#include "bench_common.hpp"

namespace {

using namespace ovq_bench;
using Mixer = ovq::OvqAttention<float>;

struct Checkpoint {
  std::int64_t tokens = 0;
  long hwm_kib = -1;
  long rss_kib = -1;
  std::size_t state_bytes = 0;
  Index dictionary_min = 0;  // smallest dictionary over the heads
  Index dictionary_max = 0;
  double seconds = 0.0;
};

// Value in kB of a "Name:   123 kB" line of /proc/self/status, -1 if unavailable.
long proc_status_kib(const char* field) {
  std::ifstream in("/proc/self/status");
  std::string line;
  const std::string prefix = std::string(field) + ":";
  while (std::getline(in, line)) {
    if (line.compare(0, prefix.size(), prefix) == 0) {
      std::istringstream ss(line.substr(prefix.size()));
      long value = -1;
      ss >> value;
      return value;
    }
  }
  return -1;
}

long long_arg(int argc, char** argv, const char* name, long fallback) {
  const std::string prefix = std::string("--") + name + "=";
  for (int i = 1; i < argc; ++i)
    if (std::strncmp(argv[i], prefix.c_str(), prefix.size()) == 0)
      return std::atol(argv[i] + prefix.size());
  return fallback;
}

std::string string_arg(int argc, char** argv, const char* name) {
  const std::string prefix = std::string("--") + name + "=";
  for (int i = 1; i < argc; ++i)
    if (std::strncmp(argv[i], prefix.c_str(), prefix.size()) == 0)
      return std::string(argv[i] + prefix.size());
  return {};
}

}  // namespace

int main(int argc, char** argv) {
  apply_threads(parse_threads(argc, argv));
  const std::int64_t total = long_arg(argc, argv, "tokens", 262144);
  const Index heads = long_arg(argc, argv, "heads", 4);
  const Index d = long_arg(argc, argv, "d", 64);
  const Index capacity = long_arg(argc, argv, "capacity", 2048);
  const Index chunk = long_arg(argc, argv, "chunk", 128);
  const Index piece = long_arg(argc, argv, "piece", 2048);
  const long tolerance_kib = long_arg(argc, argv, "tolerance-kib", 1024);
  const std::string out_path = string_arg(argc, argv, "out");
  const std::vector<std::int64_t> marks{16384, 65536, 262144};

  ovq::OvqOptions opt;
  opt.capacity = capacity;
  opt.chunk = chunk;
  ovq::MultiHead<Mixer> layer(Mixer(opt), 1, heads, heads, d, d);
  layer.set_threads(configured_threads());

  Matrix q(heads * piece, d), k(heads * piece, d), v(heads * piece, d), o(heads * piece, d);
  std::vector<Checkpoint> checkpoints;
  const Clock::time_point t0 = Clock::now();
  for (std::int64_t fed = 0; fed < total;) {
    const Index len = static_cast<Index>(std::min<std::int64_t>(piece, total - fed));
    const auto block = static_cast<std::uint64_t>(fed / piece);
    for (Index h = 0; h < heads; ++h) {
      fill_rows(q.middleRows(h * len, len), mix_seed(11, block, 3 * h), true);
      fill_rows(k.middleRows(h * len, len), mix_seed(11, block, 3 * h + 1), true);
      fill_rows(v.middleRows(h * len, len), mix_seed(11, block, 3 * h + 2), false);
    }
    layer.forward(q.topRows(heads * len), k.topRows(heads * len), v.topRows(heads * len),
                  o.topRows(heads * len));
    fed += len;
    for (std::int64_t mark : marks) {
      if (fed - len < mark && fed >= mark) {
        Checkpoint c;
        c.tokens = fed;
        c.hwm_kib = proc_status_kib("VmHWM");
        c.rss_kib = proc_status_kib("VmRSS");
        c.state_bytes = layer.bytes();
        c.dictionary_min = capacity;
        for (const auto& s : layer.states()) {
          c.dictionary_min = std::min(c.dictionary_min, s.dictionary().size());
          c.dictionary_max = std::max(c.dictionary_max, s.dictionary().size());
        }
        c.seconds = seconds_since(t0);
        checkpoints.push_back(c);
        std::printf(
            "tokens %8lld  VmHWM %8ld KiB  VmRSS %8ld KiB  state %10zu B  n %lld..%lld  "
            "%.1f s\n",
            static_cast<long long>(c.tokens), c.hwm_kib, c.rss_kib, c.state_bytes,
            static_cast<long long>(c.dictionary_min), static_cast<long long>(c.dictionary_max),
            c.seconds);
        std::fflush(stdout);
      }
    }
  }

  bool ok = true;
  std::string verdict = "pass";
  long hwm_growth = 0, rss_growth = 0;
  if (checkpoints.size() >= 2) {
    const Checkpoint& first = checkpoints.front();
    const Checkpoint& last = checkpoints.back();
    hwm_growth = last.hwm_kib - first.hwm_kib;
    rss_growth = last.rss_kib - first.rss_kib;
    if (first.hwm_kib < 0) {
      verdict = "no /proc/self/status: resident memory not checked";
    } else if (hwm_growth > tolerance_kib) {
      ok = false;
      verdict = "fail: peak resident memory grew by " + std::to_string(hwm_growth) + " KiB";
    }
    if (first.state_bytes != last.state_bytes) {
      ok = false;
      verdict = "fail: state bytes changed";
    }
  } else {
    verdict = "fewer than two checkpoints: nothing compared";
  }
  std::printf("peak resident growth %ld KiB, resident growth %ld KiB (tolerance %ld KiB): %s\n",
              hwm_growth, rss_growth, tolerance_kib, verdict.c_str());

  if (!out_path.empty()) {
    std::ofstream out(out_path);
    out << "{\n  \"program\": \"bench_ovq_memory\",\n"
        << "  \"config\": {\"tokens\": " << total << ", \"heads\": " << heads << ", \"d\": " << d
        << ", \"capacity\": " << capacity << ", \"chunk\": " << chunk << ", \"piece\": " << piece
        << ", \"threads\": " << configured_threads() << ", \"tolerance_kib\": " << tolerance_kib
        << "},\n  \"checkpoints\": [\n";
    for (std::size_t i = 0; i < checkpoints.size(); ++i) {
      const Checkpoint& c = checkpoints[i];
      out << "    {\"tokens\": " << c.tokens << ", \"vm_hwm_kib\": " << c.hwm_kib
          << ", \"vm_rss_kib\": " << c.rss_kib << ", \"state_bytes\": " << c.state_bytes
          << ", \"dictionary_min\": " << c.dictionary_min
          << ", \"dictionary_max\": " << c.dictionary_max << ", \"seconds\": " << c.seconds << "}"
          << (i + 1 < checkpoints.size() ? "," : "") << "\n";
    }
    out << "  ],\n  \"hwm_growth_kib\": " << hwm_growth << ",\n  \"rss_growth_kib\": " << rss_growth
        << ",\n  \"pass\": " << (ok ? "true" : "false") << ",\n  \"verdict\": \"" << verdict
        << "\"\n}\n";
  }
  return ok ? 0 : 1;
}
