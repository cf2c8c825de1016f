"""``ops.rms_norm`` and ``ops.layer_norm``: the row norms, forward and backward, optionally
fused with the residual add, as torch ops generated from `Operation` descriptions.

Six ops: ``kernel_api::rms_norm``, ``rms_norm_residual`` and ``rms_norm_backward``, and the
same for ``layer_norm``. The residual forms take ``(x, residual, ...)`` and return ``(y, s)``
with ``s = x + residual`` (kept for the next layer) and ``y`` the norm of ``s``. The backwards
recompute the row statistics from the normalised input (``x``, or ``s`` with a residual;
`kernel_api.arguments.norm` says why), so the forwards save no ``rstd``.
"""

from __future__ import annotations

from typing import Any

import torch

from ..arguments.norm import (LayerNormArguments, LayerNormBackwardArguments, RMSNormArguments,
                              RMSNormBackwardArguments)
from .operation import Operation, define_operation


def _like_x(x: torch.Tensor, *rest: Any) -> torch.Tensor:
    return x.new_empty(x.shape)


def _like_x_twice(x: torch.Tensor, *rest: Any) -> tuple[torch.Tensor, torch.Tensor]:
    return x.new_empty(x.shape), x.new_empty(x.shape)


# (fakes take eps in *rest: torch passes them only the arguments the caller gave)
def _rms_backward_fake(grad_out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                       *rest: Any) -> tuple[torch.Tensor, torch.Tensor]:
    return x.new_empty(x.shape), weight.new_empty(weight.shape)


def _layer_backward_fake(grad_out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                         *rest: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return x.new_empty(x.shape), weight.new_empty(weight.shape), weight.new_empty(weight.shape)


# ---- the arguments of each op: inputs in schema order, outputs by name ----

def _rms_args(x: torch.Tensor, weight: torch.Tensor, eps: float, *, out: torch.Tensor) -> RMSNormArguments:
    return RMSNormArguments(x, weight, out, eps=eps)


def _rms_residual_args(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, *,
                       out: torch.Tensor, residual_out: torch.Tensor) -> RMSNormArguments:
    return RMSNormArguments(x, weight, out, eps=eps, residual=residual, residual_out=residual_out)


def _rms_backward_args(grad_out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float, *,
                       grad_x: torch.Tensor, grad_weight: torch.Tensor) -> RMSNormBackwardArguments:
    return RMSNormBackwardArguments(grad_out, x, weight, grad_x, grad_weight, eps=eps)


def _layer_args(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float, *,
                out: torch.Tensor) -> LayerNormArguments:
    return LayerNormArguments(x, weight, bias, out, eps=eps)


def _layer_residual_args(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                         eps: float, *, out: torch.Tensor, residual_out: torch.Tensor) -> LayerNormArguments:
    return LayerNormArguments(x, weight, bias, out, eps=eps, residual=residual, residual_out=residual_out)


def _layer_backward_args(grad_out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float, *,
                         grad_x: torch.Tensor, grad_weight: torch.Tensor,
                         grad_bias: torch.Tensor) -> LayerNormBackwardArguments:
    return LayerNormBackwardArguments(grad_out, x, weight, grad_x, grad_weight, grad_bias, eps=eps)


# ---- backwards, written with the backward ops ----

def _rms_backward(saved: Any, grad: torch.Tensor) -> tuple:
    grad_x, grad_weight = rms_norm_backward(grad.contiguous(), saved.x, saved.weight, saved.eps)
    return grad_x, grad_weight, None


def _rms_residual_backward(saved: Any, grad: torch.Tensor, grad_sum: torch.Tensor) -> tuple:
    grad_s, grad_weight = rms_norm_backward(grad.contiguous(), saved.residual_out, saved.weight, saved.eps)
    grad_s = grad_s + grad_sum  # s feeds the norm and is returned: both gradients reach x and residual
    return grad_s, grad_s, grad_weight, None


def _layer_backward(saved: Any, grad: torch.Tensor) -> tuple:
    grad_x, grad_weight, grad_bias = layer_norm_backward(grad.contiguous(), saved.x, saved.weight, saved.eps)
    return grad_x, grad_weight, grad_bias, None


def _layer_residual_backward(saved: Any, grad: torch.Tensor, grad_sum: torch.Tensor) -> tuple:
    grad_s, grad_weight, grad_bias = layer_norm_backward(grad.contiguous(), saved.residual_out, saved.weight,
                                                         saved.eps)
    grad_s = grad_s + grad_sum
    return grad_s, grad_s, grad_weight, grad_bias, None


RMS_NORM = Operation(name="kernel_api::rms_norm", schema="(Tensor x, Tensor weight, float eps=1e-06) -> Tensor",
                     arguments=_rms_args, outputs=("out",), fake=_like_x, backward=_rms_backward,
                     saved=("x", "weight", "eps"))
RMS_NORM_RESIDUAL = Operation(
    name="kernel_api::rms_norm_residual",
    schema="(Tensor x, Tensor residual, Tensor weight, float eps=1e-06) -> (Tensor, Tensor)",
    arguments=_rms_residual_args, outputs=("out", "residual_out"), fake=_like_x_twice,
    backward=_rms_residual_backward, saved=("residual_out", "weight", "eps"))
RMS_NORM_BACKWARD = Operation(
    name="kernel_api::rms_norm_backward",
    schema="(Tensor grad_out, Tensor x, Tensor weight, float eps=1e-06) -> (Tensor, Tensor)",
    arguments=_rms_backward_args, outputs=("grad_x", "grad_weight"), fake=_rms_backward_fake)
LAYER_NORM = Operation(
    name="kernel_api::layer_norm", schema="(Tensor x, Tensor weight, Tensor bias, float eps=1e-05) -> Tensor",
    arguments=_layer_args, outputs=("out",), fake=_like_x, backward=_layer_backward, saved=("x", "weight", "eps"))
LAYER_NORM_RESIDUAL = Operation(
    name="kernel_api::layer_norm_residual",
    schema="(Tensor x, Tensor residual, Tensor weight, Tensor bias, float eps=1e-05) -> (Tensor, Tensor)",
    arguments=_layer_residual_args, outputs=("out", "residual_out"), fake=_like_x_twice,
    backward=_layer_residual_backward, saved=("residual_out", "weight", "eps"))
LAYER_NORM_BACKWARD = Operation(
    name="kernel_api::layer_norm_backward",
    schema="(Tensor grad_out, Tensor x, Tensor weight, float eps=1e-05) -> (Tensor, Tensor, Tensor)",
    arguments=_layer_backward_args, outputs=("grad_x", "grad_weight", "grad_bias"), fake=_layer_backward_fake)

_rms_norm = define_operation(RMS_NORM)
_rms_norm_residual = define_operation(RMS_NORM_RESIDUAL)
#: ``rms_norm_backward(grad_out, x, weight, eps=1e-6, *, grad_x=None, grad_weight=None, stream=None)``
#: -> ``(grad_x, grad_weight)``, the row statistics recomputed from ``x``.
rms_norm_backward = define_operation(RMS_NORM_BACKWARD)
_layer_norm = define_operation(LAYER_NORM)
_layer_norm_residual = define_operation(LAYER_NORM_RESIDUAL)
#: ``layer_norm_backward(grad_out, x, weight, eps=1e-5, *, grad_x=None, grad_weight=None,
#: grad_bias=None, stream=None)`` -> ``(grad_x, grad_weight, grad_bias)``.
layer_norm_backward = define_operation(LAYER_NORM_BACKWARD)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, residual: torch.Tensor | None = None, *,
             out: torch.Tensor | None = None, residual_out: torch.Tensor | None = None, stream: Any = None) -> Any:
    """RMSNorm over the last dimension, optionally after the residual add.

    Args:
        x: the rows (last dimension), any leading dimensions.
        weight: 1-D, the row length.
        eps: added to the mean square.
        residual: optional, x's shape and dtype: the norm is of ``s = x + residual``.
        out, residual_out: optional tensors to write ``y`` and ``s`` into (allocated when None).
        stream: the stream to launch on (None: the current one).

    Returns:
        ``y = s / sqrt(mean(s**2) + eps) * weight``; with ``residual``, ``(y, s)``.
    """
    if residual is None:
        if residual_out is not None:
            raise ValueError("operand residual_out: given without residual")
        return _rms_norm(x, weight, eps, out=out, stream=stream)
    return _rms_norm_residual(x, residual, weight, eps, out=out, residual_out=residual_out, stream=stream)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float = 1e-5,
               residual: torch.Tensor | None = None, *, out: torch.Tensor | None = None,
               residual_out: torch.Tensor | None = None, stream: Any = None) -> Any:
    """LayerNorm over the last dimension (biased variance), optionally after the residual add.

    Args:
        x: the rows (last dimension), any leading dimensions.
        weight, bias: 1-D, the row length.
        eps: added to the variance.
        residual: optional, x's shape and dtype: the norm is of ``s = x + residual``.
        out, residual_out: optional tensors to write ``y`` and ``s`` into (allocated when None).
        stream: the stream to launch on (None: the current one).

    Returns:
        ``y = (s - mean(s)) / sqrt(var(s) + eps) * weight + bias``; with ``residual``, ``(y, s)``.
    """
    if residual is None:
        if residual_out is not None:
            raise ValueError("operand residual_out: given without residual")
        return _layer_norm(x, weight, bias, eps, out=out, stream=stream)
    return _layer_norm_residual(x, residual, weight, bias, eps, out=out, residual_out=residual_out, stream=stream)
