// KernelSpec: accept/reject tables, names, JSON round trip, hashing.
#include <catch2/catch.hpp>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <fstream>
#include <unordered_set>

#include "flashjit/codegen/kernel_spec.hpp"
#include "flashjit/codegen/render.hpp"
#include "flashjit/error.hpp"

using namespace flashjit;
using nlohmann::json;

namespace {

KernelSpec reference(int head_dim = 128, const char* arch = "sm_80") {
  return default_spec(Family::reference_fwd, Arch::parse(arch), DType::bf16, head_dim);
}

}  // namespace

TEST_CASE("Arch parses and prints CUDA arch names", "[spec]") {
  CHECK(Arch::parse("sm_80").sm == 80);
  CHECK_FALSE(Arch::parse("sm_80").arch_specific);
  CHECK(Arch::parse("sm_90a").arch_specific);
  CHECK(Arch::parse("sm_90a").name() == "sm_90a");
  CHECK(Arch::parse("sm_100a").sm == 100);
  for (const char* bad : {"", "sm_", "sm_9", "90a", "sm_90b", "compute_90", "sm_x0", "sm_1000"})
    CHECK_THROWS_AS(Arch::parse(bad), Error);
  CHECK_THROWS_WITH(Arch::parse("compute_90"), Catch::Contains("sm_80 or sm_90a"));
}

TEST_CASE("default specs of every family and head dim are legal", "[spec]") {
  for (Family f : all_families())
    for (int d : {32, 64, 96, 128, 160, 192, 224, 256})
      for (const char* arch : {"sm_80", "sm_86", "sm_89", "sm_90a"})
        for (DType t : {DType::fp16, DType::bf16})
          for (MaskKind m : {MaskKind::none, MaskKind::causal, MaskKind::window}) {
            if (!family_covers(f, Arch::parse(arch), d)) continue;  // e.g. sm90_fwd on sm_80
            KernelSpec s = default_spec(f, Arch::parse(arch), t, d, m, true);
            INFO(s.name());
            CHECK_FALSE(s.validate().has_value());
          }
}

TEST_CASE("illegal specs are rejected with the reason", "[spec]") {
  struct Case {
    const char* what;
    KernelSpec spec;
    const char* reason;
  };
  auto with = [](auto change) {
    KernelSpec s = reference();
    change(s);
    return s;
  };
  const Case cases[] = {
      {"old arch", with([](KernelSpec& s) { s.arch = Arch::parse("sm_75"); }), "needs sm_80"},
      {"head dim 48", with([](KernelSpec& s) { s.head_dim = 48; }), "no kernel for head_dim 48"},
      {"head dim 512", with([](KernelSpec& s) { s.head_dim = 512; }), "no kernel for head_dim 512"},
      {"3 warps", with([](KernelSpec& s) { s.num_warps = 3; s.block_m = 3; }), "num_warps must be"},
      {"block_m != warps", with([](KernelSpec& s) { s.block_m = 8; }), "block_m must equal"},
      {"block_n 64", with([](KernelSpec& s) { s.block_n = 64; }), "block_n must be 32"},
      {"2 stages", with([](KernelSpec& s) { s.num_stages = 2; }), "num_stages must be 1"},
      {"zero warps", with([](KernelSpec& s) { s.num_warps = 0; }), "must be positive"},
  };
  for (const auto& c : cases) {
    INFO(c.what);
    auto reason = c.spec.validate();
    REQUIRE(reason.has_value());
    CHECK_THAT(*reason, Catch::Contains(c.reason));
  }
}

TEST_CASE("spec names are readable and stable", "[spec]") {
  // Names are part of cache paths and tuning DBs: changing them orphans users' caches.
  CHECK(reference().name() == "reference_fwd_bf16_d128_m4n32w4s1_sm80");
  KernelSpec s = default_spec(Family::reference_fwd, Arch::parse("sm_90a"), DType::fp16, 64,
                              MaskKind::causal, true);
  CHECK(s.name() == "reference_fwd_fp16_d64_m4n32w4s1_causal_softcap_sm90a");
  s.mask = MaskKind::window;
  s.has_softcap = false;
  CHECK(s.name() == "reference_fwd_fp16_d64_m4n32w4s1_window_sm90a");
}

TEST_CASE("names and hashes tell specs apart", "[spec]") {
  std::unordered_set<std::string> names;
  std::unordered_set<KernelSpec, KernelSpecHash> specs;
  int count = 0;
  for (int d : {32, 64, 96, 128, 160, 192, 224, 256})
    for (DType t : {DType::fp16, DType::bf16})
      for (MaskKind m : {MaskKind::none, MaskKind::causal, MaskKind::window})
        for (bool softcap : {false, true})
          for (const char* arch : {"sm_80", "sm_90", "sm_90a"})
            for (int warps : {1, 2, 4, 8}) {
              KernelSpec s = default_spec(Family::reference_fwd, Arch::parse(arch), t, d, m, softcap);
              s.num_warps = s.block_m = warps;
              names.insert(s.name());
              specs.insert(s);
              ++count;
            }
  CHECK(static_cast<int>(names.size()) == count);
  CHECK(static_cast<int>(specs.size()) == count);
}

TEST_CASE("JSON round trip preserves every field", "[spec]") {
  KernelSpec s = default_spec(Family::reference_fwd, Arch::parse("sm_90a"), DType::fp16, 96,
                              MaskKind::window, true);
  s.num_warps = s.block_m = 8;
  const json j = s.to_json();
  CHECK(j.at("arch") == "sm_90a");
  CHECK(j.at("mask") == "window");
  const KernelSpec back = KernelSpec::from_json(j);
  CHECK(back == s);
  CHECK(back.name() == s.name());
  CHECK(KernelSpec::from_json(json::parse(j.dump())) == s);
}

TEST_CASE("a continuing spec: sm90_fwd only, its own name, hash and JSON", "[spec]") {
  KernelSpec s = default_spec(Family::sm90_fwd, Arch::parse("sm_90a"), DType::bf16, 128, MaskKind::causal);
  const KernelSpec plain = s;
  s.continues = true;
  CHECK(!s.validate());
  CHECK(s.name() == plain.name().substr(0, plain.name().size() - 6) + "_cont_sm90a");
  CHECK(s != plain);
  CHECK(KernelSpecHash{}(s) != KernelSpecHash{}(plain));
  const json j = s.to_json();
  CHECK(j.at("continues") == true);
  CHECK(KernelSpec::from_json(j) == s);
  CHECK(plain.to_json().count("continues") == 0);  // plain specs keep the JSON they always had
  json bad = j;
  bad["continues"] = 1;
  CHECK_THROWS_WITH(KernelSpec::from_json(bad), Catch::Contains("'continues' must be true or false"));
  KernelSpec fa2 = default_spec(Family::fa2_fwd, Arch::parse("sm_80"), DType::bf16, 128);
  fa2.continues = true;
  REQUIRE(fa2.validate());
  CHECK_THAT(*fa2.validate(), Catch::Contains("does not continue partial results"));
}

TEST_CASE("ordered dQ adds: sm90_bwd's at every tile, their own name, hash and JSON", "[spec]") {
  const Arch hopper = Arch::parse("sm_90a");
  KernelSpec s = default_spec(Family::sm90_bwd, hopper, DType::bf16, 128, MaskKind::causal);
  const KernelSpec plain = s;
  s.ordered_dq = true;
  CHECK_FALSE(s.validate().has_value());
  CHECK(s.name() == "sm90_bwd_bf16_d128_m64n128w12s2_causal_ordered_sm90a");
  CHECK(s != plain);
  CHECK(KernelSpecHash{}(s) != KernelSpecHash{}(plain));
  const json j = s.to_json();
  CHECK(j.at("ordered_dq") == true);
  CHECK(KernelSpec::from_json(j) == s);
  CHECK(plain.to_json().count("ordered_dq") == 0);
  json bad = j;
  bad["ordered_dq"] = "yes";
  CHECK_THROWS_WITH(KernelSpec::from_json(bad), Catch::Contains("'ordered_dq' must be true or false"));
  // Up to head dim 128 the writer warp orders the adds of steps of 64, at two stages and three.
  // Above, where its buffer never fits, the consumers take the turns.
  for (int head_dim : {64, 96, 128})
    for (int stages : {2, 3}) {
      KernelSpec narrow = default_spec(Family::sm90_bwd, hopper, DType::bf16, head_dim, MaskKind::causal);
      narrow.block_m = 64;
      narrow.ordered_dq = true;
      narrow.num_stages = stages;
      INFO(narrow.name());
      CHECK_FALSE(narrow.validate().has_value());
      CHECK(kernel_layout(narrow).constant("kDqWriters") == 1);
    }
  for (int head_dim : {192, 256}) {
    KernelSpec wide = default_spec(Family::sm90_bwd, hopper, DType::bf16, head_dim);
    wide.ordered_dq = true;
    INFO(wide.name());
    CHECK_FALSE(wide.validate().has_value());
    CHECK(kernel_layout(wide).constant("kDqWriters") == 0);
  }
  KernelSpec fa2 = default_spec(Family::fa2_bwd, Arch::parse("sm_80"), DType::bf16, 128);
  fa2.ordered_dq = true;
  REQUIRE(fa2.validate());
  CHECK_THAT(*fa2.validate(), Catch::Contains("fa2_bwd does not order its dQ adds"));
}

TEST_CASE("v_pretransposed: FP8 sm90_fwd's V transposed beforehand, its name, hash, JSON and layout", "[spec]") {
  const Arch hopper = Arch::parse("sm_90a");
  KernelSpec s = default_spec(Family::sm90_fwd, hopper, DType::e4m3, 128, MaskKind::causal);
  const KernelSpec plain = s;
  s.v_pretransposed = true;
  CHECK_FALSE(s.validate().has_value());
  CHECK(s.name() == "sm90_fwd_e4m3_d128_m192n96w16s2_causal_vt_sm90a");
  CHECK(s != plain);
  CHECK(KernelSpecHash{}(s) != KernelSpecHash{}(plain));
  const json j = s.to_json();
  CHECK(j.at("v_pretransposed") == true);
  CHECK(KernelSpec::from_json(j) == s);
  CHECK(plain.to_json().count("v_pretransposed") == 0);
  json bad = j;
  bad["v_pretransposed"] = 1;
  CHECK_THROWS_WITH(KernelSpec::from_json(bad), Catch::Contains("'v_pretransposed' must be true or false"));
  // No V ring (one K/V tile less of shared memory per stage), and the entry that writes V^T.
  const KernelLayout layout = kernel_layout(s), plain_layout = kernel_layout(plain);
  CHECK(layout.constant("kVPretransposed") == 1);
  CHECK(plain_layout.constant("kSmemBytes") - layout.constant("kSmemBytes") == 2 * 96 * 128);
  CHECK(layout.entries.size() == plain_layout.entries.size());
  CHECK(std::any_of(layout.entries.begin(), layout.entries.end(), [](const auto& e) { return e.name == "transpose_v"; }));
  for (KernelSpec other : {default_spec(Family::sm90_fwd, hopper, DType::bf16, 128),
                           default_spec(Family::fa2_fwd, Arch::parse("sm_80"), DType::bf16, 128)}) {
    other.v_pretransposed = true;
    REQUIRE(other.validate());
    CHECK_THAT(*other.validate(),
               Catch::Contains("v_pretransposed (V transposed before the forward) is an FP8 sm90_fwd mode"));
  }
}

TEST_CASE("FP8 (e4m3): sm90_fwd's tiles of whole k32 steps, its name and JSON; refused elsewhere with the reason",
          "[spec]") {
  const Arch sm90a = Arch::parse("sm_90a");
  for (int d : {64, 96, 128, 192, 256})
    for (MaskKind m : {MaskKind::none, MaskKind::causal, MaskKind::window})
      for (bool softcap : {false, true}) {
        const KernelSpec s = default_spec(Family::sm90_fwd, sm90a, DType::e4m3, d, m, softcap);
        INFO(s.name());
        CHECK_FALSE(s.validate().has_value());
        // 128-key tiles, 96 with three consumers at head dim 128, and at 256 a window's or a
        // softcap's registers leave room for 64 keys.
        const bool heavy = m == MaskKind::window || softcap;
        CHECK(s.block_n == (d == 256 && heavy ? 64 : d == 128 && !heavy ? 96 : 128));
        CHECK(s.block_m == ((d == 64 || d == 128) && !heavy ? 192 : 128));
        KernelSpec wide = s;
        wide.block_n = 128;
        if (d == 256 && (m == MaskKind::window || softcap)) {
          REQUIRE(wide.validate());
          CHECK_THAT(*wide.validate(), Catch::Contains("registers per consumer thread"));
        }
      }
  const KernelSpec s = default_spec(Family::sm90_fwd, sm90a, DType::e4m3, 128, MaskKind::causal);
  CHECK(s.name() == "sm90_fwd_e4m3_d128_m192n96w16s2_causal_sm90a");
  CHECK(s.to_json().at("dtype") == "e4m3");
  CHECK(KernelSpec::from_json(s.to_json()) == s);
  CHECK(parse_dtype("e4m3") == DType::e4m3);
  KernelSpec narrow = s;
  narrow.block_n = 112;
  REQUIRE(narrow.validate());
  CHECK_THAT(*narrow.validate(), Catch::Contains("block_n must be a multiple of 32"));
  narrow.block_m = 128;
  narrow.num_warps = 12;
  narrow.block_n = 192;  // (a Vt panel and a half)
  CHECK_FALSE(narrow.validate().has_value());
  for (Family f : {Family::fa2_fwd, Family::fa2_bwd, Family::sm90_bwd, Family::kvcache_fwd, Family::reference_fwd}) {
    const Arch arch = f == Family::sm90_bwd ? sm90a : Arch::parse("sm_80");
    KernelSpec other = default_spec(f, arch, DType::bf16, 128);
    other.dtype = DType::e4m3;
    REQUIRE(other.validate());
    CHECK_THAT(*other.validate(), Catch::Contains("has no FP8 kernels"));
  }
  KernelSpec cont = s;
  cont.continues = true;
  REQUIRE(cont.validate());
  CHECK_THAT(*cont.validate(), Catch::Contains("FP8 specs take no user modifiers, block masks or continuations"));
}

TEST_CASE("tail splits: sm90_fwd's where unmasked; elsewhere their own name and JSON", "[spec]") {
  const Arch hopper = Arch::parse("sm_90a");
  const KernelSpec unmasked = default_spec(Family::sm90_fwd, hopper, DType::bf16, 128);
  const KernelSpec causal = default_spec(Family::sm90_fwd, hopper, DType::bf16, 128, MaskKind::causal);
  const KernelSpec sparse =
      default_spec(Family::sm90_fwd, hopper, DType::bf16, 128, MaskKind::none, false, nullptr, /*block_sparse=*/true);
  CHECK(unmasked.tail_splits);
  CHECK_FALSE(causal.tail_splits);
  CHECK_FALSE(sparse.tail_splits);
  CHECK_FALSE(default_spec(Family::fa2_fwd, hopper, DType::bf16, 128).tail_splits);
  // The defaults keep the names and JSON plain specs always had (the tuning database's, the caches').
  CHECK(unmasked.name() == "sm90_fwd_bf16_d128_m128n128w12s2_sm90a");
  CHECK(unmasked.to_json().count("tail_splits") == 0);
  CHECK(KernelSpec::from_json(unmasked.to_json()) == unmasked);
  CHECK(KernelSpec::from_json(causal.to_json()) == causal);
  // Otherwise a suffix and a field, both ways.
  KernelSpec split_causal = causal, unsplit = unmasked;
  split_causal.tail_splits = true;
  unsplit.tail_splits = false;
  CHECK(split_causal.name() == "sm90_fwd_bf16_d128_m128n128w12s2_causal_split_sm90a");
  CHECK(unsplit.name() == "sm90_fwd_bf16_d128_m128n128w12s2_nosplit_sm90a");
  for (const KernelSpec& s : {split_causal, unsplit}) {
    CHECK_FALSE(s.validate());
    CHECK(s.to_json().at("tail_splits") == s.tail_splits);
    CHECK(KernelSpec::from_json(s.to_json()) == s);
  }
  CHECK(split_causal != causal);
  CHECK(KernelSpecHash{}(split_causal) != KernelSpecHash{}(causal));
  json bad = split_causal.to_json();
  bad["tail_splits"] = "yes";
  CHECK_THROWS_WITH(KernelSpec::from_json(bad), Catch::Contains("'tail_splits' must be true or false"));
  KernelSpec fa2 = default_spec(Family::fa2_fwd, hopper, DType::bf16, 128);
  fa2.tail_splits = true;
  REQUIRE(fa2.validate());
  CHECK_THAT(*fa2.validate(), Catch::Contains("fa2_fwd does not split tails"));
  // The kernel compiles the split items' code only where the spec has them.
  CHECK(render(split_causal).text.find("kTailSplits = 1;") != std::string::npos);
  CHECK(render(causal).text.find("kTailSplits = 0;") != std::string::npos);
}

TEST_CASE("JSON with unknown, missing or mistyped fields is rejected", "[spec]") {
  const json good = reference().to_json();
  auto rejects = [&](json j, const char* message) {
    INFO(j.dump());
    CHECK_THROWS_WITH(KernelSpec::from_json(j), Catch::Contains(message));
  };
  json j = good;
  j["block_k"] = 32;
  rejects(j, "unknown field 'block_k'");
  j = good;
  j.erase("head_dim");
  rejects(j, "missing field 'head_dim'");
  j = good;
  j["head_dim"] = "128";
  rejects(j, "'head_dim' must be an integer");
  j = good;
  j["head_dim"] = -4;
  rejects(j, "out of range");
  j = good;
  j["dtype"] = "fp32";
  rejects(j, "unknown dtype 'fp32'");
  j = good;
  j["family"] = "fa9";
  rejects(j, "unknown family 'fa9'");
  j = good;
  j["softcap"] = 1;
  rejects(j, "'softcap' must be true or false");
  rejects(json::array(), "must be a JSON object");
}

TEST_CASE("fa2_bwd: tile rules, per-entry shared memory (and sm90_bwd's), names", "[spec]") {
  const Arch hopper = Arch::parse("sm_90a"), ampere = Arch::parse("sm_80");
  const KernelSpec base = default_spec(Family::fa2_bwd, hopper, DType::bf16, 128, MaskKind::causal);
  CHECK(base.name() == "fa2_bwd_bf16_d128_m64n128w8s2_causal_sm90a");
  auto with = [&](auto change) {
    KernelSpec s = base;
    change(s);
    return s.validate();
  };
  struct Case {
    const char* what;
    std::optional<std::string> reason;
    const char* expected;
  };
  const Case cases[] = {
      {"6 warps", with([](KernelSpec& s) { s.num_warps = 6; }), "num_warps must be 4 or 8"},
      {"block_m 48", with([](KernelSpec& s) { s.block_m = 48; }), "block_m must be 32, 64 or 128"},
      {"block_n 96", with([](KernelSpec& s) { s.block_n = 96; }), "block_n must be 32, 64 or 128"},
      {"3 stages", with([](KernelSpec& s) { s.num_stages = 3; }), "num_stages must be 1 or 2"},
      {"too many accumulators", with([](KernelSpec& s) { s.head_dim = 256; s.num_warps = 4; }), "cannot fit in 255 registers"},
      {"sm_80 shared memory", with([](KernelSpec& s) { s.arch = Arch::parse("sm_80"); }), "sm_80 allows"},
  };
  for (const auto& c : cases) {
    INFO(c.what);
    REQUIRE(c.reason.has_value());
    CHECK_THAT(*c.reason, Catch::Contains(c.expected));
  }
  // Entries, by name: preprocess and convert use no dynamic shared memory; the attribute covers the
  // largest; what each is launched with is the constant rendered into Config.
  for (const Arch& arch : {ampere, hopper})
    for (int d : {32, 64, 96, 128, 160, 192, 224, 256}) {
      const KernelSpec s = default_spec(Family::fa2_bwd, arch, DType::fp16, d);
      INFO(s.name());
      const KernelLayout layout = kernel_layout(s);
      REQUIRE(render(s).entry_names.size() == 5);
      REQUIRE(layout.entries.size() == 5);
      CHECK(layout.entry("preprocess").dynamic_smem_bytes == 0);
      CHECK(layout.entry("convert_dq").dynamic_smem_bytes == 0);
      CHECK(layout.entry("dkdv_atomic_dq").dynamic_smem_bytes == layout.entry("dkdv").dynamic_smem_bytes);
      CHECK(layout.entry("dkdv").dynamic_smem_bytes == layout.constant("kDkdvSmemBytes"));
      CHECK(layout.entry("dq").dynamic_smem_bytes == layout.constant("kDqSmemBytes"));
      CHECK(layout.constant("kDqBlockM") == 16 * s.num_warps);
      CHECK(layout.max_dynamic_smem_bytes() == dynamic_smem_bytes(s));
      CHECK(dynamic_smem_bytes(s) <= max_smem_per_block(arch));
      CHECK(render(s).text.find(fmt::format("static constexpr int kDqSmemBytes = {};", layout.constant("kDqSmemBytes"))) !=
            std::string::npos);
      for (size_t e = 0; e < layout.entries.size(); ++e) CHECK(layout.entries[e].symbol == render(s).entry_names[e]);
    }
  // sm90_bwd likewise: only its main entry (dkdv_atomic_dq) takes the shared memory; launched with
  // it, the row passes ran one CTA per SM. (dq_visits runs before it in deterministic mode under a
  // block mask.)
  for (int d : {64, 128, 256}) {
    const KernelSpec s = default_spec(Family::sm90_bwd, hopper, DType::bf16, d);
    INFO(s.name());
    const KernelLayout layout = kernel_layout(s);
    REQUIRE(render(s).entry_names.size() == 4);
    CHECK(layout.entry("preprocess").dynamic_smem_bytes == 0);
    CHECK(layout.entry("dq_visits").dynamic_smem_bytes == 0);
    CHECK(layout.entry("dkdv_atomic_dq").dynamic_smem_bytes == dynamic_smem_bytes(s));
    CHECK(layout.entry("convert_dq").dynamic_smem_bytes == 0);
  }
  // Asking a family for an entry or a fact it does not have is a bug, said as such.
  const KernelLayout forward = kernel_layout(default_spec(Family::fa2_fwd, hopper, DType::bf16, 128));
  CHECK_THROWS_WITH(forward.entry("dq"), Catch::Contains("family fa2_fwd has no entry 'dq'"));
  CHECK_THROWS_WITH(forward.constant("kDqBlockM"), Catch::Contains("family fa2_fwd renders no constant kDqBlockM"));
  CHECK_FALSE(is_forward_family(Family::fa2_bwd));
  CHECK(is_forward_family(Family::fa2_fwd));
}

TEST_CASE("sm90_bwd: steps of 80 queries at head dims 64 to 128, the default without a mask at 96 and 128",
          "[spec]") {
  const Arch hopper = Arch::parse("sm_90a");
  for (int d : {64, 96, 128}) {
    KernelSpec plain = default_spec(Family::sm90_bwd, hopper, DType::bf16, d);
    CHECK(plain.block_m == (d == 64 ? 128 : 80));  // (at 64 the steps of 128, below)
    plain.block_m = 80;
    INFO(plain.name());
    CHECK_FALSE(plain.validate().has_value());
    CHECK(kernel_layout(plain).constant("kDqWriters") == 1);
    CHECK(dynamic_smem_bytes(plain) <= max_smem_per_block(hopper));
    // dQ transposed: dQ^T = K^T dS^T, A (K) MN-major and B (dS) K-major, N the step's queries.
    const std::string text = render(plain).text;
    CHECK(text.find("wgmma_dq(float (&d)[40]") != std::string::npos);
    CHECK(text.find("m64n80k16.f32.bf16.bf16") != std::string::npos);
    CHECK(text.find(", p, 1, 1, 1, 0;") != std::string::npos);
    KernelSpec ordered = plain;
    ordered.ordered_dq = true;
    CHECK_FALSE(ordered.validate().has_value());
    // Masked steps, softcaps and modifiers keep 64 by default (80 is the tuner's to try there).
    CHECK(default_spec(Family::sm90_bwd, hopper, DType::bf16, d, MaskKind::causal).block_m == (d == 64 ? 128 : 64));
    CHECK(default_spec(Family::sm90_bwd, hopper, DType::bf16, d, MaskKind::window).block_m == 64);
    KernelSpec softcap = default_spec(Family::sm90_bwd, hopper, DType::bf16, d, MaskKind::none, true);
    CHECK(softcap.block_m == 64);
    softcap.block_m = 80;
    CHECK_FALSE(softcap.validate().has_value());
    KernelSpec three = plain;  // above 64 the dQ writer's buffer leaves no room for a third stage
    three.num_stages = 3;
    if (d == 64) {
      CHECK_FALSE(three.validate().has_value());
    } else {
      REQUIRE(three.validate());
      CHECK_THAT(*three.validate(), Catch::Contains("3 stages leave no room"));
    }
    KernelSpec sparse = plain;  // a block mask's blocks are 128 queries
    sparse.block_sparse = true;
    REQUIRE(sparse.validate());
    CHECK_THAT(*sparse.validate(), Catch::Contains("block_m must be 64, got 80"));
  }
  // Not where the head dim is split between the consumers.
  for (int d : {192, 256}) {
    KernelSpec s = default_spec(Family::sm90_bwd, hopper, DType::bf16, d);
    INFO(s.name());
    CHECK(s.block_m == 64);
    s.block_m = 80;
    REQUIRE(s.validate());
    CHECK_THAT(*s.validate(), Catch::Contains("block_m must be 64, got 80"));
  }
  KernelSpec s = default_spec(Family::sm90_bwd, hopper, DType::bf16, 128);
  s.block_m = 96;
  REQUIRE(s.validate());
  CHECK_THAT(*s.validate(), Catch::Contains("block_m must be 64 or 80, got 96"));
}

TEST_CASE("sm90_bwd: steps of 128 queries at head dim 64 only, with the dQ writer warp", "[spec]") {
  const Arch hopper = Arch::parse("sm_90a");
  for (DType dtype : {DType::bf16, DType::fp16})
    for (MaskKind mask : {MaskKind::none, MaskKind::causal}) {
      KernelSpec s = default_spec(Family::sm90_bwd, hopper, dtype, 64, mask);
      s.block_m = 128;
      INFO(s.name());
      CHECK_FALSE(s.validate().has_value());
      CHECK(kernel_layout(s).constant("kDqWriters") == 1);
      CHECK(dynamic_smem_bytes(s) <= max_smem_per_block(hopper));
      // S^T and dP^T of 64 keys x 128 queries; dQ of 64 queries x 64 columns per consumer, untransposed.
      const std::string text = render(s).text;
      CHECK(text.find("m64n128k16.f32") != std::string::npos);
      CHECK(text.find("wgmma_dq(float (&d)[32]") != std::string::npos);
      KernelSpec ordered = s;
      ordered.ordered_dq = true;
      CHECK_FALSE(ordered.validate().has_value());
      KernelSpec three = s;  // the dQ buffer of 128 rows leaves no room for a third stage
      three.num_stages = 3;
      REQUIRE(three.validate());
      CHECK_THAT(*three.validate(), Catch::Contains("steps of 128 queries hand dQ to the writer warp"));
      if (mask == MaskKind::none) {  // (not under a block mask yet; it replaces the built-in masks)
        KernelSpec sparse = s;
        sparse.block_sparse = true;
        REQUIRE(sparse.validate());
        CHECK_THAT(*sparse.validate(), Catch::Contains("block_m must be 64, got 128"));
      }
    }
  // The default at head dim 64 unmasked and causal (timed there), not under a window, a softcap or
  // a modifier.
  CHECK(default_spec(Family::sm90_bwd, hopper, DType::fp16, 64, MaskKind::causal).block_m == 128);
  CHECK(default_spec(Family::sm90_bwd, hopper, DType::bf16, 64, MaskKind::window).block_m == 64);
  CHECK(default_spec(Family::sm90_bwd, hopper, DType::bf16, 64, MaskKind::none, true).block_m == 64);
  for (int d : {96, 128, 192, 256}) {
    KernelSpec s = default_spec(Family::sm90_bwd, hopper, DType::bf16, d);
    s.block_m = 128;
    INFO(s.name());
    REQUIRE(s.validate());
    CHECK_THAT(*s.validate(), Catch::Contains("got 128"));
  }
}

TEST_CASE("the quick GPU tier's kernel list reads as legal specs that render", "[spec]") {
  // tests/gpu/quick_specs.json: what the quick tier compiles in parallel (gpu/main.cpp). A schema
  // change that left it unreadable would silently send the tier back to compiling case by case.
  std::ifstream file(FLASHJIT_QUICK_SPECS);
  REQUIRE(file);
  const json list = json::parse(file);
  REQUIRE(list.is_array());
  CHECK(list.size() >= 50);
  std::unordered_set<std::string> names;
  for (const auto& j : list) {
    const KernelSpec spec = KernelSpec::from_json(j);
    INFO(spec.name());
    CHECK_FALSE(spec.validate().has_value());
    CHECK_NOTHROW(render(spec));
    names.insert(spec.name());
  }
  CHECK(names.size() == list.size());
}
