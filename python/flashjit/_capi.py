"""ctypes declarations of libflashjit's C API (runtime/include/flashjit/flashjit.h)."""
import ctypes
import os
import pathlib

FLOAT16, BFLOAT16, FLOAT32, INT32 = 0, 1, 2, 3
BACKENDS = {"auto": 0, "reference": 1, "fa2": 2, "sm90": 3}
STATUS_NAMES = {
    1: "invalid argument", 2: "unsupported", 3: "compile failed", 4: "no CUDA driver", 5: "CUDA error",
    6: "cache error", 7: "I/O error", 8: "out of resources", 9: "internal error",
}


class Tensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("dtype", ctypes.c_int32),
        ("device", ctypes.c_int32),
        ("rank", ctypes.c_int32),
        ("shape", ctypes.c_int64 * 4),
        ("strides", ctypes.c_int64 * 4),
    ]


class AttentionOptions(ctypes.Structure):
    _fields_ = [
        ("softmax_scale", ctypes.c_float),
        ("causal", ctypes.c_int32),
        ("window_left", ctypes.c_int32),
        ("window_right", ctypes.c_int32),
        ("softcap", ctypes.c_float),
        ("backend", ctypes.c_int32),
        ("stream", ctypes.c_void_p),
        ("deterministic", ctypes.c_int32),
        ("sm_margin", ctypes.c_int32),
        ("num_splits", ctypes.c_int32),
    ]


def _candidates():
    # The library lives in the build tree (tools/dev.sh builds it) unless FLASHJIT_LIBRARY names it.
    explicit = os.environ.get("FLASHJIT_LIBRARY")
    if explicit:
        yield pathlib.Path(explicit)
    here = pathlib.Path(__file__).resolve().parent
    yield here / "libflashjit.so"
    root = here.parent.parent
    for build in sorted(root.glob("build*")):
        yield build / "runtime" / "libflashjit.so"


def load():
    tried = []
    for path in _candidates():
        tried.append(str(path))
        if path.exists():
            lib = ctypes.CDLL(str(path))
            break
    else:
        raise ImportError("flashjit: libflashjit.so not found (looked at: " + ", ".join(tried) +
                          "); build it with tools/dev.sh build or set FLASHJIT_LIBRARY")
    P = ctypes.POINTER
    lib.flashjit_attention_options_init.argtypes = [P(AttentionOptions)]
    lib.flashjit_attention_options_init.restype = None
    lib.flashjit_forward.argtypes = [P(Tensor)] * 5 + [P(AttentionOptions)]
    lib.flashjit_forward.restype = ctypes.c_int
    lib.flashjit_forward_varlen.argtypes = [P(Tensor)] * 7 + [ctypes.c_int32, ctypes.c_int32, P(AttentionOptions)]
    lib.flashjit_forward_varlen.restype = ctypes.c_int
    lib.flashjit_backward.argtypes = [P(Tensor)] * 9 + [P(AttentionOptions)]
    lib.flashjit_backward.restype = ctypes.c_int
    lib.flashjit_backward_varlen.argtypes = [P(Tensor)] * 11 + [ctypes.c_int32, ctypes.c_int32, P(AttentionOptions)]
    lib.flashjit_backward_varlen.restype = ctypes.c_int
    lib.flashjit_forward_kvcache.argtypes = [P(Tensor)] * 9 + [P(AttentionOptions)]
    lib.flashjit_forward_kvcache.restype = ctypes.c_int
    lib.flashjit_check_kvcache.argtypes = [ctypes.c_void_p]
    lib.flashjit_check_kvcache.restype = ctypes.c_int
    lib.flashjit_load_tuning_db.argtypes = [ctypes.c_char_p]
    lib.flashjit_load_tuning_db.restype = ctypes.c_int
    lib.flashjit_cache_stats.argtypes = [P(ctypes.c_uint64)] * 3
    lib.flashjit_cache_stats.restype = ctypes.c_int
    lib.flashjit_last_error.argtypes = []
    lib.flashjit_last_error.restype = ctypes.c_char_p
    lib.flashjit_version.argtypes = []
    lib.flashjit_version.restype = ctypes.c_char_p
    return lib
