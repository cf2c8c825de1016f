"""Liger's fused linear cross-entropy (``fused_linear_cross_entropy_forward``) for
`LinearCrossEntropyArguments`: chunks of tokens, each chunk's logits by a torch GEMM, Liger's
Triton cross-entropy kernel writing the loss and the logits' gradient in place, then the
gradient GEMMs; the (tokens x vocabulary) logits never exist whole.

Run with ``reduction="none"``, per-token losses, the per-token weights ``grad_loss`` as its
``token_grad_output``, label smoothing (torch's definition) and z-loss (its ``lse_square_scale``,
added to the loss) as kernel_api defines them. Liger allocates its results; they are copied into
the arguments' outputs. Its weight and bias gradients accumulate in their own type (bf16 weights:
bf16 sums), and it counts the kept tokens on the host (a device synchronisation per call, so it
cannot be captured in a CUDA graph). No recorded launch: every call runs Liger's Python loop.
"""

from __future__ import annotations

from typing import Any

from liger_kernel.ops.fused_linear_cross_entropy import fused_linear_cross_entropy_forward

from kernel_api import CompiledArtifact, DataType, Kernel, KernelMetadata, Status, TensorAttributes
from kernel_api.arguments.cross_entropy import LinearCrossEntropyArguments
from kernel_api.core.streams import stream_context
from kernel_api.metadata.cross_entropy import LinearCrossEntropyOperandsMetadata

from .provider import LigerProvider


@LigerProvider.register
class LigerLinearCrossEntropy(Kernel):
    """Liger's chunked fused linear cross-entropy, forward and gradients in one call."""

    supported_args_type = LinearCrossEntropyArguments
    workspace_free = True
    compiles_from_cache_only = True  # (nothing to compile: Triton compiles Liger's kernel at its first call)
    performance_hint = 0.5
    min_cc = 80

    @classmethod
    def generate_kernels(cls, metadata_filter: Any, epilogue_args: Any = None, cc: int | None = None) -> list:
        if epilogue_args is not None or (cc is not None and cc < cls.min_cc):
            return []
        found = []
        for dtype in (DataType.bf16, DataType.f16, DataType.f32):
            for index in (DataType.i64, DataType.i32):
                rows = TensorAttributes(dtype, (0, 1), 1)
                operands = LinearCrossEntropyOperandsMetadata(rows, rows, TensorAttributes(index, (1,), 1),
                                                              TensorAttributes(DataType.f32, (1,), 1))
                metadata = KernelMetadata(f"{cls.__name__}_{dtype}_{index}", cls, operands, min_cc=cls.min_cc)
                if metadata_filter is None or metadata_filter(metadata):
                    found.append(cls(metadata))
        return found

    def _supports(self, args: LinearCrossEntropyArguments) -> Status:
        return Status.success()

    def get_workspace_size(self, args: Any) -> int:
        return 0

    def compile(self, args: Any, cc: int | None = None) -> CompiledArtifact:
        return CompiledArtifact(None, self)

    def _run(self, args: LinearCrossEntropyArguments, artifact: CompiledArtifact, stream: Any,
             workspace: Any = None) -> None:
        if not args.rows:
            return
        wants = args.wants_gradient
        with stream_context(args.device, stream):
            loss, _, _, _, grad_hidden, grad_weight, grad_bias = fused_linear_cross_entropy_forward(
                args.hidden, args.weight, args.target, bias=args.bias, ignore_index=args.ignore_index,
                lse_square_scale=args.z_loss, label_smoothing=args.label_smoothing, reduction="none",
                token_grad_output=args.grad_loss if wants else None, compute_gradients=wants,
                weight_requires_grad=args.grad_weight is not None)
            args.loss.copy_(loss)
            for out, value in ((args.grad_hidden, grad_hidden), (args.grad_weight, grad_weight),
                               (args.grad_bias, grad_bias)):
                if out is not None:
                    out.copy_(value)
