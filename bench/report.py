#!/usr/bin/env python3
"""Turn one peers.py run (with its "flashjit" backend: flashjit and every peer on the same tensors,
in the same layout and process) into bench/results/<name>.json, with each row's ratio to the
peers, and print the table. The layout is peers.py's, recorded in the file.

    bench/report.py peers.json --name sm90_fwd_h200_bshd [--sweep sweep.json] [--note "..."]

(flashjit-bench's grid is for flashjit against itself, bench/ab.sh: its rows are not merged with
the peers', whose tensors and process differ.)
"""
import argparse
import datetime
import json
import math
import pathlib


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("peers", metavar="peers.json")
    ap.add_argument("--name", required=True)
    ap.add_argument("--sweep", help="flashjit-bench --sweep output of the same call, kept alongside")
    ap.add_argument("--note", default="")
    ap.add_argument("--min-seqlen", type=int, default=1024, help="rows in the summary's ratios")
    args = ap.parse_args()

    peers = json.load(open(args.peers))
    if "layout" not in peers:
        ap.error(f"{args.peers} records no layout: run peers.py again")
    own = [dict(r, spec="(dispatch default)") for r in peers["rows"] if r["backend"] == "flashjit"]
    if not own:
        ap.error(f"{args.peers} has no flashjit rows: run peers.py with --backends flashjit,...")
    grid = dict(device=peers["device"], dtype="bf16", rows=own,
                tokens=own[0]["batch"] * own[0]["seqlen"], hidden=own[0]["heads"] * own[0]["head_dim"])
    mode = peers.get("mode", "fwd")
    peer = {(r["backend"], r["head_dim"], r["seqlen"], r["causal"]): r["tflops"] for r in peers["rows"]}
    peer_clock = {(r["backend"], r["head_dim"], r["seqlen"], r["causal"]): r.get("sm_clock_mhz") for r in peers["rows"]}
    rows, ratios = [], {"flash": [], "cudnn": [], "flex": [], "fa4": []}
    print(f"{'d':>4} {'S':>6} {'mask':7} {'flashjit':>8} {'FA2':>7} {'cuDNN':>7} {'Flex':>7} {'FA4':>7} {'/FA2':>6} "
          f"{'/cuDNN':>7} {'/FA4':>6}  spec")
    for r in grid["rows"]:
        key = (r["head_dim"], r["seqlen"], r["causal"])
        row = dict(head_dim=r["head_dim"], seqlen=r["seqlen"], batch=r["batch"], heads=r["heads"],
                   causal=r["causal"], flashjit_tflops=r["tflops"], flashjit_ms=r["median_ms"], spec=r["spec"])
        if r.get("sm_clock_mhz"):
            row["flashjit_sm_clock_mhz"] = r["sm_clock_mhz"]
        for name in ratios:
            tf = peer.get((name,) + key)
            row[f"{name}_tflops"] = tf
            row[f"ratio_vs_{name}"] = r["tflops"] / tf if tf else None
            if peer_clock.get((name,) + key):
                row[f"{name}_sm_clock_mhz"] = peer_clock[(name,) + key]
            if tf and r["seqlen"] >= args.min_seqlen:
                ratios[name].append(r["tflops"] / tf)
        rows.append(row)
        fmt = lambda x: f"{x:7.1f}" if x else "      -"
        print(f"{r['head_dim']:>4} {r['seqlen']:>6} {'causal' if r['causal'] else 'full':7} {r['tflops']:8.1f} "
              f"{fmt(row['flash_tflops'])} {fmt(row['cudnn_tflops'])} {fmt(row['flex_tflops'])} {fmt(row['fa4_tflops'])} "
              f"{row['ratio_vs_flash'] or 0:6.3f} {row['ratio_vs_cudnn'] or 0:7.3f} {row['ratio_vs_fa4'] or 0:6.3f}"
              f"  {r['spec']}")
    summary = {}
    for name, values in ratios.items():
        if values:
            summary[name] = dict(geomean_ratio=math.exp(sum(map(math.log, values)) / len(values)),
                                 min_ratio=min(values), rows=len(values))
            print(f"vs {name} (rows with S >= {args.min_seqlen}): geomean {summary[name]['geomean_ratio']:.3f}, "
                  f"min {summary[name]['min_ratio']:.3f} over {len(values)} rows")
    result = dict(name=args.name, date=datetime.date.today().isoformat(), device=grid["device"],
                  torch=peers.get("torch"), cudnn=peers.get("cudnn"), dtype=grid["dtype"],
                  tokens=grid["tokens"], hidden=grid["hidden"],
                  mode=mode, layout=peers["layout"], summary_min_seqlen=args.min_seqlen, flop_convention="4*B*H*S*S*D, halved when causal" + (
                      "; forward + backward = 3.5x" if mode == "fwdbwd" else ""), method=(
                      "median of the samples, each ~10 ms of back-to-back calls between CUDA events, "
                      "after warm-up; flashjit (Python package) and the peers on the same tensors in one "
                      "process, one sample of each per round in a rotating order, the SM clock read after "
                      "each sample"),
                  note=args.note, summary=summary, rows=rows)
    if args.sweep:
        result["sweep"] = json.load(open(args.sweep))["rows"]
    out = pathlib.Path(__file__).parent / "results" / f"{args.name}.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
