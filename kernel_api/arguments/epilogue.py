"""The fused epilogue of a GEMM: the named form ``out = activation(alpha * (A @ B) + beta * C +
bias)``, or a Python function of the accumulator and named operands (`kernel_api.epilogue`
parses it into a DAG; `FusedEpilogueSignature` is what kernels compile for)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from ..core.dtypes import _FROM_TORCH, DataType
from ..core.numbers import is_finite_number
from ..core.tensor_attributes import TensorAttributes
from .base import STORAGELESS_TYPES, _lazy_bit_error, _matrix_attributes, _require_tensor, _shares_memory

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


@dataclass(frozen=True)
class FusedEpilogueSignature:
    """What kernels and caches need to know of an epilogue function bound to one GEMM
    (`GemmArguments.epilogue_signature`): ``key`` is the graph's structure with each operand's
    kind, element type and stride pattern (`kernel_api.epilogue.BoundEpilogue.key`). Equal keys
    share one compiled kernel: scalar values and literals are runtime inputs. ``graph`` (not
    compared) lets `EpilogueMetadata` name a node it cannot fuse.

    The named form's fields read as an identity epilogue, so code written for
    `EpilogueSignature` sees no C, no bias and no activation.
    """

    key: tuple
    graph: Any = field(compare=False, hash=False, repr=False)
    operand_keys: tuple = field(compare=False, hash=False, repr=False)

    scaled = False
    has_c = False
    bias_kind = None
    activation = None
    c_attributes = None
    bias_dtype = None


_UNSET: Any = object()


class EpilogueArguments:
    """Fused epilogue: ``out = activation(alpha * (A @ B) + beta * C + bias)``, or a function.

    **Function form**: ``EpilogueArguments(fn_or_source, **operands)``. ``fn_or_source`` is a
    function (or its source string) whose first parameter is ``accum``, the GEMM's
    accumulator; its other parameters bind by name to tensors (broadcast over the output like
    torch: (M, N), (N,), (1, N), (M, 1), (L, M, 1), (L, 1, N), (L, M, N)) and numbers in
    ``operands``; the names it returns bind to outputs: ``D`` is the GEMM's ``out`` (giving it
    is optional), the others are tensors in ``operands`` (extra outputs, or the targets of
    reductions, which combine onto what they hold: initialise to 0 for sum, -inf for max).
    For example::

        def epi(accum, C, alpha, bias):
            D = tanh(alpha * accum + bias) * C
            return D
        EpilogueArguments(epi, C=C, alpha=0.5, bias=bias)

    The function is parsed, never run (`kernel_api.epilogue`); what it may hold and what an
    error looks like is in that package's docstrings.

    **Named form**:

    ``C`` has out's shape; ``bias`` is a row vector (shape (N,) or (1, N): one value per
    output column) or a column vector (shape (M, 1), or (M,) when M != N: one per output row);
    ``activation`` is None, "relu", "gelu" (tanh approximation) or "silu".

    The object describes an epilogue and is not changed by use: ``bias_kind`` is None here.
    `GemmArguments.epilogue` holds a copy resolved against that GEMM's output, whose ``bias``
    is 1-D and ``bias_kind`` "row" or "column".
    """

    __slots__ = ("alpha", "beta", "C", "bias", "activation", "bias_kind", "function", "graph", "operands", "bound")

    def __init__(self, fn_or_source: Any = None, /, alpha: Any = _UNSET, beta: Any = _UNSET,
                 C: torch.Tensor | None = _UNSET, bias: torch.Tensor | None = _UNSET, activation: Any = _UNSET,
                 **operands: Any) -> None:
        if callable(fn_or_source) or isinstance(fn_or_source, str):
            self._init_function(fn_or_source, dict(alpha=alpha, beta=beta, C=C, bias=bias, activation=activation),
                                operands)
            return
        if fn_or_source is not None:  # the named form's alpha, given by position
            if alpha is not _UNSET:
                raise TypeError("epilogue: alpha given twice")
            alpha = fn_or_source
        if operands:
            raise TypeError(f"epilogue: unexpected operand {next(iter(operands))!r}; operands other than alpha, beta, "
                            f"C, bias and activation need an epilogue function")
        alpha = 1.0 if alpha is _UNSET else alpha
        beta = 0.0 if beta is _UNSET else beta
        C = None if C is _UNSET else C
        bias = None if bias is _UNSET else bias
        activation = None if activation is _UNSET else activation
        self.function = self.graph = self.operands = self.bound = None
        for label, value in (("alpha", alpha), ("beta", beta)):
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"epilogue {label}: expected a number, got {type(value).__name__}")
            if not is_finite_number(value):
                raise ValueError(f"epilogue {label}: expected a finite number, got {value!r}")
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

    def _init_function(self, fn: Any, named: dict, operands: dict) -> None:
        from ..epilogue import parse_cached  # (the IR sits beside the arguments layer, loaded on use)

        self.function = fn
        self.graph = parse_cached(fn)
        values = {k: v for k, v in named.items() if v is not _UNSET}
        values.update(operands)
        self.operands = values
        self.alpha, self.beta, self.C, self.bias, self.activation, self.bias_kind = 1.0, 0.0, None, None, None, None
        self.bound = None

    @property
    def is_function(self) -> bool:
        """Whether this epilogue is a function (`kernel_api.epilogue`) rather than the named form."""
        return self.graph is not None

    def to_graph(self) -> Any:
        """The epilogue as an `EpilogueGraph` (the named form builds the same IR a function would)."""
        if self.graph is not None:
            return self.graph
        from ..epilogue import named_graph

        return named_graph(self.alpha != 1.0 or self.beta != 0.0, self.beta != 0.0 and self.C is not None,
                           self.bias is not None, self.activation)

    @property
    def is_trivial(self) -> bool:
        return (self.graph is None and self.alpha == 1.0 and self.beta == 0.0 and self.bias is None
                and self.activation is None)

    def _bind_function(self, out: torch.Tensor, M: int, N: int) -> tuple["EpilogueArguments", FusedEpilogueSignature]:
        from ..epilogue import bind

        L = out.shape[0] if out.dim() == 3 else 1
        bound = bind(self.graph, self.operands, out, L, M, N)
        for name, t in bound.outputs.items():
            if isinstance(t, STORAGELESS_TYPES) or isinstance(out, STORAGELESS_TYPES):
                continue  # (tracing tensors have no addresses to compare)
            for other, o in (("out", out), *((n, v) for n, v in bound.inputs.items() if isinstance(v, torch.Tensor))):
                if _shares_memory(t, o):
                    raise ValueError(f"epilogue operand {name}: shares memory with {other}; write it to a separate tensor")
        resolved = object.__new__(type(self))
        resolved.alpha, resolved.beta, resolved.C, resolved.bias, resolved.activation = 1.0, 0.0, None, None, None
        resolved.bias_kind = None
        resolved.function, resolved.graph, resolved.operands, resolved.bound = (self.function, self.graph,
                                                                                  self.operands, bound)
        return resolved, FusedEpilogueSignature(bound.key, self.graph, bound.operand_keys)

    def _for_output(self, out: torch.Tensor, M: int, N: int) -> tuple["EpilogueArguments", EpilogueSignature]:
        """Check this epilogue against a GEMM's output ``out`` (M x N); return the epilogue that
        GEMM runs (a copy: C as the unit-stride view kernels take, bias flattened to 1-D,
        ``bias_kind`` known) and its signature. ``self`` is left as it is, so one
        EpilogueArguments serves GEMMs with other outputs. A function is bound to the
        operands (`kernel_api.epilogue.bind`) and gets a `FusedEpilogueSignature`."""
        if self.graph is not None:
            return self._bind_function(out, M, N)
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
        resolved.function = resolved.graph = resolved.operands = resolved.bound = None
        scaled = self.alpha != 1.0 or self.beta != 0.0
        return resolved, EpilogueSignature(scaled, c_attrs is not None, bias_kind, self.activation, c_attrs, bias_dtype)

    def __repr__(self) -> str:
        if self.graph is not None:
            ops = ", ".join(f"{k}={tuple(v.shape) if isinstance(v, torch.Tensor) else v}"
                            for k, v in self.operands.items())
            return f"EpilogueArguments({self.graph.name}{', ' + ops if ops else ''})"
        parts = [f"alpha={self.alpha}", f"beta={self.beta}"]
        if self.C is not None:
            parts.append(f"C={tuple(self.C.shape)}")
        if self.bias is not None:
            parts.append(f"bias={tuple(self.bias.shape)}({self.bias_kind})")
        if self.activation:
            parts.append(f"activation={self.activation!r}")
        return f"EpilogueArguments({', '.join(parts)})"

