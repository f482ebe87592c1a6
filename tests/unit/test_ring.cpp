// Ring attention's host side without a GPU: the layouts' shards, the steps' calls (every visible
// (query, key) pair of the whole sequence computed exactly once, nothing hidden computed), zigzag's
// balance, the continuing forward's argument checks, the local ring's checks, and NCCL's loading.
#include <catch2/catch.hpp>

#include <algorithm>
#include <set>

#include "flashjit/flashjit.h"
#include "flashjit/ring.hpp"
#include "problem.hpp"
#include "ring/steps.hpp"
#include "support/fake_tensors.hpp"

using namespace flashjit;
using ring::Layout;

namespace {

ring::Options ring_options(Layout layout, bool causal, int window_left = -1, int window_right = -1) {
  ring::Options options;
  options.layout = layout;
  options.causal = causal;
  options.window_left = window_left;
  options.window_right = window_right;
  return options;
}

const std::pair<int, int> kWindows[] = {{-1, -1}, {0, 0}, {2, -1}, {5, 0}, {4, 3}, {-1, 7}, {13, 1}, {40, 40}};

}  // namespace

TEST_CASE("ring: shards of the contiguous and zigzag layouts", "[ring]") {
  const ring::Shard c = ring::shard_of(Layout::contiguous, 2, 4, 400);
  CHECK(c.chunk == 100);
  CHECK(c.rows() == 100);
  CHECK(c.global_row(0) == 200);
  CHECK(c.global_row(99) == 299);
  const ring::Shard z = ring::shard_of(Layout::zigzag, 1, 4, 800);  // chunks 1 and 6 of 8
  CHECK(z.rows() == 200);
  CHECK(z.global_row(0) == 100);
  CHECK(z.global_row(99) == 199);
  CHECK(z.global_row(100) == 600);
  CHECK(z.global_row(199) == 699);
  // Every row of the sequence on exactly one rank.
  for (Layout layout : {Layout::contiguous, Layout::zigzag})
    for (int world : {1, 2, 3, 8}) {
      const int64_t seqlen = 2 * world * 5;
      std::multiset<int64_t> rows;
      for (int r = 0; r < world; ++r) {
        const ring::Shard s = ring::shard_of(layout, r, world, seqlen);
        for (int64_t i = 0; i < s.rows(); ++i) rows.insert(s.global_row(i));
      }
      REQUIRE(rows.size() == size_t(seqlen));
      CHECK(std::set<int64_t>(rows.begin(), rows.end()).size() == size_t(seqlen));
    }
}

TEST_CASE("ring: a call's attention options take its mask and the ring's scale, softcap, backend and stream", "[ring]") {
  ring::Options options;
  options.softmax_scale = 0.25f;
  options.softcap = 30.f;
  options.backend = Backend::sm90;
  options.sm_margin = 4;
  int stream_tag = 0;
  options.stream = &stream_tag;
  ring::StepCall call{};
  call.causal = true;
  call.window_left = 100;
  call.window_right = 0;
  const AttentionOptions a = ring::detail::call_options(options, call);
  CHECK(a.softmax_scale == 0.25f);
  CHECK((a.causal && a.window_left == 100 && a.window_right == 0));
  CHECK(a.softcap == 30.f);
  CHECK(a.backend == Backend::sm90);
  CHECK(a.stream == &stream_tag);
  CHECK(a.sm_margin == 0);  // (the forward's to add)
  CHECK((a.continuation == nullptr && a.backward_continuation == nullptr));
  options.softmax_scale.reset();
  CHECK_FALSE(ring::detail::call_options(options, call).softmax_scale.has_value());
}

TEST_CASE("ring: a sequence that does not divide into the layout's chunks is refused", "[ring]") {
  CHECK_THROWS_WITH(ring::shard_of(Layout::zigzag, 0, 4, 100), Catch::Contains("does not divide into the zigzag layout's 8"));
  CHECK_THROWS_WITH(ring::shard_of(Layout::contiguous, 0, 3, 100), Catch::Contains("3 equal chunks"));
  CHECK_THROWS_WITH(ring::shard_of(Layout::contiguous, 3, 3, 99), Catch::Contains("rank 3 is outside"));
  CHECK_THROWS_WITH(ring::shard_of(Layout::contiguous, 0, 0, 99), Catch::Contains("at least one"));
}

// Every (query, key) pair of the whole sequence that the mask (causal, a window, both or neither)
// shows is computed by exactly one call of one step on the query's rank, and no hidden pair by any;
// a call's window sides are -1 or >= 0, as AttentionOptions takes them, and every row of a call sees
// some key of it.
TEST_CASE("ring: the steps' calls cover the visible pairs exactly once", "[ring]") {
  for (Layout layout : {Layout::contiguous, Layout::zigzag})
    for (bool causal : {false, true})
      for (const auto& [left, right] : kWindows)
        for (int world = 1; world <= 8; ++world) {
          const ring::Options options = ring_options(layout, causal, left, right);
          const int64_t chunk = 3, seqlen = 2 * world * chunk;
          auto visible = [&](int64_t q, int64_t k) {
            const int64_t r = causal ? 0 : right;
            return (r < 0 || k <= q + r) && (left < 0 || k >= q - left);
          };
          std::vector<int> covered(seqlen * seqlen, 0);
          int bad_windows = 0, blind_rows = 0;
          for (int rank = 0; rank < world; ++rank) {
            const ring::Shard own = ring::shard_of(layout, rank, world, seqlen);
            for (int step = 0; step < world; ++step) {
              const int source = (rank - step + world) % world;
              const ring::Shard visiting = ring::shard_of(layout, source, world, seqlen);
              for (const ring::StepCall& call : ring::step_calls(options, rank, source, world, own.rows())) {
                bad_windows += call.window_left < -1 || call.window_right < -1 || (call.causal && call.window_right != -1);
                for (int64_t i = 0; i < call.q_rows; ++i) {
                  bool sees = false;
                  for (int64_t j = 0; j < call.kv_rows; ++j) {
                    if (!call.shows(i, j)) continue;
                    sees = true;
                    const int64_t q = own.global_row(call.q_begin + i), k = visiting.global_row(call.kv_begin + j);
                    ++covered[q * seqlen + k];
                  }
                  blind_rows += !sees;
                }
              }
            }
          }
          int wrong = 0;
          for (int64_t q = 0; q < seqlen; ++q)
            for (int64_t k = 0; k < seqlen; ++k) wrong += covered[q * seqlen + k] != (visible(q, k) ? 1 : 0);
          INFO(ring::to_string(layout) << (causal ? " causal" : "") << " window (" << left << ", " << right << "), "
                                       << world << " ranks");
          CHECK(wrong == 0);
          CHECK(bad_windows == 0);
          CHECK(blind_rows == 0);
        }
}

// The forward's plan: each row's first call starts its state (no read) and every later one merges;
// exactly one call writes each row out, its last. The backward's own step: each query and key row
// finished by exactly one call, after every other call that touches it in that step.
TEST_CASE("ring: every row's state starts once and ends once, forward and backward", "[ring]") {
  for (Layout layout : {Layout::contiguous, Layout::zigzag})
    for (bool causal : {false, true})
      for (const auto& [left, right] : kWindows)
        for (int world : {1, 2, 3, 5, 8}) {
          const ring::Options options = ring_options(layout, causal, left, right);
          const int64_t rows = layout == Layout::zigzag ? 2 * 7 : 7;
          INFO(ring::to_string(layout) << (causal ? " causal" : "") << " window (" << left << ", " << right << "), "
                                       << world << " ranks");
          for (int rank = 0; rank < world; ++rank) {
            const auto plan = ring::detail::plan_forward(options, rank, world, rows);
            std::vector<int> started(rows, 0), ended(rows, 0), touched_after_end(rows, 0);
            for (const auto& planned : plan) {
              const ring::StepCall& call = planned.call;
              for (int64_t i = call.q_begin; i < call.q_begin + call.q_rows; ++i) {
                CHECK(planned.has_state == (started[i] > 0));
                ++started[i];
                touched_after_end[i] += ended[i];
                const int64_t local = i - call.q_begin;
                ended[i] += local >= planned.final_begin && local < planned.final_begin + planned.final_rows;
              }
            }
            for (int64_t i = 0; i < rows; ++i) {
              CHECK(started[i] > 0);
              CHECK(ended[i] == 1);
              CHECK(touched_after_end[i] == 0);
            }
            const auto own = ring::detail::backward_step_calls(options, rank, rank, world, rows, /*own=*/true);
            std::vector<int> q_done(rows, 0), kv_done(rows, 0);
            int touched_after_done = 0;
            for (size_t c = 0; c < own.size(); ++c) {
              const bool final = ring::detail::ends_its_rows(own, c);
              for (int64_t i = own[c].q_begin; i < own[c].q_begin + own[c].q_rows; ++i) touched_after_done += q_done[i], q_done[i] += final;
              for (int64_t j = own[c].kv_begin; j < own[c].kv_begin + own[c].kv_rows; ++j) touched_after_done += kv_done[j], kv_done[j] += final;
            }
            CHECK(touched_after_done == 0);
            CHECK(std::count(q_done.begin(), q_done.end(), 1) == rows);
            CHECK(std::count(kv_done.begin(), kv_done.end(), 1) == rows);
          }
        }
}

// Varlen shards plan in chunks (one row per chunk): each call one chunk of queries against one of
// keys, every visible chunk pair once, each chunk's state started and finished once.
TEST_CASE("ring: varlen shards' calls are whole chunks, each pair once", "[ring][varlen]") {
  for (Layout layout : {Layout::contiguous, Layout::zigzag})
    for (bool causal : {false, true})
      for (int world = 1; world <= 8; ++world) {
        ring::Options options = ring_options(layout, causal);
        options.seqlens = {int64_t(2 * world) * 5, int64_t(2 * world) * 2};
        const int chunks = layout == Layout::zigzag ? 2 : 1, total = chunks * world;
        INFO(ring::to_string(layout) << (causal ? " causal" : "") << ", " << world << " ranks");
        std::vector<int> covered(total * total, 0);
        for (int rank = 0; rank < world; ++rank) {
          const ring::Shard own = ring::shard_of(layout, rank, world, total);
          for (int step = 0; step < world; ++step) {
            const int source = (rank - step + world) % world;
            const ring::Shard visiting = ring::shard_of(layout, source, world, total);
            for (const auto& call : ring::detail::calls_of_step(options, rank, source, world, chunks)) {
              CHECK(call.q_rows == 1);
              CHECK(call.kv_rows == 1);
              CHECK(call.window_left == -1);
              CHECK(call.window_right == -1);
              const int64_t q = own.global_row(call.q_begin), k = visiting.global_row(call.kv_begin);
              CHECK(call.causal == (causal && q == k));  // (a diagonal chunk pair stays causal at any length)
              ++covered[own.global_row(call.q_begin) * total + visiting.global_row(call.kv_begin)];
            }
          }
          for (const auto& planned : ring::detail::plan_forward(options, rank, world, chunks))
            CHECK((planned.final_rows == 0 || planned.final_rows == 1));
        }
        for (int q = 0; q < total; ++q)
          for (int k = 0; k < total; ++k) CHECK(covered[q * total + k] == ((!causal || k <= q) ? 1 : 0));
      }
  ring::Options options = ring_options(Layout::zigzag, true);
  options.seqlens = {16, 12};
  const auto shards = ring::detail::varlen_shards(options, 2, 14, "test");
  CHECK(shards.chunk == std::vector<int>{4, 3});
  CHECK(shards.start == std::vector<int>{0, 8, 14});
  CHECK(shards.call_arrays() == std::vector<int>{0, 8, 14, 4, 3, 4, 11, 14, 4, 3});
  CHECK_THROWS_WITH(ring::detail::varlen_shards(options, 2, 16, "test"), Catch::Contains("q has 16 packed rows, but the shards of seqlens hold 14"));
  options.seqlens = {16, 10};
  CHECK_THROWS_WITH(ring::detail::varlen_shards(options, 2, 13, "test"), Catch::Contains("seqlens[1] = 10 does not divide into the zigzag layout's 4"));
}

TEST_CASE("ring: zigzag balances causal work across ranks, contiguous does not", "[ring]") {
  auto work = [](Layout layout, int world, int rank) {
    const int64_t seqlen = 2 * world * 1024, rows = ring::shard_of(layout, rank, world, seqlen).rows();
    double pairs = 0;
    for (int step = 0; step < world; ++step)
      for (const auto& call : ring::step_calls(ring_options(layout, true), rank, (rank - step + world) % world, world, rows))
        pairs += call.causal ? call.q_rows * (call.q_rows + 1) / 2.0 : double(call.q_rows) * call.kv_rows;
    return pairs;
  };
  for (int world : {2, 4, 8}) {
    double zig_max = 0, zig_min = 1e300, contiguous_max = 0, contiguous_min = 1e300;
    for (int r = 0; r < world; ++r) {
      zig_max = std::max(zig_max, work(Layout::zigzag, world, r));
      zig_min = std::min(zig_min, work(Layout::zigzag, world, r));
      contiguous_max = std::max(contiguous_max, work(Layout::contiguous, world, r));
      contiguous_min = std::min(contiguous_min, work(Layout::contiguous, world, r));
    }
    INFO(world << " ranks: zigzag max/min " << zig_max / zig_min << ", contiguous " << contiguous_max / contiguous_min);
    CHECK(zig_max / zig_min <= 1.05);
    CHECK(contiguous_max / contiguous_min > 2);
  }
}

TEST_CASE("ring: a local ring's size and endpoints are checked", "[ring]") {
  CHECK_THROWS_WITH(ring::LocalRing(0), Catch::Contains("expected 1 to 64"));
  ring::LocalRing local(3);
  CHECK(local.size() == 3);
  CHECK(local.endpoint(2).rank() == 2);
  CHECK(local.endpoint(2).size() == 3);
  CHECK_THROWS_WITH(local.endpoint(3), Catch::Contains("rank 3 is outside"));
  // The first failure comes back from run(), after every thread has joined.
  CHECK_THROWS_WITH(local.run([](int rank, ring::Transport&) {
                      if (rank == 1) throw Error(ErrorCode::invalid_argument, "test", "rank 1 failed");
                    }),
                    Catch::Contains("rank 1 failed"));
}

TEST_CASE("ring: NCCL loads where it is installed, and says how to get it where not", "[ring]") {
  std::string why;
  if (const auto version = ring::nccl_version(&why)) {
    CHECK(*version >= 20700);
  } else {
    CHECK(why.find("FLASHJIT_NCCL_LIBRARY") != std::string::npos);
    CHECK_THROWS_AS(ring::NcclTransport(reinterpret_cast<void*>(1)), Error);
  }
  CHECK_THROWS_WITH(ring::NcclTransport(std::vector<char>(5), 0, 2), Catch::Contains("128 bytes"));
  CHECK_THROWS_WITH(ring::NcclTransport(nullptr), Catch::Contains("null"));
}

namespace {

// Views over a fake, aligned device address: the checks here run before any pointer is touched.
void* fake(size_t offset = 0) { return reinterpret_cast<void*>(uintptr_t(1) << 32 | offset); }

struct Continuing {
  TensorView q = TensorView::contiguous(fake(), ScalarType::bfloat16, {2, 64, 4, 128});
  TensorView kv = TensorView::contiguous(fake(), ScalarType::bfloat16, {2, 32, 2, 128});
  TensorView lse = TensorView::contiguous(fake(), ScalarType::float32, {2, 4, 64});
  ForwardContinuation continuation;
  Continuing() { continuation.o_state = TensorView::contiguous(fake(), ScalarType::float32, {2, 4, 64, 128}); }
  detail::ForwardProblem problem(const TensorView* with_lse) const {
    AttentionOptions options;
    options.continuation = &continuation;
    return detail::make_forward_problem(q, kv, kv, q, with_lse, nullptr, options);
  }
};

}  // namespace

TEST_CASE("ring: a continuing forward's arguments", "[ring]") {
  Continuing c;
  c.continuation.has_state = true;
  c.continuation.final_rows = 10;
  const auto problem = c.problem(&c.lse);
  CHECK(problem.continues);
  CHECK(problem.params.state_read == 1);
  CHECK(problem.params.state_final_begin == 0);
  CHECK(problem.params.state_final_end == 10);
  CHECK(problem.params.state_o == c.continuation.o_state.data);
  // A slice of the rows: the state's strides follow the LSE's.
  Continuing slice;
  slice.q.shape[1] = slice.lse.shape[2] = slice.continuation.o_state.shape[2] = 32;
  CHECK(slice.problem(&slice.lse).continues);

  auto refused = [](const Continuing& bad, const TensorView* lse, const char* message) {
    CHECK_THROWS_WITH(bad.problem(lse), Catch::Contains(message));
  };
  refused(c, nullptr, "lse is required");
  Continuing wrong = c;
  wrong.continuation.o_state.dtype = ScalarType::bfloat16;
  refused(wrong, &wrong.lse, "expected dtype float32");
  wrong = c;
  wrong.continuation.o_state.shape[3] = 64;
  refused(wrong, &wrong.lse, "(batch, heads_q, seqlen_q, head_dim)");
  wrong = c;
  wrong.continuation.o_state.strides[1] *= 2;
  wrong.continuation.o_state.strides[0] *= 2;
  refused(wrong, &wrong.lse, "must be lse's times head_dim");
  wrong = c;
  wrong.continuation.final_rows = 65;
  refused(wrong, &wrong.lse, "final rows [0, 65) are outside 0 .. seqlen_q 64");
  wrong = c;
  wrong.continuation.o_state.data = static_cast<char*>(fake()) + 4;
  refused(wrong, &wrong.lse, "not 8-byte aligned");
}

TEST_CASE("ring: the C API's arguments are checked before anything runs", "[ring][api]") {
  using flashjit::test::FakeTensors;
  const flashjit_tensor t = FakeTensors::tensor(FLASHJIT_BFLOAT16, {1, 64, 2, 64});
  flashjit_ring_options options;
  flashjit_ring_options_init(&options);
  CHECK(options.layout == 1);
  CHECK(options.check_shapes == 1);
  CHECK(options.window_left == -1);
  CHECK(options.window_right == -1);
  CHECK(options.seqlens == nullptr);
  CHECK(options.num_seqlens == 0);
  CHECK(flashjit_ring_forward(nullptr, &t, &t, &t, &t, nullptr, &options) == FLASHJIT_ERROR_INVALID_ARGUMENT);
  CHECK_THAT(flashjit_last_error(), Catch::Contains("transport: null"));
  CHECK(flashjit_ring_forward_local(0, &t, &t, &t, &t, nullptr, nullptr, &options) == FLASHJIT_ERROR_INVALID_ARGUMENT);
  CHECK_THAT(flashjit_last_error(), Catch::Contains("world: 0 ranks"));
  options.layout = 7;
  CHECK(flashjit_ring_forward_local(1, &t, &t, &t, &t, nullptr, nullptr, &options) == FLASHJIT_ERROR_INVALID_ARGUMENT);
  CHECK_THAT(flashjit_last_error(), Catch::Contains("options.layout: 7"));
  options.layout = 1;
  options.num_seqlens = 3;  // lengths promised, none given
  CHECK(flashjit_ring_forward_local(1, &t, &t, &t, &t, nullptr, nullptr, &options) == FLASHJIT_ERROR_INVALID_ARGUMENT);
  CHECK_THAT(flashjit_last_error(), Catch::Contains("options.seqlens: 3 lengths"));
  flashjit_ring_transport* transport = nullptr;
  CHECK(flashjit_ring_transport_nccl(nullptr, 0, 1, &transport) == FLASHJIT_ERROR_INVALID_ARGUMENT);
  CHECK(transport == nullptr);
}

TEST_CASE("ring: a continuing backward's arguments", "[ring]") {
  const TensorView q = TensorView::contiguous(fake(), ScalarType::bfloat16, {2, 64, 4, 128});
  const TensorView kv = TensorView::contiguous(fake(), ScalarType::bfloat16, {2, 32, 2, 128});
  const TensorView lse = TensorView::contiguous(fake(), ScalarType::float32, {2, 4, 64});
  BackwardContinuation c;
  c.dq_state = TensorView::contiguous(fake(), ScalarType::float32, {2, 64, 4, 128});
  c.dk_state = c.dv_state = TensorView::contiguous(fake(), ScalarType::float32, {2, 32, 2, 128});
  c.final = true;
  auto problem = [&](const BackwardContinuation& with, bool deterministic = false) {
    AttentionOptions options;
    options.backward_continuation = &with;
    options.deterministic = deterministic;
    return detail::make_backward_problem(q, kv, kv, q, q, &lse, q, kv, kv, nullptr, options);
  };
  const auto b = problem(c);
  CHECK(b.forward.continues);
  CHECK(b.params.gradients_final == 1);
  CHECK(b.params.dq_state == c.dq_state.data);
  CHECK(b.params.dkv_state_row_stride == 2 * 128);
  auto refused = [&](const BackwardContinuation& bad, const char* message, bool deterministic = false) {
    CHECK_THROWS_WITH(problem(bad, deterministic), Catch::Contains(message));
  };
  refused(c, "atomic dQ only", true);
  BackwardContinuation wrong = c;
  wrong.dq_state.dtype = ScalarType::bfloat16;
  refused(wrong, "dq_state: expected dtype float32");
  wrong = c;
  wrong.dk_state.shape[1] = 64;
  refused(wrong, "dk_state: shape");
  wrong = c;
  wrong.dv_state.strides[1] *= 2;
  wrong.dv_state.strides[0] *= 2;
  refused(wrong, "dv_state must have dk_state's strides");
  wrong = c;
  wrong.dq_state.data = static_cast<char*>(fake()) + 8;
  refused(wrong, "16-byte aligned base");
}
