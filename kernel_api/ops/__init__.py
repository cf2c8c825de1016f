"""The front door: call an operation, let the policy in force choose the kernel.

    kernel_api.ops.gemm(A, B, out=out)
    kernel_api.ops.softmax(x)
    kernel_api.ops.call(args)              # any operation's Arguments
    add = kernel_api.ops.define_operation(Operation(...))   # an operation's torch op and function

``dispatch`` holds the functions, `call`, the choice cache and the launch records; ``operation``
the `Operation` description and `define_operation`, which generates an operation's
``torch.library`` op and front door; ``library`` the ``torch.ops.kernel_api.*`` ops that
``dispatch`` routes to under tracing and autograd.
``library`` is imported after ``dispatch`` (it registers ops that call into it); ``dispatch``
reaches the custom ops through ``torch.ops.kernel_api`` at call time, so it imports nothing
from ``library``.
"""

from typing import Any

import torch

from ..arguments import EpilogueArguments, GemmArguments
from .dispatch import call, chosen_kernels, clear_dispatch_cache, column_parts, gemm, softmax, softmax_backward, split_columns
from .operation import Operation, define_operation, defined_operations, like_input
from . import library  # noqa: E402,F401  (registers torch.ops.kernel_api.*)
from .attention import attention, attention_backward  # noqa: E402  (kernel_api::attention*)
from .norms import layer_norm, layer_norm_backward, rms_norm, rms_norm_backward  # noqa: E402  (kernel_api::*_norm*)
from .cross_entropy import cross_entropy, cross_entropy_backward, linear_cross_entropy  # noqa: E402  (kernel_api::*cross_entropy*)
from .swiglu import geglu, gated_activation, gated_activation_backward, swiglu  # noqa: E402  (kernel_api::gated_*)
from .rope import rope, rope_backward  # noqa: E402  (kernel_api::rope, rope_backward)
from . import epilogue_gemm  # noqa: E402,F401  (registers kernel_api::gemm_epilogue)

__all__ = ["Operation", "attention", "call", "chosen_kernels", "clear_dispatch_cache", "define_operation", "defined_operations",
           "gemm", "gemm_arguments", "like_input", "softmax", "softmax_backward"]
__all__ += ["attention_backward"]
__all__ += ["layer_norm", "layer_norm_backward", "rms_norm", "rms_norm_backward"]
__all__ += ["cross_entropy", "cross_entropy_backward", "linear_cross_entropy"]
__all__ += ["gated_activation", "gated_activation_backward", "geglu", "rope", "rope_backward", "swiglu"]


def gemm_arguments(A: torch.Tensor, B: torch.Tensor, out: torch.Tensor | None = None, *, alpha: float = 1.0,
                   bias: torch.Tensor | None = None, activation: str | None = None,
                   accumulator_type: Any = None) -> list[GemmArguments]:
    """The `GemmArguments` of the GEMMs ``gemm(A, B, out, alpha=..., bias=..., activation=...)``
    runs, so a policy can be asked what it chooses for them without running anything (e.g.
    ``PickAny().choose(a, get_kernels(a))``, or ``PickBest.tune(a)``, which reads the record
    such a call made).

    Args:
        A, B, out, alpha, bias, activation, accumulator_type: as for `gemm`.

    Returns:
        One arguments object; two when ``gemm`` would split a new output's misaligned columns
        off (`dispatch.split_columns`: a 2-D problem of at least 256 rows whose rows are not a
        multiple of 16 bytes): the aligned columns, then the rest, both written into the padded
        output ``gemm`` allocates (its alignment is part of the arguments' signature).
    """
    def epilogue(part_bias: torch.Tensor | None) -> EpilogueArguments | None:
        if alpha == 1.0 and part_bias is None and activation is None:
            return None
        return EpilogueArguments(alpha=alpha, bias=part_bias, activation=activation)

    if out is None:
        head = split_columns(A, B, None, 0.0, bias) if A.dim() == 2 else 0
        if head:
            _, parts = column_parts(A, B, head, bias)
            return [GemmArguments(A, B_part, out_part, accumulator_type, epilogue(bias_part))
                    for B_part, out_part, bias_part in parts]
        out = A.new_empty((*A.shape[:-1], B.shape[-1]))
    return [GemmArguments(A, B, out, accumulator_type, epilogue(bias))]
