#!/usr/bin/env bash
# The installed package as an application sees it: `cmake --install` of the build tree into a
# scratch prefix, then examples/ (C++ and C) configured with find_package(flashjit) and built.
#   examples.sh BUILD_DIR SOURCE_DIR build   installs and builds
#   examples.sh BUILD_DIR SOURCE_DIR run     also runs them (exit 77, ctest's skip, without a GPU)
set -euo pipefail
build=$1 source=$2 mode=$3
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
cmake --install "$build" --prefix "$scratch/prefix" >/dev/null
cmake -S "$source/examples" -B "$scratch/examples" -G Ninja -DCMAKE_PREFIX_PATH="$scratch/prefix" >/dev/null
cmake --build "$scratch/examples"
[[ $mode == run ]] || exit 0
if ! (command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1); then
  echo "examples.sh: no GPU: built, not run"
  exit 77
fi
"$scratch/examples/attention_cpp"
"$scratch/examples/attention_c"
