"""Attention for transformers models through `ops.attention`, as an attention implementation.

transformers' attention layers call the function registered in its ``AttentionInterface``
under the config's ``attn_implementation``, with q, k and v as (batch, heads, seqlen,
head_dim) and the mask that the function registered under the same name in
``AttentionMaskInterface`` built. `register` adds both under `NAME`:

- `mask` returns None for plain causal attention with nothing masked (no padding,
  no packed sequences, no sliding window, an empty cache) and for a decode step's single query
  over exactly the cached keys, under ``torch.compile`` too (where transformers' SDPA mask always
  materialises the mask); otherwise it returns what transformers' SDPA mask function returns,
  None where SDPA's ``is_causal`` says the same.
- `attention` runs one row of packed sequences (`kernel_api.nn.packed`: FlashAttention's
  offsets, which confine attention to each sequence as transformers' FlashAttention integration
  reads them, or position ids that restart with the block-causal mask transformers builds from
  them, which under ``torch.compile`` the mask builder hands over as `PackedRows`) as
  variable-length ``ops.attention``, or SDPA under its mask confined to the sequences.
- Otherwise it runs ``ops.attention`` when the mask is None, with SDPA's reading of it
  (causal when more than one query; keys past the queries cut off, as SDPA does for an empty
  static cache), and transformers' SDPA function for any mask, dropout, attention bias, soft
  cap or sink it is handed. Under ``torch.compile`` a single query's attention (a decode step)
  runs transformers' SDPA function too, for Inductor: there the custom op's call costs more
  host time than the decode kernel saves (0.96-1.0x SDPA with one query). Prefill attention
  stays the op, whose kernel runs causal attention as causal: Inductor lowers SDPA's
  ``is_causal`` for cuDNN to a materialised causal bias, attending to every key (GPT-2's 8 x 1024
  prefill on an H200: 1.40 ms of attention a step either way). Under ``torch.compile`` an
  attention that only torch's kernels serve is torch's cuDNN op itself, causal, without the
  custom op's Python around it (`kernel_api.nn.attention_lowering`).

`kernel_api.nn.patch` sets the attention layers' configs to `NAME` and `unpatch` sets them back.
"""

from __future__ import annotations

from typing import Any

import torch

from .. import ops
from ..core import tracing
from . import packed
from .attention_lowering import cudnn_attention, lowers_to_cudnn
from .lowering import static_size
from .mixin import ops_take

#: The attention implementation's name in transformers' interfaces.
NAME = "kernel_api"
# Keyword arguments of the attention interface that change the math: handed to SDPA.
_SDPA_ONLY = ("position_bias", "softcap", "s_aux", "sinks")
# transformers' functions used here, filled by `register` (no transformers import at import time).
_transformers: dict[str, Any] = {}
_grad_enabled = torch.is_grad_enabled


def attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
              is_causal: bool | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-interface function: ``(output (batch, seqlen, heads, head_dim),
    None)`` from q (batch, heads, seqlen_q, head_dim) and k, v (batch, kv_heads, seqlen_k,
    head_dim)."""
    sdpa = _transformers["sdpa_attention_forward"]
    if isinstance(attention_mask, packed.PackedRows):  # (a row of packed sequences: the offsets, the mask)
        rows = attention_mask
        out = _packed_rows(module, query, key, value, rows, dropout, scaling, is_causal, kwargs)
        if out is not None:
            return out, None
        attention_mask = rows.full_mask()
    # (a traced decode step asks nothing else: Dynamo guards what a trace reads, at every call)
    if query.shape[2] == 1 and tracing.is_dynamo_compiling():
        return sdpa(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal,
                    **kwargs)
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    runs_op = dropout == 0.0 and _no_sdpa_keyword(kwargs) and ops_take(query, key, value)
    if runs_op and causal and (attention_mask is not None or kwargs.get("cu_seq_lens_q") is not None
                               or kwargs.get("cu_seq_lens_k") is not None):
        found = packed.plan(query, key, attention_mask, kwargs)  # (one row of packed sequences)
        if found is not None and found.offsets is not None:
            o = found.offsets
            return _packed_row(query, key, value, scaling, o.cu_seqlens_q, o.cu_seqlens_k, o.max_seqlen_q,
                               o.max_seqlen_k), None
        if found is not None:  # (the layer's mask confined to the sequences: SDPA below)
            attention_mask = found.mask
    if attention_mask is not None or not runs_op:
        return sdpa(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal,
                    **kwargs)
    q_len, kv_len = query.shape[2], key.shape[2]
    causal = q_len > 1 and causal
    if causal and kv_len > q_len:  # an empty static cache's prefill: SDPA's top-left mask, keys cut
        key, value = key[:, :, :q_len], value[:, :, :q_len]
    if tracing.is_dynamo_compiling():
        training = _grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad)
        batch, heads_q, _, head_dim = query.shape
        heads_kv, seqlen_k = key.shape[1], key.shape[2]
        if static_size(batch, heads_q, q_len, head_dim, heads_kv, seqlen_k) and lowers_to_cudnn(
                query.dtype, batch, q_len, seqlen_k, heads_q, heads_kv, head_dim, causal, training,
                query.device.index if query.is_cuda else -1):
            return cudnn_attention(query, key, value, causal, scaling, training), None
    out = ops.attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), causal=causal,
                        scale=scaling)
    return out, None


def _packed_rows(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 rows: packed.PackedRows, dropout: float, scaling: float | None, is_causal: bool | None,
                 kwargs: dict) -> torch.Tensor | None:
    """Variable-length attention over the mask builder's packed rows, as (1, tokens, heads,
    head_dim); None when the call is not that (SDPA runs it under the rows' mask)."""
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    flash_q, flash_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if not (causal and dropout == 0.0 and query.shape[0] == 1 and key.shape[2] == query.shape[2]
            and _no_sdpa_keyword(kwargs) and ops_take(query, key, value)):
        return None
    cu, longest = rows.cu_seqlens, rows.max_seqlen
    if flash_q is not None or flash_k is not None:
        # (FlashAttention's offsets too: traced, one tensor for queries and keys, the sequences of
        # both; eagerly `packed.plan` compares them with the mask)
        if longest is not None or flash_q is not flash_k:
            return None
        cu = packed.traced_common_offsets(cu, flash_q, query.shape[2])
    # (no longest length, traced: the op reads it from the offsets, once, and drops the empty sequences)
    return _packed_row(query, key, value, scaling, cu, cu, longest, longest)


def _packed_row(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float | None,
                cu_q: torch.Tensor, cu_k: torch.Tensor, max_q: int | None, max_k: int | None) -> torch.Tensor:
    """Causal variable-length ``ops.attention`` of one row (batch 1) of packed sequences, as
    (1, tokens, heads, head_dim)."""
    out = ops.attention(query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1), causal=True,
                        scale=scaling, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q, max_seqlen_k=max_k)
    return out.unsqueeze(0)


def _no_sdpa_keyword(kwargs: dict) -> bool:
    """Whether none of the keywords that change the math (`_SDPA_ONLY`) is given."""
    for name in _SDPA_ONLY:  # (a loop: Dynamo traces a generator as a frame of its own)
        if kwargs.get(name) is not None:
            return False
    return True


def mask(batch_size: int, q_length: int, kv_length: int, q_offset: Any = 0, kv_offset: Any = 0,
                   mask_function: Any = None, attention_mask: torch.Tensor | None = None, **kwargs: Any) -> Any:
    """transformers' mask-interface function (its ``sdpa_mask``'s arguments): None for plain
    causal attention over an empty cache with nothing masked, and for a decode step whose one
    query sees every cached key (under ``torch.compile`` too, where transformers' SDPA mask
    materialises a mask of all ones for it, one more kernel a layer); else ``sdpa_mask``'s answer."""
    causal_mask_function = _transformers["causal_mask_function"]
    function = causal_mask_function if mask_function is None else mask_function
    if attention_mask is None and function is causal_mask_function and type(kv_offset) is int and kv_offset == 0:
        if type(q_offset) is int and q_offset == 0 and kv_length == q_length:
            return None
        # A decode step's one query at position q_offset over exactly the keys up to it: every key
        # is visible. (A tensor offset, a static cache's, is not read: that would break the graph.)
        if q_length == 1 and not isinstance(q_offset, torch.Tensor) and kv_length == q_offset + 1:
            return None
    sdpa_mask = _transformers["sdpa_mask"]
    return sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                     kv_offset=kv_offset, mask_function=function, attention_mask=attention_mask, **kwargs)


def register() -> None:
    """Register `attention` and `mask` with transformers under `NAME` (idempotent)."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, causal_mask_function, sdpa_mask
    _transformers.update(sdpa_attention_forward=sdpa_attention_forward, causal_mask_function=causal_mask_function,
                         sdpa_mask=sdpa_mask)
    AttentionInterface.register(NAME, attention)
    AttentionMaskInterface.register(NAME, mask)
