#!/usr/bin/env python3
"""Host time per call: flashjit's Python entry points (dense, packed varlen, a paged KV-cache decode
step; each through its C++ extension and through the Python path), its C API alone (views built
once), and SDPA's FLASH and CUDNN backends, on shapes whose GPU work is shorter than the host work,
so the loop measures the host. A cProfile of flashjit's Python path follows on stderr.

    FLASHJIT_LIBRARY=build/runtime/libflashjit.so python3 bench/host_overhead.py
"""
import cProfile
import ctypes
import io
import json
import pathlib
import pstats
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "python"))
import flashjit  # noqa: E402


def host_us(fn, calls=2000):
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    begin = time.perf_counter()
    for _ in range(calls):
        fn()
    end = time.perf_counter()
    torch.cuda.synchronize()
    return (end - begin) / calls * 1e6


def main():
    b, s, h, d = 1, 128, 8, 128
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    lib = flashjit._lib
    out = torch.empty_like(q)
    lse = torch.empty(b, h, s, device="cuda", dtype=torch.float32)
    views = [flashjit._view(t, n) for t, n in ((q, "q"), (k, "k"), (v, "v"), (out, "out"), (lse, "lse"))]
    options = flashjit._options(q, None, True, -1, -1, 0.0)
    refs = [ctypes.byref(x) for x in views] + [ctypes.byref(options)]
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))

    def sdpa():
        return F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)

    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
    qgt, kgt, vgt = (t.transpose(1, 2) for t in (qg, kg, vg))
    dout = torch.randn_like(q)
    doutt = dout.transpose(1, 2)

    def flashjit_step():
        flashjit.flash_attn_func(qg, kg, vg, causal=True).backward(dout)

    def sdpa_step():
        F.scaled_dot_product_attention(qgt, kgt, vgt, is_causal=True).backward(doutt)

    # flashjit's calls through its C++ extension, where it builds, and through the Python path (ctypes
    # and a Python autograd.Function), in turn.
    native = flashjit._extension.wait()
    print(f"flashjit C++ extension: {flashjit._extension.status()}", file=sys.stderr)
    paths = [("C++", "1"), ("Python path", "0")] if native is not None else [("Python path", "0")]

    # The same problem packed (flash_attn_varlen_func), and a decode step: one query token per
    # sequence over a paged cache (page 16) with this step's token appended in place, beside SDPA
    # over the same cache held contiguous (SDPA has no paged cache or append).
    cu_seqlens = torch.tensor([0, s], device="cuda", dtype=torch.int32)
    packed = [t.view(b * s, h, d) for t in (q, k, v)]
    batch, cached, heads_kv, page = 4, 512, 2, 16
    step_q = torch.randn(batch, 1, h, d, device="cuda", dtype=torch.bfloat16)
    k_pages, v_pages = (torch.randn(batch * cached // page, page, heads_kv, d, device="cuda", dtype=torch.bfloat16)
                        for _ in range(2))
    table = torch.arange(batch * cached // page, device="cuda", dtype=torch.int32).view(batch, -1)
    lengths = torch.full((batch,), cached - 1, device="cuda", dtype=torch.int32)
    step_k, step_v = (torch.randn(batch, 1, heads_kv, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    step_qt = step_q.transpose(1, 2)
    cache_kt, cache_vt = (torch.randn(batch, h, cached, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))

    def decode_step():
        return flashjit.flash_attn_with_kvcache(step_q, k_pages, v_pages, k=step_k, v=step_v, cache_seqlens=lengths,
                                                block_table=table, causal=True)

    # (The backend is chosen outside the timed loops: sdpa_kernel's context costs host time itself.)
    rows = {}
    with torch.no_grad():
        for path, mode in paths:
            flashjit._extension._MODE = mode
            rows[f"flashjit.flash_attn_func ({path})"] = host_us(lambda: flashjit.flash_attn_func(q, k, v, causal=True))
            rows[f"flashjit varlen ({path})"] = host_us(
                lambda: flashjit.flash_attn_varlen_func(*packed, cu_seqlens, cu_seqlens, s, s, causal=True))
            rows[f"flashjit kvcache decode ({path})"] = host_us(decode_step)
        rows["flashjit C API (views prebuilt)"] = host_us(lambda: lib.flashjit_forward(*refs))
        for name, backend in (("sdpa flash", SDPBackend.FLASH_ATTENTION), ("sdpa cudnn", SDPBackend.CUDNN_ATTENTION)):
            with sdpa_kernel(backend):
                rows[name] = host_us(sdpa)
                rows[f"{name} decode"] = host_us(lambda: F.scaled_dot_product_attention(step_qt, cache_kt, cache_vt))
    packed_leaves = [t.detach().requires_grad_() for t in packed]
    packed_dout = dout.view(b * s, h, d)

    def flashjit_varlen_step():
        flashjit.flash_attn_varlen_func(*packed_leaves, cu_seqlens, cu_seqlens, s, s, causal=True).backward(packed_dout)

    for path, mode in paths:
        flashjit._extension._MODE = mode
        rows[f"flashjit fwd+bwd ({path})"] = host_us(flashjit_step, calls=500)
        rows[f"flashjit varlen fwd+bwd ({path})"] = host_us(flashjit_varlen_step, calls=500)
    flashjit._extension._MODE = "0"  # the profile below is of the Python path
    for name, backend in (("sdpa flash fwd+bwd", SDPBackend.FLASH_ATTENTION),
                          ("sdpa cudnn fwd+bwd", SDPBackend.CUDNN_ATTENTION)):
        with sdpa_kernel(backend):
            rows[name] = host_us(sdpa_step, calls=500)
    for name, us in rows.items():
        print(f"{name:40} {us:7.1f} us per call", file=sys.stderr)
    with torch.no_grad():
        profile = cProfile.Profile()  # the inference path
        profile.enable()
        for _ in range(500):
            flashjit.flash_attn_func(q, k, v, causal=True)
        profile.disable()
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(15)
        print(text.getvalue(), file=sys.stderr)
    json.dump(dict(shape=[b, s, h, d], decode=dict(batch=batch, cached=cached, heads_kv=heads_kv, page_size=page),
                   host_us_per_call=rows), sys.stdout, indent=1)


if __name__ == "__main__":
    main()
