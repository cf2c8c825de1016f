"""GPU checks of every GEMM configuration the CuTe DSL GEMM classes generate.

Each configuration runs on three shapes (the first with M, N, K odd and L = 3; aligned
configurations round up only the extents their alignment constrains, i.e. the contiguous
ones, so e.g. a "tn" tensor-op kernel still sees odd M and N) against a float64 reference, on fresh random inputs and a NaN-poisoned output.
A subset also runs rank-2 operands and every fused-epilogue variant. Run with
``pytest -m gpu -n 8`` (pytest-xdist) to spread the compiles over CPU cores.
"""

from __future__ import annotations

import pytest
import torch

import kernel_api
from kernel_api.core.arch import device_cc

from gemm_family_utils import aligned_extents, problem, relative_error, tolerance

FAMILY = ("SimtGemm", "Sm80TensorOpGemm")
SHAPES = ((67, 45, 33, 3), (257, 131, 190, 1), (5, 300, 77, 2))  # (M, N, K, L)


def _cc() -> int:
    return device_cc(None) if torch.cuda.is_available() else 90


def _family_kernels() -> list:
    return [k for k in kernel_api.get_kernels(None, cc=_cc(), providers="cutedsl")
            if type(k).__name__ in FAMILY]


_KERNELS = {k.metadata.kernel_name: k for k in _family_kernels()}


def _align(kernel) -> int:
    ops = kernel.metadata.operands
    return max(ops.A.divisibility, ops.B.divisibility, ops.out.divisibility)


def _check(kernel, M, N, K, L, rank, epilogue=None):
    M, N, K = aligned_extents(kernel.metadata, M, N, K)
    gen = torch.Generator(device="cuda").manual_seed(hash((kernel.metadata.kernel_name, M, N, K, L)) & 0xFFFF)
    args, ref = problem(kernel.metadata, M, N, K, L, rank, "cuda", epilogue, generator=gen)
    status = kernel.supports(args)
    assert status, f"{kernel.metadata.kernel_name} rejected {args}: {status.error}"
    kernel.run(args)
    torch.cuda.synchronize()
    err = relative_error(args.out, ref)
    tol = tolerance(kernel.metadata)
    assert err <= tol, f"{kernel.metadata.kernel_name} {M}x{N}x{K}x{L} rank{rank} {epilogue}: rel err {err:.3e} > {tol:.0e}"


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(_KERNELS))
def test_every_configuration(name):
    kernel = _KERNELS[name]
    for M, N, K, L in SHAPES:
        _check(kernel, M, N, K, L, rank=3)


def _representatives() -> list[str]:
    """First configuration per (class, dtypes, alignment): rank-2 and epilogue coverage."""
    seen, names = set(), []
    for name, k in _KERNELS.items():
        ops = k.metadata.operands
        key = (type(k).__name__, ops.A.dtype, ops.out.dtype, ops.math_type, _align(k) > 1)
        if key not in seen:
            seen.add(key)
            names.append(name)
    return names


@pytest.mark.gpu
@pytest.mark.parametrize("name", _representatives())
def test_rank2_operands(name):
    kernel = _KERNELS[name]
    for M, N, K, _ in SHAPES:
        _check(kernel, M, N, K, 1, rank=2)


EPILOGUES = {
    "alpha_beta_C": dict(alpha=1.5, beta=-0.75, C=True),
    "alpha_beta_Ccol_rowbias": dict(alpha=0.5, beta=2.0, C=True, C_column_major=True, bias="row"),
    "rowbias_relu": dict(bias="row", activation="relu"),
    "colbias_gelu": dict(bias="column", activation="gelu"),
    "alpha_silu": dict(alpha=-1.25, activation="silu"),
    "everything_gelu": dict(alpha=0.75, beta=0.25, C=True, bias="column", activation="gelu"),
}


@pytest.mark.gpu
@pytest.mark.parametrize("variant", sorted(EPILOGUES))
@pytest.mark.parametrize("name", _representatives())
def test_epilogue_variants(name, variant):
    kernel = _KERNELS[name]
    for M, N, K, L in SHAPES[:2]:
        _check(kernel, M, N, K, L, rank=3, epilogue=EPILOGUES[variant])


@pytest.mark.gpu
def test_misaligned_pointers_fall_back_to_alignment_1():
    """An operand shifted by one element: aligned kernels refuse it, discovery picks an a1 one."""
    from gemm_family_utils import operand
    from kernel_api.arguments import GemmArguments

    for dtype in (torch.float16, torch.float32, torch.float64):
        A = operand((2, 64, 64), dtype, False, "cuda", offset=1)
        B = operand((2, 64, 64), dtype, False, "cuda")
        out = torch.full((2, 64, 64), float("nan"), dtype=dtype, device="cuda")
        args = GemmArguments(A, B, out)
        aligned = [k for k in _KERNELS.values() if _align(k) > 1 and k.metadata.operands.A.dtype.to_torch() == dtype]
        assert aligned
        for k in aligned:
            assert not k.supports(args), f"{k.metadata.kernel_name} accepted a misaligned A"
        found = [k for k in kernel_api.get_kernels(args) if type(k).__name__ in FAMILY]
        assert found and all(_align(k) == 1 for k in found)
        found[0].run(args)
        ref = A.double() @ B.double()
        assert relative_error(out, ref) <= tolerance(found[0].metadata)


def memcheck_main() -> int:
    """One configuration per class (odd shape, batch, full epilogue) for compute-sanitizer:

        compute-sanitizer --tool memcheck --report-api-errors no python tests/test_gemm_family_gpu.py
    """
    picks = {}
    for name, k in _KERNELS.items():
        ops = k.metadata.operands
        # one per class, plus the tensor-op class's f64 (DMMA) implementation
        key = (type(k).__name__, ops.A.dtype.name == "f64" and type(k).__name__ != "SimtGemm")
        if key not in picks and ops.A.layout + ops.B.layout + ops.out.layout == "tnt":
            picks[key] = k
    for k in picks.values():
        for M, N, K, L in SHAPES:
            _check(k, M, N, K, L, rank=3)
        _check(k, *SHAPES[0][:3], SHAPES[0][3], rank=3, epilogue=EPILOGUES["everything_gelu"])
        print(f"memcheck ran {k.metadata.kernel_name} on {len(SHAPES)} shapes + epilogue", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(memcheck_main())
