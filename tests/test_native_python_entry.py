"""The launch table library's CPython entry points (kernel_api.native.entry): torch tensors read
through torch's DLPack exchange API, the table launch, bound launches, streams and errors.

Runs on CPU: a Python callable converted to a TVM-FFI function stands in for a compiled kernel.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from kernel_api import native
from kernel_api.ops import dispatch as ops  # the front door's module: its caches and launch records
from kernel_api.tuning.settings import current
from kernel_api.launcher import Launcher
from test_native_launch_table import GEMM_TAIL

tvm_ffi = pytest.importorskip("tvm_ffi")
if native.module_path() is None:
    pytest.skip("kernel_api.native._launch_table was not built by this install (pip install -e . with a C++ "
                "compiler builds it)", allow_module_level=True)


@pytest.fixture
def entry():
    module = native.entry()
    if module is None:
        pytest.skip(f"no CPython entry points here: {native.why_not_entry()}")
    native.table().clear()
    yield module
    ops.clear_dispatch_cache()
    native.table().clear()


class Recorder:
    """A TVM-FFI function that remembers what each call saw (tensors as data pointer and shape:
    tensors passed as DLTensor pointers live only during the call)."""

    def __init__(self, raises: Exception | None = None):
        self.calls = []

        def record(*args):
            self.calls.append(tuple((a.data_ptr(), tuple(a.shape)) if hasattr(a, "data_ptr") else a for a in args))
            if raises is not None:
                raise raises

        self.function = tvm_ffi.convert(record)


class FakeStream:
    """Any stream object that converts to its handle with int(), as cuda.bindings' CUstream."""

    def __init__(self, handle: int):
        self.handle = handle

    def __int__(self) -> int:
        return self.handle


def seen(tensor: torch.Tensor) -> tuple:
    return tensor.data_ptr(), tuple(tensor.shape)


def test_the_entry_shares_the_table_with_the_tvm_ffi_module(entry):
    fn = Recorder()
    A, B, out = torch.randn(4, 8), torch.randn(8, 3), torch.empty(4, 3)
    assert entry.launch(7, None, A, B, out) is False and not fn.calls
    native.table().record(7, fn.function, 3, A, B, out, None, 1.0, 132, True)
    assert entry.launch(7, None, A, B, out) is True
    assert fn.calls[-1] == (seen(A), seen(B), seen(out), None, 1.0, 132, True, None)  # CPU: no stream
    assert entry.launch(7, 5, A, B, out) is True and fn.calls[-1][-1] == 5  # ints stay ints
    assert entry.launch(7, FakeStream(4096), A, B, out) is True
    assert fn.calls[-1][-1].value == 4096  # other stream objects go as the pointer int() gives
    assert entry.launch(8, None, A, B, out) is False  # another tag
    native.table().clear()
    assert entry.launch(7, None, A, B, out) is False and len(fn.calls) == 3


def test_launch_misses_quietly_on_what_the_table_cannot_take(entry):
    fn = Recorder()
    A, B, out = torch.randn(4, 8), torch.randn(8, 3), torch.empty(4, 3)
    native.table().record(7, fn.function, 3, A, B, out)
    for operands in ((A, B, "out"), (A, B, None), (A, B), (A, B, out, out), (A, B.t(), out)):
        assert entry.launch(7, None, *operands) is False
    assert entry.launch(7, None, A, B, A[:, :3]) is False  # the output overlaps an operand
    assert not fn.calls
    with pytest.raises(TypeError, match="between 1 and 8 tensors"):
        entry.launch(7, None)
    with pytest.raises(TypeError, match="stream: expected None, an int or a CUDA stream object, got str"):
        entry.launch(7, "s", A, B, out)


def test_fake_tensors_never_launch(entry):
    from torch._subclasses.fake_tensor import FakeTensorMode

    fn = Recorder()
    x, out = torch.randn(4, 8), torch.empty(4, 8)
    native.table().record(9, fn.function, 2, x, out)
    with FakeTensorMode():
        fake_x, fake_out = torch.empty(4, 8), torch.empty(4, 8)
    assert entry.launch(9, None, fake_x, fake_out) is False and not fn.calls


def test_a_bound_launch_reads_the_live_tensors_at_each_call(entry):
    fn = Recorder()
    A, out = torch.randn(4, 8), torch.empty(4, 8)
    bound = entry.bind(fn.function, (A, None, out), (None, 2.5, 3, False, -(2**40)))
    assert isinstance(bound, entry.BoundLaunch) and bound.func is fn.function and bound.tensors == (A, None, out)
    assert bound(None) is None
    assert fn.calls[-1] == (seen(A), None, seen(out), None, 2.5, 3, False, -(2**40), None)
    bound(77)
    assert fn.calls[-1][-1] == 77
    A.resize_(2, 3)  # metadata is read per call, not frozen at bind time
    bound(None)
    assert fn.calls[-1][0] == seen(A) and fn.calls[-1][0][1] == (2, 3)
    with pytest.raises(TypeError, match="one argument: the stream"):
        bound()
    with pytest.raises(TypeError, match="one argument: the stream"):
        bound(None, stream=None)


def test_bind_refuses_what_it_cannot_hold(entry):
    fn = Recorder()
    A = torch.randn(4)
    with pytest.raises(TypeError, match=r"tail must be None, bool, int or float, got object|after the tensors"):
        entry.bind(fn.function, (A,), (object(),))
    with pytest.raises(TypeError, match=r"tensors\[1\] is a str"):
        entry.bind(fn.function, (A, "B"), ())
    with pytest.raises(TypeError, match="must be a TVM-FFI function"):
        entry.bind(lambda *args: None, (A,), ())
    with pytest.raises(ValueError, match="between 1 and 8 tensors"):
        entry.bind(fn.function, (), ())
    with pytest.raises(TypeError, match="bind"):
        entry.bind(fn.function, [A], ())


@pytest.mark.parametrize("error", [ValueError("bad shape"), TypeError("bad dtype"), KeyError("k")])
def test_errors_raised_by_the_function_reach_python_as_the_same_kind(entry, error):
    fn = Recorder(raises=error)
    A = torch.randn(4)
    with pytest.raises(type(error), match=str(error.args[0])):
        entry.bind(fn.function, (A,), ())(None)
    native.table().record(5, fn.function, 1, A)
    with pytest.raises(type(error), match=str(error.args[0])):
        entry.launch(5, None, A)


def test_a_bound_launch_keeps_its_tensors_alive_until_collected(entry):
    fn = Recorder()
    A = torch.randn(4)
    watch = weakref.ref(A)
    bound = entry.bind(fn.function, (A,), ())
    del A
    gc.collect()
    assert watch() is not None
    bound(None)
    del bound
    gc.collect()
    assert watch() is None


def test_launchers_bind_the_native_launch_when_the_function_keeps_the_gil(entry):
    from types import SimpleNamespace

    from kernel_api import CompiledArtifact
    from kernel_api.providers.cutedsl.kernel import CuteDslKernel

    A, B, out = torch.randn(4, 8), torch.randn(8, 3), torch.empty(4, 3)
    for keep, native_launch in ((True, True), (False, False)):
        fn = Recorder()
        # what cute_compile does with a kernel's keep_gil_during_launch
        assert CuteDslKernel._launch_ready(SimpleNamespace(keep_gil_during_launch=keep), fn.function) is fn.function
        launcher = Launcher(CompiledArtifact(fn.function, None), (1.0, 0))
        launch = launcher.bind((A, B, out))
        assert isinstance(launch, entry.BoundLaunch) is native_launch
        launch(None)
        assert fn.calls[-1] == (seen(A), seen(B), seen(out), 1.0, 0, None)
        # a native launch is its own snapshot (it already costs less than operands packed once)
        assert (launcher.bind_snapshot((A, B, out), launch) is launch) is native_launch
    # a constant the native launch cannot hold: the partial converts it per call
    fn = Recorder()
    fn.function.release_gil = False
    launch = Launcher(fn.function, ("fast",)).bind((A, B, out))
    assert not isinstance(launch, entry.BoundLaunch)
    launch(None)
    assert fn.calls[-1][3] == "fast"


def test_kernel_run_binds_a_launchers_native_launch_and_calls_it_with_the_stream(entry):
    """Kernel.run's bound path end to end on CPU: a kernel whose launcher holds a TVM-FFI
    function that keeps the GIL runs again through the native bound launch."""
    from cuda.bindings import driver

    from kernel_api import GemmArguments
    from toy_kernels import ToyGemm

    fn = Recorder()
    fn.function.release_gil = False

    class NativeToy(ToyGemm):
        def _launcher(self, args, artifact):
            return Launcher(fn.function, (None, 2.0))

    md = next(k for k in ToyGemm.generate_kernels(lambda m: m.operands.A.dtype.name == "f32")
              if "ttt" in k.metadata.kernel_name and k.metadata.operands.A.divisibility == 1).metadata
    kernel = NativeToy(md)
    A, B, out = torch.randn(4, 8), torch.randn(8, 3), torch.empty(4, 3)
    args = GemmArguments(A, B, out)
    artifact = kernel.compile(args)
    kernel.run(args, compiled_artifact=artifact, stream=driver.CUstream(9), assume_supported_args=True)
    assert not fn.calls and isinstance(args._binding.launch, entry.BoundLaunch)
    assert args._binding.snapshot is args._binding.launch
    kernel.run(args, compiled_artifact=artifact, stream=driver.CUstream(11), assume_supported_args=True)
    assert len(fn.calls) == 1 and fn.calls[0][:5] == (seen(A), seen(B), seen(out), None, 2.0)
    assert fn.calls[0][5].value == 11  # the CUstream, as the pointer it holds


def _summary(args) -> tuple:
    return (args.A, args.B, args.out, args.L, args.M, args.N, args.K, args.accumulator_type, args.device,
            args.device_index, args.tensor_attributes, args.signature, args.epilogue, args.epilogue_signature)


def test_gemm_arguments_recalled_from_c_equal_those_computed_in_python(entry, monkeypatch):
    """Every plain GemmArguments' summary is remembered under its operands' raw metadata; a
    later construction with equal metadata recalls it. Over operands of assorted dtypes,
    layouts, shapes, strides, batch and pointer alignments, the recalled summary equals the
    one Python computes."""
    import kernel_api.arguments.gemm as arguments
    from gemm_family_utils import operand_variants

    from kernel_api import GemmArguments

    entry.forget()
    pool = torch.empty(1 << 16, dtype=torch.float16)
    problems = []
    for t in operand_variants():
        if t.dtype != torch.float16:
            continue
        m, k = t.shape
        for offset in (0, 4, 64):  # B and out at other alignments
            B = pool[offset:offset + k * 24].view(k, 24)
            out = torch.empty(m, 24 + 8, dtype=torch.float16)[:, :24]
            problems.append((t, B, out))
    batched = torch.empty(3, 64, 32, dtype=torch.float16)
    problems.append((batched, torch.empty(3, 32, 16, dtype=torch.float16), torch.empty(3, 64, 16, dtype=torch.float16)))
    problems.append((torch.empty(8, 4, dtype=torch.float64),) + (torch.empty(4, 2, dtype=torch.float64),
                                                               torch.empty(8, 2, dtype=torch.float64)))
    for A, B, out in problems:
        first, second = GemmArguments(A, B, out), GemmArguments(A, B, out)
        with monkeypatch.context() as python_only:
            python_only.setattr(arguments, "_recall", None)
            computed = GemmArguments(A, B, out)
        assert _summary(first) == _summary(second) == _summary(computed)
        assert second.tensor_attributes is not first.tensor_attributes  # each arguments object owns its dict
        assert second._binding is None and second._verdicts is None
    assert 0 < entry.remembered() <= len(problems)


def test_gemm_arguments_remember_a_named_summary(entry):
    """What a plain GemmArguments remembers (and recall returns) is a `GemmSummary` whose fields
    name the arguments' attributes (it was a 9-tuple read by position); ``values`` holds them in
    the order the recall hit unpacks."""
    import kernel_api.arguments.gemm as arguments

    from kernel_api import GemmArguments

    entry.forget()
    A, B, out = torch.randn(3, 8, 6), torch.randn(3, 6, 4), torch.empty(3, 8, 4)
    args = GemmArguments(A, B, out)
    found = entry.recall(arguments._GEMM_SUMMARY, A, B, out)
    assert isinstance(found, arguments.GemmSummary)
    assert (found.L, found.M, found.N, found.K) == (3, 8, 4, 6)
    assert found.accumulator_type is args.accumulator_type and found.device == args.device
    assert found.device_index == args.device_index == -1 and found.signature == args.signature
    assert found.tensor_attributes == args.tensor_attributes and found.tensor_attributes is not args.tensor_attributes
    assert found.values == (found.L, found.M, found.N, found.K, found.accumulator_type, found.device,
                            found.device_index, found.tensor_attributes, found.signature)
    recalled = GemmArguments(A, B, out)
    assert _summary(recalled) == _summary(args) and recalled.tensor_attributes is not found.tensor_attributes


def test_gemm_arguments_recall_only_plain_caller_tensors(entry):
    from kernel_api import EpilogueArguments, GemmArguments

    entry.forget()
    A, B, out = torch.randn(8, 6), torch.randn(6, 4), torch.empty(8, 4)
    GemmArguments(A, B, out, epilogue=EpilogueArguments(alpha=2.0))
    assert entry.remembered() == 0  # arguments with an epilogue are not remembered
    column = torch.randn(8, 12)[:, ::12]  # (8, 1) with strides (12, 12): arguments hold a re-strided view
    for _ in range(2):
        assert GemmArguments(column, torch.randn(1, 4), out).A is not column
    assert entry.remembered() == 0
    args = GemmArguments(A, B, out)
    assert entry.remembered() == 1 and args.A is A
    again = GemmArguments(A, B, out, accumulator_type=torch.float64)  # not the remembered f32 summary
    assert str(again.accumulator_type) == "f64" and entry.remembered() == 2
    with pytest.raises(ValueError, match="operand B: K mismatch"):
        GemmArguments(A, torch.randn(5, 4), out)  # bad input after good input still gets its message
    with pytest.raises(TypeError, match="operand out"):
        GemmArguments(A, B, "out")


def test_remember_declines_tensors_it_cannot_key(entry):
    meta = torch.empty(4, 4, device="meta")
    assert entry.remember(1, "x", meta) is False and entry.recall(1, meta) is None
    x = torch.randn(4, 4)
    assert entry.remember(1, "x", x) is True and entry.recall(1, x) == "x" and entry.recall(2, x) is None
    assert entry.recall(1, x.t()) is None and entry.recall(1, "x") is None
    entry.forget()
    assert entry.recall(1, x) is None and entry.remembered() == 0


def test_gemm_plain_launches_only_plain_calls_outside_modes_and_autograd(entry):
    """ops.gemm's C preamble: it launches from the table only what the Python preamble would,
    and answers None (no error) for everything else, which then takes the Python path."""
    from torch.utils._python_dispatch import TorchDispatchMode

    import kernel_api

    fn = Recorder()
    A, B, out = torch.randn(16, 8), torch.randn(8, 4), torch.empty(16, 4)
    tag = ops._GEMM_TAG
    ops._record_native(Launcher(fn.function, GEMM_TAIL), current().policy,
                       (A, B, out), tag)
    assert ops._gemm_plain is entry.gemm_plain

    def plain(A=A, B=B, out=out, alpha=1.0, beta=0.0, C=None, bias=None, activation=None, acc=None, stream=None):
        return entry.gemm_plain(tag, A, B, out, alpha, beta, C, bias, activation, acc, stream)

    assert plain() is out and plain(alpha=1, beta=0) is out and len(fn.calls) == 2
    for declined in (dict(alpha=2.0), dict(beta=1.0), dict(alpha=torch.tensor(1.0)), dict(C=out), dict(bias=out[0]),
                     dict(activation="relu"), dict(acc=torch.float32), dict(A="A"), dict(B=None), dict(out=out.t()),
                     dict(stream="no stream")):
        assert plain(**declined) is None, declined
    assert len(fn.calls) == 2

    class Watching(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    with Watching():
        assert plain() is None  # modes must see the op: the custom op path
    A.requires_grad_(True)
    assert plain() is None  # autograd records the op: the custom op path
    with torch.no_grad():
        assert plain() is out
    A.requires_grad_(False)
    with kernel_api.settings(policy=kernel_api.PickAny()):
        assert plain() is None  # another policy has no entry
    assert len(fn.calls) == 3

    spare = torch.empty(16, 4)
    ops._record_native(Launcher(fn.function, GEMM_TAIL), current().policy,
                       (A, B, spare), tag)
    entry.configure_ops(ops._settings, ops._dispatch_modes, ops._grad_enabled, lambda A, B: spare, ops.to_cuda_stream,
                        ops._increment_version)
    try:
        assert plain(out=None) is spare and fn.calls[-1][2] == seen(spare)  # out=None: launched into new_output's
    finally:
        entry.configure_ops(ops._settings, ops._dispatch_modes, ops._grad_enabled, None,
                            ops.to_cuda_stream, ops._increment_version)
    assert plain(stream=12345) is out and fn.calls[-1][-1].value == 12345


def test_gemm_plain_leaves_kernels_that_raise_to_the_python_path(entry):
    import kernel_api

    fn = Recorder(raises=RuntimeError("launch failed"))
    A, B, out = torch.randn(16, 8), torch.randn(8, 4), torch.empty(16, 4)
    ops._record_native(Launcher(fn.function, GEMM_TAIL), current().policy,
                       (A, B, out), ops._GEMM_TAG)
    assert entry.gemm_plain(ops._GEMM_TAG, A, B, out, 1.0, 0.0, None, None, None, None, None) is None
    assert len(fn.calls) == 1
    with pytest.raises(kernel_api.errors.DeviceError):  # the Python path explains (CPU operands here)
        ops.gemm(A, B, out=out)


def test_entry_points_name_their_arguments_when_called_wrongly(entry):
    x = torch.randn(4)
    for call, message in ((lambda: entry.recall(1), r"recall\(tag, \*tensors\)"),
                          (lambda: entry.remember(1, "x"), r"remember\(tag, value, \*tensors\)"),
                          (lambda: entry.gemm_plain(1, x, x), r"gemm_plain\(tag, A, B, out"),
                          (lambda: entry.configure_ops(None), r"configure_ops\(settings"),
                          (lambda: entry.configure(42), "configure: expected torch.Tensor")):
        with pytest.raises(TypeError, match=message):
            call()
    for call in (lambda: entry.recall("not a tag", x), lambda: entry.remember("not a tag", 1, x),
                 lambda: entry.launch("not a tag", None, x)):
        with pytest.raises(TypeError):  # tags are ints
            call()


class TorchCallSpy:
    """A torch call as `TorchGemm` records one (torch.matmul): computes, and logs what it saw."""

    def __init__(self, raises: Exception | None = None):
        self.calls = []
        self.raises = raises

    def __call__(self, A, B, *, out=None):
        self.calls.append((seen(A), seen(B)) if out is None else (seen(A), seen(B), seen(out)))
        if self.raises is not None:
            raise self.raises
        return torch.matmul(A, B, out=out)


def _python_launch(*args):
    raise AssertionError("a recorded torch call must not go through the launcher's Python function")


def test_a_torch_call_that_raises_is_left_to_the_python_path(entry):
    import kernel_api

    spy = TorchCallSpy(raises=RuntimeError("cuBLAS failed"))
    A, B, out = torch.randn(16, 8), torch.randn(8, 4), torch.empty(16, 4)
    ops._record_torch_call(Launcher(_python_launch, torch_call=spy), current().policy, (A, B, out), ops._GEMM_TAG)
    assert entry.gemm_plain(ops._GEMM_TAG, A, B, out, 1.0, 0.0, None, None, None, None, None) is None
    assert len(spy.calls) == 1
    with pytest.raises(kernel_api.errors.DeviceError):  # the Python path explains (CPU operands here)
        ops.gemm(A, B, out=out)


def test_record_call_names_its_arguments_and_declines_what_it_cannot_key(entry):
    x = torch.randn(4, 4)
    with pytest.raises(TypeError, match=r"record_call\(tag, call, \*tensors\)"):
        entry.record_call(1, torch.matmul)
    with pytest.raises(TypeError, match="call must be callable"):
        entry.record_call(1, "torch.matmul", x, x, x)
    assert entry.record_call(1, torch.matmul, x, x, torch.empty(4, 4, device="meta")) is False
    assert entry.calls() == 0
    with pytest.raises(TypeError, match="torch_call must be a callable"):
        Launcher(_python_launch, (1,), torch_call=torch.matmul)  # a tail: not a torch launch
    assert "torch_call=matmul" in repr(Launcher(_python_launch, torch_call=torch.matmul))


def test_f32_entries_are_kept_per_tf32_flag(entry):
    """The choice for f32 operands follows torch's TF32 flag, so gemm_plain looks f32 GEMMs up
    under the tag with `_TF32_TAG` set while torch allows TF32: an entry recorded with the flag
    off is not used with it on (the Python path chooses again), and the other way round. Without
    the flag's hook (configure_ops with None) f32 operands are declined."""
    spy = TorchCallSpy()
    A, B, out = torch.randn(16, 8), torch.randn(8, 4), torch.empty(16, 4)
    plain = lambda: entry.gemm_plain(ops._GEMM_TAG, A, B, out, 1.0, 0.0, None, None, None, None, None)  # noqa: E731
    saved = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = False
        ops._record_torch_call(Launcher(_python_launch, torch_call=spy), current().policy, (A, B, out), ops._GEMM_TAG)
        assert plain() is out and len(spy.calls) == 1
        torch.backends.cuda.matmul.allow_tf32 = True
        assert plain() is None and len(spy.calls) == 1  # chosen with TF32 off: not used with it on
        ops._record_torch_call(Launcher(_python_launch, torch_call=spy), current().policy, (A, B, out),
                               ops._GEMM_TAG | ops._TF32_TAG)
        assert plain() is out and len(spy.calls) == 2
        entry.configure_ops(ops._settings, ops._dispatch_modes, ops._grad_enabled, None,
                            ops.to_cuda_stream, ops._increment_version, None)
        try:
            assert plain() is None and len(spy.calls) == 2  # no way to read the flag: declined
        finally:
            entry.configure_ops(ops._settings, ops._dispatch_modes, ops._grad_enabled, None,
                                ops.to_cuda_stream, ops._increment_version, ops._tf32_allowed)
        half = (A.half(), B.half(), out.half())  # other dtypes: no TF32 bit
        ops._record_torch_call(Launcher(_python_launch, torch_call=spy), current().policy, half, ops._GEMM_TAG)
        assert entry.gemm_plain(ops._GEMM_TAG, *half, 1.0, 0.0, None, None, None, None, None) is half[2]
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved


@pytest.mark.parametrize("shapes", [((16, 8), (8, 4)), ((3, 16, 8), (3, 8, 4)), ((3, 16, 8), (8, 4))])
def test_gemm_plain_makes_new_outputs_as_the_python_path_does(entry, shapes):
    """With no new_output hook (as kernel_api.ops configures it), gemm_plain makes an allocating
    call's output itself: the tensor `_new_gemm_output` makes (shape, dtype, strides, device),
    into which the recorded call writes. A torch call that served it is then kept for (A, B)
    alone, so the next allocating call lets torch allocate."""
    spy = TorchCallSpy()
    A, B = torch.randn(*shapes[0]), torch.randn(*shapes[1])
    expected = ops._new_gemm_output(A, B)
    # entries for outputs at every 4-byte offset modulo 1024: keys hold the pointer's low 10 bits
    room = torch.empty(expected.numel() + 256)
    for offset in range(256):
        at = room[offset:offset + expected.numel()].view(expected.shape)
        ops._record_torch_call(Launcher(_python_launch, torch_call=spy), current().policy, (A, B, at),
                               ops._GEMM_TAG)
    assert entry.calls() == 256
    first = entry.gemm_plain(ops._GEMM_TAG, A, B, None, 1.0, 0.0, None, None, None, None, None)
    assert len(spy.calls) == 1 and len(spy.calls[0]) == 3  # into the output gemm_plain made
    assert entry.calls() == 257  # kept for (A, B) alone
    second = entry.gemm_plain(ops._GEMM_TAG, A, B, None, 1.0, 0.0, None, None, None, None, None)
    assert len(spy.calls) == 2 and spy.calls[1] == (seen(A), seen(B))  # torch allocated it
    for got in (first, second):
        assert got.shape == expected.shape and got.stride() == expected.stride() and got.dtype == expected.dtype
        assert got.device == expected.device and not got.requires_grad
        assert torch.allclose(got, torch.matmul(A, B))
    assert first.data_ptr() != second.data_ptr()


def test_allocating_calls_run_a_torch_call_that_allocates(entry):
    """A torch call recorded from an allocating call (``new_output``) is also keyed by A and B
    alone: repeated allocating plain calls run ``torch_call(A, B)`` and return torch's tensor,
    with no output made first; out= calls keep their own entry, other streams and other
    metadata take the Python path, and a call that raises is left to it."""
    spy = TorchCallSpy()
    A, B = torch.randn(16, 8), torch.randn(8, 4)
    plain = lambda a=A, out=None, stream=None: entry.gemm_plain(  # noqa: E731
        ops._GEMM_TAG, a, B, out, 1.0, 0.0, None, None, None, None, stream)
    made = ops._new_gemm_output(A, B)
    ops._record_torch_call(Launcher(_python_launch, torch_call=spy), current().policy, (A, B, made), ops._GEMM_TAG,
                           new_output=True)
    assert entry.calls() == 2
    got = plain()
    assert spy.calls[-1] == (seen(A), seen(B)) and torch.allclose(got, A @ B)  # torch allocated it
    assert plain(stream=12345) is None and len(spy.calls) == 1  # not the current stream: the Python path
    assert plain(a=torch.randn(32, 16)[:, :8]) is None and len(spy.calls) == 1  # other strides: no entry
    assert plain(out=made) is made and len(spy.calls[-1]) == 3  # out=: the entry with the output
    spy.raises = RuntimeError("cuBLAS failed")
    assert plain() is None and not PyErr_pending()
    ops.clear_dispatch_cache()
    assert entry.calls() == 0


def PyErr_pending() -> bool:
    """Whether a call left a Python error set: the next C-API call would raise SystemError."""
    try:
        torch.empty(1)
    except SystemError:
        return True
    return False


def test_allocating_torch_calls_are_kept_per_tf32_flag(entry):
    """f32: the allocating entry, like the out= one, is keyed by torch's TF32 flag."""
    spy = TorchCallSpy()
    A, B = torch.randn(16, 8), torch.randn(8, 4)
    saved = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = False
        ops._record_torch_call(Launcher(_python_launch, torch_call=spy), current().policy,
                               (A, B, ops._new_gemm_output(A, B)), ops._GEMM_TAG, new_output=True)
        assert entry.gemm_plain(ops._GEMM_TAG, A, B, None, 1.0, 0.0, None, None, None, None, None) is not None
        torch.backends.cuda.matmul.allow_tf32 = True
        assert entry.gemm_plain(ops._GEMM_TAG, A, B, None, 1.0, 0.0, None, None, None, None, None) is None
        assert len(spy.calls) == 1
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_gemm_plain_leaves_allocating_calls_that_split_columns_to_python(entry, dtype):
    """An allocating call whose columns `split_columns` splits (two GEMMs into a padded output)
    is declined by gemm_plain even where an entry for a dense output of its metadata exists, so
    it gets the split and the padded output of the Python path; every other shape is served."""
    vec = 16 // torch.empty(0, dtype=dtype).element_size()
    shapes = [(M, N, 8) for M in (ops.SPLIT_MIN_ROWS - 1, ops.SPLIT_MIN_ROWS, 300)
              for N in (4 * vec - 1, 4 * vec, 4 * vec + 1, 5 * vec, 5 * vec + 3)]
    for M, N, K in shapes:
        spy = TorchCallSpy()
        A, B = torch.randn(M, K).to(dtype), torch.randn(K, N).to(dtype)
        dense = ops._new_gemm_output(A, B)
        room = torch.empty(dense.numel() + 1024 // dense.element_size(), dtype=dtype)
        for offset in range(1024 // dense.element_size()):  # every pointer offset modulo 1024
            ops._record_torch_call(Launcher(_python_launch, torch_call=spy), current().policy,
                                   (A, B, room[offset:offset + dense.numel()].view(dense.shape)), ops._GEMM_TAG)
        got = entry.gemm_plain(ops._GEMM_TAG, A, B, None, 1.0, 0.0, None, None, None, None, None)
        splits = ops.split_columns(A, B, None, 0.0, None) > 0
        assert (got is None) == splits, (dtype, M, N)
        assert got is None or torch.allclose(got.double(), A.double() @ B.double(), rtol=1e-2, atol=1e-2)
        ops.clear_dispatch_cache()


class EpilogueSpy:
    """A bias epilogue's torch call as `TorchGemm` records one (torch.addmm's): computes and logs."""

    def __init__(self, activation=None):
        self.calls = []
        self.activation = activation
        self.raises = None

    def __call__(self, A, B, bias, *, out=None):
        self.calls.append(tuple(seen(t) for t in (A, B, bias) + (() if out is None else (out,))))
        if self.raises is not None:
            raise self.raises
        y = torch.addmm(bias, A, B)
        y = torch.relu(y) if self.activation == "relu" else y
        return y if out is None else out.copy_(y)


def _epilogue_tag(activation=None):
    return ops._GEMM_TAG | ops._EPILOGUE_CODES[activation] << ops._EPILOGUE_SHIFT


def test_a_recorded_bias_call_runs_from_c(entry):
    """A torch call recorded for a call with a row bias (and an activation) serves repeated
    calls with that bias's metadata and that activation from gemm_plain, as call(A, B, bias,
    out=out), the output's version bumped; another activation, alpha, bias metadata, a bias that
    requires grad under autograd, an output overlapping the bias, a C operand or another stream
    take the Python path."""
    spy = EpilogueSpy("relu")
    A, B, bias, out = torch.randn(16, 8), torch.randn(8, 4), torch.randn(4), torch.empty(16, 4)
    ops._record_torch_call(Launcher(_python_launch, (bias,), torch_call=spy), current().policy, (A, B, bias, out),
                           _epilogue_tag("relu"))

    def plain(alpha=1.0, C=None, b=bias, activation="relu", o=out, stream=None):
        return entry.gemm_plain(ops._GEMM_TAG, A, B, o, alpha, 0.0, C, b, activation, None, stream)

    version = out._version
    assert plain() is out and spy.calls[-1] == (seen(A), seen(B), seen(bias), seen(out)) and out._version > version
    assert torch.allclose(out, torch.relu(A @ B + bias), atol=1e-5)
    bias.copy_(torch.randn(4))  # new values, same metadata: this call's bias is used
    assert plain() is out and torch.allclose(out, torch.relu(A @ B + bias), atol=1e-5) and len(spy.calls) == 2
    assert plain(activation=None) is None and plain(activation="gelu") is None  # other activations: no entry
    assert plain(activation="RELU") is None and plain(activation="tanh") is None  # spelled otherwise: Python's
    assert plain(alpha=2.0) is None and plain(C=out) is None and plain(stream=12345) is None
    assert plain(b=torch.randn(8)[::2]) is None  # a strided bias: other metadata
    bias.requires_grad_(True)
    try:
        assert plain() is None  # autograd must see the op
        with torch.no_grad():
            assert plain() is out
    finally:
        bias.requires_grad_(False)
    room = torch.empty(16 * 4 + 4)
    ops._record_torch_call(Launcher(_python_launch, (room[:4],), torch_call=spy), current().policy,
                           (A, B, room[:4], room[4:].view(16, 4)), _epilogue_tag("relu"))
    assert plain(b=room[:4], o=room[:64].view(16, 4)) is None  # the output overlaps the bias
    assert len(spy.calls) == 3
    ops.clear_dispatch_cache()
    assert entry.calls() == 0 and plain() is None


def test_allocating_bias_calls_let_torch_allocate(entry):
    """Recorded from an allocating call (``new_output``), a bias call is also kept for (A, B,
    bias) alone: repeated allocating calls run call(A, B, bias) and return torch's tensor; one
    that raises is left to the Python path."""
    spy = EpilogueSpy()
    A, B, bias = torch.randn(16, 8), torch.randn(8, 4), torch.randn(4)
    made = ops._new_gemm_output(A, B)
    ops._record_torch_call(Launcher(_python_launch, (bias,), torch_call=spy), current().policy, (A, B, bias, made),
                           _epilogue_tag(), new_output=True)
    assert entry.calls() == 2
    got = entry.gemm_plain(ops._GEMM_TAG, A, B, None, 1.0, 0.0, None, bias, None, None, None)
    assert spy.calls[-1] == (seen(A), seen(B), seen(bias)) and torch.allclose(got, A @ B + bias, atol=1e-5)
    spy.raises = RuntimeError("cuBLAS failed")
    assert entry.gemm_plain(ops._GEMM_TAG, A, B, None, 1.0, 0.0, None, bias, None, None, None) is None
    assert not PyErr_pending()


def test_torch_gemm_offers_torch_calls_for_its_bias_epilogues():
    """`TorchGemm`'s launchers for a row bias (alone, relu, gelu) carry the torch call that
    gemm_plain records; each computes what the launcher's function does, into out= or allocating."""
    from kernel_api.providers.torch_ops import kernels as torch_kernels

    A, B, bias = torch.randn(16, 8), torch.randn(8, 4), torch.randn(4)
    pairs = {torch_kernels._addmm_call: torch_kernels._addmm_launch,
             torch_kernels._addmm_relu_call: torch_kernels._addmm_relu_launch,
             torch_kernels._addmm_gelu_call: torch_kernels._addmm_gelu_launch}
    for call, launch in pairs.items():
        want = torch.full((16, 4), float("nan"))
        launch(A, B, want, bias, None)
        if call is torch_kernels._addmm_relu_call:
            assert torch.allclose(want, torch.relu(A @ B + bias), atol=1e-5)
        out = torch.full((16, 4), float("nan"))
        call(A, B, bias, out=out)
        assert torch.equal(out, want), call.__name__
        assert torch.equal(call(A, B, bias), want), call.__name__
    assert torch.allclose(torch_kernels._addmm_call(A, B, bias), A @ B + bias, atol=1e-5)
    with pytest.raises(TypeError, match="torch_call must be a callable"):
        Launcher(_python_launch, (bias, 1.0), torch_call=torch_kernels._addmm_call)  # not only tensors


def _at_alignment(shape: tuple, low: int) -> torch.Tensor:
    """A dense f32 tensor of ``shape`` whose data pointer is ``low`` modulo 1024."""
    numel = shape[0] * shape[1]
    room = torch.empty(numel + 512)
    offset = ((low - room.data_ptr()) % 1024) // 4
    return room[offset:offset + numel].view(shape)


@pytest.mark.parametrize("low", [0, 512])
def test_allocating_bias_calls_use_a_call_recorded_for_an_allocator_made_output(entry, low):
    """A bias call's torch call recorded for a dense output at the caching allocator's alignment
    (an out= call's) serves allocating calls too, without an output made first: kept for (A, B,
    bias) and run as call(A, B, bias). One recorded for an output at another alignment does not
    (the allocator never makes one there), and neither does one for other dtypes' outputs."""
    spy = EpilogueSpy()
    A, B, bias = torch.randn(16, 8), torch.randn(8, 4), torch.randn(4)
    allocating = lambda: entry.gemm_plain(ops._GEMM_TAG, A, B, None, 1.0, 0.0, None, bias, None, None,  # noqa: E731
                                          None)
    ops._record_torch_call(Launcher(_python_launch, (bias,), torch_call=spy), current().policy,
                           (A, B, bias, _at_alignment((16, 4), 64)), _epilogue_tag())
    assert allocating() is None and not spy.calls  # no output the allocator would make
    ops._record_torch_call(Launcher(_python_launch, (bias,), torch_call=spy), current().policy,
                           (A, B, bias, _at_alignment((16, 4), low)), _epilogue_tag())
    assert entry.calls() == 2
    got = allocating()
    assert spy.calls == [(seen(A), seen(B), seen(bias))] and entry.calls() == 3  # kept for the inputs
    assert torch.allclose(got, A @ B + bias, atol=1e-5) and got.is_contiguous()
    assert allocating() is not None and len(spy.calls) == 2
