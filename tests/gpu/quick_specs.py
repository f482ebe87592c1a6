#!/usr/bin/env python3
"""Writes tests/gpu/quick_specs.json: the kernel specs in a kernel cache directory, as a JSON array.
Run the quick tier with an empty cache, then this on that cache:
    FLASHJIT_CACHE_DIR=/tmp/quick build/tests/flashjit_gpu_tests "[quick]"
    tests/gpu/quick_specs.py /tmp/quick > tests/gpu/quick_specs.json
(flashjit-warm --specs reads the same file.)"""
import json
import pathlib
import sys

specs = {}
for meta in pathlib.Path(sys.argv[1]).glob("*/*/meta.json"):
    spec = json.loads(meta.read_text())["spec"]
    specs[meta.parent.name] = spec
json.dump([specs[name] for name in sorted(specs)], sys.stdout, indent=1)
print()
