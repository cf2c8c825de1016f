"""kernel-api-cutlass-operators on an sm_90 GPU: cutlass.operators' Hopper GEMMs through
kernel_api against float64 references, with fresh random data, outputs written into views of
sentinel-filled buffers (padded rows: what lies between and around them must stay the
sentinel), odd sizes, column-major and batched operands, two tiles and clusters; then through
the front door (`kernel_api.ops.gemm`), whose second call replays the recorded launch.

    python3 -m pytest -q examples/plugins/kernel-api-cutlass-operators/tests

Needs the plugin installed (``pip install -e examples/plugins/kernel-api-cutlass-operators``)
and nvidia-cutlass-operators; skipped otherwise, and without an sm_90 GPU. The CPU half
(registration, metadata, the compile refused without a GPU) is tests/test_plugins.py.
"""

from __future__ import annotations

import pytest
import torch

import kernel_api
from kernel_api import GemmArguments, ops

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                                 reason="needs an sm_90 GPU")]

plugin = pytest.importorskip("kernel_api_cutlass_operators")

SENTINEL = 1234.5
PROVIDER = "cutlass_operators"
TOLERANCE = {torch.bfloat16: 1e-2, torch.float16: 2e-3}  # max |error| over max |reference|


@pytest.fixture(scope="module", autouse=True)
def registered():
    """The plugin's provider in the default registry (its import registers it; the entry point
    does so for an installed package)."""
    if PROVIDER not in kernel_api.available_providers():
        pytest.skip("the cutlass_operators provider is not registered")
    ops.clear_dispatch_cache()
    yield
    ops.clear_dispatch_cache()


def operand(rows: int, cols: int, dtype: torch.dtype, major: str, batch: int | None = None) -> torch.Tensor:
    """(rows, cols), optionally batched, row-major ("t") or column-major ("n"), of fresh N(0, 1) data."""
    lead = () if batch is None else (batch,)
    if major == "t":
        return torch.randn(*lead, rows, cols, device="cuda").to(dtype)
    return torch.randn(*lead, cols, rows, device="cuda").to(dtype).transpose(-1, -2)


def output_inside(m: int, n: int, dtype: torch.dtype, major: str, pad: int,
                  batch: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(buffer, out): out an (m, n) view [per batch] of a sentinel-filled buffer whose leading
    dimension is ``pad`` elements longer than out's (16-byte aligned for pad % 8 == 0)."""
    lead = () if batch is None else (batch,)
    if major == "t":
        buffer = torch.full((*lead, m, n + pad), SENTINEL, dtype=dtype, device="cuda")
        return buffer, buffer[..., :n]
    buffer = torch.full((*lead, n, m + pad), SENTINEL, dtype=dtype, device="cuda")
    return buffer, buffer[..., :m].transpose(-1, -2)


def check(out: torch.Tensor, buffer: torch.Tensor, A: torch.Tensor, B: torch.Tensor, what: str) -> None:
    torch.cuda.synchronize()
    expected = A.double() @ B.double()
    err = (out.double() - expected).abs().max().item() / expected.abs().max().item()
    assert err < TOLERANCE[out.dtype], f"{what}: relative error {err:.2e}"
    written = torch.zeros_like(buffer, dtype=torch.bool)
    written.as_strided(out.shape, out.stride(), out.storage_offset()).fill_(True)
    assert bool((buffer[~written] == SENTINEL).all()), f"{what}: wrote outside its output"


CASES = [  # dtype, layout of A, B and out, (m, n, k), batch, padding of out's leading dimension
    (torch.bfloat16, "ttt", (1000, 136, 264), None, 8),
    (torch.float16, "ttt", (257, 520, 72), None, 16),
    (torch.bfloat16, "tnn", (296, 264, 512), None, 8),
    (torch.bfloat16, "ttt", (128, 64, 256), 3, 0),
]


@pytest.mark.parametrize("dtype,layout,mnk,batch,pad", CASES)
def test_the_best_ranked_instance_against_float64(dtype, layout, mnk, batch, pad):
    m, n, k = mnk
    A, B = operand(m, k, dtype, layout[0], batch), operand(k, n, dtype, layout[1], batch)
    buffer, out = output_inside(m, n, dtype, layout[2], pad, batch)
    args = GemmArguments(A, B, out)
    kernels = kernel_api.get_kernels(args, providers=[PROVIDER])
    assert kernels, f"cutlass.operators takes no {layout} {dtype} GEMM of {mnk}"
    kernel = kernel_api.PickAny().choose(args, kernels)
    assert layout in kernel.metadata.kernel_name
    kernel.run(args, compiled_artifact=kernel.compile(args))
    check(out, buffer, A, B, kernel.metadata.kernel_name)


def test_a_two_cta_cluster_against_float64():
    dtype, (m, n, k) = torch.bfloat16, (1000, 520, 264)
    A, B = operand(m, k, dtype, "t"), operand(k, n, dtype, "t")
    buffer, out = output_inside(m, n, dtype, "t", 8)
    args = GemmArguments(A, B, out)
    kernel = next(k for k in kernel_api.get_kernels(args, providers=[PROVIDER])
                  if k.metadata.kernel_name.endswith("_128x128x64_c2x1_a16"))
    kernel.run(args, compiled_artifact=kernel.compile(args))
    check(out, buffer, A, B, kernel.metadata.kernel_name)


def test_the_front_door_and_its_replay_against_float64():
    """ops.gemm with the candidates restricted to this plugin's: the first call chooses, compiles
    and records the launch, the second (new data, new output) replays it."""
    dtype, (m, n, k) = torch.bfloat16, (520, 392, 136)
    ops.clear_dispatch_cache()
    with kernel_api.settings(providers=[PROVIDER]):
        for call in ("first", "second"):
            A, B = operand(m, k, dtype, "t"), operand(k, n, dtype, "t")
            buffer, out = output_inside(m, n, dtype, "t", 0)
            ops.gemm(A, B, out=out)
            check(out, buffer, A, B, f"ops.gemm, {call} call")
    ops.clear_dispatch_cache()
