"""Arguments of attention's backward (`AttentionBackwardArguments`): the gradients of q, k and v
from the output's gradient, the forward's inputs, its output and its row log-sum-exp.

With ``P = softmax(q k^T * scale + mask)`` recovered row by row from ``lse``
(``P[i, j] = exp(scale * q_i . k_j - lse[i])`` on the keys query ``i`` sees):
``grad_v = P^T grad_out``, ``dP = grad_out v^T``, ``dS = P * (dP - rowsum(grad_out * out))``,
``grad_q = scale * dS k``, ``grad_k = scale * dS^T q``. Under GQA / MQA a k/v head's gradient
is the sum over the query heads of its group. Layouts, masks and offsets are the forward's
(`kernel_api.arguments.attention`); ``lse`` is the forward's, in the form that module defines,
so any forward kernel's output serves any backward kernel, and so are its problem keys
(`kernel_api.arguments.attention.key_length`) and ``outputs_made`` (the gradients made for this
call: a kernel may hand them memory of its own).
"""

from __future__ import annotations

from typing import Any

import torch

from .attention import REFERENCE_MAX_SCORES, AttentionProblem, check_distinct, describe, key_length, lse_attributes
from .attention_math import attention_backward
from .base import Arguments
from .outputs import check_outputs_disjoint


class AttentionBackwardArguments(Arguments):
    """``(grad_q, grad_k, grad_v)`` of ``out = attention(q, k, v)``.

    Args:
        grad_out: the gradient of ``out``: q's shape, dtype and device.
        q, k, v: the forward's inputs (`AttentionArguments`' layouts).
        out: the forward's output.
        lse: the forward's row log-sum-exp (float32, `kernel_api.arguments.attention.lse_shape`,
            contiguous).
        grad_q: q's shape, dtype and device (written).
        grad_k, grad_v: k's shape, dtype and device (written; under GQA the sums over each
            group's query heads).
        causal, scale, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k: the forward's.

    Raises:
        TypeError, ValueError: a one-line message naming the operand.
    """

    __slots__ = ("grad_out", "q", "k", "v", "out", "lse", "grad_q", "grad_k", "grad_v", "cu_seqlens_q",
                 "cu_seqlens_k", "causal", "scale", "varlen", "batch", "seqlen_q", "seqlen_k", "heads_q", "heads_kv",
                 "head_dim", "outputs_made")
    output_names = ("grad_q", "grad_k", "grad_v")
    #: The backward takes no per-row KV cache lengths (the forward's ``cache_seqlens``).
    cache_seqlens = None

    def __init__(self, grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                 lse: torch.Tensor, grad_q: torch.Tensor, grad_k: torch.Tensor, grad_v: torch.Tensor, *,
                 causal: bool = False, scale: float | None = None, cu_seqlens_q: torch.Tensor | None = None,
                 cu_seqlens_k: torch.Tensor | None = None, max_seqlen_q: int | None = None,
                 max_seqlen_k: int | None = None) -> None:
        p = AttentionProblem(q, k, v, causal, scale, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
        attrs: dict[str, Any] = {"grad_out": p.like(grad_out, "grad_out", q, "q"), "q": p.q, "k": p.k, "v": p.v,
                                 "out": p.like(out, "out", q, "q"), "lse": lse_attributes(lse, q, p.varlen),
                                 "grad_q": p.like(grad_q, "grad_q", q, "q"), "grad_k": p.like(grad_k, "grad_k", k, "k"),
                                 "grad_v": p.like(grad_v, "grad_v", v, "v")}
        self.varlen, self.causal, self.scale = p.varlen, p.causal, p.scale
        self.batch, self.seqlen_q, self.seqlen_k = p.batch, p.seqlen_q, p.seqlen_k
        self.heads_q, self.heads_kv, self.head_dim = p.heads_q, p.heads_kv, p.head_dim
        self.grad_out, self.q, self.k, self.v, self.out, self.lse = grad_out, q, k, v, out, lse
        self.grad_q, self.grad_k, self.grad_v = grad_q, grad_k, grad_v
        self.cu_seqlens_q, self.cu_seqlens_k = p.cu_seqlens_q, p.cu_seqlens_k
        self.outputs_made = False
        self.device = q.device
        self.device_index = q.get_device()
        self._verdicts = self._binding = None
        self.tensor_attributes = attrs
        self.signature = ("attention_backward", *(a._key for a in attrs.values()), self.head_dim,
                          self.heads_q // self.heads_kv, self.causal, self.varlen, self.device_index)

    def check_memory(self) -> None:
        """Refuse a gradient whose elements may repeat (`check_distinct`), or that overlaps an
        input or another gradient (kernels write them while reading the inputs).

        Raises:
            ValueError: naming the operands.
        """
        for name, model in (("grad_q", "q"), ("grad_k", "k"), ("grad_v", "v")):
            check_distinct(getattr(self, name), name, model)
        check_outputs_disjoint(self.tensors(), self.output_names)

    def reference_outputs(self) -> dict[str, torch.Tensor] | None:
        """The gradients in float64 from the operands' current values (`attention_math`'s
        formulas, reading ``lse`` as given); None when the scores would pass
        `REFERENCE_MAX_SCORES` elements."""
        if self.batch * self.heads_q * self.seqlen_q * self.seqlen_k > REFERENCE_MAX_SCORES:
            return None
        grads = attention_backward(*(getattr(self, n).double() for n in ("grad_out", "q", "k", "v", "out")), self.lse,
                                   self.causal, self.scale, self.cu_seqlens_q, self.cu_seqlens_k)
        return dict(zip(self.output_names, grads))

    def problem_key(self) -> tuple:
        """The signature with the sizes a choice depends on (as `AttentionArguments`')."""
        return (self.signature, self.batch, self.seqlen_q, key_length(self.seqlen_q, self.seqlen_k), self.heads_q,
                self.heads_kv, self.scale)

    def __repr__(self) -> str:
        return describe(self, type(self).__name__)


__all__ = ["AttentionBackwardArguments"]
