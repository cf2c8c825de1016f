"""Cross-entropy on CUDA: the CUDA C++ kernels (run directly and through `kernel_api.ops`) against
float64 references on fresh random data, with outputs in sentinel-filled buffers, odd vocabulary
sizes, misaligned and strided rows, ignored and all-ignored rows, in-place gradients (the mean
and the sum reduced in the launch: tests/test_cross_entropy_reduced_gpu.py); the fused
linear cross-entropy's loss and gradients against float64; torch.compile(fullgraph=True). The CPU
half is tests/test_cross_entropy.py, whose reference this reuses.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import kernel_api
from kernel_api import ops
from kernel_api.arguments import CrossEntropyArguments, CrossEntropyBackwardArguments, LinearCrossEntropyArguments
from kernel_api.arguments import cross_entropy_math

from test_cross_entropy import reference

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

SENTINEL = 1234.5
GRAD_TOL = {torch.float32: dict(atol=1e-5, rtol=1e-4), torch.float16: dict(atol=1e-3, rtol=2e-3),
            torch.bfloat16: dict(atol=4e-3, rtol=1.6e-2)}


def cuda_kernel(args):
    """The CUDA source provider's kernel for ``args`` (exactly one instance fits)."""
    found = [k for k in kernel_api.get_kernels(args) if type(k).__name__.startswith("Cuda")]
    assert len(found) == 1, [k.metadata.kernel_name for k in kernel_api.get_kernels(args)]
    return found[0]


def padded(rows, cols, dtype, offset=0, pad=0, fill=SENTINEL):
    """A (rows, cols) view into a sentinel-filled buffer: rows ``cols + pad`` apart, starting
    ``offset`` elements in (misaligned for odd offsets)."""
    buf = torch.full((rows * (cols + pad) + offset + pad + 1,), fill, dtype=dtype, device="cuda")
    return buf[offset: offset + rows * (cols + pad)].view(rows, cols + pad)[:, :cols], buf


def ref_grad(logits, target, weights, **options):
    x = logits.double().detach().requires_grad_()
    loss = reference(x, target, reduction="none", **options)
    (loss * weights.double()).sum().backward()
    return x.grad


CASES = [(1, 1, 0, 0), (5, 7, 1, 3), (64, 32003, 3, 5), (3, 32000, 0, 0), (17, 128256, 1, 0), (4, 1000, 0, 11)]


@pytest.mark.parametrize("rows, cols, offset, pad", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("index", [torch.int64, torch.int32])
@pytest.mark.parametrize("options", [dict(), dict(label_smoothing=0.1, z_loss=1e-3, ignore_index=5)])
def test_forward_and_gradient_kernel_against_float64(rows, cols, offset, pad, dtype, index, options):
    g = torch.Generator(device="cuda").manual_seed(rows * 7919 + cols)
    x, _ = padded(rows, cols, dtype, offset, pad)
    x.copy_(torch.randn(rows, cols, device="cuda", generator=g) * 4)
    target = torch.randint(0, cols, (rows,), device="cuda", generator=g).to(index)
    target[::3] = options.get("ignore_index", -100)
    loss = torch.full((rows,), SENTINEL, device="cuda")
    lse = torch.full((rows,), SENTINEL, device="cuda")
    grad, grad_buf = padded(rows, cols, dtype, offset=(offset + 1) % 8, pad=pad + 2)
    weights = torch.rand(rows, device="cuda", generator=g)
    args = CrossEntropyArguments(x, target, loss, lse, grad_logits=grad, grad_loss=weights, **options)
    cuda_kernel(args).run(args)
    want = reference(x, target, reduction="none", **options)
    torch.testing.assert_close(loss.double(), want, atol=2e-4, rtol=1e-5)
    valid = target != options.get("ignore_index", -100)
    want_lse = torch.where(valid, torch.logsumexp(x.double(), -1), torch.zeros((), dtype=torch.float64, device="cuda"))
    torch.testing.assert_close(lse.double(), want_lse, atol=2e-4, rtol=1e-5)
    torch.testing.assert_close(grad.double(), ref_grad(x, target, weights, **options), **GRAD_TOL[dtype])
    written = torch.zeros_like(grad_buf, dtype=torch.bool)
    written[(offset + 1) % 8:][: rows * (cols + pad + 2)].view(rows, cols + pad + 2)[:, :cols] = True
    assert torch.all(grad_buf[~written] == SENTINEL), "the gradient was written outside its rows"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_loss_only_and_in_place_gradient(dtype):
    rows, cols = 33, 50257
    x = (torch.randn(rows, cols, device="cuda") * 3).to(dtype)
    target = torch.randint(0, cols, (rows,), device="cuda")
    loss, lse = torch.full((rows,), SENTINEL, device="cuda"), torch.full((rows,), SENTINEL, device="cuda")
    args = CrossEntropyArguments(x, target, loss, lse, z_loss=1e-4)
    cuda_kernel(args).run(args)
    torch.testing.assert_close(loss.double(), reference(x, target, z_loss=1e-4, reduction="none"), atol=2e-4, rtol=1e-5)
    want = ref_grad(x, target, torch.full((rows,), 0.5, device="cuda"), z_loss=1e-4)
    args = CrossEntropyArguments(x, target, loss, lse, grad_logits=x, grad_loss=torch.full((), 0.5, device="cuda")
                                 .expand(rows), z_loss=1e-4)
    cuda_kernel(args).run(args)
    torch.testing.assert_close(x.double(), want, **GRAD_TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("cols", [1, 7, 32003])
def test_backward_kernel_from_saved_lse(dtype, cols):
    rows = 9
    x, _ = padded(rows, cols, dtype, offset=1, pad=1)
    x.copy_(torch.randn(rows, cols, device="cuda") * 2)
    target = torch.randint(0, cols, (rows,), device="cuda")
    target[2] = -100
    lse = torch.logsumexp(x.float(), -1)
    weights = torch.rand(rows, device="cuda")
    grad, _ = padded(rows, cols, dtype)
    args = CrossEntropyBackwardArguments(weights, x, target, lse, grad, label_smoothing=0.2)
    cuda_kernel(args).run(args)
    torch.testing.assert_close(grad.double(), ref_grad(x, target, weights, label_smoothing=0.2), **GRAD_TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("options", [dict(), dict(label_smoothing=0.1, z_loss=1e-3, ignore_index=5)])
def test_the_recorded_launches_write_what_run_writes(dtype, options):
    # `_launcher`'s recorded cuLaunchKernel (what kernel_api.ops replays) against `_run`, bit for
    # bit: strided misaligned rows, int32 targets, a broadcast and a per-row grad_loss.
    from kernel_api.core.streams import to_cuda_stream

    rows, cols = 9, 5003
    g = torch.Generator(device="cuda").manual_seed(17)
    x, _ = padded(rows, cols, dtype, offset=1, pad=3)
    x.copy_(torch.randn(rows, cols, device="cuda", generator=g) * 3)
    target = torch.randint(0, cols, (rows,), device="cuda", generator=g).int()
    target[::4] = options.get("ignore_index", -100)
    weights = torch.rand(rows, device="cuda", generator=g)
    lse = torch.logsumexp(x.float(), -1)

    def outputs():
        return (torch.full((rows,), SENTINEL, device="cuda"), torch.full((rows,), SENTINEL, device="cuda"),
                padded(rows, cols, dtype, offset=3, pad=1)[0])

    makers = {
        "loss": lambda loss, row_lse, grad: CrossEntropyArguments(x, target, loss, row_lse, **options),
        "with_grad": lambda loss, row_lse, grad: CrossEntropyArguments(
            x, target, loss, row_lse, grad_logits=grad, grad_loss=torch.full((), 0.5, device="cuda").expand(rows),
            **options),
        "backward": lambda loss, row_lse, grad: CrossEntropyBackwardArguments(weights, x, target, lse, grad,
                                                                             **options),
    }
    for name, make in makers.items():
        ran, replayed = outputs(), outputs()
        args = make(*ran)
        kernel = cuda_kernel(args)
        artifact = kernel.compile(args)
        kernel.run(args, compiled_artifact=artifact)
        again = make(*replayed)
        launcher = kernel._launcher(again, artifact)
        assert launcher is not None and launcher.ffi, name
        launcher.launch([getattr(again, n) for n in again.tensor_attributes], to_cuda_stream(None))
        for a, b in zip(ran, replayed):
            assert torch.equal(a, b), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_torch_providers_kernels_on_cuda_against_float64(dtype):
    # torch's own cross-entropy kernels (log_softmax, nll_loss and their backwards) on CUDA:
    # int32 targets, ignored rows, label smoothing, the mean's broadcast row weight.
    ops.clear_dispatch_cache()
    x = (torch.randn(6, 31, 1001, device="cuda") * 3).to(dtype).requires_grad_()
    target = torch.randint(0, 1001, (6, 31), device="cuda").int()
    target[0, :5] = 7
    options = dict(ignore_index=7, label_smoothing=0.1)
    with kernel_api.settings(providers=["torch"]):
        for reduction in ("mean", "none"):
            x.grad = None
            got = ops.cross_entropy(x, target, reduction=reduction, **options)
            want = reference(x, target.long(), reduction=reduction, **options)
            torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=1e-5)
            upstream = torch.rand(got.shape, device="cuda")
            (got * upstream).sum().backward()
            xr = x.detach().double().requires_grad_()
            (reference(xr, target.long(), reduction=reduction, **options) * upstream.double()).sum().backward()
            torch.testing.assert_close(x.grad.double(), xr.grad, **GRAD_TOL[dtype])
    assert all(type(k).__name__.startswith("Torch") for _, k in ops.chosen_kernels())
    ops.clear_dispatch_cache()


def test_all_rows_ignored():
    x = torch.randn(4, 300, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    target = torch.full((4,), -100, device="cuda")
    loss = ops.cross_entropy(x, target, reduction="sum")
    loss.backward()
    assert loss.item() == 0 and torch.equal(x.grad, torch.zeros_like(x.grad))
    assert torch.isnan(ops.cross_entropy(x.detach(), target))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_ops_cross_entropy_against_float64(dtype, reduction):
    ops.clear_dispatch_cache()
    x = (torch.randn(3, 40, 32003, device="cuda") * 2).to(dtype).requires_grad_()
    target = torch.randint(0, 32003, (3, 40), device="cuda")
    target[0, :7] = -100
    got = ops.cross_entropy(x, target, label_smoothing=0.05, reduction=reduction)
    want = reference(x, target, label_smoothing=0.05, reduction=reduction)
    torch.testing.assert_close(got.double(), want, atol=2e-4, rtol=1e-5)
    upstream = torch.rand(got.shape, device="cuda")
    (got * upstream).sum().backward()
    xr = x.detach().double().requires_grad_()
    (reference(xr, target, label_smoothing=0.05, reduction=reduction) * upstream.double()).sum().backward()
    torch.testing.assert_close(x.grad.double(), xr.grad, **GRAD_TOL[dtype])


def _relative(got, want):
    return ((got.double() - want).norm() / want.norm().clamp(min=1e-30)).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("overlap", [False, True])
def test_linear_cross_entropy_against_float64(monkeypatch, dtype, bias, reduction, overlap):
    monkeypatch.setattr(cross_entropy_math, "CHUNK_TOKENS", 128)  # several chunks, the last one short
    monkeypatch.setattr(cross_entropy_math, "OVERLAP_GRADIENT_GEMMS", overlap)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    ops.clear_dispatch_cache()
    g = torch.Generator(device="cuda").manual_seed(5)
    tokens, hidden, vocab = 301, 96, 1003
    h = (torch.randn(tokens, hidden, device="cuda", generator=g)).to(dtype).requires_grad_()
    w = (torch.randn(vocab, hidden, device="cuda", generator=g) / hidden ** 0.5).to(dtype).requires_grad_()
    b = (torch.randn(vocab, device="cuda", generator=g)).to(dtype).requires_grad_() if bias else None
    target = torch.randint(0, vocab, (tokens,), device="cuda", generator=g)
    target[::5] = -100
    options = dict(label_smoothing=0.1, z_loss=1e-3)
    got = ops.linear_cross_entropy(h, w, target, b, reduction=reduction, **options)
    upstream = torch.rand(got.shape, device="cuda", generator=g) + 0.5
    (got * upstream).sum().backward()
    hr, wr = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    br = b.detach().double().requires_grad_() if bias else None
    want = reference(F.linear(hr, wr, br), target, reduction=reduction, **options)
    (want * upstream.double()).sum().backward()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert _relative(got, want.detach()) < tol
    for mine, ref in [(h.grad, hr.grad), (w.grad, wr.grad)] + ([(b.grad, br.grad)] if bias else []):
        assert _relative(mine, ref) < tol * 2


def test_linear_cross_entropy_runs_the_cuda_kernel_and_never_holds_the_logits():
    tokens, hidden, vocab = 4096, 512, 32000
    h = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(vocab, hidden, device="cuda", dtype=torch.bfloat16) / hidden ** 0.5
    target = torch.randint(0, vocab, (tokens,), device="cuda")
    loss = torch.empty(tokens, device="cuda")
    args = LinearCrossEntropyArguments(h, w, target, loss, grad_hidden=torch.empty_like(h),
                                       grad_weight=torch.empty_like(w), grad_loss=torch.ones(tokens, device="cuda"))
    kernel = cuda_kernel(args)
    kernel.run(args)  # compile
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    kernel.run(args)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - before
    chunk = cross_entropy_math.chunk_tokens(tokens, vocab, 2) * vocab * 2
    assert extra < chunk + (8 << 20) < tokens * vocab * 2, (extra, chunk)
    want = reference(h.double() @ w.double().t(), target, reduction="none")
    assert _relative(loss, want) < 2e-2


def test_torch_compile_fullgraph():
    torch._dynamo.reset()
    h = torch.randn(256, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(5003, 64, device="cuda", dtype=torch.bfloat16) / 8).requires_grad_()
    target = torch.randint(0, 5003, (256,), device="cuda")

    def step(h, w, target):
        return ops.linear_cross_entropy(h, w, target) + ops.cross_entropy(h @ w.t(), target, z_loss=1e-4)

    got = torch.compile(step, fullgraph=True)(h, w, target)
    got.backward()
    hr, wr = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    want = reference(hr @ wr.t(), target) + reference(hr @ wr.t(), target, z_loss=1e-4)
    want.backward()
    assert _relative(got, want.detach()) < 2e-2
    assert _relative(h.grad, hr.grad) < 4e-2 and _relative(w.grad, wr.grad) < 4e-2


_SANITIZED = r"""
import torch
from kernel_api import get_kernels
from kernel_api.arguments import CrossEntropyArguments, CrossEntropyBackwardArguments, LinearCrossEntropyArguments
from kernel_api.arguments.cross_entropy import CrossEntropyReducedArguments, reduced_size
torch.manual_seed(0)
def at(rows, cols, dtype, offset):  # its own allocation, offset elements in: rows at any alignment
    return torch.randn(rows * cols + offset, device="cuda").to(dtype)[offset:].view(rows, cols)
def cuda(args):
    return [k for k in get_kernels(args) if type(k).__name__.startswith("Cuda")][0]
n = 0
for dtype in (torch.bfloat16, torch.float32):
    for rows, cols, offset in ((3, 7, 1), (2, 17000, 3), (5, 1, 0)):
        x = at(rows, cols, dtype, offset)
        t = torch.randint(0, cols, (rows,), device="cuda")
        t[0] = -100
        loss, lse, w = torch.empty(rows, device="cuda"), torch.empty(rows, device="cuda"), torch.rand(rows, device="cuda")
        for grad in (None, at(rows, cols, dtype, (offset + 1) % 8), x):
            extra = {} if grad is None else dict(grad_logits=grad, grad_loss=w)
            args = CrossEntropyArguments(x, t, loss, lse, **extra)
            cuda(args).run(args); n += 1
        args = CrossEntropyBackwardArguments(w, x, t, lse, at(rows, cols, dtype, offset))
        cuda(args).run(args); n += 1
        for reduction, grad in (("mean", None), ("sum", at(rows, cols, dtype, (offset + 3) % 8))):
            extra = {} if grad is None else dict(grad_logits=grad, grad_loss=w)
            args = CrossEntropyReducedArguments(x, t, torch.empty(reduced_size(rows), device="cuda"),
                                                reduction=reduction, **extra)
            cuda(args).run(args); n += 1
h, wt = at(70, 32, torch.bfloat16, 0), at(1001, 32, torch.bfloat16, 0)
t = torch.randint(0, 1001, (70,), device="cuda")
t[::7] = -100
args = LinearCrossEntropyArguments(h, wt, t, torch.empty(70, device="cuda"), grad_hidden=torch.empty_like(h),
                                   grad_weight=torch.empty_like(wt), grad_loss=torch.ones(70, device="cuda"))
cuda(args).run(args); n += 1
torch.cuda.synchronize()
print("runs", n)
"""


def test_memcheck_clean():
    from memcheck import run_memcheck

    out = run_memcheck(_SANITIZED)
    assert "runs 37" in out, out[-2000:]
