"""flashjit as a Hugging Face Transformers attention implementation.

    import flashjit.integrations.transformers as fj
    fj.register()                               # once, before or after loading models
    model.set_attn_implementation("fjit")       # or from_pretrained(..., attn_implementation="fjit")

The name is "fjit", not "flashjit": Transformers takes any implementation whose name contains
"flash" for a FlashAttention package or hub kernel and tries to import one by that name.

Causal and bidirectional modules, sliding windows (Mistral, Gemma), softcap (Gemma 2), GQA/MQA,
padded batches (left or right padding, through the varlen kernels) and sequences packed into one
row (cu_seq_lens_q/k, or position ids restarting at 0, as DataCollatorWithFlattening passes them) run
on flashjit, in training and in generation with a KV cache. Masks come in FlashAttention's form (a
2D padding mask, or none), so the model builds no 4D mask. Attention dropout, attention sinks and
returned attention weights raise NotImplementedError.
"""
import warnings

import torch

from .. import flash_attn_func, flash_attn_varlen_func

__all__ = ["register", "attention_forward", "NAME"]

NAME = "fjit"


def register(name=NAME):
    """Registers the attention function and its mask form under `name` with Transformers."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, flash_attention_mask)


def _window(sliding_window, causal):
    """Transformers' sliding window of n keys (q - n < k <= q) as flashjit's (left, right) widths."""
    if sliding_window is None or sliding_window <= 0:
        return (-1, -1)
    return (sliding_window - 1, 0 if causal else sliding_window - 1)


def _kernel_dtype(query):
    """fp16/bf16 run as they are; fp32 runs in the autocast dtype, else bf16 (FlashAttention's rule)."""
    if query.dtype in (torch.float16, torch.bfloat16):
        return query.dtype
    if torch.is_autocast_enabled("cuda"):
        return torch.get_autocast_dtype("cuda")
    warnings.warn("flashjit attention: float32 inputs run in bfloat16", stacklevel=3)
    return torch.bfloat16


def _unpad(x, indices):
    """Rows `indices` of x (batch, seqlen, heads, head_dim) flattened over batch and sequence."""
    return x.reshape(-1, *x.shape[2:]).index_select(0, indices)


def _sequences(mask):
    """Flat indices of the kept positions, cu_seqlens (int32) and the longest length of a 2D mask."""
    lengths = mask.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(mask.flatten(), as_tuple=False).flatten()
    cu_seqlens = torch.nn.functional.pad(torch.cumsum(lengths, dim=0, dtype=torch.int32), (1, 0))
    return indices, cu_seqlens, int(lengths.max())


def _packed_sequences(kwargs, batch, q_len, kv_len):
    """(cu_seqlens_q, cu_seqlens_k, max_q, max_k) of sequences packed into one row: from cu_seq_lens_q/k
    where given, else where position_ids restart at 0 (DataCollatorWithFlattening); None otherwise."""
    if batch != 1:
        return None
    if kwargs.get("cu_seq_lens_q") is not None:
        return (kwargs["cu_seq_lens_q"].to(torch.int32), kwargs["cu_seq_lens_k"].to(torch.int32),
                int(kwargs["max_length_q"]), int(kwargs["max_length_k"]))
    position_ids = kwargs.get("position_ids")
    if position_ids is None or q_len == 1 or q_len != kv_len:
        return None
    starts = torch.nonzero(position_ids[0] == 0).flatten()
    if starts.numel() < 2 or int(starts[0]) != 0:  # (one sequence, or positions that continue a cache)
        return None
    cu_seqlens = torch.cat([starts, starts.new_tensor([q_len])]).to(torch.int32)
    longest = int(torch.diff(cu_seqlens).max())
    return cu_seqlens, cu_seqlens, longest, longest


def attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                      sliding_window=None, softcap=None, **kwargs):
    """Transformers' attention interface: query (batch, heads_q, q_len, head_dim), key and value
    (batch, heads_kv, kv_len, head_dim), attention_mask a boolean (batch, kv_len) padding mask (True:
    a token) or None. Returns ((batch, q_len, heads_q, head_dim), None)."""
    if dropout > 0.0:
        raise NotImplementedError(f"flashjit attention has no dropout (got dropout={dropout}); set the "
                                  "model's attention_dropout to 0")
    if kwargs.get("output_attentions", False):
        raise NotImplementedError("flashjit attention does not return attention weights (output_attentions)")
    if kwargs.get("s_aux") is not None:
        raise NotImplementedError("flashjit attention has no attention sinks (s_aux)")
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    options = dict(softmax_scale=scaling, causal=bool(causal), window_size=_window(sliding_window, causal),
                   softcap=float(softcap or 0.0))
    batch, _, q_len, _ = query.shape
    dtype = _kernel_dtype(query)
    # The (batch, seqlen, heads, head_dim) views of q/k/v projections are their memory order: no copy.
    q, k, v = (t.transpose(1, 2).to(dtype) for t in (query, key, value))

    packed = _packed_sequences(kwargs, batch, q_len, k.shape[1]) if attention_mask is None else None
    if packed is not None:  # sequences packed into one row (padding-free training)
        cu_seqlens_q, cu_seqlens_k, max_q, max_k = packed
        out = flash_attn_varlen_func(q[0], k[0], v[0], cu_seqlens_q, cu_seqlens_k, max_q, max_k, **options)
        out = out.unsqueeze(0)
    elif attention_mask is None:
        out = flash_attn_func(q, k, v, **options)
    else:
        # Padded batch: the tokens alone, as a varlen batch (causal stays bottom-right aligned per
        # sequence, as the queries are each sequence's last tokens), then back into place with 0s.
        mask = attention_mask.bool()
        k_indices, cu_seqlens_k, max_k = _sequences(mask)
        q_indices, cu_seqlens_q, max_q = _sequences(mask[:, -q_len:])
        out_tokens = flash_attn_varlen_func(_unpad(q, q_indices), _unpad(k, k_indices), _unpad(v, k_indices),
                                            cu_seqlens_q, cu_seqlens_k, max_q, max_k, **options)
        out = q.new_zeros(batch * q_len, *out_tokens.shape[1:])
        out.index_copy_(0, q_indices, out_tokens)
        out = out.view(batch, q_len, *out_tokens.shape[1:])
    return out.to(query.dtype), None
