#!/usr/bin/env python3
"""FP8 (e4m3) forward against the bf16 forward, on DESIGN.md's grid (16k tokens, hidden 2048), and
FlashAttention-3's accuracy test. Prints one JSON document.

Speed: flashjit FP8, flashjit bf16 and PyTorch SDPA's cuDNN backend (bf16; PyTorch has no FP8
attention) on the same shapes, timed in turn in the same rounds (peers.interleaved_median_ms: a
lead call, then back-to-back calls between events). --layout bshd stores q, k, v sequence-major
(what a projection produces; SDPA sees a transposed view), bhsd head-major. FLOPs: 4 B H S^2 D,
halved when causal.

Accuracy (FlashAttention-3's): q, k, v ~ N(0, 1) + N(0, 100) x Bernoulli(0.001), head dim 128; the
RMSE of out against float64 attention of the unquantised inputs, for bf16 inputs and for FP8 with one
scale per tensor (amax / 448), as the paper reports it, with flashjit.quantize_fp8's scales per
sequence and KV head, and with its incoherent processing too (q and k rotated by a random Hadamard)."""
import argparse
import json
import pathlib
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "python"))  # (FLASHJIT_LIBRARY: the build's)
from peers import ClockReader, interleaved_median_ms  # noqa: E402

import flashjit  # noqa: E402


def quantize_per_tensor(x):
    scale = x.abs().amax().float().clamp(min=1e-6) / 448.0
    return (x.float() / scale).to(torch.float8_e4m3fn), scale


def speed_rows(layout, iters, clocks, head_dims, seqlens):
    rows = []
    for d in head_dims:
        heads = 2048 // d
        for s in seqlens:
            b = 16384 // s
            for causal in (False, True):
                def make(dtype):
                    shape = (b, s, heads, d) if layout == "bshd" else (b, heads, s, d)
                    t = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
                    t = t if layout == "bshd" else t.transpose(1, 2)  # flashjit's (b, s, h, d) view
                    return t if dtype == torch.bfloat16 else t.to(dtype)
                q, k, v = (make(torch.bfloat16) for _ in range(3))
                q8, k8, v8 = (t.to(torch.float8_e4m3fn) for t in (q, k, v))
                ones = torch.ones(b, heads, device="cuda")
                fns = {
                    "flashjit_fp8": lambda: flashjit.flash_attn_func(q8, k8, v8, causal=causal, q_descale=ones,
                                                                     k_descale=ones, v_descale=ones),
                    "flashjit_bf16": lambda: flashjit.flash_attn_func(q, k, v, causal=causal),
                }
                qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))

                def cudnn():
                    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                        return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
                fns["cudnn_bf16"] = cudnn
                out8 = fns["flashjit_fp8"]().float()
                ref = fns["flashjit_bf16"]().float()
                rel = ((out8 - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt()).item()
                timing = interleaved_median_ms(fns, iters=iters, clocks=clocks)
                flops = 4 * b * heads * s * s * d * (0.5 if causal else 1.0)
                row = dict(batch=b, seqlen=s, heads=heads, head_dim=d, causal=causal, layout=layout,
                           fp8_vs_bf16_relative_rmse=rel)
                for name, r in timing.items():
                    row[name] = dict(r, tflops=flops / r["median_ms"] / 1e9)
                row["fp8_over_bf16"] = timing["flashjit_bf16"]["median_ms"] / timing["flashjit_fp8"]["median_ms"]
                row["fp8_over_cudnn_bf16"] = timing["cudnn_bf16"]["median_ms"] / timing["flashjit_fp8"]["median_ms"]
                rows.append(row)
                print(json.dumps({k: row[k] for k in ("head_dim", "seqlen", "causal", "fp8_over_bf16")}
                                 | {"fp8_tflops": round(row["flashjit_fp8"]["tflops"], 1)}), file=sys.stderr)
    return rows


def accuracy(seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    b, s, h, d = 4, 4096, 16, 128  # (16k tokens x hidden 2048)

    def outlier_input():
        x = torch.randn(b, s, h, d, device="cuda", generator=g)
        spikes = torch.randn(b, s, h, d, device="cuda", generator=g) * 10.0
        return x + spikes * (torch.rand(b, s, h, d, device="cuda", generator=g) < 0.001)
    q, k, v = outlier_input(), outlier_input(), outlier_input()
    ref = F.scaled_dot_product_attention(*(t.double().transpose(1, 2) for t in (q, k, v))).transpose(1, 2)

    def rmse(out):
        return (out.double() - ref).pow(2).mean().sqrt().item()
    result = dict(shape=[b, s, h, d], bf16=rmse(flashjit.flash_attn_func(*(t.bfloat16() for t in (q, k, v)))))
    quantized = [quantize_per_tensor(t) for t in (q, k, v)]
    descales = [torch.full((b, h), scale.item(), device="cuda") for _, scale in quantized]
    result["fp8_per_tensor"] = rmse(flashjit.flash_attn_func(*(x for x, _ in quantized), q_descale=descales[0],
                                                             k_descale=descales[1], v_descale=descales[2]))
    for name, incoherent in (("fp8_per_head", False), ("fp8_per_head_incoherent", True)):
        q8, k8, v8, qs, ks, vs = flashjit.quantize_fp8(q, k, v, incoherent=incoherent)
        result[name] = rmse(flashjit.flash_attn_func(q8, k8, v8, q_descale=qs, k_descale=ks, v_descale=vs))
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--layout", choices=("bshd", "bhsd"), default="bshd")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument("--seqlens", type=int, nargs="+", default=[2048, 4096, 8192, 16384])
    parser.add_argument("--no-accuracy", action="store_true")
    args = parser.parse_args()
    clocks = ClockReader()
    rows = speed_rows(args.layout, args.iters, clocks, args.head_dims, args.seqlens)
    print(json.dumps(dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                          cudnn=torch.backends.cudnn.version(), layout=args.layout, rows=rows,
                          accuracy=None if args.no_accuracy else accuracy()), indent=1))


if __name__ == "__main__":
    main()
