#!/usr/bin/env python3
"""flashjit's decode speed against a forced split count (num_splits), beside SDPA's CUDNN backend in
the same run (contiguous caches; --page-size times a paged one alone): the data the split heuristic
is fitted on. Rows and timing as bench/decode.py (a graph
of 20 calls over rotating cache copies, median of interleaved replays); fj_s0 is the heuristic's own
choice. GB/s of K+V read."""
import argparse
import json
import pathlib
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import decode  # noqa: E402
from decode import flashjit  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", nargs="+", default=["1x1024", "1x65536", "16x1024", "16x16384", "16x65536"],
                        help="BATCHxSEQLEN")
    parser.add_argument("--splits", type=int, nargs="+", default=[0, 1, 2, 4, 8, 16, 32])
    parser.add_argument("--layout", choices=["bshd", "bhsd"], default="bshd")
    parser.add_argument("--page-size", type=int, default=0, help="a paged cache of this page size (0: contiguous)")
    parser.add_argument("--pages-in-order", action="store_true",
                        help="page ids in the sequence's order (default: shuffled, as a serving engine's pool)")
    parser.add_argument("--output", type=str, default="")
    args = parser.parse_args()
    torch.manual_seed(0)
    rows = []
    for spec in args.rows:
        batch, seqlen = (int(x) for x in spec.split("x"))
        row = decode.Row(batch, seqlen, 32, 8, 128, args.layout, torch.bfloat16)
        sets = row.caches()
        seqlens = torch.full((batch,), seqlen, dtype=torch.int32, device="cuda")
        tables = [None] * len(sets)
        if args.page_size:
            paged = [decode.paged(k, v, args.page_size, shuffled=not args.pages_in_order) for _, k, v in sets]
            sets = [(q, kp, vp) for (q, _, _), (kp, vp, _) in zip(sets, paged)]
            tables = [table for _, _, table in paged]
        fns = {f"fj_s{s}": [lambda q=q, k=k, v=v, t=t, s=s: flashjit.flash_attn_with_kvcache(
            q, k, v, cache_seqlens=seqlens, block_table=t, num_splits=s) for (q, k, v), t in zip(sets, tables)]
            for s in args.splits}

        def cudnn(q, k, v):
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                      enable_gqa=True)
        if not args.page_size:
            fns["cudnn"] = [lambda q=q, k=k, v=v: cudnn(q, k, v) for q, k, v in sets]
        graphs = {name: decode.graph_of(calls) for name, calls in fns.items()}
        times = decode.time_row(graphs)
        entry = {"batch": batch, "seqlen": seqlen,
                 "gb_per_s": {name: round(row.kv_bytes / (ms / 1e3) / 1e9) for name, ms in times.items()}}
        rows.append(entry)
        print(entry, file=sys.stderr)
        del sets, fns, graphs
        torch.cuda.empty_cache()
    doc = {"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"), "layout": args.layout,
           "page_size": args.page_size, "pages_in_order": args.pages_in_order,
           "heads_q": 32, "heads_kv": 8, "head_dim": 128, "dtype": "bf16", "seqlen_q": 1,
           "tool": "bench/decode_splits.py", "rows": rows}
    if args.output:
        pathlib.Path(args.output).write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
