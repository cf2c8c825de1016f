"""RMSNorm and LayerNorm on the CPU: the arguments' refusals, discovery and explain, the
torch provider's kernels through `kernel_api.ops` (the tests add "cpu" to
`dispatch.LAUNCH_DEVICE_TYPES`) against float64 references written here, gradients through
the generated ops, and tracing. tests/test_norm_ops_gpu.py runs the same on CUDA.
"""

from __future__ import annotations

import pytest
import torch

import kernel_api
from kernel_api import (LayerNormArguments, LayerNormBackwardArguments, RMSNormArguments, RMSNormBackwardArguments,
                        TensorAttributes, ops)
from kernel_api.metadata.norm import RMSNormOperandsMetadata

SENTINEL = 1234.5
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3),
       torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2), torch.float64: dict(atol=1e-12, rtol=1e-12)}


def reference(kind, x, weight, bias=None, eps=1e-6, residual=None):
    """(y, s) in float64: s = x (+ residual), y the norm of s."""
    s = x.double() + (residual.double() if residual is not None else 0)
    if kind == "layer_norm":
        c = s - s.mean(-1, keepdim=True)
        y = c / torch.sqrt(c.square().mean(-1, keepdim=True) + eps) * weight.double() + bias.double()
    else:
        y = s / torch.sqrt(s.square().mean(-1, keepdim=True) + eps) * weight.double()
    return y, s


def run(kind, x, weight, bias, eps, residual=None, out=None, residual_out=None):
    if kind == "layer_norm":
        return ops.layer_norm(x, weight, bias, eps, residual, out=out, residual_out=residual_out)
    return ops.rms_norm(x, weight, eps, residual, out=out, residual_out=residual_out)


# ---- refusals: one line, naming the operand ----

def _bad_cases():
    x, w = torch.randn(4, 8), torch.randn(8)
    out = torch.empty(4, 8)
    return [
        (lambda: RMSNormArguments([1.0], w, out), TypeError, "operand x: expected a torch.Tensor"),
        (lambda: RMSNormArguments(torch.tensor(1.0), w, torch.tensor(1.0)), ValueError, "operand x: a norm needs"),
        (lambda: RMSNormArguments(torch.randn(8, 4).t(), w, out), ValueError, "operand x: the last dimension must have stride 1"),
        (lambda: RMSNormArguments(torch.randn(4, 3, 8)[:, :2].transpose(0, 1), w, torch.empty(2, 4, 8)),
         ValueError, "operand x: rows of shape (2, 4, 8)"),
        (lambda: RMSNormArguments(torch._neg_view(x), w, out), ValueError, "operand x: has torch's lazy negative bit"),
        (lambda: RMSNormArguments(x, torch.randn(7), out), ValueError, "operand weight: shape (7,) must be (8,)"),
        (lambda: RMSNormArguments(x, torch.randn(1, 8), out), ValueError, "operand weight: shape (1, 8)"),
        (lambda: RMSNormArguments(x, torch.randn(16)[::2], out), ValueError, "operand weight: must have stride 1"),
        (lambda: RMSNormArguments(x, torch.randn(8, device="meta"), out), ValueError, "operand weight: on meta"),
        (lambda: RMSNormArguments(x, w, torch.empty(4, 7)), ValueError, "operand out: shape (4, 7) must equal x's"),
        (lambda: RMSNormArguments(x, w, torch.empty(4, 8, dtype=torch.float64)), TypeError, "operand out: dtype"),
        (lambda: RMSNormArguments(x, w, out, residual=x.clone()), ValueError, "operand residual_out: required with residual"),
        (lambda: RMSNormArguments(x, w, out, residual_out=x.clone()), ValueError, "operand residual: required with residual_out"),
        (lambda: RMSNormArguments(x, w, out, residual=torch.randn(2, 8), residual_out=torch.empty(4, 8)),
         ValueError, "operand residual: shape (2, 8) must equal x's"),
        (lambda: RMSNormArguments(x, w, out, residual=x.half(), residual_out=torch.empty(4, 8)),
         TypeError, "operand residual: dtype torch.float16"),
        (lambda: RMSNormArguments(x, w, out, residual=x.clone(), residual_out=torch.empty(4, 9)),
         ValueError, "operand residual_out: shape (4, 9)"),
        (lambda: RMSNormArguments(x, w, out, eps=-1.0), ValueError, "eps: expected a finite float >= 0"),
        (lambda: RMSNormArguments(x, w, out, eps=float("nan")), ValueError, "eps: expected a finite float"),
        (lambda: RMSNormArguments(x.to(torch.complex64), w, out), TypeError, "operand x: dtype torch.complex64"),
        (lambda: LayerNormArguments(x, w, None, out), TypeError, "operand bias: expected a torch.Tensor"),
        (lambda: LayerNormArguments(x, w, w.double(), out), TypeError, "operand bias: dtype torch.float64 must equal weight's"),
        (lambda: LayerNormArguments(x, w, torch.randn(9), out), ValueError, "operand bias: shape (9,)"),
        (lambda: RMSNormBackwardArguments(torch.randn(4, 7), x, w, out, w.clone()), ValueError, "operand grad_out: shape"),
        (lambda: RMSNormBackwardArguments(x, x, w, out, w.double()), TypeError, "operand grad_weight: dtype"),
        (lambda: RMSNormBackwardArguments(x, x, w, out, None), TypeError, "operand grad_weight: expected"),
        (lambda: LayerNormBackwardArguments(x, x, w, out, w.clone(), torch.randn(3)), ValueError, "operand grad_bias: shape"),
    ]


@pytest.mark.parametrize("case", range(len(_bad_cases())))
def test_refusals_name_the_operand_in_one_line(case):
    build, error, text = _bad_cases()[case]
    with pytest.raises(error) as info:
        build()
    message = str(info.value)
    assert text in message and "\n" not in message


def test_outputs_overlapping_inputs_are_refused_by_check_memory_and_ops(cpu_ops):
    x, w = torch.randn(4, 8), torch.randn(8)
    with pytest.raises(ValueError, match="operand out: overlaps x"):
        RMSNormArguments(x, w, x).check_memory()
    r = torch.randn(4, 8)
    with pytest.raises(ValueError, match="operand residual_out: overlaps x"):
        RMSNormArguments(x, w, torch.empty(4, 8), residual=r, residual_out=x).check_memory()
    same = torch.empty(4, 8)
    with pytest.raises(ValueError, match="operand out: overlaps residual_out"):
        RMSNormArguments(x, w, same, residual=r, residual_out=same).check_memory()
    with pytest.raises(ValueError, match="operand out: overlaps x"):
        ops.rms_norm(x, w, out=x)
    with pytest.raises(ValueError, match="operand residual_out: given without residual"):
        ops.layer_norm(x, w, w, residual_out=r)
    RMSNormArguments(x, w, torch.empty(4, 8), residual=r, residual_out=torch.empty(4, 8)).check_memory()


# ---- the arguments' summary, discovery and explain ----

def test_summary_output_names_problem_key_and_repr():
    x, w = torch.randn(2, 3, 7), torch.randn(7)
    plain = RMSNormArguments(x, w, torch.empty_like(x))
    fused = RMSNormArguments(x, w, torch.empty_like(x), residual=torch.randn_like(x), residual_out=torch.empty_like(x))
    assert (plain.rows, plain.cols) == (6, 7)
    assert type(plain).output_names == ("out",) and type(fused).output_names == ("out", "residual_out")
    assert isinstance(fused, RMSNormArguments)
    assert list(fused.tensor_attributes) == ["x", "residual", "weight", "out", "residual_out"]
    assert plain.tensor_attributes["x"].stride == (0, 1) and plain.tensor_attributes["weight"].stride == (1,)
    assert plain.problem_key() != fused.problem_key()
    assert plain.problem_key() == RMSNormArguments(x.clone(), w, torch.empty_like(x)).problem_key()
    assert plain.problem_key() != RMSNormArguments(x[:1], w, torch.empty(1, 3, 7)).problem_key()
    assert repr(fused) == "RMSNormArguments(rows=6, cols=7, dtype=f32, weight=f32, eps=1e-06, residual, device=cpu)"
    ln = LayerNormArguments(x, w, w, torch.empty_like(x))
    assert repr(ln) == "LayerNormArguments(rows=6, cols=7, dtype=f32, weight=f32, eps=1e-05, device=cpu)"
    assert type(LayerNormBackwardArguments(x, x, w, x.clone(), w.clone(), w.clone())).output_names == (
        "grad_x", "grad_weight", "grad_bias")


@pytest.mark.parametrize("dtype, wdtype, name", [
    (torch.bfloat16, torch.bfloat16, "TorchRMSNorm_bf16"), (torch.bfloat16, torch.float32, "TorchRMSNorm_bf16_wf32"),
    (torch.float16, torch.float32, "TorchRMSNorm_f16_wf32"), (torch.float64, torch.float64, "TorchRMSNorm_f64")])
def test_discovery_by_dtypes(dtype, wdtype, name):
    x = torch.randn(3, 4097, dtype=dtype)
    args = RMSNormArguments(x, torch.randn(4097, dtype=wdtype), torch.empty_like(x))
    assert [k.name for k in kernel_api.get_kernels(args)] == [name]
    lx = LayerNormArguments(x, torch.randn(4097, dtype=wdtype), torch.randn(4097, dtype=wdtype), torch.empty_like(x))
    assert [k.name for k in kernel_api.get_kernels(lx)] == [name.replace("RMSNorm", "LayerNorm")]
    grads = RMSNormBackwardArguments(x, x, torch.randn(4097, dtype=wdtype), torch.empty_like(x),
                                     torch.empty(4097, dtype=wdtype))
    assert [k.name for k in kernel_api.get_kernels(grads)] == [name.replace("RMSNorm", "RMSNormBackward")]


def test_explain_says_why_no_kernel_takes_the_arguments():
    x = torch.randn(2, 8, dtype=torch.float16)
    args = RMSNormArguments(x, torch.randn(8, dtype=torch.float64), torch.empty_like(x))
    assert kernel_api.get_kernels(args) == []
    text = str(kernel_api.explain(args))
    assert "torch/TorchRMSNorm" in text and "weight" in text
    # the torch provider's f16-row instances miss on the weight's dtype alone, and say so
    assert "needs weight f16/f32" in str(kernel_api.explain(args, providers=["torch"]))
    assert "no kernel supports RMSNormArguments" in str(kernel_api.registry.no_kernel_error(args))


def test_metadata_bounds_the_row_length_and_the_fused_residual():
    rows, vector = TensorAttributes("f32", (0, 1), 1), TensorAttributes("f32", (1,), 1)
    bounded = RMSNormOperandsMetadata(rows, vector, rows, max_cols=1024, residual=False)
    x = torch.randn(2, 4097)
    status = bounded.supports(RMSNormArguments(x, torch.randn(4097), torch.empty_like(x)))
    assert not status and status.error == "operand x: rows of 4097 elements but the kernel takes at most 1024"
    x = torch.randn(2, 64)
    fused = RMSNormArguments(x, torch.randn(64), torch.empty_like(x), residual=x.clone(), residual_out=torch.empty_like(x))
    status = bounded.supports(fused)
    assert not status and "operand residual" in status.error
    assert bounded.supports(RMSNormArguments(x, torch.randn(64), torch.empty_like(x)))
    assert "max_cols=1024" in repr(bounded)


# ---- the operations on CPU tensors against float64 ----

@pytest.mark.parametrize("kind", ["rms_norm", "layer_norm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(5, 1), (3, 7), (2, 4097), (2, 3, 7)])
@pytest.mark.parametrize("fused", [False, True])
def test_forward_against_float64(cpu_ops, kind, dtype, shape, fused):
    g = torch.Generator().manual_seed(sum(shape) + len(kind))
    x = torch.randn(shape, generator=g).to(dtype)
    w = (1 + 0.1 * torch.randn(shape[-1], generator=g)).to(dtype)
    b = torch.randn(shape[-1], generator=g).to(dtype)
    r = torch.randn(shape, generator=g).to(dtype) if fused else None
    eps = 1e-5
    out = torch.full(shape, SENTINEL, dtype=dtype)
    r_out = torch.full(shape, SENTINEL, dtype=dtype) if fused else None
    result = run(kind, x, w, b, eps, r, out=out, residual_out=r_out)
    y_ref, s_ref = reference(kind, x, w, b, eps, r)
    if fused:
        assert result[0] is out and result[1] is r_out
        torch.testing.assert_close(r_out.double(), s_ref, **TOL[dtype])
    else:
        assert result is out
    torch.testing.assert_close(out.double(), y_ref, **TOL[dtype])


@pytest.mark.parametrize("kind", ["rms_norm", "layer_norm"])
def test_allocating_calls_and_f32_weights(cpu_ops, kind):
    x = torch.randn(4, 33, dtype=torch.bfloat16)
    w, b = torch.randn(33), torch.randn(33)
    y = run(kind, x, w, b, 1e-6)
    assert y.dtype == torch.bfloat16 and y.shape == x.shape
    torch.testing.assert_close(y.double(), reference(kind, x, w, b, 1e-6)[0], **TOL[torch.bfloat16])


@pytest.mark.parametrize("kind", ["rms_norm", "layer_norm"])
@pytest.mark.parametrize("shape", [(3, 7), (2, 3, 4097)])
def test_backward_ops_against_float64_autograd(cpu_ops, kind, shape):
    x = torch.randn(shape, dtype=torch.float64, requires_grad=True)
    w = torch.randn(shape[-1], dtype=torch.float64, requires_grad=True)
    b = torch.randn(shape[-1], dtype=torch.float64, requires_grad=True)
    dy = torch.randn(shape, dtype=torch.float64)
    y, _ = reference(kind, x, w, b, 1e-5)
    expected = torch.autograd.grad(y, (x, w, b) if kind == "layer_norm" else (x, w), dy)
    xf, wf, dyf = x.detach().float(), w.detach().float(), dy.float()
    if kind == "layer_norm":
        got = ops.layer_norm_backward(dyf, xf, wf, 1e-5, grad_x=torch.full(shape, SENTINEL))
    else:
        got = ops.rms_norm_backward(dyf, xf, wf, 1e-5)
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g.double(), e, atol=2e-4, rtol=2e-4)


# ---- gradients through the generated ops ----

@pytest.mark.parametrize("fused", [False, True])
def test_gradcheck_rms_norm(cpu_ops, fused):
    x = torch.randn(3, 7, dtype=torch.float64, requires_grad=True)
    w = torch.randn(7, dtype=torch.float64, requires_grad=True)
    if fused:
        r = torch.randn(3, 7, dtype=torch.float64, requires_grad=True)
        assert torch.autograd.gradcheck(lambda x, w, r: ops.rms_norm(x, w, 1e-6, r), (x, w, r))
    else:
        assert torch.autograd.gradcheck(lambda x, w: ops.rms_norm(x, w, 1e-6), (x, w))


@pytest.mark.parametrize("fused", [False, True])
def test_gradcheck_layer_norm(cpu_ops, fused):
    x = torch.randn(2, 2, 5, dtype=torch.float64, requires_grad=True)
    w = torch.randn(5, dtype=torch.float64, requires_grad=True)
    b = torch.randn(5, dtype=torch.float64, requires_grad=True)
    if fused:
        r = torch.randn(2, 2, 5, dtype=torch.float64, requires_grad=True)
        assert torch.autograd.gradcheck(lambda x, w, b, r: ops.layer_norm(x, w, b, 1e-5, r), (x, w, b, r))
    else:
        assert torch.autograd.gradcheck(lambda x, w, b: ops.layer_norm(x, w, b, 1e-5), (x, w, b))


def test_residual_gradient_reaches_both_inputs(cpu_ops):
    x = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    r = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    w = torch.randn(6, dtype=torch.float64)
    y, s = ops.rms_norm(x, w, 1e-6, r)
    (y.sum() + 2 * s.sum()).backward()
    xr, rr = x.detach().requires_grad_(), r.detach().requires_grad_()
    y_ref, s_ref = reference("rms_norm", xr, w, None, 1e-6, rr)
    (y_ref.sum() + 2 * s_ref.sum()).backward()
    torch.testing.assert_close(x.grad, xr.grad)
    torch.testing.assert_close(r.grad, rr.grad)


# ---- tracing ----

def test_make_fx_fake_shows_the_kernel_api_ops():
    from torch.fx.experimental.proxy_tensor import make_fx

    def f(x, r, w, b):
        y, s = ops.rms_norm(x, w, 1e-6, r)
        return ops.layer_norm(y, w, b) + s

    graph = make_fx(f, tracing_mode="fake")(torch.randn(2, 8), torch.randn(2, 8), torch.randn(8), torch.randn(8))
    code = graph.code
    assert "kernel_api.rms_norm_residual.default" in code and "kernel_api.layer_norm.default" in code

    def g(x, w):
        return torch.autograd.grad(ops.rms_norm(x, w).sum(), (x, w))

    x, w = torch.randn(2, 8, requires_grad=True), torch.randn(8, requires_grad=True)
    assert "kernel_api.rms_norm_backward.default" in make_fx(g, tracing_mode="fake")(x, w).code
