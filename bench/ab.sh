#!/usr/bin/env bash
# A/B flashjit-bench binaries (main's and one or more branches', say: the templates are compiled into
# the binary) over the same rows in one device call. Runs alternate A, B1, B2, ..., A, B1, ... so
# clock and thermal drift fall on all alike; prints each row's median time per binary over the
# rounds and each B's speedup over A.
#   bench/ab.sh A-bench B-bench [B-bench ...] [rounds] [-- flashjit-bench arguments]
# A branch's binary, built here, travels inside the carried build folder:
#   git worktree add /tmp/b BRANCH && cmake -S /tmp/b -B /tmp/b/build -G Ninja -DCMAKE_BUILD_TYPE=Release &&
#   cmake --build /tmp/b/build --target flashjit-bench && cp /tmp/b/build/tools/flashjit-bench build/b-flashjit-bench
#   bench/ab.sh build/tools/flashjit-bench build/b-flashjit-bench 3 -- --head-dims 128,256 --seqlens 2048
set -euo pipefail
binaries=()
rounds=3
while [[ $# -gt 0 && $1 != -- ]]; do
  if [[ $1 =~ ^[0-9]+$ ]]; then rounds=$1; else binaries+=("$1"); fi
  shift
done
[[ ${1:-} == -- ]] && shift
if [[ ${#binaries[@]} -lt 2 ]]; then
  echo "usage: bench/ab.sh A-bench B-bench [B-bench ...] [rounds] [-- flashjit-bench arguments]" >&2
  exit 2
fi
out=$(mktemp -d)
# The table after every round (over the rounds so far): a run cut short still leaves one.
report() {
python3 - "$out" "$1" "${binaries[@]}" <<'PY'
import json, statistics, sys
out, rounds, names = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
print(f"after {rounds} round(s): A = {names[0]}" + "".join(f", B{i} = {n}" for i, n in enumerate(names[1:], 1)))
def load(side):
    rows = {}
    for r in range(1, rounds + 1):
        for row in json.load(open(f"{out}/{side}_{r}.json"))["rows"]:
            rows.setdefault((row["head_dim"], row["seqlen"], row["causal"]), []).append(row["median_ms"])
    return rows
sides = [load(i) for i in range(len(names))]
header = f"{'d':>4} {'S':>6} {'mask':7} {'A ms':>9}" + "".join(f" {f'B{i} ms':>9} {f'B{i} speedup':>11}" for i in range(1, len(names)))
print(header)
for key in sorted(sides[0]):
    d, s, causal = key
    a = statistics.median(sides[0][key])
    line = f"{d:4} {s:6} {'causal' if causal else 'full':7} {a:9.3f}"
    for b in sides[1:]:
        mb = statistics.median(b[key])
        line += f" {mb:9.3f} {a / mb:11.3f}"
    print(line, flush=True)
PY
}
for r in $(seq "$rounds"); do
  for i in "${!binaries[@]}"; do
    "${binaries[$i]}" "$@" --json > "$out/${i}_$r.json"
  done
  report "$r"
done
