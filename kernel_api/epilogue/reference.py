"""The reference evaluator: an `EpilogueGraph` run with torch, in float64 by default.

Tests compare fused kernels with it (``evaluate(graph, (A.double() @ B.double()), ...)``);
it is also the definition of what each node means.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from .ir import ACCUM, BINARY, CAST, INPUT, LITERAL, REDUCE, UNARY, EpilogueGraph

_CAST = {"f16": torch.float16, "bf16": torch.bfloat16, "f32": torch.float32}


def unary(op: str, x: torch.Tensor) -> torch.Tensor:
    """One unary node's math (the emitters follow these formulas)."""
    if op == "identity":
        return x
    if op == "neg":
        return -x
    if op == "relu":
        return torch.relu(x)
    # The GELUs in forms that do not cancel for x far below 0 (1 + erf(x) and 1 + tanh(x) lose
    # every digit there, in float64 from about x = -6): 0.5 * (1 + erf(t)) = 0.5 * erfc(-t) and
    # 0.5 * (1 + tanh(u)) = sigmoid(2u), the same functions.
    if op == "gelu":
        return 0.5 * x * torch.erfc(-x / math.sqrt(2.0))
    if op == "gelu_tanh":
        return x * torch.sigmoid(2.0 * math.sqrt(2.0 / math.pi) * (x + 0.044715 * x * x * x))
    if op == "silu":
        return x * torch.sigmoid(x)
    if op == "sigmoid":
        return torch.sigmoid(x)
    if op == "tanh":
        return torch.tanh(x)
    if op == "exp":
        return torch.exp(x)
    if op == "abs":
        return torch.abs(x)
    if op == "hardswish":
        return x * torch.clamp(x + 3.0, 0.0, 6.0) / 6.0
    raise ValueError(f"unknown unary op {op!r}")


def binary(op: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    if op == "add":
        return a + b
    if op == "sub":
        return a - b
    if op == "mul":
        return a * b
    if op == "div":
        return a / b
    if op == "max":
        return torch.maximum(a, b)
    if op == "min":
        return torch.minimum(a, b)
    raise ValueError(f"unknown binary op {op!r}")


def reduce(op: str, axis: str, x: torch.Tensor) -> torch.Tensor:
    """Reduce an (..., M, N) value: "row" along N (one per row, batches folded), "column"
    along M, "all" to a scalar."""
    x = x.reshape(-1, *x.shape[-2:]) if x.dim() >= 2 else x.reshape(1, 1, -1)
    dims = {"row": (0, 2), "column": (0, 1), "all": (0, 1, 2)}[axis]
    if op == "sum":
        r = x.sum(dim=dims)
    elif op == "max":
        r = x.amax(dim=dims)
    else:
        r = x.amin(dim=dims)
    return r.reshape(1) if axis == "all" else r


def evaluate(graph: EpilogueGraph, accum: torch.Tensor, operands: dict[str, Any],
             dtype: torch.dtype = torch.float64, axes: dict[str, str] | None = None) -> dict[str, torch.Tensor]:
    """Every output of ``graph`` for the accumulator ``accum`` ((L, M, N) or (M, N)) and the
    ``operands`` (parameter name -> tensor or number), computed in ``dtype``.

    Returns name -> value: (M, N)-shaped outputs in ``accum``'s shape, reductions as 1-D
    tensors (M values for "row", N for "column", one for "all"). ``axes`` gives the axis of
    reductions the function leaves to the output's shape (name -> axis; default "all")."""
    values: list[Any] = []
    acc = accum.to(dtype)
    for node in graph.nodes:
        if node.kind == ACCUM:
            v = acc
        elif node.kind == INPUT:
            value = operands[graph.params[node.attr]]
            v = value.to(dtype) if isinstance(value, torch.Tensor) else torch.tensor(float(value), dtype=dtype,
                                                                                      device=acc.device)
        elif node.kind == LITERAL:
            v = torch.tensor(float(node.attr), dtype=dtype, device=acc.device)
        elif node.kind == UNARY:
            v = unary(node.attr, values[node.args[0]])
        elif node.kind == BINARY:
            v = binary(node.attr, values[node.args[0]], values[node.args[1]])
        elif node.kind == CAST:
            v = values[node.args[0]].to(_CAST[node.attr]).to(dtype)
        elif node.kind == REDUCE:
            v = None  # computed per output below (the axis may come from the output's shape)
        else:
            raise ValueError(f"unknown node kind {node.kind!r}")
        values.append(v)
    result = {}
    for name, index in graph.outputs:
        node = graph.nodes[index]
        if node.kind == REDUCE:
            op, axis = node.attr
            if axis is None:
                axis = (axes or {}).get(name, "all")
            x = values[node.args[0]]
            result[name] = reduce(op, axis, torch.broadcast_to(x, acc.shape))
        else:
            result[name] = torch.broadcast_to(values[index], acc.shape)
    return result
