"""The console scripts of the wheel (pip install .): flashjit-warm, flashjit-tune and flashjit-bench
run the binaries installed in flashjit/bin, with the NVRTC this package loaded (the CUDA toolkit's, or
pip's where the toolkit's is not on the loader's path) first on theirs, so the tools compile and
key the cache as the library does."""
import os
import pathlib
import sys


def _loaded_nvrtc_dir():
    # (Importing the package, which this module is part of, loaded the library and its NVRTC.)
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                if "libnvrtc.so" in line:
                    return os.path.dirname(line.split()[-1])
    except OSError:
        pass
    return None


def _run(tool):
    binary = pathlib.Path(__file__).resolve().parent / "bin" / tool
    if not binary.exists():
        sys.exit(f"{tool}: {binary} is missing: this flashjit was not installed from a wheel "
                 f"(in a source tree the tools are build/tools/{tool})")
    env = dict(os.environ)
    nvrtc_dir = _loaded_nvrtc_dir()
    if nvrtc_dir:
        env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (nvrtc_dir, env.get("LD_LIBRARY_PATH")) if p)
    os.execve(str(binary), [tool] + sys.argv[1:], env)


def warm():
    _run("flashjit-warm")


def tune():
    _run("flashjit-tune")


def bench():
    _run("flashjit-bench")
