"""Cross-entropy's mean and sum reduced inside the CUDA kernel's launch: the kernel run directly
against float64 references on fresh random data (odd vocabularies, misaligned rows, ignored rows,
every row ignored, with and without the gradient), the loss buffer and gradient in
sentinel-filled memory; `ops.cross_entropy` replayed from C and giving the same bits call after
call; CUDA graph replays; two streams at once. The CPU half is
tests/test_cross_entropy_reduced.py.
"""

from __future__ import annotations

import pytest
import torch

import kernel_api
from kernel_api import ops
from kernel_api.arguments import CrossEntropyReducedArguments
from kernel_api.arguments.cross_entropy import reduced_size

from test_cross_entropy import reference
from test_cross_entropy_gpu import GRAD_TOL, SENTINEL, cuda_kernel, padded, ref_grad
from test_op_replay import count_python_path

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

# (rows, classes, first element's offset, row padding): one row, odd vocabularies, 128256 classes
# (1024-thread CTAs), more rows than an H200 holds CTAs of at once
CASES = [(1, 1, 0, 0), (7, 33, 1, 3), (65, 32003, 3, 5), (5, 128256, 1, 0), (3000, 1000, 0, 7)]


def _buffer(rows: int) -> torch.Tensor:
    return torch.full((reduced_size(rows),), SENTINEL, device="cuda")


@pytest.mark.parametrize("rows, cols, offset, pad", CASES)
@pytest.mark.parametrize("dtype, index", [(torch.float32, torch.int64), (torch.bfloat16, torch.int32)])
@pytest.mark.parametrize("options", [dict(), dict(label_smoothing=0.1, z_loss=1e-3, ignore_index=5)])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_reduced_kernel_against_float64(rows, cols, offset, pad, dtype, index, options, reduction):
    g = torch.Generator(device="cuda").manual_seed(rows * 7919 + cols + len(options))
    x, _ = padded(rows, cols, dtype, offset, pad)
    x.copy_(torch.randn(rows, cols, device="cuda", generator=g) * 4)
    target = torch.randint(0, cols, (rows,), device="cuda", generator=g).to(index)
    target[1::3] = options.get("ignore_index", -100)
    # the buffer: the loss, a row's weight in it, two zeros, the rows' losses
    kept = (target.long() != options.get("ignore_index", -100)).sum().clamp(min=1).double()
    weight = 1.0 / kept if reduction == "mean" else torch.ones((), dtype=torch.float64, device="cuda")
    want = torch.cat((reference(x, target.long(), reduction=reduction, **options).view(1), weight.view(1),
                      torch.zeros(2, dtype=torch.float64, device="cuda"),
                      reference(x, target.long(), reduction="none", **options)))
    tol = dict(atol=2e-4, rtol=2e-5)

    loss = _buffer(rows)
    args = CrossEntropyReducedArguments(x, target, loss, reduction=reduction, **options)
    cuda_kernel(args).run(args)
    torch.testing.assert_close(loss.double(), want, **tol)

    loss = _buffer(rows)
    grad, grad_buf = padded(rows, cols, dtype, offset=(offset + 1) % 8, pad=pad + 2)
    weights = torch.rand(rows, device="cuda", generator=g)
    args = CrossEntropyReducedArguments(x, target, loss, grad_logits=grad, grad_loss=weights, reduction=reduction,
                                        **options)
    cuda_kernel(args).run(args)
    torch.testing.assert_close(loss.double(), want, **tol)
    torch.testing.assert_close(grad.double(), ref_grad(x, target.long(), weights, **options), **GRAD_TOL[dtype])
    written = torch.zeros_like(grad_buf, dtype=torch.bool)
    written[(offset + 1) % 8:][: rows * (cols + pad + 2)].view(rows, cols + pad + 2)[:, :cols] = True
    assert torch.all(grad_buf[~written] == SENTINEL), "the gradient was written outside its rows"


@pytest.mark.parametrize("rows", [1, 4, 2000])
def test_every_row_ignored_gives_nan_mean_and_zero_sum(rows):
    x = torch.randn(rows, 301, device="cuda", dtype=torch.bfloat16)
    target = torch.full((rows,), -100, device="cuda")
    for reduction, want in (("mean", float("nan")), ("sum", 0.0)):
        loss = _buffer(rows)
        args = CrossEntropyReducedArguments(x, target, loss, reduction=reduction)
        cuda_kernel(args).run(args)
        torch.testing.assert_close(loss[0].cpu(), torch.tensor(want), equal_nan=True)
        assert loss[1].item() == 1 and not loss[2:].any()  # (a mean of no rows weighs each 1 / 1)
        torch.testing.assert_close(ops.cross_entropy(x, target, reduction=reduction).cpu(), torch.tensor(want),
                                   equal_nan=True)
        torch.testing.assert_close(torch.nn.functional.cross_entropy(x.float(), target, reduction=reduction).cpu(),
                                   torch.tensor(want), equal_nan=True)  # (torch's own answer)


def test_no_rows():
    x, target = torch.randn(0, 50, device="cuda"), torch.zeros(0, dtype=torch.long, device="cuda")
    assert torch.isnan(ops.cross_entropy(x, target)) and ops.cross_entropy(x, target, reduction="sum").item() == 0


def test_a_misaligned_buffer_is_refused_by_the_cuda_kernel_and_served_by_torchs():
    x, target = torch.randn(6, 40, device="cuda"), torch.randint(0, 40, (6,), device="cuda")
    buf = torch.full((reduced_size(6) + 1,), SENTINEL, device="cuda")[1:]
    args = CrossEntropyReducedArguments(x, target, buf, reduction="sum")
    assert [type(k).__name__ for k in kernel_api.get_kernels(args)] == ["TorchCrossEntropyReduced"]
    aligned = CrossEntropyReducedArguments(x, target, _buffer(6), reduction="sum")
    cuda = next(k for k in kernel_api.get_kernels(aligned) if type(k).__name__ == "CudaCrossEntropyReduced")
    assert "8-byte aligned" in cuda.supports(args).error
    assert torch.isclose(ops.call(args)[0].double(), reference(x, target, reduction="sum"), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_ops_replays_the_reduced_launch_from_c_with_the_same_bits(monkeypatch, dtype, reduction):
    launches = count_python_path(monkeypatch)
    g = torch.Generator(device="cuda").manual_seed(11)
    x = (torch.randn(2, 37, 5003, device="cuda", generator=g) * 3).to(dtype)
    target = torch.randint(0, 5003, (2, 37), device="cuda", generator=g)
    target[0, ::4] = -100
    options = dict(label_smoothing=0.05, z_loss=1e-4)
    results = [ops.cross_entropy(x, target, reduction=reduction, **options) for _ in range(20)]
    assert len(launches) <= 6, launches  # (the first call, and one per made buffer's alignment at most)
    first = results[0]
    assert first.shape == () and first.dtype == torch.float32
    assert all(torch.equal(r, first) for r in results), "the reduction's order changed between calls"
    torch.testing.assert_close(first.double(), reference(x, target, reduction=reduction, **options),
                               atol=2e-4, rtol=2e-5)
    chosen = {k.metadata.kernel_name for _, k in ops.chosen_kernels()}
    assert any(n.startswith("CudaCrossEntropyReduced_") for n in chosen), chosen
    ops.clear_dispatch_cache()


def test_cuda_graph_replays_reduce_each_time():
    rows, cols = 300, 4099
    x = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16)
    target = torch.randint(0, cols, (rows,), device="cuda")
    target[::7] = -100
    for _ in range(3):  # (recorded, replayed)
        ops.cross_entropy(x, target)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side), torch.cuda.graph(graph, stream=side):
        captured = ops.cross_entropy(x, target)
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(captured.double(), reference(x, target), atol=2e-4, rtol=2e-5)


def test_two_streams_at_once():
    # Each launch counts its CTAs on its own buffer: launches in flight together do not mix.
    rows, cols = 2000, 32003
    xs = [torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    target = torch.randint(0, cols, (rows,), device="cuda")
    streams = [torch.cuda.Stream() for _ in xs]
    for s in streams:
        s.wait_stream(torch.cuda.current_stream())
    got = [[], []]
    for _ in range(5):
        for i, (x, s) in enumerate(zip(xs, streams)):
            with torch.cuda.stream(s):
                got[i].append(ops.cross_entropy(x, target))
    torch.cuda.synchronize()
    for x, losses in zip(xs, got):
        want = reference(x, target)
        for loss in losses:
            torch.testing.assert_close(loss.double(), want, atol=2e-4, rtol=2e-5)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_autograd_through_the_reduced_kernel(reduction):
    ops.clear_dispatch_cache()
    x = (torch.randn(3, 50, 2049, device="cuda") * 2).bfloat16().requires_grad_()
    target = torch.randint(0, 2049, (3, 50), device="cuda")
    target[1, :9] = 3
    options = dict(ignore_index=3, label_smoothing=0.1, z_loss=1e-3)
    loss = ops.cross_entropy(x, target, reduction=reduction, **options)
    (2.5 * loss).backward()
    xr = x.detach().double().requires_grad_()
    want = reference(xr, target, reduction=reduction, **options)
    (2.5 * want).backward()
    torch.testing.assert_close(loss.double(), want.detach(), atol=2e-4, rtol=2e-5)
    torch.testing.assert_close(x.grad.double(), xr.grad, **GRAD_TOL[torch.bfloat16])
    chosen = {k.metadata.kernel_name for _, k in ops.chosen_kernels()}
    assert any(n.startswith("CudaCrossEntropyReduced_") for n in chosen), chosen
    ops.clear_dispatch_cache()
