"""Arguments of the rotary position embedding (RoPE) of queries and keys, forward and backward.

The math is transformers' ``apply_rotary_pos_emb`` (the ``rotate_half`` convention): with
``x1, x2`` the halves of a head's last dimension,

    out = x * cos + rotate_half(x) * sin,   rotate_half(x) = cat(-x2, x1),

applied to ``q`` and ``k`` with the same ``cos`` and ``sin``. ``q`` and ``k`` are
(batch, heads, seq, head_dim) with ``unsqueeze_dim=1`` (or (batch, seq, heads, head_dim) with
``unsqueeze_dim=2``); they may have different head counts (grouped-query attention) and any
strides with a unit last dimension, such as the transposed views transformers makes of its
projections. ``cos`` and ``sin`` are (batch or 1, seq, head_dim), broadcast over the heads.

The backward is the transpose of that linear map: ``grad_x = g * cos + rotate_half^T(g * sin)``
with ``rotate_half^T(y) = cat(y2, -y1)``; for transformers' tables, whose two halves are equal,
it is the forward with ``-sin``.

Kernels read every operand through its (batch, head, seq) strides (`HeadStrides`; cos and sin
have head stride 0, and batch stride 0 when broadcast over the batch).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from .base import (_ROW2, Arguments, _attributes, _element_type, _lazy_bit_error, _require_tensor,
                   data_pointer)
from .outputs import check_outputs_disjoint

_MAX_DIVISIBILITY = 128


class HeadStrides(NamedTuple):
    """An operand's strides, in elements, along batch, head and sequence (head_dim has stride 1)."""

    batch: int
    head: int
    seq: int


def _unsqueeze_dim(value: Any) -> int:
    if isinstance(value, bool) or value not in (1, 2, -3, -2):
        raise ValueError(f"unsqueeze_dim: expected 1 (q, k of (batch, heads, seq, head_dim)) or 2 "
                         f"((batch, seq, heads, head_dim)), got {value!r}")
    return 1 if value in (1, -3) else 2


def _heads(t: Any, name: str, unsqueeze_dim: int) -> tuple[int, int, int, int, HeadStrides]:
    """(batch, heads, seq, head_dim, strides) of a 4-D q/k-like operand."""
    _require_tensor(t, name)
    _element_type(t, name)
    if t.is_neg():
        raise _lazy_bit_error(t, name)
    if t.dim() != 4:
        layout = "(batch, heads, seq, head_dim)" if unsqueeze_dim == 1 else "(batch, seq, heads, head_dim)"
        raise ValueError(f"operand {name}: expected 4 dimensions {layout}, got shape {tuple(t.shape)}")
    b, d1, d2, d = t.shape
    st = t.stride()
    if d > 1 and st[3] != 1:
        raise ValueError(f"operand {name}: head_dim must have stride 1, got strides {tuple(st)}")
    if unsqueeze_dim == 1:
        return b, d1, d2, d, HeadStrides(st[0], st[1], st[2])
    return b, d2, d1, d, HeadStrides(st[0], st[2], st[1])


def _no_overlap(t: torch.Tensor, name: str) -> None:
    """Refuse an output two of whose indices share an address (a sufficient test: each stride,
    smallest first, reaches past the extent of the dimensions below it)."""
    extent = 1
    for stride, size in sorted((st, n) for n, st in zip(t.shape, t.stride()) if n > 1):
        if stride < extent:
            raise ValueError(f"operand {name}: elements overlap (shape {tuple(t.shape)}, strides {tuple(t.stride())}); "
                             f"thread blocks would race writing them, so pass an output of distinct elements")
        extent = stride * size if stride * size > extent else extent


def _alignment(t: torch.Tensor, strides: HeadStrides, sizes: tuple[int, int, int], half: int) -> int:
    """The largest power of two (at most 128) dividing the pointer (in elements), the strides of
    the dimensions longer than 1 and half the head dimension (the extent a vector access covers)."""
    ptr, size = data_pointer(t), t.element_size()
    bits = (ptr // size if ptr % size == 0 else 1) | half
    for stride, n in zip(strides, sizes):
        if n > 1:
            bits |= stride
    g = bits & -bits if bits else _MAX_DIVISIBILITY
    return min(g, _MAX_DIVISIBILITY)


class _RopeBase(Arguments):
    """Common to the forward and the backward: the two inputs (q-like, k-like), cos and sin, the
    two outputs, and the sizes. Kernels take the operands in ``tensor_attributes`` order: q-like,
    k-like, cos, sin, q-like output, k-like output; ``strides`` maps each name to `HeadStrides`."""

    __slots__ = ("cos", "sin", "unsqueeze_dim", "batch", "heads_q", "heads_k", "seq", "head_dim", "strides")
    kind = ""

    def _build(self, names: tuple[str, ...], q: Any, k: Any, cos: Any, sin: Any, q_out: Any, k_out: Any,
               unsqueeze_dim: Any) -> None:
        nq, nk, _, _, nqo, nko = names
        u = _unsqueeze_dim(unsqueeze_dim)
        b, hq, s, d, sq = _heads(q, nq, u)
        if d % 2:
            raise ValueError(f"operand {nq}: head_dim {d} must be even (rotate_half splits it in halves)")
        kb, hk, ks, kd, sk = _heads(k, nk, u)
        if (kb, ks, kd) != (b, s, d):
            raise ValueError(f"operand {nk}: shape {tuple(k.shape)} must match {nq}'s {tuple(q.shape)} in batch, seq "
                             f"and head_dim")
        if k.dtype != q.dtype:
            raise TypeError(f"operand {nk}: dtype {k.dtype} must equal {nq}'s {q.dtype}")
        if k.device != q.device:
            raise ValueError(f"operand {nk}: on {k.device} but {nq} is on {q.device}")
        strides = {nq: sq, nk: sk}
        for name, t in (("cos", cos), ("sin", sin)):
            _require_tensor(t, name)
            _element_type(t, name)
            if t.is_neg():
                raise _lazy_bit_error(t, name)
            if t.dim() != 3 or t.shape[0] not in (1, b) or t.shape[1] != s or t.shape[2] != d:
                raise ValueError(f"operand {name}: shape {tuple(t.shape)} must be (1 or {b}, {s}, {d}): "
                                 f"(batch, seq, head_dim) of {nq}")
            if d > 1 and t.stride(2) != 1:
                raise ValueError(f"operand {name}: head_dim must have stride 1, got strides {tuple(t.stride())}")
            if t.device != q.device:
                raise ValueError(f"operand {name}: on {t.device} but {nq} is on {q.device}")
            strides[name] = HeadStrides(t.stride(0) if t.shape[0] > 1 else 0, 0, t.stride(1))
        if sin.dtype != cos.dtype:
            raise TypeError(f"operand sin: dtype {sin.dtype} must equal cos's {cos.dtype}")
        if sin.shape != cos.shape:
            raise ValueError(f"operand sin: shape {tuple(sin.shape)} must equal cos's {tuple(cos.shape)}")
        for name, t, ref, ref_name in ((nqo, q_out, q, nq), (nko, k_out, k, nk)):
            _require_tensor(t, name)
            if t.shape != ref.shape:
                raise ValueError(f"operand {name}: shape {tuple(t.shape)} must equal {ref_name}'s {tuple(ref.shape)}")
            if t.dtype != ref.dtype:
                raise TypeError(f"operand {name}: dtype {t.dtype} must equal {ref_name}'s {ref.dtype}")
            if t.device != ref.device:
                raise ValueError(f"operand {name}: on {t.device} but {ref_name} is on {ref.device}")
            strides[name] = _heads(t, name, u)[4]
            _no_overlap(t, name)
        self.cos, self.sin = cos, sin
        self.unsqueeze_dim = u
        self.batch, self.heads_q, self.heads_k, self.seq, self.head_dim = b, hq, hk, s, d
        self.strides = strides
        self.device = q.device
        self.device_index = q.get_device()
        self._verdicts = self._binding = None
        tensors = {nq: q, nk: k, "cos": cos, "sin": sin, nqo: q_out, nko: k_out}
        half = d // 2
        attrs = {}
        for name, t in tensors.items():
            heads = hk if name in (nk, nko) else hq if name in (nq, nqo) else 1
            sizes = (cos.shape[0] if name in ("cos", "sin") else b, heads, s)
            attrs[name] = _attributes(_element_type(t, name), _ROW2, _alignment(t, strides[name], sizes, half))
        self.tensor_attributes = attrs
        self.signature = (self.kind, *[(n, a.key()) for n, a in attrs.items()], d, self.device_index)

    def problem_key(self) -> tuple:
        """The signature (which holds head_dim) with batch, head counts and sequence length."""
        return (self.signature, self.batch, self.heads_q, self.heads_k, self.seq)

    def check_memory(self) -> None:
        """Raise ValueError when an output overlaps an input or the other output."""
        check_outputs_disjoint(self.tensors(), type(self).output_names)

    def element_count(self) -> int:
        """The elements of the q-like and k-like inputs together."""
        return self.batch * self.seq * self.head_dim * (self.heads_q + self.heads_k)

    def __repr__(self) -> str:
        dtype = next(iter(self.tensor_attributes.values())).dtype
        return (f"{type(self).__name__}(batch={self.batch}, heads_q={self.heads_q}, heads_k={self.heads_k}, "
                f"seq={self.seq}, head_dim={self.head_dim}, dtype={dtype}, cos={self.tensor_attributes['cos'].dtype}, "
                f"unsqueeze_dim={self.unsqueeze_dim}, device={self.device})")


class RopeArguments(_RopeBase):
    """``q_out = q * cos + rotate_half(q) * sin`` and the same for ``k`` (transformers'
    ``apply_rotary_pos_emb``).

    Args:
        q: (batch, heads_q, seq, head_dim) with ``unsqueeze_dim=1``, (batch, seq, heads_q,
            head_dim) with 2; head_dim even and of stride 1, other strides free.
        k: as q, with its own head count.
        cos, sin: (1 or batch, seq, head_dim), head_dim of stride 1; one dtype.
        q_out, k_out: q's and k's shapes and dtypes, elements distinct (any strides).
        unsqueeze_dim: where cos and sin are broadcast over the heads, as in transformers.
    """

    __slots__ = ("q", "k", "q_out", "k_out")
    kind = "rope"
    output_names = ("q_out", "k_out")

    def __init__(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_out: torch.Tensor,
                 k_out: torch.Tensor, *, unsqueeze_dim: int = 1) -> None:
        self.q, self.k, self.q_out, self.k_out = q, k, q_out, k_out
        self._build(("q", "k", "cos", "sin", "q_out", "k_out"), q, k, cos, sin, q_out, k_out, unsqueeze_dim)


class RopeBackwardArguments(_RopeBase):
    """The gradients of `RopeArguments`' outputs with respect to q and k:
    ``grad_q = grad_q_out * cos + rotate_half^T(grad_q_out * sin)`` (and k's alike).

    Args:
        grad_q_out, grad_k_out: the gradients of q_out and k_out (their shapes, any strides).
        cos, sin: the forward's.
        grad_q, grad_k: receive the gradients of q and k.
        unsqueeze_dim: the forward's.
    """

    __slots__ = ("grad_q_out", "grad_k_out", "grad_q", "grad_k")
    kind = "rope_bwd"
    output_names = ("grad_q", "grad_k")

    def __init__(self, grad_q_out: torch.Tensor, grad_k_out: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 grad_q: torch.Tensor, grad_k: torch.Tensor, *, unsqueeze_dim: int = 1) -> None:
        self.grad_q_out, self.grad_k_out, self.grad_q, self.grad_k = grad_q_out, grad_k_out, grad_q, grad_k
        self._build(("grad_q_out", "grad_k_out", "cos", "sin", "grad_q", "grad_k"), grad_q_out, grad_k_out, cos, sin,
                    grad_q, grad_k, unsqueeze_dim)


__all__ = ["HeadStrides", "RopeArguments", "RopeBackwardArguments"]
