"""The torch provider's cross-entropy kernels: `TorchCrossEntropy` (forward, optionally with the
gradient), `TorchCrossEntropyReduced` (its mean or sum), `TorchCrossEntropyBackward` (from the
saved lse) and `TorchLinearCrossEntropy` (the fused linear loss, chunked).

They compute in f32 (f64 for f64 logits) with torch's operators, on any device (so the CPU tests
run the operations end to end). The row kernels run torch's own cross-entropy kernels, as
``F.cross_entropy`` and its autograd backward do: ``log_softmax`` and ``nll_loss`` for the loss
(the row's lse read off the log-probabilities: the row maximum less its log-probability, which
lies in [-log(classes), 0], so nothing cancels), ``nll_loss_backward`` and
``_log_softmax_backward_data`` for the gradient; label smoothing adds the rows' mean
log-probability. The z-loss's gradient takes `kernel_api.arguments.cross_entropy_math`'s
composite, where the math is written once. A 16-bit row is copied to f32 first: they are the
reference the CUDA kernels are compared with and the fallback for what those do not take, not
fast kernels. A mean or a sum adds the rows' losses with torch's sum. The row kernels' launches are one
function of the operands (`LaunchedKernel`), so `kernel_api.ops` replays repeated calls.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch
import torch.nn.functional as F

from ...arguments.cross_entropy import (REDUCED_HEAD, CrossEntropyArguments, CrossEntropyBackwardArguments,
                                        CrossEntropyReducedArguments, LinearCrossEntropyArguments)
from ...arguments.cross_entropy_math import compute_type, linear_cross_entropy_chunks, rows_gradient, rows_loss
from ...core.artifact import CompiledArtifact
from ...core.dtypes import DataType
from ...core.streams import stream_handle
from ...metadata import KernelMetadata, RowReductionDesignMetadata, TensorAttributes
from ...metadata.cross_entropy import (CrossEntropyBackwardOperandsMetadata, CrossEntropyOperandsMetadata,
                                       CrossEntropyReducedOperandsMetadata, LinearCrossEntropyOperandsMetadata)
from . import TorchProvider
from .base import TorchKernel
from .launch import LaunchedKernel, in_type, switch

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
    x = in_type(logits.reshape(rows, cols), compute_type(logits))
    t = target.reshape(rows)
    index = t if t.dtype is torch.int64 else t.long()
    logp = torch.log_softmax(x, -1)
    value = F.nll_loss(logp, index, ignore_index=ignore_index, reduction="none")
    ignored = t == ignore_index
    if label_smoothing:
        value = (1.0 - label_smoothing) * value - label_smoothing * logp.mean(-1).masked_fill_(ignored, 0)
    row_lse = lse.view(rows)
    torch.sub(x.amax(-1), logp.amax(-1), out=row_lse)  # (the row maximum's log-probability: no cancellation)
    row_lse.masked_fill_(ignored, 0)
    if z_loss:
        value = value + z_loss * row_lse.square()
    if grad_logits is not None:
        if z_loss:
            g = rows_gradient(x, t, row_lse, grad_loss.reshape(-1), ignore_index, label_smoothing, z_loss)
        else:
            g = _gradient(x, logp, index, grad_loss.reshape(-1), ignore_index, label_smoothing, ignored)
        grad_logits.copy_(g.view(grad_logits.shape))
    loss.copy_(value.view(loss.shape))


def _gradient(x: torch.Tensor, logp: torch.Tensor, index: torch.Tensor, grad_loss: torch.Tensor, ignore_index: int,
              label_smoothing: float, ignored: torch.Tensor) -> torch.Tensor:
    """The gradient of ``sum(grad_loss * loss)`` (no z-loss) with torch's own backward kernels
    of ``nll_loss`` and ``log_softmax``, in ``logp``'s type; label smoothing's share (each class
    ``-s / classes`` of the row's weight) is added to the log-probabilities' gradient."""
    w = in_type(grad_loss, logp.dtype)
    grad_logp = torch.ops.aten.nll_loss_backward(w, logp, index, None, 0, ignore_index, _unit(logp))
    if label_smoothing:
        share = w.masked_fill(ignored, 0).mul_(label_smoothing / x.shape[1]).unsqueeze(1)
        grad_logp = grad_logp.mul_(1.0 - label_smoothing).sub_(share)
    return torch._log_softmax_backward_data(grad_logp, logp, 1, logp.dtype)


_units: dict = {}


def _unit(like: torch.Tensor) -> torch.Tensor:
    """A 0-d one of ``like``'s type and device, kept: ``nll_loss_backward``'s total weight,
    which it checks but does not read without a reduction."""
    key = (like.dtype, like.device)
    found = _units.get(key)
    if found is None:
        found = _units[key] = torch.ones((), dtype=like.dtype, device=like.device)
    return found


def _cross_entropy_reduced(logits: torch.Tensor, target: torch.Tensor, loss: torch.Tensor, rows: int, cols: int,
                           ignore_index: int, label_smoothing: float, z_loss: float, reduction: str,
                           stream: Any) -> None:
    _reduced(logits, target, loss, None, None, rows, cols, ignore_index, label_smoothing, z_loss, reduction, stream)


def _cross_entropy_reduced_with_grad(logits: torch.Tensor, target: torch.Tensor, loss: torch.Tensor,
                                     grad_logits: torch.Tensor, grad_loss: torch.Tensor, rows: int, cols: int,
                                     ignore_index: int, label_smoothing: float, z_loss: float, reduction: str,
                                     stream: Any) -> None:
    _reduced(logits, target, loss, grad_logits, grad_loss, rows, cols, ignore_index, label_smoothing, z_loss,
             reduction, stream)


def _reduced(logits: torch.Tensor, target: torch.Tensor, loss: torch.Tensor, grad_logits: torch.Tensor | None,
             grad_loss: torch.Tensor | None, rows: int, cols: int, ignore_index: int, label_smoothing: float,
             z_loss: float, reduction: str, stream: Any) -> None:
    """The rows' losses (`_forward`) into the buffer's rows part, then their sum, or their mean
    over the rows not ignored (NaN when every row is, as torch's mean), into ``loss[0]``, and a
    row's weight into ``loss[1]`` (`CrossEntropyReducedArguments`' layout)."""
    context = None if stream is None else switch(logits, stream)
    if context is not None:
        with context:
            return _reduced(logits, target, loss, grad_logits, grad_loss, rows, cols, ignore_index, label_smoothing,
                            z_loss, reduction, None)
    per_row = loss[REDUCED_HEAD:]
    _forward(logits, target, per_row, loss.new_empty(rows), grad_logits, grad_loss, rows, cols, ignore_index,
             label_smoothing, z_loss, None)
    total = per_row.sum()
    loss[:REDUCED_HEAD].zero_()
    if reduction == "mean":
        count = (target.reshape(rows) != ignore_index).sum()
        total = total / count
        loss[1] = 1.0 / count.clamp(min=1).to(loss.dtype)
    else:
        loss[1] = 1.0
    loss[0] = total


def _cross_entropy_backward(grad_loss: torch.Tensor, logits: torch.Tensor, target: torch.Tensor, lse: torch.Tensor,
                            grad_logits: torch.Tensor, rows: int, cols: int, ignore_index: int,
                            label_smoothing: float, z_loss: float, stream: Any) -> None:
    context = None if stream is None else switch(logits, stream)
    if context is not None:
        with context:
            return _cross_entropy_backward(grad_loss, logits, target, lse, grad_logits, rows, cols, ignore_index,
                                           label_smoothing, z_loss, None)
    x, t = logits.reshape(rows, cols), target.reshape(rows)
    if z_loss:
        g = rows_gradient(x, t, lse.reshape(rows), grad_loss.reshape(-1), ignore_index, label_smoothing, z_loss)
    else:
        x = in_type(x, compute_type(logits))
        index = t if t.dtype is torch.int64 else t.long()
        ignored = (t == ignore_index) if label_smoothing else None
        g = _gradient(x, torch.log_softmax(x, -1), index, grad_loss.reshape(-1), ignore_index, label_smoothing,
                      ignored)
    grad_logits.copy_(g.view(grad_logits.shape))


def _row_constants(args: Any) -> tuple:
    return args.rows, args.cols, args.ignore_index, args.label_smoothing, args.z_loss


class _TorchCrossEntropyKernel(LaunchedKernel):
    """One instance per (floating type, index type); any vocabulary, any alignment. A family
    names its operands' metadata type (``operands_type``: its logits, targets and per-row or
    reduced loss or lse)."""

    performance_hint = 0.1
    operands_type: type

    @classmethod
    def _make_operands(cls, dt: DataType, it: DataType) -> Any:
        return cls.operands_type(TensorAttributes(dt, _ROWS, 1), TensorAttributes(it, _UNIT, 1),
                                 TensorAttributes(_loss_type(dt), _UNIT, 1), accumulator_type=_loss_type(dt))

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
    operands_type = CrossEntropyOperandsMetadata

    def _launch_parts(self, args: CrossEntropyArguments) -> tuple[Callable[..., None], tuple]:
        function = _cross_entropy if args.grad_logits is None else _cross_entropy_with_grad
        return function, _row_constants(args)


@TorchProvider.register
class TorchCrossEntropyReduced(_TorchCrossEntropyKernel):
    """The rows' mean or sum (and, with ``grad_logits``, the gradient) with torch's operators in f32."""

    supported_args_type = CrossEntropyReducedArguments
    operands_type = CrossEntropyReducedOperandsMetadata

    def _launch_parts(self, args: CrossEntropyReducedArguments) -> tuple[Callable[..., None], tuple]:
        function = _cross_entropy_reduced if args.grad_logits is None else _cross_entropy_reduced_with_grad
        return function, (*_row_constants(args), args.reduction)


@TorchProvider.register
class TorchCrossEntropyBackward(_TorchCrossEntropyKernel):
    """Cross-entropy's gradient from the saved lse, with torch's operators in f32."""

    supported_args_type = CrossEntropyBackwardArguments
    operands_type = CrossEntropyBackwardOperandsMetadata

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
