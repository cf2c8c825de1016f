"""Liger's RMSNorm and LayerNorm forward kernels (one program per row) as `TritonKernel`s.

Each names Liger's ``@triton.jit`` function and maps `RMSNormArguments` / `LayerNormArguments`
onto its parameters; kernel_api compiles it (for any cc, without a GPU) and launches it. The
values are those Liger's own wrappers pass:

- RMSNorm runs in Liger's "gemma" casting mode with offset 0: x and weight are read into f32,
  ``x * rstd * weight`` is computed in f32 and rounded once, as kernel_api's definition says
  (the "llama" mode rounds ``x * rstd`` to x's type before the weight multiply);
- the block is the row length rounded up to a power of two (at most 64K elements) and the warps
  are Liger's choice for it (`calculate_settings`: 4, 8 from 2K, 16 from 8K, 32 from 32K); an
  instance per warp count, each supporting the rows Liger gives its count;
- the per-row statistics the kernels store for Liger's backward (rstd; mean and rstd) go to a
  `scratch_buffer` with row stride 0: the operation has no output for them.

`LigerRMSNorm` and `LigerLayerNorm` do not fuse the residual add; `LigerFusedAddRMSNorm` is
Liger's fused-add kernel (``s = x + residual`` in x's type, written to ``residual_out``, then the
RMSNorm of the rounded ``s``), for `RMSNormArguments` with a residual only.
"""

from __future__ import annotations

from typing import Any

import triton
from liger_kernel.ops.fused_add_rms_norm import _fused_add_rms_norm_forward_kernel
from liger_kernel.ops.layer_norm import _layer_norm_forward_kernel
from liger_kernel.ops.rms_norm import _rms_norm_forward_kernel, _str_to_casting_mode
from liger_kernel.ops.utils import calculate_settings

from kernel_api import DataType, LayerNormArguments, RMSNormArguments, Status, TensorAttributes
from kernel_api.core.status import Reason
from kernel_api.metadata.norm import LayerNormOperandsMetadata, RMSNormOperandsMetadata
from kernel_api.providers.triton import TritonKernel, scratch_buffer

from .provider import LigerProvider

#: Liger's largest block (calculate_settings refuses longer rows)
MAX_COLS = 65536
_GEMMA = _str_to_casting_mode["gemma"]


def row_stride(t: Any, rows: int, cols: int) -> int:
    """The elements between rows of ``t`` seen as (rows, cols).

    Args:
        t: an operand whose rows the arguments found evenly spaced.
        rows, cols: its rows and their length.

    Returns:
        The row stride in elements (``cols`` for one row or a contiguous operand).
    """
    if rows <= 1 or t.is_contiguous():
        return cols
    return t.view(rows, cols).stride(0)


def liger_warps(cols: int) -> int:
    """The warps Liger launches a row of ``cols`` elements with (`calculate_settings`).

    Args:
        cols: the row length (at most `MAX_COLS`).

    Returns:
        4, 8, 16 or 32.
    """
    return calculate_settings(max(1, cols))[1]


class _LigerRowNorm(TritonKernel):
    """One program per row, Liger's block and warps; weight of x's type (``weight_type`` None)
    or of ``weight_type``."""

    configs = [triton.Config({}, num_warps=w) for w in (4, 8, 16, 32)]
    dtypes = (DataType.f32, DataType.f16, DataType.bf16)
    operands_type: Any = None
    weight_type: DataType | None = None
    fuses_residual = False
    performance_hint = 0.5

    @classmethod
    def operands_for(cls, dtype: DataType, divisibility: int) -> Any:
        weight = cls.weight_type or dtype
        rows = TensorAttributes(dtype, (0, 1), divisibility)
        vector = TensorAttributes(weight, (1,), max(1, divisibility * dtype.bytes // weight.bytes))
        return cls.operands_type(rows, vector, rows, max_cols=MAX_COLS, residual=cls.fuses_residual)

    def _supports(self, args: Any) -> Status:
        if self.fuses_residual and args.residual is None:
            return Status.fail("operand residual: Liger's fused-add kernel needs one (LigerRMSNorm serves without)",
                               kind=Reason.OTHER, operand="residual")
        warps = liger_warps(args.cols)
        if self.metadata.design.num_warps != warps:
            return Status.fail(f"operand x: Liger runs rows of {args.cols} elements with {warps} warps, this instance "
                               f"with {self.metadata.design.num_warps}", kind=Reason.SHAPE, operand="x",
                               actual=self.metadata.design.num_warps, required=warps)
        return Status.success()

    def grid(self, args: Any) -> tuple[int, ...]:
        return (args.rows,)


@LigerProvider.register
class LigerRMSNorm(_LigerRowNorm):
    """Liger's ``_rms_norm_forward_kernel``: one row per program, f32 math ("gemma" casting)."""

    jit_function = _rms_norm_forward_kernel
    supported_args_type = RMSNormArguments
    operands_type = RMSNormOperandsMetadata

    def launch_args(self, args: Any) -> tuple:
        rows, cols = args.rows, args.cols
        stats = scratch_buffer(args.device)
        return ((args.out, row_stride(args.out, rows, cols), args.x, row_stride(args.x, rows, cols), args.weight, 1,
                 stats, 0, cols, args.eps, 0.0),
                {"casting_mode": _GEMMA, "elementwise_affine": True, "BLOCK_SIZE": triton.next_power_of_2(cols)})


@LigerProvider.register
class LigerRMSNormF32Weight(LigerRMSNorm):
    """`LigerRMSNorm` with f32 weights under f16/bf16 rows."""

    dtypes = (DataType.f16, DataType.bf16)
    weight_type = DataType.f32


@LigerProvider.register
class LigerFusedAddRMSNorm(_LigerRowNorm):
    """Liger's ``_fused_add_rms_norm_forward_kernel``: ``s = x + residual`` (to residual_out),
    then its RMSNorm in f32 ("gemma" casting), one row per program."""

    jit_function = _fused_add_rms_norm_forward_kernel
    supported_args_type = RMSNormArguments
    operands_type = RMSNormOperandsMetadata
    fuses_residual = True

    def launch_args(self, args: Any) -> tuple:
        rows, cols = args.rows, args.cols
        stats = scratch_buffer(args.device)
        return ((args.out, row_stride(args.out, rows, cols), args.residual_out, row_stride(args.residual_out, rows, cols),
                 args.x, row_stride(args.x, rows, cols), args.residual, row_stride(args.residual, rows, cols),
                 args.weight, 1, stats, 0, cols, args.eps, 0.0),
                {"casting_mode": _GEMMA, "BLOCK_SIZE": triton.next_power_of_2(cols)})


@LigerProvider.register
class LigerFusedAddRMSNormF32Weight(LigerFusedAddRMSNorm):
    """`LigerFusedAddRMSNorm` with f32 weights under f16/bf16 rows."""

    dtypes = (DataType.f16, DataType.bf16)
    weight_type = DataType.f32


@LigerProvider.register
class LigerLayerNorm(_LigerRowNorm):
    """Liger's ``_layer_norm_forward_kernel``: one row per program, statistics and affine in f32."""

    jit_function = _layer_norm_forward_kernel
    supported_args_type = LayerNormArguments
    operands_type = LayerNormOperandsMetadata

    def launch_args(self, args: Any) -> tuple:
        rows, cols = args.rows, args.cols
        stats = scratch_buffer(args.device)
        return ((args.out, row_stride(args.out, rows, cols), args.x, row_stride(args.x, rows, cols), args.weight, 1,
                 args.bias, 1, stats, 0, stats, 0, cols, args.eps),
                {"BLOCK_SIZE": triton.next_power_of_2(cols)})


@LigerProvider.register
class LigerLayerNormF32Weight(LigerLayerNorm):
    """`LigerLayerNorm` with f32 weight and bias under f16/bf16 rows."""

    dtypes = (DataType.f16, DataType.bf16)
    weight_type = DataType.f32
