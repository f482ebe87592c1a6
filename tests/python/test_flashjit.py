"""The Python package on a GPU: flash_attn_func / flash_attn_varlen_func against an fp32 PyTorch
reference, LSE, streams, strided inputs, and argument errors."""
import math
import os
import sys

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "python"))
import flashjit  # noqa: E402
from flashjit import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache  # noqa: E402


def reference(q, k, v, causal=False, window=(-1, -1), softcap=0.0, scale=None):
    """fp32 attention over (batch, seqlen, heads, head_dim) inputs; bottom-right aligned masks."""
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    qf, kf, vf = (t.float().transpose(1, 2) for t in (q, k, v))
    kf = kf.repeat_interleave(hq // hkv, dim=1)
    vf = vf.repeat_interleave(hq // hkv, dim=1)
    scale = scale or 1.0 / math.sqrt(d)
    s = qf @ kf.transpose(-1, -2) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    i = torch.arange(sq, device=q.device)[:, None]
    j = torch.arange(sk, device=q.device)[None, :]
    diag = i + sk - sq
    visible = torch.ones(sq, sk, dtype=torch.bool, device=q.device)
    right = 0 if causal else window[1]
    if right >= 0:
        visible &= j <= diag + right
    if window[0] >= 0:
        visible &= j >= diag - window[0]
    s = s.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return (p @ vf).transpose(1, 2), lse


def assert_close(out, want, dtype):
    tol = 4 / 512 if dtype == torch.bfloat16 else 4 / 4096
    err = (out.float() - want).abs()
    assert torch.isfinite(out.float()).all()
    assert (err <= tol + tol / 2 * want.abs()).all(), f"max error {err.max().item()}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", [(2, 113, 203, 8, 2, 64), (1, 1024, 1024, 4, 4, 128), (3, 239, 1, 8, 1, 96),
                                   (1, 77, 300, 4, 4, 256)])
def test_matches_fp32_reference(dtype, causal, shape):
    b, sq, sk, hq, hkv, d = shape
    torch.manual_seed(sq * d)
    q = torch.randn(b, sq, hq, d, device="cuda", dtype=dtype)
    k = torch.randn(b, sk, hkv, d, device="cuda", dtype=dtype)
    v = torch.randn(b, sk, hkv, d, device="cuda", dtype=dtype)
    out, lse = flash_attn_func(q, k, v, causal=causal, return_lse=True)
    want, want_lse = reference(q, k, v, causal=causal)
    assert out.shape == q.shape and out.dtype == dtype
    assert_close(out, want, dtype)
    finite = torch.isfinite(want_lse)
    assert torch.allclose(lse[finite], want_lse[finite], atol=1e-3, rtol=1e-4)
    assert torch.isinf(lse[~finite]).all()


@pytest.mark.parametrize("window,softcap", [((32, 0), 0.0), ((16, 16), 30.0), ((-1, -1), 5.0)])
def test_window_and_softcap(window, softcap):
    q = torch.randn(2, 300, 4, 64, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(2, 400, 2, 64, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(2, 400, 2, 64, device="cuda", dtype=torch.bfloat16)
    out = flash_attn_func(q, k, v, window_size=window, softcap=softcap, softmax_scale=0.2)
    want, _ = reference(q, k, v, window=window, softcap=softcap, scale=0.2)
    assert_close(out, want, torch.bfloat16)


def test_window_sides_past_the_sequences_bound_nothing():
    # flash-attn's callers pass huge sides for "no window": they must neither wrap in the 32-bit C
    # fields (2**32 + 5 would become 5) nor overflow the kernels' index sums (INT32_MAX).
    q, k, v = (torch.randn(2, 300, 4, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    full = flash_attn_func(q, k, v)
    causal = flash_attn_func(q, k, v, causal=True)
    for huge in (2**31 - 1, 2**32 + 5, 2**40):
        assert torch.equal(flash_attn_func(q, k, v, window_size=(-1, huge)), full)
        assert torch.equal(flash_attn_func(q, k, v, window_size=(huge, huge)), full)
        assert torch.equal(flash_attn_func(q, k, v, window_size=(huge, 0)), causal)
    want, _ = reference(q, k, v, window=(600, 5))  # one side past the sequences, the other bounding
    assert_close(flash_attn_func(q, k, v, window_size=(2**40, 5)), want, torch.bfloat16)
    with pytest.raises(ValueError, match="window_size"):
        flash_attn_func(q, k, v, window_size=(-2**32 - 3, 0))
    with pytest.raises(ValueError, match="sm_margin must fit in 32 bits"):
        flash_attn_func(q, k, v, sm_margin=2**32)


def test_head_major_strides_and_side_stream():
    x = torch.randn(3, 3, 8, 512, 128, device="cuda", dtype=torch.bfloat16)  # (qkv, b, h, s, d)
    q, k, v = (t.transpose(1, 2) for t in x)  # (b, s, h, d) views with head-major strides
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        out = flash_attn_func(q, k, v, causal=True)
    stream.synchronize()
    want, _ = reference(q, k, v, causal=True)
    assert_close(out, want, torch.bfloat16)


def test_varlen_matches_per_sequence_reference():
    lens_q, lens_k = [0, 1, 2049, 37], [5, 0, 2049, 300]
    hq, hkv, d = 8, 2, 128
    q = torch.randn(sum(lens_q), hq, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(sum(lens_k), hkv, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(sum(lens_k), hkv, d, device="cuda", dtype=torch.bfloat16)
    cu = lambda lens: torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), device="cuda", dtype=torch.int32)
    out, lse = flash_attn_varlen_func(q, k, v, cu(lens_q), cu(lens_k), max(lens_q), max(lens_k), causal=True,
                                      return_lse=True)
    assert lse.shape == (hq, sum(lens_q))
    qs = ks = 0
    for lq, lk in zip(lens_q, lens_k):
        if lq:
            want, want_lse = reference(q[None, qs:qs + lq], k[None, ks:ks + lk], v[None, ks:ks + lk], causal=True)
            assert_close(out[qs:qs + lq], want[0], torch.bfloat16)
        qs, ks = qs + lq, ks + lk


def test_argument_errors_name_the_argument():
    q = torch.randn(1, 64, 4, 64, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="expected dtype float16, bfloat16 or float8_e4m3, got float32"):
        flash_attn_func(q.float(), q.float(), q.float())
    with pytest.raises(ValueError, match="expected a CUDA tensor"):
        flash_attn_func(q.cpu(), q.cpu(), q.cpu())
    flash_attn_func(q, q, q)  # a plan for these shapes on the GPU: the next call must not reuse it
    with pytest.raises(ValueError, match="k: expected a CUDA tensor"):
        flash_attn_func(q, q.cpu(), q)
    with pytest.raises(ValueError, match="heads_kv 3 must divide heads_q 4"):
        k = torch.randn(1, 64, 3, 64, device="cuda", dtype=torch.bfloat16)
        flash_attn_func(q, k, k)
    with pytest.raises(ValueError, match="head_dim 260 is not supported"):
        big = torch.randn(1, 8, 1, 260, device="cuda", dtype=torch.bfloat16)
        flash_attn_func(big, big, big)
    with pytest.raises(NotImplementedError, match="dropout"):
        flash_attn_func(q, q, q, dropout_p=0.1)
    with pytest.raises(ValueError, match="cu_seqlens_q is not monotone"):
        packed = q[0]
        bad = torch.tensor([0, 40, 30, 64], device="cuda", dtype=torch.int32)
        good = torch.tensor([0, 20, 40, 64], device="cuda", dtype=torch.int32)
        flash_attn_varlen_func(packed, packed, packed, bad, good, 64, 64)


def _forward_and_grads(q, k, v, dout, **kwargs):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = flash_attn_func(q, k, v, **kwargs)
    out.backward(dout)
    return out, q.grad, k.grad, v.grad


@pytest.mark.parametrize("causal", [False, True])
def test_unaligned_and_oddly_strided_inputs_are_read_correctly(causal):
    """A q 2 bytes off 16-byte alignment (a slice of a flat buffer), a k whose head_dim is strided and a
    v whose rows are 4 elements apart: copied for the kernels, so the result is right (and the
    gradients reach the original tensors)."""
    torch.manual_seed(5)
    b, s, h, d = 2, 97, 4, 64
    flat = torch.randn(b * s * h * d + 1, device="cuda", dtype=torch.bfloat16)
    q = flat[1:].view(b, s, h, d)
    assert q.data_ptr() % 16 == 2
    k = torch.randn(b, s, h, 2 * d, device="cuda", dtype=torch.bfloat16)[..., ::2]
    v = torch.randn(b, s, h, d + 4, device="cuda", dtype=torch.bfloat16)[..., :d]
    dout = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16)
    out, dq, dk, dv = _forward_and_grads(q, k, v, dout, causal=causal)
    want, _ = reference(q, k, v, causal=causal)
    assert_close(out, want, torch.bfloat16)
    for got, ref, name in zip((dq, dk, dv), reference_grads(q, k, v, dout, causal=causal), ("dq", "dk", "dv")):
        assert got.shape == ref.shape
        assert_grad_close(got, ref, torch.bfloat16, name)


def test_empty_inputs_give_empty_outputs_and_zero_gradients():
    """As PyTorch's attention: batch 0, no queries, no keys and no heads are not errors. No keys: out 0
    and dq 0; no queries: dk = dv = 0."""
    def randn(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16)
    for (b, sq, sk, h) in [(0, 16, 16, 2), (2, 0, 16, 2), (2, 16, 0, 2), (2, 16, 16, 0)]:
        q, k, v, dout = randn(b, sq, h, 64), randn(b, sk, h, 64), randn(b, sk, h, 64), randn(b, sq, h, 64)
        out, dq, dk, dv = _forward_and_grads(q, k, v, dout, causal=True)
        assert out.shape == q.shape and dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
        assert (out == 0).all() and (dq == 0).all() if sk == 0 else True
        assert (dk == 0).all() and (dv == 0).all() if sq == 0 else True
        lens = torch.zeros(4, device="cuda", dtype=torch.int32)
        packed = randn(0, 2, 64)
        assert flash_attn_varlen_func(packed, packed, packed, lens, lens, 0, 0).shape == packed.shape


def test_threads_calling_at_once_get_their_own_results():
    """Each thread keeps its own call plans (the C call releases the GIL): four threads on one shape,
    each with its own inputs, get what a lone call gives."""
    import threading
    torch.manual_seed(8)
    inputs = [tuple(torch.randn(2, 200, 4, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3)) for _ in range(4)]
    want = [flash_attn_func(q, k, v, causal=True) for q, k, v in inputs]
    torch.cuda.synchronize()
    failures = []

    def worker(i):
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            for _ in range(20):
                out = flash_attn_func(*inputs[i], causal=True)
                stream.synchronize()
                if not torch.equal(out, want[i]):
                    failures.append(i)
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures


def test_a_batch_of_70000_short_sequences():
    torch.manual_seed(6)
    q = torch.randn(70000, 3, 2, 64, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(70000, 5, 1, 64, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(70000, 5, 1, 64, device="cuda", dtype=torch.bfloat16)
    dout = torch.randn_like(q)
    out, dq, dk, dv = _forward_and_grads(q, k, v, dout, causal=True)
    assert_close(out, reference(q, k, v, causal=True)[0], torch.bfloat16)
    for got, ref, name in zip((dq, dk, dv), reference_grads(q, k, v, dout, causal=True), ("dq", "dk", "dv")):
        assert_grad_close(got, ref, torch.bfloat16, name)


def test_cache_counters():
    # Its own call first, so that the check does not depend on the tests before it: a process that
    # has run a kernel has loaded it, compiled or from the disk cache. A repeat moves no counter back.
    torch.manual_seed(7)
    q = torch.randn(1, 64, 2, 64, device="cuda", dtype=torch.bfloat16)
    assert_close(flash_attn_func(q, q, q), reference(q, q, q)[0], torch.bfloat16)
    before = flashjit.cache_stats()
    assert set(before) == {"memory_hits", "disk_hits", "compiles"}
    assert before["compiles"] + before["disk_hits"] >= 1
    flash_attn_func(q, q, q)
    torch.cuda.synchronize()
    after = flashjit.cache_stats()
    assert all(after[key] >= before[key] for key in before)


_COLD_STEP = """
import json, torch, flashjit
torch.manual_seed(3)
q, k, v = (torch.randn(1, 300, 2, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
flashjit.flash_attn_func(q, k, v, causal=True).sum().backward()
torch.cuda.synchronize()
print(json.dumps(flashjit.cache_stats()))
"""


def test_cold_forward_compiles_its_backward_beside_it(tmp_path):
    # A fresh process on an empty cache: the forward under autograd starts the backward's kernel in
    # the background, and the backward finds it in memory rather than compiling it after the forward's.
    import json
    import subprocess
    env = dict(os.environ, FLASHJIT_CACHE_DIR=str(tmp_path), FLASHJIT_VERBOSE="1",
               PYTHONPATH=os.pathsep.join([os.path.join(os.path.dirname(__file__), "..", "..", "python"),
                                           os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run([sys.executable, "-c", _COLD_STEP], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    stats = json.loads(run.stdout.strip().splitlines()[-1])
    assert stats == {"memory_hits": 1, "disk_hits": 0, "compiles": 2}, stats
    assert "in the background" in run.stderr


# ---------------------------------------------------------------------------------------------
# Backward: autograd through flash_attn_func against autograd through the fp32 reference.

def reference_grads(q, k, v, dout, **kwargs):
    qf, kf, vf = (t.detach().float().requires_grad_() for t in (q, k, v))
    out, _ = reference(qf, kf, vf, **kwargs)
    out.backward(dout.float())
    return qf.grad, kf.grad, vf.grad


def assert_grad_close(got, want, dtype, name):
    """Each gradient element sums terms with one 16-bit-rounded factor; the error scales with the
    tensor's magnitude, so the bound is relative to its largest element (plus the element's own)."""
    u = 2 ** -8 if dtype == torch.bfloat16 else 2 ** -11
    scale = want.abs().max().item()
    err = (got.float() - want).abs()
    assert torch.isfinite(got.float()).all(), f"{name}: non-finite values"
    bound = 4 * u * scale + u * want.abs()
    assert (err <= bound).all(), f"{name}: max error {err.max().item()} vs scale {scale}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", [(2, 113, 203, 8, 2, 64), (1, 512, 512, 4, 4, 128), (2, 239, 17, 8, 1, 96),
                                   (1, 77, 300, 4, 4, 256)])
def test_backward_matches_fp32_autograd(dtype, causal, shape):
    b, sq, sk, hq, hkv, d = shape
    torch.manual_seed(sq + d)
    q = torch.randn(b, sq, hq, d, device="cuda", dtype=dtype, requires_grad=True)
    k = torch.randn(b, sk, hkv, d, device="cuda", dtype=dtype, requires_grad=True)
    v = torch.randn(b, sk, hkv, d, device="cuda", dtype=dtype, requires_grad=True)
    dout = torch.randn(b, sq, hq, d, device="cuda", dtype=dtype)
    flash_attn_func(q, k, v, causal=causal).backward(dout)
    want = reference_grads(q, k, v, dout, causal=causal)
    for got, ref, name in zip((q.grad, k.grad, v.grad), want, ("dq", "dk", "dv")):
        assert got.shape == ref.shape and got.dtype == dtype
        assert_grad_close(got, ref, dtype, name)


@pytest.mark.parametrize("window,softcap", [((32, 0), 0.0), ((16, 16), 30.0), ((-1, -1), 5.0)])
def test_backward_window_and_softcap(window, softcap):
    torch.manual_seed(7)
    q = torch.randn(2, 300, 4, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(2, 400, 2, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(2, 400, 2, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dout = torch.randn(2, 300, 4, 64, device="cuda", dtype=torch.bfloat16)
    flash_attn_func(q, k, v, window_size=window, softcap=softcap, softmax_scale=0.2).backward(dout)
    want = reference_grads(q, k, v, dout, window=window, softcap=softcap, scale=0.2)
    for got, ref, name in zip((q.grad, k.grad, v.grad), want, ("dq", "dk", "dv")):
        assert_grad_close(got, ref, torch.bfloat16, name)


def test_backward_varlen_and_deterministic_reruns():
    lens_q, lens_k = [0, 1, 700, 37], [5, 0, 700, 300]
    hq, hkv, d = 8, 2, 128
    torch.manual_seed(3)
    q = torch.randn(sum(lens_q), hq, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(sum(lens_k), hkv, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(sum(lens_k), hkv, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dout = torch.randn_like(q)
    cu = lambda lens: torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), device="cuda", dtype=torch.int32)
    grads = []
    for _ in range(3):
        q.grad = k.grad = v.grad = None
        flash_attn_varlen_func(q, k, v, cu(lens_q), cu(lens_k), max(lens_q), max(lens_k), causal=True,
                               deterministic=True).backward(dout)
        grads.append([t.grad.clone() for t in (q, k, v)])
    for rerun in grads[1:]:
        assert all(torch.equal(a, b) for a, b in zip(grads[0], rerun))
    qs = ks = 0
    for lq, lk in zip(lens_q, lens_k):
        if lq and lk:
            sl_q, sl_k = slice(qs, qs + lq), slice(ks, ks + lk)
            want = reference_grads(q[None, sl_q], k[None, sl_k], v[None, sl_k], dout[None, sl_q], causal=True)
            for got, ref, name in zip((grads[0][0][sl_q], grads[0][1][sl_k], grads[0][2][sl_k]), want,
                                      ("dq", "dk", "dv")):
                assert_grad_close(got, ref[0], torch.bfloat16, name)
        qs, ks = qs + lq, ks + lk


def test_custom_op_registration_and_torch_compile():
    torch.manual_seed(5)
    q = torch.randn(2, 128, 4, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(2, 128, 2, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(2, 128, 2, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    flashjit._ops()  # registers the ops (the package does on first use: a traced call, or one on the Python path)
    torch.library.opcheck(torch.ops.flashjit.attention.default,
                          (q, k, v, None, True, -1, -1, 0.0, "auto", 0, False))

    def loss(q, k, v):
        return (flash_attn_func(q, k, v, causal=True).float() ** 2).sum()

    eager = torch.autograd.grad(loss(q, k, v), (q, k, v))
    compiled = torch.compile(loss, fullgraph=True)
    traced = torch.autograd.grad(compiled(q, k, v), (q, k, v))
    for a, b in zip(eager, traced):
        assert torch.equal(a, b) or (a.float() - b.float()).abs().max() < 1e-2


def test_eager_autograd_and_custom_op_agree():
    """Eager calls record a plain autograd.Function (less host time per call); the custom op's
    autograd, which torch.compile traces, gives the same bits (deterministic backward)."""
    torch.manual_seed(6)
    q = torch.randn(2, 160, 4, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(2, 160, 2, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(2, 160, 2, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dout = torch.randn_like(q)
    out = flash_attn_func(q, k, v, causal=True, deterministic=True)
    node = out.grad_fn.name()  # the Python autograd.Function, or the C++ extension's node
    assert node == "EagerAttentionBackward" or "CppNode" in node and "Attention" in node, node
    eager = torch.autograd.grad(out, (q, k, v), dout)
    flashjit._ops()  # registers the custom ops (eager calls through the C++ extension never needed them)
    op_out, _ = torch.ops.flashjit.attention(q, k, v, None, True, -1, -1, 0.0, "auto", 0, True)
    assert op_out.grad_fn is not None and "EagerAttention" not in type(op_out.grad_fn).__name__
    through_op = torch.autograd.grad(op_out, (q, k, v), dout)
    assert torch.equal(out, op_out)
    for a, b, name in zip(eager, through_op, ("dq", "dk", "dv")):
        assert a.abs().max() > 0, name
        assert torch.equal(a, b), name


def _native_or_skip():
    """The C++ extension (flashjit._extension), built here; a skip only where it is switched off or
    this machine cannot build it (no C++ compiler or ninja), a failure if it should build and did not."""
    import shutil
    import torch.utils.cpp_extension as cpp_extension
    native = flashjit._extension.wait()
    if native is not None:
        return native
    status = flashjit._extension.status()
    if status == "off" or not cpp_extension.is_ninja_available() or not shutil.which(os.environ.get("CXX", "c++")):
        pytest.skip(f"the C++ extension is not built here: {status}")
    pytest.fail(f"the C++ extension did not build: {status}")


def _strided_case(case):
    """Inputs (q, k, v, dout) and flash_attn_func arguments for the C++/Python agreement test."""
    def randn(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, device="cuda", dtype=dtype)
    if case == "gqa_causal":
        return randn(2, 300, 8, 128), randn(2, 300, 2, 128), randn(2, 300, 2, 128), randn(2, 300, 8, 128), \
            dict(causal=True)
    if case == "window_softcap_fp16":
        q, k, v, dout = (randn(1, 257, 4, 64, dtype=torch.float16) for _ in range(4))
        return q, k, v, dout, dict(window_size=(40, 7), softcap=20.0)
    if case == "unaligned_and_strided":  # copied for the kernels on both paths
        flat = randn(2 * 97 * 4 * 64 + 1)
        q = flat[1:].view(2, 97, 4, 64)
        k = randn(2, 97, 4, 128)[..., ::2]
        v = randn(2, 97, 4, 68)[..., :64]
        dout = randn(2, 4, 97, 64).transpose(1, 2)
        return q, k, v, dout, dict(causal=True)
    if case == "head_major_scale_margin":
        q, k, v, dout = (randn(2, 4, 333, 96).transpose(1, 2) for _ in range(4))
        return q, k, v, dout, dict(softmax_scale=0.3, sm_margin=8)
    raise ValueError(case)


@pytest.mark.parametrize("case", ["gqa_causal", "window_softcap_fp16", "unaligned_and_strided",
                                  "head_major_scale_margin"])
def test_cpp_extension_and_python_path_agree(case, monkeypatch):
    """The C++ calls (forward and autograd node) and the Python path run the same kernels on the same
    inputs: out, LSE and (deterministic) gradients bitwise equal, and right against fp32."""
    _native_or_skip()
    torch.manual_seed(21)
    q, k, v, dout, kwargs = _strided_case(case)

    def run():
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        out, lse = flash_attn_func(*leaves, deterministic=True, return_lse=True, **kwargs)
        node = out.grad_fn.name()
        out.backward(dout)
        with torch.no_grad():
            plain, plain_lse = flash_attn_func(q, k, v, return_lse=True, **kwargs)
        return node, (out, lse, plain, plain_lse) + tuple(t.grad for t in leaves)

    native_node, native = run()
    monkeypatch.setattr(flashjit._extension, "_MODE", "0")
    python_node, python = run()
    assert "CppNode" in native_node and python_node == "EagerAttentionBackward", (native_node, python_node)
    for a, b, name in zip(native, python, ("out", "lse", "inference out", "inference lse", "dq", "dk", "dv")):
        assert a.shape == b.shape and torch.equal(a, b), name
    scale = kwargs.get("softmax_scale")
    want, want_lse = reference(q, k, v, kwargs.get("causal", False), kwargs.get("window_size", (-1, -1)),
                               kwargs.get("softcap", 0.0), scale)
    assert_close(native[0], want, q.dtype)
    assert torch.allclose(native[1], want_lse.float(), atol=2e-3)


def test_cpp_extension_errors_name_the_argument():
    """Bad input through the C++ calls: ValueError naming the argument, as on the Python path."""
    _native_or_skip()
    q = torch.randn(1, 64, 4, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    for grad in (False, True):
        with torch.set_grad_enabled(grad):
            with pytest.raises(ValueError, match="heads_kv 3 must divide heads_q 4"):
                k = torch.randn(1, 64, 3, 64, device="cuda", dtype=torch.bfloat16)
                flash_attn_func(q, k, k)
            with pytest.raises(ValueError, match="head_dim 260 is not supported"):
                big = torch.randn(1, 8, 1, 260, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                flash_attn_func(big, big, big)
            with pytest.raises(ValueError, match="q: dtype"):
                flash_attn_func(q.double(), q.double(), q.double())
            with pytest.raises(ValueError, match="sm_margin must fit in 32 bits"):
                flash_attn_func(q, q, q, sm_margin=2**32 + 5)


def test_cpp_extension_varlen_and_kvcache_agree_with_python_path(monkeypatch):
    """The C++ varlen calls (forward and autograd node) and the C++ KV-cache call (paged, tokens
    appended in place) against the Python path on the same inputs: bitwise equal."""
    _native_or_skip()
    torch.manual_seed(22)
    lens_q, lens_k = [0, 3, 300, 37], [5, 0, 300, 129]
    hq, hkv, d = 8, 2, 64
    cu = lambda lens: torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), device="cuda", dtype=torch.int32)
    # q a slice of a packed projection (strides the kernels cannot read: copied on both paths)
    q = torch.randn(sum(lens_q), hq, d + 4, device="cuda", dtype=torch.bfloat16)[..., 2:d + 2]
    k, v = (torch.randn(sum(lens_k), hkv, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    dout = torch.randn(q.shape, device="cuda", dtype=torch.bfloat16)
    b, cap, page = 3, 96, 16
    q_step = torch.randn(b, 2, hq, d, device="cuda", dtype=torch.bfloat16)
    k_pages = torch.randn(b * cap // page, page, hkv, d, device="cuda", dtype=torch.bfloat16)
    v_pages = torch.randn_like(k_pages)
    table = torch.randperm(b * cap // page, device="cuda", dtype=torch.int32).view(b, cap // page)
    k_new, v_new = (torch.randn(b, 2, hkv, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))

    def run():
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        out, lse = flash_attn_varlen_func(*leaves, cu(lens_q), cu(lens_k), max(lens_q), max(lens_k), causal=True,
                                          window_size=(64, 0), deterministic=True, return_lse=True)
        node = out.grad_fn.name()
        out.backward(dout)
        with torch.no_grad():
            plain = flash_attn_varlen_func(q, k, v, cu(lens_q), cu(lens_k), max(lens_q), max(lens_k), softcap=5.0)
        caches = k_pages.clone(), v_pages.clone()
        step, step_lse = flash_attn_with_kvcache(q_step, *caches, k=k_new, v=v_new, block_table=table, causal=True,
                                                 cache_seqlens=torch.tensor([0, 17, 94], device="cuda",
                                                                            dtype=torch.int32),
                                                 return_softmax_lse=True)
        return node, (out, lse, plain, step, step_lse) + caches + tuple(t.grad for t in leaves)

    native_node, native = run()
    monkeypatch.setattr(flashjit._extension, "_MODE", "0")
    python_node, python = run()
    assert "CppNode" in native_node and python_node == "EagerAttentionVarlenBackward", (native_node, python_node)
    names = ("out", "lse", "inference out", "kvcache out", "kvcache lse", "k_cache", "v_cache", "dq", "dk", "dv")
    for a, b_, name in zip(native, python, names):
        assert a.shape == b_.shape and torch.equal(a, b_), name
    want, _ = reference(q[None, 3:303], k[None, 5:305], v[None, 5:305], True, (64, 0))
    assert_close(native[0][3:303], want[0], torch.bfloat16)


def test_cpp_extension_varlen_and_kvcache_errors():
    """Bad input through the C++ varlen and KV-cache calls: ValueError naming the argument."""
    _native_or_skip()
    q = torch.randn(10, 4, 64, device="cuda", dtype=torch.bfloat16)
    cu = torch.tensor([0, 10], device="cuda", dtype=torch.int32)
    with pytest.raises(ValueError, match="cu_seqlens_q: expected dtype int32, got int64"):
        flash_attn_varlen_func(q, q, q, cu.long(), cu, 10, 10)
    with pytest.raises(ValueError, match="max_seqlen_k must fit in 32 bits"):
        flash_attn_varlen_func(q, q, q, cu, cu, 10, 2**32)
    step = torch.randn(1, 1, 4, 64, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="cache_seqlens: expected dtype int32"):
        flash_attn_with_kvcache(step, q[None], q[None], cache_seqlens=cu[:1].long())
    with pytest.raises(ValueError, match="num_splits must fit in 32 bits"):
        flash_attn_with_kvcache(step, q[None], q[None], cache_seqlens=1, num_splits=2**40)


def test_backward_argument_errors():
    q = torch.randn(1, 64, 4, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    out, lse = flashjit._forward(q, q, q, None, False, -1, -1, 0.0, "auto", 0)
    with pytest.raises(ValueError, match="dout: shape"):
        flashjit._backward(torch.randn(1, 63, 4, 64, device="cuda", dtype=torch.bfloat16), q, q, q, out, lse,
                           None, False, -1, -1, 0.0, False)
    with pytest.raises(ValueError, match="dout: dtype float16 differs from out's bfloat16"):
        flashjit._backward(out.half(), q, q, q, out, lse, None, False, -1, -1, 0.0, False)
    with pytest.raises(ValueError, match="lse: expected shape"):
        flashjit._backward(out, q, q, q, out, lse[:, :, :10], None, False, -1, -1, 0.0, False)


def test_load_tuning_db_errors(tmp_path):
    good = tmp_path / "tuning.json"
    good.write_text('{"format": "flashjit-tuning-db", "version": 1, "entries": []}\n')
    flashjit.load_tuning_db(good)
    bad = tmp_path / "broken.json"
    bad.write_text('{"format": "flashjit-tuning-db",\n "version": 1,\n "entries": [,]}\n')
    with pytest.raises(ValueError, match=r"broken\.json:3:"):
        flashjit.load_tuning_db(bad)
    with pytest.raises(flashjit.FlashJitError, match="cannot read the tuning database"):
        flashjit.load_tuning_db(tmp_path / "missing.json")


def test_inference_and_autograd_paths_agree():
    """No-grad calls skip autograd; both paths run the same kernel and give the same bits."""
    torch.manual_seed(11)
    q = torch.randn(2, 200, 4, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(2, 200, 2, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(2, 200, 2, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    with_graph = flash_attn_func(q, k, v, causal=True)
    assert with_graph.requires_grad
    with torch.no_grad():
        plain = flash_attn_func(q, k, v, causal=True)
    assert not plain.requires_grad
    assert torch.equal(with_graph.detach(), plain)


def test_hopper_and_fa2_backends_agree_and_sm_margin():
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the sm90 backend needs an sm_90 GPU")
    torch.manual_seed(9)
    q = torch.randn(2, 1000, 8, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(2, 1000, 2, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(2, 1000, 2, 128, device="cuda", dtype=torch.bfloat16)
    fa2 = flash_attn_func(q, k, v, causal=True, backend="fa2")
    hopper = flash_attn_func(q, k, v, causal=True, backend="sm90")
    assert (fa2.float() - hopper.float()).abs().max() < 2e-2
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert torch.equal(flash_attn_func(q, k, v, causal=True, backend="sm90", sm_margin=sms - 8), hopper)
    with pytest.raises(ValueError, match="sm_margin must be >= 0"):
        flash_attn_func(q, k, v, sm_margin=-1)
    with pytest.raises(ValueError, match="sm_margin"):
        flash_attn_func(q, k, v, backend="sm90", sm_margin=sms)


# flash_attn_with_kvcache: decode over contiguous and paged caches, appending, graphs, faults.

def paged_cache(k, page_size):
    """(b, s, h, d) -> pages (shuffled) and a block table."""
    b, s, h, d = k.shape
    pages_per_seq = s // page_size
    order = torch.randperm(b * pages_per_seq, device=k.device)
    pages = torch.empty(b * pages_per_seq, page_size, h, d, dtype=k.dtype, device=k.device)
    pages[order] = k.reshape(b * pages_per_seq, page_size, h, d)
    return pages, order.view(b, pages_per_seq).to(torch.int32)


@pytest.mark.parametrize("page_size", [0, 1, 16, 64])
@pytest.mark.parametrize("seqlen_q,causal", [(1, False), (4, True)])
def test_kvcache_matches_reference(page_size, seqlen_q, causal):
    torch.manual_seed(page_size + seqlen_q)
    b, s, hq, hkv, d = 3, 256, 16, 4, 128
    q = torch.randn(b, seqlen_q, hq, d, dtype=torch.bfloat16, device="cuda")
    k = torch.randn(b, s, hkv, d, dtype=torch.bfloat16, device="cuda")
    v = torch.randn_like(k)
    lens = torch.tensor([0, 100, 256], dtype=torch.int32, device="cuda")
    if page_size:
        kc, table = paged_cache(k, page_size)
        vc = torch.empty_like(kc)
        vc[table.view(-1).long()] = v.reshape(-1, page_size, hkv, d)
    else:
        kc, vc, table = k, v, None
    out, lse = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, block_table=table, causal=causal,
                                       return_softmax_lse=True)
    for i, n in enumerate(lens.tolist()):
        want, want_lse = reference(q[i:i + 1], k[i:i + 1, :n], v[i:i + 1, :n], causal=causal)
        if n == 0:
            assert (out[i] == 0).all() and torch.isinf(lse[i]).all()
            continue
        assert_close(out[i:i + 1], want, torch.bfloat16)
        assert torch.allclose(lse[i:i + 1], want_lse, atol=1e-3)


def test_kvcache_append_then_graph_replay():
    torch.manual_seed(5)
    b, hq, hkv, d, cap = 2, 8, 2, 64, 128
    k_cache = torch.randn(b, cap, hkv, d, dtype=torch.float16, device="cuda")
    v_cache = torch.randn_like(k_cache)
    q = torch.randn(b, 1, hq, d, dtype=torch.float16, device="cuda")
    k_new = torch.randn(b, 1, hkv, d, dtype=torch.float16, device="cuda")
    v_new = torch.randn_like(k_new)
    lens = torch.tensor([5, 60], dtype=torch.int32, device="cuda")
    flash_attn_with_kvcache(q, k_cache, v_cache, k=k_new, v=v_new, cache_seqlens=lens, causal=True)  # warm
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = flash_attn_with_kvcache(q, k_cache, v_cache, k=k_new, v=v_new, cache_seqlens=lens, causal=True)
    for step in range(3):
        lens.copy_(torch.tensor([10 + step, 100 - step], dtype=torch.int32))
        k_new.normal_()
        v_new.normal_()
        graph.replay()
        torch.cuda.synchronize()
        for i, n in enumerate(lens.tolist()):
            assert torch.equal(k_cache[i, n], k_new[i, 0]) and torch.equal(v_cache[i, n], v_new[i, 0])
            want, _ = reference(q[i:i + 1], k_cache[i:i + 1, :n + 1], v_cache[i:i + 1, :n + 1], causal=True)
            assert_close(out[i:i + 1], want, torch.float16)
    flashjit.check_kvcache()


def test_kvcache_faults_and_argument_errors():
    q = torch.randn(1, 1, 4, 64, dtype=torch.bfloat16, device="cuda")
    kc = torch.randn(4, 16, 1, 64, dtype=torch.bfloat16, device="cuda")
    table = torch.tensor([[0, 99]], dtype=torch.int32, device="cuda")
    out = flash_attn_with_kvcache(q, kc, kc, cache_seqlens=torch.tensor([20], dtype=torch.int32, device="cuda"),
                                  block_table=table)
    with pytest.raises(ValueError, match=r"block_table\[0\]\[1\] is 99"):
        flashjit.check_kvcache()
    assert torch.isnan(out.float()).all()
    with pytest.raises(ValueError, match="block_table: expected dtype int32"):
        flash_attn_with_kvcache(q, kc, kc, cache_seqlens=1, block_table=table.float())
    with pytest.raises(ValueError, match="k and v"):
        flash_attn_with_kvcache(q, kc, kc, k=q)


def _hopper_or_skip():
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("user modifiers, block masks and ring attention run on sm_90")


def test_modifier_and_block_mask_under_torch_compile_fullgraph():
    """With mod and block_mask, torch.compile(fullgraph=True) traces the flashjit::mod_attention ops
    (no graph break): forward and gradients as the eager call gives them, and a second mod of the same
    code with other side-tensor values reuses the compiled kernel and gives its own result."""
    _hopper_or_skip()
    torch.manual_seed(12)
    b, s, h, d = 2, 300, 4, 64
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    dout = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16)

    def attention(q, k, v, mod, bm):
        return flash_attn_func(q, k, v, mod=mod, block_mask=bm)

    compiled = torch.compile(attention, fullgraph=True)
    for bounds in ([120, 300], [40, 260]):
        doc = torch.bucketize(torch.arange(s, device="cuda"), torch.tensor(bounds, device="cuda"), right=True)
        mod = flashjit.AttentionMod(mask="return doc[q_idx] == doc[kv_idx] && q_idx >= kv_idx;",
                                    tensors={"doc": doc.to(torch.int32)})
        bm = flashjit.create_block_mask(mod, 1, 1, s, s)
        want = attention(q, k, v, mod, bm)
        want_grads = torch.autograd.grad(want, (q, k, v), dout)
        got = compiled(q, k, v, mod, bm)
        got_grads = torch.autograd.grad(got, (q, k, v), dout)
        assert torch.equal(got, want)
        for g, w in zip(got_grads, want_grads):  # (atomic dQ: the order of additions may differ)
            torch.testing.assert_close(g, w, atol=2e-2, rtol=0)
    assert not torch.equal(got, attention(q, k, v, None, None))  # (the mask is applied)


def test_modifier_document_mask_with_block_mask_and_flex_block_mask():
    """A document mask through flashjit's block mask builder, and through FlexAttention's BlockMask."""
    _hopper_or_skip()
    torch.manual_seed(0)
    b, s, h, d = 2, 700, 4, 128
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    doc = torch.repeat_interleave(torch.arange(4), torch.tensor([300, 57, 200, 143])).to("cuda", torch.int32)
    mod = flashjit.AttentionMod(mask="return doc[q_idx] == doc[kv_idx] && q_idx >= kv_idx;", tensors={"doc": doc})
    bm = flashjit.create_block_mask(mod, 1, 1, s, s)
    out, lse = flash_attn_func(q, k, v, mod=mod, block_mask=bm, return_lse=True)
    i = torch.arange(s, device="cuda")
    visible = (doc[:, None] == doc[None, :]) & (i[:, None] >= i[None, :])
    qf, kf, vf = (t.float().transpose(1, 2) for t in (q, k, v))
    scores = (qf @ kf.transpose(-1, -2) / math.sqrt(d)).masked_fill(~visible, float("-inf"))
    want = (torch.softmax(scores, -1) @ vf).transpose(1, 2)
    assert_close(out, want, torch.bfloat16)
    assert torch.allclose(lse, torch.logsumexp(scores, -1), atol=1e-3)
    try:
        from torch.nn.attention.flex_attention import create_block_mask as flex_block_mask
    except ImportError:
        return
    flex_mask = flex_block_mask(lambda bb, hh, qi, ki: (doc[qi] == doc[ki]) & (qi >= ki), None, None, s, s, device="cuda")
    assert_close(flash_attn_func(q, k, v, mod=mod, block_mask=flex_mask), want, torch.bfloat16)


def test_modifier_score_and_errors():
    """ALiBi as a score modifier; an empty block mask gives out 0 and LSE -inf; errors name the cause."""
    _hopper_or_skip()
    torch.manual_seed(1)
    b, s, h, d = 1, 300, 4, 64
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625], device="cuda")
    mod = flashjit.AttentionMod(score="return score - slopes[head] * float(q_idx - kv_idx);", tensors={"slopes": slopes})
    out = flash_attn_func(q, k, v, causal=True, mod=mod)
    i = torch.arange(s, device="cuda")
    qf, kf, vf = (t.float().transpose(1, 2) for t in (q, k, v))
    scores = qf @ kf.transpose(-1, -2) / math.sqrt(d) - slopes[:, None, None] * (i[:, None] - i[None, :])
    scores = scores.masked_fill(i[None, :] > i[:, None], float("-inf"))
    assert_close(out, (torch.softmax(scores, -1) @ vf).transpose(1, 2), torch.bfloat16)

    empty = flashjit.block_mask_from_tiles(torch.zeros(1, 1, 3, 3, dtype=torch.bool, device="cuda"), s, s)
    out, lse = flash_attn_func(q, k, v, block_mask=empty, return_lse=True)
    assert (out == 0).all() and torch.isneginf(lse).all()

    broken = flashjit.AttentionMod(mask="return q_idx >=\n  kv_idx + nothing;")
    with pytest.raises(flashjit.FlashJitError, match=r"mask_mod\(2\)"):
        flash_attn_func(q, k, v, mod=broken)
    with pytest.raises(ValueError, match="replaces causal"):
        flash_attn_func(q, k, v, causal=True, block_mask=empty)


def test_modifier_backward_matches_autograd_and_flex_under_compile():
    """Gradients through a document mask with a block mask (flashjit's and FlexAttention's) and through
    ALiBi and tanh softcap score modifiers (derived gradients), against fp32 autograd of the same
    masked scores; a wrong hand-written score_grad shows; the mod call works inside torch.compile."""
    _hopper_or_skip()
    torch.manual_seed(2)
    b, s, h, d = 1, 600, 4, 128
    q, k, v, dout = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    doc = torch.repeat_interleave(torch.arange(3), torch.tensor([250, 130, 220])).to("cuda", torch.int32)
    i = torch.arange(s, device="cuda")
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625], device="cuda")

    def reference(score_fn, visible):
        leaves = [t.float().detach().requires_grad_() for t in (q, k, v)]
        qf, kf, vf = (t.transpose(1, 2) for t in leaves)
        scores = score_fn(qf @ kf.transpose(-1, -2) / math.sqrt(d)).masked_fill(~visible, float("-inf"))
        out = (torch.softmax(scores, -1) @ vf).transpose(1, 2)
        out.backward(dout.float())
        return [t.grad for t in leaves]

    def grads(**kwargs):
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        flash_attn_func(*leaves, **kwargs).backward(dout)
        return [t.grad for t in leaves]

    causal = i[:, None] >= i[None, :]
    document = (doc[:, None] == doc[None, :]) & causal
    mod = flashjit.AttentionMod(mask="return doc[q_idx] == doc[kv_idx] && q_idx >= kv_idx;", tensors={"doc": doc})
    want = reference(lambda x: x, document)
    for got, ref, name in zip(grads(mod=mod, block_mask=flashjit.create_block_mask(mod, 1, 1, s, s)), want, "qkv"):
        assert_grad_close(got, ref, torch.bfloat16, "d" + name)
    try:
        from torch.nn.attention.flex_attention import create_block_mask as flex_block_mask
        flex_mask = flex_block_mask(lambda bb, hh, qi, ki: (doc[qi] == doc[ki]) & (qi >= ki), None, None, s, s,
                                    device="cuda")
        for got, ref, name in zip(grads(mod=mod, block_mask=flex_mask), want, "qkv"):
            assert_grad_close(got, ref, torch.bfloat16, "d" + name)
    except ImportError:
        pass

    alibi = flashjit.AttentionMod(score="return score - slopes[head] * float(q_idx - kv_idx);", tensors={"slopes": slopes})
    want = reference(lambda x: x - slopes[:, None, None] * (i[:, None] - i[None, :]), causal)
    for got, ref, name in zip(grads(mod=alibi, causal=True), want, "qkv"):
        assert_grad_close(got, ref, torch.bfloat16, "d" + name)
    softcap = flashjit.AttentionMod(score="return 5.f * tanhf(score / 5.f);")
    want = reference(lambda x: 5 * torch.tanh(x / 5), torch.ones_like(causal))
    for got, ref, name in zip(grads(mod=softcap), want, "qkv"):
        assert_grad_close(got, ref, torch.bfloat16, "d" + name)
    # The score body's derivative is 1.5 + 0.5 score; a gradient body of 1.5 alone is off in dq.
    square = lambda x: 1.5 * x + 0.25 * x * x
    want = reference(square, torch.ones_like(causal))
    wrong = flashjit.AttentionMod(score="return 1.5f * score + 0.25f * score * score;", score_grad="return 1.5f;")
    with pytest.raises(AssertionError):
        assert_grad_close(grads(mod=wrong)[0], want[0], torch.bfloat16, "dq")
    right = flashjit.AttentionMod(score="return 1.5f * score + 0.25f * score * score;", score_grad="return 1.5f + 0.5f * score;")
    assert_grad_close(grads(mod=right)[0], want[0], torch.bfloat16, "dq")

    compiled = torch.compile(lambda a, bb, c: flash_attn_func(a, bb, c, mod=mod).float().square().sum())
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    compiled(*leaves).backward()
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in leaves)


# Ring attention: the shards' outputs, unsharded, against the whole sequence's reference; the same
# schedule over virtual ranks (LocalRing) and over a one-rank NCCL group.

def test_ring_shard_round_trip_and_errors():
    x = torch.arange(2 * 48 * 3, device="cuda").reshape(2, 48, 3)
    for layout in ("zigzag", "contiguous"):
        for world in (1, 2, 4):
            shards = [flashjit.ring_shard(x, r, world, layout) for r in range(world)]
            assert torch.equal(flashjit.ring_unshard(shards, layout), x)
    assert torch.equal(flashjit.ring_shard(x, 1, 4)[:, :6], x[:, 6:12])  # zigzag: chunks 1 and 6 of 8
    assert torch.equal(flashjit.ring_shard(x, 1, 4)[:, 6:], x[:, 36:42])
    with pytest.raises(ValueError, match="does not divide into the zigzag layout's 10"):
        flashjit.ring_shard(x, 0, 5)
    with pytest.raises(ValueError, match="layout must be"):
        flashjit.ring_shard(x, 0, 2, layout="striped")


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("causal", [False, True])
def test_ring_local_matches_reference(world, layout, causal):
    _hopper_or_skip()
    torch.manual_seed(world * 10 + causal)
    seqlen = world * 2 * 72
    q = torch.randn(2, seqlen, 4, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(2, seqlen, 2, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(2, seqlen, 2, 128, device="cuda", dtype=torch.bfloat16)
    shards = [[flashjit.ring_shard(t, r, world, layout) for r in range(world)] for t in (q, k, v)]
    results = flashjit.ring_flash_attn_local(*shards, causal=causal, layout=layout, return_lse=True)
    out = flashjit.ring_unshard([o for o, _ in results], layout)
    lse = flashjit.ring_unshard([l for _, l in results], layout, dim=2)
    want, want_lse = reference(q, k, v, causal=causal)
    assert_close(out, want, torch.bfloat16)
    assert torch.allclose(lse, want_lse, atol=1e-3, rtol=1e-4)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("causal", [False, True])
def test_ring_local_backward_matches_fp32_autograd(world, layout, causal):
    _hopper_or_skip()
    torch.manual_seed(world * 100 + causal)
    seqlen = world * 2 * 64
    q = torch.randn(2, seqlen, 4, 64, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(2, seqlen, 2, 64, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(2, seqlen, 2, 64, device="cuda", dtype=torch.bfloat16)
    dout = torch.randn_like(q)
    shards = [[flashjit.ring_shard(t, r, world, layout).requires_grad_() for r in range(world)] for t in (q, k, v)]
    outs = flashjit.ring_flash_attn_local(*shards, causal=causal, layout=layout)
    torch.autograd.backward(outs, [flashjit.ring_shard(dout, r, world, layout) for r in range(world)])
    got = [flashjit.ring_unshard([t.grad for t in ts], layout) for ts in shards]
    want = reference_grads(q, k, v, dout, causal=causal)
    for g, w, name in zip(got, want, ("dq", "dk", "dv")):
        assert_grad_close(g, w, torch.bfloat16, name)


@pytest.mark.parametrize("layout,causal,window", [("zigzag", True, (100, 0)), ("contiguous", False, (70, 40))])
def test_ring_local_window_forward_and_backward(layout, causal, window):
    _hopper_or_skip()
    torch.manual_seed(7)
    world, seqlen = 4, 4 * 2 * 64
    q = torch.randn(1, seqlen, 4, 64, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, seqlen, 2, 64, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(1, seqlen, 2, 64, device="cuda", dtype=torch.bfloat16)
    dout = torch.randn_like(q)
    shards = [[flashjit.ring_shard(t, r, world, layout).requires_grad_() for r in range(world)] for t in (q, k, v)]
    outs = flashjit.ring_flash_attn_local(*shards, causal=causal, layout=layout, window_size=window)
    assert_close(flashjit.ring_unshard([o.detach() for o in outs], layout), reference(q, k, v, causal=causal, window=window)[0],
                 torch.bfloat16)
    torch.autograd.backward(outs, [flashjit.ring_shard(dout, r, world, layout) for r in range(world)])
    got = [flashjit.ring_unshard([t.grad for t in ts], layout) for ts in shards]
    for g, w, name in zip(got, reference_grads(q, k, v, dout, causal=causal, window=window), ("dq", "dk", "dv")):
        assert_grad_close(g, w, torch.bfloat16, name)
    with pytest.raises(ValueError, match="window_size"):
        flashjit.ring_flash_attn_local(*shards, window_size=(-2, 0))


@pytest.mark.parametrize("layout,causal", [("zigzag", True), ("contiguous", False)])
def test_ring_local_varlen_forward_and_backward(layout, causal):
    _hopper_or_skip()
    torch.manual_seed(11)
    world, lens = 4, [8 * 40, 8 * 3, 8 * 90]
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32)
    q = torch.randn(sum(lens), 4, 64, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(sum(lens), 2, 64, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(sum(lens), 2, 64, device="cuda", dtype=torch.bfloat16)
    dout = torch.randn_like(q)
    x = torch.arange(sum(lens), device="cuda")
    assert torch.equal(flashjit.ring_unshard_varlen([flashjit.ring_shard_varlen(x, cu, r, world, layout) for r in range(world)],
                                                    cu, layout), x)
    shards = [[flashjit.ring_shard_varlen(t, cu, r, world, layout).requires_grad_() for r in range(world)] for t in (q, k, v)]
    results = flashjit.ring_flash_attn_varlen_local(*shards, cu, causal=causal, layout=layout, return_lse=True)
    out = flashjit.ring_unshard_varlen([o.detach() for o, _ in results], cu, layout)
    lse = flashjit.ring_unshard_varlen([l for _, l in results], cu, layout, dim=1)
    torch.autograd.backward([o for o, _ in results], [flashjit.ring_shard_varlen(dout, cu, r, world, layout) for r in range(world)])
    grads = [flashjit.ring_unshard_varlen([t.grad for t in ts], cu, layout) for ts in shards]
    for b, length in enumerate(lens):
        rows = slice(int(cu[b]), int(cu[b + 1]))
        want, want_lse = reference(q[None, rows], k[None, rows], v[None, rows], causal=causal)
        assert_close(out[rows], want[0], torch.bfloat16)
        assert torch.allclose(lse[:, rows], want_lse[0], atol=1e-3, rtol=1e-4)
        for g, w, name in zip(grads, reference_grads(q[None, rows], k[None, rows], v[None, rows], dout[None, rows],
                                                     causal=causal), ("dq", "dk", "dv")):
            assert_grad_close(g[rows], w[0], torch.bfloat16, name)
    with pytest.raises(ValueError, match="does not divide"):
        flashjit.ring_shard_varlen(x, torch.tensor([0, 10]), 0, world, layout)


def test_ring_refuses_mismatched_shards():
    _hopper_or_skip()
    q = torch.randn(1, 64, 2, 64, device="cuda", dtype=torch.bfloat16)
    short = torch.randn(1, 32, 2, 64, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="shard rows"):
        flashjit.ring_flash_attn_local([q, short], [q, short], [q, short])


def test_ring_over_a_one_rank_nccl_group(tmp_path):
    _hopper_or_skip()
    import torch.distributed as dist
    dist.init_process_group("nccl", init_method=f"file://{tmp_path}/store", rank=0, world_size=1,
                            device_id=torch.device("cuda", torch.cuda.current_device()))
    try:
        q = torch.randn(2, 256, 4, 128, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(2, 256, 2, 128, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(2, 256, 2, 128, device="cuda", dtype=torch.bfloat16)
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out, lse = flashjit.ring_flash_attn_func(*leaves, causal=True, return_lse=True)
        want, want_lse = reference(q, k, v, causal=True)
        assert_close(out, want, torch.bfloat16)
        assert torch.allclose(lse, want_lse, atol=1e-3, rtol=1e-4)
        dout = torch.randn_like(out)
        out.backward(dout)
        for leaf, w, name in zip(leaves, reference_grads(q, k, v, dout, causal=True), ("dq", "dk", "dv")):
            assert_grad_close(leaf.grad, w, torch.bfloat16, name)
    finally:
        dist.destroy_process_group()
