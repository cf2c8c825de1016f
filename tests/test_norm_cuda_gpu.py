"""The CUDA C++ row norms (cuda_src: norm.py / norm.cu) on a GPU: every instance that takes a
problem, through `Kernel.run`, against float64 references on fresh random data, outputs inside
sentinel-filled buffers with odd row strides, odd row lengths, batched inputs, misaligned
pointers, the fused residual add and the backward's gradients; then through `kernel_api.ops`
with only this provider allowed (forward, autograd backward), and memcheck.
"""

from __future__ import annotations

import pytest
import torch

import kernel_api
from kernel_api import ops
from kernel_api.arguments.norm import (LayerNormArguments, LayerNormBackwardArguments, RMSNormArguments,
                                       RMSNormBackwardArguments)
from kernel_api.providers.cuda_src.kernels.norm import (CudaLayerNorm, CudaLayerNormBackward, CudaRMSNorm,
                                                        CudaRMSNormBackward)

from memcheck import run_memcheck

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

SENTINEL = 1234.5
TOL = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
# (rows' type, weight's type)
PAIRS = [(torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16), (torch.float32, torch.float32),
         (torch.bfloat16, torch.float32)]
_FORWARD = {"rms_norm": CudaRMSNorm, "layer_norm": CudaLayerNorm}
_BACKWARD = {"rms_norm": CudaRMSNormBackward, "layer_norm": CudaLayerNormBackward}


def _close(got, ref, dtype, what):
    tol = TOL[dtype]
    scale = 1.0 + float(ref.abs().max()) if ref.numel() else 1.0
    torch.testing.assert_close(got.double(), ref, atol=tol * scale, rtol=tol, msg=lambda m: f"{what}: {m}")


def _fresh(shape, dtype, offset=0):
    """Fresh random rows; ``offset`` elements into their own allocation (misaligned when odd)."""
    n = 1
    for s in shape:
        n *= s
    return torch.randn(n + offset, device="cuda").to(dtype)[offset:].view(shape)


def _in_sentinel(shape, dtype, pad):
    """(view, buffer): a tensor of ``shape`` whose rows sit ``pad`` elements apart inside a
    sentinel-filled buffer (row stride cols + pad)."""
    rows = 1
    for s in shape[:-1]:
        rows *= s
    cols = shape[-1]
    buf = torch.full((rows + 1, cols + pad), SENTINEL, dtype=dtype, device="cuda")
    view = buf[:rows, :cols]
    return view.unflatten(0, shape[:-1]), buf


def _untouched(buf, shape):
    cols = shape[-1]
    rows = buf.shape[0] - 1
    mask = torch.ones_like(buf, dtype=torch.bool)
    mask[:rows, :cols] = False
    assert bool((buf[mask] == SENTINEL).all()), "a kernel wrote outside its output"


def _reference(kind, x, w, b, eps, r):
    s = x.double() + (r.double() if r is not None else 0)
    if kind == "layer_norm":
        c = s - s.mean(-1, keepdim=True)
        y = c / torch.sqrt(c.square().mean(-1, keepdim=True) + eps) * w.double() + b.double()
    else:
        y = s / torch.sqrt(s.square().mean(-1, keepdim=True) + eps) * w.double()
    return y, s


def _instances(cls, args):
    return [k for k in cls.generate_kernels(None, cc=90) if k.supports(args)]


def _forward_args(kind, x, w, b, out, eps, r=None, r_out=None):
    if kind == "layer_norm":
        return LayerNormArguments(x, w, b, out, eps=eps, residual=r, residual_out=r_out)
    return RMSNormArguments(x, w, out, eps=eps, residual=r, residual_out=r_out)


@pytest.mark.parametrize("kind", ["rms_norm", "layer_norm"])
@pytest.mark.parametrize("pair", PAIRS, ids=lambda p: f"{p[0]}-{p[1]}".replace("torch.", ""))
@pytest.mark.parametrize("shape", [(5, 1), (3, 7), (37, 1024), (2, 4097), (4, 8191), (9, 4096), (2, 3, 64),
                                   (3, 40000)])
@pytest.mark.parametrize("fused", [False, True])
def test_forward_every_instance(kind, pair, shape, fused):
    dtype, wtype = pair
    eps = 1e-5
    x = _fresh(shape, dtype)
    w = (1 + 0.1 * torch.randn(shape[-1], device="cuda")).to(wtype)
    b = torch.randn(shape[-1], device="cuda").to(wtype)
    r = _fresh(shape, dtype) if fused else None
    pad = 8 if shape[-1] % 8 == 0 else 3  # aligned and odd row strides
    out, out_buf = _in_sentinel(shape, dtype, pad)
    r_out, r_buf = _in_sentinel(shape, dtype, pad) if fused else (None, None)
    args = _forward_args(kind, x, w, b, out, eps, r, r_out)
    kernels = _instances(_FORWARD[kind], args)
    assert kernels, kernel_api.explain(args)
    y_ref, s_ref = _reference(kind, x, w, b, eps, r)
    # block rows of 16-byte vectors held in registers and staged in shared memory (at the default
    # bytes a thread, None, and at 128)
    block = [k for k in kernels if k.vec > 1 and k.strategy == "block"]
    runs = [(k, False, None) for k in kernels] + [(k, True, b) for b in (None, 128) for k in block]
    for k, staged, bpt in runs:
        k.staged, k.bytes_per_thread = staged, bpt
        if not k.supports(args):
            continue
        out.fill_(SENTINEL)
        if fused:
            r_out.fill_(SENTINEL)
        k.run(args)
        torch.cuda.synchronize()
        name = f"{k.metadata.kernel_name} staged={staged} bytes/thread={bpt}"
        _close(out, y_ref, dtype, name)
        _untouched(out_buf, shape)
        if fused:
            _close(r_out, s_ref, dtype, name + " residual_out")
            _untouched(r_buf, shape)


@pytest.mark.parametrize("kind", ["rms_norm", "layer_norm"])
def test_forward_misaligned_pointers_take_a1(kind):
    dtype = torch.bfloat16
    shape = (6, 1024)
    x = _fresh(shape, dtype, offset=1)
    w, b = torch.randn(1024, device="cuda").to(dtype), torch.randn(1024, device="cuda").to(dtype)
    r = _fresh(shape, dtype, offset=3)
    out, r_out = _fresh(shape, dtype, offset=5).fill_(SENTINEL), _fresh(shape, dtype, offset=7).fill_(SENTINEL)
    args = _forward_args(kind, x, w, b, out, 1e-5, r, r_out)
    kernels = _instances(_FORWARD[kind], args)
    assert kernels and all(k.metadata.kernel_name.endswith("_a1") for k in kernels)
    y_ref, s_ref = _reference(kind, x, w, b, 1e-5, r)
    for k in kernels:
        k.run(args)
        torch.cuda.synchronize()
        _close(out, y_ref, dtype, k.metadata.kernel_name)
        _close(r_out, s_ref, dtype, k.metadata.kernel_name)


@pytest.mark.parametrize("kind", ["rms_norm", "layer_norm"])
@pytest.mark.parametrize("staged", [False, True])
def test_forward_repeated_runs_read_new_data(kind, staged):
    """A second run of the same arguments replays the recorded launch (with the staged rows'
    shared memory) and sees new data."""
    x = _fresh((64, 2048), torch.bfloat16)
    w, b = torch.randn(2048, device="cuda"), torch.randn(2048, device="cuda")
    out = torch.full_like(x, SENTINEL)
    args = _forward_args(kind, x, w, b, out, 1e-6)
    k = next(k for k in _instances(_FORWARD[kind], args) if "_block_a8" in k.metadata.kernel_name)
    k.staged = staged
    for _ in range(3):
        x.copy_(torch.randn_like(x, dtype=torch.float32))
        k.run(args)
        torch.cuda.synchronize()
        _close(out, _reference(kind, x, w, b, 1e-6, None)[0], torch.bfloat16, k.metadata.kernel_name)


def _grads_reference(kind, dy, x, w, eps):
    xd = x.double().requires_grad_()
    wd = w.double().requires_grad_()
    bd = torch.zeros_like(wd, requires_grad=True)
    y, _ = _reference(kind, xd, wd, bd, eps, None)
    y.backward(dy.double())
    return xd.grad, wd.grad, bd.grad


@pytest.mark.parametrize("kind", ["rms_norm", "layer_norm"])
@pytest.mark.parametrize("pair", PAIRS, ids=lambda p: f"{p[0]}-{p[1]}".replace("torch.", ""))
@pytest.mark.parametrize("shape", [(5, 1), (3, 7), (300, 1000), (2, 4097), (64, 8191), (2, 3, 64), (2, 20000),
                                   (0, 16), (1000, 4096), (5000, 64)])
def test_backward_every_instance(kind, pair, shape):
    dtype, wtype = pair
    eps = 1e-5
    x, dy = _fresh(shape, dtype), _fresh(shape, dtype)
    w = (1 + 0.1 * torch.randn(shape[-1], device="cuda")).to(wtype)
    pad = 8 if shape[-1] % 8 == 0 else 3
    dx, dx_buf = _in_sentinel(shape, dtype, pad)
    gw = torch.full((shape[-1],), SENTINEL, dtype=wtype, device="cuda")
    gb = torch.full((shape[-1],), SENTINEL, dtype=wtype, device="cuda")
    if kind == "layer_norm":
        args = LayerNormBackwardArguments(dy, x, w, dx, gw, gb, eps=eps)
    else:
        args = RMSNormBackwardArguments(dy, x, w, dx, gw, eps=eps)
    kernels = _instances(_BACKWARD[kind], args)
    assert kernels, kernel_api.explain(args)
    dx_ref, dw_ref, db_ref = _grads_reference(kind, dy, x, w, eps)
    # register rows of 16-byte vectors also with later rows staged in shared memory (the ring),
    # at 32 and 64 bytes of a row per thread
    ring = [k for k in kernels if k.vec > 1 and k.strategy != "looped"]
    runs = [(k, 0, 32) for k in kernels] + [(k, s, b) for s, b in ((2, 32), (3, 32), (5, 32), (3, 64)) for k in ring]
    for k, stages, bpt in runs:
        k.stages, k.bytes_per_thread = stages, bpt
        if not k.supports(args):
            continue
        dx.fill_(SENTINEL)
        gw.fill_(SENTINEL)
        gb.fill_(SENTINEL)
        k.run(args)
        torch.cuda.synchronize()
        name = f"{k.metadata.kernel_name} stages={stages} bytes/thread={bpt}"
        _close(dx, dx_ref, dtype, name + " grad_x")
        _untouched(dx_buf, shape)
        _close(gw, dw_ref, wtype, name + " grad_weight")
        if kind == "layer_norm":
            _close(gb, db_ref, wtype, name + " grad_bias")


@pytest.mark.parametrize("kind", ["rms_norm", "layer_norm"])
def test_backward_grid_cut_to_resident_ctas(kind):
    """More threads per SM than registers and the ring let reside: the persistent grid is cut to
    the resident CTAs (one wave of units), and the gradients still cover every row."""
    shape, eps = (777, 4096), 1e-5
    x, dy = _fresh(shape, torch.bfloat16), _fresh(shape, torch.bfloat16)
    w = (1 + 0.1 * torch.randn(shape[-1], device="cuda")).to(torch.bfloat16)
    dx = torch.full(shape, SENTINEL, dtype=torch.bfloat16, device="cuda")
    gw, gb = torch.empty_like(w), torch.empty_like(w)
    if kind == "layer_norm":
        args = LayerNormBackwardArguments(dy, x, w, dx, gw, gb, eps=eps)
    else:
        args = RMSNormBackwardArguments(dy, x, w, dx, gw, eps=eps)
    k = next(k for k in _instances(_BACKWARD[kind], args) if k.metadata.kernel_name.endswith("_block_a8"))
    k.threads_per_sm, k.stages = 2048, 5
    k.run(args)
    torch.cuda.synchronize()
    dx_ref, dw_ref, db_ref = _grads_reference(kind, dy, x, w, eps)
    _close(dx, dx_ref, torch.bfloat16, "grad_x")
    _close(gw, dw_ref, torch.bfloat16, "grad_weight")
    if kind == "layer_norm":
        _close(gb, db_ref, torch.bfloat16, "grad_bias")


# ---- through kernel_api.ops, only this provider allowed ----

@pytest.mark.parametrize("kind", ["rms_norm", "layer_norm"])
@pytest.mark.parametrize("shape", [(4, 2, 4096), (33, 1000), (2, 4097)])
@pytest.mark.parametrize("fused", [False, True])
def test_ops_forward_and_backward(kind, shape, fused):
    ops.clear_dispatch_cache()
    dtype = torch.bfloat16
    eps = 1e-5
    x = _fresh(shape, dtype).requires_grad_()
    r = _fresh(shape, dtype).requires_grad_() if fused else None
    w = (1 + 0.1 * torch.randn(shape[-1], device="cuda")).requires_grad_()
    b = torch.randn(shape[-1], device="cuda").requires_grad_()
    with kernel_api.settings(providers="cuda_src"):
        if kind == "layer_norm":
            result = ops.layer_norm(x, w, b, eps, r)
        else:
            result = ops.rms_norm(x, w, eps, r)
        y, s = result if fused else (result, None)
        dy = torch.randn_like(y)
        ds = torch.randn_like(s) if fused else None
        torch.autograd.backward([y] + ([s] if fused else []), [dy] + ([ds] if fused else []))
    torch.cuda.synchronize()
    xd = x.detach().double().requires_grad_()
    rd = r.detach().double().requires_grad_() if fused else None
    wd, bd = w.detach().double().requires_grad_(), b.detach().double().requires_grad_()
    y_ref, s_ref = _reference(kind, xd, wd, bd, eps, rd)
    _close(y.detach(), y_ref.detach(), dtype, "y")
    outs, grads = [y_ref], [dy.double()]
    if fused:
        _close(s.detach(), s_ref.detach(), dtype, "s")
        outs.append(s_ref)
        grads.append(ds.double())
    torch.autograd.backward(outs, grads)
    _close(x.grad, xd.grad, dtype, "grad x")
    # (with a residual the backward normalises s as stored, rounded to the rows' type)
    _close(w.grad, wd.grad, dtype if fused else torch.float32, "grad weight")
    if fused:
        _close(r.grad, rd.grad, dtype, "grad residual")
    if kind == "layer_norm":
        _close(b.grad, bd.grad, torch.float32, "grad bias")


def test_ops_allocating_call_chooses_this_provider():
    ops.clear_dispatch_cache()
    x = _fresh((128, 4096), torch.bfloat16)
    w = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
    args = RMSNormArguments(x, w, torch.empty_like(x))
    chosen = kernel_api.PickAny().choose(args, kernel_api.get_kernels(args))
    assert chosen.metadata.kernel_name == "CudaRMSNorm_bf16_block_a8", chosen.metadata.kernel_name
    with kernel_api.settings(providers="cuda_src"):
        y = ops.rms_norm(x, w, 1e-6)
    _close(y, _reference("rms_norm", x, w, None, 1e-6, None)[0], torch.bfloat16, "y")


def test_memcheck():
    code = r"""
import torch
from kernel_api.arguments.norm import *
from kernel_api.providers.cuda_src.kernels.norm import *
torch.manual_seed(0)
def at(rows, cols, dtype, offset):
    return torch.randn(rows * cols + offset, device="cuda").to(dtype)[offset:].view(rows, cols)
n = 0
for rows, cols, offset in ((3, 7, 1), (5, 1024, 0), (2, 4097, 0), (2, 40000, 0), (67, 2048, 0)):
    for dtype in (torch.bfloat16, torch.float32):
        x, r, dy = (at(rows, cols, dtype, offset) for _ in range(3))
        w, b = torch.randn(cols, device="cuda"), torch.randn(cols, device="cuda")
        fwd = [LayerNormArguments(x, w, b, at(rows, cols, dtype, offset), residual=r,
                                  residual_out=at(rows, cols, dtype, offset)),
               RMSNormArguments(x, w, at(rows, cols, dtype, offset))]
        bwd = [LayerNormBackwardArguments(dy, x, w, at(rows, cols, dtype, offset), torch.empty_like(w),
                                          torch.empty_like(w)),
               RMSNormBackwardArguments(dy, x, w, at(rows, cols, dtype, offset), torch.empty_like(w))]
        for cls, cases in ((CudaLayerNorm, fwd[:1]), (CudaRMSNorm, fwd[1:]), (CudaLayerNormBackward, bwd[:1]),
                           (CudaRMSNormBackward, bwd[1:])):
            for args in cases:
                for k in cls.generate_kernels(None, cc=90):
                    if k.supports(args):
                        k.run(args); n += 1
torch.cuda.synchronize()
print("launched", n)
"""
    out = run_memcheck(code)
    assert "launched" in out


def test_memcheck_default_block_rows():
    """One forward (the residual form) and one backward of the shipped bf16 block rows under
    memcheck, at a row count that leaves the backward's units uneven."""
    code = r"""
import torch
from kernel_api.arguments.norm import *
from kernel_api.providers.cuda_src.kernels.norm import *
torch.manual_seed(0)
rows, cols = 1001, 4096
x, r, dy, y, s, dx = (torch.randn(rows, cols, device="cuda").to(torch.bfloat16) for _ in range(6))
w = torch.randn(cols, device="cuda").to(torch.bfloat16)
def byname(cls):
    return next(k for k in cls.generate_kernels(None, cc=90) if k.metadata.kernel_name.endswith("_bf16_block_a8"))
byname(CudaRMSNorm).run(RMSNormArguments(x, w, y, residual=r, residual_out=s))
byname(CudaRMSNormBackward).run(RMSNormBackwardArguments(dy, x, w, dx, torch.empty_like(w)))
torch.cuda.synchronize()
print("launched", 2)
"""
    assert "launched" in run_memcheck(code)
