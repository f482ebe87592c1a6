// Reading files that flashjit did not necessarily write (cache entries, tuning databases, spec
// files): by type and size before content, so a FIFO, a device such as /dev/zero or a huge file is
// refused with a reason instead of blocking or exhausting memory.
#pragma once

#include <sys/stat.h>

#include <cstddef>
#include <optional>
#include <string>
#include <string_view>

namespace flashjit::detail {

struct FileRead {
  std::optional<std::string> bytes;
  std::string problem;  // why not, when !bytes: "missing" when the path does not exist
  struct stat st {};     // the opened file's, when it was opened
};

// The bytes of a regular file of at most `limit` bytes. With follow_symlinks false a symbolic link
// is refused (O_NOFOLLOW). Never blocks on a FIFO (O_NONBLOCK).
FileRead read_regular_file(const std::string& path, size_t limit, bool follow_symlinks);
// The same for `name` inside the directory open as `dir_fd` (openat: the directory checked once is
// the one read from, whatever its path points at meanwhile); never follows a link.
FileRead read_regular_file_at(int dir_fd, const std::string& name, size_t limit);

// Writes all of `bytes` to `fd` (retrying short writes and EINTR); false with errno set on failure.
bool write_all(int fd, std::string_view bytes);

}  // namespace flashjit::detail
