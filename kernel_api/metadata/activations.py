"""Operands of the gated activation kernels (SwiGLU, GeGLU; forward and backward).

A kernel declares the attributes of every operand (one dtype for all, rows over the last
dimension, the alignment its vector accesses need) and the gate activations it computes.
"""

from __future__ import annotations

from typing import Any

from ..arguments.activations import GATE_ACTIVATIONS, GatedActivationArguments, GatedActivationBackwardArguments
from ..core.status import Reason, Status
from ..core.tensor_attributes import TensorAttributes
from .operands import OperandsMetadata


class _GatedLimits(OperandsMetadata):
    """The activation check common to the forward and the backward."""

    activations: tuple[str, ...]

    def _supports_scalars(self, args: Any) -> Status:
        if args.activation not in self.activations:
            return Status.fail(f"activation {args.activation} but the kernel computes {'/'.join(self.activations)}",
                               kind=Reason.OTHER, operand="activation", actual=args.activation,
                               required=self.activations)
        return Status.success()

    def _activations(self, activations: Any) -> None:
        activations = tuple(activations)
        unknown = [a for a in activations if a not in GATE_ACTIVATIONS]
        if unknown or not activations:
            raise ValueError(f"activations: expected a non-empty subset of {GATE_ACTIVATIONS}, got {activations!r}")
        self.activations = activations

    def __repr__(self) -> str:
        operands = ", ".join(f"{n}={getattr(self, n)}" for n in self.operand_names)
        return f"{type(self).__name__}({operands}, activations={self.activations})"


class GatedActivationOperandsMetadata(_GatedLimits):
    """Operands of a gated activation forward kernel.

    Args:
        gate, up, out: the attributes the kernel requires of each.
        activations: the gate activations it computes (a subset of `GATE_ACTIVATIONS`).
    """

    operand_names = ("gate", "up", "out")
    arguments_type = GatedActivationArguments

    def __init__(self, gate: TensorAttributes, up: TensorAttributes, out: TensorAttributes, *,
                 activations: Any = GATE_ACTIVATIONS) -> None:
        self.gate, self.up, self.out = gate, up, out
        self._activations(activations)


class GatedActivationBackwardOperandsMetadata(_GatedLimits):
    """Operands of a gated activation backward kernel.

    Args:
        grad_out, gate, up, grad_gate, grad_up: the attributes the kernel requires of each.
        activations: the gate activations it differentiates.
    """

    operand_names = ("grad_out", "gate", "up", "grad_gate", "grad_up")
    arguments_type = GatedActivationBackwardArguments

    def __init__(self, grad_out: TensorAttributes, gate: TensorAttributes, up: TensorAttributes,
                 grad_gate: TensorAttributes, grad_up: TensorAttributes, *, activations: Any = GATE_ACTIVATIONS) -> None:
        self.grad_out, self.gate, self.up, self.grad_gate, self.grad_up = grad_out, gate, up, grad_gate, grad_up
        self._activations(activations)
