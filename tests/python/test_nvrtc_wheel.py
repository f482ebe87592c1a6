"""Where the CUDA toolkit's NVRTC is not on the loader's path, `import flashjit` loads the NVRTC of
pip's nvidia wheel (which PyTorch depends on) and compiles with it. The toolkit's library
directories are hidden by bind-mounting empty directories over them in a private mount namespace
(`unshare -m`, root), so this runs only where that is allowed."""
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

PYTHON_DIR = pathlib.Path(__file__).resolve().parent.parent.parent / "python"
sys.path.insert(0, str(PYTHON_DIR))
from flashjit import _capi  # noqa: E402

CHILD = r"""
import torch, flashjit
q = torch.randn(1, 200, 2, 64, device="cuda", dtype=torch.bfloat16)
out = flashjit.flash_attn_func(q, q, q, causal=True)
want = torch.nn.functional.scaled_dot_product_attention(*(q.transpose(1, 2).float(),) * 3, is_causal=True)
assert (out.float() - want.transpose(1, 2)).abs().max().item() < 2e-2
assert flashjit.cache_stats()["compiles"] >= 1
print([line.split()[-1] for line in open("/proc/self/maps") if "libnvrtc.so" in line][0])
"""


def toolkit_nvrtc_dirs():
    """The real directories the loader would find the toolkit's libnvrtc.so.13 in."""
    dirs = set()
    listing = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True).stdout
    for line in listing.splitlines():
        if "libnvrtc.so.13" in line and "=>" in line:
            dirs.add(os.path.realpath(os.path.dirname(line.split("=>")[1].strip())))
    for entry in os.environ.get("LD_LIBRARY_PATH", "").split(":"):
        if entry and os.path.exists(os.path.join(entry, "libnvrtc.so.13")):
            dirs.add(os.path.realpath(entry))
    return sorted(d for d in dirs if "site-packages" not in d)


def test_import_and_compile_with_the_wheels_nvrtc():
    wheel_dirs = _capi.nvrtc_wheel_dirs()
    if not wheel_dirs:
        pytest.skip("the nvidia NVRTC wheel is not installed")
    hidden = toolkit_nvrtc_dirs()
    if shutil.which("unshare") is None or os.geteuid() != 0 or not hidden:
        pytest.skip("needs root, unshare and a toolkit NVRTC to hide")
    with tempfile.TemporaryDirectory() as empty, tempfile.TemporaryDirectory() as cache:
        mounts = " && ".join(f"mount --bind {empty} {d}" for d in hidden)
        env = dict(os.environ, FLASHJIT_CACHE_DIR=cache, PYTHONPATH=str(PYTHON_DIR))
        probe = subprocess.run(["unshare", "-m", "--propagation", "private", "true"], capture_output=True)
        if probe.returncode != 0:
            pytest.skip(f"unshare -m is not allowed here: {probe.stderr.decode().strip()}")
        child = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c",
                                f'{mounts} && exec "$0" -c "$1"', sys.executable, CHILD],
                               capture_output=True, text=True, env=env, timeout=300)
        assert child.returncode == 0, child.stderr[-3000:]
        loaded = child.stdout.strip().splitlines()[-1]
        wheels = [os.path.realpath(d) for d in wheel_dirs]
        assert any(loaded.startswith(d) for d in wheels), f"NVRTC loaded from {loaded}, not the wheel's {wheels}"
