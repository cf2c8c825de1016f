"""Arguments of the softmax family: forward (`SoftmaxArguments`) and backward
(`SoftmaxBackwardArguments`), both reducing over the last dimension."""

from __future__ import annotations

from typing import Any

import torch

from ..core.tensor_attributes import TensorAttributes
from .base import (_ROW2, Arguments, _attributes, _divisibility, _element_type, _lazy_bit_error, _require_tensor,
                   data_pointer)
from .outputs import check_outputs_disjoint


def _rows_attributes(t: torch.Tensor, name: str) -> tuple[TensorAttributes, int, int, int]:
    """Attributes of a tensor reduced along its last dim; (attrs, rows, cols, phase).

    ``phase`` is where the rows sit relative to 16-byte boundaries: the byte offsets of the
    first row and of the row stride modulo 16. Kernels that peel each row's unaligned head
    need one phase for all operands, and the attributes' divisibility cannot say that."""
    dt = _element_type(t, name)
    if t.is_neg():  # (no supported dtype is complex, so none carries the conjugate bit)
        raise _lazy_bit_error(t, name)
    shape = t.shape
    cols = shape[-1] if shape else 1
    rows = t.numel() // cols if cols else 0
    stride = t.stride()
    if t.dim() and cols > 1 and stride[-1] != 1:
        raise ValueError(f"operand {name}: softmax dim must be contiguous (stride 1), got strides {tuple(stride)}")
    # Rows must be evenly spaced so the kernels can walk them with one row stride.
    if not t.is_contiguous():
        try:
            row_stride = t.view(rows, cols).stride(0) if rows else cols
        except RuntimeError:
            raise ValueError(
                f"operand {name}: rows of shape {tuple(shape)} with strides {tuple(stride)} are not evenly "
                f"spaced; call .contiguous()") from None
    else:
        row_stride = cols
    ptr, size = data_pointer(t), t.element_size()
    div = _divisibility(ptr, size, (cols, row_stride) if rows > 1 else (cols,))
    phase = ptr % 16 | (row_stride * size % 16 if rows > 1 else 0) << 4
    return _attributes(dt, _ROW2, div), rows, cols, phase


def _normalize_dim(dim: Any, ndim: int, name: str) -> int:
    """``dim`` of operand ``name`` (of rank ``ndim``) as a non-negative index: the last dimension."""
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"dim: expected an int, got {type(dim).__name__}")
    if ndim == 0:
        raise ValueError(f"operand {name}: softmax needs at least one dimension")
    if not -ndim <= dim < ndim:
        raise ValueError(f"dim: {dim} out of range for a tensor of rank {ndim}")
    d = dim % ndim
    if d != ndim - 1:
        raise ValueError(
            f"dim: softmax kernels reduce over the last dimension; got dim={dim} for rank {ndim} "
            f"(move that dimension last, e.g. with .transpose(dim, -1).contiguous())")
    return d


def _check_like(name: str, t: torch.Tensor, ref_name: str, ref: torch.Tensor, contiguous: bool = False) -> None:
    """``t`` must have ``ref``'s shape, dtype and device (and be contiguous if asked)."""
    if t.shape != ref.shape:
        raise ValueError(f"operand {name}: shape {tuple(t.shape)} must equal {ref_name}'s {tuple(ref.shape)}")
    if t.dtype != ref.dtype:
        raise TypeError(f"operand {name}: dtype {t.dtype} must equal {ref_name}'s {ref.dtype}")
    if t.device != ref.device:
        raise ValueError(f"operand {name}: on {t.device} but {ref_name} is on {ref.device}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"operand {name}: must be contiguous, got strides {tuple(t.stride())}")


class SoftmaxArguments(Arguments):
    """``out = softmax(x, dim)`` over the last dimension; out has x's shape and dtype."""

    __slots__ = ("x", "out", "dim", "rows", "cols")
    output_names = ("out",)

    def __init__(self, x: torch.Tensor, out: torch.Tensor, dim: int = -1) -> None:
        _require_tensor(x, "x")
        _require_tensor(out, "out")
        self.dim = _normalize_dim(dim, x.dim(), "x")
        _check_like("out", out, "x", x, contiguous=True)
        xa, self.rows, self.cols, xp = _rows_attributes(x, "x")
        oa, _, _, op = _rows_attributes(out, "out")
        self.x, self.out = x, out
        self.device = x.device
        self.device_index = x.get_device()
        self._verdicts = self._binding = None
        self.tensor_attributes = {"x": xa, "out": oa}
        # (phases agree: whether peeled kernels take the operands; choices are cached per signature)
        self.signature = ("softmax", xa._key, oa._key, xp == op, x.get_device())

    def problem_key(self) -> tuple:
        """The signature with the rows and columns: the kernels see the operands as (rows, cols)."""
        return (self.signature, self.rows, self.cols)

    def check_memory(self) -> None:
        """Raise ValueError when out overlaps x other than as x itself (in place)."""
        check_outputs_disjoint(self.tensors(), ("out",), in_place=(("out", "x"),))

    def __repr__(self) -> str:
        return f"SoftmaxArguments(rows={self.rows}, cols={self.cols}, dtype={self.tensor_attributes['x'].dtype}, device={self.device})"


class SoftmaxBackwardArguments(Arguments):
    """``grad_in = out * (grad_out - sum(grad_out * out, dim))``; all three of one shape and dtype."""

    __slots__ = ("grad_out", "out", "grad_in", "dim", "rows", "cols")
    output_names = ("grad_in",)

    def __init__(self, grad_out: torch.Tensor, out: torch.Tensor, grad_in: torch.Tensor, dim: int = -1) -> None:
        _require_tensor(grad_out, "grad_out")
        _require_tensor(out, "out")
        _require_tensor(grad_in, "grad_in")
        self.dim = _normalize_dim(dim, out.dim(), "out")
        _check_like("grad_out", grad_out, "out", out)
        _check_like("grad_in", grad_in, "out", out, contiguous=True)
        ga, self.rows, self.cols, gp = _rows_attributes(grad_out, "grad_out")
        oa, _, _, op = _rows_attributes(out, "out")
        ia, _, _, ip = _rows_attributes(grad_in, "grad_in")
        self.grad_out, self.out, self.grad_in = grad_out, out, grad_in
        self.device = out.device
        self.device_index = out.get_device()
        self._verdicts = self._binding = None
        self.tensor_attributes = {"grad_out": ga, "out": oa, "grad_in": ia}
        # (phases agree: whether peeled kernels take the operands; choices are cached per signature)
        self.signature = ("softmax_bwd", ga._key, oa._key, ia._key, gp == op == ip, out.get_device())

    def problem_key(self) -> tuple:
        """The signature with the rows and columns: the kernels see the operands as (rows, cols)."""
        return (self.signature, self.rows, self.cols)

    def check_memory(self) -> None:
        """Raise ValueError when grad_in overlaps grad_out or out other than as that tensor itself
        (in place)."""
        check_outputs_disjoint(self.tensors(), ("grad_in",),
                               in_place=(("grad_in", "grad_out"), ("grad_in", "out")))

    def __repr__(self) -> str:
        return (f"SoftmaxBackwardArguments(rows={self.rows}, cols={self.cols}, "
                f"dtype={self.tensor_attributes['out'].dtype}, device={self.device})")
