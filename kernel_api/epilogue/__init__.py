"""Epilogues written as Python functions: a front end, a small DAG IR, binding to a GEMM's
operands and a reference evaluator. Nothing here imports a DSL; the emitters that lower the
IR into kernels live with the kernels (``providers/cutedsl/gemm/implementations/fusion.py``).

``parse(fn_or_source)`` gives an `EpilogueGraph`; ``bind(graph, values, out, L, M, N)`` a
`BoundEpilogue` (its ``key`` is what a compiled kernel depends on: the structure, never the
scalar values); ``evaluate`` runs a graph with torch in float64; errors are `EpilogueError`,
one line naming the node and its line; ``needs_accumulator`` whether a backward must recompute
the accumulator.
"""

from .binding import BoundEpilogue, OperandKey, bind, operand_sources, remake_operands
from .derivative import needs_accumulator
from .errors import EpilogueError
from .frontend import FUNCTIONS, parse, parse_cached, source_of
from .ir import BINARY_OPS, REDUCE_OPS, UNARY_OPS, EpilogueGraph, Node
from .named import named_graph
from .reference import evaluate

__all__ = ["BINARY_OPS", "BoundEpilogue", "EpilogueError", "EpilogueGraph", "FUNCTIONS", "Node", "OperandKey",
           "REDUCE_OPS", "UNARY_OPS", "bind", "evaluate", "named_graph", "needs_accumulator", "operand_sources", "parse",
           "parse_cached", "remake_operands", "source_of"]
