"""The base of arguments objects and the operand checks they share.

`Arguments` is what every arguments type derives from; the helpers below summarise one
operand (element type, stride pattern, alignment) into a `TensorAttributes` and refuse what
kernels would get wrong without a word (lazy negative or conjugate bits, overlapping outputs,
strides without a unit mode). They run on the hot path, so they are written for speed.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import torch

from ..core.dtypes import _BITS, _FROM_TORCH, DataType
from ..core.tensor_attributes import COLUMN_MAJOR, ROW_MAJOR, TensorAttributes

_BYTES = {dt: max(1, bits // 8) for dt, bits in _BITS.items()}

_MAX_DIVISIBILITY = 128
_ROW2 = (0, 1)

try:  # tensors without real storage: torch.compile traces with them
    from torch._subclasses.fake_tensor import FakeTensor
    from torch._subclasses.functional_tensor import FunctionalTensor

    STORAGELESS_TYPES: tuple[type, ...] = (FakeTensor, FunctionalTensor)
except ImportError:  # another torch layout: data_ptr is asked as for any tensor
    STORAGELESS_TYPES = ()


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

    Operands may be fake tensors (FakeTensor, FunctionalTensor, as torch.compile traces with):
    their data pointer is never asked for (strict tracing refuses it); their alignment is taken
    to be that of their storage offset, as for a storage allocated aligned.
    """

    __slots__ = ("tensor_attributes", "signature", "device", "device_index", "_verdicts", "_binding")

    epilogue_signature = None
    #: The operands a kernel writes, in order: what `kernel_api.ops.call` returns (one tensor,
    #: a tuple of several, or None when the type declares none).
    output_names: tuple[str, ...] = ()
    #: The non-tensor attributes a kernel's choice depends on beyond ``signature`` (sizes the
    #: shapes do not show, a reduction's length, ...): part of the default `problem_key`.
    problem_fields: tuple[str, ...] = ()

    def tensors(self) -> dict[str, torch.Tensor]:
        return {name: getattr(self, name) for name in self.tensor_attributes}

    def problem_key(self) -> tuple:
        """The key under which `kernel_api.ops` remembers its choice for these arguments.

        Two arguments with equal keys must get the same kernel from every policy: the key holds
        the arguments type, the ``signature`` (operand attributes and device), every operand's
        shape and the ``problem_fields`` the type declares. A subtype may return a shorter key
        that still says the same (softmax: rows and columns).

        Returns:
            A hashable tuple.
        """
        return (type(self), self.signature, *[tuple(getattr(self, name).shape) for name in self.tensor_attributes],
                *[getattr(self, name) for name in self.problem_fields])

    def check_memory(self) -> None:
        """Raise ValueError when an output shares memory with an operand it must not overwrite.

        Run by ``Kernel.run`` with checks on (once per arguments object) and by
        `kernel_api.ops`; kept out of construction so building arguments stays cheap.
        """

    def random_like(self, generator: torch.Generator | None = None) -> Arguments:
        """Arguments of the same metadata (type, signature, shapes, strides, pointer alignment,
        scalars) with fresh values: what a tuner verifies and times candidates on.

        The default replaces each operand of ``tensor_attributes`` by a tensor of its layout
        (`random_tensor_like`): floating inputs get standard normal values, integer inputs (class
        indices, positions) a copy of their values, outputs NaN (integers: -1), so a kernel that
        leaves elements unwritten fails verification. Operands that are one view of each other
        (an output written in place over an input) stay one view. Tensors outside
        ``tensor_attributes`` (sequence offsets, say) are shared as they are. A type whose
        kernels need particular values (a valid range, a probability distribution) overrides
        this.

        Args:
            generator: the random generator (None: torch's default for the device).

        Returns:
            A new arguments object of ``type(self)``, bound to no launch.
        """
        new = unbound_copy(self)
        outputs = type(self).output_names
        tensors = self.tensors()
        made: dict[tuple, torch.Tensor] = {}
        for name in sorted(tensors, key=lambda n: n in outputs):  # inputs first: an in-place output reuses its input's
            t = tensors[name]
            view = (data_pointer(t), tuple(t.shape), t.stride(), t.dtype)
            found = made.get(view) if t.numel() else None
            if found is None:
                found = made[view] = random_tensor_like(t, generator, output=name in outputs)
            setattr(new, name, found)
        return new

    def reference_outputs(self) -> dict[str, torch.Tensor] | None:
        """The outputs these arguments' kernels must compute, in float64 (name -> tensor shaped
        like that output), for verifying candidates; None where the type offers none (a tuner
        then compares with the torch provider's kernel). Computed from the operands' current
        values; writes nothing."""
        return None


def unbound_copy(args: Arguments) -> Arguments:
    """A copy of ``args`` sharing its tensors and summary but not the launch a kernel bound to
    it, nor the support verdicts: the next kernel to run on the copy binds a launch of its own
    (a tuner times several kernels on one set of tensors, each on its bound fast path)."""
    new = copy.copy(args)
    new._verdicts = new._binding = None
    return new


def random_tensor_like(t: torch.Tensor, generator: torch.Generator | None = None, output: bool = False) -> torch.Tensor:
    """A new tensor with ``t``'s shape, strides, dtype and device and its pointer's alignment
    (the offset, in elements, modulo 128), in storage of its own.

    Args:
        t: the model tensor.
        generator: the random generator (None: torch's default for the device).
        output: fill with NaN (integers: -1) instead of values.

    Returns:
        Floating inputs: standard normal values; integer and boolean inputs: a copy of ``t``'s.
    """
    span = 1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride())) if t.numel() else 0
    itemsize = t.element_size()
    ptr = data_pointer(t)
    offset = (ptr // itemsize) % 128 if ptr else 0
    storage = torch.empty(span + offset, dtype=t.dtype, device=t.device)
    new = storage.as_strided(t.shape, t.stride(), offset)
    if output:
        storage.fill_(float("nan") if t.is_floating_point() else -1)
    elif t.is_floating_point():
        storage.normal_(generator=generator)
    else:
        new.copy_(t)
    return new


def data_pointer(t: torch.Tensor) -> int:
    """``t.data_ptr()``, except for a FakeTensor or FunctionalTensor (torch.compile's tracing,
    whose strict mode refuses ``data_ptr``): their byte offset into the storage, so their
    alignment is that of the storage offset (storages are allocated aligned)."""
    if type(t) is not torch.Tensor and isinstance(t, STORAGELESS_TYPES):
        return t.storage_offset() * t.element_size()
    return t.data_ptr()


def byte_extent(t: torch.Tensor) -> int:
    """Bytes from a tensor's first element to past its last (0 when empty)."""
    if not t.numel():
        return 0
    return (1 + sum((n - 1) * abs(s) for n, s in zip(t.shape, t.stride()))) * t.element_size()


def _dense_extent(t: torch.Tensor) -> tuple[int, int] | None:
    """[first byte, end) of a tensor whose elements fill that range exactly; None for strided
    views with gaps, empty tensors and tensors without memory (meta, fake), which are not judged."""
    if type(t) is not torch.Tensor and isinstance(t, STORAGELESS_TYPES):
        return None
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


def _rows_overlap_error(name: str, row_stride: int, cols: int) -> ValueError:
    """The refusal of an output seen as rows whose rows overlap (a row stride below the row length,
    as an ``expand``ed output's 0)."""
    return ValueError(f"operand {name}: rows overlap (row stride {row_stride} < {cols} elements); thread blocks "
                      f"would race writing them, so pass distinct rows")


def _require_tensor(value: Any, name: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"operand {name}: expected a torch.Tensor, got {type(value).__name__}")
    if value.layout is not _STRIDED or value.is_nested:
        raise _layout_error(value, name)
    return value


_STRIDED = torch.strided


def _layout_error(t: torch.Tensor, name: str) -> TypeError:
    """The refusal of a sparse or nested tensor: kernels read dense memory through strides."""
    kind = "nested" if t.is_nested else str(t.layout).replace("torch.", "")
    return TypeError(f"operand {name}: a {kind} tensor; kernels read dense (strided) tensors, so pass "
                     f"{'a padded tensor' if t.is_nested else 'its .to_dense()'}")


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
    try:
        stride = t.stride()
    except RuntimeError:  # (a sparse CSR/CSC tensor has no strides)
        raise _layout_error(t, name) from None
    rows, cols = shape[-2], shape[-1]
    # The largest power of two dividing every value is the lowest set bit of their OR.
    if stride[-1] == 1:
        pattern = ROW_MAJOR
        bits = cols | stride[-2] if rows > 1 else cols
    elif stride[-2] == 1:
        pattern = COLUMN_MAJOR
        bits = rows | stride[-1] if cols > 1 else rows
    elif t.layout is not _STRIDED:  # (a sparse COO tensor: zero strides, no unit-stride mode)
        raise _layout_error(t, name)
    elif cols == 1:
        pattern = ROW_MAJOR
        t = t.as_strided(shape, stride[:-1] + (1,))
        bits = cols | stride[-2] if rows > 1 else cols
    elif rows == 1:
        pattern = COLUMN_MAJOR
        t = t.as_strided(shape, stride[:-2] + (1, stride[-1]))
        bits = rows | stride[-1]
    else:
        raise ValueError(
            f"operand {name}: strides {tuple(stride)} have no unit-stride mode among the last two; "
            f"kernels need a row-major or column-major matrix (call .contiguous())")
    if len(shape) == 3 and shape[0] > 1:
        bits |= stride[0]
        if output and _overlaps(*((cols, rows, stride[-2]) if pattern is ROW_MAJOR else (rows, cols, stride[-1])),
                                shape[0], stride[0]):
            raise _overlap_error(name, shape, stride)
    elif output and ((rows > 1 and stride[-2] < cols) if pattern is ROW_MAJOR else (cols > 1 and stride[-1] < rows)):
        raise _overlap_error(name, shape, stride)
    itemsize = _BYTES[dt]
    ptr = t.data_ptr() if type(t) is torch.Tensor else data_pointer(t)
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
