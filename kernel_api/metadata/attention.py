"""Operand description of attention kernels (`AttentionOperandsMetadata`): the attributes of
q, k, v and out, plus the head dims, masks and layouts a kernel supports, whether it writes
the row log-sum-exp and whether it reads a KV cache's per-row lengths;
`AttentionBackwardOperandsMetadata` the same for the backward."""

from __future__ import annotations

from typing import Any

from ..arguments.attention import AttentionArguments
from ..arguments.attention_backward import AttentionBackwardArguments
from ..core.status import Reason, Status
from ..core.tensor_attributes import TensorAttributes
from .operands import OperandsMetadata


class AttentionOperandsMetadata(OperandsMetadata):
    """Operands of ``out = softmax(q k^T * scale + mask) v`` and what a kernel supports beyond them.

    Args:
        q, k, v, out: the `TensorAttributes` each operand must have (rank 4 patterns take the
            dense layout, rank 3 the variable-length one, `varlen`; a kernel taking both lists
            two instances).
        head_dims: the head dims the kernel takes, or None for any up to ``max_head_dim``.
        max_head_dim: the largest head dim (256: FlashAttention's limit).
        causal: whether the kernel applies the causal mask.
        full: whether it runs without a mask.
        gqa: whether q may have more heads than k and v.
        lse: whether the kernel writes the row log-sum-exp (``args.lse``); a kernel that does
            not declines arguments that ask for it (a forward before a backward).
        cache_seqlens: whether the kernel reads ``args.cache_seqlens`` (each row's length in a
            KV cache); a kernel that does not declines arguments that give them (it would attend
            to the whole cache).
    """

    operand_names = ("q", "k", "v", "out")
    arguments_type = AttentionArguments

    def __init__(self, q: TensorAttributes, k: TensorAttributes, v: TensorAttributes, out: TensorAttributes, *,
                 head_dims: tuple[int, ...] | None = None, max_head_dim: int = 256, causal: bool = True,
                 full: bool = True, gqa: bool = True, lse: bool = False, cache_seqlens: bool = False) -> None:
        for name, value in (("q", q), ("k", k), ("v", v), ("out", out)):
            if not isinstance(value, TensorAttributes):
                raise TypeError(f"AttentionOperandsMetadata.{name} must be TensorAttributes, got {type(value).__name__}")
        self.q, self.k, self.v, self.out = q, k, v, out
        self.head_dims = None if head_dims is None else tuple(head_dims)
        self.max_head_dim, self.causal, self.full, self.gqa = max_head_dim, causal, full, gqa
        self.lse, self.cache_seqlens = lse, cache_seqlens

    @property
    def varlen(self) -> bool:
        """Whether the kernel takes the variable-length layout (rank-3 operand patterns)."""
        return len(self.q.stride) == 3

    def _supports_scalars(self, args: Any) -> Status:
        if args.varlen != self.varlen:
            words = {True: "variable-length", False: "dense"}
            return Status.fail(f"operand q: {words[args.varlen]} layout but the kernel takes {words[self.varlen]}",
                               kind=Reason.OTHER, operand="q", actual=args.varlen, required=self.varlen)
        d = args.head_dim
        if self.head_dims is not None and d not in self.head_dims:
            return Status.fail(f"head_dim {d} not in {self.head_dims}", kind=Reason.SHAPE, operand="q",
                               actual=d, required=self.head_dims)
        if d > self.max_head_dim:
            return Status.fail(f"head_dim {d} above the kernel's {self.max_head_dim}", kind=Reason.SHAPE,
                               operand="q", actual=d, required=self.max_head_dim)
        if args.causal and not self.causal:
            return Status.fail("causal: the kernel has no causal mask", kind=Reason.OTHER, operand="causal",
                               actual=True, required=False)
        if not args.causal and not self.full:
            return Status.fail("causal=False: the kernel runs causal attention only", kind=Reason.OTHER,
                               operand="causal", actual=False, required=True)
        if args.heads_q != args.heads_kv and not self.gqa:
            return Status.fail(f"operand k: {args.heads_kv} heads for q's {args.heads_q}, but the kernel takes "
                               f"equal heads only (no GQA)", kind=Reason.SHAPE, operand="k",
                               actual=args.heads_kv, required=args.heads_q)
        if args.lse is not None and not self.lse:
            return Status.fail("operand lse: the kernel does not write the row log-sum-exp a backward needs",
                               kind=Reason.OTHER, operand="lse", actual=True, required=False)
        if args.cache_seqlens is not None and not self.cache_seqlens:
            return Status.fail("operand cache_seqlens: the kernel reads no per-row KV cache lengths (it would attend "
                               "to the whole cache)", kind=Reason.OTHER, operand="cache_seqlens", actual=True,
                               required=False)
        return Status.success()

    def __repr__(self) -> str:
        return (f"AttentionOperandsMetadata(q={self.q}, k={self.k}, v={self.v}, out={self.out}, "
                f"head_dims={self.head_dims}, max_head_dim={self.max_head_dim}, causal={self.causal}, "
                f"full={self.full}, gqa={self.gqa}, lse={self.lse}, cache_seqlens={self.cache_seqlens})")


class AttentionBackwardOperandsMetadata(AttentionOperandsMetadata):
    """Operands of attention's backward: the attributes of grad_out, q, k, v, out and the
    gradients (``lse`` is float32 and contiguous by construction), and the head dims, masks,
    layouts and GQA the kernel supports (as `AttentionOperandsMetadata`'s).

    Args:
        q: the attributes of q, out, grad_out and grad_q.
        k: the attributes of k, v, grad_k and grad_v.
        head_dims, max_head_dim, causal, full, gqa: as for `AttentionOperandsMetadata`.
    """

    operand_names = ("grad_out", "q", "k", "v", "out", "grad_q", "grad_k", "grad_v")
    arguments_type = AttentionBackwardArguments

    def __init__(self, q: TensorAttributes, k: TensorAttributes, *, head_dims: tuple[int, ...] | None = None,
                 max_head_dim: int = 256, causal: bool = True, full: bool = True, gqa: bool = True) -> None:
        super().__init__(q, k, k, q, head_dims=head_dims, max_head_dim=max_head_dim, causal=causal, full=full,
                         gqa=gqa, lse=True)
        self.grad_out = self.grad_q = q
        self.grad_k = self.grad_v = k

    def __repr__(self) -> str:
        return (f"AttentionBackwardOperandsMetadata(q={self.q}, k={self.k}, head_dims={self.head_dims}, "
                f"max_head_dim={self.max_head_dim}, causal={self.causal}, full={self.full}, gqa={self.gqa})")
