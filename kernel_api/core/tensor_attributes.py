"""An operand's element type, stride pattern and alignment (`TensorAttributes`), and the
stride patterns kernels and arguments describe layouts with.

Both sides of discovery use it: arguments record the attributes their tensors have, kernel
metadata the attributes a kernel requires, and `TensorAttributes.accepts` compares the two.
"""

from __future__ import annotations

from typing import Any

from .dtypes import DataType, to_dtype
from .status import Reason, Status

ROW_MAJOR = (0, 0, 1)
COLUMN_MAJOR = (0, 1, 0)


def _normalize_stride_pattern(stride: Any) -> tuple[int, ...]:
    if not isinstance(stride, (tuple, list)) or not stride:
        raise TypeError(f"stride pattern must be a non-empty tuple such as (0, 0, 1), got {stride!r}")
    pattern = tuple(int(s) for s in stride)
    if any(s not in (0, 1) for s in pattern) or sum(pattern) != 1:
        raise ValueError(
            f"stride pattern {stride!r} must mark exactly one contiguous mode with 1 and the rest "
            f"with 0, e.g. (0, 0, 1) for row-major or (0, 1, 0) for column-major")
    return pattern


def pad_pattern(pattern: tuple[int, ...], rank: int) -> tuple[int, ...]:
    """Left-pad a stride pattern with batch modes, so (0, 1) compares equal to (0, 0, 1)."""
    if len(pattern) >= rank:
        return pattern
    return (0,) * (rank - len(pattern)) + pattern


class TensorAttributes:
    """An operand's element type, stride pattern and alignment.

    ``dtype``: a `DataType`, torch dtype, CuTe DSL type (``cutlass.Float64``) or name.
    ``stride``: which mode is contiguous, e.g. ``(0, 0, 1)`` (row-major) or ``(0, 1, 0)``
    (column-major); a rank-2 pattern is compared as if a batch mode were prepended.
    ``divisibility``: in kernel metadata, the element alignment the kernel requires of the
    base pointer, the leading dimensions and the contiguous extent; in arguments, the
    alignment those actually have (a power of two).
    """

    __slots__ = ("dtype", "stride", "divisibility", "_key")

    def __init__(self, dtype: Any, stride: Any, divisibility: int = 1) -> None:
        self.dtype = to_dtype(dtype, "TensorAttributes.dtype")
        self.stride = _normalize_stride_pattern(stride)
        if not isinstance(divisibility, int) or divisibility < 1:
            raise ValueError(f"TensorAttributes.divisibility must be a positive int, got {divisibility!r}")
        self.divisibility = divisibility
        self._key = (self.dtype, self.stride, divisibility)

    @classmethod
    def _trusted(cls, dtype: DataType, stride: tuple[int, ...], divisibility: int) -> "TensorAttributes":
        # Hot path for arguments: the values were computed by us, skip validation.
        obj = object.__new__(cls)
        obj.dtype = dtype
        obj.stride = stride
        obj.divisibility = divisibility
        obj._key = (dtype, stride, divisibility)
        return obj

    @property
    def layout(self) -> str:
        """'t' when the last mode is contiguous (row-major), 'n' otherwise."""
        return "t" if self.stride[-1] == 1 else "n"

    def key(self) -> tuple:
        return self._key

    def accepts(self, actual: "TensorAttributes", operand: str) -> Status:
        """Does a tensor with ``actual`` attributes fit a kernel requiring ``self``?"""
        if actual.dtype is not self.dtype:
            return Status.fail(f"operand {operand}: dtype {actual.dtype} but the kernel takes {self.dtype}",
                               kind=Reason.DTYPE, operand=operand, actual=actual.dtype, required=self.dtype)
        rank = max(len(actual.stride), len(self.stride))
        if pad_pattern(actual.stride, rank) != pad_pattern(self.stride, rank):
            return Status.fail(
                f"operand {operand}: stride pattern {actual.stride} ({layout_word(actual.stride)}) but the "
                f"kernel takes {self.stride} ({layout_word(self.stride)})",
                kind=Reason.LAYOUT, operand=operand, actual=actual.stride, required=self.stride)
        if actual.divisibility % self.divisibility:
            return Status.fail(
                f"operand {operand}: aligned to {actual.divisibility} element(s) but the kernel needs "
                f"{self.divisibility} (pointer, leading dimension and contiguous extent)",
                kind=Reason.ALIGNMENT, operand=operand, actual=actual.divisibility, required=self.divisibility)
        return Status.success()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TensorAttributes) and self.key() == other.key()

    def __hash__(self) -> int:
        return hash(self.key())

    def __repr__(self) -> str:
        return f"TensorAttributes({self.dtype}, stride={self.stride}, divisibility={self.divisibility})"


def layout_word(pattern: tuple[int, ...]) -> str:
    """The words for a stride pattern: "row-major", "column-major" or "batch-contiguous"."""
    return "row-major" if pattern[-1] == 1 else "column-major" if len(pattern) > 1 and pattern[-2] == 1 else "batch-contiguous"
