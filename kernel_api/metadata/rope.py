"""Operands of the rotary position embedding kernels (forward and backward).

A kernel declares the attributes of its six operands: the q-like and k-like inputs and outputs
(one dtype), ``cos`` and ``sin`` (one dtype, the inputs' or another), and the alignment its
vector accesses need. Beyond those it may bound the head dimension it takes.
"""

from __future__ import annotations

from typing import Any

from ..arguments.rope import RopeArguments, RopeBackwardArguments
from ..core.status import Reason, Status
from ..core.tensor_attributes import TensorAttributes
from .operands import OperandsMetadata


class RopeOperandsMetadata(OperandsMetadata):
    """Operands of a RoPE forward kernel.

    Args:
        q, k, cos, sin, q_out, k_out: the attributes the kernel requires of each.
        max_head_dim: the largest head dimension it takes (None: any).
    """

    operand_names = ("q", "k", "cos", "sin", "q_out", "k_out")
    arguments_type = RopeArguments

    def __init__(self, q: TensorAttributes, k: TensorAttributes, cos: TensorAttributes, sin: TensorAttributes,
                 q_out: TensorAttributes, k_out: TensorAttributes, *, max_head_dim: int | None = None) -> None:
        for name, value in zip(self.operand_names, (q, k, cos, sin, q_out, k_out)):
            setattr(self, name, value)
        self.max_head_dim = max_head_dim

    def _supports_scalars(self, args: Any) -> Status:
        if self.max_head_dim is not None and args.head_dim > self.max_head_dim:
            return Status.fail(f"operand {self.operand_names[0]}: head_dim {args.head_dim} but the kernel takes at "
                               f"most {self.max_head_dim}", kind=Reason.SHAPE, operand=self.operand_names[0],
                               actual=args.head_dim, required=self.max_head_dim)
        return Status.success()

    def __repr__(self) -> str:
        operands = ", ".join(f"{n}={getattr(self, n)}" for n in self.operand_names)
        return f"{type(self).__name__}({operands}, max_head_dim={self.max_head_dim})"


class RopeBackwardOperandsMetadata(RopeOperandsMetadata):
    """Operands of a RoPE backward kernel (arguments as for `RopeOperandsMetadata`, in the
    order grad_q_out, grad_k_out, cos, sin, grad_q, grad_k)."""

    operand_names = ("grad_q_out", "grad_k_out", "cos", "sin", "grad_q", "grad_k")
    arguments_type = RopeBackwardArguments

    def __init__(self, grad_q_out: TensorAttributes, grad_k_out: TensorAttributes, cos: TensorAttributes,
                 sin: TensorAttributes, grad_q: TensorAttributes, grad_k: TensorAttributes, *,
                 max_head_dim: int | None = None) -> None:
        super().__init__(grad_q_out, grad_k_out, cos, sin, grad_q, grad_k, max_head_dim=max_head_dim)
