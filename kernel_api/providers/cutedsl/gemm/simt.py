"""`SimtGemm`: CUDA-core GEMM for f64, f32, f16 and bf16; the fallback that takes anything.

Every layout combination (A/B/out row- or column-major), batched or not, any M/N/K, at
alignment 1 (any pointer, any leading dimension) or at 16 bytes (vectorised copies). Fused
epilogue: ``out = act(alpha * A@B + beta * C + bias)``. Accumulates in f64 for f64 operands
and in f32 otherwise. The implementation is ``implementations/simt_impl.py``.
"""

from __future__ import annotations

from typing import Any, Callable

from ....arguments import EpilogueArguments, GemmArguments
from ....core.dtypes import DataType
from ....cost import GEMM_COST_UNITS_PER_SECOND
from ....metadata import GemmOperandsMetadata, KernelMetadata, TensorAttributes
from ....core.status import Status
from .. import CuTeDSLProvider
from .common import (FUSED_EPILOGUE, LAYOUT_COMBOS, EpilogueSpec, GemmKernelBase,
                     epilogue_supported_by_generation, grid_y_limit, tiled_gemm_metadata)

# (operand dtype, output dtype, accumulator dtype)
_DTYPES = (
    (DataType.f64, DataType.f64, DataType.f64),
    (DataType.f32, DataType.f32, DataType.f32),
    (DataType.f16, DataType.f16, DataType.f32),
    (DataType.bf16, DataType.bf16, DataType.f32),
)
# (BM, BN, BK), (threads along M, threads along N): 8x8, 8x8 and 4x4 outputs per thread
_TILES = (
    ((128, 128, 8), (16, 16)),
    ((64, 64, 8), (8, 8)),
    ((32, 32, 8), (8, 8)),
)
_STAGES = 3

# PickAny's model of a SIMT launch (`SimtGemm.estimated_cost`), fitted to the a1 bf16/f16
# kernels on odd shapes of 37x53x29 to 4096x50257x4096 (H200, gemm_shapes.py's odd groups;
# rms log error 0.07 / 0.24 / 0.14 for the three tiles) and the f32 kernels at 4096^3 and 8192^3
# (its f32 group). A launch costs SIMT_FIXED_SECONDS; a CTA alone on its SM takes `latency`
# per k (its loads wait on memory: a 32x32 tile runs at 16 GFLOP/s), and each further CTA on
# the busiest SM adds `throughput` per k (CTAs overlap until the SM's FMA pipes fill). The
# generic tile model had rated a lone 32x32 CTA 6-8x too fast (333^3: 7.8 us against 40.7), so
# PickAny took SIMT where cuBLAS runs 3-5x faster.
SIMT_FIXED_SECONDS = 3.3e-6
# (BM, BN): (latency, throughput for 2-byte operands, throughput for 4-byte ones) in ns per k.
# 8-byte operands take twice the 4-byte throughput (Hopper's FP64 FMA rate is half FP32's;
# not measured).
SIMT_NS_PER_K = {(128, 128): (224.0, 214.0, 98.0), (64, 64): (242.0, 77.0, 21.0), (32, 32): (124.5, 9.9, 11.2)}


@CuTeDSLProvider.register
class SimtGemm(GemmKernelBase):
    """Shared-memory tiled FMA GEMM; see the module docstring.

    ``design.tile_shape`` is the CTA tile, ``design.extra`` holds ("threads", (TM, TN)).
    Names read e.g. ``SimtGemm_f64f64f64_ttt_128x128x8_t16x16_s3_a2``
    (A/B, out, accumulator types; layouts; tile; thread grid; stages; alignment).
    """

    #: relative peak for the PickAny heuristic (CUDA-core FMA: ~5% of the tensor-core rate on Hopper)
    performance_hint = 0.05

    @staticmethod
    def generate_kernels(metadata_filter: Callable[[KernelMetadata], bool], epilogue_args: EpilogueArguments | None = None,
                         cc: int | None = None) -> list["SimtGemm"]:
        if not epilogue_supported_by_generation(epilogue_args, FUSED_EPILOGUE):
            return []
        kernels = []
        for ab, out, acc in _DTYPES:
            for aligns in (16 // ab.bytes, 1):  # aligned (vectorised) variants first
                for sa, sb, so in LAYOUT_COMBOS:
                    for tile, threads in _TILES:
                        operands = GemmOperandsMetadata(
                            TensorAttributes(ab, sa, aligns), TensorAttributes(ab, sb, aligns),
                            TensorAttributes(out, so, aligns), accumulator_type=acc)
                        metadata = tiled_gemm_metadata(
                            SimtGemm, f"{ab}{out}{acc}", (sa, sb, so), operands, tile, ("threads", threads), _STAGES,
                            "simt", min_cc=70, epilogue=FUSED_EPILOGUE)
                        if metadata.supports_cc(cc) and metadata_filter(metadata):
                            kernels.append(SimtGemm(metadata))
        return kernels

    def estimated_cost(self, args: GemmArguments, sm_count: int) -> float:
        """`SIMT_FIXED_SECONDS` plus K times the busiest SM's time per k (`SIMT_NS_PER_K`: one
        CTA's latency, and the throughput for each further CTA), in `gemm_cost` units: the
        run time itself, launch included, as cuBLAS's alignment-1 estimate is."""
        tm, tn = self.metadata.design.tile_shape[:2]
        latency, two_byte, four_byte = SIMT_NS_PER_K[(tm, tn)]
        element = self.metadata.operands.A.dtype.bytes
        throughput = two_byte if element == 2 else four_byte * (element // 4)
        tiles = -(-args.M // tm) * -(-args.N // tn) * max(args.L, 1)
        per_sm = max(-(-tiles // max(sm_count, 1)), 1)
        seconds = SIMT_FIXED_SECONDS + max(args.K, 1) * (latency + (per_sm - 1) * throughput) * 1e-9
        return seconds * GEMM_COST_UNITS_PER_SECOND

    def _family_supports(self, args: GemmArguments) -> Status | None:
        # The grid is (M tiles, N tiles, L) (simt_impl.py): N tiles are bounded by gridDim.y.
        return grid_y_limit(args, self.metadata.design.tile_shape[1])

    def _make_impl(self, args: GemmArguments) -> Any:
        from .implementations.simt_impl import SimtGemmFusedImpl, SimtGemmImpl

        md = self.metadata.operands
        design = self.metadata.design
        threads = dict(design.extra)["threads"]
        fused = EpilogueSpec.from_signature(args.epilogue_signature).fusion is not None
        return (SimtGemmFusedImpl if fused else SimtGemmImpl)(
            md.A.dtype.to_cutlass(), md.out.dtype.to_cutlass(), md.accumulator_type.to_cutlass(), design.tile_shape,
            threads, design.stages, align=md.A.divisibility, **self._impl_layout_kwargs(args))
