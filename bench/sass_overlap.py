#!/usr/bin/env python3
"""Whether sm90_fwd's softmax runs while its P V GEMM does (the intra-warpgroup overlap), read from
the SASS: in each main-loop step the consumer waits for S (WARPGROUP.DEPBAR.LE gsb0, 0x1), runs
the softmax, then waits for P V (... 0x0). ptxas may hoist the second wait above the softmax; this
counts the MUFU.EX2s between the two waits of each step (all of the step's exponentials, kBlockN / 2
+ 2, when the overlap holds; 0 when ptxas moved the wait up).

Compiles the specs with flashjit-warm (no GPU needed) and disassembles them with cuobjdump, which is
not in every toolkit install (this machine: /opt/cudatools; the device machine: on PATH):
    bench/sass_overlap.py [specs.json] [--warm build/tools/flashjit-warm] [--cuobjdump PATH]
specs.json: a JSON array of kernel specs; without it, the forward kernels of flashjit-warm's
default preset for sm_90a (the heuristic's and the bundled database's picks, bf16, head dims 64,
128 and 256, full and causal).
Exit status: 0 every step of every spec overlaps, 1 some do not, 2 tools missing or bad input."""
import argparse
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile


def exponentials_between_waits(sass):
    """For each step (a 'DEPBAR ... 0x1' followed by a 'DEPBAR ... 0x0'), the MUFU.EX2s between."""
    counts, inside = [], None
    for line in sass.splitlines():
        if "WARPGROUP.DEPBAR.LE" in line:
            if re.search(r"gsb0,\s*0x1\b", line):
                inside = 0
            elif inside is not None:
                counts.append(inside)
                inside = None
        elif inside is not None and "MUFU.EX2" in line:
            inside += 1
    return counts


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("specs", nargs="?")
    ap.add_argument("--warm", default="build/tools/flashjit-warm")
    ap.add_argument("--cuobjdump", default=shutil.which("cuobjdump") or "/opt/cudatools/cuobjdump")
    args = ap.parse_args()
    if not pathlib.Path(args.cuobjdump).exists():
        print(f"cuobjdump not found (looked for {args.cuobjdump}); pass --cuobjdump", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as cache:
        which = (["--specs", args.specs] if args.specs else
                 ["--arch", "sm_90a", "--preset", "default", "--head-dims", "64", "128", "256", "--dtypes", "bf16",
                  "--masks", "none", "causal", "--passes", "fwd"])
        warm = subprocess.run([args.warm, *which, "--cache-dir", cache], capture_output=True, text=True)
        if warm.returncode != 0:
            print(warm.stdout + warm.stderr, file=sys.stderr)
            return 2
        status = 0
        for cubin in sorted(pathlib.Path(cache).glob("sm_*/sm90_fwd_*/kernel.cubin")):
            name = cubin.parent.name.rsplit("-", 1)[0]
            sass = subprocess.run([args.cuobjdump, "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
            counts = exponentials_between_waits(sass)
            overlapped = bool(counts) and all(c > 0 for c in counts)
            status = status or (0 if overlapped else 1)
            print(f"{'ok  ' if overlapped else 'NO  '} {name}: exponentials between a step's two waits: {counts}")
    return status


if __name__ == "__main__":
    sys.exit(main())
