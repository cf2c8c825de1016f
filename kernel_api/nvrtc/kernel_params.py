"""Kernel parameters for ``cuLaunchKernel``: Python values packed into per-thread slots, and the
array of pointers to them that the driver reads (its ``kernelParams``).

A `ParamPacker` serves one kernel. The C type of each value follows from its Python type, as
``cuda.core``'s launch reads it: an int is 64-bit (``intptr_t``), a float a double, a bool one
byte, a numpy or ctypes scalar its own type, a tensor its data pointer. With the kernel's
parameter sizes known (``sizes``, from the cubin), ints and floats take the size of the
parameter they fill instead (a 4-byte ``int`` parameter gets 32 bits; numpy scalars of another
size too, keeping their kind), so Python numbers can be passed as they are.

Each parameter has an 8-byte slot (no parameter the package passes is larger); slot i sits at
byte 8*i of one buffer, and the pointer array points at the slots. The layouts are built once
per sequence of value types, the buffers once per thread (the driver copies the values during
the launch call, which releases the GIL, so two threads never share a buffer). Per launch:
one tuple of types, two dictionary look-ups and one ``struct`` pack.
"""

from __future__ import annotations

import ctypes
import struct
import threading
from typing import Any, Sequence

#: struct codes (standard sizes) of the numpy scalar types a kernel may be handed, by type name
_NUMPY_CODES = {"float16": "e", "float32": "f", "float64": "d", "int8": "b", "int16": "h", "int32": "i",
                "int64": "q", "uint8": "B", "uint16": "H", "uint32": "I", "uint64": "Q", "bool": "?", "bool_": "?"}
#: struct codes of Python ints and floats by the size of the parameter they fill
_INT_BY_SIZE = {1: "b", 2: "h", 4: "i", 8: "q"}
_FLOAT_BY_SIZE = {2: "e", 4: "f", 8: "d"}
_UNSIGNED = {"b": "B", "h": "H", "i": "I", "q": "Q"}
_SLOT = 8


class ParamError(TypeError):
    """A value that cannot be a kernel parameter (the message names its position and type)."""


def _code(value: Any, size: int | None) -> tuple[str, bool]:
    """(struct code, whether the value is a tensor's data pointer) of one parameter value."""
    kind = type(value)
    if kind is bool:
        return (_INT_BY_SIZE.get(size, "q") if size else "?"), False
    if kind is int:
        return (_INT_BY_SIZE.get(size, "q") if size else "q"), False
    if kind is float:
        return (_FLOAT_BY_SIZE.get(size, "d") if size else "d"), False
    if hasattr(value, "data_ptr") and callable(value.data_ptr):  # a torch.Tensor
        return "Q", True
    module = kind.__module__
    if module == "numpy":
        code = _NUMPY_CODES.get(kind.__name__)
        if code is not None:
            if size and code != "?" and struct.calcsize("=" + code) != size:  # the parameter's size, same kind
                code = (_FLOAT_BY_SIZE if code in "efd" else _INT_BY_SIZE).get(size, code)
            return code, False
    elif module == "ctypes":
        code = getattr(kind, "_type_", None)
        if isinstance(code, str) and len(code) == 1 and code in "bBhHiIlLqQfd?P":
            return ("Q" if code == "P" else code), False
    elif isinstance(value, int):  # int subclasses (enums) as ints
        return (_INT_BY_SIZE.get(size, "q") if size else "q"), False
    raise ParamError(f"{kind.__name__}")


def _reader(value: Any) -> Any:
    """How to read a scalar object's number: a ctypes value's ``.value``, a numpy scalar's
    ``.item()``, an int subclass's ``int()``."""
    if type(value).__module__ == "ctypes":
        return lambda v: v.value
    if type(value).__module__ == "numpy":
        return lambda v: v.item()
    return int


class _Layout:
    """The packing of one sequence of value types: a struct for the slots, which positions hold
    tensors (passed as their data pointers) or values to read (``.value``, ``.item()``)."""

    __slots__ = ("struct", "unsigned", "tensors", "read", "count", "buffers", "keep")

    def __init__(self, codes: list[str], tensors: list[int], read: list[tuple[int, Any]]) -> None:
        fmt = "=" + "".join(c + "x" * (_SLOT - struct.calcsize("=" + c)) for c in codes)
        self.struct = struct.Struct(fmt)
        # the same slots with every int unsigned: a value above the signed range (a pointer or a
        # bit mask) is packed through it, masked to its size
        self.unsigned = struct.Struct("=" + "".join(_UNSIGNED.get(c, c) + "x" * (_SLOT - struct.calcsize("=" + c))
                                                   for c in codes))
        self.tensors, self.read, self.count = tuple(tensors), tuple(read), len(codes)
        self.buffers: dict[int, tuple[Any, int]] = {}  # thread id -> (slots, address of the pointer array)
        self.keep: list[Any] = []  # the pointer arrays, alive as long as the layout

    def buffer(self) -> tuple[Any, int]:
        ident = threading.get_ident()
        found = self.buffers.get(ident)
        if found is None:
            slots = ctypes.create_string_buffer(max(1, self.count) * _SLOT)
            base = ctypes.addressof(slots)
            pointers = (ctypes.c_void_p * max(1, self.count))(*[base + _SLOT * i for i in range(self.count)])
            found = (slots, ctypes.addressof(pointers))
            self.buffers[ident] = found
            self.keep.append(pointers)
        return found


class ParamPacker:
    """Packs one kernel's parameters (see the module docstring); ``label`` names the kernel in
    errors, ``sizes`` are its parameters' sizes in bytes (None: unknown, each value's own)."""

    def __init__(self, label: str, sizes: Sequence[int] | None = None) -> None:
        self.label = label
        self.sizes = None if sizes is None else tuple(int(s) for s in sizes)
        self._layouts: dict[tuple, _Layout] = {}

    def _layout(self, key: tuple, params: Sequence[Any]) -> _Layout:
        sizes = self.sizes
        if sizes is not None and len(sizes) != len(params):
            raise ParamError(f"{self.label}: the kernel takes {len(sizes)} parameter(s) but {len(params)} were given")
        codes, tensors, read = [], [], []
        for i, value in enumerate(params):
            try:
                code, tensor = _code(value, None if sizes is None else sizes[i])
            except ParamError:
                raise ParamError(f"{self.label}: parameter {i} is a {type(value).__name__}; a kernel parameter is "
                                 f"an int, float, bool, numpy or ctypes scalar, or a tensor (its data pointer)") \
                    from None
            codes.append(code)
            if tensor:
                tensors.append(i)
            elif type(value) not in (int, float, bool):
                read.append((i, _reader(value)))
        layout = self._layouts[key] = _Layout(codes, tensors, read)
        return layout

    def pack(self, params: Sequence[Any]) -> int:
        """``params`` written into this thread's slots; returns the address of the array of
        pointers to them (``cuLaunchKernel``'s ``kernelParams``), valid until this thread packs
        again."""
        key = tuple(map(type, params))
        layout = self._layouts.get(key)
        if layout is None:
            layout = self._layout(key, params)
        if layout.tensors or layout.read:
            params = list(params)
            for i in layout.tensors:
                params[i] = params[i].data_ptr()
            for i, read in layout.read:
                params[i] = read(params[i])
        slots, pointers = layout.buffer()
        try:
            layout.struct.pack_into(slots, 0, *params)
        except struct.error:
            self._pack_masked(layout, slots, params)
        return pointers

    def _pack_masked(self, layout: _Layout, slots: Any, params: Sequence[Any]) -> None:
        """Pack values outside the signed range of their slot (pointers, masks) as unsigned;
        a value that fits neither way is an error naming it."""
        fields = layout.unsigned.format[1:].replace("x", "")
        values = []
        for i, (value, code) in enumerate(zip(params, fields)):
            if code in "BHIQ" and isinstance(value, int):
                bits = 8 * struct.calcsize("=" + code)
                if not -(1 << (bits - 1)) <= value < (1 << bits):
                    raise ParamError(f"{self.label}: parameter {i} ({value}) does not fit its {bits}-bit slot")
                value &= (1 << bits) - 1
            values.append(value)
        try:
            layout.unsigned.pack_into(slots, 0, *values)
        except struct.error as exc:
            raise ParamError(f"{self.label}: the parameters do not pack: {exc}") from None
