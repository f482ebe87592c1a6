#include "disk_cache.hpp"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <mutex>
#include <set>
#include <thread>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "env.hpp"
#include "files.hpp"
#include "flashjit/codegen/render.hpp"
#include "flashjit/error.hpp"
#include "hashing.hpp"

namespace flashjit::detail {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

constexpr auto kStaleStagingAge = std::chrono::hours(1);
constexpr auto kQuarantineKeepAge = std::chrono::hours(24 * 7);

std::string errno_text(int error) { return std::strerror(error); }

Error io_error(const std::string& what, const std::string& path, int error) {
  return Error(ErrorCode::io_error, "cache", fmt::format("{} {}: {}", what, path, errno_text(error)));
}

void warn(const std::string& message) { fmt::print(stderr, "flashjit: warning: {}\n", message); }

// Writes `bytes` to a new file and fsyncs it; the file must not exist (staging dirs are private).
void write_file_durably(const std::string& path, std::string_view bytes) {
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0) throw io_error("cannot create", path, errno);
  if (!write_all(fd, bytes)) {
    const int error = errno;
    ::close(fd);
    throw io_error("cannot write", path, error);
  }
  if (::fsync(fd) != 0) {
    int error = errno;
    ::close(fd);
    throw io_error("cannot fsync", path, error);
  }
  ::close(fd);
}

void fsync_directory(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return;
  ::fsync(fd);
  ::close(fd);
}

// Why a path under the cache root may not be trusted (`st` from lstat), or "" when it may: loading
// a cubin runs its code, so every file and directory must be this user's, writable by no one else,
// and of the expected type (never a symlink, FIFO or device).
std::string untrusted_reason(const struct stat& st, bool directory) {
  if (S_ISLNK(st.st_mode)) return "it is a symbolic link";
  if (directory ? !S_ISDIR(st.st_mode) : !S_ISREG(st.st_mode))
    return directory ? "it is not a directory" : "it is not a regular file";
  if (st.st_uid != ::geteuid()) return fmt::format("it is owned by uid {}, not by this user (uid {})", st.st_uid, ::geteuid());
  if ((st.st_mode & (S_IWGRP | S_IWOTH)) != 0)
    return fmt::format("it is writable by group or others (mode {:04o})", st.st_mode & 07777);
  return "";
}

// A cache file's bytes, or the reason it cannot be used: also this user's and writable by no one
// else (symbolic links are not followed).
FileRead read_trusted_file(int dir_fd, const std::string& name, size_t limit) {
  FileRead r = read_regular_file_at(dir_fd, name, limit);
  if (r.bytes) {
    if (auto reason = untrusted_reason(r.st, /*directory=*/false); !reason.empty()) {
      r.bytes.reset();
      r.problem = reason;
    }
  }
  return r;
}

// Size limits per file kind: far above what flashjit writes (a cubin is about 1 MB, meta.json a few
// KB with the ptxas log), far below what would hurt to read.
constexpr size_t kMaxCubinBytes = 64u << 20;
constexpr size_t kMaxMetaBytes = 4u << 20;

// Throws Error(cache_error) naming the path and why, unless it is a directory this user owns that
// no one else can write (created 0700 when missing).
void require_private_dir(const std::string& path, const char* role) {
  if (::mkdir(path.c_str(), 0700) != 0 && errno != EEXIST)
    throw Error(ErrorCode::cache_error, "cache",
                fmt::format("cannot create the cache's {} directory {}: {}", role, path, errno_text(errno)));
  struct stat st {};
  if (::lstat(path.c_str(), &st) != 0)
    throw Error(ErrorCode::cache_error, "cache",
                fmt::format("cannot use the cache's {} directory {}: {}", role, path, errno_text(errno)));
  if (auto reason = untrusted_reason(st, /*directory=*/true); !reason.empty())
    throw Error(ErrorCode::cache_error, "cache",
                fmt::format("the cache's {} directory {} cannot be used: {} (remove it, or set FLASHJIT_CACHE_DIR)",
                            role, path, reason));
}

void make_private_dir(const std::string& path) {
  if (::mkdir(path.c_str(), 0700) != 0 && errno != EEXIST)
    throw Error(ErrorCode::cache_error, "cache",
                fmt::format("cannot create cache directory {}: {}", path, errno_text(errno)));
}

// An flock(2) on a per-key file, waited for with a bound. The kernel drops it when the holder dies,
// so a process killed mid-compile never blocks the others for long.
class KeyLock {
 public:
  KeyLock(const std::string& path, int timeout_ms) {
    fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_NOFOLLOW | O_CLOEXEC, 0600);  // never a planted link
    if (fd_ < 0) {
      warn(fmt::format("cannot open lock file {} ({}); compiling without it", path, errno_text(errno)));
      return;
    }
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
    auto pause = std::chrono::milliseconds(2);
    while (::flock(fd_, LOCK_EX | LOCK_NB) != 0) {
      if (errno != EWOULDBLOCK && errno != EINTR) break;
      if (std::chrono::steady_clock::now() >= deadline) {
        warn(fmt::format("waited {} ms for another process compiling the same kernel ({}); "
                         "compiling anyway", timeout_ms, path));
        break;
      }
      std::this_thread::sleep_for(pause);
      pause = std::min(pause * 2, std::chrono::milliseconds(50));
    }
  }
  ~KeyLock() {
    if (fd_ >= 0) ::close(fd_);  // releases the flock
  }
  KeyLock(const KeyLock&) = delete;
  KeyLock& operator=(const KeyLock&) = delete;

 private:
  int fd_ = -1;
};

void remove_older_than(const std::string& dir, std::chrono::hours age) {
  std::error_code ec;
  const auto now = fs::file_time_type::clock::now();
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    std::error_code time_ec;
    auto written = fs::last_write_time(it->path(), time_ec);
    if (!time_ec && now - written > age) {
      std::error_code remove_ec;
      fs::remove_all(it->path(), remove_ec);
    }
  }
}

json entry_stats_to_json(const EntryStats& e) {
  return json{{"name", e.name},
              {"registers", e.registers},
              {"barriers", e.barriers},
              {"static_smem_bytes", e.static_smem_bytes},
              {"stack_frame_bytes", e.stack_frame_bytes},
              {"spill_store_bytes", e.spill_store_bytes},
              {"spill_load_bytes", e.spill_load_bytes}};
}

EntryStats entry_stats_from_json(const json& j) {
  EntryStats e;
  e.name = j.at("name").get<std::string>();
  e.registers = j.at("registers").get<int>();
  e.barriers = j.at("barriers").get<int>();
  e.static_smem_bytes = j.at("static_smem_bytes").get<int>();
  e.stack_frame_bytes = j.at("stack_frame_bytes").get<int>();
  e.spill_store_bytes = j.at("spill_store_bytes").get<int>();
  e.spill_load_bytes = j.at("spill_load_bytes").get<int>();
  return e;
}

// The cubin's checksum bound to its key: a cubin copied in from another entry does not verify.
std::string cubin_checksum(const std::string& key, const std::string& cubin) { return hash_hex(key + "\n" + cubin); }

uint64_t unique_suffix() {
  static std::atomic<uint64_t> counter{0};
  return counter++;
}

}  // namespace

void ensure_private_directory(const std::string& dir) {
  std::error_code ec;
  fs::path path(dir);
  if (path.has_parent_path() && !fs::exists(path.parent_path(), ec))
    fs::create_directories(path.parent_path(), ec);
  make_private_dir(dir);
  struct stat st {};
  if (::stat(dir.c_str(), &st) != 0)
    throw Error(ErrorCode::cache_error, "cache",
                fmt::format("cannot use cache directory {}: {}", dir, errno_text(errno)));
  if (!S_ISDIR(st.st_mode))
    throw Error(ErrorCode::cache_error, "cache",
                fmt::format("cache path {} exists and is not a directory", dir));
  if (st.st_uid != ::geteuid())
    throw Error(ErrorCode::cache_error, "cache",
                fmt::format("cache directory {} is owned by uid {}, not by this user (uid {}); "
                            "loading a cached cubin runs its code, so flashjit only uses a cache "
                            "directory you own (set FLASHJIT_CACHE_DIR)",
                            dir, st.st_uid, ::geteuid()));
  if ((st.st_mode & (S_IWGRP | S_IWOTH)) != 0)
    throw Error(ErrorCode::cache_error, "cache",
                fmt::format("cache directory {} is writable by group or others (mode {:04o}); "
                            "another user could plant code there. Run chmod 700 on it or set "
                            "FLASHJIT_CACHE_DIR", dir, st.st_mode & 07777));
  if (::access(dir.c_str(), W_OK | X_OK) != 0)
    throw Error(ErrorCode::cache_error, "cache",
                fmt::format("cache directory {} is not writable: {} (set FLASHJIT_CACHE_DIR, or "
                            "FLASHJIT_DISABLE_DISK_CACHE=1)", dir, errno_text(errno)));
}

DiskCache::DiskCache(std::string root, int lock_timeout_ms)
    : root_(std::move(root)), lock_timeout_ms_(lock_timeout_ms) {
  ensure_private_directory(root_);
}

std::string DiskCache::arch_dir(const Arch& arch) {
  const std::string dir = root_ + "/" + arch.name();
  std::lock_guard<std::mutex> lock(prepared_mutex_);
  if (prepared_.count(dir) == 0) {
    require_private_dir(dir, "arch");
    require_private_dir(dir + "/.staging", "staging");
    require_private_dir(dir + "/.locks", "lock");
    require_private_dir(dir + "/.quarantine", "quarantine");
    prepared_.insert(dir);
    // Leftovers of processes killed while writing, and old quarantined entries.
    remove_older_than(dir + "/.staging", kStaleStagingAge);
    remove_older_than(dir + "/.quarantine", kQuarantineKeepAge);
  }
  return dir;
}

std::string DiskCache::entry_path(const DiskKey& key) const {
  return root_ + "/" + key.arch.name() + "/" + key.entry_name();
}

std::optional<CompiledKernel> DiskCache::load(const DiskKey& key, const KernelSpec& spec) {
  const std::string dir = entry_path(key);
  // The entry is opened once (never through a link) and checked through that descriptor; its files
  // are read relative to it, so what was checked is what is read.
  const int dir_fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  std::string problem;
  struct stat st {};
  if (dir_fd < 0) {
    if (errno == ENOENT) return std::nullopt;  // not cached (or a racing quarantine)
    if (::lstat(dir.c_str(), &st) != 0) return std::nullopt;
    problem = untrusted_reason(st, /*directory=*/true);
    if (problem.empty()) problem = fmt::format("cannot open it: {}", errno_text(errno));
  } else if (::fstat(dir_fd, &st) != 0) {
    problem = fmt::format("cannot stat it: {}", errno_text(errno));
  } else {
    problem = untrusted_reason(st, /*directory=*/true);
  }
  struct Closer {
    int fd;
    ~Closer() {
      if (fd >= 0) ::close(fd);
    }
  } closer{dir_fd};
  CompiledKernel kernel;
  if (problem.empty()) {
    try {
      const FileRead meta_file = read_trusted_file(dir_fd, "meta.json", kMaxMetaBytes);
      const FileRead cubin_file = meta_file.bytes ? read_trusted_file(dir_fd, "kernel.cubin", kMaxCubinBytes) : FileRead{};
      if (!meta_file.bytes) {
        problem = fmt::format("meta.json: {}", meta_file.problem);
      } else if (!cubin_file.bytes) {
        problem = fmt::format("kernel.cubin: {}", cubin_file.problem);
      } else {
        const json meta = json::parse(*meta_file.bytes);
        const std::string& cubin = *cubin_file.bytes;
        std::vector<std::string> symbols;
        for (const KernelEntry& e : kernel_layout(spec).entries) symbols.push_back(e.symbol);
        if (meta.at("format").get<int>() != kFormatVersion) {
          problem = "it was written by another cache format";
        } else if (meta.at("key").get<std::string>() != key.key) {
          problem = "its key does not match its name";
        } else if (KernelSpec::from_json(meta.at("spec")) != spec) {
          problem = fmt::format("its spec is {}, not the {} its name claims", KernelSpec::from_json(meta.at("spec")).name(),
                                spec.name());
        } else if (meta.at("template_hash").get<std::string>() != template_bundle().hash) {
          problem = "it was compiled from other templates";
        } else if (meta.at("entry_names").get<std::vector<std::string>>() != symbols) {
          problem = fmt::format("its entries are not {}'s", spec.name());
        } else if (cubin.size() != meta.at("cubin_bytes").get<size_t>()) {
          problem = fmt::format("kernel.cubin has {} bytes, meta.json says {}", cubin.size(),
                                meta.at("cubin_bytes").get<size_t>());
        } else if (cubin_checksum(key.key, cubin) != meta.at("cubin_hash").get<std::string>()) {
          problem = "kernel.cubin does not match its checksum";
        } else {
          kernel.spec = spec;
          kernel.cache_key = key.key;
          kernel.cubin = cubin;
          for (const auto& e : meta.at("entries")) kernel.entries.push_back(entry_stats_from_json(e));
          kernel.entry_names = std::move(symbols);
          kernel.compile_ms = meta.at("compile_ms").get<double>();
          kernel.log = meta.at("log").get<std::string>();
          kernel.from_disk = true;
          kernel.disk_entry = dir;
        }
      }
    } catch (const std::exception& e) {  // malformed JSON, a missing field, bad_alloc
      problem = fmt::format("meta.json is damaged ({})", e.what());
    }
  }
  if (!problem.empty()) {
    quarantine(key, problem);
    return std::nullopt;
  }
  return kernel;
}

void DiskCache::quarantine(const DiskKey& key, const std::string& reason) {
  const std::string destination =
      fmt::format("{}/.quarantine/{}.{}.{}.{}", arch_dir(key.arch), key.entry_name(),
                  std::chrono::system_clock::now().time_since_epoch().count(), ::getpid(),
                  unique_suffix());
  if (::rename(entry_path(key).c_str(), destination.c_str()) == 0) {
    ++quarantined_;
    warn(fmt::format("cache entry {} is damaged: {}; moved to {} and compiling again",
                     entry_path(key), reason, destination));
  }
  // ENOENT: another process moved it first.
}

bool DiskCache::publish(const DiskKey& key, const CompiledKernel& kernel,
                        const std::string& source_text) {
  const std::string dir = arch_dir(key.arch);
  // A fresh staging directory of this process's: the time makes a name left by a killed process
  // of the same PID differ, and mkdir must create it (never reuse what is there).
  std::string staging;
  for (int attempt = 0; attempt < 4 && staging.empty(); ++attempt) {
    const std::string name = fmt::format("{}/.staging/{}.{}.{}.{}", dir, key.entry_name(), ::getpid(),
                                         std::chrono::steady_clock::now().time_since_epoch().count(), unique_suffix());
    if (::mkdir(name.c_str(), 0700) == 0) staging = name;
    else if (errno != EEXIST) {
      warn(fmt::format("could not write cache entry for {}: cannot create {}: {}", key.spec_name, name,
                       errno_text(errno)));
      return false;
    }
  }
  if (staging.empty()) {
    warn(fmt::format("could not write cache entry for {}: no fresh staging directory", key.spec_name));
    return false;
  }
  json meta{{"format", kFormatVersion},
            {"key", key.key},
            {"spec_name", key.spec_name},
            {"spec", kernel.spec.to_json()},
            {"arch", key.arch.name()},
            {"nvrtc_version", nvrtc_version()},
            {"template_hash", std::string(template_bundle().hash)},
            {"cubin_bytes", kernel.cubin.size()},
            {"cubin_hash", cubin_checksum(key.key, kernel.cubin)},
            {"compile_ms", kernel.compile_ms},
            {"entry_names", kernel.entry_names},
            {"entries", json::array()},
            {"log", kernel.log},
            {"created_unix", std::chrono::duration_cast<std::chrono::seconds>(
                                 std::chrono::system_clock::now().time_since_epoch())
                                 .count()}};
  for (const auto& e : kernel.entries) meta["entries"].push_back(entry_stats_to_json(e));

  try {
    write_file_durably(staging + "/kernel.cubin", kernel.cubin);
    write_file_durably(staging + "/kernel.cu", source_text);
    write_file_durably(staging + "/meta.json", meta.dump(2));  // last: its presence means complete
    fsync_directory(staging);
  } catch (const Error& e) {
    std::error_code ec;
    fs::remove_all(staging, ec);
    warn(fmt::format("could not write cache entry for {}: {}", key.spec_name, e.message()));
    return false;
  }
  if (::rename(staging.c_str(), entry_path(key).c_str()) != 0) {
    const int error = errno;
    std::error_code ec;
    fs::remove_all(staging, ec);
    // EEXIST / ENOTEMPTY: another process (one that stopped waiting for the lock) got there first;
    // its entry holds the same bytes.
    if (error == EEXIST || error == ENOTEMPTY) return true;
    warn(fmt::format("could not publish cache entry {}: {}", entry_path(key), errno_text(error)));
    return false;
  }
  fsync_directory(dir);
  return true;
}

CompiledKernel DiskCache::load_or_compile(const DiskKey& key, const KernelSpec& spec,
                                          const std::string& source_text,
                                          const std::function<CompiledKernel()>& compile) {
  if (auto hit = load(key, spec)) return std::move(*hit);
  const std::string dir = arch_dir(key.arch);
  KeyLock lock(dir + "/.locks/" + key.entry_name() + ".lock", lock_timeout_ms_);
  if (auto hit = load(key, spec)) return std::move(*hit);  // compiled while we waited
  CompiledKernel kernel = compile();
  if (publish(key, kernel, source_text)) kernel.disk_entry = entry_path(key);  // else compiled, not cached
  return kernel;
}

}  // namespace flashjit::detail
