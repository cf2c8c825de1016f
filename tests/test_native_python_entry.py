"""The native library's CPython entry points (kernel_api.native.entry): torch tensors read
through torch's DLPack exchange API, bound launches, remembered summaries, streams and errors
(the replays: tests/test_native_replay.py).

Runs on CPU: a Python callable converted to a TVM-FFI function stands in for a compiled kernel.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

import kernel_api
from kernel_api import native
from kernel_api.ops import dispatch as ops  # the front door's module: its caches and launch records
from kernel_api.launcher import Launcher

tvm_ffi = pytest.importorskip("tvm_ffi")
if native.module_path() is None:
    pytest.skip("kernel_api.native._launch_table was not built by this install (pip install -e . with a C++ "
                "compiler builds it)", allow_module_level=True)


@pytest.fixture
def entry():
    module = native.entry()
    if module is None:
        pytest.skip(f"no CPython entry points here: {native.why_not_entry()}")
    yield module
    ops.clear_dispatch_cache()


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


def seen(tensor: torch.Tensor) -> tuple:
    return tensor.data_ptr(), tuple(tensor.shape)


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


def test_entry_points_name_their_arguments_when_called_wrongly(entry):
    x = torch.randn(4)
    for call, message in ((lambda: entry.recall(1), r"recall\(tag, \*tensors\)"),
                          (lambda: entry.remember(1, "x"), r"remember\(tag, value, \*tensors\)"),
                          (lambda: entry.replay(), r"replay\(op, \*args\)"),
                          (lambda: entry.record(1), r"record\(op, recipe, \*args\)"),
                          (lambda: entry.configure_replay(None), r"configure_replay\(settings"),
                          (lambda: entry.configure(42), "configure: expected torch.Tensor")):
        with pytest.raises(TypeError, match=message):
            call()
    for call in (lambda: entry.recall("not a tag", x), lambda: entry.remember("not a tag", 1, x),
                 lambda: entry.replay("not an op", x)):
        with pytest.raises(TypeError):  # tags and op numbers are ints
            call()


def _python_launch(*args):
    raise AssertionError("a recorded torch call must not go through the launcher's Python function")


def test_torch_gemm_offers_torch_calls_for_its_bias_epilogues():
    """`TorchGemm`'s launchers for a row bias (alone, relu, gelu) carry the torch call that ops
    records for replay (torch.addmm and _addmm_activation themselves, reordered to take the bias
    first, where no keyword is needed); each computes what the launcher's function does, into out=
    or allocating."""
    from kernel_api.providers.torch_ops import kernels as torch_kernels

    A, B, bias = torch.randn(16, 8), torch.randn(8, 4), torch.randn(4)
    out = torch.empty(16, 4)
    expected = {None: A @ B + bias, "relu": torch.relu(A @ B + bias),
                "gelu": torch.nn.functional.gelu(A @ B + bias, approximate="tanh")}
    kernel = next(iter(torch_kernels.TorchGemm.generate_kernels(None)))
    for activation, want in expected.items():
        args = kernel_api.GemmArguments(A, B, out, epilogue=kernel_api.EpilogueArguments(bias=bias,
                                                                                          activation=activation))
        launcher = kernel._launcher(args, None)
        assert (launcher.torch_call in (torch.addmm, torch._addmm_activation)) == (activation != "gelu")
        launched = torch.full((16, 4), float("nan"))
        launcher.function(A, B, launched, bias, None)
        # (torch's CPU kernel computes GELU exactly, cuBLASLt's epilogue with tanh: 1e-3 covers both)
        assert torch.allclose(launched, want, atol=1e-3 if activation == "gelu" else 1e-5), activation
        given = torch.full((16, 4), float("nan"))
        launcher.torch_call(*launcher.torch_arguments((A, B, bias)), out=given)
        assert torch.equal(given, launched), activation
        assert torch.equal(launcher.torch_call(*launcher.torch_arguments((A, B, bias))), launched), activation
    with pytest.raises(TypeError, match="torch_call must be a callable"):
        Launcher(_python_launch, (bias, 1.0), torch_call=torch.addmm)  # not only tensors
    with pytest.raises(TypeError, match="torch_order must be distinct positions"):
        Launcher(_python_launch, (bias,), torch_call=torch.addmm, torch_order=(0, 0, 1))
