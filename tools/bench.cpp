// flashjit-bench: time flashjit's forward attention (or, with --backward, its backward) on the
// standard grid of DESIGN.md (B*S tokens, H*D hidden), optionally checking every forward row
// against the reference kernel.
#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <cmath>
#include <functional>
#include <memory>
#include <numeric>
#include <optional>
#include <random>
#include <thread>

#include <nlohmann/json.hpp>

#include "cli_common.hpp"
#include "flashjit/flashjit.hpp"
#include "flashjit/ring.hpp"
#include "flashjit/tuning.hpp"
#include "tool_support.hpp"

using namespace flashjit;
using nlohmann::json;

namespace {

constexpr const char* kTool = "flashjit-bench";

struct Options {
  std::vector<int> head_dims{64, 128, 256};
  std::vector<int> seqlens{512, 1024, 2048, 4096, 8192, 16384};
  std::vector<std::string> causal{"off", "on"};
  int tokens = 16384;
  int hidden = 2048;
  std::string dtype = "bf16";
  std::string backend = "auto";
  std::string layout = "bshd";  // bshd: sequence-major (flash-attn's order); bhsd: head-major (SDPA's)
  int warmup = 3;
  int iters = 20;
  bool check = false;
  bool sweep = false;
  bool v_pretransposed = false;
  bool backward = false;
  bool deterministic = false;
  bool json_output = false;
  int device = 0;
  int num_splits = 0;      // the Hopper forward's tail splits (AttentionOptions::num_splits)
  double peak_tflops = 0;  // 0: the measured ceiling of a known device, else no % column
  std::string tuning_db;   // dispatch consults this database (as FLASHJIT_TUNING_DB would)
  bool versus_heuristic = false;  // also time the heuristic's spec, interleaved with dispatch's
  // --decode: forward_kvcache rows, batch x cached tokens (--seqlens), one head dim (--head-dims).
  bool decode = false;
  std::vector<int> batches{1, 16, 64};
  int heads_q = 32, heads_kv = 8, seqlen_q = 1;
  int page_size = 0;  // 0: a contiguous cache
  // --ring: ring attention over these numbers of virtual ranks, beside one call (batch 1).
  std::vector<int> ring_sizes;
  std::string ring_layout = "zigzag";
  bool host_cost = false;  // --host-cost: host time per C++ API call
};

// Dense bf16 tensor-core rates measured on real GPUs (a GEMM on random data), the ceiling the
// "% of peak" column divides by. Only devices measured by the project are listed.
double measured_peak_tflops(const std::string& device_name) {
  if (device_name == "NVIDIA H200") return 764.0;  // DESIGN.md: bf16 GEMM on the H200 here
  return 0;
}

struct Row {
  int head_dim, seqlen, batch, heads;
  bool causal;
  double median_ms = 0, tflops = 0, max_abs_err = -1, rel_l2_err = -1;
  double heuristic_ms = 0, heuristic_tflops = 0;  // --versus-heuristic
  std::string heuristic_spec;
  bool passed = true;
  std::string spec;                                 // the kernel that ran (the winner with --sweep)
  std::vector<std::pair<std::string, double>> sweep;  // every candidate's median ms
};

// Median per-call time of each of `calls`, over `iters` samples taken in turn (so clock and
// thermal drift hit them alike). A sample times back-to-back calls between two events, enough to
// span ~10 ms (up to 200): each call's host work overlaps the previous kernel, as in a model, so the
// samples time the GPU rather than the launch path. An untimed lead call before the start event
// keeps the GPU busy while the host queues the timed ones: without it the GPU waited for the first
// launch, a cost of the launch path. Warm-up calls first keep compiles, module loads and lazy
// loading out of the numbers.
std::vector<double> median_ms(const std::vector<std::function<void()>>& calls, int warmup, int iters, CUevent start,
                              CUevent stop) {
  auto timed = [&](const std::function<void()>& call, int count) {
    call();  // the lead call (untimed)
    FLASHJIT_CU(cuEventRecord, start, nullptr);
    for (int i = 0; i < count; ++i) call();
    FLASHJIT_CU(cuEventRecord, stop, nullptr);
    FLASHJIT_CU(cuEventSynchronize, stop);
    float ms = 0;
    FLASHJIT_CU(cuEventElapsedTime, &ms, start, stop);
    return static_cast<double>(ms);
  };
  for (int i = 0; i < std::max(1, warmup); ++i)
    for (const auto& call : calls) call();
  FLASHJIT_CU(cuCtxSynchronize);
  const int count = std::clamp(static_cast<int>(10.0 / std::max(timed(calls.front(), 1), 1e-3)), 1, 200);
  std::vector<std::vector<double>> samples(calls.size());
  for (int i = 0; i < iters; ++i)
    for (size_t c = 0; c < calls.size(); ++c) samples[c].push_back(timed(calls[c], count) / count);
  std::vector<double> medians;
  for (auto& s : samples) {
    std::sort(s.begin(), s.end());
    medians.push_back(s[s.size() / 2]);
  }
  return medians;
}

// --decode: one decode step (seqlen_q query tokens per sequence) over a KV cache of `seqlen` tokens
// per sequence, contiguous or paged (pages in a shuffled order); GB/s of K + V read. Every call of a
// sample reads another copy of the cache until the copies pass 200 MB, so small rows do not run
// from the L2. (Queued calls: where a call's host cost exceeds its GPU time, bench/decode.py's
// CUDA-graph timing is the one to read.)
int run_decode(const Options& o) {
  const DType dtype = parse_dtype(o.dtype);
  const ScalarType scalar = detail::input_scalar_type(dtype);
  const int d = o.head_dims.front();
  if (o.page_size < 0) throw Error(ErrorCode::invalid_argument, "--page-size", "must be >= 0 (0: contiguous)");
  for (int s : o.seqlens)
    if (o.page_size > 0 && s % o.page_size != 0)
      throw Error(ErrorCode::invalid_argument, "--seqlens", fmt::format("{} is not a multiple of --page-size {}", s, o.page_size));
  const DeviceProperties& device = device_properties(o.device);
  detail::make_context_current(o.device);
  Runtime& runtime = Runtime::global();
  CUevent start, stop;
  FLASHJIT_CU(cuEventCreate, &start, CU_EVENT_DEFAULT);
  FLASHJIT_CU(cuEventCreate, &stop, CU_EVENT_DEFAULT);
  const std::vector<uint16_t> random = detail::random_half_bits(size_t(1) << 24, dtype, 7);
  auto fill = [&](const detail::DeviceMemory& m, size_t bytes) {  // repeats of one random block
    for (size_t at = 0; at < bytes; at += random.size() * 2)
      FLASHJIT_CU(cuMemcpyHtoD, m.address() + at, random.data(), std::min(random.size() * 2, bytes - at));
  };
  if (!o.json_output)
    fmt::print("{} --decode on {}: heads {}/{}, head dim {}, {} query token(s), {}, {}\n", kTool, device.name, o.heads_q,
               o.heads_kv, d, o.seqlen_q, o.page_size > 0 ? fmt::format("page size {}", o.page_size) : "contiguous cache",
               o.layout);
  json rows = json::array();
  for (int batch : o.batches)
    for (int seqlen : o.seqlens) {
      const size_t cache_elements = size_t(batch) * seqlen * o.heads_kv * d;
      const double kv_bytes = 2.0 * cache_elements * 2;
      const int copies = static_cast<int>(std::clamp(std::ceil(200e6 / kv_bytes), 1.0, 8.0));
      struct Copy {
        std::unique_ptr<detail::DeviceMemory> k, v;
      };
      std::vector<Copy> caches;
      for (int c = 0; c < copies; ++c) {
        caches.push_back({std::make_unique<detail::DeviceMemory>(cache_elements * 2),
                          std::make_unique<detail::DeviceMemory>(cache_elements * 2)});
        fill(*caches.back().k, cache_elements * 2);
        fill(*caches.back().v, cache_elements * 2);
      }
      const size_t q_elements = size_t(batch) * o.seqlen_q * o.heads_q * d;
      detail::DeviceMemory q(q_elements * 2), out(q_elements * 2), lse(q_elements / d * 4), seqlens(size_t(batch) * 4);
      fill(q, q_elements * 2);
      const std::vector<int> lengths(batch, seqlen);
      FLASHJIT_CU(cuMemcpyHtoD, seqlens.address(), lengths.data(), lengths.size() * 4);
      const int pages_per_sequence = o.page_size > 0 ? seqlen / o.page_size : 1;
      std::vector<int> table(size_t(batch) * pages_per_sequence);
      std::iota(table.begin(), table.end(), 0);
      std::shuffle(table.begin(), table.end(), std::mt19937(3));
      detail::DeviceMemory table_memory(table.size() * 4);
      FLASHJIT_CU(cuMemcpyHtoD, table_memory.address(), table.data(), table.size() * 4);
      const TensorView q_view = TensorView::contiguous(q.get(), scalar, {batch, o.seqlen_q, o.heads_q, d}, o.device);
      const TensorView out_view = TensorView::contiguous(out.get(), scalar, {batch, o.seqlen_q, o.heads_q, d}, o.device);
      const TensorView lse_view =
          TensorView::contiguous(lse.get(), ScalarType::float32, {batch, o.heads_q, o.seqlen_q}, o.device);
      const TensorView seqlens_view = TensorView::contiguous(seqlens.get(), ScalarType::int32, {batch}, o.device);
      const TensorView table_view =
          TensorView::contiguous(table_memory.get(), ScalarType::int32, {batch, pages_per_sequence}, o.device);
      auto cache_view = [&](const detail::DeviceMemory& m) {
        if (o.page_size > 0)
          return TensorView::contiguous(m.get(), scalar, {int64_t(batch) * pages_per_sequence, o.page_size, o.heads_kv, d},
                                        o.device);
        return o.layout == "bhsd" ? TensorView::head_major(m.get(), scalar, batch, seqlen, o.heads_kv, d, o.device)
                                  : TensorView::contiguous(m.get(), scalar, {batch, seqlen, o.heads_kv, d}, o.device);
      };
      std::vector<KvCache> views;
      for (const Copy& c : caches) {
        KvCache cache;
        cache.k_cache = cache_view(*c.k);
        cache.v_cache = cache_view(*c.v);
        cache.cache_seqlens = &seqlens_view;
        if (o.page_size > 0) cache.block_table = &table_view;
        views.push_back(cache);
      }
      AttentionOptions options;
      options.num_splits = o.num_splits;
      size_t next = 0;
      auto call = [&] {
        runtime.forward_kvcache(q_view, views[next], out_view, &lse_view, options);
        next = (next + 1) % views.size();
      };
      json sweep = json::array();
      if (o.sweep) {
        const detail::KvCacheProblem problem = detail::make_kvcache_problem(q_view, views[0], out_view, &lse_view, options);
        const detail::PassProblem planned{detail::Pass::kvcache, problem.forward, nullptr, &problem};
        double best = 1e30;
        std::optional<KernelSpec> winner;
        for (const auto& spec : detail::tuning_plan(planned, device.arch()).candidates) {
          if (runtime.kernel_cache().get(spec)->has_spills()) continue;
          options.kernel = spec;
          const double ms = median_ms({call}, 1, std::max(3, o.iters / 2), start, stop)[0];
          sweep.push_back({{"spec", spec.name()}, {"ms", ms}, {"gb_per_s", kv_bytes / (ms * 1e-3) / 1e9}});
          if (ms < best) {
            best = ms;
            winner = spec;
          }
        }
        options.kernel = winner;
      }
      const double ms = median_ms({call}, o.warmup, o.iters, start, stop)[0];
      const detail::KvCacheProblem problem = detail::make_kvcache_problem(q_view, views[0], out_view, &lse_view, options);
      const std::string spec = options.kernel ? options.kernel->name()
                                              : detail::select_kernel({detail::Pass::kvcache, problem.forward, nullptr, &problem},
                                                                      device, &runtime.tuning()).name();
      const double gbps = kv_bytes / (ms * 1e-3) / 1e9;
      rows.push_back({{"batch", batch}, {"seqlen", seqlen}, {"kv_bytes", kv_bytes}, {"median_ms", ms}, {"gb_per_s", gbps},
                      {"spec", spec}, {"sweep", sweep}});
      if (!o.json_output) {
        fmt::print("b{:<4} cache {:<6} {:10.1f} us {:8.0f} GB/s  {}\n", batch, seqlen, ms * 1e3, gbps, spec);
        for (const auto& entry : sweep)
          fmt::print("    {:8.0f} GB/s  {}\n", entry["gb_per_s"].get<double>(), entry["spec"].get<std::string>());
        std::fflush(stdout);
      }
    }
  detail::driver().cuEventDestroy(start);
  detail::driver().cuEventDestroy(stop);
  if (o.json_output)
    fmt::print("{}\n", json{{"device", device.name}, {"mode", "decode"}, {"dtype", o.dtype}, {"layout", o.layout},
                            {"heads_q", o.heads_q}, {"heads_kv", o.heads_kv}, {"head_dim", d}, {"seqlen_q", o.seqlen_q},
                            {"page_size", o.page_size}, {"rows", rows}}.dump(2));
  return cli::kExitOk;
}

// --ring: ring attention over N virtual ranks on this GPU (LocalRing: each rank on its own thread
// and stream, K/V moved by device copies) beside one call on the whole sequence, batch 1, per row
// (head dim, seqlen, causal), timed in turn. A ring call's ranks start after an event on the timing
// stream and are joined back into it. ms: shapes not re-checked (Options::check_shapes off, a
// training loop's steady state); checked_ms: with the header exchange and its wait on every call.
int run_ring(const Options& o) {
  const DType dtype = parse_dtype(o.dtype);
  const ScalarType scalar = detail::input_scalar_type(dtype);
  const ring::Layout layout = o.ring_layout == "zigzag" ? ring::Layout::zigzag : ring::Layout::contiguous;
  if (o.ring_layout != "zigzag" && o.ring_layout != "contiguous")
    throw Error(ErrorCode::invalid_argument, "--ring-layout", fmt::format("'{}' is not zigzag or contiguous", o.ring_layout));
  // 2N + 1 streams at once: past the driver's 8 default hardware queues, streams share queues and
  // wait on each other's work (read when the driver starts: only if no CUDA call came before).
  setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", /*overwrite=*/0);
  const DeviceProperties& device = device_properties(o.device);
  detail::make_context_current(o.device);
  Runtime& runtime = Runtime::global();
  CUevent start, stop, ring_start;
  FLASHJIT_CU(cuEventCreate, &start, CU_EVENT_DEFAULT);
  FLASHJIT_CU(cuEventCreate, &stop, CU_EVENT_DEFAULT);
  FLASHJIT_CU(cuEventCreate, &ring_start, CU_EVENT_DISABLE_TIMING);
  const std::vector<uint16_t> random = detail::random_half_bits(size_t(1) << 22, dtype, 11);
  auto fill = [&](const detail::DeviceMemory& m, size_t bytes) {
    for (size_t at = 0; at < bytes; at += random.size() * 2)
      FLASHJIT_CU(cuMemcpyHtoD, m.address() + at, random.data(), std::min(random.size() * 2, bytes - at));
  };
  if (!o.json_output)
    fmt::print("{} --ring on {}: {} layout, {}, {} memory, batch 1, heads = {} / head dim\n", kTool, device.name,
               o.ring_layout, o.dtype, o.layout, o.hidden);
  json rows = json::array();
  for (int d : o.head_dims)
    for (int seqlen : o.seqlens)
      for (const auto& c : o.causal) {
        const bool causal = c == "on";
        const int heads = o.hidden / d;
        auto view = [&](const detail::DeviceMemory& m, int rows) {
          return o.layout == "bhsd" ? TensorView::head_major(m.get(), scalar, 1, rows, heads, d, o.device)
                                    : TensorView::contiguous(m.get(), scalar, {1, rows, heads, d}, o.device);
        };
        const size_t n = size_t(seqlen) * heads * d;
        detail::DeviceMemory q(n * 2), k(n * 2), v(n * 2), out(n * 2), lse(size_t(heads) * seqlen * 4);
        for (const auto* m : {&q, &k, &v}) fill(*m, n * 2);
        // --backward: the forward and then the backward, dout random, gradients in their own memory.
        std::optional<detail::DeviceMemory> dout, dq, dk, dv;
        if (o.backward) {
          dout.emplace(n * 2), dq.emplace(n * 2), dk.emplace(n * 2), dv.emplace(n * 2);
          fill(*dout, n * 2);
        }
        const TensorView lse_view = TensorView::contiguous(lse.get(), ScalarType::float32, {1, heads, seqlen}, o.device);
        AttentionOptions single_options;
        single_options.causal = causal;
        // The whole sequence as one continuing call (the kernel variant's own cost): a first step (no
        // state read, every row final) and a middle one (fp32 state read and written).
        detail::DeviceMemory state(n * 4);
        ForwardContinuation first, middle;
        first.o_state = middle.o_state = TensorView::contiguous(state.get(), ScalarType::float32, {1, heads, seqlen, d}, o.device);
        first.final_rows = seqlen;
        middle.has_state = true;
        AttentionOptions first_options = single_options, middle_options = single_options;
        first_options.continuation = &first;
        middle_options.continuation = &middle;
        auto whole_call = [&](const AttentionOptions& options) {
          runtime.forward(view(q, seqlen), view(k, seqlen), view(v, seqlen), view(out, seqlen), &lse_view, options);
          if (o.backward && options.continuation == nullptr)
            runtime.backward(view(q, seqlen), view(k, seqlen), view(v, seqlen), view(out, seqlen), view(*dout, seqlen),
                             &lse_view, view(*dq, seqlen), view(*dk, seqlen), view(*dv, seqlen), single_options);
        };
        std::vector<std::function<void()>> calls{[&] { whole_call(single_options); }, [&] { whole_call(first_options); },
                                                  [&] { whole_call(middle_options); }};
        struct RankSet {
          int world;
          std::unique_ptr<ring::LocalRing> local;
          std::vector<std::unique_ptr<detail::DeviceMemory>> memory;  // q, k, v, out, lse per rank
          std::vector<CUstream> streams;
          std::vector<CUevent> done;
        };
        std::vector<std::unique_ptr<RankSet>> sets;
        for (int world : o.ring_sizes) {
          const int chunks = layout == ring::Layout::zigzag ? 2 * world : world;
          if (world < 1 || seqlen % chunks != 0)
            throw Error(ErrorCode::invalid_argument, "--ring",
                        fmt::format("seqlen {} does not split into the {} layout's {} chunks", seqlen, o.ring_layout, chunks));
          auto set = std::make_unique<RankSet>();
          set->world = world;
          set->local = std::make_unique<ring::LocalRing>(world);
          const int rows = seqlen / world;
          const int tensors_per_rank = o.backward ? 8 : 4;  // q, k, v, out (dout, dq, dk, dv), then the LSE
          for (int r = 0; r < world; ++r) {
            for (int t = 0; t < tensors_per_rank; ++t) {
              set->memory.push_back(std::make_unique<detail::DeviceMemory>(n / world * 2));
              fill(*set->memory.back(), n / world * 2);
            }
            set->memory.push_back(std::make_unique<detail::DeviceMemory>(size_t(heads) * rows * 4));
            CUstream s = nullptr;
            FLASHJIT_CU(cuStreamCreate, &s, CU_STREAM_NON_BLOCKING);
            set->streams.push_back(s);
            CUevent e = nullptr;
            FLASHJIT_CU(cuEventCreate, &e, CU_EVENT_DISABLE_TIMING);
            set->done.push_back(e);
          }
          for (bool checked : {false, true})
            calls.push_back([&, set = set.get(), rows, checked, tensors_per_rank] {
              FLASHJIT_CU(cuEventRecord, ring_start, nullptr);
              set->local->run([&](int r, ring::Transport& transport) {
                const int per_rank = tensors_per_rank + 1;
                auto m = [&](int t) -> const detail::DeviceMemory& { return *set->memory[per_rank * r + t]; };
                FLASHJIT_CU(cuStreamWaitEvent, set->streams[r], ring_start, 0);
                const TensorView rank_lse = TensorView::contiguous(m(tensors_per_rank).get(), ScalarType::float32, {1, heads, rows}, o.device);
                ring::Options options;
                options.layout = layout;
                options.causal = causal;
                options.check_shapes = checked;
                options.stream = set->streams[r];
                ring::forward(runtime, transport, view(m(0), rows), view(m(1), rows), view(m(2), rows), view(m(3), rows),
                              &rank_lse, options);
                if (o.backward)
                  ring::backward(runtime, transport, view(m(0), rows), view(m(1), rows), view(m(2), rows), view(m(3), rows),
                                 view(m(4), rows), rank_lse, view(m(5), rows), view(m(6), rows), view(m(7), rows), options);
                FLASHJIT_CU(cuEventRecord, set->done[r], set->streams[r]);
              });
              for (CUevent e : set->done) FLASHJIT_CU(cuStreamWaitEvent, nullptr, e, 0);
            });
          sets.push_back(std::move(set));
        }
        const std::vector<double> ms = median_ms(calls, o.warmup, o.iters, start, stop);
        const double flops = 4.0 * heads * double(seqlen) * seqlen * d / (causal ? 2 : 1) * (o.backward ? 3.5 : 1.0);
        json row{{"head_dim", d}, {"seqlen", seqlen}, {"heads", heads}, {"causal", causal}, {"single_ms", ms[0]},
                 {"single_tflops", flops / (ms[0] * 1e-3) / 1e12}, {"ring", json::array()}};
        if (!o.backward) {  // (the continuing calls are forwards: against the forward alone)
          row["continued_first_over_single"] = ms[1] / ms[0];
          row["continued_middle_over_single"] = ms[2] / ms[0];
        }
        if (!o.json_output) {
          fmt::print("d{:<4} s{:<6} h{:<3} {:<7} one call {:9.1f} us {:6.1f} TFLOP/s", d, seqlen, heads,
                     causal ? "causal" : "full", ms[0] * 1e3, flops / (ms[0] * 1e-3) / 1e12);
          if (!o.backward) fmt::print(", continuing {:.3f}x (state read {:.3f}x)", ms[1] / ms[0], ms[2] / ms[0]);
        }
        for (size_t i = 0; i < sets.size(); ++i) {
          const double ring_ms = ms[3 + 2 * i], checked_ms = ms[4 + 2 * i];
          row["ring"].push_back({{"world", sets[i]->world}, {"ms", ring_ms}, {"over_single", ring_ms / ms[0]},
                                 {"checked_ms", checked_ms}, {"checked_over_single", checked_ms / ms[0]}});
          if (!o.json_output)
            fmt::print("  N={} {:.3f}x ({:.3f}x checked)", sets[i]->world, ring_ms / ms[0], checked_ms / ms[0]);
          for (CUstream s : sets[i]->streams) detail::driver().cuStreamDestroy(s);
          for (CUevent e : sets[i]->done) detail::driver().cuEventDestroy(e);
        }
        if (!o.json_output) {
          fmt::print("\n");
          std::fflush(stdout);
        }
        rows.push_back(row);
      }
  for (CUevent e : {start, stop, ring_start}) detail::driver().cuEventDestroy(e);
  if (o.json_output)
    fmt::print("{}\n", json{{"device", device.name}, {"mode", o.backward ? "ring fwd+bwd" : "ring"}, {"dtype", o.dtype}, {"layout", o.layout},
                            {"ring_layout", o.ring_layout}, {"hidden", o.hidden}, {"rows", rows}}.dump(2));
  return cli::kExitOk;
}

// --host-cost: the host's time per call of the C++ API on problems whose GPU work is shorter than
// it (a forward and a backward of 1 x 128 tokens x 8 heads, causal, and a decode step of 16
// sequences of 1000 cached tokens, 32/8 heads): median over bursts of 100 queued calls, each burst
// started on an idle stream, so the loop measures the host (the kernels are cached and loaded).
int run_host_cost(const Options& o) {
  const DType dtype = parse_dtype(o.dtype);
  const ScalarType scalar = detail::input_scalar_type(dtype);
  const int d = o.head_dims.front();
  const DeviceProperties& device = device_properties(o.device);
  detail::make_context_current(o.device);
  Runtime& runtime = Runtime::global();
  CUstream stream;
  FLASHJIT_CU(cuStreamCreate, &stream, CU_STREAM_NON_BLOCKING);
  const std::vector<uint16_t> random = detail::random_half_bits(size_t(1) << 20, dtype, 11);
  std::vector<std::unique_ptr<detail::DeviceMemory>> memory;
  auto tensor = [&](std::initializer_list<int64_t> shape, ScalarType type) {
    int64_t n = 1;
    for (int64_t e : shape) n *= e;
    const size_t bytes = size_t(n) * (type == ScalarType::float32 || type == ScalarType::int32 ? 4 : 2);
    memory.push_back(std::make_unique<detail::DeviceMemory>(bytes));
    for (size_t at = 0; at < bytes; at += random.size() * 2)
      FLASHJIT_CU(cuMemcpyHtoD, memory.back()->address() + at, random.data(), std::min(random.size() * 2, bytes - at));
    return TensorView::contiguous(reinterpret_cast<void*>(memory.back()->address()), type, shape, o.device);
  };
  const int b = 1, s = 128, h = 8;
  const TensorView q = tensor({b, s, h, d}, scalar), k = tensor({b, s, h, d}, scalar), v = tensor({b, s, h, d}, scalar);
  const TensorView out = tensor({b, s, h, d}, scalar), dout = tensor({b, s, h, d}, scalar);
  const TensorView dq = tensor({b, s, h, d}, scalar), dk = tensor({b, s, h, d}, scalar), dv = tensor({b, s, h, d}, scalar);
  const TensorView lse = tensor({b, h, s}, ScalarType::float32);
  AttentionOptions options;
  options.causal = true;
  options.stream = stream;
  const int decode_batch = 16, capacity = 1024;
  const TensorView decode_q = tensor({decode_batch, 1, 32, d}, scalar), decode_out = tensor({decode_batch, 1, 32, d}, scalar);
  const TensorView k_cache = tensor({decode_batch, capacity, 8, d}, scalar), v_cache = tensor({decode_batch, capacity, 8, d}, scalar);
  const TensorView lengths = tensor({decode_batch}, ScalarType::int32);
  const std::vector<int> cached(decode_batch, 1000);
  FLASHJIT_CU(cuMemcpyHtoD, reinterpret_cast<CUdeviceptr>(lengths.data), cached.data(), cached.size() * 4);
  const KvCache cache{k_cache, v_cache, nullptr, &lengths, nullptr, nullptr};
  AttentionOptions decode_options;
  decode_options.stream = stream;
  const std::pair<const char*, std::function<void()>> rows[] = {
      {"forward", [&] { runtime.forward(q, k, v, out, &lse, options); }},
      {"backward", [&] { runtime.backward(q, k, v, out, dout, &lse, dq, dk, dv, options); }},
      {"decode", [&] { runtime.forward_kvcache(decode_q, cache, decode_out, nullptr, decode_options); }},
  };
  json result = json::array();
  if (!o.json_output) fmt::print("{} --host-cost on {}: C++ API, head dim {}, {}\n", kTool, device.name, d, o.dtype);
  for (const auto& [name, call] : rows) {
    for (int i = 0; i < 50; ++i) call();  // compiles or loads the kernels, warms the caches
    FLASHJIT_CU(cuStreamSynchronize, stream);
    std::vector<double> per_call;
    for (int burst = 0; burst < 30; ++burst) {
      const auto begin = std::chrono::steady_clock::now();
      for (int i = 0; i < 100; ++i) call();
      per_call.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - begin).count() / 100);
      FLASHJIT_CU(cuStreamSynchronize, stream);
    }
    std::sort(per_call.begin(), per_call.end());
    const double median = per_call[per_call.size() / 2];
    result.push_back({{"call", name}, {"host_us", median}});
    if (!o.json_output) fmt::print("  {:<10} {:6.2f} us per call (host)\n", name, median);
  }
  FLASHJIT_CU(cuStreamDestroy, stream);
  if (o.json_output) fmt::print("{}\n", json{{"device", device.name}, {"head_dim", d}, {"rows", result}}.dump(2));
  return cli::kExitOk;
}

int run(const Options& o) {
  const DType dtype = parse_dtype(o.dtype);
  const bool fp8 = dtype == DType::e4m3;
  if (fp8 && (o.host_cost || o.decode || !o.ring_sizes.empty() || o.backward))
    throw Error(ErrorCode::invalid_argument, "--dtype",
                "e4m3 (FP8) times the forward rows only: no --backward, --decode, --ring or --host-cost");
  if (o.v_pretransposed && !fp8)
    throw Error(ErrorCode::invalid_argument, "--v-pretransposed", "V transposed beforehand is an FP8 mode: add --dtype e4m3");
  if (o.host_cost) return run_host_cost(o);
  if (o.decode) return run_decode(o);
  if (!o.ring_sizes.empty()) return run_ring(o);
  // FP8: e4m3 q, k and v (no descales: 1), a bf16 out.
  const ScalarType scalar = detail::input_scalar_type(dtype), out_scalar = detail::output_scalar_type(dtype);
  const size_t input_bytes = fp8 ? 1 : 2;
  Backend backend = Backend::automatic;
  if (o.backend == "reference") backend = Backend::reference;
  else if (o.backend == "fa2") backend = Backend::fa2;
  else if (o.backend == "sm90") backend = Backend::sm90;
  else if (o.backend != "auto")
    throw Error(ErrorCode::invalid_argument, "--backend",
                fmt::format("unknown backend '{}' (auto, reference, fa2, sm90)", o.backend));
  if (o.layout != "bshd" && o.layout != "bhsd")
    throw Error(ErrorCode::invalid_argument, "--layout", fmt::format("'{}' is not bshd or bhsd", o.layout));
  if (o.check && o.backward)
    throw Error(ErrorCode::invalid_argument, "--check",
                "checks forward rows against the reference kernel; the backward is checked by the GPU tests");
  // Every argument is checked before the driver is loaded: the rows, and the tuning database.
  std::vector<std::tuple<int, int, bool>> grid;  // (head dim, seqlen, causal)
  for (int d : o.head_dims)
    for (int s : o.seqlens)
      for (const auto& c : o.causal) {
        if (c != "on" && c != "off")
          throw Error(ErrorCode::invalid_argument, "--causal", fmt::format("'{}' is not on or off", c));
        if (s < 1 || d < 1 || o.tokens % s != 0 || o.hidden % d != 0)
          throw Error(ErrorCode::invalid_argument, "--seqlens",
                      fmt::format("seqlen {} must divide --tokens {} and head dim {} --hidden {}", s, o.tokens, d, o.hidden));
        grid.emplace_back(d, s, c == "on");
      }
  std::optional<TuningDb> tuning_db;
  if (!o.tuning_db.empty()) {
    try {
      tuning_db = TuningDb::load(o.tuning_db);
    } catch (const Error& e) {
      throw Error(ErrorCode::invalid_argument, "--tuning-db", e.message());
    }
  }
  const DeviceProperties& device = device_properties(o.device);
  detail::make_context_current(o.device);
  const double peak = o.peak_tflops > 0 ? o.peak_tflops : measured_peak_tflops(device.name);
  Runtime& runtime = Runtime::global();
  if (tuning_db) runtime.tuning().set_user_db(std::move(*tuning_db), o.tuning_db);

  std::vector<Row> rows;
  for (const auto& [d, s, causal] : grid) rows.push_back(Row{d, s, o.tokens / s, o.hidden / d, causal});

  if (!o.json_output)
    fmt::print("{} on {} (sm_{}{}, {} SMs), {} tokens x {} hidden, {}\n", kTool, device.name, device.cc_major,
               device.cc_minor, device.sm_count, o.tokens, o.hidden, o.dtype);
  bool all_passed = true;
  CUevent start, stop;
  FLASHJIT_CU(cuEventCreate, &start, CU_EVENT_DEFAULT);
  FLASHJIT_CU(cuEventCreate, &stop, CU_EVENT_DEFAULT);
  // Every row's tensors hold tokens x hidden elements, so one random set (q, k, v, and dout for
  // the backward) serves them all: drawing it per row took longer than timing the row.
  const size_t n = size_t(o.tokens) * o.hidden;
  std::vector<std::vector<uint8_t>> inputs;  // each n elements' bytes
  for (int seed = 1; seed <= (o.backward ? 4 : 3); ++seed) {
    if (fp8) {
      inputs.push_back(detail::random_e4m3_bits(n, seed * 1000));
      continue;
    }
    const std::vector<uint16_t> bits = detail::random_half_bits(n, dtype, seed * 1000);
    inputs.emplace_back(n * 2);
    std::memcpy(inputs.back().data(), bits.data(), n * 2);
  }
  for (Row& r : rows) {
    // One q/k/v set is 3 x 64 MB at 16k tokens x 2048 (bf16): every call streams past the 60 MB L2.
    detail::DeviceMemory q(n * input_bytes), k(n * input_bytes), v(n * input_bytes), out(n * 2),
        lse(size_t(r.batch) * r.heads * r.seqlen * 4);
    std::optional<detail::DeviceMemory> dout, dq, dk, dv;  // --backward
    if (o.backward) {
      dout.emplace(n * 2), dq.emplace(n * 2), dk.emplace(n * 2), dv.emplace(n * 2);
      FLASHJIT_CU(cuMemcpyHtoD, reinterpret_cast<CUdeviceptr>(dout->get()), inputs[3].data(), n * 2);
    }
    for (auto [mem, input] : {std::pair{&q, 0}, {&k, 1}, {&v, 2}})
      FLASHJIT_CU(cuMemcpyHtoD, reinterpret_cast<CUdeviceptr>(mem->get()), inputs[input].data(), n * input_bytes);
    // (batch, seqlen, heads, head_dim) views over memory in --layout's order: the inputs', or out's
    // (FP8: bf16) as `type`.
    auto view = [&](const detail::DeviceMemory& m, ScalarType type) {
      return o.layout == "bhsd"
                 ? TensorView::head_major(m.get(), type, r.batch, r.seqlen, r.heads, r.head_dim, o.device)
                 : TensorView::contiguous(m.get(), type, {r.batch, r.seqlen, r.heads, r.head_dim}, o.device);
    };
    auto view_of = [&](const detail::DeviceMemory& m) { return view(m, scalar); };  // q's type
    const TensorView out_view = view(out, out_scalar);
    auto lse_view = TensorView::contiguous(lse.get(), ScalarType::float32, {r.batch, r.heads, r.seqlen}, o.device);
    AttentionOptions options;
    options.causal = r.causal;
    options.backend = backend;
    options.deterministic = o.deterministic;
    options.num_splits = o.num_splits;
    auto call_with = [&](const AttentionOptions& opts) {
      if (o.backward)
        runtime.backward(view_of(q), view_of(k), view_of(v), out_view, view_of(*dout), &lse_view, view_of(*dq), view_of(*dk),
                         view_of(*dv), opts);
      else
        runtime.forward(view_of(q), view_of(k), view_of(v), out_view, &lse_view, opts);
    };
    auto call = [&] { call_with(options); };
    if (o.backward) {  // the backward reads the forward's out and lse
      AttentionOptions forward_options = options;
      runtime.forward(view_of(q), view_of(k), view_of(v), out_view, &lse_view, forward_options);
    }
    if (o.sweep) {
      // Every legal candidate that compiles without spills, timed; the fastest is kept in options.
      const detail::ForwardProblem forward =
          detail::make_forward_problem(view_of(q), view_of(k), view_of(v), out_view, &lse_view, nullptr, options);
      detail::BackwardProblem backward;  // (the mode is what the candidates depend on)
      backward.forward = forward;
      backward.deterministic = o.deterministic;
      const detail::PassProblem planned{o.backward ? detail::Pass::backward : detail::Pass::forward, forward,
                                        o.backward ? &backward : nullptr};
      const auto candidates = detail::tuning_plan(planned, device.arch()).candidates;
      std::vector<std::thread> compilers;
      std::atomic<size_t> next{0};
      for (unsigned t = 0; t < std::max(2u, std::thread::hardware_concurrency()); ++t)
        compilers.emplace_back([&] {
          for (size_t i; (i = next++) < candidates.size();) {
            try {
              runtime.kernel_cache().get(candidates[i]);
            } catch (const std::exception&) {  // timed below, where the failure is reported
            }
          }
        });
      for (auto& t : compilers) t.join();
      double best = 1e30;
      std::optional<KernelSpec> winner;
      for (const auto& spec : candidates) {
        if (runtime.kernel_cache().get(spec)->has_spills()) continue;
        options.kernel = spec;
        const double ms = median_ms({call}, 1, std::max(3, o.iters / 2), start, stop)[0];
        r.sweep.emplace_back(spec.name(), ms);
        if (ms < best) {
          best = ms;
          winner = spec;
        }
      }
      options.kernel = winner;
    }
    const detail::ForwardProblem problem =
        detail::make_forward_problem(view_of(q), view_of(k), view_of(v), out_view, &lse_view, nullptr, options);
    // The spec dispatch runs for this row, with `tuning` (null: the heuristic's).
    auto dispatched = [&](const TuningSources* tuning) {
      if (!o.backward) return detail::select_forward_kernel(problem, device, tuning);
      const detail::BackwardProblem backward = detail::make_backward_problem(
          view_of(q), view_of(k), view_of(v), out_view, view_of(*dout), &lse_view, view_of(*dq), view_of(*dk), view_of(*dv), nullptr, options);
      return detail::select_backward_kernel(backward, device, tuning);
    };
    // FP8 with V transposed beforehand: the row's spec (the sweep's winner, or dispatch's) in that mode;
    // beside --versus-heuristic, the heuristic's spec without it, in the same rounds.
    if (o.v_pretransposed) {
      KernelSpec spec = options.kernel ? *options.kernel : dispatched(&runtime.tuning());
      spec.v_pretransposed = true;
      options.kernel = spec;
    }
    const double flops = 4.0 * r.batch * r.heads * double(r.seqlen) * r.seqlen * r.head_dim /
                         (r.causal ? 2 : 1) * (o.backward ? 2.5 : 1.0);
    if (o.versus_heuristic) {
      AttentionOptions heuristic = options;
      heuristic.kernel = dispatched(nullptr);
      r.heuristic_spec = heuristic.kernel->name();
      const auto medians = median_ms({call, [&] { call_with(heuristic); }}, o.warmup, o.iters, start, stop);
      r.median_ms = medians[0];
      r.heuristic_ms = medians[1];
      r.heuristic_tflops = flops / (r.heuristic_ms * 1e-3) / 1e12;
    } else {
      r.median_ms = median_ms({call}, o.warmup, o.iters, start, stop)[0];
    }
    r.spec = options.kernel ? options.kernel->name() : dispatched(&runtime.tuning()).name();
    r.tflops = flops / (r.median_ms * 1e-3) / 1e12;

    if (o.check && !o.backward) {
      // The reference kernel (fp32 math) on the same values: FP8's inputs widened to bf16, which
      // holds every e4m3 value exactly.
      const DType out_dtype = fp8 ? DType::bf16 : dtype;
      const detail::DeviceMemory* reference_inputs[3] = {&q, &k, &v};
      std::vector<std::unique_ptr<detail::DeviceMemory>> widened;
      if (fp8)
        for (int i = 0; i < 3; ++i) {
          const std::vector<uint16_t> bits = detail::e4m3_as_bf16_bits(inputs[i]);
          widened.push_back(std::make_unique<detail::DeviceMemory>(n * 2));
          FLASHJIT_CU(cuMemcpyHtoD, reinterpret_cast<CUdeviceptr>(widened.back()->get()), bits.data(), n * 2);
          reference_inputs[i] = widened.back().get();
        }
      detail::DeviceMemory expected(n * 2);
      AttentionOptions reference = options;
      reference.backend = Backend::reference;
      reference.kernel.reset();
      auto reference_in = [&](int i) { return view(*reference_inputs[i], out_scalar); };
      runtime.forward(reference_in(0), reference_in(1), reference_in(2), view(expected, out_scalar), nullptr, reference);
      std::vector<uint16_t> got(n), want(n);
      FLASHJIT_CU(cuMemcpyDtoH, got.data(), reinterpret_cast<CUdeviceptr>(out.get()), n * 2);
      FLASHJIT_CU(cuMemcpyDtoH, want.data(), reinterpret_cast<CUdeviceptr>(expected.get()), n * 2);
      double err2 = 0, ref2 = 0, max_abs = 0;
      for (size_t i = 0; i < n; ++i) {
        const double g = detail::from_half_bits(got[i], out_dtype), w = detail::from_half_bits(want[i], out_dtype);
        const double e = std::fabs(g - w);
        if (!(e <= 1e30)) max_abs = INFINITY;  // NaN
        else max_abs = std::max(max_abs, e);
        err2 += e * e;
        ref2 += w * w;
      }
      r.max_abs_err = max_abs;
      r.rel_l2_err = std::sqrt(err2 / std::max(ref2, 1e-30));
      // Against the fp32 reference kernel: a 16-bit output differs by rounding, ~1e-3 relative; FP8
      // also rounds P to e4m3 for P V, a percent or two (a wrong V transpose or key order: ~1).
      r.passed = std::isfinite(max_abs) && r.rel_l2_err < (fp8 ? 5e-2 : 1e-2);
      all_passed = all_passed && r.passed;
    }
    if (!o.json_output) {
      fmt::print("d{:<4} s{:<6} b{:<3} h{:<3} {:<7} {:10.1f} us {:8.1f} TFLOP/s", r.head_dim, r.seqlen, r.batch,
                 r.heads, r.causal ? "causal" : "full", r.median_ms * 1e3, r.tflops);
      if (peak > 0) fmt::print(" {:5.1f}% of peak", 100 * r.tflops / peak);
      if (o.check) fmt::print("  rel err {:.2e} {}", r.rel_l2_err, r.passed ? "ok" : "FAILED");
      if (o.versus_heuristic)
        fmt::print("  heuristic {:8.1f} TFLOP/s ({:+.1f}%) {}", r.heuristic_tflops,
                   100 * (r.heuristic_ms / r.median_ms - 1), r.heuristic_spec);
      fmt::print("  {}\n", r.spec);
      std::fflush(stdout);
    }
  }
  detail::driver().cuEventDestroy(start);
  detail::driver().cuEventDestroy(stop);
  if (o.json_output) {
    json j{{"device", device.name}, {"peak_tflops", peak}, {"mode", o.backward ? (o.deterministic ? "bwd_deterministic" : "bwd") : "fwd"}, {"dtype", o.dtype}, {"layout", o.layout}, {"num_splits", o.num_splits}, {"tokens", o.tokens}, {"hidden", o.hidden}, {"rows", json::array()}};
    for (const Row& r : rows) {
      j["rows"].push_back({{"head_dim", r.head_dim}, {"seqlen", r.seqlen}, {"batch", r.batch}, {"heads", r.heads},
                           {"causal", r.causal}, {"median_ms", r.median_ms}, {"median_us", r.median_ms * 1e3},
                           {"tflops", r.tflops}, {"percent_of_peak", peak > 0 ? 100 * r.tflops / peak : 0.0},
                           {"rel_l2_err", r.rel_l2_err}, {"passed", r.passed}, {"spec", r.spec},
                           {"sweep", r.sweep}});
      if (o.versus_heuristic) {
        auto& row = j["rows"].back();
        row["heuristic_ms"] = r.heuristic_ms;
        row["heuristic_tflops"] = r.heuristic_tflops;
        row["heuristic_spec"] = r.heuristic_spec;
      }
    }
    fmt::print("{}\n", j.dump(2));
  }
  return all_passed ? cli::kExitOk : cli::kExitFailed;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  CLI::App app{"Time flashjit's forward (or backward) attention on the standard grid", kTool};
  app.footer(
      "Rows: for each head dim D and seqlen S, batch = tokens / S and heads = hidden / D.\n"
      "FLOPs: 4 * B * H * S * S * D, halved when causal; the backward counts 2.5x that.\n"
      "Examples:\n"
      "  flashjit-bench --head-dims 128 --seqlens 1024,8192\n"
      "  flashjit-bench --check --json > rows.json\n"
      "  flashjit-bench --backward --sweep --head-dims 128 --seqlens 4096\n"
      "  flashjit-bench --tuning-db tuning.json --json > tuned.json      rows with flashjit-tune's choices\n"
      "  flashjit-bench --tuning-db tuning.json --versus-heuristic        tuned beside the heuristic, interleaved\n"
      "\nExit status: 0 ok, 1 a checked row disagreed with the reference, 2 bad arguments.");
  app.add_option("--head-dims", o.head_dims, "Head dims")->delimiter(',');
  app.add_option("--seqlens", o.seqlens, "Sequence lengths")->delimiter(',');
  app.add_option("--causal", o.causal, "off, on, or both (off,on)")->delimiter(',');
  app.add_option("--tokens", o.tokens, "batch x seqlen per row");
  app.add_option("--hidden", o.hidden, "heads x head_dim per row");
  app.add_option("--dtype", o.dtype, "bf16, fp16, or e4m3 (FP8 forward rows: e4m3 q, k, v and a bf16 out)");
  app.add_option("--backend", o.backend, "auto, reference, fa2 or sm90");
  app.add_option("--layout", o.layout, "bshd (sequence-major, the default) or bhsd (head-major, SDPA's order)");
  app.add_option("--warmup", o.warmup, "Untimed calls first");
  app.add_option("--iters", o.iters, "Timed calls (median reported)");
  app.add_option("--device", o.device, "CUDA device ordinal");
  app.add_option("--num-splits", o.num_splits,
                 "Hopper forward: tail splits of the last round of work tiles (0: chosen, 1: none, n: n each)");
  app.add_option("--tuning-db", o.tuning_db, "Dispatch from this tuning database (flashjit-tune) instead of FLASHJIT_TUNING_DB");
  app.add_option("--peak-tflops", o.peak_tflops, "The device's dense bf16 rate for the % of peak column (default: measured H200 764)");
  app.add_flag("--check", o.check, "Compare each row with the reference kernel");
  app.add_flag("--sweep", o.sweep, "Time every spill-free candidate of the row's family per row and keep the fastest");
  app.add_flag("--v-pretransposed", o.v_pretransposed,
               "FP8 rows: the spec with V transposed before the forward (a pass writes V^T; TMA loads it)");
  app.add_flag("--backward", o.backward, "Time the backward pass (dq, dk, dv) instead of the forward");
  app.add_flag("--deterministic", o.deterministic, "With --backward: the bitwise-reproducible dQ path");
  app.add_flag("--versus-heuristic", o.versus_heuristic,
               "Also time the heuristic's spec per row, interleaved with dispatch's (tuned) choice");
  app.add_flag("--decode", o.decode, "Decode rows (forward_kvcache): --batches x --seqlens cached tokens, first --head-dims");
  app.add_option("--batches", o.batches, "--decode: batch sizes")->delimiter(',');
  app.add_option("--heads-q", o.heads_q, "--decode: query heads");
  app.add_option("--heads-kv", o.heads_kv, "--decode: KV heads");
  app.add_option("--seqlen-q", o.seqlen_q, "--decode: query tokens per sequence");
  app.add_option("--page-size", o.page_size, "--decode: tokens per page of a paged cache (0: contiguous)");
  app.add_option("--ring", o.ring_sizes, "Ring attention over these numbers of virtual ranks on one GPU, beside one call (batch 1)")
      ->delimiter(',');
  app.add_option("--ring-layout", o.ring_layout, "--ring: zigzag (the default) or contiguous");
  app.add_flag("--host-cost", o.host_cost,
               "Host time per C++ API call (forward, backward, decode step) on problems the host outpaces");
  app.add_flag("--json", o.json_output, "Print JSON");
  return cli::run_tool(kTool, app, argc, argv, [&] { return run(o); });
}
