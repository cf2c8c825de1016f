"""Which path a repeated call takes: replayed from C (the recipe a Python path recorded: a
kernel's launch, its output made in C, or a torch call) without entering the front door's
Python dispatch, for softmax's kernel families (our CUDA source kernels and the torch
provider's), GEMMs with a row bias launched by a kernel of ours, and kernel_api.nn.Linear's
forward.

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

tvm_ffi = pytest.importorskip("tvm_ffi")
if native.module_path() is None:
    pytest.skip("kernel_api.native._launch_table was not built by this install", allow_module_level=True)


@pytest.fixture
def entry():
    module = native.entry()
    if module is None:
        pytest.skip(f"no CPython entry points here: {native.why_not_entry()}")
    ops.clear_dispatch_cache()
    assert ops._load_entry()
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


def _front_door_frames(name: str) -> list[str]:
    """The Python frames a replayed call of ops.<name> enters: none where the front door is a C
    function (native/front_door.cc), else its own."""
    return [] if native.front_door_module() is not None else [f"kernel_api.ops.dispatch.{name}"]


def aligned_like(t: torch.Tensor) -> torch.Tensor:
    """A new tensor of ``t``'s shape and dtype whose data pointer has ``t``'s low 10 bits (what
    call keys hold of a pointer), filled with random values."""
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


class _Chosen:
    """A stand-in for the kernel a Python path chose: its `_launcher` is the one given."""

    def __init__(self, launcher: Launcher):
        self.launcher = launcher

    def _launcher(self, args, artifact):
        return self.launcher


def _record(op: int, launcher: Launcher, args, call: tuple, made=None) -> None:
    """Record ``launcher``'s launch of ``args`` for calls keyed as ``call``, as a front door's
    Python path does after its launch (`dispatch.record_replay`)."""
    assert ops.record_replay(op, _Chosen(launcher), None, args, call, made)


def _made_variants(op: int, launcher: Launcher, make_args, call: tuple, like: torch.Tensor) -> None:
    """Record a launch whose output the replay makes, for every pointer alignment from 16 to 1024
    bytes (the CPU allocator's addresses vary; the caching allocator's are 512-aligned)."""
    room = torch.empty(like.numel() + 1024 // like.element_size(), dtype=like.dtype)
    for low in (16, 32, 64, 128, 256, 512, 1024):
        offset = (low - (room.data_ptr() & 1023)) % 1024 // like.element_size()
        made = room[offset:offset + like.numel()].view(like.shape)
        assert native.recipes.alignment(made.data_ptr()) == low
        _record(op, launcher, make_args(made), call, made)


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
    _record(ops.SOFTMAX_OP, launcher, args, (x, -1, None, None), made=y)
    _record(ops.SOFTMAX_OP, launcher, args, (x, -1, y, None))
    want = torch.softmax(x, -1)
    with Frames() as frames:
        got = ops.softmax(x)
        again = ops.softmax(x, out=y)
    assert torch.allclose(got, want) and got is not y and again is y and torch.allclose(y, want)
    assert frames.of("kernel_api.ops.dispatch") == _front_door_frames("softmax") * 2, frames.entered
    assert not frames.of("kernel_api.kernel") and not frames.of("kernel_api.arguments.softmax")


def test_the_torch_providers_softmax_backward_is_replayed_from_c(entry):
    g, y = torch.randn(5, 9), torch.softmax(torch.randn(5, 9), -1)
    grad_in = torch.empty(5, 9)
    kernel = _torch_softmax_kernel(backward=True)
    args = SoftmaxBackwardArguments(g, y, grad_in)
    launcher = kernel._launcher(args, CompiledArtifact(None, kernel))
    assert launcher is not None and launcher.torch_call is not None
    _record(ops.SOFTMAX_BACKWARD_OP, launcher, args, (g, y, -1, None, None), made=grad_in)
    _record(ops.SOFTMAX_BACKWARD_OP, launcher, args, (g, y, -1, grad_in, None))
    want = y * (g - (g * y).sum(-1, keepdim=True))
    version = grad_in._version
    with Frames() as frames:
        got = ops.softmax_backward(g, y)
        again = ops.softmax_backward(g, y, grad_in=grad_in)
    assert torch.allclose(got, want, atol=1e-6) and again is grad_in and torch.allclose(grad_in, want, atol=1e-6)
    assert grad_in._version > version
    assert frames.of("kernel_api.ops.dispatch") == _front_door_frames("softmax_backward") * 2, frames.entered


def test_allocating_calls_of_a_table_kernel_make_their_output_in_c(entry):
    """For a kernel of ours (a TVM-FFI function), an allocating call's output is made in C as the
    recipe says (dense, like the input), then launched into: no frame of the front door's
    dispatch. Other metadata, an input that requires grad, another policy decline."""
    x = torch.randn(6, 10)
    fn = Recorder()
    _made_variants(ops.SOFTMAX_OP, Launcher(fn.function), lambda made: SoftmaxArguments(x, made), (x, -1, None, None),
                   x)
    with Frames() as frames:
        got = ops.softmax(x)
    assert got.shape == x.shape and got.is_contiguous() and fn.calls[-1][:2] == (seen(x), seen(got))
    assert frames.of("kernel_api.ops.dispatch") == _front_door_frames("softmax"), frames.entered
    assert entry.replay(ops.SOFTMAX_OP, torch.randn(6, 11), -1, None, None) is None  # another shape
    assert entry.replay(ops.SOFTMAX_OP, x.clone().requires_grad_(), -1, None, None) is None  # autograd
    with kernel_api.settings(policy=kernel_api.PickAny()):
        assert entry.replay(ops.SOFTMAX_OP, x, -1, None, None) is None  # another policy
    assert len(fn.calls) == 1
    ops.clear_dispatch_cache()
    assert entry.replays() == 0 and entry.replay(ops.SOFTMAX_OP, x, -1, None, None) is None


def test_a_replay_declines_quietly_and_bumps_a_given_outputs_version(entry):
    x, y = torch.randn(4, 8), torch.empty(4, 8)
    fn = Recorder((y,))
    _record(ops.SOFTMAX_OP, Launcher(fn.function), SoftmaxArguments(x, y), (x, -1, y, None))
    version = y._version
    assert entry.replay(ops.SOFTMAX_OP, x, -1, y, None) is y and y._version > version
    for bad in ((x, -1, y, 5), (x, -1, "y", None), ("x", -1, y, None), (x, -1, x, None)):  # a stream given;
        assert entry.replay(ops.SOFTMAX_OP, *bad) is None  # not tensors; an output that overlaps
    with pytest.raises(TypeError, match=r"replay\(op, \*args\)"):
        entry.replay()
    assert len(fn.calls) == 1


@pytest.mark.parametrize("backward", [False, True])
def test_cuda_source_softmax_kernels_offer_a_recorded_launch(monkeypatch, backward):
    """Our CUDA source softmax kernels (launched through the driver API from Python) offer a
    launcher whose function is a TVM-FFI function made by the native module
    (`native.cuda_launch`): what the Python launch does, recorded (the grid, block and row
    parameters fixed by the operands' metadata, the operands' pointers read per call), so their
    calls replay from C."""
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
        pytest.skip(f"no native library here: {native.why_not()}")
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
    constants) is recorded with the bias taken from the call's arguments, in the function's
    argument order; repeated calls are replayed with each call's own bias, without the front
    door's Python frames. Another activation is another key."""
    A, B, bias = torch.randn(16, 8), torch.randn(8, 4), torch.randn(4)
    made = torch.empty(16, 4)
    fn = Recorder((made,))
    args = kernel_api.GemmArguments(A, B, made, epilogue=kernel_api.arguments.EpilogueArguments(bias=bias))
    launcher = Launcher(fn.function, (None, args.epilogue.bias, 1.0, 0.0))  # a CuTe DSL GEMM's tail: C, bias, alpha, beta
    _record(ops.GEMM_OP, launcher, args, (A, B, made, 1.0, 0.0, None, bias, None, None, None))
    other = aligned_like(bias)  # another bias of the same metadata: the call's own is passed
    with Frames() as frames:
        out = ops.gemm(A, B, out=made, bias=other)
    assert out is made and fn.calls[-1] == (seen(A), seen(B), seen(made), None, seen(other), 1.0, 0.0, None)
    assert frames.of("kernel_api.ops.dispatch") == _front_door_frames("gemm"), frames.entered
    gelu = entry.replay(ops.GEMM_OP, A, B, made, 1.0, 0.0, None, other, "gelu", None, None)
    assert gelu is None and len(fn.calls) == 1  # another activation: another key (none)


def test_a_patched_linear_replays_its_forward_from_c(cpu_ops, entry, monkeypatch):
    """kernel_api.nn.Linear's repeated forward (cuBLAS serving it: the torch provider here) is one
    C call with the weight's transposed view kept on the layer: no _project, no ops.gemm frame,
    no new view per call; a weight given new memory or changed in place is viewed anew."""
    from kernel_api.nn import linear as nn_linear

    monkeypatch.setattr(nn_linear, "_check_device", lambda layer, x: None)
    layer = kernel_api.nn.Linear(8, 4)
    x = torch.randn(16, 8)
    with torch.no_grad(), kernel_api.settings(providers=["torch"]):
        layer(x)  # the Python path: records the GEMM's recipe and the layer's
        with Frames() as frames:
            y = layer(x)
        assert torch.allclose(y, torch.nn.functional.linear(x, layer.weight, layer.bias), atol=1e-6)
        assert not frames.of("kernel_api.ops.dispatch"), frames.entered
        assert frames.of("kernel_api.nn.linear") == ["kernel_api.nn.linear.Linear.forward"], frames.entered
        kept = nn_linear._weight_t(layer, layer.weight)
        assert nn_linear._weight_t(layer, layer.weight) is kept  # the same view while the weight stays
        layer.weight.data = torch.randn(4, 8)  # new memory: the kept view would be stale
        assert nn_linear._weight_t(layer, layer.weight).data_ptr() == layer.weight.data_ptr()
        assert torch.allclose(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias), atol=1e-6)
        kept = nn_linear._weight_t(layer, layer.weight)
        layer.weight.add_(1.0)  # changed in place (a new version): viewed anew, as a resize_ would need
        assert nn_linear._weight_t(layer, layer.weight) is not kept


def test_outputs_made_in_c_come_from_torchs_allocator_without_a_python_call(entry, monkeypatch):
    """An allocating call's output made in C comes from torch's allocator through the DLPack
    exchange API: no Python-level call such as new_empty (whose argument parsing costs as much
    host time as the rest of a replayed call), and the tensor the Python path would make."""
    made = []
    new_empty = torch.Tensor.new_empty

    def counting(self, *args, **kwargs):
        made.append(args)
        return new_empty(self, *args, **kwargs)

    x, A, B = torch.randn(6, 10), torch.randn(16, 8), torch.randn(8, 4)
    fn = Recorder()
    _made_variants(ops.SOFTMAX_OP, Launcher(fn.function), lambda out: SoftmaxArguments(x, out), (x, -1, None, None), x)
    _made_variants(ops.GEMM_OP, Launcher(fn.function), lambda out: kernel_api.GemmArguments(A, B, out),
                   (A, B, None, 1.0, 0.0, None, None, None, None, None), torch.empty(16, 4))
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
