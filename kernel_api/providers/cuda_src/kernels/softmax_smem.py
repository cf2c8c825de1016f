"""Interface of the shared-memory-row softmax kernels (implementation: softmax_smem.cu,
compiled after softmax.cu, whose helpers it uses).

Three registered families, `CudaSoftmaxSmemForward` (`SoftmaxArguments`),
`CudaSoftmaxSmemBackward` and `CudaSoftmaxSmemYBackward` (`SoftmaxBackwardArguments`), for
sm_90 and sm_100 (227 KB of shared memory per CTA): one CTA per row, the whole row (the
backward: dy's and y's rows; the y-staged backward: y's) copied once into dynamic shared
memory with cp.async, its statistics taken as the copies land, the output computed from
shared memory (the y-staged backward re-reads dy, from L2). They serve rows longer than one
CTA's registers hold and shorter than its shared memory: ``smem_peel<vec>`` /
``smemy_peel<vec>`` per dtype, rows of up to `max_cols` elements (bf16/f16: 116K forward and
y-staged backward, 58K backward; f32: half that). The looped kernels read such rows twice
from DRAM; these read them once.

Every instance peels rows (16-byte vectors after a scalar head, see softmax.py), so it takes
operands at any alignment whose rows share one offset from a 16-byte boundary. An artifact is
specialised on the threads per CTA (``compile_key`` includes it); the shared memory is sized
at launch from the row length.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ....arguments import SoftmaxArguments, SoftmaxBackwardArguments
from ....core.dtypes import DataType
from ....core.status import Status
from ....core.streams import stream_handle
from ....cost import row_cost
from ....metadata import KernelMetadata, RowReductionDesignMetadata
from ....utils import MAX_GRID_X
from ... import softmax_config
from .. import CudaSourceProvider
from ..kernel import CudaSourceKernel
from .softmax import (_TYPES, JoinsSoftmaxSource, _launch_plan, peel_status, recorded_launch, row_length_status,
                      row_params)

#: Dynamic shared memory one CTA may use on sm_90/sm_100 (227 KB opt-in, less the kernel's
#: static reduction scratch).
MAX_SMEM_BYTES = 227 * 1024 - 256
#: Shared memory of one SM (228 KB) and what the system reserves per CTA (1 KB): rows up to
#: `TWO_PER_SM_BYTES` let two CTAs share an SM, the copies of one overlapping the other's work.
SM_SMEM_BYTES, CTA_RESERVED_BYTES = 228 * 1024, 1024
TWO_PER_SM_BYTES = SM_SMEM_BYTES // 2 - CTA_RESERVED_BYTES - 256
#: Threads per CTA when two CTAs share an SM, and when one CTA has it alone.
THREADS_SHARED, THREADS_ALONE = 512, 1024
#: cp.async commit groups per row: statistics start when the first lands.
STAGES = 4
MIN_CC, MAX_CC = 90, 100
#: PickAny's cost of staging a row in shared memory, on `row_cost`'s one-read model. One
#: factor for both thread counts: the instances with an SM to themselves (1024 threads) were
#: measured at least as fast per byte as those sharing one (H200: 0.97-1.10x the copy rate at
#: f32 8192x32768 and 4096x50257, bf16 backward 8192x32768 and 4096x50257, against 1.17-1.19x
#: for the two-per-SM bf16 forward at 8192x32768 and 4096x50257), so the
#: earlier 1.25 for one CTA per SM kept the f32 forward of 8192x32768 on a register kernel
#: 1.15x slower.
STAGING_COST = 1.1
#: The y-staged backward's further factor: its second read of dy comes from L2. Measured 0.89-0.93x
#: the two-row staging's speed where both fit (H200, bf16 1024-8192 rows of 32768-50257), so it
#: takes only the rows that staging cannot.
Y_STAGING_COST = 1.1
#: The bandwidth one CTA streams alone on its SM, in shares of the GPU's over its SMs
#: (`row_cost`'s ``lone_cta_share``): with fewer rows than SMs these kernels' times stay flat
#: up to about 64 rows and each CTA streams its row at 40-50 GB/s (H100 and H200, the few-row
#: sweeps of tests/data), 1.5x a 132nd of 3.6 TB/s. So from 48-64 rows
#: of 50K-116K 16-bit elements they rank ahead of the cluster splits, as measured.
LONE_CTA_SHARE = 1.5


@dataclass(frozen=True)
class SmemPlan:
    """Launch state fixed at compile time: threads per CTA, and the longest row the artifact
    handles (it is compiled for any row up to the shared memory's limit)."""

    threads: int
    capacity: int
    rows_per_cta: int = 1


def row_smem_bytes(cols: int, dtype: DataType, staged_rows: int) -> int:
    """Dynamic shared memory for ``staged_rows`` rows of ``cols`` elements (the forward and the
    y-staged backward stage one, the backward two): their 16-byte vectors, at most
    ``cols // vec`` per row after the peeled head."""
    return (cols * dtype.bytes // 16) * 16 * staged_rows


def max_cols(dtype: DataType, staged_rows: int) -> int:
    """The longest row whose vectors fit `MAX_SMEM_BYTES` (plus a peeled head and tail)."""
    vec = 16 // dtype.bytes
    return (MAX_SMEM_BYTES // (16 * staged_rows)) * vec + vec - 1


class _SmemBase(JoinsSoftmaxSource, CudaSourceKernel):
    source_file = "softmax_smem.cu"
    #: rows each CTA stages in shared memory (the backward: dy's and y's)
    staged_rows: int = 1
    #: the template (softmax_smem.cu) and the name part of the instances
    template: str = "fwd_smem"
    tag: str = "smem"
    #: commit groups per row (`STAGES`; the y-staged backward its own)
    default_stages: int = STAGES
    #: PickAny's factor on `STAGING_COST` (the y-staged backward's second read of dy)
    staging_cost_factor: float = 1.0

    def __init__(self, metadata: KernelMetadata, params: dict) -> None:
        super().__init__(metadata, params)
        self.max_cols: int = params["max_cols"]
        #: commit groups per row, and threads per CTA (None: `threads_for`'s choice); attributes
        #: so that a sweep can vary them (the compile key follows them)
        self.stages: int = self.default_stages
        self.threads: int | None = None

    # ---- generation --------------------------------------------------------------------
    @classmethod
    def variant_params(cls) -> list[dict]:
        return [dict(dtype=dtype, max_cols=max_cols(dtype, cls.staged_rows)) for dtype in softmax_config.DTYPES]

    @classmethod
    def make_metadata(cls, params: dict) -> KernelMetadata:
        design = RowReductionDesignMetadata(cls.tag, THREADS_SHARED, 16, 1, params["max_cols"],
                                            extra=(("peel", True), ("stages", STAGES)))
        return cls.family_metadata(params, design, MIN_CC, MAX_CC)

    # ---- support --------------------------------------------------------------------------
    def _supports(self, args: Any) -> Status:
        cols, rows = args.cols, args.rows
        name = self.metadata.kernel_name
        too_long = row_length_status(name, cols)
        if too_long is not None:
            return too_long
        if cols > self.max_cols:
            return Status.fail(f"{name}: rows of {cols:,} elements need "
                               f"{row_smem_bytes(cols, self.dtype, self.staged_rows):,} bytes of shared memory, "
                               f"past its {MAX_SMEM_BYTES:,} (rows of up to {self.max_cols:,}); "
                               f"a looped or split instance takes them")
        if rows > MAX_GRID_X:
            return Status.fail(f"{name}: rows={rows:,} need {rows:,} CTAs, past the grid's x limit of "
                               f"2^31-1 = {MAX_GRID_X:,}")
        return peel_status(name, args, self.vec)

    # ---- compile: the template instance for this row length ------------------------------
    def threads_for(self, cols: int) -> int:
        """Threads per CTA: `THREADS_SHARED` while two rows' buffers fit an SM, else
        `THREADS_ALONE` (one CTA per SM issues the copies and the math alone)."""
        if self.threads is not None:
            return self.threads
        two = row_smem_bytes(cols, self.dtype, self.staged_rows) <= TWO_PER_SM_BYTES
        return THREADS_SHARED if two else THREADS_ALONE

    def plan(self, cols: int) -> tuple[str, SmemPlan]:
        """The template instance and launch plan for rows of ``cols`` elements."""
        threads = self.threads_for(cols)
        return (f"ka_softmax::{self.template}<{_TYPES[self.dtype]}, {self.vec}, {threads}, {self.stages}>",
                SmemPlan(threads, self.max_cols))

    def name_expression(self, args: Any) -> str:
        return self.plan(args.cols)[0]

    def launch_plan(self, args: Any, launcher: Any) -> SmemPlan:
        return self.plan(args.cols)[1]

    def launch_config(self, args: Any) -> tuple:
        p = self.plan(args.cols)[1]
        return (args.rows, p.threads, row_smem_bytes(args.cols, self.dtype, self.staged_rows))

    def _run(self, args: Any, artifact: Any, stream: Any, workspace: Any = None) -> None:
        p = _launch_plan(self, args, artifact)
        if p is None:
            return
        device = args.device.index
        artifact.compiled_obj.launch(stream_handle(stream, device), device, args.rows, p.threads,
                                     row_smem_bytes(args.cols, self.dtype, self.staged_rows), row_params(args))

    def _launcher(self, args: Any, artifact: Any) -> Any:
        p = _launch_plan(self, args, artifact)
        return None if p is None else recorded_launch(args, artifact, args.rows, p.threads,
                                                      row_smem_bytes(args.cols, self.dtype, self.staged_rows))

    # ---- ranking ---------------------------------------------------------------------------
    def estimated_cost(self, args: Any, sm_count: int) -> float:
        """`row_cost`'s model (one read, peeled, a CTA per row) times `STAGING_COST`, whether
        two CTAs share an SM or one has it alone. So the register kernels keep the rows they
        hold (but the forward's past 16K elements, which `row_cost` finds alone on their
        SMs), and these take the longer rows from the looped kernels (1.5: two reads)."""
        return row_cost(self, args, sm_count, lone_cta_share=LONE_CTA_SHARE) * STAGING_COST * self.staging_cost_factor


@CudaSourceProvider.register
class CudaSoftmaxSmemForward(_SmemBase):
    """``out = softmax(x, dim=-1)``, each row staged once in one CTA's shared memory (f32 math)."""

    supported_args_type = SoftmaxArguments
    backward = False


@CudaSourceProvider.register
class CudaSoftmaxSmemBackward(_SmemBase):
    """``grad_in = out * (grad_out - sum(grad_out * out))``, dy's and y's rows staged in shared memory."""

    supported_args_type = SoftmaxBackwardArguments
    backward = True
    staged_rows = 2
    template = "bwd_smem"


@CudaSourceProvider.register
class CudaSoftmaxSmemYBackward(_SmemBase):
    """``grad_in = out * (grad_out - sum(grad_out * out))``, y's row staged in shared memory and
    dy's read twice (the second time from L2): rows too long for both to be staged."""

    supported_args_type = SoftmaxBackwardArguments
    backward = True
    template = "bwd_smem_y"
    tag = "smemy"
    staging_cost_factor = Y_STAGING_COST
    #: 2 commit groups: +1 % over 4 at f32 1024 and 4096 rows of 50257 (H200), 8 no better
    default_stages = 2
