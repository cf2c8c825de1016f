"""Index limits of the GEMM and softmax kernels (CPU, meta tensors: nothing is allocated).

Each kernel's ``_supports`` names the extent and the limit it exceeds (32-bit extents, grid
axes), so that `explain` can say why; problems inside the limits, such as a GEMM whose M*K
and M*N are past 2^31 elements, stay accepted.
"""

from __future__ import annotations

import pytest
import torch

import kernel_api
from kernel_api import GemmArguments, SoftmaxArguments

GEMM_CLASSES = ("SimtGemm", "Sm80TensorOpGemm", "Sm90WarpSpecializedGemm")
INT32_MAX = 2**31 - 1
# M*K and M*N just past 2^31 elements with K = N = 64 (computed correctly on an H200).
BIG_M = 2**31 // 64 + 4096


def gemm(M, N, K, dtype=torch.float16, L=None):
    meta = dict(device="meta", dtype=dtype)
    lead = () if L is None else (L,)
    return GemmArguments(torch.empty(*lead, M, K, **meta), torch.empty(*lead, K, N, **meta),
                         torch.empty(*lead, M, N, **meta), accumulator_type=torch.float64 if dtype is torch.float64 else torch.float32)


def instances(args, cls):
    """Instances of ``cls`` whose metadata accept ``args`` (before ``_supports``)."""
    pool = kernel_api.get_kernels(None, cc=90, providers="cutedsl", metadata_filter=lambda m: m.kernel_class.__name__ == cls)
    return [k for k in pool if k.metadata.supports(args, 90)]


def verdicts(args, cls):
    """{tile (BM, BN): reason or None} over the instances of ``cls``."""
    found = {}
    for k in instances(args, cls):
        status = k.supports(args, 90)
        found.setdefault(tuple(k.metadata.design.tile_shape[:2]), set()).add(status.error)
    return found


def test_gemm_past_2_31_elements_stays_accepted_by_the_three_classes():
    args = gemm(BIG_M, 64, 64)
    assert args.M * args.K > 2**31 and args.M * args.N > 2**31
    for cls in GEMM_CLASSES:
        pool = instances(args, cls)
        assert pool, cls
        rejected = {k.metadata.kernel_name: k.supports(args, 90).error for k in pool if not k.supports(args, 90)}
        assert not rejected, rejected
    accepted = {type(k).__name__ for k in kernel_api.get_kernels(args, cc=90)}
    assert set(GEMM_CLASSES) <= accepted


def test_n_tiles_on_the_grid_y_axis_are_limited():
    # 2^22 columns: 65536 tiles of 64 (one too many for gridDim.y), 32768 of 128.
    args = gemm(64, 2**22, 64)
    simt = verdicts(args, "SimtGemm")
    assert simt[(128, 128)] == {None}
    for tile in ((64, 64), (32, 32)):
        (reason,) = simt[tile]
        assert reason and "N=4,194,304" in reason and "grid's y limit of 65,535" in reason, reason
    # The DMMA (f64) instances of Sm80TensorOpGemm put N tiles on y too; the 16-bit ones do not.
    f64 = verdicts(gemm(64, 2**22, 64, torch.float64), "Sm80TensorOpGemm")
    assert f64[(128, 128)] == {None} and "grid's y limit" in next(iter(f64[(64, 64)]))
    assert all(v == {None} for v in verdicts(args, "Sm80TensorOpGemm").values())
    reasons = [r.reason for r in kernel_api.explain(args, cc=90) if r.kernel_class == "SimtGemm" and r.kernel_name]
    assert any("grid's y limit" in r for r in reasons)


def test_extents_rounded_up_to_the_tile_must_fit_32_bits():
    # M = 2^31 - 64: a whole number of 64-row tiles, but 128-row tiles round it past 2^31 - 1.
    args = gemm(INT32_MAX - 63, 8, 8)
    for cls in GEMM_CLASSES:
        for (tm, tn), reasons in verdicts(args, cls).items():
            if tm <= 64:
                assert reasons == {None}, (cls, tm, reasons)
            else:
                (reason,) = reasons
                assert "M=2,147,483,584" in reason and "32-bit index limit" in reason and "2,147,483,647" in reason
    # An extent past 2^31 - 1 is too big for every instance.
    for cls in GEMM_CLASSES:
        for reasons in verdicts(gemm(8, 8, 2**31), cls).values():
            assert all(r and "K=2,147,483,648" in r and "32-bit index limit" in r for r in reasons), reasons
    explained = kernel_api.explain(gemm(8, 8, 2**31), cc=90)
    for cls in GEMM_CLASSES:
        assert any("K=2,147,483,648" in r.reason and "32-bit index limit" in r.reason
                   for r in explained if r.kernel_class == cls), cls


def test_tile_counts_are_limited():
    # 16-bit Sm80TensorOpGemm: all tiles of a batch on gridDim.x (a 32-bit product).
    args = gemm(2**30, 2**30, 8)
    for reasons in verdicts(args, "Sm80TensorOpGemm").values():
        (reason,) = reasons
        assert "grid's x limit of 2^31-1" in reason and "M x N = 1,073,741,824 x 1,073,741,824" in reason
    # Sm90WarpSpecializedGemm counts its cluster tiles in an Int32.
    for reasons in verdicts(args, "Sm90WarpSpecializedGemm").values():
        assert all(r and "cluster tiles" in r and "32-bit tile counter" in r for r in reasons), reasons
    # The batch is the grid's z axis for SimtGemm and Sm80TensorOpGemm.
    batched = gemm(8, 8, 8, L=65536)
    for cls in ("SimtGemm", "Sm80TensorOpGemm"):
        for reasons in verdicts(batched, cls).values():
            assert reasons == {"batch L=65,536 exceeds the grid's z limit of 65,535 blocks"}
    # The persistent Sm90WarpSpecializedGemm walks the batches itself: no grid z limit.
    sm90 = verdicts(batched, "Sm90WarpSpecializedGemm")
    assert sm90 and all(reasons == {None} for reasons in sm90.values()), sm90


def softmax_verdicts(rows, cols, providers):
    x = torch.empty(rows, cols, device="meta", dtype=torch.float16)
    args = SoftmaxArguments(x, torch.empty_like(x))
    pool = kernel_api.get_kernels(None, cc=90, providers=providers,
                                  metadata_filter=lambda m: m.kernel_class.__name__.endswith("SoftmaxForward"))
    return {k.metadata.kernel_name: k.supports(args, 90).error for k in pool if k.metadata.supports(args, 90)}


def test_softmax_rows_limits():
    # CuTe DSL: 32-bit row extents, rounded up to the CTA's rows (4 for the warp strategy).
    found = softmax_verdicts(INT32_MAX - 1, 64, "cutedsl")
    assert found and all((reason is None) != ("_warp_" in name) for name, reason in found.items()), found
    assert all("32-bit index limit" in reason for name, reason in found.items() if "_warp_" in name)
    assert all(reason and "rows=2,147,483,648" in reason for reason in softmax_verdicts(2**31, 64, "cutedsl").values())
    # CUDA C++: 64-bit indexing, one block per row (warp: per 4 rows) on gridDim.x.
    found = softmax_verdicts(2**31, 64, "cuda_src")
    assert found and all((reason is None) == ("_warp_" in name) for name, reason in found.items()), found
    assert all("grid's x limit" in reason for name, reason in found.items() if "_warp_" not in name)
    found = softmax_verdicts(4 * INT32_MAX + 4, 8, "cuda_src")
    assert found and all(reason and "grid's x limit" in reason for reason in found.values()), found
