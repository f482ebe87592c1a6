"""Quantising attention inputs for the FP8 forward (flash_attn_func on torch.float8_e4m3fn).

quantize_fp8 returns e4m3 tensors and the float32 (batch, heads_kv) descales the kernel takes: one
scale per KV head's group of query heads and per sequence, amax / 448 (e4m3's largest value).
With incoherent=True, q and k are first rotated along head_dim by the same random orthogonal matrix
(a random sign per column, then a normalised Hadamard transform: FlashAttention-3's incoherent
processing). Q K^T is unchanged by it, but an outlier channel is spread over all of them, so the
scale no longer has to cover one large value and the other values keep their precision. v is not
rotated (O would come out rotated). Head dims must be powers of two for the rotation.
"""
import math

_E4M3_MAX = 448.0


def _torch():
    import torch
    return torch


def _random_rotation(head_dim, seed, device):
    """(head_dim, head_dim) orthogonal float32: diag(random signs) times the Sylvester Hadamard / sqrt(d)."""
    torch = _torch()
    if head_dim & (head_dim - 1):
        raise ValueError(f"incoherent: head_dim {head_dim} is not a power of two (the Hadamard transform's sizes)")
    h = torch.ones(1, 1, device=device)
    while h.shape[0] < head_dim:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    g = torch.Generator(device="cpu").manual_seed(seed)
    signs = (torch.randint(0, 2, (head_dim,), generator=g) * 2 - 1).to(device=device, dtype=torch.float32)
    return signs[:, None] * h / math.sqrt(head_dim)


def _per_group(x, heads_kv, name):
    """e4m3 x and its float32 (batch, heads_kv) descale, one scale per KV head's group of heads."""
    torch = _torch()
    b, s, h, d = x.shape
    if h % heads_kv:
        raise ValueError(f"{name}: heads {h} is not a multiple of heads_kv {heads_kv}")
    grouped = x.float().reshape(b, s, heads_kv, h // heads_kv, d)
    scale = grouped.abs().amax(dim=(1, 3, 4)).clamp(min=torch.finfo(torch.float32).tiny) / _E4M3_MAX
    quantized = (grouped / scale[:, None, :, None, None]).reshape(b, s, h, d).to(torch.float8_e4m3fn)
    return quantized, scale.contiguous()


def quantize_fp8(q, k, v, incoherent=False, seed=0):
    """(q8, k8, v8, q_descale, k_descale, v_descale) for flash_attn_func(q8, k8, v8, q_descale=...).

    q (batch, seqlen_q, heads_q, head_dim), k and v (batch, seqlen_k, heads_kv, head_dim), any float
    dtype; the scales are per sequence and KV head. incoherent: rotate q and k first (see above);
    `seed` picks the rotation's signs."""
    for t, name in ((q, "q"), (k, "k"), (v, "v")):
        if t.dim() != 4:
            raise ValueError(f"{name}: expected 4 dims (batch, seqlen, heads, head_dim), got shape {tuple(t.shape)}")
    heads_kv = k.shape[2]
    if incoherent:
        rotation = _random_rotation(q.shape[-1], seed, q.device)
        q, k = q.float() @ rotation, k.float() @ rotation
    q8, q_descale = _per_group(q, heads_kv, "q")
    k8, k_descale = _per_group(k, heads_kv, "k")
    v8, v_descale = _per_group(v, heads_kv, "v")
    return q8, k8, v8, q_descale, k_descale, v_descale
