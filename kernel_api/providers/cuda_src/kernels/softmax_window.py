"""Interface of the window softmax (implementation: softmax_window.cu, compiled after softmax.cu,
whose helpers it uses).

Two registered families, `CudaSoftmaxWindowForward` (`SoftmaxArguments`) and
`CudaSoftmaxWindowBackward` (`SoftmaxBackwardArguments`), one instance per dtype
(``..._window_peel<vec>``), for rows too long for one CTA; PickAny's choice on every long row
(`estimated_cost`). One persistent, cooperative launch:

- every row is cut into parts of ``unroll`` x `THREADS` 16-byte vectors per input; step j of the
  launch takes the statistics of part j (its partial into the part's workspace slot behind a
  tag), the combination of the row whose last part was ``delay`` steps earlier (its partials in
  part order, deterministic, into the row's slot behind a tag), and the output of part j - ``lag``
  (wait for its row's tag, write the output);
- ``lag`` (`plan_window`) is a row's parts plus the delay plus a slack, so every wait is for an
  earlier step (no deadlock in a co-resident grid), rounded up to whole grids (`ALIGN`): part w's
  output runs on the CTA that read it. With a lag of one grid (rows of up to 0.6 grids of parts:
  the 1M-element rows, but the f32 backward's) the part is still in that CTA's shared-memory ring;
  with longer rows the output re-reads it from L2, ``lag`` parts after the first read
  (`WindowPlan.window_bytes`). DRAM moves each input once;
- each thread copies its own vectors of a step's statistics part into the ring with cp.async,
  `PREFETCH` steps ahead, so the loads stay in flight across the step's reductions and waits;
- 16-bit outputs of rows whose maximum is below 64 in magnitude take the exponent as one FFMA
  (softmax_window.cu, FFMA_MAX_ABS: a relative error below 2^-17), the others the exact form.

Against the row-group family (`softmax_rowgroup.py`: slices staged in shared memory, a group
of CTAs meeting per wave), no group of CTAs waits in lockstep. Against the stream family
(`softmax_stream.py`: two launches), nothing is read twice from DRAM. Measured on an H200
(benchmarks/NOTES-softmax-long.md, session 35): 1.02-1.18x the faster of the two on the 64 MB+
long rows, 2.4-3.2 TB/s; a build without the exps (WN_COPY_ONLY,
benchmarks/softmax_window_copyonly.py) is only 2-8 % faster, so its memory pipeline, not its
math, is what keeps it at 77-80 % of torch's copy of the same bytes (that build: 80-84 %).

Rows are peeled (any element alignment whose rows share one offset from a 16-byte boundary, as
the other peeled families). The workspace (`get_workspace_size`) needs no initialisation: its
slots carry a per-launch tag.
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
from ... import softmax_config
from .. import CudaSourceProvider
from ..kernel import CudaSourceKernel
from .launch_epoch import next_epoch
from .softmax import _TYPES, JoinsSoftmaxSource, peel_status, row_length_status, row_params
from .softmax_rowgroup import row_group_cost

MIN_CC = 80  # (cp.async, relaxed 64-bit accesses, a cooperative launch: nothing past sm_80)
THREADS = 256
#: 16-byte vectors per thread and operand in a part (a part is unroll x THREADS vectors), by
#: direction: the backward's ring holds two operands a step (dy, y), so its parts are half the
#: size to keep two CTAs per SM.
UNROLL = {False: 8, True: 4}
#: Steps in each CTA's shared-memory ring, and how many steps ahead the copies run: a ring of
#: PREFETCH + 2 steps also keeps the previous step's part for the output (a lag of one grid).
NSLOT = 3
PREFETCH = 1
#: CTAs per SM the launch bounds ask registers for (the grid is every co-resident CTA).
MIN_BLOCKS = 2
#: Grids of steps between a row's last statistics part and its combination (so its partials
#: are published by then), and again between the combination and the row's first output part.
DELAY_ROUNDS = 0.3
SLACK_ROUNDS = 0.1
#: Whether the lag is a whole number of grids (`plan_window`'s ``align``): each part's output then
#: runs on the CTA that took its statistics, and with a lag of one grid it reads the part from its
#: ring, not from L2.
ALIGN = True
#: A bound on the grid's share of the lag (delay, slack and the rounding up: a few grids of at most
#: 16 CTAs per SM on a few hundred SMs), for the 32-bit step numbers' check (`_supports`).
MAX_GRID_STEPS = 2**20
#: Rows from this length are what the family is built for, as the row-group family's.
MIN_COLS = 2**17
#: Workspace bytes per part and per row: a 16-byte slot each.
SLOT_BYTES = 16


@dataclass(frozen=True)
class WindowPlan:
    """One launch: parts per row, 16-byte vectors per part, all parts, the grid, the delay (in
    steps) from a row's last statistics part to its combination, and the lag (in parts)
    between a part's statistics and its output."""

    parts_per_row: int
    part_vectors: int
    parts: int
    grid: int
    delay: int
    lag: int

    def window_bytes(self, backward: bool) -> int:
        """Bytes read between a part's statistics and its output: what L2 must keep where the
        output re-reads its part (a lag past one grid)."""
        return self.lag * self.part_vectors * 16 * (2 if backward else 1)


def workspace_bytes(rows: int, parts: int) -> int:
    """A `SLOT_BYTES` slot per part, then one per row."""
    return (parts + rows) * SLOT_BYTES


def ring_bytes(part_vectors: int, nslot: int, backward: bool) -> int:
    """Dynamic shared memory of a CTA: ``nslot`` steps of a statistics part of each input (the
    output reads the previous step's slot, or with a longer lag registers loaded from L2)."""
    return nslot * (2 if backward else 1) * part_vectors * 16


def plan_window(rows: int, cols: int, elem_bytes: int, grid: int, part_vectors: int = UNROLL[False] * THREADS,
                delay_rounds: float = DELAY_ROUNDS, slack_rounds: float = SLACK_ROUNDS,
                align: bool = ALIGN) -> WindowPlan:
    """The parts of ``rows`` x ``cols`` at ``part_vectors`` 16-byte vectors per input, on at most
    ``grid`` co-resident CTAs; a row's combination ``delay_rounds`` grids after its last
    statistics part, its first output ``slack_rounds`` grids after that (the lag: a row's parts
    plus both, so every wait is for an earlier step); with ``align``, the lag rounded up to a
    whole number of grids, so that the CTA that reads a part for its statistics reads it again."""
    vec = 16 // elem_bytes
    nvec = -(-max(cols, 1) // vec)  # (a bound: a peeled row has at most this many vectors)
    bpr = max(1, -(-nvec // part_vectors))
    parts = max(rows, 1) * bpr
    grid = max(1, min(grid, parts))
    delay = int(delay_rounds * grid + 0.5)
    lag = bpr + delay + int(slack_rounds * grid + 0.5)
    if align:  # (a whole number of grids: part w's output runs on the CTA that read it for the statistics)
        lag = -(-lag // grid) * grid
    return WindowPlan(bpr, part_vectors, parts, grid, delay, lag)


class _WindowBase(JoinsSoftmaxSource, CudaSourceKernel):
    source_file = "softmax_window.cu"

    def __init__(self, metadata: KernelMetadata, params: dict) -> None:
        super().__init__(metadata, params)
        #: Threads per CTA, vectors per thread and part, ring steps, the launch bounds' CTAs per
        #: SM (compile-time: part of the compile key through the name expression and the
        #: defines), the schedule's delay and slack, and a cap on the CTAs per SM (None: every
        #: co-resident one): the defaults above, settable for tuning and tests.
        self.threads: int = THREADS
        self.unroll: int = UNROLL[self.backward]
        self.nslot: int = NSLOT
        self.prefetch: int = PREFETCH
        self.min_blocks: int = MIN_BLOCKS
        self.delay_rounds: float = DELAY_ROUNDS
        self.slack_rounds: float = SLACK_ROUNDS
        self.align: bool = ALIGN
        self.max_ctas_per_sm: int | None = None
        #: Extra compile-time defines (experiments: e.g. softmax.cu's KA_ST16, the stores' cache hint).
        self.extra_defines: dict[str, Any] = {}

    @property
    def part_vectors(self) -> int:
        return self.unroll * self.threads

    @property
    def smem_bytes(self) -> int:
        return ring_bytes(self.part_vectors, self.nslot, self.backward)

    # ---- generation --------------------------------------------------------------------
    @classmethod
    def variant_params(cls) -> list[dict]:
        return [dict(dtype=dt) for dt in softmax_config.DTYPES]

    @classmethod
    def instance_name(cls, params: dict) -> str:
        return f"{cls.__name__}_{params['dtype']}_window_peel{16 // params['dtype'].bytes}"

    @classmethod
    def make_metadata(cls, params: dict) -> KernelMetadata:
        design = RowReductionDesignMetadata("window", THREADS, 16, MIN_COLS, None,
                                            extra=(("peel", True), ("cooperative", True), ("passes", 2),
                                                   ("part_bytes", UNROLL[cls.backward] * THREADS * 16),
                                                   ("ring_steps", NSLOT)))
        return cls.family_metadata(params, design, MIN_CC)

    # ---- support --------------------------------------------------------------------------
    def _supports(self, args: Any) -> Status:
        name = self.metadata.kernel_name
        too_long = row_length_status(name, args.cols)
        if too_long is not None:
            return too_long
        # The kernel numbers steps (parts + lag, the lag at most the parts plus a few grids) with
        # 32-bit ints.
        p = plan_window(max(args.rows, 1), max(args.cols, 1), self.dtype.bytes, 1, self.part_vectors)
        if 2 * p.parts + MAX_GRID_STEPS >= 2**31:
            return Status.fail(f"{name}: {args.rows:,} rows of {p.parts_per_row:,} parts are {p.parts:,} parts, "
                               f"past the {(2**31 - MAX_GRID_STEPS) // 2:,} its step numbers reach")
        return peel_status(name, args, self.vec)

    # ---- compile -------------------------------------------------------------------------------
    def name_expression(self, args: Any) -> str:
        op = "bwd" if self.backward else "fwd"
        return (f"ka_softmax::{op}_window<{_TYPES[self.dtype]}, {self.vec}, {self.unroll}, {self.threads}, "
                f"{self.nslot}, {self.prefetch}>")

    def defines_for(self, args: Any) -> dict[str, int]:
        return {"WN_MIN_BLOCKS": int(self.min_blocks), **self.extra_defines}

    # ---- launch ------------------------------------------------------------------------------
    def resident_ctas(self, launcher: Any, device: int) -> int:
        """The co-resident CTAs of this build on ``device``, capped by `max_ctas_per_sm`."""
        ctas = launcher.max_coresident(device, self.threads, self.smem_bytes)
        if self.max_ctas_per_sm is not None:
            ctas = min(ctas, self.max_ctas_per_sm * _sm_count(torch.device("cuda", device)))
        if ctas < 1:
            raise RuntimeError(f"{self.metadata.kernel_name}: no CTA of {self.threads} threads fits an SM of "
                               f"device {device}")
        return ctas

    def plan(self, args: Any, grid: int) -> WindowPlan:
        return plan_window(max(args.rows, 1), max(args.cols, 1), self.dtype.bytes, grid, self.part_vectors,
                           self.delay_rounds, self.slack_rounds, self.align)

    def get_workspace_size(self, args: Any) -> int:
        p = plan_window(max(args.rows, 1), max(args.cols, 1), self.dtype.bytes, 1, self.part_vectors)
        return workspace_bytes(max(args.rows, 1), p.parts)

    def launch_config(self, args: Any) -> tuple:
        return (self.plan(args, _sm_count(args.device) * self.min_blocks).grid, self.threads, self.smem_bytes)

    def _run(self, args: Any, artifact: Any, stream: Any, workspace: Any = None) -> None:
        if args.rows == 0 or args.cols == 0:
            return
        need = self.get_workspace_size(args)
        if workspace is None or workspace.numel() * workspace.element_size() < need or workspace.data_ptr() % 16:
            got = "none" if workspace is None else (f"{workspace.numel() * workspace.element_size()} bytes at "
                                                    f"{workspace.data_ptr():#x}")
            raise ValueError(f"{self.metadata.kernel_name}: needs a 16-byte aligned workspace of {need} bytes "
                             f"(get_workspace_size), got {got}")
        device = args.device.index
        if device is None:
            device = torch.cuda.current_device()
        launcher = artifact.compiled_obj
        p = self.plan(args, self.resident_ctas(launcher, device))
        params = row_params(args) + (workspace.data_ptr(), p.parts_per_row, p.lag, p.delay, next_epoch())
        launcher.launch(stream_handle(stream, device), device, p.grid, self.threads, self.smem_bytes, params,
                        cooperative=True)

    # ---- ranking ---------------------------------------------------------------------------
    def estimated_cost(self, args: Any, sm_count: int) -> float:
        """`row_cost`'s units: `_COST_FACTOR` of the row-group family's cost for the same problem
        (`row_group_cost`, which also keeps rows under `MIN_COLS` with the one-CTA and cluster
        families), so PickAny takes this family first on every long row.

        Measured on an H200 (benchmarks/softmax.py --cases long, session 35,
        results/softmax-NVIDIA_H200-s35-window.*): the fastest on 22 of the 24 long cases (1x1M,
        8x1M, 32x1M, 8x4M; every dtype, both directions), 0.46-3.16 TB/s, and within 1-3 % of
        the row-group kernel on the other two (16-bit backwards of 8x1M)."""
        base = row_group_cost(args.rows, args.cols, self.dtype.bytes, self.backward, sm_count,
                              type(self).performance_hint)
        return base * _COST_FACTOR


_COST_FACTOR = 0.8

_sm_count = sm_count  # (a module name the tests patch)


@CudaSourceProvider.register
class CudaSoftmaxWindowForward(_WindowBase):
    """``out = softmax(x, dim=-1)`` for long rows in one launch that reads x from DRAM once (f32
    math)."""

    supported_args_type = SoftmaxArguments
    backward = False


@CudaSourceProvider.register
class CudaSoftmaxWindowBackward(_WindowBase):
    """``grad_in = out * (grad_out - sum(grad_out * out))`` for long rows in one launch that
    reads dy and y from DRAM once."""

    supported_args_type = SoftmaxBackwardArguments
    backward = True


__all__ = ["CudaSoftmaxWindowBackward", "CudaSoftmaxWindowForward", "WindowPlan", "plan_window", "workspace_bytes"]
