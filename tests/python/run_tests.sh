#!/usr/bin/env bash
# CTest entry for the Python package: exit 77 (skipped) only where torch is not installed or there
# is no GPU. A torch that is installed but fails to import, or a missing pytest, is a failure.
set -u
python3 - <<'PY'
import importlib.util, sys
if importlib.util.find_spec("torch") is None:
    print("python tests skipped: torch is not installed")
    sys.exit(77)
try:
    import torch
except Exception as e:  # installed but broken: a failure, not a skip
    print(f"python tests FAILED: torch is installed but does not import: {e!r}")
    sys.exit(1)
if not torch.cuda.is_available():
    print("python tests skipped: torch sees no CUDA device")
    sys.exit(77)
if importlib.util.find_spec("pytest") is None:
    print("python tests FAILED: torch and a GPU are here but pytest is not installed")
    sys.exit(1)
PY
status=$?
[[ $status -eq 0 ]] || exit $status
export FLASHJIT_LIBRARY=${1:?usage: run_tests.sh path/to/libflashjit.so}
# The C++ extension (python/flashjit/_extension.py) built before the first call that wants it, so that
# every dense, varlen and KV-cache call in the suite takes it; its agreement tests run the Python path
# beside it.
export FLASHJIT_TORCH_EXTENSION=${FLASHJIT_TORCH_EXTENSION:-sync}
exec python3 -m pytest -q "$(dirname "$0")" "${@:2}"
