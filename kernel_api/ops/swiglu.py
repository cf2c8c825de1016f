"""``ops.swiglu`` and ``ops.geglu``: the gated activations of transformer MLPs, forward and
backward, as torch ops generated from `Operation` descriptions.

Two ops: ``kernel_api::gated_activation`` (``act(gate) * up``, the activation named by a string)
and ``kernel_api::gated_activation_backward`` (``(grad_gate, grad_up)``). The backward reads
the forward's inputs, which an MLP keeps alive anyway (they are the projections' outputs), and
recomputes the activation from them, so the forward saves nothing of its own.
"""

from __future__ import annotations

from typing import Any

import torch

from ..arguments.activations import GatedActivationArguments, GatedActivationBackwardArguments, gelu_kind
from .operation import Operation, define_operation


def _like_gate(gate: torch.Tensor, *rest: Any) -> torch.Tensor:
    return gate.new_empty(gate.shape)


def _backward_fake(grad_out: torch.Tensor, gate: torch.Tensor, *rest: Any) -> tuple[torch.Tensor, torch.Tensor]:
    return gate.new_empty(gate.shape), gate.new_empty(gate.shape)


def _arguments(gate: torch.Tensor, up: torch.Tensor, activation: str, *, out: torch.Tensor) -> GatedActivationArguments:
    return GatedActivationArguments(gate, up, out, activation=activation)


def _backward_arguments(grad_out: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, activation: str, *,
                        grad_gate: torch.Tensor, grad_up: torch.Tensor) -> GatedActivationBackwardArguments:
    return GatedActivationBackwardArguments(grad_out, gate, up, grad_gate, grad_up, activation=activation)


def _backward(saved: Any, grad: torch.Tensor) -> tuple:
    # (a gradient may arrive expanded or strided: the kernels take rows of unit stride)
    grad_gate, grad_up = gated_activation_backward(grad.contiguous(), saved.gate, saved.up, saved.activation)
    return grad_gate, grad_up, None


GATED_ACTIVATION = Operation(
    name="kernel_api::gated_activation", schema="(Tensor gate, Tensor up, str activation='silu') -> Tensor",
    arguments=_arguments, outputs=("out",), fake=_like_gate, backward=_backward, saved=("gate", "up", "activation"))
GATED_ACTIVATION_BACKWARD = Operation(
    name="kernel_api::gated_activation_backward",
    schema="(Tensor grad_out, Tensor gate, Tensor up, str activation='silu') -> (Tensor, Tensor)",
    arguments=_backward_arguments, outputs=("grad_gate", "grad_up"), fake=_backward_fake)

#: ``gated_activation(gate, up, activation="silu", *, out=None, stream=None)``: ``act(gate) * up``
#: for an activation of `kernel_api.arguments.activations.GATE_ACTIVATIONS`.
gated_activation = define_operation(GATED_ACTIVATION)
#: ``gated_activation_backward(grad_out, gate, up, activation="silu", *, grad_gate=None,
#: grad_up=None, stream=None)`` -> ``(grad_gate, grad_up)``.
gated_activation_backward = define_operation(GATED_ACTIVATION_BACKWARD)


def swiglu(gate: torch.Tensor, up: torch.Tensor, *, out: torch.Tensor | None = None, stream: Any = None) -> torch.Tensor:
    """SwiGLU: ``silu(gate) * up``, elementwise.

    Args:
        gate, up: one shape and dtype; the last dimension of stride 1, rows over it evenly
            spaced (the halves of ``x.chunk(2, dim=-1)`` qualify).
        out: optional tensor to write into (allocated when None).
        stream: the stream to launch on (None: the current one).

    Returns:
        ``silu(gate) * up``, differentiable with respect to gate and up.
    """
    return gated_activation(gate, up, "silu", out=out, stream=stream)


def geglu(gate: torch.Tensor, up: torch.Tensor, approximate: str = "tanh", *, out: torch.Tensor | None = None,
          stream: Any = None) -> torch.Tensor:
    """GeGLU: ``gelu(gate, approximate=approximate) * up``, elementwise.

    Args:
        gate, up: as for `swiglu`.
        approximate: ``"tanh"`` (the tanh approximation) or ``"none"`` (erf), as
            ``torch.nn.functional.gelu`` takes it.
        out, stream: as for `swiglu`.

    Returns:
        ``gelu(gate) * up``, differentiable with respect to gate and up.
    """
    return gated_activation(gate, up, gelu_kind(approximate), out=out, stream=stream)
