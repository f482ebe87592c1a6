// The one exception type of flashjit's C++ side. The C API maps `code` to a status and keeps the
// message in a thread-local slot; nothing in the library calls exit or abort.
#pragma once

#include <stdexcept>
#include <string>

namespace flashjit {

enum class ErrorCode : int {
  invalid_argument = 1,  // a caller's tensor, option or spec is not acceptable
  unsupported = 2,       // legal request that no kernel (or this device) can serve
  compile_failed = 3,    // NVRTC rejected a rendered kernel
  no_driver = 4,         // libcuda.so.1 missing or no usable device
  cuda_error = 5,        // a driver call failed
  cache_error = 6,       // the kernel cache directory is unusable (permissions, ownership)
  io_error = 7,          // a file could not be read or written
  out_of_resources = 8,  // e.g. a kernel needs more shared memory than the device has
  internal = 9,          // a bug in flashjit
};

const char* to_string(ErrorCode code);

class Error : public std::runtime_error {
 public:
  // `where` names the operation ("forward", "cache", "compile"); `message` says what is wrong and,
  // where possible, what was expected.
  Error(ErrorCode code, std::string where, std::string message);

  ErrorCode code() const noexcept { return code_; }
  const std::string& where() const noexcept { return where_; }
  const std::string& message() const noexcept { return message_; }

 private:
  ErrorCode code_;
  std::string where_;
  std::string message_;
};

}  // namespace flashjit
