"""The decode GEMM family (cuda_src `CudaGemmDecode`, stream-K over one CTA per SM): generation,
refusals, the stream-K plan (every step in exactly one CTA, segments per tile), compilation
for sm_90a without a GPU; on a GPU, every M up to 16 against a float64 reference inside
sentinel-filled buffers for odd shapes and leading dimensions, batches, tiles split over many
CTAs and CTAs over many tiles, bit-identical repeats, workspaces left dirty (random bytes, a
previous launch's counters), a CUDA graph replayed, and compute-sanitizer memcheck.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from kernel_api import GemmArguments
from kernel_api.core.errors import CompilationError
from kernel_api.providers.cuda_src.kernels.gemm_decode import (MAX_SMEM_BYTES, TILE_K, TILE_N, CudaGemmDecode,
                                                               DecodeConfig, plan_for)
from memcheck import run_memcheck
from test_gemm_small_m import DTYPES, check_gemm, make_operands


def instance(dtype: str, layout: str, M: int) -> CudaGemmDecode:
    """The one instance for (dtype, B layout 'col' | 'row', M)."""
    found = [k for k in CudaGemmDecode.generate_kernels(None, cc=90)
             if k.dtype.name == dtype and k.b_kmajor == (layout == "col") and k.supports(_meta_args(M, 64, 64, layout=layout,
                                                                                                   dtype=DTYPES[dtype]), 90)]
    assert len(found) == 1, found
    return found[0]


def _meta_args(M: int, N: int, K: int, dtype: torch.dtype = torch.bfloat16, layout: str = "col", L: int = 1):
    A, B, out, _ = make_operands(dtype, layout, M, N, K, L, device="meta")
    return GemmArguments(A, B, out)


# ---- CPU ------------------------------------------------------------------------------------------------
def test_generation_and_metadata():
    kernels = CudaGemmDecode.generate_kernels(None, cc=90)
    assert len(kernels) == 8
    names = {k.metadata.kernel_name for k in kernels}
    assert "CudaGemmDecode_bf16_f32acc_tnt_m8_tile64x128_stages4_streamk_align8" in names
    for k in kernels:
        c = k.config
        d = k.metadata.design
        assert d.schedule == "streamk_persistent" and d.tile_shape == (c.mp, TILE_N, TILE_K)
        assert k.metadata.operands.A.divisibility == 8 and k.metadata.epilogue is None
        assert k.metadata.min_cc == 90 and k.metadata.max_cc == 90


@pytest.mark.parametrize("layout", ["col", "row"])
def test_every_m_up_to_16_has_exactly_one_instance(layout):
    kernels = [k for k in CudaGemmDecode.generate_kernels(None, cc=90) if k.b_kmajor == (layout == "col")
               and k.dtype.name == "f16"]
    for M in range(1, 17):
        args = _meta_args(M, 128, 256, torch.float16, layout)
        assert sum(bool(k.supports(args, 90)) for k in kernels) == 1, M
    args = _meta_args(17, 128, 256, torch.float16, layout)
    assert not any(k.supports(args, 90) for k in kernels)


def test_refusals_name_the_operand_and_the_value():
    k = instance("bf16", "col", 16)
    status = k.supports(_meta_args(17, 64, 64), 90)
    assert "operand A: M=17 rows, more than this instance's 16" in status.error
    status = instance("bf16", "col", 8).supports(_meta_args(9, 64, 64), 90)
    assert "operand A: M=9 rows, more than this instance's 8" in status.error
    status = k.supports(_meta_args(4, 64, 64), 90)
    assert "operand A: M=4 rows, fewer than this instance's 9" in status.error
    empty_k = _meta_args(12, 64, 0)
    status = k.supports(empty_k, 90)   # the metadata check refuses it first (no aligned extent) ...
    assert not status and "operand A" in status.error
    assert "operand A: K=0" in k._supports(empty_k).error   # ... and the family's own check names it
    # misaligned leading dimension: the metadata's 16-byte alignment refuses it
    A = torch.empty(12, 72, device="meta", dtype=torch.bfloat16)[:, :67]
    B = torch.empty(64, 67, device="meta", dtype=torch.bfloat16).t()
    status = k.supports(GemmArguments(A, B, torch.empty(12, 64, device="meta", dtype=torch.bfloat16)), 90)
    assert not status and "operand" in status.error


@pytest.mark.parametrize("N,K,L,sms", [(4096, 4096, 1, 132), (8192, 8192, 1, 132), (14336, 14336, 1, 132),
                                       (520, 1656, 3, 132), (64, 128, 1, 132), (72, 136, 1, 132),
                                       (4096, 128, 1, 132), (64, 65536, 1, 132), (1000, 1000, 2, 78)])
def test_stream_k_plan_covers_every_step_once(N, K, L, sms):
    p = plan_for(8, N, K, L, 8, sms, ctas_per_sm=1)
    assert p.tiles == -(-N // TILE_N) * L and p.ktiles == -(-K // TILE_K)
    assert p.grid == min(sms, p.steps)
    covered = []
    for c in range(p.grid):
        b, e = p.range_of(c)
        assert e - b >= p.steps // p.grid >= 1       # every CTA has work, shares differ by at most one
        assert e - b <= -(-p.steps // p.grid)
        covered.extend(range(b, e))
        for step in (b, e - 1):
            assert p.cta_of(step) == c
    assert covered == list(range(p.steps))
    for tile in range(p.tiles):
        owners = {p.cta_of(s) for s in range(tile * p.ktiles, (tile + 1) * p.ktiles)}
        assert p.segments(tile) == len(owners) == max(owners) - min(owners) + 1
    counters = -(-p.tiles * 8 // 16) * 16
    assert p.workspace_bytes == counters + p.grid * 2 * 8 * TILE_N * 4
    assert plan_for(8, N, K, L, 8, sms, ctas_per_sm=3).grid == min(3 * sms, p.steps)


def test_workspace_size_follows_the_plan():
    k = instance("f16", "row", 16)
    args = _meta_args(16, 8192, 8192, torch.float16, "row")
    p = k.plan(args)
    assert k.get_workspace_size(args) == p.workspace_bytes == 128 * 8 + 3 * 132 * 2 * 16 * 64 * 4


def test_compiles_for_sm90a_without_a_gpu():
    for dtype, layout, M in (("bf16", "col", 8), ("f16", "row", 16), ("bf16", "row", 3), ("f16", "col", 13)):
        k = instance(dtype, layout, M)
        A, B, out, _ = make_operands(DTYPES[dtype], layout, M, 64, 128, device="cpu")
        args = GemmArguments(A, B, out)
        artifact = k.compile(args, cc=90)
        launcher = artifact.compiled_obj
        c = k.config
        assert launcher.name_expression == (
            f"ka_gemm_decode::gemm_decode<{0 if dtype == 'bf16' else 1}, {'true' if layout == 'col' else 'false'}, "
            f"{c.mp}, {TILE_N}, {TILE_K}, {c.stages}, {c.ctas_per_sm}>")
        assert launcher.compiled.arch == "sm_90a" and launcher.compiled.cubin[:4] == b"\x7fELF"
    with pytest.raises(CompilationError, match="cannot compile for compute capability 80"):
        k.compile(args, cc=80)


def test_rings_fit_the_ctas_per_sm():
    for mp in (8, 16):
        for kmajor in (True, False):
            for ctas in (1, 2, 3):
                c = DecodeConfig(mp, kmajor, ctas_per_sm=ctas)
                share = min(MAX_SMEM_BYTES, 233472 // ctas - 1024)
                assert c.smem_bytes(c.stages) <= share and (c.stages == c.max_stages or
                                                            c.smem_bytes(c.stages + 1) > share)
    assert DecodeConfig(8, True).stages == 4 and DecodeConfig(16, True).stages == 3


# ---- GPU ------------------------------------------------------------------------------------------------
M_VALUES = (1, 2, 7, 8, 9, 15, 16)
# (N, K): a partial column tile and a k edge (K % 128 != 0) on both; long K over few tiles
# (a tile split over many CTAs); many tiles of one k-tile (a CTA over many tiles).
NK_VALUES = ((4104, 1000), (1000, 4104), (520, 65544), (8200, 120), (64, 8))


def gpu_cases() -> list[tuple]:
    return [(dt, layout, M, N, K, M % 2 == 1) for dt in DTYPES for layout in ("col", "row") for M in M_VALUES
            for N, K in NK_VALUES]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,layout,M,N,K,padded", gpu_cases())
def test_matches_float64(dtype, layout, M, N, K, padded):
    check_gemm(instance(dtype, layout, M), M, N, K, padded=padded)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["col", "row"])
@pytest.mark.parametrize("M,N,K", [(8, 4096, 4096), (16, 8192, 8192), (1, 14336, 4096), (3, 520, 1656)])
def test_decode_shapes_bit_identical_on_repeat(layout, M, N, K):
    check_gemm(instance("bf16", layout, M), M, N, K, repeat_identical=True)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("layout", ["col", "row"])
@pytest.mark.parametrize("M", [5, 16])
def test_batched(dtype, layout, M):
    check_gemm(instance(dtype, layout, M), M, 1000, 1656, L=3, padded=True)


@pytest.mark.gpu
@pytest.mark.parametrize("fill", ["random", "ones", "previous"])
def test_dirty_workspace(fill):
    """The counters need no zeroing: random bytes, all bits set, or the counters a launch of
    another shape left behind never count as arrivals of this launch."""
    k = instance("bf16", "col", 8)
    size = max(k.get_workspace_size(_meta_args(8, 1000, 4104)), k.get_workspace_size(_meta_args(8, 4104, 1000)))
    ws = torch.empty(size, dtype=torch.uint8, device="cuda")
    if fill == "random":
        ws.copy_(torch.randint(0, 256, (size,), dtype=torch.uint8, device="cuda"))
    elif fill == "ones":
        ws.fill_(255)
    else:
        check_gemm(k, 8, 4104, 1000, workspace=ws)
    check_gemm(k, 8, 1000, 4104, workspace=ws, repeat_identical=True)


@pytest.mark.gpu
def test_cuda_graph_replays():
    k = instance("f16", "col", 16)
    A, B, out, big = make_operands(torch.float16, "col", 16, 1000, 4104)
    args = GemmArguments(A, B, out)
    artifact = k.compile(args)
    ws = torch.empty(k.get_workspace_size(args), dtype=torch.uint8, device="cuda")
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        k.run(args, compiled_artifact=artifact, workspace=ws, stream=s)  # warm up outside the graph
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=s):
        k.run(args, compiled_artifact=artifact, workspace=ws, stream=s)
    for _ in range(3):
        A.copy_(torch.randn_like(A, dtype=torch.float32).to(A.dtype))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref = A.double() @ B.double()
        assert not torch.isnan(out).any()
        assert (out.double() - ref).norm() / ref.norm() <= 1.5e-3


_SANITIZED = r"""
import sys
sys.path.insert(0, %r)
import torch
from test_gemm_decode import instance
from test_gemm_small_m import check_gemm
n = 0
for dtype in ("bf16", "f16"):
    for layout in ("col", "row"):
        for M in (1, 9, 16):
            for N, K in ((72, 136), (200, 2056), (1000, 520)):
                check_gemm(instance(dtype, layout, M), M, N, K, padded=True); n += 1
check_gemm(instance("bf16", "col", 8), 8, 72, 136, L=2); n += 1
print("launches", n)
"""


@pytest.mark.gpu
@pytest.mark.skipif(shutil.which("compute-sanitizer") is None, reason="compute-sanitizer not installed")
def test_memcheck_clean():
    """Every instance on small odd shapes (partial tiles, k edges, split tiles) under
    compute-sanitizer memcheck, the caching allocator off so each tensor is its own allocation."""
    out = run_memcheck(_SANITIZED % os.path.dirname(os.path.abspath(__file__)))
    assert "launches 37" in out, out[-3000:]
