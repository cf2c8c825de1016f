"""The fused epilogue of a GEMM: ``out = activation(alpha * (A @ B) + beta * C + bias)``."""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..core.dtypes import _FROM_TORCH, DataType
from ..core.tensor_attributes import TensorAttributes
from .base import _lazy_bit_error, _matrix_attributes, _require_tensor

# The activations a fused epilogue may apply (kernels declare theirs in `EpilogueMetadata`).
ACTIVATIONS = ("relu", "gelu", "silu")


class EpilogueSignature(NamedTuple):
    """What kernels and caches need to know of a GEMM's fused epilogue
    (`GemmArguments.epilogue_signature`); hashable and equal by value, so discovery, support
    and compile caches key on it.

    ``scaled``: alpha != 1 or beta != 0; ``has_c``: a C operand is read (beta != 0);
    ``bias_kind``: None, "row" (one value per output column) or "column" (one per row);
    ``activation``: None or a name from `ACTIVATIONS`; ``c_attributes``: the C operand's
    `TensorAttributes` (dtype, stride pattern, alignment) when ``has_c``, else None;
    ``bias_dtype``: the bias' `DataType`, or None without a bias.
    """

    scaled: bool
    has_c: bool
    bias_kind: str | None
    activation: str | None
    c_attributes: TensorAttributes | None
    bias_dtype: DataType | None


class EpilogueArguments:
    """Fused epilogue: ``out = activation(alpha * (A @ B) + beta * C + bias)``.

    ``C`` has out's shape; ``bias`` is a row vector (shape (N,) or (1, N): one value per
    output column) or a column vector (shape (M, 1), or (M,) when M != N: one per output row);
    ``activation`` is None, "relu", "gelu" (tanh approximation) or "silu".

    The object describes an epilogue and is not changed by use: ``bias_kind`` is None here.
    `GemmArguments.epilogue` holds a copy resolved against that GEMM's output, whose ``bias``
    is 1-D and ``bias_kind`` "row" or "column".
    """

    __slots__ = ("alpha", "beta", "C", "bias", "activation", "bias_kind")

    def __init__(self, alpha: float = 1.0, beta: float = 0.0, C: torch.Tensor | None = None,
                 bias: torch.Tensor | None = None, activation: str | None = None) -> None:
        for label, value in (("alpha", alpha), ("beta", beta)):
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"epilogue {label}: expected a number, got {type(value).__name__}")
        if C is not None:
            _require_tensor(C, "C")
        if bias is not None:
            _require_tensor(bias, "bias")
        if activation is not None:
            if not isinstance(activation, str) or activation.lower() not in ACTIVATIONS:
                raise ValueError(f"epilogue activation: unknown {activation!r}; expected one of {ACTIVATIONS} or None")
            activation = activation.lower()
        if beta != 0 and C is None:
            raise ValueError(f"epilogue: beta={beta} needs a C operand")
        self.alpha = float(alpha)
        self.beta = float(beta)
        self.C = C
        self.bias = bias
        self.activation = activation
        self.bias_kind: str | None = None

    @property
    def is_trivial(self) -> bool:
        return self.alpha == 1.0 and self.beta == 0.0 and self.bias is None and self.activation is None

    def _for_output(self, out: torch.Tensor, M: int, N: int) -> tuple["EpilogueArguments", EpilogueSignature]:
        """Check this epilogue against a GEMM's output ``out`` (M x N); return the epilogue that
        GEMM runs (a copy: C as the unit-stride view kernels take, bias flattened to 1-D,
        ``bias_kind`` known) and its signature. ``self`` is left as it is, so one
        EpilogueArguments serves GEMMs with other outputs."""
        C, c_attrs = self.C, None
        if C is not None and self.beta != 0:
            if tuple(C.shape) != tuple(out.shape):
                raise ValueError(f"epilogue operand C: shape {tuple(C.shape)} must equal out's {tuple(out.shape)}")
            if C.device != out.device:
                raise ValueError(f"epilogue operand C: on {C.device} but out is on {out.device}")
            if C.dtype != out.dtype:
                raise TypeError(f"epilogue operand C: dtype {C.dtype} must equal out's {out.dtype}")
            C, c_attrs = _matrix_attributes(C, "C")
        bias, bias_kind, bias_dtype = self.bias, None, None
        if bias is not None:
            if bias.is_neg():
                raise _lazy_bit_error(bias, "bias")
            if bias.device != out.device:
                raise ValueError(f"epilogue operand bias: on {bias.device} but out is on {out.device}")
            if bias.dtype != out.dtype:
                raise TypeError(f"epilogue operand bias: dtype {bias.dtype} must equal out's {out.dtype}")
            shape = tuple(bias.shape)
            if shape == (N,) or shape == (1, N):
                bias_kind = "row"
            elif shape == (M, 1) or (shape == (M,) and M != N):
                bias_kind = "column"
            else:
                raise ValueError(
                    f"epilogue operand bias: shape {shape} fits neither a row bias (N,)=({N},) / (1, {N}) "
                    f"nor a column bias (M, 1)=({M}, 1)")
            bias_dtype = _FROM_TORCH[bias.dtype]
            bias = bias.reshape(-1)
            if bias.numel() > 1 and bias.stride(0) != 1:
                raise ValueError(
                    f"epilogue operand bias: elements must be contiguous, got strides {tuple(self.bias.stride())}")
        resolved = object.__new__(type(self))
        resolved.alpha, resolved.beta, resolved.activation = self.alpha, self.beta, self.activation
        resolved.C, resolved.bias, resolved.bias_kind = C, bias, bias_kind
        scaled = self.alpha != 1.0 or self.beta != 0.0
        return resolved, EpilogueSignature(scaled, c_attrs is not None, bias_kind, self.activation, c_attrs, bias_dtype)

    def __repr__(self) -> str:
        parts = [f"alpha={self.alpha}", f"beta={self.beta}"]
        if self.C is not None:
            parts.append(f"C={tuple(self.C.shape)}")
        if self.bias is not None:
            parts.append(f"bias={tuple(self.bias.shape)}({self.bias_kind})")
        if self.activation:
            parts.append(f"activation={self.activation!r}")
        return f"EpilogueArguments({', '.join(parts)})"
