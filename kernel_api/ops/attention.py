"""``ops.attention``: attention forward through kernel_api, with a backward.

The torch op ``torch.ops.kernel_api.attention`` is generated from one `Operation`
(`ATTENTION`): the forward runs whichever kernel the policy picks for `AttentionArguments`
(only the torch provider's `TorchAttention` serves it so far). The backward recomputes the
forward with torch's SDPA under autograd on the saved q, k and v
(`providers.torch_ops.attention.torch_attention`) and differentiates that: correct, at the cost
of a second forward and SDPA's memory, until a backward kernel exists.
"""

from __future__ import annotations

from typing import Any

import torch

from ..arguments.attention import AttentionArguments
from ..arguments.attention_math import torch_attention
from .operation import Operation, define_operation


def _arguments(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float | None,
               cu_seqlens_q: torch.Tensor | None, cu_seqlens_k: torch.Tensor | None, max_seqlen_q: int | None,
               max_seqlen_k: int | None, out: torch.Tensor) -> AttentionArguments:
    return AttentionArguments(q, k, v, out, causal=causal, scale=scale, cu_seqlens_q=cu_seqlens_q,
                              cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)


def _fake(q: torch.Tensor, *rest: Any) -> torch.Tensor:
    return q.new_empty(q.shape)


def _backward(saved: Any, grad: torch.Tensor) -> tuple:
    """Gradients of q, k and v by differentiating torch's SDPA on the saved inputs."""
    needs = saved.needs_input_grad[:3]
    inputs = [t.detach().requires_grad_(n) for t, n in zip((saved.q, saved.k, saved.v), needs)]
    scale = saved.scale if saved.scale is not None else saved.q.shape[-1] ** -0.5
    with torch.enable_grad():
        out = torch_attention(*inputs, saved.causal, scale, saved.cu_seqlens_q, saved.cu_seqlens_k)
        wanted = [t for t, n in zip(inputs, needs) if n]
        grads = iter(torch.autograd.grad(out, wanted, grad) if wanted else ())
    return (*[next(grads) if n else None for n in needs], None, None, None, None, None, None)


ATTENTION = Operation(
    name="kernel_api::attention",
    schema="(Tensor q, Tensor k, Tensor v, bool causal=False, float? scale=None, Tensor? cu_seqlens_q=None, "
           "Tensor? cu_seqlens_k=None, SymInt? max_seqlen_q=None, SymInt? max_seqlen_k=None) -> Tensor",
    arguments=_arguments,
    outputs=("out",),
    fake=_fake,
    backward=_backward,
    saved=("q", "k", "v", "causal", "scale", "cu_seqlens_q", "cu_seqlens_k"),
)

_attention = define_operation(ATTENTION)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False, scale: float | None = None,
              cu_seqlens_q: torch.Tensor | None = None, cu_seqlens_k: torch.Tensor | None = None,
              max_seqlen_q: int | None = None, max_seqlen_k: int | None = None, out: torch.Tensor | None = None,
              stream: Any = None) -> torch.Tensor:
    """``softmax(q k^T * scale + mask) v`` per head, through kernel_api.

    Args:
        q, k, v: FlashAttention's layouts, (batch, seqlen, heads, head_dim), or
            (total_tokens, heads, head_dim) with ``cu_seqlens_q`` and ``cu_seqlens_k``; q's heads
            a multiple of k's and v's (GQA / MQA). See `AttentionArguments`.
        causal: a causal mask aligned to the bottom right (decoding: the queries are the last
            ``seqlen_q`` positions of the ``seqlen_k`` keys).
        scale: the factor on q k^T; default ``1 / sqrt(head_dim)``.
        cu_seqlens_q, cu_seqlens_k: int32 cumulative sequence offsets, length batch + 1.
        max_seqlen_q, max_seqlen_k: the longest sequences; required when the offsets are not on
            the CPU.
        out: a tensor of q's shape to write, or None to allocate one.
        stream: the stream to launch on (None: the current one).

    Returns:
        ``out``: q's shape and dtype. Differentiable in q, k and v.

    Raises:
        TypeError, ValueError: invalid operands (the message names the operand).
        NoKernelFoundError: no kernel takes these arguments.
    """
    return _attention(q, k, v, causal, scale, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, out=out,
                      stream=stream)


attention.operation = ATTENTION
attention.op = _attention.op
