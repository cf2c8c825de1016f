"""Operands of the norm kernels (RMSNorm, LayerNorm; forward and backward).

A kernel declares the attributes of ``x``, ``weight`` and ``out`` (forward) or ``grad_out``,
``x``, ``weight``, ``grad_x`` (backward); the other operands follow them (residual,
residual_out and the gradients have x's or weight's dtype: the arguments check that). Beyond
those, a kernel says the longest row it takes (``max_cols``: a kernel holding a row in
registers or shared memory has one) and whether it fuses the residual add.
"""

from __future__ import annotations

from typing import Any

from ..arguments.norm import (LayerNormArguments, LayerNormBackwardArguments, RMSNormArguments,
                              RMSNormBackwardArguments)
from ..core.dtypes import DataType, to_dtype
from ..core.status import Reason, Status
from ..core.tensor_attributes import TensorAttributes
from .operands import OperandsMetadata


class _NormLimits(OperandsMetadata):
    """The scalar checks common to the norm operands: row length and the fused residual."""

    max_cols: int | None
    residual: bool
    accumulator_type: DataType

    def _supports_scalars(self, args: Any) -> Status:
        if self.max_cols is not None and args.cols > self.max_cols:
            return Status.fail(f"operand x: rows of {args.cols} elements but the kernel takes at most {self.max_cols}",
                               kind=Reason.SHAPE, operand="x", actual=args.cols, required=self.max_cols)
        if not self.residual and getattr(args, "residual", None) is not None:
            return Status.fail("operand residual: given but the kernel does not fuse the residual add",
                               kind=Reason.OTHER, operand="residual")
        return Status.success()

    def _limits(self, max_cols: int | None, residual: bool, accumulator_type: Any) -> None:
        self.max_cols, self.residual = max_cols, residual
        self.accumulator_type = to_dtype(accumulator_type, "accumulator_type")

    def __repr__(self) -> str:
        operands = ", ".join(f"{n}={getattr(self, n)}" for n in self.operand_names)
        return (f"{type(self).__name__}({operands}, max_cols={self.max_cols}, residual={self.residual}, "
                f"accumulator_type={self.accumulator_type})")


class RMSNormOperandsMetadata(_NormLimits):
    """Operands of an RMSNorm forward kernel.

    Args:
        x, weight, out: the attributes the kernel requires of each.
        max_cols: the longest row it takes (None: any).
        residual: whether it fuses ``s = x + residual`` (and writes residual_out).
        accumulator_type: the type the statistics are computed in.
    """

    operand_names = ("x", "weight", "out")
    arguments_type = RMSNormArguments

    def __init__(self, x: TensorAttributes, weight: TensorAttributes, out: TensorAttributes, *,
                 max_cols: int | None = None, residual: bool = True, accumulator_type: Any = DataType.f32) -> None:
        self.x, self.weight, self.out = x, weight, out
        self._limits(max_cols, residual, accumulator_type)


class LayerNormOperandsMetadata(RMSNormOperandsMetadata):
    """Operands of a LayerNorm forward kernel (bias has weight's attributes; arguments as for
    `RMSNormOperandsMetadata`)."""

    arguments_type = LayerNormArguments


class RMSNormBackwardOperandsMetadata(_NormLimits):
    """Operands of an RMSNorm backward kernel (grad_weight has weight's dtype, grad_x x's).

    Args:
        grad_out, x, weight, grad_x: the attributes the kernel requires of each.
        max_cols: the longest row it takes (None: any).
        accumulator_type: the type the statistics and the reductions are computed in.
    """

    operand_names = ("grad_out", "x", "weight", "grad_x")
    arguments_type = RMSNormBackwardArguments

    def __init__(self, grad_out: TensorAttributes, x: TensorAttributes, weight: TensorAttributes,
                 grad_x: TensorAttributes, *, max_cols: int | None = None, accumulator_type: Any = DataType.f32) -> None:
        self.grad_out, self.x, self.weight, self.grad_x = grad_out, x, weight, grad_x
        self._limits(max_cols, False, accumulator_type)


class LayerNormBackwardOperandsMetadata(RMSNormBackwardOperandsMetadata):
    """Operands of a LayerNorm backward kernel (as `RMSNormBackwardOperandsMetadata`; grad_bias
    has weight's dtype)."""

    arguments_type = LayerNormBackwardArguments
