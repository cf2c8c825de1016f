"""Arguments of cross-entropy over class indices, and of its fusion with the linear layer that
makes the logits.

`CrossEntropyArguments` gives each row of ``logits`` (the last dimension is the vocabulary) its
loss and log-sum-exp, against a class index per row in ``target``::

    lse[r]  = log(sum_j exp(x[r, j]))
    loss[r] = (1 - s) * (lse[r] - x[r, t]) + s * (lse[r] - mean_j x[r, j]) + z * lse[r]**2

with ``s`` the label smoothing (torch's definition) and ``z`` the z-loss weight; a row whose
target is ``ignore_index`` has loss 0 (and lse 0). Given ``grad_logits`` and ``grad_loss`` it
also writes the gradient of ``sum_r grad_loss[r] * loss[r]``:

    grad[r, j] = grad_loss[r] * (p[r, j] * (1 + 2 z lse[r]) - s / V - (1 - s) * [j == t])

(``p = softmax(x)``; zero on ignored rows). ``grad_logits`` may be ``logits`` itself: the
gradient then replaces the logits in place, which is how the fused linear cross-entropy keeps
one (chunk x vocabulary) buffer. `CrossEntropyBackwardArguments` writes the same gradient from a
saved ``lse``, without recomputing it.

`LinearCrossEntropyArguments` is the loss of ``logits = hidden @ weight.T (+ bias)`` without the
(tokens x vocabulary) logits: kernels run over chunks of tokens, and with gradients requested
they compute them in the same pass (``grad_hidden``, ``grad_weight``, ``grad_bias`` of
``sum_r grad_loss[r] * loss[r]``), so no backward pass recomputes the logits.

``grad_loss`` is one float per row of the loss's dtype, or one float broadcast to every row
(an ``expand``ed scalar, stride 0): a mean's ``1 / count`` needs no per-row tensor.

`CrossEntropyReducedArguments` is their mean over the rows not ignored (NaN when every row is)
or their sum, and no lse. Its ``loss`` is a buffer of `reduced_size` elements: the loss, a
row's weight in it (1 / the rows not ignored, at least 1, for a mean; 1 for a sum), two zeros,
then each row's loss. The CUDA kernel reduces in the same launch with that room (its arrival
counter, cleared, is the two zeros), so a reduced call is one launch into one made tensor, which
`kernel_api.ops` replays from C. The gradient (``grad_logits``,
``grad_loss``) is that of the per-row losses: a mean's weights (``1 / count``) come in
``grad_loss``. It is an arguments type of its own, so kernels written for the per-row loss are
never handed a buffer they do not know.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..core.dtypes import DataType
from ..core.numbers import is_finite_number
from ..core.tensor_attributes import TensorAttributes
from .base import (_attributes, _divisibility, _element_type, _lazy_bit_error, _require_tensor,
                   _rows_overlap_error, _shares_memory, Arguments, data_pointer)
from .cross_entropy_math import rows_gradient, rows_loss

_ROW2 = (0, 1)
_UNIT = (1,)
_FLOATS = (DataType.f16, DataType.bf16, DataType.f32, DataType.f64)
_INDEX = (DataType.i64, DataType.i32)


def row_stride(t: torch.Tensor, cols: int) -> int:
    """The element stride between consecutive rows of ``t`` seen as (rows, cols)."""
    if t.is_contiguous() or t.dim() < 2:
        return cols
    return t.reshape(-1, cols).stride(0) if t.numel() else cols


def _matrix(t: Any, name: str, output: bool = False) -> tuple[TensorAttributes, int, int]:
    """(attributes, rows, cols) of a floating operand seen as rows over its last dimension; an
    ``output``'s rows must not overlap (thread blocks write them at once)."""
    _require_tensor(t, name)
    dt = _element_type(t, name)
    if dt not in _FLOATS:
        raise TypeError(f"operand {name}: dtype {t.dtype} is not a floating type (f16, bf16, f32 or f64)")
    if t.is_neg():
        raise _lazy_bit_error(t, name)
    if t.dim() == 0:
        raise ValueError(f"operand {name}: needs at least one dimension (the classes), got a scalar")
    cols = t.shape[-1]
    rows = t.numel() // cols if cols else math.prod(t.shape[:-1])
    if cols > 1 and t.stride(-1) != 1:
        raise ValueError(f"operand {name}: the last dimension must have stride 1, got strides {tuple(t.stride())}")
    try:  # rows evenly spaced: kernels walk them with one row stride
        ld = t.view(rows, cols).stride(0) if rows > 1 and cols else cols
    except RuntimeError:
        raise ValueError(f"operand {name}: rows of shape {tuple(t.shape)} with strides {tuple(t.stride())} are not "
                         f"evenly spaced; call .contiguous()") from None
    if output and rows > 1 and ld < cols:
        raise _rows_overlap_error(name, ld, cols)
    div = _divisibility(data_pointer(t), t.element_size(), (cols, ld) if rows > 1 else (max(cols, 1),))
    return _attributes(dt, _ROW2, div), rows, cols


def _per_row(t: Any, name: str, shape: tuple, types: tuple, what: str, broadcast: bool = False) -> TensorAttributes:
    """Attributes of an operand holding one value per row: ``shape``, one element stride (1;
    or 0 where ``broadcast``), a dtype among ``types``."""
    _require_tensor(t, name)
    dt = _element_type(t, name)
    if dt not in types:
        raise TypeError(f"operand {name}: dtype {t.dtype} but {what}")
    if t.is_neg():
        raise _lazy_bit_error(t, name)
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"operand {name}: shape {tuple(t.shape)} must be {tuple(shape)}, one value per row of the "
                         f"logits")
    if t.numel() > 1:
        try:
            step = t.view(-1).stride(0)
        except RuntimeError:
            step = -1
        if step != 1 and not (broadcast and step == 0):
            allowed = "dense or a broadcast scalar (stride 0)" if broadcast else "dense (contiguous)"
            raise ValueError(f"operand {name}: strides {tuple(t.stride())} but it must be {allowed}")
    return _attributes(dt, _UNIT, _divisibility(data_pointer(t), t.element_size(), (max(t.numel(), 1),)))


#: Elements of `CrossEntropyReducedArguments`' ``loss`` buffer before the rows' losses: the
#: loss, a row's weight in it, two zeros.
REDUCED_HEAD = 4


def reduced_size(rows: int) -> int:
    """Elements of the ``loss`` buffer of a mean or a sum over ``rows`` rows: `REDUCED_HEAD`,
    then one per row."""
    return REDUCED_HEAD + rows


def _reduced_buffer(t: Any, rows: int, types: tuple, what: str) -> TensorAttributes:
    """Attributes of `CrossEntropyReducedArguments`' ``loss``: `reduced_size` elements, dense."""
    _require_tensor(t, "loss")
    dt = _element_type(t, "loss")
    if dt not in types:
        raise TypeError(f"operand loss: dtype {t.dtype} but {what}")
    if t.is_neg():
        raise _lazy_bit_error(t, "loss")
    size = reduced_size(rows)
    if tuple(t.shape) != (size,):
        raise ValueError(f"operand loss: shape {tuple(t.shape)} must be ({size},) for a mean or a sum over {rows} "
                         f"rows: the loss, then the kernels' workspace (reduced_size)")
    if t.stride(0) != 1:
        raise ValueError(f"operand loss: strides {tuple(t.stride())} but it must be dense (contiguous)")
    return _attributes(dt, _UNIT, _divisibility(data_pointer(t), t.element_size(), (size,)))


def _device(t: torch.Tensor, name: str, ref: torch.Tensor, ref_name: str) -> None:
    if t.device != ref.device:
        raise ValueError(f"operand {name}: on {t.device} but {ref_name} is on {ref.device}")


def _scalars(ignore_index: Any, label_smoothing: Any, z_loss: Any) -> tuple[int, float, float]:
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"ignore_index: expected an int, got {ignore_index!r}")
    if not -2**63 <= ignore_index < 2**63:  # kernels compare it with class indices as a 64-bit int
        raise ValueError(f"ignore_index: {ignore_index} is outside the int64 range of class indices")
    for name, v in (("label_smoothing", label_smoothing), ("z_loss", z_loss)):
        if not is_finite_number(v):
            raise ValueError(f"{name}: expected a finite float, got {v!r}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing: expected a float in [0, 1], got {label_smoothing!r}")
    if z_loss < 0:
        raise ValueError(f"z_loss: expected a float >= 0, got {z_loss!r}")
    return int(ignore_index), float(label_smoothing), float(z_loss)


def loss_dtype(t: torch.Tensor) -> torch.dtype:
    """The dtype of the per-row loss, lse and grad_loss for logits (or hidden states) ``t``:
    float64 for float64, else float32."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _loss_types(t: torch.Tensor) -> tuple:
    return (DataType.f64,) if t.dtype == torch.float64 else (DataType.f32,)


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` are the same elements (in-place operation)."""
    return (a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()
            and a.dtype == b.dtype)


def _check_disjoint(args: Arguments, outputs: tuple[str, ...], in_place: tuple[tuple[str, str], ...] = ()) -> None:
    """No output shares memory with another operand, except the pairs ``in_place`` when they are
    the very same view."""
    tensors = {n: t for n, t in args.tensors().items() if t is not None}
    for i, name in enumerate(outputs):
        out = tensors.get(name)
        if out is None:
            continue
        for other, t in tensors.items():
            if other == name or (other in outputs and outputs.index(other) < i):
                continue
            if (name, other) in in_place and _same_view(out, t):
                continue
            if _shares_memory(out, t):
                raise ValueError(f"operand {name}: overlaps {other} in memory; give {name} its own memory")


class _CrossEntropyForward(Arguments):
    """What the forward arguments types share: the logits and targets, the optional gradient,
    the loss's scalars; a subclass adds its loss outputs (`_outputs`)."""

    __slots__ = ("logits", "target", "loss", "lse", "grad_logits", "grad_loss", "ignore_index", "label_smoothing",
                 "z_loss", "rows", "cols")
    output_names: tuple[str, ...] = ()
    _with_grad: type | None = None

    def __new__(cls, *args: Any, grad_logits: Any = None, **kwargs: Any) -> "_CrossEntropyForward":
        if grad_logits is not None and cls._with_grad is not None:
            cls = cls._with_grad
        return object.__new__(cls)

    def _outputs(self, logits: torch.Tensor, loss: Any, lse: Any, floats: tuple, what: str) -> dict:
        """The loss outputs' attributes, checked."""
        raise NotImplementedError

    def _build(self, logits: Any, target: Any, loss: Any, lse: Any, grad_logits: Any, grad_loss: Any,
               ignore_index: Any, label_smoothing: Any, z_loss: Any, *key: Any) -> None:
        xa, self.rows, self.cols = _matrix(logits, "logits")
        if self.cols == 0:
            raise ValueError(f"operand logits: shape {tuple(logits.shape)} has no classes (last dimension 0)")
        rows_shape = tuple(logits.shape[:-1])
        attrs = {"logits": xa}
        attrs["target"] = _per_row(target, "target", rows_shape, _INDEX, "class indices are int64 or int32")
        _device(target, "target", logits, "logits")
        floats = _loss_types(logits)
        what = f"it must be {floats[0]} for {logits.dtype} logits"
        attrs.update(self._outputs(logits, loss, lse, floats, what))
        if (grad_logits is None) != (grad_loss is None):
            given, missing = ("grad_logits", "grad_loss") if grad_loss is None else ("grad_loss", "grad_logits")
            raise ValueError(f"operand {missing}: required with {given} (the gradient takes both)")
        if grad_logits is not None:
            ga, _, _ = _matrix(grad_logits, "grad_logits", output=True)
            if grad_logits.shape != logits.shape:
                raise ValueError(f"operand grad_logits: shape {tuple(grad_logits.shape)} must equal logits' "
                                 f"{tuple(logits.shape)}")
            if grad_logits.dtype != logits.dtype:
                raise TypeError(f"operand grad_logits: dtype {grad_logits.dtype} must equal logits' {logits.dtype}")
            _device(grad_logits, "grad_logits", logits, "logits")
            attrs["grad_logits"] = ga
            attrs["grad_loss"] = _per_row(grad_loss, "grad_loss", rows_shape, floats, what, broadcast=True)
            _device(grad_loss, "grad_loss", logits, "logits")
        self.logits, self.target, self.loss, self.lse = logits, target, loss, lse
        self.grad_logits, self.grad_loss = grad_logits, grad_loss
        self.ignore_index, self.label_smoothing, self.z_loss = _scalars(ignore_index, label_smoothing, z_loss)
        self.device = logits.device
        self.device_index = logits.get_device()
        self._verdicts = self._binding = None
        self.tensor_attributes = attrs
        self.signature = (self.kind, *key, *[(n, a.key()) for n, a in attrs.items()], self.device_index)

    def problem_key(self) -> tuple:
        """The signature with the rows and classes."""
        return (type(self), self.signature, self.rows, self.cols)

    def check_memory(self) -> None:
        """Raise ValueError when an output overlaps another operand (``grad_logits`` may be
        ``logits`` exactly)."""
        _check_disjoint(self, type(self).output_names, (("grad_logits", "logits"),))

    def _describe(self, name: str, extra: str = "") -> str:
        grad = ", grad_logits" if self.grad_logits is not None else ""
        return (f"{name}(rows={self.rows}, cols={self.cols}, "
                f"logits={self.tensor_attributes['logits'].dtype}, target={self.tensor_attributes['target'].dtype}, "
                f"ignore_index={self.ignore_index}, label_smoothing={self.label_smoothing:g}, "
                f"z_loss={self.z_loss:g}{extra}{grad}, device={self.device})")


class CrossEntropyArguments(_CrossEntropyForward):
    """Per-row cross-entropy loss and log-sum-exp; with ``grad_logits``, also its gradient.

    Args:
        logits: rows over the last dimension (the classes), any leading dimensions; f16, bf16,
            f32 or f64; the last dimension of stride 1, rows evenly spaced.
        target: class indices, ``logits.shape[:-1]``, int64 or int32, dense.
        loss, lse: receive the per-row loss and log-sum-exp: ``logits.shape[:-1]``, dense,
            float32 (float64 for f64 logits).
        grad_logits: optional, logits' shape and dtype, rows evenly spaced: receives the
            gradient of ``sum(grad_loss * loss)``; may be ``logits`` itself (in place).
        grad_loss: with ``grad_logits``: the weight of each row's loss (loss's dtype and shape,
            or a broadcast scalar).
        ignore_index: rows whose target equals it have loss 0 and gradient 0.
        label_smoothing: in [0, 1], as torch's ``cross_entropy``.
        z_loss: weight of ``lse**2`` added to each row's loss (>= 0).
    """

    __slots__ = ()
    output_names = ("loss", "lse")
    kind = "cross_entropy"

    def __init__(self, logits: torch.Tensor, target: torch.Tensor, loss: torch.Tensor, lse: torch.Tensor, *,
                 grad_logits: torch.Tensor | None = None, grad_loss: torch.Tensor | None = None,
                 ignore_index: int = -100, label_smoothing: float = 0.0, z_loss: float = 0.0) -> None:
        self._build(logits, target, loss, lse, grad_logits, grad_loss, ignore_index, label_smoothing, z_loss)

    def _outputs(self, logits: torch.Tensor, loss: Any, lse: Any, floats: tuple, what: str) -> dict:
        attrs = {}
        for name, t in (("loss", loss), ("lse", lse)):
            attrs[name] = _per_row(t, name, tuple(logits.shape[:-1]), floats, what)
            _device(t, name, logits, "logits")
        return attrs

    def __repr__(self) -> str:
        return self._describe("CrossEntropyArguments")


class CrossEntropyReducedArguments(_CrossEntropyForward):
    """The mean or the sum of the rows' cross-entropy losses (as `CrossEntropyArguments` defines
    them), in one tensor; with ``grad_logits``, also the gradient of the weighted rows' losses.

    Args:
        logits, target, grad_logits, grad_loss, ignore_index, label_smoothing, z_loss: as for
            `CrossEntropyArguments` (the gradient is of ``sum(grad_loss * per-row loss)``, so a
            mean's weights, ``1 / count``, come in ``grad_loss``).
        loss: a dense buffer of ``reduced_size(rows)`` elements, float32 (float64 for f64
            logits), for the loss (element 0), a row's weight in it (element 1: 1 / the rows
            not ignored, at least 1, for a mean; 1 for a sum), two zeros, then the rows' losses
            (element ``REDUCED_HEAD + r``: row r's, in the order of ``logits.shape[:-1]``).
        reduction: "mean" (over the rows not ignored: NaN when every row is, as torch's) or
            "sum".
    """

    __slots__ = ("reduction",)
    output_names = ("loss",)
    kind = "cross_entropy_reduced"

    def __init__(self, logits: torch.Tensor, target: torch.Tensor, loss: torch.Tensor, *,
                 grad_logits: torch.Tensor | None = None, grad_loss: torch.Tensor | None = None,
                 ignore_index: int = -100, label_smoothing: float = 0.0, z_loss: float = 0.0,
                 reduction: str = "mean") -> None:
        if reduction not in ("mean", "sum"):
            raise ValueError(f"reduction: expected 'mean' or 'sum', got {reduction!r}")
        self.reduction = reduction
        self._build(logits, target, loss, None, grad_logits, grad_loss, ignore_index, label_smoothing, z_loss,
                    reduction)

    def _outputs(self, logits: torch.Tensor, loss: Any, lse: Any, floats: tuple, what: str) -> dict:
        attrs = {"loss": _reduced_buffer(loss, self.rows, floats, what)}
        _device(loss, "loss", logits, "logits")
        return attrs

    def reference_outputs(self) -> dict[str, torch.Tensor]:
        """The buffer (and the gradient) in float64, from `cross_entropy_math`'s definition."""
        logits = self.logits.reshape(self.rows, self.cols).double()
        target = self.target.reshape(self.rows)
        scalars = (self.ignore_index, self.label_smoothing, self.z_loss)
        per_row, lse, valid = rows_loss(logits, target, *scalars)
        total, count = per_row.sum(), valid.sum()
        head = torch.zeros(REDUCED_HEAD, dtype=torch.float64, device=logits.device)
        head[0] = total / count if self.reduction == "mean" else total
        head[1] = 1.0 / count.clamp(min=1).double() if self.reduction == "mean" else 1.0
        found = {"loss": torch.cat((head, per_row))}
        if self.grad_logits is not None:
            grad = rows_gradient(logits, target, lse, self.grad_loss.reshape(-1), *scalars)
            found["grad_logits"] = grad.view(self.logits.shape)
        return found

    def __repr__(self) -> str:
        return self._describe("CrossEntropyReducedArguments", f", reduction={self.reduction}")


def _with_gradient(cls: type, names: tuple[str, ...]) -> None:
    name = f"_{cls.__name__[:-len('Arguments')]}GradArguments"
    cls._with_grad = type(name, (cls,), {"__slots__": (), "output_names": names, "__module__": __name__,
                                         "__doc__": f"`{cls.__name__}` with the gradient: outputs {', '.join(names)}."})
    globals()[name] = cls._with_grad  # found by name: pickled for compile workers


_with_gradient(CrossEntropyArguments, ("loss", "lse", "grad_logits"))
_with_gradient(CrossEntropyReducedArguments, ("loss", "grad_logits"))


class CrossEntropyBackwardArguments(Arguments):
    """The gradient of `CrossEntropyArguments`' loss with respect to the logits, from the
    forward's saved ``lse``.

    Args:
        grad_loss: the weight of each row's loss: ``logits.shape[:-1]``, float32 (float64 for
            f64 logits), dense or a broadcast scalar.
        logits, target, lse: as the forward had them (lse: its output).
        grad_logits: receives the gradient, logits' shape and dtype; may be ``logits`` itself.
        ignore_index, label_smoothing, z_loss: the forward's.
    """

    __slots__ = ("grad_loss", "logits", "target", "lse", "grad_logits", "ignore_index", "label_smoothing", "z_loss",
                 "rows", "cols")
    output_names = ("grad_logits",)
    kind = "cross_entropy_bwd"

    def __init__(self, grad_loss: torch.Tensor, logits: torch.Tensor, target: torch.Tensor, lse: torch.Tensor,
                 grad_logits: torch.Tensor, *, ignore_index: int = -100, label_smoothing: float = 0.0,
                 z_loss: float = 0.0) -> None:
        xa, self.rows, self.cols = _matrix(logits, "logits")
        if self.cols == 0:
            raise ValueError(f"operand logits: shape {tuple(logits.shape)} has no classes (last dimension 0)")
        rows_shape = tuple(logits.shape[:-1])
        floats = _loss_types(logits)
        what = f"it must be {floats[0]} for {logits.dtype} logits"
        attrs = {"grad_loss": _per_row(grad_loss, "grad_loss", rows_shape, floats, what, broadcast=True),
                 "logits": xa,
                 "target": _per_row(target, "target", rows_shape, _INDEX, "class indices are int64 or int32"),
                 "lse": _per_row(lse, "lse", rows_shape, floats, what)}
        for name, t in (("grad_loss", grad_loss), ("target", target), ("lse", lse)):
            _device(t, name, logits, "logits")
        attrs["grad_logits"], _, _ = _matrix(grad_logits, "grad_logits", output=True)
        if grad_logits.shape != logits.shape:
            raise ValueError(f"operand grad_logits: shape {tuple(grad_logits.shape)} must equal logits' "
                             f"{tuple(logits.shape)}")
        if grad_logits.dtype != logits.dtype:
            raise TypeError(f"operand grad_logits: dtype {grad_logits.dtype} must equal logits' {logits.dtype}")
        _device(grad_logits, "grad_logits", logits, "logits")
        self.grad_loss, self.logits, self.target, self.lse, self.grad_logits = grad_loss, logits, target, lse, grad_logits
        self.ignore_index, self.label_smoothing, self.z_loss = _scalars(ignore_index, label_smoothing, z_loss)
        self.device = logits.device
        self.device_index = logits.get_device()
        self._verdicts = self._binding = None
        self.tensor_attributes = attrs
        self.signature = (self.kind, *[(n, a.key()) for n, a in attrs.items()], self.device_index)

    def problem_key(self) -> tuple:
        """The signature with the rows and classes."""
        return (type(self), self.signature, self.rows, self.cols)

    def check_memory(self) -> None:
        """Raise ValueError when grad_logits overlaps another operand (it may be ``logits`` exactly)."""
        _check_disjoint(self, self.output_names, (("grad_logits", "logits"),))

    def __repr__(self) -> str:
        return (f"CrossEntropyBackwardArguments(rows={self.rows}, cols={self.cols}, "
                f"logits={self.tensor_attributes['logits'].dtype}, ignore_index={self.ignore_index}, "
                f"label_smoothing={self.label_smoothing:g}, z_loss={self.z_loss:g}, device={self.device})")


_GRADIENTS = ("grad_hidden", "grad_weight", "grad_bias")


class LinearCrossEntropyArguments(Arguments):
    """Cross-entropy of ``logits = hidden @ weight.T (+ bias)`` per token, without the logits;
    with gradient outputs, also those gradients of ``sum(grad_loss * loss)``.

    Args:
        hidden: (tokens, hidden size), f16, bf16 or f32 (f64 on the torch provider), row-major
            with the last dimension of stride 1.
        weight: (vocabulary, hidden size), hidden's dtype, row-major.
        target: (tokens,), int64 or int32, dense.
        loss: receives the per-token loss: (tokens,), float32 (float64 for f64), dense.
        bias: optional, (vocabulary,), hidden's dtype, dense.
        grad_hidden, grad_weight, grad_bias: optional, each receives its input's gradient
            (its input's shape and dtype, dense); any subset (a frozen weight needs none of
            its own), grad_bias only with a bias.
        grad_loss: with any gradient: each token's loss weight (loss's dtype, or a broadcast
            scalar).
        ignore_index, label_smoothing, z_loss: as for `CrossEntropyArguments`.
    """

    __slots__ = ("hidden", "weight", "target", "loss", "bias", "grad_hidden", "grad_weight", "grad_bias", "grad_loss",
                 "ignore_index", "label_smoothing", "z_loss", "rows", "cols", "vocab")
    output_names = ("loss",)
    kind = "linear_cross_entropy"
    #: The subclass of each set of outputs (`kernel_api.ops.call` returns the outputs the type
    #: names): construction picks it; users name only this class.
    _by_outputs: dict = {}

    def __new__(cls, *args: Any, **kwargs: Any) -> "LinearCrossEntropyArguments":
        names = ("loss", *[n for n in _GRADIENTS if kwargs.get(n) is not None])
        if len(names) > 1 and cls is LinearCrossEntropyArguments:
            cls = _with_outputs(names)
        return object.__new__(cls)

    def __init__(self, hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, loss: torch.Tensor, *,
                 bias: torch.Tensor | None = None, grad_hidden: torch.Tensor | None = None,
                 grad_weight: torch.Tensor | None = None, grad_bias: torch.Tensor | None = None,
                 grad_loss: torch.Tensor | None = None, ignore_index: int = -100, label_smoothing: float = 0.0,
                 z_loss: float = 0.0) -> None:
        ha, self.rows, self.cols = _dense_matrix(hidden, "hidden")
        wa, self.vocab, wcols = _dense_matrix(weight, "weight")
        if wcols != self.cols:
            raise ValueError(f"operand weight: shape {tuple(weight.shape)} must be (vocabulary, {self.cols}), the "
                             f"hidden size of hidden {tuple(hidden.shape)}")
        if self.vocab == 0:
            raise ValueError(f"operand weight: shape {tuple(weight.shape)} has no classes (vocabulary 0)")
        if weight.dtype != hidden.dtype:
            raise TypeError(f"operand weight: dtype {weight.dtype} must equal hidden's {hidden.dtype}")
        _device(weight, "weight", hidden, "hidden")
        rows_shape = (self.rows,)
        floats = _loss_types(hidden)
        what = f"it must be {floats[0]} for {hidden.dtype} hidden states"
        attrs = {"hidden": ha, "weight": wa,
                 "target": _per_row(target, "target", rows_shape, _INDEX, "class indices are int64 or int32"),
                 "loss": _per_row(loss, "loss", rows_shape, floats, what)}
        _device(target, "target", hidden, "hidden")
        _device(loss, "loss", hidden, "hidden")
        if bias is not None:
            attrs["bias"] = _vector(bias, "bias", self.vocab, hidden)
        if grad_hidden is not None:
            attrs["grad_hidden"] = _like(grad_hidden, "grad_hidden", hidden, "hidden")
        if grad_weight is not None:
            attrs["grad_weight"] = _like(grad_weight, "grad_weight", weight, "weight")
        if grad_bias is not None:
            if bias is None:
                raise ValueError("operand grad_bias: given without bias")
            attrs["grad_bias"] = _vector(grad_bias, "grad_bias", self.vocab, hidden)
        wants = grad_hidden is not None or grad_weight is not None or grad_bias is not None
        if wants != (grad_loss is not None):
            raise ValueError("operand grad_loss: required with the gradient outputs" if wants else
                             "operand grad_loss: given without a gradient output (grad_hidden, grad_weight, grad_bias)")
        if grad_loss is not None:
            attrs["grad_loss"] = _per_row(grad_loss, "grad_loss", rows_shape, floats, what, broadcast=True)
            _device(grad_loss, "grad_loss", hidden, "hidden")
        self.hidden, self.weight, self.target, self.loss, self.bias = hidden, weight, target, loss, bias
        self.grad_hidden, self.grad_weight, self.grad_bias, self.grad_loss = grad_hidden, grad_weight, grad_bias, grad_loss
        self.ignore_index, self.label_smoothing, self.z_loss = _scalars(ignore_index, label_smoothing, z_loss)
        self.device = hidden.device
        self.device_index = hidden.get_device()
        self._verdicts = self._binding = None
        self.tensor_attributes = attrs
        self.signature = (self.kind, *[(n, a.key()) for n, a in attrs.items()], self.device_index)

    @property
    def wants_gradient(self) -> bool:
        """Whether any gradient output is given."""
        return self.grad_loss is not None

    def problem_key(self) -> tuple:
        """The signature with the tokens, hidden size and vocabulary."""
        return (type(self), self.signature, self.rows, self.cols, self.vocab)

    def check_memory(self) -> None:
        """Raise ValueError when an output overlaps another operand."""
        _check_disjoint(self, type(self).output_names)

    def __repr__(self) -> str:
        grads = [n[5:] for n in _GRADIENTS if getattr(self, n) is not None]
        grad = f", gradients of {'/'.join(grads)}" if grads else ""
        bias = ", bias" if self.bias is not None else ""
        return (f"LinearCrossEntropyArguments(tokens={self.rows}, hidden={self.cols}, vocab={self.vocab}, "
                f"dtype={self.tensor_attributes['hidden'].dtype}{bias}, ignore_index={self.ignore_index}, "
                f"label_smoothing={self.label_smoothing:g}, z_loss={self.z_loss:g}{grad}, device={self.device})")


def _with_outputs(names: tuple[str, ...]) -> type:
    """The `LinearCrossEntropyArguments` subclass whose outputs are ``names``."""
    found = LinearCrossEntropyArguments._by_outputs.get(names)
    if found is None:
        doc = f"`LinearCrossEntropyArguments` with outputs {', '.join(names)}."
        found = type(f"_LinearCrossEntropy_{'_'.join(n[5:] for n in names[1:])}", (LinearCrossEntropyArguments,),
                     {"__slots__": (), "output_names": names, "__doc__": doc, "__module__": __name__})
        LinearCrossEntropyArguments._by_outputs[names] = found
    return found


def _dense_matrix(t: Any, name: str) -> tuple[TensorAttributes, int, int]:
    """(attributes, rows, cols) of a 2-D row-major operand (the GEMMs read it with one row stride)."""
    _require_tensor(t, name)
    if t.dim() != 2:
        raise ValueError(f"operand {name}: must be 2-D, got shape {tuple(t.shape)}")
    return _matrix(t, name)


def _like(t: Any, name: str, ref: torch.Tensor, ref_name: str) -> TensorAttributes:
    """Attributes of a dense output with ``ref``'s shape, dtype and device."""
    _require_tensor(t, name)
    if t.shape != ref.shape:
        raise ValueError(f"operand {name}: shape {tuple(t.shape)} must equal {ref_name}'s {tuple(ref.shape)}")
    if t.dtype != ref.dtype:
        raise TypeError(f"operand {name}: dtype {t.dtype} must equal {ref_name}'s {ref.dtype}")
    _device(t, name, ref, ref_name)
    if not t.is_contiguous():
        raise ValueError(f"operand {name}: strides {tuple(t.stride())} but it must be contiguous")
    return _matrix(t, name)[0]


def _vector(t: Any, name: str, n: int, ref: torch.Tensor) -> TensorAttributes:
    """Attributes of a dense 1-D operand of ``n`` elements of ``ref``'s dtype and device."""
    _require_tensor(t, name)
    _element_type(t, name)
    if t.is_neg():
        raise _lazy_bit_error(t, name)
    if tuple(t.shape) != (n,):
        raise ValueError(f"operand {name}: shape {tuple(t.shape)} must be ({n},), the vocabulary")
    if t.dtype != ref.dtype:
        raise TypeError(f"operand {name}: dtype {t.dtype} must equal hidden's {ref.dtype}")
    _device(t, name, ref, "hidden")
    if n > 1 and t.stride(0) != 1:
        raise ValueError(f"operand {name}: must have stride 1, got stride {t.stride(0)}")
    return _attributes(_element_type(t, name), _UNIT, _divisibility(data_pointer(t), t.element_size(), (n,)))
