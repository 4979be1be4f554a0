#pragma once
// One exception family. Every message names the argument at fault and what was expected,
// and a call that throws leaves every state exactly as it was.
#include <sstream>
#include <stdexcept>
#include <string>

namespace ovq {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A caller passed a value, a shape or an option the call cannot accept.
class ArgumentError : public Error {
 public:
  using Error::Error;
};

// A file or byte stream is malformed, truncated, or of an unsupported kind.
class FormatError : public Error {
 public:
  using Error::Error;
};

// The operating system refused to open, read, write or rename a file.
class IoError : public Error {
 public:
  using Error::Error;
};

namespace detail {

template <class... Parts>
std::string concat(const Parts&... parts) {
  std::ostringstream out;
  (out << ... << parts);
  return out.str();
}

// Throws ArgumentError("<where>: <argument> <what>") unless `ok`.
template <class... Parts>
inline void require(bool ok, const char* where, const Parts&... what) {
  if (!ok) throw ArgumentError(concat(where, ": ", what...));
}

}  // namespace detail
}  // namespace ovq
