"""Per-operation operand descriptions: what each tensor operand of a kernel must be.

Each `OperandsMetadata` subclass names the arguments type it describes (``arguments_type``),
which `KernelMetadata.supports` checks with ``isinstance`` before comparing operands.
"""

from __future__ import annotations

from typing import Any, ClassVar

from ..arguments import Arguments, GemmArguments, SoftmaxArguments, SoftmaxBackwardArguments
from ..core.dtypes import DataType, to_dtype
from ..core.status import Reason, Status
from ..core.tensor_attributes import TensorAttributes


class OperandsMetadata:
    """Base of per-operation operand descriptions. Subclasses list their tensor operands."""

    operand_names: ClassVar[tuple[str, ...]] = ()
    # The arguments type these operands describe; None accepts any (KernelMetadata.supports).
    arguments_type: ClassVar[type[Arguments] | None] = None

    def tensor_attributes(self) -> dict[str, TensorAttributes]:
        return {name: getattr(self, name) for name in self.operand_names}

    def supports(self, args: Any) -> Status:
        """Compare each operand's attributes and the scalar types with those of ``args``."""
        for name in self.operand_names:
            status = getattr(self, name).accepts(args.tensor_attributes[name], name)
            if not status:
                return status
        return self._supports_scalars(args)

    def _supports_scalars(self, args: Any) -> Status:
        return Status.success()


class GemmOperandsMetadata(OperandsMetadata):
    """Operands of ``out = A @ B``: attributes of A, B, out and the accumulator type.

    ``math_type`` is the type the multiply runs in when it differs from A's, e.g.
    ``tf32`` for f32 operands on tensor cores, so users can filter such kernels out.

    Rank: a rank-3 stride pattern (``(0, 0, 1)``) takes (L, M, K)-style and (M, K)-style
    operands; a rank-2 pattern (``(0, 1)``) takes (M, K)-style operands only, so a kernel
    written for matrices is never handed batched tensors. (`GemmArguments` records rank-3
    patterns for both ranks; the operands' rank is compared here.)
    """

    operand_names = ("A", "B", "out")
    arguments_type = GemmArguments

    def __init__(self, A: TensorAttributes, B: TensorAttributes, out: TensorAttributes,
                 accumulator_type: Any, math_type: Any = None) -> None:
        for name, value in (("A", A), ("B", B), ("out", out)):
            if not isinstance(value, TensorAttributes):
                raise TypeError(f"GemmOperandsMetadata.{name} must be TensorAttributes, got {type(value).__name__}")
        self.A, self.B, self.out = A, B, out
        self.accumulator_type = to_dtype(accumulator_type, "accumulator_type")
        self.math_type = A.dtype if math_type is None else to_dtype(math_type, "math_type")

    def supports(self, args: Any) -> Status:
        status = super().supports(args)
        if status and args.A.dim() == 3:
            for name in self.operand_names:
                pattern = getattr(self, name).stride
                if len(pattern) == 2:
                    return Status.fail(
                        f"operand {name}: rank 3 (batched) but the kernel's stride pattern {pattern} is rank 2: it "
                        f"takes rank-2 operands only", kind=Reason.SHAPE, operand=name, actual=3, required=2)
        return status

    def _supports_scalars(self, args: Any) -> Status:
        if args.accumulator_type is not self.accumulator_type:
            return Status.fail(
                f"accumulator_type {args.accumulator_type} but the kernel accumulates in {self.accumulator_type}",
                kind=Reason.ACCUMULATOR, operand="accumulator_type", actual=args.accumulator_type,
                required=self.accumulator_type)
        return Status.success()

    def __repr__(self) -> str:
        return (f"GemmOperandsMetadata(A={self.A}, B={self.B}, out={self.out}, "
                f"accumulator_type={self.accumulator_type}, math_type={self.math_type})")


class SoftmaxOperandsMetadata(OperandsMetadata):
    """Operands of ``out = softmax(x, dim=-1)``; math in ``accumulator_type`` (f32)."""

    operand_names = ("x", "out")
    arguments_type = SoftmaxArguments

    def __init__(self, x: TensorAttributes, out: TensorAttributes, accumulator_type: Any = DataType.f32) -> None:
        self.x, self.out = x, out
        self.accumulator_type = to_dtype(accumulator_type, "accumulator_type")

    def __repr__(self) -> str:
        return f"SoftmaxOperandsMetadata(x={self.x}, out={self.out}, accumulator_type={self.accumulator_type})"


class SoftmaxBackwardOperandsMetadata(OperandsMetadata):
    """Operands of ``grad_in = out * (grad_out - sum(grad_out * out, dim=-1))``."""

    operand_names = ("grad_out", "out", "grad_in")
    arguments_type = SoftmaxBackwardArguments

    def __init__(self, grad_out: TensorAttributes, out: TensorAttributes, grad_in: TensorAttributes,
                 accumulator_type: Any = DataType.f32) -> None:
        self.grad_out, self.out, self.grad_in = grad_out, out, grad_in
        self.accumulator_type = to_dtype(accumulator_type, "accumulator_type")

    def __repr__(self) -> str:
        return (f"SoftmaxBackwardOperandsMetadata(grad_out={self.grad_out}, out={self.out}, "
                f"grad_in={self.grad_in}, accumulator_type={self.accumulator_type})")


def softmax_operands(dtype: Any, divisibility: int, backward: bool = False) -> OperandsMetadata:
    """Operands of a softmax forward (x, out) or backward (grad_out, out, grad_in) kernel whose
    tensors are all row-major of one ``dtype`` and aligned to ``divisibility`` elements; f32 math."""
    attrs = TensorAttributes(dtype, (0, 1), divisibility)
    if backward:
        return SoftmaxBackwardOperandsMetadata(attrs, attrs, attrs, DataType.f32)
    return SoftmaxOperandsMetadata(attrs, attrs, DataType.f32)
