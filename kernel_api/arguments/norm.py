"""Arguments of the row norms: RMSNorm and LayerNorm, forward and backward.

A norm normalises each row (the last dimension; any leading dimensions) of ``x`` and scales it
by ``weight`` (LayerNorm: then adds ``bias``), both 1-D of the row length. The forward may be
fused with the residual add of a transformer block: given ``residual`` it computes
``s = x + residual``, writes ``s`` into ``residual_out`` (the stream the next layer adds to) and
normalises ``s``.

The backward recomputes the row statistics (mean, 1 / rms) from the forward's normalised input
instead of reading them saved: a row's statistics are one pass over a row the backward reads
anyway, and the forward then has no extra output (no f32 ``rstd`` tensor to keep alive between
the passes, nothing the fake implementations or the C replay must know about). With a residual
the normalised input is ``residual_out``, which the forward keeps.
"""

from __future__ import annotations

from typing import Any

import torch

from ..core.numbers import is_finite_number
from ..core.tensor_attributes import TensorAttributes
from .base import (_ROW2, Arguments, _attributes, _divisibility, _element_type, _lazy_bit_error,
                   _require_tensor, _rows_overlap_error, _shares_memory, data_pointer)

_UNIT = (1,)


def _rows(t: torch.Tensor, name: str, output: bool = False) -> tuple[TensorAttributes, int, int]:
    """Attributes of an operand seen as (rows, cols) over its last dimension; (attrs, rows, cols).
    An ``output``'s rows must not overlap (thread blocks write them at once)."""
    dt = _element_type(t, name)
    if t.is_neg():
        raise _lazy_bit_error(t, name)
    if t.dim() == 0:
        raise ValueError(f"operand {name}: a norm needs at least one dimension, got a scalar")
    cols = t.shape[-1]
    rows = t.numel() // cols if cols else 0
    stride = t.stride()
    if cols > 1 and stride[-1] != 1:
        raise ValueError(f"operand {name}: the last dimension must have stride 1, got strides {tuple(stride)}")
    if t.is_contiguous():
        row_stride = cols
    else:
        try:  # rows evenly spaced: kernels walk them with one row stride
            row_stride = t.view(rows, cols).stride(0) if rows else cols
        except RuntimeError:
            raise ValueError(f"operand {name}: rows of shape {tuple(t.shape)} with strides {tuple(stride)} are not "
                             f"evenly spaced; call .contiguous()") from None
    if output and rows > 1 and row_stride < cols:
        raise _rows_overlap_error(name, row_stride, cols)
    div = _divisibility(data_pointer(t), t.element_size(), (cols, row_stride) if rows > 1 else (cols,))
    return _attributes(dt, _ROW2, div), rows, cols


def _vector(t: Any, name: str, cols: int, x: torch.Tensor) -> TensorAttributes:
    """Attributes of a 1-D per-column operand (weight, bias) of ``cols`` elements on x's device."""
    _require_tensor(t, name)
    dt = _element_type(t, name)
    if t.is_neg():
        raise _lazy_bit_error(t, name)
    if t.dim() != 1 or t.shape[0] != cols:
        raise ValueError(f"operand {name}: shape {tuple(t.shape)} must be ({cols},), the row length of x")
    if t.device != x.device:
        raise ValueError(f"operand {name}: on {t.device} but x is on {x.device}")
    if cols > 1 and t.stride(0) != 1:
        raise ValueError(f"operand {name}: must have stride 1, got stride {t.stride(0)}")
    return _attributes(dt, _UNIT, _divisibility(data_pointer(t), t.element_size(), (cols,)))


def _like(t: Any, name: str, ref: torch.Tensor, ref_name: str, output: bool = False) -> TensorAttributes:
    """Attributes of a row operand with ``ref``'s shape, dtype and device (rows distinct for an ``output``)."""
    _require_tensor(t, name)
    if t.shape != ref.shape:
        raise ValueError(f"operand {name}: shape {tuple(t.shape)} must equal {ref_name}'s {tuple(ref.shape)}")
    if t.dtype != ref.dtype:
        raise TypeError(f"operand {name}: dtype {t.dtype} must equal {ref_name}'s {ref.dtype}")
    if t.device != ref.device:
        raise ValueError(f"operand {name}: on {t.device} but {ref_name} is on {ref.device}")
    return _rows(t, name, output)[0]


def _eps(eps: Any) -> float:
    if not is_finite_number(eps) or eps < 0:
        raise ValueError(f"eps: expected a finite float >= 0, got {eps!r}")
    return float(eps)


def _check_disjoint(args: Arguments, outputs: tuple[str, ...]) -> None:
    """No output shares memory with an input or with another output."""
    tensors = args.tensors()
    for i, name in enumerate(outputs):
        for other, t in tensors.items():
            if other != name and (other not in outputs or outputs.index(other) > i) and _shares_memory(tensors[name], t):
                raise ValueError(f"operand {name}: overlaps {other} in memory; give {name} its own memory")


class _NormArguments(Arguments):
    """Common to the forward norms: ``x`` (rows over the last dim), per-column ``weight`` (and
    ``bias``), ``out`` like x, optionally ``residual`` in and ``residual_out`` like x."""

    __slots__ = ("x", "residual", "weight", "bias", "out", "residual_out", "eps", "rows", "cols")
    kind = ""
    output_names = ("out",)
    #: The subclass built when a residual is given: `kernel_api.ops.call` returns the outputs the
    #: arguments' type names, so the fused form is a type of its own, output_names ("out",
    #: "residual_out"). Construction picks it; users name only the public class.
    _fused: type | None = None

    def __new__(cls, *args: Any, residual: Any = None, **kwargs: Any) -> "_NormArguments":
        if residual is not None and cls._fused is not None:
            cls = cls._fused
        return object.__new__(cls)

    def _build(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor,
               eps: float, residual: torch.Tensor | None, residual_out: torch.Tensor | None) -> None:
        _require_tensor(x, "x")
        xa, self.rows, self.cols = _rows(x, "x")
        attrs = {"x": xa}
        if (residual is None) != (residual_out is None):
            given, missing = ("residual", "residual_out") if residual is not None else ("residual_out", "residual")
            raise ValueError(f"operand {missing}: required with {given} (the fused residual add takes both)")
        if residual is not None:
            attrs["residual"] = _like(residual, "residual", x, "x")
        attrs["weight"] = _vector(weight, "weight", self.cols, x)
        if bias is not None:
            attrs["bias"] = _vector(bias, "bias", self.cols, x)
            if bias.dtype != weight.dtype:
                raise TypeError(f"operand bias: dtype {bias.dtype} must equal weight's {weight.dtype}")
        attrs["out"] = _like(out, "out", x, "x", output=True)
        if residual_out is not None:
            attrs["residual_out"] = _like(residual_out, "residual_out", x, "x", output=True)
        self.x, self.residual, self.weight, self.bias, self.out, self.residual_out = (
            x, residual, weight, bias, out, residual_out)
        self.eps = _eps(eps)
        self.device = x.device
        self.device_index = x.get_device()
        self._verdicts = self._binding = None
        self.tensor_attributes = attrs  # (the order kernels take the operands in)
        # cols: metadata bounds the row length (a kernel holds a row in registers)
        self.signature = (self.kind, *[(n, a.key()) for n, a in attrs.items()], self.cols, self.device_index)

    def problem_key(self) -> tuple:
        """The signature (which holds the row length) with the number of rows."""
        return (self.signature, self.rows)

    def check_memory(self) -> None:
        """Raise ValueError when ``out`` or ``residual_out`` overlaps an input or each other."""
        _check_disjoint(self, type(self).output_names)

    def __repr__(self) -> str:
        fused = ", residual" if self.residual is not None else ""
        name = type(self).__mro__[1].__name__ if self.residual is not None else type(self).__name__
        return (f"{name}(rows={self.rows}, cols={self.cols}, dtype={self.tensor_attributes['x'].dtype}, "
                f"weight={self.tensor_attributes['weight'].dtype}, eps={self.eps:g}{fused}, device={self.device})")


class RMSNormArguments(_NormArguments):
    """``out = s / sqrt(mean(s**2) + eps) * weight`` per row, ``s = x`` or, with ``residual``,
    ``s = x + residual`` (also written to ``residual_out``).

    Args:
        x: the rows (last dimension), any leading dimensions.
        weight: 1-D, the row length; its dtype may differ from x's (f32 weights, say).
        out: x's shape, dtype and device.
        eps: added to the mean square.
        residual: optional, x's shape, dtype and device.
        residual_out: with ``residual``: receives ``x + residual``.
    """

    __slots__ = ()
    kind = "rms_norm"

    def __init__(self, x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, *, eps: float = 1e-6,
                 residual: torch.Tensor | None = None, residual_out: torch.Tensor | None = None) -> None:
        self._build(x, weight, None, out, eps, residual, residual_out)


class LayerNormArguments(_NormArguments):
    """``out = (s - mean(s)) / sqrt(var(s) + eps) * weight + bias`` per row (biased variance),
    ``s = x`` or, with ``residual``, ``s = x + residual`` (also written to ``residual_out``).

    Args:
        x: the rows (last dimension), any leading dimensions.
        weight, bias: 1-D, the row length, one dtype (which may differ from x's).
        out: x's shape, dtype and device.
        eps: added to the variance.
        residual: optional, x's shape, dtype and device.
        residual_out: with ``residual``: receives ``x + residual``.
    """

    __slots__ = ()
    kind = "layer_norm"

    def __init__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, out: torch.Tensor, *,
                 eps: float = 1e-5, residual: torch.Tensor | None = None,
                 residual_out: torch.Tensor | None = None) -> None:
        _require_tensor(bias, "bias")
        self._build(x, weight, bias, out, eps, residual, residual_out)


class _RMSNormResidualArguments(RMSNormArguments):
    """`RMSNormArguments` with the fused residual add: outputs out and residual_out."""

    __slots__ = ()
    output_names = ("out", "residual_out")


class _LayerNormResidualArguments(LayerNormArguments):
    """`LayerNormArguments` with the fused residual add: outputs out and residual_out."""

    __slots__ = ()
    output_names = ("out", "residual_out")


RMSNormArguments._fused = _RMSNormResidualArguments
LayerNormArguments._fused = _LayerNormResidualArguments


class _NormBackwardArguments(Arguments):
    """Common to the norm backwards: ``grad_out`` and ``x`` (the forward's normalised input:
    ``residual_out`` with a residual), ``weight``; outputs ``grad_x`` like x, ``grad_weight``
    (and ``grad_bias``) like weight. The row statistics are recomputed from x."""

    __slots__ = ("grad_out", "x", "weight", "grad_x", "grad_weight", "grad_bias", "eps", "rows", "cols")
    kind = ""

    def _build(self, grad_out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, grad_x: torch.Tensor,
               grad_weight: torch.Tensor, grad_bias: torch.Tensor | None, eps: float) -> None:
        _require_tensor(x, "x")
        xa, self.rows, self.cols = _rows(x, "x")
        attrs = {"grad_out": _like(grad_out, "grad_out", x, "x"), "x": xa,
                 "weight": _vector(weight, "weight", self.cols, x),
                 "grad_x": _like(grad_x, "grad_x", x, "x", output=True)}
        for name, t in (("grad_weight", grad_weight), ("grad_bias", grad_bias)):
            if t is None:
                continue
            attrs[name] = _vector(t, name, self.cols, x)
            if t.dtype != weight.dtype:
                raise TypeError(f"operand {name}: dtype {t.dtype} must equal weight's {weight.dtype}")
        self.grad_out, self.x, self.weight = grad_out, x, weight
        self.grad_x, self.grad_weight, self.grad_bias = grad_x, grad_weight, grad_bias
        self.eps = _eps(eps)
        self.device = x.device
        self.device_index = x.get_device()
        self._verdicts = self._binding = None
        self.tensor_attributes = attrs
        self.signature = (self.kind, *[(n, a.key()) for n, a in attrs.items()], self.cols, self.device_index)

    def problem_key(self) -> tuple:
        """The signature (which holds the row length) with the number of rows."""
        return (self.signature, self.rows)

    def check_memory(self) -> None:
        """Raise ValueError when a gradient output overlaps an input or another output."""
        _check_disjoint(self, self.output_names)

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(rows={self.rows}, cols={self.cols}, dtype={self.tensor_attributes['x'].dtype}, "
                f"weight={self.tensor_attributes['weight'].dtype}, eps={self.eps:g}, device={self.device})")


class RMSNormBackwardArguments(_NormBackwardArguments):
    """The gradients of `RMSNormArguments`' ``out`` with respect to its normalised input and weight.

    Args:
        grad_out: the gradient of ``out``, x's shape and dtype.
        x: the forward's normalised input (``residual_out`` when a residual was added).
        weight: the forward's weight.
        grad_x: receives the gradient of x (x's shape and dtype).
        grad_weight: receives the gradient of weight (weight's shape and dtype).
        eps: the forward's eps.
    """

    __slots__ = ()
    kind = "rms_norm_bwd"
    output_names = ("grad_x", "grad_weight")

    def __init__(self, grad_out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, grad_x: torch.Tensor,
                 grad_weight: torch.Tensor, *, eps: float = 1e-6) -> None:
        _require_tensor(grad_weight, "grad_weight")
        self._build(grad_out, x, weight, grad_x, grad_weight, None, eps)


class LayerNormBackwardArguments(_NormBackwardArguments):
    """The gradients of `LayerNormArguments`' ``out`` with respect to its normalised input,
    weight and bias.

    Args:
        grad_out: the gradient of ``out``, x's shape and dtype.
        x: the forward's normalised input (``residual_out`` when a residual was added).
        weight: the forward's weight.
        grad_x: receives the gradient of x.
        grad_weight, grad_bias: receive the gradients of weight and bias (weight's shape and dtype).
        eps: the forward's eps.
    """

    __slots__ = ()
    kind = "layer_norm_bwd"
    output_names = ("grad_x", "grad_weight", "grad_bias")

    def __init__(self, grad_out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, grad_x: torch.Tensor,
                 grad_weight: torch.Tensor, grad_bias: torch.Tensor, *, eps: float = 1e-5) -> None:
        _require_tensor(grad_weight, "grad_weight")
        _require_tensor(grad_bias, "grad_bias")
        self._build(grad_out, x, weight, grad_x, grad_weight, grad_bias, eps)
