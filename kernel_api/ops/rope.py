"""``ops.rope``: the rotary position embedding of queries and keys with transformers'
``apply_rotary_pos_emb`` math, forward and backward, as torch ops generated from `Operation`
descriptions.

Two ops: ``kernel_api::rope`` (``(q_out, k_out)``, both rotated in one launch) and
``kernel_api::rope_backward`` (the transposed rotation of the two gradients). The backward needs
only cos and sin, so the forward keeps neither q nor k alive. Gradients reach q and k; when cos
or sin themselves require grad (transformers computes them without), `rope` computes with torch's
differentiable operators instead.
"""

from __future__ import annotations

from typing import Any

import torch

from ..arguments.rope import RopeArguments, RopeBackwardArguments
from .operation import Operation, define_operation


def _rope_fake(q: torch.Tensor, k: torch.Tensor, *rest: Any) -> tuple[torch.Tensor, torch.Tensor]:
    # q's and k's memory order kept, as torch's elementwise operators keep it
    return torch.empty_like(q), torch.empty_like(k)


def _arguments(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int, *,
               q_out: torch.Tensor, k_out: torch.Tensor) -> RopeArguments:
    return RopeArguments(q, k, cos, sin, q_out, k_out, unsqueeze_dim=unsqueeze_dim)


def _backward_arguments(grad_q_out: torch.Tensor, grad_k_out: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                        unsqueeze_dim: int, *, grad_q: torch.Tensor, grad_k: torch.Tensor) -> RopeBackwardArguments:
    return RopeBackwardArguments(grad_q_out, grad_k_out, cos, sin, grad_q, grad_k, unsqueeze_dim=unsqueeze_dim)


def _unit_last(g: torch.Tensor) -> torch.Tensor:
    """``g`` with a unit-stride last dimension (gradients may arrive expanded)."""
    return g if g.stride(-1) == 1 or g.shape[-1] <= 1 else g.contiguous()


def _backward(saved: Any, grad_q: torch.Tensor, grad_k: torch.Tensor) -> tuple:
    # (autograd materialises a missing output gradient as zeros, so both are tensors)
    dq, dk = rope_backward(_unit_last(grad_q), _unit_last(grad_k), saved.cos, saved.sin, saved.unsqueeze_dim)
    return dq, dk, None, None, None


ROPE = Operation(
    name="kernel_api::rope",
    schema="(Tensor q, Tensor k, Tensor cos, Tensor sin, int unsqueeze_dim=1) -> (Tensor, Tensor)",
    arguments=_arguments, outputs=("q_out", "k_out"), fake=_rope_fake, backward=_backward,
    saved=("cos", "sin", "unsqueeze_dim"))
ROPE_BACKWARD = Operation(
    name="kernel_api::rope_backward",
    schema="(Tensor grad_q_out, Tensor grad_k_out, Tensor cos, Tensor sin, int unsqueeze_dim=1) -> (Tensor, Tensor)",
    arguments=_backward_arguments, outputs=("grad_q", "grad_k"), fake=_rope_fake)

_rope = define_operation(ROPE)
#: ``rope_backward(grad_q_out, grad_k_out, cos, sin, unsqueeze_dim=1, *, grad_q=None, grad_k=None,
#: stream=None)`` -> ``(grad_q, grad_k)``: the transposed rotation.
rope_backward = define_operation(ROPE_BACKWARD)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *,
         position_ids: torch.Tensor | None = None, unsqueeze_dim: int = 1, stream: Any = None) -> tuple:
    """Rotary position embedding of q and k, as transformers' ``apply_rotary_pos_emb``.

    ``q_out = q * cos + rotate_half(q) * sin`` (and k's alike), cos and sin broadcast over the
    heads at ``unsqueeze_dim``.

    Args:
        q: (batch, heads_q, seq, head_dim) with ``unsqueeze_dim=1`` (transformers' layout after
            its transpose; any strides with a unit last dimension), or (batch, seq, heads_q,
            head_dim) with ``unsqueeze_dim=2``; head_dim even.
        k: as q, with its own head count (grouped-query attention).
        cos, sin: (1 or batch, seq, head_dim); with ``position_ids``, tables of (positions,
            head_dim) that ``position_ids`` indexes.
        position_ids: optional (batch or 1, seq) integer positions: cos and sin become
            ``cos[position_ids]`` and ``sin[position_ids]``.
        unsqueeze_dim: 1 or 2, where transformers unsqueezes cos and sin.
        stream: the stream to launch on (None: the current one).

    Returns:
        ``(q_out, k_out)`` in q's and k's memory order, differentiable with respect to q and k
        (and to cos and sin, through torch's operators, when they require grad).
    """
    if position_ids is not None:
        cos, sin = cos[position_ids], sin[position_ids]
    if torch.is_grad_enabled() and (cos.requires_grad or sin.requires_grad):
        c, s = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
        return q * c + _rotate_half(q) * s, k * c + _rotate_half(k) * s
    return _rope(q, k, cos, sin, unsqueeze_dim, stream=stream)
