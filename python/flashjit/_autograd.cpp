// flashjit._autograd: the dense attention's eager calls and its autograd node in C++ (a torch
// extension the package compiles on first use, python/flashjit/_extension.py). The ctypes path
// costs Python work on every call, and its backward runs Python on the autograd thread; here the
// forward builds its C structs in C++ and the backward is a C++ node, as SDPA's are.
//
// The C API comes from the library the package already loaded: bind() takes its functions'
// addresses, so this module links only against torch.
#include <torch/csrc/autograd/custom_function.h>
#include <torch/python.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <string>
#include <tuple>

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
  switch (t.scalar_type()) {
    case at::kHalf: v.dtype = FLASHJIT_FLOAT16; break;
    case at::kBFloat16: v.dtype = FLASHJIT_BFLOAT16; break;
    case at::kFloat: v.dtype = FLASHJIT_FLOAT32; break;
    default:
      throw Failure(FLASHJIT_ERROR_INVALID_ARGUMENT,
                    std::string(name) + ": dtype " + std::string(c10::toString(t.scalar_type())) +
                        " is not supported (expected torch.float16 or torch.bfloat16)");
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
  bool causal;
  int64_t window_left, window_right;
  double softcap;
  int64_t backend, sm_margin;
  bool deterministic;

  // The C options for a call on `device`'s current stream.
  flashjit_attention_options c_options(int32_t device, bool prepare_backward) const {
    flashjit_attention_options o;
    api.options_init(&o);
    if (softmax_scale) o.softmax_scale = static_cast<float>(*softmax_scale);
    o.causal = causal;
    o.window_left = static_cast<int32_t>(window_left);  // (sides checked by the package: -1..INT32_MAX)
    o.window_right = static_cast<int32_t>(window_right);
    o.softcap = static_cast<float>(softcap);
    o.backend = static_cast<int32_t>(backend);
    o.sm_margin = static_cast<int32_t>(sm_margin);
    o.deterministic = deterministic;
    o.prepare_backward = prepare_backward;
    void* stream = nullptr;
    if (aoti_torch_get_current_cuda_stream(device, &stream) != 0)
      throw Failure(FLASHJIT_ERROR_CUDA, "torch did not give the current CUDA stream of device " + std::to_string(device));
    o.stream = stream;
    return o;
  }
};

// (out, lse); lse undefined unless with_lse.
std::tuple<at::Tensor, at::Tensor> run_forward(at::Tensor q, at::Tensor k, at::Tensor v, const Options& options,
                                               bool with_lse, bool prepare_backward) {
  q = kernel_input(q, "q");
  k = kernel_input(k, "k");
  v = kernel_input(v, "v");
  at::Tensor out = at::empty(q.sizes(), q.options());
  at::Tensor lse;
  if (with_lse) lse = at::empty({q.size(0), q.size(2), q.size(1)}, q.options().dtype(at::kFloat));
  const flashjit_tensor views[5] = {view(q, "q"), view(k, "k"), view(v, "v"), view(out, "out"),
                                    with_lse ? view(lse, "lse") : flashjit_tensor{}};
  const flashjit_attention_options o = options.c_options(q.get_device(), prepare_backward);
  check(api.forward(&views[0], &views[1], &views[2], &views[3], with_lse ? &views[4] : nullptr, &o));
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> run_backward(const at::Tensor& dout_in, const at::Tensor& q_in,
                                                            const at::Tensor& k_in, const at::Tensor& v_in,
                                                            const at::Tensor& out, const at::Tensor& lse,
                                                            const Options& options) {
  const at::Tensor dout = kernel_input(dout_in, "dout"), q = kernel_input(q_in, "q"), k = kernel_input(k_in, "k"),
                   v = kernel_input(v_in, "v");
  at::Tensor dq = at::empty_like(q), dk = at::empty_like(k), dv = at::empty_like(v);
  const flashjit_tensor views[9] = {view(q, "q"),       view(k, "k"),     view(v, "v"),
                                    view(out, "out"),   view(dout, "dout"), view(lse, "lse"),
                                    view(dq, "dq"),     view(dk, "dk"),   view(dv, "dv")};
  const flashjit_attention_options o = options.c_options(q.get_device(), false);
  check(api.backward(&views[0], &views[1], &views[2], &views[3], &views[4], &views[5], &views[6], &views[7],
                     &views[8], &o));
  return {dq, dk, dv};
}

// The node: q, k, v saved as given (the backward copies them again where the kernels need it,
// as the Python path does), the options beside them.
struct Attention : torch::autograd::Function<Attention> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const Options& options) {
    auto [out, lse] = run_forward(q, k, v, options, /*with_lse=*/true, /*prepare_backward=*/true);
    ctx->mark_non_differentiable({lse});  // a loss through the LSE fails loudly (as in flash-attn)
    ctx->set_materialize_grads(false);    // no zero-filled dLSE: it is unused
    ctx->save_for_backward({q, k, v, out, lse});
    auto& saved = ctx->saved_data;
    if (options.softmax_scale) saved["softmax_scale"] = *options.softmax_scale;
    saved["causal"] = options.causal;
    saved["window_left"] = options.window_left;
    saved["window_right"] = options.window_right;
    saved["softcap"] = options.softcap;
    saved["deterministic"] = options.deterministic;
    return {out, lse};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const at::Tensor& dout = grads[0];
    if (!dout.defined()) return {at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};  // out not in the loss
    const variable_list saved = ctx->get_saved_variables();
    const auto& data = ctx->saved_data;
    Options options{};
    if (auto scale = data.find("softmax_scale"); scale != data.end()) options.softmax_scale = scale->second.toDouble();
    options.causal = data.at("causal").toBool();
    options.window_left = data.at("window_left").toInt();
    options.window_right = data.at("window_right").toInt();
    options.softcap = data.at("softcap").toDouble();
    options.backend = FLASHJIT_BACKEND_AUTO;
    options.deterministic = data.at("deterministic").toBool();
    auto [dq, dk, dv] = run_backward(dout, saved[0], saved[1], saved[2], saved[3], saved[4], options);
    return {dq, dk, dv, at::Tensor()};
  }
};

Options make_options(std::optional<double> softmax_scale, bool causal, int64_t window_left, int64_t window_right,
                     double softcap, int64_t backend, int64_t sm_margin, bool deterministic) {
  return {softmax_scale, causal, window_left, window_right, softcap, backend, sm_margin, deterministic};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "flashjit's dense attention calls and autograd node in C++ (see _autograd.cpp)";

  m.def("bind", [](std::uintptr_t options_init, std::uintptr_t forward, std::uintptr_t backward,
                   std::uintptr_t last_error, py::object error, bool be_verbose) {
    api.options_init = reinterpret_cast<decltype(api.options_init)>(options_init);
    api.forward = reinterpret_cast<decltype(api.forward)>(forward);
    api.backward = reinterpret_cast<decltype(api.backward)>(backward);
    api.last_error = reinterpret_cast<decltype(api.last_error)>(last_error);
    delete error_class;
    error_class = new py::object(std::move(error));
    verbose = be_verbose;
  });

  // Inference: the raw call. Returns (out, lse or None).
  m.def("forward", [](const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                      std::optional<double> softmax_scale, bool causal, int64_t window_left, int64_t window_right,
                      double softcap, int64_t backend, int64_t sm_margin, bool with_lse) -> py::tuple {
    std::tuple<at::Tensor, at::Tensor> result;
    {
      py::gil_scoped_release unlocked;  // a cold cache compiles here: other Python threads run on
      result = run_forward(q, k, v,
                           make_options(softmax_scale, causal, window_left, window_right, softcap, backend, sm_margin,
                                        false),
                           with_lse, false);
    }
    const at::Tensor& lse = std::get<1>(result);
    return py::make_tuple(std::get<0>(result), lse.defined() ? py::cast(lse) : py::none());
  });

  // Training: the autograd node. Returns (out, lse), lse not differentiable.
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
