"""Operands kernels would get wrong without a word: tensors with torch's lazy negative
or conjugate bit, outputs whose elements overlap, outputs autograd saved, and operands that
are not tensors; plus GemmArguments' recalled summaries for explicit accumulators.

The CPU tests stand a Python callable converted to a TVM-FFI function in for a compiled kernel,
recorded for replay as a front door records it (as tests/test_native_replay.py does); the `gpu`
tests run the registry's kernels.
"""

from __future__ import annotations

import itertools

import pytest
import torch

import kernel_api
import kernel_api.arguments.gemm as arguments  # GemmArguments and the summaries it recalls
from kernel_api import EpilogueArguments, GemmArguments, SoftmaxArguments, SoftmaxBackwardArguments, native
from kernel_api.arguments.base import _overlaps
from kernel_api.dtypes import DataType
from kernel_api.launcher import Launcher
from kernel_api.ops import dispatch as ops  # the front door's module: its caches and launch records
from kernel_api.tuning.settings import current


def _neg(t: torch.Tensor) -> torch.Tensor:
    """t's memory read as -t by torch, and as t by anything that reads it through DLPack."""
    view = torch._neg_view(t)
    assert view.is_neg() and view.data_ptr() == t.data_ptr()
    return view


def _needs_native():
    tvm_ffi = pytest.importorskip("tvm_ffi")
    if native.module_path() is None:
        pytest.skip("kernel_api.native._launch_table was not built by this install")
    if native.entry() is None:
        pytest.skip(f"no CPython entry points here: {native.why_not_entry()}")
    return tvm_ffi


@pytest.fixture
def entry():
    _needs_native()
    module = native.entry()
    ops.clear_dispatch_cache()
    assert ops._load_entry()
    yield module
    ops.clear_dispatch_cache()


class Recorder:
    """A TVM-FFI function that counts its calls."""

    def __init__(self):
        import tvm_ffi

        self.calls = 0

        def call(*args):
            self.calls += 1

        self.function = tvm_ffi.convert(call)


class _Chosen:
    """A stand-in for the kernel a front door's Python path chose: its `_launcher` is ``launcher``."""

    def __init__(self, launcher):
        self.launcher = launcher

    def _launcher(self, args, artifact):
        return self.launcher


def _gemm_call(A, B, out):
    """``ops.gemm(A, B, out=out)``'s arguments as its replay keys them."""
    return (A, B, out, 1.0, 0.0, None, None, None, None, None)


def _record(fn, args, op, call):
    """Record ``fn``'s launch of ``args`` for calls keyed as ``call``, as ops does after running them."""
    assert ops.record_replay(op, _Chosen(Launcher(fn.function)), None, args, call)


# ---- lazy negative / conjugate bits ---------------------------------------------------------------

def test_arguments_refuse_operands_with_a_lazy_negative_bit():
    A, B, out = torch.randn(8, 6), torch.randn(6, 4), torch.empty(8, 4)
    for name, operands in (("A", (_neg(A), B, out)), ("B", (A, _neg(B), out)), ("out", (A, B, _neg(out)))):
        with pytest.raises(ValueError, match=rf"operand {name}: has torch's lazy negative bit set.*\.resolve_neg\(\)"):
            GemmArguments(*operands)
    imag = torch.randn(6, 4, dtype=torch.complex64).conj().imag  # a real view that negates
    assert imag.is_neg() and not imag.is_conj()
    with pytest.raises(ValueError, match=r"operand B: has torch's lazy negative bit"):
        GemmArguments(A, imag, out)
    with pytest.raises(ValueError, match=r"operand C: has torch's lazy negative bit"):
        GemmArguments(A, B, out, epilogue=EpilogueArguments(beta=1.0, C=_neg(torch.randn(8, 4))))
    with pytest.raises(ValueError, match=r"operand bias: has torch's lazy negative bit"):
        GemmArguments(A, B, out, epilogue=EpilogueArguments(bias=_neg(torch.randn(4))))
    x, y = torch.randn(5, 7), torch.empty(5, 7)
    with pytest.raises(ValueError, match=r"operand x: has torch's lazy negative bit"):
        SoftmaxArguments(_neg(x), y)
    with pytest.raises(ValueError, match=r"operand out: has torch's lazy negative bit"):
        SoftmaxArguments(x, _neg(y))
    for name, operands in (("grad_out", (_neg(x), y, torch.empty(5, 7))), ("out", (x, _neg(y), torch.empty(5, 7))),
                           ("grad_in", (x, y, _neg(torch.empty(5, 7))))):
        with pytest.raises(ValueError, match=rf"operand {name}: has torch's lazy negative bit"):
            SoftmaxBackwardArguments(*operands)
    # Complex tensors (the only ones that can carry the conjugate bit) are refused by dtype.
    with pytest.raises(TypeError, match="operand A: dtype torch.complex64"):
        GemmArguments(torch.randn(8, 6, dtype=torch.complex64).conj(), B.cfloat(), out.cfloat())
    # Resolved, the same values are accepted; the arguments keep the tensors they were given.
    resolved = _neg(A).resolve_neg()
    assert GemmArguments(resolved, B, out).A is resolved


def test_a_recalled_summary_never_bypasses_the_refusal(entry):
    A, B, out = torch.randn(8, 6), torch.randn(6, 4), torch.empty(8, 4)
    for accumulator in (None, torch.float32):
        GemmArguments(A, B, out, accumulator_type=accumulator)
        GemmArguments(A, B, out, accumulator_type=accumulator)  # remembered and recalled
        for operands in ((_neg(A), B, out), (A, _neg(B), out), (A, B, _neg(out))):
            with pytest.raises(ValueError, match="lazy negative bit"):
                GemmArguments(*operands, accumulator_type=accumulator)
    tag = arguments._GEMM_SUMMARY
    assert entry.recall(tag, A, B, out) is not None and entry.recall(tag, _neg(A), B, out) is None
    assert entry.remember(tag, "x", _neg(A), B, out) is False


def test_the_launch_table_never_launches_lazily_negated_operands(entry):
    fn = Recorder()
    A, B, out = torch.randn(16, 8), torch.randn(8, 4), torch.empty(16, 4)
    _record(fn, GemmArguments(A, B, out), ops.GEMM_OP, _gemm_call(A, B, out))
    assert entry.replay(ops.GEMM_OP, *_gemm_call(A, B, out)) is out and fn.calls == 1
    for operands in ((_neg(A), B, out), (A, _neg(B), out), (A, B, _neg(out))):  # the recorded metadata, negated
        assert entry.replay(ops.GEMM_OP, *_gemm_call(*operands)) is None
        with pytest.raises(ValueError, match=r"lazy negative bit set.*resolve_neg"):
            ops.gemm(*operands[:2], out=operands[2])  # the Python path refuses, naming the operand
    assert fn.calls == 1
    with pytest.raises(ValueError, match="lazy negative bit"):  # a bound launch reading one raises
        entry.bind(fn.function, (_neg(A),), ())(None)
    x, y = torch.randn(6, 10), torch.empty(6, 10)
    _record(fn, SoftmaxArguments(x, y), ops.SOFTMAX_OP, (x, -1, y, None))
    assert ops.softmax(x, out=y) is y and fn.calls == 2
    with pytest.raises(ValueError, match="operand x: has torch's lazy negative bit"):
        ops.softmax(_neg(x), out=y)
    with pytest.raises(ValueError, match="operand out: has torch's lazy negative bit"):
        ops.softmax(x, out=_neg(y))
    assert fn.calls == 2


def test_bind_refuses_lazy_bits_once_and_a_bound_launch_checks_tensors_that_moved(entry):
    fn = Recorder()
    A, B = torch.randn(8, 6), torch.randn(6, 4)
    # Refused when bound, naming the tensor: a bound launch reads the same objects at every call.
    with pytest.raises(ValueError, match=r"bind: tensors\[1\] has torch's lazy negative bit set.*resolve_neg"):
        entry.bind(fn.function, (A, _neg(B)), ())
    conj = torch.randn(4, dtype=torch.complex64).conj()
    with pytest.raises(ValueError, match=r"bind: tensors\[0\] has torch's lazy conjugate bit set.*resolve_conj"):
        entry.bind(fn.function, (conj, None), ())
    assert fn.calls == 0
    bound = entry.bind(fn.function, (A, None, B), ())
    bound(None)
    assert fn.calls == 1
    # `t.data = view` brings the view's bits with its storage (a new data pointer): checked again.
    A.data = _neg(torch.randn(8, 6))
    assert A.is_neg()
    with pytest.raises(ValueError, match="lazy negative bit set"):
        bound(None)
    assert fn.calls == 1
    A.data = A.data.resolve_neg()
    bound(None)
    assert fn.calls == 2


def test_per_call_reads_tell_a_lazily_negated_tensor_from_one_seen_before(entry):
    """replay, recall and remember remember the tensors they found without lazy bits (by
    identity and data pointer); a negated tensor is never taken for one of them: not a new view
    at the address of a released one, not a known tensor whose storage was swapped."""
    fn = Recorder()
    A, B, out = torch.randn(16, 8), torch.randn(8, 4), torch.empty(16, 4)
    _record(fn, GemmArguments(A, B, out), ops.GEMM_OP, _gemm_call(A, B, out))
    summary = arguments._GEMM_SUMMARY
    assert entry.recall(summary, A, B, out) is not None
    for _ in range(50):  # released views' addresses are reused by the next ones
        view = A[:]
        assert entry.replay(ops.GEMM_OP, *_gemm_call(view, B, out)) is out
        del view
        negated = _neg(A)
        assert entry.replay(ops.GEMM_OP, *_gemm_call(negated, B, out)) is None
        assert entry.recall(summary, negated, B, out) is None
        assert entry.remember(summary, "x", negated, B, out) is False
        del negated
    assert fn.calls == 50
    held = B.data
    B.data = _neg(torch.randn(8, 4))  # the same tensor object, another storage with the bit
    assert entry.replay(ops.GEMM_OP, *_gemm_call(A, B, out)) is None
    assert entry.recall(summary, A, B, out) is None
    B.data = held
    assert entry.replay(ops.GEMM_OP, *_gemm_call(A, B, out)) is out and fn.calls == 51


def test_the_c_paths_keep_no_tensor_alive(entry):
    """The verdicts on lazy bits hold weak references, the version bump lets go of out."""
    import weakref

    fn = Recorder()
    A, B, out = torch.randn(16, 8), torch.randn(8, 4), torch.empty(16, 4)
    _record(fn, GemmArguments(A, B, out), ops.GEMM_OP, _gemm_call(A, B, out))  # (the arguments are released)
    watch = [weakref.ref(t) for t in (A, B, out)]
    for _ in range(3):
        assert entry.replay(ops.GEMM_OP, *_gemm_call(A, B, out)) is out
    assert entry.recall(arguments._GEMM_SUMMARY, A, B, out) is not None
    assert fn.calls == 3
    del A, B, out
    assert all(w() is None for w in watch)


def _python_launchers_only(monkeypatch, A, B, out, launched: list) -> None:
    """ops without the native replay, with a recorded Python launcher for (A, B, out) on the CPU."""
    monkeypatch.setattr(ops, "replay_call", None)
    monkeypatch.setattr(ops, "_current_device", lambda: -1)  # the CPU operands' "device"
    extents = tuple(ops.byte_extent(t) for t in (A, B, out))
    monkeypatch.setitem(ops._fast, ops._raw_gemm_key(current().policy, A, B, out),
                        ops.PlainEntry(Launcher(lambda *t: launched.append(t)), -1, current().policy, extents))


def test_the_python_fast_path_never_launches_lazily_negated_operands(monkeypatch):
    launched = []
    A, B, out = torch.randn(16, 16), torch.randn(16, 16), torch.empty(16, 16)
    _python_launchers_only(monkeypatch, A, B, out, launched)
    key = ops._raw_gemm_key(current().policy, A, B, out)
    assert ops._raw_gemm_key(current().policy, _neg(A), B, out) == key  # the raw key cannot tell
    assert ops.gemm(A, B, out=out, stream=0) is out and len(launched) == 1
    for operands in ((_neg(A), B, out), (A, _neg(B), out), (A, B, _neg(out))):
        with pytest.raises(ValueError, match="lazy negative bit"):
            ops.gemm(*operands[:2], out=operands[2], stream=0)
    assert len(launched) == 1


# ---- outputs whose elements overlap -----------------------------------------------------------------

def _overlap_brute_force(shape, strides) -> bool:
    seen = set()
    for index in itertools.product(*(range(n) for n in shape)):
        address = sum(i * s for i, s in zip(index, strides))
        if address in seen:
            return True
        seen.add(address)
    return False


def test_gemm_refuses_outputs_whose_elements_overlap():
    A, B = torch.randn(64, 32), torch.randn(32, 64)
    for out in (torch.empty(1, 64).expand(64, 64), torch.empty(64, 1).expand(64, 64),
                torch.empty(127).as_strided((64, 64), (1, 1)), torch.empty(4096).as_strided((64, 64), (32, 1)),
                torch.empty(4096).as_strided((64, 64), (1, 63))):
        with pytest.raises(ValueError, match=r"operand out: elements overlap .*thread blocks would race"):
            GemmArguments(A, B, out)
        with pytest.raises(ValueError, match="operand out: elements overlap"):
            ops.gemm(A, B, out=out)  # refused before anything is chosen or launched
    A3, B3 = torch.randn(3, 8, 6), torch.randn(3, 6, 5)
    for out in (torch.empty(1, 8, 5).expand(3, 8, 5), torch.empty(64).as_strided((3, 8, 5), (5, 5, 1)),
                torch.empty(200).as_strided((3, 8, 5), (7, 5, 1))):  # batches that meet
        with pytest.raises(ValueError, match="operand out: elements overlap"):
            GemmArguments(A3, B3, out)
    # What torch makes without overlap stays accepted: transposes, padding, batch-interleaving,
    # size-1 modes of any stride, expanded inputs, empty outputs.
    for out in (torch.empty(64, 64), torch.empty(64, 64).t(), torch.empty(64, 80)[:, :64]):
        GemmArguments(A, B, out)
    GemmArguments(torch.empty(1, 32).expand(64, 32), B, torch.empty(64, 64))
    for out in (torch.empty(8, 3, 5).transpose(0, 1), torch.empty(5, 3, 8).permute(1, 2, 0),
                torch.empty(200).as_strided((3, 8, 5), (6, 24, 1))):  # interleaved rows (5 + 1 padding)
        GemmArguments(A3, B3, out)
    GemmArguments(torch.randn(1, 6), torch.randn(6, 5), torch.empty(5, 3).t()[:1])  # one row, a stride 3 apart
    GemmArguments(torch.randn(8, 6), torch.randn(6, 1), torch.empty(8, 5)[:, :1])
    GemmArguments(torch.randn(0, 6), torch.randn(6, 5), torch.empty(0, 5).expand(0, 5))
    GemmArguments(torch.randn(4, 8, 0), torch.randn(4, 0, 3), torch.empty(4, 8, 3))


def test_the_overlap_rule_is_exact():
    """Against brute force over every small batched layout: what is refused has two indices at
    one address, and what is accepted has none."""
    checked = 0
    for batch, rows, inner in itertools.product((1, 2, 3, 4), (1, 2, 3), (1, 2, 3)):
        for row_stride, batch_stride in itertools.product(range(0, 10), range(0, 14)):
            expected = _overlap_brute_force((batch, rows, inner), (batch_stride, row_stride, 1))
            assert _overlaps(inner, rows, row_stride, batch, batch_stride) is expected, (
                batch, rows, inner, batch_stride, row_stride)
            checked += 1
    assert checked > 4000


def test_softmax_outputs_whose_elements_overlap_stay_refused():
    x = torch.randn(5, 7)
    with pytest.raises(ValueError, match="operand out: must be contiguous"):
        SoftmaxArguments(x, torch.empty(1, 7).expand(5, 7))
    with pytest.raises(ValueError, match="operand grad_in: must be contiguous"):
        SoftmaxBackwardArguments(x, x, torch.empty(1, 7).expand(5, 7))


# ---- autograd's version counter -------------------------------------------------------------------

def _saved_by_autograd(out: torch.Tensor):
    """A graph that saved ``out`` for its backward (the gradient of x * out is out)."""
    x = torch.randn(out.shape, requires_grad=True)
    return (x * out).sum()


def test_ops_bump_the_version_of_outputs_written_from_c(entry):
    fn = Recorder()
    A, B, out = torch.randn(16, 8), torch.randn(8, 4), torch.empty(16, 4)
    _record(fn, GemmArguments(A, B, out), ops.GEMM_OP, _gemm_call(A, B, out))
    y = _saved_by_autograd(out)
    version = out._version
    assert ops.gemm(A, B, out=out) is out and fn.calls == 1  # replayed, in C
    assert out._version > version
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()
    version = out._version
    assert entry.replay(ops.GEMM_OP, *_gemm_call(A, B, out)) is out
    assert out._version > version

    x, soft, grad, grad_in = torch.randn(6, 10), torch.empty(6, 10), torch.randn(6, 10), torch.empty(6, 10)
    _record(fn, SoftmaxArguments(x, soft), ops.SOFTMAX_OP, (x, -1, soft, None))
    _record(fn, SoftmaxBackwardArguments(grad, soft, grad_in), ops.SOFTMAX_BACKWARD_OP, (grad, soft, -1, grad_in, None))
    for call, written in ((lambda: ops.softmax(x, out=soft), soft),
                          (lambda: ops.softmax_backward(grad, soft, grad_in=grad_in), grad_in)):
        y = _saved_by_autograd(written)
        version, calls = written._version, fn.calls
        assert call() is written and fn.calls == calls + 1
        assert written._version > version
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            y.backward()


def test_ops_bump_the_version_through_the_python_paths(entry, monkeypatch):
    A, B, out = torch.randn(16, 8), torch.randn(8, 4), torch.empty(16, 4)
    # without the native replay: the Python dictionary of launchers
    launched = []
    _python_launchers_only(monkeypatch, A, B, out, launched)
    version = out._version
    assert ops.gemm(A, B, out=out, stream=0) is out and len(launched) == 1 and out._version > version
    # the first call of a layout: arguments, choice and launch in Python (the launch stubbed here)
    monkeypatch.setattr(ops, "_fast", {})
    monkeypatch.setattr(ops, "_launch", lambda *a, **k: None)
    x, grad = torch.randn(6, 10), torch.randn(6, 10)
    for call, written in ((lambda o: ops._gemm_eager(A, B, o, 1.0, 0.0, None, None, None, None, None), out),
                          (lambda o: ops._softmax_eager(x, -1, o, None), torch.empty(6, 10)),
                          (lambda o: ops._softmax_backward_eager(grad, x, -1, o, None), torch.empty(6, 10))):
        version = written._version
        assert call(written) is written and written._version > version
        made = call(None)
        assert made is not written and made._version == 0  # new outputs: nothing could have saved them


# ---- operands that are not tensors ----------------------------------------------------------------

@pytest.mark.parametrize("grad", [False, True])
def test_ops_name_operands_that_are_not_tensors(grad):
    x = torch.randn(4, 8, requires_grad=grad)
    A, B = torch.randn(4, 8, requires_grad=grad), torch.randn(8, 3)
    calls = [
        (lambda: ops.softmax(None), r"softmax: x must be a torch tensor, got NoneType"),
        (lambda: ops.softmax([1.0]), r"softmax: x must be a torch tensor, got list"),
        (lambda: ops.softmax(x, out=[1.0]), r"softmax: out must be a torch tensor or None, got list"),
        (lambda: ops.softmax_backward([1.0], x), r"softmax_backward: grad_out must be a torch tensor, got list"),
        (lambda: ops.softmax_backward(x, None), r"softmax_backward: out must be a torch tensor, got NoneType"),
        (lambda: ops.softmax_backward(x, x, grad_in="g"), r"softmax_backward: grad_in must be a torch tensor or None"),
        (lambda: ops.gemm(A, B, out="out"), r"gemm: out must be a torch tensor or None, got str"),
        (lambda: ops.gemm(A, B, C=[[1.0]], beta=1.0), r"gemm: C must be a torch tensor or None, got list"),
        (lambda: ops.gemm(A, B, bias=1.0), r"gemm: bias must be a torch tensor or None, got float"),
        (lambda: ops.gemm(None, B), r"gemm: A and B must be torch tensors, got NoneType and Tensor"),
    ]
    for call, message in calls:
        with pytest.raises(TypeError, match=message):
            call()


# ---- recalled summaries for explicit accumulators ---------------------------------------------------

def _summary(args) -> tuple:
    return (args.A, args.B, args.out, args.L, args.M, args.N, args.K, args.accumulator_type, args.device,
            args.device_index, args.tensor_attributes, args.signature, args.epilogue, args.epilogue_signature)


def test_explicit_accumulators_recall_their_own_summaries(entry, monkeypatch):
    recalled = []
    recall = arguments._recall

    def counting(tag, *tensors):
        found = recall(tag, *tensors)
        recalled.append(found is not None)
        return found

    monkeypatch.setattr(arguments, "_recall", counting)
    A, B, out = torch.randn(8, 6).half(), torch.randn(6, 4).half(), torch.empty(8, 4).half()
    for spelling, expected in ((torch.float32, DataType.f32), ("f32", DataType.f32), (DataType.f32, DataType.f32),
                               (torch.float64, DataType.f64), (torch.float16, DataType.f16), (None, DataType.f32)):
        recalled.clear()
        first, second = (GemmArguments(A, B, out, accumulator_type=spelling) for _ in range(2))
        assert recalled[-1] is True, spelling  # the second construction recalled the first's summary
        with monkeypatch.context() as python_only:
            python_only.setattr(arguments, "_recall", None)
            computed = GemmArguments(A, B, out, accumulator_type=spelling)
        assert _summary(first) == _summary(second) == _summary(computed)
        assert second.accumulator_type is expected
    # Never a summary made for another accumulator: each is recalled under its own.
    entry.forget()
    GemmArguments(A, B, out, accumulator_type=torch.float32)
    recalled.clear()
    for spelling, expected in ((torch.float64, DataType.f64), (torch.float16, DataType.f16), (None, DataType.f32)):
        assert GemmArguments(A, B, out, accumulator_type=spelling).accumulator_type is expected
    assert recalled == [False, False, False]
    assert GemmArguments(A, B, out, accumulator_type="f32").accumulator_type is DataType.f32 and recalled[-1]
    with pytest.raises(ValueError, match="not a floating-point"):
        GemmArguments(A, B, out, accumulator_type=torch.int32)  # bad spellings are still explained
    with pytest.raises(TypeError, match="accumulator_type"):
        GemmArguments(A, B, out, accumulator_type=[torch.float32])


# ---- on a GPU -----------------------------------------------------------------------------------------

def _rand(*shape, dtype=torch.float16):
    return torch.randn(*shape, device="cuda", dtype=dtype)


class _PreferCuteDsl(kernel_api.Policy):
    """Chooses a CuTe DSL kernel when one is among the candidates (their launches are recordable)."""

    def choose(self, args, candidates):
        return next((k for k in candidates if k.metadata.provider == "cutedsl"), candidates[0])


@pytest.mark.gpu
def test_gpu_recorded_launches_never_serve_lazily_negated_operands():
    ops.clear_dispatch_cache()
    A, B = _rand(128, 64), _rand(64, 96)
    out = torch.full((128, 96), float("nan"), device="cuda", dtype=torch.float16)
    with kernel_api.settings(policy=_PreferCuteDsl()):
        ops.gemm(A, B, out=out)
        ops.gemm(A, B, out=out)  # from the recorded launch
        assert ops._entry is not None and ops._entry.replays() >= 1, kernel_api.native.why_not_entry()
        negated = torch.full_like(out, float("nan"))
        for operands in ((_neg(A), B, negated), (A, _neg(B), negated), (A, B, _neg(negated))):
            with pytest.raises(ValueError, match="lazy negative bit"):
                ops.gemm(*operands[:2], out=operands[2])
            with pytest.raises(ValueError, match="lazy negative bit"):
                GemmArguments(*operands)
        torch.cuda.synchronize()
        assert torch.isnan(negated).all()  # nothing was launched into it
        # resolved, the negation is computed
        y = ops.gemm(_neg(A).resolve_neg(), B)
        torch.testing.assert_close(y, (-(A.double() @ B.double())).half(), atol=2e-2, rtol=2e-2)
        x, soft = _rand(32, 200, dtype=torch.float32), torch.empty(32, 200, device="cuda")
        ops.softmax(x, out=soft)
        ops.softmax(x, out=soft)
        with pytest.raises(ValueError, match="operand x: has torch's lazy negative bit"):
            ops.softmax(_neg(x), out=soft)
        # Through the custom ops (autograd here), torch resolves the negation before our code runs.
        leaf = x.clone().requires_grad_()
        y = ops.softmax(torch._neg_view(leaf))
        torch.testing.assert_close(y.double(), torch.softmax(-x.double(), -1), atol=1e-5, rtol=1e-4)


@pytest.mark.gpu
def test_gpu_ops_bump_the_version_of_outputs_saved_for_backward():
    ops.clear_dispatch_cache()
    A, B = _rand(64, 32), _rand(32, 48)
    x, grad = _rand(16, 100, dtype=torch.float32), _rand(16, 100, dtype=torch.float32)
    out = torch.empty(64, 48, device="cuda", dtype=torch.float16)
    soft, grad_in = torch.empty_like(x), torch.empty_like(x)
    with kernel_api.settings(policy=_PreferCuteDsl()):
        for call, written in ((lambda: ops.gemm(A, B, out=out), out), (lambda: ops.softmax(x, out=soft), soft),
                              (lambda: ops.softmax_backward(grad, soft, grad_in=grad_in), grad_in)):
            for _ in range(3):  # the first call (Python path), then the recorded launch
                w = torch.randn(written.shape, device="cuda", dtype=written.dtype, requires_grad=True)
                y = (w * written).sum()
                version = written._version
                assert call() is written
                assert written._version > version
                with pytest.raises(RuntimeError, match="modified by an inplace operation"):
                    y.backward()
        torch.cuda.synchronize()
        torch.testing.assert_close(out, (A.double() @ B.double()).half(), atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(soft.double(), torch.softmax(x.double(), -1), atol=1e-5, rtol=1e-4)


@pytest.mark.gpu
def test_gpu_overlapping_outputs_are_refused_before_any_launch():
    A, B = _rand(64, 32), _rand(32, 64)
    row = torch.full((1, 64), float("nan"), device="cuda", dtype=torch.float16)
    ops.gemm(A, B, out=torch.empty(64, 64, device="cuda", dtype=torch.float16))  # a recorded layout
    with pytest.raises(ValueError, match="operand out: elements overlap"):
        ops.gemm(A, B, out=row.expand(64, 64))
    torch.cuda.synchronize()
    assert torch.isnan(row).all()


@pytest.mark.gpu
def test_gpu_arguments_recalled_with_an_explicit_accumulator_run_correctly():
    A, B = _rand(128, 64), _rand(64, 96)
    for _ in range(2):
        out = torch.full((128, 96), float("nan"), device="cuda", dtype=torch.float16)
        args = GemmArguments(A, B, out, accumulator_type=torch.float32)
        assert args.accumulator_type is DataType.f32
        kernel = kernel_api.get_kernels(args)[0]
        kernel.run(args)
        torch.cuda.synchronize()
        torch.testing.assert_close(out, (A.double() @ B.double()).half(), atol=2e-2, rtol=2e-2)


def test_the_python_fast_path_takes_parameters(monkeypatch):
    """nn layers pass their weight (GPT-2's Conv1D: the Parameter itself) and their bias as
    torch.nn.Parameter: repeated calls with them take the recorded launchers, as plain tensors
    do (they went through GemmArguments on every call: GPT-2 patched was host-bound)."""
    launched = []
    A, out = torch.randn(16, 8), torch.empty(16, 12)
    W = torch.nn.Parameter(torch.randn(8, 12))
    bias = torch.nn.Parameter(torch.randn(12))
    _python_launchers_only(monkeypatch, A, W, out, launched)
    # an epilogue call (bias, activation): recorded as its function and the tails before and after the bias
    key = (ops._raw_gemm_key(current().scope_token, A, W, out), 1.0, "gelu",
           (bias.dtype, bias.shape, bias.stride(), bias.data_ptr() & 1023, bias.get_device()))
    extents = tuple(ops.byte_extent(t) for t in (A, W, out))
    entry = ops.EpilogueEntry(lambda *t: launched.append(t), (), (), -1, current().scope_token, extents)
    monkeypatch.setitem(ops._fast, key, entry)
    with torch.no_grad():  # (parameters require grad: inference, as a prefill runs)
        assert ops.gemm(A, W, out=out, stream=0) is out and len(launched) == 1
        assert ops.gemm(A, W, out=out, bias=bias, activation="gelu", stream=0) is out
    assert len(launched) == 2 and launched[-1][3] is bias
