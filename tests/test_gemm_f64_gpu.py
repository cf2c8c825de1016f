"""GPU checks of the f64 (DMMA) mode of `Sm80TensorOpGemm`.

Each case draws fresh f64 random operands (full 53-bit mantissas, so a product computed in any
narrower type fails), places the output inside a NaN-filled guard buffer (a store outside it,
or an element never written, fails), and compares with two float64 references: torch.matmul
on the GPU (cuBLAS DGEMM) and the CPU product. Shapes are odd (or, for alignment 2, rounded
up only where the alignment requires), batched, with pointers shifted by one element where
the alignment allows, in every layout combination. Run with ``pytest -m gpu -n 8``.
"""

from __future__ import annotations

import itertools

import pytest
import torch

import kernel_api
from kernel_api.arguments import GemmArguments
from kernel_api.core.arch import device_cc

from gemm_family_utils import aligned_extents

TOL = 1e-12
SHAPES = ((197, 133, 301, 3), (64, 40, 16, 1), (5, 300, 77, 2))  # (M, N, K, L)
LAYOUTS = ["".join(p) for p in itertools.product("tn", repeat=3)]
GUARD = 67  # elements of NaN before and after the output


def _cc() -> int:
    return device_cc(None) if torch.cuda.is_available() else 90


def _family_f64() -> dict:
    return {k.metadata.kernel_name: k for k in kernel_api.get_kernels(None, cc=_cc(), providers="cutedsl")
            if type(k).__name__ == "Sm80TensorOpGemm" and k.metadata.operands.A.dtype.name == "f64"}


def _operand(L: int, rows: int, cols: int, column_major: bool, offset: int, gen) -> torch.Tensor:
    """(L, rows, cols) f64, row- or column-major per matrix, its pointer ``offset`` elements past an allocation."""
    stored = (L, cols, rows) if column_major else (L, rows, cols)
    flat = torch.randn(offset + L * rows * cols, dtype=torch.float64, device="cuda", generator=gen)
    t = flat[offset:].view(stored)
    return t.transpose(-1, -2) if column_major else t


def _guarded_out(L: int, M: int, N: int, column_major: bool, offset: int):
    """A NaN buffer and the (L, M, N) output view inside it, GUARD + ``offset`` elements in."""
    buf = torch.full((2 * GUARD + offset + L * M * N,), float("nan"), dtype=torch.float64, device="cuda")
    inner = buf[GUARD + offset:GUARD + offset + L * M * N]
    out = inner.view(L, N, M).transpose(-1, -2) if column_major else inner.view(L, M, N)
    return buf, out


def check_case(kernel, M: int, N: int, K: int, L: int, offset: int = 0, rank: int = 3) -> None:
    """Run ``kernel`` on one problem of its layouts and check it against both references."""
    md = kernel.metadata
    lay = md.operands.A.layout + md.operands.B.layout + md.operands.out.layout
    M, N, K = aligned_extents(md, M, N, K)
    if md.operands.A.divisibility > 1:
        offset = 0  # an aligned instance rejects a shifted pointer (test_misaligned_* covers that)
    gen = torch.Generator(device="cuda").manual_seed(hash((md.kernel_name, M, N, K, L, offset)) & 0xFFFFFFFF)
    A = _operand(L, M, K, lay[0] == "n", offset, gen)
    B = _operand(L, K, N, lay[1] == "n", offset, gen)
    buf, out = _guarded_out(L, M, N, lay[2] == "n", 1)  # out takes any alignment: always shifted
    if rank == 2:
        assert L == 1
        A, B, out = A[0], B[0], out[0]
    args = GemmArguments(A, B, out)
    status = kernel.supports(args)
    assert status, f"{md.kernel_name} rejected {lay} {M}x{N}x{K}x{L}: {status.error}"
    kernel.run(args)
    torch.cuda.synchronize()
    where = f"{md.kernel_name} {M}x{N}x{K}x{L} rank{rank} offset{offset}"
    assert torch.isnan(buf[:GUARD + 1]).all() and torch.isnan(buf[GUARD + 1 + L * M * N:]).all(), \
        f"{where}: stored outside the output"
    assert torch.isfinite(out).all(), f"{where}: left output elements unwritten"
    ref = torch.matmul(A, B)
    err = float(torch.linalg.vector_norm(out - ref) / torch.linalg.vector_norm(ref))
    assert err <= TOL, f"{where}: rel err {err:.2e} vs torch.matmul f64"
    ref_cpu = A.cpu() @ B.cpu()
    err_cpu = float(torch.linalg.vector_norm(out.cpu() - ref_cpu) / torch.linalg.vector_norm(ref_cpu))
    assert err_cpu <= TOL, f"{where}: rel err {err_cpu:.2e} vs the CPU product"


_FAMILY = _family_f64()


def test_family_has_f64_instances_on_every_layout():
    layouts = {k.metadata.operands.A.layout + k.metadata.operands.B.layout + k.metadata.operands.out.layout
               for k in _FAMILY.values()}
    assert layouts == set(LAYOUTS) and {k.metadata.operands.A.divisibility for k in _FAMILY.values()} == {1, 2}


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(_FAMILY))
def test_family_f64(name):
    kernel = _FAMILY[name]
    for M, N, K, L in SHAPES:
        check_case(kernel, M, N, K, L, offset=1)
    check_case(kernel, 131, 67, 45, 1, offset=1, rank=2)


@pytest.mark.gpu
def test_misaligned_f64_falls_back_to_alignment_1():
    """A pointer shifted by one f64: the a2 instances refuse it, an a1 instance computes it."""
    gen = torch.Generator(device="cuda").manual_seed(7)
    A = _operand(2, 96, 80, False, 1, gen)
    B = _operand(2, 80, 72, True, 0, gen)
    buf, out = _guarded_out(2, 96, 72, False, 0)
    args = GemmArguments(A, B, out)
    for k in _FAMILY.values():
        assert not k.supports(args) or k.metadata.operands.A.divisibility == 1, k.metadata.kernel_name
    accepted = [k for k in _FAMILY.values() if k.supports(args)]
    assert accepted
    for k in accepted:
        out.fill_(float("nan"))
        k.run(args)
        torch.cuda.synchronize()
        ref = torch.matmul(A, B)
        assert float(torch.linalg.vector_norm(out - ref) / torch.linalg.vector_norm(ref)) <= TOL
