"""Binding an `EpilogueGraph` to one GEMM: which operand each parameter is, how it broadcasts
over the output, where each extra output goes.

Every tensor operand is handed to kernels as an (L, M, N) view of itself: broadcast modes get
the stride 0, so one indexing rule serves a full (M, N) tensor, a row vector (N,) / (1, N), a
column vector (M, 1), per-batch vectors (L, M, 1) / (L, 1, N) and one-element tensors, and the
kernel's compile-time stride pattern (0: broadcast, 1: unit, -1: any) says which it is.
Reduction outputs are (L, M, N) views too, with the stride 0 on the reduced modes (and on L:
batches are folded), so an element's reduction target is its own coordinate's address.

What a kernel depends on is `BoundEpilogue.key`: the graph's structure and, per operand, its
kind, element type and stride pattern, and for a tensor read over the whole (M, N) output or
written its alignment (`OperandKey.align`: a kernel may then copy its tiles in bulk, as TMA
does on SM90);
scalar values and literals are runtime inputs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from ..core.dtypes import _FROM_TORCH, DataType
from ..core.numbers import is_finite_number
from .errors import EpilogueError
from .ir import REDUCE, EpilogueGraph

#: Element types an input tensor may have (converted to f32 in the kernel).
INPUT_TYPES = frozenset({DataType.f16, DataType.bf16, DataType.f32, DataType.f64})
#: Element types an extra (M, N) output may have.
OUTPUT_TYPES = frozenset({DataType.f16, DataType.bf16, DataType.f32})



def _short(value: Any) -> str:
    """A number's repr cut to one short line (an int literal may have hundreds of digits)."""
    text = repr(value)
    return text if len(text) <= 24 else text[:21] + "..."

@dataclass(frozen=True)
class OperandKey:
    """One bound operand as a kernel sees it: ``kind`` is "scalar" (a number), "load" (a
    tensor read), "store" (an extra output written) or "reduce" (an output reduced into);
    ``dtype`` its element type (None for a scalar); ``pattern`` its (L, M, N) stride pattern
    (0 broadcast, 1 unit, -1 any); ``axis`` a reduction's ("row", "column", "all");
    ``align``, for a "load" varying along both M and N and for a "store": the largest of 1,
    2, 4, 8, 16 bytes that divides its address and the byte size of each stride other than 0
    and 1 (None for other operands). Kernels that copy such a tensor in tiles (SM90's TMA
    needs 16) choose that path at compile time from it."""

    kind: str
    dtype: DataType | None = None
    pattern: tuple[int, int, int] | None = None
    axis: str | None = None
    align: int | None = None


@dataclass(frozen=True)
class BoundEpilogue:
    """An epilogue graph bound to one GEMM's operands.

    ``key``: hashable, what a compiled kernel depends on; ``operands``: the runtime values in
    kernel order (inputs by parameter, then extra outputs by return order, then literals),
    tensors as (L, M, N) views; ``inputs``/``outputs``: name -> the caller's value.
    """

    graph: EpilogueGraph
    key: tuple
    operands: tuple
    inputs: dict
    outputs: dict
    operand_keys: tuple[OperandKey, ...]


def _pattern(view: torch.Tensor) -> tuple[int, int, int]:
    return tuple(0 if s == 0 else 1 if s == 1 else -1 for s in view.stride())


#: The widest alignment `OperandKey.align` records (TMA's, the largest any kernel asks for).
MAX_ALIGN = 16


def _address(t: torch.Tensor) -> int:
    """``t.data_ptr()``, or for a tensor without storage (torch.compile traces with FakeTensors
    and FunctionalTensors, whose strict mode refuses ``data_ptr``) its byte offset into its
    storage: storages are allocated aligned."""
    if type(t) is torch.Tensor:
        return t.data_ptr()
    from torch._subclasses.fake_tensor import FakeTensor
    from torch._subclasses.functional_tensor import FunctionalTensor

    if isinstance(t, (FakeTensor, FunctionalTensor)):
        return t.storage_offset() * t.element_size()
    return t.data_ptr()


def _align(view: torch.Tensor) -> int:
    """The largest power of two up to `MAX_ALIGN` dividing the view's address and the byte
    size of its strides other than 0 and 1."""
    size = view.element_size()
    align = math.gcd(MAX_ALIGN, _address(view))
    for s in view.stride():
        if s not in (0, 1):
            align = math.gcd(align, s * size)
    return align


def _lmn_view(t: torch.Tensor, shape: tuple[int, int, int], name: str, broadcast_ok: bool) -> torch.Tensor:
    """``t`` as an (L, M, N) view, size-1 modes given the stride 0; refuses shapes that do not
    broadcast (or, without ``broadcast_ok``, that are not the output's)."""
    if t.dim() > 3:
        raise EpilogueError(f"operand {name}: rank {t.dim()}; expected at most (L, M, N)")
    dims = (1,) * (3 - t.dim()) + tuple(t.shape)
    strides = (0,) * (3 - t.dim()) + tuple(t.stride())
    out_shape = shape if shape[0] > 1 else shape[1:]
    for d, want in zip(dims, shape):
        if d != want and d != 1:
            raise EpilogueError(f"operand {name}: shape {tuple(t.shape)} does not broadcast to the output's "
                                f"{tuple(out_shape)}")
        if not broadcast_ok and d != want and want != 1:
            raise EpilogueError(f"operand {name}: an extra output has the output's shape {tuple(out_shape)}, "
                                f"got {tuple(t.shape)}")
    strides = tuple(0 if d == 1 else s for d, s in zip(dims, strides))
    return t.as_strided(shape, strides, t.storage_offset())


def _reduce_view(t: torch.Tensor, shape: tuple[int, int, int], name: str, axis: str | None,
                 node_text: str | None) -> tuple[torch.Tensor, str]:
    L, M, N = shape
    numel = t.numel()
    dims = tuple(d for d in t.shape if d != 1)
    if axis is None:
        if numel == 1:
            axis = "all"
        elif t.dim() >= 2 and t.shape[-1] == 1 and numel == M:
            axis = "row"
        elif numel == N and (t.dim() == 1 or t.shape[-2] == 1):
            axis = "column"
        elif t.dim() == 1 and numel == M:
            axis = "row"
        else:
            raise EpilogueError(f"operand {name}: shape {tuple(t.shape)} fits no reduction of an output of "
                                f"{(M, N)}: (M, 1) for one value per row, (N,) per column, (1,) for a scalar",
                                node=node_text)
    want = {"row": M, "column": N, "all": 1}[axis]
    if numel != want or len(dims) > 1:
        raise EpilogueError(f"operand {name}: a reduction {'along N' if axis == 'row' else 'along M' if axis == 'column' else 'to a scalar'} "
                            f"writes {want} value{'s' if want != 1 else ''}, got shape {tuple(t.shape)}", node=node_text)
    stride = 0
    for d, s in zip(t.shape, t.stride()):
        if d != 1:
            stride = s
    strides = {"row": (0, stride, 0), "column": (0, 0, stride), "all": (0, 0, 0)}[axis]
    return t.as_strided(shape, strides, t.storage_offset()), axis


def bind(graph: EpilogueGraph, values: dict[str, Any], out: torch.Tensor, L: int, M: int, N: int) -> BoundEpilogue:
    """Bind ``graph``'s parameters and extra outputs to ``values`` (name -> tensor or number)
    for a GEMM whose output ``out`` is (L, M, N) (or (M, N), L = 1)."""
    shape = (L, M, N)
    keys: list[OperandKey] = []
    operands: list[Any] = []
    inputs: dict[str, Any] = {}
    device = out.device
    for name in graph.params:
        if name not in values:
            raise EpilogueError(f"operand {name}: not given (the function's parameters after accum are "
                                f"{', '.join(graph.params)})", function=graph.name)
        value = values[name]
        inputs[name] = value
        if isinstance(value, torch.Tensor):
            dtype = _FROM_TORCH.get(value.dtype)
            if dtype not in INPUT_TYPES:
                raise EpilogueError(f"operand {name}: dtype {value.dtype} is not one an epilogue reads "
                                    f"({', '.join(sorted(str(t) for t in INPUT_TYPES))})")
            _same_device(value, out, name)
            view = _lmn_view(value, shape, name, True)
            pattern = _pattern(view)
            keys.append(OperandKey("load", dtype, pattern, align=_align(view) if pattern[1] and pattern[2] else None))
            operands.append(view)
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            if not is_finite_number(value):
                raise EpilogueError(f"operand {name}: expected a finite number, got {_short(value)}")
            keys.append(OperandKey("scalar"))
            operands.append(float(value))
        else:
            raise EpilogueError(f"operand {name}: expected a tensor or a number, got {type(value).__name__}")
    outputs: dict[str, Any] = {}
    for name, index in graph.outputs:
        if name == "D":
            given = values.get("D")
            if given is not None and given is not out:
                raise EpilogueError("operand D: D is the GEMM's output; pass the same tensor as out")
            continue
        if name not in values or not isinstance(values[name], torch.Tensor):
            raise EpilogueError(f"operand {name}: the function returns {name}; give it as a tensor",
                                function=graph.name)
        t = values[name]
        outputs[name] = t
        _same_device(t, out, name)
        dtype = _FROM_TORCH.get(t.dtype)
        node = graph.nodes[index]
        if node.kind == REDUCE:
            if dtype is not DataType.f32:
                raise EpilogueError(f"operand {name}: a reduction output must be float32, got {t.dtype}",
                                    function=graph.name, line=node.line, node=node.text)
            view, axis = _reduce_view(t, shape, name, node.attr[1], node.text)
            keys.append(OperandKey("reduce", dtype, _pattern(view), axis))
            operands.append(view)
        else:
            if dtype not in OUTPUT_TYPES:
                raise EpilogueError(f"operand {name}: dtype {t.dtype} is not one an epilogue writes "
                                    f"({', '.join(sorted(str(t) for t in OUTPUT_TYPES))})")
            view = _lmn_view(t, shape, name, False)
            keys.append(OperandKey("store", dtype, _pattern(view), align=_align(view)))
            operands.append(view)
    operands.extend(graph.literals)
    key = (graph.structure, tuple(keys))
    return BoundEpilogue(graph, key, tuple(operands), inputs, outputs, tuple(keys))


def operand_sources(bound: BoundEpilogue) -> tuple:
    """How each of ``bound.operands`` is made again from another call's values whose tensors
    have the metadata of this call's (`remake_operands`): ``(name, shape, strides)`` for a
    tensor's (L, M, N) view, ``(name, None, None)`` for a number, ``(None, literal, None)`` for
    a literal. `bind`'s order: parameters, extra outputs by return order, literals."""
    names = (*bound.graph.params, *bound.outputs)
    sources: list[tuple] = []
    for name, operand in zip(names, bound.operands):
        if isinstance(operand, torch.Tensor):
            sources.append((name, tuple(operand.shape), tuple(operand.stride())))
        else:
            sources.append((name, None, None))
    sources.extend((None, literal, None) for literal in bound.operands[len(names):])
    return tuple(sources)


def remake_operands(sources: tuple, values: dict[str, Any]) -> tuple:
    """The kernel operands `bind` would give for ``values`` (name -> tensor or number), from
    `operand_sources` of a call whose tensors had the same dtypes, shapes, strides and
    alignment; no checks (the caller's key holds that metadata)."""
    operands: list[Any] = []
    for name, shape, strides in sources:
        if name is None:
            operands.append(shape)
        elif shape is None:
            operands.append(float(values[name]))
        else:
            t = values[name]
            operands.append(t.as_strided(shape, strides, t.storage_offset()))
    return tuple(operands)


def _same_device(t: torch.Tensor, out: torch.Tensor, name: str) -> None:
    if t.device != out.device:
        raise EpilogueError(f"operand {name}: on {t.device} but out is on {out.device}")
    if t.is_neg() or t.is_conj():
        raise EpilogueError(f"operand {name}: carries torch's lazy negative or conjugate bit; "
                            f"call .resolve_neg() / .resolve_conj() first")
