"""Which operands of an epilogue function a TMA kernel moves in tiles through shared memory
(the SM90 GEMM: `sm90_warpspecialized.plan_staged`), decided from the operands' keys
(`kernel_api.epilogue.OperandKey`: kind, type, stride pattern, alignment), so the choice is
made at compile time and is part of the artifact's key. DSL-free: the interface and the
emitter (``implementations/fusion.py``) both read it."""

from __future__ import annotations

from typing import Any

#: Bytes TMA needs its global address and strides divisible by.
TMA_ALIGN = 16


def tma_loadable(key: Any) -> bool:
    """Whether an epilogue function's operand (`kernel_api.epilogue.OperandKey`) is one a TMA
    kernel loads in tiles: a 16- or 32-bit tensor read varying along M and N, unit stride
    along one of them, its address and other strides `TMA_ALIGN`-byte multiples. The others
    (misaligned, strided both ways, broadcast vectors, f64) are read element-wise."""
    return (key.kind == "load" and key.dtype is not None and key.dtype.bytes in (2, 4)
            and bool(key.pattern[1]) and bool(key.pattern[2]) and 1 in key.pattern[1:]
            and (key.align or 0) >= TMA_ALIGN)


def tma_storable(key: Any) -> bool:
    """Whether an epilogue function's extra output is one a TMA kernel stores in tiles, as it
    stores D: 16- or 32-bit, unit stride along M or N, address and strides `TMA_ALIGN`-byte
    multiples. Others are stored element-wise."""
    return (key.kind == "store" and key.dtype.bytes in (2, 4) and 1 in key.pattern[1:]
            and (key.align or 0) >= TMA_ALIGN)
