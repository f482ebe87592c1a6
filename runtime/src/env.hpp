// Every FLASHJIT_* environment variable is read here and nowhere else (README lists them).
#pragma once

#include <optional>
#include <string>

namespace flashjit::detail {

struct Environment {
  std::optional<std::string> cache_dir;  // FLASHJIT_CACHE_DIR
  bool disable_disk_cache = false;       // FLASHJIT_DISABLE_DISK_CACHE=1
  std::optional<std::string> tuning_db;  // FLASHJIT_TUNING_DB
  std::optional<std::string> dump_dir;   // FLASHJIT_DUMP_DIR: write each compiled source + PTX
  bool verbose = false;                  // FLASHJIT_VERBOSE=1: compile log and cache decisions
  int lock_timeout_ms = 120000;          // FLASHJIT_LOCK_TIMEOUT_MS: wait for another compiler
  std::optional<std::string> nccl_library;  // FLASHJIT_NCCL_LIBRARY: NCCL's path (else libnccl.so.2)
};

// Read once, on first use.
const Environment& environment();

// $FLASHJIT_CACHE_DIR, else $XDG_CACHE_HOME/flashjit, else $HOME/.cache/flashjit.
std::string default_cache_dir();

}  // namespace flashjit::detail
