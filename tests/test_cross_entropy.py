"""Cross-entropy and the fused linear cross-entropy on the CPU: the arguments' refusals, discovery
and explain, the torch provider's kernels through `kernel_api.ops` (the tests add "cpu" to
`dispatch.LAUNCH_DEVICE_TYPES`) against float64 references written here, gradients (gradcheck
in f64), tracing (make_fx, torch.compile), and the CUDA kernels compiled for sm_90a without a
GPU. tests/test_cross_entropy_gpu.py runs the kernels on CUDA.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import kernel_api
from kernel_api import ops
from kernel_api.arguments import CrossEntropyArguments, CrossEntropyBackwardArguments, LinearCrossEntropyArguments
from kernel_api.arguments.cross_entropy_math import chunk_tokens, linear_cross_entropy_chunks, rows_gradient, rows_loss


def reference(logits, target, ignore_index=-100, label_smoothing=0.0, z_loss=0.0, reduction="mean"):
    """The loss in float64, written from the definition (not torch's cross_entropy)."""
    x = logits.double().reshape(-1, logits.shape[-1])
    t = target.reshape(-1)
    valid = t != ignore_index
    lse = torch.logsumexp(x, -1)
    logp = x - lse[:, None]
    nll = -logp.gather(1, torch.where(valid, t, 0).long()[:, None])[:, 0]
    smooth = -logp.mean(-1)
    loss = (1 - label_smoothing) * nll + label_smoothing * smooth + z_loss * lse ** 2
    loss = torch.where(valid, loss, torch.zeros_like(loss))
    if reduction == "none":
        return loss.view(target.shape)
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / valid.sum()


# ---- refusals: one line, naming the operand ----

def _bad_cases():
    x, t = torch.randn(4, 8), torch.randint(0, 8, (4,))
    loss, lse = torch.empty(4), torch.empty(4)
    h, w = torch.randn(4, 6), torch.randn(8, 6)
    return [
        (lambda: CrossEntropyArguments([1.0], t, loss, lse), TypeError, "operand logits: expected a torch.Tensor"),
        (lambda: CrossEntropyArguments(x.long(), t, loss, lse), TypeError, "operand logits: dtype torch.int64 is not"),
        (lambda: CrossEntropyArguments(torch.tensor(1.0), t, loss, lse), ValueError, "operand logits: needs at least"),
        (lambda: CrossEntropyArguments(torch.randn(8, 4).t(), t, loss, lse), ValueError,
         "operand logits: the last dimension must have stride 1"),
        (lambda: CrossEntropyArguments(torch.randn(4, 0), t, loss, lse), ValueError, "operand logits: shape (4, 0)"),
        (lambda: CrossEntropyArguments(torch._neg_view(x), t, loss, lse), ValueError, "operand logits: has torch's lazy"),
        (lambda: CrossEntropyArguments(x, t.float(), loss, lse), TypeError, "operand target: dtype torch.float32"),
        (lambda: CrossEntropyArguments(x, t[:3], loss, lse), ValueError, "operand target: shape (3,) must be (4,)"),
        (lambda: CrossEntropyArguments(x, torch.randint(0, 8, (8,))[::2], loss, lse), ValueError,
         "operand target: strides (2,)"),
        (lambda: CrossEntropyArguments(x, t, loss.double(), lse), TypeError, "operand loss: dtype torch.float64"),
        (lambda: CrossEntropyArguments(x, t, loss, torch.empty(5)), ValueError, "operand lse: shape (5,)"),
        (lambda: CrossEntropyArguments(x, t, loss, lse, grad_logits=x.clone()), ValueError,
         "operand grad_loss: required with grad_logits"),
        (lambda: CrossEntropyArguments(x, t, loss, lse, grad_logits=torch.empty(4, 9), grad_loss=torch.ones(4)),
         ValueError, "operand grad_logits: shape (4, 9)"),
        (lambda: CrossEntropyArguments(x, t, loss, lse, grad_logits=x.clone(), grad_loss=torch.ones(4).double()),
         TypeError, "operand grad_loss: dtype torch.float64"),
        (lambda: CrossEntropyArguments(x, t, loss, lse, ignore_index=1.5), TypeError, "ignore_index: expected an int"),
        (lambda: CrossEntropyArguments(x, t, loss, lse, label_smoothing=1.5), ValueError, "label_smoothing: expected"),
        (lambda: CrossEntropyArguments(x, t, loss, lse, z_loss=float("nan")), ValueError, "z_loss: expected a finite"),
        (lambda: CrossEntropyArguments(x, t, loss, lse, z_loss=-1.0), ValueError, "z_loss: expected a float >= 0"),
        (lambda: CrossEntropyArguments(x, t.to("meta"), loss, lse), ValueError, "operand target: on meta"),
        (lambda: CrossEntropyBackwardArguments(torch.ones(3), x, t, lse, x.clone()), ValueError,
         "operand grad_loss: shape (3,)"),
        (lambda: CrossEntropyBackwardArguments(torch.ones(4), x, t, lse, x.half()), TypeError,
         "operand grad_logits: dtype torch.float16"),
        (lambda: LinearCrossEntropyArguments(h.view(2, 2, 6), w, t, loss), ValueError,
         "operand hidden: must be 2-D"),
        (lambda: LinearCrossEntropyArguments(h, torch.randn(8, 5), t, loss), ValueError,
         "operand weight: shape (8, 5) must be (vocabulary, 6)"),
        (lambda: LinearCrossEntropyArguments(h, w.double(), t, loss), TypeError, "operand weight: dtype torch.float64"),
        (lambda: LinearCrossEntropyArguments(h, w, t, loss, bias=torch.randn(7)), ValueError, "operand bias: shape (7,)"),
        (lambda: LinearCrossEntropyArguments(h, w, t, loss, grad_hidden=h.clone()), ValueError,
         "operand grad_loss: required with the gradient outputs"),
        (lambda: LinearCrossEntropyArguments(h, w, t, loss, grad_loss=torch.ones(4)), ValueError,
         "operand grad_loss: given without a gradient output"),
        (lambda: LinearCrossEntropyArguments(h, w, t, loss, grad_hidden=torch.empty(4, 7), grad_weight=w.clone(),
                                             grad_loss=torch.ones(4)), ValueError, "operand grad_hidden: shape (4, 7)"),
        (lambda: LinearCrossEntropyArguments(h, w, t, loss, grad_bias=torch.empty(8), grad_loss=torch.ones(4)),
         ValueError, "operand grad_bias: given without bias"),
        (lambda: LinearCrossEntropyArguments(h, w, t, loss, grad_weight=w.t().contiguous().t(), grad_loss=torch.ones(4)),
         ValueError, "operand grad_weight: strides (1, 8) but it must be contiguous"),
    ]


@pytest.mark.parametrize("case", range(len(_bad_cases())))
def test_refusals_name_the_operand_in_one_line(case):
    make, error, text = _bad_cases()[case]
    with pytest.raises(error) as info:
        make()
    message = str(info.value)
    assert text in message and "\n" not in message, message


def test_outputs_overlapping_inputs_are_refused_and_in_place_gradient_is_not():
    x, t = torch.randn(4, 8), torch.randint(0, 8, (4,))
    buf = torch.empty(8)
    with pytest.raises(ValueError, match="operand loss: overlaps lse"):
        CrossEntropyArguments(x, t, buf[:4], buf[2:6]).check_memory()
    CrossEntropyArguments(x, t, torch.empty(4), torch.empty(4), grad_logits=x, grad_loss=torch.ones(4)).check_memory()
    with pytest.raises(ValueError, match="operand grad_logits: overlaps logits"):
        big = torch.randn(5, 8)
        CrossEntropyArguments(big[:4], t, torch.empty(4), torch.empty(4), grad_logits=big[1:],
                              grad_loss=torch.ones(4)).check_memory()


def test_output_names_problem_key_and_repr():
    x, t = torch.randn(2, 3, 8), torch.randint(0, 8, (2, 3))
    a = CrossEntropyArguments(x, t, torch.empty(2, 3), torch.empty(2, 3))
    assert type(a).output_names == ("loss", "lse") and (a.rows, a.cols) == (6, 8)
    g = CrossEntropyArguments(x, t, torch.empty(2, 3), torch.empty(2, 3), grad_logits=x,
                              grad_loss=torch.ones(()).expand(2, 3))
    assert isinstance(g, CrossEntropyArguments) and type(g).output_names == ("loss", "lse", "grad_logits")
    assert a.problem_key() != g.problem_key()
    assert "rows=6, cols=8" in repr(a) and "grad_logits" in repr(g)
    h, w = torch.randn(6, 4), torch.randn(8, 4)
    lin = LinearCrossEntropyArguments(h, w, t.view(-1), torch.empty(6), bias=torch.randn(8), grad_hidden=h.clone(),
                                      grad_weight=w.clone(), grad_bias=torch.empty(8), grad_loss=torch.ones(6))
    assert type(lin).output_names == ("loss", "grad_hidden", "grad_weight", "grad_bias")
    assert "tokens=6, hidden=4, vocab=8" in repr(lin) and "gradients of hidden/weight/bias" in repr(lin)
    frozen = LinearCrossEntropyArguments(h, w, t.view(-1), torch.empty(6), grad_hidden=h.clone(),
                                         grad_loss=torch.ones(6))
    assert type(frozen).output_names == ("loss", "grad_hidden") and isinstance(frozen, LinearCrossEntropyArguments)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_discovery_offers_the_cuda_and_torch_kernels(dtype):
    x = torch.empty(4, 32003, dtype=dtype, device="meta")
    t = torch.empty(4, dtype=torch.int32, device="meta")
    loss = torch.empty(4, device="meta")
    names = {k.metadata.kernel_name for k in kernel_api.get_kernels(CrossEntropyArguments(x, t, loss, loss.clone()),
                                                                    cc=90)}
    assert any(n.startswith("CudaCrossEntropy_") for n in names) and any(n.startswith("TorchCrossEntropy_") for n in names)
    assert all(n.endswith("_i32") for n in names), names


def test_explain_says_why_the_cuda_kernels_refuse_f64():
    meta = dict(device="meta", dtype=torch.float64)
    args = CrossEntropyArguments(torch.empty(3, 7, **meta), torch.zeros(3, dtype=torch.long, device="meta"),
                                 torch.empty(3, **meta), torch.empty(3, **meta))
    text = str(kernel_api.explain(args, cc=90))
    assert "TorchCrossEntropy_f64_i64" in text and "CudaCrossEntropy" in text and "needs logits" in text


# ---- the math against float64 ----

SHAPES = [(5, 7), (1, 1), (2, 3, 11), (9, 130)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("options", [dict(), dict(label_smoothing=0.1), dict(z_loss=1e-3),
                                     dict(label_smoothing=0.2, z_loss=1e-2, ignore_index=0)])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cross_entropy_against_float64(cpu_ops, shape, dtype, options, reduction):
    g = torch.Generator().manual_seed(hash((shape, str(dtype), reduction)) % 2**31)
    logits = (torch.randn(shape, generator=g) * 3).to(dtype)
    target = torch.randint(0, shape[-1], shape[:-1], generator=g)
    if target.numel() > 2:
        target.view(-1)[1] = options.get("ignore_index", -100)
    got = ops.cross_entropy(logits, target, reduction=reduction, **options)
    want = reference(logits, target, reduction=reduction, **options)
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol, equal_nan=True)  # (nan: every row ignored)
    if not options.get("z_loss"):
        torch_loss = F.cross_entropy(logits.double().reshape(-1, shape[-1]), target.reshape(-1),
                                     ignore_index=options.get("ignore_index", -100),
                                     label_smoothing=options.get("label_smoothing", 0.0), reduction=reduction)
        torch.testing.assert_close(got.double().reshape(torch_loss.shape), torch_loss, atol=tol, rtol=tol,
                                   equal_nan=True)


def _reference_gradient(logits, target, grad_loss, ignore_index=-100, label_smoothing=0.0, z_loss=0.0):
    """The gradient of ``sum(grad_loss * loss)`` in float64, from the definition."""
    x = logits.double().detach().requires_grad_()
    loss = reference(x, target, ignore_index, label_smoothing, z_loss, reduction="none")
    (grad,) = torch.autograd.grad(loss, x, grad_loss.double().expand(loss.shape))
    return grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("index", [torch.int64, torch.int32])
@pytest.mark.parametrize("options", [dict(), dict(label_smoothing=0.15), dict(ignore_index=2),
                                     dict(label_smoothing=0.1, z_loss=1e-2, ignore_index=0)])
def test_the_torch_kernels_write_loss_lse_and_gradients_against_float64(cpu_ops, dtype, index, options):
    g = torch.Generator().manual_seed(hash((str(dtype), str(index), str(options))) % 2**31)
    logits = (torch.randn(2, 5, 37, generator=g) * 4).to(dtype)
    target = torch.randint(0, 37, (2, 5), generator=g).to(index)
    target[0, 1], target[1, 3] = options.get("ignore_index", -100), 2
    grad_loss = torch.rand(2, 5, generator=g, dtype=logits.double().dtype if dtype == torch.float64
                           else torch.float32)
    scalars = (options.get("ignore_index", -100), options.get("label_smoothing", 0.0), options.get("z_loss", 0.0))
    tol = dict(atol=1e-12, rtol=1e-12) if dtype == torch.float64 else dict(atol=2e-6, rtol=2e-6)
    grad_tol = tol if dtype != torch.bfloat16 else dict(atol=8e-3, rtol=8e-3)  # (the gradient in bf16)
    valid = target.long() != scalars[0]
    want_lse = torch.where(valid, torch.logsumexp(logits.double(), -1), 0)
    want_grad = _reference_gradient(logits, target.long(), grad_loss, *scalars)
    loss, lse = torch.ops.kernel_api.cross_entropy(logits, target, *scalars)
    torch.testing.assert_close(loss.double(), reference(logits, target.long(), *scalars, reduction="none"), **tol)
    torch.testing.assert_close(lse.double(), want_lse, **tol)
    loss, lse, grad = torch.ops.kernel_api.cross_entropy_with_grad(logits, target, grad_loss, *scalars)
    torch.testing.assert_close(lse.double(), want_lse, **tol)
    torch.testing.assert_close(grad.double(), want_grad, **grad_tol)
    grad = ops.cross_entropy_backward(grad_loss, logits, target, lse, *scalars)
    torch.testing.assert_close(grad.double(), want_grad, **grad_tol)


def test_the_torch_kernels_run_torchs_own_cross_entropy_kernels():
    # log_softmax and nll_loss (F.cross_entropy's kernels) for the loss, their backward kernels
    # for the gradient: a few launches a call, not a composite of a few dozen.
    from launched_ops import LaunchedOps

    from kernel_api.providers.torch_ops import cross_entropy as torch_ce

    x, t = torch.randn(4, 33, dtype=torch.bfloat16), torch.randint(0, 33, (4,))
    loss, lse, grad, grad_loss = torch.empty(4), torch.empty(4), torch.empty_like(x), torch.rand(4)
    with LaunchedOps() as forward:
        torch_ce._cross_entropy(x, t, loss, lse, 4, 33, -100, 0.0, 0.0, None)
    with LaunchedOps() as backward:
        torch_ce._cross_entropy_backward(grad_loss, x, t, lse, grad, 4, 33, -100, 0.0, 0.0, None)
    assert {"_log_softmax", "nll_loss_forward"} <= set(forward.ops) and len(forward.ops) <= 10, forward.ops
    assert {"nll_loss_backward", "_log_softmax_backward_data"} <= set(backward.ops), backward.ops
    assert len(backward.ops) <= 6, backward.ops
    torch.testing.assert_close(loss, F.cross_entropy(x.float(), t, reduction="none"))


def test_all_rows_ignored_give_nan_mean_and_zero_gradient(cpu_ops):
    x = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    t = torch.full((3,), -100)
    assert torch.isnan(ops.cross_entropy(x, t))
    loss = ops.cross_entropy(x, t, reduction="sum")
    loss.backward()
    assert loss.item() == 0 and torch.equal(x.grad, torch.zeros_like(x))


@pytest.mark.parametrize("options", [dict(), dict(label_smoothing=0.3, z_loss=0.05, ignore_index=2)])
def test_gradcheck_cross_entropy(cpu_ops, options):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, 9, dtype=torch.float64, generator=g, requires_grad=True)
    t = torch.randint(0, 9, (6,), generator=g)
    t[0] = options.get("ignore_index", -100)
    for reduction in ("mean", "sum", "none"):
        assert torch.autograd.gradcheck(lambda x: ops.cross_entropy(x, t, reduction=reduction, **options), (x,))


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("options", [dict(), dict(label_smoothing=0.1, z_loss=0.01, ignore_index=3)])
def test_gradcheck_linear_cross_entropy(cpu_ops, bias, options):
    g = torch.Generator().manual_seed(2)
    h = torch.randn(7, 5, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(11, 5, dtype=torch.float64, generator=g, requires_grad=True)
    b = torch.randn(11, dtype=torch.float64, generator=g, requires_grad=True) if bias else None
    t = torch.randint(0, 11, (7,), generator=g)
    t[1] = options.get("ignore_index", -100)
    inputs = (h, w) + ((b,) if bias else ())
    for reduction in ("mean", "sum", "none"):
        def f(h, w, *b):
            return ops.linear_cross_entropy(h, w, t, *b, reduction=reduction, **options)
        assert torch.autograd.gradcheck(f, inputs)


@pytest.mark.parametrize("tokens", [1, 3, 64, None])
@pytest.mark.parametrize("skip_ignored", [True, False])
def test_chunk_loop_matches_float64_for_every_chunk_size(tokens, skip_ignored):
    g = torch.Generator().manual_seed(3)
    h, w = torch.randn(10, 6, dtype=torch.float64, generator=g), torch.randn(13, 6, dtype=torch.float64, generator=g)
    b = torch.randn(13, dtype=torch.float64, generator=g)
    t = torch.randint(0, 13, (10,), generator=g)
    t[4] = t[7] = -100
    weights = torch.rand(10, dtype=torch.float64, generator=g)
    args = LinearCrossEntropyArguments(h, w, t, torch.full((10,), 1234.5, dtype=torch.float64), bias=b,
                                       grad_hidden=torch.full_like(h, 1234.5), grad_weight=torch.full_like(w, 1234.5),
                                       grad_bias=torch.full_like(b, 1234.5), grad_loss=weights, label_smoothing=0.1)

    def rows(logits, target, loss, grad_loss):
        value, lse, _ = rows_loss(logits, target, -100, 0.1, 0.0)
        logits.copy_(rows_gradient(logits, target, lse, grad_loss, -100, 0.1, 0.0))
        loss.copy_(value)

    seen = []

    def counted(logits, target, loss, grad_loss):
        seen.append(target.clone())
        rows(logits, target, loss, grad_loss)

    linear_cross_entropy_chunks(args, counted, tokens, skip_ignored=skip_ignored)
    assert sum(len(s) for s in seen) == (8 if skip_ignored else 10)  # the ignored tokens skip the GEMMs
    hh, ww, bb = (v.clone().requires_grad_() for v in (h, w, b))
    ref = reference(F.linear(hh, ww, bb), t, label_smoothing=0.1, reduction="none")
    torch.testing.assert_close(args.loss, ref.detach())
    grads = torch.autograd.grad((ref * weights).sum(), (hh, ww, bb))
    for got, want in zip((args.grad_hidden, args.grad_weight, args.grad_bias), grads):
        torch.testing.assert_close(got, want)


def test_all_tokens_ignored_give_zero_gradients():
    h, w, t = torch.randn(3, 4), torch.randn(5, 4), torch.full((3,), -100)
    args = LinearCrossEntropyArguments(h, w, t, torch.full((3,), 7.0), grad_hidden=torch.full_like(h, 7.0),
                                       grad_weight=torch.full_like(w, 7.0), grad_loss=torch.ones(3))
    linear_cross_entropy_chunks(args, lambda *a: pytest.fail("no row should reach the kernel"))
    assert not args.loss.any() and not args.grad_hidden.any() and not args.grad_weight.any()


def test_chunk_tokens_bounds_the_buffer():
    assert chunk_tokens(8192, 128256, 2) == 1024
    assert chunk_tokens(100, 128256, 2) == 100
    assert chunk_tokens(10**6, 10**7, 4) == 13  # 512 MiB of f32 logits at most
    assert chunk_tokens(0, 10, 2) == 1
    assert chunk_tokens(5000, 32000, 2, tokens=300) == 256


@pytest.mark.parametrize("frozen", ["weight", "hidden"])
def test_frozen_inputs_get_no_gradient_and_cost_no_gemm(cpu_ops, frozen):
    g = torch.Generator().manual_seed(6)
    h = torch.randn(5, 4, dtype=torch.float64, generator=g, requires_grad=frozen != "hidden")
    w = torch.randn(9, 4, dtype=torch.float64, generator=g, requires_grad=frozen != "weight")
    t = torch.randint(0, 9, (5,), generator=g)
    ops.linear_cross_entropy(h, w, t, label_smoothing=0.1).backward()
    live, dead = (h, w) if frozen == "weight" else (w, h)
    hh, ww = h.detach().requires_grad_(), w.detach().requires_grad_()
    reference(F.linear(hh, ww), t, label_smoothing=0.1).backward()
    torch.testing.assert_close(live.grad, hh.grad if live is h else ww.grad)
    assert dead.grad is None
    args_seen = []
    real = LinearCrossEntropyArguments.__init__

    def spy(self, *a, **k):
        args_seen.append(type(self).output_names)
        real(self, *a, **k)

    with pytest.MonkeyPatch.context() as m:
        m.setattr(LinearCrossEntropyArguments, "__init__", spy)
        ops.linear_cross_entropy(h, w, t).backward()
    assert args_seen == [("loss", "grad_hidden" if frozen == "weight" else "grad_weight")]


def test_autocast_casts_the_gemm_operands_as_linear_does(cpu_ops):
    g = torch.Generator().manual_seed(7)
    h = torch.randn(6, 8, generator=g, requires_grad=True)
    w = torch.randn(10, 8, generator=g, requires_grad=True)
    t = torch.randint(0, 10, (6,), generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = ops.linear_cross_entropy(h, w, t)
    loss.backward()
    assert loss.dtype == torch.float32 and h.grad.dtype == w.grad.dtype == torch.float32
    hb, wb = h.detach().bfloat16().double().requires_grad_(), w.detach().bfloat16().double().requires_grad_()
    reference(F.linear(hb, wb).bfloat16(), t).backward()  # (our logits are rounded to bf16 as well)
    torch.testing.assert_close(loss.double(), reference(F.linear(hb, wb).bfloat16(), t).detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(w.grad.double(), wb.grad, atol=2e-2, rtol=2e-2)


def test_inference_runs_the_loss_only_op(cpu_ops, monkeypatch):
    h, w, t = torch.randn(4, 3), torch.randn(6, 3), torch.randint(0, 6, (4,))
    with torch.no_grad():
        got = ops.linear_cross_entropy(h.requires_grad_(), w, t, reduction="sum")
    # (an f32 loss against the float64 one: f32's tolerance, not float64's)
    torch.testing.assert_close(got.double(), reference(F.linear(h, w).detach(), t, reduction="sum"),
                               rtol=1.3e-6, atol=1e-5)


def test_incoming_gradient_scales_the_saved_gradients_once(cpu_ops, monkeypatch):
    import sys

    g = torch.Generator().manual_seed(8)
    x = torch.randn(5, 6, dtype=torch.float64, generator=g, requires_grad=True)
    t = torch.randint(0, 6, (5,), generator=g)
    xr = x.detach().requires_grad_()
    (3.0 * reference(xr, t)).backward()
    # small gradients: scaled out of place without reading the incoming gradient (no sync), so a
    # second backward through the graph scales the saved gradient again from scratch
    loss = ops.cross_entropy(x, t)
    (3.0 * loss).backward(retain_graph=True)
    torch.testing.assert_close(x.grad, xr.grad)
    loss.backward()
    torch.testing.assert_close(x.grad, xr.grad * (4.0 / 3.0))
    # large ones: in place (no second gradient-sized buffer), so a second backward refuses
    monkeypatch.setattr(sys.modules["kernel_api.ops.cross_entropy"], "SCALE_WITHOUT_READING_ELEMENTS", 0)
    x.grad = None
    loss = ops.cross_entropy(x, t)
    (3.0 * loss).backward(retain_graph=True)
    torch.testing.assert_close(x.grad, xr.grad)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_reduction_is_checked():
    with pytest.raises(ValueError, match="reduction: expected 'mean', 'sum' or 'none', got 'avg'"):
        ops.cross_entropy(torch.randn(2, 3), torch.zeros(2, dtype=torch.long), reduction="avg")
    with pytest.raises(ValueError, match="reduction: expected"):
        ops.linear_cross_entropy(torch.randn(2, 3), torch.randn(4, 3), torch.zeros(2, dtype=torch.long),
                                 reduction=None)


# ---- tracing ----

def test_make_fx_shows_the_kernel_api_ops():
    from torch.fx.experimental.proxy_tensor import make_fx

    def f(x, t):
        return ops.cross_entropy(x, t, label_smoothing=0.1)

    code = make_fx(f, tracing_mode="fake")(torch.randn(4, 7), torch.randint(0, 7, (4,))).code
    assert "kernel_api.cross_entropy_reduced.default" in code

    def g(x, t):
        return torch.autograd.grad(ops.cross_entropy(x, t), (x,))

    def g_none(x, t):
        return torch.autograd.grad(ops.cross_entropy(x, t, reduction="none").sum(), (x,))

    x, t = torch.randn(4, 7, requires_grad=True), torch.randint(0, 7, (4,))
    code = make_fx(g, tracing_mode="fake")(x, t).code
    assert "kernel_api.cross_entropy_reduced_with_grad.default" in code and "cross_entropy_backward" not in code
    assert "kernel_api.cross_entropy_backward.default" in make_fx(g_none, tracing_mode="fake")(x, t).code

    def lin(h, w, t):
        return torch.autograd.grad(ops.linear_cross_entropy(h, w, t), (h, w))

    h, w = torch.randn(4, 3, requires_grad=True), torch.randn(7, 3, requires_grad=True)
    code = make_fx(lin, tracing_mode="fake")(h, w, torch.randint(0, 7, (4,))).code
    assert "kernel_api.linear_cross_entropy_with_grads.default" in code and "addmm" not in code


def test_torch_compile_traces_both_ops(cpu_ops):
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(4)
    h = torch.randn(6, 4, generator=g, requires_grad=True)
    w = torch.randn(9, 4, generator=g, requires_grad=True)
    t = torch.randint(0, 9, (6,), generator=g)

    def step(h, w, t):
        return ops.linear_cross_entropy(h, w, t, z_loss=1e-3) + ops.cross_entropy(h @ w.t(), t, label_smoothing=0.1)

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    got = compiled(h, w, t)
    got.backward()
    gh, gw = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    hh, ww = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    want = (reference(hh @ ww.t(), t, z_loss=1e-3) + reference(hh @ ww.t(), t, label_smoothing=0.1))
    want.backward()
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(gh.double(), hh.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(gw.double(), ww.grad, atol=1e-5, rtol=1e-5)


# ---- the CUDA kernels compile without a GPU ----

def test_cuda_kernels_compile_for_sm90a_without_a_gpu():
    meta = dict(device="meta")
    x, t = torch.empty(3, 32003, dtype=torch.bfloat16, **meta), torch.empty(3, dtype=torch.long, **meta)
    loss, lse, ones = torch.empty(3, **meta), torch.empty(3, **meta), torch.empty(3, **meta)
    cases = [CrossEntropyArguments(x, t, loss, lse),
             CrossEntropyArguments(x, t, loss, lse, grad_logits=x, grad_loss=ones),
             CrossEntropyBackwardArguments(ones, x.float(), t.int(), lse, torch.empty(3, 32003, **meta)),
             LinearCrossEntropyArguments(torch.empty(3, 8, dtype=torch.float16, **meta),
                                         torch.empty(7, 8, dtype=torch.float16, **meta), t, loss)]
    for args in cases:
        kernels = [k for k in kernel_api.get_kernels(args, cc=90) if type(k).__name__.startswith("Cuda")]
        assert len(kernels) == 1, kernels
        artifact = kernels[0].compile(args, cc=90)
        assert artifact.compiled_obj is not None
