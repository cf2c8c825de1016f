"""GPU checks of every configuration `Sm90WarpSpecializedGemm.generate_kernels` emits.

Each instance runs batched (L = 3) on a shape whose non-contiguous extents are odd and not
tile multiples, plus a second shape spanning several tiles of every cluster, against a
float64 reference with fresh random inputs and a NaN-poisoned output. Subsets run rank-2
operands, strided (padded) operands, K < one k-tile, every fused-epilogue variant, and the
rejection of misaligned operands. Needs an sm_90 GPU; run with ``pytest -n 12`` to spread
the compiles over CPU cores.
"""

from __future__ import annotations

import pytest
import torch

import kernel_api
from kernel_api.errors import UnsupportedArgumentsError
from kernel_api.providers.cutedsl.gemm.sm90_warpspecialized import Sm90WarpSpecializedGemm

from sm90_gemm_utils import TOLERANCE, make_problem, relative_error, shape_for

pytestmark = pytest.mark.gpu

_ALL = {k.name: k for k in Sm90WarpSpecializedGemm.generate_kernels(None, cc=90)}
# One instance per schedule/tile/cluster for the deeper checks (bf16, row-major).
_REPS = [n for n, k in _ALL.items() if "_bf16bf16_bf16_" in n and "_ttt_" in n]


def _needs_sm90():
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an sm_90 GPU")


def _run_and_check(kernel, args, ref, what: str) -> None:
    status = kernel.supports(args)
    assert status, f"{kernel.name} rejected {args}: {status.error}"
    kernel.run(args)
    torch.cuda.synchronize()
    err = relative_error(args.out, ref)
    tol = TOLERANCE[args.out.dtype]
    assert err < tol, f"{kernel.name} {what}: relative error {err:.3e} >= {tol:.0e} ({args})"


def _gen(name: str, salt: int) -> torch.Generator:
    return torch.Generator(device="cuda").manual_seed((hash(name) + salt) & 0x7FFFFFFF)


@pytest.mark.parametrize("name", sorted(_ALL))
def test_every_config(name):
    _needs_sm90()
    kernel = _ALL[name]
    gen = _gen(name, 1)
    tm, tn = kernel.config.tile_mn
    cm, cn = kernel.config.cluster_mn
    for base, L in (((203, 301, 139), 3), ((tm * cm * 2 + 37, tn * cn * 2 + 11, 1000), 1)):
        M, N, K = shape_for(kernel, base)
        args, ref = make_problem(kernel, M, N, K, L, 3, gen)
        _run_and_check(kernel, args, ref, f"(L,M,N,K)=({L},{M},{N},{K})")


@pytest.mark.parametrize("name", _REPS)
def test_rank2_strided_and_short_k(name):
    _needs_sm90()
    kernel = _ALL[name]
    gen = _gen(name, 2)
    for (M, N, K), pad in (((1, 8, 8), 0), ((517, 264, 40), 8), ((128, 1024, 4096), 16), ((1000, 72, 520), 0)):
        args, ref = make_problem(kernel, M, N, K, 1, 2, gen, pad=pad)
        _run_and_check(kernel, args, ref, f"rank-2 (M,N,K)=({M},{N},{K}) pad={pad}")


_EPILOGUES = [
    dict(alpha=0.5),
    dict(alpha=1.5, beta=-0.75, C=True),
    dict(alpha=1.0, beta=1.0, C=True, C_column_major=True, bias="row", activation="relu"),
    dict(bias="column", activation="gelu"),
    dict(alpha=0.25, bias="row", activation="silu"),
]


@pytest.mark.parametrize("name", [n for n in _ALL if ("_ttt_" in n or "_ntn_" in n)
                                  and ("_bf16bf16_bf16_" in n or "_f16f16_f32_" in n)
                                  and ("cluster2x1_cooperative" in n or "128x128x64_cluster2x1_pingpong" in n)])
@pytest.mark.parametrize("epi", range(len(_EPILOGUES)))
def test_fused_epilogue(name, epi):
    _needs_sm90()
    kernel = _ALL[name]
    M, N, K = shape_for(kernel, (301, 203, 136))
    args, ref = make_problem(kernel, M, N, K, 2, 3, _gen(name, 10 + epi), epilogue=_EPILOGUES[epi])
    _run_and_check(kernel, args, ref, f"epilogue {_EPILOGUES[epi]}")


def test_misaligned_operands_are_never_offered():
    _needs_sm90()
    base = torch.randn(1024 * 1024 + 1, device="cuda").to(torch.bfloat16)
    A = base[1:1 + 512 * 512].view(512, 512)          # pointer off by one element
    B = torch.randn(512, 512, device="cuda").to(torch.bfloat16)
    out = torch.empty(512, 512, device="cuda", dtype=torch.bfloat16)
    args = kernel_api.GemmArguments(A, B, out, accumulator_type=torch.float32)
    found = kernel_api.get_kernels(args, metadata_filter=lambda m: m.kernel_class is Sm90WarpSpecializedGemm)
    assert found == []
    kernel = _ALL[_REPS[0]]
    with pytest.raises(UnsupportedArgumentsError, match="operand A"):
        kernel.run(args)


def test_discovery_on_device_offers_aligned_problems():
    _needs_sm90()
    A = torch.randn(256, 128, device="cuda").to(torch.bfloat16)
    B = torch.randn(128, 512, device="cuda").to(torch.bfloat16)
    out = torch.empty(256, 512, device="cuda", dtype=torch.bfloat16)
    args = kernel_api.GemmArguments(A, B, out, accumulator_type=torch.float32)
    found = kernel_api.get_kernels(args, metadata_filter=lambda m: m.kernel_class is Sm90WarpSpecializedGemm)
    assert {k.config for k in found} == {k.config for k in (_ALL[n] for n in _REPS)}
    found[0].run(args)
    torch.cuda.synchronize()
    ref = A.double() @ B.double()
    assert relative_error(out, ref) < TOLERANCE[torch.bfloat16]
