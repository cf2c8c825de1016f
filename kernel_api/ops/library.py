"""``torch.library`` ops for the front door, so PyTorch's graph tools see our kernels.

    torch.ops.kernel_api.gemm(A, B, C, bias, alpha, beta, activation)
    torch.ops.kernel_api.softmax(x, dim)
    torch.ops.kernel_api.softmax_backward(grad_out, out, dim)

Each op runs the same dispatch as `kernel_api.ops` (the policy in force picks the kernel) and
has a fake (meta) implementation, so ``torch.compile(..., fullgraph=True)`` and
``torch.export`` trace through it without running anything. ``softmax`` and ``gemm`` have
autograd formulas; softmax's backward runs the registry's backward kernels
(`SoftmaxBackwardArguments`), gemm's runs two more GEMMs through the registry (three with an
activation: the pre-activation is recomputed, then multiplied by the activation's derivative).

`kernel_api.ops` routes here by itself when it is traced or when an input requires grad, so
users rarely call these ops directly.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from ..arguments import SoftmaxArguments, SoftmaxBackwardArguments
from ..core import tracing
from . import dispatch as _ops
from .operation import Operation, define_operation, like_input

_NS = "kernel_api"


def _gemm_shape(A: torch.Tensor, B: torch.Tensor) -> tuple[int, ...]:
    return (*A.shape[:-1], B.shape[-1])


# ---- gemm -----------------------------------------------------------------------------------
# Defined with torch.library.Library rather than torch.library.custom_op: custom_op's Python
# wrappers (argument checks, the autograd kernel's redispatch) cost about 40 us a call, more than
# a small GEMM runs; here a call that needs no autograd goes from the Autograd kernel straight
# to the implementation (`_gemm_autograd`), about as cheap as the dispatcher itself.
_lib = torch.library.Library(_NS, "FRAGMENT")
_lib.define("gemm(Tensor A, Tensor B, Tensor? C=None, Tensor? bias=None, float alpha=1.0, float beta=0.0, "
            "str? activation=None) -> Tensor", tags=(torch.Tag.pt2_compliant_tag,))
_Tensor = torch.Tensor
_grad_enabled = torch.is_grad_enabled
_dispatch_modes = tracing.dispatch_mode_depth


def gemm(A: torch.Tensor, B: torch.Tensor, C: Optional[torch.Tensor] = None, bias: Optional[torch.Tensor] = None,
         alpha: float = 1.0, beta: float = 0.0, activation: Optional[str] = None) -> torch.Tensor:
    """``activation(alpha * A @ B + beta * C + bias)`` through the registry (the op's
    implementation, below autograd; call ``torch.ops.kernel_api.gemm``). A call keyed as an
    earlier one is replayed from C, as the front door's are: a compiled graph calls the op for
    every projection it keeps, and the Python path would cost it hundreds of microseconds each."""
    replay = _ops.replay_call
    if replay is not None:
        done = replay(_ops.GEMM_OP, A, B, None, alpha, beta, C, bias, activation, None, None)
        if done is not None:
            return done
    return _ops._gemm_eager(A, B, None, alpha, beta, C, bias, activation, None, None)


_lib.impl("gemm", gemm, "CompositeExplicitAutograd")


def _gemm_fake(A, B, C=None, bias=None, alpha=1.0, beta=0.0, activation=None):
    if A.dim() != B.dim() or A.dim() not in (2, 3):
        raise ValueError(f"kernel_api::gemm: A and B must both be rank 2 or 3, got {A.dim()} and {B.dim()}")
    if A.shape[-1] != B.shape[-2]:
        raise ValueError(f"kernel_api::gemm: K mismatch, A is {tuple(A.shape)} and B is {tuple(B.shape)}")
    # The implementation's output layout exactly (padded rows where it splits the columns).
    if A.dim() == 2 and _ops.split_columns(A, B, C, beta, bias):
        return _ops.padded_output(A, B.shape[-1])
    return A.new_empty(_gemm_shape(A, B))


torch.library.register_fake(f"{_NS}::gemm", _gemm_fake, lib=_lib)


class _GemmFunction(torch.autograd.Function):
    """The op under autograd: the forward runs it below autograd, the backward is `_gemm_backward`."""

    @staticmethod
    def forward(ctx: Any, A, B, C, bias, alpha, beta, activation):
        with torch._C._AutoDispatchBelowADInplaceOrView():
            out = torch.ops.kernel_api.gemm.default(A, B, C, bias, alpha, beta, activation)
        _gemm_setup(ctx, (A, B, C, bias, alpha, beta, activation), out)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return _gemm_backward(ctx, grad)


def _gemm_autograd(A, B, C=None, bias=None, alpha=1.0, beta=0.0, activation=None):
    """The op's Autograd kernel: `_GemmFunction` when a gradient is wanted; otherwise the
    implementation itself for plain CUDA tensors outside dispatch modes (nothing below
    autograd would do anything else with them), else the usual redispatch."""
    if _grad_enabled() and (A.requires_grad or B.requires_grad or (C is not None and C.requires_grad)
                            or (bias is not None and bias.requires_grad)):
        return _GemmFunction.apply(A, B, C, bias, alpha, beta, activation)
    if (type(A) is _Tensor and type(B) is _Tensor and A.is_cuda and (C is None or type(C) is _Tensor)
            and (bias is None or type(bias) is _Tensor) and not _dispatch_modes()):
        return gemm(A, B, C, bias, alpha, beta, activation)
    with torch._C._AutoDispatchBelowADInplaceOrView():
        return torch.ops.kernel_api.gemm.default(A, B, C, bias, alpha, beta, activation)


_lib.impl("gemm", _gemm_autograd, "Autograd")


def _gemm_setup(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    A, B, C, bias, alpha, beta, activation = inputs
    if activation is None:
        ctx.save_for_backward(A, B)
    else:
        # The fused epilogue writes only activation(z); the backward recomputes the
        # pre-activation z with one more GEMM (no second output, no extra memory held).
        ctx.save_for_backward(A, B, C, bias)
    ctx.alpha, ctx.beta, ctx.activation = alpha, beta, activation
    ctx.has_C, ctx.bias_shape = C is not None, None if bias is None else tuple(bias.shape)


def _activation_backward(grad: torch.Tensor, z: torch.Tensor, activation: str) -> torch.Tensor:
    """dL/dz from dL/dy for ``y = activation(z)``, with the epilogue's formulas (gelu: tanh)."""
    name = activation.lower()
    if name == "relu":
        return torch.ops.aten.threshold_backward(grad, z, 0)
    if name == "gelu":
        return torch.ops.aten.gelu_backward(grad, z, approximate="tanh")
    if name == "silu":
        return torch.ops.aten.silu_backward(grad, z)
    raise ValueError(f"kernel_api::gemm backward: unknown activation {activation!r}")


def _aligned_grad(grad: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``grad`` with dense rows, and the columns of its aligned part (0: all of it).

    A 2-D gradient whose rows are not a multiple of 16 bytes (the lm_head's 50257 logits) is
    copied into padded rows (`padded_output`, one pass over it), and the GEMMs that read it are split
    at the last aligned column (`_split_contraction`, `_split_rows`), so tensor-core kernels
    take nearly all the work instead of an alignment-1 path."""
    if grad.dim() == 2 and grad.shape[0] >= _ops.SPLIT_MIN_ROWS:
        N, vec = grad.shape[1], 16 // grad.element_size()
        if N % vec and N >= 4 * vec:
            padded = _ops.padded_output(grad, N)
            padded.copy_(grad)
            return padded, N - N % vec
    return grad.contiguous(), 0


def _bw_gemm(A: torch.Tensor, B: torch.Tensor, out: Optional[torch.Tensor] = None, alpha: float = 1.0,
             beta: float = 0.0, C: Optional[torch.Tensor] = None, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """A GEMM of the backward: CUDA tensors through the front door (its replays, or the
    op again under tracing or double backward), others (meta) through the op."""
    if A.is_cuda:
        return _ops.gemm(A, B, out, alpha=alpha, beta=beta, C=C, bias=bias)
    result = torch.ops.kernel_api.gemm(A, B, C, bias, alpha, beta, None)
    return result if out is None else out.copy_(result)


def _split_contraction(X: torch.Tensor, Y: torch.Tensor, head: int, alpha: float) -> torch.Tensor:
    """``alpha * X @ Y`` with the contraction split at ``head``: the aligned part, then the rest
    accumulated into it (the C operand)."""
    out = _bw_gemm(X[:, :head], Y[:head], alpha=alpha)
    return _bw_gemm(X[:, head:], Y[head:], alpha=alpha, beta=1.0, C=out)


def _split_rows(X: torch.Tensor, Y: torch.Tensor, head: int, alpha: float) -> torch.Tensor:
    """``alpha * X @ Y`` with the output's rows split at ``head`` (X's aligned rows, then the rest)."""
    out = X.new_empty((X.shape[0], Y.shape[1]))
    _bw_gemm(X[:head], Y, out[:head], alpha=alpha)
    _bw_gemm(X[head:], Y, out[head:], alpha=alpha)
    return out


def _gemm_backward(ctx: Any, grad: torch.Tensor) -> tuple:
    A, B = ctx.saved_tensors[:2]
    grad, head = _aligned_grad(grad)
    if ctx.activation is not None:
        C, bias = ctx.saved_tensors[2:]
        z = _bw_gemm(A, B, alpha=ctx.alpha, beta=ctx.beta, C=C, bias=bias)
        grad = _activation_backward(grad, z, ctx.activation).contiguous()
        head = 0
    gA = gB = gC = gbias = None
    # The transposed operands are column-major views: the kernels take them without copies.
    if ctx.needs_input_grad[0]:
        if head:
            gA = _split_contraction(grad, B.transpose(-1, -2), head, ctx.alpha)
        else:
            gA = _bw_gemm(grad, B.transpose(-1, -2), alpha=ctx.alpha)
    if ctx.needs_input_grad[1]:
        if head:
            # dB^T = grad^T A: its rows are grad's columns, so the aligned ones split off.
            gB = _split_rows(grad.transpose(-1, -2), A, head, ctx.alpha).transpose(-1, -2)
        else:
            gB = _bw_gemm(A.transpose(-1, -2), grad, alpha=ctx.alpha)
    if ctx.has_C and ctx.needs_input_grad[2]:
        gC = grad * ctx.beta
    if ctx.bias_shape is not None and ctx.needs_input_grad[3]:
        rows = grad.reshape(-1, grad.shape[-2], grad.shape[-1])
        n = rows.shape[-1]
        row_bias = ctx.bias_shape in ((n,), (1, n))
        gbias = (rows.sum(dim=(0, 1)) if row_bias else rows.sum(dim=(0, 2))).reshape(ctx.bias_shape)
    return gA, gB, gC, gbias, None, None, None


# ---- softmax --------------------------------------------------------------------------------
# Generated from their descriptions (`Operation`). Their implementations replay a recorded call
# from C, or run the front door's own eager functions, which move ``dim`` last when needed and
# record the launch for that replay (as `dispatch.softmax` does).
def _softmax_arguments(x: torch.Tensor, dim: int, out: torch.Tensor) -> SoftmaxArguments:
    return SoftmaxArguments(x, out, dim=dim)


def _softmax_implementation(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    x = x.contiguous()
    replay = _ops.replay_call
    done = replay(_ops.SOFTMAX_OP, x, dim, None, None) if replay is not None else None
    return done if done is not None else _ops._softmax_eager(x, dim, None, None)


def _softmax_grad(saved: Any, grad: torch.Tensor) -> tuple:
    return torch.ops.kernel_api.softmax_backward(grad, saved.out, saved.dim), None


SOFTMAX = Operation(
    name=f"{_NS}::softmax", schema="(Tensor x, SymInt dim=-1) -> Tensor", arguments=_softmax_arguments,
    outputs=("out",), fake=like_input(0), backward=_softmax_grad, saved=("out", "dim"),
    implementation=_softmax_implementation)


def _softmax_backward_arguments(grad_out: torch.Tensor, out: torch.Tensor, dim: int,
                                grad_in: torch.Tensor) -> SoftmaxBackwardArguments:
    return SoftmaxBackwardArguments(grad_out, out, grad_in, dim=dim)


def _softmax_backward_implementation(grad_out: torch.Tensor, out: torch.Tensor, dim: int = -1) -> torch.Tensor:
    # Autograd often hands over expanded (stride-0) gradients; the kernels need dense rows.
    grad_out, out = grad_out.contiguous(), out.contiguous()
    replay = _ops.replay_call
    done = replay(_ops.SOFTMAX_BACKWARD_OP, grad_out, out, dim, None, None) if replay is not None else None
    return done if done is not None else _ops._softmax_backward_eager(grad_out, out, dim, None, None)


SOFTMAX_BACKWARD = Operation(
    name=f"{_NS}::softmax_backward", schema="(Tensor grad_out, Tensor out, SymInt dim=-1) -> Tensor",
    arguments=_softmax_backward_arguments, outputs=("grad_in",), fake=like_input(1),
    implementation=_softmax_backward_implementation)

softmax = define_operation(SOFTMAX)
softmax_backward = define_operation(SOFTMAX_BACKWARD)
