"""RMSNorm and LayerNorm on CUDA: `kernel_api.ops` against float64 references (outputs in
sentinel-filled buffers, odd row lengths, 3-D inputs, the fused residual form), gradients
through the generated ops, and torch.compile(fullgraph=True). The CPU half is
tests/test_norm_ops.py, whose references these reuse.
"""

from __future__ import annotations

import pytest
import torch

from kernel_api import ops

from test_norm_ops import SENTINEL, TOL, reference, run

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("kind", ["rms_norm", "layer_norm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(5, 1), (3, 7), (2, 4097), (2, 3, 7), (512, 4096)])
@pytest.mark.parametrize("fused", [False, True])
def test_forward_against_float64(kind, dtype, shape, fused):
    ops.clear_dispatch_cache()
    x = torch.randn(shape, device="cuda").to(dtype)
    w = (1 + 0.1 * torch.randn(shape[-1], device="cuda")).to(dtype)
    b = torch.randn(shape[-1], device="cuda").to(dtype)
    r = torch.randn(shape, device="cuda").to(dtype) if fused else None
    out = torch.full(shape, SENTINEL, dtype=dtype, device="cuda")
    r_out = torch.full(shape, SENTINEL, dtype=dtype, device="cuda") if fused else None
    result = run(kind, x, w, b, 1e-5, r, out=out, residual_out=r_out)
    torch.cuda.synchronize()
    y_ref, s_ref = reference(kind, x, w, b, 1e-5, r)
    if fused:
        assert result[1] is r_out
        torch.testing.assert_close(r_out.double(), s_ref, **TOL[dtype])
    torch.testing.assert_close(out.double(), y_ref, **TOL[dtype])


@pytest.mark.parametrize("kind", ["rms_norm", "layer_norm"])
@pytest.mark.parametrize("fused", [False, True])
def test_gradcheck(kind, fused):
    f64 = dict(dtype=torch.float64, device="cuda", requires_grad=True)
    x, w, b = torch.randn(3, 7, **f64), torch.randn(7, **f64), torch.randn(7, **f64)
    r = torch.randn(3, 7, **f64) if fused else None
    if kind == "layer_norm":
        inputs = (x, w, b) + ((r,) if fused else ())
        assert torch.autograd.gradcheck(lambda x, w, b, *r: ops.layer_norm(x, w, b, 1e-5, *r), inputs)
    else:
        inputs = (x, w) + ((r,) if fused else ())
        assert torch.autograd.gradcheck(lambda x, w, *r: ops.rms_norm(x, w, 1e-6, *r), inputs)


def test_torch_compile_fullgraph():
    torch._dynamo.reset()

    def block(x, r, w, b):
        y, s = ops.rms_norm(x, w, 1e-6, r)
        return ops.layer_norm(y, w, b), s

    x, r = torch.randn(64, 4097, device="cuda", dtype=torch.bfloat16), torch.randn(64, 4097, device="cuda",
                                                                                 dtype=torch.bfloat16)
    w, b = torch.randn(4097, device="cuda", dtype=torch.bfloat16), torch.randn(4097, device="cuda", dtype=torch.bfloat16)
    compiled = torch.compile(block, fullgraph=True)
    y, s = compiled(x, r, w, b)
    y_ref, s_ref = reference("rms_norm", x, w, None, 1e-6, r)
    z_ref, _ = reference("layer_norm", y_ref.to(torch.bfloat16), w, b, 1e-5)
    torch.testing.assert_close(s.double(), s_ref, **TOL[torch.bfloat16])
    torch.testing.assert_close(y.double(), z_ref, atol=5e-2, rtol=5e-2)
