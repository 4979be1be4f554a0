#pragma once
// Whole-file reads and atomic whole-file writes, shared by the .npy and state-file formats.
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "ovq/core/error.hpp"

#if defined(__unix__) || defined(__APPLE__)
#include <fcntl.h>
#include <unistd.h>
#define OVQ_IO_POSIX 1
#endif

namespace ovq::io {

namespace file_detail {

inline std::string errno_text(int err) { return std::strerror(err); }

// Unique per process and call, so concurrent writers of one path never share a temporary.
inline std::string temp_path_for(const std::string& path) {
  static std::atomic<unsigned long> counter{0};
#if defined(OVQ_IO_POSIX)
  const long pid = static_cast<long>(::getpid());
#else
  const long pid = 0;
#endif
  return path + ".tmp." + std::to_string(pid) + "." + std::to_string(counter.fetch_add(1));
}

// Best effort: makes the rename itself durable.
inline void sync_parent_dir(const std::string& path) {
#if defined(OVQ_IO_POSIX)
  const std::size_t slash = path.find_last_of('/');
  const std::string dir =
      slash == std::string::npos ? "." : (slash == 0 ? "/" : path.substr(0, slash));
  const int fd = ::open(dir.c_str(), O_RDONLY);
  if (fd >= 0) {
    (void)::fsync(fd);
    (void)::close(fd);
  }
#else
  (void)path;
#endif
}

}  // namespace file_detail

// Replaces `path` with `size` bytes atomically: write a temporary file in the same directory,
// flush, fsync, rename. A crash at any point leaves either the old file or the new one.
inline void write_file_atomic(const std::string& path, const unsigned char* bytes,
                              std::size_t size, const char* where) {
  using file_detail::errno_text;
  const std::string tmp = file_detail::temp_path_for(path);
  std::FILE* f = std::fopen(tmp.c_str(), "wb");
  if (f == nullptr) {
    throw IoError(std::string(where) + ": cannot create temporary file '" + tmp +
                  "': " + errno_text(errno));
  }
  auto fail = [&](const char* what, int err) {
    if (f != nullptr) std::fclose(f);
    std::remove(tmp.c_str());
    throw IoError(std::string(where) + ": " + what + " '" + tmp + "': " + errno_text(err));
  };
  if (size > 0 && std::fwrite(bytes, 1, size, f) != size) fail("cannot write", errno);
  if (std::fflush(f) != 0) fail("cannot flush", errno);
#if defined(OVQ_IO_POSIX)
  if (::fsync(::fileno(f)) != 0) fail("cannot fsync", errno);
#endif
  const int closed = std::fclose(f);
  f = nullptr;
  if (closed != 0) fail("cannot close", errno);
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    std::remove(tmp.c_str());
    throw IoError(std::string(where) + ": cannot rename '" + tmp + "' to '" + path +
                  "': " + errno_text(err));
  }
  file_detail::sync_parent_dir(path);
}

inline void write_file_atomic(const std::string& path, const std::vector<unsigned char>& bytes,
                              const char* where) {
  write_file_atomic(path, bytes.data(), bytes.size(), where);
}

// Reads a whole file. The buffer is sized from the file's own size, read back to the end.
inline std::vector<unsigned char> read_file(const std::string& path, const char* where) {
  using file_detail::errno_text;
  std::FILE* f = std::fopen(path.c_str(), "rb");
  if (f == nullptr) {
    throw IoError(std::string(where) + ": cannot open '" + path + "': " + errno_text(errno));
  }
  std::vector<unsigned char> out;
  unsigned char buf[1 << 16];
  for (;;) {
    const std::size_t n = std::fread(buf, 1, sizeof buf, f);
    out.insert(out.end(), buf, buf + n);
    if (n < sizeof buf) break;
  }
  const bool failed = std::ferror(f) != 0;
  std::fclose(f);
  if (failed) throw IoError(std::string(where) + ": cannot read '" + path + "'");
  return out;
}

}  // namespace ovq::io
