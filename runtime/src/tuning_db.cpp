// The tuning database: device stamps, problem keys, strict JSON, atomic merge-on-save, and the
// ordered sources dispatch consults.
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <atomic>
#include <mutex>
#include <set>
#include <sstream>
#include <unordered_map>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "flashjit/error.hpp"
#include "flashjit/kernel_cache.hpp"
#include "flashjit/tuning.hpp"
#include "family.hpp"
#include "files.hpp"
#include "json_text.hpp"

namespace flashjit {

using nlohmann::json;

// ---------------------------------------------------------------------------------------------
// DeviceStamp and ProblemKey

DeviceStamp DeviceStamp::of(const DeviceProperties& device) {
  DeviceStamp s;
  s.name = device.name;
  s.cc_major = device.cc_major;
  s.cc_minor = device.cc_minor;
  s.sm_count = device.sm_count;
  s.memory_bytes = device.total_memory;
  s.driver_version = device.driver_version;
  s.nvrtc_version = flashjit::nvrtc_version();
  return s;
}

std::string DeviceStamp::describe() const {
  return fmt::format("{} (sm_{}{}, {} SMs, {:.0f} GB, driver {}, NVRTC {})", name, cc_major, cc_minor, sm_count,
                     memory_bytes / 1e9, driver_version, nvrtc_version);
}

bool DeviceStamp::operator==(const DeviceStamp& o) const {
  return name == o.name && cc_major == o.cc_major && cc_minor == o.cc_minor && sm_count == o.sm_count &&
         memory_bytes == o.memory_bytes && driver_version == o.driver_version && nvrtc_version == o.nvrtc_version;
}

int ProblemKey::bucket(int64_t n) {
  int64_t b = 64;
  while (b < n && b < (int64_t{1} << 30)) b *= 2;
  return static_cast<int>(b);
}

int ProblemKey::query_rows(int64_t n) {
  int b = 16;
  while (b < n && b < 128) b *= 2;
  return b;
}

std::string ProblemKey::describe() const {
  return fmt::format("{} {} d{}{}{} s<={} bh<={}{}{}", to_string(family), to_string(dtype), head_dim,
                     mask == MaskKind::none ? "" : fmt::format(" {}", to_string(mask)), softcap ? " softcap" : "",
                     seqlen_bucket, batch_heads_bucket,
                     query_rows_bucket > 0 ? fmt::format(" rows<={}", query_rows_bucket) : "", head_major ? " bhsd" : "");
}

bool ProblemKey::operator==(const ProblemKey& o) const {
  return family == o.family && dtype == o.dtype && head_dim == o.head_dim && mask == o.mask && softcap == o.softcap &&
         seqlen_bucket == o.seqlen_bucket && batch_heads_bucket == o.batch_heads_bucket && head_major == o.head_major &&
         query_rows_bucket == o.query_rows_bucket;
}

namespace {

struct ProblemKeyHash {
  size_t operator()(const ProblemKey& k) const noexcept {
    size_t h = 0;
    for (long long field : {static_cast<long long>(k.family), static_cast<long long>(k.dtype),
                            static_cast<long long>(k.head_dim), static_cast<long long>(k.mask),
                            static_cast<long long>(k.softcap), static_cast<long long>(k.seqlen_bucket),
                            static_cast<long long>(k.batch_heads_bucket), static_cast<long long>(k.head_major),
                            static_cast<long long>(k.query_rows_bucket)})
      h = h * 1000003u ^ std::hash<long long>{}(field);
    return h;
  }
};

}  // namespace

// ---------------------------------------------------------------------------------------------
// JSON

namespace {

constexpr const char* kFormat = "flashjit-tuning-db";
constexpr int kVersion = 1;

// Strict reading of one JSON object: every listed field required, nothing else allowed; errors
// carry the path of the offending value.
class Reader {
 public:
  Reader(const json& j, std::string path, const std::string& origin) : j_(j), path_(std::move(path)), origin_(origin) {
    if (!j_.is_object()) throw fail(fmt::format("{} must be an object, got {}", where(), j_.type_name()));
  }
  // `fields` are required, `optional` ones may be absent; nothing else is allowed.
  void expect_fields(std::initializer_list<const char*> fields, std::initializer_list<const char*> optional = {}) const {
    auto listed = [](std::initializer_list<const char*> list, const std::string& key) {
      return std::find_if(list.begin(), list.end(), [&](const char* f) { return key == f; }) != list.end();
    };
    for (const auto& [key, value] : j_.items())
      if (!listed(fields, key) && !listed(optional, key))
        throw fail(fmt::format("{}: unknown field '{}' (known: {}{}{})", where(), key, fmt::join(fields, ", "),
                               optional.size() ? ", " : "", fmt::join(optional, ", ")));
    for (const char* f : fields)
      if (!j_.contains(f)) throw fail(fmt::format("{}: missing field '{}'", where(), f));
  }
  bool has(const char* key) const { return j_.contains(key); }
  const json& at(const char* key) const { return j_.at(key); }
  std::string path(const char* key) const { return path_.empty() ? key : path_ + "." + key; }
  std::string text(const char* key) const {
    const json& v = j_.at(key);
    if (!v.is_string()) throw fail(fmt::format("{} must be a string, got {}", path(key), v.dump()));
    return v.get<std::string>();
  }
  // An integer in [min, max], checked in 64 bits: a value past the field's range is refused, never
  // truncated (head_dim 4294967360 would read as 64).
  int64_t integer(const char* key, int64_t min, int64_t max = std::numeric_limits<int32_t>::max()) const {
    const json& v = j_.at(key);
    const bool in_range = v.is_number_integer() &&
                          !(v.is_number_unsigned() && v.get<uint64_t>() > static_cast<uint64_t>(max)) &&
                          v.get<int64_t>() >= min && v.get<int64_t>() <= max;
    if (!in_range) throw fail(fmt::format("{} must be an integer from {} to {}, got {}", path(key), min, max, v.dump()));
    return v.get<int64_t>();
  }
  double number(const char* key) const {
    const json& v = j_.at(key);
    if (!v.is_number() || !(v.get<double>() >= 0) || !std::isfinite(v.get<double>()))
      throw fail(fmt::format("{} must be a finite number >= 0, got {}", path(key), v.dump()));
    return v.get<double>();
  }
  bool boolean(const char* key) const {
    const json& v = j_.at(key);
    if (!v.is_boolean()) throw fail(fmt::format("{} must be true or false, got {}", path(key), v.dump()));
    return v.get<bool>();
  }
  template <class Parse>
  auto parsed(const char* key, Parse&& parse) const {
    try {
      return parse(text(key));
    } catch (const Error& e) {
      throw fail(fmt::format("{}: {}", path(key), e.message()));
    }
  }
  KernelSpec spec(const char* key) const {
    try {
      KernelSpec s = KernelSpec::from_json(j_.at(key));
      if (auto reason = s.validate()) throw Error(ErrorCode::invalid_argument, "spec", *reason);
      return s;
    } catch (const Error& e) {
      throw fail(fmt::format("{}: {}", path(key), e.message()));
    }
  }
  Error fail(const std::string& message) const {
    return Error(ErrorCode::invalid_argument, "tuning db", fmt::format("{}: {}", origin_, message));
  }

 private:
  std::string where() const { return path_.empty() ? "the document" : path_; }
  const json& j_;
  std::string path_;
  const std::string& origin_;
};

json stamp_json(const DeviceStamp& s) {
  return json{{"name", s.name},
              {"compute_capability", fmt::format("{}.{}", s.cc_major, s.cc_minor)},
              {"sm_count", s.sm_count},
              {"memory_bytes", s.memory_bytes},
              {"driver_version", s.driver_version},
              {"nvrtc_version", s.nvrtc_version}};
}

DeviceStamp read_stamp(const Reader& r) {
  r.expect_fields({"name", "compute_capability", "sm_count", "memory_bytes", "driver_version", "nvrtc_version"});
  DeviceStamp s;
  s.name = r.text("name");
  const std::string cc = r.text("compute_capability");
  if (std::sscanf(cc.c_str(), "%d.%d", &s.cc_major, &s.cc_minor) != 2 ||
      fmt::format("{}.{}", s.cc_major, s.cc_minor) != cc)
    throw r.fail(fmt::format("{} must look like \"9.0\", got \"{}\"", r.path("compute_capability"), cc));
  s.sm_count = static_cast<int>(r.integer("sm_count", 1));
  s.memory_bytes = r.integer("memory_bytes", 0, std::numeric_limits<int64_t>::max());
  s.driver_version = static_cast<int>(r.integer("driver_version", 0));
  s.nvrtc_version = r.text("nvrtc_version");
  return s;
}

json problem_json(const ProblemKey& p) {
  json j{{"family", to_string(p.family)},   {"dtype", to_string(p.dtype)},
         {"head_dim", p.head_dim},          {"mask", to_string(p.mask)},
         {"softcap", p.softcap},            {"seqlen_bucket", p.seqlen_bucket},
         {"batch_heads_bucket", p.batch_heads_bucket}, {"layout", p.head_major ? "bhsd" : "bshd"}};
  if (p.query_rows_bucket > 0) j["query_rows_bucket"] = p.query_rows_bucket;
  return j;
}

ProblemKey read_problem(const Reader& r) {
  r.expect_fields({"family", "dtype", "head_dim", "mask", "softcap", "seqlen_bucket", "batch_heads_bucket"},
                  {"layout", "query_rows_bucket"});
  ProblemKey p;
  p.family = r.parsed("family", parse_family);
  if (p.family == Family::reference_fwd)
    throw r.fail(fmt::format("{}: {} is not tuned (fa2_fwd, fa2_bwd, sm90_fwd, kvcache_fwd)", r.path("family"),
                             to_string(p.family)));
  p.dtype = r.parsed("dtype", parse_dtype);
  p.head_dim = static_cast<int>(r.integer("head_dim", 1, 256));
  p.mask = r.parsed("mask", parse_mask);
  p.softcap = r.boolean("softcap");
  p.seqlen_bucket = static_cast<int>(r.integer("seqlen_bucket", 1, 1 << 30));
  p.batch_heads_bucket = static_cast<int>(r.integer("batch_heads_bucket", 1, 1 << 30));
  for (const char* key : {"seqlen_bucket", "batch_heads_bucket"}) {
    const int64_t v = r.integer(key, 1, 1 << 30);
    if (ProblemKey::bucket(v) != v)
      throw r.fail(fmt::format("{} must be a power of two >= 64, got {}", r.path(key), v));
  }
  if (r.has("layout")) {
    const std::string layout = r.text("layout");
    if (layout != "bshd" && layout != "bhsd")
      throw r.fail(fmt::format("{} must be \"bshd\" or \"bhsd\", got \"{}\"", r.path("layout"), layout));
    p.head_major = layout == "bhsd";
  }
  const bool kvcache = p.family == Family::kvcache_fwd;
  if (kvcache != r.has("query_rows_bucket"))
    throw r.fail(fmt::format("{}: {} entries {} query_rows_bucket", r.path("query_rows_bucket"), to_string(p.family),
                             kvcache ? "need a" : "have no"));
  if (kvcache) {
    const int64_t rows = r.integer("query_rows_bucket", 16, 128);
    if (ProblemKey::query_rows(rows) != rows)
      throw r.fail(fmt::format("{} must be 16, 32, 64 or 128, got {}", r.path("query_rows_bucket"), rows));
    p.query_rows_bucket = static_cast<int>(rows);
  }
  return p;
}

TunedEntry read_entry(const json& j, const std::string& path, const std::string& origin) {
  const Reader r(j, path, origin);
  r.expect_fields({"device", "problem", "spec", "median_ms", "runner_ups", "tuned_at"});
  TunedEntry e;
  e.device = read_stamp(Reader(r.at("device"), r.path("device"), origin));
  e.problem = read_problem(Reader(r.at("problem"), r.path("problem"), origin));
  e.spec = r.spec("spec");
  // (A family keyed by another's entries, as sm90_bwd by fa2_bwd's, serves that family's problems.)
  if (detail::runtime_family(e.spec.family).tuning_key != e.problem.family || e.spec.dtype != e.problem.dtype ||
      e.spec.head_dim != e.problem.head_dim || e.spec.mask != e.problem.mask || e.spec.has_softcap != e.problem.softcap)
    throw r.fail(fmt::format("{}: spec {} does not serve the problem {}", path, e.spec.name(), e.problem.describe()));
  e.median_ms = r.number("median_ms");
  const json& runner_ups = r.at("runner_ups");
  if (!runner_ups.is_array()) throw r.fail(fmt::format("{} must be an array", r.path("runner_ups")));
  for (size_t i = 0; i < runner_ups.size(); ++i) {
    const Reader u(runner_ups[i], fmt::format("{}[{}]", r.path("runner_ups"), i), origin);
    u.expect_fields({"spec", "median_ms"});
    e.runner_ups.emplace_back(u.spec("spec"), u.number("median_ms"));
  }
  e.tuned_at = r.text("tuned_at");
  return e;
}

json entry_json(const TunedEntry& e) {
  json runner_ups = json::array();
  for (const auto& [spec, ms] : e.runner_ups) runner_ups.push_back({{"spec", spec.to_json()}, {"median_ms", ms}});
  return json{{"device", stamp_json(e.device)}, {"problem", problem_json(e.problem)}, {"spec", e.spec.to_json()},
              {"median_ms", e.median_ms},      {"runner_ups", runner_ups},          {"tuned_at", e.tuned_at}};
}

Error io_error(const std::string& path, const std::string& what) {
  return Error(ErrorCode::io_error, "tuning db", fmt::format("{}: {}: {}", path, what, std::strerror(errno)));
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// TuningDb

TuningDb TuningDb::parse(const std::string& text, const std::string& origin) {
  const json j = detail::parse_json_text(text, origin, "tuning db");
  const Reader r(j, "", origin);
  r.expect_fields({"format", "version", "entries"});
  if (r.text("format") != kFormat)
    throw r.fail(fmt::format("format must be \"{}\", got \"{}\"", kFormat, r.text("format")));
  if (r.integer("version", 0) != kVersion)
    throw r.fail(fmt::format("version {} is not supported (this flashjit reads version {})", r.integer("version", 0),
                             kVersion));
  const json& entries = r.at("entries");
  if (!entries.is_array()) throw r.fail("entries must be an array");
  TuningDb db;
  for (size_t i = 0; i < entries.size(); ++i) db.upsert(read_entry(entries[i], fmt::format("entries[{}]", i), origin));
  return db;
}

TuningDb TuningDb::load(const std::string& path) {
  // A tuning database of thousands of entries is a few MB; a FIFO or a device is refused unread.
  constexpr size_t kMaxBytes = 64u << 20;
  const detail::FileRead file = detail::read_regular_file(path, kMaxBytes, /*follow_symlinks=*/true);
  if (!file.bytes)
    throw Error(ErrorCode::io_error, "tuning db",
                fmt::format("{}: cannot read the tuning database: {}", path,
                            file.problem == "missing" ? "no such file" : file.problem));
  return parse(*file.bytes, path);
}

std::string TuningDb::dump() const {
  json entries = json::array();
  for (const auto& e : entries_) entries.push_back(entry_json(e));
  return json{{"format", kFormat}, {"version", kVersion}, {"entries", entries}}.dump(1) + "\n";
}

const TunedEntry* TuningDb::find(const DeviceStamp& device, const ProblemKey& problem) const {
  for (const auto& e : entries_)
    if (e.device == device && e.problem == problem) return &e;
  return nullptr;
}

void TuningDb::upsert(TunedEntry entry) {
  for (auto& e : entries_)
    if (e.device == entry.device && e.problem == entry.problem) {
      e = std::move(entry);
      return;
    }
  entries_.push_back(std::move(entry));
}

void TuningDb::merge(const TuningDb& newer) {
  for (const auto& e : newer.entries_) upsert(e);
}

void TuningDb::save_merged(const std::string& requested_path) const {
  // A symbolic link is resolved explicitly: the database it points at is merged and replaced, and
  // the link stays (replacing the link itself would leave the target stale).
  std::string path = requested_path;
  {
    std::error_code ec;
    if (std::filesystem::is_symlink(requested_path, ec)) {
      const auto target = std::filesystem::canonical(requested_path, ec);
      if (ec)
        throw Error(ErrorCode::io_error, "tuning db",
                    fmt::format("{} is a symbolic link whose target cannot be resolved: {}", requested_path, ec.message()));
      path = target.string();
    }
  }
  const std::string lock_path = path + ".lock";
  const int lock_fd = ::open(lock_path.c_str(), O_RDWR | O_CREAT | O_NOFOLLOW | O_CLOEXEC, 0644);
  if (lock_fd < 0) throw io_error(lock_path, "cannot create the lock file");
  struct Unlock {
    int fd;
    ~Unlock() { ::close(fd); }  // closing releases the flock
  } unlock{lock_fd};
  while (::flock(lock_fd, LOCK_EX) != 0)
    if (errno != EINTR) throw io_error(lock_path, "cannot lock");

  TuningDb merged;
  mode_t mode = 0644;
  struct stat existing {};
  if (::lstat(path.c_str(), &existing) == 0) {
    if (!S_ISREG(existing.st_mode))
      throw Error(ErrorCode::io_error, "tuning db",
                  fmt::format("{} is not a regular file, so it is left alone", path));
    merged = load(path);  // a damaged file is refused, not replaced
    mode = existing.st_mode & 07777;  // the user's mode (600, say) is kept
  }
  merged.merge(*this);
  const std::string text = merged.dump();
  parse(text, path);  // what is written must load: the same rules as on load (a bucket of 0, say)

  // A fresh temporary file beside the target (the same file system, for the rename): O_EXCL and
  // O_NOFOLLOW, so a planted file or symlink of that name is never written through.
  static std::atomic<unsigned> counter{0};
  std::string tmp;
  int fd = -1;
  for (int attempt = 0; attempt < 8 && fd < 0; ++attempt) {
    tmp = fmt::format("{}.tmp.{}.{}", path, ::getpid(), counter++);
    fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
    if (fd < 0 && errno != EEXIST) throw io_error(tmp, "cannot write");
  }
  if (fd < 0) throw io_error(tmp, "cannot create a fresh temporary file");
  if (::fchmod(fd, mode) != 0 || !detail::write_all(fd, text) || ::fsync(fd) != 0) {
    const Error e = io_error(tmp, "write failed");
    ::close(fd);
    ::unlink(tmp.c_str());
    throw e;
  }
  if (::close(fd) != 0) {
    const Error e = io_error(tmp, "cannot flush");
    ::unlink(tmp.c_str());
    throw e;
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const Error e = io_error(path, "cannot replace");
    ::unlink(tmp.c_str());
    throw e;
  }
}

// ---------------------------------------------------------------------------------------------
// The bundled database

namespace detail {
const char* bundled_tuning_db_json();  // generated from runtime/tuning/bundled.json
}

const TuningDb& bundled_tuning_db() {
  static const TuningDb db = TuningDb::parse(detail::bundled_tuning_db_json(), "the bundled tuning database");
  return db;
}

// ---------------------------------------------------------------------------------------------
// TuningSources

struct TuningSources::Impl {
  std::function<void(const std::string&)> warn;
  std::atomic<bool> has_entries{false};
  mutable std::mutex mutex;
  TuningDb in_memory, user, bundled;
  std::string user_origin = "the user tuning database";
  mutable std::set<std::string> warned;  // "<origin>|<device>"
  // lookup_spec's answers by problem, each with the device it was found for.
  struct Remembered {
    DeviceStamp device;
    std::optional<KernelSpec> spec;
  };
  mutable std::unordered_map<ProblemKey, std::vector<Remembered>, ProblemKeyHash> remembered;

  void update_has_entries() {  // under the mutex, after every change of a source
    remembered.clear();
    has_entries.store(!in_memory.entries().empty() || !user.entries().empty() || !bundled.entries().empty(),
                      std::memory_order_release);
  }

  // Entries of `db` for this problem exist, but none for this device: say so once.
  const TunedEntry* find(const TuningDb& db, const std::string& origin, const DeviceStamp& device,
                         const ProblemKey& problem) const {
    if (const TunedEntry* e = db.find(device, problem)) return e;
    for (const auto& e : db.entries())
      if (e.device != device) {
        const std::string key = origin + "|" + device.describe();
        if (warned.insert(key).second && warn)
          warn(fmt::format("flashjit: {} has entries for {}, not this {}; they are skipped (re-tune with "
                           "flashjit-tune)", origin, e.device.describe(), device.describe()));
        break;
      }
    return nullptr;
  }
};

TuningSources::TuningSources(std::function<void(const std::string&)> warn) : impl_(std::make_unique<Impl>()) {
  impl_->warn = warn ? std::move(warn) : [](const std::string& m) { std::fprintf(stderr, "%s\n", m.c_str()); };
}
TuningSources::~TuningSources() = default;

void TuningSources::add_in_memory(TunedEntry entry) {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  impl_->in_memory.upsert(std::move(entry));
  impl_->update_has_entries();
}

void TuningSources::set_user_db(TuningDb db, std::string origin) {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  impl_->user = std::move(db);
  impl_->user_origin = std::move(origin);
  impl_->update_has_entries();
}

void TuningSources::set_bundled_db(TuningDb db) {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  impl_->bundled = std::move(db);
  impl_->update_has_entries();
}

bool TuningSources::empty() const { return !impl_->has_entries.load(std::memory_order_acquire); }

std::optional<KernelSpec> TuningSources::lookup_spec(const DeviceStamp& device, const ProblemKey& problem) const {
  {
    std::lock_guard<std::mutex> lock(impl_->mutex);
    if (auto it = impl_->remembered.find(problem); it != impl_->remembered.end())
      for (const Impl::Remembered& r : it->second)
        if (r.device == device) return r.spec;
  }
  auto entry = lookup(device, problem);
  std::optional<KernelSpec> spec = entry ? std::optional<KernelSpec>(std::move(entry->spec)) : std::nullopt;
  std::lock_guard<std::mutex> lock(impl_->mutex);
  if (impl_->remembered.size() > 4096) impl_->remembered.clear();  // (a bound for processes of endless shapes)
  impl_->remembered[problem].push_back({device, spec});
  return spec;
}

std::optional<TunedEntry> TuningSources::lookup(const DeviceStamp& device, const ProblemKey& problem) const {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  // The problem's own layout in every source first; then the other layout's entry, a closer guess
  // than the heuristic (the tile preferences of the two differ by a few percent).
  ProblemKey other_layout = problem;
  other_layout.head_major = !problem.head_major;
  const ProblemKey* const keys[] = {&problem, &other_layout};
  for (const ProblemKey* key : keys)
    for (const auto& [db, origin] : {std::pair<const TuningDb*, std::string>{&impl_->in_memory, "in-memory tuning"},
                                     {&impl_->user, impl_->user_origin},
                                     {&impl_->bundled, "the bundled tuning database"}})
      if (const TunedEntry* e = impl_->find(*db, origin, device, *key)) return *e;
  return std::nullopt;
}

}  // namespace flashjit
