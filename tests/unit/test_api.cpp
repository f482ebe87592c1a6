// The C and C++ APIs on a machine without a GPU: argument errors name the argument, and a valid
// call fails cleanly with "no CUDA driver" instead of crashing.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstring>
#include <vector>

#include "driver.hpp"
#include "host_tensors.hpp"
#include "flashjit/flashjit.h"
#include "flashjit/flashjit.hpp"
#include "support/fake_tensors.hpp"

namespace {

using flashjit::test::FakeTensors;

struct Call {
  flashjit_tensor q = FakeTensors::tensor(FLASHJIT_BFLOAT16, {2, 128, 8, 64});
  flashjit_tensor k = FakeTensors::tensor(FLASHJIT_BFLOAT16, {2, 96, 2, 64});
  flashjit_tensor v = FakeTensors::tensor(FLASHJIT_BFLOAT16, {2, 96, 2, 64});
  flashjit_tensor out = FakeTensors::tensor(FLASHJIT_BFLOAT16, {2, 128, 8, 64});
  flashjit_tensor lse = FakeTensors::tensor(FLASHJIT_FLOAT32, {2, 8, 128});
  flashjit_attention_options options{};
  Call() { flashjit_attention_options_init(&options); }

  flashjit_status run(bool with_lse = true) {
    return flashjit_forward(&q, &k, &v, &out, with_lse ? &lse : nullptr, &options);
  }
};

void expect_invalid(Call& call, const char* message) {
  INFO(message);
  CHECK(call.run() == FLASHJIT_ERROR_INVALID_ARGUMENT);
  CHECK_THAT(flashjit_last_error(), Catch::Contains(message));
}

}  // namespace

TEST_CASE("options_init sets the documented defaults", "[api]") {
  flashjit_attention_options o;
  std::memset(&o, 0x5a, sizeof o);
  flashjit_attention_options_init(&o);
  CHECK(o.softmax_scale == 0.f);
  CHECK(o.causal == 0);
  CHECK(o.window_left == -1);
  CHECK(o.window_right == -1);
  CHECK(o.softcap == 0.f);
  CHECK(o.backend == FLASHJIT_BACKEND_AUTO);
  CHECK(o.stream == nullptr);
}

TEST_CASE("bad arguments are named in the error, nothing is launched", "[api]") {
  Call c;
  SECTION("null tensor") {
    CHECK(flashjit_forward(nullptr, &c.k, &c.v, &c.out, nullptr, &c.options) ==
          FLASHJIT_ERROR_INVALID_ARGUMENT);
    CHECK_THAT(flashjit_last_error(), Catch::Contains("q is NULL"));
    // Several NULL: the first in argument order is named (not whichever the compiler evaluates first).
    CHECK(flashjit_forward(nullptr, nullptr, nullptr, nullptr, nullptr, &c.options) == FLASHJIT_ERROR_INVALID_ARGUMENT);
    CHECK_THAT(flashjit_last_error(), Catch::Contains("q is NULL"));
    CHECK(flashjit_backward(&c.q, nullptr, &c.v, &c.out, &c.out, nullptr, nullptr, nullptr, nullptr, &c.options) ==
          FLASHJIT_ERROR_INVALID_ARGUMENT);
    CHECK_THAT(flashjit_last_error(), Catch::Contains("k is NULL"));
  }
  SECTION("null data") {
    c.v.data = nullptr;
    expect_invalid(c, "v: data pointer is null");
  }
  SECTION("wrong dtype") {
    c.q.dtype = c.k.dtype = c.v.dtype = c.out.dtype = FLASHJIT_FLOAT32;
    expect_invalid(c, "q: expected dtype float16, bfloat16 or float8_e4m3, got float32");
  }
  SECTION("mixed dtypes") {
    c.k.dtype = FLASHJIT_FLOAT16;
    expect_invalid(c, "k: dtype float16 differs from q's bfloat16");
  }
  SECTION("unknown dtype code") {
    c.q.dtype = 42;
    expect_invalid(c, "q: unknown dtype code 42");
  }
  SECTION("wrong rank") {
    c.q = FakeTensors::tensor(FLASHJIT_BFLOAT16, {128, 8, 64});
    expect_invalid(c, "q: expected 4 dims (batch, seqlen_q, heads_q, head_dim), got 3 dims (128, 8, 64)");
  }
  SECTION("k and v disagree") {
    c.v = FakeTensors::tensor(FLASHJIT_BFLOAT16, {2, 95, 2, 64});
    expect_invalid(c, "v: expected shape (2, 96, 2, 64)");
  }
  SECTION("batch mismatch") {
    c.k = FakeTensors::tensor(FLASHJIT_BFLOAT16, {3, 96, 2, 64});
    expect_invalid(c, "k: expected shape (2, 96, 2, 64)");
  }
  SECTION("out shape") {
    c.out = FakeTensors::tensor(FLASHJIT_BFLOAT16, {2, 128, 8, 32});
    expect_invalid(c, "out: expected shape (2, 128, 8, 64)");
  }
  SECTION("heads_q not a multiple of heads_kv") {
    c.k = FakeTensors::tensor(FLASHJIT_BFLOAT16, {2, 96, 3, 64});
    c.v = c.k;
    expect_invalid(c, "heads_kv 3 must divide heads_q 8");
  }
  SECTION("head_dim over 256") {
    for (auto* t : {&c.q, &c.k, &c.v, &c.out}) t->shape[3] = 264;
    c.q = FakeTensors::tensor(FLASHJIT_BFLOAT16, {2, 128, 8, 264});
    c.k = c.v = FakeTensors::tensor(FLASHJIT_BFLOAT16, {2, 96, 2, 264});
    c.out = c.q;
    expect_invalid(c, "head_dim 264 is not supported (expected a multiple of 8, at most 256)");
  }
  SECTION("head_dim not a multiple of 8") {
    c.q = c.out = FakeTensors::tensor(FLASHJIT_BFLOAT16, {2, 128, 8, 60});
    c.k = c.v = FakeTensors::tensor(FLASHJIT_BFLOAT16, {2, 96, 2, 60});
    expect_invalid(c, "head_dim 60 is not supported");
  }
  SECTION("non-contiguous last dim") {
    c.k.strides[3] = 2;
    expect_invalid(c, "k: the last dim (head_dim) must be contiguous (stride 1), got stride 2");
  }
  SECTION("stride not a multiple of 16 bytes") {
    c.q.strides[1] = 8 * 64 + 4;
    expect_invalid(c, "q: stride 516 of dim 1 is not a multiple of 8 elements");
  }
  SECTION("misaligned pointer") {
    c.out.data = static_cast<char*>(c.out.data) + 2;
    expect_invalid(c, "out: data pointer");
    CHECK_THAT(flashjit_last_error(), Catch::Contains("is not 16-byte aligned"));
  }
  SECTION("device mismatch") {
    c.v.device = 1;
    expect_invalid(c, "v: on device 1, but q is on device 0");
  }
  SECTION("lse dtype and shape") {
    c.lse.dtype = FLASHJIT_BFLOAT16;
    expect_invalid(c, "lse: expected dtype float32, got bfloat16");
    c.lse = FakeTensors::tensor(FLASHJIT_FLOAT32, {2, 128, 8});
    expect_invalid(c, "lse: expected shape (2, 8, 128) (batch, heads_q, seqlen_q), got (2, 128, 8)");
  }
  SECTION("bad options") {
    c.options.window_left = -5;
    expect_invalid(c, "window_size (-5, -1)");
    c.options.window_left = -1;
    c.options.softcap = -1.f;
    expect_invalid(c, "softcap must be finite and >= 0");
    c.options.softcap = 0.f;
    c.options.backend = 99;
    expect_invalid(c, "options.backend: unknown backend code 99");
  }
}

TEST_CASE("FP8 arguments are checked: dtypes, out, descales, the passes that have no FP8", "[api]") {
  Call c;
  c.q.dtype = c.k.dtype = c.v.dtype = FLASHJIT_FLOAT8_E4M3;
  flashjit_tensor descale = FakeTensors::tensor(FLASHJIT_FLOAT32, {2, 2});  // (batch, heads_kv)
  auto run = [&](const flashjit_tensor* q_descale, const flashjit_tensor* k_descale, const char* message) {
    INFO(message);
    CHECK(flashjit_forward_fp8(&c.q, &c.k, &c.v, &c.out, &c.lse, q_descale, k_descale, nullptr, nullptr, nullptr, 0, 0,
                               &c.options) == FLASHJIT_ERROR_INVALID_ARGUMENT);
    CHECK_THAT(flashjit_last_error(), Catch::Contains(message));
  };
  c.out.dtype = FLASHJIT_FLOAT8_E4M3;
  run(nullptr, nullptr, "out: expected dtype bfloat16 for float8_e4m3 inputs, got float8_e4m3");
  c.out.dtype = FLASHJIT_BFLOAT16;
  c.v.dtype = FLASHJIT_BFLOAT16;
  run(nullptr, nullptr, "v: dtype bfloat16 differs from q's float8_e4m3");
  c.v.dtype = FLASHJIT_FLOAT8_E4M3;
  flashjit_tensor wrong_shape = FakeTensors::tensor(FLASHJIT_FLOAT32, {2, 8});
  run(&wrong_shape, nullptr, "q_descale: expected shape (2, 2) (batch, heads_kv), got (2, 8)");
  flashjit_tensor wrong_type = FakeTensors::tensor(FLASHJIT_INT32, {2, 2});
  run(&descale, &wrong_type, "k_descale: expected dtype float32, got int32");
  // FP8 strides are 16-byte multiples of 1-byte values: a row stride of 8 heads x 64 is; 8 is not.
  c.q.strides[1] = 8;
  c.q.shape[2] = 1;
  c.out.shape[2] = 1;
  c.lse.shape[1] = 1;
  c.k.shape[2] = c.v.shape[2] = 1;
  c.q.strides[0] = 8 * 128;
  run(nullptr, nullptr, "q: stride 8 of dim 1 is not a multiple of 16 elements (16 bytes)");
  // Descales given with 16-bit inputs, and FP8 where there is no FP8 kernel: named, not ignored.
  Call bf16;
  CHECK(flashjit_forward_fp8(&bf16.q, &bf16.k, &bf16.v, &bf16.out, nullptr, &descale, nullptr, nullptr, nullptr, nullptr,
                             0, 0, &bf16.options) == FLASHJIT_ERROR_INVALID_ARGUMENT);
  CHECK_THAT(flashjit_last_error(), Catch::Contains("q_descale: given for bfloat16 inputs"));
  Call fp8;
  fp8.q.dtype = fp8.k.dtype = fp8.v.dtype = FLASHJIT_FLOAT8_E4M3;
  CHECK(flashjit_backward(&fp8.q, &fp8.k, &fp8.v, &fp8.out, &fp8.out, &fp8.lse, &fp8.q, &fp8.k, &fp8.v, &fp8.options) ==
        FLASHJIT_ERROR_INVALID_ARGUMENT);
  CHECK_THAT(flashjit_last_error(), Catch::Contains("float8_e4m3 has no backward (FP8 is forward-only)"));
}

TEST_CASE("varlen arguments are checked", "[api]") {
  Call c;
  c.q = c.out = FakeTensors::tensor(FLASHJIT_BFLOAT16, {300, 8, 64});
  c.k = c.v = FakeTensors::tensor(FLASHJIT_BFLOAT16, {200, 2, 64});
  c.lse = FakeTensors::tensor(FLASHJIT_FLOAT32, {8, 300});
  flashjit_tensor cu_q = FakeTensors::tensor(FLASHJIT_INT32, {4});
  flashjit_tensor cu_k = FakeTensors::tensor(FLASHJIT_INT32, {4});
  auto run = [&](int max_q, int max_k) {
    return flashjit_forward_varlen(&c.q, &c.k, &c.v, &c.out, &c.lse, &cu_q, &cu_k, max_q, max_k, &c.options);
  };
  cu_q.dtype = FLASHJIT_FLOAT32;
  CHECK(run(100, 100) == FLASHJIT_ERROR_INVALID_ARGUMENT);
  CHECK_THAT(flashjit_last_error(), Catch::Contains("cu_seqlens_q: expected dtype int32"));
  cu_q.dtype = FLASHJIT_INT32;
  cu_k = FakeTensors::tensor(FLASHJIT_INT32, {5});
  CHECK(run(100, 100) == FLASHJIT_ERROR_INVALID_ARGUMENT);
  CHECK_THAT(flashjit_last_error(), Catch::Contains("cu_seqlens_k: 5 entries, but cu_seqlens_q has 4"));
  cu_k = FakeTensors::tensor(FLASHJIT_INT32, {4});
  CHECK(run(400, 100) == FLASHJIT_ERROR_INVALID_ARGUMENT);
  CHECK_THAT(flashjit_last_error(), Catch::Contains("max_seqlen_q 400 exceeds total_q 300"));
  c.lse = FakeTensors::tensor(FLASHJIT_FLOAT32, {3, 8, 100});
  CHECK(run(100, 100) == FLASHJIT_ERROR_INVALID_ARGUMENT);
  CHECK_THAT(flashjit_last_error(), Catch::Contains("lse: expected shape (8, 300) (heads_q, total_q)"));
}

TEST_CASE("with no driver a valid call fails with a clear error, not a crash", "[api]") {
  if (flashjit::detail::driver_available()) {
    WARN("a CUDA driver is present: the no-driver path is not exercised here");
    return;
  }
  Call c;
  CHECK(c.run() == FLASHJIT_ERROR_NO_DRIVER);
  CHECK_THAT(flashjit_last_error(), Catch::Contains("no CUDA driver") || Catch::Contains("libcuda.so.1"));
  CHECK_THAT(flashjit_last_error(), Catch::Contains("libcuda.so.1"));
  // The C++ API: a flashjit::Error with the no_driver code, every time.
  flashjit::Runtime runtime(flashjit::CacheConfig{});
  for (int attempt = 0; attempt < 2; ++attempt) {
    try {
      flashjit::device_count();
      FAIL("device_count() worked without a driver");
    } catch (const flashjit::Error& e) {
      CHECK(e.code() == flashjit::ErrorCode::no_driver);
    }
  }
  uint64_t compiles = 99;
  CHECK(flashjit_cache_stats(nullptr, nullptr, &compiles) == FLASHJIT_OK);
  CHECK(compiles == 0);
  CHECK(std::strlen(flashjit_version()) > 0);
}

TEST_CASE("backward arguments are checked before anything runs", "[api]") {
  Call c;
  flashjit_tensor dout = c.out, dq = c.q, dk = c.k, dv = c.v;
  auto run = [&](bool with_lse = true) {
    return flashjit_backward(&c.q, &c.k, &c.v, &c.out, &dout, with_lse ? &c.lse : nullptr, &dq, &dk, &dv,
                             &c.options);
  };
  auto expect = [&](const char* message, bool with_lse = true) {
    INFO(message);
    CHECK(run(with_lse) == FLASHJIT_ERROR_INVALID_ARGUMENT);
    CHECK_THAT(flashjit_last_error(), Catch::Contains("backward") && Catch::Contains(message));
  };
  SECTION("missing lse") { expect("lse: the backward needs the forward's logsumexp", false); }
  SECTION("dout shape differs from out") {
    dout = FakeTensors::tensor(FLASHJIT_BFLOAT16, {2, 127, 8, 64});
    expect("dout: shape (2, 127, 8, 64) differs from out's (2, 128, 8, 64)");
  }
  SECTION("dout dtype differs from out") {
    dout.dtype = FLASHJIT_FLOAT16;
    expect("dout: dtype float16 differs from out's bfloat16");
  }
  SECTION("dq rank") {
    dq = FakeTensors::tensor(FLASHJIT_BFLOAT16, {256, 8, 64});
    expect("dq: expected 4 dims");
  }
  SECTION("dk shape") {
    dk = FakeTensors::tensor(FLASHJIT_BFLOAT16, {2, 96, 8, 64});
    expect("dk: shape (2, 96, 8, 64) differs from k's (2, 96, 2, 64)");
  }
  SECTION("dv layout") {
    dv.strides[3] = 2;
    expect("dv: the last dim (head_dim) must be contiguous");
  }
  SECTION("dv misaligned") {
    dv.data = static_cast<char*>(dv.data) + 8;
    expect("dv: data pointer");
  }
  SECTION("forward checks apply too") {
    c.k = FakeTensors::tensor(FLASHJIT_BFLOAT16, {2, 96, 3, 64});
    c.v = dk = dv = c.k;
    expect("heads_kv 3 must divide heads_q 8");
  }
}

TEST_CASE("load_tuning_db reports a malformed or missing file and keeps the previous database", "[api]") {
  const std::string path = std::string(std::getenv("TMPDIR") ? std::getenv("TMPDIR") : "/tmp") + "/flashjit-api-tuning.json";
  std::FILE* f = std::fopen(path.c_str(), "w");
  REQUIRE(f != nullptr);
  std::fputs("{\"format\": \"flashjit-tuning-db\", \"version\": 1, \"entries\": []}\n", f);
  std::fclose(f);
  CHECK(flashjit_load_tuning_db(path.c_str()) == FLASHJIT_OK);
  f = std::fopen(path.c_str(), "w");
  std::fputs("{\"format\": \"flashjit-tuning-db\",\n\"version\": 1,\n\"entries\": [,]}\n", f);
  std::fclose(f);
  CHECK(flashjit_load_tuning_db(path.c_str()) == FLASHJIT_ERROR_INVALID_ARGUMENT);
  CHECK_THAT(flashjit_last_error(), Catch::Contains(path + ":3:"));
  CHECK(flashjit_load_tuning_db("/nonexistent/tuning.json") == FLASHJIT_ERROR_IO);
  CHECK_THAT(flashjit_last_error(), Catch::Contains("/nonexistent/tuning.json"));
  CHECK(flashjit_load_tuning_db(nullptr) == FLASHJIT_ERROR_INVALID_ARGUMENT);
  std::remove(path.c_str());
}

// The tools' and tests' FP8 inputs (host_tensors.hpp) are e4m3 as the device rounds: every value
// round-trips, halfway cases go to the even neighbour, and magnitudes past 448 saturate.
TEST_CASE("e4m3 storage bits round to nearest even and saturate", "[api]") {
  using flashjit::detail::from_e4m3_bits;
  using flashjit::detail::to_e4m3_bits;
  for (int bits = 0; bits < 256; ++bits) {
    if ((bits & 0x7f) == 0x7f) {
      CHECK(std::isnan(from_e4m3_bits(static_cast<uint8_t>(bits))));
      continue;
    }
    INFO("bits " << bits);
    CHECK(to_e4m3_bits(from_e4m3_bits(static_cast<uint8_t>(bits))) == bits);
  }
  for (int bits = 0; bits < 0x7e; ++bits) {  // consecutive non-negative values
    const float below = from_e4m3_bits(static_cast<uint8_t>(bits)), above = from_e4m3_bits(static_cast<uint8_t>(bits + 1));
    const float halfway = (below + above) / 2;
    INFO("between bits " << bits << " and " << bits + 1);
    CHECK(to_e4m3_bits(halfway) == (bits % 2 == 0 ? bits : bits + 1));
    CHECK(to_e4m3_bits(std::nextafter(halfway, 0.f)) == bits);
    CHECK(to_e4m3_bits(std::nextafter(halfway, 1e9f)) == bits + 1);
  }
  CHECK(from_e4m3_bits(0x7e) == 448.f);
  CHECK(from_e4m3_bits(0x01) == std::ldexp(1.f, -9));
  CHECK(to_e4m3_bits(1e9f) == 0x7e);
  CHECK(to_e4m3_bits(-500.f) == 0xfe);
  CHECK(to_e4m3_bits(-0.f) == 0x80);
  CHECK((to_e4m3_bits(std::nanf("")) & 0x7f) == 0x7f);
}
