// Autotuning: the candidate specs of a problem class, the tuning database the dispatcher consults,
// and the tuner that fills it on a GPU.
//
// Dispatch order for a problem: options.kernel (forced), then the runtime's in-memory entries
// (Runtime::add_tuned), the user database (FLASHJIT_TUNING_DB or Runtime::load_tuning_db), the
// database bundled in the library, and finally the heuristic. Entries recorded on another device
// or software stack (their DeviceStamp differs) are skipped, with one warning per database.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "flashjit/codegen/kernel_spec.hpp"
#include "flashjit/device.hpp"

namespace flashjit {

// Legal specs of a family (validate() passes) for this arch, dtype, kernel head dim, mask and
// softcap: the family's own tile grid (its runtime module's tuning candidates). Specs whose
// compiled kernel spills are still listed: the caller compiles and drops them (only ptxas knows).
// What the tuner times for a problem is the candidates of every family that shares the
// dispatched family's tuning key (runtime/src/dispatch.hpp, tuning_plan).
std::vector<KernelSpec> candidate_specs(Family family, const Arch& arch, DType dtype, int head_dim,
                                        MaskKind mask, bool has_softcap);

// What a tuning result is valid for: the GPU and the software that compiled and ran the kernels.
struct DeviceStamp {
  std::string name;
  int cc_major = 0, cc_minor = 0;
  int sm_count = 0;
  int64_t memory_bytes = 0;
  int driver_version = 0;
  std::string nvrtc_version;  // "13.0"

  static DeviceStamp of(const DeviceProperties& device);  // with this process's NVRTC
  std::string describe() const;  // "NVIDIA H200 (sm_90, 132 SMs, 143 GB, driver 13000, NVRTC 13.0)"
  bool operator==(const DeviceStamp& o) const;
  bool operator!=(const DeviceStamp& o) const { return !(*this == o); }
};

// The class of problems one tuned spec serves. Sequence lengths and batch x heads are bucketed to
// the next power of two, so a handful of entries covers a model's shapes.
struct ProblemKey {
  Family family = Family::fa2_fwd;  // the dispatched family's tuning key (family.hpp)
  DType dtype = DType::bf16;
  int head_dim = 128;  // the kernel head dim (problem head dims rounded up)
  MaskKind mask = MaskKind::none;
  bool softcap = false;
  int seqlen_bucket = 0;      // bucket(max(seqlen_q, seqlen_k))
  int batch_heads_bucket = 0; // bucket(batch * heads_q)
  // q stored (batch, heads, seqlen, head_dim), SDPA's order, rather than sequence-major (batch,
  // seqlen, heads, head_dim), flash-attn's: the layouts favour different tiles (H200, head dim 128).
  // JSON "layout": "bhsd" or "bshd" (absent: bshd, as databases before it). Dispatch falls back to
  // the other layout's entry where its own has none.
  bool head_major = false;
  // kvcache_fwd only (0 for the other families): bucket of the packed query rows one KV head's
  // tile holds (seqlen_q x the group of query heads), what decides its block_m. JSON
  // "query_rows_bucket", present for kvcache_fwd entries and only there.
  int query_rows_bucket = 0;

  static int bucket(int64_t n);  // the smallest power of two >= n, at least 64 (1 -> 64, 100 -> 128)
  static int query_rows(int64_t n);  // the smallest power of two >= n from 16 to 128 (1 -> 16, 500 -> 128)
  std::string describe() const;  // "fa2_fwd bf16 d128 causal s<=4096 bh<=64", then " bhsd" if head-major
  bool operator==(const ProblemKey& o) const;
};

struct TunedEntry {
  DeviceStamp device;
  ProblemKey problem;
  KernelSpec spec;
  double median_ms = 0;
  std::vector<std::pair<KernelSpec, double>> runner_ups;  // next best specs and their median ms
  std::string tuned_at;  // ISO 8601, UTC
};

// A tuning database: a JSON document
//   {"format": "flashjit-tuning-db", "version": 1, "entries": [{"device": {...}, "problem": {...},
//    "spec": {...}, "median_ms": ..., "runner_ups": [{"spec": {...}, "median_ms": ...}],
//    "tuned_at": "..."}]}
// parsed strictly: malformed JSON is reported with its line and column, unknown or missing fields
// and bad values by their path ("entries[3].problem.mask").
class TuningDb {
 public:
  TuningDb() = default;
  static TuningDb parse(const std::string& text, const std::string& origin);
  static TuningDb load(const std::string& path);  // Error(io_error) when it cannot be read
  std::string dump() const;                       // pretty JSON, entries in insertion order

  const std::vector<TunedEntry>& entries() const { return entries_; }
  const TunedEntry* find(const DeviceStamp& device, const ProblemKey& problem) const;
  // Adds an entry, replacing one with the same device and problem.
  void upsert(TunedEntry entry);
  void merge(const TuningDb& newer);  // newer's entries win

  // Merges this database into the file at `path` and replaces it atomically: under an exclusive
  // lock on `<path>.lock` it reads the current file (if any), merges, writes `<path>.tmp.<pid>`,
  // fsyncs and renames it over `path`. Concurrent savers serialize; a crash leaves the old file.
  // Error(io_error) names the path when it cannot be written, and the existing file is untouched.
  void save_merged(const std::string& path) const;

 private:
  std::vector<TunedEntry> entries_;
};

// A process-wide view of the databases dispatch consults, in order. Thread-safe.
class TuningSources {
 public:
  // `warn` receives one message per database whose entries were recorded on another device or
  // software stack (default: stderr).
  explicit TuningSources(std::function<void(const std::string&)> warn = {});
  ~TuningSources();
  TuningSources(const TuningSources&) = delete;
  TuningSources& operator=(const TuningSources&) = delete;

  void add_in_memory(TunedEntry entry);
  void set_user_db(TuningDb db, std::string origin);
  void set_bundled_db(TuningDb db);

  // True while no source holds an entry: dispatch then skips the lookup (no lock on the call path).
  bool empty() const;

  // The first entry for this device and problem: in-memory, user, bundled; nullopt if none.
  // Copies out, so the result stays valid while sources change.
  std::optional<TunedEntry> lookup(const DeviceStamp& device, const ProblemKey& problem) const;
  // lookup()'s spec, remembered per (device, problem) until a source changes: dispatch's path on
  // every call (a lookup walks the databases: about a microsecond).
  std::optional<KernelSpec> lookup_spec(const DeviceStamp& device, const ProblemKey& problem) const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// The tuning database compiled into the library (bench results of GPUs measured by the project).
const TuningDb& bundled_tuning_db();

// ---------------------------------------------------------------------------------------------
// The tuner (needs a GPU).

struct TuneShape {
  bool backward = false;  // tune fa2_bwd (forward + the gradients' kernels) instead of fa2_fwd
  // tune kvcache_fwd instead: seqlen_q new queries against a contiguous cache of seqlen_k tokens
  // (forward_kvcache; decode is seqlen_q 1)
  bool kvcache = false;
  DType dtype = DType::bf16;
  int batch = 1, seqlen_q = 4096, seqlen_k = 4096, heads_q = 16, heads_kv = 16, head_dim = 128;
  bool causal = false;
  bool head_major = false;  // time (batch, heads, seqlen, head_dim) tensors; the entry is keyed so

  std::string describe() const;
};

struct TuneProgress {
  const char* stage;  // "compile", "time", "verify", "retime"
  size_t done, total;
};

struct TuneOptions {
  int device = 0;
  int warmup = 2;
  int iters = 15;          // timed samples per candidate (median)
  int finalists = 3;       // re-timed interleaved before choosing
  int compile_threads = 0; // 0: one per core
  std::function<void(const TuneProgress&)> progress;
};

struct TuneResult {
  TunedEntry entry;
  size_t candidates = 0, timed = 0, dropped_spills = 0, dropped_failed = 0;
  double seconds = 0;    // wall time of the whole tune
  double max_rel_error = 0;  // the winner against the check (reference kernel, or the heuristic's backward)
  double heuristic_ms = 0;   // the heuristic's spec, re-timed beside the finalists (the winner must beat it by 1%)
};

class Runtime;
// Times every spill-free candidate of the shape's problem class on the device (compiling on a
// thread pool while the GPU times what is ready), with inputs rotated past the L2 and the median
// of `iters` samples; verifies the fastest numerically, then re-times the finalists interleaved
// with the heuristic's spec and returns the winner (the heuristic's unless one beats it by 1%). Throws Error(unsupported) when no candidate runs.
TuneResult tune(Runtime& runtime, const TuneShape& shape, const TuneOptions& options = {});

}  // namespace flashjit
