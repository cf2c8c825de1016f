"""GPU checks of the f32 instances of `Sm90WarpSpecializedGemm` (tf32 and 3xTF32) and of the
f32 precision rule of `kernel_api.ops`: float64 references on fresh random data, NaN-filled
outputs, odd extents where the layout allows, batched and rank 2, fused epilogues. The 3xTF32
error is held to cuBLAS FP32's (``allow_tf32=False``) on the same data, measured in the test, or
to 3xTF32's own K-independent floor (`_split3_limit`)."""

from __future__ import annotations

import pytest
import torch

import kernel_api
from kernel_api.arguments import EpilogueArguments, GemmArguments
from kernel_api.dtypes import DataType
from kernel_api.ops import dispatch
from kernel_api.providers.cutedsl.gemm.sm90_warpspecialized import Sm90WarpSpecializedGemm
from gemm_family_utils import epilogue_reference, relative_error
from test_sm90_gemm_gpu import operand, shape_for

pytestmark = pytest.mark.gpu

#: tf32 operands keep 10 mantissa bits: norm-wise errors near 3e-4 for random data
TF32_TOL = 3e-3
_F32 = {k.name: k for k in Sm90WarpSpecializedGemm.generate_kernels(
    lambda m: m.operands.math_type in (DataType.tf32, DataType.tf32x3), cc=90)}
_TF32 = sorted(n for n, k in _F32.items() if k.metadata.operands.math_type is DataType.tf32)
_TF32X3 = sorted(n for n, k in _F32.items() if k.metadata.operands.math_type is DataType.tf32x3)


def _needs_sm90():
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an sm_90 GPU")


class _Tf32:
    """Sets torch's allow_tf32 for the block and restores it."""

    def __init__(self, allow: bool) -> None:
        self.allow = allow

    def __enter__(self):
        self.saved = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = self.allow

    def __exit__(self, *exc):
        torch.backends.cuda.matmul.allow_tf32 = self.saved


def _problem(kernel, M, N, K, L, rank, gen, pad=0):
    ops = kernel.metadata.operands
    batch = (L,) if rank == 3 else ()
    A = operand(batch + (M, K), torch.float32, ops.A.layout == "n", gen, pad=pad)
    B = operand(batch + (K, N), torch.float32, ops.B.layout == "n", gen, pad=pad)
    out = operand(batch + (M, N), torch.float32, ops.out.layout == "n", gen).fill_(float("nan"))
    return A, B, out


def _cublas_fp32_error(A, B, ref) -> float:
    with _Tf32(False):
        return relative_error(torch.matmul(A, B), ref)


#: 3xTF32's own floor: big + small keep 22 of an f32 operand's 24 bits (|x - big - small| <=
#: 2^-22 |x|) and small x small is dropped, so a product is off by ~2^-22 relative whatever K is
#: (measured 2.4e-7 .. 3.2e-7 norm-wise at K = 4096 .. 8192 on an H200), while cuBLAS FP32's error
#: starts at 2^-24 and grows with sqrt(K) (1.1e-6 at K = 4096): below K ~ 300, or where cuBLAS
#: splits K, cuBLAS FP32 is the more accurate one (the 1.5x bound alone fails there).
SPLIT3_FLOOR = 4 * 2.0**-22


def _split3_limit(A, B, ref, K: int) -> float:
    """What 3xTF32 is held to: 1.5 x cuBLAS FP32's error on the same data or `SPLIT3_FLOOR`,
    the larger. Independent of K: the accumulator is promoted into register FADDs every
    k-tile or two, so the tensor cores' truncating accumulation does not pile up along K
    (without that: 2.3e-9 K, 9.6e-6 at K = 4096, which the floor fails)."""
    return max(1.5 * _cublas_fp32_error(A, B, ref), SPLIT3_FLOOR)


def _gen(name: str, salt: int) -> torch.Generator:
    return torch.Generator(device="cuda").manual_seed((hash(name) + salt) & 0x7FFFFFFF)


@pytest.mark.parametrize("name", _TF32 + _TF32X3)
def test_f32_instance(name):
    """Every f32 instance: batched odd shapes and a multi-tile shape, rank 2 and 3."""
    _needs_sm90()
    kernel = _F32[name]
    split3 = kernel.metadata.operands.math_type is DataType.tf32x3
    gen = _gen(name, 1)
    tm, tn = kernel.config.tile_mn
    for base, L, rank in (((203, 301, 139), 3, 3), ((tm * 4 + 37, tn * 4 + 11, 1001), 1, 2), ((77, 45, 5), 2, 3)):
        M, N, K = shape_for(kernel, base)
        A, B, out = _problem(kernel, M, N, K, L, rank, gen)
        args = GemmArguments(A, B, out, accumulator_type=torch.float32)
        status = kernel.supports(args)
        assert status, f"{name} rejected {(L, M, N, K)}: {status.error}"
        kernel.run(args)
        torch.cuda.synchronize()
        ref = A.double() @ B.double()
        err = relative_error(out, ref)
        if split3:
            limit = _split3_limit(A, B, ref, K)
            assert err <= limit, f"{name} {(L, M, N, K)}: 3xTF32 error {err:.3e} > {limit:.3e}"
        else:
            assert err < TF32_TOL, f"{name} {(L, M, N, K)}: tf32 error {err:.3e} >= {TF32_TOL:.0e}"


@pytest.mark.parametrize("name", [n for n in _TF32X3 if "_tnt_" in n])
@pytest.mark.parametrize("K", [4096, 8192])
def test_3xtf32_long_k_error_does_not_grow_with_k(name, K):
    """Long K, where an unpromoted tensor-core accumulator drifts (truncation, linear in K):
    within `_split3_limit`, on zero-mean data and on non-negative data (whose partial sums all
    share one sign, so truncation errors cannot cancel)."""
    _needs_sm90()
    kernel = _F32[name]
    gen = _gen(name, 4 + K)
    M, N, _ = shape_for(kernel, (389, 270, K))  # (out's rows rounded to its 16-byte alignment)
    for positive in (False, True):
        A, B, out = _problem(kernel, M, N, K, 1, 2, gen)
        if positive:
            A.uniform_(0, 1, generator=gen)
            B.uniform_(0, 1, generator=gen)
        args = GemmArguments(A, B, out, accumulator_type=torch.float32)
        kernel.run(args)
        torch.cuda.synchronize()
        ref = A.double() @ B.double()
        err, limit = relative_error(out, ref), _split3_limit(A, B, ref, K)
        assert err <= limit, f"{name} K={K} positive={positive}: error {err:.3e} > {limit:.3e}"


@pytest.mark.parametrize("name", [n for n in _TF32X3 if "_tnt_" in n or "_nnn_" in n])
def test_3xtf32_unaligned_and_strided_operands(name):
    """3xTF32 reads A and B with plain loads: odd leading dimensions and offsets are fine."""
    _needs_sm90()
    kernel = _F32[name]
    gen = _gen(name, 2)
    M, N, K = shape_for(kernel, (131, 264, 333))
    A, B, out = _problem(kernel, M, N, K, 2, 3, gen, pad=1)  # leading dimensions padded by 1: misaligned
    assert A.stride(-1 if kernel.metadata.operands.A.layout == "n" else -2) % 4 != 0
    args = GemmArguments(A, B, out, accumulator_type=torch.float32)
    assert kernel.supports(args), kernel.supports(args).error
    kernel.run(args)
    torch.cuda.synchronize()
    ref = A.double() @ B.double()
    err = relative_error(out, ref)
    assert err <= _split3_limit(A, B, ref, K), f"{name}: error {err:.3e}"


@pytest.mark.parametrize("math", ["tf32", "tf32x3"])
@pytest.mark.parametrize("epi", [dict(alpha=0.5, beta=2.0, C=True, bias="row", activation="gelu"),
                                 dict(bias="column", activation="relu")], ids=["ab_c_biasrow_gelu", "biascol_relu"])
def test_f32_fused_epilogue(math, epi):
    _needs_sm90()
    name = next(n for n in (_TF32 if math == "tf32" else _TF32X3) if "_tnt_" in n and "cooperative" in n)
    kernel = _F32[name]
    gen = _gen(name, 3)
    M, N, K, L = 200, 300, 260, 2
    A, B, out = _problem(kernel, M, N, K, L, 3, gen)
    kw = dict(epi)
    bias_kind = kw.pop("bias")
    if kw.pop("C", False):
        kw["C"] = torch.randn(L, M, N, device="cuda", generator=gen)
    kw["bias"] = torch.randn(N, device="cuda", generator=gen) if bias_kind == "row" else \
        torch.randn(M, 1, device="cuda", generator=gen)
    ep = EpilogueArguments(**kw)
    args = GemmArguments(A, B, out, accumulator_type=torch.float32, epilogue=ep)
    kernel.run(args)
    torch.cuda.synchronize()
    ref = epilogue_reference(A.double() @ B.double(), ep, bias_kind, M, N)
    err = relative_error(out, ref)
    assert err < (TF32_TOL if math == "tf32" else 1e-5), f"{name} {epi}: error {err:.3e}"


def _chosen(A, B):
    """The kernel ops chose for the last f32 problem of A's shape."""
    # (the dispatch dict's keys: the scope token's id, the problem key (signature, M, N, K, L), the TF32 flag)
    found = [kernel for (_, problem, tf32), (kernel, _, _) in dispatch._dispatch.items()
             if problem[1:4] == (A.shape[-2], B.shape[-1], A.shape[-1]) and tf32 is torch.backends.cuda.matmul.allow_tf32]
    assert len(found) == 1, found
    return found[0]


@pytest.mark.parametrize("b_column_major", [True, False])
def test_ops_gemm_f32_follows_torch_precision(b_column_major):
    """ops.gemm on f32: f32 math (no tf32/tf32x3 kernel, error <= 1.5 x cuBLAS FP32's) while
    torch disallows TF32; tf32 allowed once torch allows it; accurate again after switching back,
    without clearing any cache (repeated calls take the fast paths)."""
    _needs_sm90()
    gen = torch.Generator(device="cuda").manual_seed(1234)
    M, N, K = 1000, 1536, 2048
    A = torch.randn(M, K, device="cuda", generator=gen)
    B = torch.randn(N, K, device="cuda", generator=gen).t() if b_column_major else \
        torch.randn(K, N, device="cuda", generator=gen)
    ref = A.double() @ B.double()
    fp32_err = _cublas_fp32_error(A, B, ref)
    out = torch.full((M, N), float("nan"), device="cuda")
    dispatch.clear_dispatch_cache()
    for allow in (False, True, False, True, False):
        with _Tf32(allow):
            for _ in range(3):  # first call chooses; the others take the fast paths
                out.fill_(float("nan"))
                kernel_api.ops.gemm(A, B, out=out)
                torch.cuda.synchronize()
                err = relative_error(out, ref)
                if allow:
                    assert err < TF32_TOL
                else:
                    assert err <= 1.5 * fp32_err, f"allow_tf32=False: error {err:.3e} vs cuBLAS FP32 {fp32_err:.3e}"
            kernel = _chosen(A, B)
            math = kernel.metadata.operands.math_type
            if not allow:
                assert math is DataType.f32
            elif b_column_major:
                # PickAny prefers a tf32 kernel when allowed: ours, or cuBLAS, which then runs TF32
                # too (measured level with ours: docs/performance.md, "f64 and f32 GEMM")
                assert math is DataType.tf32 or kernel.metadata.provider == "torch", kernel.name
    with _Tf32(False):
        torch.set_float32_matmul_precision("high")
        try:
            out.fill_(float("nan"))
            kernel_api.ops.gemm(A, B, out=out)
            torch.cuda.synchronize()
            assert relative_error(out, ref) < TF32_TOL
            if b_column_major:
                chosen = _chosen(A, B)
                assert chosen.metadata.operands.math_type is DataType.tf32 or chosen.metadata.provider == "torch"
        finally:
            torch.backends.cuda.matmul.allow_tf32 = False  # (the legacy flag overrides the precision)
    out.fill_(float("nan"))
    kernel_api.ops.gemm(A, B, out=out)
    torch.cuda.synchronize()
    assert relative_error(out, ref) <= 1.5 * fp32_err


def memcheck_main() -> int:
    """One tf32 and one 3xTF32 instance on small odd batched shapes, plain and with a fused
    epilogue, for compute-sanitizer:

        compute-sanitizer --tool memcheck --report-api-errors no python tests/test_sm90_gemm_f32_gpu.py
    """
    picks = [next(n for n in names if "_tnt_" in n) for names in (_TF32, _TF32X3)]
    for name in picks:
        kernel = _F32[name]
        gen = _gen(name, 5)
        for base, L, epilogue in (((203, 301, 139), 3, False), ((77, 45, 5), 2, False), ((130, 70, 66), 2, True)):
            M, N, K = shape_for(kernel, base)
            A, B, out = _problem(kernel, M, N, K, L, 3, gen)
            ep = None
            if epilogue:
                ep = EpilogueArguments(alpha=0.5, beta=2.0, C=torch.randn(L, M, N, device="cuda", generator=gen),
                                       bias=torch.randn(N, device="cuda", generator=gen), activation="gelu")
            kernel.run(GemmArguments(A, B, out, accumulator_type=torch.float32, epilogue=ep))
            torch.cuda.synchronize()
            ref = A.double() @ B.double()
            if ep is not None:
                ref = epilogue_reference(ref, ep, "row", M, N)
            err = relative_error(out, ref)
            assert err < TF32_TOL, f"{name} {(L, M, N, K)}: error {err:.3e}"
        print(f"memcheck ran {name} on 3 shapes (one with a fused epilogue)", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(memcheck_main())
