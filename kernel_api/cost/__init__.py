"""Analytic run-time estimates: what `PickAny` ranks candidates by, and what kernel families
build their own estimates from (`Kernel.estimated_cost`).

A layer below the providers and above the kernel contract, so a provider prices its kernels
without reaching up into `kernel_api.tuning`. One idea per module:

- `units`: the estimates' units (`GEMM_COST_UNITS_PER_SECOND`);
- `gemm`: the GEMM tile model (`gemm_cost`) and its terms;
- `rows`: the row-wise (softmax) model (`row_cost`, `fixed_row_cost`);
- `estimate`: one kernel's estimate, its own or its operation's model (`estimated_cost`);
- `floor`: a lower bound of a run's GPU time (`gpu_floor_ms`), for timing.

It imports only the arguments (and the kernel contract, for type hints) and runs nothing.
"""

from .estimate import estimated_cost
from .floor import gpu_floor_ms
from .gemm import SKINNY_GEMM, TILE_STREAM_BYTES_PER_SECOND, gemm_bytes, gemm_cost, streaming_floor, tile_work_cost
from .rows import fixed_row_cost, row_cost, row_problem_bytes, single_trip
from .units import GEMM_COST_UNITS_PER_SECOND

__all__ = ["GEMM_COST_UNITS_PER_SECOND", "SKINNY_GEMM", "TILE_STREAM_BYTES_PER_SECOND", "estimated_cost",
           "fixed_row_cost", "gemm_bytes", "gemm_cost", "gpu_floor_ms", "row_cost", "row_problem_bytes",
           "single_trip", "streaming_floor", "tile_work_cost"]
