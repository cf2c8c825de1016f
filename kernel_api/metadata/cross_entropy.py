"""Operands of the cross-entropy kernels: per-row cross-entropy (forward, optionally with its
gradient, and the backward from a saved log-sum-exp), its mean or sum, and the fused linear
cross-entropy.

A kernel declares the attributes of the logits (or the hidden states and weight), the class
indices and the per-row loss; the other operands follow them (lse, grad_loss of the loss's
type, the gradients of their input's: the arguments check that). Beyond those a kernel says
whether it writes the gradient (``gradient``: the forward with ``grad_logits``, or the fused
linear kernel with its gradient outputs) and the largest vocabulary it takes.
"""

from __future__ import annotations

from typing import Any

from ..arguments.cross_entropy import (CrossEntropyArguments, CrossEntropyBackwardArguments,
                                       CrossEntropyReducedArguments, LinearCrossEntropyArguments)
from ..core.dtypes import DataType, to_dtype
from ..core.status import Reason, Status
from ..core.tensor_attributes import TensorAttributes
from .operands import OperandsMetadata


class _CrossEntropyLimits(OperandsMetadata):
    """The scalar checks: the vocabulary's size and whether the gradient is written."""

    max_classes: int | None
    gradient: bool
    accumulator_type: DataType

    def _supports_scalars(self, args: Any) -> Status:
        classes = getattr(args, "vocab", None) or args.cols
        if self.max_classes is not None and classes > self.max_classes:
            return Status.fail(f"operand logits: {classes} classes but the kernel takes at most {self.max_classes}",
                               kind=Reason.SHAPE, operand="logits", actual=classes, required=self.max_classes)
        wants = getattr(args, "grad_logits", None) is not None or getattr(args, "wants_gradient", False)
        if wants and not self.gradient:
            return Status.fail("operand grad_logits: given but the kernel writes no gradient", kind=Reason.OTHER,
                               operand="grad_logits")
        return Status.success()

    def _limits(self, max_classes: int | None, gradient: bool, accumulator_type: Any) -> None:
        self.max_classes, self.gradient = max_classes, gradient
        self.accumulator_type = to_dtype(accumulator_type, "accumulator_type")

    def __repr__(self) -> str:
        operands = ", ".join(f"{n}={getattr(self, n)}" for n in self.operand_names)
        return (f"{type(self).__name__}({operands}, max_classes={self.max_classes}, gradient={self.gradient}, "
                f"accumulator_type={self.accumulator_type})")


class CrossEntropyOperandsMetadata(_CrossEntropyLimits):
    """Operands of a per-row cross-entropy forward kernel.

    Args:
        logits, target, loss: the attributes the kernel requires of each (lse has loss's;
            grad_logits logits').
        max_classes: the longest row it takes (None: any).
        gradient: whether it also writes the gradient (``grad_logits``, in place or not).
        accumulator_type: the type of its math.
    """

    operand_names = ("logits", "target", "loss")
    arguments_type = CrossEntropyArguments

    def __init__(self, logits: TensorAttributes, target: TensorAttributes, loss: TensorAttributes, *,
                 max_classes: int | None = None, gradient: bool = True, accumulator_type: Any = DataType.f32) -> None:
        self.logits, self.target, self.loss = logits, target, loss
        self._limits(max_classes, gradient, accumulator_type)


class CrossEntropyReducedOperandsMetadata(CrossEntropyOperandsMetadata):
    """Operands of a kernel of the rows' mean or sum (`CrossEntropyReducedArguments`): as
    `CrossEntropyOperandsMetadata`, ``loss`` the attributes of the buffer the loss goes to."""

    arguments_type = CrossEntropyReducedArguments


class CrossEntropyBackwardOperandsMetadata(_CrossEntropyLimits):
    """Operands of a per-row cross-entropy backward kernel (from the saved lse).

    Args:
        logits, target, lse: the attributes the kernel requires of each (grad_loss has lse's,
            grad_logits logits').
        max_classes: the longest row it takes (None: any).
        accumulator_type: the type of its math.
    """

    operand_names = ("logits", "target", "lse")
    arguments_type = CrossEntropyBackwardArguments

    def __init__(self, logits: TensorAttributes, target: TensorAttributes, lse: TensorAttributes, *,
                 max_classes: int | None = None, accumulator_type: Any = DataType.f32) -> None:
        self.logits, self.target, self.lse = logits, target, lse
        self._limits(max_classes, False, accumulator_type)

    def _supports_scalars(self, args: Any) -> Status:
        if self.max_classes is not None and args.cols > self.max_classes:
            return Status.fail(f"operand logits: {args.cols} classes but the kernel takes at most {self.max_classes}",
                               kind=Reason.SHAPE, operand="logits", actual=args.cols, required=self.max_classes)
        return Status.success()


class LinearCrossEntropyOperandsMetadata(_CrossEntropyLimits):
    """Operands of a fused linear cross-entropy kernel.

    Args:
        hidden, weight, target, loss: the attributes the kernel requires of each (the
            gradients have their input's; bias and grad_bias weight's dtype).
        max_classes: the largest vocabulary it takes (None: any).
        gradient: whether it computes the gradients in the same pass.
        accumulator_type: the type of its math.
    """

    operand_names = ("hidden", "weight", "target", "loss")
    arguments_type = LinearCrossEntropyArguments

    def __init__(self, hidden: TensorAttributes, weight: TensorAttributes, target: TensorAttributes,
                 loss: TensorAttributes, *, max_classes: int | None = None, gradient: bool = True,
                 accumulator_type: Any = DataType.f32) -> None:
        self.hidden, self.weight, self.target, self.loss = hidden, weight, target, loss
        self._limits(max_classes, gradient, accumulator_type)
