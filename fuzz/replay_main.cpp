// A main() for a fuzz target built without libFuzzer: runs LLVMFuzzerTestOneInput once on each
// file named on the command line, or on each file inside a named directory (in name order,
// skipping names that start with '.'). This is how CTest replays the seed corpus and the saved
// regressions with any compiler; a finding aborts, which fails the test.
//
//   fuzz_TARGET_replay PATH...
//
// Exit status: 0 when every input ran, 2 when a path is missing or unreadable.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <system_error>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size);

namespace {

namespace fs = std::filesystem;

bool read_whole(const fs::path& path, std::vector<std::uint8_t>& out) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return false;
  out.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  return !in.bad();
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s FILE_OR_DIRECTORY...\n", argv[0]);
    return 2;
  }
  std::vector<fs::path> inputs;
  for (int i = 1; i < argc; ++i) {
    const fs::path path(argv[i]);
    std::error_code ec;
    if (fs::is_directory(path, ec)) {
      std::vector<fs::path> files;
      for (const fs::directory_entry& e : fs::directory_iterator(path, ec)) {
        const std::string name = e.path().filename().string();
        if (!name.empty() && name[0] != '.' && e.is_regular_file(ec)) files.push_back(e.path());
      }
      if (ec) {
        std::fprintf(stderr, "replay: cannot list '%s': %s\n", argv[i], ec.message().c_str());
        return 2;
      }
      std::sort(files.begin(), files.end());
      inputs.insert(inputs.end(), files.begin(), files.end());
    } else if (fs::is_regular_file(path, ec)) {
      inputs.push_back(path);
    } else {
      std::fprintf(stderr, "replay: no such file or directory: '%s'\n", argv[i]);
      return 2;
    }
  }
  std::vector<std::uint8_t> bytes;
  for (const fs::path& path : inputs) {
    if (!read_whole(path, bytes)) {
      std::fprintf(stderr, "replay: cannot read '%s'\n", path.string().c_str());
      return 2;
    }
    std::printf("replay: %s (%zu bytes)\n", path.string().c_str(), bytes.size());
    std::fflush(stdout);
    // A copy of exactly the input's size, so reading past the end is caught by ASan.
    std::vector<std::uint8_t> exact(bytes);
    LLVMFuzzerTestOneInput(exact.data(), exact.size());
  }
  std::printf("replay: %zu inputs ran\n", inputs.size());
  return 0;
}
