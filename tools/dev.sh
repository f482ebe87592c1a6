#!/usr/bin/env bash
# flashjit's one entry point for a fresh machine (Debian/Ubuntu, CUDA toolkit installed):
#   tools/dev.sh main    set up, build, then with a GPU run attention (checked against the
#                        reference) and time it; with none, warm the cache for sm_90a and list it
#   tools/dev.sh test    set up, build, run the test suite (GPU tests skip without a GPU)
#   tools/dev.sh sanitize  the CPU tests again in an ASan + UBSan build (UBSan aborts on any
#                        finding), in build-sanitize/
#   tools/dev.sh wheel   pip install . into a fresh virtual environment, then import it and run a tool
#   tools/dev.sh deps | build
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=${FLASHJIT_BUILD_DIR:-$root/build}
packages=(cmake ninja-build g++ libfmt-dev nlohmann-json3-dev catch2 libcli11-dev libxxhash-dev)

deps() {
  local missing=()
  for p in "${packages[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing+=("$p")
  done
  if ((${#missing[@]})); then
    echo "dev.sh: installing ${missing[*]}"
    local sudo=""
    [[ $(id -u) -eq 0 ]] || sudo=sudo
    $sudo apt-get update -q
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q "${missing[@]}"
  fi
  if ! command -v nvcc >/dev/null && [[ ! -x /usr/local/cuda/bin/nvcc ]]; then
    echo "dev.sh: the CUDA toolkit (NVRTC and headers) is missing; install it first" >&2
    exit 1
  fi
}

configure_and_build() {
  export PATH=$PATH:/usr/local/cuda/bin
  cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
  cmake --build "$build" -j "$(nproc)"
}

has_gpu() {
  command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1
}

main_job() {
  if has_gpu; then
    # Tune this GPU for a few grid rows (merged into build/tuning.json), then run them checked
    # against the reference kernel (fp32, slow, so the sequence lengths stay short) with the
    # tuned kernels; flashjit-bench without --check times the whole grid.
    "$build/tools/flashjit-tune" --shape 16,1024,1024,16,16,128 --shape 8,2048,2048,16,16,128 \
        --causal off,on --output "$build/tuning.json"
    "$build/tools/flashjit-bench" --check --seqlens 512,1024,2048 --tuning-db "$build/tuning.json"
  else
    echo "dev.sh: no GPU here: warming the kernel cache for sm_90a"
    "$build/tools/flashjit-warm" --arch sm_90a --preset default
  fi
}

sanitize() {
  export PATH=$PATH:/usr/local/cuda/bin
  local dir=${FLASHJIT_SANITIZE_BUILD_DIR:-$root/build-sanitize}
  cmake -S "$root" -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
      -DCMAKE_CXX_FLAGS="-fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer" >/dev/null
  cmake --build "$dir" -j "$(nproc)"
  # Leaks are not what this build is for (NVRTC and the driver keep process-lifetime state). The
  # compile sweeps (label `sweep`) run NVRTC a thousand times, ASan's allocator slowing NVRTC
  # rather than checking flashjit: the plain tier runs them, this one the compile smoke set. The
  # installed-package tests (label `install`) build programs against the instrumented library.
  ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
      ctest --test-dir "$dir" --output-on-failure -j "$(nproc)" --label-exclude 'sweep|install'
}

# pip install . into a fresh virtual environment, as a user would: the wheel's library, package and
# console scripts work with no environment variables (built by scikit-build-core from PyPI).
wheel() {
  export PATH=$PATH:/usr/local/cuda/bin
  local venv
  venv=$(mktemp -d)
  trap 'rm -rf "$venv"' RETURN
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q "$root"
  (cd "$venv" && "$venv/bin/python" -c 'import flashjit; print("dev.sh: installed flashjit", flashjit.__version__, "at", flashjit.__file__)')
  # What the package's C++ torch extension compiles from on first use: its source and the C API's header.
  (cd "$venv" && "$venv/bin/python" -c 'from flashjit import _extension as e; h = e._include_dir(); s = e._HERE / "_autograd.cpp"
assert h.is_relative_to(e._HERE) and s.exists(), (h, s); print("dev.sh: extension sources", s, h)')
  "$venv/bin/flashjit-warm" --version
  # One compile through the installed tool, into a cache of its own.
  printf '[{"family":"reference_fwd","arch":"sm_90a","dtype":"bf16","head_dim":64,"block_m":4,"block_n":32,"num_warps":4,"num_stages":1,"mask":"causal","softcap":false,"block_sparse":false,"continues":false}]' \
      > "$venv/spec.json"
  "$venv/bin/flashjit-warm" --specs "$venv/spec.json" --cache-dir "$venv/cache"
}

case "${1:-}" in
  deps) deps ;;
  build) deps && configure_and_build ;;
  main) deps && configure_and_build && main_job ;;
  test) deps && configure_and_build && ctest --test-dir "$build" --output-on-failure -j "$(nproc)" ;;
  sanitize) deps && sanitize ;;
  wheel) deps && wheel ;;
  *) echo "usage: tools/dev.sh main|test|sanitize|wheel|deps|build" >&2; exit 2 ;;
esac
