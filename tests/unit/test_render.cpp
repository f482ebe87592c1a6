// render(): golden output, structure shared by all variants, and the embedded template bundle.
#include <catch2/catch.hpp>

#include <fstream>
#include <sstream>

#include "flashjit/codegen/render.hpp"
#include "flashjit/error.hpp"

using namespace flashjit;

namespace {

std::string read_text(const std::string& path) {
  std::ifstream in(path);
  std::stringstream buffer;
  buffer << in.rdbuf();
  return buffer.str();
}

// Set UPDATE_GOLDENS=1 to rewrite a golden after an intended change (then review the diff).
void check_golden(const std::string& name, const std::string& text) {
  const std::string path = std::string(FLASHJIT_GOLDEN_DIR) + "/" + name;
  if (const char* update = std::getenv("UPDATE_GOLDENS"); update && std::string(update) == "1")
    std::ofstream(path) << text;
  INFO("golden file " << path << " (UPDATE_GOLDENS=1 rewrites it)");
  CHECK(read_text(path) == text);
}

std::string prefix_before_config(const std::string& text) { return text.substr(0, text.find("struct Config")); }

}  // namespace

TEST_CASE("render output matches the golden", "[render]") {
  KernelSpec s = default_spec(Family::reference_fwd, Arch::parse("sm_80"), DType::bf16, 128,
                              MaskKind::causal);
  const Source source = render(s);
  CHECK(source.spec_name == s.name());
  CHECK(source.file_name == s.name() + ".cu");
  REQUIRE(source.entry_names == std::vector<std::string>{"flashjit_reference_fwd_forward"});
  check_golden("reference_fwd_bf16_d128_causal_sm80.cu", source.text);
}

TEST_CASE("sm90_fwd's Config carries the wgmma instructions of its tile widths", "[render]") {
  // Any multiple of 16 is a legal block_n, so the generator writes each width's asm statement.
  KernelSpec s = default_spec(Family::sm90_fwd, Arch::parse("sm_90a"), DType::bf16, 128);
  s.block_n = 80;
  const Source source = render(s);
  check_golden("sm90_fwd_bf16_d128_m128n80w12s2_sm90a.cu", source.text);
  // S = Q K^T: 40 accumulators, then both descriptors (K-major, no transposes).
  CHECK_THAT(source.text, Catch::Contains("wgmma.mma_async.sync.aligned.m64n80k16.f32.bf16.bf16 {%0, %1,") &&
                              Catch::Contains("%38, %39}, %40, %41, p, 1, 1, 0, 0;") &&
                              Catch::Contains("\"+f\"(d[39])\n        : \"l\"(desc_a), \"l\"(desc_b)"));
  // O += P V: 64 accumulators, P in four registers, V transposed (MN-major).
  CHECK_THAT(source.text, Catch::Contains("m64n128k16.f32.bf16.bf16") &&
                              Catch::Contains("%63}, {%64, %65, %66, %67}, %68, p, 1, 1, 1;"));
  s.dtype = DType::fp16;
  CHECK_THAT(render(s).text, Catch::Contains("m64n80k16.f32.f16.f16") && Catch::Contains("m64n128k16.f32.f16.f16"));
}

TEST_CASE("FP8 sm90_fwd: k32 e4m3 wgmma with both operands K-major, a bf16 output, the Vt ring's bytes", "[render]") {
  KernelSpec s = default_spec(Family::sm90_fwd, Arch::parse("sm_90a"), DType::e4m3, 128, MaskKind::causal);
  s.block_m = 128;
  s.block_n = 128;
  s.num_warps = 12;
  const std::string text = render(s).text;
  CHECK_THAT(text, Catch::Contains("using Element = flashjit::kernels::float8_e4m3_t;") &&
                       Catch::Contains("using OutputElement = flashjit::kernels::bfloat16_t;"));
  // S = Q K^T from two descriptors and O += P V with P in registers: no transpose immediates.
  CHECK_THAT(text, Catch::Contains("m64n128k32.f32.e4m3.e4m3 {%0,") && Catch::Contains("%63}, %64, %65, p, 1, 1;") &&
                       Catch::Contains("%63}, {%64, %65, %66, %67}, %68, p, 1, 1;"));
  // One 128-byte panel of Q and K at head dim 128; two Q slots, two stages of K, V and Vt (128 x
  // 128 bytes each), six barriers per stage, the published tiles and the transposers' end slot.
  const int expected = 1024 + 2 * 128 * 128 + 2 * 2 * 128 * 128 + 2 * 128 * 128 + 8 * (2 * 2 + 6 * 2) + 32 * 2 + 8;
  CHECK(dynamic_smem_bytes(s) == expected);
  CHECK_THAT(text, Catch::Contains("kSmemBytes = " + std::to_string(expected) + ";"));
  // 96-key tiles (the default, with three consumers): Vt still takes a whole 128-key panel per stage.
  KernelSpec narrow = s;
  narrow.block_m = 192;
  narrow.block_n = 96;
  narrow.num_warps = 16;
  REQUIRE_FALSE(narrow.validate().has_value());
  CHECK(dynamic_smem_bytes(narrow) ==
        1024 + 2 * 192 * 128 + 2 * 2 * 96 * 128 + 2 * 128 * 128 + 8 * (2 * 2 + 6 * 2) + 32 * 2 + 8);
}

TEST_CASE("sm90_fwd takes a second Q slot where shared memory holds it", "[render]") {
  // Shared memory: 1024 (alignment) + Q slots x block_m x 128 bytes per 64-dim panel + two rings of
  // K and V tiles + barriers (8 bytes each: q_full, q_empty per slot, four per stage) + the tile
  // published with each slot (32 bytes).
  auto expected = [](const KernelSpec& s, int q_slots) {
    const int panels = (s.head_dim + 63) / 64;
    return 1024 + q_slots * panels * s.block_m * 128 + 2 * s.num_stages * panels * s.block_n * 128 +
           8 * (2 * q_slots + 4 * s.num_stages) + 32 * q_slots;
  };
  const Arch sm90 = Arch::parse("sm_90a");
  const KernelSpec d128 = default_spec(Family::sm90_fwd, sm90, DType::bf16, 128);  // m128 n128: 193 KB with two
  CHECK(dynamic_smem_bytes(d128) == expected(d128, 2));
  CHECK_THAT(render(d128).text, Catch::Contains("kQStages = 2;"));
  const KernelSpec d256 = default_spec(Family::sm90_fwd, sm90, DType::bf16, 256);  // m128 n64: 257 KB with two
  CHECK(dynamic_smem_bytes(d256) == expected(d256, 1));
  CHECK(expected(d256, 2) > 227 * 1024);
  CHECK_THAT(render(d256).text, Catch::Contains("kQStages = 1;"));
}

TEST_CASE("variants differ only after the fixed include block", "[render]") {
  // Same includes, then constexpr values: keeps NVRTC's precompiled-header path open.
  const auto a = render(default_spec(Family::reference_fwd, Arch::parse("sm_80"), DType::bf16, 64));
  const auto b = render(default_spec(Family::reference_fwd, Arch::parse("sm_90a"), DType::fp16,
                                     256, MaskKind::window, true));
  auto strip_first_line = [](const std::string& t) { return t.substr(t.find('\n') + 1); };
  CHECK(prefix_before_config(strip_first_line(a.text)) == prefix_before_config(strip_first_line(b.text)));
  CHECK_THAT(b.text, Catch::Contains("kHeadDim = 256;"));
  CHECK_THAT(b.text, Catch::Contains("using Element = flashjit::kernels::half_t;"));
  CHECK_THAT(b.text, Catch::Contains("kMask = flashjit::kernels::MaskKind::kWindow;"));
  CHECK_THAT(b.text, Catch::Contains("kHasSoftcap = true;"));
}

TEST_CASE("render refuses an illegal spec and says why", "[render]") {
  KernelSpec s = default_spec(Family::reference_fwd, Arch::parse("sm_80"), DType::bf16, 128);
  s.head_dim = 100;
  CHECK_THROWS_WITH(render(s), Catch::Contains("illegal kernel spec") &&
                                   Catch::Contains("no kernel for head_dim 100"));
}

TEST_CASE("resource formulas", "[render]") {
  KernelSpec s = default_spec(Family::reference_fwd, Arch::parse("sm_80"), DType::bf16, 128);
  s.num_warps = s.block_m = 8;
  CHECK(threads_per_block(s) == 256);
  CHECK(dynamic_smem_bytes(s) == 0);
}

TEST_CASE("the template bundle holds every template with a content hash", "[render]") {
  const TemplateBundle& bundle = template_bundle();
  CHECK(bundle.hash.size() == 32);
  std::vector<std::string> paths;
  for (const auto& f : bundle.files) {
    paths.emplace_back(f.path);
    CHECK_FALSE(f.text.empty());
    CHECK(f.text.data()[f.text.size()] == '\0');  // handed to NVRTC as C strings
    // The bundle is the build-time copy of templates/: it must equal the checkout.
    CHECK(read_text(std::string(FLASHJIT_TEMPLATE_DIR) + "/" + std::string(f.path)) == f.text);
  }
  CHECK(std::find(paths.begin(), paths.end(), "reference_fwd.cuh") != paths.end());
  CHECK(std::find(paths.begin(), paths.end(), "common/params.cuh") != paths.end());
}
