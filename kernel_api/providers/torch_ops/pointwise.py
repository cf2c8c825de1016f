"""The torch provider's pointwise kernels of transformer blocks: the gated activations (SwiGLU,
GeGLU) and the rotary position embedding, forward and backward.

They compute in f32 (f64 for f64 operands) with torch's own operators, on any device (so the CPU
tests run the operations end to end and gradcheck them in f64), and write into the arguments'
outputs. Any shape, strides and alignment. They are the reference the CUDA kernels are compared
with and the fallback for what those do not take, not fast kernels: each makes several passes
over f32 copies of its operands. Each launch is one function of the operands that writes the
outputs with torch's ``out=`` (`LaunchedKernel`), so `kernel_api.ops` replays repeated calls.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
import torch.nn.functional as F

from ...arguments.activations import (GATE_ACTIVATIONS, GatedActivationArguments,
                                      GatedActivationBackwardArguments)
from ...arguments.rope import RopeArguments, RopeBackwardArguments
from ...core.dtypes import DataType
from ...metadata import KernelMetadata, TensorAttributes
from ...metadata.activations import GatedActivationBackwardOperandsMetadata, GatedActivationOperandsMetadata
from ...metadata.rope import RopeBackwardOperandsMetadata, RopeOperandsMetadata
from . import TorchProvider
from .launch import LaunchedKernel, in_type, switch

_DTYPES = (DataType.f16, DataType.bf16, DataType.f32, DataType.f64)
_ROWS = (0, 1)
#: Passes over the problem's bytes an f32 torch composition makes against a fused kernel's one
#: (conversions, the activation, the product, the copy out): what `estimated_cost` charges.
_PASSES = 4.0


def _compute_type(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def gate_activation(g: torch.Tensor, activation: str) -> torch.Tensor:
    """``act(g)`` for a name of `GATE_ACTIVATIONS`."""
    if activation == "silu":
        return F.silu(g)
    return F.gelu(g, approximate="tanh" if activation == "gelu_tanh" else "none")


def gate_activation_grad(g: torch.Tensor, activation: str) -> torch.Tensor:
    """``act'(g)``, the derivative of `gate_activation`."""
    if activation == "silu":
        s = torch.sigmoid(g)
        return s * (1 + g * (1 - s))
    if activation == "gelu_tanh":
        k = math.sqrt(2 / math.pi)
        t = torch.tanh(k * (g + 0.044715 * g ** 3))
        return 0.5 * (1 + t) + 0.5 * g * (1 - t * t) * k * (1 + 3 * 0.044715 * g * g)
    return 0.5 * (1 + torch.erf(g / math.sqrt(2))) + g * torch.exp(-0.5 * g * g) / math.sqrt(2 * math.pi)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``cat(-x2, x1)`` over the last dimension's halves (transformers' convention)."""
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def rotate_half_transposed(y: torch.Tensor) -> torch.Tensor:
    """The transpose of `rotate_half`: ``cat(y2, -y1)``."""
    h = y.shape[-1] // 2
    return torch.cat((y[..., h:], -y[..., :h]), dim=-1)


# The launch functions: operands in the arguments' order (``tensor_attributes``), then the
# constants, then the stream. Each output is written by the last operator's ``out=`` (the f32
# result rounded once into the output's type, as a copy would).

def _gated(gate: torch.Tensor, up: torch.Tensor, out: torch.Tensor, activation: str, stream: Any) -> None:
    context = None if stream is None else switch(gate, stream)
    if context is not None:
        with context:
            return _gated(gate, up, out, activation, None)
    ct = _compute_type(gate)
    torch.mul(gate_activation(in_type(gate, ct), activation), in_type(up, ct), out=out)


def _gated_backward(grad_out: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, grad_gate: torch.Tensor,
                    grad_up: torch.Tensor, activation: str, stream: Any) -> None:
    context = None if stream is None else switch(gate, stream)
    if context is not None:
        with context:
            return _gated_backward(grad_out, gate, up, grad_gate, grad_up, activation, None)
    ct = _compute_type(gate)
    g, u, dy = in_type(gate, ct), in_type(up, ct), in_type(grad_out, ct)
    torch.mul(dy, gate_activation(g, activation), out=grad_up)
    torch.mul(dy * u, gate_activation_grad(g, activation), out=grad_gate)


def _rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_out: torch.Tensor,
          k_out: torch.Tensor, unsqueeze_dim: int, stream: Any) -> None:
    context = None if stream is None else switch(q, stream)
    if context is not None:
        with context:
            return _rope(q, k, cos, sin, q_out, k_out, unsqueeze_dim, None)
    ct = _compute_type(q)
    cos, sin = _tables(cos, sin, unsqueeze_dim, ct)
    for x, out in ((q, q_out), (k, k_out)):
        x = in_type(x, ct)
        torch.add(x * cos, rotate_half(x) * sin, out=out)


def _rope_backward(grad_q_out: torch.Tensor, grad_k_out: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   grad_q: torch.Tensor, grad_k: torch.Tensor, unsqueeze_dim: int, stream: Any) -> None:
    context = None if stream is None else switch(grad_q_out, stream)
    if context is not None:
        with context:
            return _rope_backward(grad_q_out, grad_k_out, cos, sin, grad_q, grad_k, unsqueeze_dim, None)
    ct = _compute_type(grad_q_out)
    cos, sin = _tables(cos, sin, unsqueeze_dim, ct)
    for g, out in ((grad_q_out, grad_q), (grad_k_out, grad_k)):
        g = in_type(g, ct)
        torch.add(g * cos, rotate_half_transposed(g * sin), out=out)


def _tables(cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int,
            ct: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin in ``ct``, broadcast over the heads where transformers unsqueezes them."""
    return in_type(cos, ct).unsqueeze(unsqueeze_dim), in_type(sin, ct).unsqueeze(unsqueeze_dim)


class _TorchPointwise(LaunchedKernel):
    """Common to the pointwise kernels: one instance per dtype, any layout and alignment."""

    performance_hint = 0.02
    _operands: Callable[[DataType], Any]

    @classmethod
    def generate_kernels(cls, metadata_filter: Callable[[KernelMetadata], bool] | None, epilogue_args: Any = None,
                         cc: int | None = None) -> list["_TorchPointwise"]:
        if epilogue_args is not None:
            return []
        found = []
        for name, operands in cls._variants():
            metadata = KernelMetadata(name, cls, operands)
            if metadata_filter is None or metadata_filter(metadata):
                found.append(cls(metadata))
        return found

    @classmethod
    def _variants(cls) -> list[tuple[str, Any]]:
        return [(f"{cls.__name__}_{dt}", cls._operands(dt)) for dt in _DTYPES]

    def estimated_cost(self, args: Any, sm_count: int) -> float:
        return _PASSES


class _TorchGated(_TorchPointwise):
    _function: Callable[..., None]

    def _launch_parts(self, args: Any) -> tuple[Callable[..., None], tuple]:
        return self._function, (args.activation,)


class _TorchRotary(_TorchPointwise):
    _function: Callable[..., None]

    def _launch_parts(self, args: Any) -> tuple[Callable[..., None], tuple]:
        return self._function, (args.unsqueeze_dim,)


def _glu_operands(dt: DataType) -> GatedActivationOperandsMetadata:
    a = TensorAttributes(dt, _ROWS, 1)
    return GatedActivationOperandsMetadata(a, a, a, activations=GATE_ACTIVATIONS)


def _glu_backward_operands(dt: DataType) -> GatedActivationBackwardOperandsMetadata:
    a = TensorAttributes(dt, _ROWS, 1)
    return GatedActivationBackwardOperandsMetadata(a, a, a, a, a, activations=GATE_ACTIVATIONS)


@TorchProvider.register
class TorchGatedActivation(_TorchGated):
    """``out = act(gate) * up`` with torch's activations in f32."""

    supported_args_type = GatedActivationArguments
    _operands = staticmethod(_glu_operands)
    _function = staticmethod(_gated)


@TorchProvider.register
class TorchGatedActivationBackward(_TorchGated):
    """The gated activation's gradients with torch's operators in f32."""

    supported_args_type = GatedActivationBackwardArguments
    _operands = staticmethod(_glu_backward_operands)
    _function = staticmethod(_gated_backward)


def _rope_variants(cls: type, operands_type: type) -> list[tuple[str, Any]]:
    """Per dtype of q: cos and sin of that dtype, and f32 tables under 16-bit q and k."""
    found = []
    for dt in _DTYPES:
        for table in (dt, DataType.f32) if dt in (DataType.f16, DataType.bf16) else (dt,):
            x, c = TensorAttributes(dt, _ROWS, 1), TensorAttributes(table, _ROWS, 1)
            name = f"{cls.__name__}_{dt}" + (f"_cos{table}" if table is not dt else "")
            found.append((name, operands_type(x, x, c, c, x, x)))
    return found


@TorchProvider.register
class TorchRope(_TorchRotary):
    """RoPE of q and k (transformers' ``rotate_half`` convention) with torch's operators in f32."""

    supported_args_type = RopeArguments
    _function = staticmethod(_rope)

    @classmethod
    def _variants(cls) -> list[tuple[str, Any]]:
        return _rope_variants(cls, RopeOperandsMetadata)


@TorchProvider.register
class TorchRopeBackward(_TorchRotary):
    """RoPE's gradients with respect to q and k (the transposed rotation) in f32."""

    supported_args_type = RopeBackwardArguments
    _function = staticmethod(_rope_backward)

    @classmethod
    def _variants(cls) -> list[tuple[str, Any]]:
        return _rope_variants(cls, RopeBackwardOperandsMetadata)
