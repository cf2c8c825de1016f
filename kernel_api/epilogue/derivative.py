"""What the backward of an epilogue needs: whether its gradients depend on the accumulator's
value.

The backward of a fused GEMM differentiates the epilogue with torch (`kernel_api.epilogue
.evaluate`) at the accumulator's value, which the forward never kept in memory; recomputing it
costs one more GEMM. An epilogue whose outputs are affine in the accumulator with coefficients
that do not involve it (``accum + C``, ``alpha * accum + bias``, ``(accum + bias) * scale``, and
the same with an activation applied to inputs only) has gradients that do not depend on that
value, so the backward can skip the recompute.
"""

from __future__ import annotations

from collections.abc import Collection

from .ir import ACCUM, BINARY, INPUT, REDUCE, UNARY, EpilogueGraph

#: Unary functions whose derivative is a constant.
_LINEAR_UNARY = frozenset({"identity", "neg"})


def needs_accumulator(graph: EpilogueGraph, differentiated: Collection[str]) -> bool:
    """Whether the gradients of ``graph``'s outputs other than reductions (those are not
    differentiated), with respect to the accumulator and to the parameters named in
    ``differentiated``, depend on the accumulator's value.

    A node needs the value of an argument when its derivative with respect to another argument
    that a gradient flows through reads it (``a * b``: each factor for the other's gradient) or
    its own derivative does (a nonlinear unary function; ``max``/``min``; a divisor); the answer
    is True when a node reached by the differentiated outputs needs the value of an argument that
    depends on the accumulator.
    """
    nodes = graph.nodes
    on_accum = [False] * len(nodes)   # the value depends on the accumulator
    carries = [False] * len(nodes)    # a gradient flows into this node
    for i, node in enumerate(nodes):
        if node.kind == ACCUM:
            on_accum[i] = carries[i] = True
        elif node.kind == INPUT:
            carries[i] = graph.params[node.attr] in differentiated
        elif node.kind != REDUCE:
            on_accum[i] = any(on_accum[a] for a in node.args)
            carries[i] = any(carries[a] for a in node.args)
    live = [False] * len(nodes)       # reached from a differentiated output
    for _, index in graph.outputs:
        if nodes[index].kind != REDUCE:
            live[index] = True
    for i in range(len(nodes) - 1, -1, -1):
        if live[i]:
            for a in nodes[i].args:
                live[a] = True
    for i, node in enumerate(nodes):
        if not live[i] or not carries[i]:
            continue
        read: list[int] = []
        if node.kind == UNARY and node.attr not in _LINEAR_UNARY:
            read = list(node.args)
        elif node.kind == BINARY:
            a, b = node.args
            if node.attr == "mul":
                read = ([b] if carries[a] else []) + ([a] if carries[b] else [])
            elif node.attr == "div":
                read = [b] + ([a] if carries[b] else [])
            elif node.attr in ("max", "min"):
                read = [a, b]
        if any(on_accum[r] for r in read):
            return True
    return False
