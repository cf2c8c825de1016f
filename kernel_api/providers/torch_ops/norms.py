"""The torch provider's norm kernels: `TorchRMSNorm`, `TorchLayerNorm` and their backwards.

They compute in f32 (f64 for f64 operands) with torch's own operators, on any device (so the
CPU tests run the operations end to end), and write into the arguments' outputs. One instance
per element type of x and weight: weight of x's type, or f32 weights under 16-bit activations.
Any row length, any alignment, with or without the fused residual add. They are the reference
every fused norm kernel is compared with, not fast kernels: a 16-bit forward makes several
passes over f32 copies of the rows.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch
import torch.nn.functional as F

from ...arguments.norm import (LayerNormArguments, LayerNormBackwardArguments, RMSNormArguments,
                               RMSNormBackwardArguments)
from ...core.artifact import CompiledArtifact
from ...core.dtypes import DataType
from ...core.streams import stream_handle
from ...metadata import KernelMetadata, RowReductionDesignMetadata, TensorAttributes
from ...metadata.norm import (LayerNormBackwardOperandsMetadata, LayerNormOperandsMetadata,
                              RMSNormBackwardOperandsMetadata, RMSNormOperandsMetadata)
from . import TorchProvider
from .base import TorchKernel

# (x's type, weight's type): same types, and f32 weights under 16-bit activations
_TYPES = ((DataType.f16, DataType.f16), (DataType.bf16, DataType.bf16), (DataType.f32, DataType.f32),
          (DataType.f64, DataType.f64), (DataType.f16, DataType.f32), (DataType.bf16, DataType.f32))
_ROWS = (0, 1)
_VECTOR = (1,)


def _stream_context(device: torch.device, stream: Any) -> Any:
    """The launch stream as torch's current one on CUDA (nothing to do on other devices)."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    if stream is None or isinstance(stream, torch.cuda.Stream):
        return torch.cuda.stream(stream)
    return torch.cuda.stream(torch.cuda.ExternalStream(stream_handle(stream)))


def _compute_type(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _normalised(s: torch.Tensor, eps: float, centred: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(s_hat, rstd) per row of ``s`` (already in the compute type)."""
    if centred:
        s = s - s.mean(-1, keepdim=True)
    rstd = torch.rsqrt(s.square().mean(-1, keepdim=True) + eps)
    return s * rstd, rstd


class _TorchNormKernel(TorchKernel):
    """Common to the norm kernels: every row length."""

    performance_hint = 0.02
    _operands_type: Callable[..., Any]
    _backward = False

    @classmethod
    def generate_kernels(cls, metadata_filter: Callable[[KernelMetadata], bool] | None, epilogue_args: Any = None,
                         cc: int | None = None) -> list["_TorchNormKernel"]:
        if epilogue_args is not None:
            return []
        found = []
        for x_type, w_type in _TYPES:
            rows, vector = TensorAttributes(x_type, _ROWS, 1), TensorAttributes(w_type, _VECTOR, 1)
            accumulator = DataType.f64 if x_type is DataType.f64 else DataType.f32
            if cls._backward:
                operands = cls._operands_type(rows, rows, vector, rows, accumulator_type=accumulator)
            else:
                operands = cls._operands_type(rows, vector, rows, accumulator_type=accumulator)
            name = f"{cls.__name__}_{x_type}" + (f"_w{w_type}" if w_type is not x_type else "")
            metadata = KernelMetadata(name, cls, operands, design=RowReductionDesignMetadata("block", 1, 1, 1, None))
            if metadata_filter is None or metadata_filter(metadata):
                found.append(cls(metadata))
        return found

class _TorchNormForward(_TorchNormKernel):
    centred = False

    def _run(self, args: Any, artifact: CompiledArtifact, stream: Any, workspace: Any = None) -> None:
        with _stream_context(args.device, stream):
            ct = _compute_type(args.x)
            s = args.x.to(ct)
            if args.residual is not None:
                s = s + args.residual.to(ct)
                args.residual_out.copy_(s)
            weight = args.weight.to(ct)
            if self.centred:
                y = F.layer_norm(s, (args.cols,), weight, args.bias.to(ct), args.eps)
            else:
                y = F.rms_norm(s, (args.cols,), weight, args.eps)
            args.out.copy_(y)


class _TorchNormBackward(_TorchNormKernel):
    _backward = True
    centred = False

    def _run(self, args: Any, artifact: CompiledArtifact, stream: Any, workspace: Any = None) -> None:
        with _stream_context(args.device, stream):
            ct = _compute_type(args.x)
            x_hat, rstd = _normalised(args.x.to(ct), args.eps, self.centred)
            dy = args.grad_out.to(ct)
            g = dy * args.weight.to(ct)
            dx = g - x_hat * (g * x_hat).mean(-1, keepdim=True)
            if self.centred:
                dx = dx - g.mean(-1, keepdim=True)
            args.grad_x.copy_(dx * rstd)
            reduce = tuple(range(args.x.dim() - 1))
            args.grad_weight.copy_((dy * x_hat).sum(reduce) if reduce else dy * x_hat)
            if args.grad_bias is not None:
                args.grad_bias.copy_(dy.sum(reduce) if reduce else dy)


@TorchProvider.register
class TorchRMSNorm(_TorchNormForward):
    """RMSNorm (optionally fused with the residual add) with ``torch.nn.functional.rms_norm`` in f32."""

    supported_args_type = RMSNormArguments
    _operands_type = RMSNormOperandsMetadata


@TorchProvider.register
class TorchLayerNorm(_TorchNormForward):
    """LayerNorm (optionally fused with the residual add) with ``torch.nn.functional.layer_norm`` in f32."""

    supported_args_type = LayerNormArguments
    _operands_type = LayerNormOperandsMetadata
    centred = True


@TorchProvider.register
class TorchRMSNormBackward(_TorchNormBackward):
    """RMSNorm's gradients in f32, the row statistics recomputed from x."""

    supported_args_type = RMSNormBackwardArguments
    _operands_type = RMSNormBackwardOperandsMetadata


@TorchProvider.register
class TorchLayerNormBackward(_TorchNormBackward):
    """LayerNorm's gradients in f32, the row statistics recomputed from x."""

    supported_args_type = LayerNormBackwardArguments
    _operands_type = LayerNormBackwardOperandsMetadata
    centred = True
