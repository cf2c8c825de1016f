"""Interface of the small-M GEMM (implementation: gemm_small_m.cu beside this file).

`CudaGemmSmallM` computes ``out = A @ B`` for M <= 128 rows (decode steps and the tails of
prefill), where the time goes to reading B (K x N) once: a split-K kernel streams B with
16-byte cp.async loads and multiplies on the tensor cores (mma.sync), and the split-K
partials are summed inside thread-block clusters through distributed shared memory, in a
fixed order (deterministic, no workspace, one launch).

Instances, per operand type (bf16, f16) and B layout (row-major ``A @ B``, or column-major
``x @ W.t()`` as nn.Linear computes it), one per padded row count MP in 8, 16, 32, 64, 128:
an instance takes the M that it pads least (MP/2 < M <= MP; M <= 8 for MP=8). A is row-major, out row-major, every operand 16-byte aligned
(base pointer, leading dimension, batch stride and contiguous extent: N and K are multiples of
8); plain epilogue only (alpha=1, beta=0). The split count is chosen per shape at launch
(`CudaGemmSmallM.split_for`); set ``kernel.split_k`` to force one (1, 2, 4 or 8). What it
reaches and why it stops there (reading B at DRAM bandwidth): docs/performance.md, "Small-M GEMM".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from ....arguments import GemmArguments
from ....core.artifact import CompiledArtifact
from ....core.dtypes import DataType
from ....core.arch import planning_sm_count
from ....core.status import Status
from ....cost import GEMM_COST_UNITS_PER_SECOND
from ....launcher import Launcher, raw_stream
from ....metadata import BLASDesignMetadata, GemmOperandsMetadata, KernelMetadata, TensorAttributes
from .. import CudaSourceProvider
from ..kernel import CudaSourceKernel
from ....nvrtc import CudaLauncher
from ....core.streams import stream_handle

ROW = (0, 0, 1)
COL = (0, 1, 0)
#: CTAs per thread-block cluster (the kernel's CLUSTER template parameter): the largest split-K.
CLUSTER = 8
SPLITS = (1, 2, 4, 8)
#: At split 2 every instance launches clusters of this many CTAs instead of `CLUSTER` (a
#: second kernel compiled into the same module). Measured with the shuffled house timing, B
#: column-major, at N = 8192 (docs/performance.md, "Small-M GEMM"), clusters
#: of 2 against 8 at split 2: H200 M = 1: 36.1 against 39.8 us at 8192^2 (cuBLAS 36.6), 58.3
#: against 64.3 at K = 14336, 20.8 against 22.8 at K = 4096; M = 16 2-5 % faster; M = 32 16-19 %
#: (41.0 against 48.6 at 8192^2); H100 2-8 % (M = 1 8192^2: 49.7 against 53.3, cuBLAS 50.4).
#: At split 1 and 4 clusters of 8 were as fast or faster than clusters of 1, 2 or 4.
SPLIT2_CLUSTER = 2
#: Clusters of CLUSTER CTAs that can reside at once, as a share of (SMs x CTAs per SM) / CLUSTER:
#: a cluster must fit inside one GPC, so the slots left over in each GPC are lost. Measured on an
#: H200 (132 SMs; ncu's "Max Active Clusters"): 45 clusters at
#: 3 CTAs per SM (49.5 without the loss) and 30 at 2 (33).
CLUSTER_PACKING = 0.9
#: Shared memory of one Hopper SM, and what the system reserves per CTA.
SM_SMEM_BYTES = 233472
CTA_RESERVED_SMEM = 1024
_DT_TAG = {DataType.bf16: 0, DataType.f16: 1}
_INDEX_LIMIT = 2**31 - 1024  # N and K are 32-bit inside the kernel (with room for n0 + BN)
_MAX_BATCH = 65535  # batches run on gridDim.y


@dataclass(frozen=True)
class SmallMConfig:
    """One design point: padded rows MP, CTA tile BN x BK, pipeline stages, warps (WN x WM)."""

    mp: int
    bn: int
    bk: int
    stages: int
    wn: int
    wm: int
    min_ctas: int  # __launch_bounds__ occupancy target (caps registers)

    @property
    def threads(self) -> int:
        return 32 * self.wn * self.wm

    @property
    def smem_bytes(self) -> int:
        pipeline = self.stages * (self.bn + self.mp) * self.bk * 2
        partial = self.mp * (self.bn + 4) * 4
        return max(pipeline, partial)

    @property
    def ctas_per_sm(self) -> int:
        by_smem = SM_SMEM_BYTES // (self.smem_bytes + CTA_RESERVED_SMEM)
        return max(1, min(by_smem, 2048 // self.threads, 32))


#: Per padded M: the tile and pipeline.
#: MP <= 16: 64 columns x 128 k per stage (256-byte row pieces of a K-major B), 3 CTAs per SM.
#: MP >= 32: 128 columns so that A, re-read from L2 once per column tile, costs at most a
#: quarter (MP=32) to the same (MP=128) of B's bytes; warps split 2 x 2 for MP >= 64.
CONFIGS: dict[int, SmallMConfig] = {
    8: SmallMConfig(8, 64, 128, 4, 4, 1, 3),
    16: SmallMConfig(16, 64, 128, 3, 4, 1, 3),
    32: SmallMConfig(32, 128, 64, 4, 4, 1, 2),
    64: SmallMConfig(64, 128, 64, 4, 2, 2, 2),
    128: SmallMConfig(128, 128, 64, 3, 2, 2, 2),
}

#: The fewest rows each instance takes: every M has exactly one instance, the one padding least.
MIN_M: dict[int, int] = {mp: lo + 1 if lo else 0 for lo, mp in zip((0, *CONFIGS), CONFIGS)}

# PickAny's time model of this family, in predicted seconds (converted to gemm_cost's units with
# `kernel_api.cost.GEMM_COST_UNITS_PER_SECOND`).
# Streaming B: a fixed time (launch, pipeline fill, the cluster reduction) and a rate, fitted to
# this family on the H200 at M = 1, N = K = 4096 / 8192 / 14336 (14.6 / 39.7 / 100.5 us:
# the family alone against cuBLAS, alternating launches); the first model (3.6 TB/s + 2.5 us)
# was 20 % optimistic at 4096^2 and 16 % pessimistic at 14336^2.
_B_BYTES_PER_SECOND = 4.39e12
_L2_BYTES_PER_SECOND = 9.0e12    # A's re-reads (once per column tile) come from L2
# The rate this family's mma.sync work reaches on the H200 once it is compute-bound: 67-90 TFLOP/s
# at M = 64 and 128 (the same runs), far below the Sm80
# family's 316-447 at large sizes. With it PickAny keeps M > 32 on the Sm90 family, which is
# faster there (the family is 0.4-0.6x cuBLAS at M = 64 and 128).
_MMA_FLOPS = 80e12
_FIXED_SECONDS = 7.0e-6


class LaunchPlan(NamedTuple):
    """How one call is launched: the split-K count, the column tiles, the grid and the CTAs per
    cluster (the grid's x is padded to whole clusters of `CLUSTER`, a multiple of every size)."""

    split: int
    tiles: int
    grid: tuple[int, int, int]
    cluster: int = CLUSTER


@CudaSourceProvider.register
class CudaGemmSmallM(CudaSourceKernel):
    """Split-K GEMM for M <= 128 (bf16/f16, f32 accumulate, sm_90): streams B once with 16-byte
    cp.async loads, mma.sync tensor cores, deterministic split-K reduction across a cluster."""

    supported_args_type = GemmArguments
    source_file = "gemm_small_m.cu"
    convert_arguments = False  # every kernel parameter is a pointer or a 64-bit int
    workspace_free = True
    #: relative peak when ranked by the generic tile model (not used: see estimated_cost)
    performance_hint = 1.0

    def __init__(self, metadata: KernelMetadata, params: dict) -> None:
        super().__init__(metadata, params)
        self.dtype: DataType = params["dtype"]
        self.b_kmajor: bool = params["b_layout"] == "col"
        self.config: SmallMConfig = CONFIGS[params["mp"]]
        self._split_k: int | None = None
        self._cluster: int | None = None

    @property
    def split_k(self) -> int | None:
        """A forced split-K count (1, 2, 4 or 8) instead of the per-shape choice (None); for tuning and tests."""
        return self._split_k

    @split_k.setter
    def split_k(self, value: int | None) -> None:
        if value is not None and (type(value) is not int or value not in SPLITS):
            raise ValueError(f"{self.metadata.kernel_name}: split_k must be None or one of {SPLITS} (it must divide "
                             f"the cluster of {CLUSTER} CTAs that reduces the splits), got {value!r}")
        self._split_k = value

    @property
    def cluster(self) -> int | None:
        """A forced cluster size (`CLUSTER` or `SPLIT2_CLUSTER`, holding the split) instead of the
        per-split choice (None); for tuning and tests."""
        return self._cluster

    @cluster.setter
    def cluster(self, value: int | None) -> None:
        allowed = self.cluster_sizes()
        if value is not None and (type(value) is not int or value not in allowed):
            raise ValueError(f"{self.metadata.kernel_name}: cluster must be None or one of {allowed}, got {value!r}")
        self._cluster = value

    def cluster_sizes(self) -> tuple[int, ...]:
        """The cluster sizes this instance's module holds kernels for."""
        return (CLUSTER, SPLIT2_CLUSTER)

    def cluster_for(self, split: int) -> int:
        """CTAs per cluster for a launch at ``split``: `SPLIT2_CLUSTER` at split 2 where this
        instance has that kernel, else `CLUSTER` (a forced `cluster` wins where it holds the split)."""
        if self._cluster is not None and self._cluster % split == 0:
            return self._cluster
        return SPLIT2_CLUSTER if split == 2 and SPLIT2_CLUSTER in self.cluster_sizes() else CLUSTER

    # ---- generation --------------------------------------------------------------------
    @classmethod
    def variant_params(cls) -> list[dict]:
        return [dict(dtype=dt, b_layout=layout, mp=mp)
                for dt in (DataType.bf16, DataType.f16) for layout in ("col", "row") for mp in CONFIGS]

    @classmethod
    def instance_name(cls, params: dict) -> str:
        c = CONFIGS[params["mp"]]
        b = "n" if params["b_layout"] == "col" else "t"
        return (f"CudaGemmSmallM_{params['dtype']}_f32acc_t{b}t_m{c.mp}_tile{c.bn}x{c.bk}_stages{c.stages}"
                f"_warps{c.wn}x{c.wm}_splitk{CLUSTER}_align8")

    @classmethod
    def make_metadata(cls, params: dict) -> KernelMetadata:
        dt = params["dtype"]
        c = CONFIGS[params["mp"]]
        operands = GemmOperandsMetadata(TensorAttributes(dt, ROW, 8),
                                        TensorAttributes(dt, COL if params["b_layout"] == "col" else ROW, 8),
                                        TensorAttributes(dt, ROW, 8), accumulator_type=DataType.f32)
        design = BLASDesignMetadata(tile_shape=(c.mp, c.bn, c.bk), cluster_shape=(1, 1, CLUSTER), stages=c.stages,
                                    schedule="splitk_cluster",
                                    extra=(("min_m", MIN_M[c.mp]), ("max_m", c.mp), ("warps", (c.wn, c.wm)),
                                           ("max_split_k", CLUSTER)))
        # No fused epilogue (metadata epilogue None): calls with alpha/beta/bias/activation go elsewhere.
        return KernelMetadata(cls.instance_name(params), cls, operands, design=design, min_cc=90, max_cc=90)

    @classmethod
    def check_definition(cls) -> None:
        pass  # names come from name_expression, not kernel_name

    # ---- support --------------------------------------------------------------------------
    def _supports(self, args: GemmArguments) -> Status:
        mp, lo = self.config.mp, MIN_M[self.config.mp]
        if args.M > mp:
            return Status.fail(f"operand A: M={args.M} rows, more than this instance's {mp} "
                               f"(the small-M family takes M <= {max(CONFIGS)})")
        if args.M < lo:
            return Status.fail(f"operand A: M={args.M} rows, fewer than this instance's {lo} "
                               f"(the instance for up to {lo - 1} rows pads less)")
        if args.N > _INDEX_LIMIT:
            return Status.fail(f"operand B: N={args.N:,} exceeds the kernel's 32-bit column index "
                               f"(at most {_INDEX_LIMIT:,})")
        if args.K > _INDEX_LIMIT:
            return Status.fail(f"operand A: K={args.K:,} exceeds the kernel's 32-bit k index (at most {_INDEX_LIMIT:,})")
        if args.L > _MAX_BATCH:
            return Status.fail(f"operand A: batch L={args.L:,} exceeds the grid's y limit of {_MAX_BATCH:,}")
        return Status.success()

    # ---- the plan: split count and grid -------------------------------------------------------
    def split_for(self, M: int, N: int, K: int, L: int, sm_count: int = 132) -> int:
        """The split-K count for a shape: the largest of 1, 2, 4, 8 that keeps every CTA resident
        at once (one wave: memory-bound CTAs of equal work then finish together) and gives each
        split at least two k-tiles; 1 when even that overfills the machine. Residency counts
        whole clusters (`max_clusters`): the grid launches as clusters of `CLUSTER` CTAs."""
        if self._split_k is not None:
            return self._split_k
        c = self.config
        tiles = -(-N // c.bn) * L
        ktiles = -(-K // c.bk)
        clusters = self.max_clusters(sm_count)
        best = 1
        for s in SPLITS[1:]:
            if -(-tiles * s // CLUSTER) <= clusters and ktiles >= 2 * s:
                best = s
        return best

    def max_clusters(self, sm_count: int = 132) -> int:
        """Clusters of `CLUSTER` CTAs of this instance that can reside at once on ``sm_count`` SMs
        (`CLUSTER_PACKING` of the slots: a cluster must fit in one GPC). At 64x4096x4096 a split
        of 8 (32 clusters) against the 30 that fit ran in two waves: 32.1 us, against 24.4 us at a
        split of 4 (H200)."""
        return max(1, int(CLUSTER_PACKING * sm_count * self.config.ctas_per_sm / CLUSTER))

    def estimated_cost(self, args: GemmArguments, sm_count: int) -> float:
        """Predicted run time in `kernel_api.cost.gemm_cost` units (PickAny ranks by it).

        The larger of streaming B from memory (and B plus A's re-reads through L2) and the
        mma.sync work on MP padded rows, plus a fixed cost for launch, pipeline fill and reduction.
        """
        c = self.config
        M, N, K, L = args.M, args.N, args.K, args.L
        b_bytes = 2 * N * K * L
        a_l2_bytes = 2 * M * K * L * -(-N // c.bn)
        # B passes through L2 on its way from memory, so L2 carries B and A's re-reads together.
        memory = max(b_bytes / _B_BYTES_PER_SECOND, (b_bytes + a_l2_bytes) / _L2_BYTES_PER_SECOND)
        compute = 2 * c.mp * N * K * L / _MMA_FLOPS
        return (max(memory, compute) + _FIXED_SECONDS) * GEMM_COST_UNITS_PER_SECOND

    # ---- compile and launch -----------------------------------------------------------------
    def name_expression_for(self, cluster: int) -> str:
        """The kernel template instance that launches clusters of ``cluster`` CTAs."""
        c = self.config
        return (f"ka_gemm_small_m::gemm_small_m<{_DT_TAG[self.dtype]}, {'true' if self.b_kmajor else 'false'}, "
                f"{c.mp}, {c.bn}, {c.bk}, {c.stages}, {c.wn}, {c.wm}, {c.min_ctas}, {cluster}>")

    def name_expression(self, args: Any) -> str:
        return self.name_expression_for(CLUSTER)

    def companion_name_expressions(self, args: Any) -> tuple[str, ...]:
        return tuple(self.name_expression_for(n) for n in self.cluster_sizes() if n != CLUSTER)

    def launch_plan(self, args: Any, launcher: CudaLauncher) -> dict[int, CudaLauncher]:
        """The artifact's ``extra``: a launcher per cluster size, the companions' from the same module."""
        found = {CLUSTER: launcher}
        for n in self.cluster_sizes():
            if n != CLUSTER:
                found[n] = CudaLauncher(launcher.compiled, self.name_expression_for(n),
                                        f"{self.metadata.kernel_name} (clusters of {n})", convert_args=False)
        return found

    def plan(self, args: GemmArguments) -> LaunchPlan:
        """The launch for ``args``; the grid's x is padded to whole clusters of `CLUSTER` (the
        padding CTAs only join the cluster barriers)."""
        split = self.split_for(args.M, args.N, args.K, args.L, planning_sm_count(args.device))
        tiles = -(-args.N // self.config.bn)
        return LaunchPlan(split, tiles, (-(-tiles * split // CLUSTER) * CLUSTER, args.L, 1), self.cluster_for(split))

    def launch_config(self, args: GemmArguments) -> tuple:
        return self.plan(args).grid, self.config.threads, self.config.smem_bytes

    def _shape_params(self, args: GemmArguments, split: int, tiles: int) -> tuple:
        """The kernel's parameters after the three pointers: extents, leading dimensions, batch
        strides, split count and column tiles (all fixed by the operands' metadata)."""
        A, B, out = args.A, args.B, args.out
        batched = A.dim() == 3 and args.L > 1
        ldb = B.stride(-1) if self.b_kmajor else B.stride(-2)
        return (args.M, args.N, args.K, A.stride(-2), ldb, out.stride(-2), A.stride(0) if batched else 0,
                B.stride(0) if batched else 0, out.stride(0) if batched else 0, split, tiles)

    def _run(self, args: GemmArguments, artifact: Any, stream: Any, workspace: Any = None) -> None:
        if args.M == 0 or args.N == 0 or args.L == 0:
            return
        c = self.config
        split, tiles, grid, cluster = self.plan(args)
        launcher = artifact.extra[cluster] if cluster != CLUSTER else artifact.compiled_obj
        device = args.device.index
        if device is None:
            device = torch.cuda.current_device()
        launcher.launch(stream_handle(stream, device), device, grid, c.threads, c.smem_bytes,
                        (args.A.data_ptr(), args.B.data_ptr(), args.out.data_ptr(),
                         *self._shape_params(args, split, tiles)))

    def _launcher(self, args: GemmArguments, artifact: CompiledArtifact) -> Launcher | None:
        """One launch of the planned kernel: the split, grid and every parameter but the three
        pointers follow from the operands' metadata, so they are fixed here, and a call costs
        reading three pointers and the cubin launch. Measured on an H200, `kernel_api.ops.gemm`
        back to back against torch.matmul(out=): bf16 3x9216x3072 18.0 against 19.2 us a call,
        8x4096x4096 12.8-13.0 against 15.2-16.0, where `_run`'s Python path for every call ran
        0.64x and 0.40x torch's speed."""
        if not (args.M and args.N and args.L):
            return None
        c = self.config
        split, tiles, grid, cluster = self.plan(args)
        launch = (artifact.extra[cluster] if cluster != CLUSTER else artifact.compiled_obj).launch
        device = args.device_index
        threads, smem, params = c.threads, c.smem_bytes, self._shape_params(args, split, tiles)

        def gemm_small_m(A: torch.Tensor, B: torch.Tensor, out: torch.Tensor, stream: Any) -> None:
            launch(raw_stream(stream, device), device, grid, threads, smem,
                   (A.data_ptr(), B.data_ptr(), out.data_ptr(), *params))

        return Launcher(gemm_small_m)


__all__ = ["CLUSTER", "CLUSTER_PACKING", "CONFIGS", "MIN_M", "SPLIT2_CLUSTER", "CudaGemmSmallM", "LaunchPlan",
           "SmallMConfig"]
