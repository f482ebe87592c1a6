// flashjit._autograd: the eager calls of the dense attention (fixed-length and packed variable-length
// batches), their autograd nodes and the KV-cache forward in C++ (a torch extension the package
// compiles on first use, python/flashjit/_extension.py). The ctypes path costs Python work on every
// call, and its backward runs Python on the autograd thread; here each call builds its C structs in
// C++ and the backward is a C++ node, as SDPA's are.
//
// The C API comes from the library the package already loaded: bind() takes its functions'
// addresses, so this module links only against torch.
#include <torch/csrc/autograd/custom_function.h>
#include <torch/python.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>

#include "flashjit/flashjit.h"

// torch's C shim (libtorch_cuda): the current stream of a device, without the CUDA toolkit's headers.
extern "C" int32_t aoti_torch_get_current_cuda_stream(int32_t device_index, void** ret_stream);

namespace {

namespace py = pybind11;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct CApi {
  decltype(&flashjit_attention_options_init) options_init = nullptr;
  decltype(&flashjit_forward) forward = nullptr;
  decltype(&flashjit_backward) backward = nullptr;
  decltype(&flashjit_forward_varlen) forward_varlen = nullptr;
  decltype(&flashjit_backward_varlen) backward_varlen = nullptr;
  decltype(&flashjit_forward_kvcache) forward_kvcache = nullptr;
  decltype(&flashjit_last_error) last_error = nullptr;
};
CApi api;
py::object* error_class = nullptr;  // flashjit.FlashJitError (never freed: Python may be gone at exit)
bool verbose = false;

// A failure the C API reported; raised in Python as FlashJitError (ValueError for invalid arguments).
struct Failure : std::runtime_error {
  Failure(int status, const std::string& message) : std::runtime_error(message), status(status) {}
  int status;
};

void check(flashjit_status status) {
  if (status != FLASHJIT_OK) throw Failure(status, api.last_error());
}

flashjit_tensor view(const at::Tensor& t, const char* name) {
  if (!t.is_cuda()) throw Failure(FLASHJIT_ERROR_INVALID_ARGUMENT, std::string(name) + ": expected a CUDA tensor");
  if (t.dim() > 4)
    throw Failure(FLASHJIT_ERROR_INVALID_ARGUMENT,
                  std::string(name) + ": expected at most 4 dims, got " + std::to_string(t.dim()));
  flashjit_tensor v{};
  switch (t.scalar_type()) {  // (the runtime checks each argument's dtype and names it)
    case at::kHalf: v.dtype = FLASHJIT_FLOAT16; break;
    case at::kBFloat16: v.dtype = FLASHJIT_BFLOAT16; break;
    case at::kFloat: v.dtype = FLASHJIT_FLOAT32; break;
    case at::kInt: v.dtype = FLASHJIT_INT32; break;
    case at::kLong: v.dtype = FLASHJIT_INT64; break;
    default:
      throw Failure(FLASHJIT_ERROR_INVALID_ARGUMENT,
                    std::string(name) + ": dtype " + std::string(c10::toString(t.scalar_type())) +
                        " is not supported (expected torch.float16 or torch.bfloat16; lengths and page ids int32)");
  }
  v.data = t.data_ptr();
  v.device = t.get_device();
  v.rank = static_cast<int32_t>(t.dim());
  for (int64_t d = 0; d < t.dim(); ++d) {
    v.shape[d] = t.size(d);
    v.strides[d] = t.stride(d);
  }
  return v;
}

// t, or a contiguous copy where the kernels' 16-byte loads cannot read it (as the Python path's
// _kernel_input: a pointer off 16 bytes, a last dim not contiguous, other strides off 16 bytes).
at::Tensor kernel_input(const at::Tensor& t, const char* name) {
  const int64_t vector = 16 / t.element_size();
  bool ready = reinterpret_cast<std::uintptr_t>(t.data_ptr()) % 16 == 0 && t.dim() > 0 && t.stride(-1) == 1;
  for (int64_t d = 0; ready && d + 1 < t.dim(); ++d) ready = t.size(d) <= 1 || t.stride(d) % vector == 0;
  if (ready) return t;
  if (verbose)
    std::fprintf(stderr, "flashjit: %s is copied to an aligned contiguous tensor for the kernels\n", name);
  return t.clone(at::MemoryFormat::Contiguous);
}

struct Options {
  std::optional<double> softmax_scale;
  bool causal = false;
  int64_t window_left = -1, window_right = -1;
  double softcap = 0;
  int64_t backend = FLASHJIT_BACKEND_AUTO, sm_margin = 0, num_splits = 0;
  bool deterministic = false;

  // The C options for a call on `device`'s current stream.
  flashjit_attention_options c_options(int32_t device, bool prepare_backward) const {
    flashjit_attention_options o;
    api.options_init(&o);
    if (softmax_scale) o.softmax_scale = static_cast<float>(*softmax_scale);
    o.causal = causal;
    // (The package checks the integers against int32 and the window's sides against -1..INT32_MAX.)
    o.window_left = static_cast<int32_t>(window_left);
    o.window_right = static_cast<int32_t>(window_right);
    o.softcap = static_cast<float>(softcap);
    o.backend = static_cast<int32_t>(backend);
    o.sm_margin = static_cast<int32_t>(sm_margin);
    o.num_splits = static_cast<int32_t>(num_splits);
    o.deterministic = deterministic;
    o.prepare_backward = prepare_backward;
    void* stream = nullptr;
    if (aoti_torch_get_current_cuda_stream(device, &stream) != 0)
      throw Failure(FLASHJIT_ERROR_CUDA, "torch did not give the current CUDA stream of device " + std::to_string(device));
    o.stream = stream;
    return o;
  }

  // What the backward needs of the forward's options, kept in the node between the two.
  void save(AutogradContext* ctx) const {
    auto& saved = ctx->saved_data;
    if (softmax_scale) saved["softmax_scale"] = *softmax_scale;
    saved["causal"] = causal;
    saved["window_left"] = window_left;
    saved["window_right"] = window_right;
    saved["softcap"] = softcap;
    saved["deterministic"] = deterministic;
  }

  static Options saved_in(AutogradContext* ctx) {
    const auto& data = ctx->saved_data;
    Options options;
    if (auto scale = data.find("softmax_scale"); scale != data.end()) options.softmax_scale = scale->second.toDouble();
    options.causal = data.at("causal").toBool();
    options.window_left = data.at("window_left").toInt();
    options.window_right = data.at("window_right").toInt();
    options.softcap = data.at("softcap").toDouble();
    options.deterministic = data.at("deterministic").toBool();
    return options;
  }
};

// A packed batch's sequence boundaries (flashjit_forward_varlen).
struct Varlen {
  at::Tensor cu_seqlens_q, cu_seqlens_k;
  int64_t max_seqlen_q, max_seqlen_k;
};

// (out, lse): a fixed-length batch's lse is (batch, heads_q, seqlen_q), a packed one's
// (heads_q, total_q); undefined unless with_lse.
std::tuple<at::Tensor, at::Tensor> run_forward(at::Tensor q, at::Tensor k, at::Tensor v, const Options& options,
                                               const Varlen* varlen, bool with_lse, bool prepare_backward) {
  q = kernel_input(q, "q");
  k = kernel_input(k, "k");
  v = kernel_input(v, "v");
  at::Tensor out = at::empty(q.sizes(), q.options());
  at::Tensor lse;
  if (with_lse) {
    const auto fp32 = q.options().dtype(at::kFloat);
    lse = varlen ? at::empty({q.size(1), q.size(0)}, fp32) : at::empty({q.size(0), q.size(2), q.size(1)}, fp32);
  }
  const flashjit_tensor views[5] = {view(q, "q"), view(k, "k"), view(v, "v"), view(out, "out"),
                                    with_lse ? view(lse, "lse") : flashjit_tensor{}};
  const flashjit_tensor* lse_view = with_lse ? &views[4] : nullptr;
  const flashjit_attention_options o = options.c_options(q.get_device(), prepare_backward);
  if (varlen) {
    const flashjit_tensor lengths[2] = {view(varlen->cu_seqlens_q, "cu_seqlens_q"),
                                        view(varlen->cu_seqlens_k, "cu_seqlens_k")};
    check(api.forward_varlen(&views[0], &views[1], &views[2], &views[3], lse_view, &lengths[0], &lengths[1],
                             static_cast<int32_t>(varlen->max_seqlen_q), static_cast<int32_t>(varlen->max_seqlen_k),
                             &o));
  } else {
    check(api.forward(&views[0], &views[1], &views[2], &views[3], lse_view, &o));
  }
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> run_backward(const at::Tensor& dout_in, const at::Tensor& q_in,
                                                            const at::Tensor& k_in, const at::Tensor& v_in,
                                                            const at::Tensor& out, const at::Tensor& lse,
                                                            const Options& options, const Varlen* varlen) {
  const at::Tensor dout = kernel_input(dout_in, "dout"), q = kernel_input(q_in, "q"), k = kernel_input(k_in, "k"),
                   v = kernel_input(v_in, "v");
  at::Tensor dq = at::empty_like(q), dk = at::empty_like(k), dv = at::empty_like(v);
  const flashjit_tensor views[9] = {view(q, "q"),       view(k, "k"),     view(v, "v"),
                                    view(out, "out"),   view(dout, "dout"), view(lse, "lse"),
                                    view(dq, "dq"),     view(dk, "dk"),   view(dv, "dv")};
  const flashjit_attention_options o = options.c_options(q.get_device(), false);
  if (varlen) {
    const flashjit_tensor lengths[2] = {view(varlen->cu_seqlens_q, "cu_seqlens_q"),
                                        view(varlen->cu_seqlens_k, "cu_seqlens_k")};
    check(api.backward_varlen(&views[0], &views[1], &views[2], &views[3], &views[4], &views[5], &views[6], &views[7],
                              &views[8], &lengths[0], &lengths[1], static_cast<int32_t>(varlen->max_seqlen_q),
                              static_cast<int32_t>(varlen->max_seqlen_k), &o));
  } else {
    check(api.backward(&views[0], &views[1], &views[2], &views[3], &views[4], &views[5], &views[6], &views[7],
                       &views[8], &o));
  }
  return {dq, dk, dv};
}

// The nodes: q, k, v saved as given (the backward copies them again where the kernels need it, as
// the Python path does), the options beside them. lse is not differentiable: a loss through it
// fails loudly (as in flash-attn), and no zero-filled dLSE is made.
struct Attention : torch::autograd::Function<Attention> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const Options& options) {
    auto [out, lse] = run_forward(q, k, v, options, nullptr, /*with_lse=*/true, /*prepare_backward=*/true);
    ctx->mark_non_differentiable({lse});
    ctx->set_materialize_grads(false);
    ctx->save_for_backward({q, k, v, out, lse});
    options.save(ctx);
    return {out, lse};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    if (!grads[0].defined()) return {at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};  // out not in the loss
    const variable_list saved = ctx->get_saved_variables();
    auto [dq, dk, dv] = run_backward(grads[0], saved[0], saved[1], saved[2], saved[3], saved[4],
                                     Options::saved_in(ctx), nullptr);
    return {dq, dk, dv, at::Tensor()};
  }
};

struct AttentionVarlen : torch::autograd::Function<AttentionVarlen> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const Varlen& varlen, const Options& options) {
    auto [out, lse] = run_forward(q, k, v, options, &varlen, /*with_lse=*/true, /*prepare_backward=*/true);
    ctx->mark_non_differentiable({lse});
    ctx->set_materialize_grads(false);
    ctx->save_for_backward({q, k, v, out, lse, varlen.cu_seqlens_q, varlen.cu_seqlens_k});
    ctx->saved_data["max_seqlen_q"] = varlen.max_seqlen_q;
    ctx->saved_data["max_seqlen_k"] = varlen.max_seqlen_k;
    options.save(ctx);
    return {out, lse};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    if (!grads[0].defined()) return {at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
    const variable_list saved = ctx->get_saved_variables();
    const Varlen varlen{saved[5], saved[6], ctx->saved_data.at("max_seqlen_q").toInt(),
                        ctx->saved_data.at("max_seqlen_k").toInt()};
    auto [dq, dk, dv] = run_backward(grads[0], saved[0], saved[1], saved[2], saved[3], saved[4],
                                     Options::saved_in(ctx), &varlen);
    return {dq, dk, dv, at::Tensor(), at::Tensor()};
  }
};

// q over a contiguous or paged KV cache, k_new and v_new appended in place (flashjit_forward_kvcache).
// The caches are written in place, so they are passed as they are; q and the new tokens are copied
// where the kernels cannot read them. Returns (out, lse or undefined).
std::tuple<at::Tensor, at::Tensor> run_forward_kvcache(at::Tensor q, const at::Tensor& k_cache,
                                                       const at::Tensor& v_cache, std::optional<at::Tensor> k_new,
                                                       std::optional<at::Tensor> v_new,
                                                       const std::optional<at::Tensor>& cache_seqlens,
                                                       const std::optional<at::Tensor>& block_table,
                                                       const Options& options, bool with_lse) {
  q = kernel_input(q, "q");
  if (k_new) k_new = kernel_input(*k_new, "k");
  if (v_new) v_new = kernel_input(*v_new, "v");
  at::Tensor out = at::empty(q.sizes(), q.options());
  at::Tensor lse;
  if (with_lse) lse = at::empty({q.size(0), q.size(2), q.size(1)}, q.options().dtype(at::kFloat));
  auto optional_view = [](const std::optional<at::Tensor>& t, const char* name) {
    return t ? std::optional<flashjit_tensor>(view(*t, name)) : std::nullopt;
  };
  const flashjit_tensor views[4] = {view(q, "q"), view(k_cache, "k_cache"), view(v_cache, "v_cache"), view(out, "out")};
  const auto table = optional_view(block_table, "block_table"), lengths = optional_view(cache_seqlens, "cache_seqlens");
  const auto k_view = optional_view(k_new, "k"), v_view = optional_view(v_new, "v");
  const auto lse_view = with_lse ? std::optional<flashjit_tensor>(view(lse, "lse")) : std::nullopt;
  auto pointer = [](const std::optional<flashjit_tensor>& t) { return t ? &*t : nullptr; };
  const flashjit_attention_options o = options.c_options(q.get_device(), false);
  check(api.forward_kvcache(&views[0], &views[1], &views[2], pointer(table), pointer(lengths), pointer(k_view),
                            pointer(v_view), &views[3], pointer(lse_view), &o));
  return {out, lse};
}

Options make_options(std::optional<double> softmax_scale, bool causal, int64_t window_left, int64_t window_right,
                     double softcap, int64_t backend, int64_t sm_margin, bool deterministic) {
  Options options;
  options.softmax_scale = softmax_scale;
  options.causal = causal;
  options.window_left = window_left;
  options.window_right = window_right;
  options.softcap = softcap;
  options.backend = backend;
  options.sm_margin = sm_margin;
  options.deterministic = deterministic;
  return options;
}

py::tuple out_and_lse(const std::tuple<at::Tensor, at::Tensor>& result) {
  const at::Tensor& lse = std::get<1>(result);
  return py::make_tuple(std::get<0>(result), lse.defined() ? py::cast(lse) : py::none());
}

}  // namespace

// Every call releases the GIL while it runs: a cold cache compiles inside it, and other Python
// threads run on.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "flashjit's attention calls and autograd nodes in C++ (see _autograd.cpp)";

  // The C API's functions by name (their addresses in the library the package loaded).
  m.def("bind", [](const std::map<std::string, std::uintptr_t>& functions, py::object error, bool be_verbose) {
    auto bind = [&](auto& slot, const char* name) {
      slot = reinterpret_cast<std::remove_reference_t<decltype(slot)>>(functions.at(name));
    };
    bind(api.options_init, "flashjit_attention_options_init");
    bind(api.forward, "flashjit_forward");
    bind(api.backward, "flashjit_backward");
    bind(api.forward_varlen, "flashjit_forward_varlen");
    bind(api.backward_varlen, "flashjit_backward_varlen");
    bind(api.forward_kvcache, "flashjit_forward_kvcache");
    bind(api.last_error, "flashjit_last_error");
    delete error_class;
    error_class = new py::object(std::move(error));
    verbose = be_verbose;
  });

  // Inference: the raw calls. Return (out, lse or None).
  m.def("forward", [](const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                      std::optional<double> softmax_scale, bool causal, int64_t window_left, int64_t window_right,
                      double softcap, int64_t backend, int64_t sm_margin, bool with_lse) {
    std::tuple<at::Tensor, at::Tensor> result;
    {
      py::gil_scoped_release unlocked;
      const Options options =
          make_options(softmax_scale, causal, window_left, window_right, softcap, backend, sm_margin, false);
      result = run_forward(q, k, v, options, nullptr, with_lse, false);
    }
    return out_and_lse(result);
  });

  m.def("forward_varlen", [](const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q,
                             int64_t max_seqlen_k, std::optional<double> softmax_scale, bool causal,
                             int64_t window_left, int64_t window_right, double softcap, int64_t backend,
                             int64_t sm_margin, bool with_lse) {
    std::tuple<at::Tensor, at::Tensor> result;
    {
      py::gil_scoped_release unlocked;
      const Options options =
          make_options(softmax_scale, causal, window_left, window_right, softcap, backend, sm_margin, false);
      const Varlen varlen{cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k};
      result = run_forward(q, k, v, options, &varlen, with_lse, false);
    }
    return out_and_lse(result);
  });

  m.def("forward_kvcache", [](const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                              std::optional<at::Tensor> k, std::optional<at::Tensor> v,
                              std::optional<at::Tensor> cache_seqlens, std::optional<at::Tensor> block_table,
                              std::optional<double> softmax_scale, bool causal, int64_t window_left,
                              int64_t window_right, double softcap, int64_t num_splits, bool with_lse) {
    std::tuple<at::Tensor, at::Tensor> result;
    {
      py::gil_scoped_release unlocked;
      Options options = make_options(softmax_scale, causal, window_left, window_right, softcap,
                                     FLASHJIT_BACKEND_AUTO, 0, false);
      options.num_splits = num_splits;
      result = run_forward_kvcache(q, k_cache, v_cache, k, v, cache_seqlens, block_table, options, with_lse);
    }
    return out_and_lse(result);
  });

  // Training: the autograd nodes. Return (out, lse), lse not differentiable.
  m.def("attention", [](const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                        std::optional<double> softmax_scale, bool causal, int64_t window_left, int64_t window_right,
                        double softcap, int64_t backend, int64_t sm_margin, bool deterministic) {
    variable_list outputs;
    {
      py::gil_scoped_release unlocked;
      outputs = Attention::apply(q, k, v,
                                 make_options(softmax_scale, causal, window_left, window_right, softcap, backend,
                                              sm_margin, deterministic));
    }
    return std::make_tuple(outputs[0], outputs[1]);
  });

  m.def("attention_varlen", [](const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q,
                               int64_t max_seqlen_k, std::optional<double> softmax_scale, bool causal,
                               int64_t window_left, int64_t window_right, double softcap, int64_t backend,
                               int64_t sm_margin, bool deterministic) {
    variable_list outputs;
    {
      py::gil_scoped_release unlocked;
      outputs = AttentionVarlen::apply(q, k, v, Varlen{cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k},
                                       make_options(softmax_scale, causal, window_left, window_right, softcap,
                                                    backend, sm_margin, deterministic));
    }
    return std::make_tuple(outputs[0], outputs[1]);
  });

  py::register_exception_translator([](std::exception_ptr failure) {
    try {
      if (failure) std::rethrow_exception(failure);
    } catch (const Failure& e) {
      if (e.status == FLASHJIT_ERROR_INVALID_ARGUMENT) {
        PyErr_SetString(PyExc_ValueError, e.what());
      } else {
        py::object error = (*error_class)(e.status, e.what());
        PyErr_SetObject(error_class->ptr(), error.ptr());
      }
    }
  });
}
