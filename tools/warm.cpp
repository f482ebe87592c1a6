// flashjit-warm: compile kernels into a cache directory ahead of time, with no GPU needed.
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <fstream>
#include <mutex>
#include <sstream>
#include <thread>

#include <nlohmann/json.hpp>

#include "cli_common.hpp"
#include "flashjit/dispatch.hpp"
#include "flashjit/kernel_cache.hpp"
#include "flashjit/tuning.hpp"
#include "tool_support.hpp"

using namespace flashjit;
using nlohmann::json;

namespace {

constexpr const char* kTool = "flashjit-warm";

struct Options {
  std::vector<std::string> archs;
  std::string preset;
  std::vector<int> head_dims{64, 128, 256};
  std::vector<std::string> dtypes{"bf16", "fp16"};
  std::vector<std::string> masks{"none", "causal"};
  std::string specs_file;
  std::string tuning_db;
  std::vector<std::string> passes{"fwd", "bwd", "kvcache"};
  std::string cache_dir;
  int jobs = 0;
  bool check = false;
  bool json_output = false;
};

std::vector<KernelSpec> read_spec_file(const std::string& path) {
  const detail::FileRead file = detail::read_regular_file(path, 64u << 20, /*follow_symlinks=*/true);
  if (!file.bytes) throw Error(ErrorCode::invalid_argument, "--specs", fmt::format("cannot read {}: {}", path, file.problem));
  json j = detail::parse_json_text(*file.bytes, path, "--specs");
  if (j.is_object() && j.contains("specs")) j = j.at("specs");
  if (!j.is_array())
    throw Error(ErrorCode::invalid_argument, "--specs",
                fmt::format("{}: expected a JSON array of kernel specs (or {{\"specs\": [...]}})", path));
  std::vector<KernelSpec> specs;
  for (size_t i = 0; i < j.size(); ++i) {
    try {
      specs.push_back(KernelSpec::from_json(j[i]));
    } catch (const Error& e) {
      throw Error(ErrorCode::invalid_argument, "--specs", fmt::format("{}: spec #{}: {}", path, i, e.message()));
    }
  }
  return specs;
}

std::vector<KernelSpec> gather_specs(const Options& o) {
  const std::vector<Arch> archs = cli::parse_archs(o.archs);
  for (const Arch& arch : archs)
    if (!nvrtc_supports(arch))
      throw Error(ErrorCode::invalid_argument, "--arch",
                  fmt::format("NVRTC {} cannot compile for {}", nvrtc_version(), arch.name()));
  std::vector<KernelSpec> specs;
  if (!o.specs_file.empty()) {
    for (KernelSpec s : read_spec_file(o.specs_file)) {
      if (archs.empty()) {
        specs.push_back(s);
        continue;
      }
      for (const Arch& arch : archs) {  // retarget each spec to every requested arch
        s.arch = arch;
        specs.push_back(s);
      }
    }
  }
  if (!o.tuning_db.empty()) {
    // Every winner and runner-up of the database: what dispatch may pick, and what a re-tune
    // would try first. Retargeted to --arch when given, else compiled for their recorded arch.
    TuningDb db;
    try {
      db = TuningDb::load(o.tuning_db);
    } catch (const Error& e) {  // an input that cannot be used: nothing was done (exit 2)
      throw Error(ErrorCode::invalid_argument, "--tuning-db", e.message());
    }
    for (const TunedEntry& e : db.entries()) {
      std::vector<KernelSpec> from_entry{e.spec};
      for (const auto& [spec, ms] : e.runner_ups) from_entry.push_back(spec);
      for (KernelSpec s : from_entry) {
        if (archs.empty()) {
          specs.push_back(s);
          continue;
        }
        for (const Arch& arch : archs) {
          s.arch = arch;
          specs.push_back(s);
        }
      }
    }
  }
  if (!o.preset.empty()) {
    if (o.preset != "default")
      throw Error(ErrorCode::invalid_argument, "--preset",
                  fmt::format("unknown preset '{}' (known: default)", o.preset));
    if (archs.empty()) throw Error(ErrorCode::invalid_argument, "--preset", "needs at least one --arch");
    auto fp8_kernel_exists = [](const Arch& arch, int head_dim, MaskKind mask) {
      const std::optional<int> kernel_head_dim = family_kernel_head_dim(Family::sm90_fwd, head_dim);
      return kernel_head_dim && family_covers(Family::sm90_fwd, arch, *kernel_head_dim) &&
             !default_spec(Family::sm90_fwd, arch, DType::e4m3, *kernel_head_dim, mask).validate();
    };
    for (const Arch& arch : archs)
      for (DType dtype : cli::parse_dtypes(o.dtypes))
        for (int head_dim : o.head_dims)
          for (MaskKind mask : cli::parse_masks(o.masks))
            for (const auto& pass : o.passes) {
              // FP8 is forward-only, on sm90_fwd (sm_90a), where its tiles fit (head dim 256 has no
              // window or softcap kernel): the other combinations have no kernel to warm.
              if (dtype == DType::e4m3 && (pass != "fwd" || !fp8_kernel_exists(arch, head_dim, mask))) continue;
              if (pass == "kvcache") {  // forward_kvcache: decode and longer query tiles
                for (const KernelSpec& s : heuristic_kvcache_specs(arch, dtype, head_dim, mask)) specs.push_back(s);
                continue;
              }
              KernelSpec heuristic;
              if (pass == "fwd")
                heuristic = heuristic_forward_spec(arch, dtype, head_dim, mask);
              else if (pass == "bwd" || pass == "bwd-deterministic")
                heuristic = heuristic_backward_spec(arch, dtype, head_dim, mask, false, pass == "bwd-deterministic");
              else
                throw Error(ErrorCode::invalid_argument, "--passes",
                            fmt::format("'{}' is not fwd, bwd, bwd-deterministic or kvcache", pass));
              specs.push_back(heuristic);
              // Where the bundled database overrides the heuristic (the H200's tuned tiles), its
              // picks too: dispatch runs them for the shapes they were tuned on (in deterministic
              // mode with ordered dQ adds, where the tiles have room for them).
              for (KernelSpec tuned : bundled_tuned_specs(heuristic)) {
                tuned.ordered_dq = heuristic.ordered_dq;
                if (!tuned.validate()) specs.push_back(tuned);
              }
            }
  }
  // Drop duplicates (head dims that round to the same kernel), keep the order.
  std::vector<KernelSpec> unique;
  for (const auto& s : specs)
    if (std::find(unique.begin(), unique.end(), s) == unique.end()) unique.push_back(s);
  for (const auto& s : unique)
    if (auto reason = s.validate())
      throw Error(ErrorCode::invalid_argument, "spec", fmt::format("{}: {}", s.name(), *reason));
  return unique;
}

struct Outcome {
  KernelSpec spec;
  std::string status;  // compiled, cached, failed, ok, missing, damaged
  std::string message;
  double compile_ms = 0;
  int registers = 0;     // the most of any entry
  int spill_bytes = 0;   // over all entries
  std::vector<EntryStats> entries;
};

int run(const Options& o) {
  const std::vector<KernelSpec> specs = gather_specs(o);
  if (specs.empty())
    throw Error(ErrorCode::invalid_argument, "arguments", "nothing to do: give --preset, --specs or --tuning-db");
  CacheConfig config = CacheConfig::from_environment();
  if (!o.cache_dir.empty()) config.directory = o.cache_dir;
  if (config.directory.empty())
    throw Error(ErrorCode::invalid_argument, "--cache-dir",
                "the disk cache is disabled (FLASHJIT_DISABLE_DISK_CACHE): give --cache-dir");
  KernelCache cache(config);

  std::vector<Outcome> outcomes(specs.size());
  std::atomic<size_t> next{0};
  std::atomic<size_t> done{0};
  std::mutex print_mutex;
  const bool progress = !o.json_output;
  auto work = [&] {
    for (size_t i; (i = next++) < specs.size();) {
      Outcome& out = outcomes[i];
      out.spec = specs[i];
      try {
        if (o.check) {
          const uint64_t quarantined = cache.stats().quarantined;
          auto found = cache.find_on_disk(specs[i]);
          out.status = found ? "ok" : cache.stats().quarantined > quarantined ? "damaged" : "missing";
        } else {
          auto kernel = cache.get(specs[i]);
          out.status = kernel->from_disk ? "cached" : "compiled";
          out.compile_ms = kernel->compile_ms;
          out.entries = kernel->entries;
          for (const auto& e : kernel->entries) {
            out.registers = std::max(out.registers, e.registers);
            out.spill_bytes += e.spill_store_bytes + e.spill_load_bytes;
          }
          if (out.status == "compiled" && kernel->disk_entry.empty()) {
            out.status = "uncached";  // compiled, but the entry could not be written (the warning says why)
            out.message = "compiled, but not cached: the cache entry could not be written";
          }
        }
      } catch (const Error& e) {
        out.status = "failed";
        out.message = e.message();
      } catch (const std::exception& e) {  // out of memory, say: one spec fails, not the process
        out.status = "failed";
        out.message = e.what();
      }
      if (progress) {
        std::lock_guard<std::mutex> lock(print_mutex);
        const size_t n = ++done;
        std::string detail = out.status == "compiled" || out.status == "cached"
                                 ? fmt::format("{:6.0f} ms  {:3} regs  {} spill bytes", out.compile_ms,
                                               out.registers, out.spill_bytes)
                                 : out.message;
        fmt::print("[{:>{}}/{}] {:<9} {:<52} {}\n", n, std::to_string(specs.size()).size(),
                   specs.size(), out.status, out.spec.name(), detail);
        std::fflush(stdout);
      }
    }
  };
  const int jobs = o.jobs > 0 ? o.jobs : std::max(1u, std::thread::hardware_concurrency());
  std::vector<std::thread> pool;
  for (int t = 0; t < jobs; ++t) {
    try {
      pool.emplace_back(work);
    } catch (const std::system_error&) {  // the system gave no more threads: the started ones do the work
      if (pool.empty()) throw;
      break;
    }
  }
  for (auto& t : pool) t.join();

  std::map<std::string, int> counts;
  for (const auto& out : outcomes) ++counts[out.status];
  const bool failed = counts["failed"] + counts["uncached"] + counts["missing"] + counts["damaged"] > 0;
  if (o.json_output) {
    json j{{"cache_dir", config.directory}, {"counts", counts}, {"kernels", json::array()}};
    for (const auto& out : outcomes) {
      json entries = json::array();
      for (const auto& e : out.entries)
        entries.push_back({{"name", e.name},
                           {"registers", e.registers},
                           {"static_smem_bytes", e.static_smem_bytes},
                           {"spill_bytes", e.spill_store_bytes + e.spill_load_bytes}});
      j["kernels"].push_back({{"spec", out.spec.to_json()},
                              {"name", out.spec.name()},
                              {"status", out.status},
                              {"message", out.message},
                              {"compile_ms", out.compile_ms},
                              {"registers", out.registers},
                              {"spill_bytes", out.spill_bytes},
                              {"entries", entries}});
    }
    fmt::print("{}\n", j.dump(2));
  } else if (o.check) {
    fmt::print("{}: {} ok, {} missing, {} damaged in {}\n", kTool, counts["ok"], counts["missing"],
               counts["damaged"], config.directory);
  } else {
    fmt::print("{}: {} compiled, {} already cached, {} failed in {}{}\n", kTool, counts["compiled"],
               counts["cached"], counts["failed"], config.directory,
               counts["uncached"] ? fmt::format(" ({} compiled but not cached)", counts["uncached"]) : "");
  }
  return failed ? cli::kExitFailed : cli::kExitOk;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  CLI::App app{"Compile flashjit kernels into the disk cache ahead of time (no GPU needed)", kTool};
  app.footer(
      "Examples:\n"
      "  flashjit-warm --arch sm_90a --preset default     forward, backward and KV-cache kernels\n"
      "      the kernels dispatch picks by default for head dims 64/128/256, bf16 and fp16\n"
      "  flashjit-warm --arch sm_80 --arch sm_90a --preset default --head-dims 128 --dtypes bf16\n"
      "  flashjit-warm --specs specs.json --cache-dir /opt/app/flashjit-cache\n"
      "  flashjit-warm --arch sm_90a --preset default --check     verify, compile nothing\n"
      "  flashjit-warm --tuning-db tuning.json                    what flashjit-tune chose\n"
      "\nExit status: 0 all good, 1 a compile or check failed, 2 bad arguments or input.");
  app.add_option("--arch", o.archs, "Target arch, repeatable (sm_80, sm_86, sm_89, sm_90a, ...)");
  app.add_option("--preset", o.preset, "Named spec set: 'default' = dispatch's heuristic choices and the bundled tuning database's picks");
  app.add_option("--head-dims", o.head_dims, "Head dims for the preset")->delimiter(',')->check(cli::kHeadDimCheck);
  app.add_option("--dtypes", o.dtypes, "Dtypes for the preset (bf16, fp16, e4m3: FP8 forward on sm_90a)")->delimiter(',');
  app.add_option("--masks", o.masks, "Mask kinds for the preset (none, causal, window)")->delimiter(',');
  app.add_option("--passes", o.passes,
                 "Passes for the preset (fwd, bwd, bwd-deterministic: the backward's deterministic mode, kvcache: "
                 "forward_kvcache's decode tiles)")->delimiter(',');
  app.add_option("--specs", o.specs_file, "JSON file: an array of kernel specs");
  app.add_option("--tuning-db", o.tuning_db, "Tuning database (flashjit-tune): its winners and runner-ups");
  app.add_option("--cache-dir", o.cache_dir, "Cache directory (default: FLASHJIT_CACHE_DIR or ~/.cache/flashjit)");
  app.add_option("-j,--jobs", o.jobs, "Parallel compiles, 1 to 1024 (default: one per core)")->check(cli::kJobsRange);
  app.add_flag("--check", o.check, "Verify that every spec is in the cache; compile nothing");
  app.add_flag("--json", o.json_output, "Print a JSON report instead of progress lines");
  return cli::run_tool(kTool, app, argc, argv, [&] {
    if (o.preset.empty() && o.specs_file.empty() && o.tuning_db.empty()) o.preset = "default";
    return run(o);
  });
}
