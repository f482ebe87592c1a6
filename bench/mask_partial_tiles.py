"""What the element mask of partly visible tiles costs: each of bench/masks.py's user masks through
its block mask, beside the same visible tiles run as fully visible ones without a mask (the floor:
list walk and GEMMs only) and the built-in causal mask. Forward, and forward + backward for the
user masks. flashjit only (peers: bench/masks.py); run it once per library build to compare builds.

  FLASHJIT_LIBRARY=... python3 bench/mask_partial_tiles.py --label NAME [--no-backward]

Prints a JSON row per timing and writes bench/results/mask_partial_tiles_<label>.json.
"""
import argparse
import json
import pathlib
import sys
import time

import torch

import flashjit

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from masks import document_ids, masks  # noqa: E402


def visible_tile_map(bm, q_blocks, kv_blocks):
    """The (1, 1, q_blocks, kv_blocks) map of the tiles bm visits, partly or fully."""
    seen = torch.zeros(q_blocks, kv_blocks + 1, dtype=torch.bool, device="cuda")
    for num, idx in ((bm.kv_num_blocks, bm.kv_indices), (bm.full_kv_num_blocks, bm.full_kv_indices)):
        count, ids = num[0, 0].long(), idx[0, 0].long()
        listed = torch.arange(ids.shape[-1], device="cuda")[None, :] < count[:, None]
        seen.scatter_(1, torch.where(listed, ids, kv_blocks), True)  # unlisted entries land in the spare column
    return seen[:, :kv_blocks].reshape(1, 1, q_blocks, kv_blocks)


def queued_ms(fn, calls=20, samples=5):
    """Best of `samples` means over `calls` queued calls after an untimed lead call."""
    fn()
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(samples):
        fn()
        start.record()
        for _ in range(calls):
            fn()
        stop.record()
        stop.synchronize()
        best = min(best, start.elapsed_time(stop) / calls)
    return best


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--label", required=True)
    parser.add_argument("--seqlen", type=int, default=8192)
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--no-backward", action="store_true")
    args = parser.parse_args()
    seqlen, blocks = args.seqlen, args.seqlen // 128
    doc = document_ids(seqlen, "cuda", torch.Generator().manual_seed(0))
    rows = []

    def record(**row):
        rows.append(row)
        print(json.dumps(row), flush=True)

    for head_dim in args.head_dims:
        heads = 2048 // head_dim
        q, k, v = (torch.randn(2, seqlen, heads, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        runs = {"causal_builtin": lambda: flashjit.flash_attn_func(q, k, v, causal=True)}
        for name in ("causal", "document", "sliding_window"):
            mod = masks(seqlen, doc)[name][1]
            bm = flashjit.create_block_mask(mod, 1, 1, seqlen, seqlen)
            runs[name] = lambda mod=mod, bm=bm: flashjit.flash_attn_func(q, k, v, mod=mod, block_mask=bm)
            whole = flashjit.block_mask_from_tiles(visible_tile_map(bm, blocks, blocks), seqlen, seqlen)
            runs[name + "_tiles_full_no_mask"] = lambda bm=whole: flashjit.flash_attn_func(q, k, v, block_mask=bm)
        with torch.no_grad():
            for name, fn in runs.items():
                record(head_dim=head_dim, run=name, timed="fwd", ms=queued_ms(fn))
        if args.no_backward:
            continue
        dout = torch.randn_like(q)
        for t in (q, k, v):
            t.requires_grad_()
        for name in ("causal_builtin", "causal", "document", "sliding_window"):
            fn = runs[name]
            record(head_dim=head_dim, run=name, timed="fwd+bwd",
                   ms=queued_ms(lambda: torch.autograd.grad(fn(), (q, k, v), dout), calls=5))
        for t in (q, k, v):
            t.requires_grad_(False)
    result = dict(device=torch.cuda.get_device_name(), label=args.label, date=time.strftime("%Y-%m-%d"),
                  dtype="bf16", batch=2, seqlen=seqlen, hidden=2048, layout="bshd", rows=rows)
    out = pathlib.Path(__file__).resolve().parent / "results" / f"mask_partial_tiles_{args.label}.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
