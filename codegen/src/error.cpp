#include "flashjit/error.hpp"

namespace flashjit {

const char* to_string(ErrorCode code) {
  switch (code) {
    case ErrorCode::invalid_argument: return "invalid argument";
    case ErrorCode::unsupported: return "unsupported";
    case ErrorCode::compile_failed: return "compile failed";
    case ErrorCode::no_driver: return "no CUDA driver";
    case ErrorCode::cuda_error: return "CUDA error";
    case ErrorCode::cache_error: return "cache error";
    case ErrorCode::io_error: return "I/O error";
    case ErrorCode::out_of_resources: return "out of resources";
    case ErrorCode::internal: return "internal error";
  }
  return "unknown error";
}

Error::Error(ErrorCode code, std::string where, std::string message)
    : std::runtime_error("flashjit: " + where + ": " + message),
      code_(code),
      where_(std::move(where)),
      message_(std::move(message)) {}

}  // namespace flashjit
