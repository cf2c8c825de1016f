"""`Sm80TensorOpGemm`: tensor-core GEMM with ``mma.sync`` for every GPU with cc >= 80 (Hopper too).

f16/bf16 operands with f32 accumulation and f16/bf16/f32 output; f64 operands on the f64
tensor cores (DMMA, f64 accumulation, any alignment); f32 operands in TF32 mode
(metadata ``math_type`` is ``DataType.tf32``, so ``metadata_filter=lambda m: str(m.operands.math_type) != "tf32"``
style filters can exclude them). Multistage ``cp.async`` pipeline into swizzled shared
memory, ``ldmatrix`` to registers; every layout combination, batched, any M/N/K. A and B
must be 16-byte aligned (pointer, leading dimension, contiguous extent; f64 also at
alignment 1); out and C have no alignment requirement. Implementations:
``implementations/sm80_tensorop_impl.py`` (f16/bf16/tf32) and ``sm80_dmma_impl.py`` (f64). Fused epilogue ``out = act(alpha * A@B + beta * C + bias)``.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any, Callable

from ....arguments import EpilogueArguments, GemmArguments
from ....core.dtypes import DataType
from ....metadata import GemmOperandsMetadata, KernelMetadata, TensorAttributes
from ....core.status import Status
from ....kernel import target_cc
from .. import CuTeDSLProvider
from .common import (FULL_EPILOGUE, FUSED_EPILOGUE, LAYOUT_COMBOS, EpilogueSpec, GemmKernelBase,
                     epilogue_supported_by_generation, grid_x_tiles_limit, grid_y_limit, tiled_gemm_metadata)

# (operand dtype, output dtype); accumulation is always f32
_DTYPES_16 = ((DataType.bf16, DataType.bf16), (DataType.f16, DataType.f16),
              (DataType.bf16, DataType.f32), (DataType.f16, DataType.f32))
# (BM, BN, BK), (warps along M, warps along N), stages
_CONFIGS_16 = (
    ((128, 256, 64), (2, 4), 4),
    ((128, 256, 64), (2, 4), 3),
    ((256, 128, 64), (4, 2), 4),
    ((128, 256, 32), (2, 4), 5),
    ((128, 128, 32), (2, 2), 5),
    ((64, 128, 32), (2, 2), 4),
)
# f64 runs on the DMMA units: warps own 64x32 / 32x32 blocks. Last: the DMMA's k on sm_90
# (m16n8k16 or m16n8k8; m8n8k4 before). Measured on an H200 against cuBLAS DGEMM (2048^3 to
# 8192^3): m16n8k16 beats m16n8k8 by 14-17% in the 128x128 tile and loses 4-10% in the 64x64
# one; BK 32, more stages and 128x64 tiles (two CTAs per SM) were all slower.
_CONFIGS_F64 = (
    ((128, 128, 16), (2, 4), 3, 16),
    ((64, 64, 16), (2, 2), 3, 8),
)
#: f16 accumulation (f16 operands and output): one tile, for GPUs without the SM90 kernel's
_CONFIGS_F16_ACC = (((128, 128, 32), (2, 2), 5),)
_CONFIGS_TF32 = (
    ((128, 256, 32), (2, 4), 3),
    ((128, 128, 32), (2, 2), 4),
    ((64, 128, 32), (2, 2), 4),
)


@CuTeDSLProvider.register
class Sm80TensorOpGemm(GemmKernelBase):
    """Ampere-style tensor-core GEMM; see the module docstring.

    ``design``: tile_shape (BM, BN, BK), stages, schedule "multistage",
    extra (("warps", (WM, WN)),), and for f64 ("mma_k", 16 or 8): the k of the sm_90 DMMA
    (m16n8k16 or m16n8k8; m8n8k4 before sm_90), optionally ("raster_group", G) for a 1-D grid
    walked G M-tiles at a time. Names read e.g.
    ``Sm80TensorOpGemm_bf16bf16f32_tnt_128x256x64_w2x4_s3_a8`` (A/B, out, accumulator or
    ``tf32`` math; layouts; tile; warps; stages; A/B alignment in elements).
    """

    #: relative peak for the PickAny heuristic (mma.sync on Hopper: measured ~0.55x of the wgmma kernels)
    performance_hint = 0.55

    @staticmethod
    def generate_kernels(metadata_filter: Callable[[KernelMetadata], bool], epilogue_args: EpilogueArguments | None = None,
                         cc: int | None = None) -> list["Sm80TensorOpGemm"]:
        if not epilogue_supported_by_generation(epilogue_args, FUSED_EPILOGUE):
            return []
        # (A/B dtype, out dtype, accumulator, math type, A/B alignments, configs)
        combos = [(ab, out, DataType.f32, None, (8,), _CONFIGS_16) for ab, out in _DTYPES_16]
        combos.append((DataType.f32, DataType.f32, DataType.f32, DataType.tf32, (4,), _CONFIGS_TF32))
        # cp.async moves single f64 elements too, so f64 also comes at alignment 1.
        combos.append((DataType.f64, DataType.f64, DataType.f64, None, (2, 1), _CONFIGS_F64))
        # f16 accumulation into f16, only for callers asking for accumulator_type=f16 (matched exactly)
        combos.append((DataType.f16, DataType.f16, DataType.f16, None, (8,), _CONFIGS_F16_ACC))
        kernels = []
        for ab, out, acc, math, aligns, configs in combos:
            for align, (sa, sb, so), config in itertools.product(aligns, LAYOUT_COMBOS, configs):
                tile, warps, stages, *mma_k = config
                operands = GemmOperandsMetadata(
                    TensorAttributes(ab, sa, align), TensorAttributes(ab, sb, align), TensorAttributes(out, so, 1),
                    accumulator_type=acc, math_type=math)
                # (the f64 DMMA kernel fuses the named epilogue only)
                metadata = tiled_gemm_metadata(Sm80TensorOpGemm, f"{ab}{out}{math or acc}", (sa, sb, so), operands,
                                               tile, ("warps", warps), stages, "multistage", min_cc=80,
                                               epilogue=FULL_EPILOGUE if ab is DataType.f64 else FUSED_EPILOGUE)
                if mma_k:  # f64: the DMMA shape on sm_90 (design.extra "mma_k")
                    metadata.design = dataclasses.replace(metadata.design,
                                                          extra=metadata.design.extra + (("mma_k", mma_k[0]),))
                if metadata.supports_cc(cc) and metadata_filter(metadata):
                    kernels.append(Sm80TensorOpGemm(metadata))
        return kernels

    def _family_supports(self, args: GemmArguments) -> Status | None:
        tm, tn, _ = self.metadata.design.tile_shape
        if self.metadata.operands.A.dtype is DataType.f64 and not dict(self.metadata.design.extra).get("raster_group"):
            # DMMA's grid is (M tiles, N tiles, L) (sm80_dmma_impl.py): N tiles are bounded by gridDim.y.
            return grid_y_limit(args, tn)
        # One grid row of M tiles x N tiles, a 32-bit product (sm80_tensorop_impl.py).
        return grid_x_tiles_limit(args, tm, tn)

    def _make_impl(self, args: GemmArguments) -> Any:
        md = self.metadata.operands
        design = self.metadata.design
        if md.A.dtype is DataType.f64:
            from .implementations.sm80_dmma_impl import Sm80DmmaGemmImpl

            extra = dict(design.extra)
            return Sm80DmmaGemmImpl(design.tile_shape, extra["warps"], design.stages, align=md.A.divisibility,
                                    cc=target_cc(), mma_k=extra.get("mma_k"), group=extra.get("raster_group", 0),
                                    **self._impl_layout_kwargs(args))
        from .implementations.sm80_tensorop_impl import Sm80TensorOpGemmFusedImpl, Sm80TensorOpGemmImpl

        fused = EpilogueSpec.from_signature(args.epilogue_signature).fusion is not None
        impl = Sm80TensorOpGemmFusedImpl if fused else Sm80TensorOpGemmImpl
        acc = dict(acc_f16=True) if md.accumulator_type is DataType.f16 else {}
        return impl(md.A.dtype.to_cutlass(), md.out.dtype.to_cutlass(), design.tile_shape,
                    dict(design.extra)["warps"], design.stages, **acc, **self._impl_layout_kwargs(args))
