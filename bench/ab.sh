#!/usr/bin/env bash
# A/B two flashjit-bench binaries (main's and a branch's, say: the templates are compiled into the
# binary) over the same rows in one device call. Runs alternate A, B, A, B... so clock and thermal
# drift fall on both alike; prints each row's median time per binary over the rounds and B's speedup.
#   bench/ab.sh A-bench B-bench [rounds] [-- flashjit-bench arguments]
# B's binary, built here from a branch, travels inside the carried build folder:
#   git worktree add /tmp/b BRANCH && cmake -S /tmp/b -B /tmp/b/build -G Ninja -DCMAKE_BUILD_TYPE=Release &&
#   cmake --build /tmp/b/build --target flashjit-bench && cp /tmp/b/build/tools/flashjit-bench build/b-flashjit-bench
#   bench/ab.sh build/tools/flashjit-bench build/b-flashjit-bench 3 -- --head-dims 128,256 --seqlens 2048
set -euo pipefail
a=$1 b=$2
shift 2
rounds=3
if [[ $# -gt 0 && $1 != -- ]]; then rounds=$1; shift; fi
[[ ${1:-} == -- ]] && shift
out=$(mktemp -d)
# The table after every round (over the rounds so far): a run cut short still leaves one.
report() {
python3 - "$out" "$1" <<'PY'
import json, statistics, sys
out, rounds = sys.argv[1], int(sys.argv[2])
print(f"after {rounds} round(s):")
def load(side):
    rows = {}
    for r in range(1, rounds + 1):
        for row in json.load(open(f"{out}/{side}_{r}.json"))["rows"]:
            rows.setdefault((row["head_dim"], row["seqlen"], row["causal"]), []).append(row["median_ms"])
    return rows
a, b = load("a"), load("b")
print(f"{'d':>4} {'S':>6} {'mask':7} {'A ms':>9} {'B ms':>9} {'B speedup':>9}")
for key in sorted(a):
    ma, mb = statistics.median(a[key]), statistics.median(b[key])
    d, s, causal = key
    print(f"{d:4} {s:6} {'causal' if causal else 'full':7} {ma:9.3f} {mb:9.3f} {ma / mb:9.3f}", flush=True)
PY
}
for r in $(seq "$rounds"); do
  "$a" "$@" --json > "$out/a_$r.json"
  "$b" "$@" --json > "$out/b_$r.json"
  report "$r"
done
