"""What a kernel's fused epilogue can do (`EpilogueMetadata`)."""

from __future__ import annotations

from dataclasses import dataclass

from ..arguments.epilogue import ACTIVATIONS, EpilogueSignature, FusedEpilogueSignature
from ..core.status import Reason, Status

#: Everything an epilogue function may hold, as `EpilogueMetadata.functions` names it: node
#: functions (unary and binary op names, "cast"), operand kinds ("load", "store") and
#: reductions ("reduce_<op>_<axis>", axis row / column / all).
FUNCTION_FEATURES = frozenset({
    "identity", "neg", "relu", "gelu", "gelu_tanh", "silu", "sigmoid", "tanh", "exp", "abs", "hardswish",
    "add", "sub", "mul", "div", "max", "min", "cast", "load", "store",
    *(f"reduce_{op}_{axis}" for op in ("sum", "max", "min") for axis in ("row", "column", "all"))})


@dataclass(frozen=True)
class EpilogueMetadata:
    """What a kernel's fused epilogue can do: ``out = act(alpha*acc + beta*C + bias)``, and
    which epilogue functions it can emit.

    ``alpha_beta``: scales (and a C operand when beta != 0) supported; ``bias``: the bias
    kinds supported ("row": one value per output column n, "column": one per row m);
    ``activations``: names from `ACTIVATIONS`; ``functions``: the features of epilogue
    functions the kernel emits (names from `FUNCTION_FEATURES`; empty: none).
    """

    alpha_beta: bool = True
    bias: frozenset = frozenset({"row", "column"})
    activations: frozenset = frozenset(ACTIVATIONS)
    functions: frozenset = frozenset()

    def supports(self, epilogue_signature: EpilogueSignature | FusedEpilogueSignature | None) -> Status:
        """Can this epilogue do what ``epilogue_signature`` (`GemmArguments.epilogue_signature`) asks?"""
        if epilogue_signature is None:
            return Status.success()
        if type(epilogue_signature) is FusedEpilogueSignature:
            return self._supports_function(epilogue_signature)
        bias_kind, activation = epilogue_signature.bias_kind, epilogue_signature.activation
        if (epilogue_signature.scaled or epilogue_signature.has_c) and not self.alpha_beta:
            return Status.fail("epilogue: alpha/beta/C requested but the kernel's epilogue has no scaling",
                               kind=Reason.EPILOGUE)
        if bias_kind is not None and bias_kind not in self.bias:
            return Status.fail(
                f"epilogue: {bias_kind} bias requested but the kernel supports {sorted(self.bias) or 'none'}",
                kind=Reason.EPILOGUE, operand="bias", actual=bias_kind, required=self.bias)
        if activation is not None and activation not in self.activations:
            return Status.fail(f"epilogue: activation {activation!r} not among the kernel's {sorted(self.activations)}",
                               kind=Reason.EPILOGUE, operand="activation", actual=activation,
                               required=self.activations)
        return Status.success()

    def _supports_function(self, signature: FusedEpilogueSignature) -> Status:
        """The first node or operand of the function this kernel cannot fuse, named with its line."""
        graph = signature.graph
        if not self.functions:
            return Status.fail(f"epilogue: function {graph.name!r} given, but this kernel fuses only the named "
                               f"epilogue (alpha, beta, C, bias, activation)", kind=Reason.EPILOGUE,
                               operand="epilogue")
        outputs = [(name, i) for name, i in graph.outputs if name != "D"]
        keys = iter(signature.operand_keys[len(graph.params):])
        reductions = {i: next(keys) for name, i in outputs}
        for i, node in enumerate(graph.nodes):
            feature = None
            if node.kind in ("unary", "binary"):
                feature = node.attr
            elif node.kind == "cast":
                feature = "cast"
            elif node.kind == "reduce":
                feature = f"reduce_{node.attr[0]}_{reductions[i].axis}"
            if feature is not None and feature not in self.functions:
                return Status.fail(f"epilogue: node {graph.node_label(i)} ({feature}) is not fused by this kernel",
                                   kind=Reason.EPILOGUE, operand="epilogue", actual=feature)
        for name, key in zip(graph.params, signature.operand_keys):
            if key.kind == "load" and "load" not in self.functions:
                return Status.fail(f"epilogue: operand {name} (a tensor read) is not fused by this kernel",
                                   kind=Reason.EPILOGUE, operand=name)
        for (name, i), key in zip(outputs, signature.operand_keys[len(graph.params):]):
            if key.kind == "store" and "store" not in self.functions:
                return Status.fail(f"epilogue: output {name} (node {graph.node_label(i)}) is not fused by this kernel",
                                   kind=Reason.EPILOGUE, operand=name)
        return Status.success()
