#!/usr/bin/env python3
"""Decode-step attention over a KV cache: flashjit's flash_attn_with_kvcache beside PyTorch SDPA's
CUDNN and FLASH backends, on the same cache in the same run. One query token per sequence, GQA
(32 query / 8 KV heads by default), head dim 128, bf16; rows {batch} x {cached tokens}.

Reported: GB/s of K+V read (the cache's bytes, K and V, over the GPU time of one call) and its
fraction of the device copy bandwidth measured in the same run (read + write of a 2 GB buffer);
flashjit with paged caches (page sizes 16 and 64) beside its contiguous cache; host cost per call.

GPU time: each backend's calls are captured in a CUDA graph (20 calls, rotating over enough
copies of the cache that the copies pass the L2 where one would fit in it), so tiny rows time the
GPU, not the launch path; samples of the graph's replay are interleaved across backends and the
median kept. Host cost: eager calls, timed on the host, queue drained at the end. Layouts: --layout
bshd stores the cache (batch, seqlen, heads, head_dim) as flash-attn's and vLLM's (SDPA gets a
transposed view); bhsd stores it head-major, SDPA's own (flashjit gets the transposed view).
SDPA is called with enable_gqa=True; a backend that refuses a row is reported with its error."""
import argparse
import json
import math
import pathlib
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "python"))
import flashjit  # noqa: E402

L2_PASS_BYTES = 200 << 20  # rotate over copies until they pass 200 MB (the H200's L2 is 60 MB)


def copy_bandwidth():
    """Device copy bandwidth (read + write bytes per second) of a 2 GB buffer, median of 20."""
    a = torch.empty(1 << 30, dtype=torch.int16, device="cuda")
    b = torch.empty_like(a)
    a.random_()
    times = []
    for _ in range(25):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        b.copy_(a)
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    times = sorted(times[5:])
    return 2 * a.numel() * 2 / (times[len(times) // 2] / 1e3)


class Row:
    def __init__(self, batch, seqlen, heads_q, heads_kv, head_dim, layout, dtype):
        self.batch, self.seqlen, self.heads_q, self.heads_kv, self.head_dim = batch, seqlen, heads_q, heads_kv, head_dim
        self.layout, self.dtype = layout, dtype
        self.kv_bytes = 2 * batch * seqlen * heads_kv * head_dim * torch.finfo(dtype).bits // 8
        self.copies = max(1, min(8, math.ceil(L2_PASS_BYTES / self.kv_bytes)))

    def caches(self):
        """`copies` (q, k, v) sets: q (b, 1, hq, d); k, v as (b, s, hkv, d) views of the stored layout."""
        sets = []
        for _ in range(self.copies):
            shape = (self.batch, self.seqlen, self.heads_kv, self.head_dim)
            if self.layout == "bshd":
                k = torch.randn(shape, dtype=self.dtype, device="cuda")
                v = torch.randn(shape, dtype=self.dtype, device="cuda")
            else:
                k = torch.randn(self.batch, self.heads_kv, self.seqlen, self.head_dim, dtype=self.dtype,
                                device="cuda").transpose(1, 2)
                v = torch.randn(self.batch, self.heads_kv, self.seqlen, self.head_dim, dtype=self.dtype,
                                device="cuda").transpose(1, 2)
            q = torch.randn(self.batch, 1, self.heads_q, self.head_dim, dtype=self.dtype, device="cuda")
            sets.append((q, k, v))
        return sets


def paged(k, v, page_size, shuffled=True):
    """The same tokens in a paged cache (pages in a shuffled order, or in order) and its block table."""
    b, s, h, d = k.shape
    pages_per_seq = s // page_size
    order = (torch.randperm(b * pages_per_seq, device="cuda", dtype=torch.int64) if shuffled
             else torch.arange(b * pages_per_seq, device="cuda", dtype=torch.int64))
    kp = torch.empty(b * pages_per_seq, page_size, h, d, dtype=k.dtype, device="cuda")
    vp = torch.empty_like(kp)
    kp[order] = k.reshape(b * pages_per_seq, page_size, h, d)
    vp[order] = v.reshape(b * pages_per_seq, page_size, h, d)
    table = order.view(b, pages_per_seq).to(torch.int32)
    return kp, vp, table


def backends(row, sets, with_paged):
    """name -> list of per-copy callables."""
    seqlens = torch.full((row.batch,), row.seqlen, dtype=torch.int32, device="cuda")
    fns = {"flashjit": [lambda q=q, k=k, v=v: flashjit.flash_attn_with_kvcache(q, k, v, cache_seqlens=seqlens)
                        for q, k, v in sets]}
    if with_paged:
        for page_size in (16, 64):
            calls = []
            for q, k, v in sets:
                kp, vp, table = paged(k, v, page_size)
                calls.append(lambda q=q, kp=kp, vp=vp, table=table: flashjit.flash_attn_with_kvcache(
                    q, kp, vp, cache_seqlens=seqlens, block_table=table))
            fns[f"flashjit_page{page_size}"] = calls
    for name, backend in (("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION), ("sdpa_flash", SDPBackend.FLASH_ATTENTION)):
        def call(q, k, v, backend=backend):
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                      enable_gqa=True)
        fns[name] = [lambda q=q, k=k, v=v, call=call: call(q, k, v) for q, k, v in sets]
    return fns


def graph_of(calls, per_graph=20):
    """A CUDA graph of `per_graph` calls cycling over the copies, or the error that stopped it."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for c in calls:
            c()  # compile, load, warm
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(per_graph):
            calls[i % len(calls)]()
    return graph, per_graph


def time_row(graphs, rounds=9):
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = {name: [] for name in graphs}
    for r in range(rounds):
        names = list(graphs)
        for name in names[r % len(names):] + names[:r % len(names)]:
            graph, calls = graphs[name]
            graph.replay()  # lead replay
            start.record()
            graph.replay()
            stop.record()
            stop.synchronize()
            samples[name].append(start.elapsed_time(stop) / calls)
    return {name: sorted(s)[len(s) // 2] for name, s in samples.items()}


def host_us(calls, gpu_ms):
    """Host time per eager call, queue drained at the end (enough calls to span ~0.2 s of GPU time)."""
    n = max(20, min(200, int(200 / max(gpu_ms, 1e-3))))
    for c in calls:
        c()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(n):
        calls[i % len(calls)]()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / n * 1e6


def check(row, sets):
    """flashjit's output against SDPA's math backend in fp32 (the first sequence of one copy): max abs error."""
    q, k, v = (t[:1] for t in sets[0])
    out = flashjit.flash_attn_with_kvcache(q, k, v)
    ref = F.scaled_dot_product_attention(q.transpose(1, 2).float(), k.transpose(1, 2).float(), v.transpose(1, 2).float(),
                                         enable_gqa=True).transpose(1, 2)
    return (out.float() - ref).abs().max().item()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--seqlens", type=int, nargs="+", default=[1024, 4096, 16384, 65536])
    parser.add_argument("--heads-q", type=int, default=32)
    parser.add_argument("--heads-kv", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--layout", choices=["bshd", "bhsd"], default="bshd")
    parser.add_argument("--no-paged", action="store_true", help="skip the paged-cache rows")
    parser.add_argument("--max-gb", type=float, default=80.0,
                        help="skip rows whose caches (all copies) exceed this; paged rows need 3x")
    parser.add_argument("--output", type=str, default="")
    args = parser.parse_args()
    torch.manual_seed(0)
    copy_bw = copy_bandwidth()
    print(f"device copy bandwidth {copy_bw / 1e12:.2f} TB/s (read + write)", file=sys.stderr)
    results = []
    for batch in args.batches:
        for seqlen in args.seqlens:
            row = Row(batch, seqlen, args.heads_q, args.heads_kv, args.head_dim, args.layout, torch.bfloat16)
            if row.kv_bytes * row.copies > args.max_gb * 1e9:
                print(f"skip batch {batch} seqlen {seqlen}: {row.kv_bytes / 1e9:.1f} GB x {row.copies}", file=sys.stderr)
                continue
            # The paged copies of the cache too, where they fit beside it.
            with_paged = not args.no_paged and 3 * row.kv_bytes * row.copies <= args.max_gb * 1e9
            sets = row.caches()
            fns = backends(row, sets, with_paged)
            graphs, errors, host = {}, {}, {}
            for name, calls in fns.items():
                try:
                    graphs[name] = graph_of(calls)
                except Exception as e:  # noqa: BLE001 - a peer that cannot run the row is reported
                    errors[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            times = time_row(graphs)
            for name in graphs:
                host[name] = host_us(fns[name], times[name])
            entry = {"batch": batch, "seqlen": seqlen, "kv_bytes": row.kv_bytes, "copies": row.copies,
                     "max_abs_err_vs_fp32": check(row, sets), "backends": {}}
            for name, ms in times.items():
                bw = row.kv_bytes / (ms / 1e3)
                entry["backends"][name] = {"ms": ms, "gb_per_s": bw / 1e9, "fraction_of_copy": bw / copy_bw,
                                           "host_us_per_call": host[name]}
            for name, error in errors.items():
                entry["backends"][name] = {"error": error}
            results.append(entry)
            cells = " ".join(f"{n}={v['gb_per_s']:.0f}" if "gb_per_s" in v else f"{n}=ERR"
                             for n, v in entry["backends"].items())
            print(f"batch {batch:4d} seqlen {seqlen:6d}: GB/s {cells}", file=sys.stderr)
            del sets, fns, graphs
            torch.cuda.empty_cache()
            write(args, copy_bw, results)  # after every row: a run cut short keeps what it measured
    print(write(args, copy_bw, results))


def write(args, copy_bw, results):
    doc = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "cudnn": torch.backends.cudnn.version(), "date": time.strftime("%Y-%m-%d"),
           "method": "CUDA graph of 20 calls over rotating cache copies, median of interleaved replays",
           "layout": args.layout, "heads_q": args.heads_q, "heads_kv": args.heads_kv, "head_dim": args.head_dim,
           "seqlen_q": 1, "dtype": "bf16", "copy_bandwidth_gb_per_s": copy_bw / 1e9, "rows": results}
    text = json.dumps(doc, indent=1)
    if args.output:
        pathlib.Path(args.output).write_text(text)
    return text


if __name__ == "__main__":
    main()
