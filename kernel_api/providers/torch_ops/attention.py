"""The torch provider's attention kernel, `TorchAttention`: it runs
`kernel_api.arguments.attention_math.torch_attention`, the operation's definition in torch.

``torch.nn.functional.scaled_dot_product_attention`` on any device (so CPU tests run it), in
FlashAttention's layouts: dense tensors go to SDPA as ``(batch, heads, seqlen, head_dim)``
views; GQA / MQA with ``enable_gqa=True`` (torch 2.5 and later; before, k and v heads are
repeated with ``repeat_interleave``, a copy of k and v per group). The causal mask is
bottom-right aligned (`kernel_api.arguments.attention`): SDPA's ``is_causal`` where the lengths
are equal, an explicit boolean mask otherwise, and queries that see no key get 0.

Cost of variable length: the offsets are read on the host (on a GPU a device synchronisation
per call) and each sequence runs as its own SDPA call, so a batch of ``n`` sequences is ``n``
launches and one concatenation. Correct first; the fused varlen kernel comes with a
FlashAttention-style provider.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch

from ...arguments.attention import AttentionArguments
from ...arguments.attention_math import torch_attention
from ...core.artifact import CompiledArtifact
from ...core.dtypes import DataType
from ...core.streams import stream_handle
from ...cost.attention import attention_cost
from ...metadata import KernelMetadata, TensorAttributes
from ...metadata.attention import AttentionOperandsMetadata
from . import TorchProvider
from .base import TorchKernel

_DTYPES = (DataType.f16, DataType.bf16, DataType.f32, DataType.f64)
_LAYOUTS = {"dense": (0, 0, 0, 1), "varlen": (0, 0, 1)}
@TorchProvider.register
class TorchAttention(TorchKernel):
    """Attention with ``torch.nn.functional.scaled_dot_product_attention``, any head dim up to
    256, causal or full, GQA / MQA, dense or variable length, on any device."""

    supported_args_type = AttentionArguments
    performance_hint = 0.5

    @classmethod
    def generate_kernels(cls, metadata_filter: Callable[[KernelMetadata], bool] | None, epilogue_args: Any = None,
                         cc: int | None = None) -> list["TorchAttention"]:
        """One instance per dtype (f16, bf16, f32, f64) and layout (dense, varlen), alignment 1.

        Args:
            metadata_filter: keeps the instances whose metadata it accepts (None: all).
            epilogue_args: attention has no epilogue; any makes the list empty.
            cc: unused (torch runs on whatever device the tensors are on).

        Returns:
            The instances.
        """
        if epilogue_args is not None:
            return []
        found = []
        for dt in _DTYPES:
            for layout, pattern in _LAYOUTS.items():
                attrs = TensorAttributes(dt, pattern, 1)
                operands = AttentionOperandsMetadata(attrs, attrs, attrs, attrs)
                metadata = KernelMetadata(f"TorchAttention_{dt}_{layout}", cls, operands)
                if metadata_filter is None or metadata_filter(metadata):
                    found.append(cls(metadata))
        return found

    def estimated_cost(self, args: AttentionArguments, sm_count: int) -> float:
        """`kernel_api.cost.attention.attention_cost` (the per-sequence launches of variable
        length are not counted)."""
        return attention_cost(args)

    def _run(self, args: AttentionArguments, artifact: CompiledArtifact, stream: Any, workspace: Any = None) -> None:
        context = contextlib.nullcontext()
        if args.device.type == "cuda" and stream is not None:
            context = torch.cuda.stream(stream if isinstance(stream, torch.cuda.Stream)
                                        else torch.cuda.ExternalStream(stream_handle(stream)))
        with context, torch.no_grad():
            args.out.copy_(torch_attention(args.q, args.k, args.v, args.causal, args.scale, args.cu_seqlens_q,
                                           args.cu_seqlens_k))
