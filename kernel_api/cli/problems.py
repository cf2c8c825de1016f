"""Problems described by sizes and dtype names: the arguments the ``kernel-api`` commands and
the shapes files build.

Tensors are made on torch's "meta" device by default, so nothing is allocated and no GPU is
needed; pointers then count as fully aligned.
"""

from __future__ import annotations

import torch

from ..arguments import GemmArguments, SoftmaxArguments, SoftmaxBackwardArguments
from ..core.dtypes import to_dtype
from ..utils import layout_string_to_strides

DEVICE = "meta"


def _matrix(rows: int, cols: int, batch: int | None, row_major: bool, dtype: torch.dtype, device: str) -> torch.Tensor:
    shape = (rows, cols) if batch is None else (batch, rows, cols)
    stride2 = (cols, 1) if row_major else (1, rows)
    stride = stride2 if batch is None else (rows * cols,) + stride2
    return torch.empty_strided(shape, stride, dtype=dtype, device=device)


def gemm_arguments(m: int, n: int, k: int, batch: int | None = None, dtype: str = "bf16", layout: str = "ttt",
                   out_dtype: str | None = None, accumulator: str | None = None, device: str = DEVICE) -> GemmArguments:
    """GemmArguments for a problem described by sizes, dtype names and a layout string.

    Args:
        m, n, k: the problem's sizes (at least 1).
        batch: the batch count L (operands become rank 3), or None for rank-2 operands.
        dtype: the operands' type name ("bf16", "f16", "f32", "f64").
        layout: "t" (row-major) or "n" (column-major) per A, B and out, e.g. "tnt".
        out_dtype: the output's type name (default: ``dtype``).
        accumulator: the accumulator's type name (default: the arguments' own).
        device: where the tensors are made (default: "meta", nothing allocated).

    Returns:
        The arguments; ValueError names the flag of a size or type that is not valid.
    """
    for label, v in (("--m", m), ("--n", n), ("--k", k)):
        if v < 1:
            raise ValueError(f"{label} must be >= 1, got {v}")
    if batch is not None and batch < 1:
        raise ValueError(f"--batch must be >= 1, got {batch}")
    in_t = to_dtype(dtype, "--dtype").to_torch()
    out_t = to_dtype(out_dtype or dtype, "--out-dtype").to_torch()
    sa, sb, so = layout_string_to_strides(layout)
    A = _matrix(m, k, batch, sa[-1] == 1, in_t, device)
    B = _matrix(k, n, batch, sb[-1] == 1, in_t, device)
    out = _matrix(m, n, batch, so[-1] == 1, out_t, device)
    return GemmArguments(A, B, out, accumulator_type=accumulator)


def softmax_arguments(rows: int, cols: int, dtype: str = "bf16", backward: bool = False,
                      device: str = DEVICE) -> SoftmaxArguments | SoftmaxBackwardArguments:
    """Softmax arguments (forward, or backward) for ``rows`` x ``cols`` row-major tensors.

    Args:
        rows, cols: the problem's sizes (at least 1).
        dtype: the tensors' type name.
        backward: the backward pass's arguments instead of the forward's.
        device: where the tensors are made (default: "meta", nothing allocated).

    Returns:
        `SoftmaxArguments`, or `SoftmaxBackwardArguments` with ``backward``.
    """
    if rows < 1 or cols < 1:
        raise ValueError(f"--rows and --cols must be >= 1, got {rows} x {cols}")
    t = to_dtype(dtype, "--dtype").to_torch()
    make = lambda: torch.empty(rows, cols, dtype=t, device=device)  # noqa: E731
    if backward:
        return SoftmaxBackwardArguments(make(), make(), make())
    return SoftmaxArguments(make(), make())
