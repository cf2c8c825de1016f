"""The named epilogue (``alpha, beta, C, bias, activation``) as an `EpilogueGraph`: the same
IR a function builds, so `explain`, the reference evaluator and the structure key read it
alike."""

from __future__ import annotations

from .frontend import parse_cached
from .ir import EpilogueGraph

_ACTIVATION_FUNCTION = {None: "", "relu": "relu", "gelu": "gelu_tanh", "silu": "silu"}


def named_graph(scaled: bool, has_c: bool, bias: bool, activation: str | None) -> EpilogueGraph:
    """``D = activation(alpha * accum + beta * C + bias)`` with the parts the flags keep
    (``gelu`` is the tanh approximation, as the named form defines it)."""
    params, terms = [], []
    if scaled:
        params.append("alpha")
        terms.append("alpha * accum")
    else:
        terms.append("accum")
    if has_c:
        params += ["beta", "C"]
        terms.append("beta * C")
    if bias:
        params.append("bias")
        terms.append("bias")
    body = " + ".join(terms)
    act = _ACTIVATION_FUNCTION[activation]
    source = f"def epilogue({', '.join(['accum', *params])}):\n    D = {act}({body})\n    return D\n"
    return parse_cached(source)
