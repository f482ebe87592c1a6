"""The attention's eager calls (dense, packed variable-length, KV cache) and autograd nodes in C++
(_autograd.cpp), compiled for the installed torch and Python by torch.utils.cpp_extension on first
use and kept in torch's extension folder (TORCH_EXTENSIONS_DIR, or torch's default), so that a later
process loads it in milliseconds.

FLASHJIT_TORCH_EXTENSION: 1 (default) builds it in the background, calls taking the Python path
until it is ready; sync builds it inside the first call that wants it; 0 never uses it. Where it
cannot be built (no C++ compiler or ninja, a torch without CUDA) the Python path stays, and
FLASHJIT_VERBOSE=1 says why.

The compile runs in a process of its own, in a session of its own: a program that exits (or is
killed) during the build leaves it to finish, not torch's build lock held by a dead process, which
would make every later load wait on it. A lock older than any build is removed.

Run as a script (`python _extension.py`, as the build does), this file builds the extension and exits.
"""
import hashlib
import os
import pathlib
import subprocess
import sys
import threading
import time

_HERE = pathlib.Path(__file__).resolve().parent
_MODE = os.environ.get("FLASHJIT_TORCH_EXTENSION", "1").strip().lower()
_VERBOSE = os.environ.get("FLASHJIT_VERBOSE", "") not in ("", "0")
_STALE_LOCK_SECONDS = 900  # a build takes under a minute; a lock this old belongs to a dead one
_BUILD_TIMEOUT_SECONDS = 600
_C_FUNCTIONS = ("flashjit_attention_options_init", "flashjit_forward", "flashjit_backward", "flashjit_forward_varlen",
                "flashjit_backward_varlen", "flashjit_forward_kvcache", "flashjit_last_error")  # what bind() takes

_module = None  # the built and bound module, once ready
_failure = None  # why it is not available, once known
_builder = None  # the thread that waits for the build and loads the module
_lock = threading.Lock()


def _off():
    return _MODE in ("0", "off")


def _include_dir():
    """flashjit.h's folder: in the wheel beside the package, else in the source tree."""
    for candidate in (_HERE / "include", _HERE.parent.parent / "runtime" / "include"):
        if (candidate / "flashjit" / "flashjit.h").exists():
            return candidate
    raise FileNotFoundError("flashjit/flashjit.h (the C API's header) is neither in the package nor in the source tree")


def _load_arguments():
    """cpp_extension.load's arguments. The name changes with the sources, torch and Python, so that two
    versions never share (or rebuild over) one build folder."""
    import torch
    import torch.utils.cpp_extension as cpp_extension
    source = _HERE / "_autograd.cpp"
    include = _include_dir()
    python = f"{sys.version_info.major}.{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
    digest = hashlib.sha256(source.read_bytes() + (include / "flashjit" / "flashjit.h").read_bytes() +
                            f"{torch.__version__} {python}".encode()).hexdigest()[:16]
    name = f"flashjit_autograd_{digest}"
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()
    folder = pathlib.Path(root) / name
    return dict(name=name, sources=[str(source)], extra_include_paths=[str(include)], extra_cflags=["-O2"],
                extra_ldflags=["-ltorch_cuda"], build_directory=str(folder), verbose=_VERBOSE)


def _compile():
    """The build itself (in the child process)."""
    import torch.utils.cpp_extension as cpp_extension
    arguments = _load_arguments()
    folder = pathlib.Path(arguments["build_directory"])
    folder.mkdir(parents=True, exist_ok=True)
    lock = folder / "lock"
    try:
        if time.time() - lock.stat().st_mtime > _STALE_LOCK_SECONDS:
            lock.unlink()
    except FileNotFoundError:
        pass
    cpp_extension.load(**arguments)


def _build():
    """Builds in a child process unless an earlier one did, then loads the module here and binds it to
    the loaded library."""
    global _module, _failure
    try:
        import ctypes
        import torch.utils.cpp_extension as cpp_extension
        from . import FlashJitError, _lib
        arguments = _load_arguments()
        if not (pathlib.Path(arguments["build_directory"]) / f"{arguments['name']}.so").exists():
            # (ninja from pip sits beside the interpreter, which need not be on PATH)
            path = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])
            child = subprocess.run([sys.executable, str(_HERE / "_extension.py")], capture_output=not _VERBOSE,
                                   text=True, timeout=_BUILD_TIMEOUT_SECONDS, start_new_session=True,
                                   env={**os.environ, "PATH": path})
            if child.returncode != 0:  # (its last line is the exception; with FLASHJIT_VERBOSE=1 all went to stderr)
                lines = (child.stderr or child.stdout or "see above").strip().splitlines()
                raise RuntimeError(f"its build exited with {child.returncode}: {lines[-1]}")
        module = cpp_extension.load(**arguments)  # (built: this checks it is current and loads it)
        functions = {name: ctypes.cast(getattr(_lib, name), ctypes.c_void_p).value for name in _C_FUNCTIONS}
        module.bind(functions, FlashJitError, _VERBOSE)
        _module = module
    except Exception as e:  # (no compiler or ninja, a build error, a timeout: the Python path stays)
        _failure = f"{type(e).__name__}: {e}"
        if _VERBOSE:
            print(f"flashjit: the C++ autograd extension is not used ({_failure})", file=sys.stderr)


def module():
    """The extension module if it is ready, else None (its build starts on the first call)."""
    if _off():
        return None
    if _module is not None or _failure is not None:
        return _module
    global _builder
    with _lock:
        if _builder is None:
            _builder = threading.Thread(target=_build, name="flashjit-extension-build", daemon=True)
            _builder.start()
    if _MODE == "sync":
        _builder.join()
    return _module


def wait(timeout=None):
    """Builds (or loads) the extension and returns it; None where it is off or unavailable (status())."""
    if _off():
        return None
    module()
    if _builder is not None:
        _builder.join(timeout)
    return _module


def status():
    """'ready', 'off', 'building', 'not started', or why it is unavailable."""
    if _module is not None:
        return "ready"
    if _off():
        return "off"
    if _failure is not None:
        return _failure
    return "building" if _builder is not None else "not started"


if __name__ == "__main__":
    _compile()
