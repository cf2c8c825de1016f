"""The torch provider's norm kernels: `TorchRMSNorm`, `TorchLayerNorm` and their backwards.

They compute in f32 (f64 for f64 operands) with torch's own operators, on any device (so the
CPU tests run the operations end to end), and write into the arguments' outputs. One instance
per element type of x and weight: weight of x's type, or f32 weights under 16-bit activations.
Any row length, any alignment, with or without the fused residual add. They are the reference
every fused norm kernel is compared with, not fast kernels: a 16-bit forward makes several
passes over f32 copies of the rows. The backwards run torch's own norm kernels where torch has
them (``native_layer_norm`` and its backward; ``_fused_rms_norm`` and its backward where it has
a kernel for the device, CUDA), the statistics recomputed in the compute type; elsewhere a
composite of torch's operators. Each launch is one function of the operands (`_forward`,
`_gradients` through the per-variant functions below), so `kernel_api.ops` replays repeated
calls (`LaunchedKernel`).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F

from ...arguments.norm import (LayerNormArguments, LayerNormBackwardArguments, RMSNormArguments,
                               RMSNormBackwardArguments)
from ...core.dtypes import DataType
from ...metadata import KernelMetadata, RowReductionDesignMetadata, TensorAttributes
from ...metadata.norm import (LayerNormBackwardOperandsMetadata, LayerNormOperandsMetadata,
                              RMSNormBackwardOperandsMetadata, RMSNormOperandsMetadata)
from . import TorchProvider
from .launch import LaunchedKernel, in_type, switch

# (x's type, weight's type): same types, and f32 weights under 16-bit activations
_TYPES = ((DataType.f16, DataType.f16), (DataType.bf16, DataType.bf16), (DataType.f32, DataType.f32),
          (DataType.f64, DataType.f64), (DataType.f16, DataType.f32), (DataType.bf16, DataType.f32))
_ROWS = (0, 1)
_VECTOR = (1,)


def _compute_type(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _normalised(s: torch.Tensor, eps: float, centred: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(s_hat, rstd) per row of ``s`` (already in the compute type)."""
    if centred:
        s = s - s.mean(-1, keepdim=True)
    rstd = torch.rsqrt(s.square().mean(-1, keepdim=True) + eps)
    return s * rstd, rstd


def _forward(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, bias: torch.Tensor | None,
             out: torch.Tensor, residual_out: torch.Tensor | None, eps: float, stream: Any) -> None:
    """The forward norm (LayerNorm with ``bias``, else RMSNorm), on ``stream``."""
    context = None if stream is None else switch(x, stream)
    if context is not None:
        with context:
            return _forward(x, residual, weight, bias, out, residual_out, eps, None)
    ct = _compute_type(x)
    s = in_type(x, ct)
    if residual is not None:
        s = s + in_type(residual, ct)
        residual_out.copy_(s)
    w = in_type(weight, ct)
    if bias is not None:
        y = F.layer_norm(s, (x.shape[-1],), w, in_type(bias, ct), eps)
    else:
        y = F.rms_norm(s, (x.shape[-1],), w, eps)
    out.copy_(y)


# The launch functions, operands in the arguments' order (``tensor_attributes``), then eps.
def _rms_norm(x: Any, weight: Any, out: Any, eps: float, stream: Any) -> None:
    _forward(x, None, weight, None, out, None, eps, stream)


def _rms_norm_residual(x: Any, residual: Any, weight: Any, out: Any, residual_out: Any, eps: float,
                       stream: Any) -> None:
    _forward(x, residual, weight, None, out, residual_out, eps, stream)


def _layer_norm(x: Any, weight: Any, bias: Any, out: Any, eps: float, stream: Any) -> None:
    _forward(x, None, weight, bias, out, None, eps, stream)


def _layer_norm_residual(x: Any, residual: Any, weight: Any, bias: Any, out: Any, residual_out: Any, eps: float,
                         stream: Any) -> None:
    _forward(x, residual, weight, bias, out, residual_out, eps, stream)


def _gradients(grad_out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, grad_x: torch.Tensor,
              grad_weight: torch.Tensor, grad_bias: torch.Tensor | None, eps: float, centred: bool,
              stream: Any) -> None:
    """The norms' gradients (LayerNorm's when ``centred``), the statistics recomputed from x."""
    context = None if stream is None else switch(x, stream)
    if context is not None:
        with context:
            return _gradients(grad_out, x, weight, grad_x, grad_weight, grad_bias, eps, centred, None)
    ct = _compute_type(x)
    if centred or (x.is_cuda and _FUSED_RMS_ON_CUDA):
        return _fused_gradients(in_type(grad_out, ct), in_type(x, ct), in_type(weight, ct), grad_x, grad_weight,
                                grad_bias, eps, centred)
    x_hat, rstd = _normalised(in_type(x, ct), eps, centred)
    dy = in_type(grad_out, ct)
    g = dy * in_type(weight, ct)
    dx = g - x_hat * (g * x_hat).mean(-1, keepdim=True)
    if centred:
        dx = dx - g.mean(-1, keepdim=True)
    grad_x.copy_(dx * rstd)
    reduce = tuple(range(x.dim() - 1))
    grad_weight.copy_((dy * x_hat).sum(reduce) if reduce else dy * x_hat)
    if grad_bias is not None:
        grad_bias.copy_(dy.sum(reduce) if reduce else dy)


#: Whether torch has a CUDA kernel for RMSNorm's backward (``_fused_rms_norm_backward``).
_FUSED_RMS_ON_CUDA = (hasattr(torch.ops.aten, "_fused_rms_norm_backward")
                      and torch._C._dispatch_has_kernel_for_dispatch_key("aten::_fused_rms_norm", "CUDA")
                      and torch._C._dispatch_has_kernel_for_dispatch_key("aten::_fused_rms_norm_backward", "CUDA"))


def _fused_gradients(dy: torch.Tensor, x: torch.Tensor, w: torch.Tensor, grad_x: torch.Tensor,
                     grad_weight: torch.Tensor, grad_bias: torch.Tensor | None, eps: float, centred: bool) -> None:
    """`_gradients` with torch's own norm kernels, the operands in the compute type: the forward
    kernel for the row statistics, then its backward kernel."""
    shape = [x.shape[-1]]
    if centred:
        _, mean, rstd = torch.native_layer_norm(x, shape, None, None, eps)
        # (the bias's values take no part in the gradients: the weight stands in for its shape)
        dx, dw, db = torch.ops.aten.native_layer_norm_backward(dy, x, shape, mean, rstd, w, w,
                                                               [True, True, grad_bias is not None])
        if grad_bias is not None:
            grad_bias.copy_(db)
    else:
        _, rstd = torch.ops.aten._fused_rms_norm(x, shape, None, eps)
        dx, dw = torch.ops.aten._fused_rms_norm_backward(dy, x, shape, rstd, w, [True, True])
    grad_x.copy_(dx)
    grad_weight.copy_(dw)


def _rms_norm_backward(grad_out: Any, x: Any, weight: Any, grad_x: Any, grad_weight: Any, eps: float,
                       stream: Any) -> None:
    _gradients(grad_out, x, weight, grad_x, grad_weight, None, eps, False, stream)


def _layer_norm_backward(grad_out: Any, x: Any, weight: Any, grad_x: Any, grad_weight: Any, grad_bias: Any,
                         eps: float, stream: Any) -> None:
    _gradients(grad_out, x, weight, grad_x, grad_weight, grad_bias, eps, True, stream)


class _TorchNormKernel(LaunchedKernel):
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
    #: (without, with) the fused residual add
    _functions: tuple[Callable[..., None], Callable[..., None]]

    def _launch_parts(self, args: Any) -> tuple[Callable[..., None], tuple]:
        return self._functions[args.residual is not None], (args.eps,)


class _TorchNormBackward(_TorchNormKernel):
    _backward = True
    _function: Callable[..., None]

    def _launch_parts(self, args: Any) -> tuple[Callable[..., None], tuple]:
        return self._function, (args.eps,)


@TorchProvider.register
class TorchRMSNorm(_TorchNormForward):
    """RMSNorm (optionally fused with the residual add) with ``torch.nn.functional.rms_norm`` in f32."""

    supported_args_type = RMSNormArguments
    _operands_type = RMSNormOperandsMetadata
    _functions = (_rms_norm, _rms_norm_residual)


@TorchProvider.register
class TorchLayerNorm(_TorchNormForward):
    """LayerNorm (optionally fused with the residual add) with ``torch.nn.functional.layer_norm`` in f32."""

    supported_args_type = LayerNormArguments
    _operands_type = LayerNormOperandsMetadata
    _functions = (_layer_norm, _layer_norm_residual)


@TorchProvider.register
class TorchRMSNormBackward(_TorchNormBackward):
    """RMSNorm's gradients in f32, the row statistics recomputed from x."""

    supported_args_type = RMSNormBackwardArguments
    _operands_type = RMSNormBackwardOperandsMetadata
    _function = staticmethod(_rms_norm_backward)


@TorchProvider.register
class TorchLayerNormBackward(_TorchNormBackward):
    """LayerNorm's gradients in f32, the row statistics recomputed from x."""

    supported_args_type = LayerNormBackwardArguments
    _operands_type = LayerNormBackwardOperandsMetadata
    _function = staticmethod(_layer_norm_backward)
