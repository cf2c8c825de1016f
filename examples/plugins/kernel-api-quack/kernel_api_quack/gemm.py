"""QuACK's GEMM (``quack.gemm_interface.gemm_out``) on sm_90 and later: TMA + wgmma, its tile and
cluster chosen by QuACK's heuristic (nvMatmulHeuristics where installed, else QuACK's default),
compiled by QuACK at the first call of each configuration.

Offered for f16/bf16 A and B of either major (TMA reads both), a row-major output of the same
type, f32 accumulation, rank 2 or 3 (batched), every operand 16-byte aligned (TMA's
requirement), no fused epilogue. ``compile`` runs QuACK once on the arguments' own tensors when
they are on the GPU (the warm-up: QuACK's JIT compiles at its first call; it writes only
``out``, which the run overwrites).
"""

from __future__ import annotations

from typing import Any

from quack.gemm_interface import gemm_out

from kernel_api import BLASDesignMetadata, DataType, GemmArguments, GemmOperandsMetadata, KernelMetadata, Status
from kernel_api import TensorAttributes
from kernel_api.core.status import Reason

from .base import QuackKernel
from .provider import QuackProvider

_LAYOUTS = {"t": (0, 0, 1), "n": (0, 1, 0)}  # row-major, column-major
# QuACK's heuristic chooses the tile per problem; the design states the one it takes for large
# 16-bit problems on sm_90 (128x256, clusters of 2 along M), which the cost model ranks it by
_HEURISTIC = BLASDesignMetadata(tile_shape=(128, 256, 64), cluster_shape=(2, 1, 1), schedule="quack-heuristic")


@QuackProvider.register
class QuackGemm(QuackKernel):
    """``quack.gemm_interface.gemm_out``: f16/bf16 GEMM with f32 accumulation (sm_90+)."""

    supported_args_type = GemmArguments
    # the same design as kernel_api's own TMA + wgmma family, at the speed measured beside it:
    # 201 us against that family's 185 us and cuBLAS's 182.5 us at 4096^3 bf16 on an H200
    # (benchmarks/providers.py --ops gemm), 4 % faster at 3000x5000x2000; PickBest measures both
    performance_hint = 0.92

    @classmethod
    def generate_kernels(cls, metadata_filter: Any, epilogue_args: Any = None, cc: int | None = None) -> list:
        if epilogue_args is not None or (cc is not None and cc < cls.min_cc):
            return []
        found = []
        for dtype in (DataType.bf16, DataType.f16):
            for a_name, a_layout in _LAYOUTS.items():
                for b_name, b_layout in _LAYOUTS.items():
                    operands = GemmOperandsMetadata(TensorAttributes(dtype, a_layout, 8),
                                                    TensorAttributes(dtype, b_layout, 8),
                                                    TensorAttributes(dtype, _LAYOUTS["t"], 8), DataType.f32)
                    metadata = KernelMetadata(f"{cls.__name__}_{dtype}_{a_name}{b_name}t_a16", cls, operands,
                                              design=_HEURISTIC, min_cc=cls.min_cc)
                    if metadata_filter is None or metadata_filter(metadata):
                        found.append(cls(metadata))
        return found

    def _supports(self, args: GemmArguments) -> Status:
        if args.B.dim() != args.A.dim():
            return Status.fail(f"operand B: rank {args.B.dim()} but A has rank {args.A.dim()}; QuACK takes both batched "
                               f"or neither", kind=Reason.SHAPE, operand="B", actual=args.B.dim(), required=args.A.dim())
        return Status.success()

    def build(self, args: Any) -> Any:
        if args.A.is_cuda and args.A.numel() and args.B.numel():
            gemm_out(args.A, args.B, args.out, tuned=False)
        return None

    def call(self, function: Any, args: Any) -> None:
        gemm_out(args.A, args.B, args.out, tuned=False)

    def caller(self, function: Any, args: Any) -> Any:
        return lambda A, B, out: gemm_out(A, B, out, tuned=False)
