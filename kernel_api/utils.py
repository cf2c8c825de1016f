"""Small helpers kernels and users share: streams, layout strings, problem sizes."""

from __future__ import annotations

from typing import Any

import torch

from .metadata import COLUMN_MAJOR, ROW_MAJOR, pad_pattern


_cu_streams: dict[int, Any] = {}  # raw handle -> CUstream (a value wrapper; cached to save its construction)
_current_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
_current_device = getattr(torch._C, "_cuda_getDevice", None)


# The stream object last converted and its CUstream, as one tuple so threads read a
# consistent pair: a launch loop passes the same stream object every time.
_last_stream: tuple[Any, Any] = (object(), None)


def to_cuda_stream(stream: Any = None) -> Any:
    """Return a ``cuda.bindings.driver.CUstream`` for a torch stream, a raw handle, an object
    with ``__cuda_stream__``, a CUstream, or None (the current torch stream)."""
    global _last_stream
    last = _last_stream
    if stream is last[0]:
        return last[1]
    if stream is None:
        if _current_raw_stream is not None:
            handle = _current_raw_stream(_current_device())  # torch.cuda.current_stream() costs microseconds
        else:
            handle = torch.cuda.current_stream().cuda_stream
    elif type(stream) is torch.cuda.Stream:
        handle = stream.cuda_stream
    else:
        from cuda.bindings import driver

        if isinstance(stream, driver.CUstream):
            _last_stream = (stream, stream)
            return stream
        handle = stream_handle(stream)
    found = _cu_streams.get(handle)
    if found is None:
        from cuda.bindings import driver

        if len(_cu_streams) > 4096:
            _cu_streams.clear()
        found = _cu_streams[handle] = driver.CUstream(handle)
    if stream is not None and type(stream) is not int:
        _last_stream = (stream, found)  # not None (the current stream changes), not ints (ids are reused)
    return found


def stream_handle(stream: Any = None) -> int:
    """The raw ``cudaStream_t`` value (an int) of any accepted stream spelling."""
    if stream is None:
        return torch.cuda.current_stream().cuda_stream
    if isinstance(stream, torch.cuda.Stream):
        return stream.cuda_stream
    if isinstance(stream, int) and not isinstance(stream, bool):
        return stream
    protocol = getattr(stream, "__cuda_stream__", None)
    if protocol is not None:
        return int(protocol()[1])
    if type(stream).__name__ == "CUstream":
        return int(stream)
    raise TypeError(f"stream: expected a torch.cuda.Stream, CUstream, int handle or None, got {type(stream).__name__}")


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


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def gemm_flops(M: int, N: int, K: int, L: int = 1) -> int:
    return 2 * M * N * K * L
