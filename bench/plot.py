#!/usr/bin/env python3
"""TFLOP/s against sequence length, one panel per head dim and mask, flashjit beside the peers of
a peers.py table (bench/results/*.json with rows of head_dim, seqlen, causal and <peer>_tflops),
as a PNG. Needs matplotlib (not a dependency of flashjit).

    python3 bench/plot.py bench/results/sm90_fwd_h200.json -o bench/results/sm90_fwd_h200.png
"""
import argparse
import json
import pathlib

LABELS = {"flashjit": "flashjit", "fa4": "FlashAttention-4", "cudnn": "SDPA cuDNN", "flash": "SDPA FLASH (FA2)",
          "flex": "FlexAttention"}
COLORS = {"flashjit": "tab:blue", "fa4": "tab:purple", "cudnn": "tab:orange", "flash": "tab:green", "flex": "tab:red"}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("table", type=pathlib.Path, help="a peers.py results JSON")
    parser.add_argument("-o", "--output", type=pathlib.Path, help="the PNG (default: the table's name, .png)")
    args = parser.parse_args()
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    table = json.loads(args.table.read_text())
    rows = table["rows"]
    head_dims = sorted({r["head_dim"] for r in rows})
    masks = sorted({bool(r["causal"]) for r in rows})
    peers = [p for p in LABELS if any(f"{p}_tflops" in r for r in rows)]
    fig, axes = plt.subplots(len(masks), len(head_dims), figsize=(4.2 * len(head_dims), 3.4 * len(masks)),
                             squeeze=False, sharey=True)
    for i, causal in enumerate(masks):
        for j, d in enumerate(head_dims):
            ax = axes[i][j]
            panel = sorted((r for r in rows if r["head_dim"] == d and bool(r["causal"]) == causal),
                           key=lambda r: r["seqlen"])
            for peer in peers:
                points = [(r["seqlen"], r[f"{peer}_tflops"]) for r in panel if r.get(f"{peer}_tflops")]
                if points:
                    ax.plot(*zip(*points), marker="o", linewidth=2.5 if peer == "flashjit" else 1.2,
                            color=COLORS[peer], label=LABELS[peer])
            ax.set_xscale("log", base=2)
            ax.set_title(f"head dim {d}, {'causal' if causal else 'no mask'}")
            ax.set_xlabel("sequence length")
            ax.grid(alpha=0.3)
            if j == 0:
                ax.set_ylabel("TFLOP/s")
    # One legend for every peer, whichever panels it appears in.
    handles = {}
    for ax in axes.flat:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, handle)
    axes[0][0].legend(handles.values(), handles.keys(), fontsize=8)
    mode = {"fwd": "forward", "fwdbwd": "forward + backward"}.get(table.get("mode"), table.get("mode", ""))
    fig.suptitle(f"{table.get('device', '')} {table.get('dtype', '')}, {table.get('tokens', '')} tokens x "
                 f"{table.get('hidden', '')} hidden, {mode}, {table.get('layout', '')} ({table.get('date', '')}, "
                 f"{args.table.name})", fontsize=10)
    fig.tight_layout()
    output = args.output or args.table.with_suffix(".png")
    fig.savefig(output, dpi=90)
    print(f"plot.py: {output}")


if __name__ == "__main__":
    main()
