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
- the build follows the problem (`choose_build`, stored with the artifact as a `WindowBuild`): on
  problems of many grids of parts and rows of many parts, a deep ring (24 KB parts, four steps) with
  each row's combination a grid after its last part, so every lag is two grids, still in the
  ring, and no output waits on its own round of steps; rows of more parts than a CTA has threads
  have their combinations ask for the partials at the top of the step (`PEEKS`);
- 16-bit outputs of rows whose maximum is below 64 in magnitude take the exponent as one FFMA
  (softmax_window.cu, FFMA_MAX_ABS: a relative error below 2^-17), the others the exact form.

Against the row-group family (`softmax_rowgroup.py`: slices staged in shared memory, a group
of CTAs meeting per wave), no group of CTAs waits in lockstep. Against the looped and
cluster-split kernels, nothing is read twice from DRAM. Measured on an H200 (the "H200 window"
and "H200 final" runs of tests/data/measured_softmax_times.json; docs/performance.md,
"Softmax"): 1.01-1.18x the fastest other kernel on the 64 MB+ long rows, 2.4-3.3 TB/s, 0.77-0.85
of torch's copy of the same bytes. A build without the exps
(WN_COPY_ONLY) is only 2-8 % faster, while the same cp.async ring copying alone moves 0.97 of
torch's copy, and a build without the row combinations gains 6-7 %: the schedule's
combinations and the waits between CTAs of one round cost the rest, not the memory pipeline.

Rows are peeled (any element alignment whose rows share one offset from a 16-byte boundary, as
the other peeled families). The workspace (`get_workspace_size`) needs no initialisation: its
slots carry a per-launch tag.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

from ....arguments import SoftmaxArguments, SoftmaxBackwardArguments
from ....core.arch import sm_count
from ....core.status import Status
from ....core.streams import stream_handle
from ....metadata import KernelMetadata, RowReductionDesignMetadata
from .. import CudaSourceProvider
from ..kernel import CudaSourceKernel
from .launch_epoch import next_epoch
from .softmax import _TYPES, JoinsSoftmaxSource, peel_status, row_length_status, row_params
from .softmax_rowgroup import long_rows_from, row_group_cost

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
#: The deep-ring build, for problems of many grids of parts (`choose_build`): parts of
#: RING2_UNROLL vectors per thread and operand (24 KB of ring a step in either direction), a ring of
#: RING2_NSLOT steps, and each row's combination a whole grid after its last statistics part. Every
#: lag is then two grids, which the ring still holds (no second read), and no output waits on work
#: of its own round of steps: with a lag of one grid, the rows that straddle two rounds make the
#: output of one CTA wait on the statistics and the combination of others in the same round.
#: Measured on an H200: 3.27 against 3.14-3.16 TB/s on f32
#: 32x1M forward, 3.10-3.12 against 2.96-2.99 on bf16 32x1M backward, 4-9 % on 16x1M and 256x256K
#: backwards and f32 forwards, 1-2 % on 16-bit 32x1M and 64x1M forwards (4 % on an H100); 16-bit
#: forwards of fewer grids of parts, bound by instruction issue, lose 5-7 % to its smaller parts.
RING2_UNROLL = {False: 6, True: 3}
RING2_NSLOT = 4
RING2_DELAY_ROUNDS = 1.0
#: Grids of parts from which `choose_build` takes the deep ring (its lag of two grids is more steps
#: without output at the start and without statistics at the end), and the least share of a grid a
#: row's parts must be (rows of fewer parts rarely straddle two rounds, so the lag of one grid costs
#: them little: 128 rows of 128K elements, 22 parts a row, run 6-7 % slower on the deep ring, 43
#: parts 4-6 % faster; 16x1M 16-bit forwards, 5.2 grids of parts, 5 % slower, 10.4 grids faster).
RING2_MIN_GRIDS = 8
RING2_MIN_ROW_GRIDS = 0.125
#: Partials per thread a combination asks for at the top of its step (WN_PEEKS) where a row has more
#: parts than a CTA threads, so each thread merges several and would wait on each in turn: 2-3 % on
#: f32 8x4M (512 and 1024 parts a row), none on 256 or fewer and 1-4 % slower on the 1M rows.
PEEKS = 1
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


@dataclass(frozen=True)
class WindowBuild:
    """What one compiled kernel of the family is: 16-byte vectors per thread and part, ring steps,
    partials per thread a combination asks for early, and the delay its launches are planned with
    (stored with the artifact, so a launch plans for the kernel it has)."""

    unroll: int
    nslot: int
    peeks: int
    delay_rounds: float


@functools.lru_cache(maxsize=1024)  # (on every run's compile key: a lookup, not two plans)
def choose_build(rows: int, cols: int, elem_bytes: int, backward: bool, grid: int,
                 threads: int = THREADS) -> WindowBuild:
    """The build for ``rows`` x ``cols`` on ``grid`` co-resident CTAs: the deep ring
    (`RING2_UNROLL`) where its plan has at least `RING2_MIN_GRIDS` grids of parts, rows of at
    least `RING2_MIN_ROW_GRIDS` of a grid, and a lag of two grids; else the default parts
    (`UNROLL`), with `PEEKS` where a row has more of them than a CTA threads."""
    deep = plan_window(rows, cols, elem_bytes, grid, RING2_UNROLL[backward] * threads, RING2_DELAY_ROUNDS)
    if (deep.parts >= RING2_MIN_GRIDS * deep.grid and deep.parts_per_row >= RING2_MIN_ROW_GRIDS * deep.grid
            and deep.lag == 2 * deep.grid):
        return WindowBuild(RING2_UNROLL[backward], RING2_NSLOT, 0, RING2_DELAY_ROUNDS)
    p = plan_window(rows, cols, elem_bytes, grid, UNROLL[backward] * threads)
    return WindowBuild(UNROLL[backward], NSLOT, PEEKS if p.parts_per_row > threads else 0, DELAY_ROUNDS)


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
    tag = "window"

    def __init__(self, metadata: KernelMetadata, params: dict) -> None:
        super().__init__(metadata, params)
        #: Threads per CTA, vectors per thread and part, ring steps, partials asked for early, the
        #: launch bounds' CTAs per SM (compile-time: part of the compile key through the name
        #: expression and the defines), the schedule's delay and slack, and a cap on the CTAs per
        #: SM (None: every co-resident one): the defaults above, settable for tuning and tests.
        #: With ``by_problem`` (the default) `choose_build` sets the part size, ring, peeks and
        #: delay per problem, and ``unroll``, ``nslot``, ``peeks`` and ``delay_rounds`` are unused.
        self.by_problem: bool = True
        self.threads: int = THREADS
        self.unroll: int = UNROLL[self.backward]
        self.nslot: int = NSLOT
        self.peeks: int = 0
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
        """Vectors per part of the attributes' build (``by_problem`` off)."""
        return self.unroll * self.threads

    @property
    def smem_bytes(self) -> int:
        """Ring bytes of the attributes' build (``by_problem`` off)."""
        return ring_bytes(self.part_vectors, self.nslot, self.backward)

    def build(self, args: Any) -> WindowBuild:
        """The kernel to compile and launch for ``args``: `choose_build`'s for the device's
        co-resident grid (``by_problem``), else the attributes'."""
        if not self.by_problem:
            return WindowBuild(self.unroll, self.nslot, self.peeks, self.delay_rounds)
        return choose_build(max(args.rows, 1), max(args.cols, 1), self.dtype.bytes, self.backward,
                            _sm_count(args.device) * self.min_blocks, self.threads)

    def _build_smem(self, build: WindowBuild) -> int:
        return ring_bytes(build.unroll * self.threads, build.nslot, self.backward)

    # ---- generation --------------------------------------------------------------------
    @classmethod
    def make_metadata(cls, params: dict) -> KernelMetadata:
        design = RowReductionDesignMetadata("window", THREADS, 16, long_rows_from(params["dtype"].bytes), None,
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
        p = plan_window(max(args.rows, 1), max(args.cols, 1), self.dtype.bytes, 1, self._least_part_vectors())
        if 2 * p.parts + MAX_GRID_STEPS >= 2**31:
            return Status.fail(f"{name}: {args.rows:,} rows of {p.parts_per_row:,} parts are {p.parts:,} parts, "
                               f"past the {(2**31 - MAX_GRID_STEPS) // 2:,} its step numbers reach")
        return peel_status(name, args, self.vec)

    # ---- compile -------------------------------------------------------------------------------
    def name_expression(self, args: Any) -> str:
        return self._name_for(self.build(args))

    def defines_for(self, args: Any) -> dict[str, int]:
        return self._defines_for(self.build(args))

    def compile_key(self, args: Any, cc: int | None) -> tuple:
        """The name expression, defines and cc, and the build's delay: `launch_plan` stores the
        whole build with the artifact, so an artifact cached for one delay is not reused for
        another. (Every run without an artifact asks for it: one `build`.)"""
        b = self.build(args)
        return (self._name_for(b), tuple(sorted(self._defines_for(b).items())), cc, b.delay_rounds)

    def _name_for(self, b: WindowBuild) -> str:
        op = "bwd" if self.backward else "fwd"
        return (f"ka_softmax::{op}_window<{_TYPES[self.dtype]}, {self.vec}, {b.unroll}, {self.threads}, "
                f"{b.nslot}, {self.prefetch}>")

    def _defines_for(self, b: WindowBuild) -> dict[str, int]:
        return {"WN_MIN_BLOCKS": int(self.min_blocks), **({"WN_PEEKS": b.peeks} if b.peeks else {}),
                **self.extra_defines}

    def launch_plan(self, args: Any, launcher: Any) -> WindowBuild:
        """Stored with the artifact: `_run` plans for the build it holds, whatever ``args`` it
        is given."""
        return self.build(args)

    # ---- launch ------------------------------------------------------------------------------
    def resident_ctas(self, launcher: Any, device: int, smem: int | None = None) -> int:
        """The co-resident CTAs of a build with ``smem`` ring bytes (default: the attributes')
        on ``device``, capped by `max_ctas_per_sm`."""
        ctas = launcher.max_coresident(device, self.threads, self.smem_bytes if smem is None else smem)
        if self.max_ctas_per_sm is not None:
            ctas = min(ctas, self.max_ctas_per_sm * _sm_count(torch.device("cuda", device)))
        if ctas < 1:
            raise RuntimeError(f"{self.metadata.kernel_name}: no CTA of {self.threads} threads fits an SM of "
                               f"device {device}")
        return ctas

    def plan(self, args: Any, grid: int, build: WindowBuild | None = None) -> WindowPlan:
        """The launch of ``build`` (default: `build(args)`) for ``args`` on ``grid`` CTAs."""
        b = self.build(args) if build is None else build
        return plan_window(max(args.rows, 1), max(args.cols, 1), self.dtype.bytes, grid, b.unroll * self.threads,
                           b.delay_rounds, self.slack_rounds, self.align)

    def _least_part_vectors(self) -> int:
        """The smallest parts any build of this instance cuts (the most parts: the workspace and
        the step-number bound hold for every build, also an artifact compiled for other args)."""
        unrolls = [self.unroll] + ([UNROLL[self.backward], RING2_UNROLL[self.backward]] if self.by_problem else [])
        return min(unrolls) * self.threads

    def get_workspace_size(self, args: Any) -> int:
        p = plan_window(max(args.rows, 1), max(args.cols, 1), self.dtype.bytes, 1, self._least_part_vectors())
        return workspace_bytes(max(args.rows, 1), p.parts)

    def launch_config(self, args: Any) -> tuple:
        b = self.build(args)
        return (self.plan(args, _sm_count(args.device) * self.min_blocks, b).grid, self.threads, self._build_smem(b))

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
        build = getattr(artifact, "extra", None)
        if not isinstance(build, WindowBuild):
            build = self.build(args)
        smem = self._build_smem(build)
        p = self.plan(args, self.resident_ctas(launcher, device, smem), build)
        params = row_params(args) + (workspace.data_ptr(), p.parts_per_row, p.lag, p.delay, next_epoch())
        launcher.launch(stream_handle(stream, device), device, p.grid, self.threads, smem, params, cooperative=True)

    # ---- ranking ---------------------------------------------------------------------------
    def estimated_cost(self, args: Any, sm_count: int) -> float:
        """`row_cost`'s units: `_COST_FACTOR` of the row-group family's cost for the same problem
        (`row_group_cost`, which keeps rows shorter than `long_rows_from` with the one-CTA and
        cluster families, but the few rows of `ranks_long_rows`), so PickAny takes this family first on every long row, but forward rows
        of fewer than `_SHORT_FORWARD_PARTS` parts, which rank after the row-group family.

        Measured on an H200 (benchmarks/softmax.py --cases long): the fastest on 22 of the 24
        long cases (1x1M, 8x1M, 32x1M, 8x4M; every dtype, both directions), 0.46-3.16 TB/s, and within 1-3 % of
        the row-group kernel on the other two (16-bit backwards of 8x1M); on LM-head rows
        (2048 rows of 65536-128256 elements) the fastest on f32 rows of 100000 and
        128256 elements and on 16-bit backwards of 128256, where the register and cluster-split
        kernels ran 15-25 % slower."""
        base = row_group_cost(args.rows, args.cols, self.dtype.bytes, self.backward, sm_count,
                              type(self).performance_hint)
        if not self.backward:
            bpr = plan_window(max(args.rows, 1), max(args.cols, 1), self.dtype.bytes, 1,
                              UNROLL[False] * THREADS).parts_per_row
            if bpr < _SHORT_FORWARD_PARTS:
                return base * _COST_FACTOR * _SHORT_FORWARD_FACTOR
        return base * _COST_FACTOR


_COST_FACTOR = 0.8
#: Forward rows of fewer parts than this (a combination every few parts) rank after the row-group
#: family: measured on an H200, 8 parts a row ran
#: 0.84 of the row-group kernel's rate at 16-bit 128256 elements and 0.93 at f32 65536; 10 and
#: more parts ran faster than it (16-bit 152064, f32 100000 and 128256).
_SHORT_FORWARD_PARTS = 9
_SHORT_FORWARD_FACTOR = 1.5

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


__all__ = ["CudaSoftmaxWindowBackward", "CudaSoftmaxWindowForward", "WindowBuild", "WindowPlan", "choose_build",
           "plan_window", "workspace_bytes"]
