"""The torch provider's cross-entropy kernels: `TorchCrossEntropy` (forward, optionally with the
gradient), `TorchCrossEntropyBackward` (from the saved lse) and `TorchLinearCrossEntropy` (the
fused linear loss, chunked).

They compute in f32 (f64 for f64 logits) with torch's operators, on any device (so the CPU tests
run the operations end to end), as `kernel_api.arguments.cross_entropy_math` writes the math
once. They are the reference the CUDA kernels are compared with and the fallback for what those
do not take, not fast kernels: a 16-bit row is copied to f32 and read several times. The row
kernels' launches are one function of the operands (`LaunchedKernel`), so `kernel_api.ops`
replays repeated calls.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch

from ...arguments.cross_entropy import (CrossEntropyArguments, CrossEntropyBackwardArguments,
                                        LinearCrossEntropyArguments)
from ...arguments.cross_entropy_math import linear_cross_entropy_chunks, rows_gradient, rows_loss
from ...core.artifact import CompiledArtifact
from ...core.dtypes import DataType
from ...metadata import KernelMetadata, RowReductionDesignMetadata, TensorAttributes
from ...metadata.cross_entropy import (CrossEntropyBackwardOperandsMetadata, CrossEntropyOperandsMetadata,
                                       LinearCrossEntropyOperandsMetadata)
from . import TorchProvider
from .base import TorchKernel
from .launch import LaunchedKernel, switch

_FLOATS = (DataType.f16, DataType.bf16, DataType.f32, DataType.f64)
_INDEX = (DataType.i64, DataType.i32)
_ROWS, _UNIT = (0, 1), (1,)


def _stream_context(device: torch.device, stream: Any) -> Any:
    """The launch stream as torch's current one on CUDA (nothing to do on other devices)."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    if stream is None or isinstance(stream, torch.cuda.Stream):
        return torch.cuda.stream(stream)
    return torch.cuda.stream(torch.cuda.ExternalStream(stream_handle(stream)))


def _loss_type(dt: DataType) -> DataType:
    return DataType.f64 if dt is DataType.f64 else DataType.f32


# The launch functions: operands in the arguments' order (``tensor_attributes``), then the rows,
# the classes and the loss's scalars, then the stream.

def _cross_entropy(logits: torch.Tensor, target: torch.Tensor, loss: torch.Tensor, lse: torch.Tensor,
                   rows: int, cols: int, ignore_index: int, label_smoothing: float, z_loss: float,
                   stream: Any) -> None:
    _forward(logits, target, loss, lse, None, None, rows, cols, ignore_index, label_smoothing, z_loss, stream)


def _cross_entropy_with_grad(logits: torch.Tensor, target: torch.Tensor, loss: torch.Tensor, lse: torch.Tensor,
                             grad_logits: torch.Tensor, grad_loss: torch.Tensor, rows: int, cols: int,
                             ignore_index: int, label_smoothing: float, z_loss: float, stream: Any) -> None:
    _forward(logits, target, loss, lse, grad_logits, grad_loss, rows, cols, ignore_index, label_smoothing, z_loss,
             stream)


def _forward(logits: torch.Tensor, target: torch.Tensor, loss: torch.Tensor, lse: torch.Tensor,
             grad_logits: torch.Tensor | None, grad_loss: torch.Tensor | None, rows: int, cols: int,
             ignore_index: int, label_smoothing: float, z_loss: float, stream: Any) -> None:
    context = None if stream is None else switch(logits, stream)
    if context is not None:
        with context:
            return _forward(logits, target, loss, lse, grad_logits, grad_loss, rows, cols, ignore_index,
                            label_smoothing, z_loss, None)
    x = logits.reshape(rows, cols)
    t = target.reshape(rows)
    value, row_lse, _ = rows_loss(x, t, ignore_index, label_smoothing, z_loss)
    if grad_logits is not None:
        g = rows_gradient(x, t, row_lse, grad_loss.reshape(-1), ignore_index, label_smoothing, z_loss)
        grad_logits.copy_(g.view(grad_logits.shape))
    loss.copy_(value.view(loss.shape))
    lse.copy_(row_lse.view(lse.shape))


def _cross_entropy_backward(grad_loss: torch.Tensor, logits: torch.Tensor, target: torch.Tensor, lse: torch.Tensor,
                            grad_logits: torch.Tensor, rows: int, cols: int, ignore_index: int,
                            label_smoothing: float, z_loss: float, stream: Any) -> None:
    context = None if stream is None else switch(logits, stream)
    if context is not None:
        with context:
            return _cross_entropy_backward(grad_loss, logits, target, lse, grad_logits, rows, cols, ignore_index,
                                           label_smoothing, z_loss, None)
    g = rows_gradient(logits.reshape(rows, cols), target.reshape(rows), lse.reshape(rows), grad_loss.reshape(-1),
                      ignore_index, label_smoothing, z_loss)
    grad_logits.copy_(g.view(grad_logits.shape))


def _row_constants(args: Any) -> tuple:
    return args.rows, args.cols, args.ignore_index, args.label_smoothing, args.z_loss


class _TorchCrossEntropyKernel(LaunchedKernel):
    """One instance per (floating type, index type); any vocabulary, any alignment."""

    performance_hint = 0.1
    _make_operands: Callable[[DataType, DataType], Any]

    @classmethod
    def generate_kernels(cls, metadata_filter: Callable[[KernelMetadata], bool] | None, epilogue_args: Any = None,
                         cc: int | None = None) -> list["_TorchCrossEntropyKernel"]:
        if epilogue_args is not None:
            return []
        found = []
        for dt in _FLOATS:
            for it in _INDEX:
                name = f"{cls.__name__}_{dt}_{it}"
                metadata = KernelMetadata(name, cls, cls._make_operands(dt, it),
                                          design=RowReductionDesignMetadata("block", 1, 1, 1, None,
                                                                            extra=(("passes", 3),)))
                if metadata_filter is None or metadata_filter(metadata):
                    found.append(cls(metadata))
        return found


@TorchProvider.register
class TorchCrossEntropy(_TorchCrossEntropyKernel):
    """Per-row cross-entropy (and, with ``grad_logits``, its gradient) with torch's operators in f32."""

    supported_args_type = CrossEntropyArguments

    @staticmethod
    def _make_operands(dt: DataType, it: DataType) -> CrossEntropyOperandsMetadata:
        return CrossEntropyOperandsMetadata(TensorAttributes(dt, _ROWS, 1), TensorAttributes(it, _UNIT, 1),
                                            TensorAttributes(_loss_type(dt), _UNIT, 1),
                                            accumulator_type=_loss_type(dt))

    def _launch_parts(self, args: CrossEntropyArguments) -> tuple[Callable[..., None], tuple]:
        function = _cross_entropy if args.grad_logits is None else _cross_entropy_with_grad
        return function, _row_constants(args)


@TorchProvider.register
class TorchCrossEntropyBackward(_TorchCrossEntropyKernel):
    """Cross-entropy's gradient from the saved lse, with torch's operators in f32."""

    supported_args_type = CrossEntropyBackwardArguments

    @staticmethod
    def _make_operands(dt: DataType, it: DataType) -> CrossEntropyBackwardOperandsMetadata:
        return CrossEntropyBackwardOperandsMetadata(TensorAttributes(dt, _ROWS, 1), TensorAttributes(it, _UNIT, 1),
                                                    TensorAttributes(_loss_type(dt), _UNIT, 1),
                                                    accumulator_type=_loss_type(dt))

    def _launch_parts(self, args: CrossEntropyBackwardArguments) -> tuple[Callable[..., None], tuple]:
        return _cross_entropy_backward, _row_constants(args)


def _torch_rows(args: LinearCrossEntropyArguments) -> Callable[..., None]:
    """The chunk loop's per-row kernel in torch: loss, and the gradient in place of the logits."""
    def rows(logits: torch.Tensor, target: torch.Tensor, loss: torch.Tensor, grad_loss: Any) -> None:
        value, lse, _ = rows_loss(logits, target, args.ignore_index, args.label_smoothing, args.z_loss)
        if grad_loss is not None:
            logits.copy_(rows_gradient(logits, target, lse, grad_loss, args.ignore_index, args.label_smoothing,
                                       args.z_loss))
        loss.copy_(value)

    return rows


@TorchProvider.register
class TorchLinearCrossEntropy(TorchKernel):
    """The fused linear cross-entropy: torch's GEMMs over token chunks, the rows in f32 with
    torch's operators (`kernel_api.arguments.cross_entropy_math`)."""

    supported_args_type = LinearCrossEntropyArguments
    performance_hint = 0.5

    @classmethod
    def generate_kernels(cls, metadata_filter: Callable[[KernelMetadata], bool] | None, epilogue_args: Any = None,
                         cc: int | None = None) -> list["TorchLinearCrossEntropy"]:
        if epilogue_args is not None:
            return []
        found = []
        for dt in _FLOATS:
            for it in _INDEX:
                rows = TensorAttributes(dt, _ROWS, 1)
                operands = LinearCrossEntropyOperandsMetadata(rows, rows, TensorAttributes(it, _UNIT, 1),
                                                              TensorAttributes(_loss_type(dt), _UNIT, 1),
                                                              accumulator_type=_loss_type(dt))
                metadata = KernelMetadata(f"{cls.__name__}_{dt}_{it}", cls, operands)
                if metadata_filter is None or metadata_filter(metadata):
                    found.append(cls(metadata))
        return found

    def estimated_cost(self, args: Any, sm_count: int) -> float:
        return linear_cost(args) / self.performance_hint

    def _run(self, args: LinearCrossEntropyArguments, artifact: CompiledArtifact, stream: Any,
             workspace: Any = None) -> None:
        with _stream_context(args.device, stream):
            linear_cross_entropy_chunks(args, _torch_rows(args))


def linear_cost(args: Any) -> float:
    """The fused linear cross-entropy's GEMM work relative to its logits' bytes (the row-wise
    cost model's unit): the GEMMs dominate, one for the logits and one per gradient of the
    hidden states or the weight."""
    gemms = 1 + (args.grad_hidden is not None) + (args.grad_weight is not None)
    return 1.0 + gemms * args.cols / 64.0
