"""The torch provider's attention backward, `TorchAttentionBackward`: torch's own attention
backward ops, each fed the saved log-sum-exp (`AttentionBackwardArguments`), one instance per
backend of `kernel_api.providers.torch_ops.attention.BACKENDS` that has a backward:

- ``math`` (``..._math``): `kernel_api.arguments.attention_math.attention_backward`, the
  formulas with the scores materialised, on any device and dtype;
- ``flash`` (``..._flash``): aten ``_flash_attention_backward`` (FlashAttention-2), CUDA,
  f16/bf16, dense and variable length, GQA natively (it sums each group's k/v gradients);
- ``cudnn`` (``..._cudnn``): aten ``_scaled_dot_product_cudnn_attention_backward``, CUDA,
  f16/bf16, dense, equal lengths when causal; GQA read in place where torch's cuDNN attention
  takes it (`cudnn_reads_gqa`), else k and v repeated to q's heads (a copy) and their
  gradients summed per group.

Dropout is never used, so the ops' random-state operands are placeholders. The ops allocate
the gradients in their inputs' layouts: gradients the op made for the call take that memory
(`adopt`, no copy kernel) where the layouts agree, and are copied into otherwise. Dense CUDA
calls replay as the forward's do.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from ...arguments.attention_backward import AttentionBackwardArguments
from ...arguments.attention_math import attention_backward
from ...core.artifact import CompiledArtifact
from ...core.status import Status
from ...core.streams import stream_context
from ...cost.attention import attention_backward_cost
from ...launcher import Launcher
from ...metadata import KernelMetadata
from ...metadata.attention import AttentionBackwardOperandsMetadata
from . import TorchProvider
from .attention import Scalars, adopt, backend_status, cudnn_reads_gqa, direct_launch, generate, launch_context, \
    repeat_heads
from .base import TorchKernel

#: The backends' backward speeds against cuDNN's (H200, benchmarks/attention.py, each kernel on
#: its own: FlashAttention-2's 264, 288 and 159 TFLOP/s against cuDNN's 461, 554 and 205 at b4
#: h32 s4096 d128 causal and full and b16 h16 s1024 d64 causal; ``math`` nominal).
BACKWARD_SPEED = {"math": 0.05, "flash": 0.55, "cudnn": 1.0}
_FLASH = torch.ops.aten._flash_attention_backward.default
_CUDNN = torch.ops.aten._scaled_dot_product_cudnn_attention_backward.default

_placeholders: dict[Any, tuple[torch.Tensor, torch.Tensor]] = {}


def _random_state(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The unused random-state operands of the aten backward ops (no dropout), one pair per device."""
    found = _placeholders.get(device)
    if found is None:
        found = _placeholders[device] = (torch.empty(2, dtype=torch.uint64, device=device),
                                         torch.empty((), dtype=torch.uint64, device=device))
    return found


@TorchProvider.register
class TorchAttentionBackward(TorchKernel):
    """Attention's backward with torch's kernels from the saved log-sum-exp: the materialised
    formulas (any device), FlashAttention-2's and cuDNN's backward (CUDA)."""

    supported_args_type = AttentionBackwardArguments
    performance_hint = 0.5

    @classmethod
    def generate_kernels(cls, metadata_filter: Callable[[KernelMetadata], bool] | None, epilogue_args: Any = None,
                         cc: int | None = None) -> list["TorchAttentionBackward"]:
        """One instance per backend with a backward, dtype and layout.

        Args:
            metadata_filter: keeps the instances whose metadata it accepts (None: all).
            epilogue_args: attention has no epilogue; any makes the list empty.
            cc: unused.

        Returns:
            The instances.
        """
        if epilogue_args is not None:
            return []
        return generate(cls, lambda a, spec: AttentionBackwardOperandsMetadata(a, a, max_head_dim=spec.max_head_dim),
                        metadata_filter)

    @property
    def backend(self) -> str:
        return self.metadata.design.backend

    def _supports(self, args: AttentionBackwardArguments) -> Status:
        return backend_status(self.backend, args)

    def estimated_cost(self, args: AttentionBackwardArguments, sm_count: int) -> float:
        """`attention_backward_cost` over the backend's `BACKWARD_SPEED`."""
        return attention_backward_cost(args) / BACKWARD_SPEED[self.backend]

    def _run(self, args: AttentionBackwardArguments, artifact: CompiledArtifact, stream: Any,
             workspace: Any = None) -> None:
        with launch_context(args, stream), torch.no_grad():
            getattr(self, f"_run_{self.backend}")(args, *[getattr(args, n) for n in args.tensor_attributes])

    def _launcher(self, args: AttentionBackwardArguments, artifact: CompiledArtifact) -> Launcher | None:
        """Dense calls (variable length keeps its offsets outside the operands)."""
        if args.varlen:
            return None
        run, scalars = getattr(self, f"_run_{self.backend}"), Scalars(args)
        index = scalars.index

        def launch(*tensors: Any) -> None:
            if direct_launch(index, tensors[-1], *tensors[:6]):
                run(scalars, *tensors[:-1])
                return
            with stream_context(scalars.device, tensors[-1]), torch.no_grad():
                run(scalars, *tensors[:-1])

        launch.__name__ = f"launch_{self.metadata.kernel_name}"
        return Launcher(launch)

    # ---- one method per backend: (args, grad_out, q, k, v, out, lse, grad_q, grad_k, grad_v) ----

    @staticmethod
    def _run_math(args: Any, grad_out: Any, q: Any, k: Any, v: Any, out: Any, lse: Any, grad_q: torch.Tensor,
                  grad_k: torch.Tensor, grad_v: torch.Tensor) -> None:
        grads = attention_backward(grad_out, q, k, v, out, lse, args.causal, args.scale, args.cu_seqlens_q,
                                   args.cu_seqlens_k)
        for target, grad in zip((grad_q, grad_k, grad_v), grads):
            adopt(target, grad, args.outputs_made)

    @staticmethod
    def _run_flash(args: Any, grad_out: Any, q: Any, k: Any, v: Any, out: Any, lse: Any, grad_q: torch.Tensor,
                   grad_k: torch.Tensor, grad_v: torch.Tensor) -> None:
        if _empty(q, k, grad_q, grad_k, grad_v):
            return
        seed, offset = _random_state(q.device)
        grads = _FLASH(grad_out, q, k, v, out, lse, args.cu_seqlens_q, args.cu_seqlens_k, args.seqlen_q, args.seqlen_k,
                       0.0, args.causal, seed, offset, scale=args.scale)
        for target, grad in zip((grad_q, grad_k, grad_v), grads):
            adopt(target, grad, args.outputs_made)

    @staticmethod
    def _run_cudnn(args: Any, grad_out: Any, q: Any, k: Any, v: Any, out: Any, lse: Any, grad_q: torch.Tensor,
                   grad_k: torch.Tensor, grad_v: torch.Tensor) -> None:
        if _empty(q, k, grad_q, grad_k, grad_v):
            return
        heads, groups = q.shape[2], q.shape[2] // k.shape[2]
        if groups > 1 and cudnn_reads_gqa(q.device):
            groups = 1  # (k and v read in place; their gradients come per KV head)
        elif groups > 1:
            k, v = repeat_heads(k, heads), repeat_heads(v, heads)
        seed, offset = _random_state(q.device)
        dq, dk, dv = _CUDNN(grad_out.transpose(1, 2), q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                            out.transpose(1, 2), lse.unsqueeze(-1), seed, offset, None, None, None, args.seqlen_q,
                            args.seqlen_k, 0.0, args.causal, scale=args.scale)
        made = args.outputs_made
        adopt(grad_q, dq.transpose(1, 2), made)
        for target, grad in ((grad_k, dk), (grad_v, dv)):
            grad = grad.transpose(1, 2)
            if groups > 1:
                b, s, _, d = grad.shape
                grad = grad.reshape(b, s, target.shape[2], groups, d).sum(3)
            adopt(target, grad, made)


def _empty(q: torch.Tensor, k: torch.Tensor, grad_q: torch.Tensor, grad_k: torch.Tensor, grad_v: torch.Tensor) -> bool:
    """Zero the gradients of a problem without queries or keys (nothing to launch); whether it was one."""
    if q.numel() and k.numel():
        return False
    for t in (grad_q, grad_k, grad_v):
        t.zero_()
    return True

