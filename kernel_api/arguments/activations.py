"""Arguments of the gated activations of transformer MLPs: SwiGLU and GeGLU, forward and backward.

A gated activation multiplies ``act(gate)`` by ``up`` elementwise: ``silu`` gives SwiGLU (Llama,
Mistral, Qwen), ``gelu_tanh`` and ``gelu`` (erf) give GeGLU (Gemma, T5 v1.1). ``gate`` and ``up``
often are the two halves of one fused projection (``x.chunk(2, dim=-1)``), so the operands are
taken as rows over their last dimension with any even spacing, not only dense.

The kernels see every operand as ``rows`` rows of ``cols`` elements, each operand with its own
row stride. When every operand is dense the arguments record one row of all the elements
(``rows`` 1, ``cols`` the element count): a kernel then streams them without splitting rows,
and the alignment of a dense operand depends on its pointer alone.
"""

from __future__ import annotations

from typing import Any

import torch

from .base import (_ROW2, Arguments, _attributes, _element_type, _lazy_bit_error, _require_tensor,
                   _rows_overlap_error, data_pointer)
from .outputs import check_outputs_disjoint

#: The activations of the gate: ``silu`` (SwiGLU), ``gelu_tanh`` (GeGLU, tanh approximation), ``gelu`` (erf).
GATE_ACTIVATIONS = ("silu", "gelu_tanh", "gelu")
_MAX_DIVISIBILITY = 128


def _row_stride(t: torch.Tensor, name: str, rows: int, cols: int) -> int:
    """The stride between ``t``'s rows over its last dimension (which must have stride 1)."""
    stride = t.stride()
    if cols > 1 and stride[-1] != 1:
        raise ValueError(f"operand {name}: the last dimension must have stride 1, got strides {tuple(stride)}")
    if rows <= 1 or t.is_contiguous():
        return cols
    try:  # rows evenly spaced: kernels walk them with one row stride
        return t.view(rows, cols).stride(0)
    except RuntimeError:
        raise ValueError(f"operand {name}: rows of shape {tuple(t.shape)} with strides {tuple(stride)} are not evenly "
                         f"spaced; call .contiguous()") from None


def _operand(t: Any, name: str, ref: torch.Tensor | None, ref_name: str) -> torch.Tensor:
    """``t`` checked: a tensor of a kernel_api dtype, no lazy bit, at least one dimension, and
    ``ref``'s shape, dtype and device when given."""
    _require_tensor(t, name)
    _element_type(t, name)
    if t.is_neg():
        raise _lazy_bit_error(t, name)
    if ref is None:
        if t.dim() == 0:
            raise ValueError(f"operand {name}: needs at least one dimension, got a scalar")
        return t
    if t.shape != ref.shape:
        raise ValueError(f"operand {name}: shape {tuple(t.shape)} must equal {ref_name}'s {tuple(ref.shape)}")
    if t.dtype != ref.dtype:
        raise TypeError(f"operand {name}: dtype {t.dtype} must equal {ref_name}'s {ref.dtype}")
    if t.device != ref.device:
        raise ValueError(f"operand {name}: on {t.device} but {ref_name} is on {ref.device}")
    return t


def _activation(activation: Any) -> str:
    if activation not in GATE_ACTIVATIONS:
        raise ValueError(f"activation: expected one of {GATE_ACTIVATIONS}, got {activation!r}")
    return activation


class _GatedBase(Arguments):
    """What the forward and the backward share: operands as rows, one row when all are dense."""

    __slots__ = ("activation", "rows", "cols", "row_strides")
    kind = ""

    def _summarise(self, tensors: dict[str, torch.Tensor], outputs: tuple[str, ...], activation: Any) -> None:
        first = next(iter(tensors.values()))
        cols = first.shape[-1]
        rows = first.numel() // cols if cols else 0
        strides = {name: _row_stride(t, name, rows, cols) for name, t in tensors.items()}
        for name in outputs:
            if rows > 1 and strides[name] < cols:
                raise _rows_overlap_error(name, strides[name], cols)
        if rows > 1 and all(s == cols for s in strides.values()):  # all dense: one row of every element
            rows, cols = 1, rows * cols
            strides = dict.fromkeys(strides, cols)
        self.activation = _activation(activation)
        self.rows, self.cols, self.row_strides = rows, cols, strides
        self.device = first.device
        self.device_index = first.get_device()
        self._verdicts = self._binding = None
        attrs = {}
        for name, t in tensors.items():
            # alignment of the pointer (in elements) and, over several rows, of the row stride;
            # a row's length is not part of it: kernels finish each row's tail element by element
            ptr = data_pointer(t)
            size = t.element_size()
            bits = (ptr // size if ptr % size == 0 else 1) | (strides[name] if rows > 1 else 0)
            div = bits & -bits if bits else _MAX_DIVISIBILITY
            attrs[name] = _attributes(_element_type(t, name), _ROW2, min(div, _MAX_DIVISIBILITY))
        self.tensor_attributes = attrs
        self.signature = (self.kind, self.activation, *[(n, a.key()) for n, a in attrs.items()], self.device_index)

    def problem_key(self) -> tuple:
        """The signature (kind, activation, operand attributes, device) with rows and columns."""
        return (self.signature, self.rows, self.cols)

    def check_memory(self) -> None:
        """Raise ValueError when an output overlaps an input or another output."""
        check_outputs_disjoint(self.tensors(), type(self).output_names)

    def element_count(self) -> int:
        """The elements of one operand (``rows * cols``)."""
        return self.rows * self.cols

    def __repr__(self) -> str:
        dtype = next(iter(self.tensor_attributes.values())).dtype
        return (f"{type(self).__name__}(rows={self.rows}, cols={self.cols}, dtype={dtype}, "
                f"activation={self.activation}, device={self.device})")


class GatedActivationArguments(_GatedBase):
    """``out = act(gate) * up`` elementwise: SwiGLU with ``activation="silu"``, GeGLU with
    ``"gelu_tanh"`` or ``"gelu"``.

    Args:
        gate: any shape (at least one dimension); the last dimension has stride 1 and rows over
            it are evenly spaced (a half of ``x.chunk(2, -1)`` qualifies).
        up: gate's shape, dtype and device, rows as gate's.
        out: gate's shape, dtype and device; its rows must not overlap.
        activation: one of `GATE_ACTIVATIONS`.
    """

    __slots__ = ("gate", "up", "out")
    kind = "gated_activation"
    output_names = ("out",)

    def __init__(self, gate: torch.Tensor, up: torch.Tensor, out: torch.Tensor, *, activation: str = "silu") -> None:
        _operand(gate, "gate", None, "")
        _operand(up, "up", gate, "gate")
        _operand(out, "out", gate, "gate")
        self.gate, self.up, self.out = gate, up, out
        self._summarise({"gate": gate, "up": up, "out": out}, ("out",), activation)


class GatedActivationBackwardArguments(_GatedBase):
    """The gradients of `GatedActivationArguments`' ``out`` with respect to ``gate`` and ``up``:
    ``grad_gate = grad_out * up * act'(gate)``, ``grad_up = grad_out * act(gate)``.

    Args:
        grad_out: the gradient of ``out``, gate's shape and dtype.
        gate, up: the forward's inputs.
        grad_gate, grad_up: receive the gradients (gate's shape and dtype).
        activation: the forward's, one of `GATE_ACTIVATIONS`.
    """

    __slots__ = ("grad_out", "gate", "up", "grad_gate", "grad_up")
    kind = "gated_activation_bwd"
    output_names = ("grad_gate", "grad_up")

    def __init__(self, grad_out: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, grad_gate: torch.Tensor,
                 grad_up: torch.Tensor, *, activation: str = "silu") -> None:
        _operand(gate, "gate", None, "")
        _operand(grad_out, "grad_out", gate, "gate")
        _operand(up, "up", gate, "gate")
        _operand(grad_gate, "grad_gate", gate, "gate")
        _operand(grad_up, "grad_up", gate, "gate")
        self.grad_out, self.gate, self.up, self.grad_gate, self.grad_up = grad_out, gate, up, grad_gate, grad_up
        self._summarise({"grad_out": grad_out, "gate": gate, "up": up, "grad_gate": grad_gate, "grad_up": grad_up},
                        ("grad_gate", "grad_up"), activation)


def gelu_kind(approximate: Any) -> str:
    """The activation name of ``torch.nn.functional.gelu``'s ``approximate``: "tanh" or "none"."""
    if approximate == "tanh":
        return "gelu_tanh"
    if approximate == "none":
        return "gelu"
    raise ValueError(f"approximate: expected 'tanh' or 'none', got {approximate!r}")


__all__ = ["GATE_ACTIVATIONS", "GatedActivationArguments", "GatedActivationBackwardArguments", "gelu_kind"]
