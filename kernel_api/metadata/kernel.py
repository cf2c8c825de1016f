"""`KernelMetadata`: everything that identifies a kernel instance and what it accepts."""

from __future__ import annotations

from typing import Any

from ..core.status import Reason, Status
from .epilogue import EpilogueMetadata
from .operands import OperandsMetadata


class KernelMetadata:
    """Everything that identifies a kernel instance and what it accepts.

    ``kernel_name`` encodes what distinguishes the instance; ``kernel_class`` is the
    registered `Kernel` subclass; ``operands`` an `OperandsMetadata`; ``design`` the
    kernel's knobs (e.g. `BLASDesignMetadata`); ``min_cc``/``max_cc`` the architectures it
    runs on; ``epilogue`` an `EpilogueMetadata` or None (no fused epilogue).
    ``provider`` is the name of the provider the class was registered with.
    """

    __slots__ = ("kernel_name", "kernel_class", "operands", "design", "min_cc", "max_cc", "epilogue")

    def __init__(self, kernel_name: str, kernel_class: type, operands: OperandsMetadata, design: Any = None,
                 min_cc: int = 0, max_cc: int | None = None, epilogue: EpilogueMetadata | None = None) -> None:
        if not isinstance(kernel_name, str) or not kernel_name:
            raise TypeError("KernelMetadata.kernel_name must be a non-empty string")
        if not isinstance(operands, OperandsMetadata):
            raise TypeError(f"KernelMetadata.operands must be an OperandsMetadata, got {type(operands).__name__}")
        self.kernel_name = kernel_name
        self.kernel_class = kernel_class
        self.operands = operands
        self.design = design
        self.min_cc = int(min_cc or 0)
        self.max_cc = None if max_cc is None else int(max_cc)
        self.epilogue = epilogue

    @property
    def provider(self) -> str | None:
        provider = getattr(self.kernel_class, "_kernel_api_provider", None)
        return None if provider is None else provider.name

    def supports_cc(self, cc: int | None) -> Status:
        if cc is None:
            return Status.success()
        if cc < self.min_cc or (self.max_cc is not None and cc > self.max_cc):
            # required: the (min_cc, max_cc) range the kernel runs on (max_cc None: no upper bound)
            message = (f"needs compute capability >= {self.min_cc}, target is {cc}" if cc < self.min_cc else
                       f"runs on compute capability <= {self.max_cc}, target is {cc}")
            return Status.fail(message, kind=Reason.CC, actual=cc, required=(self.min_cc, self.max_cc))
        return Status.success()

    def supports(self, args: Any, cc: int | None = None) -> Status:
        """Metadata-level check: operand types, layouts, alignment, epilogue, architecture."""
        expected = self.operands.arguments_type
        if expected is not None and not isinstance(args, expected):
            return Status.fail(f"kernel takes {expected.__name__}, got {type(args).__name__}", kind=Reason.ARGUMENTS,
                               actual=type(args), required=expected)
        status = self.operands.supports(args)
        if not status:
            return status
        epilogue_signature = getattr(args, "epilogue_signature", None)
        if epilogue_signature is not None:
            if self.epilogue is None:
                return Status.fail("epilogue requested but the kernel has no fused epilogue", kind=Reason.EPILOGUE)
            status = self.epilogue.supports(epilogue_signature)
            if not status:
                return status
        return self.supports_cc(cc)

    def __repr__(self) -> str:
        return f"KernelMetadata({self.kernel_name!r}, provider={self.provider!r}, design={self.design!r})"
