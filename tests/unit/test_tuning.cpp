// Autotuning without a GPU: candidate enumeration and pruning, problem buckets, the tuning
// database (schema, strict parsing, atomic merge with concurrent writers), the dispatch order and
// stamp mismatches, and the flashjit-tune / flashjit-warm command lines.
#include <catch2/catch.hpp>

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include <fmt/format.h>

#include <nlohmann/json.hpp>

#include "dispatch.hpp"
#include "family.hpp"
#include "flashjit/dispatch.hpp"
#include "flashjit/flashjit.h"
#include "flashjit/codegen/render.hpp"
#include "flashjit/tuning.hpp"
#include "support/subprocess.hpp"
#include "support/temp_dir.hpp"
#include "support/tuning_entries.hpp"
#include "support/worker_specs.hpp"
#include "tuner.hpp"

using namespace flashjit;
using namespace flashjit::test;

namespace {

std::string read_file(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

void write_file(const std::string& path, const std::string& text) { std::ofstream(path) << text; }

DeviceProperties tabulated_h200() {
  DeviceProperties d;
  d.name = "NVIDIA H200";
  d.cc_major = 9;
  d.cc_minor = 0;
  d.sm_count = 132;
  d.max_smem_per_block_optin = 232448;
  d.total_memory = int64_t(150) << 30;
  d.driver_version = 13000;
  return d;
}

detail::ForwardProblem causal_problem(int batch, int seqlen, int heads, int head_dim, bool head_major = false) {
  alignas(16) static unsigned char arena[16];
  auto q = head_major ? TensorView::head_major(arena, ScalarType::bfloat16, batch, seqlen, heads, head_dim)
                      : TensorView::contiguous(arena, ScalarType::bfloat16, {batch, seqlen, heads, head_dim});
  AttentionOptions options;
  options.causal = true;
  return detail::make_forward_problem(q, q, q, q, nullptr, nullptr, options);
}

// A tuned entry for a causal head-dim-128 problem on `device`: sm90_fwd's default spec with
// `block_n` replaced, recorded under `stamp`.
TunedEntry causal_d128_entry(const DeviceProperties& device, const ProblemKey& key, int block_n,
                             const DeviceStamp& stamp) {
  TunedEntry e;
  e.device = stamp;
  e.problem = key;
  e.spec = default_spec(Family::sm90_fwd, device.arch(), DType::bf16, 128, MaskKind::causal);
  e.spec.block_n = block_n;
  REQUIRE_FALSE(e.spec.validate().has_value());
  e.median_ms = 1;
  e.tuned_at = "2026-11-30T00:00:00Z";
  return e;
}

struct Tool {
  int status;
  std::string output;
};

Tool run_tool(std::vector<std::string> args) {
  Subprocess p(args);
  const int status = p.wait();
  return {status, p.output()};
}

}  // namespace

TEST_CASE("candidates: legal, pruned to the arch's shared memory, default included", "[tuning]") {
  struct Row {
    Family family;
    const char* arch;
    int head_dim;
  };
  for (Row r : {Row{Family::fa2_fwd, "sm_90a", 128}, Row{Family::fa2_fwd, "sm_80", 256}, Row{Family::fa2_fwd, "sm_86", 256},
                Row{Family::fa2_bwd, "sm_90a", 128}, Row{Family::fa2_bwd, "sm_80", 256}, Row{Family::fa2_bwd, "sm_89", 64}}) {
    const Arch arch = Arch::parse(r.arch);
    for (MaskKind mask : {MaskKind::none, MaskKind::causal}) {
      INFO(to_string(r.family) << " " << r.arch << " d" << r.head_dim << " " << to_string(mask));
      const auto candidates = candidate_specs(r.family, arch, DType::bf16, r.head_dim, mask, false);
      CHECK(candidates.size() >= 4);
      const KernelSpec fallback = default_spec(r.family, arch, DType::bf16, r.head_dim, mask);
      CHECK(std::find(candidates.begin(), candidates.end(), fallback) != candidates.end());
      for (const auto& c : candidates) {
        CHECK_FALSE(c.validate().has_value());
        CHECK(c.family == r.family);
        CHECK(c.arch == arch);
        CHECK(c.mask == mask);
        CHECK(dynamic_smem_bytes(c) <= max_smem_per_block(arch));
        CHECK(std::count(candidates.begin(), candidates.end(), c) == 1);
      }
    }
  }
  // The 99 KB archs lose the big tiles that Hopper keeps.
  const auto hopper = candidate_specs(Family::fa2_fwd, Arch::parse("sm_90a"), DType::bf16, 256, MaskKind::none, false);
  const auto ada = candidate_specs(Family::fa2_fwd, Arch::parse("sm_89"), DType::bf16, 256, MaskKind::none, false);
  CHECK(ada.size() < hopper.size());
  CHECK(candidate_specs(Family::reference_fwd, Arch::parse("sm_80"), DType::bf16, 64, MaskKind::none, false).size() == 1);
}

TEST_CASE("backward candidates: fa2_bwd tiles, and sm90_bwd's steps and stage counts where it has the head dim",
          "[tuning]") {
  // What the tuner times for a backward problem: every family sharing the dispatched one's key.
  auto backward_candidates = [](const Arch& arch, int head_dim) {
    const detail::ForwardProblem problem = causal_problem(2, 256, 4, head_dim);
    const detail::TuningPlan plan = detail::tuning_plan(detail::PassProblem{detail::Pass::backward, problem}, arch);
    CHECK(plan.key.family == Family::fa2_bwd);
    return plan.candidates;
  };
  const Arch hopper = Arch::parse("sm_90a");
  for (int head_dim : {64, 96, 128, 256}) {
    INFO("d" << head_dim);
    const auto candidates = backward_candidates(hopper, head_dim);
    const auto fa2 = candidate_specs(Family::fa2_bwd, hopper, DType::bf16, head_dim, MaskKind::causal, false);
    const auto sm90 = std::count_if(candidates.begin(), candidates.end(), [](const KernelSpec& c) { return c.family == Family::sm90_bwd; });
    CHECK(candidates.size() == fa2.size() + sm90);
    // Steps of 64 queries at both stage counts at 64, 96 and 128 (at 256 the tiles leave room for
    // two only); steps of 80 at two, and at 64 also three; steps of 128 at 64 only, at two.
    CHECK(sm90 == (head_dim == 256 ? 1 : head_dim == 64 ? 5 : 3));
    const KernelSpec dispatch_default = heuristic_backward_spec(hopper, DType::bf16, head_dim, MaskKind::causal);
    CHECK(std::find(candidates.begin(), candidates.end(), dispatch_default) != candidates.end());
    for (const auto& c : candidates) {
      CHECK_FALSE(c.validate().has_value());
      CHECK(dynamic_smem_bytes(c) <= max_smem_per_block(hopper));
    }
  }
  const auto ampere = backward_candidates(Arch::parse("sm_80"), 128);
  CHECK(std::none_of(ampere.begin(), ampere.end(), [](const KernelSpec& c) { return c.family == Family::sm90_bwd; }));
}

TEST_CASE("problem keys bucket seqlens and batch x heads to powers of two", "[tuning]") {
  const std::pair<int64_t, int> buckets[] = {{0, 64}, {1, 64}, {64, 64}, {65, 128}, {4096, 4096}, {4097, 8192}, {100000, 131072}};
  for (auto [n, bucket] : buckets) CHECK(ProblemKey::bucket(n) == bucket);
  const ProblemKey key = detail::problem_key(causal_problem(2, 3000, 16, 120), Family::fa2_bwd);
  CHECK(key.family == Family::fa2_bwd);
  CHECK(key.head_dim == 128);
  CHECK(key.mask == MaskKind::causal);
  CHECK(key.seqlen_bucket == 4096);
  CHECK(key.batch_heads_bucket == 64);
  CHECK(key.describe() == "fa2_bwd bf16 d128 causal s<=4096 bh<=64");
  CHECK_FALSE(key.head_major);
}

TEST_CASE("problem keys carry the layout: head-major q is keyed apart from sequence-major", "[tuning]") {
  const ProblemKey bhsd = detail::problem_key(causal_problem(2, 3000, 16, 128, true), Family::sm90_fwd);
  CHECK(bhsd.head_major);
  CHECK(bhsd.describe() == "sm90_fwd bf16 d128 causal s<=4096 bh<=64 bhsd");
  ProblemKey bshd = bhsd;
  bshd.head_major = false;
  CHECK_FALSE(bshd == bhsd);
  CHECK(detail::problem_key(causal_problem(2, 3000, 16, 128), Family::sm90_fwd) == bshd);
  // One head: the strides do not tell a layout, and sequence-major is the default.
  CHECK_FALSE(detail::problem_key(causal_problem(2, 3000, 1, 128, true), Family::sm90_fwd).head_major);

  // The database keeps the layout ("layout": "bhsd"); an entry without the field is sequence-major
  // (databases written before it), and anything else is refused by name.
  TuningDb db;
  TunedEntry e = numbered_entry(0);
  e.problem.head_major = true;
  db.upsert(e);
  db.upsert(numbered_entry(0));  // the same problem in the other layout: a second entry
  REQUIRE(db.entries().size() == 2);
  nlohmann::json j = nlohmann::json::parse(db.dump());
  CHECK(j["entries"][0]["problem"]["layout"] == "bhsd");
  CHECK(j["entries"][1]["problem"]["layout"] == "bshd");
  j["entries"][1]["problem"].erase("layout");
  const TuningDb back = TuningDb::parse(j.dump(), "memory");
  REQUIRE(back.entries().size() == 2);
  CHECK(back.entries()[0].problem.head_major);
  CHECK_FALSE(back.entries()[1].problem.head_major);
  j["entries"][0]["problem"]["layout"] = "bsdh";
  CHECK_THROWS_WITH(TuningDb::parse(j.dump(), "db.json"),
                    Catch::Contains("entries[0].problem.layout must be \"bshd\" or \"bhsd\", got \"bsdh\""));
}

TEST_CASE("kvcache_fwd keys carry the packed query rows; its entries must have them, others must not", "[tuning]") {
  const std::pair<int64_t, int> rows[] = {{1, 16}, {16, 16}, {17, 32}, {64, 64}, {100, 128}, {5000, 128}};
  for (auto [n, bucket] : rows) CHECK(ProblemKey::query_rows(n) == bucket);
  alignas(16) static unsigned char arena[16];
  auto view = [](int batch, int seqlen, int heads) {
    return TensorView::contiguous(arena, ScalarType::bfloat16, {batch, seqlen, heads, 128});
  };
  // Decode (one query of a group of 4) and speculative verification (8 queries of it) over the
  // same cache: keyed apart, and the fa2_fwd key of the same problem has no rows.
  const detail::ForwardProblem decode =
      detail::make_kvcache_problem(view(4, 1, 32), KvCache{view(4, 16384, 8), view(4, 16384, 8)}, view(4, 1, 32),
                                   nullptr, {})
          .forward;
  const detail::ForwardProblem verify =
      detail::make_kvcache_problem(view(4, 8, 32), KvCache{view(4, 16384, 8), view(4, 16384, 8)}, view(4, 8, 32),
                                   nullptr, {})
          .forward;
  const ProblemKey decode_key = detail::problem_key(decode, Family::kvcache_fwd);
  CHECK(decode_key.query_rows_bucket == 16);
  CHECK(detail::problem_key(verify, Family::kvcache_fwd).query_rows_bucket == 32);
  CHECK_FALSE(decode_key == detail::problem_key(verify, Family::kvcache_fwd));
  CHECK(decode_key.describe() == "kvcache_fwd bf16 d128 s<=16384 bh<=128 rows<=16");
  CHECK(detail::problem_key(decode, Family::fa2_fwd).query_rows_bucket == 0);

  TunedEntry e = numbered_entry(0);
  e.problem = decode_key;
  e.spec = default_spec(Family::kvcache_fwd, Arch::parse("sm_90a"), DType::bf16, 128, MaskKind::none);
  TuningDb db;
  db.upsert(e);
  db.upsert(numbered_entry(0));
  const std::string text = db.dump();
  const TuningDb back = TuningDb::parse(text, "memory");
  REQUIRE(back.entries().size() == 2);
  CHECK(back.entries()[0].problem == decode_key);
  CHECK(back.dump() == text);
  nlohmann::json j = nlohmann::json::parse(text);
  CHECK(j["entries"][0]["problem"]["query_rows_bucket"] == 16);
  CHECK_FALSE(j["entries"][1]["problem"].contains("query_rows_bucket"));
  nlohmann::json bad = j;
  bad["entries"][0]["problem"].erase("query_rows_bucket");
  CHECK_THROWS_WITH(TuningDb::parse(bad.dump(), "db.json"),
                    Catch::Contains("entries[0].problem.query_rows_bucket: kvcache_fwd entries need a query_rows_bucket"));
  bad = j;
  bad["entries"][0]["problem"]["query_rows_bucket"] = 48;
  CHECK_THROWS_WITH(TuningDb::parse(bad.dump(), "db.json"), Catch::Contains("must be 16, 32, 64 or 128, got 48"));
  bad = j;
  bad["entries"][1]["problem"]["query_rows_bucket"] = 16;
  CHECK_THROWS_WITH(TuningDb::parse(bad.dump(), "db.json"), Catch::Contains("entries have no query_rows_bucket"));
}

TEST_CASE("tuning db: round trip and strict parsing", "[tuning]") {
  TuningDb db;
  for (int i = 0; i < 3; ++i) db.upsert(numbered_entry(i));
  db.upsert(numbered_entry(1));  // same device and problem: replaced, not added
  REQUIRE(db.entries().size() == 3);
  const TuningDb back = TuningDb::parse(db.dump(), "memory");
  REQUIRE(back.entries().size() == 3);
  CHECK(back.dump() == db.dump());
  const TunedEntry* found = back.find(test_stamp(), numbered_entry(2).problem);
  REQUIRE(found != nullptr);
  CHECK(found->spec == numbered_entry(2).spec);
  CHECK(found->runner_ups.size() == 1);
  CHECK(back.find(test_stamp("Other GPU"), numbered_entry(2).problem) == nullptr);

  auto expect_error = [&](const std::string& text, const std::string& message) {
    INFO(text);
    CHECK_THROWS_WITH(TuningDb::parse(text, "db.json"), Catch::Contains(message));
  };
  expect_error("{\"format\": \"flashjit-tuning-db\",\n \"version\": 1\n \"entries\": []}", "db.json:3:");
  expect_error("{\"format\": \"flashjit-tuning-db\", \"version\": 1}", "missing field 'entries'");
  expect_error("{\"format\": \"other\", \"version\": 1, \"entries\": []}", "format must be \"flashjit-tuning-db\"");
  expect_error("{\"format\": \"flashjit-tuning-db\", \"version\": 7, \"entries\": []}", "version 7 is not supported");
  nlohmann::json j = nlohmann::json::parse(db.dump());
  auto mutated = [&](auto&& change) {
    nlohmann::json copy = j;
    change(copy);
    return copy.dump();
  };
  expect_error(mutated([](auto& c) { c["entries"][1]["problem"]["maks"] = 1; }),
               "entries[1].problem: unknown field 'maks'");
  expect_error(mutated([](auto& c) { c["entries"][0]["problem"]["mask"] = "diagonal"; }),
               "entries[0].problem.mask: unknown mask 'diagonal'");
  expect_error(mutated([](auto& c) { c["entries"][0]["problem"]["seqlen_bucket"] = 100; }),
               "entries[0].problem.seqlen_bucket must be a power of two");
  expect_error(mutated([](auto& c) { c["entries"][0]["device"].erase("sm_count"); }),
               "entries[0].device: missing field 'sm_count'");
  expect_error(mutated([](auto& c) { c["entries"][0]["spec"]["block_m"] = 48; }), "entries[0].spec:");
  expect_error(mutated([](auto& c) { c["entries"][0]["spec"]["mask"] = "none"; }), "does not serve the problem");
  expect_error(mutated([](auto& c) { c["entries"][2]["median_ms"] = -1; }), "entries[2].median_ms must be a finite number");
  expect_error(mutated([](auto& c) { c["entries"][0]["problem"]["family"] = "reference_fwd"; }),
               "entries[0].problem.family: reference_fwd is not tuned (fa2_fwd, fa2_bwd, sm90_fwd, kvcache_fwd)");
}

TEST_CASE("tuning db: backward entries are keyed by fa2_bwd and hold either backward family's spec", "[tuning]") {
  // (flashjit-tune --pass bwd times sm90_bwd beside fa2_bwd under fa2_bwd's key; a winner of either
  // family must survive the database's save and strict reading.)
  const Arch hopper = Arch::parse("sm_90a");
  TuningDb db;
  for (Family family : {Family::sm90_bwd, Family::fa2_bwd}) {
    TunedEntry e = numbered_entry(family == Family::sm90_bwd ? 0 : 1);
    e.problem.family = Family::fa2_bwd;
    e.problem.head_dim = 64;
    e.spec = default_spec(family, hopper, DType::bf16, 64, MaskKind::causal);
    e.runner_ups = {{default_spec(Family::fa2_bwd, hopper, DType::bf16, 64, MaskKind::causal), 2.0}};
    db.upsert(e);
  }
  const std::string text = db.dump();
  const TuningDb back = TuningDb::parse(text, "memory");
  REQUIRE(back.entries().size() == 2);
  CHECK(back.entries()[0].spec.family == Family::sm90_bwd);
  CHECK(back.dump() == text);
  // A forward spec under the backward key serves nothing.
  nlohmann::json j = nlohmann::json::parse(text);
  j["entries"][0]["spec"] = default_spec(Family::sm90_fwd, hopper, DType::bf16, 64, MaskKind::causal).to_json();
  CHECK_THROWS_WITH(TuningDb::parse(j.dump(), "db.json"), Catch::Contains("does not serve the problem"));
}

TEST_CASE("the bundled tuning database parses and every entry is usable", "[tuning]") {
  const TuningDb* bundled = nullptr;
  REQUIRE_NOTHROW(bundled = &bundled_tuning_db());  // strict parsing at first use
  for (const TunedEntry& e : bundled->entries()) {
    INFO(e.device.describe() << " " << e.problem.describe());
    CHECK_FALSE(e.device.name.empty());
    CHECK_FALSE(e.spec.validate().has_value());
    CHECK(detail::runtime_family(e.spec.family).tuning_key == e.problem.family);
    CHECK(e.median_ms > 0);
  }
}

TEST_CASE("tuning db: concurrent writers merge atomically, a bad file is left alone", "[tuning]") {
  TempDir dir;
  const std::string path = dir / "tuning.json";
  {
    std::vector<std::unique_ptr<Subprocess>> writers;
    for (int w = 0; w < 2; ++w)
      writers.push_back(std::make_unique<Subprocess>(std::vector<std::string>{
          FLASHJIT_TUNING_WORKER, path, std::to_string(w * 20), "20"}));
    for (auto& w : writers) CHECK(w->wait() == 0);
  }
  const TuningDb db = TuningDb::load(path);
  CHECK(db.entries().size() == 40);
  for (int i = 0; i < 40; ++i) CHECK(db.find(test_stamp(), numbered_entry(i).problem) != nullptr);

  // A file that is not a tuning database is refused and keeps its bytes.
  const std::string other = dir / "notes.json";
  write_file(other, "{\"my\": \"notes\"}\n");
  TuningDb one;
  one.upsert(numbered_entry(0));
  CHECK_THROWS_WITH(one.save_merged(other), Catch::Contains("unknown field 'my'"));
  CHECK(read_file(other) == "{\"my\": \"notes\"}\n");
  CHECK_THROWS_AS(one.save_merged(dir / "no/such/dir/tuning.json"), Error);
}

TEST_CASE("dispatch order: forced, in-memory, user, bundled, heuristic; other devices skipped once", "[tuning]") {
  const DeviceProperties device = tabulated_h200();
  const DeviceStamp here = DeviceStamp::of(device);
  const detail::ForwardProblem problem = causal_problem(2, 4096, 16, 128);
  // On an H200 the forward's family is sm90_fwd, whose default block_n at head dim 128 is 128.
  const ProblemKey key = detail::problem_key(problem, Family::sm90_fwd);
  auto entry_with = [&](int block_n, const DeviceStamp& stamp) { return causal_d128_entry(device, key, block_n, stamp); };
  std::vector<std::string> warnings;
  TuningSources sources([&](const std::string& w) { warnings.push_back(w); });
  const KernelSpec heuristic = detail::select_forward_kernel(problem, device, &sources);
  CHECK(heuristic == heuristic_forward_spec(device.arch(), DType::bf16, 128, MaskKind::causal));

  TuningDb bundled, user;
  bundled.upsert(entry_with(64, here));
  sources.set_bundled_db(bundled);
  CHECK(detail::select_forward_kernel(problem, device, &sources).block_n == 64);
  user.upsert(entry_with(96, here));
  sources.set_user_db(user, "user.json");
  CHECK(detail::select_forward_kernel(problem, device, &sources).block_n == 96);
  sources.add_in_memory(entry_with(112, here));
  CHECK(detail::select_forward_kernel(problem, device, &sources).block_n == 112);
  // A forced spec beats every database; the backward's key is its own.
  detail::ForwardProblem forced = problem;
  forced.forced_kernel = heuristic;
  CHECK(detail::select_forward_kernel(forced, device, &sources) == heuristic);
  const KernelSpec backward = detail::select_kernel(detail::PassProblem{detail::Pass::backward, problem}, device, &sources);
  CHECK(backward == heuristic_backward_spec(device.arch(), DType::bf16, 128, MaskKind::causal));
  // A problem in another bucket falls through to the heuristic.
  CHECK(detail::select_forward_kernel(causal_problem(2, 8192, 16, 128), device, &sources) ==
        heuristic_forward_spec(device.arch(), DType::bf16, 128, MaskKind::causal));
  CHECK(warnings.empty());

  // Entries from another device (or driver, or NVRTC) are skipped, with one warning per database.
  DeviceStamp newer_driver = here;
  newer_driver.driver_version += 10;
  TuningSources stale([&](const std::string& w) { warnings.push_back(w); });
  TuningDb old;
  old.upsert(entry_with(64, newer_driver));
  stale.set_user_db(old, "old.json");
  for (int call = 0; call < 3; ++call)
    CHECK(detail::select_forward_kernel(problem, device, &stale) ==
          heuristic_forward_spec(device.arch(), DType::bf16, 128, MaskKind::causal));
  REQUIRE(warnings.size() == 1);
  CHECK_THAT(warnings[0], Catch::Contains("old.json") && Catch::Contains("skipped"));
}

TEST_CASE("dispatch: an entry of the call's own layout first, else the other layout's", "[tuning]") {
  const DeviceProperties device = tabulated_h200();
  const detail::ForwardProblem bshd = causal_problem(2, 4096, 16, 128);
  const detail::ForwardProblem bhsd = causal_problem(2, 4096, 16, 128, true);
  auto entry_with = [&](int block_n, const detail::ForwardProblem& problem) {
    return causal_d128_entry(device, detail::problem_key(problem, Family::sm90_fwd), block_n, DeviceStamp::of(device));
  };
  TuningSources sources;
  TuningDb bundled;
  bundled.upsert(entry_with(64, bshd));
  sources.set_bundled_db(bundled);
  // Only a sequence-major entry: head-major calls use it too.
  CHECK(detail::select_forward_kernel(bshd, device, &sources).block_n == 64);
  CHECK(detail::select_forward_kernel(bhsd, device, &sources).block_n == 64);
  // A head-major entry (even in a later source) serves head-major calls only.
  TuningDb user;
  user.upsert(entry_with(96, bhsd));
  sources.set_user_db(user, "user.json");
  CHECK(detail::select_forward_kernel(bhsd, device, &sources).block_n == 96);
  CHECK(detail::select_forward_kernel(bshd, device, &sources).block_n == 64);
  bundled.upsert(entry_with(112, bhsd));
  sources.set_bundled_db(bundled);
  sources.set_user_db(TuningDb{}, "none");
  CHECK(detail::select_forward_kernel(bhsd, device, &sources).block_n == 112);
  CHECK(detail::select_forward_kernel(bshd, device, &sources).block_n == 64);
}

TEST_CASE("flashjit-tune: dry run lists candidates; bad input exits 2 and writes nothing", "[tuning]") {
  TempDir dir;
  Tool t = run_tool({FLASHJIT_TUNE_TOOL, "--shape", "2,4096,4096,16,8,128", "--causal", "off,on", "--pass", "fwd,bwd",
                     "--dry-run", "--arch", "sm_80", "--json"});
  REQUIRE(t.status == 0);
  const auto listed = nlohmann::json::parse(t.output);
  REQUIRE(listed.size() == 4);
  CHECK(listed[0]["problem"] == "fa2_fwd bf16 d128 s<=4096 bh<=64");
  CHECK(listed[3]["problem"] == "fa2_bwd bf16 d128 causal s<=4096 bh<=64");
  for (const auto& shape : listed) {
    CHECK(shape["candidates"].size() >= 4);
    for (const auto& name : shape["candidates"]) CHECK_THAT(name.get<std::string>(), Catch::EndsWith("_sm80"));
  }
  // --layout bhsd keys the shapes head-major.
  t = run_tool({FLASHJIT_TUNE_TOOL, "--shape", "2,4096,4096,16,8,128", "--layout", "bhsd", "--dry-run", "--json"});
  REQUIRE(t.status == 0);
  CHECK(nlohmann::json::parse(t.output)[0]["problem"] == "sm90_fwd bf16 d128 s<=4096 bh<=64 bhsd");
  // --pass kvcache: decode's candidates, keyed by the packed query rows.
  t = run_tool({FLASHJIT_TUNE_TOOL, "--shape", "64,1,16384,32,8,128", "--pass", "kvcache", "--dry-run", "--json"});
  REQUIRE(t.status == 0);
  const auto decode = nlohmann::json::parse(t.output)[0];
  CHECK(decode["problem"] == "kvcache_fwd bf16 d128 s<=16384 bh<=2048 rows<=16");
  CHECK(decode["candidates"].size() >= 8);
  for (const auto& name : decode["candidates"]) CHECK_THAT(name.get<std::string>(), Catch::StartsWith("kvcache_fwd_"));

  auto expect_usage = [&](std::vector<std::string> args, const std::string& why) {
    args.insert(args.begin(), FLASHJIT_TUNE_TOOL);
    INFO(why);
    CHECK(run_tool(args).status == 2);
  };
  expect_usage({"--shape", "2,4096"}, "a shape needs six numbers");
  expect_usage({"--shape", "2,64,64,4,3,64", "--dry-run"}, "heads_kv must divide heads_q");
  expect_usage({"--shape", "2,64,64,4,4,512", "--dry-run"}, "head dims over 256 have no spec");
  expect_usage({"--shape", "2,64,64,4,4,64", "--pass", "sideways", "--dry-run"}, "unknown pass");
  expect_usage({"--shape", "2,64,64,4,4,64", "--dry-run", "--arch", "sm_99"}, "an arch NVRTC does not know");
  expect_usage({"--shape", "2,64,64,4,4,64", "--dry-run", "--arch", "gfx90a"}, "not an arch name");
  expect_usage({"--dry-run"}, "no shapes");
  expect_usage({"--shape", "2,64,64,4,4,64", "--layout", "bsdh", "--dry-run"}, "unknown layout");
  write_file(dir / "shapes.json", "[{\"batch\": 1, \"seqlen_q\": 64,\n  \"seqlen_k\" 64}]");
  expect_usage({"--shapes", dir / "shapes.json", "--dry-run"}, "malformed JSON");
  write_file(dir / "shapes2.json", "[{\"batch\":1,\"seqlen_q\":64,\"seqlen_k\":64,\"heads_q\":4,\"heads_kv\":4,\"head_dim\":64,\"windw\":1}]");
  expect_usage({"--shapes", dir / "shapes2.json", "--dry-run"}, "unknown field");

  // An output that is not a tuning database, or cannot be written: refused before any work.
  write_file(dir / "precious.json", "not json at all");
  expect_usage({"--shape", "2,64,64,4,4,64", "--output", dir / "precious.json"}, "existing non-database output");
  CHECK(read_file(dir / "precious.json") == "not json at all");
  expect_usage({"--shape", "2,64,64,4,4,64", "--output", dir / "missing/dir/tuning.json"}, "unwritable output");
}

TEST_CASE("flashjit-warm: fills an empty cache, then finds it all cached; a fresh process compiles nothing", "[tuning]") {
  TempDir dir;
  const std::string cache = dir / "cache";
  nlohmann::json specs = nlohmann::json::array();
  const auto worker = worker_specs();
  for (int i = 0; i < 2; ++i) specs.push_back(worker[i].to_json());
  write_file(dir / "specs.json", specs.dump());

  Tool first = run_tool({FLASHJIT_WARM_TOOL, "--specs", dir / "specs.json", "--cache-dir", cache, "--json"});
  REQUIRE(first.status == 0);
  CHECK(nlohmann::json::parse(first.output)["counts"]["compiled"] == 2);
  Tool second = run_tool({FLASHJIT_WARM_TOOL, "--specs", dir / "specs.json", "--cache-dir", cache, "--json"});
  REQUIRE(second.status == 0);
  CHECK(nlohmann::json::parse(second.output)["counts"]["cached"] == 2);
  CHECK(nlohmann::json::parse(second.output)["counts"].value("compiled", 0) == 0);

  Tool fresh = run_tool({FLASHJIT_CACHE_WORKER, cache, "0", "2"});
  REQUIRE(fresh.status == 0);
  const auto stats = nlohmann::json::parse(fresh.output);
  CHECK(stats["compiles"] == 0);
  CHECK(stats["disk_hits"] == 2);

  // A tuning database's winners and runner-ups, retargeted to --arch.
  TuningDb db;
  db.upsert(numbered_entry(0));
  db.save_merged(dir / "tuning.json");
  Tool tuned = run_tool({FLASHJIT_WARM_TOOL, "--tuning-db", dir / "tuning.json", "--arch", "sm_80", "--cache-dir", cache,
                         "--json"});
  REQUIRE(tuned.status == 0);
  const auto report = nlohmann::json::parse(tuned.output);
  CHECK(report["counts"]["compiled"] == 2);
  for (const auto& k : report["kernels"]) CHECK(k["spec"]["arch"] == "sm_80");
  write_file(dir / "broken.json", "{\"format\": \"flashjit-tuning-db\", \"version\": 1, \"entries\": [}");
  CHECK(run_tool({FLASHJIT_WARM_TOOL, "--tuning-db", dir / "broken.json", "--cache-dir", cache}).status == 2);
}

TEST_CASE("the tuner keeps the heuristic's spec unless a finalist beats it by the margin", "[tuning]") {
  using Ranking = std::vector<std::pair<double, size_t>>;
  auto winner = [](Ranking medians, size_t heuristic) {
    return detail::rank_against_heuristic(std::move(medians), heuristic, 0.01).front().second;
  };
  CHECK(winner({{1.000, 7}, {0.980, 3}, {1.050, 5}}, 7) == 3);  // 2% faster: a real win
  CHECK(winner({{1.000, 7}, {0.995, 3}, {1.050, 5}}, 7) == 7);  // 0.5%: noise, the heuristic stays
  CHECK(winner({{0.990, 7}, {1.000, 3}}, 7) == 7);              // the heuristic is fastest
  CHECK(winner({{1.000, 7}, {0.990, 3}}, 7) == 3);              // exactly the margin
  CHECK(winner({{1.000, 7}}, 7) == 7);
  // The runner-ups keep their order behind the winner.
  const Ranking ranked = detail::rank_against_heuristic({{1.000, 7}, {0.995, 3}, {0.999, 4}, {1.2, 5}}, 7, 0.01);
  CHECK(ranked == Ranking{{1.000, 7}, {0.995, 3}, {0.999, 4}, {1.2, 5}});
}

TEST_CASE("the tools check every argument before any work: exit 2, naming the flag", "[tuning]") {
  const test::TempDir dir;
  const std::string cache = dir / "cache";
  struct Case {
    std::vector<std::string> args;
    const char* named;
  };
  const Case cases[] = {
      {{FLASHJIT_TUNE_TOOL, "--shape", "99999999999,64,64,4,4,64", "--dry-run"}, "--shape"},
      {{FLASHJIT_TUNE_TOOL, "--shape", "2,64,64,4,4,64,", "--dry-run"}, "--shape"},
      {{FLASHJIT_TUNE_TOOL, "--shape", "2,64,64,4,4,64", "--dry-run", "--arch", "sm_75"}, "sm_80 or newer"},
      {{FLASHJIT_TUNE_TOOL, "--shape", "2,64,64,4,4,64", "--dry-run", "--arch", "sm_80a"}, "arch-specific"},
      {{FLASHJIT_WARM_TOOL, "--arch", "sm_80", "--cache-dir", cache, "-j", "0"}, "--jobs"},
      {{FLASHJIT_WARM_TOOL, "--arch", "sm_80", "--cache-dir", cache, "-j", "-1"}, "--jobs"},
      {{FLASHJIT_WARM_TOOL, "--arch", "sm_80", "--cache-dir", cache, "-j", "100000"}, "--jobs"},
      {{FLASHJIT_WARM_TOOL, "--arch", "sm_80", "--cache-dir", cache, "--head-dims", "7"}, "head dim 7"},
      {{FLASHJIT_WARM_TOOL, "--arch", "sm_80", "--cache-dir", cache, "--head-dims", "0"}, "head dim 0"},
      {{FLASHJIT_WARM_TOOL, "--arch", "sm_80", "--cache-dir", cache, "--head-dims", "-64"}, "head dim -64"},
      {{FLASHJIT_WARM_TOOL, "--arch", "sm_80", "--cache-dir", cache, "--head-dims", "1000"}, "head dim 1000"},
      {{FLASHJIT_WARM_TOOL, "--arch", "sm_75", "--cache-dir", cache}, "sm_80 or newer"},
      {{FLASHJIT_WARM_TOOL, "--tuning-db", dir / "missing.json", "--cache-dir", cache}, "--tuning-db"},
      {{FLASHJIT_BENCH_TOOL, "--seqlens", "3000"}, "--seqlens"},
      {{FLASHJIT_BENCH_TOOL, "--causal", "sometimes"}, "--causal"},
      {{FLASHJIT_BENCH_TOOL, "--tuning-db", dir / "missing.json"}, "--tuning-db"},
  };
  for (const Case& c : cases) {
    std::string command;
    for (const auto& a : c.args) command += "'" + a + "' ";
    INFO(command);
    const Tool t = run_tool({"/bin/sh", "-c", command + "2>&1"});  // the message goes to stderr
    INFO(t.output);
    CHECK(t.status == 2);
    CHECK_THAT(t.output, Catch::Contains(c.named));
  }
  CHECK_FALSE(std::filesystem::exists(cache + "/sm_80"));  // nothing was compiled
}

TEST_CASE("the tools' --version names the tool and the library's version, exit 0", "[tuning]") {
  for (const char* tool : {FLASHJIT_TUNE_TOOL, FLASHJIT_WARM_TOOL, FLASHJIT_BENCH_TOOL}) {
    const Tool t = run_tool({tool, "--version"});
    INFO(tool << ": " << t.output);
    CHECK(t.status == 0);
    const std::string name = std::filesystem::path(tool).filename().string();
    CHECK(t.output == fmt::format("{} {}\n", name, flashjit_version()));
  }
  CHECK(std::string(flashjit_version()).find('.') != std::string::npos);
}

TEST_CASE("tuning databases: 64-bit range checks, validated saves, no file written through a planted link", "[tuning]") {
  namespace fs = std::filesystem;
  const test::TempDir dir;
  TuningDb one;
  one.upsert(numbered_entry(0));
  const std::string good = one.dump();

  // Integers past their field's range are refused, not truncated.
  const std::pair<std::string, std::string> out_of_range[] = {
      {"\"head_dim\": 128", "\"head_dim\": 4294967424"},
      {"\"sm_count\": 132", "\"sm_count\": 4294967428"},
      {"\"seqlen_bucket\": 64", "\"seqlen_bucket\": 8589934592"},
  };
  for (const auto& [from, to] : out_of_range) {
    INFO(to);
    std::string text = good;
    const auto at = text.find(from);
    REQUIRE(at != std::string::npos);
    text.replace(at, from.size(), to);
    CHECK_THROWS_WITH(TuningDb::parse(text, "db.json"), Catch::Contains("must be an integer from"));
  }

  // What a save writes must load: an entry the loader refuses is refused on save, the file untouched.
  const std::string path = dir / "tuning.json";
  one.save_merged(path);
  const std::string before = read_file(path);
  TuningDb bad;
  TunedEntry e = numbered_entry(1);
  e.problem.batch_heads_bucket = 0;
  bad.upsert(e);
  CHECK_THROWS_WITH(bad.save_merged(path), Catch::Contains("batch_heads_bucket"));
  CHECK(read_file(path) == before);

  // A planted temporary file (a symlink to a victim) is never written through.
  const std::string victim = dir / "victim.txt";
  write_file(victim, "precious");
  for (int i = 0; i < 8; ++i) fs::create_symlink(victim, fmt::format("{}.tmp.{}.{}", path, ::getpid(), i));
  TuningDb two;
  two.upsert(numbered_entry(2));
  two.save_merged(path);
  CHECK(read_file(victim) == "precious");
  CHECK(TuningDb::load(path).entries().size() == 2);

  // The file's mode is kept; a symlinked database is updated where it points, the link kept.
  fs::permissions(path, fs::perms::owner_read | fs::perms::owner_write, fs::perm_options::replace);
  const std::string link = dir / "link.json";
  fs::create_symlink(path, link);
  TuningDb three;
  three.upsert(numbered_entry(3));
  three.save_merged(link);
  CHECK(fs::is_symlink(link));
  CHECK(TuningDb::load(path).entries().size() == 3);
  CHECK((fs::status(path).permissions() & fs::perms::all) == (fs::perms::owner_read | fs::perms::owner_write));

  // A directory, a device or a missing file is named as such.
  CHECK_THROWS_WITH(TuningDb::load(dir.path()), Catch::Contains("is a directory"));
  CHECK_THROWS_WITH(TuningDb::load("/dev/zero"), Catch::Contains("not a regular file"));
  CHECK_THROWS_WITH(TuningDb::load(dir / "missing.json"), Catch::Contains("no such file"));
}

TEST_CASE("FLASHJIT_DUMP_DIR: a missing directory is an error; dump files are 0600 and never written through links", "[tuning]") {
  namespace fs = std::filesystem;
  TempDir dir;
  const KernelSpec spec = worker_specs()[0];
  write_file(dir / "specs.json", nlohmann::json::array({spec.to_json()}).dump());
  auto warm = [&](const std::string& dump_dir, const std::string& cache) {
    return run_tool({"/bin/sh", "-c",
                     "FLASHJIT_DUMP_DIR='" + dump_dir + "' '" + FLASHJIT_WARM_TOOL + "' --specs '" + (dir / "specs.json") +
                         "' --cache-dir '" + cache + "' 2>&1"});
  };
  const Tool missing = warm(dir / "no-such-dir", dir / "cache1");
  CHECK(missing.status == 1);
  CHECK_THAT(missing.output, Catch::Contains("FLASHJIT_DUMP_DIR") && Catch::Contains("is not a directory"));

  const std::string dumps = dir / "dumps", victim = dir / "victim.txt";
  fs::create_directory(dumps);
  write_file(victim, "precious");
  fs::create_symlink(victim, dumps + "/" + spec.name() + ".cu");
  const Tool ok = warm(dumps, dir / "cache2");
  INFO(ok.output);
  CHECK(ok.status == 0);
  CHECK(read_file(victim) == "precious");
  const fs::path source = dumps + "/" + spec.name() + ".cu";
  CHECK_FALSE(fs::is_symlink(source));
  CHECK(read_file(source).find("Generated by flashjit") != std::string::npos);
  CHECK((fs::status(source).permissions() & fs::perms::all) == (fs::perms::owner_read | fs::perms::owner_write));
}

TEST_CASE("flashjit-warm: a kernel compiled but not written to the cache is a failure, not 'compiled'", "[tuning]") {
  TempDir dir;
  write_file(dir / "specs.json", nlohmann::json::array({worker_specs()[0].to_json()}).dump());
  // A file-size limit of 8 KB (with SIGXFSZ ignored, writes past it fail with EFBIG): the cubin
  // (~40 KB) cannot be written, as on a full disk.
  const Tool t = run_tool({"/bin/sh", "-c",
                           "trap '' XFSZ; ulimit -f 8; '" + std::string(FLASHJIT_WARM_TOOL) + "' --specs '" +
                               (dir / "specs.json") + "' --cache-dir '" + (dir / "cache") + "' 2>&1"});
  INFO(t.output);
  CHECK(t.status == 1);
  CHECK_THAT(t.output, Catch::Contains("uncached") && Catch::Contains("could not write cache entry"));
  CHECK_THAT(t.output, Catch::Contains("0 compiled") && Catch::Contains("1 compiled but not cached"));
}
