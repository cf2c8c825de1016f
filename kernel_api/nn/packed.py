"""Packed sequences in transformers' attention calls, found for `ops.attention`'s variable length.

A packed batch is one row of several sequences (padding-free training). transformers describes it
in two ways, and `plan` reads both:

- FlashAttention's keywords (``cu_seq_lens_q``, ``cu_seq_lens_k``, ``max_length_q``,
  ``max_length_k``, as ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)`` passes
  them). They confine attention to each sequence, as transformers' FlashAttention integration
  reads them; a mask the layer also has (a sliding window, say) applies on top. Without a mask,
  or with exactly their block-causal mask, the call is variable-length attention; with another
  mask it is SDPA under that mask confined to the sequences. Under ``torch.compile`` the same,
  traced: no offset is read on the host there, so the mask is not compared and confines SDPA.
- Position ids that restart (``DataCollatorWithFlattening``, TRL's padding-free collators):
  transformers then builds a block-causal mask from them. The sequences start where the position
  ids do not go up by one (transformers' own rule), and variable-length attention runs only when
  the layer's mask is exactly their block-causal mask; any other masking (a sliding window that
  bites, padding) keeps SDPA and the mask. In a patched model the mask builder says so instead
  (`PackedRows`, from `kernel_api.nn.positions`): it knows when transformers' mask is exactly
  that, so nothing is compared. Eagerly it reads the offsets once a forward and builds no mask
  unless a layer runs SDPA; under ``torch.compile`` it traces the offsets from the position ids
  (`traced_offsets`) at a size fixed by the token count, the sequences past the last one empty,
  and ``ops.attention`` reads them once a call (one synchronisation) and drops the empty ones.

The eager paths read the offsets on the host (their values, and the mask's comparison): once per
forward, since the layers of a forward get the same mask and position ids and the answers are
kept for them (`_Kept`; not for inference tensors, which have no version counter to say that
they are unchanged).
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Callable, NamedTuple

import torch

from ..core import tracing

#: transformers' FlashAttention keywords of a packed batch (`FlashAttentionKwargs`).
FLASH_KEYWORDS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
#: Rows of the mask compared at a time: the comparison's temporaries stay at a few rows of it.
_CHECK_ROWS = 1024
#: Answers kept per thread: models whose layers alternate masks (full and sliding) ask with each.
_KEPT_ANSWERS = 4


class Offsets(NamedTuple):
    """A packed batch's int32 offsets (``batch + 1``, on the query's device) and longest lengths."""

    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int


class PackedRows(NamedTuple):
    """The mask builder's answer for one row of packed sequences that transformers would mask by
    their position ids alone: the sequences' int32 offsets and transformers' block-causal mask
    for the layers that run SDPA. Traced: the offsets `traced_offsets` makes (``max_seqlen``
    None: the op reads them) and the mask built (unused when attention runs variable length,
    and Inductor drops it). Eager: the exact offsets and longest length (`position_offsets`, read
    once a forward) and ``build``, which makes the mask only for a layer that needs it (a
    (tokens x tokens) mask is 1 GiB at 32768 tokens)."""

    cu_seqlens: torch.Tensor
    max_seqlen: int | None
    mask: torch.Tensor | None
    build: Callable[[], Any] | None

    def full_mask(self) -> Any:
        """transformers' mask for these rows."""
        return self.mask if self.mask is not None else self.build()


def position_offsets(position_ids: torch.Tensor, device: torch.device) -> Offsets:
    """The offsets (on ``device``) of the sequences ``position_ids`` (one row) restart, where they
    do not go up by one, as transformers splits them, and the longest: one read of the ids."""
    return _offsets_of(_position_bounds(position_ids), device)


def _position_bounds(position_ids: torch.Tensor) -> list[int]:
    positions = position_ids.reshape(-1)
    later = (positions[1:] - positions[:-1] != 1).nonzero().view(-1) + 1
    return [0, *later.tolist(), positions.shape[0]]


def _offsets_of(bounds: list[int], device: torch.device) -> Offsets:
    cu = torch.tensor(bounds, dtype=torch.int32, device=device)
    longest = max(b - a for a, b in zip(bounds, bounds[1:]))
    return Offsets(cu, cu, longest, longest)


def traced_offsets(position_ids: torch.Tensor) -> torch.Tensor:
    """int32 offsets of the sequences that ``position_ids`` (one row) restart, where they do not go
    up by one, as transformers splits them: ``tokens + 1`` values, those past the last sequence equal
    to ``tokens`` (empty sequences). Shapes depend on the token count only, so it traces with no
    value read on the host."""
    positions = position_ids.reshape(-1)
    tokens = positions.shape[0]
    starts = torch.cat([positions.new_ones(1, dtype=torch.bool), positions[1:] - positions[:-1] != 1])
    sequence = torch.cumsum(starts, 0) - 1  # (each token's sequence: non-decreasing)
    # (sequence i starts at the first token of sequence i or later; past the last, at the end)
    return torch.searchsorted(sequence, torch.arange(tokens + 1, device=positions.device), out_int32=True)


def traced_common_offsets(offsets: torch.Tensor, other: torch.Tensor, tokens: int) -> torch.Tensor:
    """`traced_offsets`' form (``tokens + 1`` values, empty sequences at the end) of the sequences
    that both ``offsets`` and ``other`` (FlashAttention's offsets of the same row) put together:
    a sequence starts wherever either starts. Traces with no value read; ``other``'s values are
    held to ``[0, tokens]``."""
    starts = torch.zeros(tokens + 1, dtype=torch.bool, device=offsets.device)
    starts = starts.index_fill(0, offsets.long(), True).index_fill(0, other.to(offsets.device).long().clamp(0, tokens),
                                                                  True)
    starts = starts[:tokens].index_fill(0, torch.zeros(1, dtype=torch.long, device=offsets.device), True)
    sequence = torch.cumsum(starts, 0) - 1
    return torch.searchsorted(sequence, torch.arange(tokens + 1, device=offsets.device), out_int32=True)


class Packed(NamedTuple):
    """What a packed call runs: variable-length attention over ``offsets``, or (``offsets`` None)
    SDPA under ``mask``, the layer's mask confined to the sequences."""

    offsets: Offsets | None
    mask: torch.Tensor | None


class _Kept(threading.local):
    """The last answers (offsets, or None) of this thread, each for the objects it was found from
    (weakly held, with their versions) and the values it depends on."""

    def __init__(self) -> None:
        self.entries: list[tuple] = []  # (values, refs, versions, answer), newest last

    @staticmethod
    def _keepable(objects: tuple) -> bool:
        return not any(obj is not None and obj.is_inference() for obj in objects)

    def get(self, objects: tuple, values: tuple) -> tuple[bool, Any]:
        if not self._keepable(objects):
            return False, None
        for entry in reversed(self.entries):
            kept_values, refs, versions, answer = entry
            if kept_values == values and len(refs) == len(objects) and all(
                    (ref is None and obj is None) or (ref is not None and obj is not None and ref() is obj
                                                      and obj._version == version)
                    for ref, version, obj in zip(refs, versions, objects)):
                return True, answer
        return False, None

    def put(self, objects: tuple, values: tuple, answer: Any) -> Any:
        if self._keepable(objects):
            entry = (values, tuple(None if obj is None else weakref.ref(obj) for obj in objects),
                     tuple(None if obj is None else obj._version for obj in objects), answer)
            self.entries = (self.entries + [entry])[-_KEPT_ANSWERS:]
        return answer


_kept = _Kept()


def plan(query: torch.Tensor, key: torch.Tensor, attention_mask: torch.Tensor | None, kwargs: dict) -> Packed | None:
    """How a causal attention call ``(query (1, heads, tokens, head_dim), key, mask, **kwargs)``
    that is one row of packed sequences runs; None when it is no such call (or, by position ids,
    when the mask is not exactly theirs)."""
    tokens = query.shape[2]
    if query.shape[0] != 1 or key.shape[2] != tokens:
        return None
    flash = [kwargs.get(name) for name in FLASH_KEYWORDS]
    if flash[0] is not None or flash[1] is not None:
        return _by_flash_keywords(query, attention_mask, flash, tokens)
    position_ids = kwargs.get("position_ids")
    # (one position per token: not the several rows of multimodal rotary positions)
    if (attention_mask is None or not isinstance(position_ids, torch.Tensor) or position_ids.numel() != tokens
            or tokens < 2 or tracing.is_dynamo_compiling()):
        return None
    objects, values = (position_ids, attention_mask), (str(query.device),)
    found, offsets = _kept.get(objects, values)
    if not found:
        offsets = _kept.put(objects, values, _position_offsets(query, attention_mask, position_ids, tokens))
    return None if offsets is None else Packed(offsets, None)


def _position_offsets(query: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                      tokens: int) -> Offsets | None:
    """The offsets of the sequences the position ids restart (where they do not go up by one) when
    the layer's mask is exactly their block-causal mask; else None."""
    bounds = _position_bounds(position_ids)
    if len(bounds) < 3 or not _is_block_causal(attention_mask, bounds):
        return None
    return _offsets_of(bounds, query.device)


def _by_flash_keywords(query: torch.Tensor, attention_mask: torch.Tensor | None, flash: list,
                       tokens: int) -> Packed:
    cu_q, cu_k, max_q, max_k = flash
    for name, cu in (("cu_seq_lens_q", cu_q), ("cu_seq_lens_k", cu_k)):
        if not isinstance(cu, torch.Tensor) or cu.dim() != 1 or cu.shape[0] < 2:
            got = tuple(cu.shape) if isinstance(cu, torch.Tensor) else type(cu).__name__
            raise ValueError(f"{name}: expected a 1-D tensor of at least 2 offsets, got {got}")
    if cu_q.shape != cu_k.shape:
        raise ValueError(f"cu_seq_lens_q and cu_seq_lens_k: {cu_q.shape[0]} and {cu_k.shape[0]} offsets, "
                         f"one per sequence plus one each")
    if tracing.is_dynamo_compiling():  # (traced: nothing read on the host)
        if attention_mask is None:
            longest = (max_q if isinstance(max_q, int) else tokens, max_k if isinstance(max_k, int) else tokens)
            return Packed(Offsets(cu_q.to(query.device, torch.int32), cu_k.to(query.device, torch.int32),
                                  *longest), None)
        return Packed(None, _confined(attention_mask, cu_q, cu_k, tokens))
    objects, values = (cu_q, cu_k, attention_mask), (str(query.device),)
    found, offsets = _kept.get(objects, values)
    if not found:
        offsets = _kept.put(objects, values, _flash_offsets(query, attention_mask, cu_q, cu_k, tokens))
    # (a confined mask is made at each call, not kept: it is as large as the layer's mask)
    return Packed(offsets, None) if offsets is not None else Packed(None, _confined(attention_mask, cu_q, cu_k, tokens))


def _flash_offsets(query: torch.Tensor, attention_mask: torch.Tensor | None, cu_q: torch.Tensor,
                   cu_k: torch.Tensor, tokens: int) -> Offsets | None:
    """FlashAttention's offsets, checked, when variable-length attention computes the call: no
    mask, or exactly their block-causal one; None when the mask is another (it confines SDPA)."""
    bounds_q, bounds_k = cu_q.tolist(), cu_k.tolist()
    for name, bounds in (("cu_seq_lens_q", bounds_q), ("cu_seq_lens_k", bounds_k)):
        if bounds[0] != 0 or bounds[-1] != tokens or any(b < a for a, b in zip(bounds, bounds[1:])):
            raise ValueError(f"{name}: offsets must go from 0 to the row's {tokens} tokens without decreasing, "
                             f"got {bounds}")
    if attention_mask is not None and not (bounds_q == bounds_k and _is_block_causal(attention_mask, bounds_q)):
        return None
    longest_q = max(b - a for a, b in zip(bounds_q, bounds_q[1:]))
    longest_k = max(b - a for a, b in zip(bounds_k, bounds_k[1:]))
    return Offsets(torch.tensor(bounds_q, dtype=torch.int32, device=query.device),
                   torch.tensor(bounds_k, dtype=torch.int32, device=query.device), longest_q, longest_k)


def _confined(mask: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor, tokens: int) -> torch.Tensor:
    """``mask`` ((1, 1, tokens, tokens): bool, True where a query sees a key, or additive) where
    the query and the key are of the same sequence, closed elsewhere."""
    rows = torch.arange(tokens, device=mask.device)
    sequence_q = torch.searchsorted(cu_q[1:].to(mask.device, torch.int64), rows, right=True)
    sequence_k = torch.searchsorted(cu_k[1:].to(mask.device, torch.int64), rows, right=True)
    same = sequence_q[:, None] == sequence_k[None, :]
    if mask.dtype == torch.bool:
        return mask & same
    return mask.masked_fill(~same, torch.finfo(mask.dtype).min)


def _is_block_causal(mask: torch.Tensor, bounds: list[int]) -> bool:
    """Whether ``mask`` ((1, 1, tokens, tokens), True where a query sees a key) lets each token see
    exactly the earlier tokens of its own sequence (``bounds``: the sequences' offsets) and itself."""
    tokens = bounds[-1]
    if mask.dtype != torch.bool or tuple(mask.shape) != (1, 1, tokens, tokens) or any(
            b < a for a, b in zip(bounds, bounds[1:])):
        return False
    lengths = torch.tensor([b - a for a, b in zip(bounds, bounds[1:])], device=mask.device)
    sequence = torch.repeat_interleave(torch.arange(len(lengths), device=mask.device), lengths, output_size=tokens)
    columns = torch.arange(tokens, device=mask.device)
    same = torch.ones((), dtype=torch.bool, device=mask.device)
    for first in range(0, tokens, _CHECK_ROWS):  # (a few rows at a time: no (tokens, tokens) temporary)
        rows = columns[first:first + _CHECK_ROWS]
        expected = (sequence[rows, None] == sequence[None, :]) & (columns[None, :] <= rows[:, None])
        same &= (mask[0, 0, first:first + len(rows)] == expected).all()
    return bool(same)
