#!/usr/bin/env bash
# One device call: GPU tests and timings over a build tree made on the development machine and
# carried along (the device has no -dev packages; binaries built here run there).
#   bench/device_run.sh [build-dir] [what...]
#   what: warm | tests | sanitize | sanitize-kvcache | python | host | sweep | grid | peers | fwdbwd |
#   tune | profile | decode | decode-splits | ring | fp8-vt | bwd-modes | train | pending | ab
#   (default: tests);
#   ab: a branch against this build: AB_BUILD is the branch's slim build (tools/flashjit-bench,
#   tools/flashjit-warm, tests/flashjit_gpu_tests), AB_TESTS a Catch spec for its GPU tests.
#   FLASHJIT_BENCH_ARGS adds arguments to the flashjit-bench steps, PEERS_ARGS to the peers step,
#   FWDBWD_ARGS to fwdbwd, RING_ARGS to ring's flashjit-bench runs (e.g. --backward), TRAIN_ARGS to
#   train (e.g. --backends flashjit,cudnn,flash,fa4 after sourcing FA4's part-b install).
#   STEP_TIMEOUT (seconds, default 480) bounds each program, so a hang costs one step, not the call;
#   budget it generously: a fresh machine compiles every kernel first (the grid alone takes ~100 s).
set -uo pipefail
build=${1:-build}
shift || true
what=${*:-tests}
out=${OUT:-/tmp/flashjit-out}
mkdir -p "$out"
nvrtc=$(ls /usr/local/cuda/lib64/libnvrtc.so.13 2>/dev/null || find / -name 'libnvrtc.so.13' -print -quit 2>/dev/null)
export LD_LIBRARY_PATH=$(dirname "$nvrtc"):${LD_LIBRARY_PATH:-}
export FLASHJIT_CACHE_DIR=${FLASHJIT_CACHE_DIR:-/tmp/flashjit-cache}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
status=0
bounded() {
  timeout --kill-after=10 "${STEP_TIMEOUT:-480}" "$@"
  local rc=$?
  [[ $rc -eq 124 || $rc -eq 137 ]] && echo "device_run: '$1' stopped after ${STEP_TIMEOUT:-480} s" >&2
  return $rc
}
for step in $what; do
  case $step in
    warm)
      # The default kernels compiled on every core first, so the steps after it mostly hit the cache.
      bounded "$build/tools/flashjit-warm" --arch sm_90a --preset default --head-dims 64 96 128 192 256 \
          --dtypes bf16 fp16 --masks none causal window --passes fwd bwd 2>&1 | tail -3
      [[ ${PIPESTATUS[0]} -eq 0 ]] || status=1 ;;
    sanitize)
      # compute-sanitizer over the Hopper kernels. Forward: memcheck on its tile-shape and margin
      # tests, racecheck and synccheck on the margin test (one persistent CTA takes every tile).
      # Backward: memcheck over head dims 192 and 256 (sm90_bwd's split path) and the smallest case of
      # each head dim, racecheck and synccheck on the latter.
      san() { bounded compute-sanitizer --tool "$1" --error-exitcode 1 "$build/tests/flashjit_gpu_tests" "$2" 2>&1 |
                tee -a "$out/sanitize_$1.log" | tail -4; [[ ${PIPESTATUS[0]} -eq 0 ]] || status=1; }
      san memcheck "[sm90]"
      san racecheck "sm90_fwd: sm_margin*"
      san synccheck "sm90_fwd: sm_margin*"
      san memcheck "backward: head dims 192 and 256*"
      san memcheck "backward: one head and an odd row count*"
      san racecheck "backward: one head and an odd row count*"
      san synccheck "backward: one head and an odd row count*" ;;
    sanitize-kvcache)
      # memcheck, racecheck and synccheck over forward_kvcache's quick set (TMA ring, cluster merge).
      for tool in memcheck racecheck synccheck; do
        bounded compute-sanitizer --tool $tool --error-exitcode 1 "$build/tests/flashjit_gpu_tests" "[kvcache][quick]" 2>&1 |
            tee -a "$out/sanitize_kvcache_$tool.log" | tail -3
        [[ ${PIPESTATUS[0]} -eq 0 ]] || status=1
      done ;;
    decode)
      # The decode table beside SDPA cuDNN/FLASH (bench/decode.py): sequence-major caches with the
      # paged rows, then head-major ones.
      export FLASHJIT_LIBRARY=$build/runtime/libflashjit.so PYTHONUNBUFFERED=1
      bounded python3 bench/decode.py --layout bshd --output "$out/decode_bshd.json" 2>&1 >/dev/null | tail -20
      [[ ${PIPESTATUS[0]} -eq 0 ]] || status=1
      bounded python3 bench/decode.py --layout bhsd --no-paged --output "$out/decode_bhsd.json" 2>&1 >/dev/null | tail -20
      [[ ${PIPESTATUS[0]} -eq 0 ]] || status=1 ;;
    decode-splits)
      # Decode speed against forced split counts (bench/decode_splits.py; DECODE_SPLITS_ARGS).
      export FLASHJIT_LIBRARY=$build/runtime/libflashjit.so PYTHONUNBUFFERED=1
      bounded python3 bench/decode_splits.py ${DECODE_SPLITS_ARGS:-} --output "$out/decode_splits.json" 2>&1 | tail -20
      [[ ${PIPESTATUS[0]} -eq 0 ]] || status=1 ;;
    tests)
      # GPU_TEST_FILTER: a Catch2 test spec (e.g. "[backward]") to run a subset.
      GPU_TEST_REPORT=$out/pipeline_costs.jsonl bounded "$build/tests/flashjit_gpu_tests" ${GPU_TEST_FILTER:+"$GPU_TEST_FILTER"} \
          --durations yes 2>&1 | tee "$out/gpu_tests.log" | grep -vE '^[0-9.]+ s: ' | tail -40
      [[ ${PIPESTATUS[0]} -eq 0 ]] || status=1 ;;
    sweep)
      bounded "$build/tools/flashjit-bench" --sweep --seqlens 4096 ${FLASHJIT_BENCH_ARGS:-} --json > "$out/sweep.json" || status=1
      python3 -c "
import json; r = json.load(open('$out/sweep.json'))
for row in r['rows']:
    best = sorted(row['sweep'], key=lambda x: x[1])[:4]
    print(row['head_dim'], row['seqlen'], 'causal' if row['causal'] else 'full', round(row['tflops'], 1), 'TFLOP/s', [(n.split('_')[3], round(ms, 3)) for n, ms in best])
" ;;
    grid)
      bounded "$build/tools/flashjit-bench" ${FLASHJIT_BENCH_ARGS:-} --json > "$out/grid.json" || status=1
      python3 -c "
import json; r = json.load(open('$out/grid.json'))
for row in r['rows']: print(row['head_dim'], row['seqlen'], 'causal' if row['causal'] else 'full', round(row['tflops'], 1), row['spec'])
" ;;
    tune)
      # flashjit-tune over the forward grid (TUNE_ARGS adds e.g. --pass fwd,bwd), then the grid with
      # the tuned database, each row interleaved with the heuristic's spec, for the per-row gain.
      bounded "$build/tools/flashjit-tune" --grid --causal off,on ${TUNE_ARGS:-} --output "$out/tuning.json" 2>&1 |
          tee "$out/tune.log" | tail -40
      [[ ${PIPESTATUS[0]} -eq 0 ]] || status=1
      rm -f "$out/tuning.json.lock"
      bounded "$build/tools/flashjit-bench" ${FLASHJIT_BENCH_ARGS:-} --tuning-db "$out/tuning.json" --versus-heuristic \
          --json > "$out/grid_tuned.json" || status=1
      python3 -c "
import json
for r in json.load(open('$out/grid_tuned.json'))['rows']:
    print(r['head_dim'], r['seqlen'], 'causal' if r['causal'] else 'full', round(r['heuristic_tflops'], 1), '->',
          round(r['tflops'], 1), round(r['heuristic_ms'] / r['median_ms'], 3), r['spec'])
" ;;
    python)
      bounded tests/python/run_tests.sh "$build/runtime/libflashjit.so" 2>&1 | tail -15
      [[ ${PIPESTATUS[0]} -eq 0 ]] || status=1 ;;
    profile)
      # Nsight Compute on the default kernels at one shape per head dim (FLASHJIT_PROFILE_DIMS,
      # FLASHJIT_PROFILE_SEQLEN); FLASHJIT_PROFILE_PASS=bwd profiles the backward's main kernel.
      pass=${FLASHJIT_PROFILE_PASS:-fwd} kernel=regex:flashjit_ pass_args=
      [[ $pass == bwd ]] && kernel=regex:dkdv && pass_args=--backward
      for d in ${FLASHJIT_PROFILE_DIMS:-64 128 256}; do
        profiled=("$build/tools/flashjit-bench" --head-dims $d --seqlens ${FLASHJIT_PROFILE_SEQLEN:-4096} --causal off
                  $pass_args --iters 1 --warmup 1)
        # The L2 reduction counters: the backward's dQ adds (requests, and sectors per request) are
        # what bound it at head dims 192 and 256 (stop 61).
        ncu --clock-control none -k $kernel -c 1 --section SpeedOfLight --section WarpStateStats \
            --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis_Tables --section Occupancy \
            --metrics lts__t_requests_op_red.sum,lts__t_sectors_op_red.sum,lts__throughput.avg.pct_of_peak_sustained_elapsed \
            "${profiled[@]}" > "$out/ncu_${pass}_d$d.txt" 2>&1 || status=1
        grep -E "Duration|Throughput|Pipe|Stall|Bank|Occupancy|Registers|Issued|Eligible|No Eligible|lts__" \
            "$out/ncu_${pass}_d$d.txt" | head -44
        # FLASHJIT_PROFILE_SOURCE=1: warp-stall samples per SASS instruction (where the warps wait:
        # which barrier, which wgmma), as CSV.
        if [[ -n ${FLASHJIT_PROFILE_SOURCE:-} ]]; then
          ncu --clock-control none -k $kernel -c 1 --section WarpStateStats --section SourceCounters --page source \
              --print-source sass --csv "${profiled[@]}" > "$out/ncu_source_${pass}_d$d.csv" 2>&1 || status=1
        fi
      done ;;
    host)
      # Host time per call: flashjit's Python and C entry points beside SDPA's (bench/host_overhead.py).
      FLASHJIT_LIBRARY=$build/runtime/libflashjit.so bounded python3 bench/host_overhead.py > "$out/host.json" \
          2> "$out/host.log" || status=1
      head -n 40 "$out/host.log" ;;
    peers)
      # flashjit (the Python package) is in the rounds by default, on the same tensors as the peers.
      FLASHJIT_LIBRARY=$build/runtime/libflashjit.so bounded python3 bench/peers.py ${PEERS_ARGS:-} \
          > "$out/peers.json" 2> "$out/peers.log" || status=1
      tail -n 40 "$out/peers.log" ;;
    fwdbwd)
      # Forward + backward: flashjit (Python package) beside SDPA FLASH and CUDNN, one process.
      FLASHJIT_LIBRARY=$build/runtime/libflashjit.so bounded python3 bench/peers.py --mode fwdbwd \
          --backends flashjit,flash,cudnn ${FWDBWD_ARGS:-} > "$out/fwdbwd.json" 2> "$out/fwdbwd.log" || status=1
      tail -n 60 "$out/fwdbwd.log" ;;
    train)
      # Training steps of a 4-layer Llama-shaped model (hidden 2048, GQA 16/4) per attention backend:
      # tokens/s of whole steps, the backends' first losses side by side (bench/train_step.py).
      FLASHJIT_LIBRARY=$build/runtime/libflashjit.so bounded python3 bench/train_step.py ${TRAIN_ARGS:-} \
          > "$out/train_step.json" 2> "$out/train_step.log" || status=1
      tail -n 30 "$out/train_step.log" ;;
    ring)
      # Ring attention: its GPU tests, the Python package's ring tests, and N virtual ranks beside one
      # call in both memory layouts (bench/results/ring_h200.json's rows).
      bounded "$build/tests/flashjit_gpu_tests" "[ring]" 2>&1 | grep -E '^ring|FAILED|passed|failed' | tail -40
      [[ ${PIPESTATUS[0]} -eq 0 ]] || status=1
      library=$(realpath "$build/runtime/libflashjit.so")
      (cd tests/python && FLASHJIT_LIBRARY=$library bounded python3 -m pytest -q -k ring test_flashjit.py) \
          > "$out/ring_python.log" 2>&1 || status=1
      tail -5 "$out/ring_python.log"
      for layout in bshd bhsd; do
        bounded "$build/tools/flashjit-bench" --ring 2,4,8 --layout $layout --head-dims 128 --seqlens 16384,32768,65536 \
            --causal off,on --iters 7 ${RING_ARGS:-} --json > "$out/ring_$layout.json" || status=1
      done ;;
    pending)
      # What the tree has not yet measured on a device (the README's "still to come"). Stop 58 (H100)
      # cleared sm90_bwd's gates (bench/results/bwd_modes_h100.json), FP8 with V transposed
      # beforehand (fp8-vt) and the compile-time change (ab). Left: the FP8 tiles in both V modes
      # (the tuner's candidates since then) timed by the tuner over the grid's FP8 rows, for the
      # defaults and the bundled database (on an H200), then the tuned rows beside the heuristic's in
      # both layouts; and the host's cold compile of the default forward kernels.
      bounded "$build/tools/flashjit-tune" --grid --dtype e4m3 --causal off,on --output "$out/tuning_fp8.json" 2>&1 |
          tee "$out/tune_fp8.log" | tail -20
      [[ ${PIPESTATUS[0]} -eq 0 ]] || status=1
      rm -f "$out/tuning_fp8.json.lock"
      for layout in bshd bhsd; do
        bounded "$build/tools/flashjit-bench" --dtype e4m3 --tuning-db "$out/tuning_fp8.json" --versus-heuristic \
            --layout $layout --json > "$out/fp8_tuned_$layout.json" || status=1
      done
      python3 -c "
import json
for layout in ('bshd', 'bhsd'):
    for r in json.load(open('$out/fp8_tuned_' + layout + '.json'))['rows']:
        print(layout, r['head_dim'], r['seqlen'], 'causal' if r['causal'] else 'full', round(r['heuristic_tflops']), '->',
              round(r['tflops']), round(r['heuristic_ms'] / r['median_ms'], 3), r['spec'])
" || status=1
      CUDA_CACHE_DISABLE=1 bounded "$build/tools/flashjit-warm" --arch sm_90a --preset default --passes fwd -j1 --json \
          --cache-dir "$(mktemp -d)" > "$out/compile_default_fwd.json" || status=1 ;;
    fp8-vt)
      # FP8 with V transposed before the forward (v_pretransposed, forced specs until this passes):
      # its GPU tests, then each row's spec in that mode beside the heuristic's (V transposed in shared
      # memory) in the same rounds, both layouts, then the mode's rows checked against the reference.
      GPU_TEST_REPORT=$out/pipeline_costs.jsonl bounded "$build/tests/flashjit_gpu_tests" "fp8: V transposed beforehand*,fp8: varlen*" \
          2>&1 | tee "$out/fp8_vt_tests.log" | grep -vE '^[0-9.]+ s: ' | tail -6
      [[ ${PIPESTATUS[0]} -eq 0 ]] || status=1
      for layout in bshd bhsd; do
        bounded "$build/tools/flashjit-bench" --dtype e4m3 --v-pretransposed --versus-heuristic --layout $layout \
            --head-dims 64,128,256 --seqlens 2048,4096,8192,16384 --causal off,on --json > "$out/fp8_vt_$layout.json" || status=1
      done
      python3 -c "
import json
for layout in ('bshd', 'bhsd'):
    for r in json.load(open('$out/fp8_vt_' + layout + '.json'))['rows']:
        print(layout, r.get('head_dim'), r.get('seqlen'), 'causal' if r.get('causal') else 'full',
              round(r['tflops']), 'vs', round(r['heuristic_tflops']), round(r['tflops'] / r['heuristic_tflops'], 3))
" || status=1
      for d in 64 96 128 192 256; do  # (16 heads each: 2048 is no multiple of 96 or 192)
        bounded "$build/tools/flashjit-bench" --dtype e4m3 --v-pretransposed --check --head-dims $d --hidden $((16 * d)) \
            --seqlens 1024 --causal off,on --iters 2 2>&1 | tail -2
        [[ ${PIPESTATUS[0]} -eq 0 ]] || status=1
      done ;;
    bwd-modes)
      # sm90_bwd beside fa2_bwd at head dims 32, 96, 160, 192 and 224, and deterministic beside atomic
      # from 64 to 256 (the writer warps order the adds up to 128, the consumers above); both layouts,
      # 16 heads of each head dim (hidden = 16 x head dim: 2048 is no multiple of 96 or 160). Rows in
      # $out/bwd_*.json, ratios printed (bench/results/bwd_modes_h100.json is a run of this).
      bench() { bounded "$build/tools/flashjit-bench" --backward --iters 10 "$@" --json; }
      for layout in bshd bhsd; do
        for d in 32 96 160 192 224; do
          for backend in fa2 sm90; do
            bench --backend $backend --layout $layout --head-dims $d --hidden $((16 * d)) --seqlens 2048,8192 \
                --causal off,on > "$out/bwd_${backend}_${layout}_d$d.json" || status=1
          done
        done
        for d in 64 96 128 192 256; do
          bench --backend sm90 --layout $layout --head-dims $d --hidden $((16 * d)) --seqlens 1024,4096,16384 \
              --causal off,on > "$out/bwd_atomic_${layout}_d$d.json" || status=1
          bench --backend sm90 --deterministic --layout $layout --head-dims $d --hidden $((16 * d)) \
              --seqlens 1024,4096,16384 --causal off,on > "$out/bwd_deterministic_${layout}_d$d.json" || status=1
        done
      done
      python3 - "$out" <<'PY'
import glob, json, sys
out = sys.argv[1]
def rows(prefix):
    r = {}
    for name in glob.glob(f"{out}/{prefix}_d*.json"):
        try:
            for x in json.load(open(name))["rows"]: r[(x["head_dim"], x["seqlen"], x["causal"])] = x["tflops"]
        except (OSError, ValueError, KeyError): pass
    return r
for layout in ("bshd", "bhsd"):
    for a, b, what in (("fa2", "sm90", "sm90_bwd / fa2_bwd"), ("atomic", "deterministic", "deterministic / atomic")):
        base, new = rows(f"bwd_{a}_{layout}"), rows(f"bwd_{b}_{layout}")
        print(f"{layout} {what}:")
        for key in sorted(base):
            if key in new: print(f"  d{key[0]} S{key[1]} {'causal' if key[2] else 'full'}: {base[key]:.0f} -> {new[key]:.0f} TFLOP/s, {new[key] / base[key]:.3f}x")
PY
      ;;
    ab)
      # A change to the kernels on a branch, before it lands: its GPU tests (AB_TESTS, default the
      # quick tier and the sm90 forward's), then its forward against this build's over the grid in
      # both layouts (bench/ab.sh, alternating rounds; AB_ARGS adds flashjit-bench arguments, e.g.
      # --backward), then both builds' cold compile of the default forward kernels, one at a time
      # (CUDA_CACHE_DISABLE: the driver's own cache would answer a repeat).
      ab_build=${AB_BUILD:?"ab: set AB_BUILD to the branch's build folder"}
      GPU_TEST_REPORT=$out/ab_pipeline_costs.jsonl bounded "$ab_build/tests/flashjit_gpu_tests" \
          "${AB_TESTS:-[quick],[sm90],[edges]}" 2>&1 | tee "$out/ab_tests.log" | grep -vE '^[0-9.]+ s: ' | tail -8
      [[ ${PIPESTATUS[0]} -eq 0 ]] || status=1
      for layout in bshd bhsd; do
        bounded bench/ab.sh "$build/tools/flashjit-bench" "$ab_build/tools/flashjit-bench" ${AB_ROUNDS:-3} -- \
            --layout $layout ${AB_ARGS:-} > "$out/ab_$layout.txt" 2>&1 || status=1
        tail -n 40 "$out/ab_$layout.txt"
      done
      for side in "$build" "$ab_build"; do
        name=$(basename "$side")
        CUDA_CACHE_DISABLE=1 bounded "$side/tools/flashjit-warm" --arch sm_90a --preset default --passes fwd -j1 --json \
            --cache-dir "$(mktemp -d)" > "$out/compile_$name.json" || status=1
        python3 -c "
import json, sys
kernels = json.load(open(sys.argv[1]))['kernels']
print(sys.argv[2], 'cold compile, default forward kernels:', round(sum(k['compile_ms'] for k in kernels) / 1000, 1), 's over',
      len(kernels), '; max', round(max(k['compile_ms'] for k in kernels)), 'ms')" "$out/compile_$name.json" "$name" || status=1
      done ;;
    *) echo "unknown step $step"; status=2 ;;
  esac
done
exit $status
