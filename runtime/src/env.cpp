#include "env.hpp"

#include <cstdlib>
#include <string_view>

#include <fmt/format.h>

#include "flashjit/error.hpp"

namespace flashjit::detail {
namespace {

std::optional<std::string> read(const char* name) {
  const char* value = std::getenv(name);
  if (value == nullptr || *value == '\0') return std::nullopt;
  return std::string(value);
}

bool read_flag(const char* name) {
  auto value = read(name);
  if (!value) return false;
  if (*value == "1" || *value == "true" || *value == "yes" || *value == "on") return true;
  if (*value == "0" || *value == "false" || *value == "no" || *value == "off") return false;
  throw Error(ErrorCode::invalid_argument, "environment",
              fmt::format("{}='{}' is not a boolean (use 1 or 0)", name, *value));
}

int read_int(const char* name, int fallback) {
  auto value = read(name);
  if (!value) return fallback;
  char* end = nullptr;
  long parsed = std::strtol(value->c_str(), &end, 10);
  if (*end != '\0' || parsed < 0 || parsed > 24L * 3600 * 1000)
    throw Error(ErrorCode::invalid_argument, "environment",
                fmt::format("{}='{}' is not a non-negative integer", name, *value));
  return static_cast<int>(parsed);
}

Environment read_environment() {
  Environment env;
  env.cache_dir = read("FLASHJIT_CACHE_DIR");
  env.disable_disk_cache = read_flag("FLASHJIT_DISABLE_DISK_CACHE");
  env.tuning_db = read("FLASHJIT_TUNING_DB");
  env.dump_dir = read("FLASHJIT_DUMP_DIR");
  env.verbose = read_flag("FLASHJIT_VERBOSE");
  env.lock_timeout_ms = read_int("FLASHJIT_LOCK_TIMEOUT_MS", env.lock_timeout_ms);
  env.nccl_library = read("FLASHJIT_NCCL_LIBRARY");
  return env;
}

}  // namespace

const Environment& environment() {
  static const Environment env = read_environment();
  return env;
}

std::string default_cache_dir() {
  if (auto dir = environment().cache_dir) return *dir;
  if (auto xdg = read("XDG_CACHE_HOME")) return *xdg + "/flashjit";
  if (auto home = read("HOME")) return *home + "/.cache/flashjit";
  throw Error(ErrorCode::cache_error, "cache",
              "no cache directory: set FLASHJIT_CACHE_DIR (HOME and XDG_CACHE_HOME are unset)");
}

}  // namespace flashjit::detail
