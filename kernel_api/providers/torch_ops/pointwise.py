"""The torch provider's pointwise kernels of transformer blocks: the gated activations (SwiGLU,
GeGLU) and the rotary position embedding, forward and backward.

They compute in f32 (f64 for f64 operands) with torch's own operators, on any device (so the CPU
tests run the operations end to end and gradcheck them in f64), and write into the arguments'
outputs. Any shape, strides and alignment. They are the reference the CUDA kernels are compared
with and the fallback for what those do not take, not fast kernels: each makes several passes
over f32 copies of its operands.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Callable

import torch
import torch.nn.functional as F

from ...arguments.activations import (GATE_ACTIVATIONS, GatedActivationArguments,
                                      GatedActivationBackwardArguments)
from ...arguments.rope import RopeArguments, RopeBackwardArguments
from ...core.artifact import CompiledArtifact
from ...core.dtypes import DataType
from ...core.streams import stream_handle
from ...metadata import KernelMetadata, TensorAttributes
from ...metadata.activations import GatedActivationBackwardOperandsMetadata, GatedActivationOperandsMetadata
from ...metadata.rope import RopeBackwardOperandsMetadata, RopeOperandsMetadata
from . import TorchProvider
from .base import TorchKernel

_DTYPES = (DataType.f16, DataType.bf16, DataType.f32, DataType.f64)
_ROWS = (0, 1)
#: Passes over the problem's bytes an f32 torch composition makes against a fused kernel's one
#: (conversions, the activation, the product, the copy out): what `estimated_cost` charges.
_PASSES = 4.0


def _stream_context(device: torch.device, stream: Any) -> Any:
    """The launch stream as torch's current one on CUDA (nothing to do on other devices)."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    if stream is None or isinstance(stream, torch.cuda.Stream):
        return torch.cuda.stream(stream)
    return torch.cuda.stream(torch.cuda.ExternalStream(stream_handle(stream)))


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


class _TorchPointwise(TorchKernel):
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


def _glu_operands(dt: DataType) -> GatedActivationOperandsMetadata:
    a = TensorAttributes(dt, _ROWS, 1)
    return GatedActivationOperandsMetadata(a, a, a, activations=GATE_ACTIVATIONS)


def _glu_backward_operands(dt: DataType) -> GatedActivationBackwardOperandsMetadata:
    a = TensorAttributes(dt, _ROWS, 1)
    return GatedActivationBackwardOperandsMetadata(a, a, a, a, a, activations=GATE_ACTIVATIONS)


@TorchProvider.register
class TorchGatedActivation(_TorchPointwise):
    """``out = act(gate) * up`` with torch's activations in f32."""

    supported_args_type = GatedActivationArguments
    _operands = staticmethod(_glu_operands)

    def _run(self, args: Any, artifact: CompiledArtifact, stream: Any, workspace: Any = None) -> None:
        with _stream_context(args.device, stream):
            ct = _compute_type(args.gate)
            args.out.copy_(gate_activation(args.gate.to(ct), args.activation) * args.up.to(ct))


@TorchProvider.register
class TorchGatedActivationBackward(_TorchPointwise):
    """The gated activation's gradients with torch's operators in f32."""

    supported_args_type = GatedActivationBackwardArguments
    _operands = staticmethod(_glu_backward_operands)

    def _run(self, args: Any, artifact: CompiledArtifact, stream: Any, workspace: Any = None) -> None:
        with _stream_context(args.device, stream):
            ct = _compute_type(args.gate)
            g, u, dy = args.gate.to(ct), args.up.to(ct), args.grad_out.to(ct)
            args.grad_up.copy_(dy * gate_activation(g, args.activation))
            args.grad_gate.copy_(dy * u * gate_activation_grad(g, args.activation))


def _rope_variants(cls: type, operands_type: type) -> list[tuple[str, Any]]:
    """Per dtype of q: cos and sin of that dtype, and f32 tables under 16-bit q and k."""
    found = []
    for dt in _DTYPES:
        for table in (dt, DataType.f32) if dt in (DataType.f16, DataType.bf16) else (dt,):
            x, c = TensorAttributes(dt, _ROWS, 1), TensorAttributes(table, _ROWS, 1)
            name = f"{cls.__name__}_{dt}" + (f"_cos{table}" if table is not dt else "")
            found.append((name, operands_type(x, x, c, c, x, x)))
    return found


def _tables(args: Any, ct: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin in ``ct``, broadcast over the heads where transformers unsqueezes them."""
    return args.cos.to(ct).unsqueeze(args.unsqueeze_dim), args.sin.to(ct).unsqueeze(args.unsqueeze_dim)


@TorchProvider.register
class TorchRope(_TorchPointwise):
    """RoPE of q and k (transformers' ``rotate_half`` convention) with torch's operators in f32."""

    supported_args_type = RopeArguments

    @classmethod
    def _variants(cls) -> list[tuple[str, Any]]:
        return _rope_variants(cls, RopeOperandsMetadata)

    def _run(self, args: Any, artifact: CompiledArtifact, stream: Any, workspace: Any = None) -> None:
        with _stream_context(args.device, stream):
            ct = _compute_type(args.q)
            cos, sin = _tables(args, ct)
            for x, out in ((args.q, args.q_out), (args.k, args.k_out)):
                x = x.to(ct)
                out.copy_(x * cos + rotate_half(x) * sin)


@TorchProvider.register
class TorchRopeBackward(_TorchPointwise):
    """RoPE's gradients with respect to q and k (the transposed rotation) in f32."""

    supported_args_type = RopeBackwardArguments

    @classmethod
    def _variants(cls) -> list[tuple[str, Any]]:
        return _rope_variants(cls, RopeBackwardOperandsMetadata)

    def _run(self, args: Any, artifact: CompiledArtifact, stream: Any, workspace: Any = None) -> None:
        with _stream_context(args.device, stream):
            ct = _compute_type(args.grad_q_out)
            cos, sin = _tables(args, ct)
            for g, out in ((args.grad_q_out, args.grad_q), (args.grad_k_out, args.grad_k)):
                g = g.to(ct)
                out.copy_(g * cos + rotate_half_transposed(g * sin))
