"""One kernel's estimated run time on one problem: its own model where it has one, else the
generic model of its operation. PickAny ranks candidates by it, and a kernel that wraps another
(the realigned GEMM's inner kernel) prices its inner launch with it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..arguments import GemmArguments
from .gemm import gemm_cost
from .rows import fixed_row_cost, row_cost

if TYPE_CHECKING:
    from ..kernel import Kernel

def estimated_cost(kernel: Kernel, args: Any, sm_count: int) -> float:
    """The kernel's own estimate (`Kernel.estimated_cost`) or else the generic model's; for a
    row-wise problem plus the design's fixed time (`fixed_row_cost`), which decides the
    problems too small to fill the GPU."""
    own = kernel.estimated_cost(args, sm_count)
    if isinstance(args, GemmArguments):
        return gemm_cost(kernel, args, sm_count) if own is None else own
    return (row_cost(kernel, args, sm_count) if own is None else own) + fixed_row_cost(kernel, args)
