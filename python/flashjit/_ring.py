"""Ring attention (context parallelism) for PyTorch: flashjit/ring.hpp through the C API.

    shard = flashjit.ring_shard(x, rank, world)                  # this rank's rows of (batch, seqlen, ...)
    out = flashjit.ring_flash_attn_func(q, k, v, group, causal=True)  # q, k, v: this rank's shards
    x = flashjit.ring_unshard([out_0, ..., out_N-1])             # the whole sequence again

Each step's rows merge into a running fp32 O and LSE inside the kernel, so no hop rounds O to 16 bits;
the backward sums dQ, dK and dV in fp32 (dK and dV travel with their K/V) and rounds each once.
Both functions are differentiable in q, k and v. Packed batches of sequences (varlen):
ring_shard_varlen / ring_unshard_varlen and ring_flash_attn_varlen_func (ring_flash_attn_varlen_local
over virtual ranks).
"""
import ctypes

from . import _capi

_LAYOUTS = {"contiguous": 0, "zigzag": 1}


def _layout_code(layout):
    if layout not in _LAYOUTS:
        raise ValueError(f"layout must be 'zigzag' or 'contiguous', got {layout!r}")
    return _LAYOUTS[layout]


def _chunks(layout, rank, world, seqlen):
    """The (start, length) row ranges of the whole sequence that `rank` holds, in shard order."""
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"rank {rank} of {world} ranks: expected 0 <= rank < world")
    count = 2 * world if _layout_code(layout) == 1 else world
    if seqlen % count != 0:
        raise ValueError(f"seqlen {seqlen} does not divide into the {layout} layout's {count} equal chunks "
                         f"({world} ranks)")
    chunk = seqlen // count
    if count == world:
        return [(rank * chunk, chunk)]
    return [(rank * chunk, chunk), ((count - 1 - rank) * chunk, chunk)]


def ring_shard(x, rank, world, layout="zigzag", dim=1):
    """This rank's rows of `x` along `dim` (the sequence): chunk `rank` of `world` (contiguous), or
    chunks rank and 2 world - 1 - rank of 2 world (zigzag), concatenated. A new contiguous tensor."""
    torch = _torch()
    parts = [x.narrow(dim, start, length) for start, length in _chunks(layout, rank, world, x.shape[dim])]
    return torch.cat(parts, dim=dim).contiguous()


def _lengths(cu_seqlens):
    """The whole sequences' lengths from cu_seqlens (a tensor or a list; read to the host)."""
    cu = cu_seqlens.tolist() if hasattr(cu_seqlens, "tolist") else list(cu_seqlens)
    if not cu or cu[0] != 0 or any(b < a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"cu_seqlens must start at 0 and not decrease, got {cu[:8]}{'...' if len(cu) > 8 else ''}")
    return tuple(int(b - a) for a, b in zip(cu, cu[1:])), cu


def ring_shard_varlen(x, cu_seqlens, rank, world, layout="zigzag", dim=0):
    """This rank's rows of a packed batch `x` (sequences at cu_seqlens along `dim`): each sequence's
    shard (ring_shard's rows of it), packed in order. A new contiguous tensor."""
    torch = _torch()
    lengths, cu = _lengths(cu_seqlens)
    parts = [x.narrow(dim, cu[b] + start, length) for b in range(len(lengths))
             for start, length in _chunks(layout, rank, world, lengths[b])]
    return torch.cat(parts, dim=dim).contiguous() if parts else x.narrow(dim, 0, 0).contiguous()


def ring_unshard_varlen(shards, cu_seqlens, layout="zigzag", dim=0):
    """The whole packed batch from every rank's varlen shard (in rank order), as ring_shard_varlen cut it."""
    torch = _torch()
    world = len(shards)
    lengths, cu = _lengths(cu_seqlens)
    pieces = {}
    for rank, shard in enumerate(shards):
        offset = 0
        for b in range(len(lengths)):
            for start, length in _chunks(layout, rank, world, lengths[b]):
                pieces[cu[b] + start] = shard.narrow(dim, offset, length)
                offset += length
    return torch.cat([pieces[start] for start in sorted(pieces)], dim=dim)


def ring_unshard(shards, layout="zigzag", dim=1):
    """The whole sequence from every rank's shard (in rank order), as ring_shard cut it."""
    torch = _torch()
    world = len(shards)
    rows = shards[0].shape[dim]
    seqlen = rows * world
    pieces = {}
    for rank, shard in enumerate(shards):
        offset = 0
        for start, length in _chunks(layout, rank, world, seqlen):
            pieces[start] = shard.narrow(dim, offset, length)
            offset += length
    return torch.cat([pieces[start] for start in sorted(pieces)], dim=dim)


def _window(window_size):
    left, right = window_size
    if left < -1 or right < -1:
        raise ValueError(f"window_size {tuple(window_size)}: each side must be -1 (unbounded) or >= 0")
    return int(left), int(right)


def _torch():
    import torch
    return torch


def _options(tensor, causal, layout, window_size, softmax_scale, softcap, sm_margin, check_shapes, seqlens=(),
             backend="auto"):
    from . import _lib
    o = _capi.RingOptions()
    _lib.flashjit_ring_options_init(ctypes.byref(o))
    o.layout = _layout_code(layout)
    o.causal = bool(causal)
    o.window_left, o.window_right = _capi.window(*window_size)
    if softmax_scale is not None:
        o.softmax_scale = softmax_scale
    o.softcap = float(softcap)
    o.backend = _capi.BACKENDS[backend]
    o.sm_margin = _capi.int32(sm_margin, "sm_margin")
    o.check_shapes = bool(check_shapes)
    o.stream = _torch().cuda.current_stream(tensor.device).cuda_stream
    if seqlens:
        o.lengths = (ctypes.c_int64 * len(seqlens))(*seqlens)  # (kept alive with the options)
        o.seqlens, o.num_seqlens = ctypes.cast(o.lengths, ctypes.POINTER(ctypes.c_int64)), len(seqlens)
    return o


def _outputs(q):
    """out like q and the LSE: (batch, heads_q, shard rows), or for varlen shards (heads_q, total rows)."""
    torch = _torch()
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    shape = (q.shape[1], q.shape[0]) if q.dim() == 3 else (q.shape[0], q.shape[2], q.shape[1])
    lse = torch.empty(shape, dtype=torch.float32, device=q.device)
    return out, lse


def _grad_ready(t):
    """dout as the kernels read it (autograd may hand over an expanded or transposed gradient)."""
    from . import _kernel_ready
    return t if _kernel_ready(t) else t.contiguous()


_transports = {}  # id(group) -> (group, handle): one NCCL communicator per process group


def _transport(group):
    """flashjit's NCCL communicator over the ranks of `group`: rank 0's unique id broadcast through it."""
    from . import _check, _lib
    torch = _torch()
    import torch.distributed as dist
    if group is None:
        group = dist.group.WORLD
    entry = _transports.get(id(group))
    if entry is not None and entry[0] is group:
        return entry[1]
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    id_buffer = ctypes.create_string_buffer(128)
    if rank == 0:
        _check(_lib.flashjit_nccl_unique_id(id_buffer))
    backend = dist.get_backend(group)
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    unique_id = torch.frombuffer(bytearray(id_buffer.raw), dtype=torch.uint8).to(device)
    dist.broadcast(unique_id, src=dist.get_global_rank(group, 0), group=group)
    raw = bytes(unique_id.cpu().tolist())
    handle = ctypes.c_void_p()
    _check(_lib.flashjit_ring_transport_nccl(raw, rank, world, ctypes.byref(handle)))
    _transports[id(group)] = (group, handle)
    return handle


def _group_forward(handle, q, k, v, settings):
    from . import _check, _lib, _view
    torch = _torch()
    out, lse = _outputs(q)
    with torch.cuda.device(q.device):
        options = _options(q, *settings)
        _check(_lib.flashjit_ring_forward(handle, ctypes.byref(_view(q, "q")), ctypes.byref(_view(k, "k")),
                                          ctypes.byref(_view(v, "v")), ctypes.byref(_view(out, "out")),
                                          ctypes.byref(_view(lse, "lse")), ctypes.byref(options)))
    return out, lse


def _group_backward(handle, q, k, v, out, dout, lse, settings):
    from . import _check, _lib, _view
    torch = _torch()
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    views = [_view(t, n) for t, n in ((q, "q"), (k, "k"), (v, "v"), (out, "out"), (dout, "dout"), (lse, "lse"),
                                      (dq, "dq"), (dk, "dk"), (dv, "dv"))]
    with torch.cuda.device(q.device):
        options = _options(q, *settings)
        _check(_lib.flashjit_ring_backward(handle, *(ctypes.byref(t) for t in views), ctypes.byref(options)))
    return dq, dk, dv


def _side_streams(device, world):
    """One stream per virtual rank, after the current stream's work."""
    torch = _torch()
    current = torch.cuda.current_stream(device)
    streams = [torch.cuda.Stream(device) for _ in range(world)]
    for s in streams:
        s.wait_stream(current)
    return current, streams, (ctypes.c_void_p * world)(*(s.cuda_stream for s in streams))


def _local_call(entry, world, tensors_by_name, settings, device, first):
    from . import _check, _view
    torch = _torch()
    current, streams, handles = _side_streams(device, world)
    arrays = [(_capi.Tensor * world)(*(_view(t, name) for t in tensors)) for name, tensors in tensors_by_name]
    with torch.cuda.device(device):
        options = _options(first, *settings)
        _check(entry(world, *arrays, handles, ctypes.byref(options)))
    for s in streams:  # (so everything the ranks read or wrote is freed after them)
        current.wait_stream(s)


_functions = {}


def _autograd_functions():
    """The autograd.Functions (built on first use: torch is imported lazily)."""
    if _functions:
        return _functions
    torch = _torch()
    from . import _lib

    class RingAttention(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, handle, settings):
            out, lse = _group_forward(handle, q, k, v, settings)
            ctx.save_for_backward(q, k, v, out, lse)
            ctx.handle, ctx.settings = handle, settings
            ctx.mark_non_differentiable(lse)
            return out, lse

        @staticmethod
        def backward(ctx, dout, _dlse):
            q, k, v, out, lse = ctx.saved_tensors
            dq, dk, dv = _group_backward(ctx.handle, q, k, v, out, _grad_ready(dout), lse, ctx.settings)
            return dq, dk, dv, None, None

    class RingAttentionLocal(torch.autograd.Function):
        @staticmethod
        def forward(ctx, settings, world, *tensors):
            qs, ks, vs = tensors[:world], tensors[world:2 * world], tensors[2 * world:]
            outputs = [_outputs(q) for q in qs]
            outs, lses = [o for o, _ in outputs], [l for _, l in outputs]
            _local_call(_lib.flashjit_ring_forward_local, world,
                        (("q", qs), ("k", ks), ("v", vs), ("out", outs), ("lse", lses)), settings, qs[0].device, qs[0])
            ctx.save_for_backward(*qs, *ks, *vs, *outs, *lses)
            ctx.settings, ctx.world = settings, world
            ctx.mark_non_differentiable(*lses)
            return (*outs, *lses)

        @staticmethod
        def backward(ctx, *grads):
            world = ctx.world
            saved = ctx.saved_tensors
            qs, ks, vs = saved[:world], saved[world:2 * world], saved[2 * world:3 * world]
            outs, lses = saved[3 * world:4 * world], saved[4 * world:]
            douts = [_grad_ready(g) if g is not None else torch.zeros_like(o) for g, o in zip(grads[:world], outs)]
            dqs, dks, dvs = [torch.empty_like(t) for t in qs], [torch.empty_like(t) for t in ks], [torch.empty_like(t) for t in vs]
            _local_call(_lib.flashjit_ring_backward_local, world,
                        (("q", qs), ("k", ks), ("v", vs), ("out", outs), ("dout", douts), ("lse", lses), ("dq", dqs),
                         ("dk", dks), ("dv", dvs)), ctx.settings, qs[0].device, qs[0])
            return (None, None, *dqs, *dks, *dvs)

    _functions.update(group=RingAttention, local=RingAttentionLocal)
    return _functions


def ring_flash_attn_func(q, k, v, group=None, causal=False, layout="zigzag", window_size=(-1, -1), softmax_scale=None,
                         softcap=0.0, return_lse=False, sm_margin=0, check_shapes=True):
    """This rank's part of attention over a sequence sharded across `group` (torch.distributed, NCCL;
    None: the default group). q (batch, shard rows, heads_q, head_dim), k, v (batch, shard rows,
    heads_kv, head_dim): this rank's shards (ring_shard). Returns this rank's output shard (and its
    LSE, (batch, heads_q, shard rows), with return_lse); differentiable in q, k and v (every rank
    runs the backward too). window_size (left, right) as flash_attn_func's, over the whole sequence's
    positions. Every rank calls it with the same shapes and options."""
    settings = (causal, layout, _window(window_size), softmax_scale, softcap, sm_margin, check_shapes)
    _layout_code(layout)
    handle = _transport(group)
    out, lse = _autograd_functions()["group"].apply(q, k, v, handle, settings)
    return (out, lse) if return_lse else out


def ring_flash_attn_local(qs, ks, vs, causal=False, layout="zigzag", window_size=(-1, -1), softmax_scale=None,
                          softcap=0.0, return_lse=False):
    """Ring attention over len(qs) virtual ranks on one GPU (flashjit::ring::LocalRing: the same
    schedule, K/V moved by device copies), for tests and benchmarks: lists of every rank's shards in,
    the list of their output shards (and LSEs) out; differentiable. The ranks run on side streams that
    start after the current stream's work and end before its next."""
    world = len(qs)
    if not (len(ks) == len(vs) == world) or world < 1:
        raise ValueError(f"qs, ks and vs must be lists of the same positive length, got {len(qs)}, {len(ks)}, {len(vs)}")
    _layout_code(layout)
    settings = (causal, layout, _window(window_size), softmax_scale, softcap, 0, True)
    results = _autograd_functions()["local"].apply(settings, world, *qs, *ks, *vs)
    outs, lses = list(results[:world]), list(results[world:])
    return list(zip(outs, lses)) if return_lse else outs


def ring_flash_attn_varlen_func(q, k, v, cu_seqlens, group=None, causal=False, layout="zigzag", softmax_scale=None,
                                softcap=0.0, return_lse=False, sm_margin=0, check_shapes=True):
    """ring_flash_attn_func over a packed batch of sequences: cu_seqlens (batch + 1) of the whole
    sequences (each length a multiple of the layout's chunk count; read to the host), q (total shard
    rows, heads_q, head_dim), k, v (total shard rows, heads_kv, head_dim): this rank's varlen shards
    (ring_shard_varlen). Returns the output shard (and the LSE, (heads_q, total shard rows)).
    Differentiable; no window yet."""
    lengths, _ = _lengths(cu_seqlens)
    settings = (causal, layout, (-1, -1), softmax_scale, softcap, sm_margin, check_shapes, lengths)
    _layout_code(layout)
    handle = _transport(group)
    out, lse = _autograd_functions()["group"].apply(q, k, v, handle, settings)
    return (out, lse) if return_lse else out


def ring_flash_attn_varlen_local(qs, ks, vs, cu_seqlens, causal=False, layout="zigzag", softmax_scale=None,
                                 softcap=0.0, return_lse=False):
    """ring_flash_attn_local over varlen shards (ring_shard_varlen of a packed batch at cu_seqlens)."""
    world = len(qs)
    if not (len(ks) == len(vs) == world) or world < 1:
        raise ValueError(f"qs, ks and vs must be lists of the same positive length, got {len(qs)}, {len(ks)}, {len(vs)}")
    _layout_code(layout)
    lengths, _ = _lengths(cu_seqlens)
    settings = (causal, layout, (-1, -1), softmax_scale, softcap, 0, True, lengths)
    results = _autograd_functions()["local"].apply(settings, world, *qs, *ks, *vs)
    outs, lses = list(results[:world]), list(results[world:])
    return list(zip(outs, lses)) if return_lse else outs
