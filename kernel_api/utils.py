"""Small helpers kernels and users share: streams (from `kernel_api.core.streams`), layout strings,
launch limits."""

from __future__ import annotations

from .core.streams import stream_handle, to_cuda_stream  # noqa: F401  (public here: kernels and notebooks use them)
from .metadata import COLUMN_MAJOR, ROW_MAJOR, pad_pattern


def _layout_letter(stride: tuple[int, ...]) -> str:
    pattern = pad_pattern(tuple(stride), 3)
    if pattern == ROW_MAJOR:
        return "t"
    if pattern == COLUMN_MAJOR:
        return "n"
    raise ValueError(f"stride pattern {stride} is neither row-major (0, 0, 1) nor column-major (0, 1, 0)")


def strides_to_layout_string(stride_A: tuple[int, ...], stride_B: tuple[int, ...], stride_out: tuple[int, ...]) -> str:
    """Layout letters of A, B, out: 't' for row-major patterns, 'n' for column-major, e.g. "ttt"."""
    return _layout_letter(stride_A) + _layout_letter(stride_B) + _layout_letter(stride_out)


def layout_string_to_strides(layout: str) -> tuple[tuple[int, ...], ...]:
    """Inverse of `strides_to_layout_string`: "tnt" -> ((0,0,1), (0,1,0), (0,0,1))."""
    if len(layout) != 3 or any(c not in "tnTN" for c in layout):
        raise ValueError(f"layout {layout!r}: expected three letters of t (row-major) / n (column-major), e.g. 'tnt'")
    return tuple(ROW_MAJOR if c in "tT" else COLUMN_MAJOR for c in layout)


#: Largest grid.x a CUDA launch accepts.
MAX_GRID_X = 2**31 - 1


def next_pow2(n: int) -> int:
    """Smallest power of two >= n, for n >= 1."""
    return 1 << max(0, (n - 1).bit_length())

