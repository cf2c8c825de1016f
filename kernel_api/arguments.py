"""Arguments objects: the user's tensors for one operation, validated and summarised.

Construction is on the hot path (a few microseconds): it checks ranks, shapes, devices and
dtypes, and records per operand a `TensorAttributes` (dtype, stride pattern, alignment) plus
a hashable ``signature`` that discovery caches on. No DSL objects, no device sync.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from . import native
from .core.dtypes import _BITS, _FLOATS, _FROM_TORCH, DataType, to_dtype

_BYTES = {dt: max(1, bits // 8) for dt, bits in _BITS.items()}
from .metadata import ACTIVATIONS, TensorAttributes

_MAX_DIVISIBILITY = 128
_ROW = (0, 0, 1)
_COL = (0, 1, 0)
_ROW2 = (0, 1)


class Arguments:
    """Base of all arguments objects.

    ``tensor_attributes`` maps operand names to `TensorAttributes`; ``signature`` is a
    hashable summary of everything metadata checks depend on; ``device`` is the operands'
    device and ``device_index`` its CUDA index (-1 for CPU or meta tensors). Arguments are
    summarised once, at construction: changing an operand's shape, strides or storage
    afterwards (``resize_``, ``set_``) is not supported; build new arguments instead.

    Construction refuses (ValueError naming the operand) what kernels would get wrong without
    a word: an operand carrying torch's lazy negative or conjugate bit (``torch._neg_view(x)``,
    ``c.conj().imag``), which DLPack and raw pointers do not carry (call ``.resolve_neg()`` /
    ``.resolve_conj()``; the tensors passed are kept, never silently copied), and an output
    whose elements overlap (a zero stride on a dimension longer than 1, e.g. from ``expand``),
    which thread blocks would race writing.
    """

    __slots__ = ("tensor_attributes", "signature", "device", "device_index", "_verdicts", "_binding")

    epilogue_signature = None

    def tensors(self) -> dict[str, torch.Tensor]:
        return {name: getattr(self, name) for name in self.tensor_attributes}

    def check_memory(self) -> None:
        """Raise ValueError when an output shares memory with an operand it must not overwrite.

        Run by ``Kernel.run`` with checks on (once per arguments object) and by
        `kernel_api.ops`; kept out of construction so building arguments stays cheap.
        """


def byte_extent(t: torch.Tensor) -> int:
    """Bytes from a tensor's first element to past its last (0 when empty)."""
    if not t.numel():
        return 0
    return (1 + sum((n - 1) * abs(s) for n, s in zip(t.shape, t.stride()))) * t.element_size()


def _dense_extent(t: torch.Tensor) -> tuple[int, int] | None:
    """[first byte, end) of a tensor whose elements fill that range exactly; None for strided
    views with gaps, empty tensors and tensors without memory (meta), which are not judged."""
    ptr, extent = t.data_ptr(), byte_extent(t)
    if not ptr or extent != t.numel() * t.element_size():
        return None
    return (ptr, ptr + extent)


def _shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Exact for dense tensors (overlapping ranges then mean shared elements): torch's rule."""
    ea, eb = _dense_extent(a), _dense_extent(b)
    return ea is not None and eb is not None and ea[0] < eb[1] and eb[0] < ea[1]


def _lazy_bit_error(t: torch.Tensor, name: str) -> ValueError:
    """The refusal of an operand with torch's lazy negative or conjugate bit set."""
    bit, resolve = ("conjugate", "resolve_conj") if t.is_conj() else ("negative", "resolve_neg")
    return ValueError(
        f"operand {name}: has torch's lazy {bit} bit set (a view such as torch._neg_view(x) or c.conj().imag); "
        f"kernels read its memory without the {'conjugation' if bit == 'conjugate' else 'negation'}, "
        f"so call .{resolve}() first")


def _overlaps(inner: int, rows: int, row_stride: int, batch: int, batch_stride: int) -> bool:
    """Whether a non-empty matrix batch of ``batch`` x ``rows`` x ``inner`` elements, ``inner``
    of them contiguous, rows ``row_stride`` apart and matrices ``batch_stride`` apart (strides
    >= 0, as torch's), has two indices at one address. Exact: the cheap tests decide every
    layout torch makes; interleavings they cannot decide are searched."""
    if inner <= 0 or rows <= 0 or batch <= 0:  # empty: nothing is written
        return False
    if rows > 1 and row_stride < inner:  # rows reach into each other (a zero stride included)
        return True
    if batch == 1:
        return False
    if rows <= 1:
        return batch_stride < inner
    if batch_stride >= (rows - 1) * row_stride + inner:  # matrices one after another
        return False
    if batch_stride >= inner and row_stride >= (batch - 1) * batch_stride + inner:  # matrices interleaved by row
        return False
    # Indices (b, r, i) != (b', r', i') meet where db * batch_stride + dr * row_stride is within
    # inner of 0 (|db| < batch, |dr| < rows); row_stride >= inner >= 1 here.
    for db in range(1, batch):
        q, rest = divmod(db * batch_stride, row_stride)
        if (rest < inner and q < rows) or (row_stride - rest < inner and q + 1 < rows):
            return True
    return False


def _require_tensor(value: Any, name: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"operand {name}: expected a torch.Tensor, got {type(value).__name__}")
    return value


def _element_type(t: torch.Tensor, name: str) -> DataType:
    dt = _FROM_TORCH.get(t.dtype)
    if dt is None:
        raise TypeError(f"operand {name}: dtype {t.dtype} is not supported by kernel_api")
    return dt


def _divisibility(ptr: int, itemsize: int, values: tuple[int, ...]) -> int:
    """Largest power of two (capped) dividing the pointer (in elements) and ``values``."""
    g = math.gcd(ptr // itemsize, *values) if ptr % itemsize == 0 else 1
    if g == 0:
        return _MAX_DIVISIBILITY
    g &= -g
    return g if g < _MAX_DIVISIBILITY else _MAX_DIVISIBILITY


_ATTRIBUTES_CACHE: dict[tuple, TensorAttributes] = {}

# kernel_api.native's recall/remember once its CPython entry points load (see _use_native);
# until then (or without a C++ compiler) arguments are summarised in Python every time.
_recall: Any = None
_remember: Any = None
_GEMM_SUMMARY = 0x67656D6D  # the tag of GemmArguments' summaries with the default accumulator
# The tag of summaries made with an explicit accumulator, per accumulator: a summary is only ever
# recalled for the accumulator it was made with.
_SUMMARY_TAG = {dt: _GEMM_SUMMARY + 1 + i for i, dt in enumerate(DataType)}
# accumulator_type as callers spell it (torch.float32, "f32", ...) -> its tag, learnt the first
# time each spelling is resolved; spellings that are not hashable are summarised in Python.
_ACCUMULATOR_TAGS: dict[Any, int] = {}
_ACCUMULATOR_SPELLINGS_LIMIT = 64


def _use_native(entry: Any) -> None:
    global _recall, _remember
    _remember, _recall = entry.remember, entry.recall


native.when_entry_loads(_use_native)


def _attributes(dt: DataType, pattern: tuple[int, ...], div: int) -> TensorAttributes:
    key = (dt, pattern, div)
    found = _ATTRIBUTES_CACHE.get(key)
    if found is None:
        found = _ATTRIBUTES_CACHE[key] = TensorAttributes._trusted(dt, pattern, div)
    return found


def _matrix_attributes(t: torch.Tensor, name: str, shape: Any = None,
                       output: bool = False) -> tuple[torch.Tensor, TensorAttributes]:
    """Attributes of a (L, R, C) or (R, C) operand; may return a re-strided view.

    The stride of a size-1 mode is meaningless, so such a mode is treated as contiguous and
    given stride 1 in a view, which lets kernels rely on the unit stride they declare. An
    ``output`` must not have overlapping elements. Runs three times per GemmArguments, so it
    is written for speed.
    """
    dt = _FROM_TORCH.get(t.dtype)
    if dt is None:
        raise TypeError(f"operand {name}: dtype {t.dtype} is not supported by kernel_api")
    if t.is_neg():  # (no supported dtype is complex, so none carries the conjugate bit)
        raise _lazy_bit_error(t, name)
    if shape is None:
        shape = t.shape
    stride = t.stride()
    rows, cols = shape[-2], shape[-1]
    # The largest power of two dividing every value is the lowest set bit of their OR.
    if stride[-1] == 1:
        pattern = _ROW
        bits = cols | stride[-2] if rows > 1 else cols
    elif stride[-2] == 1:
        pattern = _COL
        bits = rows | stride[-1] if cols > 1 else rows
    elif cols == 1:
        pattern = _ROW
        t = t.as_strided(shape, stride[:-1] + (1,))
        bits = cols | stride[-2] if rows > 1 else cols
    elif rows == 1:
        pattern = _COL
        t = t.as_strided(shape, stride[:-2] + (1, stride[-1]))
        bits = rows | stride[-1]
    else:
        raise ValueError(
            f"operand {name}: strides {tuple(stride)} have no unit-stride mode among the last two; "
            f"kernels need a row-major or column-major matrix (call .contiguous())")
    if len(shape) == 3 and shape[0] > 1:
        bits |= stride[0]
        if output and _overlaps(*((cols, rows, stride[-2]) if pattern is _ROW else (rows, cols, stride[-1])),
                                shape[0], stride[0]):
            raise _overlap_error(name, shape, stride)
    elif output and ((rows > 1 and stride[-2] < cols) if pattern is _ROW else (cols > 1 and stride[-1] < rows)):
        raise _overlap_error(name, shape, stride)
    itemsize = _BYTES[dt]
    ptr = t.data_ptr()
    bits |= ptr // itemsize if ptr % itemsize == 0 else 1
    g = bits & -bits if bits else _MAX_DIVISIBILITY
    if g > _MAX_DIVISIBILITY:
        g = _MAX_DIVISIBILITY
    key = (dt, pattern, g)
    found = _ATTRIBUTES_CACHE.get(key)
    if found is None:
        found = _ATTRIBUTES_CACHE[key] = TensorAttributes._trusted(dt, pattern, g)
    return t, found


def _overlap_error(name: str, shape: Any, stride: Any) -> ValueError:
    return ValueError(
        f"operand {name}: elements overlap (shape {tuple(shape)}, strides {tuple(stride)}: a zero stride, as from "
        f"expand, or strides too small for the sizes); thread blocks would race writing them, so pass an output "
        f"whose elements are distinct (e.g. torch.empty or .contiguous())")


class EpilogueArguments:
    """Fused epilogue: ``out = activation(alpha * (A @ B) + beta * C + bias)``.

    ``C`` has out's shape; ``bias`` is a row vector (shape (N,) or (1, N): one value per
    output column) or a column vector (shape (M, 1), or (M,) when M != N: one per output row);
    ``activation`` is None, "relu", "gelu" (tanh approximation) or "silu".
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

    def _bind(self, out: torch.Tensor, M: int, N: int) -> tuple:
        """Validate against the GEMM's output; return the epilogue's signature."""
        c_attrs = None
        if self.C is not None and self.beta != 0:
            if tuple(self.C.shape) != tuple(out.shape):
                raise ValueError(f"epilogue operand C: shape {tuple(self.C.shape)} must equal out's {tuple(out.shape)}")
            if self.C.device != out.device:
                raise ValueError(f"epilogue operand C: on {self.C.device} but out is on {out.device}")
            if self.C.dtype != out.dtype:
                raise TypeError(f"epilogue operand C: dtype {self.C.dtype} must equal out's {out.dtype}")
            self.C, c_attrs = _matrix_attributes(self.C, "C")
        bias_dtype = None
        if self.bias is not None:
            b = self.bias
            if b.is_neg():
                raise _lazy_bit_error(b, "bias")
            if b.device != out.device:
                raise ValueError(f"epilogue operand bias: on {b.device} but out is on {out.device}")
            if b.dtype != out.dtype:
                raise TypeError(f"epilogue operand bias: dtype {b.dtype} must equal out's {out.dtype}")
            shape = tuple(b.shape)
            if shape == (N,) or shape == (1, N):
                self.bias_kind = "row"
            elif shape == (M, 1) or (shape == (M,) and M != N):
                self.bias_kind = "column"
            else:
                raise ValueError(
                    f"epilogue operand bias: shape {shape} fits neither a row bias (N,)=({N},) / (1, {N}) "
                    f"nor a column bias (M, 1)=({M}, 1)")
            flat = b.reshape(-1)
            if flat.numel() > 1 and flat.stride(0) != 1:
                raise ValueError(f"epilogue operand bias: elements must be contiguous, got strides {tuple(b.stride())}")
            self.bias = flat
            bias_dtype = _FROM_TORCH[b.dtype]
        scaled = self.alpha != 1.0 or self.beta != 0.0
        return (scaled, c_attrs is not None, self.bias_kind, self.activation,
                None if c_attrs is None else c_attrs.key(), bias_dtype)

    def __repr__(self) -> str:
        parts = [f"alpha={self.alpha}", f"beta={self.beta}"]
        if self.C is not None:
            parts.append(f"C={tuple(self.C.shape)}")
        if self.bias is not None:
            parts.append(f"bias={tuple(self.bias.shape)}({self.bias_kind})")
        if self.activation:
            parts.append(f"activation={self.activation!r}")
        return f"EpilogueArguments({', '.join(parts)})"


class GemmArguments(Arguments):
    """``out = A @ B`` (plus an optional fused epilogue).

    A is (L, M, K) or (M, K), B (L, K, N) or (K, N), out (L, M, N) or (M, N), all of one
    rank and on one device. ``accumulator_type`` (torch dtype, CuTe DSL type or name)
    defaults to f64 for f64 operands and f32 otherwise. A trivial epilogue (alpha=1,
    beta=0, no bias, no activation) is dropped so plain kernels stay eligible.
    """

    __slots__ = ("A", "B", "out", "accumulator_type", "epilogue", "epilogue_signature", "L", "M", "N", "K")

    def __init__(self, A: torch.Tensor, B: torch.Tensor, out: torch.Tensor, accumulator_type: Any = None,
                 epilogue: EpilogueArguments | None = None) -> None:
        if _recall is not None and epilogue is None:
            # Operands with the raw metadata (dtypes, shapes, strides, pointer alignment, devices)
            # of earlier arguments without epilogue and with this accumulator have their summary:
            # found in C, without recomputing it.
            if accumulator_type is None:
                tag = _GEMM_SUMMARY
            else:
                try:
                    tag = _ACCUMULATOR_TAGS.get(accumulator_type, 0)
                except TypeError:  # not hashable
                    tag = 0
            found = _recall(tag, A, B, out) if tag else None
            if found is not None:
                (self.L, self.M, self.N, self.K, self.accumulator_type, self.device, self.device_index,
                 attributes, self.signature) = found
                self.A, self.B, self.out = A, B, out
                self.epilogue = self.epilogue_signature = None
                self._verdicts = self._binding = None
                self.tensor_attributes = attributes.copy()
                return
            plain = (A, B, out)
        else:
            plain = None
        if type(A) is not torch.Tensor:
            _require_tensor(A, "A")
        if type(B) is not torch.Tensor:
            _require_tensor(B, "B")
        if type(out) is not torch.Tensor:
            _require_tensor(out, "out")
        sa, sb, so = A.shape, B.shape, out.shape
        rank = len(sa)
        if rank not in (2, 3):
            raise ValueError(f"operand A: rank {rank}, expected (L, M, K) or (M, K)")
        if len(sb) != rank:
            raise ValueError(f"operand B: rank {len(sb)} but A has rank {rank}; expected (L, K, N) or (K, N) to match")
        if len(so) != rank:
            raise ValueError(f"operand out: rank {len(so)} but A has rank {rank}; expected (L, M, N) or (M, N) to match")
        M, K = sa[-2], sa[-1]
        N = sb[-1]
        if sb[-2] != K:
            raise ValueError(f"operand B: K mismatch, B is {tuple(sb)} but A is {tuple(sa)} (K={K})")
        if so[-2] != M:
            raise ValueError(f"operand out: M mismatch, out is {tuple(so)} but A is {tuple(sa)} (M={M})")
        if so[-1] != N:
            raise ValueError(f"operand out: N mismatch, out is {tuple(so)} but B is {tuple(sb)} (N={N})")
        L = 1
        if rank == 3:
            L = sa[0]
            if sb[0] != L:
                raise ValueError(f"operand B: batch mismatch, B has L={sb[0]} but A has L={L}")
            if so[0] != L:
                raise ValueError(f"operand out: batch mismatch, out has L={so[0]} but A has L={L}")
        device_index = A.get_device()
        if B.get_device() != device_index or (device_index < 0 and B.device != A.device):
            raise ValueError(f"operand B: on {B.device} but A is on {A.device}")
        if out.get_device() != device_index or (device_index < 0 and out.device != A.device):
            raise ValueError(f"operand out: on {out.device} but A is on {A.device}")
        device = A.device
        A, a = _matrix_attributes(A, "A", sa)
        B, b = _matrix_attributes(B, "B", sb)
        out, o = _matrix_attributes(out, "out", so, True)
        if accumulator_type is None:
            acc = DataType.f64 if a.dtype is DataType.f64 else DataType.f32
        else:
            acc = _FROM_TORCH.get(accumulator_type) if isinstance(accumulator_type, torch.dtype) else None
            if acc is None:
                acc = to_dtype(accumulator_type, "accumulator_type")
            if acc not in _FLOATS:
                raise ValueError(f"accumulator_type: {acc} is not a floating-point type")
        epilogue_signature = None
        if epilogue is not None:
            if not isinstance(epilogue, EpilogueArguments):
                raise TypeError(f"epilogue: expected EpilogueArguments, got {type(epilogue).__name__}")
            if epilogue.is_trivial:
                epilogue = None
            else:
                epilogue_signature = epilogue._bind(out, M, N)
        self.A, self.B, self.out = A, B, out
        self.L, self.M, self.N, self.K = L, M, N, K
        self.accumulator_type = acc
        self.epilogue = epilogue
        self.epilogue_signature = epilogue_signature
        self.device = device
        self.device_index = device_index
        self._verdicts = self._binding = None
        self.tensor_attributes = {"A": a, "B": b, "out": o}
        self.signature = ("gemm", rank, a._key, b._key, o._key, acc, epilogue_signature, device_index)
        if plain is not None and plain[0] is A and plain[1] is B and plain[2] is out:  # no re-strided views
            if accumulator_type is None:
                tag = _GEMM_SUMMARY
            else:
                tag = _SUMMARY_TAG[acc]
                try:
                    if len(_ACCUMULATOR_TAGS) < _ACCUMULATOR_SPELLINGS_LIMIT:
                        _ACCUMULATOR_TAGS[accumulator_type] = tag
                except TypeError:  # not hashable: never recalled
                    return
            # (its own dict: one this object's owner might change is never handed to later arguments)
            _remember(tag, (L, M, N, K, acc, device, device_index, dict(self.tensor_attributes), self.signature),
                      A, B, out)

    @property
    def problem_shape(self) -> tuple[int, int, int, int]:
        """(M, N, K, L)."""
        return (self.M, self.N, self.K, self.L)

    def check_memory(self) -> None:
        # A kernel would overwrite operands it still reads (torch refuses this too).
        for name in ("A", "B"):
            if _shares_memory(self.out, getattr(self, name)):
                raise ValueError(f"operand out: shares memory with operand {name}; write the result to a separate tensor")

    def __repr__(self) -> str:
        a, b, o = (self.tensor_attributes[n] for n in ("A", "B", "out"))
        return (f"GemmArguments(M={self.M}, N={self.N}, K={self.K}, L={self.L}, "
                f"{a.dtype}{a.layout}*{b.dtype}{b.layout}->{o.dtype}{o.layout}, acc={self.accumulator_type}"
                f"{'' if self.epilogue is None else ', ' + repr(self.epilogue)}, device={self.device})")


def _rows_attributes(t: torch.Tensor, name: str) -> tuple[TensorAttributes, int, int]:
    """Attributes of a tensor reduced along its last dim; (attrs, rows, cols)."""
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
    div = _divisibility(t.data_ptr(), t.element_size(), (cols, row_stride) if rows > 1 else (cols,))
    return _attributes(dt, _ROW2, div), rows, cols


def _normalize_dim(dim: Any, ndim: int) -> int:
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"dim: expected an int, got {type(dim).__name__}")
    if ndim == 0:
        raise ValueError("operand x: softmax needs at least one dimension")
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

    def __init__(self, x: torch.Tensor, out: torch.Tensor, dim: int = -1) -> None:
        _require_tensor(x, "x")
        _require_tensor(out, "out")
        self.dim = _normalize_dim(dim, x.dim())
        _check_like("out", out, "x", x, contiguous=True)
        xa, self.rows, self.cols = _rows_attributes(x, "x")
        oa, _, _ = _rows_attributes(out, "out")
        self.x, self.out = x, out
        self.device = x.device
        self.device_index = x.get_device()
        self._verdicts = self._binding = None
        self.tensor_attributes = {"x": xa, "out": oa}
        self.signature = ("softmax", xa._key, oa._key, x.get_device())

    def __repr__(self) -> str:
        return f"SoftmaxArguments(rows={self.rows}, cols={self.cols}, dtype={self.tensor_attributes['x'].dtype}, device={self.device})"


class SoftmaxBackwardArguments(Arguments):
    """``grad_in = out * (grad_out - sum(grad_out * out, dim))``; all three of one shape and dtype."""

    __slots__ = ("grad_out", "out", "grad_in", "dim", "rows", "cols")

    def __init__(self, grad_out: torch.Tensor, out: torch.Tensor, grad_in: torch.Tensor, dim: int = -1) -> None:
        _require_tensor(grad_out, "grad_out")
        _require_tensor(out, "out")
        _require_tensor(grad_in, "grad_in")
        self.dim = _normalize_dim(dim, out.dim())
        _check_like("grad_out", grad_out, "out", out)
        _check_like("grad_in", grad_in, "out", out, contiguous=True)
        ga, self.rows, self.cols = _rows_attributes(grad_out, "grad_out")
        oa, _, _ = _rows_attributes(out, "out")
        ia, _, _ = _rows_attributes(grad_in, "grad_in")
        self.grad_out, self.out, self.grad_in = grad_out, out, grad_in
        self.device = out.device
        self.device_index = out.get_device()
        self._verdicts = self._binding = None
        self.tensor_attributes = {"grad_out": ga, "out": oa, "grad_in": ia}
        self.signature = ("softmax_bwd", ga._key, oa._key, ia._key, out.get_device())

    def __repr__(self) -> str:
        return (f"SoftmaxBackwardArguments(rows={self.rows}, cols={self.cols}, "
                f"dtype={self.tensor_attributes['out'].dtype}, device={self.device})")
