"""FlashAttention-4's backward (``flash_attn.cute.interface._flash_attn_bwd``) for
`AttentionBackwardArguments`: dense and variable-length layouts, causal (bottom-right) or full,
GQA/MQA (FA4 sums each group's k/v gradients), f16/bf16, sm_90+.

On sm_90 FA4 runs its Hopper backward (wgmma, the tile following the head dim and the mask). It
reads any forward's log-sum-exp (kernel_api's form is FA4's), treating rows without keys
(``-inf`` or ``+inf``) as giving zero gradients. It writes the gradients into ``grad_q``,
``grad_k`` and ``grad_v``, which must be dense (the op allocates them so); q, k, v, out and
grad_out that are not dense are copied by FA4 first.

As for the forward, FA4 compiles with its own JIT for the GPU it runs on: ``compile`` runs the
backward once on the arguments' own tensors (it writes only the gradients).
"""

from __future__ import annotations

from typing import Any

import torch
from flash_attn.cute.interface import _flash_attn_bwd

from kernel_api import CompilationError, CompiledArtifact, DataType, Kernel, KernelMetadata, Status, TensorAttributes
from kernel_api import AttentionBackwardArguments
from kernel_api.core.status import Reason
from kernel_api.core.streams import stream_context
from kernel_api.cost.attention import attention_backward_cost
from kernel_api.launcher import Launcher
from kernel_api.metadata.attention import AttentionBackwardOperandsMetadata

from .attention import _LAYOUTS, MAX_HEAD_DIM, _Scalars, head_dim_status, launch_stream
from .provider import FlashAttnProvider

#: FA4's backward speed against torch's cuDNN backward (`TorchAttentionBackward`'s ``_cudnn``)
#: by whether the head dim is at least 128 (H200, benchmarks/attention.py, each kernel on its
#: own: 582 against 461 TFLOP/s at b4 h32 s4096 d128 causal, 647 against 554 full; 309 against
#: 205 at b16 h16 s1024 d64 causal).
SPEED_VS_CUDNN = {True: 1.2, False: 1.5}
_GRADIENTS = ("grad_q", "grad_k", "grad_v")


@FlashAttnProvider.register
class FlashAttnBackward(Kernel):
    """``flash_attn.cute``'s backward: one instance per dtype and layout (dense, varlen), sm_90+."""

    supported_args_type = AttentionBackwardArguments
    workspace_free = True
    compiles_from_cache_only = True  # (FA4 keeps what it compiles in this process, as the forward)
    performance_hint = 0.9
    min_cc = 90

    @classmethod
    def generate_kernels(cls, metadata_filter: Any, epilogue_args: Any = None, cc: int | None = None) -> list:
        if epilogue_args is not None or (cc is not None and cc < cls.min_cc):
            return []
        found = []
        for dtype in (DataType.bf16, DataType.f16):
            for layout, pattern in _LAYOUTS.items():
                attrs = TensorAttributes(dtype, pattern, 8)
                operands = AttentionBackwardOperandsMetadata(attrs, attrs, max_head_dim=MAX_HEAD_DIM)
                metadata = KernelMetadata(f"{cls.__name__}_{dtype}_{layout}_a16", cls, operands, min_cc=cls.min_cc)
                if metadata_filter is None or metadata_filter(metadata):
                    found.append(cls(metadata))
        return found

    def _supports(self, args: AttentionBackwardArguments) -> Status:
        for name in _GRADIENTS:
            if not getattr(args, name).is_contiguous():
                return Status.fail(f"operand {name}: FlashAttention-4 writes dense gradients only", kind=Reason.OTHER,
                                   operand=name, actual="strided", required="dense")
        return head_dim_status(args)

    def get_workspace_size(self, args: Any) -> int:
        return 0

    def estimated_cost(self, args: AttentionBackwardArguments, sm_count: int) -> float:
        """`attention_backward_cost` (what the torch provider's backwards are ranked by, cuDNN's
        at speed 1) over FA4's `SPEED_VS_CUDNN`."""
        return attention_backward_cost(args) / SPEED_VS_CUDNN[args.head_dim >= 128]

    def compile(self, args: Any, cc: int | None = None) -> CompiledArtifact:
        """The warm-up: FA4's first backward for these arguments' configuration (on the GPU
        only; CompilationError for another target)."""
        present = torch.cuda.get_device_capability() if torch.cuda.is_available() else None
        present = None if present is None else present[0] * 10 + present[1]
        if present is None or (cc is not None and cc != present):
            where = "no GPU is present" if present is None else f"the GPU is sm_{present}"
            raise CompilationError(f"{self.metadata.kernel_name}: FlashAttention-4 compiles for the GPU it runs on "
                                   f"and {where}; it cannot target sm_{cc}")
        if args.q.is_cuda and args.q.numel() and args.k.numel():
            try:
                _backward(args, *[getattr(args, n) for n in args.tensor_attributes])
            except Exception as exc:  # noqa: BLE001 - FA4's compile or launch failure, said in one line
                raise CompilationError(f"{self.metadata.kernel_name}: FlashAttention-4's backward failed: "
                                       f"{type(exc).__name__}: {exc}") from exc
        return CompiledArtifact(None, self)

    def _run(self, args: AttentionBackwardArguments, artifact: CompiledArtifact, stream: Any,
             workspace: Any = None) -> None:
        with stream_context(args.device, stream):
            _backward(args, *[getattr(args, n) for n in args.tensor_attributes])

    def _launcher(self, args: AttentionBackwardArguments, artifact: CompiledArtifact) -> Launcher | None:
        """Dense layouts only: a varlen call's sequence offsets are no operand of the launch."""
        if args.varlen:
            return None
        device, scalars = args.device, _Scalars(args)

        def launch(*tensors: Any) -> None:  # the nine operands, then the stream
            with launch_stream(device, tensors[-1]):
                _backward(scalars, *tensors[:-1])

        launch.__name__ = f"launch_{self.metadata.kernel_name}"
        return Launcher(launch)


def _backward(args: Any, grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              out: torch.Tensor, lse: torch.Tensor, grad_q: torch.Tensor, grad_k: torch.Tensor,
              grad_v: torch.Tensor) -> None:
    """FA4's backward into the gradients on torch's current stream."""
    if not q.numel() or not k.numel():
        for t in (grad_q, grad_k, grad_v):
            t.zero_()
        return
    if args.varlen:
        _flash_attn_bwd(q, k, v, out, grad_out, lse, softmax_scale=args.scale, causal=args.causal,
                        cu_seqlens_q=args.cu_seqlens_q, cu_seqlens_k=args.cu_seqlens_k, max_seqlen_q=args.seqlen_q,
                        max_seqlen_k=args.seqlen_k, dq=grad_q, dk=grad_k, dv=grad_v)
    else:
        _flash_attn_bwd(q, k, v, out, grad_out, lse, softmax_scale=args.scale, causal=args.causal, dq=grad_q,
                        dk=grad_k, dv=grad_v)
