"""flashjit: FlashAttention kernels compiled just in time (NVRTC), for PyTorch tensors.

    from flashjit import flash_attn_func
    out = flash_attn_func(q, k, v, causal=True)            # q, k, v: (batch, seqlen, heads, head_dim)
    out, lse = flash_attn_func(q, k, v, return_lse=True)

The argument names follow the flash-attn package. Calls run on the current torch stream of the
tensors' device; the first call for a new kernel compiles it (or loads it from the disk cache).
"""
import ctypes
import math
import os
import sys
import threading

from . import _capi, _extension

__all__ = ["flash_attn_func", "ring_flash_attn_func", "ring_flash_attn_local", "ring_shard", "ring_unshard",
           "ring_flash_attn_varlen_func", "ring_flash_attn_varlen_local", "ring_shard_varlen", "ring_unshard_varlen", "AttentionMod", "BlockMask", "create_block_mask", "block_mask_from_tiles", "flash_attn_varlen_func", "flash_attn_with_kvcache", "check_kvcache", "FlashJitError", "build_torch_extension", "cache_stats", "load_tuning_db", "quantize_fp8",
           "__version__"]

_lib = _capi.load()
__version__ = _lib.flashjit_version().decode()

from ._fp8 import quantize_fp8  # noqa: E402
from ._modifiers import AttentionMod, BlockMask, block_mask_from_tiles, create_block_mask  # noqa: E402
from ._ring import (ring_flash_attn_func, ring_flash_attn_local, ring_flash_attn_varlen_func,  # noqa: E402
                    ring_flash_attn_varlen_local, ring_shard, ring_shard_varlen, ring_unshard, ring_unshard_varlen)


class FlashJitError(RuntimeError):
    """A failure reported by the flashjit runtime; `status` names its kind."""

    def __init__(self, status, message):
        super().__init__(message)
        self.status = _capi.STATUS_NAMES.get(status, str(status))


def _check(status):
    if status != 0:
        message = _lib.flashjit_last_error().decode(errors="replace")
        if status == 1:
            raise ValueError(message)
        raise FlashJitError(status, message)


_torch_module = None


def _torch():
    """torch, imported on first use: the package loads without it for the C API alone. (Kept in a
    global: an import statement on every call costs host time.)"""
    global _torch_module
    if _torch_module is None:
        import torch
        _torch_module = torch
    return _torch_module


_DTYPE_CODES = {}  # torch dtype -> C API code, filled on first use (torch is imported lazily)


def _dtype_code(tensor, name):
    if not _DTYPE_CODES:
        torch = _torch()
        _DTYPE_CODES.update({torch.float16: _capi.FLOAT16, torch.bfloat16: _capi.BFLOAT16,
                             torch.float32: _capi.FLOAT32, torch.int32: _capi.INT32,
                             torch.float8_e4m3fn: _capi.FLOAT8_E4M3})
    code = _DTYPE_CODES.get(tensor.dtype)
    if code is None:
        raise ValueError(f"{name}: dtype {tensor.dtype} is not supported (expected torch.float16 or torch.bfloat16)")
    return code


def _view(tensor, name):
    if not tensor.is_cuda:
        raise ValueError(f"{name}: expected a CUDA tensor, got one on {tensor.device}")
    rank = tensor.dim()
    if rank > 4:
        raise ValueError(f"{name}: expected at most 4 dims, got {rank}")
    t = _capi.Tensor(data=tensor.data_ptr(), dtype=_dtype_code(tensor, name), device=tensor.device.index, rank=rank)
    t.shape[:rank] = tensor.shape
    t.strides[:rank] = tensor.stride()
    return t


def _options(tensor, softmax_scale, causal, window_left, window_right, softcap, backend="auto", deterministic=False,
             sm_margin=0, prepare_backward=False):
    """The C options; prepare_backward: a forward whose backward follows (autograd), so that the backward's
    kernel compiles beside the forward's on a cold cache (for `deterministic` as given)."""
    o = _capi.AttentionOptions()
    _lib.flashjit_attention_options_init(ctypes.byref(o))
    if softmax_scale is not None:
        o.softmax_scale = softmax_scale
    o.causal = bool(causal)
    o.window_left, o.window_right = _capi.window(window_left, window_right)
    o.softcap = float(softcap)
    o.backend = _capi.BACKENDS[backend]
    o.deterministic = bool(deterministic)
    o.sm_margin = _capi.int32(sm_margin, "sm_margin")
    o.prepare_backward = bool(prepare_backward)
    o.stream = _torch().cuda.current_stream(tensor.device).cuda_stream
    return o


def _current_stream(device_index):
    """The raw handle of the current torch stream of CUDA device `device_index` (the cheapest way
    torch offers)."""
    torch = _torch()
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:
        return raw(device_index)
    return torch.cuda.current_stream(device_index).cuda_stream


class _CallPlan:
    """A C call's argument structs for one key (every tensor's shape, strides, dtype and device, and
    the options), built once per thread; a call then sets only the data pointers and the stream. `copy`: some input's strides
    are not the kernels' (see _kernel_input), so calls take the copying path instead. `scalars`: plain
    arguments between the tensors and the options."""
    __slots__ = ("views", "options", "args", "copy")

    def __init__(self, named_tensors, options, copy=False, scalars=()):
        # An optional tensor left out (None) is a NULL argument; `call` takes the others' pointers.
        self.views = [_view(t, name) for t, name in named_tensors if t is not None]
        views = iter(self.views)
        self.options = options
        self.args = [None if t is None else ctypes.byref(next(views)) for t, _ in named_tensors]
        self.args += list(scalars)
        self.args.append(ctypes.byref(options))
        self.copy = copy

    def call(self, function, pointers, stream):
        for view, pointer in zip(self.views, pointers):
            view.data = pointer
        self.options.stream = stream
        _check(function(*self.args))


_thread = threading.local()
_MAX_PLANS = 256  # per thread and operation; a process of endless shapes starts over


def _plans(operation):
    plans = getattr(_thread, operation, None)
    if plans is None or len(plans) >= _MAX_PLANS:
        plans = {}
        setattr(_thread, operation, plans)
    return plans


def _check_options(softmax_scale, window_size, backend):
    if softmax_scale is not None and not (softmax_scale > 0 and math.isfinite(softmax_scale)):
        raise ValueError(f"softmax_scale must be a positive finite number, got {softmax_scale}")
    if len(window_size) != 2:
        raise ValueError(f"window_size must be a (left, right) pair, got {window_size}")
    if backend not in _capi.BACKENDS:
        raise ValueError(f"backend must be one of {sorted(_capi.BACKENDS)}, got {backend!r}")


def _kernel_ready(t):
    """The layout the kernels read: last dim contiguous, other strides multiples of 16 bytes."""
    vector = 16 // t.element_size()
    return t.stride(-1) == 1 and all(s % vector == 0 for s, n in zip(t.stride()[:-1], t.shape[:-1]) if n > 1)


_VERBOSE = os.environ.get("FLASHJIT_VERBOSE", "") not in ("", "0")


def _kernel_input(t, name):
    """t, or a contiguous copy where the kernels' 16-byte loads cannot read it: a data pointer off
    16-byte alignment or strides off 8 elements (a slice of a packed tensor, say). PyTorch's SDPA
    takes such tensors too; the copy costs one pass over t. FLASHJIT_VERBOSE=1 reports it."""
    if t.data_ptr() % 16 == 0 and _kernel_ready(t):
        return t
    if _VERBOSE:
        print(f"flashjit: {name} (data pointer {t.data_ptr():#x}, strides {tuple(t.stride())}) is copied to an "
              "aligned contiguous tensor for the kernels", file=sys.stderr)
    return t.clone(memory_format=_torch().contiguous_format)


# The raw calls, on the current stream of the tensors' device. _torch_ops wraps them in custom ops and
# autograd.Functions.

def _forward(q, k, v, softmax_scale, causal, window_left, window_right, softcap, backend, sm_margin, with_lse=True,
             may_copy=True, prepare_backward=False, deterministic=False):
    """(out, lse); lse None unless with_lse (inference that does not return it skips writing it).
    prepare_backward, deterministic: see _options."""
    torch = _torch()
    plans = _plans("forward")
    # (Device indices, not torch.device objects, which cost host time to make; the callers have
    # checked that the tensors are CUDA tensors.)
    key = (q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), q.dtype, k.dtype, v.dtype, q.get_device(),
           k.get_device(), v.get_device(), softmax_scale, causal, window_left, window_right, softcap, backend,
           sm_margin, with_lse, prepare_backward, deterministic)
    plan = plans.get(key)
    pointers = (q.data_ptr(), k.data_ptr(), v.data_ptr())
    if may_copy and ((plan is not None and plan.copy) or (pointers[0] | pointers[1] | pointers[2]) & 15):
        # (Once: a copy the kernels still cannot read, such as a head_dim off 8, gets the C API's error.)
        return _forward(_kernel_input(q, "q"), _kernel_input(k, "k"), _kernel_input(v, "v"), softmax_scale, causal,
                        window_left, window_right, softcap, backend, sm_margin, with_lse, may_copy=False,
                        prepare_backward=prepare_backward, deterministic=deterministic)
    out = q.new_empty(q.shape)
    lse = q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32) if with_lse else None
    if plan is None:
        options = _options(q, softmax_scale, causal, window_left, window_right, softcap, backend, deterministic,
                           sm_margin, prepare_backward)
        copy = not all(_kernel_ready(t) for t in (q, k, v))
        plan = plans[key] = _CallPlan(((q, "q"), (k, "k"), (v, "v"), (out, "out"), (lse, "lse")), options, copy)
        if copy and may_copy:
            return _forward(q, k, v, softmax_scale, causal, window_left, window_right, softcap, backend, sm_margin,
                            with_lse, prepare_backward=prepare_backward, deterministic=deterministic)
    pointers += (out.data_ptr(), lse.data_ptr()) if with_lse else (out.data_ptr(),)
    plan.call(_lib.flashjit_forward, pointers, _current_stream(q.get_device()))
    return out, lse


def _forward_fp8(q, k, v, softmax_scale, causal, window_left, window_right, softcap, backend, sm_margin, q_descale,
                 k_descale, v_descale, varlen=None):
    """(out bf16, lse) of float8_e4m3fn q, k, v with optional float32 (batch, heads_kv) descales;
    varlen: (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) for packed 3-D tensors."""
    torch = _torch()
    for t, name in ((q, "q"), (k, "k"), (v, "v")):
        if t.dtype != torch.float8_e4m3fn:
            raise ValueError(f"{name}: FP8 attention takes torch.float8_e4m3fn q, k and v, got {t.dtype}")
        if t.requires_grad and torch.is_grad_enabled():
            raise ValueError(f"{name}: FP8 attention is forward-only (no gradients); run it in torch.bfloat16 to train")
    if varlen is None:
        return _forward_fp8_planned(q, k, v, softmax_scale, causal, window_left, window_right, softcap, backend,
                                    sm_margin, (q_descale, k_descale, v_descale))
    q, k, v = _kernel_input(q, "q"), _kernel_input(k, "k"), _kernel_input(v, "v")
    out = torch.empty(q.shape, dtype=torch.bfloat16, device=q.device)
    lse = torch.empty((q.shape[1], q.shape[0]), dtype=torch.float32, device=q.device)
    views = [_view(t, name) for t, name in ((q, "q"), (k, "k"), (v, "v"), (out, "out"), (lse, "lse"))]
    descales = [None if t is None else _view(t, name)
                for t, name in ((q_descale, "q_descale"), (k_descale, "k_descale"), (v_descale, "v_descale"))]
    lengths = [_view(varlen[0], "cu_seqlens_q"), _view(varlen[1], "cu_seqlens_k")]
    max_lengths = (int(varlen[2]), int(varlen[3]))
    with torch.cuda.device(q.device):
        options = _options(q, softmax_scale, causal, window_left, window_right, softcap, backend, sm_margin=sm_margin)
        by_ref = [None if view is None else ctypes.byref(view) for view in views + descales + lengths]
        _check(_lib.flashjit_forward_fp8(*by_ref, *max_lengths, ctypes.byref(options)))
    return out, lse


def _forward_fp8_planned(q, k, v, softmax_scale, causal, window_left, window_right, softcap, backend, sm_margin,
                         descales, may_copy=True):
    """_forward_fp8 of a fixed-length batch through a per-shape _CallPlan, as _forward."""
    torch = _torch()
    plans = _plans("forward_fp8")
    key = (q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), q.device, k.device, v.device,
           tuple(None if d is None else (d.shape, d.stride(), d.dtype, d.device) for d in descales), softmax_scale,
           causal, window_left, window_right, softcap, backend, sm_margin)
    plan = plans.get(key)
    pointers = (q.data_ptr(), k.data_ptr(), v.data_ptr())
    if may_copy and ((plan is not None and plan.copy) or (pointers[0] | pointers[1] | pointers[2]) & 15):
        return _forward_fp8_planned(_kernel_input(q, "q"), _kernel_input(k, "k"), _kernel_input(v, "v"), softmax_scale,
                                    causal, window_left, window_right, softcap, backend, sm_margin, descales,
                                    may_copy=False)
    out = torch.empty(q.shape, dtype=torch.bfloat16, device=q.device)
    lse = torch.empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32, device=q.device)
    if plan is None:
        options = _options(q, softmax_scale, causal, window_left, window_right, softcap, backend, sm_margin=sm_margin)
        copy = not all(_kernel_ready(t) for t in (q, k, v))
        named = ((q, "q"), (k, "k"), (v, "v"), (out, "out"), (lse, "lse"), (descales[0], "q_descale"),
                 (descales[1], "k_descale"), (descales[2], "v_descale"), (None, "cu_seqlens_q"), (None, "cu_seqlens_k"))
        plan = plans[key] = _CallPlan(named, options, copy, scalars=(0, 0))
        if copy and may_copy:
            return _forward_fp8_planned(q, k, v, softmax_scale, causal, window_left, window_right, softcap, backend,
                                        sm_margin, descales)
    pointers += (out.data_ptr(), lse.data_ptr()) + tuple(d.data_ptr() for d in descales if d is not None)
    plan.call(_lib.flashjit_forward_fp8, pointers, _current_stream(q.get_device()))
    return out, lse


def _forward_mod(q, k, v, softmax_scale, causal, window_left, window_right, softcap, backend, sm_margin, mod,
                 block_mask, prepare_backward=False):
    from . import _modifiers
    torch = _torch()
    q, k, v = _kernel_input(q, "q"), _kernel_input(k, "k"), _kernel_input(v, "v")
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32, device=q.device)
    if mod is not None:
        mod_tensors, mod_count = mod._tensor_views()
    else:
        mod_tensors, mod_count = None, 0
    mask = _modifiers.as_block_mask(block_mask)._c_struct() if block_mask is not None else None
    with torch.cuda.device(q.device):
        options = _options(q, softmax_scale, causal, window_left, window_right, softcap, backend, sm_margin=sm_margin,
                           prepare_backward=prepare_backward)
        _check(_lib.flashjit_forward_mod(ctypes.byref(_view(q, "q")), ctypes.byref(_view(k, "k")),
                                         ctypes.byref(_view(v, "v")), ctypes.byref(_view(out, "out")),
                                         ctypes.byref(_view(lse, "lse")), mod._handle if mod is not None else None,
                                         mod_tensors, mod_count, ctypes.byref(mask) if mask is not None else None,
                                         ctypes.byref(options)))
    return out, lse


def _backward_mod(dout, q, k, v, out, lse, softmax_scale, causal, window_left, window_right, softcap, mod, block_mask):
    from . import _modifiers
    torch = _torch()
    q, k, v, dout = _kernel_input(q, "q"), _kernel_input(k, "k"), _kernel_input(v, "v"), _kernel_input(dout, "dout")
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    mod_tensors, mod_count = mod._tensor_views() if mod is not None else (None, 0)
    mask = _modifiers.as_block_mask(block_mask)._c_struct() if block_mask is not None else None
    with torch.cuda.device(q.device):
        options = _options(q, softmax_scale, causal, window_left, window_right, softcap, "auto")
        views = [_view(t, n) for t, n in ((q, "q"), (k, "k"), (v, "v"), (out, "out"), (dout, "dout"), (lse, "lse"),
                                          (dq, "dq"), (dk, "dk"), (dv, "dv"))]
        _check(_lib.flashjit_backward_mod(*(ctypes.byref(t) for t in views), mod._handle if mod is not None else None,
                                          mod_tensors, mod_count, ctypes.byref(mask) if mask is not None else None,
                                          ctypes.byref(options)))
    return dq, dk, dv


def _backward(dout, q, k, v, out, lse, softmax_scale, causal, window_left, window_right, softcap, deterministic,
              may_copy=True):
    torch = _torch()
    plans = _plans("backward")
    key = (dout.shape, dout.stride(), q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), out.shape,
           out.stride(), lse.shape, lse.stride(), q.dtype, k.dtype, v.dtype, out.dtype, dout.dtype, lse.dtype,
           q.get_device(), k.get_device(), v.get_device(), out.get_device(), dout.get_device(), lse.get_device(),
           softmax_scale, causal, window_left, window_right, softcap, deterministic)
    plan = plans.get(key)
    pointers = (q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), dout.data_ptr(), lse.data_ptr())
    if may_copy and ((plan is not None and plan.copy) or (pointers[0] | pointers[1] | pointers[2] | pointers[4]) & 15):
        return _backward(_kernel_input(dout, "dout"), _kernel_input(q, "q"), _kernel_input(k, "k"),
                         _kernel_input(v, "v"), out, lse, softmax_scale, causal, window_left, window_right, softcap,
                         deterministic, may_copy=False)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    if plan is None:
        options = _options(q, softmax_scale, causal, window_left, window_right, softcap, "auto", deterministic)
        copy = not all(_kernel_ready(t) for t in (q, k, v, dout))
        plan = plans[key] = _CallPlan(((q, "q"), (k, "k"), (v, "v"), (out, "out"), (dout, "dout"), (lse, "lse"),
                                       (dq, "dq"), (dk, "dk"), (dv, "dv")), options, copy)
        if copy and may_copy:
            return _backward(dout, q, k, v, out, lse, softmax_scale, causal, window_left, window_right, softcap,
                             deterministic)
    plan.call(_lib.flashjit_backward, pointers + (dq.data_ptr(), dk.data_ptr(), dv.data_ptr()),
              _current_stream(q.get_device()))
    return dq, dk, dv


def _forward_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                    window_left, window_right, softcap, backend, sm_margin, prepare_backward=False, deterministic=False):
    torch = _torch()
    q, k, v = _kernel_input(q, "q"), _kernel_input(k, "k"), _kernel_input(v, "v")
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((q.shape[1], q.shape[0]), dtype=torch.float32, device=q.device)
    with torch.cuda.device(q.device):
        options = _options(q, softmax_scale, causal, window_left, window_right, softcap, backend, deterministic,
                           sm_margin, prepare_backward)
        _check(_lib.flashjit_forward_varlen(
            ctypes.byref(_view(q, "q")), ctypes.byref(_view(k, "k")), ctypes.byref(_view(v, "v")),
            ctypes.byref(_view(out, "out")), ctypes.byref(_view(lse, "lse")),
            ctypes.byref(_view(cu_seqlens_q, "cu_seqlens_q")), ctypes.byref(_view(cu_seqlens_k, "cu_seqlens_k")),
            _capi.int32(max_seqlen_q, "max_seqlen_q"), _capi.int32(max_seqlen_k, "max_seqlen_k"),
            ctypes.byref(options)))
    return out, lse


def _backward_varlen(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                     causal, window_left, window_right, softcap, deterministic):
    torch = _torch()
    q, k, v, dout = _kernel_input(q, "q"), _kernel_input(k, "k"), _kernel_input(v, "v"), _kernel_input(dout, "dout")
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    with torch.cuda.device(q.device):
        options = _options(q, softmax_scale, causal, window_left, window_right, softcap, "auto", deterministic)
        views = [_view(t, n) for t, n in ((q, "q"), (k, "k"), (v, "v"), (out, "out"), (dout, "dout"), (lse, "lse"),
                                          (dq, "dq"), (dk, "dk"), (dv, "dv"), (cu_seqlens_q, "cu_seqlens_q"),
                                          (cu_seqlens_k, "cu_seqlens_k"))]
        _check(_lib.flashjit_backward_varlen(*(ctypes.byref(t) for t in views),
                                             _capi.int32(max_seqlen_q, "max_seqlen_q"),
                                             _capi.int32(max_seqlen_k, "max_seqlen_k"), ctypes.byref(options)))
    return dq, dk, dv


def _unsupported(dropout_p, alibi_slopes, return_attn_probs):
    if dropout_p:
        raise NotImplementedError("flashjit: dropout is not supported (dropout_p must be 0)")
    if alibi_slopes is not None:
        raise NotImplementedError("flashjit: ALiBi is not supported (alibi_slopes must be None)")
    if return_attn_probs:
        raise NotImplementedError("flashjit: return_attn_probs is not supported; use return_lse=True")


def _same_device(tensors, names):
    index = tensors[0].get_device()
    for t in tensors:  # the common case first, without making torch.device objects
        if not t.is_cuda or t.get_device() != index:
            break
    else:
        return
    device = tensors[0].device
    for t, name in zip(tensors, names):
        if not t.is_cuda:
            raise ValueError(f"{name}: expected a CUDA tensor, got one on {t.device}")
        if t.device != device:
            raise ValueError(f"q, k, v must be on one device, got {sorted({str(t.device) for t in tensors})}")


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                    softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False,
                    return_lse=False, backend="auto", sm_margin=0, mod=None, block_mask=None, q_descale=None,
                    k_descale=None, v_descale=None):
    """softmax(q k^T * scale + mask) v, differentiable in q, k and v.

    q: (batch, seqlen_q, heads_q, head_dim); k, v: (batch, seqlen_k, heads_kv, head_dim), fp16 or bf16,
    heads_q a multiple of heads_kv (GQA/MQA), head_dim a multiple of 8 up to 256, last dim contiguous.
    causal is bottom-right aligned; window_size=(left, right) with -1 for unbounded. Returns out
    (like q), and with return_lse=True also the float32 logsumexp (batch, heads_q, seqlen_q), which
    is not differentiable. deterministic=True makes the backward bitwise reproducible (slower).
    sm_margin: SMs the persistent Hopper forward leaves free for other kernels (as in FlashAttention-3).
    Under torch.compile a torch custom op (torch.ops.flashjit.attention), which it traces through.
    mod: an AttentionMod (user mask/score functions compiled into the kernel); block_mask: a BlockMask
    (create_block_mask) or a FlexAttention BlockMask, whose empty tiles are skipped (it replaces
    causal and window_size). Rows that see no key under them get out 0, LSE -inf and no gradient.
    With mod or block_mask (sm_90) the call is differentiable too; under torch.compile it goes through
    the custom op torch.ops.flashjit.mod_attention (the mod's code and side tensors and the block
    mask's arrays are its arguments), so fullgraph=True holds.
    FP8 (sm_90, forward only, as FlashAttention-3's): torch.float8_e4m3fn q, k and v give a bfloat16
    out; q_descale, k_descale, v_descale (float32 (batch, heads_kv), optional) dequantise them: the
    scores are (q k^T) q_descale k_descale times softmax_scale, and out is (P v) v_descale.
    """
    _unsupported(dropout_p, alibi_slopes, return_attn_probs)
    _check_options(softmax_scale, window_size, backend)
    for t, name in ((q, "q"), (k, "k"), (v, "v")):
        if t.dim() != 4:
            raise ValueError(f"{name}: expected 4 dims (batch, seqlen, heads, head_dim), got shape {tuple(t.shape)}")
    _same_device((q, k, v), ("q", "k", "v"))
    if q.dtype == _torch().float8_e4m3fn or q_descale is not None or k_descale is not None or v_descale is not None:
        if mod is not None or block_mask is not None:
            raise ValueError("mod, block_mask: FP8 attention takes no user modifiers or block masks")
        out, lse = _forward_fp8(q, k, v, softmax_scale, bool(causal), int(window_size[0]), int(window_size[1]),
                                float(softcap), backend, int(sm_margin), q_descale, k_descale, v_descale)
        return (out, lse) if return_lse else out
    path = _autograd_path(q, k, v)
    if mod is not None or block_mask is not None:
        out, lse = _ops().mod_attention(q, k, v, softmax_scale, bool(causal), int(window_size[0]), int(window_size[1]),
                                        float(softcap), backend, int(sm_margin), mod, block_mask)
        return (out, lse) if return_lse else out
    native = _extension.module() if path != "traced" else None
    if native is not None:  # the C++ calls: the raw forward, or the autograd node
        window_left, window_right = _capi.window(window_size[0], window_size[1])
        arguments = (q, k, v, softmax_scale, bool(causal), window_left, window_right, float(softcap),
                     _capi.BACKENDS[backend], _capi.int32(sm_margin, "sm_margin"))
        if path is None:
            out, lse = native.forward(*arguments, bool(return_lse))
        else:
            out, lse = native.attention(*arguments, bool(deterministic))
    elif path is not None:
        attention = _ops().attention if path == "traced" else _ops().eager_attention
        out, lse = attention(q, k, v, softmax_scale, bool(causal), int(window_size[0]), int(window_size[1]),
                             float(softcap), backend, int(sm_margin), bool(deterministic))
    else:  # inference: the raw call, without the custom op's dispatch
        out, lse = _forward(q, k, v, softmax_scale, bool(causal), int(window_size[0]), int(window_size[1]),
                            float(softcap), backend, int(sm_margin), with_lse=return_lse)
    return (out, lse) if return_lse else out


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                           alibi_slopes=None, deterministic=False, return_attn_probs=False, return_lse=False,
                           backend="auto", sm_margin=0, q_descale=None, k_descale=None, v_descale=None):
    """Variable-length batch, packed: q (total_q, heads_q, head_dim), k and v (total_k, heads_kv,
    head_dim); sequence b is rows cu_seqlens[b]:cu_seqlens[b+1] (int32, on the device). Returns out,
    and with return_lse=True the float32 logsumexp (heads_q, total_q). Differentiable in q, k, v.
    FP8 inputs and descales (batch = sequences) as in flash_attn_func."""
    _unsupported(dropout_p, alibi_slopes, return_attn_probs)
    _check_options(softmax_scale, window_size, backend)
    for t, name in ((q, "q"), (k, "k"), (v, "v")):
        if t.dim() != 3:
            raise ValueError(f"{name}: expected 3 dims (total, heads, head_dim), got shape {tuple(t.shape)}")
    _same_device((q, k, v, cu_seqlens_q, cu_seqlens_k), ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k"))
    if q.dtype == _torch().float8_e4m3fn or q_descale is not None or k_descale is not None or v_descale is not None:
        out, lse = _forward_fp8(q, k, v, softmax_scale, bool(causal), int(window_size[0]), int(window_size[1]),
                                float(softcap), backend, int(sm_margin), q_descale, k_descale, v_descale,
                                varlen=(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k))
        return (out, lse) if return_lse else out
    path = _autograd_path(q, k, v)
    native = _extension.module() if path != "traced" else None
    if native is not None:  # the C++ calls: the raw forward, or the autograd node
        window_left, window_right = _capi.window(window_size[0], window_size[1])
        arguments = (q, k, v, cu_seqlens_q, cu_seqlens_k, _capi.int32(max_seqlen_q, "max_seqlen_q"),
                     _capi.int32(max_seqlen_k, "max_seqlen_k"), softmax_scale, bool(causal), window_left,
                     window_right, float(softcap), _capi.BACKENDS[backend], _capi.int32(sm_margin, "sm_margin"))
        if path is None:
            out, lse = native.forward_varlen(*arguments, bool(return_lse))
        else:
            out, lse = native.attention_varlen(*arguments, bool(deterministic))
    elif path is not None:
        attention = _ops().attention_varlen if path == "traced" else _ops().eager_attention_varlen
        out, lse = attention(q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k),
                             softmax_scale, bool(causal), int(window_size[0]), int(window_size[1]),
                             float(softcap), backend, int(sm_margin), bool(deterministic))
    else:
        out, lse = _forward_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k),
                                   softmax_scale, bool(causal), int(window_size[0]), int(window_size[1]),
                                   float(softcap), backend, int(sm_margin))
    return (out, lse) if return_lse else out


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, cache_seqlens=None, block_table=None,
                            softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, num_splits=0,
                            return_softmax_lse=False):
    """Attention of q over a KV cache, as flash-attn's function of the same name (inference only).

    q: (batch, seqlen_q, heads_q, head_dim). k_cache, v_cache: (batch, seqlen_cache, heads_kv, head_dim),
    or paged (num_pages, page_size, heads_kv, head_dim) with block_table (batch, max_pages_per_seq) int32
    page ids. cache_seqlens: int or int32 (batch,) tokens already cached; k, v: (batch, seqlen_new,
    heads_kv, head_dim) written into the cache at cache_seqlens inside the call, and attended to.
    causal/window are bottom-right aligned (the queries are the last tokens). num_splits: key-range
    splits (0 chosen). No host synchronisation: capturable in a CUDA graph. Page ids or lengths out of
    range are never read through; the sequence's rows come out NaN, and check_kvcache() raises naming them.
    Returns out, or (out, softmax_lse (batch, heads_q, seqlen_q) float32) with return_softmax_lse=True.
    """
    torch = _torch()
    _check_options(softmax_scale, window_size, "auto")
    if (k is None) != (v is None):
        raise ValueError("k and v: pass both new tensors or neither")
    if q.dim() != 4:
        raise ValueError(f"q: expected 4 dims (batch, seqlen_q, heads_q, head_dim), got shape {tuple(q.shape)}")
    tensors = [(q, "q"), (k_cache, "k_cache"), (v_cache, "v_cache")]
    if isinstance(cache_seqlens, int):
        cache_seqlens = torch.full((q.shape[0],), cache_seqlens, dtype=torch.int32, device=q.device)
    for t, name in ((k, "k"), (v, "v"), (cache_seqlens, "cache_seqlens"), (block_table, "block_table")):
        if t is not None:
            tensors.append((t, name))
    _same_device([t for t, _ in tensors], [n for _, n in tensors])
    native = _extension.module() if not torch.compiler.is_compiling() else None
    if native is not None:  # the C++ call
        window_left, window_right = _capi.window(window_size[0], window_size[1])
        out, lse = native.forward_kvcache(q, k_cache, v_cache, k, v, cache_seqlens, block_table, softmax_scale,
                                          bool(causal), window_left, window_right, float(softcap),
                                          _capi.int32(num_splits, "num_splits"), bool(return_softmax_lse))
        return (out, lse) if return_softmax_lse else out
    q = _kernel_input(q, "q")  # (the caches are written in place: they must be readable as they are)
    k, v = (None if t is None else _kernel_input(t, n) for t, n in ((k, "k"), (v, "v")))
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32, device=q.device)
    with torch.cuda.device(q.device):
        options = _options(q, softmax_scale, causal, window_size[0], window_size[1], softcap)
        options.num_splits = _capi.int32(num_splits, "num_splits")
        optional = [ctypes.byref(_view(t, name)) if t is not None else None
                    for t, name in ((block_table, "block_table"), (cache_seqlens, "cache_seqlens"), (k, "k"), (v, "v"))]
        _check(_lib.flashjit_forward_kvcache(ctypes.byref(_view(q, "q")), ctypes.byref(_view(k_cache, "k_cache")),
                                             ctypes.byref(_view(v_cache, "v_cache")), *optional,
                                             ctypes.byref(_view(out, "out")), ctypes.byref(_view(lse, "lse")),
                                             ctypes.byref(options)))
    return (out, lse) if return_softmax_lse else out


def check_kvcache(device=None):
    """Waits for the current stream of `device` and raises ValueError naming the first out-of-range page
    id or cache length that a flash_attn_with_kvcache call found on the GPU since the last check."""
    torch = _torch()
    stream = torch.cuda.current_stream(device).cuda_stream
    _check(_lib.flashjit_check_kvcache(ctypes.c_void_p(stream)))


def build_torch_extension(timeout=None):
    """Builds (or loads) the C++ torch extension (the dense, varlen and KV-cache calls) now, at deploy
    time say, rather than in the background of the first call (see _extension). Returns its status:
    'ready', 'off', or why it is unavailable."""
    _extension.wait(timeout)
    return _extension.status()


def _autograd_path(*tensors):
    """Returns "traced" under torch.compile (the custom op, which it traces through), "eager" where a
    backward must be recorded (an autograd.Function, without the custom op's dispatch), None for a
    plain inference call (the raw call)."""
    torch = _torch()
    if torch.compiler.is_compiling():
        return "traced"
    if torch.is_grad_enabled():
        for t in tensors:
            if t.requires_grad:
                return "eager"
    return None


def _ops():
    """The torch custom ops, registered on first use (the package imports without torch)."""
    global _registered_ops
    if _registered_ops is None:
        from . import _torch_ops
        _registered_ops = _torch_ops.register(sys.modules[__name__])
    return _registered_ops


_registered_ops = None


def load_tuning_db(path):
    """Use the tuning database at `path` (written by flashjit-tune) for the kernels dispatch picks;
    replaces FLASHJIT_TUNING_DB's. Raises ValueError for a malformed file, FlashJitError if unreadable."""
    _check(_lib.flashjit_load_tuning_db(str(path).encode()))


def cache_stats():
    """Counters of the process' kernel cache: {"memory_hits", "disk_hits", "compiles"}."""
    values = [ctypes.c_uint64() for _ in range(3)]
    _check(_lib.flashjit_cache_stats(*(ctypes.byref(v) for v in values)))
    return dict(zip(("memory_hits", "disk_hits", "compiles"), (v.value for v in values)))
