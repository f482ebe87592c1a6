#!/usr/bin/env bash
# CTest entry for the Python package: exit 77 (skipped) where python3 lacks pytest or torch, or
# there is no GPU; otherwise run the tests against the library that was just built.
set -u
python3 -c "import pytest, torch; assert torch.cuda.is_available()" 2>/dev/null || {
  echo "python tests skipped: needs pytest, torch and a CUDA device"
  exit 77
}
export FLASHJIT_LIBRARY=${1:?usage: run_tests.sh path/to/libflashjit.so}
exec python3 -m pytest -q "$(dirname "$0")"
