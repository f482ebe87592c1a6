#!/usr/bin/env python3
"""Where a forward + backward (or, with --forward, a forward) call's GPU time goes, kernel by kernel,
for flashjit and SDPA's backends on one shape (torch.profiler's CUDA activity; the times are the
profiler's, not a benchmark). Prints one table per backend: each kernel's share of the call's GPU
time, and the call's wall time between CUDA events beside the sum of its kernels (the difference is
GPU idle time); with --launch, each kernel's grid, block, registers and shared memory (what tiles a
peer's kernel runs).
  FLASHJIT_LIBRARY=build/runtime/libflashjit.so bench/kernel_breakdown.py --head-dim 128 --seqlen 1024 --causal
  bench/kernel_breakdown.py --forward --backends flashjit,cudnn --launch --seqlen 2048"""
import argparse
import json
import pathlib
import sys
import tempfile
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "python"))
import flashjit  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--seqlen", type=int, default=1024)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--host-ops", type=int, default=0, help="also list this many host-side ops by self time")
    ap.add_argument("--forward", action="store_true", help="the forward alone")
    ap.add_argument("--backends", default="flashjit,flash", help="of flashjit, flash (SDPA FLASH), cudnn (SDPA CUDNN), fa4 (FlashAttention-4)")
    ap.add_argument("--launch", action="store_true", help="each kernel's launch configuration")
    args = ap.parse_args()
    b, h, s, d = args.tokens // args.seqlen, args.hidden // args.head_dim, args.seqlen, args.head_dim
    torch.manual_seed(0)
    # Sequence-major memory, (b, h, s, d) views: flash-attn's layout under SDPA's shape.
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    dout = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16)
    t = lambda x: x.transpose(1, 2)

    def sdpa(backend):
        def attention():
            with sdpa_kernel(backend):
                return t(F.scaled_dot_product_attention(t(q), t(k), t(v), is_causal=args.causal))
        return attention

    available = {"flashjit": lambda: flashjit.flash_attn_func(q, k, v, causal=args.causal),
                 "flash": sdpa(SDPBackend.FLASH_ATTENTION), "cudnn": sdpa(SDPBackend.CUDNN_ATTENTION)}
    if "fa4" in args.backends.split(","):  # flash-attn-4 where installed (../shared/peers/fa4/)
        from flash_attn.cute import flash_attn_func as fa4_attention

        def fa4():
            out = fa4_attention(q, k, v, causal=args.causal)
            return out[0] if isinstance(out, tuple) else out
        available["fa4"] = fa4
    for name in args.backends.split(","):
        if name not in available:
            ap.error(f"--backends: unknown backend '{name}' (expected flashjit, flash, cudnn or fa4)")
    for name in args.backends.split(","):
        attention = available[name]
        if args.forward:
            def call(attention=attention):
                with torch.no_grad():
                    return attention()
        else:
            call = lambda attention=attention: torch.autograd.grad(attention(), (q, k, v), dout)
        for _ in range(5):
            call()
        torch.cuda.synchronize()
        # Host time to enqueue the calls (no sync inside): above the GPU time, the host is the limit.
        host_start = time.perf_counter()
        for _ in range(args.calls):
            call()
        host_ms = (time.perf_counter() - host_start) * 1e3 / args.calls
        torch.cuda.synchronize()
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            start.record()
            for _ in range(args.calls):
                call()
            stop.record()
            torch.cuda.synchronize()
        wall_ms = start.elapsed_time(stop) / args.calls
        kernels = {}
        for event in prof.events():
            if event.device_type == torch.autograd.DeviceType.CUDA:
                kernels.setdefault(event.name, []).append(event.device_time_total / 1000.0)
        total = sum(sum(v) for v in kernels.values()) / args.calls
        print(f"{name}: {'fwd' if args.forward else 'fwd+bwd'} d{d} s{s} {'causal' if args.causal else 'full'}: "
              f"{wall_ms:.3f} ms per call between events, "
              f"{total:.3f} ms in kernels, {host_ms:.3f} ms host enqueue")
        for kernel, times in sorted(kernels.items(), key=lambda kv: -sum(kv[1])):
            per_call = sum(times) / args.calls
            print(f"  {per_call:8.3f} ms {100 * per_call / total:5.1f}%  x{len(times) / args.calls:g}  {kernel[:110]}")
        # The GPU timeline of the last calls: each kernel's start, duration and the idle gap before it.
        timeline = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                          if e.device_type == torch.autograd.DeviceType.CUDA)
        previous_end = None
        for begin, end, kernel in timeline[-2 * len(kernels):]:
            gap = "" if previous_end is None else f"gap {begin - previous_end:7.1f} us"
            print(f"    {gap:>16}  {end - begin:8.1f} us  {kernel[:80]}")
            previous_end = end
        if args.launch:
            # The chrome trace carries each kernel launch's configuration (torch.profiler's events do not).
            with tempfile.NamedTemporaryFile(suffix=".json") as trace:
                prof.export_chrome_trace(trace.name)
                events = json.load(open(trace.name))["traceEvents"]
            seen = set()
            for e in events:
                a = e.get("args", {})
                if e.get("cat") != "kernel" or e["name"] in seen:
                    continue
                seen.add(e["name"])
                print(f"    grid {a.get('grid')} block {a.get('block')} regs {a.get('registers per thread')} "
                      f"smem {a.get('shared memory')} B  {e['name'][:140]}")
        if args.host_ops:
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.host_ops))


if __name__ == "__main__":
    main()
