"""Repeated calls replayed from C on the GPU: correct results, and no Python dispatch once a
call's metadata is recorded, for softmax's kernel families (our CUDA source kernels through
their recorded CUDA launch, the torch provider through its torch call), softmax under
autograd, GEMMs with a bias, and kernel_api.nn.Linear at decode batch sizes. Timings are the
benchmarks' (benchmarks/softmax.py, benchmarks/host_latency_torch.py --linear)."""

from __future__ import annotations

import pytest
import torch

import kernel_api
from kernel_api import SoftmaxArguments, native
from kernel_api.ops import dispatch as ops

pytestmark = pytest.mark.gpu

_DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}


def _rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.double() - ref.double()).norm() / ref.double().norm()).item()


@pytest.fixture
def python_path(monkeypatch):
    """Counts the calls that reach the front door's Python path (`_launch`)."""
    counted = []
    launch = ops._launch

    def counting(*args, **kwargs):
        counted.append(args[0])
        return launch(*args, **kwargs)

    monkeypatch.setattr(ops, "_launch", counting)
    yield counted


# (rows, cols, dtype, providers): our register, shared-memory and cluster kernels, and torch's
CASES = [
    (8192, 128, "bf16", None),
    (128, 32000, "bf16", None),
    (4096, 50257, "f16", None),  # (the shared-memory kernels)
    (16, 65536, "bf16", ["cuda_src"]),  # (the cluster splits: few long rows)
    (32, 131072, "f16", None),  # (a replayable family, not one whose every call takes the Python path)
    (1, 1 << 20, "bf16", None),
    (16384, 1024, "f32", None),
    (333, 1000, "f16", ["torch"]),
]


def _placement(args) -> tuple:
    """What of a Python-path call's arguments the call key holds besides their metadata: the
    operation and each input's address modulo 1024 (outputs are left out: a made one is not in
    the key, and a given one is the same tensor in every round)."""
    inputs = [n for n in args.tensor_attributes if n not in args.output_names]
    return (type(args).__name__, tuple(getattr(args, n).data_ptr() & 1023 for n in inputs))


@pytest.mark.parametrize("rows,cols,dtype,providers", CASES)
def test_repeated_softmax_calls_are_replayed_from_c(python_path, rows, cols, dtype, providers):
    if native.entry() is None:
        pytest.skip(f"no native entry points: {native.why_not_entry()}")
    ops.clear_dispatch_cache()
    dt = _DTYPES[dtype]
    x = torch.randn(rows, cols, device="cuda", dtype=dt) * 3
    g = torch.randn(rows, cols, device="cuda", dtype=dt)
    with kernel_api.settings(providers=providers):
        out, grad_in = torch.full_like(x, float("nan")), torch.full_like(x, float("nan"))

        def rounds(n: int) -> tuple:
            for _ in range(n):
                x.copy_(torch.randn_like(x) * 3)  # new data, same metadata
                y = kernel_api.ops.softmax(x)
                assert kernel_api.ops.softmax(x, out=out) is out
                d = kernel_api.ops.softmax_backward(g, y)
                assert kernel_api.ops.softmax_backward(g, y, grad_in=grad_in) is grad_in
            return y, d

        # The first calls choose and record one recipe per placement of their inputs (the call key
        # holds each tensor's address modulo 1024: the backward's y, an allocated output, comes in
        # either of the allocator's two 512-byte classes), so warm up in the pattern of the timed
        # rounds until eight rounds in a row record nothing new. A placement the warm-up never
        # saw (the allocator's reuse pattern can change when garbage is freed) may still take the
        # Python path once; a placement seen before must not.
        quiet = 0
        for _ in range(64):
            before = len(python_path)
            rounds(1)
            quiet = quiet + 1 if len(python_path) == before else 0
            if quiet == 8:
                break
        first = len(python_path)
        seen = {_placement(a) for a in python_path}
        y, d = rounds(4)
        torch.cuda.synchronize()
    again = [_placement(a) for a in python_path[first:]]
    assert not [p for p in again if p in seen], "a repeated call of a recorded placement took the Python path"
    assert len(set(again)) == len(again), "a call took the Python path twice with one placement"
    want = torch.softmax(x.double(), -1)
    assert _rel(y, want) < 1e-2 and _rel(out, want) < 1e-2
    y64 = y.double()
    want_grad = y64 * (g.double() - (g.double() * y64).sum(-1, keepdim=True))
    assert _rel(d, want_grad) < 2e-2 and _rel(grad_in, want_grad) < 2e-2


def test_a_recorded_cuda_launch_runs_on_other_streams_and_devices_current():
    """The recorded launch of a CUDA source kernel honours the stream it is given, and launches
    in the tensors' device's context whatever device is current."""
    x = torch.randn(4096, 1024, device="cuda", dtype=torch.bfloat16)
    with kernel_api.settings(providers=["cuda_src"]):
        for _ in range(2):
            kernel_api.ops.softmax(x)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            y = kernel_api.ops.softmax(x, stream=side)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
    assert _rel(y, torch.softmax(x.double(), -1)) < 1e-2


def test_kernel_run_replays_a_cuda_source_softmax_through_its_bound_launch():
    from kernel_api.providers.cuda_src.kernels.softmax import CudaSoftmaxForward

    x = torch.randn(1000, 700, device="cuda", dtype=torch.float16)
    out = torch.full_like(x, float("nan"))
    args = SoftmaxArguments(x, out)
    kernel = next(k for k in kernel_api.get_kernels(args) if isinstance(k, CudaSoftmaxForward) and k.strategy == "warp")
    artifact = kernel.compile(args)
    kernel.run(args, compiled_artifact=artifact)
    launcher = kernel._launcher(args, artifact)
    assert launcher is not None and launcher.ffi, "no recorded CUDA launch on a GPU machine"
    assert isinstance(args._binding.launch, native.entry().BoundLaunch)
    for _ in range(3):
        out.fill_(float("nan"))
        x.copy_(torch.randn_like(x))
        kernel.run(args, compiled_artifact=artifact)  # the bound launch: the recorded CUDA launch
        torch.cuda.synchronize()
        assert _rel(out, torch.softmax(x.double(), -1)) < 1e-2


@pytest.mark.parametrize("rows,cols", [(512, 2000), (8192, 4097)])
def test_softmax_under_autograd_matches_torch_without_the_custom_op(monkeypatch, rows, cols):
    """Eager autograd: small problems are torch's own softmax (its C++ backward node), larger ones
    ours through `_SoftmaxWithGrad`; neither goes through the custom op's dispatch."""
    calls = []
    op = torch.ops.kernel_api.softmax

    class Spy:
        def __call__(self, *args, **kwargs):
            calls.append(args)
            return op(*args, **kwargs)

        def __getattr__(self, name):
            return getattr(op, name)

    x = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16)
    monkeypatch.setattr(torch.ops.kernel_api, "softmax", Spy(), raising=False)
    for _ in range(3):
        y = kernel_api.ops.softmax(x)
        (got,) = torch.autograd.grad(y, x, g)
    ours = x.numel() > ops.AUTOGRAD_NATIVE_MAX_ELEMENTS
    assert (type(y.grad_fn).__name__ == "_SoftmaxWithGradBackward") == ours, y.grad_fn
    ref = x.detach().double().requires_grad_()
    (want,) = torch.autograd.grad(torch.softmax(ref, -1), ref, g.double())
    assert _rel(got, want) < 2e-2
    assert not calls, "eager autograd went through the custom op's dispatch"


@pytest.mark.parametrize("in_f,out_f", [(768, 3072), (4096, 4096)])
@pytest.mark.parametrize("batch", [1, 4, 16])
def test_patched_linear_at_decode_batches_is_replayed_from_c(python_path, monkeypatch, in_f, out_f, batch):
    from kernel_api.nn import linear as nn_linear

    if native.entry() is None:
        pytest.skip(f"no native entry points: {native.why_not_entry()}")
    torch.manual_seed(0)
    layer = kernel_api.nn.Linear(in_f, out_f, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(batch, in_f, device="cuda", dtype=torch.bfloat16)
    projected = []
    project = nn_linear._project
    monkeypatch.setattr(nn_linear, "_project", lambda *a: projected.append(1) or project(*a))
    with torch.no_grad():
        for _ in range(3):
            y = layer(x)
        first, first_projected = len(python_path), len(projected)
        for _ in range(3):
            x.copy_(torch.randn_like(x))
            y = layer(x)
        want = torch.nn.functional.linear(x.double(), layer.weight.double(), layer.bias.double())
    assert _rel(y, want) < 2e-2
    assert len(python_path) == first and len(projected) == first_projected, "a repeated forward took the Python path"
