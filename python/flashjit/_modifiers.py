"""User modifiers and block masks (FlexAttention's mask_mod/score_mod and BlockMask), compiled into
flashjit's kernels by NVRTC from CUDA C++ bodies.

    doc = torch.tensor(...)                     # a document id per token
    mod = flashjit.AttentionMod(mask="return doc[q_idx] == doc[kv_idx] && q_idx >= kv_idx;",
                                tensors={"doc": doc})
    bm = flashjit.create_block_mask(mod, B, H, Sq, Sk)      # on the GPU, by a generated kernel
    out = flashjit.flash_attn_func(q, k, v, mod=mod, block_mask=bm)
"""
import ctypes
import json

from . import _capi

_TENSOR_DTYPES = None  # torch dtype -> C API code, filled on first use


def _tensor_dtype_code(torch, tensor, name):
    global _TENSOR_DTYPES
    if _TENSOR_DTYPES is None:
        _TENSOR_DTYPES = {torch.int32: _capi.INT32, torch.int64: _capi.INT64, torch.float32: _capi.FLOAT32}
    code = _TENSOR_DTYPES.get(tensor.dtype)
    if code is None:
        raise ValueError(f"mod tensor '{name}': dtype {tensor.dtype} is not supported "
                         "(expected torch.int32, torch.int64 or torch.float32)")
    return code


class AttentionMod:
    """Mask and score functions as CUDA C++ function bodies, with read-only side tensors by name.

    mask: body of `bool mask(int batch, int head, int q_idx, int kv_idx)`: may query q_idx see key
    kv_idx (indices within the sequence, head a query head)? score: body of
    `float score(float score, int batch, int head, int q_idx, int kv_idx)`, given q.k times the
    softmax scale. score_grad (optional): body of its derivative with respect to score, same
    parameters; without it the backward differentiates the score body exactly by running it on dual
    numbers (write `auto` rather than `float` for values computed from score). tensors: {name: CUDA
    tensor}, each read in the bodies as a flat `const T* name` (T int, long long or float); kept
    contiguous here. The code (not the tensors' values) is part of
    the kernel's cache key: new values reuse the compiled kernel.
    """

    def __init__(self, mask=None, score=None, tensors=None, score_grad=None):
        from . import _check, _lib, _torch
        torch = _torch()
        self.mask, self.score, self.score_grad = mask or "", score or "", score_grad or ""
        self.tensors = {}
        for name, t in (tensors or {}).items():
            if not isinstance(t, torch.Tensor) or not t.is_cuda:
                raise ValueError(f"mod tensor '{name}': expected a CUDA tensor")
            self.tensors[name] = t.contiguous()
        names = [n.encode() for n in self.tensors]
        codes = [_tensor_dtype_code(torch, t, n) for n, t in self.tensors.items()]
        handle = ctypes.c_void_p()
        _check(_lib.flashjit_modifier_create(self.mask.encode(), self.score.encode(), self.score_grad.encode(), len(names),
                                             (ctypes.c_char_p * len(names))(*names),
                                             (ctypes.c_int32 * len(codes))(*codes), ctypes.byref(handle)))
        self._handle = handle
        self._lib = _lib
        # The code and tensor names as one string: a custom op argument under torch.compile.
        self.op_code = json.dumps(dict(mask=self.mask, score=self.score, score_grad=self.score_grad,
                                       tensors=list(self.tensors)))

    def __del__(self):
        handle = getattr(self, "_handle", None)
        if handle is not None and handle.value:
            self._lib.flashjit_modifier_destroy(handle)

    def _tensor_views(self):
        views = [_view_any(t, f"mod tensor '{n}'") for n, t in self.tensors.items()]
        return (_capi.Tensor * max(len(views), 1))(*views), len(views)


def _view_any(tensor, name):
    """A C API view of an int32/int64/float32/uint8 tensor (the attention views take fp16/bf16)."""
    import torch
    codes = {torch.int32: _capi.INT32, torch.int64: _capi.INT64, torch.float32: _capi.FLOAT32,
             torch.uint8: _capi.UINT8, torch.float16: _capi.FLOAT16, torch.bfloat16: _capi.BFLOAT16}
    if tensor.dtype not in codes:
        raise ValueError(f"{name}: dtype {tensor.dtype} is not supported")
    rank = tensor.dim()
    if rank < 1 or rank > 4:
        raise ValueError(f"{name}: expected 1 to 4 dims, got {rank}")
    t = _capi.Tensor(data=tensor.data_ptr(), dtype=codes[tensor.dtype], device=tensor.device.index, rank=rank)
    t.shape[:rank] = tensor.shape
    t.strides[:rank] = tensor.stride()
    return t


class BlockMask:
    """FlexAttention's block lists, int32 on the device: kv_num_blocks (B, H, q_blocks), kv_indices
    (B, H, q_blocks, kv_blocks) of the partly visible key blocks of each query block, full_kv_* of
    the fully visible ones, and the transposes q_* (the backward's). B and H may be 1 (shared)."""

    def __init__(self, kv_num_blocks, kv_indices, full_kv_num_blocks=None, full_kv_indices=None, q_num_blocks=None,
                 q_indices=None, full_q_num_blocks=None, full_q_indices=None, block_size=(128, 128), seq_lengths=None):
        self.kv_num_blocks, self.kv_indices = kv_num_blocks, kv_indices
        self.full_kv_num_blocks, self.full_kv_indices = full_kv_num_blocks, full_kv_indices
        self.q_num_blocks, self.q_indices = q_num_blocks, q_indices
        self.full_q_num_blocks, self.full_q_indices = full_q_num_blocks, full_q_indices
        self.BLOCK_SIZE = tuple(block_size)
        self.seq_lengths = seq_lengths

    @classmethod
    def from_flex(cls, flex_mask):
        """A torch.nn.attention.flex_attention.BlockMask (or anything with its attributes)."""
        block = flex_mask.BLOCK_SIZE
        block = (block, block) if isinstance(block, int) else tuple(block)
        as_int32 = lambda t: None if t is None else t.to(dtype=_int32()).contiguous()
        return cls(*(as_int32(getattr(flex_mask, name, None)) for name in _capi.BLOCK_ARRAYS), block_size=block,
                   seq_lengths=getattr(flex_mask, "seq_lengths", None))

    def density(self):
        """The fraction of tiles that are visible at all (partly or fully)."""
        visible = self.kv_num_blocks.sum() + (self.full_kv_num_blocks.sum() if self.full_kv_num_blocks is not None else 0)
        return float(visible) / (self.kv_num_blocks.numel() * self.kv_indices.shape[-1])

    def _c_struct(self):
        """The C API's flashjit_block_mask; arrays that are None become empty views (not given)."""
        views = {}
        for name in _capi.BLOCK_ARRAYS:
            array = getattr(self, name)
            views[name] = _view_any(array, f"block_mask.{name}") if array is not None else _capi.Tensor()
        q_block, kv_block = (_capi.int32(size, "block_mask.BLOCK_SIZE") for size in self.BLOCK_SIZE)
        return _capi.BlockMaskArrays(**views, q_block_size=q_block, kv_block_size=kv_block)


def mod_arguments(mod, block_mask):
    """A mod and a block mask as custom op arguments (what torch.compile can put in a graph): the mod's
    code and side-tensor names as one string (AttentionMod.op_code, "" for none) and its tensors, the
    block mask's eight arrays (None where not given) and [q, kv] block size (empty lists for none)."""
    code, tensors = (mod.op_code, list(mod.tensors.values())) if mod is not None else ("", [])
    if block_mask is None:
        return code, tensors, [], []
    bm = as_block_mask(block_mask)
    return code, tensors, [getattr(bm, name) for name in _capi.BLOCK_ARRAYS], list(bm.BLOCK_SIZE)


class _BoundMod:
    """An AttentionMod's compiled code (its handle, kept by the cache below) with one call's side tensors."""

    def __init__(self, owner, tensors):
        self._owner, self._handle, self.tensors = owner, owner._handle, tensors

    def _tensor_views(self):
        return AttentionMod._tensor_views(self)


_mods_by_code = {}  # (op_code, tensor dtypes) -> AttentionMod: one modifier handle per distinct code


def from_arguments(code, tensors, block_arrays, block_size):
    """mod_arguments' inverse: (a mod or None, a BlockMask or None)."""
    mod = None
    if code:
        key = (code, tuple(t.dtype for t in tensors))
        owner = _mods_by_code.get(key)
        if owner is None:
            fields = json.loads(code)
            owner = _mods_by_code[key] = AttentionMod(fields["mask"], fields["score"],
                                                      dict(zip(fields["tensors"], tensors)), fields["score_grad"])
            owner.tensors = dict.fromkeys(owner.tensors)  # (the names only: no call's tensors kept alive)
        mod = _BoundMod(owner, {n: t.contiguous() for n, t in zip(owner.tensors, tensors)})
    block_mask = BlockMask(*block_arrays, block_size=tuple(block_size)) if block_arrays else None
    return mod, block_mask


def _int32():
    import torch
    return torch.int32


def as_block_mask(mask):
    return mask if isinstance(mask, BlockMask) else BlockMask.from_flex(mask)


def _empty_block_mask(B, H, Sq, Sk, block_size, device):
    import torch
    qb, kb = -(-Sq // block_size[0]), -(-Sk // block_size[1])
    new = lambda *shape: torch.empty(shape, dtype=torch.int32, device=device)
    return BlockMask(new(B, H, qb), new(B, H, qb, kb), new(B, H, qb), new(B, H, qb, kb), new(B, H, kb),
                     new(B, H, kb, qb), new(B, H, kb), new(B, H, kb, qb), block_size=block_size, seq_lengths=(Sq, Sk))


def _buffers(bm):
    q_block, kv_block = (_capi.int32(size, "BLOCK_SIZE") for size in bm.BLOCK_SIZE)
    return _capi.BlockMaskBuffers(*(_view_any(getattr(bm, n), n) for n in _capi.BLOCK_ARRAYS),
                                  q_block_size=q_block, kv_block_size=kv_block)


def create_block_mask(mod, B, H, Q_LEN, KV_LEN, device="cuda", BLOCK_SIZE=128):
    """A BlockMask from mod's mask function, built on the GPU (a generated kernel classifies every tile
    as empty, partly or fully visible). B, H: the mask's batch and heads (1 or None: shared). Runs on
    the current stream of `device`."""
    import torch
    from . import _check, _lib
    block = (BLOCK_SIZE, BLOCK_SIZE) if isinstance(BLOCK_SIZE, int) else tuple(BLOCK_SIZE)
    B, H = B or 1, H or 1
    device = torch.device(device)
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    bm = _empty_block_mask(B, H, Q_LEN, KV_LEN, block, device)
    tensors, count = mod._tensor_views()
    with torch.cuda.device(device):
        stream = torch.cuda.current_stream(device).cuda_stream
        _check(_lib.flashjit_create_block_mask(mod._handle, tensors, count, B, H, Q_LEN, KV_LEN,
                                               ctypes.byref(_buffers(bm)), ctypes.c_void_p(stream)))
    return bm


def block_mask_from_tiles(tile_map, Q_LEN, KV_LEN, mod=None, BLOCK_SIZE=128):
    """A BlockMask from a dense boolean tile map (B, H, q_blocks, kv_blocks) on the device: True tiles
    are visible, partly (the mask function decides per element) where `mod` has a mask function,
    else fully."""
    import torch
    from . import _check, _lib
    block = (BLOCK_SIZE, BLOCK_SIZE) if isinstance(BLOCK_SIZE, int) else tuple(BLOCK_SIZE)
    if tile_map.dim() != 4:
        raise ValueError(f"tile_map: expected 4 dims (B, H, q_blocks, kv_blocks), got shape {tuple(tile_map.shape)}")
    partial = mod is not None and bool(mod.mask)
    states = (tile_map != 0).to(torch.uint8) * (1 if partial else 2)
    B, H = tile_map.shape[:2]
    bm = _empty_block_mask(B, H, Q_LEN, KV_LEN, block, tile_map.device)
    with torch.cuda.device(tile_map.device):
        stream = torch.cuda.current_stream(tile_map.device).cuda_stream
        _check(_lib.flashjit_block_mask_from_tiles(ctypes.byref(_view_any(states, "tile_map")), Q_LEN, KV_LEN,
                                                   ctypes.byref(_buffers(bm)), ctypes.c_void_p(stream)))
    return bm
