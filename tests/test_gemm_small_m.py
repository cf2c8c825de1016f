"""The small-M GEMM family (cuda_src `CudaGemmSmallM`): generation, refusals, the split-K plan,
compilation for sm_90a without a GPU, PickAny's choice; on a GPU, every M of interest against a
float64 reference inside sentinel-filled buffers, forced splits, batches, determinism, ops.gemm
and compute-sanitizer memcheck.

`check_gemm` and `GPU_CASES` drive the GPU sweep.
"""

from __future__ import annotations

import os
import random
import shutil

import pytest
import torch

import kernel_api
from kernel_api.providers.torch_ops.kernels import TorchGemm
from kernel_api import GemmArguments
from kernel_api.arguments import EpilogueArguments
from kernel_api.core.errors import CompilationError
from kernel_api.providers.cuda_src.kernels.gemm_small_m import (CLUSTER, CONFIGS, MIN_M, SPLIT2_CLUSTER, SPLITS,
                                                                 CudaGemmSmallM)
from kernel_api.tuning.timing import relative_error
from memcheck import run_memcheck

DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16}
# Relative Frobenius error allowed (rounding the output dominates: unit roundoff 2^-8 for bf16, 2^-11
# for f16), and the element-wise bound: twice the unit roundoff of |ref| plus 1e-3 of rms(ref).
NORM_TOL = {torch.bfloat16: 5e-3, torch.float16: 1.5e-3}
ELEM_RTOL = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}


def instance(dtype: str, layout: str, M: int) -> CudaGemmSmallM:
    """The one instance for (dtype, B layout 'col' | 'row', M), fresh (no forced split)."""
    found = [k for k in CudaGemmSmallM.generate_kernels(None, cc=90)
             if k.dtype.name == dtype and (k.b_kmajor == (layout == "col")) and MIN_M[k.config.mp] <= M <= k.config.mp]
    assert len(found) == 1, found
    return found[0]


def make_operands(dtype: torch.dtype, layout: str, M: int, N: int, K: int, L: int = 1, padded: bool = False,
                  device: str = "cuda") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fresh random A, B (col: a view of W[N, K] transposed; row: K x N) and out, the last a view
    into a NaN-filled larger buffer (returned too). ``padded``: leading dimensions past the extents."""
    pad = 8 if padded else 0
    A = torch.randn(L, M, K + pad, device=device).to(dtype)[..., :K]
    if layout == "col":
        B = torch.randn(L, N, K + pad, device=device).to(dtype)[..., :K].transpose(-1, -2)
    else:
        B = torch.randn(L, K, N + pad, device=device).to(dtype)[..., :N]
    big = torch.full((L, M + 2, N + 16), float("nan"), device=device, dtype=dtype)
    out = big[:, 1:M + 1, 8:8 + N]
    if L == 1:
        A, B, out = A[0], B[0], out[0]
    return A, B, out, big


def check_gemm(kernel: CudaGemmSmallM, M: int, N: int, K: int, L: int = 1, padded: bool = False,
               split: int | None = None, artifact=None, repeat_identical: bool = False,
               workspace: torch.Tensor | None = None) -> float:
    """Run ``kernel`` on fresh random operands and assert the result: every output written, no
    store outside it (NaN sentinels intact), norm and element-wise error against float64.
    Returns the relative error. Also checks kernels without a split-K knob (``split`` None), run
    with ``workspace`` when one is given."""
    dtype = kernel.dtype.to_torch()
    layout = "col" if kernel.b_kmajor else "row"
    seed = random.randrange(2**31)
    torch.manual_seed(seed)
    what = f"{kernel.metadata.kernel_name} M={M} N={N} K={K} L={L} padded={padded} split={split} seed={seed}"
    A, B, out, big = make_operands(dtype, layout, M, N, K, L, padded)
    args = GemmArguments(A, B, out)
    status = kernel.supports(args)
    assert status, f"{what}: not supported: {status.error}"
    splits = hasattr(kernel, "split_k")
    if splits:
        kernel.split_k = split
    try:
        kernel.run(args, compiled_artifact=artifact, workspace=workspace)
        torch.cuda.synchronize()
        first = out.clone() if repeat_identical else None
        if repeat_identical:
            kernel.run(args, compiled_artifact=artifact, workspace=workspace)
            torch.cuda.synchronize()
    finally:
        if splits:
            kernel.split_k = None
    inside = torch.zeros_like(big, dtype=torch.bool)
    inside[:, 1:M + 1, 8:8 + N] = True
    assert torch.isnan(big[~inside]).all(), f"{what}: a store landed outside out"
    assert not torch.isnan(out).any(), f"{what}: some outputs were not written"
    ref = torch.matmul(A.double(), B.double())
    err = relative_error(out, ref)
    assert err <= NORM_TOL[dtype], f"{what}: relative error {err:.3e} > {NORM_TOL[dtype]:.1e}"
    rms = ref.pow(2).mean().sqrt().item()
    bound = ELEM_RTOL[dtype] * ref.abs() + 1e-3 * rms + 1e-6
    worst = ((out.double() - ref).abs() - bound).max().item()
    assert worst <= 0, f"{what}: an element is off by {worst:.3e} past its bound"
    if repeat_identical:
        assert torch.equal(first, out), f"{what}: a second run gave different bits (the reduction is not deterministic)"
    return err


# ---- the GPU sweep ----------------------------------------------------------------------------------------
M_VALUES = (1, 2, 7, 8, 15, 16, 17, 33, 64, 100, 128)
NK_VALUES = ((4104, 1000), (1000, 4104), (4096, 14336))


def gpu_cases() -> list[tuple]:
    """(dtype, layout, M, N, K, padded) of the sweep: every M x layout x dtype x (N, K)."""
    return [(dt, layout, M, N, K, M % 2 == 1) for dt in DTYPES for layout in ("col", "row") for M in M_VALUES
            for N, K in NK_VALUES]


# K=1656: 13 k-tiles of 128 or 26 of 64, divisible by none of 2, 4, 8; K=136: fewer k-tiles than
# splits (some CTAs of a tile get no k-tile and contribute zeros). N=520: a partial last tile.
SPLIT_CASES = [(M, K, split) for M in (8, 64, 128) for K in (1656, 136, 4096) for split in SPLITS]


# ---- CPU: generation and metadata -----------------------------------------------------------------------
def test_generation_and_metadata():
    kernels = CudaGemmSmallM.generate_kernels(None, cc=90)
    assert len(kernels) == 2 * 2 * len(CONFIGS)
    assert len({k.metadata.kernel_name for k in kernels}) == len(kernels)
    for k in kernels:
        md = k.metadata
        ops = md.operands
        assert md.min_cc == 90 and md.max_cc == 90 and md.epilogue is None and md.provider == "cuda_src"
        assert ops.A.stride == (0, 0, 1) and ops.out.stride == (0, 0, 1)
        assert ops.B.stride == ((0, 1, 0) if k.b_kmajor else (0, 0, 1))
        assert {ops.A.divisibility, ops.B.divisibility, ops.out.divisibility} == {8}
        assert ops.accumulator_type.name == "f32" and ops.A.dtype is k.dtype
        c = k.config
        assert md.design.tile_shape == (c.mp, c.bn, c.bk) and md.design.cluster_shape == (1, 1, CLUSTER)
        assert c.smem_bytes <= 227 * 1024 and c.ctas_per_sm >= 1
    assert CudaGemmSmallM.generate_kernels(None, cc=80) == [] and CudaGemmSmallM.generate_kernels(None, cc=100) == []
    assert CudaGemmSmallM.generate_kernels(None, epilogue_args=EpilogueArguments(alpha=2.0), cc=90) == []


def _meta_args(M, N, K, dtype=torch.bfloat16, layout="col", L=None):
    meta = dict(device="meta", dtype=dtype)
    lead = () if L is None else (L,)
    A = torch.empty(*lead, M, K, **meta)
    B = torch.empty(*lead, N, K, **meta).transpose(-1, -2) if layout == "col" else torch.empty(*lead, K, N, **meta)
    return GemmArguments(A, B, torch.empty(*lead, M, N, **meta))


@pytest.mark.parametrize("layout", ["col", "row"])
def test_every_m_up_to_128_has_exactly_the_least_padding_instance(layout):
    for M in range(1, 130):
        args = _meta_args(M, 256, 512, layout=layout)
        found = [k for k in kernel_api.get_kernels(args, cc=90, providers="cuda_src") if isinstance(k, CudaGemmSmallM)]
        if M > 128:
            assert found == []
            continue
        assert len(found) == 1, (M, found)
        mp = found[0].config.mp
        assert M <= mp and (mp == 8 or M > mp // 2)


def _error(kernel, args):
    status = kernel.supports(args, 90)
    assert not status
    return status.error


def test_refusals_name_the_operand_and_the_value():
    k = instance("bf16", "col", 8)
    cpu = dict(dtype=torch.bfloat16)
    # K = 4100: A's rows (and B's columns) are only 4-element aligned.
    a = GemmArguments(torch.randn(8, 4100, **cpu), torch.randn(64, 4100, **cpu).t(), torch.empty(8, 64, **cpu))
    assert "operand A: aligned to 4 element(s) but the kernel needs 8" in _error(k, a)
    # B's base pointer 8 bytes off a 16-byte boundary.
    flat = torch.randn(64 * 256 + 4, **cpu)
    a = GemmArguments(torch.randn(8, 256, **cpu), flat[4:].view(64, 256).t(), torch.empty(8, 64, **cpu))
    assert "operand B: aligned to 4 element(s)" in _error(k, a)
    # N = 68: out's rows are 68 elements (B, K-major, is fine).
    a = GemmArguments(torch.randn(8, 256, **cpu), torch.randn(68, 256, **cpu).t(), torch.empty(8, 68, **cpu))
    assert "operand out: aligned to 4 element(s)" in _error(k, a)
    a = GemmArguments(torch.randn(256, 8, **cpu).t(), torch.randn(64, 256, **cpu).t(), torch.empty(8, 64, **cpu))
    assert "operand A: stride pattern" in _error(k, a)
    a = GemmArguments(torch.randn(8, 256, **cpu), torch.randn(64, 256, **cpu).t(), torch.empty(64, 8, **cpu).t())
    assert "operand out: stride pattern" in _error(k, a)
    a = GemmArguments(torch.randn(8, 256), torch.randn(64, 256).t(), torch.empty(8, 64))
    assert "operand A: dtype f32" in _error(k, a)
    a = GemmArguments(torch.randn(8, 256, **cpu), torch.randn(64, 256, **cpu).t(), torch.empty(8, 64, **cpu),
                      epilogue=EpilogueArguments(alpha=2.0))
    assert "epilogue requested but the kernel has no fused epilogue" in _error(k, a)
    big = instance("bf16", "col", 128)
    assert "operand A: M=129 rows, more than this instance's 128" in _error(big, _meta_args(129, 64, 64))
    assert "operand A: M=8 rows, fewer than this instance's 65" in _error(big, _meta_args(8, 64, 64))
    assert "operand B: N=2,147,483,648 exceeds" in _error(k, _meta_args(8, 2**31, 64))
    assert "operand A: K=2,147,483,648 exceeds" in _error(k, _meta_args(8, 64, 2**31))
    assert "operand A: batch L=70,000 exceeds" in _error(k, _meta_args(8, 64, 64, L=70000))
    assert k.supports(_meta_args(8, 64, 64, L=3), 90)


def test_compiles_for_sm90a_without_a_gpu():
    for dtype, layout, M in (("bf16", "col", 8), ("f16", "row", 128), ("bf16", "row", 33)):
        k = instance(dtype, layout, M)
        A, B, out, _ = make_operands(DTYPES[dtype], layout, M, 64, 128, device="cpu")
        args = GemmArguments(A, B, out)
        assert k.supports(args, 90)
        artifact = k.compile(args, cc=90)
        launcher = artifact.compiled_obj
        c = k.config
        assert launcher.name_expression == (
            f"ka_gemm_small_m::gemm_small_m<{0 if dtype == 'bf16' else 1}, {'true' if layout == 'col' else 'false'}, "
            f"{c.mp}, {c.bn}, {c.bk}, {c.stages}, {c.wn}, {c.wm}, {c.min_ctas}, {CLUSTER}>")
        # the split-2 kernel (clusters of SPLIT2_CLUSTER) from the same module
        assert set(artifact.extra) == {CLUSTER, SPLIT2_CLUSTER}
        assert all(x.compiled is launcher.compiled for x in artifact.extra.values())
        assert launcher.compiled.arch == "sm_90a" and launcher.compiled.cubin[:4] == b"\x7fELF"
        assert artifact.cc == 90
    with pytest.raises(CompilationError, match="cannot compile for compute capability 80"):
        k.compile(args, cc=80)


def test_split_plan():
    k = instance("bf16", "col", 8)
    # N = K = 4096: 64 column tiles of 64; 3 CTAs per SM -> 396 resident: split 4 (256 CTAs, 8 k-tiles each).
    assert k.config.ctas_per_sm == 3 and k.split_for(8, 4096, 4096, 1) == 4
    assert k.split_for(8, 14336, 4096, 1) == 1     # 224 tiles already fill the machine
    assert k.split_for(8, 4096, 256, 1) == 1       # 2 k-tiles: no room to split
    for M in (1, 16, 64, 128):
        for layout in ("col", "row"):
            kk = instance("f16", layout, M)
            c = kk.config
            for N in (1000, 4096, 8192, 14336, 65536):
                for K in (256, 1000, 4096, 14336):
                    s = kk.split_for(M, N, K, 1)
                    tiles, ktiles = -(-N // c.bn), -(-K // c.bk)
                    assert s in SPLITS
                    assert s == 1 or (-(-tiles * s // CLUSTER) <= kk.max_clusters(132) and ktiles >= 2 * s)
                    plan = kk.plan(_meta_args(M, N, K, torch.float16, layout))
                    assert plan.split == s and plan.tiles == tiles and plan.grid[0] % CLUSTER == 0
                    assert tiles * s <= plan.grid[0] < tiles * s + CLUSTER
    # Whole clusters must fit: 2 CTAs per SM leave room for 29 clusters of 8 on 132 SMs (the H200
    # measured 30), so 32 column tiles x split 8 = 32 clusters would run in two waves: split 4.
    k64 = instance("bf16", "col", 64)
    assert k64.config.ctas_per_sm == 2 and k64.max_clusters(132) == 29
    assert k64.split_for(64, 4096, 4096, 1) == 4
    assert instance("bf16", "col", 16).max_clusters(132) == 44
    k.split_k = 8
    assert k.split_for(8, 14336, 4096, 1) == 8
    k.split_k = None
    with pytest.raises(ValueError, match="split_k must be None or one of .* got 3"):
        k.split_k = 3


def test_clusters_of_two_at_split_two():
    """Split 2 launches clusters of 2 CTAs (H200: 33-34 us against 39-40 with clusters of 8 at
    M <= 16 and 8192^2; docs/performance.md, "Small-M GEMM"); every other split keeps clusters
    of 8."""
    for M in (1, 8, 16):
        k = instance("bf16", "col", M)
        assert k.plan(_meta_args(M, 8192, 8192))[:2] == (2, 128)
        assert k.plan(_meta_args(M, 8192, 8192)).cluster == SPLIT2_CLUSTER == 2
        assert k.plan(_meta_args(M, 4096, 4096)).split == 4 and k.plan(_meta_args(M, 4096, 4096)).cluster == CLUSTER
        assert k.plan(_meta_args(M, 14336, 4096)).cluster == CLUSTER
        k.split_k, k.cluster = 2, CLUSTER  # forced: clusters of 8 at split 2 (tests, tuning)
        try:
            assert k.plan(_meta_args(M, 8192, 8192)).cluster == CLUSTER
        finally:
            k.split_k, k.cluster = None, None
    k64 = instance("bf16", "col", 64)
    k64.split_k = 2
    assert k64.plan(_meta_args(64, 4096, 4096)).cluster == SPLIT2_CLUSTER
    k64.split_k = 4
    assert k64.plan(_meta_args(64, 4096, 4096)).cluster == CLUSTER
    k64.split_k = None
    with pytest.raises(ValueError, match="cluster must be None or one of"):
        k64.cluster = 4


@pytest.mark.parametrize("layout", ["col", "row"])
def test_pick_any_chooses_it_for_small_m_only(layout):
    # Measured on the H200 (gemm_shapes.py --group small_m): at M <= 16 the
    # family beats the Sm90 family's 64-row tiles and is within 5 % of cuBLAS (0.99-1.04x at
    # N = K = 4096), so either may lead; at M = 64 and 128 it is the slower one.
    for M in (1, 8, 16):
        args = _meta_args(M, 4096, 4096, layout=layout)
        candidates = kernel_api.get_kernels(args, cc=90)
        chosen = kernel_api.PickAny().choose(args, candidates)
        assert isinstance(chosen, (CudaGemmSmallM, TorchGemm)), (M, chosen)
        ours = kernel_api.PickAny().choose(args, [k for k in candidates if not isinstance(k, TorchGemm)])
        assert isinstance(ours, CudaGemmSmallM), (M, ours)
    for M in (64, 128, 4096):
        args = _meta_args(M, 4096, 4096, layout=layout)
        candidates = kernel_api.get_kernels(args, cc=90)
        assert candidates and not isinstance(kernel_api.PickAny().choose(args, candidates), CudaGemmSmallM), M


@pytest.mark.parametrize("M", [1, 8, 16])
@pytest.mark.parametrize("N,K", [(4096, 4096), (8192, 8192), (14336, 4096), (14336, 14336)])
def test_pick_any_weighs_streaming_b_at_decode(M, N, K):
    """At M <= 16 the time is reading B (H200, gemm_shapes.py --group small_m:
    the family 0.98-1.14x cuBLAS, the Sm90 tiles 1.4-1.8x slower than both); the MAC models
    priced cuBLAS and the Sm90 tiles as if B cost nothing (Sm90 at 22 us for 117 MB), so
    PickAny took cuBLAS everywhere and, among ours, Sm90 at N = 14336."""
    args = _meta_args(M, N, K)
    candidates = kernel_api.get_kernels(args, cc=90)
    assert isinstance(kernel_api.PickAny().choose(args, candidates), CudaGemmSmallM)
    ours = [k for k in candidates if not isinstance(k, TorchGemm)]
    assert isinstance(kernel_api.PickAny().choose(args, ours), CudaGemmSmallM)


# ---- GPU ------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("dtype,layout,M,N,K,padded", gpu_cases())
def test_matches_float64(dtype, layout, M, N, K, padded):
    check_gemm(instance(dtype, layout, M), M, N, K, padded=padded)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["col", "row"])
@pytest.mark.parametrize("M,K,split", SPLIT_CASES)
def test_forced_splits_are_right_and_deterministic(layout, M, K, split):
    check_gemm(instance("bf16", layout, M), M, 520, K, split=split, repeat_identical=True)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["col", "row"])
@pytest.mark.parametrize("M,N,K", [(1, 8192, 8192), (16, 520, 1656), (9, 8200, 136), (33, 8192, 4096),
                                   (100, 1000, 1656)])
def test_split_two_clusters_of_two_and_eight_agree(layout, M, N, K):
    """At split 2 the clusters-of-2 kernel (the default) and the clusters-of-8 one
    sum the same two partials in the same order: both right, bit for bit the same."""
    k = instance("bf16", layout, M)
    A, B, out, big = make_operands(torch.bfloat16, layout, M, N, K)
    args = GemmArguments(A, B, out)
    results = {}
    k.split_k = 2
    try:
        for cluster in (SPLIT2_CLUSTER, CLUSTER):
            k.cluster = cluster
            assert k.plan(args).cluster == cluster
            big.fill_(float("nan"))
            k.run(args)
            torch.cuda.synchronize()
            results[cluster] = big.clone()
    finally:
        k.split_k, k.cluster = None, None
    inside = torch.zeros_like(big, dtype=torch.bool)
    inside[:, 1:M + 1, 8:8 + N] = True  # (make_operands' buffer has a batch mode of 1)
    for got in results.values():
        assert torch.isnan(got[~inside]).all() and not torch.isnan(got[inside]).any()
    assert torch.equal(results[SPLIT2_CLUSTER][inside], results[CLUSTER][inside])  # (NaN sentinels outside)
    ref = torch.matmul(A.double(), B.double())
    assert relative_error(out, ref) <= NORM_TOL[torch.bfloat16]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("layout", ["col", "row"])
@pytest.mark.parametrize("M", [8, 100])
def test_batched(dtype, layout, M):
    check_gemm(instance(dtype, layout, M), M, 1000, 1656, L=2, padded=True)


@pytest.mark.gpu
def test_ops_gemm_picks_it_and_is_right():
    A = torch.randn(8, 4096, device="cuda").to(torch.bfloat16)
    W = torch.randn(4096, 4096, device="cuda").to(torch.bfloat16)
    args = GemmArguments(A, W.t(), torch.empty(8, 4096, device="cuda", dtype=torch.bfloat16))
    ours = ["cutedsl", "cuda_src"]  # (cuBLAS is within 5 % here and may lead: test_pick_any_chooses_it...)
    assert isinstance(kernel_api.PickAny().choose(args, kernel_api.get_kernels(args, providers=ours)), CudaGemmSmallM)
    with kernel_api.settings(providers=ours):
        y = kernel_api.ops.gemm(A, W.t())
    ref = A.double() @ W.double().t()
    assert relative_error(y, ref) <= NORM_TOL[torch.bfloat16]


_SANITIZED = r"""
import sys
sys.path.insert(0, %r)
import torch
from test_gemm_small_m import check_gemm, instance
n = 0
for dtype in ("bf16", "f16"):
    for layout in ("col", "row"):
        for M in (1, 16, 17, 64, 65, 128):
            for N, K, split in ((72, 136, 8), (200, 264, 2), (1000, 520, None)):
                check_gemm(instance(dtype, layout, M), M, N, K, padded=True, split=split); n += 1
check_gemm(instance("bf16", "col", 8), 8, 72, 136, L=2, split=4); n += 1
print("launches", n)
"""


@pytest.mark.gpu
@pytest.mark.skipif(shutil.which("compute-sanitizer") is None, reason="compute-sanitizer not installed")
def test_memcheck_clean():
    """Every instance on small odd shapes (partial tiles, empty splits) under compute-sanitizer
    memcheck, the caching allocator off so that each tensor is its own allocation."""
    out = run_memcheck(_SANITIZED % os.path.dirname(os.path.abspath(__file__)))
    assert "launches 73" in out, out[-3000:]
