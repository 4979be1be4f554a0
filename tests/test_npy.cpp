// Tests for the .npy reader/writer: round trips, files written by NumPy, and rejection of
// malformed or unsupported input with the right exception type and an informative message.
#include "ovq/io/npy.hpp"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "support/catch.hpp"

// Everything below lives in this file's own namespace, so the suite can be built as one
// unity source without the files' helpers colliding.
namespace ovq_test_npy {

namespace {

using ovq::FormatError;
using ovq::IoError;
using ovq::io::DType;
using ovq::io::NpyArray;
using Bytes = std::vector<unsigned char>;
using Shape = std::vector<std::int64_t>;

// ---- Fixtures produced by NumPy 1.24 (numpy.save / numpy.lib.format.write_array) ----------------
// np.save(np.array([[1.5, -2, 3.25], [0, 1e-3, -7]], dtype="<f4")) (152 bytes)
const unsigned char kNumpyF32_2x3[] = {
    0x93, 0x4e, 0x55, 0x4d, 0x50, 0x59, 0x01, 0x00, 0x76, 0x00, 0x7b, 0x27, 0x64, 0x65, 0x73, 0x63,
    0x72, 0x27, 0x3a, 0x20, 0x27, 0x3c, 0x66, 0x34, 0x27, 0x2c, 0x20, 0x27, 0x66, 0x6f, 0x72, 0x74,
    0x72, 0x61, 0x6e, 0x5f, 0x6f, 0x72, 0x64, 0x65, 0x72, 0x27, 0x3a, 0x20, 0x46, 0x61, 0x6c, 0x73,
    0x65, 0x2c, 0x20, 0x27, 0x73, 0x68, 0x61, 0x70, 0x65, 0x27, 0x3a, 0x20, 0x28, 0x32, 0x2c, 0x20,
    0x33, 0x29, 0x2c, 0x20, 0x7d, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20,
    0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20,
    0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20,
    0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x0a,
    0x00, 0x00, 0xc0, 0x3f, 0x00, 0x00, 0x00, 0xc0, 0x00, 0x00, 0x50, 0x40, 0x00, 0x00, 0x00, 0x00,
    0x6f, 0x12, 0x83, 0x3a, 0x00, 0x00, 0xe0, 0xc0,
};
// np.save(np.array([1, -0.5, np.pi, 1e300], dtype="<f8")) (160 bytes)
const unsigned char kNumpyF64_4[] = {
    0x93, 0x4e, 0x55, 0x4d, 0x50, 0x59, 0x01, 0x00, 0x76, 0x00, 0x7b, 0x27, 0x64, 0x65, 0x73, 0x63,
    0x72, 0x27, 0x3a, 0x20, 0x27, 0x3c, 0x66, 0x38, 0x27, 0x2c, 0x20, 0x27, 0x66, 0x6f, 0x72, 0x74,
    0x72, 0x61, 0x6e, 0x5f, 0x6f, 0x72, 0x64, 0x65, 0x72, 0x27, 0x3a, 0x20, 0x46, 0x61, 0x6c, 0x73,
    0x65, 0x2c, 0x20, 0x27, 0x73, 0x68, 0x61, 0x70, 0x65, 0x27, 0x3a, 0x20, 0x28, 0x34, 0x2c, 0x29,
    0x2c, 0x20, 0x7d, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20,
    0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20,
    0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20,
    0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x0a,
    0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0xf0, 0x3f, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0xe0, 0xbf,
    0x18, 0x2d, 0x44, 0x54, 0xfb, 0x21, 0x09, 0x40, 0x9c, 0x75, 0x00, 0x88, 0x3c, 0xe4, 0x37, 0x7e,
};
// np.save(np.array(42.5, dtype="<f8")) (136 bytes)
const unsigned char kNumpyF64Scalar[] = {
    0x93, 0x4e, 0x55, 0x4d, 0x50, 0x59, 0x01, 0x00, 0x76, 0x00, 0x7b, 0x27, 0x64, 0x65, 0x73, 0x63,
    0x72, 0x27, 0x3a, 0x20, 0x27, 0x3c, 0x66, 0x38, 0x27, 0x2c, 0x20, 0x27, 0x66, 0x6f, 0x72, 0x74,
    0x72, 0x61, 0x6e, 0x5f, 0x6f, 0x72, 0x64, 0x65, 0x72, 0x27, 0x3a, 0x20, 0x46, 0x61, 0x6c, 0x73,
    0x65, 0x2c, 0x20, 0x27, 0x73, 0x68, 0x61, 0x70, 0x65, 0x27, 0x3a, 0x20, 0x28, 0x29, 0x2c, 0x20,
    0x7d, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20,
    0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20,
    0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20,
    0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x0a,
    0x00, 0x00, 0x00, 0x00, 0x00, 0x40, 0x45, 0x40,
};
// np.save(np.zeros((0,), dtype="<f4")) (128 bytes)
const unsigned char kNumpyF32Empty[] = {
    0x93, 0x4e, 0x55, 0x4d, 0x50, 0x59, 0x01, 0x00, 0x76, 0x00, 0x7b, 0x27, 0x64, 0x65, 0x73, 0x63,
    0x72, 0x27, 0x3a, 0x20, 0x27, 0x3c, 0x66, 0x34, 0x27, 0x2c, 0x20, 0x27, 0x66, 0x6f, 0x72, 0x74,
    0x72, 0x61, 0x6e, 0x5f, 0x6f, 0x72, 0x64, 0x65, 0x72, 0x27, 0x3a, 0x20, 0x46, 0x61, 0x6c, 0x73,
    0x65, 0x2c, 0x20, 0x27, 0x73, 0x68, 0x61, 0x70, 0x65, 0x27, 0x3a, 0x20, 0x28, 0x30, 0x2c, 0x29,
    0x2c, 0x20, 0x7d, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20,
    0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20,
    0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20,
    0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x0a,
};
// format.write_array(np.array([[1, 2], [3, 4]], dtype="<f8"), version=(2, 0)) (160 bytes)
const unsigned char kNumpyF64V2_2x2[] = {
    0x93, 0x4e, 0x55, 0x4d, 0x50, 0x59, 0x02, 0x00, 0x74, 0x00, 0x00, 0x00, 0x7b, 0x27, 0x64, 0x65,
    0x73, 0x63, 0x72, 0x27, 0x3a, 0x20, 0x27, 0x3c, 0x66, 0x38, 0x27, 0x2c, 0x20, 0x27, 0x66, 0x6f,
    0x72, 0x74, 0x72, 0x61, 0x6e, 0x5f, 0x6f, 0x72, 0x64, 0x65, 0x72, 0x27, 0x3a, 0x20, 0x46, 0x61,
    0x6c, 0x73, 0x65, 0x2c, 0x20, 0x27, 0x73, 0x68, 0x61, 0x70, 0x65, 0x27, 0x3a, 0x20, 0x28, 0x32,
    0x2c, 0x20, 0x32, 0x29, 0x2c, 0x20, 0x7d, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20,
    0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20,
    0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20,
    0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x0a,
    0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0xf0, 0x3f, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x40,
    0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x08, 0x40, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x10, 0x40,
};
// format.write_array(np.array([0.5, -1, 2], dtype="<f4"), version=(3, 0)) (140 bytes)
const unsigned char kNumpyF32V3_3[] = {
    0x93, 0x4e, 0x55, 0x4d, 0x50, 0x59, 0x03, 0x00, 0x74, 0x00, 0x00, 0x00, 0x7b, 0x27, 0x64, 0x65,
    0x73, 0x63, 0x72, 0x27, 0x3a, 0x20, 0x27, 0x3c, 0x66, 0x34, 0x27, 0x2c, 0x20, 0x27, 0x66, 0x6f,
    0x72, 0x74, 0x72, 0x61, 0x6e, 0x5f, 0x6f, 0x72, 0x64, 0x65, 0x72, 0x27, 0x3a, 0x20, 0x46, 0x61,
    0x6c, 0x73, 0x65, 0x2c, 0x20, 0x27, 0x73, 0x68, 0x61, 0x70, 0x65, 0x27, 0x3a, 0x20, 0x28, 0x33,
    0x2c, 0x29, 0x2c, 0x20, 0x7d, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20,
    0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20,
    0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20,
    0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x0a,
    0x00, 0x00, 0x00, 0x3f, 0x00, 0x00, 0x80, 0xbf, 0x00, 0x00, 0x00, 0x40,
};
// np.save(np.array([1, 2], dtype=">f4")) (136 bytes)
const unsigned char kNumpyBigEndianF4[] = {
    0x93, 0x4e, 0x55, 0x4d, 0x50, 0x59, 0x01, 0x00, 0x76, 0x00, 0x7b, 0x27, 0x64, 0x65, 0x73, 0x63,
    0x72, 0x27, 0x3a, 0x20, 0x27, 0x3e, 0x66, 0x34, 0x27, 0x2c, 0x20, 0x27, 0x66, 0x6f, 0x72, 0x74,
    0x72, 0x61, 0x6e, 0x5f, 0x6f, 0x72, 0x64, 0x65, 0x72, 0x27, 0x3a, 0x20, 0x46, 0x61, 0x6c, 0x73,
    0x65, 0x2c, 0x20, 0x27, 0x73, 0x68, 0x61, 0x70, 0x65, 0x27, 0x3a, 0x20, 0x28, 0x32, 0x2c, 0x29,
    0x2c, 0x20, 0x7d, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20,
    0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20,
    0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20,
    0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x0a,
    0x3f, 0x80, 0x00, 0x00, 0x40, 0x00, 0x00, 0x00,
};
// np.save(np.array([1, 2, 3], dtype="<i4")) (140 bytes)
const unsigned char kNumpyInt32[] = {
    0x93, 0x4e, 0x55, 0x4d, 0x50, 0x59, 0x01, 0x00, 0x76, 0x00, 0x7b, 0x27, 0x64, 0x65, 0x73, 0x63,
    0x72, 0x27, 0x3a, 0x20, 0x27, 0x3c, 0x69, 0x34, 0x27, 0x2c, 0x20, 0x27, 0x66, 0x6f, 0x72, 0x74,
    0x72, 0x61, 0x6e, 0x5f, 0x6f, 0x72, 0x64, 0x65, 0x72, 0x27, 0x3a, 0x20, 0x46, 0x61, 0x6c, 0x73,
    0x65, 0x2c, 0x20, 0x27, 0x73, 0x68, 0x61, 0x70, 0x65, 0x27, 0x3a, 0x20, 0x28, 0x33, 0x2c, 0x29,
    0x2c, 0x20, 0x7d, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20,
    0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20,
    0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20,
    0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x0a,
    0x01, 0x00, 0x00, 0x00, 0x02, 0x00, 0x00, 0x00, 0x03, 0x00, 0x00, 0x00,
};
// np.save(np.asfortranarray(np.array([[1, 2, 3], [4, 5, 6]], dtype="<f8"))) (176 bytes)
const unsigned char kNumpyFortran[] = {
    0x93, 0x4e, 0x55, 0x4d, 0x50, 0x59, 0x01, 0x00, 0x76, 0x00, 0x7b, 0x27, 0x64, 0x65, 0x73, 0x63,
    0x72, 0x27, 0x3a, 0x20, 0x27, 0x3c, 0x66, 0x38, 0x27, 0x2c, 0x20, 0x27, 0x66, 0x6f, 0x72, 0x74,
    0x72, 0x61, 0x6e, 0x5f, 0x6f, 0x72, 0x64, 0x65, 0x72, 0x27, 0x3a, 0x20, 0x54, 0x72, 0x75, 0x65,
    0x2c, 0x20, 0x27, 0x73, 0x68, 0x61, 0x70, 0x65, 0x27, 0x3a, 0x20, 0x28, 0x32, 0x2c, 0x20, 0x33,
    0x29, 0x2c, 0x20, 0x7d, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20,
    0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20,
    0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20,
    0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x20, 0x0a,
    0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0xf0, 0x3f, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x10, 0x40,
    0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x40, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x14, 0x40,
    0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x08, 0x40, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x18, 0x40,
};

template <std::size_t N>
Bytes bytes_of(const unsigned char (&a)[N]) {
  return Bytes(a, a + N);
}

NpyArray parse(const Bytes& b) { return ovq::io::parse_npy(b.data(), b.size()); }

// A file with an arbitrary header dict (no padding) and `payload` zero bytes.
Bytes make_npy(const std::string& dict, std::size_t payload, int major = 1) {
  Bytes out = {0x93, 'N', 'U', 'M', 'P', 'Y', static_cast<unsigned char>(major), 0};
  const std::size_t len = dict.size();
  out.push_back(static_cast<unsigned char>(len & 0xff));
  out.push_back(static_cast<unsigned char>((len >> 8) & 0xff));
  if (major != 1) {
    out.push_back(static_cast<unsigned char>((len >> 16) & 0xff));
    out.push_back(static_cast<unsigned char>((len >> 24) & 0xff));
  }
  out.insert(out.end(), dict.begin(), dict.end());
  out.resize(out.size() + payload, 0);
  return out;
}

std::string f4_dict(const std::string& shape) {
  return "{'descr': '<f4', 'fortran_order': False, 'shape': " + shape + ", }\n";
}

// Runs `parse` on `b`, requires a FormatError, and returns its message.
std::string format_error_of(const Bytes& b) {
  try {
    parse(b);
  } catch (const FormatError& e) {
    return e.what();
  } catch (const std::exception& e) {
    FAIL("expected FormatError, got another exception: " << e.what());
  }
  FAIL("expected FormatError, parse succeeded");
  return {};
}

bool contains(const std::string& haystack, const std::string& needle) {
  return haystack.find(needle) != std::string::npos;
}

// A fresh, empty directory under the system temp dir, removed on destruction.
struct TempDir {
  std::filesystem::path path;
  TempDir() {
    static int serial = 0;
    std::random_device rd;
    path = std::filesystem::temp_directory_path() /
           ("ovq_npy_test_" + std::to_string(rd()) + "_" + std::to_string(serial++));
    std::filesystem::remove_all(path);
    std::filesystem::create_directories(path);
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
  std::string file(const std::string& name) const { return (path / name).string(); }
};

void write_bytes(const std::string& path, const Bytes& b) {
  std::ofstream out(path, std::ios::binary);
  out.write(reinterpret_cast<const char*>(b.data()), static_cast<std::streamsize>(b.size()));
}

template <class T>
std::vector<T> sample_values(std::size_t n) {
  std::vector<T> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = static_cast<T>(0.25 * static_cast<double>(i) - 1.0) / T(3);
  // Values whose bit patterns must survive exactly.
  if (n > 0) v[0] = -T(0);
  if (n > 1) v[1] = std::numeric_limits<T>::infinity();
  if (n > 2) v[2] = std::numeric_limits<T>::denorm_min();
  if (n > 3) v[3] = std::numeric_limits<T>::quiet_NaN();
  return v;
}

template <class T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0);
}

const std::vector<Shape> kShapes = {{}, {0}, {5}, {3, 4}, {2, 3, 4}};

}  // namespace

// ---- Round trips ---------------------------------------------------------------------------------

TEMPLATE_TEST_CASE("npy: encode/parse round trip", "[io][npy]", float, double) {
  const DType want = std::is_same<TestType, float>::value ? DType::f32 : DType::f64;
  for (const Shape& shape : kShapes) {
    CAPTURE(shape);
    std::int64_t n = 1;
    for (auto d : shape) n *= d;
    const auto values = sample_values<TestType>(static_cast<std::size_t>(n));
    const Bytes file = ovq::io::encode_npy(values.data(), shape);
    // Version 1.0, payload aligned to 64 bytes, header ends in '\n'.
    REQUIRE(file.size() >= 10);
    CHECK(file[6] == 1);
    CHECK(file[7] == 0);
    const std::size_t offset = 10 + std::size_t(file[8]) + (std::size_t(file[9]) << 8);
    CHECK(offset % 64 == 0);
    CHECK(file[offset - 1] == '\n');
    CHECK(file.size() == offset + values.size() * sizeof(TestType));

    const NpyArray a = parse(file);
    CHECK(a.dtype == want);
    CHECK(a.shape == shape);
    CHECK(a.size() == n);
    CHECK(same_bits(a.to_vector<TestType>(), values));
  }
}

TEMPLATE_TEST_CASE("npy: write_npy/read_npy round trip", "[io][npy]", float, double) {
  TempDir dir;
  for (const Shape& shape : kShapes) {
    CAPTURE(shape);
    std::int64_t n = 1;
    for (auto d : shape) n *= d;
    const auto values = sample_values<TestType>(static_cast<std::size_t>(n));
    const std::string path = dir.file("a.npy");
    ovq::io::write_npy(path, values.data(), shape);  // overwrites the previous iteration's file
    const NpyArray a = ovq::io::read_npy(path);
    CHECK(a.shape == shape);
    CHECK(same_bits(a.to_vector<TestType>(), values));
    // The file on disk is byte-identical to the in-memory encoding.
    const NpyArray b = parse(ovq::io::encode_npy(values.data(), shape));
    CHECK(a.data == b.data);
  }
  // No temporary files are left behind.
  std::size_t entries = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir.path)) {
    (void)e;
    ++entries;
  }
  CHECK(entries == 1);
}

TEST_CASE("npy: to_vector converts between float widths", "[io][npy]") {
  const std::vector<double> d = {1.0, 0.1, -3.5};
  const NpyArray a = parse(ovq::io::encode_npy(d.data(), {3}));
  const auto f = a.to_vector<float>();
  REQUIRE(f.size() == 3);
  CHECK(f[1] == 0.1f);
  const std::vector<float> g = {0.1f, 2.0f};
  const NpyArray b = parse(ovq::io::encode_npy(g.data(), {1, 2}));
  CHECK(b.to_vector<double>() == std::vector<double>{static_cast<double>(0.1f), 2.0});
}

TEST_CASE("npy: float16 arrays are read and written ('<f2'), exactly", "[io][npy]") {
  using ovq::fp16;
  // 1, -2.5, the largest half, the smallest subnormal half, 0.1 rounded to half.
  const std::vector<fp16> h = {fp16(1.0f), fp16(-2.5f), fp16(65504.0f),
                               Eigen::numext::bit_cast<fp16>(std::uint16_t(1)), fp16(0.1f)};
  const Bytes bytes = ovq::io::encode_npy(h.data(), {5});
  const NpyArray a = parse(bytes);
  CHECK(a.dtype == ovq::io::DType::f16);
  CHECK(a.data.size() == 10);
  const auto f = a.to_vector<float>();
  CHECK(f[0] == 1.0f);
  CHECK(f[1] == -2.5f);
  CHECK(f[2] == 65504.0f);
  CHECK(f[3] == std::ldexp(1.0f, -24));
  CHECK(f[4] == static_cast<float>(fp16(0.1f)));
  const auto back = a.to_vector<fp16>();
  for (std::size_t i = 0; i < h.size(); ++i)
    CHECK(Eigen::numext::bit_cast<std::uint16_t>(back[i]) ==
          Eigen::numext::bit_cast<std::uint16_t>(h[i]));
  // The header names the dtype as NumPy does.
  const std::string header(bytes.begin(), bytes.begin() + 64);
  CHECK(contains(header, "'descr': '<f2'"));
}

TEST_CASE("npy: a large array round trips through the chunked writer", "[io][npy]") {
  TempDir dir;
  std::vector<float> v(100000);
  for (std::size_t i = 0; i < v.size(); ++i) v[i] = static_cast<float>(std::sin(static_cast<double>(i)));
  const std::string path = dir.file("big.npy");
  ovq::io::write_npy(path, v.data(), {100, 1000});
  const NpyArray a = ovq::io::read_npy(path);
  CHECK(a.shape == Shape{100, 1000});
  CHECK(a.to_vector<float>() == v);
}

// ---- Files written by NumPy ----------------------------------------------------------------------

TEST_CASE("npy: reads files written by NumPy", "[io][npy]") {
  SECTION("float32 (2, 3), version 1.0") {
    const NpyArray a = parse(bytes_of(kNumpyF32_2x3));
    CHECK(a.dtype == DType::f32);
    CHECK(a.shape == Shape{2, 3});
    CHECK(a.to_vector<float>() == std::vector<float>{1.5f, -2.0f, 3.25f, 0.0f, 1e-3f, -7.0f});
  }
  SECTION("float64 (4,)") {
    const NpyArray a = parse(bytes_of(kNumpyF64_4));
    CHECK(a.dtype == DType::f64);
    CHECK(a.shape == Shape{4});
    CHECK(a.to_vector<double>() == std::vector<double>{1.0, -0.5, 3.141592653589793, 1e300});
  }
  SECTION("float64 scalar ()") {
    const NpyArray a = parse(bytes_of(kNumpyF64Scalar));
    CHECK(a.shape.empty());
    CHECK(a.size() == 1);
    CHECK(a.to_vector<double>() == std::vector<double>{42.5});
  }
  SECTION("float32 empty (0,)") {
    const NpyArray a = parse(bytes_of(kNumpyF32Empty));
    CHECK(a.shape == Shape{0});
    CHECK(a.size() == 0);
    CHECK(a.data.empty());
    CHECK(a.to_vector<float>().empty());
  }
  SECTION("float64 (2, 2), version 2.0") {
    const NpyArray a = parse(bytes_of(kNumpyF64V2_2x2));
    CHECK(a.shape == Shape{2, 2});
    CHECK(a.to_vector<double>() == std::vector<double>{1.0, 2.0, 3.0, 4.0});
  }
  SECTION("float32 (3,), version 3.0") {
    const NpyArray a = parse(bytes_of(kNumpyF32V3_3));
    CHECK(a.shape == Shape{3});
    CHECK(a.to_vector<float>() == std::vector<float>{0.5f, -1.0f, 2.0f});
  }
  SECTION("read_npy on a NumPy file on disk") {
    TempDir dir;
    const std::string path = dir.file("numpy.npy");
    write_bytes(path, bytes_of(kNumpyF64V2_2x2));
    CHECK(ovq::io::read_npy(path).to_vector<double>() == std::vector<double>{1.0, 2.0, 3.0, 4.0});
  }
}

TEST_CASE("npy: header dict parsing is tolerant of layout", "[io][npy]") {
  SECTION("keys in any order, double quotes, extra whitespace, no trailing comma") {
    const NpyArray a = parse(make_npy("{ \"shape\" :(2 ,3 ,) ,\t'fortran_order':False,'descr':\"<f8\"}  \n", 48));
    CHECK(a.dtype == DType::f64);
    CHECK(a.shape == Shape{2, 3});
  }
  SECTION("trailing comma in a 2-d tuple and spaces inside ()") {
    CHECK(parse(make_npy(f4_dict("(3, 4,)"), 48)).shape == Shape{3, 4});
    CHECK(parse(make_npy(f4_dict("( )"), 4)).shape.empty());
  }
  SECTION("zero dimension anywhere") {
    CHECK(parse(make_npy(f4_dict("(3, 0, 7)"), 0)).size() == 0);
  }
  SECTION("rank 8 is accepted") {
    CHECK(parse(make_npy(f4_dict("(1, 1, 1, 1, 1, 1, 1, 2,)"), 8)).shape.size() == 8);
  }
}

// ---- Rejections ----------------------------------------------------------------------------------

TEST_CASE("npy: rejects a bad magic string", "[io][npy]") {
  Bytes b = bytes_of(kNumpyF64_4);
  b[1] = 'X';
  CHECK(contains(format_error_of(b), "magic"));
  CHECK(contains(format_error_of(Bytes{}), "magic"));
  CHECK(contains(format_error_of(Bytes{0x93, 'N', 'U'}), "magic"));
  CHECK_THROWS_AS(ovq::io::parse_npy(nullptr, 0), FormatError);
}

TEST_CASE("npy: rejects unsupported format versions", "[io][npy]") {
  Bytes b = bytes_of(kNumpyF64_4);
  b[6] = 4;
  CHECK(contains(format_error_of(b), "version"));
  b[6] = 1;
  b[7] = 1;
  CHECK(contains(format_error_of(b), "version"));
}

TEST_CASE("npy: rejects a truncated header", "[io][npy]") {
  const Bytes full = bytes_of(kNumpyF64_4);
  const std::string msg = format_error_of(Bytes(full.begin(), full.begin() + 50));
  CHECK(contains(msg, "truncated header"));
  CHECK(contains(msg, "header length"));
  CHECK(contains(format_error_of(Bytes(full.begin(), full.begin() + 9)), "truncated header"));
  CHECK(contains(format_error_of(Bytes(full.begin(), full.begin() + 7)), "truncated header"));
}

TEST_CASE("npy: every truncation of a valid file is rejected", "[io][npy]") {
  for (const Bytes& full : {bytes_of(kNumpyF32_2x3), bytes_of(kNumpyF64V2_2x2), bytes_of(kNumpyF64Scalar)}) {
    for (std::size_t n = 0; n < full.size(); ++n) {
      CAPTURE(n);
      CHECK_THROWS_AS(parse(Bytes(full.begin(), full.begin() + static_cast<std::ptrdiff_t>(n))), FormatError);
    }
  }
}

TEST_CASE("npy: rejects a truncated payload", "[io][npy]") {
  Bytes b = bytes_of(kNumpyF64_4);
  b.pop_back();
  const std::string msg = format_error_of(b);
  CHECK(contains(msg, "truncated payload"));
  CHECK(contains(msg, "32"));  // bytes needed for (4,) of <f8
}

TEST_CASE("npy: rejects trailing bytes after the payload", "[io][npy]") {
  Bytes b = bytes_of(kNumpyF32_2x3);
  b.push_back(0);
  CHECK(contains(format_error_of(b), "trailing"));
  Bytes e = bytes_of(kNumpyF32Empty);
  e.insert(e.end(), 4, 0);
  CHECK(contains(format_error_of(e), "trailing"));
}

TEST_CASE("npy: rejects a big-endian dtype, naming it", "[io][npy]") {
  const std::string msg = format_error_of(bytes_of(kNumpyBigEndianF4));
  CHECK(contains(msg, "dtype"));
  CHECK(contains(msg, ">f4"));
  CHECK(contains(msg, "<f4"));  // and says what is supported
}

TEST_CASE("npy: rejects integer and other dtypes", "[io][npy]") {
  const std::string msg = format_error_of(bytes_of(kNumpyInt32));
  CHECK(contains(msg, "dtype"));
  CHECK(contains(msg, "<i4"));
  for (const char* descr : {"|f4", "=f8", ">f2", "<c8", ">f8", "f4", "<u1", ""}) {
    CAPTURE(descr);
    const std::string m =
        format_error_of(make_npy(std::string("{'descr': '") + descr + "', 'fortran_order': False, 'shape': (1,), }", 8));
    CHECK(contains(m, "dtype"));
  }
  // Structured dtypes have a list as descr.
  CHECK(contains(format_error_of(make_npy("{'descr': [('a', '<f4')], 'fortran_order': False, 'shape': (1,), }", 4)),
                 "dtype"));
}

TEST_CASE("npy: rejects Fortran order", "[io][npy]") {
  CHECK(contains(format_error_of(bytes_of(kNumpyFortran)), "fortran_order"));
  CHECK(contains(format_error_of(make_npy("{'descr': '<f4', 'fortran_order': 0, 'shape': (1,), }", 4)),
                 "fortran_order"));
}

TEST_CASE("npy: rejects a negative dimension", "[io][npy]") {
  const std::string msg = format_error_of(make_npy(f4_dict("(-3,)"), 0));
  CHECK(contains(msg, "negative"));
  CHECK(contains(format_error_of(make_npy(f4_dict("(2, -1)"), 0)), "negative"));
}

TEST_CASE("npy: rejects shapes whose size overflows", "[io][npy]") {
  // 2**62 * 16 elements overflows int64.
  CHECK(contains(format_error_of(make_npy(f4_dict("(4611686018427387904, 16)"), 0)), "overflow"));
  // The element count fits but count * itemsize does not.
  CHECK(contains(format_error_of(make_npy(f4_dict("(4611686018427387904,)"), 0)), "overflow"));
  // A single dimension past int64.
  CHECK(contains(format_error_of(make_npy(f4_dict("(99999999999999999999,)"), 0)), "overflow"));
  // Overflow hidden behind a zero dimension is still rejected.
  CHECK(contains(format_error_of(make_npy(f4_dict("(0, 4611686018427387904, 16)"), 0)), "overflow"));
}

TEST_CASE("npy: rejects a header length beyond the file", "[io][npy]") {
  Bytes b = bytes_of(kNumpyF64V2_2x2);
  b[8] = b[9] = b[10] = b[11] = 0xff;  // 4 GiB header in a 160-byte file
  const std::string msg = format_error_of(b);
  CHECK(contains(msg, "header length"));
  CHECK(contains(msg, "4294967295"));
  Bytes v1 = bytes_of(kNumpyF64_4);
  v1[8] = v1[9] = 0xff;
  CHECK(contains(format_error_of(v1), "header length"));
}

TEST_CASE("npy: rejects malformed header dicts", "[io][npy]") {
  struct Case {
    const char* dict;
    const char* mentions;
  };
  const Case cases[] = {
      {"", "'{'"},
      {"{'descr': '<f4', 'fortran_order': False}", "shape"},
      {"{'descr': '<f4', 'shape': (1,)}", "fortran_order"},
      {"{'fortran_order': False, 'shape': (1,)}", "descr"},
      {"{'descr': '<f4', 'fortran_order': False, 'shape': (1,), 'extra': 1}", "extra"},
      {"{'descr': '<f4', 'descr': '<f4', 'fortran_order': False, 'shape': (1,)}", "duplicate"},
      {"{'descr': '<f4', 'fortran_order': False, 'shape': (1)}", "tuple"},
      {"{'descr': '<f4', 'fortran_order': False, 'shape': [1]}", "shape"},
      {"{'descr': '<f4', 'fortran_order': False, 'shape': (1,,)}", "shape"},
      {"{'descr': '<f4', 'fortran_order': False, 'shape': (1 2)}", "shape"},
      {"{'descr': '<f4', 'fortran_order': False, 'shape': (1.5,)}", "shape"},
      {"{'descr': '<f4', 'fortran_order': False, 'shape': (1,)} x", "after"},
      {"{'descr': '<f4', 'fortran_order': False, 'shape': (1,)", "'}'"},
      {"{'descr: '<f4', 'fortran_order': False, 'shape': (1,)}", "'"},
      {"{'descr': '<f4' 'fortran_order': False, 'shape': (1,)}", "','"},
      {"{'descr': '<f4', 'fortran_order': Falsey, 'shape': (1,)}", "fortran_order"},
      {"{'descr': '<f4', 'fortran_order': False, 'shape': (1, 1, 1, 1, 1, 1, 1, 1, 1)}", "rank"},
  };
  for (const Case& c : cases) {
    CAPTURE(c.dict);
    const std::string msg = format_error_of(make_npy(c.dict, 4));
    CHECK(contains(msg, c.mentions));
  }
}

TEST_CASE("npy: single-byte corruption never crashes and only ever throws FormatError", "[io][npy]") {
  const Bytes base = bytes_of(kNumpyF32_2x3);
  const unsigned char probes[] = {0x00, 0x20, 0x27, 0x28, 0x29, 0x2c, 0x2d, 0x30, 0x39, 0x7b, 0x7d, 0xff};
  for (std::size_t i = 0; i < base.size(); ++i) {
    for (unsigned char v : probes) {
      Bytes b = base;
      b[i] = v;
      CAPTURE(i, int(v));
      try {
        const NpyArray a = parse(b);
        CHECK(static_cast<std::size_t>(a.size()) * ovq::io::dtype_size(a.dtype) == a.data.size());
      } catch (const FormatError&) {
      }
    }
  }
}

// ---- File errors ---------------------------------------------------------------------------------

TEST_CASE("npy: read_npy reports I/O and format errors", "[io][npy]") {
  TempDir dir;
  CHECK_THROWS_AS(ovq::io::read_npy(dir.file("missing.npy")), IoError);
  try {
    ovq::io::read_npy(dir.file("missing.npy"));
  } catch (const IoError& e) {
    CHECK(contains(e.what(), "missing.npy"));
  }
  const std::string bad = dir.file("bad.npy");
  Bytes b = bytes_of(kNumpyF64_4);
  b.pop_back();
  write_bytes(bad, b);
  try {
    ovq::io::read_npy(bad);
    FAIL("expected FormatError");
  } catch (const FormatError& e) {
    CHECK(contains(e.what(), "truncated payload"));
    CHECK(contains(e.what(), "bad.npy"));
  }
  const std::string huge = dir.file("huge.npy");
  write_bytes(huge, make_npy(f4_dict("(4611686018427387904, 16)"), 0));
  CHECK_THROWS_AS(ovq::io::read_npy(huge), FormatError);
  const std::string empty = dir.file("empty.npy");
  write_bytes(empty, {});
  CHECK_THROWS_AS(ovq::io::read_npy(empty), FormatError);
  // A v1.0 header shorter than the 12 bytes read up front.
  const std::string tiny = dir.file("tiny.npy");
  write_bytes(tiny, make_npy("{", 1));
  CHECK_THROWS_AS(ovq::io::read_npy(tiny), FormatError);
  CHECK_THROWS_AS(ovq::io::read_npy(dir.path.string()), ovq::Error);  // a directory
}

TEST_CASE("npy: write_npy reports I/O and argument errors", "[io][npy]") {
  TempDir dir;
  const float x[2] = {1.0f, 2.0f};
  CHECK_THROWS_AS(ovq::io::write_npy(dir.file("no/such/dir/a.npy"), x, {2}), IoError);
  CHECK_THROWS_AS(ovq::io::write_npy(dir.file("a.npy"), x, {-1}), ovq::ArgumentError);
  CHECK_THROWS_AS(ovq::io::write_npy(dir.file("a.npy"), static_cast<const float*>(nullptr), {2}),
                  ovq::ArgumentError);
  CHECK_THROWS_AS(ovq::io::encode_npy(x, Shape(9, 1)), ovq::ArgumentError);
  CHECK_THROWS_AS(ovq::io::encode_npy(x, {std::int64_t(1) << 62, 16}), ovq::ArgumentError);
  CHECK_NOTHROW(ovq::io::encode_npy(static_cast<const double*>(nullptr), {0, 3}));
  // A failed write leaves an existing file untouched.
  const std::string path = dir.file("keep.npy");
  ovq::io::write_npy(path, x, {2});
  CHECK_THROWS(ovq::io::write_npy(path, x, {-2}));
  CHECK(ovq::io::read_npy(path).to_vector<float>() == std::vector<float>{1.0f, 2.0f});
}

}  // namespace ovq_test_npy
