"""Attention as `AttentionArguments` defines it, written once with torch: what every attention
kernel must compute. `torch_attention` runs it through SDPA (differentiable);
`attention_with_lse` computes it with the row log-sum-exp from materialised scores (both take a
KV cache of per-row lengths through `cache_mask`), and
`attention_backward` the gradients from that log-sum-exp (the formulas of
`kernel_api.arguments.attention_backward`). The torch provider's kernels run them.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

#: Whether this torch's SDPA takes ``enable_gqa`` (k and v with fewer heads than q, read in
#: place): read from the op's schema.
SDPA_GQA = any(a.name == "enable_gqa" for schema in torch._C._jit_get_schemas_for_operator(
    "aten::scaled_dot_product_attention") for a in schema.arguments)


def _sdpa_kv(k: torch.Tensor, v: torch.Tensor, heads_q: int) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """k and v as SDPA's (batch, heads, seqlen, head_dim) views, and SDPA's keywords for GQA:
    ``enable_gqa`` where this torch has it, else k and v repeated to q's heads."""
    kt, vt = k.transpose(1, 2), v.transpose(1, 2)
    groups = heads_q // k.shape[2]
    if groups == 1:
        return kt, vt, {}
    if SDPA_GQA:
        return kt, vt, {"enable_gqa": True}
    return kt.repeat_interleave(groups, dim=1), vt.repeat_interleave(groups, dim=1), {}


def _dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float) -> torch.Tensor:
    """Attention of (batch, seqlen, heads, head_dim) tensors, differentiable."""
    sq, sk = q.shape[1], k.shape[1]
    skip = max(sq - sk, 0) if causal else 0  # bottom-right: the first sq - sk queries see no key
    if sk == 0 or sq == skip:
        return q * 0  # (keeps the graph: a zero gradient for q)
    qt = (q[:, skip:] if skip else q).transpose(1, 2)
    kt, vt, extra = _sdpa_kv(k, v, q.shape[2])
    rows = sq - skip
    mask = None
    if causal and rows == 1:
        causal = False  # (the one query is the last: it sees every key)
    elif causal and rows != sk:
        mask = torch.ones(rows, sk, dtype=torch.bool, device=q.device).tril(sk - rows)
    o = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, is_causal=causal and mask is None, scale=scale,
                                       **extra).transpose(1, 2)
    if skip:
        o = torch.cat([q[:, :skip] * 0, o], dim=1)
    return o


def cache_mask(cache_seqlens: torch.Tensor, seqlen_q: int, seqlen_k: int, causal: bool) -> torch.Tensor:
    """Which keys each query sees in a KV cache of per-row lengths (`AttentionArguments`'
    ``cache_seqlens``): row ``b`` its first ``cache_seqlens[b]`` keys, under the causal mask query
    ``i`` those up to ``i + cache_seqlens[b] - seqlen_q``.

    Args:
        cache_seqlens: int32 ``(batch,)``.
        seqlen_q, seqlen_k: the queries per row and the cache's size.
        causal: the bottom-right aligned causal mask, aligned to each row's length.

    Returns:
        A bool ``(batch, 1, seqlen_q, seqlen_k)`` tensor on ``cache_seqlens``' device (True: seen).
    """
    device = cache_seqlens.device
    lengths = cache_seqlens.to(torch.int64).view(-1, 1, 1, 1)
    j = torch.arange(seqlen_k, device=device).view(1, 1, 1, -1)
    seen = j < lengths
    if causal:
        i = torch.arange(seqlen_q, device=device).view(1, 1, -1, 1)
        seen = seen & (j <= i + lengths - seqlen_q)
    return seen.expand(-1, 1, seqlen_q, -1)


def _dense_cache(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
                 cache_seqlens: torch.Tensor) -> torch.Tensor:
    """Attention against a KV cache of per-row lengths through SDPA with `cache_mask`; rows that
    see no key give 0."""
    seen = cache_mask(cache_seqlens, q.shape[1], k.shape[1], causal)
    if not (q.numel() and k.shape[1]):
        return q * 0
    kt, vt, extra = _sdpa_kv(k, v, q.shape[2])
    o = F.scaled_dot_product_attention(q.transpose(1, 2), kt, vt, attn_mask=seen, scale=scale, **extra)
    # (a row that sees nothing: SDPA's softmax of no key is NaN or 0 by backend; the definition's 0)
    return torch.where(seen.any(-1, keepdim=True), o, 0).transpose(1, 2)


def torch_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
                    cu_seqlens_q: torch.Tensor | None = None, cu_seqlens_k: torch.Tensor | None = None,
                    cache_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """Attention with torch's SDPA, in FlashAttention's layouts; differentiable.

    Args:
        q, k, v: as for `AttentionArguments` (dense, or variable length with the offsets).
        causal: a bottom-right aligned causal mask.
        scale: the factor on q k^T.
        cu_seqlens_q, cu_seqlens_k: int32 offsets, or None for dense tensors.
        cache_seqlens: for dense k and v that are a KV cache, the keys each row holds (int32
            ``(batch,)``; `cache_mask`), or None.

    Returns:
        A new tensor of q's shape and dtype.
    """
    if cache_seqlens is not None:
        return _dense_cache(q, k, v, causal, scale, cache_seqlens)
    if cu_seqlens_q is None:
        return _dense(q, k, v, causal, scale)
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()  # (a synchronisation on a GPU)
    pieces = [_dense(q[a:b].unsqueeze(0), k[c:d].unsqueeze(0), v[c:d].unsqueeze(0), causal, scale)[0]
              for a, b, c, d in zip(cq, cq[1:], ck, ck[1:])]
    return torch.cat(pieces, dim=0) if pieces else q * 0




# ---- the definition with the row log-sum-exp, and the backward from it ----

def _scores(q: torch.Tensor, k: torch.Tensor, causal: bool, scale: float,
            cache_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """``scale * q k^T`` of one dense (batch, seqlen, heads, head_dim) problem as (batch, heads_q,
    seqlen_q, seqlen_k) in float32 (float64 for float64 inputs), masked keys -inf (`cache_mask`
    with ``cache_seqlens``); k's heads repeated to q's."""
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    groups = q.shape[2] // k.shape[2]
    kt = k.to(compute).transpose(1, 2).repeat_interleave(groups, dim=1)
    s = torch.matmul(q.to(compute).transpose(1, 2), kt.transpose(-1, -2)) * scale
    if cache_seqlens is not None:
        s = s.masked_fill(~cache_mask(cache_seqlens, q.shape[1], k.shape[1], causal), -math.inf)
    elif causal:
        sq, sk = q.shape[1], k.shape[1]
        seen = torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril(sk - sq)
        s = s.masked_fill(~seen, -math.inf)
    return s


def _probabilities(s: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """``exp(s - lse)`` row by row; rows whose lse is not finite (they see no key) give 0."""
    finite = torch.isfinite(lse)
    p = torch.exp(s - torch.where(finite, lse, 0.0).unsqueeze(-1).to(s.dtype))
    return p.masked_fill(~finite.unsqueeze(-1), 0.0)


def _dense_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
               cache_seqlens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    s = _scores(q, k, causal, scale, cache_seqlens)
    lse = torch.logsumexp(s, dim=-1) if s.shape[-1] else s.new_full(s.shape[:-1], -math.inf)
    groups = q.shape[2] // k.shape[2]
    vt = v.to(s.dtype).transpose(1, 2).repeat_interleave(groups, dim=1)
    out = torch.matmul(_probabilities(s, lse), vt).transpose(1, 2).to(q.dtype)
    return out, lse.float()


def _dense_backward(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                    lse: torch.Tensor, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    s = _scores(q, k, causal, scale)
    compute, groups = s.dtype, q.shape[2] // k.shape[2]
    p = _probabilities(s, lse.to(compute))
    do = grad_out.to(compute).transpose(1, 2)
    vt = v.to(compute).transpose(1, 2).repeat_interleave(groups, dim=1)
    kt = k.to(compute).transpose(1, 2).repeat_interleave(groups, dim=1)
    qt = q.to(compute).transpose(1, 2)
    delta = (do * out.to(compute).transpose(1, 2)).sum(-1, keepdim=True)
    ds = p * (torch.matmul(do, vt.transpose(-1, -2)) - delta)
    dq = torch.matmul(ds, kt) * scale
    dk = torch.matmul(ds.transpose(-1, -2), qt) * scale
    dv = torch.matmul(p.transpose(-1, -2), do)

    def heads_kv(t: torch.Tensor) -> torch.Tensor:  # (b, hq, s, d) -> (b, s, hkv, d), summed per group
        b, _, n, d = t.shape
        return t.reshape(b, k.shape[2], groups, n, d).sum(2).transpose(1, 2)

    return dq.transpose(1, 2), heads_kv(dk), heads_kv(dv)


def _pieces(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor) -> list[tuple[int, int, int, int]]:
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()  # (a synchronisation on a GPU)
    return list(zip(cq, cq[1:], ck, ck[1:]))


def attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
                       cu_seqlens_q: torch.Tensor | None = None, cu_seqlens_k: torch.Tensor | None = None,
                       cache_seqlens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention and its row log-sum-exp from the scores, materialised (float32 arithmetic;
    float64 for float64 inputs): the definition the backward kernels read ``lse`` by.

    Args:
        q, k, v, causal, scale, cu_seqlens_q, cu_seqlens_k, cache_seqlens: as for
            `torch_attention`.

    Returns:
        ``(out, lse)``: out of q's shape and dtype; lse float32 in
        `kernel_api.arguments.attention.lse_shape` (``-inf`` for rows that see no key).
    """
    if cu_seqlens_q is None:
        return _dense_lse(q, k, v, causal, scale, cache_seqlens)
    out = torch.zeros_like(q)
    lse = torch.full((q.shape[1], q.shape[0]), -math.inf, dtype=torch.float32, device=q.device)
    for a, b, c, d in _pieces(cu_seqlens_q, cu_seqlens_k):
        if b > a:
            o, s = _dense_lse(q[a:b][None], k[c:d][None], v[c:d][None], causal, scale)
            out[a:b], lse[:, a:b] = o[0], s[0]
    return out, lse


def attention_backward(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                       lse: torch.Tensor, causal: bool, scale: float, cu_seqlens_q: torch.Tensor | None = None,
                       cu_seqlens_k: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of q, k and v from ``lse``, with the scores materialised
    (`kernel_api.arguments.attention_backward` gives the formulas).

    Args:
        grad_out, q, k, v, out, lse: as for `AttentionBackwardArguments`.
        causal, scale, cu_seqlens_q, cu_seqlens_k: the forward's.

    Returns:
        ``(grad_q, grad_k, grad_v)`` in q's, k's and v's shapes and dtype (k/v heads summed
        over their group).
    """
    if cu_seqlens_q is None:
        dq, dk, dv = _dense_backward(grad_out, q, k, v, out, lse, causal, scale)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for a, b, c, d in _pieces(cu_seqlens_q, cu_seqlens_k):
        if b > a and d > c:
            g = _dense_backward(grad_out[a:b][None], q[a:b][None], k[c:d][None], v[c:d][None], out[a:b][None],
                                lse[:, a:b][None], causal, scale)
            dq[a:b], dk[c:d], dv[c:d] = g[0][0], g[1][0], g[2][0]
    return dq, dk, dv


__all__ = ["SDPA_GQA", "attention_backward", "attention_with_lse", "cache_mask", "torch_attention"]
