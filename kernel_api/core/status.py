"""Outcome of a support check: truthy on success, carries the reason on failure."""

from __future__ import annotations

import enum
from typing import Any


class Reason(enum.Enum):
    """What kind of requirement a failed `Status` reports; `kernel_api.explain` groups and ranks
    rejections by it (and by the structured values the status carries), never by message text."""

    DTYPE = "dtype"              #: an operand's element type
    LAYOUT = "layout"            #: an operand's stride pattern (row- or column-major)
    ALIGNMENT = "alignment"      #: an operand's pointer, leading dimension or extent alignment
    SHAPE = "shape"              #: a size or limit: M, N, K, batch, grid, index width
    ACCUMULATOR = "accumulator"  #: the accumulator (math) type
    EPILOGUE = "epilogue"        #: a fused-epilogue feature
    CC = "cc"                    #: the target architecture
    ARGUMENTS = "arguments"      #: the arguments type (another operation)
    OTHER = "other"              #: anything else


class Status:
    """Result of `Kernel.supports` and friends.

    ``Status.success()`` is truthy; ``Status.fail(message)`` is falsy and keeps the
    message in ``.error`` so callers can say *why* a kernel does not fit. A failure also
    carries ``kind`` (a `Reason`, `Reason.OTHER` unless given) and, where the check knows
    them, the ``operand`` it concerns, the ``actual`` value the arguments have and the value
    the kernel ``required``: a `DataType` for `Reason.DTYPE`, a stride pattern such as
    ``(0, 0, 1)`` for `Reason.LAYOUT`, a number of elements for `Reason.ALIGNMENT`.
    On success all four are None.
    """

    __slots__ = ("error", "kind", "operand", "actual", "required")

    def __init__(self, error: str | None = None, kind: Reason | None = None, operand: str | None = None,
                 actual: Any = None, required: Any = None) -> None:
        self.error = error
        self.kind = Reason.OTHER if kind is None and error is not None else kind
        self.operand = operand
        self.actual = actual
        self.required = required

    @classmethod
    def success(cls) -> "Status":
        return _SUCCESS

    @classmethod
    def fail(cls, message: str, *, kind: Reason = Reason.OTHER, operand: str | None = None, actual: Any = None,
             required: Any = None) -> "Status":
        """A failure saying ``message``; ``kind`` and the structured values are optional.

        Args:
            message: what is unsupported, naming the operand (shown to users as is).
            kind: the kind of requirement that is not met (a `Reason`).
            operand: the operand it concerns, e.g. "A".
            actual: the value the arguments have (e.g. ``DataType.f16``).
            required: the value the kernel needs (e.g. ``DataType.bf16``).
        """
        if not message:
            raise ValueError("Status.fail needs a message saying what is unsupported")
        if not isinstance(kind, Reason):
            raise TypeError(f"Status.fail: kind must be a kernel_api.status.Reason, got {kind!r}")
        return cls(str(message), kind, operand, actual, required)

    @property
    def ok(self) -> bool:
        return self.error is None

    def __bool__(self) -> bool:
        return self.error is None

    def __repr__(self) -> str:
        if self.error is None:
            return "Status.success()"
        extra = "" if self.kind is Reason.OTHER else f", kind={self.kind}"
        extra += "".join(f", {name}={getattr(self, name)!r}" for name in ("operand", "actual", "required")
                         if getattr(self, name) is not None)
        return f"Status.fail({self.error!r}{extra})"


_SUCCESS = Status()
