// The tuner: compile every candidate on a thread pool while the GPU times the ones already
// compiled, verify the fastest, re-time the finalists interleaved, and record the winner.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <ctime>
#include <deque>
#include <mutex>
#include <random>
#include <thread>

#include <fmt/format.h>

#include "dispatch.hpp"
#include "family.hpp"
#include "driver.hpp"
#include "flashjit/codegen/render.hpp"
#include "flashjit/flashjit.hpp"
#include "flashjit/tuning.hpp"
#include "host_tensors.hpp"
#include "module_cache.hpp"
#include "problem.hpp"
#include "tuner.hpp"

namespace flashjit {

using namespace detail;

std::string TuneShape::describe() const {
  return fmt::format("{} {} b{} sq{} sk{} hq{} hkv{} d{}{}{}", kvcache ? "kvcache" : backward ? "bwd" : "fwd",
                     to_string(dtype), batch,
                     seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, causal ? " causal" : "", head_major ? " bhsd" : "");
}

namespace {

// How much faster than the heuristic's spec (interleaved medians) a candidate must be to win.
constexpr double kWinMargin = 0.01;
// Back-to-back calls before timing, long enough for the clock to settle under the power limit.
constexpr int kHeatMs = 300;

// One set of inputs and outputs. Several sets are rotated through so that consecutive timed calls
// never find their inputs in the L2.
struct ProblemBuffers {
  DeviceMemory q, k, v, out, lse, dout, dq, dk, dv;
  // (FP8: one-byte q, k and v, a bf16 out of out_bytes.)
  ProblemBuffers(size_t q_bytes, size_t kv_bytes, size_t out_bytes, size_t lse_bytes, bool backward)
      : q(q_bytes), k(kv_bytes), v(kv_bytes), out(out_bytes), lse(lse_bytes), dout(backward ? q_bytes : 0),
        dq(backward ? q_bytes : 0), dk(backward ? kv_bytes : 0), dv(backward ? kv_bytes : 0) {}
};

double relative_l2(const std::vector<uint16_t>& got, const std::vector<uint16_t>& want, DType dtype) {
  double err = 0, ref = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double g = from_half_bits(got[i], dtype), w = from_half_bits(want[i], dtype);
    if (!std::isfinite(g)) return INFINITY;
    err += (g - w) * (g - w);
    ref += w * w;
  }
  return std::sqrt(err / std::max(ref, 1e-30));
}

std::string utc_now() {
  const std::time_t now = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&now, &tm);
  char text[32];
  std::strftime(text, sizeof text, "%Y-%m-%dT%H:%M:%SZ", &tm);
  return text;
}

}  // namespace

TuneResult tune(Runtime& runtime, const TuneShape& shape, const TuneOptions& o) {
  const auto started = std::chrono::steady_clock::now();
  const DeviceProperties& device = device_properties(o.device);
  make_context_current(o.device);
  const DType dtype = shape.dtype;
  const bool fp8 = dtype == DType::e4m3;  // e4m3 q, k and v (no descales: 1), a bf16 out; forward only
  if (fp8 && (shape.backward || shape.kvcache))
    throw Error(ErrorCode::invalid_argument, "tune", "e4m3 (FP8) runs forward only: no backward or KV-cache pass to tune");
  const ScalarType scalar = input_scalar_type(dtype), out_scalar = output_scalar_type(dtype);
  const DType out_dtype = fp8 ? DType::bf16 : dtype;
  const size_t element_bytes = fp8 ? 1 : 2;
  auto report = [&](const char* stage, size_t done, size_t total) {
    if (o.progress) o.progress(TuneProgress{stage, done, total});
  };

  // Buffers, and the problem as the dispatcher sees it (which also validates the shape).
  const size_t q_elems = size_t(shape.batch) * shape.seqlen_q * shape.heads_q * shape.head_dim;
  const size_t kv_elems = size_t(shape.batch) * shape.seqlen_k * shape.heads_kv * shape.head_dim;
  const size_t lse_bytes = size_t(shape.batch) * shape.heads_q * shape.seqlen_q * 4;
  // q, k, v and out (and the backward's dout, dq, dk, dv alike) and the LSE.
  const size_t set_bytes = ((q_elems + kv_elems * 2) * element_bytes + q_elems * 2) * (shape.backward ? 2 : 1) + lse_bytes;
  const size_t sets = std::clamp<size_t>(3 * size_t(device.l2_bytes) / std::max<size_t>(set_bytes, 1) + 1, 1, 8);
  std::vector<std::unique_ptr<ProblemBuffers>> buffers;
  // FP8's inputs, for the check: the reference kernel reads them widened to bf16 (which holds every
  // e4m3 value exactly).
  std::vector<std::vector<uint16_t>> widened_inputs;
  {
    std::mt19937_64 rng(12345);
    std::normal_distribution<float> normal(0.f, 1.f);
    auto random_bits = [&](size_t n) {  // n elements' storage bytes
      std::vector<uint8_t> bytes(n * element_bytes);
      for (size_t i = 0; i < n; ++i) {
        if (fp8) {
          bytes[i] = to_e4m3_bits(normal(rng));
        } else {
          const uint16_t bits = to_half_bits(normal(rng), dtype);
          std::memcpy(&bytes[2 * i], &bits, 2);
        }
      }
      return bytes;
    };
    const auto q_bits = random_bits(q_elems), k_bits = random_bits(kv_elems), v_bits = random_bits(kv_elems);
    const auto dout_bits = shape.backward ? random_bits(q_elems) : std::vector<uint8_t>{};
    if (fp8)
      for (const auto* input : {&q_bits, &k_bits, &v_bits}) widened_inputs.push_back(e4m3_as_bf16_bits(*input));
    for (size_t i = 0; i < sets; ++i) {
      auto b = std::make_unique<ProblemBuffers>(q_elems * element_bytes, kv_elems * element_bytes, q_elems * 2,
                                                lse_bytes, shape.backward);
      auto upload = [](const DeviceMemory& m, const std::vector<uint8_t>& bytes) {
        FLASHJIT_CU(cuMemcpyHtoD, reinterpret_cast<CUdeviceptr>(m.get()), bytes.data(), bytes.size());
      };
      upload(b->q, q_bits);
      upload(b->k, k_bits);
      upload(b->v, v_bits);
      if (shape.backward) upload(b->dout, dout_bits);
      buffers.push_back(std::move(b));
    }
  }
  // (batch, seqlen, heads, head_dim) views over memory in the shape's layout: the inputs' type, or
  // out's (`type`).
  auto view = [&](const DeviceMemory& m, int seqlen, int heads, ScalarType type) {
    return shape.head_major
               ? TensorView::head_major(m.get(), type, shape.batch, seqlen, heads, shape.head_dim, o.device)
               : TensorView::contiguous(m.get(), type, {shape.batch, seqlen, heads, shape.head_dim}, o.device);
  };
  auto q_view = [&](const DeviceMemory& m) { return view(m, shape.seqlen_q, shape.heads_q, scalar); };
  auto kv_view = [&](const DeviceMemory& m) { return view(m, shape.seqlen_k, shape.heads_kv, scalar); };
  auto out_view = [&](const DeviceMemory& m) { return view(m, shape.seqlen_q, shape.heads_q, out_scalar); };
  auto lse_view = [&](const DeviceMemory& m) {
    return TensorView::contiguous(m.get(), ScalarType::float32, {shape.batch, shape.heads_q, shape.seqlen_q}, o.device);
  };
  AttentionOptions base;
  base.causal = shape.causal;
  const ProblemBuffers& first = *buffers[0];
  const TensorView first_lse = lse_view(first.lse);
  const ForwardProblem forward = make_forward_problem(q_view(first.q), kv_view(first.k), kv_view(first.v),
                                                      out_view(first.out), nullptr, nullptr, base);
  if (shape.kvcache && shape.backward)
    throw Error(ErrorCode::invalid_argument, "tune", "a shape tunes the backward or the KV-cache pass, not both");
  std::optional<BackwardProblem> backward;
  std::optional<KvCacheProblem> kvcache;
  // The KV-cache pass attends over the whole contiguous cache (no cache_seqlens, nothing appended).
  auto cache_of = [&](const ProblemBuffers& b) { return KvCache{kv_view(b.k), kv_view(b.v)}; };
  if (shape.kvcache) kvcache = make_kvcache_problem(q_view(first.q), cache_of(first), out_view(first.out), &first_lse, base);
  if (shape.backward)
    backward = make_backward_problem(q_view(first.q), kv_view(first.k), kv_view(first.v), out_view(first.out),
                                     q_view(first.dout), &first_lse, q_view(first.dq), kv_view(first.dk),
                                     kv_view(first.dv), nullptr, base);
  const PassProblem problem = backward  ? PassProblem{Pass::backward, backward->forward, &*backward}
                              : kvcache ? PassProblem{Pass::kvcache, kvcache->forward, nullptr, &*kvcache}
                                        : PassProblem{Pass::forward, forward};
  const TuningPlan plan = tuning_plan(problem, device.arch());

  // One call of the pass being tuned, on buffer set `set`.
  auto run = [&](const AttentionOptions& options, size_t set) {
    ProblemBuffers& b = *buffers[set];
    const TensorView lse = lse_view(b.lse);
    if (shape.backward)
      runtime.backward(q_view(b.q), kv_view(b.k), kv_view(b.v), out_view(b.out), q_view(b.dout), &lse, q_view(b.dq),
                       kv_view(b.dk), kv_view(b.dv), options);
    else if (shape.kvcache)
      runtime.forward_kvcache(q_view(b.q), cache_of(b), out_view(b.out), &lse, options);
    else
      runtime.forward(q_view(b.q), kv_view(b.k), kv_view(b.v), out_view(b.out), &lse, options);
  };
  if (shape.backward)  // the backward reads the forward's out and lse
    for (size_t s = 0; s < sets; ++s) {
      ProblemBuffers& b = *buffers[s];
      const TensorView lse = lse_view(b.lse);
      runtime.forward(q_view(b.q), kv_view(b.k), kv_view(b.v), out_view(b.out), &lse, base);
    }

  CUevent start, stop;
  FLASHJIT_CU(cuEventCreate, &start, CU_EVENT_DEFAULT);
  FLASHJIT_CU(cuEventCreate, &stop, CU_EVENT_DEFAULT);
  struct Events {
    CUevent a, b;
    ~Events() {
      driver().cuEventDestroy(a);
      driver().cuEventDestroy(b);
    }
  } events{start, stop};
  size_t rotation = 0;
  int calls_per_sample = 1;  // back-to-back calls per sample, so the host's launch work hides
  auto sample_ms = [&](const AttentionOptions& options) {
    FLASHJIT_CU(cuEventRecord, start, nullptr);
    for (int i = 0; i < calls_per_sample; ++i) run(options, rotation++ % sets);
    FLASHJIT_CU(cuEventRecord, stop, nullptr);
    FLASHJIT_CU(cuEventSynchronize, stop);
    float ms = 0;
    FLASHJIT_CU(cuEventElapsedTime, &ms, start, stop);
    return static_cast<double>(ms) / calls_per_sample;
  };
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  // What dispatch runs with no tuning entry.
  const KernelSpec heuristic = select_kernel(problem, device);
  auto with_kernel = [&](const KernelSpec& spec) {
    AttentionOptions options = base;
    options.kernel = spec;
    return options;
  };

  // Candidates, compiled on a pool; the GPU times each as soon as it is ready.
  std::vector<KernelSpec> candidates = plan.candidates;
  candidates.erase(std::remove_if(candidates.begin(), candidates.end(),
                                  [&](const KernelSpec& s) { return dynamic_smem_bytes(s) > device.max_smem_per_block_optin; }),
                   candidates.end());
  TuneResult result;
  result.candidates = candidates.size();
  std::mutex mutex;
  std::condition_variable ready_cv;
  std::deque<std::pair<size_t, bool>> ready;  // (candidate, compiled and spill-free)
  std::atomic<size_t> next{0};
  std::vector<std::thread> pool;
  const int threads = o.compile_threads > 0 ? o.compile_threads : std::max(1u, std::thread::hardware_concurrency());
  for (int t = 0; t < threads; ++t)
    pool.emplace_back([&] {
      for (size_t i; (i = next++) < candidates.size();) {
        bool usable = false;
        try {
          usable = !runtime.kernel_cache().get(candidates[i])->has_spills();
        } catch (const std::exception&) {  // a failed compile (or out of memory): this candidate is dropped
        }
        std::lock_guard<std::mutex> lock(mutex);
        ready.emplace_back(i, usable);
        ready_cv.notify_one();
      }
    });
  struct Join {
    std::vector<std::thread>& pool;
    ~Join() {
      for (auto& t : pool)
        if (t.joinable()) t.join();
    }
  } join{pool};

  // The GPU at its sustained clock: a cool GPU runs above the clock its power limit holds it to
  // under steady load (on the H200, the forward at 8k ran ~10% faster alone under the profiler than
  // in the benchmark's loop), and the fastest tile at the burst clock is not always the fastest at
  // the steady one, which is where a model runs.
  auto heat = [&](const AttentionOptions& options) {
    const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(kHeatMs);
    while (std::chrono::steady_clock::now() < until) sample_ms(options);
  };
  {  // ~5 ms of back-to-back calls per sample, sized on the heuristic's spec
    const AttentionOptions options = with_kernel(heuristic);
    run(options, rotation++ % sets);
    calls_per_sample = std::clamp(static_cast<int>(5.0 / std::max(sample_ms(options), 1e-3)), 1, 50);
    heat(options);
  }
  std::vector<std::pair<double, size_t>> timed;  // (median ms, candidate)
  for (size_t seen = 0; seen < candidates.size(); ++seen) {
    std::pair<size_t, bool> item;
    {
      std::unique_lock<std::mutex> lock(mutex);
      ready_cv.wait(lock, [&] { return !ready.empty(); });
      item = ready.front();
      ready.pop_front();
    }
    report("time", seen + 1, candidates.size());
    if (!item.second) {
      ++result.dropped_spills;  // spills, or the compile failed
      continue;
    }
    const AttentionOptions options = with_kernel(candidates[item.first]);
    try {
      for (int i = 0; i < std::max(1, o.warmup); ++i) run(options, rotation++ % sets);
      std::vector<double> samples;
      for (int i = 0; i < std::max(3, o.iters); ++i) samples.push_back(sample_ms(options));
      timed.emplace_back(median(samples), item.first);
    } catch (const Error&) {
      ++result.dropped_failed;  // e.g. out of resources on this device
    }
  }
  result.timed = timed.size();
  if (timed.empty())
    throw Error(ErrorCode::unsupported, "tune", fmt::format("no candidate of {} ran on {}", shape.describe(), device.name));
  std::sort(timed.begin(), timed.end());

  // Verify the finalists: the forward and the KV-cache pass against the reference kernel, the
  // backward against the heuristic spec's deterministic path (a different dQ kernel). A finalist
  // that disagrees is dropped.
  auto download = [&](const DeviceMemory& m, size_t elems) {
    std::vector<uint16_t> host(elems);
    FLASHJIT_CU(cuMemcpyDtoH, host.data(), reinterpret_cast<CUdeviceptr>(m.get()), elems * 2);
    return host;
  };
  auto outputs = [&]() {
    ProblemBuffers& b = *buffers[0];
    std::vector<std::vector<uint16_t>> all;
    if (shape.backward) {
      all.push_back(download(b.dq, q_elems));
      all.push_back(download(b.dk, kv_elems));
      all.push_back(download(b.dv, kv_elems));
    } else {
      all.push_back(download(b.out, q_elems));
    }
    return all;
  };
  AttentionOptions check = base;
  if (shape.backward) {
    check.deterministic = true;
    run(check, 0);
  } else if (fp8) {  // the reference kernel on the inputs widened to bf16
    check.backend = Backend::reference;
    std::vector<std::unique_ptr<DeviceMemory>> widened;
    for (const auto& bits : widened_inputs) {
      widened.push_back(std::make_unique<DeviceMemory>(bits.size() * 2));
      FLASHJIT_CU(cuMemcpyHtoD, reinterpret_cast<CUdeviceptr>(widened.back()->get()), bits.data(), bits.size() * 2);
    }
    auto bf16_view = [&](int i, int seqlen, int heads) { return view(*widened[i], seqlen, heads, ScalarType::bfloat16); };
    runtime.forward(bf16_view(0, shape.seqlen_q, shape.heads_q), bf16_view(1, shape.seqlen_k, shape.heads_kv),
                    bf16_view(2, shape.seqlen_k, shape.heads_kv), out_view(buffers[0]->out), nullptr, check);
  } else {  // the KV-cache pass over a whole cache is the dense forward (both bottom-right causal)
    check.backend = Backend::reference;
    ProblemBuffers& b = *buffers[0];
    const TensorView lse = lse_view(b.lse);
    runtime.forward(q_view(b.q), kv_view(b.k), kv_view(b.v), out_view(b.out), &lse, check);
  }
  const auto expected = outputs();
  // (FP8 also rounds P to e4m3 for P V: a percent or two of the output; a wrong tile, ~1.)
  const double tolerance = shape.backward ? 2e-2 : fp8 ? 5e-2 : 1e-2;
  std::vector<std::pair<double, size_t>> finalists;
  for (size_t i = 0; i < timed.size() && finalists.size() < size_t(std::max(1, o.finalists)); ++i) {
    report("verify", i + 1, std::min(timed.size(), size_t(o.finalists)));
    run(with_kernel(candidates[timed[i].second]), 0);
    const auto got = outputs();
    double worst = 0;
    for (size_t t = 0; t < got.size(); ++t) worst = std::max(worst, relative_l2(got[t], expected[t], out_dtype));
    if (worst < tolerance) {
      finalists.push_back(timed[i]);
      result.max_rel_error = std::max(result.max_rel_error, worst);
    }
  }
  if (finalists.empty())
    throw Error(ErrorCode::internal, "tune",
                fmt::format("{}: every fast candidate disagreed with the check; this is a bug", shape.describe()));

  // The heuristic's spec is always re-timed with the finalists: it is what dispatch runs without
  // this entry, and a challenger replaces it only when measurably faster (kWinMargin), so that a
  // tuned entry never trades the default for a noise-level "win".
  for (auto& t : pool) t.join();  // every candidate is in; the compile threads must stop reading `candidates`
  if (std::find(candidates.begin(), candidates.end(), heuristic) == candidates.end()) candidates.push_back(heuristic);
  const size_t heuristic_index = static_cast<size_t>(std::find(candidates.begin(), candidates.end(), heuristic) - candidates.begin());
  if (std::none_of(finalists.begin(), finalists.end(), [&](const auto& f) { return f.second == heuristic_index; }))
    finalists.emplace_back(0.0, heuristic_index);

  // Re-time the finalists interleaved, so clock and thermal drift hit them alike, on a GPU kept
  // at its sustained clock (the verification let it idle).
  heat(with_kernel(heuristic));
  std::vector<std::vector<double>> samples(finalists.size());
  const int rounds = std::max(5, o.iters);
  for (int r = 0; r < rounds; ++r) {
    report("retime", r + 1, rounds);
    for (size_t f = 0; f < finalists.size(); ++f) samples[f].push_back(sample_ms(with_kernel(candidates[finalists[f].second])));
  }
  std::vector<std::pair<double, size_t>> medians;
  for (size_t f = 0; f < finalists.size(); ++f) {
    medians.emplace_back(median(samples[f]), finalists[f].second);
    if (finalists[f].second == heuristic_index) result.heuristic_ms = medians.back().first;
  }
  const auto ranked = rank_against_heuristic(std::move(medians), heuristic_index, kWinMargin);

  TunedEntry& e = result.entry;
  e.device = DeviceStamp::of(device);
  e.problem = plan.key;
  e.spec = candidates[ranked[0].second];
  e.median_ms = ranked[0].first;
  for (size_t i = 1; i < ranked.size(); ++i) e.runner_ups.emplace_back(candidates[ranked[i].second], ranked[i].first);
  for (size_t i = 0; i < timed.size() && e.runner_ups.size() < 5; ++i) {  // then the next fastest of the first pass
    const KernelSpec& s = candidates[timed[i].second];
    if (s == e.spec || std::any_of(e.runner_ups.begin(), e.runner_ups.end(), [&](const auto& r) { return r.first == s; }))
      continue;
    e.runner_ups.emplace_back(s, timed[i].first);
  }
  e.tuned_at = utc_now();
  result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  return result;
}

}  // namespace flashjit

namespace flashjit::detail {

std::vector<std::pair<double, size_t>> rank_against_heuristic(std::vector<std::pair<double, size_t>> medians,
                                                              size_t heuristic, double margin) {
  std::sort(medians.begin(), medians.end());
  const auto at = std::find_if(medians.begin(), medians.end(), [&](const auto& m) { return m.second == heuristic; });
  if (at != medians.end() && medians.front().first > at->first * (1.0 - margin)) std::rotate(medians.begin(), at, at + 1);
  return medians;
}

}  // namespace flashjit::detail
