#!/usr/bin/env python3
"""Where ring attention's time goes on one GPU (N virtual ranks, flashjit.ring_flash_attn_local),
beside one flashjit call over the whole sequence: torch.profiler's CUDA activity (the profiler's
times, not a benchmark). For each: the span from the first GPU activity to the last, the summed and
the merged (union) busy time of kernels and of copies, the kernels by name (count, mean us), and
how much of the span had no kernel running (idle) or more than one (overlap).
  FLASHJIT_LIBRARY=build/runtime/libflashjit.so bench/ring_timeline.py --world 8 --seqlen 16384 --causal"""
import argparse
import json
import pathlib
import sys
import tempfile
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "python"))
import flashjit  # noqa: E402


def union_us(intervals):
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total


def summarise(trace_path, label, dump=False):
    events = [e for e in json.load(open(trace_path))["traceEvents"] if e.get("ph") == "X"]
    kernels = [e for e in events if e.get("cat") == "kernel"]
    copies = [e for e in events if e.get("cat") in ("gpu_memcpy", "gpu_memset")]
    gpu = kernels + copies
    if not gpu:
        print(f"{label}: no GPU activity recorded")
        return {}
    span = max(e["ts"] + e["dur"] for e in gpu) - min(e["ts"] for e in gpu)
    k_iv = [(e["ts"], e["ts"] + e["dur"]) for e in kernels]
    c_iv = [(e["ts"], e["ts"] + e["dur"]) for e in copies]
    by_name = defaultdict(list)
    for e in gpu:
        by_name[(e["cat"], e["name"][:90])].append(e["dur"])
    streams = {e["args"].get("stream") for e in kernels}
    result = {"span_us": span, "kernel_sum_us": sum(e["dur"] for e in kernels), "kernel_union_us": union_us(k_iv),
              "copy_sum_us": sum(e["dur"] for e in copies), "copy_union_us": union_us(c_iv),
              "all_union_us": union_us(k_iv + c_iv), "kernel_streams": len(streams)}
    print(f"{label}: span {span:.0f} us; kernels {len(kernels)} on {len(streams)} streams, sum {result['kernel_sum_us']:.0f} us, "
          f"union {result['kernel_union_us']:.0f} us (no kernel running {span - result['kernel_union_us']:.0f} us); "
          f"copies {len(copies)}, sum {result['copy_sum_us']:.0f} us, union {result['copy_union_us']:.0f} us")
    for (cat, name), durs in sorted(by_name.items(), key=lambda kv: -sum(kv[1])):
        print(f"    {sum(durs):9.0f} us  {len(durs):5d} x {sum(durs) / len(durs):8.1f} us  {cat:10s} {name}")
    if dump:  # every GPU activity of the last call, by start time: stream, start and end (us), what
        origin = min(e["ts"] for e in gpu)
        for e in sorted(gpu, key=lambda e: e["ts"]):
            size = e["args"].get("bytes")
            what = f"{size / 1e6:.1f} MB {size / e['dur'] / 1e6:.2f} TB/s" if size and e["dur"] else e["name"][:40]
            grid = e["args"].get("grid", "")
            print(f"  s{e['args'].get('stream')} {e['ts'] - origin:8.1f} {e['ts'] + e['dur'] - origin:8.1f} {e['cat']:10s} {what} {grid}")
    return result


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--world", type=int, default=8)
    ap.add_argument("--seqlen", type=int, default=16384)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--layout", default="zigzag")
    ap.add_argument("--backward", action="store_true", help="forward and backward")
    ap.add_argument("--calls", type=int, default=3)
    ap.add_argument("--dump", action="store_true", help="list every GPU activity (use with --calls 1)")
    args = ap.parse_args()
    torch.manual_seed(0)
    shape = (1, args.seqlen, args.heads, args.head_dim)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=args.backward) for _ in range(3))
    dout = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    shard = lambda x: [flashjit.ring_shard(x.detach(), r, args.world, args.layout).requires_grad_(args.backward)
                       for r in range(args.world)]
    qs, ks, vs, douts = shard(q), shard(k), shard(v), shard(dout)

    def single():
        out = flashjit.flash_attn_func(q, k, v, causal=args.causal)
        if args.backward:
            out.backward(dout)

    def ring():
        outs = flashjit.ring_flash_attn_local(qs, ks, vs, causal=args.causal, layout=args.layout)
        if args.backward:
            torch.autograd.backward(outs, douts)

    for label, call in (("single call", single), (f"ring N={args.world}", ring)):
        for _ in range(2):
            call()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(args.calls):
                call()
            torch.cuda.synchronize()
        with tempfile.NamedTemporaryFile(suffix=".json") as trace:
            prof.export_chrome_trace(trace.name)
            summarise(trace.name, f"{label} x{args.calls}", args.dump and label != "single call")


if __name__ == "__main__":
    main()
