"""The replay of the generated operations' repeated calls (`kernel_api.ops.replay`) on the CPU.

The front door launches on CPU tensors here (the tests add "cpu" to
`dispatch.LAUNCH_DEVICE_TYPES`): the torch provider's norm, pointwise and cross-entropy kernels
compute anywhere, and a toy operation whose arguments view their input stands in for kernels
whose launches take reshaped operands. What is checked: a replayed call gives the Python path's
results bit for bit and really skips it (counted calls of the front door's `_launch`), other
metadata or settings choose again, errors are still explained, given outputs, autograd and
torch.compile; kernels whose launches take a workspace are replayed, and host-bound problems go
to the CUDA kernels that record their launches rather than to the torch provider's.
"""

from __future__ import annotations

import importlib
import os
import sys

import pytest
import torch
import torch.nn.functional as F

import kernel_api
from kernel_api import (Arguments, CompiledArtifact, Kernel, KernelMetadata, Status, TensorAttributes, native, ops,
                        registry)
from kernel_api.dtypes import from_torch
from kernel_api.launcher import Launcher
from kernel_api.metadata import OperandsMetadata
from kernel_api.ops import Operation, define_operation, dispatch, replay


def count_python_path(monkeypatch) -> list[str]:
    """Fresh front-door caches, and a list that gets the arguments type of each launch the
    Python path makes (a replayed call adds nothing)."""
    ops.clear_dispatch_cache()
    launches = []
    python_path = dispatch._launch

    def counting(args, *a, **kw):
        launches.append(type(args).__name__)
        return python_path(args, *a, **kw)

    monkeypatch.setattr(dispatch, "_launch", counting)
    return launches


@pytest.fixture
def cpu_ops(monkeypatch):
    """The front door on CPU tensors, fresh caches, and the count of Python-path launches."""
    monkeypatch.setattr(dispatch, "LAUNCH_DEVICE_TYPES", frozenset({"cuda", "cpu"}))
    launches = count_python_path(monkeypatch)
    yield launches
    monkeypatch.undo()
    ops.clear_dispatch_cache()


def _twice(f):
    """f() on the Python path, then again (replayed once recorded): both results."""
    first = f()
    first = tuple(t.clone() for t in first) if isinstance(first, tuple) else first.clone()
    return first, f()


def _settled(f, launches, first=None):
    """Call f until the pointer alignments its made outputs take (a part of the key of calls
    that make their outputs; the CPU allocator gives 64-byte alignment, so up to five per
    output) are all recorded: a batch of calls that the Python path serves none of. (A long
    process's allocator can take a rare alignment late: 80 batches leave it room.)"""
    for _ in range(80):
        made = len(launches)
        for _ in range(8):
            result = f()
            if first is not None:
                _same(first, result)
        if len(launches) == made:
            return
    raise AssertionError(f"still {len(launches) - made} Python-path launches in a batch of 8 calls")


def _same(a, b):
    if isinstance(a, tuple):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _same(x, y)
        return
    assert a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
    assert torch.equal(a, b)


def _on_torch(f):
    """f under the torch provider alone (the CUDA source kernels do not launch on the CPU)."""
    def call():
        with kernel_api.settings(providers=["torch"]):
            return f()
    return call


def _cases():
    x, r = torch.randn(5, 3, 24), torch.randn(5, 3, 24)
    w, b = torch.randn(24), torch.randn(24)
    g, u, dy = torch.randn(6, 40, dtype=torch.bfloat16), torch.randn(6, 40, dtype=torch.bfloat16), torch.randn(6, 40)
    q, k = torch.randn(2, 4, 7, 16), torch.randn(2, 2, 7, 16)
    cos, sin = torch.randn(1, 7, 16), torch.randn(1, 7, 16)
    qt, kt = torch.randn(2, 7, 4, 16).transpose(1, 2), torch.randn(2, 7, 2, 16).transpose(1, 2)
    logits, target = torch.randn(9, 33), torch.randint(0, 33, (9,))
    grad_loss = torch.randn(9)
    a, bt, bias = torch.randn(6, 24), torch.randn(24, 40), torch.randn(40)
    p = torch.softmax(torch.randn(6, 40), -1)
    # (inputs made once: an input made per call takes a new pointer alignment, part of the call
    # key, each time, so the calls would settle only when every combination had been seen)
    dy_bf16, lse = dy.bfloat16(), torch.logsumexp(logits, -1)
    return {
        # the torch ops a compiled graph calls (their implementations replay as the front doors do)
        "gemm_op": lambda: torch.ops.kernel_api.gemm(a, bt, None, bias, 1.0, 0.0, None),
        "gemm_op_gelu": lambda: torch.ops.kernel_api.gemm(a, bt, None, bias, 1.0, 0.0, "gelu"),
        "softmax_op": lambda: torch.ops.kernel_api.softmax(dy, -1),
        "softmax_backward_op": lambda: torch.ops.kernel_api.softmax_backward(dy, p, -1),
        "rms_norm": lambda: ops.rms_norm(x, w, 1e-6),
        "rms_norm_residual": lambda: ops.rms_norm(x, w, 1e-5, r),
        "rms_norm_backward": lambda: ops.rms_norm_backward(r, x, w, 1e-6),
        "layer_norm": lambda: ops.layer_norm(x, w, b, 1e-5),
        "layer_norm_residual": lambda: ops.layer_norm(x, w, b, 1e-5, r),
        "layer_norm_backward": lambda: ops.layer_norm_backward(r, x, w, 1e-5),
        "swiglu": lambda: ops.swiglu(g, u),
        "geglu": lambda: ops.geglu(g, u),
        "gated_backward": lambda: ops.gated_activation_backward(dy_bf16, g, u, "gelu_tanh"),
        "rope": lambda: ops.rope(q, k, cos, sin),
        # dense but not contiguous: the outputs keep q's and k's memory order (the fake's empty_like)
        "rope_transposed": lambda: ops.rope(qt, kt, cos, sin),
        "rope_backward": lambda: ops.rope_backward(q, k, cos, sin, 1),
        "cross_entropy": lambda: ops.cross_entropy(logits, target, reduction="none"),
        "cross_entropy_backward": lambda: torch.ops.kernel_api.cross_entropy_backward(grad_loss, logits, target, lse),
    }


@pytest.mark.parametrize("name", sorted(_cases()))
def test_a_repeated_call_is_replayed_with_the_python_paths_results(cpu_ops, name):
    f = _on_torch(_cases()[name])
    first, again = _twice(f)
    _same(first, again)
    _settled(f, cpu_ops, first)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_torch_providers_launches_write_what_their_copies_wrote(cpu_ops, dtype):
    # The launch functions write through out= (one rounding of the f32 result, as copy_ made).
    torch_only = kernel_api.settings(providers=["torch"])
    torch_only.__enter__()
    g, u = torch.randn(64, 96, dtype=torch.bfloat16), torch.randn(64, 96, dtype=torch.bfloat16)
    g, u = g.to(dtype), u.to(dtype)
    try:
        for _ in range(2):
            _same(ops.swiglu(g, u), (F.silu(g.float()) * u.float()).to(dtype))
            _same(ops.geglu(g, u, "none"), (F.gelu(g.float()) * u.float()).to(dtype))
        q = torch.randn(2, 3, 5, 8, dtype=dtype)
        cos, sin = torch.randn(1, 5, 8), torch.randn(1, 5, 8)
        half = lambda t: torch.cat((-t[..., 4:], t[..., :4]), -1)  # noqa: E731
        c, s = cos.unsqueeze(1), sin.unsqueeze(1)
        _same(ops.rope(q, q.clone(), cos, sin)[0], (q.float() * c + half(q.float()) * s).to(dtype))
    finally:
        torch_only.__exit__(None, None, None)


def test_the_torch_layer_norm_backward_runs_torchs_own_kernels():
    # native_layer_norm for the statistics and its backward kernel: a few launches a call, not a
    # composite of a couple of dozen (what a repeated call's host time is made of).
    from launched_ops import LaunchedOps

    from kernel_api.providers.torch_ops import norms

    dy, x, w = torch.randn(4, 33), torch.randn(4, 33), torch.randn(33)
    grads = torch.empty(4, 33), torch.empty(33), torch.empty(33)
    with LaunchedOps() as seen:
        norms._layer_norm_backward(dy, x, w, *grads, 1e-5, None)
    assert {"native_layer_norm", "native_layer_norm_backward"} <= set(seen.ops) and len(seen.ops) <= 5, seen.ops
    xr, wr, br = (t.clone().requires_grad_() for t in (x, w, torch.zeros(33)))
    for got, want in zip(grads, torch.autograd.grad(F.layer_norm(xr, (33,), wr, br, 1e-5), (xr, wr, br), dy)):
        torch.testing.assert_close(got, want)


def test_other_metadata_chooses_again(cpu_ops):
    # (outputs given: a key of fixed pointers)
    w = torch.randn(64)
    x = torch.randn(8, 64)
    out = torch.empty(8, 64)
    ops.rms_norm(x, w, out=out)
    x.copy_(torch.randn(8, 64))  # other values: the same key
    ops.rms_norm(x, w, out=out)
    assert len(cpu_ops) == 1
    wide = torch.randn(8, 80)
    flat = torch.randn(8 * 64 + 1)
    others = {
        "shape": torch.randn(4, 64),
        "strides": wide[:, :64],
        "alignment": flat[1:].view(8, 64),
        "dtype": torch.randn(8, 64, dtype=torch.float64),
    }
    for what, other in others.items():
        before = len(cpu_ops)
        weight = w.double() if other.dtype == torch.float64 else w
        y = torch.empty(other.shape, dtype=other.dtype)
        ops.rms_norm(other, weight, out=y)
        assert len(cpu_ops) == before + 1, what
        torch.testing.assert_close(y, F.rms_norm(other, (64,), weight, 1e-6))
        ops.rms_norm(other, weight, out=y)
        assert len(cpu_ops) == before + 1, what  # and then replayed
    ops.rms_norm(x, w, 1e-3, out=out)  # another eps: the values of the other inputs are part of the key
    assert len(cpu_ops) == 6
    ops.rms_norm(x, w, 1e-3, out=out)
    assert len(cpu_ops) == 6
    misaligned = torch.empty(8 * 64 + 1)[1:].view(8, 64)  # another output alignment
    ops.rms_norm(x, w, 1e-3, out=misaligned)
    assert len(cpu_ops) == 7


def test_settings_and_clearing_choose_again(cpu_ops):
    x, w, out = torch.randn(8, 64), torch.randn(64), torch.empty(8, 64)
    ops.rms_norm(x, w, out=out)
    with kernel_api.settings(providers=["torch"]):
        ops.rms_norm(x, w, out=out)
        ops.rms_norm(x, w, out=out)
    assert len(cpu_ops) == 2
    with kernel_api.settings(policy=kernel_api.PickAny()):
        ops.rms_norm(x, w, out=out)
    assert len(cpu_ops) == 3
    ops.rms_norm(x, w, out=out)
    assert len(cpu_ops) == 3
    ops.clear_dispatch_cache()
    ops.rms_norm(x, w, out=out)
    assert len(cpu_ops) == 4


def _error(f):
    with pytest.raises(Exception) as caught:
        f()
    return type(caught.value), str(caught.value)


def test_errors_after_a_replayed_call_are_the_python_paths(cpu_ops):
    x, w = torch.randn(8, 64), torch.randn(64)
    out = torch.empty(8, 64)
    bad = {
        "weight": lambda: ops.rms_norm(x, torch.randn(32)),
        "eps bool": lambda: ops.rms_norm(x, w, True),
        "eps int": lambda: ops.rms_norm(x, w, -1),
        "out overlaps x": lambda: ops.rms_norm(x, w, out=x),
        "out wrong dtype": lambda: ops.rms_norm(x, w, out=torch.empty(8, 64, dtype=torch.float64)),
        "not a tensor": lambda: ops.rms_norm(x.tolist(), w),
    }
    fresh = {name: _error(f) for name, f in bad.items()}
    ops.clear_dispatch_cache()
    ops.rms_norm(x, w, 1.0)
    ops.rms_norm(x, w, out=out)
    ops.rms_norm(x, w, out=out)  # recorded and replayed
    for name, f in bad.items():
        kind, message = _error(f)
        assert (kind, message) == fresh[name], name
        assert "\n" not in message, name


def test_given_outputs_replay_unless_they_overlap(cpu_ops):
    x, r, w = torch.randn(8, 64), torch.randn(8, 64), torch.randn(64)
    out, s = torch.full((8, 64), 7.0), torch.full((8, 64), 7.0)
    y, t = ops.rms_norm(x, w, 1e-6, r, out=out, residual_out=s)
    assert y is out and t is s
    version = out._version
    y, t = ops.rms_norm(x, w, 1e-6, r, out=out, residual_out=s)
    assert y is out and t is s and len(cpu_ops) == 1
    assert out._version > version  # bumped, as a torch in-place op would
    torch.testing.assert_close(s, x + r)
    torch.testing.assert_close(out, F.rms_norm(x + r, (64,), w, 1e-6))
    # The same metadata, but residual_out is x's memory: the Python path judges (and refuses) it.
    with pytest.raises(ValueError, match="operand residual_out: overlaps x"):
        ops.rms_norm(x, w, 1e-6, r, out=out, residual_out=x)
    # One output given, the other made here.
    y, t = ops.rms_norm(x, w, 1e-6, r, out=out)
    t = t.clone()
    _settled(lambda: ops.rms_norm(x, w, 1e-6, r, out=out)[1], cpu_ops, t)
    assert ops.rms_norm(x, w, 1e-6, r, out=out)[0] is out


def test_trailing_defaulted_inputs_left_out_need_no_binding(cpu_ops, monkeypatch):
    # A call leaving out the trailing inputs that have defaults (eps, ignore_index...) takes them
    # from the schema without a signature binding (about as costly as the replay itself);
    # inputs by name still bind, and a wrong call still explains.
    import inspect

    x, w, logits = torch.randn(8, 64), torch.randn(64), torch.randn(6, 9)
    target, grad_loss = torch.randint(0, 9, (6,)), torch.rand(6)
    lse = torch.logsumexp(logits, -1)
    want_norm = ops.rms_norm_backward(x, x, w, 1e-6)
    want_ce = ops.cross_entropy_backward(grad_loss, logits, target, lse, -100, 0.0, 0.0)
    bind = inspect.Signature.bind

    def refused(*args, **kwargs):
        raise AssertionError("bound")

    monkeypatch.setattr(inspect.Signature, "bind", refused)
    for _ in range(2):
        _same(ops.rms_norm_backward(x, x, w), want_norm)
        _same(ops.cross_entropy_backward(grad_loss, logits, target, lse), want_ce)
        _same(ops.cross_entropy_backward(grad_loss, logits, target, lse, -100), want_ce)
    monkeypatch.setattr(inspect.Signature, "bind", bind)
    _same(ops.cross_entropy_backward(grad_loss, logits, target, lse=lse), want_ce)
    with pytest.raises(TypeError, match="missing a required argument: 'lse'"):
        ops.cross_entropy_backward(grad_loss, logits, target)


def test_outputs_apart():
    buffer = torch.zeros(100)
    a, b, c = buffer[:40], buffer[40:80], buffer[70:]
    extents = tuple(t.numel() * 4 for t in (a, b, c))
    assert replay.outputs_apart((a, b), 1, extents[:2])
    assert not replay.outputs_apart((a, b, c), 2, extents)  # c starts inside b
    assert replay.outputs_apart((buffer[:0], a), 1, (0, 160))


def test_unusual_calls_take_the_python_path(cpu_ops):
    x, w, out = torch.randn(8, 64), torch.randn(64), torch.empty(8, 64)
    ops.rms_norm(x, w, out=out)
    ops.rms_norm(x, w, out=out)
    assert len(cpu_ops) == 1

    class Marked(torch.Tensor):
        pass

    ops.rms_norm(x.as_subclass(Marked), w, out=out)  # a tensor subclass
    ops.rms_norm(x, w, out=out.as_subclass(Marked))
    ops.rms_norm(x, w, out=out, stream=0)  # a stream given
    assert len(cpu_ops) == 4
    with pytest.raises(ValueError, match="negative"):  # a lazy bit: the arguments refuse it
        ops.rms_norm(torch._neg_view(x), w, out=out)
    with torch.no_grad():
        ops.rms_norm(x, w, out=out)  # no grad mode: still replayed
    assert len(cpu_ops) == 4


def test_python_keys_when_the_native_entry_points_are_missing(cpu_ops, monkeypatch):
    monkeypatch.setattr(replay, "_recall", None)
    monkeypatch.setattr(replay, "_remember", None)
    monkeypatch.setattr(replay.native, "entry", lambda: None)
    x, w, out = torch.randn(8, 64), torch.randn(64), torch.empty(8, 64)
    first, again = _twice(lambda: ops.rms_norm(x, w))
    _same(first, again)
    _settled(lambda: ops.rms_norm(x, w), cpu_ops, first)
    ops.rms_norm(x, w, out=out)
    made = len(cpu_ops)
    ops.rms_norm(x, w, out=out)
    assert len(cpu_ops) == made and replay._python_store
    ops.rms_norm(torch.randn(4, 64), w)
    assert len(cpu_ops) == made + 1
    ops.clear_dispatch_cache()
    assert not replay._python_store


def test_autograd_and_torch_compile_are_unchanged(cpu_ops):
    x, w = torch.randn(8, 64, dtype=torch.float64), torch.randn(64, dtype=torch.float64)
    ref_x, ref_w = x.clone().requires_grad_(), w.clone().requires_grad_()
    F.rms_norm(ref_x, (64,), ref_w, 1e-6).square().sum().backward()
    a, b = x.clone().requires_grad_(), w.clone().requires_grad_()

    def step():  # the autograd forward and the backward op reach the torch op's implementation
        a.grad = b.grad = None
        y = ops.rms_norm(a, b)
        assert y.requires_grad
        y.square().sum().backward()
        torch.testing.assert_close(a.grad, ref_x.grad)
        torch.testing.assert_close(b.grad, ref_w.grad)

    _settled(step, cpu_ops)
    assert set(cpu_ops) == {"RMSNormArguments", "RMSNormBackwardArguments"}
    assert torch.autograd.gradcheck(lambda a, b: ops.rms_norm(a, b), (x[:2, :5].clone().requires_grad_(),
                                                                        w[:5].clone().requires_grad_()))
    compiled = torch.compile(lambda a, b: ops.rms_norm(a, b) * 2, fullgraph=True, backend="aot_eager")
    for _ in range(2):
        torch.testing.assert_close(compiled(x, w), F.rms_norm(x, (64,), w, 1e-6) * 2)


# ---- a toy operation whose arguments view the input (rows of a 2-D view) ----

class ToyRowsArguments(Arguments):
    """``out = x * scale`` over ``x`` seen as (rows, last dimension)."""

    __slots__ = ("x", "out", "scale")
    output_names = ("out",)

    def __init__(self, x: torch.Tensor, scale: float, out: torch.Tensor) -> None:
        if not isinstance(x, torch.Tensor) or not x.is_contiguous() or x.dim() < 1:
            raise ValueError("operand x: a contiguous tensor")
        if not isinstance(out, torch.Tensor) or out.shape != x.shape:
            raise ValueError(f"operand out: shape must equal x's {tuple(x.shape)}")
        self.x, self.out = x.view(-1, x.shape[-1]), out
        self.scale = float(scale)
        self.device, self.device_index = x.device, x.get_device()
        self._verdicts = self._binding = None
        attrs = TensorAttributes(from_torch(x.dtype), (0, 1), 1)
        self.tensor_attributes = {"x": attrs, "out": attrs}
        self.signature = ("toy_rows", attrs.key(), self.device_index)

    def problem_key(self) -> tuple:
        return (self.signature, tuple(self.x.shape))


class ToyRowsOperands(OperandsMetadata):
    operand_names = ("x", "out")
    arguments_type = ToyRowsArguments

    def __init__(self, x: TensorAttributes, out: TensorAttributes) -> None:
        self.x, self.out = x, out


class ToyReplayProvider(kernel_api.Provider):
    name = "toy_replay"


def _rows_launch(x: torch.Tensor, out: torch.Tensor, scale: float, stream) -> None:
    assert x.dim() == 2  # the arguments' own view, remade by the replay
    torch.mul(x, scale, out=out.view(x.shape))


class ToyRows(Kernel):
    supported_args_type = ToyRowsArguments
    workspace_free = True
    runs = 0

    @staticmethod
    def generate_kernels(metadata_filter, epilogue_args=None, cc=None):
        attrs = TensorAttributes("f32", (0, 1), 1)
        md = KernelMetadata("ToyRows_f32", ToyRows, ToyRowsOperands(attrs, attrs))
        return [ToyRows(md)] if metadata_filter is None or metadata_filter(md) else []

    def _supports(self, args):
        return Status.success()

    def get_workspace_size(self, args):
        return 0

    def compile(self, args, cc=None):
        return CompiledArtifact(None, self)

    def _run(self, args, artifact, stream, workspace=None):
        type(self).runs += 1
        _rows_launch(args.x, args.out, args.scale, stream)

    def _launcher(self, args, artifact):
        return Launcher(_rows_launch, (args.scale,))


toy_rows = define_operation(Operation(name="toy_replay::rows", schema="(Tensor x, float scale) -> Tensor",
                                      arguments=lambda x, scale, *, out: ToyRowsArguments(x, scale, out)))


@pytest.fixture
def toy(cpu_ops):
    kernel_api.register_provider(ToyReplayProvider)
    ToyReplayProvider.register(ToyRows)
    ToyRows.runs = 0
    yield cpu_ops
    registry.unregister_provider("toy_replay")


def test_views_the_arguments_make_are_remade(toy):
    x = torch.randn(2, 3, 5)
    out = torch.empty(2, 3, 5)
    _same(toy_rows(x, 2.0, out=out), x * 2.0)
    for _ in range(3):
        x.copy_(torch.randn(2, 3, 5))
        _same(toy_rows(x, 2.0, out=out), x * 2.0)
    assert len(toy) == 1 and ToyRows.runs == 1
    _same(toy_rows(x, 3.0, out=out), x * 3.0)  # another scale: recorded apart
    assert len(toy) == 2
    _settled(lambda: toy_rows(x, 3.0), toy, x * 3.0)
    out = torch.empty_like(x)
    step = replay.derivation(ToyRowsArguments(x, 1.0, out), (x, out))
    assert step[0] == (0, (6, 5), (5, 1), 0)


def test_a_kernel_without_a_launch_to_replay_is_asked_once(toy, monkeypatch):
    monkeypatch.setattr(ToyRows, "_launcher", lambda self, args, artifact: None)
    records = []
    record = replay.OperationReplay._record
    monkeypatch.setattr(replay.OperationReplay, "_record", lambda *a: records.append(1) or record(*a))
    x, out = torch.randn(2, 3, 5), torch.empty(2, 3, 5)
    for _ in range(3):
        _same(toy_rows(x, 2.0, out=out), x * 2.0)
    assert len(toy) == 3 and ToyRows.runs == 3  # every call on the Python path
    assert len(records) == 1  # the kernel's refusal recorded for the metadata
    runs = ToyRows.runs
    # (made outputs: one record per alignment they take; then none)
    _settled(lambda: toy_rows(x, 2.0), records, x * 2.0)
    assert len(records) <= 6 and ToyRows.runs > runs + 8  # still the Python path


def test_a_kernel_whose_launches_take_a_workspace_is_replayed(toy, monkeypatch):
    # Its launcher's function makes the workspace per call, as `_run` receives one from `run`.
    workspaces = []

    def run(self, args, artifact, stream, workspace=None):
        assert workspace is not None and workspace.numel() >= 64
        type(self).runs += 1
        _rows_launch(args.x, args.out, args.scale, stream)

    def with_workspace(x, out, scale, stream):
        workspaces.append(torch.empty(64, dtype=torch.uint8, device=x.device))
        _rows_launch(x, out, scale, stream)

    monkeypatch.setattr(ToyRows, "workspace_free", False)
    monkeypatch.setattr(ToyRows, "get_workspace_size", lambda self, args: 64)
    monkeypatch.setattr(ToyRows, "_run", run)
    monkeypatch.setattr(ToyRows, "_launcher", lambda self, args, artifact: Launcher(with_workspace, (args.scale,)))
    x, out = torch.randn(2, 3, 5), torch.empty(2, 3, 5)
    for _ in range(4):
        x.copy_(torch.randn(2, 3, 5))
        _same(toy_rows(x, 2.0, out=out), x * 2.0)
    assert len(toy) == 1 and ToyRows.runs == 1  # the first call on the Python path, with run's workspace
    assert len(workspaces) == 3  # the others replayed, each with a workspace of its own
    _settled(lambda: toy_rows(x, 2.0), toy, x * 2.0)
    assert ToyRows.runs < 10


def _meta(*shape, dtype=torch.bfloat16):
    return torch.empty(*shape, device="meta", dtype=dtype)


@pytest.mark.parametrize("name", ["rms_norm_backward", "layer_norm_backward", "cross_entropy",
                                  "cross_entropy_backward"])
@pytest.mark.parametrize("n", [16, 65536])
def test_host_bound_problems_go_to_our_replayable_cuda_kernels(name, n):
    # Problems the front door gives to replayable kernels first (`dispatch.replayable_first`):
    # the CUDA norm backwards (their launcher makes the workspace) and cross-entropy kernels
    # offer a launcher, so PickAny takes them over the torch provider's composites; large
    # problems (every candidate kept) still go to them.
    from kernel_api.arguments import (CrossEntropyArguments, CrossEntropyBackwardArguments,
                                      LayerNormBackwardArguments, RMSNormBackwardArguments)

    rows, x, w = _meta(n, 1024), _meta(n, 1024), _meta(1024)
    logits, target, per_row = _meta(n, 4096), _meta(n, dtype=torch.int64), _meta(n, dtype=torch.float32)
    args = {
        "rms_norm_backward": lambda: RMSNormBackwardArguments(rows, x, w, _meta(n, 1024), _meta(1024)),
        "layer_norm_backward": lambda: LayerNormBackwardArguments(rows, x, w, _meta(n, 1024), _meta(1024),
                                                                  _meta(1024)),
        "cross_entropy": lambda: CrossEntropyArguments(logits, target, per_row, _meta(n, dtype=torch.float32)),
        "cross_entropy_backward": lambda: CrossEntropyBackwardArguments(per_row, logits, target,
                                                                        _meta(n, dtype=torch.float32),
                                                                        _meta(n, 4096)),
    }[name]()
    candidates = registry.get_kernels(args)
    kept = dispatch.replayable_first(candidates, args)
    assert len(kept) == len(candidates)
    assert kernel_api.PickAny().choose(args, kept).metadata.kernel_name.startswith("Cuda")


def test_an_operation_without_tensor_inputs_takes_the_python_path():
    schema = torch._C.parse_schema("toy_replay::fill(float value) -> Tensor")
    made = []
    no_tensors = replay.OperationReplay(5, "toy_replay::fill", schema, lambda value: torch.empty(3),
                                        lambda value, *, out: made.append(value), ("out",))
    assert no_tensors.fresh((1.0,)) is replay.DECLINED
    assert no_tensors.given((1.0,), (torch.empty(3),)) is replay.DECLINED
    unnumbered = replay.OperationReplay(1 << 11, "toy_replay::fill", torch._C.parse_schema(
        "toy_replay::scale(Tensor x) -> Tensor"), lambda x: torch.empty_like(x), lambda x, *, out: None, ("out",))
    assert unnumbered.fresh((torch.ones(3),)) is replay.DECLINED


_PACKAGE = os.path.dirname(kernel_api.__file__) + os.sep


def _kernel_api_frames(f):
    """f() with the Python frames it runs (file, function) and the C functions Python code calls."""
    seen = []

    def profile(frame, event, arg):
        if event == "call":
            seen.append((frame.f_code.co_filename, frame.f_code.co_name))
        elif event == "c_call":
            seen.append(("<C>", getattr(arg, "__name__", "")))

    sys.setprofile(profile)
    try:
        result = f()
    finally:
        sys.setprofile(None)
    return result, seen


#: ops.attention's own frame: none where the front door is a C function (native/front_door.cc)
_FRONT_DOOR_FRAME = [] if native.front_door_module() is not None else ["attention"]


@pytest.mark.parametrize("causal", [False, True])
def test_a_repeated_attention_call_is_sdpas_call_replayed_from_c(cpu_ops, causal):
    """Where SDPA serves, a repeated ops.attention call runs from C as the one SDPA call its
    Python path made: no Python frame of kernel_api's beyond ops.attention and the launcher's
    SDPA call (not even ops.attention's where it is a C function), no output made only to be
    replaced by SDPA's; the Python path's results."""
    if native.entry() is None:
        pytest.skip(f"native entry points unavailable: {native.why_not_entry()}")
    q, k, v = torch.randn(2, 6, 4, 16), torch.randn(2, 6, 2, 16), torch.randn(2, 6, 2, 16)  # GQA
    with kernel_api.settings(providers=["torch"]):
        first = ops.attention(q, k, v, causal=causal).clone()
        made = len(cpu_ops)
        result, seen = _kernel_api_frames(lambda: ops.attention(q, k, v, causal=causal))
        again = ops.attention(q, k, v, causal=causal)
    assert len(cpu_ops) == made == 1
    ours = [name for file, name in seen if file.startswith(_PACKAGE)]
    assert ours == _FRONT_DOOR_FRAME + ["call"], seen
    assert not {"empty_like", "new_empty", "empty", "set_", "copy_"} & {name for file, name in seen if file == "<C>"}
    _same(first, result)
    _same(first, again)
    reference = F.scaled_dot_product_attention(q.transpose(1, 2).double(), k.transpose(1, 2).double(),
                                               v.transpose(1, 2).double(), is_causal=causal,
                                               enable_gqa=True).transpose(1, 2)
    torch.testing.assert_close(result.double(), reference, rtol=1e-5, atol=1e-5)


def test_attention_calls_the_c_replay_leaves_to_python(cpu_ops):
    """Calls given an optional tensor whose values steer the result (a KV cache's lengths) are not
    replayed from C: each such call's result is the Python path's."""
    if native.entry() is None:
        pytest.skip(f"native entry points unavailable: {native.why_not_entry()}")
    q, k, v = torch.randn(2, 1, 4, 16), torch.randn(2, 9, 4, 16), torch.randn(2, 9, 4, 16)
    with kernel_api.settings(providers=["torch"]):
        results = []
        for lengths in ([9, 3], [2, 7], [9, 3]):
            cache_seqlens = torch.tensor(lengths, dtype=torch.int32)
            results.append(ops.attention(q, k, v, cache_seqlens=cache_seqlens).clone())
    assert not torch.equal(results[0], results[1])
    _same(results[0], results[2])
    for row, n in enumerate([2, 7]):
        want = F.scaled_dot_product_attention(q[row:row + 1].transpose(1, 2), k[row:row + 1, :n].transpose(1, 2),
                                              v[row:row + 1, :n].transpose(1, 2)).transpose(1, 2)
        torch.testing.assert_close(results[1][row:row + 1], want)


def test_a_repeated_attention_call_given_its_output_is_replayed_from_c(cpu_ops):
    """A repeated ops.attention(out=) runs from C as SDPA's call writing the given output (its
    version bumped); an output that is an input's memory declines to the Python path."""
    if native.entry() is None:
        pytest.skip(f"native entry points unavailable: {native.why_not_entry()}")
    q, k, v = (torch.randn(2, 6, 4, 16) for _ in range(3))
    out = torch.full_like(q, float("nan"))
    with kernel_api.settings(providers=["torch"]):
        assert ops.attention(q, k, v, out=out) is out
        want = out.clone()
        out.fill_(float("nan"))
        version = out._version
        result, seen = _kernel_api_frames(lambda: ops.attention(q, k, v, out=out))
        assert result is out
        assert out._version > version
        assert [name for file, name in seen if file.startswith(_PACKAGE)] == _FRONT_DOOR_FRAME + ["call"], seen
        _same(want, out)
        assert len(cpu_ops) == 1
        for _ in range(2):
            x = q.clone()
            result, seen = _kernel_api_frames(lambda: ops.attention(x, k, v, out=x))
            assert result is x
            replayed = _FRONT_DOOR_FRAME + ["call"]
            assert [name for file, name in seen if file.startswith(_PACKAGE)][:len(replayed)] != replayed
            _same(want, x)


def test_a_torch_call_returning_another_layout_is_not_replayed_from_c(cpu_ops, monkeypatch):
    """When SDPA lays its output out otherwise than the op's made output (its math backend's
    (batch, heads, seqlen, head_dim) order), the Python path copies into the made output, and no
    C recipe returning SDPA's output is recorded: every call returns a dense output."""
    if native.entry() is None:
        pytest.skip(f"native entry points unavailable: {native.why_not_entry()}")
    from kernel_api.providers.torch_ops import attention as provider

    attention_module = importlib.import_module("kernel_api.ops.attention")  # (ops.attention is the function)

    sdpa = provider._sdpa
    monkeypatch.setattr(provider, "_sdpa", lambda *a, **kw: sdpa(*a, **kw).contiguous())
    q, k, v = (torch.randn(2, 6, 4, 16) for _ in range(3))
    with kernel_api.settings(providers=["torch"]):
        results = [ops.attention(q, k, v) for _ in range(3)]
        assert dispatch._load_entry()
        key = (attention_module._ATTENTION_NUMBER, q, k, v, False, *[None] * 8)  # (inputs, out, stream)
        recorded = dispatch._entry.recipe(*key)
        monkeypatch.setattr(provider, "_sdpa", sdpa)
        ops.clear_dispatch_cache()
        ops.attention(q, k, v)
        assert dispatch._entry.recipe(*key) is not None  # (the same lookup finds SDPA's own)
    assert recorded is None
    for r in results:
        assert r.is_contiguous()
        _same(results[0], r)


def test_no_torch_call_is_checked_or_recorded_during_a_cuda_graph_capture(cpu_ops, monkeypatch):
    """Recording a made output's torch call runs it once to check what it returns: never while a
    CUDA graph is captured (the extra launch would be captured); such calls record nothing for C."""
    if native.entry() is None:
        pytest.skip(f"native entry points unavailable: {native.why_not_entry()}")
    attention_module = importlib.import_module("kernel_api.ops.attention")
    checked = []
    returns_like = replay._returns_like
    monkeypatch.setattr(replay, "_returns_like", lambda *a: checked.append(1) or returns_like(*a))
    monkeypatch.setattr(replay, "_capturing", lambda args: True)
    q, k, v = (torch.randn(2, 6, 4, 16) for _ in range(3))
    with kernel_api.settings(providers=["torch"]):
        ops.attention(q, k, v)
        assert dispatch._load_entry()
        assert dispatch._entry.recipe(attention_module._ATTENTION_NUMBER, q, k, v, False, *[None] * 8) is None
    assert not checked
