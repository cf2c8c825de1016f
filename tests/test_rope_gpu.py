"""RoPE on CUDA: every CUDA source instance through `Kernel.run` and `kernel_api.ops.rope`
restricted to the cuda_src provider, against float64 references on fresh random data, outputs
inside sentinel-filled buffers: transformers' transposed q/k views, contiguous and (batch, seq,
heads, head_dim) layouts, GQA, cos/sin broadcast over the batch, odd head counts and lengths,
misaligned views, forward and backward, and torch.compile(fullgraph=True). The CPU half is
tests/test_rope.py, whose references these reuse.
"""

from __future__ import annotations

import pytest
import torch

import kernel_api
from kernel_api import ops
from kernel_api.arguments import RopeArguments, RopeBackwardArguments

from memcheck import run_memcheck
from test_rope import SENTINEL, TOL, make_tables, reference, reference_backward

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _heads(b, h, s, d, dtype, layout, g, offset=0):
    """(b, h, s, d) q-like input: "hf" transposed from (b, s, h, d) memory, "dense", or
    "offset" (contiguous, ``offset`` elements past an aligned pointer)."""
    if layout == "hf":
        return torch.randn(b, s, h, d, generator=g, device="cuda").to(dtype).transpose(1, 2)
    n = b * h * s * d
    flat = torch.randn(n + offset, generator=g, device="cuda").to(dtype)
    return flat[offset:].view(b, h, s, d)


def _framed_like(t, offset):
    """A sentinel-filled buffer and a view inside it with ``t``'s shape and memory order."""
    n = t.numel()
    buf = torch.full((n + offset + 64,), SENTINEL, dtype=t.dtype, device="cuda")
    view = torch.empty_like(t)
    return buf, buf[offset:offset + n].as_strided(view.shape, view.stride())


def _check_frame(buf, n, offset):
    assert torch.all(buf[:offset] == SENTINEL) and torch.all(buf[offset + n:] == SENTINEL)


CASES = [(1, 1, 1, 1, 2, "dense"), (2, 4, 2, 5, 128, "hf"), (3, 5, 3, 7, 64, "hf"), (2, 3, 1, 9, 128, "dense"),
         (1, 2, 2, 3, 96, "offset"), (2, 32, 8, 33, 128, "hf"), (1, 3, 1, 4, 10, "dense"), (4, 8, 8, 64, 80, "hf")]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("table_batch", [1, "batch"])
def test_every_cuda_instance_forward_and_backward(dtype, case, table_batch):
    b, hq, hk, s, d, layout = CASES[case]
    g = torch.Generator(device="cuda").manual_seed(case * 7 + (table_batch == 1))
    offset = 1 if layout == "offset" else 0
    q, k = _heads(b, hq, s, d, dtype, layout, g, offset), _heads(b, hk, s, d, dtype, layout, g, offset)
    cos, sin = make_tables(b if table_batch == "batch" else 1, s, d, device="cuda", dtype=dtype)
    want_q, want_k = reference(q, k, cos, sin)
    for cls, want in ((RopeArguments, (want_q, want_k)), (RopeBackwardArguments, reference_backward(q, k, cos, sin))):
        kernels = [kn for kn in kernel_api.get_kernels(cls(q, k, cos, sin, torch.empty_like(q), torch.empty_like(k)))
                   if kn.name.startswith("Cuda")]
        assert kernels
        for kernel in kernels:
            (bq, qo), (bk, ko) = _framed_like(q, offset), _framed_like(k, offset)
            kernel.run(cls(q, k, cos, sin, qo, ko))
            torch.cuda.synchronize()
            _check_frame(bq, q.numel(), offset)
            _check_frame(bk, k.numel(), offset)
            torch.testing.assert_close(qo.double(), want[0], **TOL[dtype], msg=lambda m: f"{kernel.name} q: {m}")
            torch.testing.assert_close(ko.double(), want[1], **TOL[dtype], msg=lambda m: f"{kernel.name} k: {m}")


def test_instances_by_alignment():
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k = _heads(2, 4, 8, 128, torch.bfloat16, "hf", g), _heads(2, 2, 8, 128, torch.bfloat16, "hf", g)
    cos, sin = make_tables(1, 8, 128, device="cuda", dtype=torch.bfloat16)
    names = [kn.name for kn in kernel_api.get_kernels(RopeArguments(q, k, cos, sin, torch.empty_like(q),
                                                                    torch.empty_like(k)))]
    assert "CudaRope_bf16_v8" in names
    q1 = _heads(1, 2, 3, 96, torch.bfloat16, "offset", g, 1)
    k1 = _heads(1, 2, 3, 96, torch.bfloat16, "dense", g)
    cos, sin = make_tables(1, 3, 96, device="cuda", dtype=torch.bfloat16)
    names = [kn.name for kn in kernel_api.get_kernels(RopeArguments(q1, k1, cos, sin, torch.empty_like(q1),
                                                                    torch.empty_like(k1)))]
    assert "CudaRope_bf16_v1" in names and "CudaRope_bf16_v8" not in names


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("unsqueeze_dim", [1, 2])
def test_ops_forced_to_cuda_src_forward_and_backward(dtype, unsqueeze_dim):
    ops.clear_dispatch_cache()
    g = torch.Generator(device="cuda").manual_seed(unsqueeze_dim)
    q = _heads(2, 8, 17, 64, dtype, "hf", g)
    k = _heads(2, 2, 17, 64, dtype, "hf", g)
    if unsqueeze_dim == 2:
        q, k = q.transpose(1, 2), k.transpose(1, 2)
    q, k = q.detach().requires_grad_(), k.detach().requires_grad_()
    cos, sin = make_tables(1, 17, 64, device="cuda", dtype=dtype)
    with kernel_api.settings(providers="cuda_src"):
        qo, ko = ops.rope(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)
        dq_out, dk_out = torch.randn_like(qo), torch.randn_like(ko)
        torch.autograd.backward((qo, ko), (dq_out, dk_out))
    torch.cuda.synchronize()
    want = reference(q.detach(), k.detach(), cos, sin, unsqueeze_dim)
    torch.testing.assert_close(qo.detach().double(), want[0], **TOL[dtype])
    torch.testing.assert_close(ko.detach().double(), want[1], **TOL[dtype])
    assert qo.stride() == q.stride()  # q's memory order kept
    want_g = reference_backward(dq_out, dk_out, cos, sin, unsqueeze_dim)
    torch.testing.assert_close(q.grad.double(), want_g[0], **TOL[dtype])
    torch.testing.assert_close(k.grad.double(), want_g[1], **TOL[dtype])


def test_position_ids_gather_the_tables():
    g = torch.Generator(device="cuda").manual_seed(3)
    q, k = _heads(2, 4, 6, 32, torch.float32, "hf", g), _heads(2, 2, 6, 32, torch.float32, "hf", g)
    cos, sin = make_tables(1, 40, 32, device="cuda", dtype=torch.float32)
    pos = torch.randint(0, 40, (2, 6), device="cuda")
    qo, ko = ops.rope(q, k, cos[0], sin[0], position_ids=pos)
    want = reference(q, k, cos[0][pos], sin[0][pos])
    torch.testing.assert_close(qo.double(), want[0], **TOL[torch.float32])
    torch.testing.assert_close(ko.double(), want[1], **TOL[torch.float32])


def test_gradcheck_f64_on_cuda():
    f64 = dict(dtype=torch.float64, device="cuda")
    q = torch.randn(1, 2, 3, 4, **f64, requires_grad=True)
    k = torch.randn(1, 1, 3, 4, **f64, requires_grad=True)
    cos, sin = make_tables(1, 3, 4, device="cuda", dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda q, k: ops.rope(q, k, cos, sin), (q, k))


def test_torch_compile_fullgraph():
    torch._dynamo.reset()
    g = torch.Generator(device="cuda").manual_seed(4)
    q, k = _heads(2, 8, 16, 128, torch.bfloat16, "hf", g), _heads(2, 2, 16, 128, torch.bfloat16, "hf", g)
    cos, sin = make_tables(1, 16, 128, device="cuda", dtype=torch.bfloat16)

    def f(q, k, cos, sin):
        qo, ko = ops.rope(q, k, cos, sin)
        return qo * 2, ko

    qo, ko = torch.compile(f, fullgraph=True)(q, k, cos, sin)
    want = reference(q, k, cos, sin)
    torch.testing.assert_close(qo.double(), 2 * want[0], atol=5e-2, rtol=5e-2)
    torch.testing.assert_close(ko.double(), want[1], **TOL[torch.bfloat16])


def test_memcheck():
    """Every CUDA instance, forward and backward, on transposed, misaligned and odd-sized q and
    k, under compute-sanitizer memcheck (each tensor its own allocation)."""
    code = r"""
import torch
import kernel_api
from kernel_api.arguments import RopeArguments, RopeBackwardArguments
torch.manual_seed(0)
def at(b, h, s, d, dtype, offset, transposed):
    if transposed:
        return torch.randn(b * s * h * d + offset, device="cuda").to(dtype)[offset:].view(b, s, h, d).transpose(1, 2)
    return torch.randn(b * h * s * d + offset, device="cuda").to(dtype)[offset:].view(b, h, s, d)
n = 0
for b, hq, hk, s, d, offset, transposed in ((1, 1, 1, 1, 2, 0, False), (2, 5, 3, 7, 64, 0, True),
                                            (1, 2, 2, 3, 96, 1, False), (2, 4, 1, 9, 128, 0, True)):
    for dtype in (torch.bfloat16, torch.float32):
        q, k = at(b, hq, s, d, dtype, offset, transposed), at(b, hk, s, d, dtype, offset, transposed)
        cos = torch.randn(s * d + offset, device="cuda").to(dtype)[offset:].view(1, s, d)
        sin = torch.randn(s * d + offset, device="cuda").to(dtype)[offset:].view(1, s, d)
        for cls in (RopeArguments, RopeBackwardArguments):
            args = cls(q, k, cos, sin, at(b, hq, s, d, dtype, offset, transposed), at(b, hk, s, d, dtype, offset, transposed))
            for kn in kernel_api.get_kernels(args):
                if kn.name.startswith("Cuda"):
                    kn.run(args); n += 1
torch.cuda.synchronize()
print("runs", n)
"""
    out = run_memcheck(code)
    assert "runs " in out and int(out.split("runs ")[1].split()[0]) > 10
