"""Attention as `AttentionArguments` defines it, computed with torch's SDPA: what every attention
kernel must compute, written once. The torch provider's kernel runs it, and the attention
operation's backward differentiates through it until a backward kernel of ours exists.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_GQA = tuple(int(p) for p in torch.__version__.split(".")[:2]) >= (2, 5)  # SDPA's enable_gqa


def _dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float) -> torch.Tensor:
    """Attention of (batch, seqlen, heads, head_dim) tensors, differentiable."""
    sq, sk = q.shape[1], k.shape[1]
    skip = max(sq - sk, 0) if causal else 0  # bottom-right: the first sq - sk queries see no key
    if sk == 0 or sq == skip:
        return q * 0  # (keeps the graph: a zero gradient for q)
    qt, kt, vt = q[:, skip:].transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    groups = q.shape[2] // k.shape[2]
    extra = {}
    if groups > 1:
        if _GQA:
            extra["enable_gqa"] = True
        else:
            kt, vt = kt.repeat_interleave(groups, dim=1), vt.repeat_interleave(groups, dim=1)
    rows = sq - skip
    mask = None
    if causal and rows != sk:
        mask = torch.ones(rows, sk, dtype=torch.bool, device=q.device).tril(sk - rows)
    o = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, is_causal=causal and mask is None, scale=scale,
                                       **extra).transpose(1, 2)
    if skip:
        o = torch.cat([q[:, :skip] * 0, o], dim=1)
    return o


def torch_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
                    cu_seqlens_q: torch.Tensor | None = None, cu_seqlens_k: torch.Tensor | None = None) -> torch.Tensor:
    """Attention with torch's SDPA, in FlashAttention's layouts; differentiable.

    Args:
        q, k, v: as for `AttentionArguments` (dense, or variable length with the offsets).
        causal: a bottom-right aligned causal mask.
        scale: the factor on q k^T.
        cu_seqlens_q, cu_seqlens_k: int32 offsets, or None for dense tensors.

    Returns:
        A new tensor of q's shape and dtype.
    """
    if cu_seqlens_q is None:
        return _dense(q, k, v, causal, scale)
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()  # (a synchronisation on a GPU)
    pieces = [_dense(q[a:b].unsqueeze(0), k[c:d].unsqueeze(0), v[c:d].unsqueeze(0), causal, scale)[0]
              for a, b, c, d in zip(cq, cq[1:], ck, ck[1:])]
    return torch.cat(pieces, dim=0) if pieces else q * 0


__all__ = ["torch_attention"]
