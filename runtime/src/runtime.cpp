#include "dispatch.hpp"
#include "driver.hpp"
#include "env.hpp"
#include "family.hpp"
#include "families/kvcache_fwd.hpp"
#include "flashjit/flashjit.hpp"
#include "module_cache.hpp"
#include "problem.hpp"

namespace flashjit {

using namespace detail;

namespace {

struct NamedTensor {
  const TensorView* view;  // null: an optional tensor not given
  const char* name;
};

}  // namespace

struct Runtime::Impl {
  KernelCache kernels;
  ModuleCache modules{kernels};
  TuningSources tuning;

  explicit Impl(CacheConfig config) : kernels(std::move(config)) {
    tuning.set_bundled_db(bundled_tuning_db());
    if (const auto& path = environment().tuning_db) tuning.set_user_db(TuningDb::load(*path), *path);
  }

  // Validates the pointers and the device, then dispatches and runs the chosen family's entry
  // sequence on the problem's stream. `check_on_device` runs once the pointers are known to be
  // device memory, before dispatch.
  template <class DeviceCheck>
  void run(const PassProblem& problem, DeviceCheck&& check_on_device, std::initializer_list<NamedTensor> tensors) {
    const ForwardProblem& f = problem.forward;
    driver();  // a clear "no CUDA driver" error before anything else needs the GPU
    const DeviceProperties& device = device_properties(f.device);
    for (const auto& [view, name] : tensors)
      if (view != nullptr) check_device_pointer(*view, name);
    make_context_current(f.device);
    check_on_device();
    if (problem.is_empty()) return;

    const KernelSpec spec = select_kernel(problem, device, &tuning);
    const LoadedKernel& kernel = modules.get(spec, device);
    runtime_family(spec.family).run(FamilyCall{problem, spec, kernel, device, static_cast<CUstream>(f.stream)});
  }
};

Runtime::Runtime(CacheConfig cache) : impl_(std::make_unique<Impl>(std::move(cache))) {}
Runtime::~Runtime() = default;

Runtime& Runtime::global() {
  static Runtime runtime;
  return runtime;
}

void Runtime::forward(const TensorView& q, const TensorView& k, const TensorView& v,
                      const TensorView& out, const TensorView* lse, const AttentionOptions& options) {
  const ForwardProblem problem = make_forward_problem(q, k, v, out, lse, nullptr, options);
  impl_->run(PassProblem{Pass::forward, problem}, [] {}, {{&q, "q"}, {&k, "k"}, {&v, "v"}, {&out, "out"}, {lse, "lse"}});
}

void Runtime::forward_varlen(const TensorView& q, const TensorView& k, const TensorView& v,
                             const TensorView& out, const TensorView* lse, const VarlenBatch& batch,
                             const AttentionOptions& options) {
  const ForwardProblem problem = make_forward_problem(q, k, v, out, lse, &batch, options);
  impl_->run(PassProblem{Pass::forward, problem}, [&] {
    if (batch.check_cu_seqlens) check_cu_seqlens(problem, batch, q.shape[0], k.shape[0]);
  }, {{&q, "q"},
                               {&k, "k"},
                               {&v, "v"},
                               {&out, "out"},
                               {lse, "lse"},
                               {&batch.cu_seqlens_q, "cu_seqlens_q"},
                               {&batch.cu_seqlens_k, "cu_seqlens_k"}});
}

void Runtime::backward(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
                       const TensorView& dout, const TensorView* lse, const TensorView& dq,
                       const TensorView& dk, const TensorView& dv, const AttentionOptions& options) {
  const BackwardProblem problem = make_backward_problem(q, k, v, out, dout, lse, dq, dk, dv, nullptr, options);
  impl_->run(PassProblem{Pass::backward, problem.forward, &problem}, [] {}, {{&q, "q"}, {&k, "k"}, {&v, "v"}, {&out, "out"}, {&dout, "dout"},
                                       {lse, "lse"}, {&dq, "dq"}, {&dk, "dk"}, {&dv, "dv"}});
}

void Runtime::backward_varlen(const TensorView& q, const TensorView& k, const TensorView& v,
                              const TensorView& out, const TensorView& dout, const TensorView* lse,
                              const TensorView& dq, const TensorView& dk, const TensorView& dv,
                              const VarlenBatch& batch, const AttentionOptions& options) {
  const BackwardProblem problem = make_backward_problem(q, k, v, out, dout, lse, dq, dk, dv, &batch, options);
  impl_->run(PassProblem{Pass::backward, problem.forward, &problem}, [&] {
    if (batch.check_cu_seqlens) check_cu_seqlens(problem.forward, batch, q.shape[0], k.shape[0]);
  }, {{&q, "q"}, {&k, "k"}, {&v, "v"}, {&out, "out"}, {&dout, "dout"}, {lse, "lse"}, {&dq, "dq"},
      {&dk, "dk"}, {&dv, "dv"}, {&batch.cu_seqlens_q, "cu_seqlens_q"}, {&batch.cu_seqlens_k, "cu_seqlens_k"}});
}

void Runtime::forward_kvcache(const TensorView& q, const KvCache& cache, const TensorView& out, const TensorView* lse,
                              const AttentionOptions& options) {
  const KvCacheProblem problem = make_kvcache_problem(q, cache, out, lse, options);
  impl_->run(PassProblem{Pass::kvcache, problem.forward, nullptr, &problem}, [] {},
             {{&q, "q"}, {&cache.k_cache, "k_cache"}, {&cache.v_cache, "v_cache"}, {&out, "out"}, {lse, "lse"},
              {cache.block_table, "block_table"}, {cache.cache_seqlens, "cache_seqlens"}, {cache.k_new, "k"},
              {cache.v_new, "v"}});
}

void Runtime::check_kvcache(void* stream) {
  driver();
  check_kvcache_status(static_cast<CUstream>(stream));
}

KernelCache& Runtime::kernel_cache() { return impl_->kernels; }

TuningSources& Runtime::tuning() { return impl_->tuning; }

void Runtime::load_tuning_db(const std::string& path) { impl_->tuning.set_user_db(TuningDb::load(path), path); }

}  // namespace flashjit
