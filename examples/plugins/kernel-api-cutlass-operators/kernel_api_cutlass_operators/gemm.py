"""cutlass.operators' Hopper GEMM (``Sm90StaticPersistentGemmOperator``) for `GemmArguments`.

What nvidia-cutlass-operators 0.3.0 offers for sm_90 (``get_operators(target_sm="90a")``):
``Sm90StaticPersistentGemmOperator`` (TMA + wgmma, persistent static tile scheduler; tiles
64/128 x 64/128/256 x 64, clusters 1x1 to 2x2; every row/column-major combination of A, B and
out; 16-bit, 8-bit float and integer inputs) and ``Sm80TensorOpGemmOperator`` (mma.sync, which
kernel_api's own `Sm80TensorOpGemm` already covers). The rest (``Sm100*``, ``Sm107*``) need
Blackwell. This plugin offers the sm_90 operator for f16/bf16 A and B, an output of the same
type, f32 accumulation: one kernel_api instance per cutlass.operators operator (layout, tile,
cluster), its ``supports`` deciding with the operator's own.

``compile`` is the operator's (a CuTe DSL compile for the target). It needs the GPU: the
operator reads the active-cluster limit from the driver when it compiles, so compiling for
sm_90 without a GPU raises `CompilationError` naming that.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import cutlass.operators as co
from cutlass.operators import GlobalOptions

from kernel_api import (BLASDesignMetadata, CompilationError, CompiledArtifact, DataType, GemmArguments,
                        GemmOperandsMetadata, Kernel, KernelMetadata, Status, TensorAttributes)
from kernel_api.core.dtypes import to_dtype
from kernel_api.core.streams import to_cuda_stream
from kernel_api.launcher import Launcher, ffi_function

from .provider import CutlassOperatorsProvider

_OPERATOR = "Sm90StaticPersistentGemmOperator"
_DTYPES = (DataType.f16, DataType.bf16)
_LAYOUT = {(0, 0, 1): "t", (0, 1, 0): "n"}


@functools.lru_cache(maxsize=1)
def sm90_operators() -> tuple:
    """cutlass.operators' sm_90 GEMM operators with f16/bf16 inputs, an output of their type and
    f32 accumulation (read once per process).

    Returns:
        The operators, one per layout, tile and cluster.
    """
    found = []
    for op in co.get_operators(None, metadata_filter=lambda m: m.operator_class.__name__ == _OPERATOR,
                               target_sm="90a"):
        operands = op.metadata.operands
        types = [to_dtype(t) for t in (operands.A.dtype, operands.B.dtype, operands.out.dtype,
                                       operands.accumulator_type)]
        if types[0] in _DTYPES and types[0] == types[1] == types[2] and types[3] is DataType.f32:
            found.append(op)
    return tuple(found)


def _attributes(constraint: Any) -> TensorAttributes:
    return TensorAttributes(to_dtype(constraint.dtype), tuple(constraint.stride), constraint.divisibility)


def co_arguments(A: torch.Tensor, B: torch.Tensor, out: torch.Tensor) -> Any:
    """cutlass.operators' GemmArguments for kernel_api's operands.

    Args:
        A, B, out: the GEMM's operands (all rank 2 or all rank 3).

    Returns:
        ``cutlass.operators.GemmArguments`` with f32 accumulation.
    """
    return co.GemmArguments(A, B, out, torch.float32)


@CutlassOperatorsProvider.register
class CutlassOperatorsSm90Gemm(Kernel):
    """One cutlass.operators ``Sm90StaticPersistentGemmOperator`` (its layout, tile and cluster)."""

    supported_args_type = GemmArguments
    workspace_free = True
    # compile runs in this process even while tuning asks for cached artifacts only: the
    # operator's artifact lives in this process (there is no disk cache to fill from a worker)
    compiles_from_cache_only = True
    performance_hint = 0.9
    min_cc = 90

    def __init__(self, metadata: KernelMetadata, operator: Any = None) -> None:
        super().__init__(metadata)
        self.operator = operator

    @classmethod
    def generate_kernels(cls, metadata_filter: Any, epilogue_args: Any = None, cc: int | None = None) -> list:
        if epilogue_args is not None or (cc is not None and not 90 <= cc < 100):
            return []  # (sm_90a's wgmma: not on Blackwell)
        found = []
        for op in sm90_operators():
            operands = op.metadata.operands
            design = op.metadata.design
            ours = GemmOperandsMetadata(_attributes(operands.A), _attributes(operands.B), _attributes(operands.out),
                                        DataType.f32)
            layout = "".join(_LAYOUT[tuple(c.stride)] for c in (operands.A, operands.B, operands.out))
            tile = "x".join(map(str, design.tile_shape))
            cluster = "x".join(map(str, design.cluster_shape[:2]))
            name = f"{cls.__name__}_{ours.A.dtype}_{layout}_{tile}_c{cluster}_a16"
            metadata = KernelMetadata(name, cls, ours, min_cc=90, max_cc=99,
                                      design=BLASDesignMetadata(tuple(design.tile_shape), tuple(design.cluster_shape),
                                                                schedule="persistent"))
            if metadata_filter is None or metadata_filter(metadata):
                found.append(cls(metadata, op))
        return found

    def _supports(self, args: GemmArguments) -> Status:
        if args.A.dim() != args.B.dim():
            return Status.fail(f"operand B: rank {args.B.dim()} but A has rank {args.A.dim()}; cutlass.operators takes "
                               f"all rank 2 or all rank 3")
        status = self.operator.supports(co_arguments(args.A, args.B, args.out), target_sm="90a")
        if not status:
            return Status.fail(f"cutlass.operators refuses the operands: {status.error}")
        return Status.success()

    def get_workspace_size(self, args: Any) -> int:
        return 0

    def compile(self, args: Any, cc: int | None = None) -> CompiledArtifact:
        """The operator's compile for ``cc`` (default: the GPU's); needs the GPU (see the module docstring)."""
        if not torch.cuda.is_available():
            raise CompilationError(f"{self.metadata.kernel_name}: cutlass.operators' sm_90 GEMM reads the GPU's "
                                   f"active-cluster limit when it compiles; no GPU is present")
        target = cc if cc is not None else torch.cuda.get_device_capability()[0] * 10
        try:
            compiled = self.operator.compile(co_arguments(args.A, args.B, args.out), target_sm=f"{target}a")
        except Exception as exc:  # noqa: BLE001 - the operator's failure, said in one line
            raise CompilationError(f"{self.metadata.kernel_name}: cutlass.operators' compile failed: "
                                   f"{type(exc).__name__}: {exc}") from exc
        return CompiledArtifact(compiled, self)

    def _run(self, args: GemmArguments, artifact: CompiledArtifact, stream: Any, workspace: Any = None) -> None:
        self.operator.run(co_arguments(args.A, args.B, args.out), artifact.compiled_obj, stream=to_cuda_stream(stream),
                          assume_supported_args=True)

    def _launcher(self, args: GemmArguments, artifact: CompiledArtifact) -> Launcher | None:
        """The compiled TVM-FFI function itself where cutlass.operators compiled one (it takes
        ``(A, B, out, stream)``, the torch tensors as they are: what the operator's run passes),
        so `kernel_api.ops` can record it for the native replay; else a launch through the
        operator's ``run``."""
        operator, compiled = self.operator, artifact.compiled_obj
        function = getattr(compiled, "compiled_obj", None)
        if GlobalOptions().use_tvm_ffi and ffi_function(function) is not None:
            return Launcher(function)

        def launch(A: torch.Tensor, B: torch.Tensor, out: torch.Tensor, stream: Any) -> None:
            operator.run(co_arguments(A, B, out), compiled, stream=to_cuda_stream(stream), assume_supported_args=True)

        launch.__name__ = f"launch_{self.metadata.kernel_name}"
        return Launcher(launch)
