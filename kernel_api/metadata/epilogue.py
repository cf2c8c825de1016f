"""What a kernel's fused epilogue can do (`EpilogueMetadata`)."""

from __future__ import annotations

from dataclasses import dataclass

from ..arguments.epilogue import ACTIVATIONS, EpilogueSignature
from ..core.status import Reason, Status


@dataclass(frozen=True)
class EpilogueMetadata:
    """What a kernel's fused epilogue can do: ``out = act(alpha*acc + beta*C + bias)``.

    ``alpha_beta``: scales (and a C operand when beta != 0) supported; ``bias``: the bias
    kinds supported ("row": one value per output column n, "column": one per row m);
    ``activations``: names from `ACTIVATIONS`.
    """

    alpha_beta: bool = True
    bias: frozenset = frozenset({"row", "column"})
    activations: frozenset = frozenset(ACTIVATIONS)

    def supports(self, epilogue_signature: EpilogueSignature | None) -> Status:
        """Can this epilogue do what ``epilogue_signature`` (`GemmArguments.epilogue_signature`) asks?"""
        if epilogue_signature is None:
            return Status.success()
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
