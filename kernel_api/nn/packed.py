"""Packed sequences in transformers' attention calls, found for `ops.attention`'s variable length.

A packed batch is one row of several sequences (padding-free training). transformers describes it
in two ways, and `offsets` reads both:

- FlashAttention's keywords (``cu_seq_lens_q``, ``cu_seq_lens_k``, ``max_length_q``,
  ``max_length_k``, as `DataCollatorWithFlattening(return_flash_attn_kwargs=True)` passes them):
  taken as transformers' FlashAttention integration takes them, when no mask says otherwise (no
  mask, or the block-causal mask of those offsets).
- Position ids that restart (``DataCollatorWithFlattening``, TRL's padding-free collators):
  transformers then builds a block-causal mask from them (each token sees the earlier tokens of
  its own sequence). The offsets are the restarts, and they are used only when the mask handed to
  the layer is exactly that mask, so any other masking (a sliding window, padding, a prefix) keeps
  SDPA and the mask.

Both need a host read (the offsets' values: the longest sequence, the check of the mask). It is
done once per forward, not per layer: the layers of one forward get the same mask and position
ids, and the answer is kept for them (`_Kept`).
"""

from __future__ import annotations

import weakref
from typing import Any, NamedTuple

import torch

#: transformers' FlashAttention keywords of a packed batch (`FlashAttentionKwargs`).
FLASH_KEYWORDS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
#: Rows of the mask compared at a time: the check's temporaries stay at a few rows of the mask.
_CHECK_ROWS = 1024


class Offsets(NamedTuple):
    """A packed batch's int32 offsets (``batch + 1``, on the tensors' device) and longest lengths."""

    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int


class _Kept:
    """The last answer, for the objects it was found from (weakly held, with their versions):
    the layers of one forward ask with the same mask and position ids."""

    def __init__(self) -> None:
        self.refs: tuple = ()
        self.versions: tuple = ()
        self.answer: Offsets | None = None

    def get(self, *objects: Any) -> tuple[bool, Offsets | None]:
        if len(self.refs) != len(objects):
            return False, None
        for ref, version, obj in zip(self.refs, self.versions, objects):
            if (ref is None) != (obj is None) or (obj is not None and (ref() is not obj or obj._version != version)):
                return False, None
        return True, self.answer

    def put(self, answer: Offsets | None, *objects: Any) -> Offsets | None:
        self.refs = tuple(None if obj is None else weakref.ref(obj) for obj in objects)
        self.versions = tuple(None if obj is None else obj._version for obj in objects)
        self.answer = answer
        return answer


_kept = _Kept()


def offsets(query: torch.Tensor, key: torch.Tensor, attention_mask: torch.Tensor | None,
            kwargs: dict) -> Offsets | None:
    """The offsets when a causal attention call ``(query (1, heads, tokens, head_dim), key, mask,
    **kwargs)`` is a packed batch that variable-length attention computes exactly; else None."""
    tokens = query.shape[2]
    if query.shape[0] != 1 or key.shape[2] != tokens or tokens < 2:
        return None
    flash = [kwargs.get(name) for name in FLASH_KEYWORDS]
    position_ids = kwargs.get("position_ids")
    if all(value is not None for value in flash):
        cu_q, cu_k, max_q, max_k = flash
        if not isinstance(cu_q, torch.Tensor) or not isinstance(cu_k, torch.Tensor):
            return None
        found, answer = _kept.get(cu_q, cu_k, attention_mask)
        if found:
            return answer
        answer = None
        # (self-attention over the packed row: the same offsets for queries and keys)
        if cu_q.shape == cu_k.shape and torch.equal(cu_q, cu_k.to(cu_q.device)):
            cu = cu_q.to(device=query.device, dtype=torch.int32)
            if attention_mask is None or _is_block_causal(attention_mask, cu, tokens):
                answer = Offsets(cu, cu, int(max_q), int(max_k))
        return _kept.put(answer, cu_q, cu_k, attention_mask)
    if attention_mask is None or not isinstance(position_ids, torch.Tensor) or position_ids.shape[-1] != tokens:
        return None
    found, answer = _kept.get(position_ids, attention_mask)
    if found:
        return answer
    starts = (position_ids.reshape(-1) == position_ids.min()).nonzero().view(-1)
    cu = torch.cat((starts, starts.new_tensor([tokens]))).to(device=query.device, dtype=torch.int32)
    answer = None
    if int(starts[0]) == 0 and len(starts) > 1 and _is_block_causal(attention_mask, cu, tokens):
        longest = int((cu[1:] - cu[:-1]).max())
        answer = Offsets(cu, cu, longest, longest)
    return _kept.put(answer, position_ids, attention_mask)


def _is_block_causal(mask: torch.Tensor, cu: torch.Tensor, tokens: int) -> bool:
    """Whether ``mask`` ((1, 1, tokens, tokens), True where a query sees a key) lets each token see
    exactly the earlier tokens of its own sequence (``cu``'s segments) and itself."""
    if mask.dtype != torch.bool or tuple(mask.shape) != (1, 1, tokens, tokens):
        return False
    lengths = cu[1:] - cu[:-1]
    if bool((lengths < 0).any()) or int(cu[-1]) != tokens or int(cu[0]) != 0:
        return False
    segment = torch.repeat_interleave(torch.arange(len(lengths), device=mask.device), lengths.to(mask.device))
    columns = torch.arange(tokens, device=mask.device)
    same = torch.ones((), dtype=torch.bool, device=mask.device)
    for first in range(0, tokens, _CHECK_ROWS):  # (a few rows at a time: no (tokens, tokens) temporary)
        rows = torch.arange(first, min(first + _CHECK_ROWS, tokens), device=mask.device)
        expected = (segment[rows, None] == segment[None, :]) & (columns[None, :] <= rows[:, None])
        same &= (mask[0, 0, first:first + len(rows)] == expected).all()
    return bool(same)
