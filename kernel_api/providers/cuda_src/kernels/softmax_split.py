"""Interface of the split-row softmax kernels (implementation: softmax_split.cu, compiled after
softmax.cu, whose helpers it uses).

Two registered families, `CudaSoftmaxSplitForward` (`SoftmaxArguments`) and
`CudaSoftmaxSplitBackward` (`SoftmaxBackwardArguments`), for sm_90: each row is split across
the CTAs of a thread-block cluster, which combine their partial statistics through
distributed shared memory. They serve rows longer than one CTA holds (a 1M-element row) and
few long rows, which one CTA per row would spread over few SMs. Per dtype (bf16, f16, f32)
the instances are

- ``split_ept{16,32}_c{2,4,8}``: clusters of 2, 4 or 8 CTAs, the row held in registers (one
  read, one write), 16 elements per thread in CTAs of up to 1024 threads or 32 (forward only)
  in CTAs of up to 512, so rows of up to cluster x 16K elements;
- ``split_looped_c8``: clusters of 8 CTAs over rows of any length, each CTA reading its slice
  twice (statistics, then output; the second read mostly hits L2).

PickAny (`estimated_cost`, `row_cost`'s cluster term) charges each row's cluster barrier over the
bytes each thread of the CTA moves: the register instances are measured fastest for the f32
backward of 32K-50K columns, past one CTA's registers and shared memory (H100, H200: 0.67-0.74x
the looped kernel's time), and, with rows enough to fill the SMs, slower than a CTA per row
wherever one holds the row.

Every instance peels rows (16-byte vectors after a scalar head, see softmax.py), so it takes
operands at any alignment whose rows share one offset from a 16-byte boundary. An artifact is
specialised on the threads per CTA the row length needs (``compile_key`` includes it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ....arguments import SoftmaxArguments, SoftmaxBackwardArguments
from ....core.status import Status
from ....core.streams import stream_handle
from ....cost import row_cost
from ....metadata import KernelMetadata, RowReductionDesignMetadata
from ....utils import MAX_GRID_X, next_pow2
from ... import softmax_config
from .. import CudaSourceProvider
from ..kernel import CudaSourceKernel
from .softmax import (_TYPES, JoinsSoftmaxSource, _launch_plan, peel_status, recorded_launch, row_length_status,
                      row_params)

#: Cluster sizes (portable: at most 8).
CLUSTERS = (2, 4, 8)
#: Most threads per CTA (at 1024, 64 registers per thread hold 16 elements, not 32).
MAX_THREADS = {16: 1024, 32: 512}
#: Fewest threads per CTA (at least one 16-byte vector's elements, for the peeled edges).
MIN_THREADS = 128
#: Elements per thread of the register-resident instances (the backward holds two rows).
EPT_FORWARD, EPT_BACKWARD = (16, 32), (16,)
#: Threads and elements per thread per chunk of the looped instances.
LOOPED_THREADS, LOOPED_EPT = 512, 32
MIN_CC = 90  # thread-block clusters
#: Registers per thread of the instances (`ptxas` for sm_90a, CUDA 13, by
#: ``(backward, ept or "looped", element bytes, threads per CTA)``; scripts/split_registers.py
#: prints it), for the CTAs one SM holds (`ctas_per_sm`): PickAny's wave term (`row_cost`). The
#: ept32 forward's 512-thread CTAs at 96-105 and the looped f32 forward at 113 leave one CTA per
#: SM, the looped 16-bit forward at 64 two.
REGISTERS = {
    (False, 'looped', 2, 512): 64,
    (False, 'looped', 4, 512): 113,
    (False, 16, 2, 1024): 51,
    (False, 16, 2, 128): 48,
    (False, 16, 2, 256): 48,
    (False, 16, 2, 512): 60,
    (False, 16, 4, 1024): 54,
    (False, 16, 4, 128): 48,
    (False, 16, 4, 256): 48,
    (False, 16, 4, 512): 60,
    (False, 32, 2, 128): 80,
    (False, 32, 2, 256): 80,
    (False, 32, 2, 512): 105,
    (False, 32, 4, 128): 80,
    (False, 32, 4, 256): 80,
    (False, 32, 4, 512): 96,
    (True, 'looped', 2, 512): 74,
    (True, 'looped', 4, 512): 108,
    (True, 16, 2, 1024): 60,
    (True, 16, 2, 128): 48,
    (True, 16, 2, 256): 48,
    (True, 16, 2, 512): 55,
    (True, 16, 4, 1024): 64,
    (True, 16, 4, 128): 56,
    (True, 16, 4, 256): 62,
    (True, 16, 4, 512): 62,
}
#: Registers and threads of one SM (sm_90), and the allocation's granule per thread.
SM_REGISTERS, SM_THREADS, REGISTER_GRANULE = 65536, 2048, 8


@dataclass(frozen=True)
class SplitPlan:
    """Launch state fixed at compile time: CTAs per row (the cluster), threads per CTA, and the
    longest row the artifact handles (None: any)."""

    cluster: int
    threads: int
    capacity: int | None


class _SplitBase(JoinsSoftmaxSource, CudaSourceKernel):
    source_file = "softmax_split.cu"

    def __init__(self, metadata: KernelMetadata, params: dict) -> None:
        super().__init__(metadata, params)
        self.cluster: int = params["cluster"]
        self.looped: bool = params["looped"]
        self.ept: int = params.get("ept", 0)
        self.max_cols: int | None = params["max_cols"]

    # ---- generation --------------------------------------------------------------------
    @classmethod
    def variant_params(cls) -> list[dict]:
        found = []
        for dtype in softmax_config.DTYPES:
            for ept in (EPT_BACKWARD if cls.backward else EPT_FORWARD):
                for c in CLUSTERS:
                    found.append(dict(dtype=dtype, cluster=c, ept=ept, looped=False,
                                      max_cols=c * MAX_THREADS[ept] * ept))
            found.append(dict(dtype=dtype, cluster=CLUSTERS[-1], looped=True, max_cols=None))
        return found

    @classmethod
    def instance_name(cls, params: dict) -> str:
        kind = "split_looped" if params["looped"] else f"split_ept{params['ept']}"
        return f"{cls.__name__}_{params['dtype']}_{kind}_c{params['cluster']}_peel{16 // params['dtype'].bytes}"

    @classmethod
    def make_metadata(cls, params: dict) -> KernelMetadata:
        c = params["cluster"]
        extra = (("cluster", c), ("peel", True)) + ((("passes", 2),) if params["looped"] else
                                                     (("elements_per_thread", params["ept"]),))
        threads = LOOPED_THREADS if params["looped"] else MAX_THREADS[params["ept"]]
        # Rows one CTA holds go to the block kernels unless they are few (see row_cost).
        design = RowReductionDesignMetadata("cluster", threads * c, 16, 1, params["max_cols"], extra=extra)
        return cls.family_metadata(params, design, MIN_CC)

    # ---- support --------------------------------------------------------------------------
    def _supports(self, args: Any) -> Status:
        cols, rows = args.cols, args.rows
        name = self.metadata.kernel_name
        too_long = row_length_status(name, cols)
        if too_long is not None:
            return too_long
        if self.max_cols is not None and cols > self.max_cols:
            return Status.fail(f"{name}: rows of {cols:,} elements exceed its {self.max_cols:,} "
                               f"(a larger cluster or split_looped instance takes them)")
        blocks = rows * self.cluster
        if blocks > MAX_GRID_X:
            return Status.fail(f"{name}: rows={rows:,} need {blocks:,} CTAs, past the grid's x limit of "
                               f"2^31-1 = {MAX_GRID_X:,}")
        return peel_status(name, args, self.vec)

    # ---- compile: the template instance for this row length ------------------------------
    def plan(self, cols: int) -> tuple[str, SplitPlan]:
        """The template instance and launch plan for rows of ``cols`` elements."""
        t, vec, c = _TYPES[self.dtype], self.vec, self.cluster
        op = "bwd" if self.backward else "fwd"
        if self.looped:
            nv = max(1, LOOPED_EPT // vec)
            return (f"ka_softmax::{op}_split<{t}, {vec}, {nv}, {LOOPED_THREADS}, {c}, false>",
                    SplitPlan(c, LOOPED_THREADS, None))
        nv = self.ept // vec
        per_cta = -(-max(cols, 1) // (vec * c))  # vectors per CTA (a bound: the peeled edges are scalars)
        threads = min(MAX_THREADS[self.ept], max(MIN_THREADS, next_pow2(-(-per_cta // nv))))
        return (f"ka_softmax::{op}_split<{t}, {vec}, {nv}, {threads}, {c}, true>",
                SplitPlan(c, threads, threads * nv * vec * c))

    def name_expression(self, args: Any) -> str:
        return self.plan(args.cols)[0]

    def ctas_per_sm(self, cols: int, threads: int | None = None) -> int:
        """The CTAs of this instance one SM holds for rows of ``cols`` elements (CTAs of
        ``threads``, when the caller has the plan): by threads and by registers (`REGISTERS`)."""
        threads = threads or self.plan(max(cols, 1))[1].threads
        regs = REGISTERS[(self.backward, "looped" if self.looped else self.ept, self.dtype.bytes, threads)]
        regs = -(-regs // REGISTER_GRANULE) * REGISTER_GRANULE
        return max(1, min(SM_THREADS // threads, SM_REGISTERS // (threads * regs)))

    def launch_plan(self, args: Any, launcher: Any) -> SplitPlan:
        return self.plan(args.cols)[1]

    def launch_config(self, args: Any) -> tuple:
        p = self.plan(args.cols)[1]
        return (args.rows * p.cluster, p.threads)

    def _run(self, args: Any, artifact: Any, stream: Any, workspace: Any = None) -> None:
        p = _launch_plan(self, args, artifact)
        if p is None:
            return
        device = args.device.index
        artifact.compiled_obj.launch(stream_handle(stream, device), device, args.rows * p.cluster, p.threads, 0,
                                     row_params(args))

    def _launcher(self, args: Any, artifact: Any) -> Any:
        p = _launch_plan(self, args, artifact)
        return None if p is None else recorded_launch(args, artifact, args.rows * p.cluster, p.threads)

    # ---- ranking ---------------------------------------------------------------------------
    def estimated_cost(self, args: Any, sm_count: int) -> float:
        """`row_cost` with the threads this instance's CTA has for the row (`plan`): its
        cluster term counts the bytes each thread moves per barrier; and the CTAs an SM holds
        (`ctas_per_sm`), for its waves of clusters: on few rows of 82K-128K 16-bit elements the
        8-CTA clusters of one CTA per SM step from one wave to two at 16 rows, where the
        row-group and window kernels ran 1.2-1.3x faster (H100 and H200)."""
        cols = max(args.cols, 1)
        threads = self.plan(cols)[1].threads
        return row_cost(self, args, sm_count, cta_threads=threads, ctas_per_sm=self.ctas_per_sm(cols, threads))


@CudaSourceProvider.register
class CudaSoftmaxSplitForward(_SplitBase):
    """``out = softmax(x, dim=-1)``, each row split across a thread-block cluster (f32 math)."""

    supported_args_type = SoftmaxArguments
    backward = False


@CudaSourceProvider.register
class CudaSoftmaxSplitBackward(_SplitBase):
    """``grad_in = out * (grad_out - sum(grad_out * out))``, each row split across a cluster."""

    supported_args_type = SoftmaxBackwardArguments
    backward = True
