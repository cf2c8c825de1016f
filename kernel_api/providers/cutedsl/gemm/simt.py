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
from ....metadata import GemmOperandsMetadata, KernelMetadata, TensorAttributes
from ....core.status import Status
from .. import CuTeDSLProvider
from .common import (FULL_EPILOGUE, LAYOUT_COMBOS, GemmKernelBase, epilogue_supported_by_generation, grid_y_limit,
                     tiled_gemm_metadata)

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
        if not epilogue_supported_by_generation(epilogue_args, FULL_EPILOGUE):
            return []
        kernels = []
        for ab, out, acc in _DTYPES:
            for aligns in (16 // ab.bytes, 1):  # aligned (vectorised) variants first
                for sa, sb, so in LAYOUT_COMBOS:
                    for tile, threads in _TILES:
                        operands = GemmOperandsMetadata(
                            TensorAttributes(ab, sa, aligns), TensorAttributes(ab, sb, aligns),
                            TensorAttributes(out, so, aligns), accumulator_type=acc)
                        metadata = tiled_gemm_metadata(SimtGemm, f"{ab}{out}{acc}", (sa, sb, so), operands, tile,
                                                       ("threads", threads), _STAGES, "simt", min_cc=70)
                        if metadata.supports_cc(cc) and metadata_filter(metadata):
                            kernels.append(SimtGemm(metadata))
        return kernels

    def _family_supports(self, args: GemmArguments) -> Status | None:
        # The grid is (M tiles, N tiles, L) (simt_impl.py): N tiles are bounded by gridDim.y.
        return grid_y_limit(args, self.metadata.design.tile_shape[1])

    def _make_impl(self, args: GemmArguments) -> Any:
        from .implementations.simt_impl import SimtGemmImpl

        md = self.metadata.operands
        design = self.metadata.design
        threads = dict(design.extra)["threads"]
        return SimtGemmImpl(
            md.A.dtype.to_cutlass(), md.out.dtype.to_cutlass(), md.accumulator_type.to_cutlass(), design.tile_shape,
            threads, design.stages, align=md.A.divisibility, **self._impl_layout_kwargs(args))
