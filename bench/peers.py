#!/usr/bin/env python3
"""Time flashjit's peers on the standard grid of DESIGN.md, with the same method as flashjit-bench
(batched calls between CUDA events, median of samples): PyTorch SDPA with the FLASH
(FlashAttention-2) and CUDNN backends, FlexAttention, and FlashAttention-4 ("fa4", flash-attn-4's
flash_attn.cute where installed: ../shared/peers/fa4/). The backends of a row are timed in turn,
one sample each per round, with the SM clock read after each sample (NVML, where present). Prints
one JSON document.

This is the one path for tables against peers: the "flashjit" backend (the Python package, on
(b, s, h, d) views of the same tensors) runs beside the peers in the same rounds, so every number of
a row comes from the same tensors in the same layout, which the output records. --layout bshd (the
default, as flashjit-bench's) stores the tensors sequence-major (what a q/k/v projection produces,
flash-attn's order; SDPA sees a transposed view), bhsd head-major (SDPA's own). --mode fwdbwd times
forward + backward (autograd over q, k, v with a random dout).
FLOPs: forward 4*B*H*S*S*D (halved when causal); forward + backward 3.5x that."""
import argparse
import json
import math
import pathlib
import sys

import torch
import torch._dynamo
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


class ClockReader:
    """The SM clock and the active clock-event reasons (power cap, thermal) through NVML, read right
    after each sample: whether a backend's time was set by the chip's clock rather than its code.
    Inert where NVML is missing."""
    POWER_CAP, THERMAL = 0x4 | 0x80, 0x20 | 0x40  # SW power cap, HW power brake; SW/HW thermal slowdown

    def __init__(self):
        try:
            import pynvml
            pynvml.nvmlInit()
            self.nvml = pynvml
            device = torch.cuda.current_device()
            try:  # NVML numbers GPUs its own way (CUDA_VISIBLE_DEVICES does not apply): ours by PCI bus
                props = torch.cuda.get_device_properties(device)
                bus = f"{props.pci_domain_id:08x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
                self.handle = pynvml.nvmlDeviceGetHandleByPciBusId(bus)
            except Exception:
                self.handle = pynvml.nvmlDeviceGetHandleByIndex(device)
        except Exception:
            self.nvml = None

    def read(self):
        if self.nvml is None:
            return None
        reasons = self.nvml.nvmlDeviceGetCurrentClocksEventReasons(self.handle)
        return self.nvml.nvmlDeviceGetClockInfo(self.handle, self.nvml.NVML_CLOCK_SM), reasons


def interleaved_median_ms(fns, iters=20, clocks=None):
    """Median ms per call of each function in `fns` (name -> callable), timed in turn: every round
    takes one sample of each, in an order that rotates, so clock or thermal drift during a row falls
    on every backend alike.
    With a ClockReader, also each backend's median SM clock (MHz) and the share of its samples that
    ended under a power or thermal cap."""
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def timed(fn, calls):
        fn()  # untimed lead call (see below)
        start.record()
        for _ in range(calls):
            fn()
        stop.record()
        stop.synchronize()
        return start.elapsed_time(stop)

    # Back-to-back calls filling ~10 ms per sample, so that one call's host work overlaps the
    # previous call's kernel, as it does in a model: the samples time the GPU, not the launch path.
    # An untimed lead call runs before the start event, so the GPU is busy while the host queues the
    # timed calls. Without it each sample began with the GPU waiting for the host's first launches:
    # on the H200 machine that cost a forward + backward sample ~0.4 ms through flashjit's Python
    # autograd path and ~0.17 ms through SDPA's (batches of 1 to 16 calls, 1k tokens, head dim 64),
    # 3-6% of a 10 ms sample, a launch-path cost the samples are not meant to hold.
    calls = {name: max(1, min(200, int(10.0 / max(timed(fn, 1), 1e-3)))) for name, fn in fns.items()}
    samples = {name: [] for name in fns}
    readings = {name: [] for name in fns}
    names = list(fns)
    for round_ in range(iters):
        # The order rotates each round: no backend always runs right after the same one (a
        # power-hungry predecessor leaves the clock lower for whatever follows it).
        for name in names[round_ % len(names):] + names[:round_ % len(names)]:
            fn = fns[name]
            samples[name].append(timed(fn, calls[name]) / calls[name])
            if clocks is not None and (reading := clocks.read()) is not None:
                readings[name].append(reading)
    median = lambda v: sorted(v)[len(v) // 2]
    result = {}
    for name, v in samples.items():
        result[name] = dict(median_ms=median(v))
        if readings[name]:
            share = lambda mask: sum(bool(r & mask) for _, r in readings[name]) / len(readings[name])
            result[name].update(sm_clock_mhz=median([mhz for mhz, _ in readings[name]]),
                                power_capped=share(ClockReader.POWER_CAP), thermal_capped=share(ClockReader.THERMAL))
    return result


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--head-dims", default="64,128,256")
    ap.add_argument("--seqlens", default="512,1024,2048,4096,8192,16384")
    ap.add_argument("--causal", default="off,on")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--backends", default="flashjit,flash,cudnn,flex")
    ap.add_argument("--flex-head-dims", default="64,128,256", help="FlexAttention compiles per shape: limit it")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--mode", choices=("fwd", "fwdbwd"), default="fwd")
    ap.add_argument("--layout", choices=("bhsd", "bshd"), default="bshd",
                    help="memory order of q, k, v and dout: head-major (SDPA's) or sequence-major (flash-attn's)")
    args = ap.parse_args()
    backward = args.mode == "fwdbwd"

    backends = args.backends.split(",")
    flex = None
    if "flex" in backends:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        torch._dynamo.config.cache_size_limit = 256
        flex = torch.compile(flex_attention, dynamic=False)
    if "fa4" in backends:
        from flash_attn.cute import flash_attn_func as fa4_attention
    if "flashjit" in backends:
        sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "python"))
        import flashjit

    rows = []
    clocks = ClockReader()
    torch.manual_seed(0)
    for d in map(int, args.head_dims.split(",")):
        for s in map(int, args.seqlens.split(",")):
            for c in args.causal.split(","):
                causal = c == "on"
                b, h = args.tokens // s, args.hidden // d
                # Every backend sees (b, h, s, d) tensors over memory in --layout's order (FA2 runs
                # 8-13% faster on sequence-major memory at 1k tokens, measured on the H200).
                def tensor(grad=False):
                    if args.layout == "bhsd":
                        return torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=grad)
                    base = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=grad)
                    return base.transpose(1, 2)

                q, k, v = (tensor(backward) for _ in range(3))
                dout = tensor()
                flops = 4.0 * b * h * s * s * d / (2 if causal else 1) * (3.5 if backward else 1.0)

                def make_attention(name):
                    if name in ("flash", "cudnn"):
                        backend = SDPBackend.FLASH_ATTENTION if name == "flash" else SDPBackend.CUDNN_ATTENTION
                        def attention():
                            with sdpa_kernel(backend):
                                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
                        return attention
                    if name == "flashjit":  # (b, s, h, d) views of the same tensors
                        return lambda: flashjit.flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                                causal=causal).transpose(1, 2)
                    if name == "fa4":  # (b, s, h, d) views too; it may return (out, lse)
                        def attention():
                            out = fa4_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=causal)
                            return (out[0] if isinstance(out, tuple) else out).transpose(1, 2)
                        return attention
                    if name == "flex" and str(d) in args.flex_head_dims.split(","):
                        mask = None
                        if causal:
                            mask = create_block_mask(lambda b_, h_, qi, ki: qi >= ki, None, None, s, s, device="cuda")
                        return lambda: flex(q, k, v, block_mask=mask)
                    return None

                # Warm-up calls (FlexAttention compiles here); a backend that cannot run a shape is
                # recorded, not fatal.
                fns = {}
                for name in backends:
                    try:
                        attention = make_attention(name)
                        if attention is None:
                            continue
                        fn = (lambda a=attention: torch.autograd.grad(a(), (q, k, v), dout)) if backward else attention
                        for _ in range(3):
                            fn()
                        torch.cuda.synchronize()
                        fns[name] = fn
                    except Exception as e:
                        print(f"{name} d{d} s{s} causal={causal}: {type(e).__name__}: {e}", file=sys.stderr)
                for name, timing in interleaved_median_ms(fns, iters=args.iters, clocks=clocks).items():
                    ms = timing["median_ms"]
                    rows.append(dict(backend=name, head_dim=d, seqlen=s, batch=b, heads=h, causal=causal,
                                     tflops=flops / (ms * 1e-3) / 1e12, **timing))
                    clock = (f"  {timing['sm_clock_mhz']} MHz, power-capped {timing['power_capped']:.0%}"
                             if "sm_clock_mhz" in timing else "")
                    print(f"{name:8} d{d:<4} s{s:<6} {'causal' if causal else 'full':7} {ms:9.3f} ms "
                          f"{rows[-1]['tflops']:7.1f} TFLOP/s{clock}", file=sys.stderr, flush=True)
    json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, mode=args.mode, layout=args.layout,
                   cudnn=torch.backends.cudnn.version(), rows=rows), sys.stdout, indent=1)


if __name__ == "__main__":
    main()
