// Fuzz target: the .npy reader (ovq::io::parse_npy, ovq::io::read_npy).
//
// The input is an .npy file. Oracle:
//   - parse_npy either returns or throws ovq::FormatError (nothing else, no crash, no UB);
//   - read_npy on the same bytes written to a file agrees: the same array, or FormatError too;
//   - an accepted array is consistent (rank <= 8, payload = elements x item size) and survives
//     to_vector / encode_npy / parse_npy bit for bit, NaN payloads included.
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include <unistd.h>

#include "fuzz_support.hpp"
#include "ovq/io/npy.hpp"

namespace {

using ovq::io::DType;
using ovq::io::NpyArray;

bool same(const NpyArray& a, const NpyArray& b) {
  return a.dtype == b.dtype && a.shape == b.shape && a.data == b.data;
}

std::string scratch_path() {
  const char* dir = ::access("/dev/shm", W_OK) == 0 ? "/dev/shm" : "/tmp";
  return std::string(dir) + "/ovq_fuzz_npy_" + std::to_string(static_cast<long>(::getpid())) +
         ".npy";
}

// read_npy over the bytes: the array, or false after a FormatError.
bool read_through_file(const std::uint8_t* data, std::size_t size, NpyArray& out) {
  static const std::string path = scratch_path();
  std::FILE* f = std::fopen(path.c_str(), "wb");
  OVQ_FUZZ_CHECK(f != nullptr, "cannot create ", path);
  OVQ_FUZZ_CHECK(size == 0 || std::fwrite(data, 1, size, f) == size, "cannot write ", path);
  OVQ_FUZZ_CHECK(std::fclose(f) == 0, "cannot close ", path);
  try {
    out = ovq::io::read_npy(path);
    return true;
  } catch (const ovq::FormatError&) {
    return false;
  }
}

template <class T>
void check_round_trip(const NpyArray& a) {
  const std::vector<T> values = a.to_vector<T>();
  const std::vector<unsigned char> bytes = ovq::io::encode_npy(values.data(), a.shape);
  const NpyArray b = ovq::io::parse_npy(bytes.data(), bytes.size());
  OVQ_FUZZ_CHECK(same(a, b), "encode_npy(to_vector(a)) does not parse back to a");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  NpyArray parsed;
  bool accepted = false;
  std::string why;
  try {
    parsed = ovq::io::parse_npy(data, size);
    accepted = true;
  } catch (const ovq::FormatError& e) {
    why = e.what();
  } catch (const std::exception& e) {
    OVQ_FUZZ_CHECK(false, "parse_npy threw something other than ovq::FormatError: ", e.what());
  }

  NpyArray from_file;
  bool file_accepted = false;
  try {
    file_accepted = read_through_file(data, size, from_file);
  } catch (const std::exception& e) {
    OVQ_FUZZ_CHECK(false, "read_npy threw something other than ovq::FormatError: ", e.what());
  }
  OVQ_FUZZ_CHECK(accepted == file_accepted, "parse_npy ", accepted ? "accepts" : "rejects",
                 " the bytes but read_npy ", file_accepted ? "accepts" : "rejects",
                 " the same file; parse_npy said: ", accepted ? "(accepted)" : why.c_str());
  if (!accepted) return 0;
  OVQ_FUZZ_CHECK(same(parsed, from_file), "read_npy and parse_npy read different arrays");

  OVQ_FUZZ_CHECK(parsed.shape.size() <= ovq::io::kNpyMaxRank, "rank ", parsed.shape.size());
  const std::int64_t count = parsed.size();
  OVQ_FUZZ_CHECK(count >= 0 && static_cast<std::uint64_t>(count) * ovq::io::dtype_size(parsed.dtype) ==
                                   parsed.data.size(),
                 "payload of ", parsed.data.size(), " bytes for ", count, " elements");
  if (parsed.dtype == DType::f32) {
    check_round_trip<float>(parsed);
  } else if (parsed.dtype == DType::f16) {
    check_round_trip<ovq::fp16>(parsed);
  } else {
    check_round_trip<double>(parsed);
  }
  // Widening never fails and keeps the count.
  OVQ_FUZZ_CHECK(static_cast<std::int64_t>(parsed.to_vector<double>().size()) == count,
                 "to_vector<double> size");
  return 0;
}
