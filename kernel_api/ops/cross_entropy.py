"""``ops.cross_entropy`` and ``ops.linear_cross_entropy``: the loss over class indices, from the
logits or fused with the linear layer that makes them, as torch ops generated from `Operation`
descriptions.

Seven ops:

- ``kernel_api::cross_entropy(logits, target, ...) -> (loss, lse)``: per-row loss and
  log-sum-exp; its backward is ``kernel_api::cross_entropy_backward``, which reads the saved
  lse instead of recomputing it (one read and one write of the logits);
- ``kernel_api::cross_entropy_with_grad(logits, target, grad_loss, ...) -> (loss, lse,
  grad_logits)``: the loss and the gradient of ``sum(grad_loss * loss)`` in one kernel (the
  logits read once from DRAM and once from L2);
- ``kernel_api::cross_entropy_reduced(logits, target, ..., reduction) -> buffer``: the mean or
  the sum in ``buffer[0]``, reduced by the kernel itself (the rest of the buffer is its
  workspace: `reduced_size`), so a repeated `cross_entropy` with a mean or a sum is one launch,
  which the native entry points replay from C (the front door's `replay_call`) with no Python
  frame beyond `cross_entropy` itself;
- ``kernel_api::cross_entropy_reduced_with_grad(logits, target, grad_loss, ..., reduction) ->
  (buffer, grad_logits)``: both at once. `cross_entropy` with a mean or a sum takes it when the
  logits require grad: the rows' weights (``1 / count`` or 1) are known in the forward, and the
  backward only scales the saved gradient;
- ``kernel_api::linear_cross_entropy(hidden, weight, target, bias, ...) -> loss``: per-token
  loss, no gradients;
- ``kernel_api::linear_cross_entropy_with_grads(hidden, weight, target, grad_loss, bias, ...,
  hidden_grad, weight_grad, bias_grad) -> (loss, grad_hidden, grad_weight, grad_bias)``: the
  loss and the gradients of ``sum(grad_loss * loss)`` in one chunked pass; a gradient not
  wanted (its flag False, or no bias) is an empty tensor and costs nothing (a frozen lm_head
  skips its weight-gradient GEMM).

``linear_cross_entropy`` computes the gradients in the forward when they are wanted (for a mean
or a sum the per-token weights are known then: ``1 / count`` or 1), keeps them, and its
backward only scales them by the incoming gradient, so no pass recomputes the logits: three
GEMMs in all. The autograd function around the op hands back only the loss (an op returning
the gradients as outputs would have autograd make zero gradients for them, a weight-sized
allocation). With ``reduction="none"`` the weights come with the backward, which runs the
fused op then (four GEMMs).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..arguments.cross_entropy import (CrossEntropyArguments, CrossEntropyBackwardArguments,
                                       CrossEntropyReducedArguments, LinearCrossEntropyArguments, loss_dtype,
                                       reduced_size)
from ..core import tracing
from ..native import recipes
from . import dispatch
from .operation import Operation, define_operation

_REDUCTIONS = ("mean", "sum", "none")
#: The reduced call's number in the native replay's call keys.
_REDUCED_OP = recipes.op_number("kernel_api.cross_entropy_reduced")
#: Devices whose reduced calls take the Python path that records a launch for the native replay
#: (where our recordable kernels run); other calls take the generated op's function.
RECORDED_DEVICE_TYPES = frozenset({"cuda"})
_is_dynamo_compiling = tracing.is_dynamo_compiling
_Tensor = torch.Tensor


# ---- fakes: output metadata (torch passes only the arguments the caller gave, so defaults in *rest) ----

def _ce_fake(logits: torch.Tensor, *rest: Any) -> tuple[torch.Tensor, torch.Tensor]:
    shape, dt = logits.shape[:-1], loss_dtype(logits)
    return logits.new_empty(shape, dtype=dt), logits.new_empty(shape, dtype=dt)


def _ce_grad_fake(logits: torch.Tensor, *rest: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return (*_ce_fake(logits), logits.new_empty(logits.shape))


def _ce_backward_fake(grad_loss: torch.Tensor, logits: torch.Tensor, *rest: Any) -> torch.Tensor:
    return logits.new_empty(logits.shape)


def _reduced_fake(logits: torch.Tensor, *rest: Any) -> torch.Tensor:
    return logits.new_empty((reduced_size(math.prod(logits.shape[:-1])),), dtype=loss_dtype(logits))


def _reduced_grad_fake(logits: torch.Tensor, *rest: Any) -> tuple[torch.Tensor, torch.Tensor]:
    return _reduced_fake(logits), logits.new_empty(logits.shape)


def _lce_fake(hidden: torch.Tensor, *rest: Any) -> torch.Tensor:
    return hidden.new_empty((hidden.shape[0],), dtype=loss_dtype(hidden))


def _wanted(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, rest: tuple) -> tuple:
    """(grad_hidden, grad_weight, grad_bias) wanted, from the trailing flags given (default all)."""
    flags = (*rest[3:6], True, True, True)[:3]  # (after ignore_index, label_smoothing, z_loss)
    return bool(flags[0]), bool(flags[1]), bool(flags[2]) and bias is not None


def _lce_grads_fake(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, grad_loss: torch.Tensor,
                    bias: torch.Tensor | None = None, *rest: Any) -> tuple:
    want_h, want_w, want_b = _wanted(hidden, weight, bias, rest)
    empty = hidden.new_empty((0,))
    return (hidden.new_empty((hidden.shape[0],), dtype=loss_dtype(hidden)),
            hidden.new_empty(hidden.shape) if want_h else empty, weight.new_empty(weight.shape) if want_w else empty,
            bias.new_empty(bias.shape) if want_b else empty)


# ---- the arguments of each op: inputs in schema order, outputs by name ----

def _ce_args(logits: torch.Tensor, target: torch.Tensor, ignore_index: int, label_smoothing: float, z_loss: float,
             *, loss: torch.Tensor, lse: torch.Tensor) -> CrossEntropyArguments:
    return CrossEntropyArguments(logits, target, loss, lse, ignore_index=ignore_index,
                                 label_smoothing=label_smoothing, z_loss=z_loss)


def _ce_grad_args(logits: torch.Tensor, target: torch.Tensor, grad_loss: torch.Tensor, ignore_index: int,
                  label_smoothing: float, z_loss: float, *, loss: torch.Tensor, lse: torch.Tensor,
                  grad_logits: torch.Tensor) -> CrossEntropyArguments:
    return CrossEntropyArguments(logits, target, loss, lse, grad_logits=grad_logits, grad_loss=grad_loss,
                                 ignore_index=ignore_index, label_smoothing=label_smoothing, z_loss=z_loss)


def _reduced_args(logits: torch.Tensor, target: torch.Tensor, ignore_index: int, label_smoothing: float,
                  z_loss: float, reduction: str, *, loss: torch.Tensor) -> CrossEntropyReducedArguments:
    return CrossEntropyReducedArguments(logits, target, loss, ignore_index=ignore_index,
                                        label_smoothing=label_smoothing, z_loss=z_loss, reduction=reduction)


def _reduced_grad_args(logits: torch.Tensor, target: torch.Tensor, grad_loss: torch.Tensor, ignore_index: int,
                       label_smoothing: float, z_loss: float, reduction: str, *, loss: torch.Tensor,
                       grad_logits: torch.Tensor) -> CrossEntropyReducedArguments:
    return CrossEntropyReducedArguments(logits, target, loss, grad_logits=grad_logits, grad_loss=grad_loss,
                                        ignore_index=ignore_index, label_smoothing=label_smoothing, z_loss=z_loss,
                                        reduction=reduction)


def _ce_backward_args(grad_loss: torch.Tensor, logits: torch.Tensor, target: torch.Tensor, lse: torch.Tensor,
                      ignore_index: int, label_smoothing: float, z_loss: float, *,
                      grad_logits: torch.Tensor) -> CrossEntropyBackwardArguments:
    return CrossEntropyBackwardArguments(grad_loss, logits, target, lse, grad_logits, ignore_index=ignore_index,
                                         label_smoothing=label_smoothing, z_loss=z_loss)


def _lce_args(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, bias: torch.Tensor | None,
              ignore_index: int, label_smoothing: float, z_loss: float, *,
              loss: torch.Tensor) -> LinearCrossEntropyArguments:
    return LinearCrossEntropyArguments(hidden, weight, target, loss, bias=bias, ignore_index=ignore_index,
                                       label_smoothing=label_smoothing, z_loss=z_loss)


def _lce_grads_args(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, grad_loss: torch.Tensor,
                    bias: torch.Tensor | None, ignore_index: int, label_smoothing: float, z_loss: float,
                    hidden_grad: bool, weight_grad: bool, bias_grad: bool, *, loss: torch.Tensor,
                    grad_hidden: torch.Tensor, grad_weight: torch.Tensor,
                    grad_bias: torch.Tensor) -> LinearCrossEntropyArguments:
    return LinearCrossEntropyArguments(hidden, weight, target, loss, bias=bias,
                                       grad_hidden=grad_hidden if hidden_grad else None,
                                       grad_weight=grad_weight if weight_grad else None,
                                       grad_bias=grad_bias if bias_grad and bias is not None else None,
                                       grad_loss=grad_loss, ignore_index=ignore_index,
                                       label_smoothing=label_smoothing, z_loss=z_loss)


def _per_row(grad: torch.Tensor) -> torch.Tensor:
    """``grad`` as the kernels take a per-row weight: viewable as 1-D with one stride."""
    try:
        grad.view(-1)
        return grad
    except RuntimeError:
        return grad.contiguous()


def _ce_backward(saved: Any, grad_loss: torch.Tensor, grad_lse: torch.Tensor) -> tuple:
    grad = cross_entropy_backward(_per_row(grad_loss), saved.logits, saved.target, saved.lse, saved.ignore_index,
                                  saved.label_smoothing, saved.z_loss)
    return grad, None, None, None, None


_SCALARS = "int ignore_index=-100, float label_smoothing=0., float z_loss=0."

CROSS_ENTROPY = Operation(
    name="kernel_api::cross_entropy", schema=f"(Tensor logits, Tensor target, {_SCALARS}) -> (Tensor, Tensor)",
    arguments=_ce_args, outputs=("loss", "lse"), fake=_ce_fake, backward=_ce_backward,
    saved=("logits", "target", "lse", "ignore_index", "label_smoothing", "z_loss"))
CROSS_ENTROPY_WITH_GRAD = Operation(
    name="kernel_api::cross_entropy_with_grad",
    schema=f"(Tensor logits, Tensor target, Tensor grad_loss, {_SCALARS}) -> (Tensor, Tensor, Tensor)",
    arguments=_ce_grad_args, outputs=("loss", "lse", "grad_logits"), fake=_ce_grad_fake)
CROSS_ENTROPY_REDUCED = Operation(
    name="kernel_api::cross_entropy_reduced",
    schema=f"(Tensor logits, Tensor target, {_SCALARS}, str reduction='mean') -> Tensor",
    arguments=_reduced_args, outputs=("loss",), fake=_reduced_fake)
CROSS_ENTROPY_REDUCED_WITH_GRAD = Operation(
    name="kernel_api::cross_entropy_reduced_with_grad",
    schema=f"(Tensor logits, Tensor target, Tensor grad_loss, {_SCALARS}, str reduction='mean') -> (Tensor, Tensor)",
    arguments=_reduced_grad_args, outputs=("loss", "grad_logits"), fake=_reduced_grad_fake)
CROSS_ENTROPY_BACKWARD = Operation(
    name="kernel_api::cross_entropy_backward",
    schema=f"(Tensor grad_loss, Tensor logits, Tensor target, Tensor lse, {_SCALARS}) -> Tensor",
    arguments=_ce_backward_args, outputs=("grad_logits",), fake=_ce_backward_fake)
LINEAR_CROSS_ENTROPY = Operation(
    name="kernel_api::linear_cross_entropy",
    schema=f"(Tensor hidden, Tensor weight, Tensor target, Tensor? bias=None, {_SCALARS}) -> Tensor",
    arguments=_lce_args, outputs=("loss",), fake=_lce_fake)
LINEAR_CROSS_ENTROPY_WITH_GRADS = Operation(
    name="kernel_api::linear_cross_entropy_with_grads",
    schema=(f"(Tensor hidden, Tensor weight, Tensor target, Tensor grad_loss, Tensor? bias=None, {_SCALARS}, "
            f"bool hidden_grad=True, bool weight_grad=True, bool bias_grad=True) -> (Tensor, Tensor, Tensor, Tensor)"),
    arguments=_lce_grads_args, outputs=("loss", "grad_hidden", "grad_weight", "grad_bias"), fake=_lce_grads_fake)

_cross_entropy = define_operation(CROSS_ENTROPY)
#: ``cross_entropy_backward(grad_loss, logits, target, lse, ignore_index=-100, label_smoothing=0.,
#: z_loss=0., *, grad_logits=None, stream=None)`` -> ``grad_logits``, from the forward's lse.
cross_entropy_backward = define_operation(CROSS_ENTROPY_BACKWARD)
_cross_entropy_with_grad = define_operation(CROSS_ENTROPY_WITH_GRAD)
_cross_entropy_reduced = define_operation(CROSS_ENTROPY_REDUCED)
_cross_entropy_reduced_with_grad = define_operation(CROSS_ENTROPY_REDUCED_WITH_GRAD)
_linear_cross_entropy = define_operation(LINEAR_CROSS_ENTROPY)
_linear_cross_entropy_with_grads = define_operation(LINEAR_CROSS_ENTROPY_WITH_GRADS)


def _check_reduction(reduction: Any) -> None:
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction: expected 'mean', 'sum' or 'none', got {reduction!r}")


def _reduce(loss: torch.Tensor, count: Any, reduction: str) -> torch.Tensor:
    if reduction == "none":
        return loss
    total = loss.sum()
    return total / count if reduction == "mean" else total


def cross_entropy(logits: torch.Tensor, target: torch.Tensor, *, ignore_index: int = -100,
                  label_smoothing: float = 0.0, z_loss: float = 0.0, reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy of ``logits`` (classes in the last dimension) against class indices.

    Args:
        logits: (..., classes), f16, bf16, f32 or f64; rows evenly spaced, last dimension of
            stride 1.
        target: class indices, ``logits.shape[:-1]``, int64 or int32.
        ignore_index: targets equal to it contribute neither loss nor gradient, nor count in
            the mean.
        label_smoothing: in [0, 1], as ``torch.nn.functional.cross_entropy``.
        z_loss: weight of each row's ``logsumexp(logits)**2`` added to its loss.
        reduction: "mean" (over the rows not ignored), "sum" or "none".

    Returns:
        The loss in float32 (float64 for f64 logits): a scalar, or ``logits.shape[:-1]``
        for "none". Differentiable with respect to the logits. A mean or a sum is the kernel's
        own (the last of its CTAs adds the rows' losses in a fixed order, so repeated calls give
        the same bits), and repeated calls are replayed from C.
    """
    if reduction == "mean" or reduction == "sum":
        replay = dispatch.replay_call
        if replay is not None and not _is_dynamo_compiling():
            try:
                like = _f32_like.get(logits.get_device())
            except AttributeError:  # (not a tensor: the Python path says so)
                like = None
            if like is not None:
                done = replay(_REDUCED_OP, like, logits, target, ignore_index, label_smoothing, z_loss, reduction,
                              None)
                if done is not None:
                    return done[0]
        return _mean_or_sum(logits, target, ignore_index, label_smoothing, z_loss, reduction)
    _check_reduction(reduction)
    loss, _ = _cross_entropy(logits, target, ignore_index, label_smoothing, z_loss)
    return loss


#: Per device index, a float32 tensor of one element: the first argument of the reduced calls'
#: keys, whose dtype and device the native replay gives the buffer it makes (`dispatch.record_replay`).
_f32_like: dict[int, torch.Tensor] = {}


def _mean_or_sum(logits: torch.Tensor, target: torch.Tensor, ignore_index: int, label_smoothing: float,
                 z_loss: float, reduction: str) -> torch.Tensor:
    """A mean or a sum on the Python path: under autograd `_CrossEntropy`; for float32 losses on
    `RECORDED_DEVICE_TYPES`, the reduced arguments into a made buffer, launched and recorded for
    the native replay; otherwise the generated op's function (its own replay, tracing)."""
    if isinstance(logits, _Tensor) and logits.requires_grad and torch.is_grad_enabled():
        if torch_serves_autograd(logits, target, label_smoothing, z_loss):
            return _torch_mean_or_sum(logits, target, ignore_index, label_smoothing, reduction)
        return _CrossEntropy.apply(logits, target, ignore_index, label_smoothing, z_loss, reduction)
    if (not isinstance(logits, _Tensor) or tracing.is_compiling() or tracing.dispatch_mode_depth()
            or logits.device.type not in RECORDED_DEVICE_TYPES or loss_dtype(logits) is not torch.float32):
        return _cross_entropy_reduced(logits, target, ignore_index, label_smoothing, z_loss, reduction)[0]
    index = logits.get_device()
    like = _f32_like.get(index)
    if like is None:
        like = _f32_like[index] = torch.zeros(1, dtype=torch.float32, device=logits.device)
    made = like.new_empty((reduced_size(math.prod(logits.shape[:-1])),))
    args = CrossEntropyReducedArguments(logits, target, made, ignore_index=ignore_index,
                                        label_smoothing=label_smoothing, z_loss=z_loss, reduction=reduction)
    dispatch.call_recorded(_REDUCED_OP, args, (like, logits, target, ignore_index, label_smoothing, z_loss,
                                               reduction, None), made)
    return made[0]


#: A mean or sum under autograd of logits of at most this many elements is torch's own
#: (`F.cross_entropy` on the logits in the loss's dtype), whose autograd nodes are C++: ours
#: (`_CrossEntropy`) costs the forward and the backward a Python frame each, and the backward the
#: GIL on autograd's device thread. H200 host, 16 x 4096 bf16 logits, a mean's forward and
#: ``backward()`` repeated: 207.8 us a step through `_CrossEntropy`, 124.0 through torch's
#: (benchmarks/cross_entropy.py --host). Above it our kernel's one pass over the logits for the
#: loss and the gradient (1.10 ms against torch's 2.34 at 16384 x 32000 bf16) earns its frames back.
AUTOGRAD_TORCH_MAX_ELEMENTS = 1 << 22

#: Devices whose small means and sums under autograd are torch's own (where kernel_api's kernels
#: run; elsewhere the generated op serves).
TORCH_AUTOGRAD_DEVICE_TYPES = frozenset({"cuda"})
_TORCH_LOGITS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_TORCH_TARGETS = (torch.int64, torch.int32)


def torch_serves_autograd(logits: torch.Tensor, target: Any, label_smoothing: float, z_loss: float) -> bool:
    """Whether a mean or sum under autograd is torch's own `F.cross_entropy`: a CUDA problem of at
    most `AUTOGRAD_TORCH_MAX_ELEMENTS` logits, no z-loss (torch has none), well-formed operands
    (anything else takes our path, whose arguments name what is wrong), no tracer (which sees
    kernel_api's ops), and the settings in force allowing the torch provider."""
    if (z_loss != 0 or logits.device.type not in TORCH_AUTOGRAD_DEVICE_TYPES
            or logits.numel() > AUTOGRAD_TORCH_MAX_ELEMENTS or logits.dim() < 1
            or logits.dtype not in _TORCH_LOGITS or not isinstance(target, _Tensor)
            or target.dtype not in _TORCH_TARGETS or target.shape != logits.shape[:-1]
            or target.device != logits.device or not 0.0 <= label_smoothing <= 1.0
            or tracing.is_compiling() or tracing.dispatch_mode_depth()):
        return False
    return dispatch.torch_provider_allowed()


def _torch_mean_or_sum(logits: torch.Tensor, target: torch.Tensor, ignore_index: int, label_smoothing: float,
                       reduction: str) -> torch.Tensor:
    """`F.cross_entropy`'s mean or sum of (..., classes) logits in the loss's dtype (float32, or
    float64 for f64): the same values as ours (a mean over the rows not ignored, NaN when every
    row is)."""
    if logits.dim() != 2:  # (a view is an autograd node of its own: only where needed)
        logits, target = logits.reshape(-1, logits.shape[-1]), target.reshape(-1)
    dtype = loss_dtype(logits)
    return torch.nn.functional.cross_entropy(logits if logits.dtype is dtype else logits.to(dtype), target.long(),
                                             ignore_index=ignore_index, reduction=reduction,
                                             label_smoothing=label_smoothing)


def _row_weight(count: torch.Tensor | None, reduction: str, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Each row's weight in a mean (``1 / count``, ``count`` the rows not ignored, counted on the
    device) or a sum (1), as a 0-d tensor."""
    if reduction == "mean":
        return 1.0 / count.clamp(min=1).to(dtype)
    return torch.ones((), dtype=dtype, device=device)


#: Saved gradients of at most this many elements in all are scaled by the incoming gradient
#: without looking at it (out of place: one small pass, no sync), larger ones only when it is not
#: 1 (`_scaled`; `_CrossEntropy` also leaves a mean's ``1 / count`` to the backward below it).
#: Reading the incoming gradient waits for the GPU to finish the forward: for a
#: host-bound step that wait is most of its time (H200, 16 x 4096 bf16 logits, a mean's forward
#: and ``backward()`` repeated: 411 us a step with the wait, torch's own 158 us;
#: benchmarks/cross_entropy.py --host), while for a large one a pass over the gradient costs more
#: (0.7 ms for 16384 x 32000 bf16 logits) than the wait.
SCALE_WITHOUT_READING_ELEMENTS = 1 << 22


def _scaled(grads: tuple, grad: torch.Tensor) -> tuple:
    """The saved gradients ``grads`` times the incoming gradient ``grad`` (a 0-d tensor). Small
    ones (`SCALE_WITHOUT_READING_ELEMENTS`) out of place, without reading ``grad``; larger ones
    not at all when it is 1 (one sync; ``loss.backward()`` gives 1), else in place (no second
    weight-sized buffer; a second backward through the same graph, ``retain_graph=True``, then
    fails with torch's error on saved tensors modified in place rather than scale them twice)."""
    if (tracing.is_compiling() or tracing.dispatch_mode_depth() or grad.is_meta
            or (grad.is_cuda and torch.cuda.is_current_stream_capturing())  # (no value to test)
            or sum(g.numel() for g in grads) <= SCALE_WITHOUT_READING_ELEMENTS):
        return tuple(g * grad for g in grads)
    if bool(grad == 1):
        return grads
    return tuple(g.mul_(grad) for g in grads)


class _CrossEntropy(torch.autograd.Function):
    """A mean or sum of the rows' losses, the gradient computed in the forward (one pass over the
    logits and a second from L2 instead of a forward and a backward over them) and scaled in the
    backward.

    A small gradient (`SCALE_WITHOUT_READING_ELEMENTS`) is the sum's (each row weighed 1) and the
    backward scales it out of place by the incoming gradient times the row's weight the kernel
    wrote (the buffer's element 1: ``1 / count`` for a mean), so the forward counts nothing on
    the host's behalf and the backward reads nothing. A larger one is weighed ``1 / count`` in
    the forward (the count taken on the device first), so that the backward can skip the pass
    over it when the incoming gradient is 1 (`_scaled`)."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, target: torch.Tensor, ignore_index: int, label_smoothing: float,
                z_loss: float, reduction: str) -> torch.Tensor:
        ctx.folded = logits.numel() <= SCALE_WITHOUT_READING_ELEMENTS
        dtype = loss_dtype(logits)
        if ctx.folded:
            weight = torch.ones((), dtype=dtype, device=logits.device)
        else:
            count = (target != ignore_index).sum() if reduction == "mean" else None
            weight = _row_weight(count, reduction, dtype, logits.device)
        loss, grad = _cross_entropy_reduced_with_grad.op(logits, target, weight.expand(target.shape), ignore_index,
                                                         label_smoothing, z_loss, reduction)
        ctx.save_for_backward(grad, loss)
        return loss[0]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        if ctx.folded:
            grad_logits, loss = ctx.saved_tensors
            return grad_logits * (grad * loss[1]), None, None, None, None, None
        (grad_logits,) = _scaled(ctx.saved_tensors[:1], grad)
        return grad_logits, None, None, None, None, None


class _LinearCrossEntropy(torch.autograd.Function):
    """The loss, its gradients computed in the forward and scaled in the backward."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, bias: Any,
                ignore_index: int, label_smoothing: float, z_loss: float, reduction: str) -> torch.Tensor:
        h, t = hidden.reshape(-1, hidden.shape[-1]), target.reshape(-1)
        ctx.hidden_shape, ctx.reduction = hidden.shape, reduction
        ctx.scalars = (ignore_index, label_smoothing, z_loss)
        needs = ctx.needs_input_grad
        ctx.wanted = (needs[0], needs[1], bias is not None and needs[3])
        if reduction == "none":
            loss = _linear_cross_entropy(h, weight, t, bias, ignore_index, label_smoothing, z_loss)
            ctx.save_for_backward(h, weight, t, bias)
            return loss.view(target.shape)
        count = (t != ignore_index).sum() if reduction == "mean" else None
        weight_per_row = _row_weight(count, reduction, loss_dtype(hidden), hidden.device)
        op = _linear_cross_entropy_with_grads.op
        loss, grad_h, grad_w, grad_b = op(h, weight, t, weight_per_row.expand(h.shape[0]), bias, ignore_index,
                                          label_smoothing, z_loss, *ctx.wanted)
        ctx.save_for_backward(grad_h, grad_w, grad_b)
        return _reduce(loss, count, reduction)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        if ctx.reduction == "none":
            h, weight, t, bias = ctx.saved_tensors
            op = _linear_cross_entropy_with_grads.op
            _, grad_h, grad_w, grad_b = op(h, weight, t, _per_row(grad.reshape(-1).to(loss_dtype(h))), bias,
                                           *ctx.scalars, *ctx.wanted)
        else:
            grad_h, grad_w, grad_b = _scaled(ctx.saved_tensors, grad)
        want_h, want_w, want_b = ctx.wanted
        return (grad_h.view(ctx.hidden_shape) if want_h else None, grad_w if want_w else None, None,
                grad_b if want_b else None, None, None, None, None)


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                         bias: torch.Tensor | None = None, *, ignore_index: int = -100, label_smoothing: float = 0.0,
                         z_loss: float = 0.0, reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy of ``hidden @ weight.T (+ bias)`` against class indices, without making the
    (tokens x vocabulary) logits: the kernels run over chunks of tokens, one logits chunk at a
    time, and compute the gradients in the same pass when they are wanted.

    Args:
        hidden: (..., hidden size), f16, bf16 or f32 (f64 on the torch provider).
        weight: (vocabulary, hidden size), hidden's dtype (an lm_head's weight); under autocast
            both are cast to the autocast dtype first, as ``F.linear`` casts them.
        target: class indices, ``hidden.shape[:-1]``, int64 or int32.
        bias: optional, (vocabulary,), hidden's dtype.
        ignore_index, label_smoothing, z_loss, reduction: as for `cross_entropy`.

    Returns:
        The loss in float32 (float64 for f64), a scalar or ``hidden.shape[:-1]`` for "none";
        differentiable with respect to hidden, weight and bias.
    """
    _check_reduction(reduction)
    device = hidden.device.type
    if device in ("cuda", "cpu") and torch.is_autocast_enabled(device):
        # as F.linear under autocast: the GEMMs' operands in the autocast dtype (the casts are
        # differentiable, so the gradients reach f32 parameters in f32)
        dt = torch.get_autocast_dtype(device)
        hidden, weight = hidden.to(dt), weight.to(dt)
        bias = bias.to(dt) if bias is not None else None
    wants_grad = torch.is_grad_enabled() and any(
        isinstance(v, torch.Tensor) and v.requires_grad for v in (hidden, weight, bias))
    if not wants_grad:
        h, t = hidden.reshape(-1, hidden.shape[-1]), target.reshape(-1)
        loss = _linear_cross_entropy(h, weight, t, bias, ignore_index, label_smoothing, z_loss)
        count = (t != ignore_index).sum() if reduction == "mean" else None
        return _reduce(loss.view(target.shape), count, reduction)
    return _LinearCrossEntropy.apply(hidden, weight, target, bias, ignore_index, label_smoothing, z_loss, reduction)
