"""Interface of the two-launch streaming softmax (implementation: softmax_stream.cu, compiled
after softmax.cu, whose helpers it uses).

Two registered families, `CudaSoftmaxStreamForward` (`SoftmaxArguments`) and
`CudaSoftmaxStreamBackward` (`SoftmaxBackwardArguments`), one instance per dtype
(``..._stream_peel<vec>``), for rows too long for one CTA. Every row is cut into parts of
`PART_BYTES` per input, one CTA per part:

1. a statistics launch writes each part's partial (forward: max and sum of exp; backward:
   sum(dy * y)) into the workspace (`get_workspace_size`: 8 or 4 bytes per part);
2. an output launch, parts in reverse order, combines the row's partials (in one fixed order,
   so every part of a row agrees bit for bit), re-reads its part and writes the output.

The input is read twice, the second time partly from L2 (the parts the first launch read last
come first), but neither launch waits on another CTA: there is no cooperative launch, no
cluster and no wave of group meetings. So it beats the row-group family (`softmax_rowgroup.py`,
one read) where that family's plan gives each row the whole grid or half of it, and loses
elsewhere (H200; docs/performance.md, "Softmax"); `estimated_cost` ranks it so.
Rows are peeled (any element alignment whose rows share one offset from a 16-byte boundary, as
the other peeled families).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ....arguments import SoftmaxArguments, SoftmaxBackwardArguments
from ....core.arch import sm_count
from ....core.status import Status
from ....core.streams import stream_handle
from ....metadata import KernelMetadata, RowReductionDesignMetadata
from ....utils import MAX_GRID_X
from .. import CudaSourceProvider
from ..kernel import CudaSourceKernel
from ....nvrtc import CudaLauncher
from .softmax import _TYPES, JoinsSoftmaxSource, peel_status, row_length_status, row_params
from .softmax_rowgroup import DEFAULT_RING, long_rows_from, plan_rows, row_group_cost

MIN_CC = 80  # (plain loads and stores: nothing past sm_80)
THREADS = 512
#: 16-byte vectors per thread and array in flight per step of softmax.cu's loops
#: (`default_unroll`). Measured on an H200:
#: 512 threads x 2 within 2 % of the best of 256-1024 threads x 1-4 on the long shapes, 1024
#: threads 4-12 % slower; the 16-bit backward takes 1 (within 2 % of 4 there).
UNROLL = {False: 2, True: 2}
UNROLL_BACKWARD_16BIT = 1


def default_unroll(backward: bool, elem_bytes: int) -> int:
    """The step's vectors per thread and array for a direction and element size."""
    return UNROLL_BACKWARD_16BIT if backward and elem_bytes < 4 else UNROLL[backward]


#: Bytes of each input per part (one CTA), at most; smaller parts where the problem has
#: fewer than `MIN_PARTS_PER_SM` parts per SM at this size.
PART_BYTES = 64 * 1024
MIN_PART_BYTES = 8 * 1024
MIN_PARTS_PER_SM = 4


@dataclass(frozen=True)
class StreamPlan:
    """One launch pair: parts per row, 16-byte vectors per part, and the grid (rows x parts)."""

    parts_per_row: int
    part_vectors: int
    grid: int

    def workspace_bytes(self, backward: bool) -> int:
        return self.grid * (4 if backward else 8)


def plan_parts(rows: int, cols: int, elem_bytes: int, sm_count: int = 132,
               part_bytes: int = PART_BYTES) -> StreamPlan:
    """The parts for ``rows`` x ``cols``: ``part_bytes`` per input, halved down to
    `MIN_PART_BYTES` while the grid has fewer than `MIN_PARTS_PER_SM` parts per SM."""
    vec = 16 // elem_bytes
    nvec = -(-max(cols, 1) // vec)  # (a bound: a peeled row has at most this many vectors)
    part = max(1, part_bytes // 16)
    while part * 16 > MIN_PART_BYTES and rows * -(-nvec // part) < MIN_PARTS_PER_SM * sm_count:
        part //= 2
    bpr = -(-nvec // part)
    return StreamPlan(bpr, part, rows * bpr)


@dataclass(frozen=True)
class StreamBuild:
    """What an artifact holds besides the statistics kernel's launcher (its ``compiled_obj``):
    the output kernel's launcher and the CTA size both were compiled for."""

    output: CudaLauncher
    threads: int


class _StreamBase(JoinsSoftmaxSource, CudaSourceKernel):
    source_file = "softmax_stream.cu"
    tag = "stream"

    def __init__(self, metadata: KernelMetadata, params: dict) -> None:
        super().__init__(metadata, params)
        #: Threads per CTA, 16-byte loads in flight per thread and array, bytes of each input
        #: per part: the defaults above; settable for tuning and tests (the first two are
        #: template parameters, part of the compile key through the name expressions).
        self.threads: int = THREADS
        self.unroll: int = default_unroll(self.backward, self.dtype.bytes)
        self.part_bytes: int = PART_BYTES

    # ---- generation --------------------------------------------------------------------
    @classmethod
    def make_metadata(cls, params: dict) -> KernelMetadata:
        design = RowReductionDesignMetadata("stream", THREADS, 16, long_rows_from(params["dtype"].bytes), None,
                                            extra=(("peel", True), ("passes", 2), ("launches", 2),
                                                   ("part_bytes", PART_BYTES)))
        return cls.family_metadata(params, design, MIN_CC)

    # ---- support --------------------------------------------------------------------------
    def _supports(self, args: Any) -> Status:
        name = self.metadata.kernel_name
        too_long = row_length_status(name, args.cols)
        if too_long is not None:
            return too_long
        p = self.plan(args)
        if p.grid > MAX_GRID_X:
            return Status.fail(f"{name}: rows={args.rows:,} x {p.parts_per_row:,} parts need {p.grid:,} CTAs, past "
                               f"the grid's x limit of 2^31-1 = {MAX_GRID_X:,}")
        return peel_status(name, args, self.vec)

    # ---- compile: both launches from one module ----------------------------------------------
    def name_expressions(self) -> tuple[str, str]:
        """The statistics and the output kernels' template instances."""
        op = "bwd" if self.backward else "fwd"
        t = f"{_TYPES[self.dtype]}, {self.vec}, {self.unroll}, {self.threads}"
        return f"ka_softmax::{op}_stream_stats<{t}>", f"ka_softmax::{op}_stream_out<{t}>"

    def name_expression(self, args: Any) -> str:
        return self.name_expressions()[0]

    def companion_name_expressions(self, args: Any) -> tuple[str, ...]:
        return self.name_expressions()[1:]

    def launch_plan(self, args: Any, launcher: CudaLauncher) -> StreamBuild:
        """The artifact's ``extra``: the output kernel's launcher (compiled in the statistics
        kernel's module, `companion_name_expressions`) and the CTA size both were built for."""
        out = self.name_expressions()[1]
        return StreamBuild(CudaLauncher(launcher.compiled, out, f"{self.metadata.kernel_name} (output)",
                                        convert_args=False), self.threads)

    # ---- launch ------------------------------------------------------------------------------
    def plan(self, args: Any) -> StreamPlan:
        return plan_parts(max(args.rows, 1), max(args.cols, 1), self.dtype.bytes, _sm_count(args.device),
                          self.part_bytes)

    def get_workspace_size(self, args: Any) -> int:
        return self.plan(args).workspace_bytes(self.backward)

    def launch_config(self, args: Any) -> tuple:
        return (self.plan(args).grid, self.threads)

    def _run(self, args: Any, artifact: Any, stream: Any, workspace: Any = None) -> None:
        if args.rows == 0 or args.cols == 0:
            return
        p = self.plan(args)
        need = p.workspace_bytes(self.backward)
        if workspace is None or workspace.numel() * workspace.element_size() < need or workspace.data_ptr() % 8:
            got = "none" if workspace is None else (f"{workspace.numel() * workspace.element_size()} bytes at "
                                                    f"{workspace.data_ptr():#x}")
            raise ValueError(f"{self.metadata.kernel_name}: needs an 8-byte aligned workspace of {need} bytes "
                             f"(get_workspace_size), got {got}")
        device = args.device.index
        if device is None:
            device = torch.cuda.current_device()
        handle = stream_handle(stream, device)
        params = row_params(args) + (workspace.data_ptr(), p.parts_per_row, p.part_vectors)
        build = artifact.extra
        artifact.compiled_obj.launch(handle, device, p.grid, build.threads, 0, params)
        build.output.launch(handle, device, p.grid, build.threads, 0, params)

    # ---- ranking ---------------------------------------------------------------------------
    def estimated_cost(self, args: Any, sm_count: int) -> float:
        """`row_cost`'s units, relative to the row-group family's cost for the same problem
        (`row_group_cost`, which keeps rows shorter than `long_rows_from` with the one-CTA and
        cluster families, but the few rows of `ranks_long_rows`): `_ALONE_FACTOR` of it where the row-group plan gives each row the whole grid
        (one row group: every wave a meeting of all CTAs, which nothing overlaps), else
        `_GROUPED_FACTOR` (which plans count as alone: `_FEW_GROUPS`). Measured on an H200
        (benchmarks/softmax.py --cases long):
        with one row group this family was 0.93-1.22x the row-group kernel's speed (1x1M, 8x4M
        in f32, bf16 8x4M backward), with several 0.83-1.09x (8x1M, 32x1M, bf16 8x4M forward)."""
        plan = plan_rows(max(args.rows, 1), max(args.cols, 1), self.dtype.bytes, self.backward, max(sm_count, 1),
                         DEFAULT_RING)
        base = row_group_cost(args.rows, args.cols, self.dtype.bytes, self.backward, sm_count,
                              type(self).performance_hint)
        few = plan.groups <= _FEW_GROUPS[self.backward, self.dtype.bytes == 2]
        return base * (_ALONE_FACTOR if few else _GROUPED_FACTOR)


_ALONE_FACTOR = 0.9
_GROUPED_FACTOR = 1.1
#: The row-group plans this family beats, by (backward, 16-bit): one row group, and for the f32
#: forward two (f32 4x2M). The 16-bit forwards of two groups (8x4M, S = 64) went to this family
#: at 2.20 against 2.03 TB/s (bf16) and go to the row-group kernel since its batched passes
#: (bf16 2.44 against 2.27, f16 2.28 against 2.27; H200).
#: The f32 backward of 8x1M and 32x1M, S = 64 in two groups, stays with the row-group kernel
#: (2.53-2.65 against 2.27-2.39).
_FEW_GROUPS = {(False, False): 2, (False, True): 1, (True, False): 1, (True, True): 1}


_sm_count = sm_count  # (a module name the tests patch)


@CudaSourceProvider.register
class CudaSoftmaxStreamForward(_StreamBase):
    """``out = softmax(x, dim=-1)`` for long rows in two streaming launches: per-part
    statistics, then the output (f32 math)."""

    supported_args_type = SoftmaxArguments
    backward = False


@CudaSourceProvider.register
class CudaSoftmaxStreamBackward(_StreamBase):
    """``grad_in = out * (grad_out - sum(grad_out * out))`` for long rows in two streaming
    launches: per-part sums of dy * y, then the output."""

    supported_args_type = SoftmaxBackwardArguments
    backward = True


__all__ = ["CudaSoftmaxStreamBackward", "CudaSoftmaxStreamForward", "StreamBuild", "StreamPlan", "default_unroll",
           "plan_parts"]
