"""ctypes declarations of libflashjit's C API (runtime/include/flashjit/flashjit.h)."""
import ctypes
import os
import pathlib

FLOAT16, BFLOAT16, FLOAT32, INT32, INT64, UINT8, FLOAT8_E4M3 = 0, 1, 2, 3, 4, 5, 6
BACKENDS = {"auto": 0, "reference": 1, "fa2": 2, "sm90": 3}
STATUS_NAMES = {
    1: "invalid argument", 2: "unsupported", 3: "compile failed", 4: "no CUDA driver", 5: "CUDA error",
    6: "cache error", 7: "I/O error", 8: "out of resources", 9: "internal error",
}


INT32_MAX = 2**31 - 1


def int32(value, name):
    """`value` for an int32 field of the C structs, which ctypes would silently wrap (2**32 + 5 -> 5)."""
    value = int(value)
    if not -INT32_MAX - 1 <= value <= INT32_MAX:
        raise ValueError(f"{name} must fit in 32 bits, got {value}")
    return value


def window(window_left, window_right):
    """window_size's two sides for the C structs: -1 (unbounded) or >= 0, a side past int32 as int32's
    largest (the runtime takes any side past both sequences as unbounded)."""
    sides = int(window_left), int(window_right)
    if min(sides) < -1:
        raise ValueError(f"window_size {sides}: each side must be -1 (unbounded) or >= 0")
    return tuple(min(side, INT32_MAX) for side in sides)


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
        ("prepare_backward", ctypes.c_int32),
    ]


# A block mask's arrays (FlexAttention's names), in the order of the C structs below.
BLOCK_ARRAYS = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices", "q_num_blocks", "q_indices",
                "full_q_num_blocks", "full_q_indices")


class BlockMaskArrays(ctypes.Structure):  # flashjit_block_mask
    _fields_ = [(n, Tensor) for n in BLOCK_ARRAYS] + [("q_block_size", ctypes.c_int32), ("kv_block_size", ctypes.c_int32)]


class BlockMaskBuffers(ctypes.Structure):  # flashjit_block_mask_buffers
    _fields_ = [(n, Tensor) for n in BLOCK_ARRAYS] + [("q_block_size", ctypes.c_int32), ("kv_block_size", ctypes.c_int32)]


class RingOptions(ctypes.Structure):  # flashjit_ring_options
    _fields_ = [
        ("layout", ctypes.c_int32),
        ("causal", ctypes.c_int32),
        ("softmax_scale", ctypes.c_float),
        ("softcap", ctypes.c_float),
        ("backend", ctypes.c_int32),
        ("sm_margin", ctypes.c_int32),
        ("check_shapes", ctypes.c_int32),
        ("stream", ctypes.c_void_p),
        ("window_left", ctypes.c_int32),
        ("window_right", ctypes.c_int32),
        ("seqlens", ctypes.POINTER(ctypes.c_int64)),
        ("num_seqlens", ctypes.c_int32),
    ]


def _candidates():
    # FLASHJIT_LIBRARY, else the installed package's own (pip install .), else the source tree's
    # build (tools/dev.sh build).
    explicit = os.environ.get("FLASHJIT_LIBRARY")
    if explicit:
        yield pathlib.Path(explicit)
    here = pathlib.Path(__file__).resolve().parent
    yield here / "libflashjit.so"
    root = here.parent.parent
    for build in sorted(root.glob("build*")):
        yield build / "runtime" / "libflashjit.so"


def nvrtc_wheel_dirs():
    """Where pip's NVIDIA NVRTC wheel (which PyTorch depends on) keeps libnvrtc.so.13, if installed."""
    import importlib.util
    spec = importlib.util.find_spec("nvidia")
    if spec is None or not spec.submodule_search_locations:
        return []
    found = []
    for base in spec.submodule_search_locations:
        for sub in ("cu13/lib", "cuda_nvrtc/lib"):
            if (pathlib.Path(base) / sub / "libnvrtc.so.13").exists():
                found.append(str(pathlib.Path(base) / sub))
    return found


def _open(path):
    """The library at `path`; where the CUDA toolkit's NVRTC is not on the loader's path, with the
    NVRTC of pip's wheel loaded first (its soname then satisfies the library's)."""
    try:
        return ctypes.CDLL(str(path))
    except OSError as e:
        wheel_dirs = nvrtc_wheel_dirs() if "libnvrtc" in str(e) else []
        if not wheel_dirs:
            raise ImportError(f"flashjit: {path} does not load ({e}); it needs NVRTC 13 from the CUDA toolkit "
                              "(on the loader's path) or the nvidia-cuda-nvrtc wheel") from e
        ctypes.CDLL(str(pathlib.Path(wheel_dirs[0]) / "libnvrtc.so.13"), mode=ctypes.RTLD_GLOBAL)
        return ctypes.CDLL(str(path))


def load():
    tried = []
    for path in _candidates():
        tried.append(str(path))
        if path.exists():
            lib = _open(path)
            break
    else:
        raise ImportError("flashjit: libflashjit.so not found (looked at: " + ", ".join(tried) +
                          "); pip install . builds and installs it, or tools/dev.sh build, or set FLASHJIT_LIBRARY")
    P = ctypes.POINTER
    lib.flashjit_attention_options_init.argtypes = [P(AttentionOptions)]
    lib.flashjit_attention_options_init.restype = None
    lib.flashjit_forward.argtypes = [P(Tensor)] * 5 + [P(AttentionOptions)]
    lib.flashjit_forward.restype = ctypes.c_int
    lib.flashjit_forward_varlen.argtypes = [P(Tensor)] * 7 + [ctypes.c_int32, ctypes.c_int32, P(AttentionOptions)]
    lib.flashjit_forward_varlen.restype = ctypes.c_int
    lib.flashjit_forward_fp8.argtypes = [P(Tensor)] * 10 + [ctypes.c_int32, ctypes.c_int32, P(AttentionOptions)]
    lib.flashjit_forward_fp8.restype = ctypes.c_int
    lib.flashjit_backward.argtypes = [P(Tensor)] * 9 + [P(AttentionOptions)]
    lib.flashjit_backward.restype = ctypes.c_int
    lib.flashjit_backward_varlen.argtypes = [P(Tensor)] * 11 + [ctypes.c_int32, ctypes.c_int32, P(AttentionOptions)]
    lib.flashjit_backward_varlen.restype = ctypes.c_int
    lib.flashjit_forward_kvcache.argtypes = [P(Tensor)] * 9 + [P(AttentionOptions)]
    lib.flashjit_forward_kvcache.restype = ctypes.c_int
    lib.flashjit_check_kvcache.argtypes = [ctypes.c_void_p]
    lib.flashjit_check_kvcache.restype = ctypes.c_int
    lib.flashjit_modifier_create.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_int32,
                                             P(ctypes.c_char_p), P(ctypes.c_int32), P(ctypes.c_void_p)]
    lib.flashjit_modifier_create.restype = ctypes.c_int
    lib.flashjit_modifier_destroy.argtypes = [ctypes.c_void_p]
    lib.flashjit_modifier_destroy.restype = None
    lib.flashjit_forward_mod.argtypes = [P(Tensor)] * 5 + [ctypes.c_void_p, P(Tensor), ctypes.c_int32,
                                                           P(BlockMaskArrays), P(AttentionOptions)]
    lib.flashjit_forward_mod.restype = ctypes.c_int
    lib.flashjit_backward_mod.argtypes = [P(Tensor)] * 9 + [ctypes.c_void_p, P(Tensor), ctypes.c_int32,
                                                            P(BlockMaskArrays), P(AttentionOptions)]
    lib.flashjit_backward_mod.restype = ctypes.c_int
    lib.flashjit_create_block_mask.argtypes = [ctypes.c_void_p, P(Tensor), ctypes.c_int32] + [ctypes.c_int64] * 4 + [
        P(BlockMaskBuffers), ctypes.c_void_p]
    lib.flashjit_create_block_mask.restype = ctypes.c_int
    lib.flashjit_block_mask_from_tiles.argtypes = [P(Tensor), ctypes.c_int64, ctypes.c_int64, P(BlockMaskBuffers),
                                                   ctypes.c_void_p]
    lib.flashjit_block_mask_from_tiles.restype = ctypes.c_int
    lib.flashjit_ring_options_init.argtypes = [P(RingOptions)]
    lib.flashjit_ring_options_init.restype = None
    lib.flashjit_nccl_unique_id.argtypes = [ctypes.c_char_p]
    lib.flashjit_nccl_unique_id.restype = ctypes.c_int
    lib.flashjit_ring_transport_nccl.argtypes = [ctypes.c_char_p, ctypes.c_int32, ctypes.c_int32, P(ctypes.c_void_p)]
    lib.flashjit_ring_transport_nccl.restype = ctypes.c_int
    lib.flashjit_ring_transport_destroy.argtypes = [ctypes.c_void_p]
    lib.flashjit_ring_transport_destroy.restype = None
    lib.flashjit_ring_forward.argtypes = [ctypes.c_void_p] + [P(Tensor)] * 5 + [P(RingOptions)]
    lib.flashjit_ring_forward.restype = ctypes.c_int
    lib.flashjit_ring_forward_local.argtypes = [ctypes.c_int32] + [P(Tensor)] * 5 + [P(ctypes.c_void_p), P(RingOptions)]
    lib.flashjit_ring_forward_local.restype = ctypes.c_int
    lib.flashjit_ring_backward.argtypes = [ctypes.c_void_p] + [P(Tensor)] * 9 + [P(RingOptions)]
    lib.flashjit_ring_backward.restype = ctypes.c_int
    lib.flashjit_ring_backward_local.argtypes = [ctypes.c_int32] + [P(Tensor)] * 9 + [P(ctypes.c_void_p), P(RingOptions)]
    lib.flashjit_ring_backward_local.restype = ctypes.c_int
    lib.flashjit_load_tuning_db.argtypes = [ctypes.c_char_p]
    lib.flashjit_load_tuning_db.restype = ctypes.c_int
    lib.flashjit_cache_stats.argtypes = [P(ctypes.c_uint64)] * 3
    lib.flashjit_cache_stats.restype = ctypes.c_int
    lib.flashjit_last_error.argtypes = []
    lib.flashjit_last_error.restype = ctypes.c_char_p
    lib.flashjit_version.argtypes = []
    lib.flashjit_version.restype = ctypes.c_char_p
    return lib
