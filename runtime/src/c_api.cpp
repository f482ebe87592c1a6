// The C API: each function converts its arguments, calls the C++ runtime, and turns any exception
// into a status plus a thread-local message. Nothing escapes as an exception.
#include "flashjit/flashjit.h"

#include <cmath>
#include <optional>
#include <string>

#include <vector>

#include <fmt/format.h>

#include "flashjit/flashjit.hpp"

namespace {

thread_local std::string last_error;

flashjit_status fail(flashjit_status status, std::string message) {
  last_error = std::move(message);
  return status;
}

template <class Body>
flashjit_status guarded(Body&& body) {
  try {
    body();
    last_error.clear();
    return FLASHJIT_OK;
  } catch (const flashjit::Error& e) {
    return fail(static_cast<flashjit_status>(e.code()), e.what());
  } catch (const std::exception& e) {
    return fail(FLASHJIT_ERROR_INTERNAL, fmt::format("flashjit: internal error: {}", e.what()));
  } catch (...) {
    return fail(FLASHJIT_ERROR_INTERNAL, "flashjit: internal error: unknown exception");
  }
}

flashjit::Error invalid(const std::string& message) {
  return flashjit::Error(flashjit::ErrorCode::invalid_argument, "C API", message);
}

flashjit::TensorView view_of(const flashjit_tensor* t, const char* name);

// Several tensors' views, converted (and checked) in the order given.
using Views = std::vector<flashjit::TensorView>;
Views views_of(std::initializer_list<std::pair<const flashjit_tensor*, const char*>> tensors) {
  Views views;
  for (const auto& [tensor, name] : tensors) views.push_back(view_of(tensor, name));
  return views;
}

flashjit::TensorView view_of(const flashjit_tensor* t, const char* name) {
  if (t == nullptr) throw invalid(fmt::format("{} is NULL", name));
  if (t->dtype < FLASHJIT_FLOAT16 || t->dtype > FLASHJIT_INT32)
    throw invalid(fmt::format("{}: unknown dtype code {}", name, t->dtype));
  if (t->rank < 1 || t->rank > 4) throw invalid(fmt::format("{}: rank {} is not 1 to 4", name, t->rank));
  flashjit::TensorView v;
  v.data = t->data;
  v.dtype = static_cast<flashjit::ScalarType>(t->dtype);
  v.device = t->device;
  v.rank = t->rank;
  for (int d = 0; d < t->rank; ++d) {
    v.shape[d] = t->shape[d];
    v.strides[d] = t->strides[d];
  }
  return v;
}

flashjit::AttentionOptions options_of(const flashjit_attention_options* o) {
  flashjit::AttentionOptions options;
  if (o == nullptr) return options;
  if (o->softmax_scale > 0.f) options.softmax_scale = o->softmax_scale;
  options.causal = o->causal != 0;
  options.window_left = o->window_left;
  options.window_right = o->window_right;
  options.softcap = o->softcap;
  switch (o->backend) {
    case FLASHJIT_BACKEND_AUTO: options.backend = flashjit::Backend::automatic; break;
    case FLASHJIT_BACKEND_REFERENCE: options.backend = flashjit::Backend::reference; break;
    case FLASHJIT_BACKEND_FA2: options.backend = flashjit::Backend::fa2; break;
    case FLASHJIT_BACKEND_SM90: options.backend = flashjit::Backend::sm90; break;
    default: throw invalid(fmt::format("options.backend: unknown backend code {}", o->backend));
  }
  options.stream = o->stream;
  options.deterministic = o->deterministic != 0;
  options.sm_margin = o->sm_margin;
  options.num_splits = o->num_splits;
  return options;
}

}  // namespace

extern "C" {

void flashjit_attention_options_init(flashjit_attention_options* options) {
  if (options == nullptr) return;
  *options = flashjit_attention_options{};
  options->softmax_scale = 0.f;
  options->window_left = -1;
  options->window_right = -1;
  options->backend = FLASHJIT_BACKEND_AUTO;
}

flashjit_status flashjit_forward(const flashjit_tensor* q, const flashjit_tensor* k,
                                 const flashjit_tensor* v, const flashjit_tensor* out,
                                 const flashjit_tensor* lse,
                                 const flashjit_attention_options* options) {
  return guarded([&] {
    // In argument order, so the first bad one is named (a call's arguments are evaluated in any order).
    const Views t = views_of({{q, "q"}, {k, "k"}, {v, "v"}, {out, "out"}});
    const flashjit::TensorView lse_view = lse ? view_of(lse, "lse") : flashjit::TensorView{};
    flashjit::Runtime::global().forward(t[0], t[1], t[2], t[3], lse ? &lse_view : nullptr, options_of(options));
  });
}

flashjit_status flashjit_forward_varlen(const flashjit_tensor* q, const flashjit_tensor* k,
                                        const flashjit_tensor* v, const flashjit_tensor* out,
                                        const flashjit_tensor* lse,
                                        const flashjit_tensor* cu_seqlens_q,
                                        const flashjit_tensor* cu_seqlens_k, int32_t max_seqlen_q,
                                        int32_t max_seqlen_k,
                                        const flashjit_attention_options* options) {
  return guarded([&] {
    const Views t = views_of({{q, "q"}, {k, "k"}, {v, "v"}, {out, "out"}});
    const flashjit::TensorView lse_view = lse ? view_of(lse, "lse") : flashjit::TensorView{};
    flashjit::VarlenBatch batch;
    batch.cu_seqlens_q = view_of(cu_seqlens_q, "cu_seqlens_q");
    batch.cu_seqlens_k = view_of(cu_seqlens_k, "cu_seqlens_k");
    batch.max_seqlen_q = max_seqlen_q;
    batch.max_seqlen_k = max_seqlen_k;
    flashjit::Runtime::global().forward_varlen(t[0], t[1], t[2], t[3], lse ? &lse_view : nullptr, batch,
                                               options_of(options));
  });
}

flashjit_status flashjit_backward(const flashjit_tensor* q, const flashjit_tensor* k,
                                  const flashjit_tensor* v, const flashjit_tensor* out,
                                  const flashjit_tensor* dout, const flashjit_tensor* lse,
                                  const flashjit_tensor* dq, const flashjit_tensor* dk,
                                  const flashjit_tensor* dv, const flashjit_attention_options* options) {
  return guarded([&] {
    const Views t = views_of({{q, "q"}, {k, "k"}, {v, "v"}, {out, "out"}, {dout, "dout"}});
    const flashjit::TensorView lse_view = lse ? view_of(lse, "lse") : flashjit::TensorView{};
    const Views g = views_of({{dq, "dq"}, {dk, "dk"}, {dv, "dv"}});
    flashjit::Runtime::global().backward(t[0], t[1], t[2], t[3], t[4], lse ? &lse_view : nullptr, g[0], g[1], g[2],
                                         options_of(options));
  });
}

flashjit_status flashjit_backward_varlen(const flashjit_tensor* q, const flashjit_tensor* k,
                                         const flashjit_tensor* v, const flashjit_tensor* out,
                                         const flashjit_tensor* dout, const flashjit_tensor* lse,
                                         const flashjit_tensor* dq, const flashjit_tensor* dk,
                                         const flashjit_tensor* dv, const flashjit_tensor* cu_seqlens_q,
                                         const flashjit_tensor* cu_seqlens_k, int32_t max_seqlen_q,
                                         int32_t max_seqlen_k, const flashjit_attention_options* options) {
  return guarded([&] {
    const Views t = views_of({{q, "q"}, {k, "k"}, {v, "v"}, {out, "out"}, {dout, "dout"}});
    const flashjit::TensorView lse_view = lse ? view_of(lse, "lse") : flashjit::TensorView{};
    const Views g = views_of({{dq, "dq"}, {dk, "dk"}, {dv, "dv"}});
    flashjit::VarlenBatch batch;
    batch.cu_seqlens_q = view_of(cu_seqlens_q, "cu_seqlens_q");
    batch.cu_seqlens_k = view_of(cu_seqlens_k, "cu_seqlens_k");
    batch.max_seqlen_q = max_seqlen_q;
    batch.max_seqlen_k = max_seqlen_k;
    flashjit::Runtime::global().backward_varlen(t[0], t[1], t[2], t[3], t[4], lse ? &lse_view : nullptr, g[0], g[1],
                                                g[2], batch, options_of(options));
  });
}

flashjit_status flashjit_forward_kvcache(const flashjit_tensor* q, const flashjit_tensor* k_cache,
                                         const flashjit_tensor* v_cache, const flashjit_tensor* block_table,
                                         const flashjit_tensor* cache_seqlens, const flashjit_tensor* k_new,
                                         const flashjit_tensor* v_new, const flashjit_tensor* out,
                                         const flashjit_tensor* lse, const flashjit_attention_options* options) {
  return guarded([&] {
    const Views t = views_of({{q, "q"}, {k_cache, "k_cache"}, {v_cache, "v_cache"}, {out, "out"}});
    auto optional = [](const flashjit_tensor* tensor, const char* name) {
      return tensor ? std::optional<flashjit::TensorView>(view_of(tensor, name)) : std::nullopt;
    };
    const auto table = optional(block_table, "block_table"), seqlens = optional(cache_seqlens, "cache_seqlens");
    const auto kn = optional(k_new, "k"), vn = optional(v_new, "v"), lse_view = optional(lse, "lse");
    flashjit::KvCache cache;
    cache.k_cache = t[1];
    cache.v_cache = t[2];
    cache.block_table = table ? &*table : nullptr;
    cache.cache_seqlens = seqlens ? &*seqlens : nullptr;
    cache.k_new = kn ? &*kn : nullptr;
    cache.v_new = vn ? &*vn : nullptr;
    flashjit::Runtime::global().forward_kvcache(t[0], cache, t[3], lse_view ? &*lse_view : nullptr,
                                                options_of(options));
  });
}

flashjit_status flashjit_check_kvcache(void* stream) {
  return guarded([&] { flashjit::Runtime::global().check_kvcache(stream); });
}

flashjit_status flashjit_load_tuning_db(const char* path) {
  return guarded([&] {
    if (path == nullptr) throw invalid("path is NULL");
    flashjit::Runtime::global().load_tuning_db(path);
  });
}

flashjit_status flashjit_cache_stats(uint64_t* memory_hits, uint64_t* disk_hits, uint64_t* compiles) {
  return guarded([&] {
    const flashjit::CacheStats s = flashjit::Runtime::global().kernel_cache().stats();
    if (memory_hits) *memory_hits = s.memory_hits;
    if (disk_hits) *disk_hits = s.disk_hits;
    if (compiles) *compiles = s.compiles;
  });
}

const char* flashjit_last_error(void) { return last_error.c_str(); }

const char* flashjit_version(void) { return FLASHJIT_VERSION; }

}  // extern "C"
