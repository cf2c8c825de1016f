"""GPU checks of the Triton provider with the example row softmaxes (tests/triton_example_kernels.py).

Each case draws random rows (some entries -inf, one row all equal), places the output inside a
guard buffer filled with a sentinel (a store outside it, or an element never written, fails),
and compares with a float64 reference (torch.softmax of x in float64). Sizes are odd (1 to
20000 columns, 1 to 37 rows), pointers shifted by one element (the ``_a1`` instances), rows
strided inside wider tensors; every launch path runs: ``Kernel.run`` (its first, checked run
and the bound repeat), the recorded `Launcher`, a side stream, and ``kernel_api.ops.softmax``
under ``settings(providers=["triton"])``. The launch of a cached artifact costs about what
Triton's own launch of the same jit function costs.
"""

from __future__ import annotations


import pytest
import torch

triton = pytest.importorskip("triton")

import kernel_api  # noqa: E402
from kernel_api import SoftmaxArguments  # noqa: E402
from kernel_api.core.arch import device_cc  # noqa: E402
from kernel_api.core.streams import to_cuda_stream  # noqa: E402
from kernel_api.providers.triton import compiler as triton_compiler  # noqa: E402

import triton_example_kernels as examples  # noqa: E402

pytestmark = pytest.mark.gpu

GUARD = 61  # sentinel elements before and after the output
SENTINEL = 4096.0  # exact in f32, f16 and bf16; no softmax value
TOL = {torch.float32: 5e-6, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
SIZES = ((1, 1), (3, 7), (37, 999), (5, 1025), (2, 4097), (1, 16384), (3, 20000))


@pytest.fixture(scope="module")
def families():
    row, looped = examples.define_kernels()
    yield row, looped
    examples.unregister(row, looped)


def _x(rows: int, cols: int, dtype: torch.dtype, offset: int = 0, row_pad: int = 0) -> torch.Tensor:
    """(rows, cols) random values, ``offset`` elements past an allocation, rows ``cols + row_pad`` apart."""
    gen = torch.Generator(device="cuda").manual_seed(rows * 7919 + cols)
    base = (torch.randn(offset + rows * (cols + row_pad), device="cuda", generator=gen) * 4).to(dtype)
    x = base[offset:].view(rows, cols + row_pad)[:, :cols]
    x[0, ::5] = -float("inf")  # masked entries (never a whole row)
    x[0, 1 if cols > 1 else 0] = 3.0
    if rows > 1:
        x[-1] = 1.5  # a constant row: 1/cols each
    return x


def _guarded_out(rows: int, cols: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    buffer = torch.full((GUARD + rows * cols + GUARD,), SENTINEL, device="cuda", dtype=dtype)
    return buffer, buffer[GUARD:GUARD + rows * cols].view(rows, cols)


def _check(x: torch.Tensor, buffer: torch.Tensor, out: torch.Tensor, name: str) -> None:
    torch.cuda.synchronize()
    assert (buffer[:GUARD] == SENTINEL).all() and (buffer[-GUARD:] == SENTINEL).all(), f"{name}: wrote outside out"
    reference = torch.softmax(x.double(), dim=-1)
    got = out.double()
    assert not (got == SENTINEL).any(), f"{name}: left elements unwritten"
    error = (got - reference).abs().max().item() if out.numel() else 0.0
    assert error <= TOL[x.dtype], f"{name}: max error {error:.3g} vs the float64 reference"


def _kernels(args: SoftmaxArguments) -> list:
    return kernel_api.get_kernels(args, cc=device_cc(None), providers=["triton"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rows, cols", SIZES)
@pytest.mark.parametrize("offset, row_pad", [(0, 0), (1, 3)])
def test_every_instance_that_fits_computes_softmax(families, dtype, rows, cols, offset, row_pad):
    x = _x(rows, cols, dtype, offset, row_pad)
    buffer, out = _guarded_out(rows, cols, dtype)
    args = SoftmaxArguments(x, out)
    kernels = _kernels(args)
    assert kernels, kernel_api.explain(args, providers=["triton"]).all()
    if offset:
        assert all(k.metadata.kernel_name.endswith("_a1") for k in kernels)
    for kernel in kernels:
        buffer.fill_(SENTINEL)
        kernel.run(args)  # checks, compiles for this GPU, launches, binds
        _check(x, buffer, out, kernel.metadata.kernel_name)
        buffer.fill_(SENTINEL)
        kernel.run(args)  # the bound launch
        _check(x, buffer, out, kernel.metadata.kernel_name + " (bound)")


def test_the_recorded_launcher_and_a_side_stream(families):
    x = _x(37, 999, torch.float16)
    buffer, out = _guarded_out(37, 999, torch.float16)
    args = SoftmaxArguments(x, out)
    kernel = _kernels(args)[0]  # (the output sits 61 elements into its guard buffer: the _a1 instances)
    artifact = kernel.compile(args)
    launcher = kernel._launcher(args, artifact)
    assert launcher is not None
    x2 = _x(37, 999, torch.float16) * 0.5  # (other data, the same metadata)
    buffer2, out2 = _guarded_out(37, 999, torch.float16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        launcher.function(x2, out2, to_cuda_stream(side))
    side.synchronize()
    _check(x2, buffer2, out2, "launcher on a side stream")
    kernel.run(args, compiled_artifact=artifact, stream=side)
    side.synchronize()
    _check(x, buffer, out, "run on a side stream")


def test_ops_softmax_through_the_triton_provider(families):
    kernel_api.ops.clear_dispatch_cache()
    with kernel_api.settings(providers=["triton"]):
        for cols in (999, 4097, 20000):
            x = _x(9, cols, torch.float32)
            for _ in range(3):  # the first call chooses, compiles and records; the others replay
                out = kernel_api.ops.softmax(x)
                torch.cuda.synchronize()
                reference = torch.softmax(x.double(), dim=-1)
                assert (out.double() - reference).abs().max().item() <= TOL[torch.float32]
    kernel_api.ops.clear_dispatch_cache()


def test_a_second_process_would_load_the_cached_artifact_and_run_it(families):
    """The disk cache's entry, loaded without the in-process memo, launches correctly."""
    x = _x(5, 777, torch.bfloat16)
    buffer, out = _guarded_out(5, 777, torch.bfloat16)
    args = SoftmaxArguments(x, out)
    kernel = _kernels(args)[0]
    triton_compiler.clear_memory_cache()  # an earlier test's compile would not reach this test's cache folder
    kernel.compile(args)
    triton_compiler.clear_memory_cache()
    artifact = kernel.compile(args)
    assert artifact.compiled_obj.cache_hit
    kernel.run(args, compiled_artifact=artifact)
    _check(x, buffer, out, "from the disk cache")
