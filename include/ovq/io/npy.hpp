#pragma once
// Reader and writer for NumPy .npy files holding little-endian float16 / float32 / float64 arrays.
//
// Format summary (numpy.lib.format):
//   bytes 0..5   magic "\x93NUMPY"
//   byte  6, 7   format version major, minor: 1.0, 2.0 or 3.0
//   then         header length HLEN: uint16 little-endian for 1.0, uint32 little-endian for 2.0/3.0
//   then         HLEN bytes of header: a Python dict literal such as
//                  {'descr': '<f4', 'fortran_order': False, 'shape': (3, 4), }
//                padded with spaces and ended by '\n' (ASCII for 1.0/2.0, UTF-8 for 3.0)
//   then         the payload: prod(shape) * itemsize raw bytes, C (row-major) order.
//   A shape of () is a scalar holding one element.
//
// Reading is strict: anything this library would have to guess about (other dtypes, big-endian data,
// Fortran order, a payload that is short or followed by extra bytes) is a FormatError, never a
// silent misread. Sizes taken from the file are checked against the real file size before anything
// is allocated from them, so a hostile header cannot trigger a huge allocation.
//
// Writing produces version 1.0 files padded to 64 bytes, as numpy.save does, and replaces the
// destination atomically (temporary file in the same directory, flush, fsync, rename).
//
// Byte order: payload bytes are assembled into / split from integers with shifts, which is
// independent of the host's byte order; the only assumption is IEEE-754 floats whose byte order
// matches the host's integers (true on every platform this library targets).
#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "ovq/core/error.hpp"
#include "ovq/core/types.hpp"
#include "ovq/io/file.hpp"

namespace ovq {
namespace io {

static_assert(std::numeric_limits<float>::is_iec559 && sizeof(float) == 4,
              "npy: float must be IEEE-754 binary32");
static_assert(std::numeric_limits<double>::is_iec559 && sizeof(double) == 8,
              "npy: double must be IEEE-754 binary64");

enum class DType { f32, f64, f16 };

// Bytes per element of `dtype`.
inline std::size_t dtype_size(DType dtype) {
  return dtype == DType::f32 ? 4u : dtype == DType::f64 ? 8u : 2u;
}

// The numpy descr string of `dtype` ("<f4", "<f8" or "<f2").
inline const char* dtype_descr(DType dtype) {
  return dtype == DType::f32 ? "<f4" : dtype == DType::f64 ? "<f8" : "<f2";
}

// Largest rank accepted when reading or writing.
inline constexpr std::size_t kNpyMaxRank = 8;

namespace npy_detail {

inline constexpr unsigned char kMagic[6] = {0x93, 'N', 'U', 'M', 'P', 'Y'};
inline constexpr std::int64_t kInt64Max = std::numeric_limits<std::int64_t>::max();

// a * b for non-negative a, b; false when the product would exceed int64.
inline bool checked_mul(std::int64_t a, std::int64_t b, std::int64_t* out) {
  if (a != 0 && b > kInt64Max / a) return false;
  *out = a * b;
  return true;
}

// Element count of `shape`. Zero dimensions are skipped while testing for overflow so that every
// partial product a caller might form (strides, for example) is also known to fit.
// Returns false when a dimension is negative or the product overflows.
inline bool element_count(const std::vector<std::int64_t>& shape, std::int64_t* count) {
  std::int64_t nonzero = 1;
  bool has_zero = false;
  for (std::int64_t d : shape) {
    if (d < 0) return false;
    if (d == 0) {
      has_zero = true;
      continue;
    }
    if (!checked_mul(nonzero, d, &nonzero)) return false;
  }
  *count = has_zero ? 0 : nonzero;
  return true;
}

inline std::string shape_string(const std::vector<std::int64_t>& shape) {
  std::string s = "(";
  for (std::size_t i = 0; i < shape.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(shape[i]);
  }
  if (shape.size() == 1) s += ",";
  return s + ")";
}

// Little-endian loads and stores done with shifts, so they are correct on any host byte order.
inline float load_f32(const unsigned char* p) {
  std::uint32_t u = std::uint32_t(p[0]) | (std::uint32_t(p[1]) << 8) | (std::uint32_t(p[2]) << 16) |
                    (std::uint32_t(p[3]) << 24);
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline double load_f64(const unsigned char* p) {
  std::uint64_t u = 0;
  for (int i = 7; i >= 0; --i) u = (u << 8) | p[i];
  double d;
  std::memcpy(&d, &u, 8);
  return d;
}

inline void store_f32(float f, unsigned char* p) {
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  for (int i = 0; i < 4; ++i) p[i] = static_cast<unsigned char>(u >> (8 * i));
}

inline float load_f16(const unsigned char* p) {
  const auto bits = static_cast<std::uint16_t>(std::uint16_t(p[0]) | (std::uint16_t(p[1]) << 8));
  return static_cast<float>(Eigen::numext::bit_cast<fp16>(bits));
}

inline void store_f16(fp16 h, unsigned char* p) {
  const auto bits = Eigen::numext::bit_cast<std::uint16_t>(h);
  p[0] = static_cast<unsigned char>(bits & 0xff);
  p[1] = static_cast<unsigned char>(bits >> 8);
}

inline void store_f64(double d, unsigned char* p) {
  std::uint64_t u;
  std::memcpy(&u, &d, 8);
  for (int i = 0; i < 8; ++i) p[i] = static_cast<unsigned char>(u >> (8 * i));
}

template <class T>
void store_le(const T* src, std::size_t count, unsigned char* dst) {
  for (std::size_t i = 0; i < count; ++i) {
    if constexpr (std::is_same<T, float>::value) {
      store_f32(src[i], dst + 4 * i);
    } else if constexpr (std::is_same<T, fp16>::value) {
      store_f16(src[i], dst + 2 * i);
    } else {
      store_f64(src[i], dst + 8 * i);
    }
  }
}

template <class T>
constexpr DType dtype_of() {
  static_assert(std::is_same<T, float>::value || std::is_same<T, double>::value ||
                    std::is_same<T, fp16>::value,
                "npy: only float16, float32 and float64 arrays can be written");
  return std::is_same<T, float>::value ? DType::f32
                                       : std::is_same<T, double>::value ? DType::f64 : DType::f16;
}

// What the fixed-size part of the file says: where the header dict lies.
struct Preamble {
  std::size_t header_offset = 0;  // 10 for version 1.0, 12 for 2.0 / 3.0
  std::size_t header_len = 0;
};

// What the header dict says.
struct Header {
  DType dtype = DType::f64;
  std::vector<std::int64_t> shape;
  std::size_t payload_bytes = 0;
};

// Parses magic, version and header length from the first min(total, 12) bytes `b` of a stream
// whose full size is `total`.
inline Preamble parse_preamble(const unsigned char* b, std::size_t avail, std::uint64_t total,
                               const std::string& where) {
  if (avail < 6 || std::memcmp(b, kMagic, 6) != 0) {
    throw FormatError(where + ": bad magic: not an npy file (expected \"\\x93NUMPY\" at offset 0)");
  }
  if (avail < 8) throw FormatError(where + ": truncated header: file ends inside the version field");
  const int major = b[6], minor = b[7];
  if (!((major == 1 || major == 2 || major == 3) && minor == 0)) {
    throw FormatError(where + ": unsupported npy format version " + std::to_string(major) + "." +
                      std::to_string(minor) + " (supported: 1.0, 2.0, 3.0)");
  }
  Preamble pre;
  std::uint64_t hlen = 0;
  if (major == 1) {
    if (avail < 10) throw FormatError(where + ": truncated header: file ends inside the header length");
    hlen = std::uint64_t(b[8]) | (std::uint64_t(b[9]) << 8);
    pre.header_offset = 10;
  } else {
    if (avail < 12) throw FormatError(where + ": truncated header: file ends inside the header length");
    hlen = std::uint64_t(b[8]) | (std::uint64_t(b[9]) << 8) | (std::uint64_t(b[10]) << 16) |
           (std::uint64_t(b[11]) << 24);
    pre.header_offset = 12;
  }
  const std::uint64_t remaining = total - pre.header_offset;
  if (hlen > remaining) {
    throw FormatError(where + ": truncated header: header length " + std::to_string(hlen) +
                      " exceeds the " + std::to_string(remaining) + " bytes left in the file");
  }
  pre.header_len = static_cast<std::size_t>(hlen);
  return pre;
}

// Recursive-descent parser for the small subset of Python literal syntax numpy writes.
class HeaderParser {
 public:
  HeaderParser(const char* text, std::size_t len, const std::string& where)
      : p_(text), end_(text + len), where_(where) {}

  Header parse() {
    bool have_descr = false, have_order = false, have_shape = false;
    std::string descr;
    bool fortran = false;
    std::vector<std::int64_t> shape;

    skip_ws();
    expect('{', "the header dict");
    for (;;) {
      skip_ws();
      if (peek() == '}') break;
      const std::string key = parse_string("a header key");
      skip_ws();
      expect(':', "after header key '" + key + "'");
      skip_ws();
      if (key == "descr") {
        if (have_descr) fail("duplicate header key 'descr'");
        have_descr = true;
        if (peek() != '\'' && peek() != '"') {
          fail("unsupported dtype: structured or non-string 'descr' (supported dtypes: '<f2', '<f4', '<f8')");
        }
        descr = parse_string("the 'descr' value");
      } else if (key == "fortran_order") {
        if (have_order) fail("duplicate header key 'fortran_order'");
        have_order = true;
        fortran = parse_bool("fortran_order");
      } else if (key == "shape") {
        if (have_shape) fail("duplicate header key 'shape'");
        have_shape = true;
        shape = parse_shape();
      } else {
        fail("unexpected header key '" + key + "' (expected 'descr', 'fortran_order', 'shape')");
      }
      skip_ws();
      if (peek() == ',') {
        ++p_;
        continue;
      }
      if (peek() != '}') fail("expected ',' or '}' in the header dict");
    }
    ++p_;  // the closing '}'
    skip_ws();
    if (p_ != end_) fail("unexpected characters after the header dict");
    if (!have_descr) fail("header is missing key 'descr'");
    if (!have_order) fail("header is missing key 'fortran_order'");
    if (!have_shape) fail("header is missing key 'shape'");

    Header h;
    if (descr == "<f4") {
      h.dtype = DType::f32;
    } else if (descr == "<f8") {
      h.dtype = DType::f64;
    } else if (descr == "<f2") {
      h.dtype = DType::f16;
    } else {
      fail("unsupported dtype '" + descr + "' (supported dtypes: '<f2', '<f4', '<f8')");
    }
    if (fortran) fail("fortran_order True is not supported (only C-order arrays can be read)");
    std::int64_t count = 0, bytes = 0;
    if (!element_count(shape, &count) ||
        !checked_mul(count, static_cast<std::int64_t>(dtype_size(h.dtype)), &bytes) ||
        static_cast<std::uint64_t>(bytes) > std::numeric_limits<std::size_t>::max()) {
      fail("shape " + shape_string(shape) + " overflows: its byte size does not fit in 64 bits");
    }
    h.shape = std::move(shape);
    h.payload_bytes = static_cast<std::size_t>(bytes);
    return h;
  }

 private:
  [[noreturn]] void fail(const std::string& what) const {
    throw FormatError(where_ + ": bad header: " + what);
  }

  // '\0' stands for "end of header"; a literal NUL inside the header is rejected wherever it lands.
  char peek() const { return p_ < end_ ? *p_ : '\0'; }

  void skip_ws() {
    while (p_ < end_ && (*p_ == ' ' || *p_ == '\t' || *p_ == '\n' || *p_ == '\r')) ++p_;
  }

  void expect(char c, const std::string& context) {
    if (peek() != c) fail(std::string("expected '") + c + "' for " + context);
    ++p_;
  }

  std::string parse_string(const std::string& what) {
    const char quote = peek();
    if (quote != '\'' && quote != '"') fail("expected a quoted string for " + what);
    ++p_;
    const char* start = p_;
    while (p_ < end_ && *p_ != quote) {
      // dtype strings and keys never need escapes; refusing them keeps the parser trivial.
      if (*p_ == '\\' || *p_ == '\n' || *p_ == '\0') fail("unsupported character in string for " + what);
      ++p_;
    }
    if (p_ == end_) fail("unterminated string for " + what);
    std::string s(start, p_);
    ++p_;
    return s;
  }

  bool parse_bool(const char* key) {
    const char* start = p_;
    while (p_ < end_ && ((*p_ >= 'A' && *p_ <= 'Z') || (*p_ >= 'a' && *p_ <= 'z'))) ++p_;
    const std::string word(start, p_);
    if (word == "True") return true;
    if (word == "False") return false;
    fail(std::string("'") + key + "' must be True or False");
  }

  // A Python tuple of non-negative ints: (), (5,), (3, 4), (3, 4,). A bare (5) is an int in
  // Python, not a tuple, so numpy rejects it and so do we.
  std::vector<std::int64_t> parse_shape() {
    expect('(', "the 'shape' tuple");
    std::vector<std::int64_t> shape;
    skip_ws();
    if (peek() == ')') {
      ++p_;
      return shape;
    }
    bool trailing_comma = false;
    for (;;) {
      if (shape.size() == kNpyMaxRank) {
        fail("shape has more than " + std::to_string(kNpyMaxRank) + " dimensions (rank limit)");
      }
      shape.push_back(parse_dim());
      skip_ws();
      trailing_comma = false;
      if (peek() == ',') {
        ++p_;
        trailing_comma = true;
        skip_ws();
      }
      if (peek() == ')') break;
      if (!trailing_comma) fail("expected ',' or ')' in the 'shape' tuple");
    }
    ++p_;
    if (shape.size() == 1 && !trailing_comma) fail("'shape' (n) is not a tuple; a 1-d shape is written (n,)");
    return shape;
  }

  std::int64_t parse_dim() {
    const bool negative = peek() == '-';
    if (negative) {
      ++p_;
      skip_ws();
    }
    if (!(peek() >= '0' && peek() <= '9')) fail("expected an integer in the 'shape' tuple");
    std::int64_t v = 0;
    bool too_big = false;
    while (peek() >= '0' && peek() <= '9') {
      const int digit = *p_ - '0';
      if (v > (kInt64Max - digit) / 10) too_big = true;
      if (!too_big) v = v * 10 + digit;
      ++p_;
    }
    if (peek() == 'L' || peek() == 'l') ++p_;  // Python 2 long suffix in old files
    if (negative) fail("negative dimension in 'shape' (dimensions must be >= 0)");
    if (too_big) fail("dimension in 'shape' overflows a 64-bit integer");
    return v;
  }

  const char* p_;
  const char* end_;
  const std::string& where_;
};

inline Header parse_header(const unsigned char* text, std::size_t len, const std::string& where) {
  return HeaderParser(reinterpret_cast<const char*>(text), len, where).parse();
}

inline void check_payload(const Header& h, std::uint64_t available, const std::string& where) {
  if (available < h.payload_bytes) {
    throw FormatError(where + ": truncated payload: shape " + shape_string(h.shape) + " of " +
                      dtype_descr(h.dtype) + " needs " + std::to_string(h.payload_bytes) +
                      " bytes, file has " + std::to_string(available));
  }
  if (available > h.payload_bytes) {
    throw FormatError(where + ": " + std::to_string(available - h.payload_bytes) +
                      " trailing bytes after the payload of shape " + shape_string(h.shape));
  }
}

// Builds the version 1.0 preamble + header for `shape`, padded with spaces and a final '\n' so
// the payload starts on a 64-byte boundary (what numpy writes, and what lets readers mmap aligned).
inline std::vector<unsigned char> make_preamble(DType dtype, const std::vector<std::int64_t>& shape,
                                                std::size_t* payload_bytes) {
  if (shape.size() > kNpyMaxRank) {
    throw ArgumentError("write_npy: shape has " + std::to_string(shape.size()) +
                        " dimensions; the rank limit is " + std::to_string(kNpyMaxRank));
  }
  for (std::int64_t d : shape) {
    if (d < 0) throw ArgumentError("write_npy: shape " + shape_string(shape) + " has a negative dimension");
  }
  std::int64_t count = 0, bytes = 0;
  if (!element_count(shape, &count) ||
      !checked_mul(count, static_cast<std::int64_t>(dtype_size(dtype)), &bytes) ||
      static_cast<std::uint64_t>(bytes) > std::numeric_limits<std::size_t>::max()) {
    throw ArgumentError("write_npy: shape " + shape_string(shape) + " overflows: byte size too large");
  }
  *payload_bytes = static_cast<std::size_t>(bytes);

  std::string dict = std::string("{'descr': '") + dtype_descr(dtype) +
                     "', 'fortran_order': False, 'shape': " + shape_string(shape) + ", }";
  const std::size_t unpadded = 10 + dict.size() + 1;  // + the terminating '\n'
  dict.append((64 - unpadded % 64) % 64, ' ');
  dict.push_back('\n');
  // With at most 8 dims of at most 19 digits the dict stays far below the 1.0 limit of 65535.
  const std::size_t hlen = dict.size();

  std::vector<unsigned char> out(kMagic, kMagic + 6);
  out.push_back(1);
  out.push_back(0);
  out.push_back(static_cast<unsigned char>(hlen & 0xff));
  out.push_back(static_cast<unsigned char>(hlen >> 8));
  out.insert(out.end(), dict.begin(), dict.end());
  return out;
}

inline std::string errno_text(int err) { return std::string(std::strerror(err)); }

}  // namespace npy_detail

// A dense C-order array as stored in an .npy file.
struct NpyArray {
  DType dtype = DType::f64;
  std::vector<std::int64_t> shape;   // () for a scalar
  std::vector<unsigned char> data;   // raw little-endian payload, size() * dtype_size(dtype) bytes

  // Number of elements: the product of `shape` (1 for a scalar shape).
  std::int64_t size() const {
    std::int64_t count = 0;
    if (!npy_detail::element_count(shape, &count)) {
      throw FormatError("npy: shape " + npy_detail::shape_string(shape) + " is negative or overflows");
    }
    return count;
  }

  // The elements converted to T (a floating-point or 16-bit type, so no conversion is
  // undefined; to a 16-bit type through float, to nearest).
  template <class T>
  std::vector<T> to_vector() const {
    static_assert(std::is_floating_point<T>::value || is_half_v<T>,
                  "NpyArray::to_vector: T must be a floating-point type");
    const std::int64_t count = size();
    const std::size_t item = dtype_size(dtype);
    if (data.size() / item != static_cast<std::uint64_t>(count) || data.size() % item != 0) {
      throw FormatError("npy: payload of " + std::to_string(data.size()) + " bytes does not match shape " +
                        npy_detail::shape_string(shape) + " of " + dtype_descr(dtype));
    }
    std::vector<T> out(static_cast<std::size_t>(count));
    const unsigned char* p = data.data();
    if (dtype == DType::f32) {
      for (std::size_t i = 0; i < out.size(); ++i) out[i] = static_cast<T>(npy_detail::load_f32(p + 4 * i));
    } else if (dtype == DType::f16) {
      if constexpr (std::is_same<T, fp16>::value) {
        // Bit for bit: no trip through float that could quiet a NaN's payload.
        for (std::size_t i = 0; i < out.size(); ++i)
          out[i] = Eigen::numext::bit_cast<fp16>(
              static_cast<std::uint16_t>(std::uint16_t(p[2 * i]) | (std::uint16_t(p[2 * i + 1]) << 8)));
      } else {
        for (std::size_t i = 0; i < out.size(); ++i) out[i] = static_cast<T>(npy_detail::load_f16(p + 2 * i));
      }
    } else if constexpr (is_half_v<T>) {
      // float64 to a 16-bit type through float: rounded twice, documented as such.
      for (std::size_t i = 0; i < out.size(); ++i)
        out[i] = static_cast<T>(static_cast<float>(npy_detail::load_f64(p + 8 * i)));
    } else {
      for (std::size_t i = 0; i < out.size(); ++i) out[i] = static_cast<T>(npy_detail::load_f64(p + 8 * i));
    }
    return out;
  }
};

// Parses a complete .npy file held in memory. Throws FormatError for anything malformed or
// unsupported; the payload is copied, so `bytes` need not outlive the call.
inline NpyArray parse_npy(const unsigned char* bytes, std::size_t n) {
  if (bytes == nullptr && n != 0) throw ArgumentError("parse_npy: bytes is null but n is " + std::to_string(n));
  const std::string where = "npy";
  const npy_detail::Preamble pre = npy_detail::parse_preamble(bytes, std::min<std::size_t>(n, 12), n, where);
  npy_detail::Header h = npy_detail::parse_header(bytes + pre.header_offset, pre.header_len, where);
  const std::size_t data_offset = pre.header_offset + pre.header_len;
  npy_detail::check_payload(h, n - data_offset, where);
  NpyArray a;
  a.dtype = h.dtype;
  a.shape = std::move(h.shape);
  a.data.assign(bytes + data_offset, bytes + data_offset + h.payload_bytes);
  return a;
}

// Reads an .npy file. IoError when the file cannot be opened or read, FormatError when its
// contents are malformed or unsupported. Memory is only allocated for sizes already checked
// against the actual file size.
inline NpyArray read_npy(const std::string& path) {
  const std::string where = "npy file '" + path + "'";
  std::ifstream in(path, std::ios::binary);
  if (!in) throw IoError(where + ": cannot open for reading: " + npy_detail::errno_text(errno));
  in.seekg(0, std::ios::end);
  const std::streamoff end = in.tellg();
  if (!in || end < 0) throw IoError(where + ": cannot determine the file size");
  in.seekg(0, std::ios::beg);
  const std::uint64_t total = static_cast<std::uint64_t>(end);

  auto read_exact = [&](unsigned char* dst, std::size_t n) {
    if (n == 0) return;
    in.read(reinterpret_cast<char*>(dst), static_cast<std::streamsize>(n));
    if (!in || static_cast<std::size_t>(in.gcount()) != n) {
      throw IoError(where + ": read failed (file shorter than its size, or an I/O error)");
    }
  };

  unsigned char head[12];
  const std::size_t avail = static_cast<std::size_t>(std::min<std::uint64_t>(total, sizeof head));
  read_exact(head, avail);
  const npy_detail::Preamble pre = npy_detail::parse_preamble(head, avail, total, where);
  // header_len <= total - header_offset was checked above, so this allocation is bounded by the file.
  std::vector<unsigned char> header(pre.header_len);
  const std::size_t already = avail - pre.header_offset;  // header bytes that sat in `head` (v1.0)
  const std::size_t from_head = std::min(already, pre.header_len);
  std::copy(head + pre.header_offset, head + pre.header_offset + from_head, header.begin());
  if (from_head < pre.header_len) {
    read_exact(header.data() + from_head, pre.header_len - from_head);
  } else if (already > from_head) {
    // A header shorter than the bytes we prefetched: rewind to the payload start.
    in.seekg(static_cast<std::streamoff>(pre.header_offset + pre.header_len), std::ios::beg);
  }
  npy_detail::Header h = npy_detail::parse_header(header.data(), header.size(), where);
  const std::uint64_t data_offset = pre.header_offset + pre.header_len;
  npy_detail::check_payload(h, total - data_offset, where);

  NpyArray a;
  a.dtype = h.dtype;
  a.shape = std::move(h.shape);
  a.data.resize(h.payload_bytes);  // equals the bytes remaining in the file
  read_exact(a.data.data(), a.data.size());
  return a;
}

// Encodes `data` (C order, product(shape) elements) as a version 1.0 .npy file in memory.
template <class T>
std::vector<unsigned char> encode_npy(const T* data, const std::vector<std::int64_t>& shape) {
  constexpr DType dtype = npy_detail::dtype_of<T>();
  std::size_t payload = 0;
  std::vector<unsigned char> out = npy_detail::make_preamble(dtype, shape, &payload);
  if (data == nullptr && payload != 0) throw ArgumentError("encode_npy: data is null for a non-empty shape");
  const std::size_t offset = out.size();
  out.resize(offset + payload);
  if (payload != 0) npy_detail::store_le(data, payload / sizeof(T), out.data() + offset);
  return out;
}

// Writes `data` (C order, product(shape) elements) to `path` as a version 1.0 .npy file.
// The file is replaced atomically: readers see either the old file or the complete new one.
template <class T>
void write_npy(const std::string& path, const T* data, const std::vector<std::int64_t>& shape) {
  if (data == nullptr) {
    std::size_t payload = 0;
    (void)npy_detail::make_preamble(npy_detail::dtype_of<T>(), shape, &payload);
    if (payload != 0) throw ArgumentError("write_npy: data is null for a non-empty shape");
  }
  write_file_atomic(path, encode_npy(data, shape), "write_npy");
}

}  // namespace io
}  // namespace ovq
