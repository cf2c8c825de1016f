"""SwiGLU and GeGLU on CUDA: every CUDA source instance through `Kernel.run` and the operations
through `kernel_api.ops` restricted to the cuda_src provider, against float64 references on
fresh random data, outputs inside sentinel-filled buffers (odd sizes, chunked halves of a fused
projection, misaligned views, batched), gradients through the generated ops, and
torch.compile(fullgraph=True). The CPU half is tests/test_swiglu.py, whose references these reuse.
"""

from __future__ import annotations

import pytest
import torch

import kernel_api
from kernel_api import ops
from kernel_api.arguments import GatedActivationArguments, GatedActivationBackwardArguments

from memcheck import run_memcheck
from test_swiglu import SENTINEL, TOL, reference, reference_grads

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

ACTIVATIONS = ("silu", "gelu_tanh", "gelu")


def _framed(shape, dtype, offset=0):
    """A sentinel-filled buffer and the view of ``shape`` inside it, ``offset`` elements in."""
    n = 1
    for s in shape:
        n *= s
    buf = torch.full((n + offset + 64,), SENTINEL, dtype=dtype, device="cuda")
    return buf, buf[offset:offset + n].view(shape)


def _check_frame(buf, view, offset):
    n = view.numel()
    assert torch.all(buf[:offset] == SENTINEL) and torch.all(buf[offset + n:] == SENTINEL)


def _operands(shape, dtype, layout, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    if layout == "chunked":  # the halves of a fused gate/up projection: rows 2 * cols apart
        x = torch.randn(*shape[:-1], 2 * shape[-1], generator=g, device="cuda").mul_(3).to(dtype)
        return x.chunk(2, dim=-1)
    if layout == "offset":  # one element past an aligned pointer
        flat = torch.randn(torch.Size(shape).numel() * 2 + 2, generator=g, device="cuda").mul_(3).to(dtype)
        n = torch.Size(shape).numel()
        return flat[1:1 + n].view(shape), flat[n + 1:2 * n + 1].view(shape)
    gate = torch.randn(shape, generator=g, device="cuda").mul_(3).to(dtype)
    return gate, torch.randn(shape, generator=g, device="cuda").to(dtype)


CASES = [((1,), "dense"), ((7,), "dense"), ((3, 13), "dense"), ((5, 1000), "dense"), ((2, 3, 4097), "dense"),
         ((64, 1408), "chunked"), ((9, 11), "chunked"), ((33, 64), "offset"), ((2, 5, 17), "offset"),
         ((1024, 4096), "dense")]


def _cuda_kernels(args):
    found = [k for k in kernel_api.get_kernels(args) if k.name.startswith("Cuda")]
    assert found, str(kernel_api.explain(args))
    return found


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("case", range(len(CASES)))
def test_every_cuda_instance_forward_and_backward(dtype, activation, case):
    shape, layout = CASES[case]
    gate, up = _operands(shape, dtype, layout, seed=case * 31 + len(activation))
    offset = 3 if layout == "offset" else 0
    want = reference(gate, up, activation)
    dy = torch.randn(shape, device="cuda").to(dtype)
    want_dg, want_du = reference_grads(dy, gate, up, activation)
    for kernel in _cuda_kernels(GatedActivationArguments(gate, up, torch.empty_like(gate), activation=activation)):
        buf, out = _framed(shape, dtype, offset)
        kernel.run(GatedActivationArguments(gate, up, out, activation=activation))
        torch.cuda.synchronize()
        _check_frame(buf, out, offset)
        torch.testing.assert_close(out.double(), want, **TOL[dtype], msg=lambda m: f"{kernel.name}: {m}")
    bargs = GatedActivationBackwardArguments(dy, gate, up, torch.empty_like(gate), torch.empty_like(up),
                                             activation=activation)
    for kernel in _cuda_kernels(bargs):
        (bg, dg), (bu, du) = _framed(shape, dtype, offset), _framed(shape, dtype, offset)
        kernel.run(GatedActivationBackwardArguments(dy, gate, up, dg, du, activation=activation))
        torch.cuda.synchronize()
        _check_frame(bg, dg, offset)
        _check_frame(bu, du, offset)
        torch.testing.assert_close(dg.double(), want_dg, **TOL[dtype], msg=lambda m: f"{kernel.name} dg: {m}")
        torch.testing.assert_close(du.double(), want_du, **TOL[dtype], msg=lambda m: f"{kernel.name} du: {m}")


def test_aligned_operands_get_the_vector_instance():
    gate, up = _operands((64, 1408), torch.bfloat16, "chunked", 0)
    args = GatedActivationArguments(gate, up, torch.empty_like(gate))
    names = [k.name for k in _cuda_kernels(args)]
    assert "CudaGatedActivation_bf16_v8" in names
    gate, up = _operands((33, 64), torch.bfloat16, "offset", 0)
    names = [k.name for k in _cuda_kernels(GatedActivationArguments(gate, up, torch.empty_like(gate)))]
    assert names == ["CudaGatedActivation_bf16_v1"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("layout", ["dense", "chunked"])
def test_ops_forced_to_cuda_src_forward_and_backward(dtype, layout):
    ops.clear_dispatch_cache()
    gate, up = _operands((4, 77, 96), dtype, layout, seed=5)
    gate, up = gate.detach().requires_grad_(), up.detach().requires_grad_()
    dy = torch.randn(gate.shape, device="cuda").to(dtype)
    with kernel_api.settings(providers="cuda_src"):
        for name, fn in (("silu", lambda g, u: ops.swiglu(g, u)), ("gelu_tanh", lambda g, u: ops.geglu(g, u)),
                         ("gelu", lambda g, u: ops.geglu(g, u, approximate="none"))):
            gate.grad = up.grad = None
            y = fn(gate, up)
            y.backward(dy)
            torch.cuda.synchronize()
            torch.testing.assert_close(y.detach().double(), reference(gate, up, name), **TOL[dtype])
            want_dg, want_du = reference_grads(dy, gate.detach(), up.detach(), name)
            torch.testing.assert_close(gate.grad.double(), want_dg, **TOL[dtype])
            torch.testing.assert_close(up.grad.double(), want_du, **TOL[dtype])
        out = torch.full(gate.shape, SENTINEL, dtype=dtype, device="cuda")
        with torch.no_grad():
            assert ops.swiglu(gate, up, out=out) is out
        torch.testing.assert_close(out.double(), reference(gate, up, "silu"), **TOL[dtype])


def test_gradcheck_f64_on_cuda():
    f64 = dict(dtype=torch.float64, device="cuda", requires_grad=True)
    g, u = torch.randn(3, 7, **f64), torch.randn(3, 7, **f64)
    assert torch.autograd.gradcheck(lambda g, u: ops.swiglu(g, u), (g, u))
    assert torch.autograd.gradcheck(lambda g, u: ops.geglu(g, u, "none"), (g, u))


def test_torch_compile_fullgraph_mlp():
    torch._dynamo.reset()

    def mlp(x, w):
        gate, up = (x @ w).chunk(2, dim=-1)
        return ops.swiglu(gate, up)

    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(256, 2 * 352, device="cuda", dtype=torch.bfloat16) / 16
    y = torch.compile(mlp, fullgraph=True)(x, w)
    gate, up = (x @ w).chunk(2, dim=-1)
    torch.testing.assert_close(y.double(), reference(gate, up, "silu"), atol=5e-2, rtol=5e-2)


def test_memcheck():
    """Every CUDA instance, forward and backward, on row tails, chunked halves and misaligned
    operands, under compute-sanitizer memcheck (each tensor its own allocation)."""
    code = r"""
import torch
import kernel_api
from kernel_api.arguments import GatedActivationArguments, GatedActivationBackwardArguments
torch.manual_seed(0)
def at(shape, dtype, offset):
    n = 1
    for s in shape:
        n *= s
    return torch.randn(n + offset, device="cuda").to(dtype)[offset:].view(shape)
n = 0
for shape, offset in (((7,), 0), ((3, 13), 1), ((5, 1000), 0), ((2, 3, 4097), 3)):
    for dtype in (torch.bfloat16, torch.float32):
        for activation in ("silu", "gelu_tanh", "gelu"):
            g, u, dy = (at(shape, dtype, offset) for _ in range(3))
            x = at((*shape[:-1], 2 * shape[-1]), dtype, 0)
            for gate, up in ((g, u), x.chunk(2, -1)):
                fwd = GatedActivationArguments(gate, up, at(shape, dtype, offset), activation=activation)
                bwd = GatedActivationBackwardArguments(dy, gate, up, at(shape, dtype, offset), at(shape, dtype, offset),
                                                       activation=activation)
                for args in (fwd, bwd):
                    for k in kernel_api.get_kernels(args):
                        if k.name.startswith("Cuda"):
                            k.run(args); n += 1
torch.cuda.synchronize()
print("runs", n)
"""
    out = run_memcheck(code)
    assert "runs " in out and int(out.split("runs ")[1].split()[0]) > 50
