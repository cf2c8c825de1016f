"""The launch table library's CPython entry points (kernel_api.native.entry): torch tensors read
through torch's DLPack exchange API, the table launch, bound launches, streams and errors.

Runs on CPU: a Python callable converted to a TVM-FFI function stands in for a compiled kernel.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from kernel_api import native, ops
from kernel_api.settings import current

tvm_ffi = pytest.importorskip("tvm_ffi")
if native._compiler() is None:
    pytest.skip("no C++ compiler to build the launch table", allow_module_level=True)


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


def test_cutedsl_kernels_bind_the_native_launch_when_they_keep_the_gil(entry):
    from types import SimpleNamespace

    from kernel_api.providers.cutedsl.kernel import CuteDslKernel

    fn = Recorder()
    A, B, out = torch.randn(4, 8), torch.randn(8, 3), torch.empty(4, 3)
    args = SimpleNamespace(A=A, B=B, out=out, tensor_attributes=("A", "B", "out"))
    artifact = SimpleNamespace(compiled_obj=fn.function)
    for keep, native_launch in ((True, True), (False, False)):
        kernel = SimpleNamespace(keep_gil_during_launch=keep, _launch_tail=lambda a: (1.0, 0))
        launch = CuteDslKernel._bind_launch(kernel, args, artifact)
        assert isinstance(launch, entry.BoundLaunch) is native_launch
        launch(None)
        assert fn.calls[-1] == (seen(A), seen(B), seen(out), 1.0, 0, None)
    # a constant the native launch cannot hold: the partial converts it per call
    kernel = SimpleNamespace(keep_gil_during_launch=True, _launch_tail=lambda a: ("fast",))
    launch = CuteDslKernel._bind_launch(kernel, args, artifact)
    assert not isinstance(launch, entry.BoundLaunch)
    launch(None)
    assert fn.calls[-1][3] == "fast"
    # a native launch is its own snapshot (it already costs less than operands packed once)
    bound = CuteDslKernel._bind_launch(SimpleNamespace(keep_gil_during_launch=True, _launch_tail=lambda a: ()),
                                       args, artifact)
    assert CuteDslKernel._bind_snapshot_launch(None, args, artifact, bound) is bound


def test_ops_launch_through_the_entry(entry):
    from test_native_launch_table import NativeOnlyKernel

    import kernel_api

    fn = Recorder()
    A, B, out = torch.randn(16, 8), torch.randn(8, 4), torch.empty(16, 4)
    args = kernel_api.GemmArguments(A, B, out)
    ops._record_native(NativeOnlyKernel(fn.function), None, args, current().policy, (A, B, out), ops._GEMM_TAG)
    assert ops._table_launch is entry.launch
    assert ops.gemm(A, B, out=out) is out and fn.calls[-1][:3] == (seen(A), seen(B), seen(out))
    assert ops.gemm(A, B, out=out, stream=12345) is out and len(fn.calls) == 2
    assert fn.calls[-1][-1].value == 12345  # a raw handle, as a CUstream: the pointer it holds
