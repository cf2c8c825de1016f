"""Interface of the decode GEMM (implementation: gemm_decode.cu beside this file).

`CudaGemmDecode` computes ``out = A @ B`` for M <= 16 rows (decode steps), where the time is
reading B (K x N) once. A persistent grid (three CTAs per SM) takes equal shares of the flat
list of (column tile, k-tile) steps (stream-K), so every SM streams the same bytes whatever
the shape. Each CTA's threads copy B with 16-byte cp.async and multiply with mma.sync; tiles
split between CTAs are finished by whichever of their segments arrives last, summing the
parked partials in a fixed order (deterministic; no CTA waits for another).

Instances, per operand type (bf16, f16) and B layout (row-major ``A @ B``, or column-major
``x @ W.t()`` as nn.Linear computes it), one per padded row count MP in 8, 16 (M <= 8, and
8 < M <= 16). A is row-major, out row-major, every operand 16-byte aligned (base pointer,
leading dimension, batch stride and contiguous extent: N and K are multiples of 8), K >= 1;
plain epilogue only (alpha=1, beta=0). Needs a workspace (`get_workspace_size`): a tagged
counter per column tile and two partial tiles per CTA; it needs no zeroing. Design notes and
measurements: ``benchmarks/NOTES-small-m.md``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from ....arguments import GemmArguments
from ....core.arch import DEFAULT_SM_COUNT, sm_count
from ....core.dtypes import DataType
from ....core.status import Status
from ....core.streams import stream_handle
from ....metadata import BLASDesignMetadata, GemmOperandsMetadata, KernelMetadata, TensorAttributes
from .. import CudaSourceProvider
from ..kernel import CudaSourceKernel
from .launch_epoch import next_epoch

ROW = (0, 0, 1)
COL = (0, 1, 0)
#: Column tile (output columns per step; one consumer warp per 16) and k per step.
TILE_N = 64
TILE_K = 128
#: Dynamic shared memory one CTA may opt into on Hopper (227 KB), an SM's shared memory, and
#: what the system reserves per CTA.
MAX_SMEM_BYTES = 232448
SM_SMEM_BYTES = 233472
CTA_RESERVED_SMEM = 1024
MAX_STAGES = 8
_DT_TAG = {DataType.bf16: 0, DataType.f16: 1}
_INDEX_LIMIT = 2**31 - 1024  # N, K and M are 32-bit inside the kernel


@dataclass(frozen=True)
class DecodeConfig:
    """One design point: padded rows MP, B layout, CTAs of the persistent grid per SM, and the
    ring depth (the deepest that fits their share of shared memory, up to `max_stages`)."""

    mp: int
    b_kmajor: bool
    ctas_per_sm: int = 3
    max_stages: int = MAX_STAGES

    @property
    def warps(self) -> int:
        return TILE_N // 16

    @property
    def threads(self) -> int:
        return 32 * self.warps

    @property
    def stage_bytes(self) -> int:
        return (TILE_N + self.mp) * TILE_K * 2

    def smem_bytes(self, stages: int) -> int:
        return stages * self.stage_bytes + self.mp * (TILE_N + 4) * 4 + 16

    @property
    def stages(self) -> int:
        """The deepest ring (at most `max_stages`) that fits the SM's shared memory shared by
        `ctas_per_sm` CTAs (and `MAX_SMEM_BYTES` per CTA)."""
        budget = min(MAX_SMEM_BYTES, SM_SMEM_BYTES // self.ctas_per_sm - CTA_RESERVED_SMEM)
        s = self.max_stages
        while s > 2 and self.smem_bytes(s) > budget:
            s -= 1
        return s

    def tag(self) -> str:
        """The design knobs that differ from the defaults (for benchmark variants)."""
        return "".join(f"{k}{v}" for k, v, d in (("c", self.ctas_per_sm, 3), ("s", self.max_stages, MAX_STAGES))
                       if v != d) or "default"


class DecodePlan(NamedTuple):
    """How one call is launched: column tiles (all batches), k-tiles, CTAs, workspace bytes."""

    tiles: int
    ktiles: int
    grid: int
    workspace_bytes: int

    @property
    def steps(self) -> int:
        return self.tiles * self.ktiles

    def range_of(self, cta: int) -> tuple[int, int]:
        """CTA ``cta``'s steps [begin, end), as the kernel computes them."""
        return cta * self.steps // self.grid, (cta + 1) * self.steps // self.grid

    def cta_of(self, step: int) -> int:
        """The CTA whose range holds ``step`` (gemm_decode.cu's cta_of)."""
        return ((step + 1) * self.grid - 1) // self.steps

    def segments(self, tile: int) -> int:
        """How many CTAs share ``tile``'s k-steps."""
        return self.cta_of((tile + 1) * self.ktiles - 1) - self.cta_of(tile * self.ktiles) + 1


def plan_for(M: int, N: int, K: int, L: int, mp: int, sms: int, ctas_per_sm: int = 3) -> DecodePlan:
    """The launch for an (M, N, K, L) problem on ``sms`` SMs: ``ctas_per_sm`` CTAs per SM, fewer
    when there are fewer steps (every CTA gets at least one)."""
    tiles = -(-N // TILE_N) * L
    ktiles = -(-K // TILE_K)
    grid = max(1, min(sms * ctas_per_sm, tiles * ktiles))
    counters = -(-tiles * 8 // 16) * 16
    return DecodePlan(tiles, ktiles, grid, counters + grid * 2 * mp * TILE_N * 4)


# PickAny's time model of this family, in predicted seconds (converted to gemm_cost's units with
# `kernel_api.tuning.policies.GEMM_COST_UNITS_PER_SECOND`): a fixed time (launch, the ring's first
# fill, the last partials' fix-up) and B at a streaming rate, with A's re-reads (once per column
# tile) through L2. Provisional until measured: the split-K family's fitted rate and a fixed time
# above its 7 us, so PickAny keeps that family first.
_B_BYTES_PER_SECOND = 4.39e12
_L2_BYTES_PER_SECOND = 9.0e12
_FIXED_SECONDS = 8.0e-6


def _sm_count(device: torch.device | None) -> int:
    return sm_count(device) if device is not None else DEFAULT_SM_COUNT


@CudaSourceProvider.register
class CudaGemmDecode(CudaSourceKernel):
    """Stream-K GEMM for M <= 16 (bf16/f16, f32 accumulate, sm_90): a persistent grid streams
    equal shares of B through cp.async rings, mma.sync tensor cores, split tiles finished by
    their last segment from partials summed in a fixed order."""

    supported_args_type = GemmArguments
    source_file = "gemm_decode.cu"
    convert_arguments = False  # every kernel parameter is a pointer or a 64-bit int
    #: relative peak when ranked by the generic tile model (not used: see estimated_cost)
    performance_hint = 1.0

    def __init__(self, metadata: KernelMetadata, params: dict) -> None:
        super().__init__(metadata, params)
        self.dtype: DataType = params["dtype"]
        self.config = DecodeConfig(params["mp"], params["b_layout"] == "col")
        self.b_kmajor: bool = self.config.b_kmajor

    # ---- generation --------------------------------------------------------------------
    @classmethod
    def variant_params(cls) -> list[dict]:
        return [dict(dtype=dt, b_layout=layout, mp=mp)
                for dt in (DataType.bf16, DataType.f16) for layout in ("col", "row") for mp in (8, 16)]

    @classmethod
    def instance_name(cls, params: dict) -> str:
        c = DecodeConfig(params["mp"], params["b_layout"] == "col")
        b = "n" if c.b_kmajor else "t"
        return (f"CudaGemmDecode_{params['dtype']}_f32acc_t{b}t_m{c.mp}_tile{TILE_N}x{TILE_K}_stages{c.stages}"
                f"_streamk_align8")

    @classmethod
    def make_metadata(cls, params: dict) -> KernelMetadata:
        dt = params["dtype"]
        c = DecodeConfig(params["mp"], params["b_layout"] == "col")
        operands = GemmOperandsMetadata(TensorAttributes(dt, ROW, 8),
                                        TensorAttributes(dt, COL if c.b_kmajor else ROW, 8),
                                        TensorAttributes(dt, ROW, 8), accumulator_type=DataType.f32)
        design = BLASDesignMetadata(tile_shape=(c.mp, TILE_N, TILE_K), cluster_shape=(1, 1, 1), stages=c.stages,
                                    schedule="streamk_persistent",
                                    extra=(("min_m", 1 if c.mp == 8 else 9), ("max_m", c.mp),
                                           ("warps", (c.warps, 1)), ("ctas_per_sm", c.ctas_per_sm)))
        # No fused epilogue (metadata epilogue None): calls with alpha/beta/bias/activation go elsewhere.
        return KernelMetadata(cls.instance_name(params), cls, operands, design=design, min_cc=90, max_cc=90)

    @classmethod
    def check_definition(cls) -> None:
        pass  # names come from name_expression, not kernel_name

    # ---- support --------------------------------------------------------------------------
    def _supports(self, args: GemmArguments) -> Status:
        mp = self.config.mp
        lo = 1 if mp == 8 else 9
        if args.M > mp:
            return Status.fail(f"operand A: M={args.M} rows, more than this instance's {mp} "
                               f"(the decode family takes M <= 16)")
        if args.M < lo:
            return Status.fail(f"operand A: M={args.M} rows, fewer than this instance's {lo} "
                               f"(the instance for up to 8 rows pads less)")
        if args.K < 1:
            return Status.fail("operand A: K=0, an empty inner dimension (nothing to stream)")
        if args.N > _INDEX_LIMIT:
            return Status.fail(f"operand B: N={args.N:,} exceeds the kernel's 32-bit column index "
                               f"(at most {_INDEX_LIMIT:,})")
        if args.K > _INDEX_LIMIT:
            return Status.fail(f"operand A: K={args.K:,} exceeds the kernel's 32-bit k index (at most {_INDEX_LIMIT:,})")
        return Status.success()

    # ---- the plan -----------------------------------------------------------------------------
    def plan(self, args: GemmArguments) -> DecodePlan:
        """The launch for ``args`` (`plan_for` on the device's SMs)."""
        c = self.config
        return plan_for(args.M, args.N, args.K, args.L, c.mp, _sm_count(args.device), c.ctas_per_sm)

    def get_workspace_size(self, args: GemmArguments) -> int:
        """A tagged counter per column tile and two f32 partial tiles per CTA (no zeroing needed)."""
        return self.plan(args).workspace_bytes

    def estimated_cost(self, args: GemmArguments, sm_count: int) -> float:
        """Predicted run time in `kernel_api.tuning.policies.gemm_cost` units (PickAny ranks by it):
        streaming B from memory (or B plus A's re-reads through L2), plus a fixed cost."""
        M, N, K, L = args.M, args.N, args.K, args.L
        b_bytes = 2 * N * K * L
        a_l2_bytes = 2 * M * K * L * -(-N // TILE_N)
        memory = max(b_bytes / _B_BYTES_PER_SECOND, (b_bytes + a_l2_bytes) / _L2_BYTES_PER_SECOND)
        from ....tuning.policies import GEMM_COST_UNITS_PER_SECOND

        return (memory + _FIXED_SECONDS) * GEMM_COST_UNITS_PER_SECOND

    # ---- compile and launch -----------------------------------------------------------------
    def name_expression(self, args: Any) -> str:
        c = self.config
        return (f"ka_gemm_decode::gemm_decode<{_DT_TAG[self.dtype]}, {'true' if c.b_kmajor else 'false'}, "
                f"{c.mp}, {TILE_N}, {TILE_K}, {c.stages}, {c.ctas_per_sm}>")

    def launch_config(self, args: GemmArguments) -> tuple:
        c = self.config
        return (self.plan(args).grid, 1, 1), c.threads, c.smem_bytes(c.stages)

    def _run(self, args: GemmArguments, artifact: Any, stream: Any, workspace: Any = None) -> None:
        if args.M == 0 or args.N == 0 or args.L == 0:
            return
        c = self.config
        p = self.plan(args)
        if (workspace is None or workspace.numel() * workspace.element_size() < p.workspace_bytes
                or workspace.data_ptr() % 16):
            got = "none" if workspace is None else (f"{workspace.numel() * workspace.element_size()} bytes at "
                                                    f"{workspace.data_ptr():#x}")
            raise ValueError(f"{self.metadata.kernel_name}: needs a 16-byte aligned workspace of "
                             f"{p.workspace_bytes} bytes (get_workspace_size), got {got}")
        device = args.device.index
        if device is None:
            device = torch.cuda.current_device()
        A, B, out = args.A, args.B, args.out
        batched = A.dim() == 3 and args.L > 1
        ldb = B.stride(-1) if c.b_kmajor else B.stride(-2)
        artifact.compiled_obj.launch(
            stream_handle(stream, device), device, (p.grid, 1, 1), c.threads, c.smem_bytes(c.stages),
            (A.data_ptr(), B.data_ptr(), out.data_ptr(), args.M, args.N, args.K, A.stride(-2), ldb, out.stride(-2),
             A.stride(0) if batched else 0, B.stride(0) if batched else 0, out.stride(0) if batched else 0,
             args.L, workspace.data_ptr(), next_epoch()))


__all__ = ["CudaGemmDecode", "DecodeConfig", "DecodePlan", "MAX_SMEM_BYTES", "TILE_K", "TILE_N", "plan_for"]
