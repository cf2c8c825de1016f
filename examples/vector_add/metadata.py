"""What a vector add kernel accepts: `VectorAddOperandsMetadata` and `VectorAddDesign`.

Discovery compares these with what `VectorAddArguments` records: ``operand_names`` lists the
operands whose `TensorAttributes` are compared (``TensorAttributes.accepts``: dtype, stride
pattern, alignment), and ``arguments_type`` makes `KernelMetadata.supports` refuse arguments
of another operation with ``isinstance`` before any operand is looked at.
"""

from __future__ import annotations

from dataclasses import dataclass

from kernel_api import TensorAttributes
from kernel_api.metadata import OperandsMetadata

from .arguments import VectorAddArguments


class VectorAddOperandsMetadata(OperandsMetadata):
    """The attributes a kernel requires of ``x``, ``y`` and ``out``."""

    operand_names = ("x", "y", "out")
    arguments_type = VectorAddArguments

    def __init__(self, x: TensorAttributes, y: TensorAttributes, out: TensorAttributes) -> None:
        self.x, self.y, self.out = x, y, out

    def __repr__(self) -> str:
        return f"VectorAddOperandsMetadata(x={self.x}, y={self.y}, out={self.out})"


@dataclass(frozen=True)
class VectorAddDesign:
    """How an instance maps the vector onto the GPU: ``vec`` elements per thread, ``threads`` per CTA."""

    vec: int
    threads: int = 256
