"""Masked attention beside FlexAttention and FlashAttention-4, in one process (H200, bf16): the
document, prefix-LM and sliding-window masks as flashjit user mask functions with block masks from
flashjit.create_block_mask, against flex_attention (torch.compile) with its own block masks of the
same functions and FA4's mask_mod path with those block masks (where flash-attn-4 is installed:
../shared/peers/fa4); forward and forward + backward, in sequence-major memory (what a projection
produces; Flex sees a transposed view) and head-major memory. Also causal written as a user mask
beside flashjit's built-in causal, a random 10%-dense block mask beside the dense run, and the time
to build a block mask. Outputs checked against Flex's (max abs difference). Results:
bench/results/masks_<tag>.json.

    python bench/masks.py --tag h200 [--seqlens 8192 32768] [--head-dims 64 128] [--layouts bshd bhsd]
"""
import argparse
import json
import pathlib
import sys
import time

import torch
import torch._dynamo
from torch.nn.attention.flex_attention import create_block_mask as flex_block_mask
from torch.nn.attention.flex_attention import flex_attention

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from peers import interleaved_median_ms  # noqa: E402

import flashjit  # noqa: E402

try:
    import fa4_masks  # noqa: E402
except ImportError:
    fa4_masks = None

HIDDEN, TOKENS = 2048, 32768


def document_ids(seqlen, device, generator):
    """Documents of random lengths 256-4096 packed into the sequence."""
    lengths = []
    while sum(lengths) < seqlen:
        lengths.append(int(torch.randint(256, 4097, (1,), generator=generator)))
    ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[:seqlen]
    return ids.to(device=device, dtype=torch.int32).contiguous()


def masks(seqlen, doc):
    prefix, window = seqlen // 4, 1024
    return {
        "document": (lambda b, h, q, kv: (doc[q] == doc[kv]) & (q >= kv),
                     flashjit.AttentionMod(mask="return doc[q_idx] == doc[kv_idx] && q_idx >= kv_idx;",
                                           tensors={"doc": doc})),
        "prefix_lm": (lambda b, h, q, kv: (kv < prefix) | (q >= kv),
                      flashjit.AttentionMod(mask=f"return kv_idx < {prefix} || q_idx >= kv_idx;")),
        "sliding_window": (lambda b, h, q, kv: (q >= kv) & (q - kv < window),
                           flashjit.AttentionMod(mask=f"return q_idx >= kv_idx && q_idx - kv_idx < {window};")),
        "causal": (lambda b, h, q, kv: q >= kv, flashjit.AttentionMod(mask="return q_idx >= kv_idx;")),
    }


def event_ms(fn, iters=10):
    fn()
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(iters):
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    return sorted(times)[len(times) // 2]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tag", default="h200")
    parser.add_argument("--seqlens", type=int, nargs="+", default=[8192, 32768])
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--layouts", nargs="+", default=["bshd", "bhsd"], choices=["bshd", "bhsd"])
    parser.add_argument("--iters", type=int, default=10)
    args = parser.parse_args()
    device = torch.device("cuda")
    # Every (shape, mask) pair compiles flex_attention anew; past the default limit Dynamo falls back
    # to Flex's unfused path (and runs out of memory at 32k).
    torch._dynamo.config.cache_size_limit = torch._dynamo.config.recompile_limit = 256
    generator = torch.Generator().manual_seed(0)
    flex = torch.compile(flex_attention, dynamic=False)
    rows = []
    for seqlen in args.seqlens:
        batch = max(1, TOKENS // seqlen // 2)  # 8k: 2 sequences, 32k: 1
        doc = document_ids(seqlen, device, generator)
        prefix, window = seqlen // 4, 1024
        for head_dim in args.head_dims:
            heads = HIDDEN // head_dim
            for layout in args.layouts:
                # flashjit and FA4 take (B, S, H, D) views, Flex (B, H, S, D) views, of the same memory.
                shape = (batch, seqlen, heads, head_dim) if layout == "bshd" else (batch, heads, seqlen, head_dim)
                base = [torch.randn(shape, device=device, dtype=torch.bfloat16) for _ in range(4)]
                q, k, v, dout = (t if layout == "bshd" else t.transpose(1, 2) for t in base)
                for t in (q, k, v):
                    t.requires_grad_()
                bhsd = lambda t: t.transpose(1, 2)
                fwd_bwd = lambda fn: (lambda: torch.autograd.grad(fn(), (q, k, v), dout))
                with torch.no_grad():
                    dense_ms = interleaved_median_ms({"flashjit": lambda: flashjit.flash_attn_func(q, k, v)},
                                                     args.iters)["flashjit"]["median_ms"]
                for name, (mask_mod, mod) in masks(seqlen, doc).items():
                    flex_mask = flex_block_mask(mask_mod, None, None, seqlen, seqlen, device=device)
                    ours = flashjit.create_block_mask(mod, 1, 1, seqlen, seqlen)
                    fns = {"flashjit": lambda: flashjit.flash_attn_func(q, k, v, mod=mod, block_mask=ours),
                           "flex": lambda: bhsd(flex(bhsd(q), bhsd(k), bhsd(v), block_mask=flex_mask))}
                    if name == "causal":
                        fns["flashjit_builtin_causal"] = lambda: flashjit.flash_attn_func(q, k, v, causal=True)
                    fa4_error = None
                    if fa4_masks is not None:
                        fa4 = lambda: fa4_masks.attention(q, k, v, name, flex_mask, doc, prefix, window)
                        try:
                            fwd_bwd(fa4)()
                            fns["fa4"] = fa4
                        except Exception as e:  # noqa: BLE001 (recorded in the row)
                            fa4_error = f"{type(e).__name__}: {str(e)[:300]}"
                    with torch.no_grad():
                        forward = interleaved_median_ms(fns, args.iters)
                    both = interleaved_median_ms({n: fwd_bwd(fn) for n, fn in fns.items()}, args.iters)
                    with torch.no_grad():
                        want = fns["flex"]().float()
                        diffs = {n: (fn().float() - want).abs().max().item() for n, fn in fns.items() if n != "flex"}
                    row = dict(mask=name, layout=layout, seqlen=seqlen, batch=batch, heads=heads, head_dim=head_dim,
                               block_density=ours.density(), dense_fwd_ms=dense_ms,
                               max_abs_diff_vs_flex=diffs,
                               **{f"{n}_fwd_ms": t["median_ms"] for n, t in forward.items()},
                               **{f"{n}_fwd_bwd_ms": t["median_ms"] for n, t in both.items()})
                    for peer in ("flex", "fa4"):
                        if peer in fns:
                            row[f"flashjit_over_{peer}_fwd"] = row[f"{peer}_fwd_ms"] / row["flashjit_fwd_ms"]
                            row[f"flashjit_over_{peer}_fwd_bwd"] = row[f"{peer}_fwd_bwd_ms"] / row["flashjit_fwd_bwd_ms"]
                    if fa4_error:
                        row["fa4_error"] = fa4_error
                    if name == "causal":
                        for which in ("fwd", "fwd_bwd"):
                            row[f"user_over_builtin_causal_{which}"] = (row[f"flashjit_builtin_causal_{which}_ms"] /
                                                                        row[f"flashjit_{which}_ms"])
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                if layout != args.layouts[0]:
                    continue
                # Run time against the visible blocks: a random block mask at 10% density, full tiles.
                q_blocks = -(-seqlen // 128)
                tiles = torch.rand(1, 1, q_blocks, q_blocks, generator=generator) < 0.10
                sparse = flashjit.block_mask_from_tiles(tiles.to(device), seqlen, seqlen)
                with torch.no_grad():
                    t = interleaved_median_ms({"sparse": lambda: flashjit.flash_attn_func(q, k, v, block_mask=sparse)},
                                              args.iters)
                row = dict(mask="random_10pct", layout=layout, seqlen=seqlen, head_dim=head_dim,
                           block_density=sparse.density(), flashjit_fwd_ms=t["sparse"]["median_ms"], dense_fwd_ms=dense_ms)
                row["share_of_dense_time"] = row["flashjit_fwd_ms"] / dense_ms
                rows.append(row)
                print(json.dumps(row), flush=True)
    # Building a block mask: 32k x 32k in 128-blocks, one (batch, head), the document mask.
    build = {}
    seqlen = 32768
    doc = document_ids(seqlen, device, generator)
    for name, (mask_mod, mod) in masks(seqlen, doc).items():
        build[name] = dict(flashjit_ms=event_ms(lambda: flashjit.create_block_mask(mod, 1, 1, seqlen, seqlen)),
                           flex_ms=event_ms(lambda: flex_block_mask(mask_mod, None, None, seqlen, seqlen, device=device)))
        print(json.dumps({"build_block_mask_32k": name, **build[name]}), flush=True)
    result = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, flashjit=flashjit.__version__,
                  date=time.strftime("%Y-%m-%d"), dtype="bf16", fa4=fa4_masks is not None,
                  layouts="bshd: sequence-major memory, bhsd: head-major memory", rows=rows,
                  build_block_mask_32k=build)
    out = pathlib.Path(__file__).resolve().parent / "results" / f"masks_{args.tag}.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
