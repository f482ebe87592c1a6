#!/usr/bin/env python3
"""Training steps of a Llama-shaped model with each attention backend: tokens per second of a whole
step (forward, cross-entropy loss, backward, AdamW), the number a user training a model sees.

The model is written here in plain PyTorch (no Transformers needed): embedding, --layers blocks of
RMSNorm -> fused q/k/v projection -> rotary embedding -> causal GQA attention -> output projection,
RMSNorm -> SwiGLU MLP, then a final RMSNorm and the LM head; bf16 weights, fused AdamW. Every
backend trains its own copy of the same initial weights on the same tokens; only the attention call
differs. q, k and v come out of the projection sequence-major, (batch, seq, heads, head_dim): that is
what flashjit and FlashAttention-4 take, and SDPA gets the transposed views (its GQA through
enable_gqa, or, where a backend refuses that, k and v repeated per query head, as models did before
it; the output records which).

Backends: flashjit (the Python package), cudnn and flash (SDPA's CUDNN and FLASH backends), fa4
(flash-attn-4's flash_attn.cute, where installed: ../shared/peers/fa4/). Steps are timed as
bench/peers.py times calls: a lead step, then back-to-back steps between CUDA events, one sample per
backend per round in a rotating order, median over --iters rounds. Before timing, each backend runs
--check-steps steps from the initial weights and the losses are printed side by side: the backends
must agree to bf16 noise, or the comparison is of different work. Prints one JSON document."""
import argparse
import copy
import json
import pathlib
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from peers import ClockReader, interleaved_median_ms  # noqa: E402


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


def rotary_tables(seqlen, head_dim, base=500000.0, device="cuda"):
    """cos and sin of shape (1, seq, 1, head_dim), broadcast over batch and heads of (b, s, h, d)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(seqlen, device=device, dtype=torch.float32), inv_freq)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos()[None, :, None, :].to(torch.bfloat16), angles.sin()[None, :, None, :].to(torch.bfloat16)


def apply_rotary(x, cos, sin):
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Block(nn.Module):
    def __init__(self, hidden, heads, kv_heads, ffn, attention):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, hidden // heads
        self.attention = attention  # (q, k, v) in (b, s, h, d) -> (b, s, h, d), causal
        self.attn_norm, self.mlp_norm = RMSNorm(hidden), RMSNorm(hidden)
        self.qkv = nn.Linear(hidden, (heads + 2 * kv_heads) * self.head_dim, bias=False)
        self.out = nn.Linear(heads * self.head_dim, hidden, bias=False)
        self.gate_up = nn.Linear(hidden, 2 * ffn, bias=False)
        self.down = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x, cos, sin):
        b, s, _ = x.shape
        qkv = self.qkv(self.attn_norm(x))
        q, k, v = qkv.split([self.heads * self.head_dim, self.kv_heads * self.head_dim,
                             self.kv_heads * self.head_dim], dim=-1)
        q = apply_rotary(q.view(b, s, self.heads, self.head_dim), cos, sin)
        k = apply_rotary(k.view(b, s, self.kv_heads, self.head_dim), cos, sin)
        v = v.view(b, s, self.kv_heads, self.head_dim)
        x = x + self.out(self.attention(q, k, v).reshape(b, s, self.heads * self.head_dim))
        gate, up = self.gate_up(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class Model(nn.Module):
    def __init__(self, args, attention):
        super().__init__()
        self.embed = nn.Embedding(args.vocab, args.hidden)
        self.blocks = nn.ModuleList(Block(args.hidden, args.heads, args.kv_heads, args.ffn, attention)
                                    for _ in range(args.layers))
        self.norm = RMSNorm(args.hidden)
        self.head = nn.Linear(args.hidden, args.vocab, bias=False)
        self.cos, self.sin = rotary_tables(args.seqlen, args.hidden // args.heads)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, self.cos, self.sin)
        return self.head(self.norm(x))


def attention_functions(backends):
    """name -> (attention(q, k, v) on (b, s, h, d), causal; a note on how it ran GQA)."""
    functions = {}
    if "flashjit" in backends:
        sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "python"))
        import flashjit
        functions["flashjit"] = (lambda q, k, v: flashjit.flash_attn_func(q, k, v, causal=True), "native GQA")
    if "fa4" in backends:
        from flash_attn.cute import flash_attn_func as fa4_attention

        def fa4(q, k, v):
            out = fa4_attention(q, k, v, causal=True)
            return out[0] if isinstance(out, tuple) else out
        functions["fa4"] = (fa4, "native GQA")
    for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
        if name not in backends:
            continue

        def sdpa(q, k, v, backend=backend, repeat=False):
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            with sdpa_kernel(backend):
                if repeat:
                    group = q.shape[1] // k.shape[1]
                    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
                    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
                else:
                    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            return out.transpose(1, 2)
        functions[name] = (sdpa, "enable_gqa")
        functions[name + ":repeat"] = (lambda q, k, v, sdpa=sdpa: sdpa(q, k, v, repeat=True), "k, v repeated")
    return functions


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--ffn", type=int, default=5632)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seqlens", default="2048,4096,8192")
    ap.add_argument("--tokens", type=int, default=16384, help="tokens per step (batch = tokens / seqlen)")
    ap.add_argument("--backends", default="flashjit,cudnn,flash")
    ap.add_argument("--iters", type=int, default=10, help="timed rounds")
    ap.add_argument("--check-steps", type=int, default=3, help="steps from the initial weights whose losses must agree")
    args = ap.parse_args()

    clocks = ClockReader()
    rows = []
    for seqlen in map(int, args.seqlens.split(",")):
        args.seqlen = seqlen
        batch = args.tokens // seqlen
        torch.manual_seed(0)
        reference = Model(args, attention=None).to(device="cuda", dtype=torch.bfloat16)
        tokens = torch.randint(0, args.vocab, (batch, seqlen + 1), device="cuda")
        inputs, targets = tokens[:, :-1], tokens[:, 1:]

        steps, losses, notes = {}, {}, {}
        for name, (attention, note) in attention_functions(args.backends.split(",")).items():
            if name.endswith(":repeat") and name.split(":")[0] in steps:
                continue  # SDPA with k and v repeated only where its enable_gqa path did not run
            model = copy.deepcopy(reference)
            for block in model.blocks:
                block.attention = attention
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

            def step(model=model, optimizer=optimizer):
                optimizer.zero_grad(set_to_none=True)
                logits = model(inputs)
                loss = F.cross_entropy(logits.float().view(-1, args.vocab), targets.reshape(-1))
                loss.backward()
                optimizer.step()
                return loss

            try:  # (a backend that cannot run the shape, or SDPA's GQA through a backend that refuses it)
                losses[name] = [step().item() for _ in range(args.check_steps)]
            except Exception as e:
                print(f"{name} s{seqlen}: {type(e).__name__}: {str(e).splitlines()[0]}", file=sys.stderr)
                continue
            steps[name], notes[name] = step, note
        print(f"s{seqlen} losses over {args.check_steps} steps: " +
              "; ".join(f"{n} {' '.join(f'{l:.4f}' for l in v)}" for n, v in losses.items() if n in steps),
              file=sys.stderr, flush=True)

        for name, timing in interleaved_median_ms(steps, iters=args.iters, clocks=clocks).items():
            tokens_per_s = args.tokens / (timing["median_ms"] * 1e-3)
            rows.append(dict(backend=name, gqa=notes[name], seqlen=seqlen, batch=batch, tokens_per_step=args.tokens,
                             tokens_per_s=tokens_per_s, losses=losses[name], **timing))
            clock = f"  {timing['sm_clock_mhz']} MHz" if "sm_clock_mhz" in timing else ""
            print(f"{name:14} s{seqlen:<6} {timing['median_ms']:9.2f} ms/step {tokens_per_s:10.0f} tokens/s{clock}",
                  file=sys.stderr, flush=True)
        base = {r["backend"]: r["tokens_per_s"] for r in rows if r["seqlen"] == seqlen}
        if "flashjit" in base:
            print("  flashjit / " + ", ".join(f"{n} {base['flashjit'] / t:.3f}" for n, t in base.items() if n != "flashjit"),
                  file=sys.stderr, flush=True)
        del reference
        torch.cuda.empty_cache()
    config = {k: getattr(args, k) for k in ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "tokens")}
    json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, cudnn=torch.backends.cudnn.version(),
                   model=config, rows=rows), sys.stdout, indent=1)


if __name__ == "__main__":
    main()
