"""Interface of the f64 tensor-core GEMM (implementation: gemm_f64.cu beside this file).

`CudaGemmF64` computes ``out = A @ B`` in float64 on Hopper's FP64 tensor cores
(``mma.sync`` m16n8k8 .f64, sm_90) for any M, N, K, batched or not, with A, B and out each
row- or column-major. The ``_align2`` instances need A's and B's base pointers 16-byte aligned
and their leading dimensions and batch strides even (16-byte rows: the copies into shared
memory are 16-byte ``cp.async``); the ``_align1`` ones take any f64 operand (8-byte copies,
`COPY8_COST`). Extents may be odd (the edges are zero-filled). out needs only its natural
8-byte alignment. Plain epilogue (alpha=1, beta=0; calls with a fused epilogue go to the
`Sm80TensorOpGemm` f64 instances). The warp-specialized instances run a last wave at most a
quarter full as stream-K (`CudaGemmF64.split_plan`; workspace for the partial sums, added up
in a fixed order by a second launch). Design: gemm_f64.cu's header; measurements:
docs/performance.md, "f64 and f32 GEMM".

Instances: one per (A, B, out) layout, tile configuration (`CONFIGS`) and copy width.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any

import torch

from ....arguments import GemmArguments
from ....core.arch import planning_sm_count
from ....core.artifact import CompiledArtifact
from ....core.dtypes import DataType
from ....core.status import Status
from ....core.streams import stream_handle
from ....cost import streaming_floor, tile_work_cost
from ....launcher import Launcher, launch_workspace, raw_stream
from ....metadata import BLASDesignMetadata, GemmOperandsMetadata, KernelMetadata, TensorAttributes
from .. import CudaSourceProvider
from ..kernel import CudaSourceKernel
from ....nvrtc import CudaLauncher

ROW = (0, 0, 1)
COL = (0, 1, 0)
#: Shared memory of one Hopper SM, and what the system reserves per CTA.
SM_SMEM_BYTES = 233472
CTA_RESERVED_SMEM = 1024
#: Row tiles per raster band (gemm_f64.cu's GROUP_M): a wave's tiles share A and B in L2.
GROUP_M = 8
#: Fewest k tiles a stream-K CTA of the last wave takes (`CudaGemmF64.split_plan`).
MIN_SPLIT_KTILES = 4
#: `CudaGemmF64.estimated_cost`'s split last wave, in tiles' time per split: 15 / 33 of a tile's
#: time at 8192^3, fitted to the measured gains (the 32nd wave split 33 ways saved 2.0 % of the
#: 128x128 tile's time and 1.4 % of the 128x64 tile's, against 3 % idle: its CTAs start as the
#: whole tiles' drain, and store and add up partial sums; H200)
SPLIT_WAVE_COST = 15.0
#: `CudaGemmF64.estimated_cost`'s factor for the ``_align1`` instances (two 8-byte copies per
#: 16-byte chunk): it ranks them after the 16-byte ones wherever both apply.
COPY8_COST = 1.05
_INDEX_LIMIT = 2**31 - 1024  # M, N, K are 32-bit inside the kernel (with room for a tile past the edge)
_MAX_BATCH = 65535           # batches run on gridDim.y


@dataclass(frozen=True)
class F64Config:
    """A tile BM x BN (x 16 deep), WM x WN warps, a ring of ``stages`` k tiles, and the CTAs per
    SM that ``__launch_bounds__`` sizes the registers for."""

    bm: int
    bn: int
    wm: int
    wn: int
    stages: int
    min_ctas: int
    #: `estimated_cost`'s correction of the tile model, from the measured speed (H200; 128x128
    #: with 8 warps and a block barrier, measured at 47.8 / 45.4 TF/s at 2048^3 / 8192^3, is the
    #: model's 1.0)
    cost_scale: float = 1.0
    #: load the next k step's fragments while this step's DMMAs run (more registers)
    prefetch: bool = False
    #: depth of a shared-memory k tile (one barrier each)
    bk: int = 16
    #: the DMMA's k: 8 (m16n8k8, as cuBLAS) or 16 (m16n8k16: half the instructions per flop)
    mma_k: int = 8
    #: where the next stage's copies issue in a k tile (gemm_f64.cu's COPY_AT): 0 after the
    #: barrier, 1 after the first step's fragment loads, 2 after its DMMAs
    copy_at: int = 0
    #: warp-specialized (gemm_f64.cu's gemm_f64_ws): a producer warpgroup copies and signals each
    #: slot on an mbarrier; the consumers (whole warpgroups: wm * wn of 4 or 8) never meet at a
    #: barrier
    ws: bool = False
    #: registers the warp-specialized kernel's producers keep (0: gemm_f64.cu's WsRegs default by
    #: CTAs per SM); the rest go to the consumers
    producer_regs: int = 0
    #: warp-specialized: run a last wave at most a quarter full as stream-K (`CudaGemmF64.split_plan`);
    #: False (tag ``_dp``) keeps every tile whole, for comparison
    split_last_wave: bool = True

    @property
    def threads(self) -> int:
        return 32 * self.wm * self.wn + (128 if self.ws else 0)

    @property
    def smem_bytes(self) -> int:
        ring = self.stages * (self.bm + self.bn) * self.bk * 8
        return ring + (2 * 8 * self.stages if self.ws else 0)  # ws: a full and an empty mbarrier per slot

    @property
    def ctas_per_sm(self) -> int:
        by_smem = SM_SMEM_BYTES // (self.smem_bytes + CTA_RESERVED_SMEM)
        return max(1, min(by_smem, self.min_ctas))

    @classmethod
    def from_tag(cls, tag: str) -> "F64Config":
        """The configuration a `tag` names: the family's own (`CONFIGS`, with its cost scale and
        CTAs per SM) or one beyond it for benchmarks, with an optional ``_ctasN`` suffix for
        ``min_ctas`` (default: as many as shared memory allows, at most 2)."""
        for config in CONFIGS:
            if config.tag == tag:
                return config
        m = re.fullmatch(r"tile(\d+)x(\d+)x(\d+)_warps(\d+)x(\d+)_stages(\d+)(_prefetch)?(?:_mma(\d+))?(?:_copy(\d))?"
                         r"(_ws)?(?:_p(\d+))?(_dp)?(?:_ctas(\d+))?",
                         tag)
        if not m:
            raise ValueError(f"F64Config tag {tag!r}: expected tileBMxBNxBK_warpsWMxWN_stagesS[_prefetch][_mmaK][_copyC][_ws][_pR][_dp][_ctasN]")
        bm, bn, bk, wm, wn, stages = (int(v) for v in m.groups()[:6])
        config = cls(bm, bn, wm, wn, stages, 2, prefetch=bool(m.group(7)), bk=bk, mma_k=int(m.group(8) or 8),
                           copy_at=int(m.group(9) or 0), ws=bool(m.group(10)), producer_regs=int(m.group(11) or 0),
                     split_last_wave=not m.group(12))
        if (config.producer_regs or m.group(12)) and not config.ws:
            raise ValueError(f"F64Config tag {tag!r}: _pN (producer registers) and _dp (no stream-K last wave) need "
                             f"the warp-specialized kernel (_ws)")
        if config.ws and (config.wm * config.wn % 4 or config.copy_at):
            raise ValueError(f"F64Config tag {tag!r}: the warp-specialized kernel takes whole warpgroups of consumer "
                             f"warps (4 or 8) and no _copy option")
        by_smem = SM_SMEM_BYTES // (config.smem_bytes + CTA_RESERVED_SMEM)
        return dataclasses.replace(config, min_ctas=int(m.group(13)) if m.group(13) else max(1, min(by_smem, 2)))

    @property
    def tag(self) -> str:
        return (f"tile{self.bm}x{self.bn}x{self.bk}_warps{self.wm}x{self.wn}_stages{self.stages}"
                + ("_prefetch" if self.prefetch else "") + (f"_mma{self.mma_k}" if self.mma_k != 8 else "")
                + (f"_copy{self.copy_at}" if self.copy_at else "") + ("_ws" if self.ws else "")
                + (f"_p{self.producer_regs}" if self.producer_regs else "")
                + ("_dp" if self.ws and not self.split_last_wave else ""))


#: The configurations that won a size in the sweeps (H200; docs/performance.md, "f64 and f32
#: GEMM"). The warp-specialized kernel with m16n8k16 and 32-deep k tiles: 128x128 with 8 consumer
#: warps of 64x32 and 1 CTA per SM, 0.96-0.99x cuBLAS DGEMM at 2048-8192^3, and 128x64 with 4
#: consumer warps and 2 CTAs per SM, 0.95-0.97x (the single-barrier 128x64, cuBLAS's own design,
#: ran at 0.89x in the same runs, and 4 stages, 64x64, 256x64, 6 stages and prefetching under
#: warp specialisation measured no better). 64x64
#: with 3 CTAs per SM and the prefetching single-barrier loop keeps small outputs' SMs busy.
#: The cost scales fit the measured speeds of these sweeps (the 128x64 single-barrier tile at 0.76).
CONFIGS: tuple[F64Config, ...] = (
    F64Config(128, 128, 2, 4, 3, 1, 0.83, bk=32, mma_k=16, ws=True),
    F64Config(128, 64, 2, 2, 2, 2, 0.74, bk=32, mma_k=16, ws=True),
    F64Config(64, 64, 2, 2, 4, 3, 0.77, True),
)

@CudaSourceProvider.register
class CudaGemmF64(CudaSourceKernel):
    """f64 GEMM on the FP64 tensor cores (sm_90): 16-byte cp.async copies into swizzled shared
    memory (by a producer warpgroup, through mbarriers, in the warp-specialized instances),
    conflict-free fragment loads, DMMA m16n8k8 / m16n8k16, any extents and layouts."""

    supported_args_type = GemmArguments
    source_file = "gemm_f64.cu"
    convert_arguments = False  # every kernel parameter is a pointer or a 64-bit int
    workspace_free = False  # per instance (__init__): the warp-specialized ones' stream-K partials
    #: ranks the family in `gemm_cost`'s tile model (with `estimated_cost`'s CTAs per SM)
    performance_hint = 0.6

    def __init__(self, metadata: KernelMetadata, params: dict) -> None:
        super().__init__(metadata, params)
        self.a_kmajor: bool = params["a"] == "t"   # row-major A: K contiguous
        self.b_kmajor: bool = params["b"] == "n"   # column-major B: K contiguous
        self.o_nmajor: bool = params["out"] == "t"  # row-major out: N contiguous
        self.config: F64Config = params["config"]
        #: 2: 16-byte copies (A and B 16-byte aligned, even strides); 1: 8-byte copies (any)
        self.align: int = params.get("align", 2)
        # only the warp-specialized instances ever need a workspace (`split_plan`)
        self.workspace_free = not self.config.ws

    # ---- generation --------------------------------------------------------------------
    @classmethod
    def variant_params(cls) -> list[dict]:
        return [dict(a=a, b=b, out=o, config=c, align=align)
                for align in (2, 1) for c in CONFIGS for a in "tn" for b in "tn" for o in "tn"]

    @classmethod
    def instance_name(cls, params: dict) -> str:
        return (f"CudaGemmF64_f64_{params['a']}{params['b']}{params['out']}_{params['config'].tag}"
                f"_align{params.get('align', 2)}")

    @classmethod
    def make_metadata(cls, params: dict) -> KernelMetadata:
        c: F64Config = params["config"]
        f64 = DataType.f64
        # Divisibility 1: extents may be odd; pointer and leading-dimension alignment is checked
        # in `_supports` (the metadata's divisibility would also demand even extents).
        operands = GemmOperandsMetadata(TensorAttributes(f64, ROW if params["a"] == "t" else COL, 1),
                                        TensorAttributes(f64, ROW if params["b"] == "t" else COL, 1),
                                        TensorAttributes(f64, ROW if params["out"] == "t" else COL, 1),
                                        accumulator_type=f64)
        design = BLASDesignMetadata(tile_shape=(c.bm, c.bn, c.bk), cluster_shape=(1, 1, 1), stages=c.stages,
                                    schedule="warpspecialized" if c.ws else "multistage",
                                    extra=(("warps", (c.wm, c.wn)), ("ctas_per_sm", c.ctas_per_sm),
                                           ("mma", f"m16n8k{c.mma_k}.f64"), ("raster_group", GROUP_M)))
        return KernelMetadata(cls.instance_name(params), cls, operands, design=design, min_cc=90, max_cc=90)

    @classmethod
    def check_definition(cls) -> None:
        pass  # names come from name_expression, not kernel_name

    # ---- support --------------------------------------------------------------------------
    def _lead(self, t: torch.Tensor, contiguous_last: bool) -> int:
        return t.stride(-2) if contiguous_last else t.stride(-1)

    @staticmethod
    def _batch_stride(t: torch.Tensor, L: int) -> int:
        return t.stride(0) if t.dim() == 3 and L > 1 else 0

    def _supports(self, args: GemmArguments) -> Status:
        for name, t, contiguous_last in (("A", args.A, self.a_kmajor), ("B", args.B, not self.b_kmajor)):
            if self.align == 1:
                if t.data_ptr() % 8:
                    return Status.fail(f"operand {name}: base address {t.data_ptr():#x} is not 8-byte aligned")
                continue
            if t.data_ptr() % 16:
                return Status.fail(f"operand {name}: base address {t.data_ptr():#x} is not 16-byte aligned "
                                   f"(the kernel copies 16-byte chunks)")
            lead, batch = self._lead(t, contiguous_last), self._batch_stride(t, args.L)
            if lead % 2 or batch % 2:
                what = f"leading dimension {lead}" if lead % 2 else f"batch stride {batch}"
                return Status.fail(f"operand {name}: {what} is odd; the kernel needs even leading dimensions "
                                   f"and batch strides (16-byte rows)")
        if args.out.data_ptr() % 8:
            return Status.fail(f"operand out: base address {args.out.data_ptr():#x} is not 8-byte aligned")
        for operand, name, value in (("A", "M", args.M), ("B", "N", args.N), ("A", "K", args.K)):
            if value > _INDEX_LIMIT:
                return Status.fail(f"operand {operand}: {name}={value:,} exceeds the kernel's 32-bit index "
                                   f"(at most {_INDEX_LIMIT:,})")
        if args.L > _MAX_BATCH:
            return Status.fail(f"operand A: batch L={args.L:,} exceeds the grid's y limit of {_MAX_BATCH:,}")
        tiles = -(-args.M // self.config.bm) * -(-args.N // self.config.bn)
        if tiles > 2**31 - 1:
            return Status.fail(f"operand out: {tiles:,} tiles of {self.config.bm}x{self.config.bn} exceed the "
                               f"grid's x limit")
        return Status.success()

    # ---- ranking -------------------------------------------------------------------------------
    def estimated_cost(self, args: GemmArguments, sm_count: int) -> float:
        """`gemm_cost`'s tile model with the CTAs that share an SM (waves of SMs x
        `F64Config.ctas_per_sm` tiles, each tile's work at the efficiency of its intensity),
        scaled by the configuration's measured speed (`F64Config.cost_scale`) and, for 8-byte
        copies, `COPY8_COST`; at least the streaming floor (`kernel_api.cost.streaming_floor`, which
        the CTAs per SM do not multiply: multiplied, 64x50257x768 rated the 64x64 tile 2.9x
        its measured time)."""
        c = self.config
        cost = max(tile_work_cost(self, args, sm_count * c.ctas_per_sm) * c.ctas_per_sm * c.cost_scale,
                   streaming_floor(args))
        if self.align == 1:
            cost *= COPY8_COST
        plan = self.split_plan(args, sm_count)
        if plan is not None:  # the split last wave: SPLIT_WAVE_COST / splits of a tile's time
            slots = sm_count * c.ctas_per_sm
            waves = -(-(-(-args.M // c.bm) * -(-args.N // c.bn)) // slots)
            cost *= (waves - 1 + SPLIT_WAVE_COST / plan[1]) / waves
        return cost

    # ---- stream-K over the last wave ----------------------------------------------------------
    def split_plan(self, args: GemmArguments, sm_count: int | None = None) -> tuple[int, int] | None:
        """``(tile_base, splits)`` when the warp-specialized kernel runs the output tiles past a
        whole number of waves as stream-K (None: every CTA computes a whole tile).

        A last wave of R tiles on S slots (SMs x CTAs per SM) holds R / S of the GPU for a whole
        tile's time: at 8192^3 and 128x128 tiles, 4 tiles of the 32nd wave leave 128 of 132 SMs
        idle for 3 % of the run. Split, each of those tiles' k range goes to ``splits`` CTAs
        (``splits * R <= S``, at least `MIN_SPLIT_KTILES` k tiles each), which store partial
        sums that a second launch adds up in a fixed order (deterministic). Only where the last
        wave is at most a quarter full (the partial sums' traffic must stay small against the
        idle time it saves) and for one batch. ``sm_count``: the SMs to plan for (default: the
        arguments' device's)."""
        c = self.config
        if not (c.ws and c.split_last_wave) or args.L != 1:
            return None
        tiles = -(-args.M // c.bm) * -(-args.N // c.bn)
        slots = (planning_sm_count(args.device) if sm_count is None else sm_count) * c.ctas_per_sm
        last = tiles % slots
        if tiles <= slots or last == 0 or 4 * last > slots:
            return None
        splits = min(slots // last, -(-args.K // c.bk) // MIN_SPLIT_KTILES)
        return (tiles - last, splits) if splits >= 2 else None

    def get_workspace_size(self, args: GemmArguments) -> int:
        plan = self.split_plan(args)
        return 0 if plan is None else self._partials_bytes(args, plan)

    def _partials_bytes(self, args: GemmArguments, plan: tuple[int, int]) -> int:
        """Bytes of the partial sums of ``plan``'s split tiles (one whole tile per split)."""
        c = self.config
        return (self.grid(args)[0] - plan[0]) * plan[1] * c.bm * c.bn * 8

    def _partials_address(self, args: GemmArguments, plan: tuple[int, int], workspace: Any) -> int:
        """Where ``plan``'s partial sums go: ``workspace``'s address, once it is large enough."""
        needed = self._partials_bytes(args, plan)
        if workspace is None or workspace.numel() * workspace.element_size() < needed:
            got = "none" if workspace is None else f"{workspace.numel() * workspace.element_size()} bytes"
            raise ValueError(f"{self.metadata.kernel_name}: operand workspace: needs {needed} bytes for the "
                             f"stream-K partial sums, got {got}")
        return workspace.data_ptr()

    # ---- compile and launch -----------------------------------------------------------------
    def name_expression(self, args: Any) -> str:
        c = self.config
        b = lambda v: "true" if v else "false"  # noqa: E731
        copy8 = ", true" if self.align == 1 else ""  # (COPY8; its default false otherwise)
        if c.ws:
            return (f"ka_gemm_f64::gemm_f64_ws<{b(self.a_kmajor)}, {b(self.b_kmajor)}, {b(self.o_nmajor)}, {c.bm}, "
                    f"{c.bn}, {c.wm}, {c.wn}, {c.stages}, {c.min_ctas}, {b(c.prefetch)}, {GROUP_M}, {c.bk}, {c.mma_k}, "
                    f"{c.producer_regs}{copy8}>")
        return (f"ka_gemm_f64::gemm_f64<{b(self.a_kmajor)}, {b(self.b_kmajor)}, {b(self.o_nmajor)}, {c.bm}, {c.bn}, "
                f"{c.wm}, {c.wn}, {c.stages}, {c.min_ctas}, {b(c.prefetch)}, {GROUP_M}, {c.bk}, {c.mma_k}, {c.copy_at}"
                f"{copy8}>")

    def _reduce_expression(self) -> str:
        c = self.config
        return (f"ka_gemm_f64::gemm_f64_split_reduce<{'true' if self.o_nmajor else 'false'}, {c.bm}, {c.bn}, "
                f"{GROUP_M}>")

    def companion_name_expressions(self, args: Any) -> tuple[str, ...]:
        return (self._reduce_expression(),) if self.config.ws else ()

    def launch_plan(self, args: Any, launcher: CudaLauncher) -> CudaLauncher | None:
        """The artifact's ``extra``: the split reduction's launcher (warp-specialized instances)."""
        if not self.config.ws:
            return None
        return CudaLauncher(launcher.compiled, self._reduce_expression(), f"{self.metadata.kernel_name} (split sums)",
                            convert_args=False)

    def grid(self, args: GemmArguments) -> tuple[int, int, int]:
        c = self.config
        return (-(-args.M // c.bm) * -(-args.N // c.bn), args.L, 1)

    def launch_config(self, args: GemmArguments) -> tuple:
        return self.grid(args), self.config.threads, self.config.smem_bytes

    def _shape_params(self, args: GemmArguments) -> tuple:
        """The kernel's parameters after the three pointers (extents, leading dimensions, batch
        strides, whether out takes 16-byte stores): all fixed by the operands' metadata."""
        A, B, out, L = args.A, args.B, args.out, args.L
        ldo, batch_o = self._lead(out, self.o_nmajor), self._batch_stride(out, L)
        # 16-byte stores of column pairs need a 16-byte aligned row-major out with even strides.
        out_vec = self.o_nmajor and out.data_ptr() % 16 == 0 and ldo % 2 == 0 and batch_o % 2 == 0
        return (args.M, args.N, args.K, self._lead(A, self.a_kmajor), self._lead(B, not self.b_kmajor), ldo,
                self._batch_stride(A, L), self._batch_stride(B, L), batch_o, int(out_vec))

    def _run(self, args: GemmArguments, artifact: Any, stream: Any, workspace: Any = None) -> None:
        if args.M == 0 or args.N == 0 or args.L == 0:
            return
        device = args.device.index
        if device is None:
            device = torch.cuda.current_device()
        plan = self.split_plan(args) if self.config.ws else None
        partial = None if plan is None else self._partials_address(args, plan, workspace)
        self._launch(args, artifact, device, plan)(args.A, args.B, args.out, stream_handle(stream, device), partial)

    def _launch(self, args: GemmArguments, artifact: CompiledArtifact, device: int,
                plan: tuple[int, int] | None) -> Any:
        """``launch(A, B, out, raw stream, partials address or None)``: this instance's launches
        (the main kernel, then the split sums where ``plan`` splits the last wave) for operands
        with ``args``' metadata."""
        c = self.config
        main, reduce = artifact.compiled_obj.launch, artifact.extra.launch if c.ws else None
        params = self._shape_params(args)
        grid = self.grid(args)
        if plan is not None:
            tile_base, splits = plan
            split_tiles = grid[0] - tile_base
            grid = (tile_base + split_tiles * splits, 1, 1)
            reduce_grid = (split_tiles, c.bm * c.bn // 256, 1)
            M, N, ldo = args.M, args.N, params[5]
        threads, smem = c.threads, c.smem_bytes

        def launch(A: torch.Tensor, B: torch.Tensor, out: torch.Tensor, stream: int, partial: int | None) -> None:
            pointers = (A.data_ptr(), B.data_ptr(), out.data_ptr())
            if not c.ws:
                main(stream, device, grid, threads, smem, (*pointers, *params))
            elif plan is None:
                main(stream, device, grid, threads, smem, (*pointers, *params, 0, 0, 0))
            else:
                main(stream, device, grid, threads, smem, (*pointers, *params, partial, tile_base, splits))
                reduce(stream, device, reduce_grid, 256, 0, (partial, pointers[2], M, N, ldo, tile_base, splits))

        return launch

    def _launcher(self, args: GemmArguments, artifact: CompiledArtifact) -> Launcher | None:
        """Every launch's grid and parameters but the pointers follow from the operands'
        metadata, so they are fixed here; a split last wave's partial sums take a workspace from
        torch's caching allocator on the launch stream, per call."""
        if not (args.M and args.N and args.L):
            return None
        device = args.device_index
        plan = self.split_plan(args) if self.config.ws else None
        launch = self._launch(args, artifact, device, plan)
        if plan is None:
            def gemm_f64(A: torch.Tensor, B: torch.Tensor, out: torch.Tensor, stream: Any) -> None:
                launch(A, B, out, raw_stream(stream, device), None)
        else:
            size = self._partials_bytes(args, plan)

            def gemm_f64(A: torch.Tensor, B: torch.Tensor, out: torch.Tensor, stream: Any) -> None:
                handle = raw_stream(stream, device)
                workspace = launch_workspace(size, device, handle)  # (kept until both launches are queued)
                launch(A, B, out, handle, workspace.data_ptr())

        return Launcher(gemm_f64)


__all__ = ["CONFIGS", "CudaGemmF64", "F64Config"]
