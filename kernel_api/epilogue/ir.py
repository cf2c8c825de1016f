"""The epilogue IR: a small DAG of loads, elementwise compute, stores and reductions.

An `EpilogueGraph` holds its nodes in topological order (every node's arguments come before
it), so an emitter walks them once. Each `Node` records the line of the function it came from
and its source text, so a kernel that cannot fuse a node names it.

The graph is data, hashable and free of values: scalar operands and literals are runtime
inputs (`Node.attr` of a literal is its value, but `EpilogueGraph.structure` leaves it out),
so two epilogues that differ only in scalar values have one `structure` and share one
compiled kernel.
"""

from __future__ import annotations

from dataclasses import dataclass, field

#: Elementwise functions of one argument. ``gelu`` is the erf form (torch's default),
#: ``gelu_tanh`` the tanh approximation (what the named form's ``activation="gelu"`` means).
UNARY_OPS = frozenset({"identity", "neg", "relu", "gelu", "gelu_tanh", "silu", "sigmoid", "tanh", "exp", "abs",
                       "hardswish"})
#: Elementwise functions of two arguments.
BINARY_OPS = frozenset({"add", "sub", "mul", "div", "max", "min"})
#: Reductions of an (M, N) expression into an output: along N (one value per row), along M
#: (one per column) or over both (a scalar). Batches are folded into the same output.
REDUCE_OPS = frozenset({"sum", "max", "min"})
#: Element types a `cast` node may round to (it rounds and continues in f32).
CAST_TYPES = frozenset({"f16", "bf16", "f32"})

#: Node kinds.
ACCUM, INPUT, LITERAL, UNARY, BINARY, CAST, REDUCE = "accum", "input", "literal", "unary", "binary", "cast", "reduce"


@dataclass(frozen=True)
class Node:
    """One value of the DAG.

    ``kind``: one of accum, input, literal, unary, binary, cast, reduce. ``args``: indices of
    the argument nodes in the graph. ``attr``: the input's parameter index (input), the value
    (literal), the function name (unary, binary), the target type (cast) or ``(op, axis)``
    (reduce; axis "row": along N into one value per row, "column": along M, "all": a scalar,
    None: from the output's shape when bound). ``line``/``text``: where it came from.
    """

    kind: str
    args: tuple[int, ...] = ()
    attr: object = None
    line: int | None = field(default=None, compare=False)
    text: str | None = field(default=None, compare=False)

    def structure(self) -> tuple:
        """What a kernel compiled for this node depends on (a literal's value is a runtime input)."""
        return (self.kind, self.args, None if self.kind == LITERAL else self.attr)


@dataclass(frozen=True)
class EpilogueGraph:
    """An epilogue function as a DAG.

    ``params``: the parameter names after ``accum`` (tensors or scalars bound by name);
    ``nodes``: in topological order; ``outputs``: (name, node index) per returned name, ``D``
    (the GEMM's output) among them; ``name``: the function's name; ``source``: its text.
    """

    params: tuple[str, ...]
    nodes: tuple[Node, ...]
    outputs: tuple[tuple[str, int], ...]
    name: str = field(default="epilogue", compare=False)
    source: str | None = field(default=None, compare=False)

    @property
    def structure(self) -> tuple:
        """Hashable and free of names and values: the nodes, which parameter each input reads,
        and which node each output stores (in the order of `outputs`, ``D`` by name)."""
        return (tuple(n.structure() for n in self.nodes),
                tuple(("D" if name == "D" else "aux", index) for name, index in self.outputs))

    @property
    def literals(self) -> tuple[float, ...]:
        """The literal values in node order: runtime scalars of the compiled kernel."""
        return tuple(float(n.attr) for n in self.nodes if n.kind == LITERAL)

    def output_names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.outputs)

    def node_label(self, index: int) -> str:
        """The node's source text and line, for messages."""
        node = self.nodes[index]
        text = node.text or node.kind
        return f"`{text}` (line {node.line})" if node.line is not None else f"`{text}`"

    def __repr__(self) -> str:
        return f"EpilogueGraph({self.name}: {len(self.nodes)} nodes, outputs {self.output_names()})"
