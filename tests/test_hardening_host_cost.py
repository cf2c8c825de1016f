"""Which path a repeated call takes: replayed from C (the launch table, a recorded torch call, a
recorded output maker) without entering the front door's Python dispatch, for softmax's kernel
families (our CUDA source kernels and the torch provider's), GEMMs with a row bias launched by a
kernel of ours, and kernel_api.nn.Linear's forward.

Runs on CPU: stand-ins take the place of compiled kernels (a Python callable converted to a
TVM-FFI function), recorded as the front door records a launcher after a call's Python path;
the frames a call enters are watched with ``sys.setprofile``. The timings these paths reach are
benchmarks' business (benchmarks/softmax.py, benchmarks/host_latency_torch.py --linear).
"""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
import torch

import kernel_api
from kernel_api import SoftmaxArguments, SoftmaxBackwardArguments, native
from kernel_api.core.artifact import CompiledArtifact
from kernel_api.launcher import Launcher
from kernel_api.ops import dispatch as ops  # the front door's module: its caches and launch records
from kernel_api.tuning.settings import current

tvm_ffi = pytest.importorskip("tvm_ffi")
if native.module_path() is None:
    pytest.skip("kernel_api.native._launch_table was not built by this install", allow_module_level=True)


@pytest.fixture
def entry():
    module = native.entry()
    if module is None:
        pytest.skip(f"no CPython entry points here: {native.why_not_entry()}")
    ops.clear_dispatch_cache()
    assert ops._load_table()
    yield module
    ops.clear_dispatch_cache()


class Recorder:
    """A TVM-FFI stand-in for a compiled kernel: logs what each call saw (tensors as data
    pointer and shape: tensors passed as DLTensor pointers live only during the call) and fills
    those of ``outputs`` it is given with 0.5, as a kernel writes its output."""

    def __init__(self, outputs: tuple = ()):
        self.calls = []

        def record(*args):
            self.calls.append(tuple((a.data_ptr(), tuple(a.shape)) if hasattr(a, "data_ptr") else a for a in args))
            written = {a.data_ptr() for a in args if hasattr(a, "data_ptr")}
            for out in outputs:
                if out.data_ptr() in written:
                    out.fill_(0.5)

        self.function = tvm_ffi.convert(record)


def seen(tensor: torch.Tensor) -> tuple:
    return tensor.data_ptr(), tuple(tensor.shape)


class Frames:
    """The Python functions a block of code enters (qualified names), through sys.setprofile."""

    def __init__(self):
        self.entered: list[str] = []

    def __enter__(self):
        def profile(frame, event, arg):
            if event == "call":
                code = frame.f_code
                self.entered.append(f"{frame.f_globals.get('__name__', '?')}.{code.co_qualname}")
        sys.setprofile(profile)
        return self

    def __exit__(self, *exc):
        sys.setprofile(None)

    def of(self, module: str) -> list[str]:
        return [name for name in self.entered if name.startswith(module + ".")]


def aligned_like(t: torch.Tensor) -> torch.Tensor:
    """A new tensor of ``t``'s shape and dtype whose data pointer has ``t``'s low 10 bits (what
    the launch table keys alignment on), filled with random values."""
    size = t.element_size()
    pool = torch.empty(t.numel() + 1024 // size, dtype=t.dtype)
    offset = ((t.data_ptr() - pool.data_ptr()) & 1023) // size
    view = pool[offset:offset + t.numel()].view(t.shape)
    assert view.data_ptr() & 1023 == t.data_ptr() & 1023
    return view.copy_(torch.randn(t.shape))


def _torch_softmax_kernel(backward: bool = False):
    from kernel_api.providers.torch_ops.kernels import TorchSoftmax, TorchSoftmaxBackward

    cls = TorchSoftmaxBackward if backward else TorchSoftmax
    return next(k for k in cls.generate_kernels(None) if k.metadata.kernel_name.endswith("_f32"))


def test_the_torch_providers_softmax_is_replayed_from_c(entry):
    """A softmax choice of the torch provider offers a launcher with a torch call; once recorded
    (as the front door records it after a call's Python path), repeated ops.softmax calls,
    allocating or not, run torch's softmax from C: no frame of the front door's dispatch, no
    Kernel.run, no arguments built."""
    x, y = torch.randn(6, 10), torch.empty(6, 10)
    kernel = _torch_softmax_kernel()
    args = SoftmaxArguments(x, y)
    launcher = kernel._launcher(args, CompiledArtifact(None, kernel))
    assert launcher is not None and launcher.torch_call is not None and not launcher.ffi
    ops._record_torch_call(launcher, current().policy, (x, y), ops._SOFTMAX_TAG, True)
    want = torch.softmax(x, -1)
    with Frames() as frames:
        got = ops.softmax(x)
        again = ops.softmax(x, out=y)
    assert torch.allclose(got, want) and again is y and torch.allclose(y, want)
    assert frames.of("kernel_api.ops.dispatch") == ["kernel_api.ops.dispatch.softmax"] * 2, frames.entered
    assert not frames.of("kernel_api.kernel") and not frames.of("kernel_api.arguments.softmax")


def test_the_torch_providers_softmax_backward_is_replayed_from_c(entry):
    g, y = torch.randn(5, 9), torch.softmax(torch.randn(5, 9), -1)
    grad_in = torch.empty(5, 9)
    kernel = _torch_softmax_kernel(backward=True)
    launcher = kernel._launcher(SoftmaxBackwardArguments(g, y, grad_in), CompiledArtifact(None, kernel))
    assert launcher is not None and launcher.torch_call is not None
    ops._record_torch_call(launcher, current().policy, (g, y, grad_in), ops._SOFTMAX_BACKWARD_TAG, True)
    want = y * (g - (g * y).sum(-1, keepdim=True))
    version = grad_in._version
    with Frames() as frames:
        got = ops.softmax_backward(g, y)
        again = ops.softmax_backward(g, y, grad_in=grad_in)
    assert torch.allclose(got, want, atol=1e-6) and again is grad_in and torch.allclose(grad_in, want, atol=1e-6)
    assert grad_in._version > version
    assert frames.of("kernel_api.ops.dispatch") == ["kernel_api.ops.dispatch.softmax_backward"] * 2, frames.entered


def test_allocating_calls_of_a_table_kernel_make_their_output_in_c(entry):
    """For a kernel in the launch table, an allocating call's output is made from C by the maker
    recorded with the entry (what the Python path made it with), then launched into: no frame
    of the front door's dispatch. Other metadata, or an input that requires grad, declines."""
    x = torch.randn(6, 10)
    made = torch.empty(6, 10)  # (the stand-in maker's output: its pointer alignment is the key's)
    fn = Recorder((made,))
    ops._record_native(Launcher(fn.function), current().policy, (x, made), ops._SOFTMAX_TAG,
                       maker=(lambda t: made, 1))
    assert entry.makers() == 1
    with Frames() as frames:
        got = ops.softmax(x)
    assert got is made and fn.calls[-1][:2] == (seen(x), seen(made)) and torch.all(made == 0.5)
    assert frames.of("kernel_api.ops.dispatch") == ["kernel_api.ops.dispatch.softmax"], frames.entered
    assert entry.call(ops._SOFTMAX_TAG, None, None, torch.randn(6, 11)) is None  # another shape: no maker
    assert entry.call(ops._SOFTMAX_TAG, None, None, x.clone().requires_grad_()) is None  # autograd: Python
    with kernel_api.settings(policy=kernel_api.PickAny()):
        assert ops.softmax is not None and entry.call(ops._SOFTMAX_TAG, None, None, x) is None  # another policy
    assert len(fn.calls) == 1
    ops.clear_dispatch_cache()
    assert entry.makers() == 0 and entry.call(ops._SOFTMAX_TAG, None, None, x) is None


def test_call_declines_quietly_and_bumps_a_given_outputs_version(entry):
    x, y = torch.randn(4, 8), torch.empty(4, 8)
    fn = Recorder((y,))
    ops._record_native(Launcher(fn.function), current().policy, (x, y), ops._SOFTMAX_TAG)
    version = y._version
    assert entry.call(ops._SOFTMAX_TAG, None, y, x) is y and y._version > version
    assert entry.call(ops._SOFTMAX_TAG, 5, y, x) is y and fn.calls[-1][-1].value == 5  # a raw handle, as a CUstream
    for bad in ((ops._SOFTMAX_TAG, None, y, "x"), (ops._SOFTMAX_TAG, None, "y", x),
                (ops._SOFTMAX_TAG, None, x[:, :8], x)):  # not tensors; an output that overlaps
        assert entry.call(*bad) is None
    with pytest.raises(TypeError, match=r"call\(tag, stream, out, \*inputs\)"):
        entry.call(ops._SOFTMAX_TAG, None, y)
    assert len(fn.calls) == 2


@pytest.mark.parametrize("backward", [False, True])
def test_cuda_source_softmax_kernels_offer_a_recorded_launch(monkeypatch, backward):
    """Our CUDA source softmax kernels (launched by cuda.core from Python) offer a launcher whose
    function is a TVM-FFI function made by the native module (`native.cuda_launch`): what the
    Python launch does, recorded (the grid, block and row parameters fixed by the operands'
    metadata, the operands' pointers read per call), so the table replays it from C."""
    from kernel_api.providers.cuda_src.kernels.softmax import CudaSoftmaxBackward, CudaSoftmaxForward

    made = []
    stand_in = Recorder().function

    def cuda_launch(kernel, n_tensors, grid, block, shared_bytes, parameters):
        made.append((kernel, n_tensors, grid, block, shared_bytes, parameters))
        return stand_in

    monkeypatch.setattr(native, "cuda_launch", cuda_launch)
    cls = CudaSoftmaxBackward if backward else CudaSoftmaxForward
    name = f"{cls.__name__}_bf16_warp_a8"
    kernel = next(k for k in cls.generate_kernels(None, cc=90) if k.metadata.kernel_name == name)
    rows, cols = 8192, 128
    t = [torch.empty(rows, cols, dtype=torch.bfloat16) for _ in range(3 if backward else 2)]
    args = SoftmaxBackwardArguments(*t) if backward else SoftmaxArguments(*t)
    artifact = CompiledArtifact(SimpleNamespace(kernel=SimpleNamespace(handle=0x1234)), kernel,
                                extra=kernel.launch_plan(args, None))
    launcher = kernel._launcher(args, artifact)
    assert launcher is not None and launcher.ffi and launcher.function is stand_in and launcher.tail == ()
    T = native.TENSOR
    operands = ((T, 0), (T, 1), (T, 2)) if backward else ((T, 0), (T, 1))
    lds = (cols,) * (3 if backward else 2)
    assert made == [(0x1234, len(t), (rows // 4, 1, 1), (128, 1, 1), 0,
                     operands + ((8, rows), (8, cols)) + tuple((8, ld) for ld in lds))]


def test_the_native_cuda_launch_checks_what_it_is_given():
    table = native.table()
    if table is None:
        pytest.skip(f"no launch table here: {native.why_not()}")
    for bad in ((0x10, 2, 1, 1, 1, 32, 1, 1, 0, 0, 5),  # a tensor index past the tensors
                (0x10, 2, 1, 1, 1, 32, 1, 1, 0, 3, 1),  # a constant of 3 bytes
                (0x10, 2, 0, 1, 1, 32, 1, 1, 0),  # an empty grid
                (0x10, 0, 1, 1, 1, 32, 1, 1, 0)):  # no tensors
        with pytest.raises(ValueError, match="cuda_launch"):
            table.cuda_launch(*bad)
    with pytest.raises(TypeError, match="cuda_launch"):
        table.cuda_launch(0x10, 2, 1, 1, 1, 32, 1, 1, 0, 0)  # half a parameter
    try:
        import ctypes.util
        driver = ctypes.util.find_library("cuda")
    except Exception:  # noqa: BLE001
        driver = None
    if driver is None:  # no CUDA driver here: nothing is made, and the Python launch stays
        with pytest.raises(RuntimeError, match="CUDA driver"):
            table.cuda_launch(0x10, 2, 1, 1, 1, 32, 1, 1, 0, 0, 0, 0, 1)
        assert native.cuda_launch(0x10, 2, (1, 1, 1), (32, 1, 1), 0, ((0, 0), (0, 1))) is None


def test_a_gemm_with_a_bias_of_our_kernel_is_replayed_from_c(entry):
    """A GEMM with a row bias launched by a TVM-FFI function of ours (the bias among its launcher's
    constants) is recorded in the launch table with the bias as an operand, in the function's
    argument order; gemm_plain then replays repeated calls with each call's own bias, allocating
    ones into the output it makes, without the front door's Python frames."""
    A, B, bias = torch.randn(16, 8), torch.randn(8, 4), torch.randn(4)
    made = torch.empty(16, 4)
    fn = Recorder((made,))
    launcher = Launcher(fn.function, (None, bias, 1.0, 0.0))  # a CuTe DSL GEMM's tail: C, bias, alpha, beta
    entry_ = ops._epilogue_entry(launcher, bias, -1, current().policy, (0, 0, 0))
    tag = ops._GEMM_TAG | 1 << ops._EPILOGUE_SHIFT
    ops._record_native_epilogue(entry_, current().policy, (A, B, bias, made), tag)
    other = aligned_like(bias)  # another bias of the same metadata: the call's own is passed
    with Frames() as frames:
        out = ops.gemm(A, B, out=made, bias=other)
    assert out is made and fn.calls[-1] == (seen(A), seen(B), seen(made), None, seen(other), 1.0, 0.0, None)
    assert frames.of("kernel_api.ops.dispatch") == ["kernel_api.ops.dispatch.gemm"], frames.entered
    gelu = entry.gemm_plain(ops._GEMM_TAG, A, B, made, 1.0, 0.0, None, other, "gelu", None, None)
    assert gelu is None and len(fn.calls) == 1  # another activation: another entry (none)
    # an allocating call: C makes the dense output the caching allocator would, if the table has
    # an entry for one (the stand-in's output here is dense, its pointer's low bits what they are).
    # On the CPU the output C makes lands at whatever address malloc gives, so it may fall in
    # another alignment class than the recorded one: then C declines (None), never a wrong launch.
    low = made.data_ptr() & 1023
    if low in (0, 512):
        served = entry.gemm_plain(ops._GEMM_TAG, A, B, None, 1.0, 0.0, None, other, None, None, None)
        assert (served is None and len(fn.calls) == 1) or (served is not None and len(fn.calls) == 2)


def test_a_patched_linear_replays_its_gemm_from_c(entry):
    """kernel_api.nn.Linear's forward of a 2-D input with recorded metadata calls gemm_plain
    itself, with the weight's transposed view kept on the layer: no _project, no ops.gemm
    frame, no new view per call; a weight given new memory is viewed anew."""
    from kernel_api.providers.torch_ops.kernels import TorchGemm

    layer = kernel_api.nn.Linear(8, 4)
    x = torch.randn(16, 8)
    with torch.no_grad():
        out = torch.empty(16, 4)
        args = kernel_api.GemmArguments(x, layer.weight.t(), out,
                                        epilogue=kernel_api.arguments.EpilogueArguments(bias=layer.bias))
        kernel = next(k for k in TorchGemm.generate_kernels(None) if k.metadata.kernel_name == "TorchGemm_f32_tnt")
        launcher = kernel._launcher(args, CompiledArtifact(None, kernel))
        ops._record_torch_call(launcher, current().policy, (x, layer.weight.t(), layer.bias, out),
                               ops._GEMM_TAG | 1 << ops._EPILOGUE_SHIFT, True)
        layer(x)  # keeps the weight's view
        with Frames() as frames:
            y = layer(x)
        assert torch.allclose(y, torch.nn.functional.linear(x, layer.weight, layer.bias), atol=1e-6)
        assert not frames.of("kernel_api.ops.dispatch"), frames.entered
        entered = [name.rsplit(".", 1)[-1] for name in frames.of("kernel_api.nn.linear")]
        assert "_project" not in entered and entered.count("forward") == 1
        from kernel_api.nn.linear import _weight_t

        kept = _weight_t(layer, layer.weight)
        assert _weight_t(layer, layer.weight) is kept  # the same view while the weight stays
        layer.weight.data = torch.randn(4, 8)  # new memory: the kept view would be stale
        assert _weight_t(layer, layer.weight).data_ptr() == layer.weight.data_ptr()
        kept = _weight_t(layer, layer.weight)
        layer.weight.add_(1.0)  # changed in place (a new version): viewed anew, as a resize_ would need
        assert _weight_t(layer, layer.weight) is not kept


def test_outputs_made_in_c_come_from_torchs_allocator_without_a_python_call(entry, monkeypatch):
    """An allocating call's output made in C (softmax's "dense, like the first input" maker,
    gemm_plain's (*A.shape[:-1], N)) comes from torch's allocator through the DLPack exchange
    API: no Python-level call such as new_empty (whose argument parsing costs as much host time
    as the rest of a replayed call), and the tensor the Python path would make."""
    made = []
    new_empty = torch.Tensor.new_empty

    def counting(self, *args, **kwargs):
        made.append(args)
        return new_empty(self, *args, **kwargs)

    x, A, B = torch.randn(6, 10), torch.randn(16, 8), torch.randn(8, 4)
    fn = Recorder()
    room = torch.empty(64 + 256)
    for offset in range(256):  # entries for outputs at every 4-byte offset modulo 1024 (keys hold 10 bits)
        ops._record_native(Launcher(fn.function), current().policy, (x, room[offset:offset + 60].view(6, 10)),
                           ops._SOFTMAX_TAG, maker=ops._NEW_LIKE_FIRST)
        ops._record_native(Launcher(fn.function), current().policy, (A, B, room[offset:offset + 64].view(16, 4)),
                           ops._GEMM_TAG)
    monkeypatch.setattr(torch.Tensor, "new_empty", counting)
    y = ops.softmax(x)
    out = ops.gemm(A, B)
    assert len(fn.calls) == 2 and not made
    want = ops._new_like(x), ops._new_gemm_output(A, B)
    for got, like in zip((y, out), want):
        assert (got.shape, got.stride(), got.dtype, got.device) == (like.shape, like.stride(), like.dtype, like.device)


def test_small_problems_go_to_kernels_whose_calls_are_replayed():
    """Below `REPLAYABLE_FIRST_BYTES` the front door leaves out kernel classes that offer no
    `_launcher` (every call of theirs takes the Python path) when another candidate fits: 32x131072
    softmax goes to the cluster splits, not the window / row-group kernels. Larger problems keep
    every candidate, as does a problem only such kernels take."""
    from kernel_api.kernel import Kernel
    from kernel_api.tuning.policies import rank_candidates

    def meta_args(rows, cols, dtype):
        x = torch.empty(rows, cols, dtype=dtype, device="meta")
        return SoftmaxArguments(x, torch.empty_like(x))

    never = lambda k: type(k)._launcher is Kernel._launcher  # noqa: E731
    small = meta_args(32, 131072, torch.float16)
    kernels = kernel_api.get_kernels(small, cc=90)
    assert any(never(k) for k in kernels)
    kept = ops.replayable_first(kernels, small)
    assert kept and not any(never(k) for k in kept)
    assert "Split" in rank_candidates(kept, small, sm_count=132)[0].metadata.kernel_name
    large = meta_args(8, 1 << 22, torch.float32)  # (256 MiB read and written)
    assert ops.replayable_first(kernel_api.get_kernels(large, cc=90), large) == kernel_api.get_kernels(large, cc=90)
    only_python_path = [k for k in kernels if never(k)]
    assert ops.replayable_first(only_python_path, small) == only_python_path


def test_softmax_under_autograd_is_torchs_only_where_the_settings_allow_the_torch_provider():
    """Small softmax problems under autograd take torch's own op (a C++ autograd node), unless the
    settings restrict the providers to ones without torch: the restriction holds."""
    from kernel_api.ops import dispatch

    small = torch.empty(8, 16, device="meta")
    large = torch.empty(dispatch.AUTOGRAD_NATIVE_MAX_ELEMENTS + 1, device="meta")
    assert dispatch.torch_softmax_serves_autograd(small)
    assert not dispatch.torch_softmax_serves_autograd(large)
    with kernel_api.settings(providers=["cuda_src"]):
        assert not dispatch.torch_softmax_serves_autograd(small)
    with kernel_api.settings(providers=["torch", "cuda_src"]):
        assert dispatch.torch_softmax_serves_autograd(small)
