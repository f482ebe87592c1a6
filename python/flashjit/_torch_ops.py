"""torch custom ops around the C API: flashjit::attention (and _varlen, and mod_attention for user
modifiers and block masks) with autograd through their _backward ops, plus fake implementations so
torch.compile traces through them without graph breaks; and the same autograd as plain
autograd.Functions for eager calls.
Imported on first use by the package (which itself loads without torch)."""
import types
from typing import List, Optional, Tuple

import torch
from torch import Tensor

from . import _modifiers


def register(impl):
    """Registers the ops over `impl` (the package module's raw calls); returns their entry points."""

    @torch.library.custom_op("flashjit::attention", mutates_args=(), device_types="cuda")
    def attention(q: Tensor, k: Tensor, v: Tensor, softmax_scale: Optional[float], causal: bool, window_left: int,
                  window_right: int, softcap: float, backend: str, sm_margin: int,
                  deterministic: bool) -> Tuple[Tensor, Tensor]:
        return impl._forward(q, k, v, softmax_scale, causal, window_left, window_right, softcap, backend, sm_margin)

    @attention.register_fake
    def _(q, k, v, softmax_scale, causal, window_left, window_right, softcap, backend, sm_margin, deterministic):
        return (torch.empty(q.shape, dtype=q.dtype, device=q.device),
                torch.empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32, device=q.device))

    @torch.library.custom_op("flashjit::attention_backward", mutates_args=(), device_types="cuda")
    def attention_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                           softmax_scale: Optional[float], causal: bool, window_left: int, window_right: int,
                           softcap: float, deterministic: bool) -> Tuple[Tensor, Tensor, Tensor]:
        return impl._backward(dout, q, k, v, out, lse, softmax_scale, causal, window_left, window_right, softcap,
                              deterministic)

    @attention_backward.register_fake
    def _(dout, q, k, v, out, lse, softmax_scale, causal, window_left, window_right, softcap, deterministic):
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

    def setup_context(ctx, inputs, output):
        q, k, v, softmax_scale, causal, window_left, window_right, softcap, _backend, _sm_margin, deterministic = inputs
        out, lse = output
        ctx.mark_non_differentiable(lse)  # a loss through the LSE fails loudly instead of losing its gradient
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.options = (softmax_scale, causal, window_left, window_right, softcap, deterministic)

    def backward(ctx, dout, _dlse):  # the LSE output is not differentiable (as in flash-attn)
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = attention_backward(dout, q, k, v, out, lse, *ctx.options)
        return (dq, dk, dv) + (None,) * 8

    attention.register_autograd(backward, setup_context=setup_context)

    @torch.library.custom_op("flashjit::attention_varlen", mutates_args=(), device_types="cuda")
    def attention_varlen(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                         max_seqlen_q: int, max_seqlen_k: int, softmax_scale: Optional[float], causal: bool,
                         window_left: int, window_right: int, softcap: float, backend: str, sm_margin: int,
                         deterministic: bool) -> Tuple[Tensor, Tensor]:
        return impl._forward_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                                    causal, window_left, window_right, softcap, backend, sm_margin)

    @attention_varlen.register_fake
    def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_left,
          window_right, softcap, backend, sm_margin, deterministic):
        return (torch.empty(q.shape, dtype=q.dtype, device=q.device),
                torch.empty((q.shape[1], q.shape[0]), dtype=torch.float32, device=q.device))

    @torch.library.custom_op("flashjit::attention_varlen_backward", mutates_args=(), device_types="cuda")
    def attention_varlen_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                                  cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int,
                                  softmax_scale: Optional[float], causal: bool, window_left: int, window_right: int,
                                  softcap: float, deterministic: bool) -> Tuple[Tensor, Tensor, Tensor]:
        return impl._backward_varlen(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                     softmax_scale, causal, window_left, window_right, softcap, deterministic)

    @attention_varlen_backward.register_fake
    def _(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
          window_left, window_right, softcap, deterministic):
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

    def setup_context_varlen(ctx, inputs, output):
        (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_left,
         window_right, softcap, _backend, _sm_margin, deterministic) = inputs
        out, lse = output
        ctx.mark_non_differentiable(lse)
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k)
        ctx.options = (max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_left, window_right, softcap,
                       deterministic)

    def backward_varlen(ctx, dout, _dlse):
        q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k = ctx.saved_tensors
        dq, dk, dv = attention_varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, *ctx.options)
        return (dq, dk, dv) + (None,) * 12

    attention_varlen.register_autograd(backward_varlen, setup_context=setup_context_varlen)

    # Eager autograd: the same forward and backward as plain autograd.Functions over the raw calls.
    # They skip the custom ops' dispatch (schema checks, the autograd wrapper, a zero-filled
    # gradient for the LSE), host work on every call; the package uses them unless torch.compile
    # is tracing. Their forwards know a backward follows: on a cold cache its kernel compiles beside
    # the forward's (prepare_backward). (The traced ops cannot tell training from inference.)
    class EagerAttention(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, softmax_scale, causal, window_left, window_right, softcap, backend, sm_margin,
                    deterministic):
            out, lse = impl._forward(q, k, v, softmax_scale, causal, window_left, window_right, softcap, backend,
                                     sm_margin, prepare_backward=True, deterministic=deterministic)
            ctx.mark_non_differentiable(lse)
            ctx.set_materialize_grads(False)  # no zero-filled dLSE: it is unused
            ctx.save_for_backward(q, k, v, out, lse)
            ctx.options = (softmax_scale, causal, window_left, window_right, softcap, deterministic)
            return out, lse

        @staticmethod
        def backward(ctx, dout, _dlse):
            if dout is None:  # out did not reach the loss
                return (None,) * 11
            q, k, v, out, lse = ctx.saved_tensors
            return impl._backward(dout, q, k, v, out, lse, *ctx.options) + (None,) * 8

    class EagerAttentionVarlen(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                    window_left, window_right, softcap, backend, sm_margin, deterministic):
            out, lse = impl._forward_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                            softmax_scale, causal, window_left, window_right, softcap, backend,
                                            sm_margin, prepare_backward=True, deterministic=deterministic)
            ctx.mark_non_differentiable(lse)
            ctx.set_materialize_grads(False)
            ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k)
            ctx.options = (max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_left, window_right, softcap,
                           deterministic)
            return out, lse

        @staticmethod
        def backward(ctx, dout, _dlse):
            if dout is None:
                return (None,) * 15
            q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k = ctx.saved_tensors
            return impl._backward_varlen(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
                                         *ctx.options) + (None,) * 12

    # User modifiers and block masks. Under torch.compile the mod and the block mask travel as op
    # arguments (the mod's code and side tensors, the mask's arrays and block sizes: _modifiers'
    # mod_arguments), so the graph holds the ops; eager calls keep the Python objects in an
    # autograd.Function, without the custom op's dispatch.
    @torch.library.custom_op("flashjit::mod_attention", mutates_args=(), device_types="cuda")
    def traced_mod_attention(q: Tensor, k: Tensor, v: Tensor, softmax_scale: Optional[float], causal: bool,
                             window_left: int, window_right: int, softcap: float, backend: str, sm_margin: int,
                             mod_code: str, tensors: List[Tensor], block_arrays: List[Optional[Tensor]],
                             block_size: List[int]) -> Tuple[Tensor, Tensor]:
        mod, block_mask = _modifiers.from_arguments(mod_code, tensors, block_arrays, block_size)
        return impl._forward_mod(q, k, v, softmax_scale, causal, window_left, window_right, softcap, backend, sm_margin,
                                 mod, block_mask)

    @traced_mod_attention.register_fake
    def _(q, k, v, softmax_scale, causal, window_left, window_right, softcap, backend, sm_margin, mod_code, tensors,
          block_arrays, block_size):
        return (torch.empty(q.shape, dtype=q.dtype, device=q.device),
                torch.empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32, device=q.device))

    @torch.library.custom_op("flashjit::mod_attention_backward", mutates_args=(), device_types="cuda")
    def traced_mod_attention_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                                      softmax_scale: Optional[float], causal: bool, window_left: int,
                                      window_right: int, softcap: float, mod_code: str, tensors: List[Tensor],
                                      block_arrays: List[Optional[Tensor]],
                                      block_size: List[int]) -> Tuple[Tensor, Tensor, Tensor]:
        mod, block_mask = _modifiers.from_arguments(mod_code, tensors, block_arrays, block_size)
        return impl._backward_mod(dout, q, k, v, out, lse, softmax_scale, causal, window_left, window_right, softcap,
                                  mod, block_mask)

    @traced_mod_attention_backward.register_fake
    def _(dout, q, k, v, out, lse, softmax_scale, causal, window_left, window_right, softcap, mod_code, tensors,
          block_arrays, block_size):
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

    def setup_context_mod(ctx, inputs, output):
        q, k, v, softmax_scale, causal, window_left, window_right, softcap, _backend, _sm_margin = inputs[:10]
        out, lse = output
        ctx.mark_non_differentiable(lse)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.options = (softmax_scale, causal, window_left, window_right, softcap) + tuple(inputs[10:])
        # No gradient for the other inputs, in the structure torch checks them against: a list holding
        # only tensors (an empty one too) is a node and gets a list of None; anything else, a list
        # with a None or an int in it included, is a leaf and gets None.
        tensor_list = lambda x: isinstance(x, list) and all(isinstance(e, Tensor) for e in x)
        ctx.no_grads = tuple([None] * len(x) if tensor_list(x) else None for x in inputs[3:])

    def backward_mod(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = traced_mod_attention_backward(dout, q, k, v, out, lse, *ctx.options)
        return (dq, dk, dv) + ctx.no_grads

    traced_mod_attention.register_autograd(backward_mod, setup_context=setup_context_mod)

    def traced_mod(q, k, v, softmax_scale, causal, window_left, window_right, softcap, backend, sm_margin, mod,
                   block_mask):
        return traced_mod_attention(q, k, v, softmax_scale, causal, window_left, window_right, softcap, backend,
                                    sm_margin, *_modifiers.mod_arguments(mod, block_mask))

    class ModAttention(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, softmax_scale, causal, window_left, window_right, softcap, backend, sm_margin,
                    mod, block_mask):
            out, lse = impl._forward_mod(q, k, v, softmax_scale, causal, window_left, window_right, softcap, backend,
                                         sm_margin, mod, block_mask, prepare_backward=True)
            ctx.mark_non_differentiable(lse)
            ctx.set_materialize_grads(False)
            ctx.save_for_backward(q, k, v, out, lse)
            ctx.options = (softmax_scale, causal, window_left, window_right, softcap, mod, block_mask)
            return out, lse

        @staticmethod
        def backward(ctx, dout, _dlse):
            if dout is None:
                return (None,) * 12
            q, k, v, out, lse = ctx.saved_tensors
            return impl._backward_mod(dout, q, k, v, out, lse, *ctx.options) + (None,) * 9

    def mod_attention(q, k, v, softmax_scale, causal, window_left, window_right, softcap, backend, sm_margin, mod,
                      block_mask):
        if torch.compiler.is_compiling():
            return traced_mod(q, k, v, softmax_scale, causal, window_left, window_right, softcap, backend, sm_margin,
                              mod, block_mask)
        args = (q, k, v, softmax_scale, causal, window_left, window_right, softcap, backend, sm_margin, mod, block_mask)
        if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
            return ModAttention.apply(*args)
        return impl._forward_mod(*args)

    return types.SimpleNamespace(attention=attention, attention_varlen=attention_varlen,
                                 mod_attention=mod_attention,
                                 attention_backward=attention_backward,
                                 attention_varlen_backward=attention_varlen_backward,
                                 eager_attention=EagerAttention.apply,
                                 eager_attention_varlen=EagerAttentionVarlen.apply)
