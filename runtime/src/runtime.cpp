#include <fmt/format.h>

#include "dispatch.hpp"
#include "driver.hpp"
#include "flashjit/codegen/render.hpp"
#include "flashjit/flashjit.hpp"
#include "module_cache.hpp"
#include "problem.hpp"

namespace flashjit {

using namespace detail;

namespace {

struct Grid {
  unsigned x, y, z;
};

Grid forward_grid(const KernelSpec& spec, const ForwardProblem& p) {
  return {static_cast<unsigned>((p.seqlen_q + spec.block_m - 1) / spec.block_m),
          static_cast<unsigned>(p.heads_q), static_cast<unsigned>(p.batch)};
}

struct NamedTensor {
  const TensorView* view;  // null: an optional tensor not given
  const char* name;
};

}  // namespace

struct Runtime::Impl {
  KernelCache kernels;
  ModuleCache modules{kernels};

  explicit Impl(CacheConfig config) : kernels(std::move(config)) {}

  // `check_on_device` runs once the pointers are known to be device memory, before dispatch.
  template <class DeviceCheck>
  void run_forward(const ForwardProblem& problem, DeviceCheck&& check_on_device,
                   std::initializer_list<NamedTensor> tensors) {
    driver();  // a clear "no CUDA driver" error before anything else needs the GPU
    const DeviceProperties& device = device_properties(problem.device);
    for (const auto& [view, name] : tensors)
      if (view != nullptr) check_device_pointer(*view, name);
    make_context_current(problem.device);
    check_on_device();
    if (problem.is_empty()) return;

    const KernelSpec spec = select_forward_kernel(problem, device);
    const LoadedKernel& kernel = modules.get(spec, device);
    const Grid grid = forward_grid(spec, problem);

    CUlaunchConfig config{};
    config.gridDimX = grid.x;
    config.gridDimY = grid.y;
    config.gridDimZ = grid.z;
    config.blockDimX = static_cast<unsigned>(threads_per_block(spec));
    config.blockDimY = config.blockDimZ = 1;
    config.sharedMemBytes = static_cast<unsigned>(kernel.dynamic_smem_bytes);
    config.hStream = static_cast<CUstream>(problem.stream);
    AttentionFwdParams params = problem.params;
    void* arguments[] = {&params};
    FLASHJIT_CU(cuLaunchKernelEx, &config, reinterpret_cast<CUfunction>(kernel.entries[0]),
                arguments, nullptr);
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
  impl_->run_forward(problem, [] {}, {{&q, "q"}, {&k, "k"}, {&v, "v"}, {&out, "out"}, {lse, "lse"}});
}

void Runtime::forward_varlen(const TensorView& q, const TensorView& k, const TensorView& v,
                             const TensorView& out, const TensorView* lse, const VarlenBatch& batch,
                             const AttentionOptions& options) {
  const ForwardProblem problem = make_forward_problem(q, k, v, out, lse, &batch, options);
  impl_->run_forward(problem, [&] {
    if (batch.check_cu_seqlens) check_cu_seqlens(problem, batch, q.shape[0], k.shape[0]);
  }, {{&q, "q"},
                               {&k, "k"},
                               {&v, "v"},
                               {&out, "out"},
                               {lse, "lse"},
                               {&batch.cu_seqlens_q, "cu_seqlens_q"},
                               {&batch.cu_seqlens_k, "cu_seqlens_k"}});
}

KernelCache& Runtime::kernel_cache() { return impl_->kernels; }

}  // namespace flashjit
