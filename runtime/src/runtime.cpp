#include "dispatch.hpp"
#include "driver.hpp"
#include "env.hpp"
#include "family.hpp"
#include "families/kvcache_fwd.hpp"
#include "flashjit/flashjit.hpp"
#include "module_cache.hpp"
#include "problem.hpp"

#include <vector>

#include <fmt/format.h>

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

  // Starts compiling the kernel backward() will pick for this forward's problem in the background
  // (AttentionOptions::prepare_backward). Only a hint, which never fails the forward: where the
  // backward cannot run this problem, backward() says why (FLASHJIT_VERBOSE shows it here too).
  void prefetch_backward(const ForwardProblem& forward, const DeviceProperties& device) {
    BackwardProblem backward;  // (its gradient tensors unknown yet: laid out as the forward's)
    backward.forward = forward;
    backward.forward.backend = Backend::automatic;  // a forced forward family or kernel is not the backward's
    backward.forward.forced_kernel.reset();
    backward.deterministic = forward.deterministic_backward;
    try {
      kernels.prefetch(select_kernel(PassProblem{Pass::backward, backward.forward, &backward}, device, &tuning));
    } catch (const std::exception& e) {
      if (environment().verbose) fmt::print(stderr, "flashjit: no backward kernel to prepare: {}\n", e.what());
    }
  }

  // Validates the pointers and the device, then dispatches and runs the chosen family's entry
  // sequence on the problem's stream. `check_on_device` runs once the pointers are known to be
  // device memory, before dispatch.
  template <class DeviceCheck, class Tensors = std::initializer_list<NamedTensor>>
  void run(const PassProblem& problem, DeviceCheck&& check_on_device, const Tensors& tensors) {
    const ForwardProblem& f = problem.forward;
    driver();  // a clear "no CUDA driver" error before anything else needs the GPU
    const DeviceProperties& device = device_properties(f.device);
    for (const auto& [view, name] : tensors)
      if (view != nullptr) check_device_pointer(*view, name);
    const DeviceContextScope context(f.device);
    check_on_device();
    if (problem.is_empty()) return;

    const bool sliceable = problem.pass == Pass::forward || problem.pass == Pass::backward;
    const bool one_grid = !sliceable || fits_one_grid(f);
    // Before dispatch, so that a problem no slices can cover is refused before anything compiles.
    const std::vector<ProblemSlice> slices = one_grid ? std::vector<ProblemSlice>{} : grid_slices(f);
    const KernelSpec spec = select_kernel(problem, device, &tuning);
    if (problem.pass == Pass::forward && f.prepare_backward && !modules.contains(spec)) prefetch_backward(f, device);
    const LoadedKernel& kernel = modules.get(spec, device);
    const RuntimeFamily& family = runtime_family(spec.family);
    const auto stream = static_cast<CUstream>(f.stream);
    if (one_grid) {
      family.run(FamilyCall{problem, spec, kernel, device, stream});
      return;
    }
    if (environment().verbose)
      fmt::print(stderr, "flashjit: {} of batch {} x {} heads runs as {} launches of at most {} sequences and heads\n",
                 problem.operation(), f.batch, f.heads_q, slices.size(), kMaxGridBatch);
    for (const ProblemSlice& slice : slices) {
      if (problem.pass == Pass::backward) {
        const BackwardProblem part = slice_problem(*problem.backward, slice);
        family.run(FamilyCall{PassProblem{Pass::backward, part.forward, &part}, spec, kernel, device, stream});
      } else {
        const ForwardProblem part = slice_problem(f, slice);
        family.run(FamilyCall{PassProblem{Pass::forward, part}, spec, kernel, device, stream});
      }
    }
  }
};

Runtime::Runtime(CacheConfig cache) : impl_(std::make_unique<Impl>(std::move(cache))) {}
Runtime::~Runtime() = default;

Runtime& Runtime::global() {
  static Runtime runtime;
  return runtime;
}

namespace {

// options.mod's side tensors and options.block_mask's arrays, for the device pointer checks.
void add_modifier_views(const AttentionOptions& options, std::vector<NamedTensor>& views) {
  if (options.mod != nullptr)
    for (const TensorView& t : options.mod->tensors) views.push_back({&t, "mod tensor"});
  if (const BlockMask* mask = options.block_mask)
    views.insert(views.end(), {{&mask->kv_num_blocks, "block_mask.kv_num_blocks"},
                               {&mask->kv_indices, "block_mask.kv_indices"},
                               {mask->full_kv_num_blocks, "block_mask.full_kv_num_blocks"},
                               {mask->full_kv_indices, "block_mask.full_kv_indices"},
                               {mask->q_num_blocks, "block_mask.q_num_blocks"},
                               {mask->q_indices, "block_mask.q_indices"},
                               {mask->full_q_num_blocks, "block_mask.full_q_num_blocks"},
                               {mask->full_q_indices, "block_mask.full_q_indices"}});
}

// An optional tensor (data null: not given) for the device pointer checks.
const TensorView* optional_view(const TensorView& t) { return t.data != nullptr ? &t : nullptr; }

bool has_modifiers(const AttentionOptions& options) { return options.mod != nullptr || options.block_mask != nullptr; }

}  // namespace

void Runtime::forward(const TensorView& q, const TensorView& k, const TensorView& v,
                      const TensorView& out, const TensorView* lse, const AttentionOptions& options) {
  const ForwardProblem problem = make_forward_problem(q, k, v, out, lse, nullptr, options);
  if (!has_modifiers(options)) {  // (no allocation on the common path)
    impl_->run(PassProblem{Pass::forward, problem}, [] {}, {{&q, "q"}, {&k, "k"}, {&v, "v"}, {&out, "out"}, {lse, "lse"}});
    return;
  }
  std::vector<NamedTensor> views{{&q, "q"}, {&k, "k"}, {&v, "v"}, {&out, "out"}, {lse, "lse"}};
  add_modifier_views(options, views);
  impl_->run(PassProblem{Pass::forward, problem}, [] {}, views);
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
                               {&batch.cu_seqlens_k, "cu_seqlens_k"},
                               {optional_view(batch.seqused_q), "seqused_q"},
                               {optional_view(batch.seqused_k), "seqused_k"}});
}

void Runtime::backward(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
                       const TensorView& dout, const TensorView* lse, const TensorView& dq,
                       const TensorView& dk, const TensorView& dv, const AttentionOptions& options) {
  const BackwardProblem problem = make_backward_problem(q, k, v, out, dout, lse, dq, dk, dv, nullptr, options);
  std::vector<NamedTensor> views{{&q, "q"},       {&k, "k"},   {&v, "v"},   {&out, "out"}, {&dout, "dout"},
                                 {lse, "lse"},    {&dq, "dq"}, {&dk, "dk"}, {&dv, "dv"}};
  if (has_modifiers(options)) add_modifier_views(options, views);
  impl_->run(PassProblem{Pass::backward, problem.forward, &problem}, [] {}, views);
}

void Runtime::backward_varlen(const TensorView& q, const TensorView& k, const TensorView& v,
                              const TensorView& out, const TensorView& dout, const TensorView* lse,
                              const TensorView& dq, const TensorView& dk, const TensorView& dv,
                              const VarlenBatch& batch, const AttentionOptions& options) {
  const BackwardProblem problem = make_backward_problem(q, k, v, out, dout, lse, dq, dk, dv, &batch, options);
  impl_->run(PassProblem{Pass::backward, problem.forward, &problem}, [&] {
    if (batch.check_cu_seqlens) check_cu_seqlens(problem.forward, batch, q.shape[0], k.shape[0]);
  }, {{&q, "q"}, {&k, "k"}, {&v, "v"}, {&out, "out"}, {&dout, "dout"}, {lse, "lse"}, {&dq, "dq"},
      {&dk, "dk"}, {&dv, "dv"}, {&batch.cu_seqlens_q, "cu_seqlens_q"}, {&batch.cu_seqlens_k, "cu_seqlens_k"},
      {optional_view(batch.seqused_q), "seqused_q"}, {optional_view(batch.seqused_k), "seqused_k"}});
}

void Runtime::forward_kvcache(const TensorView& q, const KvCache& cache, const TensorView& out, const TensorView* lse,
                              const AttentionOptions& options) {
  const KvCacheProblem problem = make_kvcache_problem(q, cache, out, lse, options);
  impl_->run(PassProblem{Pass::kvcache, problem.forward, nullptr, &problem}, [] {},
             {{&q, "q"}, {&cache.k_cache, "k_cache"}, {&cache.v_cache, "v_cache"}, {&out, "out"}, {lse, "lse"},
              {cache.block_table, "block_table"}, {cache.cache_seqlens, "cache_seqlens"}, {cache.k_new, "k"},
              {cache.v_new, "v"}});
}

namespace {

// The named views of a block mask build, for the device pointer checks.
std::vector<NamedTensor> block_mask_views(const BlockMaskBuffers& out, const AttentionMod* mod) {
  std::vector<NamedTensor> views{{&out.kv_num_blocks, "kv_num_blocks"},
                                 {&out.kv_indices, "kv_indices"},
                                 {&out.full_kv_num_blocks, "full_kv_num_blocks"},
                                 {&out.full_kv_indices, "full_kv_indices"}};
  if (out.q_num_blocks.data != nullptr)
    views.insert(views.end(), {{&out.q_num_blocks, "q_num_blocks"},
                               {&out.q_indices, "q_indices"},
                               {&out.full_q_num_blocks, "full_q_num_blocks"},
                               {&out.full_q_indices, "full_q_indices"}});
  if (mod != nullptr)
    for (const TensorView& t : mod->tensors) views.push_back({&t, "mod tensor"});
  return views;
}

}  // namespace

void Runtime::create_block_mask(const AttentionMod& mod, int64_t batch, int64_t heads, int64_t seqlen_q,
                                int64_t seqlen_k, const BlockMaskBuffers& out, void* stream) {
  const BlockMaskProblem problem = make_block_mask_problem(&mod, nullptr, batch, heads, seqlen_q, seqlen_k, out, stream);
  impl_->run(PassProblem{Pass::block_mask, problem.forward, nullptr, nullptr, &problem}, [] {},
             block_mask_views(out, &mod));
}

void Runtime::block_mask_from_tiles(const TensorView& tile_map, int64_t seqlen_q, int64_t seqlen_k,
                                    const BlockMaskBuffers& out, void* stream) {
  const BlockMaskProblem problem = make_block_mask_problem(nullptr, &tile_map, tile_map.shape[0], tile_map.shape[1],
                                                           seqlen_q, seqlen_k, out, stream);
  std::vector<NamedTensor> views = block_mask_views(out, nullptr);
  views.push_back({&tile_map, "tile_map"});
  impl_->run(PassProblem{Pass::block_mask, problem.forward, nullptr, nullptr, &problem}, [] {}, views);
}

void Runtime::check_kvcache(void* stream) {
  driver();
  check_kvcache_status(static_cast<CUstream>(stream));
}

KernelCache& Runtime::kernel_cache() { return impl_->kernels; }

TuningSources& Runtime::tuning() { return impl_->tuning; }

void Runtime::load_tuning_db(const std::string& path) { impl_->tuning.set_user_db(TuningDb::load(path), path); }

}  // namespace flashjit
