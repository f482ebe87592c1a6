#include "files.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include <fmt/format.h>

namespace flashjit::detail {

namespace {

FileRead read_opened(int dir_fd, const std::string& path, size_t limit, bool follow_symlinks) {
  FileRead r;
  const int fd = ::openat(dir_fd, path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC | (follow_symlinks ? 0 : O_NOFOLLOW));
  if (fd < 0) {
    r.problem = errno == ENOENT ? "missing"
                : errno == ELOOP ? "it is a symbolic link"
                                 : fmt::format("cannot open it: {}", std::strerror(errno));
    return r;
  }
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};
  if (::fstat(fd, &r.st) != 0) {
    r.problem = fmt::format("cannot stat it: {}", std::strerror(errno));
    return r;
  }
  if (!S_ISREG(r.st.st_mode)) {
    r.problem = S_ISDIR(r.st.st_mode) ? "it is a directory, not a file" : "it is not a regular file";
    return r;
  }
  if (static_cast<size_t>(r.st.st_size) > limit) {
    r.problem = fmt::format("it has {} bytes, over the {} allowed", r.st.st_size, limit);
    return r;
  }
  std::string bytes;
  bytes.reserve(static_cast<size_t>(r.st.st_size));
  char buffer[1 << 16];
  for (;;) {
    const ssize_t n = ::read(fd, buffer, sizeof buffer);
    if (n < 0 && (errno == EINTR || errno == EAGAIN)) continue;
    if (n < 0) {
      r.problem = fmt::format("cannot read it: {}", std::strerror(errno));
      return r;
    }
    if (n == 0) break;
    bytes.append(buffer, static_cast<size_t>(n));
    if (bytes.size() > limit) {
      r.problem = fmt::format("it grew past {} bytes while read", limit);
      return r;
    }
  }
  r.bytes = std::move(bytes);
  return r;
}

}  // namespace

FileRead read_regular_file(const std::string& path, size_t limit, bool follow_symlinks) {
  return read_opened(AT_FDCWD, path, limit, follow_symlinks);
}

FileRead read_regular_file_at(int dir_fd, const std::string& name, size_t limit) {
  return read_opened(dir_fd, name, limit, /*follow_symlinks=*/false);
}

bool write_all(int fd, std::string_view bytes) {
  size_t written = 0;
  while (written < bytes.size()) {
    const ssize_t n = ::write(fd, bytes.data() + written, bytes.size() - written);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return false;
    if (n == 0) {
      errno = EIO;
      return false;
    }
    written += static_cast<size_t>(n);
  }
  return true;
}

}  // namespace flashjit::detail
