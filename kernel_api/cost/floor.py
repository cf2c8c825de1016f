"""A lower bound of one run's GPU time: `PickBest`'s timing reads it to tell when the host, not
the GPU, may set a candidate's pace (`kernel_api.tuning.timing.QueuedTiming`)."""

from __future__ import annotations

from typing import Any

from ..arguments import GemmArguments
from ..core.dtypes import DataType

#: Rates no run reaches, just above an H200's peaks: dense tensor-core FLOPs per ms by the GEMM's
#: operand dtype (f64 67, tf32 495, 16-bit 989 TFLOP/s), every other dtype at the 16-bit rate,
#: and bytes per ms of memory bandwidth (4.8 TB/s).
FLOOR_FLOPS_PER_MS = {DataType.f64: 7e10, DataType.f32: 5e11}
FLOOR_FLOPS_PER_MS_OTHER = 1e12
FLOOR_BYTES_PER_MS = 5e9


def gpu_floor_ms(args: Any) -> float:
    """A lower bound of one run's GPU time for ``args`` (ms): a GEMM's FLOPs at
    `FLOOR_FLOPS_PER_MS` for its dtype, any other problem's bytes at `FLOOR_BYTES_PER_MS`.

    Args:
        args: the problem's arguments (`GemmArguments`, or any with ``tensors()``).

    Returns:
        Milliseconds no run of ``args`` can beat.
    """
    if isinstance(args, GemmArguments):
        dtype = args.tensor_attributes["A"].dtype
        flops_per_ms = FLOOR_FLOPS_PER_MS.get(dtype, FLOOR_FLOPS_PER_MS_OTHER)
        return 2.0 * args.M * args.N * args.K * args.L / flops_per_ms
    return sum(t.numel() * t.element_size() for t in args.tensors().values()) / FLOOR_BYTES_PER_MS
