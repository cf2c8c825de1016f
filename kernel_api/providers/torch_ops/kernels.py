"""The torch provider's kernels: `TorchGemm`, `TorchSoftmax`, `TorchSoftmaxBackward`.

Each instance covers one dtype (f16, bf16, f32, f64) and, for GEMM, one layout of each of A,
B and out (row- or column-major), at any alignment (divisibility 1): metadata matches layouts
exactly, so the 32 GEMM instances together take every operand GemmArguments accepts. torch
picks its own algorithm per call, so an instance is one entry in a tuning table, not a design.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch

from ...arguments import GemmArguments, SoftmaxArguments, SoftmaxBackwardArguments
from ...core.artifact import CompiledArtifact
from ...core.dtypes import DataType
from ...core.status import Status
from ...core.streams import stream_handle
from ...kernel import Kernel
from ...metadata import (BLASDesignMetadata, EpilogueMetadata, GemmOperandsMetadata, KernelMetadata, RowReductionDesignMetadata,
                         SoftmaxBackwardOperandsMetadata, SoftmaxOperandsMetadata, TensorAttributes)
from . import TorchProvider

_DTYPES = (DataType.f16, DataType.bf16, DataType.f32, DataType.f64)
# torch's accumulators: f32 for the half types and f32, f64 for f64
_ACCUMULATOR = {DataType.f16: DataType.f32, DataType.bf16: DataType.f32, DataType.f32: DataType.f32,
                DataType.f64: DataType.f64}
_LAYOUTS = {"t": (0, 0, 1), "n": (0, 1, 0)}  # row-major, column-major (GemmArguments' only patterns)
_TORCH_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "relu": torch.relu,
    "gelu": lambda z: torch.nn.functional.gelu(z, approximate="tanh"),  # the epilogue's gelu
    "silu": torch.nn.functional.silu,
}

# PickAny's model of cuBLAS in `kernel_api.tuning.policies.gemm_cost` units: the tile model at
# this efficiency, with the cheapest of a few cuBLAS-like tiles. 0.3 lies between our SIMT
# family (0.05: 0.13-0.19x cuBLAS on the H200) and our tensor-core families (Sm80 0.55,
# Sm90 1.0), so PickAny keeps our tensor-core kernels wherever one fits and prefers cuBLAS
# to the SIMT fallback; PickBest measures them all.
TORCH_GEMM_HINT = 0.3
_TILES = ((64, 64), (128, 128), (128, 256))
# torch chooses its algorithm (and tile) per call: tile (0, 0, 0) says "none fixed", so
# metadata filters on tile sizes pass these instances over.
_LIBRARY = BLASDesignMetadata(tile_shape=(0, 0, 0), schedule="library")


def _torch_stream(stream: Any) -> Any:
    """A torch stream context for any stream spelling kernel_api accepts (None: the current one)."""
    if stream is None or isinstance(stream, torch.cuda.Stream):
        return torch.cuda.stream(stream)
    return torch.cuda.stream(torch.cuda.ExternalStream(stream_handle(stream)))


class _TorchKernel(Kernel):
    """Common to the torch kernels: nothing to compile, no workspace, no fast-path launcher
    (every launch is a torch call through ``_run``)."""

    workspace_free = True

    def compile(self, args: Any, cc: int | None = None) -> CompiledArtifact:
        return CompiledArtifact(None, self)

    def get_workspace_size(self, args: Any) -> int:
        return 0

    def _supports(self, args: Any) -> Status:
        return Status.success()


@TorchProvider.register
class TorchGemm(_TorchKernel):
    """``out = activation(alpha * A @ B + beta * C + bias)`` with torch (cuBLAS / cuBLASLt)."""

    supported_args_type = GemmArguments
    performance_hint = TORCH_GEMM_HINT

    @classmethod
    def generate_kernels(cls, metadata_filter: Callable[[KernelMetadata], bool] | None, epilogue_args: Any = None,
                         cc: int | None = None) -> list["TorchGemm"]:
        found = []
        for dt in _DTYPES:
            for a in _LAYOUTS:
                for b in _LAYOUTS:
                    for o in _LAYOUTS:
                        operands = GemmOperandsMetadata(TensorAttributes(dt, _LAYOUTS[a], 1),
                                                        TensorAttributes(dt, _LAYOUTS[b], 1),
                                                        TensorAttributes(dt, _LAYOUTS[o], 1), _ACCUMULATOR[dt])
                        metadata = KernelMetadata(f"TorchGemm_{dt}_{a}{b}{o}", cls, operands, design=_LIBRARY,
                                                  epilogue=EpilogueMetadata())
                        if metadata_filter is None or metadata_filter(metadata):
                            found.append(cls(metadata))
        return found

    def estimated_cost(self, args: GemmArguments, sm_count: int) -> float:
        """The tile model of `gemm_cost` at `TORCH_GEMM_HINT`, with the cheapest tile of `_TILES`."""
        best = math.inf
        for tm, tn in _TILES:
            tiles = math.ceil(args.M / tm) * math.ceil(args.N / tn) * args.L
            intensity = tm * tn / (tm + tn)
            efficiency = TORCH_GEMM_HINT * intensity / (intensity + 32)
            best = min(best, math.ceil(tiles / max(sm_count, 1)) * tm * tn * max(args.K, 1) / efficiency)
        return best

    def _run(self, args: GemmArguments, artifact: CompiledArtifact, stream: Any, workspace: Any = None) -> None:
        A, B, out, epilogue = args.A, args.B, args.out, args.epilogue
        with _torch_stream(stream):
            if epilogue is None:
                torch.matmul(A, B, out=out)
                return
            alpha, beta, bias, activation = epilogue.alpha, epilogue.beta, epilogue.bias, epilogue.activation
            plain_scale = alpha == 1.0 and beta == 0.0
            if (A.dim() == 2 and plain_scale and bias is not None and epilogue.bias_kind == "row"
                    and activation in (None, "relu", "gelu")):
                # cuBLASLt's bias (+ relu / tanh-gelu) epilogues
                if activation is None:
                    torch.addmm(bias, A, B, out=out)
                else:
                    torch._addmm_activation(bias, A, B, use_gelu=activation == "gelu", out=out)
                return
            z = torch.matmul(A, B)
            if alpha != 1.0:
                z.mul_(alpha)
            if beta != 0.0:
                z.add_(epilogue.C, alpha=beta)
            if bias is not None:
                z.add_(bias if epilogue.bias_kind == "row" else bias.unsqueeze(-1))
            if activation is not None:
                z = _TORCH_ACTIVATIONS[activation](z)
            out.copy_(z)


def _row_design() -> RowReductionDesignMetadata:
    return RowReductionDesignMetadata("block", 1, 1, 1, None)


@TorchProvider.register
class TorchSoftmax(_TorchKernel):
    """``softmax(x)`` over the last dimension with ``torch._softmax``."""

    supported_args_type = SoftmaxArguments
    # Below every softmax of ours in PickAny's row_cost (theirs stays under 24 = 12 / 0.5).
    performance_hint = 0.02

    @classmethod
    def generate_kernels(cls, metadata_filter: Callable[[KernelMetadata], bool] | None, epilogue_args: Any = None,
                         cc: int | None = None) -> list["TorchSoftmax"]:
        if epilogue_args is not None:
            return []
        found = []
        for dt in _DTYPES:
            attrs = TensorAttributes(dt, (0, 1), 1)
            metadata = KernelMetadata(f"TorchSoftmax_{dt}", cls, SoftmaxOperandsMetadata(attrs, attrs, _ACCUMULATOR[dt]),
                                      design=_row_design())
            if metadata_filter is None or metadata_filter(metadata):
                found.append(cls(metadata))
        return found

    def _run(self, args: SoftmaxArguments, artifact: CompiledArtifact, stream: Any, workspace: Any = None) -> None:
        with _torch_stream(stream):
            torch._softmax(args.x, -1, False, out=args.out)


_softmax_backward_out = torch.ops.aten._softmax_backward_data.out


@TorchProvider.register
class TorchSoftmaxBackward(_TorchKernel):
    """The gradient of softmax with ``torch._softmax_backward_data``."""

    supported_args_type = SoftmaxBackwardArguments
    performance_hint = 0.02

    @classmethod
    def generate_kernels(cls, metadata_filter: Callable[[KernelMetadata], bool] | None, epilogue_args: Any = None,
                         cc: int | None = None) -> list["TorchSoftmaxBackward"]:
        if epilogue_args is not None:
            return []
        found = []
        for dt in _DTYPES:
            attrs = TensorAttributes(dt, (0, 1), 1)
            operands = SoftmaxBackwardOperandsMetadata(attrs, attrs, attrs, _ACCUMULATOR[dt])
            metadata = KernelMetadata(f"TorchSoftmaxBackward_{dt}", cls, operands, design=_row_design())
            if metadata_filter is None or metadata_filter(metadata):
                found.append(cls(metadata))
        return found

    def _run(self, args: SoftmaxBackwardArguments, artifact: CompiledArtifact, stream: Any,
             workspace: Any = None) -> None:
        with _torch_stream(stream):
            # (the out= overload names its output grad_input; torch._softmax_backward_data takes no out=)
            _softmax_backward_out(args.grad_out, args.out, -1, args.out.dtype, grad_input=args.grad_in)
