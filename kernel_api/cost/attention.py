"""A first attention cost model (`attention_cost`): the matmul work at a tensor-core rate or
the bytes of q, k, v and out at a streaming rate, whichever is longer, in `gemm_cost` units.

Not fitted to measurements yet: the rates are nominal H100/H200-class figures, and PickAny
has one attention family (the torch provider's) to rank so far.
"""

from __future__ import annotations

from typing import Any

from .units import GEMM_COST_UNITS_PER_SECOND

#: Dense 16-bit tensor-core rate assumed for the two matmuls (FLOP/s; nominal, not measured).
ATTENTION_FLOPS_PER_SECOND = 4.0e14
#: Streaming rate for q, k, v and out (bytes/s; nominal).
ATTENTION_BYTES_PER_SECOND = 3.0e12
#: A launch's fixed time (seconds; nominal).
ATTENTION_FIXED_SECONDS = 5e-6


def attention_cost(args: Any) -> float:
    """The estimated run time of attention on ``args`` (an `AttentionArguments`).

    Args:
        args: the arguments; for variable length the longest sequences stand for all.

    Returns:
        The time in `gemm_cost` units (`GEMM_COST_UNITS_PER_SECOND` per second).
    """
    pairs = args.seqlen_q * args.seqlen_k
    if args.causal:
        pairs = pairs / 2 if args.seqlen_q == args.seqlen_k else pairs
    flops = 4.0 * args.batch * args.heads_q * pairs * args.head_dim
    element = args.tensor_attributes["q"].dtype.bytes
    tokens_q = args.batch * args.seqlen_q
    tokens_k = args.batch * args.seqlen_k
    moved = element * args.head_dim * (2 * tokens_q * args.heads_q + 2 * tokens_k * args.heads_kv)
    seconds = ATTENTION_FIXED_SECONDS + max(flops / ATTENTION_FLOPS_PER_SECOND, moved / ATTENTION_BYTES_PER_SECOND)
    return seconds * GEMM_COST_UNITS_PER_SECOND


#: A backward's matmul work against its forward's: five matmuls against two.
ATTENTION_BACKWARD_WORK = 2.5


def attention_backward_cost(args: Any) -> float:
    """The estimated run time of attention's backward on ``args`` (an
    `AttentionBackwardArguments`, or the forward's arguments): `attention_cost` times
    `ATTENTION_BACKWARD_WORK`, in `gemm_cost` units."""
    return attention_cost(args) * ATTENTION_BACKWARD_WORK
