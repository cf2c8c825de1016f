"""``ops.attention``: attention forward and backward through kernel_api.

Three torch ops, each generated from one `Operation`:

- ``kernel_api::attention`` (`ATTENTION`): the forward for inference; it asks for no row
  log-sum-exp, so nothing is allocated for a backward and every forward kernel may serve.
- ``kernel_api::attention_forward`` (`ATTENTION_FORWARD`): the forward when a gradient is
  wanted, returning ``(out, lse)``; the kernels that serve it write the log-sum-exp
  (`AttentionArguments`' ``lse``; the others decline). Its backward runs the next op on the
  saved q, k, v, out and lse: no second forward.
- ``kernel_api::attention_backward`` (`ATTENTION_BACKWARD`): the gradients of q, k and v
  (`AttentionBackwardArguments`), whichever backward kernel the policy picks, independently of
  the forward's (the log-sum-exp has one form for all).

`attention` goes to the first when no input needs a gradient and to the second otherwise
(under ``torch.compile`` too: the branch is decided while tracing). The log-sum-exp is not
differentiated (``attention`` never returns it). Calling ``torch.ops.kernel_api.attention``
itself with inputs that need gradients works too: its backward runs the training forward once
more for the log-sum-exp, then the backward op.

The arguments these ops build say ``outputs_made`` (a kernel may hand the outputs memory of
its own instead of copying into them: `AttentionArguments`) unless the caller gave outputs
(``out=``, ``grad_q=``...): the torch ops make theirs, and the functions here say when they
were given some, for the call's duration on the calling thread.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from ..arguments.attention import AttentionArguments, lse_shape
from ..arguments.attention_backward import AttentionBackwardArguments
from ..core import tracing
from . import dispatch as _dispatch, front_doors
from .operation import Operation, define_operation
from .replay import replay_from_c

_SCHEMA_INPUTS = ("(Tensor q, Tensor k, Tensor v, bool causal=False, float? scale=None, Tensor? cu_seqlens_q=None, "
                  "Tensor? cu_seqlens_k=None, SymInt? max_seqlen_q=None, SymInt? max_seqlen_k=None, "
                  "Tensor? cache_seqlens=None)")
_SCALARS = ("causal", "scale", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k")
_empty_like = torch.empty_like
_dense = torch.contiguous_format
_grad_enabled = torch.is_grad_enabled


class _CallerOutputs(threading.local):
    """Whether the call in progress on this thread was given outputs by its caller."""

    given = False


_caller_outputs = _CallerOutputs()


def _with_given_outputs(function: Any, *inputs: Any, **named: Any) -> Any:
    """``function(*inputs, **named)`` with `_caller_outputs` saying its outputs were given."""
    before = _caller_outputs.given
    _caller_outputs.given = True
    try:
        return function(*inputs, **named)
    finally:
        _caller_outputs.given = before


def _arguments(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float | None,
               cu_seqlens_q: torch.Tensor | None, cu_seqlens_k: torch.Tensor | None, max_seqlen_q: int | None,
               max_seqlen_k: int | None, cache_seqlens: torch.Tensor | None, out: torch.Tensor,
               lse: torch.Tensor | None = None) -> AttentionArguments:
    if lse is not None and cache_seqlens is not None:
        raise ValueError("cache_seqlens: attention against a KV cache has no backward; call it with no input "
                         "requiring grad")
    args = AttentionArguments(q, k, v, out, lse, causal=causal, scale=scale, cu_seqlens_q=cu_seqlens_q,
                              cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                              cache_seqlens=cache_seqlens)
    args.outputs_made = not _caller_outputs.given
    return args


def _backward_arguments(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        out: torch.Tensor, lse: torch.Tensor, causal: bool, scale: float | None,
                        cu_seqlens_q: torch.Tensor | None, cu_seqlens_k: torch.Tensor | None,
                        max_seqlen_q: int | None, max_seqlen_k: int | None, *, grad_q: torch.Tensor,
                        grad_k: torch.Tensor, grad_v: torch.Tensor) -> AttentionBackwardArguments:
    args = AttentionBackwardArguments(grad_out, q, k, v, out, lse, grad_q, grad_k, grad_v, causal=causal,
                                      scale=scale, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                                      max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)
    args.outputs_made = not _caller_outputs.given
    return args


# (fakes take the scalars in *rest: torch passes them only the arguments the caller gave)
def _fake(q: torch.Tensor, *rest: Any) -> torch.Tensor:
    return _empty_like(q, memory_format=_dense)


def _forward_fake(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False, scale: Any = None,
                  cu_seqlens_q: Any = None, *rest: Any) -> tuple[torch.Tensor, torch.Tensor]:
    return _empty_like(q, memory_format=_dense), q.new_empty(lse_shape(q, cu_seqlens_q is not None),
                                                             dtype=torch.float32)


def _backward_fake(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   *rest: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return (_empty_like(q, memory_format=_dense), _empty_like(k, memory_format=_dense),
            _empty_like(v, memory_format=_dense))


def _gradients(saved: Any, out: torch.Tensor, lse: torch.Tensor, grad: torch.Tensor) -> tuple:
    """The inputs' gradients through the backward op, from the forward's out and lse."""
    needs = saved.needs_input_grad[:3]
    if not any(needs):
        return (None,) * 10
    grads = _attention_backward(grad.contiguous(), saved.q, saved.k, saved.v, out, lse,
                                *[getattr(saved, name) for name in _SCALARS])
    return (*[g if n else None for g, n in zip(grads, needs)], None, None, None, None, None, None, None)


def _forward_backward(saved: Any, grad: torch.Tensor, grad_lse: Any) -> tuple:
    """The training forward's backward: the backward op on the saved out and lse (the
    log-sum-exp's own gradient is dropped: `attention` never returns it)."""
    return _gradients(saved, saved.out, saved.lse, grad)


def _recompute_backward(saved: Any, grad: torch.Tensor) -> tuple:
    """The inference op's backward (only when its op is called directly with inputs that need
    gradients): the training forward once more for out and lse, then the backward op."""
    scalars = [getattr(saved, name) for name in _SCALARS]
    out, lse = _attention_forward.op(saved.q.detach(), saved.k.detach(), saved.v.detach(), *scalars,
                                     saved.cache_seqlens)
    return _gradients(saved, out, lse, grad)


ATTENTION = Operation(
    name="kernel_api::attention",
    schema=f"{_SCHEMA_INPUTS} -> Tensor",
    arguments=_arguments,
    outputs=("out",),
    fake=_fake,
    backward=_recompute_backward,
    saved=("q", "k", "v", *_SCALARS, "cache_seqlens"),
)

ATTENTION_FORWARD = Operation(
    name="kernel_api::attention_forward",
    schema=f"{_SCHEMA_INPUTS} -> (Tensor, Tensor)",
    arguments=_arguments,
    outputs=("out", "lse"),
    fake=_forward_fake,
    backward=_forward_backward,
    saved=("q", "k", "v", "out", "lse", *_SCALARS, "cache_seqlens"),
)

ATTENTION_BACKWARD = Operation(
    name="kernel_api::attention_backward",
    schema="(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, bool causal=False, "
           "float? scale=None, Tensor? cu_seqlens_q=None, Tensor? cu_seqlens_k=None, SymInt? max_seqlen_q=None, "
           "SymInt? max_seqlen_k=None) -> (Tensor, Tensor, Tensor)",
    arguments=_backward_arguments,
    outputs=("grad_q", "grad_k", "grad_v"),
    fake=_backward_fake,
)

_attention = define_operation(ATTENTION)
#: ``kernel_api::attention``'s number in the native call key: `attention`'s repeated calls are
#: replayed from C, keyed by its arguments in schema order, then ``out`` and ``stream``.
_ATTENTION_NUMBER = replay_from_c(_attention)
_is_dynamo_compiling = tracing.is_dynamo_compiling
_attention_forward = define_operation(ATTENTION_FORWARD)
_attention_backward = define_operation(ATTENTION_BACKWARD)


def attention_backward(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                       lse: torch.Tensor, causal: bool = False, scale: float | None = None,
                       cu_seqlens_q: torch.Tensor | None = None, cu_seqlens_k: torch.Tensor | None = None,
                       max_seqlen_q: int | None = None, max_seqlen_k: int | None = None, *,
                       grad_q: torch.Tensor | None = None, grad_k: torch.Tensor | None = None,
                       grad_v: torch.Tensor | None = None, stream: Any = None) -> tuple:
    """The gradients of q, k and v of attention, from the forward's out and row log-sum-exp
    (`AttentionBackwardArguments`), through kernel_api.

    Args:
        grad_out, q, k, v, out, lse: as for `AttentionBackwardArguments`.
        causal, scale, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k: the forward's.
        grad_q, grad_k, grad_v: tensors to write, or None to allocate them.
        stream: the stream to launch on (None: the current one).

    Returns:
        ``(grad_q, grad_k, grad_v)``.
    """
    inputs = (grad_out, q, k, v, out, lse, causal, scale, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    if grad_q is None and grad_k is None and grad_v is None:
        return _attention_backward(*inputs, stream=stream)
    return _with_given_outputs(_attention_backward, *inputs, grad_q=grad_q, grad_k=grad_k, grad_v=grad_v,
                               stream=stream)


attention_backward.operation = ATTENTION_BACKWARD
attention_backward.op = _attention_backward.op


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False, scale: float | None = None,
              cu_seqlens_q: torch.Tensor | None = None, cu_seqlens_k: torch.Tensor | None = None,
              max_seqlen_q: int | None = None, max_seqlen_k: int | None = None,
              cache_seqlens: torch.Tensor | None = None, out: torch.Tensor | None = None,
              stream: Any = None) -> torch.Tensor:
    """``softmax(q k^T * scale + mask) v`` per head, through kernel_api.

    Args:
        q, k, v: FlashAttention's layouts, (batch, seqlen, heads, head_dim), or
            (total_tokens, heads, head_dim) with ``cu_seqlens_q`` and ``cu_seqlens_k``; q's heads
            a multiple of k's and v's (GQA / MQA). See `AttentionArguments`.
        causal: a causal mask aligned to the bottom right (decoding: the queries are the last
            ``seqlen_q`` positions of the ``seqlen_k`` keys).
        scale: the factor on q k^T; default ``1 / sqrt(head_dim)``.
        cu_seqlens_q, cu_seqlens_k: int32 cumulative sequence offsets, length batch + 1.
        max_seqlen_q, max_seqlen_k: the longest sequences, both or neither: given, the offsets
            are trusted; left out, they are read (on a GPU, one synchronisation), checked, and
            the empty sequences after the last non-empty one dropped.
        cache_seqlens: for dense k and v that are a preallocated KV cache (batch, max_seqlen_k,
            heads_kv, head_dim): int32 (batch,) on q's device, the keys each row holds (its
            queries are the last ones of them); no gradient with it.
        out: a tensor of q's shape to write, or None to allocate one (None when a gradient is
            wanted).
        stream: the stream to launch on (None: the current one).

    Returns:
        ``out``: q's shape and dtype. Differentiable in q, k and v: when one of them requires
        grad (grad mode on) the forward keeps the row log-sum-exp and the backward runs
        ``kernel_api::attention_backward`` on it.

    Raises:
        TypeError, ValueError: invalid operands (the message names the operand).
        NoKernelFoundError: no kernel takes these arguments.
    """
    # (_is_dynamo_compiling first: Dynamo folds it to True and traces nothing of the replay)
    if not _is_dynamo_compiling():
        replay_call = _dispatch.replay_call
        if replay_call is not None:
            # what the Python path recorded for a call keyed as this one, run in C; None when
            # nothing is (docs/architecture.md, "The replay contract")
            done = replay_call(_ATTENTION_NUMBER, q, k, v, causal, scale, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                               max_seqlen_k, cache_seqlens, out, stream)
            if done is not None:
                return done
    return _attention_unreplayed(q, k, v, causal=causal, scale=scale, cu_seqlens_q=cu_seqlens_q,
                                 cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                                 cache_seqlens=cache_seqlens, out=out, stream=stream)


def _attention_unreplayed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
                          scale: float | None = None, cu_seqlens_q: torch.Tensor | None = None,
                          cu_seqlens_k: torch.Tensor | None = None, max_seqlen_q: int | None = None,
                          max_seqlen_k: int | None = None, cache_seqlens: torch.Tensor | None = None,
                          out: torch.Tensor | None = None, stream: Any = None) -> torch.Tensor:
    """`attention` after its replay attempt (what the C front door runs when the replay has nothing)."""
    if _grad_enabled() and (getattr(q, "requires_grad", False) or getattr(k, "requires_grad", False)
                            or getattr(v, "requires_grad", False)):
        if out is not None:
            return _with_given_outputs(_attention_forward, q, k, v, causal, scale, cu_seqlens_q, cu_seqlens_k,
                                       max_seqlen_q, max_seqlen_k, cache_seqlens, out=out, stream=stream)[0]
        return _attention_forward(q, k, v, causal, scale, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                  cache_seqlens, stream=stream)[0]
    if out is not None:
        return _with_given_outputs(_attention, q, k, v, causal, scale, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                   max_seqlen_k, cache_seqlens, out=out, stream=stream)
    return _attention(q, k, v, causal, scale, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, cache_seqlens,
                      stream=stream)


# The front door callers see: a C function where the native front doors are built (front_doors.py)
attention = front_doors.c_front_door(
    attention, _attention_unreplayed, _ATTENTION_NUMBER,
    key=("q", "k", "v", "causal", "scale", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k",
         "cache_seqlens", "out", "stream"))
