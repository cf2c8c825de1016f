"""Arguments of attention (`AttentionArguments`): ``out = softmax(q k^T * scale + mask) v``.

Layouts are FlashAttention's: dense ``(batch, seqlen, heads, head_dim)``, or variable length
``(total_tokens, heads, head_dim)`` with int32 cumulative sequence offsets ``cu_seqlens_q`` /
``cu_seqlens_k`` of length ``batch + 1`` (sequence ``b`` is rows ``cu[b]:cu[b + 1]``).
GQA / MQA: q's heads a multiple of k's and v's (q head ``h`` reads k/v head
``h // (heads_q // heads_kv)``).

Causal masks are aligned to the bottom right, as FlashAttention's: query ``i`` of a sequence
with ``seqlen_q`` queries and ``seqlen_k`` keys sees keys ``j <= i + seqlen_k - seqlen_q``.
With ``seqlen_q < seqlen_k`` (decoding against a KV cache) the queries are the last ones;
with ``seqlen_q > seqlen_k`` the first ``seqlen_q - seqlen_k`` queries see no key and their
output is 0.

The row log-sum-exp (``lse``, an optional output) is what a backward needs of the forward:
``lse[b, h, i] = log(sum_j exp(scale * q_i . k_j))`` over the keys query ``i`` sees, float32,
``(batch, heads_q, seqlen_q)`` dense and ``(heads_q, total_q)`` variable length (FlashAttention's
forms), contiguous. A row that sees no key has the empty sum's ``-inf`` (kernels may write
``+inf`` there, as FlashAttention-2 does; backward kernels take either and give such rows zero
gradients). Forward kernels write it when it is given and decline it otherwise
(`AttentionOperandsMetadata`'s ``lse``), so inference allocates nothing for it.

What construction checks: ranks, shapes, dtypes, devices, a unit-stride head_dim, the heads'
ratio and out's shape; for cu_seqlens the dtype (int32), rank, length and device. Their values
(first 0, non-decreasing, last = total tokens) are checked where they are read: on the CPU
always, on a GPU only when ``max_seqlen_q`` and ``max_seqlen_k`` are not given. Given them, the
offsets are trusted (reading them would synchronise with the device); left out, they are read
(one synchronisation), checked, and the longest sequences found. Offsets that are read may end in
empty sequences (a fixed-size offsets tensor padded with the token count, as a traced model makes
it): those are dropped, so kernels launch no work for them.

Choices are keyed by the key length as `key_length` gives it: exact up to the query length, and
past it (decoding against a KV cache, a prefill chunk after cached tokens) by its power-of-two
bucket, so a cache that grows by a token a step keeps its choice until its length doubles. A
kernel's support may therefore depend on ``seqlen_k`` only through its comparison with
``seqlen_q`` (and zero); the shipped kernels' does (cuDNN's causal mask needs equal lengths).

KV caches of per-row lengths (``cache_seqlens``, FlashAttention's ``flash_attn_with_kvcache``
form): k and v are a preallocated cache ``(batch, max_seqlen_k, heads_kv, head_dim)`` and the
int32 ``cache_seqlens`` of shape ``(batch,)`` on q's device says how many of its first keys
row ``b`` holds; row ``b`` attends to keys ``[0, cache_seqlens[b])`` only, and under the causal
mask its last query sits at position ``cache_seqlens[b] - 1`` (query ``i`` sees keys
``j <= i + cache_seqlens[b] - seqlen_q``). The values are never read on the host: they must
lie in ``[0, max_seqlen_k]`` (kernels clamp them there so no read leaves the cache). The
problem key holds that the lengths are given and the cache's size, not their values, so a
decode loop growing its cache keeps one choice and one compiled kernel. Unlike the sequence
offsets it is an operand (in ``tensor_attributes``, after the outputs): a recorded launch takes
it as a tensor, so a repeated call replays with the lengths tensor it is given. Dense layout
only (variable length gives each sequence's keys by ``cu_seqlens_k``); kernels declare it
(`AttentionOperandsMetadata`'s ``cache_seqlens``) and the others decline.

``outputs_made`` (False unless the caller says so): the outputs were made for this call and
nothing else holds them (the generated ``ops.attention`` ops' own allocations). A kernel that
computes its result into memory of its own may then hand that memory to the outputs
(``Tensor.set_``, no copy) instead of copying into them.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..core.dtypes import DataType
from ..core.numbers import is_finite_number
from ..core.tensor_attributes import TensorAttributes
from .attention_math import attention_with_lse, torch_attention
from .base import STORAGELESS_TYPES, Arguments, _attributes, _divisibility, _element_type, \
    _lazy_bit_error, _require_tensor, data_pointer
from .outputs import check_outputs_disjoint, elements_distinct

#: The most score elements (batch x heads x seqlen_q x seqlen_k) a float64 reference materialises.
REFERENCE_MAX_SCORES = 1 << 28

#: The operands' stride patterns by layout: dense (batch, seqlen, heads, head_dim) and variable
#: length (total_tokens, heads, head_dim), the head dim contiguous in both. Kernels declare one
#: instance per layout from it.
LAYOUTS = {"dense": (0, 0, 0, 1), "varlen": (0, 0, 1)}
_DENSE, _VARLEN = LAYOUTS["dense"], LAYOUTS["varlen"]


def _operand(t: torch.Tensor, name: str, rank: int) -> TensorAttributes:
    """Attributes of q, k, v or out: rank, a contiguous head_dim, no lazy bits."""
    dt = _element_type(t, name)
    if t.dim() != rank:
        layout = "(batch, seqlen, heads, head_dim)" if rank == 4 else "(total_tokens, heads, head_dim)"
        raise ValueError(f"operand {name}: expected rank {rank} {layout}, got shape {tuple(t.shape)}")
    if t.is_neg():
        raise _lazy_bit_error(t, name)
    stride = t.stride()
    if t.shape[-1] > 1 and stride[-1] != 1:
        raise ValueError(f"operand {name}: head_dim must be contiguous (stride 1), got strides {tuple(stride)}")
    div = _divisibility(data_pointer(t), t.element_size(), (t.shape[-1], *stride[:-1]))
    return _attributes(dt, _DENSE if rank == 4 else _VARLEN, div)


def _offsets(cu: Any, name: str, batch: int | None, device: torch.device) -> int:
    """Check cumulative sequence offsets; returns the batch (their length - 1)."""
    _require_tensor(cu, name)
    if cu.dtype != torch.int32:
        raise TypeError(f"operand {name}: dtype {cu.dtype} but cumulative sequence offsets are torch.int32")
    if cu.is_neg():
        raise _lazy_bit_error(cu, name)
    if cu.dim() != 1 or cu.shape[0] < 1:
        raise ValueError(f"operand {name}: expected a 1-D tensor of length batch + 1, got shape {tuple(cu.shape)}")
    if cu.shape[0] > 1 and cu.stride(0) != 1:  # kernels take its pointer and read consecutive int32s
        raise ValueError(f"operand {name}: must be contiguous, got stride {cu.stride(0)}")
    if batch is not None and cu.shape[0] != batch + 1:
        raise ValueError(f"operand {name}: length {cu.shape[0]} but cu_seqlens_q's is {batch + 1} (batch + 1)")
    if cu.device != device:
        raise ValueError(f"operand {name}: on {cu.device} but q is on {device}")
    return cu.shape[0] - 1


def _readable(cu: torch.Tensor) -> bool:
    """Whether ``cu``'s values exist to be read (not a meta or fake tensor)."""
    return cu.device.type != "meta" and (type(cu) is torch.Tensor or not isinstance(cu, STORAGELESS_TYPES))


def _host_lengths(cu: torch.Tensor, name: str, tokens: int, operand: str) -> list[int] | None:
    """The sequence lengths when ``cu`` can be read cheaply (a real CPU tensor), checked; else None."""
    if cu.device.type != "cpu" or not _readable(cu):
        return None
    values = cu.tolist()
    lengths = [b - a for a, b in zip(values, values[1:])]
    _check_offsets(name, values[0], min(lengths, default=0), values[-1], tokens, operand)
    return lengths


def _check_offsets(name: str, first: int, shortest: int, last: int, tokens: int, operand: str) -> None:
    if first != 0:
        raise ValueError(f"operand {name}: must start at 0, got {first}")
    if shortest < 0:
        raise ValueError(f"operand {name}: must be non-decreasing (a sequence of length {shortest})")
    if last != tokens:
        raise ValueError(f"operand {name}: ends at {last} but {operand} has {tokens} tokens")


def _device_summary(cu_q: torch.Tensor, cu_k: torch.Tensor) -> list[list[int]]:
    """Per offsets tensor (q's, then k's): first, shortest and longest length, last, and the
    sequences up to the last non-empty one; read from the device in one transfer."""
    parts = []
    for cu in (cu_q, cu_k):
        lengths = (cu[1:] - cu[:-1]).long()
        if lengths.numel() == 0:  # (no sequence: nothing shorter or longer than 0)
            lengths = lengths.new_zeros(1)
        used = torch.arange(1, lengths.shape[0] + 1, device=cu.device) * (lengths > 0)
        parts.append(torch.stack([cu[0].long(), lengths.min(), lengths.max(), cu[-1].long(), used.max()]))
    return torch.stack(parts).tolist()


def _used(lengths: list[int]) -> int:
    """The sequences up to the last non-empty one."""
    return max((i + 1 for i, n in enumerate(lengths) if n > 0), default=0)


def _max_seqlen(value: Any, name: str, lengths: list[int] | None, cu_name: str, tokens: int,
                other_given: bool) -> int:
    """The longest sequence: ``value`` checked, at most ``tokens`` (no sequence holds more than the
    packed tensor, and kernels size their grids by it); from the offsets when not given."""
    if value is None:
        if lengths is None:
            why = ("when the other longest length is given (give both, or leave both out to have the offsets read)"
                   if other_given else "whose values cannot be read (a meta or fake tensor)")
            raise ValueError(f"{name}: required with {cu_name} {why}")
        return max(lengths, default=0)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name}: expected a non-negative int, got {value!r}")
    if lengths is not None and value < max(lengths, default=0):
        raise ValueError(f"{name}: {value} is below the longest sequence in {cu_name}, {max(lengths)}")
    return min(value, tokens)


def _cache_lengths(lengths: Any, batch: int, varlen: bool, device: torch.device) -> TensorAttributes:
    """Check ``cache_seqlens`` (int32, ``(batch,)``, contiguous, q's device; its values are not
    read) and return its attributes."""
    _require_tensor(lengths, "cache_seqlens")
    if varlen:
        raise ValueError("operand cache_seqlens: with the dense layout only (variable length gives each sequence's "
                         "keys by cu_seqlens_k)")
    if lengths.dtype != torch.int32:
        raise TypeError(f"operand cache_seqlens: dtype {lengths.dtype} but the cached lengths are torch.int32")
    if lengths.is_neg():
        raise _lazy_bit_error(lengths, "cache_seqlens")
    if tuple(lengths.shape) != (batch,):
        raise ValueError(f"operand cache_seqlens: shape {tuple(lengths.shape)} but q's batch is {batch} (expected "
                         f"({batch},), one length per row)")
    if lengths.device != device:
        raise ValueError(f"operand cache_seqlens: on {lengths.device} but q is on {device}")
    if batch > 1 and lengths.stride(0) != 1:
        raise ValueError(f"operand cache_seqlens: must be contiguous, got stride {lengths.stride(0)}")
    return _attributes(DataType.i32, (1,), _divisibility(data_pointer(lengths), 4, (batch,)))


def key_length(seqlen_q: int, seqlen_k: int) -> int:
    """The key length as attention's problem keys hold it (see the module docstring).

    Args:
        seqlen_q, seqlen_k: the (longest) query and key lengths.

    Returns:
        ``seqlen_k`` when it is at most ``seqlen_q``; else minus the number of bits of
        ``seqlen_k - 1`` (129 to 256 keys: -8), which no exact length equals.
    """
    if seqlen_k <= seqlen_q:
        return seqlen_k
    return -(seqlen_k - 1).bit_length()


def lse_shape(q: torch.Tensor, varlen: bool) -> tuple[int, ...]:
    """The shape of the row log-sum-exp of attention with queries ``q``.

    Args:
        q: the queries, (batch, seqlen_q, heads_q, head_dim) or (total_q, heads_q, head_dim).
        varlen: whether the layout is variable length.

    Returns:
        ``(batch, heads_q, seqlen_q)``, or ``(heads_q, total_q)`` for variable length.
    """
    if varlen:
        return (q.shape[1], q.shape[0])
    return (q.shape[0], q.shape[2], q.shape[1])


def lse_attributes(lse: Any, q: torch.Tensor, varlen: bool) -> TensorAttributes:
    """Check the row log-sum-exp operand (float32, `lse_shape`, contiguous, q's device).

    Args:
        lse: the operand.
        q: the queries.
        varlen: whether the layout is variable length.

    Returns:
        Its `TensorAttributes`.

    Raises:
        TypeError, ValueError: naming ``lse``.
    """
    _require_tensor(lse, "lse")
    if lse.dtype != torch.float32:
        raise TypeError(f"operand lse: dtype {lse.dtype} but the log-sum-exp is torch.float32")
    if lse.is_neg():
        raise _lazy_bit_error(lse, "lse")
    shape = lse_shape(q, varlen)
    if tuple(lse.shape) != shape:
        form = "(heads_q, total_q)" if varlen else "(batch, heads_q, seqlen_q)"
        raise ValueError(f"operand lse: shape {tuple(lse.shape)} but q's is {shape} {form}")
    if lse.device != q.device:
        raise ValueError(f"operand lse: on {lse.device} but q is on {q.device}")
    if not lse.is_contiguous():
        raise ValueError(f"operand lse: must be contiguous, got strides {tuple(lse.stride())}")
    div = _divisibility(data_pointer(lse), 4, (lse.shape[-1],))
    return _attributes(DataType.f32, (0,) * (len(shape) - 1) + (1,), div)


def expanded_dim(t: torch.Tensor) -> int | None:
    """The first dim of ``t`` wider than 1 with a stride 0 (an expanded tensor, such as k
    repeated over heads by ``expand``); None when there is none."""
    strides = t.stride()
    if 0 not in strides:
        return None
    return next((m for m, (n, st) in enumerate(zip(t.shape, strides)) if n > 1 and st == 0), None)


def expanded(**operands: torch.Tensor) -> tuple[str, ...]:
    """The names of the operands that `expanded_dim` finds expanded: part of the signature, since
    a kernel may take such an operand or not (the stride pattern says only which stride is 1)."""
    return tuple(name for name, t in operands.items() if expanded_dim(t) is not None)


class AttentionProblem:
    """What q, k, v and the scalars of attention say, checked once (shared by the forward's and
    the backward's arguments): sizes, the scale, and the attributes of q, k and v.

    Raises:
        TypeError, ValueError: a one-line message naming the operand.
    """

    __slots__ = ("varlen", "rank", "q", "k", "v", "causal", "scale", "batch", "seqlen_q", "seqlen_k", "heads_q",
                 "heads_kv", "head_dim", "cu_seqlens_q", "cu_seqlens_k")

    def __init__(self, q: Any, k: Any, v: Any, causal: Any, scale: Any, cu_seqlens_q: Any, cu_seqlens_k: Any,
                 max_seqlen_q: Any, max_seqlen_k: Any) -> None:
        for name, t in (("q", q), ("k", k), ("v", v)):
            _require_tensor(t, name)
        if (cu_seqlens_q is None) != (cu_seqlens_k is None):
            given = "cu_seqlens_q" if cu_seqlens_k is None else "cu_seqlens_k"
            raise ValueError(f"operand {given}: variable length needs both cu_seqlens_q and cu_seqlens_k")
        self.varlen = varlen = cu_seqlens_q is not None
        self.rank = rank = 3 if varlen else 4
        self.q = _operand(q, "q", rank)
        self.k = _operand(k, "k", rank)
        self.v = _operand(v, "v", rank)
        for name, t in (("k", k), ("v", v)):
            _like(t, name, q, "q")
        if k.shape[-1] != q.shape[-1]:
            raise ValueError(f"operand k: head_dim {k.shape[-1]} must equal q's {q.shape[-1]}")
        if v.shape != k.shape:
            raise ValueError(f"operand v: shape {tuple(v.shape)} must equal k's {tuple(k.shape)}")
        self.heads_q, self.heads_kv, self.head_dim = q.shape[-2], k.shape[-2], q.shape[-1]
        if self.heads_kv == 0 or self.heads_q % self.heads_kv:
            raise ValueError(f"operand k: {self.heads_kv} heads, but q's {self.heads_q} heads must be a multiple "
                             f"of them (GQA/MQA)")
        if not isinstance(causal, bool):
            raise TypeError(f"causal: expected a bool, got {type(causal).__name__}")
        if scale is None:
            scale = 1.0 / math.sqrt(self.head_dim) if self.head_dim else 1.0
        elif not is_finite_number(scale):
            raise ValueError(f"scale: expected a finite float, got {scale!r}")
        self.causal, self.scale = causal, float(scale)
        self.cu_seqlens_q, self.cu_seqlens_k = cu_seqlens_q, cu_seqlens_k
        if varlen:
            self.batch = _offsets(cu_seqlens_q, "cu_seqlens_q", None, q.device)
            _offsets(cu_seqlens_k, "cu_seqlens_k", self.batch, q.device)
            neither = max_seqlen_q is None and max_seqlen_k is None
            if neither and cu_seqlens_q.device.type != "cpu" and _readable(cu_seqlens_q) and _readable(cu_seqlens_k):
                self._read_offsets(q.shape[0], k.shape[0])
            else:
                lq = _host_lengths(cu_seqlens_q, "cu_seqlens_q", q.shape[0], "q")
                lk = _host_lengths(cu_seqlens_k, "cu_seqlens_k", k.shape[0], "k")
                self.seqlen_q = _max_seqlen(max_seqlen_q, "max_seqlen_q", lq, "cu_seqlens_q", q.shape[0],
                                            max_seqlen_k is not None)
                self.seqlen_k = _max_seqlen(max_seqlen_k, "max_seqlen_k", lk, "cu_seqlens_k", k.shape[0],
                                            max_seqlen_q is not None)
                if neither and lq is not None and lk is not None:
                    self._drop_trailing_empty(max(_used(lq), _used(lk)))
        else:
            for name, value in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
                if value is not None:
                    raise ValueError(f"{name}: only for variable length (with cu_seqlens_q and cu_seqlens_k)")
            if k.shape[0] != q.shape[0]:
                raise ValueError(f"operand k: batch {k.shape[0]} must equal q's {q.shape[0]}")
            self.batch, self.seqlen_q, self.seqlen_k = q.shape[0], q.shape[1], k.shape[1]

    def _read_offsets(self, tokens_q: int, tokens_k: int) -> None:
        """The offsets on the device, read once (their check and longest sequences)."""
        of_q, of_k = _device_summary(self.cu_seqlens_q, self.cu_seqlens_k)
        for (first, shortest, _, last, _), name, tokens, operand in ((of_q, "cu_seqlens_q", tokens_q, "q"),
                                                                     (of_k, "cu_seqlens_k", tokens_k, "k")):
            _check_offsets(name, first, shortest, last, tokens, operand)
        self.seqlen_q, self.seqlen_k = of_q[2], of_k[2]
        self._drop_trailing_empty(max(of_q[4], of_k[4]))

    def _drop_trailing_empty(self, used: int) -> None:
        """Keep the first ``used`` sequences (those after are empty in both offsets)."""
        if used < self.batch:
            self.batch = used
            self.cu_seqlens_q, self.cu_seqlens_k = self.cu_seqlens_q[:used + 1], self.cu_seqlens_k[:used + 1]

    def like(self, t: Any, name: str, model: torch.Tensor, model_name: str) -> TensorAttributes:
        """Attributes of an operand that must have ``model``'s shape, dtype and device."""
        _require_tensor(t, name)
        attrs = _operand(t, name, self.rank)
        _like(t, name, model, model_name)
        if t.shape != model.shape:
            raise ValueError(f"operand {name}: shape {tuple(t.shape)} must equal {model_name}'s {tuple(model.shape)}")
        return attrs


def _like(t: torch.Tensor, name: str, model: torch.Tensor, model_name: str) -> None:
    if t.dtype != model.dtype:
        raise TypeError(f"operand {name}: dtype {t.dtype} must equal {model_name}'s {model.dtype}")
    if t.device != model.device:
        raise ValueError(f"operand {name}: on {t.device} but {model_name} is on {model.device}")


def check_distinct(t: torch.Tensor, name: str, model_name: str) -> None:
    """Refuse an output ``name`` whose elements may repeat (a stride 0, as from ``expand``, or
    strides that interleave): kernels would race writing them.

    Raises:
        ValueError: naming the operand (and ``model_name``, the input whose layout to copy).
    """
    if not elements_distinct(t):
        repeat = "a zero stride, as from expand" if expanded(t=t) else "strides that interleave"
        raise ValueError(f"operand {name}: elements overlap (shape {tuple(t.shape)}, strides {tuple(t.stride())}: "
                         f"{repeat}); pass an output whose elements are distinct (e.g. torch.empty_like({model_name}))")


def describe(args: Any, name: str) -> str:
    """The repr of an attention arguments object (forward or backward): sizes and flags."""
    lengths = f"max_seqlen_q={args.seqlen_q}, max_seqlen_k={args.seqlen_k}" if args.varlen else \
        f"seqlen_q={args.seqlen_q}, seqlen_k={args.seqlen_k}"
    cache = ", cache_seqlens=given" if args.cache_seqlens is not None else ""
    return (f"{name}(batch={args.batch}, {lengths}{cache}, heads_q={args.heads_q}, heads_kv={args.heads_kv}, "
            f"head_dim={args.head_dim}, causal={args.causal}, varlen={args.varlen}, "
            f"dtype={args.tensor_attributes['q'].dtype}, device={args.device})")


class AttentionArguments(Arguments):
    """``out = softmax(q k^T * scale + causal mask) v`` per head, FlashAttention's layouts.

    Args:
        q: (batch, seqlen_q, heads_q, head_dim), or (total_q, heads_q, head_dim) with
            ``cu_seqlens_q``.
        k: (batch, seqlen_k, heads_kv, head_dim), or (total_k, heads_kv, head_dim); heads_q
            must be a multiple of heads_kv (GQA; MQA when heads_kv is 1).
        v: k's shape, dtype and device.
        out: q's shape, dtype and device (written).
        lse: optional, the row log-sum-exp to write (float32, `lse_shape`, contiguous; see the
            module docstring): given when a backward will follow. Construction then makes an
            `AttentionWithLseArguments`, whose outputs (what ``ops.call`` returns) are
            ``(out, lse)``.
        causal: a bottom-right aligned causal mask (see the module docstring).
        scale: the factor on q k^T; default ``1 / sqrt(head_dim)``.
        cu_seqlens_q, cu_seqlens_k: int32 offsets of length batch + 1, both or neither.
        max_seqlen_q, max_seqlen_k: the longest sequence of each, both or neither; left out,
            they are read from the offsets (on a GPU, one synchronisation; see the module
            docstring). A value past the packed tokens is held at their count (kernels size their
            grids by it).
        cache_seqlens: optional, for a dense k and v that are a KV cache: int32 ``(batch,)`` on
            q's device, the keys each row holds (see the module docstring; values not read here).

    Raises:
        TypeError, ValueError: a one-line message naming the operand.
    """

    __slots__ = ("q", "k", "v", "out", "lse", "cu_seqlens_q", "cu_seqlens_k", "cache_seqlens", "causal", "scale",
                 "varlen", "batch", "seqlen_q", "seqlen_k", "heads_q", "heads_kv", "head_dim", "outputs_made")
    output_names = ("out",)

    def __new__(cls, *args: Any, **kwargs: Any) -> "AttentionArguments":
        lse = args[4] if len(args) > 4 else kwargs.get("lse")
        if lse is not None and cls is AttentionArguments:
            cls = AttentionWithLseArguments
        return object.__new__(cls)

    def __init__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                 lse: torch.Tensor | None = None, *, causal: bool = False, scale: float | None = None,
                 cu_seqlens_q: torch.Tensor | None = None, cu_seqlens_k: torch.Tensor | None = None,
                 max_seqlen_q: int | None = None, max_seqlen_k: int | None = None,
                 cache_seqlens: torch.Tensor | None = None) -> None:
        p = AttentionProblem(q, k, v, causal, scale, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
        oa = p.like(out, "out", q, "q")
        ca = None if cache_seqlens is None else _cache_lengths(cache_seqlens, p.batch, p.varlen, q.device)
        self.varlen, self.causal, self.scale = p.varlen, p.causal, p.scale
        self.batch, self.seqlen_q, self.seqlen_k = p.batch, p.seqlen_q, p.seqlen_k
        self.heads_q, self.heads_kv, self.head_dim = p.heads_q, p.heads_kv, p.head_dim
        self.q, self.k, self.v, self.out, self.lse = q, k, v, out, lse
        self.cu_seqlens_q, self.cu_seqlens_k = p.cu_seqlens_q, p.cu_seqlens_k
        self.cache_seqlens = cache_seqlens
        self.outputs_made = False
        self.device = q.device
        self.device_index = q.get_device()
        self._verdicts = self._binding = None
        self.tensor_attributes = {"q": p.q, "k": p.k, "v": p.v, "out": oa}
        if lse is not None:
            self.tensor_attributes["lse"] = lse_attributes(lse, q, p.varlen)
        if ca is not None:
            self.tensor_attributes["cache_seqlens"] = ca
        self.signature = ("attention", p.q._key, p.k._key, p.v._key, oa._key, lse is not None, self.head_dim,
                          self.heads_q // self.heads_kv, self.causal, self.varlen, None if ca is None else ca._key,
                          expanded(q=q, k=k, v=v), self.device_index)  # (the device last, as every signature)

    def check_memory(self) -> None:
        """Refuse an output whose elements may repeat (a stride 0, as from ``expand``, or strides
        that interleave), and an output or lse that meets another operand's memory: kernels would
        race writing them, or overwrite keys and values other query tiles still read. ``out`` may
        be q itself (the same view): every kernel reads a query row before it writes that row's
        output.

        Raises:
            ValueError: naming the operand.
        """
        out = self.out
        check_distinct(out, "out", "q")
        check_outputs_disjoint(self.tensors(), ("out", "lse") if self.lse is not None else ("out",),
                               in_place=(("out", "q"),))

    def problem_key(self) -> tuple:
        """The signature with the sizes a choice depends on: batch, sequence lengths (the
        longest, for variable length; the cache's size with ``cache_seqlens``; the key length as
        `key_length` buckets it), heads and the scale. Never a tensor's values.

        Returns:
            A hashable tuple.
        """
        return (self.signature, self.batch, self.seqlen_q, key_length(self.seqlen_q, self.seqlen_k), self.heads_q,
                self.heads_kv, self.scale)

    def reference_outputs(self) -> dict[str, torch.Tensor] | None:
        """``out`` (and ``lse`` when asked) in float64 from the operands' current values: the
        definition (`attention_math`), sequence offsets and cache lengths included; None when the
        scores would pass `REFERENCE_MAX_SCORES` elements."""
        if self.batch * self.heads_q * self.seqlen_q * self.seqlen_k > REFERENCE_MAX_SCORES:
            return None
        q, k, v = (t.double() for t in (self.q, self.k, self.v))
        lengths = (self.cu_seqlens_q, self.cu_seqlens_k, self.cache_seqlens)
        if self.lse is None:
            return {"out": torch_attention(q, k, v, self.causal, self.scale, *lengths)}
        out, lse = attention_with_lse(q, k, v, self.causal, self.scale, *lengths)
        return {"out": out, "lse": lse}

    def __repr__(self) -> str:
        return describe(self, type(self).__name__)


class AttentionWithLseArguments(AttentionArguments):
    """`AttentionArguments` given ``lse``: its outputs are ``out`` and ``lse`` (what
    ``kernel_api.ops.call`` returns). `AttentionArguments` makes it when ``lse`` is given; users
    name only that class."""

    __slots__ = ()
    output_names = ("out", "lse")
