// flashjit-tune: autotune block sizes for attention shapes on this GPU and write a tuning database.
#include <unistd.h>

#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "cli_common.hpp"
#include "flashjit/flashjit.hpp"
#include "flashjit/kernel_cache.hpp"
#include "flashjit/tuning.hpp"
#include "tool_support.hpp"

using namespace flashjit;
using nlohmann::json;

namespace {

constexpr const char* kTool = "flashjit-tune";

struct Options {
  std::vector<std::string> shapes;      // "B,SQ,SK,HQ,HKV,D"
  std::string shapes_file;
  bool grid = false;
  std::vector<std::string> causal{"off"};
  std::vector<std::string> dtypes{"bf16"};
  std::vector<std::string> passes{"fwd"};
  std::string layout = "bshd";  // the tensors timed: bshd (sequence-major) or bhsd (head-major)
  std::string output;
  bool dry_run = false;
  std::string arch;  // --dry-run: the target (default: sm_90a)
  int device = 0;
  int iters = 15;
  int finalists = 3;
  bool json_output = false;
};

Error usage(const std::string& where, const std::string& message) {
  return Error(ErrorCode::invalid_argument, where, message);
}

std::vector<TuneShape> expand(int batch, int sq, int sk, int hq, int hkv, int d, const Options& o) {
  std::vector<TuneShape> out;
  for (const auto& pass : o.passes) {
    if (pass != "fwd" && pass != "bwd" && pass != "kvcache")
      throw usage("--pass", fmt::format("'{}' is not fwd, bwd or kvcache", pass));
    for (const auto& dtype : o.dtypes)
      for (const auto& c : o.causal) {
        if (c != "on" && c != "off") throw usage("--causal", fmt::format("'{}' is not on or off", c));
        TuneShape s;
        s.backward = pass == "bwd";
        s.kvcache = pass == "kvcache";
        s.dtype = parse_dtype(dtype);
        s.batch = batch, s.seqlen_q = sq, s.seqlen_k = sk, s.heads_q = hq, s.heads_kv = hkv, s.head_dim = d;
        s.causal = c == "on";
        if (o.layout != "bshd" && o.layout != "bhsd")
          throw usage("--layout", fmt::format("'{}' is not bshd or bhsd", o.layout));
        s.head_major = o.layout == "bhsd";
        out.push_back(s);
      }
  }
  return out;
}

// A JSON array of {"batch", "seqlen_q", "seqlen_k", "heads_q", "heads_kv", "head_dim"} objects, each
// optionally with "causal" (bool), "dtype", "pass" ("fwd"/"bwd"/"kvcache") and "layout" ("bshd"/"bhsd")
// overriding the command line's.
std::vector<TuneShape> read_shapes_file(const std::string& path, const Options& o) {
  const detail::FileRead file = detail::read_regular_file(path, 64u << 20, /*follow_symlinks=*/true);
  if (!file.bytes) throw usage("--shapes", fmt::format("cannot read {}: {}", path, file.problem));
  const json j = detail::parse_json_text(*file.bytes, path, "--shapes");
  if (!j.is_array()) throw usage("--shapes", fmt::format("{}: expected a JSON array of shapes", path));
  static const std::vector<std::string> kRequired{"batch", "seqlen_q", "seqlen_k", "heads_q", "heads_kv", "head_dim"};
  static const std::vector<std::string> kOptional{"causal", "dtype", "pass", "layout"};
  std::vector<TuneShape> shapes;
  for (size_t i = 0; i < j.size(); ++i) {
    const json& s = j[i];
    auto bad = [&](const std::string& m) { return usage("--shapes", fmt::format("{}: shapes[{}]: {}", path, i, m)); };
    if (!s.is_object()) throw bad("must be an object");
    for (const auto& [key, value] : s.items())
      if (std::find(kRequired.begin(), kRequired.end(), key) == kRequired.end() &&
          std::find(kOptional.begin(), kOptional.end(), key) == kOptional.end())
        throw bad(fmt::format("unknown field '{}' (known: {}, {})", key, fmt::join(kRequired, ", "), fmt::join(kOptional, ", ")));
    int v[6];
    for (size_t f = 0; f < kRequired.size(); ++f) {
      if (!s.contains(kRequired[f])) throw bad(fmt::format("missing field '{}'", kRequired[f]));
      const json& x = s.at(kRequired[f]);
      if (!x.is_number_integer() || x.get<int64_t>() < 1 || x.get<int64_t>() > (1 << 30))
        throw bad(fmt::format("'{}' must be a positive integer, got {}", kRequired[f], x.dump()));
      v[f] = x.get<int>();
    }
    Options local = o;
    if (s.contains("causal")) {
      if (!s.at("causal").is_boolean()) throw bad("'causal' must be true or false");
      local.causal = {s.at("causal").get<bool>() ? "on" : "off"};
    }
    for (const char* key : {"dtype", "pass"})
      if (s.contains(key)) {
        if (!s.at(key).is_string()) throw bad(fmt::format("'{}' must be a string", key));
        (std::string(key) == "dtype" ? local.dtypes : local.passes) = {s.at(key).get<std::string>()};
      }
    if (s.contains("layout")) {
      if (!s.at("layout").is_string()) throw bad("'layout' must be a string");
      local.layout = s.at("layout").get<std::string>();
    }
    try {
      for (const auto& t : expand(v[0], v[1], v[2], v[3], v[4], v[5], local)) shapes.push_back(t);
    } catch (const Error& e) {
      throw bad(e.message());
    }
  }
  return shapes;
}

std::vector<TuneShape> gather_shapes(const Options& o) {
  std::vector<TuneShape> shapes;
  for (const auto& text : o.shapes) {
    // Six integers from 1 to 2^30, as a shapes file takes them (read as 64-bit: a larger value is
    // refused, never wrapped).
    int v[6];
    std::stringstream fields(text);
    std::string field;
    int n = 0;
    bool valid = true;
    while (valid && std::getline(fields, field, ',')) {
      size_t used = 0;
      long long value = 0;
      try {
        value = std::stoll(field, &used);
      } catch (const std::exception&) {
        used = 0;
      }
      valid = n < 6 && used == field.size() && !field.empty() && value >= 1 && value <= (1 << 30);
      if (valid) v[n++] = static_cast<int>(value);
    }
    if (!valid || n != 6 || text.empty() || text.back() == ',')
      throw usage("--shape", fmt::format("'{}' is not B,SQ,SK,HQ,HKV,D (six integers from 1 to 2^30)", text));
    for (const auto& s : expand(v[0], v[1], v[2], v[3], v[4], v[5], o)) shapes.push_back(s);
  }
  if (!o.shapes_file.empty())
    for (const auto& s : read_shapes_file(o.shapes_file, o)) shapes.push_back(s);
  if (o.grid)  // DESIGN.md's forward grid: 16k tokens x 2048 hidden
    for (int d : {64, 128, 256})
      for (int s : {512, 1024, 2048, 4096, 8192, 16384})
        for (const auto& t : expand(16384 / s, s, s, 2048 / d, 2048 / d, d, o)) shapes.push_back(t);
  if (shapes.empty()) throw usage("arguments", "no shapes: give --shape, --shapes or --grid");
  return shapes;
}

detail::Pass pass_of(const TuneShape& s) {
  return s.kvcache ? detail::Pass::kvcache : s.backward ? detail::Pass::backward : detail::Pass::forward;
}

// Validates a shape as the runtime would (without touching a GPU) and returns its problem.
detail::ForwardProblem problem_of(const TuneShape& s) {
  alignas(16) static unsigned char stand_in[16];  // validation only reads addresses
  const bool fp8 = s.dtype == DType::e4m3;
  if (fp8 && (s.backward || s.kvcache))
    throw usage("dtype", fmt::format("{}: e4m3 (FP8) runs forward only (--pass fwd)", s.describe()));
  const ScalarType t = detail::input_scalar_type(s.dtype);
  for (int v : {s.batch, s.seqlen_q, s.seqlen_k, s.heads_q, s.heads_kv, s.head_dim})
    if (v < 1) throw usage("shape", fmt::format("{}: every extent must be positive", s.describe()));
  auto view = [&](int seqlen, int heads, ScalarType type) {
    return s.head_major ? TensorView::head_major(stand_in, type, s.batch, seqlen, heads, s.head_dim)
                        : TensorView::contiguous(stand_in, type, {s.batch, seqlen, heads, s.head_dim});
  };
  auto q = view(s.seqlen_q, s.heads_q, t);
  auto k = view(s.seqlen_k, s.heads_kv, t);
  auto out = view(s.seqlen_q, s.heads_q, detail::output_scalar_type(s.dtype));  // (FP8: a bf16 out)
  AttentionOptions options;
  options.causal = s.causal;
  try {
    detail::ForwardProblem p = s.kvcache ? detail::make_kvcache_problem(q, KvCache{k, k}, out, nullptr, options).forward
                                         : detail::make_forward_problem(q, k, k, out, nullptr, nullptr, options);
    // (A head dim over 256, say, has no family; FP8 has one only on sm_90.)
    detail::tuning_plan(detail::PassProblem{pass_of(s), p}, Arch::parse(fp8 ? "sm_90a" : "sm_80"));
    return p;
  } catch (const Error& e) {
    throw usage("shape", fmt::format("{}: {}", s.describe(), e.message()));
  }
}

// Refuse an output we could not write before spending GPU time (the file is never touched here).
void check_output(const std::string& path) {
  if (path.empty()) return;
  const auto slash = path.find_last_of('/');
  const std::string dir = slash == std::string::npos ? "." : path.substr(0, slash == 0 ? 1 : slash);
  if (::access(dir.c_str(), W_OK) != 0)
    throw usage("--output", fmt::format("cannot write to {} (directory {} is not writable or does not exist)", path, dir));
  if (::access(path.c_str(), F_OK) == 0) {
    if (::access(path.c_str(), W_OK) != 0) throw usage("--output", fmt::format("{} is not writable", path));
    try {
      TuningDb::load(path);  // entries are merged into it: it must be a tuning database
    } catch (const Error& e) {
      throw usage("--output", fmt::format("{} exists and is not a tuning database, so it is left alone: {}", path, e.message()));
    }
  }
}

int dry_run(const Options& o, const std::vector<TuneShape>& shapes) {
  const Arch arch = cli::parse_arch(o.arch.empty() ? "sm_90a" : o.arch);
  if (!nvrtc_supports(arch))
    throw usage("--arch", fmt::format("NVRTC {} cannot compile for {}", nvrtc_version(), arch.name()));
  json report = json::array();
  for (const auto& s : shapes) {
    const detail::ForwardProblem p = problem_of(s);
    const detail::TuningPlan plan =
        detail::tuning_plan(detail::PassProblem{pass_of(s), p}, arch);
    const ProblemKey& key = plan.key;
    const std::vector<KernelSpec>& candidates = plan.candidates;
    if (o.json_output) {
      json names = json::array();
      for (const auto& c : candidates) names.push_back(c.name());
      report.push_back({{"shape", s.describe()}, {"problem", key.describe()}, {"candidates", names}});
    } else {
      fmt::print("{} -> {}: {} candidates\n", s.describe(), key.describe(), candidates.size());
      for (const auto& c : candidates) fmt::print("  {}\n", c.name());
    }
  }
  if (o.json_output) fmt::print("{}\n", report.dump(1));
  return cli::kExitOk;
}

int run(const Options& o) {
  const std::vector<TuneShape> shapes = gather_shapes(o);
  for (const auto& s : shapes) problem_of(s);  // every shape is checked before any work starts
  if (o.dry_run) return dry_run(o, shapes);
  if (!o.arch.empty()) throw usage("--arch", "only with --dry-run: tuning targets the device's own arch");
  check_output(o.output);

  device_properties(o.device);  // no driver or no such device: fail before anything else
  Runtime& runtime = Runtime::global();
  const bool terminal = ::isatty(STDERR_FILENO) != 0;
  TuningDb db;
  bool failed = false;
  for (size_t i = 0; i < shapes.size(); ++i) {
    const TuneShape& s = shapes[i];
    TuneOptions options;
    options.device = o.device;
    options.iters = o.iters;
    options.finalists = o.finalists;
    if (terminal)
      options.progress = [&](const TuneProgress& p) {
        const int width = 30, filled = p.total ? int(width * p.done / p.total) : width;
        fmt::print(stderr, "\r[{}/{}] {:<40} {:<7} [{}{}] {}/{}   ", i + 1, shapes.size(), s.describe(), p.stage,
                   std::string(filled, '#'), std::string(width - filled, '.'), p.done, p.total);
      };
    try {
      const TuneResult r = tune(runtime, s, options);
      if (terminal) fmt::print(stderr, "\r{:<100}\r", "");
      fmt::print(stderr,
                 "[{}/{}] {}: {} {:.3f} ms, heuristic {:.3f} ms ({:+.1f}%; {} of {} candidates timed, {:.1f} s, "
                 "max rel error {:.1e})\n",
                 i + 1, shapes.size(), s.describe(), r.entry.spec.name(), r.entry.median_ms, r.heuristic_ms,
                 100 * (r.heuristic_ms / r.entry.median_ms - 1), r.timed, r.candidates, r.seconds, r.max_rel_error);
      db.upsert(r.entry);
    } catch (const Error& e) {
      if (terminal) fmt::print(stderr, "\n");
      fmt::print(stderr, "[{}/{}] {}: failed: {}\n", i + 1, shapes.size(), s.describe(), e.what());
      failed = true;
    }
  }
  if (o.output.empty()) {
    fmt::print("{}", db.dump());
  } else {
    db.save_merged(o.output);
    fmt::print(stderr, "{}: {} entries merged into {}\n", kTool, db.entries().size(), o.output);
  }
  return failed ? cli::kExitFailed : cli::kExitOk;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  CLI::App app{"Autotune flashjit's block sizes for attention shapes on this GPU; write a tuning database", kTool};
  app.footer(
      "Shapes: B,SQ,SK,HQ,HKV,D (batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim), crossed with\n"
      "--causal, --dtype and --pass. A --shapes file is a JSON array of objects with those six fields\n"
      "(batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim) and optional causal/dtype/pass/layout.\n"
      "--layout bhsd times head-major tensors (PyTorch SDPA's order) and keys the entries so: dispatch\n"
      "uses an entry of the call's own layout first, then the other layout's.\n"
      "Examples:\n"
      "  flashjit-tune --shape 2,8192,8192,32,8,128 --causal on --output tuning.json\n"
      "  flashjit-tune --grid --causal off,on --pass fwd,bwd --output tuning.json\n"
      "  flashjit-tune --shape 64,1,16384,32,8,128 --pass kvcache --output tuning.json   decode\n"
      "  flashjit-tune --shapes model_shapes.json > tuning.json\n"
      "  flashjit-tune --grid --dry-run --arch sm_80     list the candidates, no GPU needed\n"
      "Use the result with FLASHJIT_TUNING_DB=tuning.json, Runtime::load_tuning_db, or\n"
      "flashjit-warm --tuning-db tuning.json to precompile its kernels.\n"
      "\nExit status: 0 ok, 1 a shape failed to tune, 2 bad arguments or input (nothing was written).");
  app.add_option("--shape", o.shapes, "B,SQ,SK,HQ,HKV,D (repeatable)");
  app.add_option("--shapes", o.shapes_file, "JSON file of shapes");
  app.add_flag("--grid", o.grid, "The forward grid of DESIGN.md (16k tokens x 2048 hidden, D 64/128/256)");
  app.add_option("--causal", o.causal, "off, on, or off,on")->delimiter(',');
  app.add_option("--dtype", o.dtypes, "bf16, fp16, e4m3 (FP8, forward only), or a list")->delimiter(',');
  app.add_option("--pass", o.passes, "fwd, bwd, kvcache (forward_kvcache over a contiguous cache of SK tokens), or a list")
      ->delimiter(',');
  app.add_option("--layout", o.layout, "bshd (sequence-major, flash-attn's order; the default) or bhsd (head-major, SDPA's)");
  app.add_option("--output", o.output, "Merge the results into this tuning database (atomic); default: stdout");
  app.add_flag("--dry-run", o.dry_run, "List each shape's candidate specs; no GPU needed");
  app.add_option("--arch", o.arch, "Target arch for --dry-run (default sm_90a)");
  app.add_option("--device", o.device, "CUDA device ordinal");
  app.add_option("--iters", o.iters, "Timed samples per candidate (median)");
  app.add_option("--finalists", o.finalists, "Candidates re-timed interleaved before choosing");
  app.add_flag("--json", o.json_output, "--dry-run: print JSON");
  return cli::run_tool(kTool, app, argc, argv, [&] { return run(o); });
}
