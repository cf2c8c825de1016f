"""Helpers for the GEMM family tests: operands of any layout, float64 references, tolerances."""

from __future__ import annotations

import math

import torch

from kernel_api.arguments import EpilogueArguments, GemmArguments
from kernel_api.dtypes import DataType

TOLERANCE = {DataType.f64: 1e-12, DataType.f32: 1e-5, DataType.tf32: 5e-3, DataType.f16: 1e-2, DataType.bf16: 1e-2}


def tolerance(metadata) -> float:
    """Relative (norm-wise) tolerance for a kernel: by math type (tf32) and operand/output types."""
    ops = metadata.operands
    tol = max(TOLERANCE[ops.math_type], TOLERANCE[ops.A.dtype], TOLERANCE[ops.out.dtype])
    return tol


def operand(shape: tuple[int, ...], dtype: torch.dtype, column_major: bool, device: str, offset: int = 0,
            generator: torch.Generator | None = None) -> torch.Tensor:
    """Random tensor of ``shape`` whose last two modes are row- or column-major.

    ``offset`` > 0 shifts the data pointer by that many elements (misaligned operands).
    """
    stored = shape[:-2] + ((shape[-1], shape[-2]) if column_major else (shape[-2], shape[-1]))
    n = math.prod(stored)
    flat = torch.randn(n + offset, dtype=torch.float32, device=device, generator=generator).to(dtype)
    t = flat[offset:].view(stored)
    return t.transpose(-1, -2) if column_major else t


def problem(metadata, M: int, N: int, K: int, L: int, rank: int, device: str, epilogue: dict | None = None,
            offset: int = 0, generator: torch.Generator | None = None) -> tuple[GemmArguments, torch.Tensor]:
    """GemmArguments for a kernel's dtypes/layouts (output poisoned with NaN) and its float64 reference."""
    ops = metadata.operands
    batch = (L,) if rank == 3 else ()
    assert rank == 3 or L == 1
    A = operand(batch + (M, K), ops.A.dtype.to_torch(), ops.A.layout == "n", device, offset, generator)
    B = operand(batch + (K, N), ops.B.dtype.to_torch(), ops.B.layout == "n", device, offset, generator)
    out = operand(batch + (M, N), ops.out.dtype.to_torch(), ops.out.layout == "n", device, offset, generator)
    out.fill_(float("nan"))
    ep = None
    ref = A.double() @ B.double()
    if epilogue:
        kw = dict(epilogue)
        if kw.pop("C", None) is not None:
            c_col = kw.pop("C_column_major", False)
            kw["C"] = operand(batch + (M, N), ops.out.dtype.to_torch(), c_col, device, 0, generator)
        kw.pop("C_column_major", None)
        bias_kind = kw.pop("bias", None)
        if bias_kind == "row":
            kw["bias"] = torch.randn(N, device=device, generator=generator).to(ops.out.dtype.to_torch())
        elif bias_kind == "column":
            kw["bias"] = torch.randn(M, 1, device=device, generator=generator).to(ops.out.dtype.to_torch())
        ep = EpilogueArguments(**kw)
        ref = epilogue_reference(ref, ep, bias_kind, M, N)
    args = GemmArguments(A, B, out, accumulator_type=ops.accumulator_type, epilogue=ep)
    return args, ref


def epilogue_reference(ref: torch.Tensor, ep: EpilogueArguments, bias_kind: str | None, M: int,
                       N: int) -> torch.Tensor:
    """``activation(alpha * ref + beta * C + bias)`` in float64, as the fused epilogue computes it."""
    ref = ref * ep.alpha
    if ep.C is not None and ep.beta != 0:
        ref = ref + ep.beta * ep.C.double()
    if bias_kind == "row":
        ref = ref + ep.bias.double().reshape(1, N)
    elif bias_kind == "column":
        ref = ref + ep.bias.double().reshape(M, 1)
    if ep.activation == "relu":
        ref = torch.relu(ref)
    elif ep.activation == "gelu":
        ref = torch.nn.functional.gelu(ref, approximate="tanh")
    elif ep.activation == "silu":
        ref = torch.nn.functional.silu(ref)
    return ref


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖ / ‖ref‖ in float64; NaN anywhere (unwritten output) gives inf."""
    o = out.double()
    if not torch.isfinite(o).all():
        return float("inf")
    return float(torch.linalg.vector_norm(o - ref) / torch.linalg.vector_norm(ref).clamp_min(1e-300))


def round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def aligned_extents(metadata, M: int, N: int, K: int) -> tuple[int, int, int]:
    """Round up the extents a kernel's alignment constrains: each operand's contiguous one."""
    need = {"M": 1, "N": 1, "K": 1}
    ops = metadata.operands
    for attrs, (rows, cols) in ((ops.A, ("M", "K")), (ops.B, ("K", "N")), (ops.out, ("M", "N"))):
        dim = cols if attrs.layout == "t" else rows
        need[dim] = max(need[dim], attrs.divisibility)
    return round_up(M, need["M"]), round_up(N, need["N"]), round_up(K, need["K"])


def operand_variants() -> list[torch.Tensor]:
    """CPU tensors with assorted dtypes, layouts, shapes, pointer offsets and strides."""
    base = torch.empty(1 << 16, dtype=torch.float16)
    variants = []
    for rows, cols in ((64, 32), (64, 48), (32, 48), (63, 32)):
        for offset in (0, 1, 8, 64, 512):
            for transpose in (False, True):
                r, c = (cols, rows) if transpose else (rows, cols)
                t = base[offset:offset + r * c].view(r, c)
                variants.append(t.t() if transpose else t)
        variants.append(torch.empty(rows, cols, dtype=torch.bfloat16))
        variants.append(torch.empty(rows, 2 * cols, dtype=torch.float16)[:, :cols])
    return variants
