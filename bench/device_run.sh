#!/usr/bin/env bash
# One device call: GPU tests and timings over a build tree made on the development machine and
# carried along (the device has no -dev packages; binaries built here run there).
#   bench/device_run.sh [build-dir] [what...]   what: tests bench peers (default: tests)
set -uo pipefail
build=${1:-build}
shift || true
what=${*:-tests}
out=${OUT:-/tmp/flashjit-out}
mkdir -p "$out"
nvrtc=$(ls /usr/local/cuda/lib64/libnvrtc.so.13 2>/dev/null || find / -name 'libnvrtc.so.13' -print -quit 2>/dev/null)
export LD_LIBRARY_PATH=$(dirname "$nvrtc"):${LD_LIBRARY_PATH:-}
export FLASHJIT_CACHE_DIR=/tmp/flashjit-cache
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
status=0
for step in $what; do
  case $step in
    tests)
      GPU_TEST_REPORT=$out/pipeline_costs.jsonl "$build/tests/flashjit_gpu_tests" --durations yes 2>&1 | tee "$out/gpu_tests.log" | grep -vE '^[0-9.]+ s: ' | tail -40
      [[ ${PIPESTATUS[0]} -eq 0 ]] || status=1 ;;
    bench)
      "$build/tools/flashjit-bench" --check --json > "$out/bench.json" || status=1
      tail -c 3000 "$out/bench.json" ;;
    *) echo "unknown step $step"; status=2 ;;
  esac
done
exit $status
