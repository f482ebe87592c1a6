// The C API: each function converts its arguments, calls the C++ runtime, and turns any exception
// into a status plus a thread-local message. Nothing escapes as an exception.
#include "flashjit/flashjit.h"

#include <cmath>
#include <memory>
#include <optional>
#include <string>

#include <vector>

#include <fmt/format.h>

#include "flashjit/flashjit.hpp"
#include "flashjit/ring.hpp"

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
  if (t->dtype < FLASHJIT_FLOAT16 || t->dtype > FLASHJIT_FLOAT8_E4M3)
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
  options.prepare_backward = o->prepare_backward != 0;
  return options;
}

// A modifier's side tensors, converted in order.
std::vector<flashjit::TensorView> mod_tensors_of(const flashjit_tensor* tensors, int32_t count) {
  if (count < 0 || (count > 0 && tensors == nullptr))
    throw invalid(fmt::format("mod_tensors: {} tensors at {}", count, static_cast<const void*>(tensors)));
  std::vector<flashjit::TensorView> views;
  for (int32_t i = 0; i < count; ++i) views.push_back(view_of(tensors + i, "mod tensor"));
  return views;
}

flashjit::BlockMaskBuffers buffers_of(const flashjit_block_mask_buffers* b) {
  if (b == nullptr) throw invalid("out is NULL");
  flashjit::BlockMaskBuffers out;
  out.kv_num_blocks = view_of(&b->kv_num_blocks, "kv_num_blocks");
  out.kv_indices = view_of(&b->kv_indices, "kv_indices");
  out.full_kv_num_blocks = view_of(&b->full_kv_num_blocks, "full_kv_num_blocks");
  out.full_kv_indices = view_of(&b->full_kv_indices, "full_kv_indices");
  if (b->q_num_blocks.data != nullptr) {
    out.q_num_blocks = view_of(&b->q_num_blocks, "q_num_blocks");
    out.q_indices = view_of(&b->q_indices, "q_indices");
    out.full_q_num_blocks = view_of(&b->full_q_num_blocks, "full_q_num_blocks");
    out.full_q_indices = view_of(&b->full_q_indices, "full_q_indices");
  }
  out.q_block_size = b->q_block_size;
  out.kv_block_size = b->kv_block_size;
  return out;
}

}  // namespace

struct flashjit_modifier {
  std::shared_ptr<const flashjit::AttentionModifier> code;
};

extern "C" {

flashjit_status flashjit_modifier_create(const char* mask_body, const char* score_body, const char* score_grad_body,
                                         int32_t num_tensors, const char* const* tensor_names,
                                         const int32_t* tensor_dtypes, flashjit_modifier** out) {
  return guarded([&] {
    if (out == nullptr) throw invalid("out is NULL");
    *out = nullptr;
    auto code = std::make_shared<flashjit::AttentionModifier>();
    code->mask = mask_body != nullptr ? mask_body : "";
    code->score = score_body != nullptr ? score_body : "";
    code->score_grad = score_grad_body != nullptr ? score_grad_body : "";
    if (num_tensors < 0 || (num_tensors > 0 && (tensor_names == nullptr || tensor_dtypes == nullptr)))
      throw invalid(fmt::format("{} side tensors without their names or dtypes", num_tensors));
    for (int32_t i = 0; i < num_tensors; ++i) {
      flashjit::ModifierTensorType type;
      switch (tensor_dtypes[i]) {
        case FLASHJIT_INT32: type = flashjit::ModifierTensorType::int32; break;
        case FLASHJIT_INT64: type = flashjit::ModifierTensorType::int64; break;
        case FLASHJIT_FLOAT32: type = flashjit::ModifierTensorType::float32; break;
        default: throw invalid(fmt::format("side tensor {}: dtype code {} is not int32, int64 or float32", i, tensor_dtypes[i]));
      }
      if (tensor_names[i] == nullptr) throw invalid(fmt::format("side tensor {}: name is NULL", i));
      code->tensors.push_back({tensor_names[i], type});
    }
    if (auto reason = code->validate()) throw invalid(*reason);
    *out = new flashjit_modifier{std::move(code)};
  });
}

void flashjit_modifier_destroy(flashjit_modifier* modifier) { delete modifier; }

namespace {

// A C block mask and modifier as the C++ API's options (the views they point at live here).
struct ModifierOptions {
  ModifierOptions(const ModifierOptions&) = delete;  // the options point into it
  flashjit::AttentionMod mod;
  flashjit::BlockMask mask;
  flashjit::TensorView full_num, full_ids, q_num, q_ids, full_q_num, full_q_ids;

  ModifierOptions(flashjit::AttentionOptions& o, const flashjit_modifier* modifier, const flashjit_tensor* mod_tensors,
                  int32_t num_mod_tensors, const flashjit_block_mask* block_mask) {
    if (modifier != nullptr) {
      mod = {modifier->code, mod_tensors_of(mod_tensors, num_mod_tensors)};
      o.mod = &mod;
    }
    if (block_mask == nullptr) return;
    mask.kv_num_blocks = view_of(&block_mask->kv_num_blocks, "block_mask.kv_num_blocks");
    mask.kv_indices = view_of(&block_mask->kv_indices, "block_mask.kv_indices");
    // An optional pair: both given (data not NULL) or neither.
    auto optional_pair = [](const flashjit_tensor& num, const flashjit_tensor& ids, const char* num_name,
                            const char* ids_name, flashjit::TensorView& num_view, flashjit::TensorView& ids_view,
                            const flashjit::TensorView*& num_out, const flashjit::TensorView*& ids_out) {
      if (num.data == nullptr && ids.data == nullptr) return;
      num_view = view_of(&num, num_name);
      ids_view = view_of(&ids, ids_name);
      num_out = &num_view;
      ids_out = &ids_view;
    };
    optional_pair(block_mask->full_kv_num_blocks, block_mask->full_kv_indices, "block_mask.full_kv_num_blocks",
                  "block_mask.full_kv_indices", full_num, full_ids, mask.full_kv_num_blocks, mask.full_kv_indices);
    optional_pair(block_mask->q_num_blocks, block_mask->q_indices, "block_mask.q_num_blocks", "block_mask.q_indices",
                  q_num, q_ids, mask.q_num_blocks, mask.q_indices);
    optional_pair(block_mask->full_q_num_blocks, block_mask->full_q_indices, "block_mask.full_q_num_blocks",
                  "block_mask.full_q_indices", full_q_num, full_q_ids, mask.full_q_num_blocks, mask.full_q_indices);
    mask.q_block_size = block_mask->q_block_size;
    mask.kv_block_size = block_mask->kv_block_size;
    o.block_mask = &mask;
  }
};

}  // namespace

flashjit_status flashjit_forward_mod(const flashjit_tensor* q, const flashjit_tensor* k, const flashjit_tensor* v,
                                     const flashjit_tensor* out, const flashjit_tensor* lse,
                                     const flashjit_modifier* modifier, const flashjit_tensor* mod_tensors,
                                     int32_t num_mod_tensors, const flashjit_block_mask* block_mask,
                                     const flashjit_attention_options* options) {
  return guarded([&] {
    const Views t = views_of({{q, "q"}, {k, "k"}, {v, "v"}, {out, "out"}});
    const flashjit::TensorView lse_view = lse ? view_of(lse, "lse") : flashjit::TensorView{};
    flashjit::AttentionOptions o = options_of(options);
    const ModifierOptions modifiers(o, modifier, mod_tensors, num_mod_tensors, block_mask);
    flashjit::Runtime::global().forward(t[0], t[1], t[2], t[3], lse ? &lse_view : nullptr, o);
  });
}

flashjit_status flashjit_backward_mod(const flashjit_tensor* q, const flashjit_tensor* k, const flashjit_tensor* v,
                                      const flashjit_tensor* out, const flashjit_tensor* dout,
                                      const flashjit_tensor* lse, const flashjit_tensor* dq, const flashjit_tensor* dk,
                                      const flashjit_tensor* dv, const flashjit_modifier* modifier,
                                      const flashjit_tensor* mod_tensors, int32_t num_mod_tensors,
                                      const flashjit_block_mask* block_mask, const flashjit_attention_options* options) {
  return guarded([&] {
    const Views t = views_of({{q, "q"}, {k, "k"}, {v, "v"}, {out, "out"}, {dout, "dout"}});
    const flashjit::TensorView lse_view = lse ? view_of(lse, "lse") : flashjit::TensorView{};
    const Views g = views_of({{dq, "dq"}, {dk, "dk"}, {dv, "dv"}});
    flashjit::AttentionOptions o = options_of(options);
    const ModifierOptions modifiers(o, modifier, mod_tensors, num_mod_tensors, block_mask);
    flashjit::Runtime::global().backward(t[0], t[1], t[2], t[3], t[4], lse ? &lse_view : nullptr, g[0], g[1], g[2], o);
  });
}

flashjit_status flashjit_create_block_mask(const flashjit_modifier* modifier, const flashjit_tensor* mod_tensors,
                                           int32_t num_mod_tensors, int64_t batch, int64_t heads, int64_t seqlen_q,
                                           int64_t seqlen_k, const flashjit_block_mask_buffers* out, void* stream) {
  return guarded([&] {
    if (modifier == nullptr) throw invalid("modifier is NULL");
    const flashjit::AttentionMod mod{modifier->code, mod_tensors_of(mod_tensors, num_mod_tensors)};
    flashjit::Runtime::global().create_block_mask(mod, batch, heads, seqlen_q, seqlen_k, buffers_of(out), stream);
  });
}

flashjit_status flashjit_block_mask_from_tiles(const flashjit_tensor* tile_map, int64_t seqlen_q, int64_t seqlen_k,
                                               const flashjit_block_mask_buffers* out, void* stream) {
  return guarded([&] {
    const flashjit::TensorView map = view_of(tile_map, "tile_map");
    flashjit::Runtime::global().block_mask_from_tiles(map, seqlen_q, seqlen_k, buffers_of(out), stream);
  });
}

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

flashjit_status flashjit_forward_fp8(const flashjit_tensor* q, const flashjit_tensor* k, const flashjit_tensor* v,
                                     const flashjit_tensor* out, const flashjit_tensor* lse,
                                     const flashjit_tensor* q_descale, const flashjit_tensor* k_descale,
                                     const flashjit_tensor* v_descale, const flashjit_tensor* cu_seqlens_q,
                                     const flashjit_tensor* cu_seqlens_k, int32_t max_seqlen_q, int32_t max_seqlen_k,
                                     const flashjit_attention_options* options) {
  return guarded([&] {
    const Views t = views_of({{q, "q"}, {k, "k"}, {v, "v"}, {out, "out"}});
    const flashjit::TensorView lse_view = lse ? view_of(lse, "lse") : flashjit::TensorView{};
    const flashjit::TensorView descales[] = {q_descale ? view_of(q_descale, "q_descale") : flashjit::TensorView{},
                                             k_descale ? view_of(k_descale, "k_descale") : flashjit::TensorView{},
                                             v_descale ? view_of(v_descale, "v_descale") : flashjit::TensorView{}};
    flashjit::AttentionOptions o = options_of(options);
    o.q_descale = q_descale ? &descales[0] : nullptr;
    o.k_descale = k_descale ? &descales[1] : nullptr;
    o.v_descale = v_descale ? &descales[2] : nullptr;
    if (cu_seqlens_q == nullptr) {
      flashjit::Runtime::global().forward(t[0], t[1], t[2], t[3], lse ? &lse_view : nullptr, o);
      return;
    }
    flashjit::VarlenBatch batch;
    batch.cu_seqlens_q = view_of(cu_seqlens_q, "cu_seqlens_q");
    batch.cu_seqlens_k = view_of(cu_seqlens_k, "cu_seqlens_k");
    batch.max_seqlen_q = max_seqlen_q;
    batch.max_seqlen_k = max_seqlen_k;
    flashjit::Runtime::global().forward_varlen(t[0], t[1], t[2], t[3], lse ? &lse_view : nullptr, batch, o);
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

namespace {

flashjit::Backend backend_of(int32_t code) {
  flashjit_attention_options o;
  flashjit_attention_options_init(&o);
  o.backend = code;
  return options_of(&o).backend;
}

flashjit::ring::Options ring_options_of(const flashjit_ring_options* o) {
  flashjit::ring::Options options;
  if (o == nullptr) return options;
  if (o->layout != 0 && o->layout != 1) throw invalid(fmt::format("options.layout: {} is not 0 (contiguous) or 1 (zigzag)", o->layout));
  options.layout = o->layout == 1 ? flashjit::ring::Layout::zigzag : flashjit::ring::Layout::contiguous;
  options.causal = o->causal != 0;
  options.window_left = o->window_left;
  options.window_right = o->window_right;
  if (o->softmax_scale > 0.f) options.softmax_scale = o->softmax_scale;
  options.softcap = o->softcap;
  options.backend = backend_of(o->backend);
  options.sm_margin = o->sm_margin;
  if (o->num_seqlens < 0 || (o->num_seqlens > 0 && o->seqlens == nullptr))
    throw invalid(fmt::format("options.seqlens: {} lengths at {}", o->num_seqlens, static_cast<const void*>(o->seqlens)));
  if (o->num_seqlens > 0) options.seqlens.assign(o->seqlens, o->seqlens + o->num_seqlens);
  options.check_shapes = o->check_shapes != 0;
  options.stream = o->stream;
  return options;
}

}  // namespace

struct flashjit_ring_transport {
  std::unique_ptr<flashjit::ring::Transport> transport;
};

void flashjit_ring_options_init(flashjit_ring_options* options) {
  if (options == nullptr) return;
  *options = flashjit_ring_options{};
  options->layout = 1;
  options->check_shapes = 1;
  options->window_left = options->window_right = -1;
}

flashjit_status flashjit_nccl_unique_id(char* id_128_bytes) {
  return guarded([&] {
    if (id_128_bytes == nullptr) throw invalid("id: null");
    const std::vector<char> id = flashjit::ring::nccl_unique_id();
    std::copy(id.begin(), id.end(), id_128_bytes);
  });
}

flashjit_status flashjit_ring_transport_nccl(const char* id_128_bytes, int32_t rank, int32_t world,
                                             flashjit_ring_transport** out) {
  return guarded([&] {
    if (id_128_bytes == nullptr || out == nullptr) throw invalid("id and out must not be null");
    auto made = std::make_unique<flashjit_ring_transport>();
    made->transport = std::make_unique<flashjit::ring::NcclTransport>(
        std::vector<char>(id_128_bytes, id_128_bytes + 128), rank, world);
    *out = made.release();
  });
}

void flashjit_ring_transport_destroy(flashjit_ring_transport* transport) { delete transport; }

flashjit_status flashjit_ring_forward(flashjit_ring_transport* transport, const flashjit_tensor* q,
                                      const flashjit_tensor* k, const flashjit_tensor* v, const flashjit_tensor* out,
                                      const flashjit_tensor* lse, const flashjit_ring_options* options) {
  return guarded([&] {
    if (transport == nullptr) throw invalid("transport: null");
    const Views t = views_of({{q, "q"}, {k, "k"}, {v, "v"}, {out, "out"}});
    const flashjit::TensorView lse_view = lse ? view_of(lse, "lse") : flashjit::TensorView{};
    flashjit::ring::forward(flashjit::Runtime::global(), *transport->transport, t[0], t[1], t[2], t[3],
                            lse ? &lse_view : nullptr, ring_options_of(options));
  });
}

flashjit_status flashjit_ring_forward_local(int32_t world, const flashjit_tensor* q, const flashjit_tensor* k,
                                            const flashjit_tensor* v, const flashjit_tensor* out,
                                            const flashjit_tensor* lse, void* const* streams,
                                            const flashjit_ring_options* options) {
  return guarded([&] {
    if (world < 1) throw invalid(fmt::format("world: {} ranks, expected at least 1", world));
    if (q == nullptr || k == nullptr || v == nullptr || out == nullptr) throw invalid("q, k, v and out must not be null");
    std::vector<Views> shards;
    std::vector<std::optional<flashjit::TensorView>> lses(world);
    for (int r = 0; r < world; ++r) {
      shards.push_back(views_of({{q + r, "q"}, {k + r, "k"}, {v + r, "v"}, {out + r, "out"}}));
      if (lse != nullptr && lse[r].data != nullptr) lses[r] = view_of(lse + r, "lse");
    }
    const flashjit::ring::Options base = ring_options_of(options);
    flashjit::ring::LocalRing ring(world);
    ring.run([&](int r, flashjit::ring::Transport& transport) {
      flashjit::ring::Options rank_options = base;
      if (streams != nullptr) rank_options.stream = streams[r];
      const Views& t = shards[r];
      flashjit::ring::forward(flashjit::Runtime::global(), transport, t[0], t[1], t[2], t[3],
                              lses[r] ? &*lses[r] : nullptr, rank_options);
    });
  });
}

flashjit_status flashjit_ring_backward(flashjit_ring_transport* transport, const flashjit_tensor* q,
                                       const flashjit_tensor* k, const flashjit_tensor* v, const flashjit_tensor* out,
                                       const flashjit_tensor* dout, const flashjit_tensor* lse, const flashjit_tensor* dq,
                                       const flashjit_tensor* dk, const flashjit_tensor* dv,
                                       const flashjit_ring_options* options) {
  return guarded([&] {
    if (transport == nullptr) throw invalid("transport: null");
    const Views t = views_of({{q, "q"}, {k, "k"}, {v, "v"}, {out, "out"}, {dout, "dout"}, {lse, "lse"}, {dq, "dq"},
                              {dk, "dk"}, {dv, "dv"}});
    flashjit::ring::backward(flashjit::Runtime::global(), *transport->transport, t[0], t[1], t[2], t[3], t[4], t[5],
                             t[6], t[7], t[8], ring_options_of(options));
  });
}

flashjit_status flashjit_ring_backward_local(int32_t world, const flashjit_tensor* q, const flashjit_tensor* k,
                                             const flashjit_tensor* v, const flashjit_tensor* out,
                                             const flashjit_tensor* dout, const flashjit_tensor* lse,
                                             const flashjit_tensor* dq, const flashjit_tensor* dk,
                                             const flashjit_tensor* dv, void* const* streams,
                                             const flashjit_ring_options* options) {
  return guarded([&] {
    if (world < 1) throw invalid(fmt::format("world: {} ranks, expected at least 1", world));
    for (const flashjit_tensor* t : {q, k, v, out, dout, lse, dq, dk, dv})
      if (t == nullptr) throw invalid("q, k, v, out, dout, lse, dq, dk and dv must not be null");
    std::vector<Views> shards;
    for (int r = 0; r < world; ++r)
      shards.push_back(views_of({{q + r, "q"}, {k + r, "k"}, {v + r, "v"}, {out + r, "out"}, {dout + r, "dout"},
                                 {lse + r, "lse"}, {dq + r, "dq"}, {dk + r, "dk"}, {dv + r, "dv"}}));
    const flashjit::ring::Options base = ring_options_of(options);
    flashjit::ring::LocalRing ring(world);
    ring.run([&](int r, flashjit::ring::Transport& transport) {
      flashjit::ring::Options rank_options = base;
      if (streams != nullptr) rank_options.stream = streams[r];
      const Views& t = shards[r];
      flashjit::ring::backward(flashjit::Runtime::global(), transport, t[0], t[1], t[2], t[3], t[4], t[5], t[6], t[7],
                               t[8], rank_options);
    });
  });
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
