"""Cross-entropy's mean and sum as one launch into one made buffer, on the CPU: the arguments of a
reduced call, the torch provider's reduced kernels against float64, the front door's repeated
mean or sum replayed from C (no Python frame of ours beyond `ops.cross_entropy`, no torch op
after the kernel), and tracing. tests/test_cross_entropy_reduced_gpu.py runs the CUDA kernel.
"""

from __future__ import annotations

import ctypes
import math
import sys

import pytest
import torch

import kernel_api
from kernel_api import native, ops
from kernel_api.arguments import CrossEntropyArguments, CrossEntropyReducedArguments
from kernel_api.arguments.cross_entropy import reduced_size
from kernel_api.launcher import Launcher

from test_cross_entropy import reference


def _problem(seed, rows=9, cols=33, dtype=torch.float32, ignore_index=-100):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, cols, generator=g) * 3).to(dtype)
    t = torch.randint(0, cols, (rows,), generator=g)
    t[1::4] = ignore_index
    return x, t


def test_reduced_arguments_take_a_buffer():
    x, t = _problem(0)
    args = CrossEntropyReducedArguments(x, t, torch.empty(reduced_size(9)), reduction="mean")
    assert type(args).output_names == ("loss",) and "reduction=mean" in repr(args)
    grad = CrossEntropyReducedArguments(x, t, torch.empty(reduced_size(9)), grad_logits=x.clone(),
                                        grad_loss=torch.ones(9), reduction="sum")
    assert isinstance(grad, CrossEntropyReducedArguments) and type(grad).output_names == ("loss", "grad_logits")
    assert not isinstance(args, CrossEntropyArguments)  # (kernels of the per-row loss never see a buffer)
    assert args.problem_key() != CrossEntropyReducedArguments(x, t, torch.empty(reduced_size(9)),
                                                              reduction="sum").problem_key()
    cases = [
        (lambda: CrossEntropyReducedArguments(x, t, torch.empty(())), ValueError,
         f"operand loss: shape () must be ({reduced_size(9)},) for a mean or a sum over 9 rows"),
        (lambda: CrossEntropyReducedArguments(x, t, torch.empty(reduced_size(9), dtype=torch.float64)), TypeError,
         "operand loss: dtype torch.float64"),
        (lambda: CrossEntropyReducedArguments(x, t, torch.empty(2 * reduced_size(9))[::2]), ValueError,
         "operand loss: strides (2,)"),
        (lambda: CrossEntropyReducedArguments(x, t, torch.empty(reduced_size(9)), reduction="none"), ValueError,
         "reduction: expected 'mean' or 'sum', got 'none'"),
        (lambda: CrossEntropyReducedArguments(x, t[:4], torch.empty(reduced_size(9))), ValueError,
         "operand target: shape (4,) must be (9,)"),
        (lambda: CrossEntropyReducedArguments(x, t, torch.empty(reduced_size(9)), grad_logits=x.clone()), ValueError,
         "operand grad_loss: required with grad_logits"),
    ]
    for make, error, text in cases:
        with pytest.raises(error) as info:
            make()
        assert text in str(info.value) and "\n" not in str(info.value), str(info.value)


def test_the_reduced_kernels_are_offered_and_compile_for_sm90a_without_a_gpu():
    meta = dict(device="meta")
    x, t = torch.empty(3, 32003, dtype=torch.bfloat16, **meta), torch.empty(3, dtype=torch.int32, **meta)
    for reduction in ("mean", "sum"):
        for grad in ({}, dict(grad_logits=x, grad_loss=torch.empty(3, **meta))):
            args = CrossEntropyReducedArguments(x, t, torch.empty(reduced_size(3), **meta), reduction=reduction,
                                                **grad)
            names = {k.metadata.kernel_name for k in kernel_api.get_kernels(args, cc=90)}
            assert names == {"CudaCrossEntropyReduced_bf16_i32", "TorchCrossEntropyReduced_bf16_i32"}, names
            kernel = next(k for k in kernel_api.get_kernels(args, cc=90) if type(k).__name__.startswith("Cuda"))
            assert kernel.compile(args, cc=90).compiled_obj is not None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("options", [dict(), dict(label_smoothing=0.2, z_loss=1e-2, ignore_index=0)])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_the_torch_kernels_reduce_against_float64(cpu_ops, dtype, options, reduction):
    x, t = _problem(hash((str(dtype), reduction, len(options))) % 2**31, rows=13, cols=37, dtype=dtype,
                    ignore_index=options.get("ignore_index", -100))
    weights = torch.rand(13, dtype=torch.float64 if dtype == torch.float64 else torch.float32)
    loss_type = torch.float64 if dtype == torch.float64 else torch.float32
    tol = dict(atol=1e-12, rtol=1e-12) if dtype == torch.float64 else dict(atol=1e-5, rtol=1e-5)
    # the buffer: the loss, a row's weight in it, two zeros, the rows' losses
    kept = (t != options.get("ignore_index", -100)).sum().double()
    weight = 1.0 / kept if reduction == "mean" else torch.ones((), dtype=torch.float64)
    want = torch.cat((reference(x, t, reduction=reduction, **options).view(1), weight.view(1),
                      torch.zeros(2, dtype=torch.float64), reference(x, t, reduction="none", **options)))
    buffer = torch.full((reduced_size(13),), 1234.5, dtype=loss_type)
    args = CrossEntropyReducedArguments(x, t, buffer, reduction=reduction, **options)
    got = ops.call(args)
    assert got is buffer
    torch.testing.assert_close(buffer.double(), want, **tol)
    torch.testing.assert_close(args.reference_outputs()["loss"], want, atol=1e-12, rtol=1e-12)
    grad = torch.full_like(x, 1234.5)
    buffer.fill_(1234.5)
    args = CrossEntropyReducedArguments(x, t, buffer, grad_logits=grad, grad_loss=weights, reduction=reduction,
                                        **options)
    ops.call(args)
    torch.testing.assert_close(buffer.double(), want, **tol)
    xr = x.double().requires_grad_()
    (reference(xr, t, reduction="none", **options) * weights.double()).sum().backward()
    grad_tol = tol if dtype != torch.bfloat16 else dict(atol=8e-3, rtol=8e-3)
    torch.testing.assert_close(grad.double(), xr.grad, **grad_tol)
    torch.testing.assert_close(args.reference_outputs()["grad_logits"], xr.grad, atol=1e-12, rtol=1e-12)


def _in_place(t, dtype):
    """A CPU tensor of ``dtype`` over the memory of the launch's tensor ``t`` (dense)."""
    size = torch.empty((), dtype=dtype).element_size() * math.prod(t.shape)
    memory = (ctypes.c_char * size).from_address(t.data_ptr())
    return torch.frombuffer(memory, dtype=dtype).view(tuple(t.shape))


@pytest.fixture
def c_replay(cpu_ops, monkeypatch):
    """The native entry points, the reduced calls on the CPU taking the Python path that records
    for them, and the torch provider's cross-entropy kernel launching through a TVM-FFI function
    (as the CUDA kernel's recorded launch does), counted."""
    tvm_ffi = pytest.importorskip("tvm_ffi")
    from kernel_api.ops import dispatch
    from kernel_api.providers.torch_ops.cross_entropy import TorchCrossEntropyReduced

    if native.entry() is None:
        pytest.skip(f"no CPython entry points here: {native.why_not_entry()}")
    assert dispatch._load_entry()
    monkeypatch.setattr(sys.modules["kernel_api.ops.cross_entropy"], "RECORDED_DEVICE_TYPES", frozenset({"cpu"}))
    launched = []

    def ffi_launcher(self, args, artifact):
        function, tail = self._launch_parts(args)
        dtypes = [getattr(args, name).dtype for name in args.tensor_attributes]

        def launch(*operands):  # the tensors (as DLTensor pointers: read in place), then the stream
            launched.append(len(operands))
            function(*[_in_place(t, dt) for t, dt in zip(operands, dtypes)], *tail, None)

        return Launcher(tvm_ffi.convert(launch))

    monkeypatch.setattr(TorchCrossEntropyReduced, "_launcher", ffi_launcher)
    with kernel_api.settings(providers=["torch"]):
        yield launched


def _replayed(f, launched):
    """f() until a call is replayed (the made buffer's pointer alignment is part of the key: the
    CPU allocator's vary, so a few calls record a variant each); its result and the frames it
    entered."""
    from test_hardening_host_cost import Frames

    for _ in range(40):
        before = len(launched)
        with Frames() as frames:
            result = f()
        if len(launched) > before:
            assert len(launched) == before + 1
            return result, frames
    raise AssertionError("no call was replayed")


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("options", [dict(), dict(label_smoothing=0.1, z_loss=1e-3, ignore_index=2)])
def test_a_repeated_mean_or_sum_is_one_launch_replayed_from_c(c_replay, reduction, options):
    from launched_ops import LaunchedOps

    x, t = _problem(3, ignore_index=options.get("ignore_index", -100))
    first = ops.cross_entropy(x, t, reduction=reduction, **options)  # the Python path records its launch
    assert c_replay == []
    again, frames = _replayed(lambda: ops.cross_entropy(x, t, reduction=reduction, **options), c_replay)
    inside = next(i for i, f in enumerate(frames.entered) if f.endswith("ffi_launcher.<locals>.launch"))
    ours = [f for f in frames.entered[:inside] if f.startswith("kernel_api.")]  # (before the kernel's own)
    assert ours == ["kernel_api.ops.cross_entropy.cross_entropy"], frames.entered[:inside]
    assert c_replay[-1] == 4  # one launch: logits, target, the made buffer, the stream
    assert again.shape == () and again.dtype == torch.float32 and torch.equal(again, first)
    torch.testing.assert_close(again.double(), reference(x, t, reduction=reduction, **options), atol=1e-5, rtol=1e-5)
    # no torch op after the kernel's own (the kernel here is torch's: its ops run inside the launch)
    with LaunchedOps() as seen:
        ops.cross_entropy(x, t, reduction=reduction, **options)
    assert "div" not in seen.ops and seen.ops.count("sum") <= 2, seen.ops


def test_what_the_key_does_not_hold_takes_the_python_path_and_is_recorded(c_replay):
    x, t = _problem(4)
    kept = t.clamp(min=0)
    for call in (lambda: ops.cross_entropy(x, t), lambda: ops.cross_entropy(x, t, reduction="sum"),
                 lambda: ops.cross_entropy(x, t, z_loss=1e-3), lambda: ops.cross_entropy(x[:5], t[:5]),
                 lambda: ops.cross_entropy(x, kept, ignore_index=3)):
        before = len(c_replay)
        first = call()
        assert len(c_replay) == before  # (the Python path runs the kernel itself)
        again, _ = _replayed(call, c_replay)
        assert torch.equal(first, again)


def test_every_row_ignored_gives_torchs_nan_mean(c_replay):
    x, t = torch.randn(4, 6), torch.full((4,), -100)
    for _ in range(2):
        assert torch.isnan(ops.cross_entropy(x, t))
        assert ops.cross_entropy(x, t, reduction="sum").item() == 0
    assert torch.isnan(torch.nn.functional.cross_entropy(x, t))


def test_make_fx_shows_the_reduced_ops():
    from torch.fx.experimental.proxy_tensor import make_fx

    x, t = torch.randn(4, 7), torch.randint(0, 7, (4,))
    code = make_fx(lambda x, t: ops.cross_entropy(x, t, reduction="sum"), tracing_mode="fake")(x, t).code
    assert "kernel_api.cross_entropy_reduced.default" in code and "sum" not in code.replace("'sum'", "")
    xg = x.clone().requires_grad_()
    code = make_fx(lambda x, t: torch.autograd.grad(ops.cross_entropy(x, t), (x,)), tracing_mode="fake")(xg, t).code
    assert "kernel_api.cross_entropy_reduced_with_grad.default" in code


def test_torch_compile_of_the_mean(cpu_ops):
    torch._dynamo.reset()
    x, t = _problem(5)
    compiled = torch.compile(lambda x, t: ops.cross_entropy(x, t, label_smoothing=0.1), fullgraph=True,
                             backend="aot_eager")
    torch.testing.assert_close(compiled(x, t).double(), reference(x, t, label_smoothing=0.1), atol=1e-5, rtol=1e-5)
    xg = x.clone().requires_grad_()
    compiled(xg, t).backward()
    xr = x.double().requires_grad_()
    reference(xr, t, label_smoothing=0.1).backward()
    torch.testing.assert_close(xg.grad.double(), xr.grad, atol=1e-6, rtol=1e-5)


def test_a_small_differentiable_mean_counts_nothing_before_the_kernel_and_never_syncs(cpu_ops):
    # (`SCALE_WITHOUT_READING_ELEMENTS`: the sum's gradient in the forward, scaled in the backward
    # by the incoming gradient times the row weight the kernel wrote; no count, no read of a value)
    from launched_ops import LaunchedOps

    x, t = _problem(6)
    x.requires_grad_()
    with LaunchedOps() as seen:
        loss = ops.cross_entropy(x, t, label_smoothing=0.1)
        (2.0 * loss).backward()
    assert seen.ops[:2] == ["ones", "cross_entropy_reduced_with_grad"], seen.ops
    assert not {"ne", "sum", "clamp", "eq", "_local_scalar_dense", "item"} & set(seen.ops), seen.ops
    xr = x.detach().double().requires_grad_()
    (2.0 * reference(xr, t, label_smoothing=0.1)).backward()
    torch.testing.assert_close(x.grad.double(), xr.grad, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("case", ["bf16", "f64", "int32-3d", "smoothing", "every-row-ignored", "sum"])
def test_a_small_mean_or_sum_under_autograd_is_torchs_own(case, monkeypatch, cpu_ops):
    """Under autograd a small mean or sum is `F.cross_entropy` in the loss's dtype (C++ autograd
    nodes, no Python frame of ours in the backward): the loss and gradient against float64, the
    ops launched, and what stays ours (a z-loss, more logits than the bound, a restriction to
    other providers, malformed operands)."""
    import importlib

    ce = importlib.import_module("kernel_api.ops.cross_entropy")  # (the module: ops re-exports its function)
    monkeypatch.setattr(ce, "TORCH_AUTOGRAD_DEVICE_TYPES", frozenset({"cpu"}))
    dtype = {"bf16": torch.bfloat16, "f64": torch.float64}.get(case, torch.float32)
    x, t = _problem(7, rows=12, cols=37, dtype=dtype)
    if case == "int32-3d":
        x, t = x.reshape(3, 4, 37), t.reshape(3, 4).int()
    if case == "every-row-ignored":
        t.fill_(-100)
    options = {"label_smoothing": 0.2} if case == "smoothing" else {}
    reduction = "sum" if case == "sum" else "mean"
    xg = x.clone().requires_grad_()
    loss = ops.cross_entropy(xg, t, reduction=reduction, **options)
    # (torch's C++ nodes, NllLoss's among them; ours would be _CrossEntropy's Python node)
    nodes, stack = [], [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is not None:
            nodes.append(node)
            stack.extend(next_fn for next_fn, _ in node.next_functions)
    assert "NllLossBackward0" in {type(n).__name__ for n in nodes}
    assert not any(isinstance(n, torch.autograd.function.BackwardCFunction) for n in nodes), nodes
    (3.0 * loss).backward()
    assert loss.dtype == (torch.float64 if dtype is torch.float64 else torch.float32) and xg.grad.dtype == dtype
    xr = x.detach().double().requires_grad_()
    ref = reference(xr, t.long(), reduction=reduction, **options)
    if case == "every-row-ignored":
        assert torch.isnan(loss)
        return
    (3.0 * ref).backward()
    tol = 2e-2 if dtype is torch.bfloat16 else 1e-5
    torch.testing.assert_close(loss.double(), ref.detach(), atol=tol, rtol=tol)
    torch.testing.assert_close(xg.grad.double(), xr.grad, atol=tol, rtol=tol)
    for other in (dict(z_loss=1e-3), dict(label_smoothing=1.5)):
        assert not ce.torch_serves_autograd(xg, t, other.get("label_smoothing", 0.0), other.get("z_loss", 0.0))
    assert not ce.torch_serves_autograd(xg, t[..., :-1], 0.0, 0.0)
    assert not ce.torch_serves_autograd(xg, t.float(), 0.0, 0.0)
    monkeypatch.setattr(ce, "AUTOGRAD_TORCH_MAX_ELEMENTS", x.numel() - 1)
    assert not ce.torch_serves_autograd(xg, t, 0.0, 0.0)
    monkeypatch.setattr(ce, "AUTOGRAD_TORCH_MAX_ELEMENTS", x.numel())
    assert ce.torch_serves_autograd(xg, t, 0.0, 0.0)
    with kernel_api.settings(providers=["cuda_src"]):
        assert not ce.torch_serves_autograd(xg, t, 0.0, 0.0)
