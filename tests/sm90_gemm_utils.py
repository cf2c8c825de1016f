"""Helpers for the SM90 GEMM tests: operands of a kernel's types/layouts, float64 references."""

from __future__ import annotations

import torch

from kernel_api.arguments import EpilogueArguments, GemmArguments

# Norm-wise relative error allowed per output type (inputs are exact in the reference; the
# error is the f32 accumulation plus one rounding to the output type).
TOLERANCE = {torch.bfloat16: 8e-3, torch.float16: 2e-3, torch.float32: 1e-4}


def operand(shape: tuple[int, ...], dtype: torch.dtype, column_major: bool, gen: torch.Generator,
            device: str = "cuda", pad: int = 0) -> torch.Tensor:
    """Random operand whose last two modes are row- or column-major; ``pad`` extra elements
    of leading dimension (a strided view of a larger buffer)."""
    rows, cols = shape[-2], shape[-1]
    stored = shape[:-2] + ((cols, rows + pad) if column_major else (rows, cols + pad))
    t = torch.randn(stored, device=device, generator=gen, dtype=torch.float32).to(dtype)
    if column_major:
        return t[..., :rows].transpose(-1, -2)
    return t[..., :cols]


def shape_for(kernel, base: tuple[int, int, int]) -> tuple[int, int, int]:
    """(M, N, K) near ``base``: extents that are some operand's contiguous mode are rounded to
    the kernel's alignment, the others are left odd (TMA handles ragged edges)."""
    ops = kernel.metadata.operands
    M, N, K = base
    def up(x, a):
        return -(-x // a) * a
    if ops.A.layout == "n" or ops.out.layout == "n":
        M = up(M, max(ops.A.divisibility, ops.out.divisibility))
    if ops.B.layout == "t" or ops.out.layout == "t":
        N = up(N, max(ops.B.divisibility, ops.out.divisibility))
    if ops.A.layout == "t" or ops.B.layout == "n":
        K = up(K, max(ops.A.divisibility, ops.B.divisibility))
    return M, N, K


def make_problem(kernel, M: int, N: int, K: int, L: int, rank: int, gen: torch.Generator,
                 epilogue: dict | None = None, pad: int = 0) -> tuple[GemmArguments, torch.Tensor]:
    """Arguments with a NaN-poisoned output for ``kernel``'s types/layouts, and the float64 reference."""
    ops = kernel.metadata.operands
    ab, od = ops.A.dtype.to_torch(), ops.out.dtype.to_torch()
    batch = (L,) if rank == 3 else ()
    A = operand(batch + (M, K), ab, ops.A.layout == "n", gen, pad=pad)
    B = operand(batch + (K, N), ab, ops.B.layout == "n", gen, pad=pad)
    out = operand(batch + (M, N), od, ops.out.layout == "n", gen, pad=pad).fill_(float("nan"))
    ref = A.double() @ B.double()
    ep = None
    if epilogue:
        kw = dict(epilogue)
        bias_kind = kw.pop("bias", None)
        if kw.pop("C", False):
            kw["C"] = operand(batch + (M, N), od, kw.pop("C_column_major", False), gen)
        if bias_kind == "row":
            kw["bias"] = torch.randn(N, device="cuda", generator=gen).to(od)
        elif bias_kind == "column":
            kw["bias"] = torch.randn(M, 1, device="cuda", generator=gen).to(od)
        ep = EpilogueArguments(**kw)
        ref = ref * ep.alpha
        if ep.C is not None:
            ref = ref + ep.beta * ep.C.double()
        if bias_kind == "row":
            ref = ref + kw["bias"].double().reshape(N)
        elif bias_kind == "column":
            ref = ref + kw["bias"].double().reshape(M, 1)
        if ep.activation == "relu":
            ref = torch.relu(ref)
        elif ep.activation == "gelu":
            ref = torch.nn.functional.gelu(ref, approximate="tanh")
        elif ep.activation == "silu":
            ref = torch.nn.functional.silu(ref)
    return GemmArguments(A, B, out, accumulator_type=torch.float32, epilogue=ep), ref


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖ / ‖ref‖ in float64; any NaN/inf (e.g. an unwritten element) gives inf."""
    o = out.double()
    if not torch.isfinite(o).all():
        return float("inf")
    return float(torch.linalg.vector_norm(o - ref) / torch.linalg.vector_norm(ref).clamp_min(1e-300))
