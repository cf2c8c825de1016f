"""``torch.library`` custom ops for the front door, so PyTorch's graph tools see our kernels.

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

from . import dispatch as _ops

_NS = "kernel_api"


def _gemm_shape(A: torch.Tensor, B: torch.Tensor) -> tuple[int, ...]:
    return (*A.shape[:-1], B.shape[-1])


# ---- gemm -----------------------------------------------------------------------------------
@torch.library.custom_op(f"{_NS}::gemm", mutates_args=())
def gemm(A: torch.Tensor, B: torch.Tensor, C: Optional[torch.Tensor] = None, bias: Optional[torch.Tensor] = None,
         alpha: float = 1.0, beta: float = 0.0, activation: Optional[str] = None) -> torch.Tensor:
    """``activation(alpha * A @ B + beta * C + bias)`` through the registry."""
    return _ops._gemm_eager(A, B, None, alpha, beta, C, bias, activation, None, None)


@gemm.register_fake
def _gemm_fake(A, B, C=None, bias=None, alpha=1.0, beta=0.0, activation=None):
    if A.dim() != B.dim() or A.dim() not in (2, 3):
        raise ValueError(f"kernel_api::gemm: A and B must both be rank 2 or 3, got {A.dim()} and {B.dim()}")
    if A.shape[-1] != B.shape[-2]:
        raise ValueError(f"kernel_api::gemm: K mismatch, A is {tuple(A.shape)} and B is {tuple(B.shape)}")
    return A.new_empty(_gemm_shape(A, B))


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


def _gemm_backward(ctx: Any, grad: torch.Tensor) -> tuple:
    A, B = ctx.saved_tensors[:2]
    grad = grad.contiguous()
    if ctx.activation is not None:
        C, bias = ctx.saved_tensors[2:]
        z = torch.ops.kernel_api.gemm(A, B, C, bias, ctx.alpha, ctx.beta, None)
        grad = _activation_backward(grad, z, ctx.activation).contiguous()
    gA = gB = gC = gbias = None
    # The transposed operands are column-major views: the kernels take them without copies.
    if ctx.needs_input_grad[0]:
        gA = torch.ops.kernel_api.gemm(grad, B.transpose(-1, -2), None, None, ctx.alpha, 0.0, None)
    if ctx.needs_input_grad[1]:
        gB = torch.ops.kernel_api.gemm(A.transpose(-1, -2), grad, None, None, ctx.alpha, 0.0, None)
    if ctx.has_C and ctx.needs_input_grad[2]:
        gC = grad * ctx.beta
    if ctx.bias_shape is not None and ctx.needs_input_grad[3]:
        rows = grad.reshape(-1, grad.shape[-2], grad.shape[-1])
        n = rows.shape[-1]
        row_bias = ctx.bias_shape in ((n,), (1, n))
        gbias = (rows.sum(dim=(0, 1)) if row_bias else rows.sum(dim=(0, 2))).reshape(ctx.bias_shape)
    return gA, gB, gC, gbias, None, None, None


gemm.register_autograd(_gemm_backward, setup_context=_gemm_setup)


# ---- softmax --------------------------------------------------------------------------------
@torch.library.custom_op(f"{_NS}::softmax", mutates_args=())
def softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """``softmax(x, dim)`` through the registry's forward kernels."""
    return _ops._softmax_eager(x.contiguous(), dim, None, None)


@softmax.register_fake
def _softmax_fake(x, dim=-1):
    return x.new_empty(x.shape)


@torch.library.custom_op(f"{_NS}::softmax_backward", mutates_args=())
def softmax_backward(grad_out: torch.Tensor, out: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Gradient of softmax through the registry's backward kernels (`SoftmaxBackwardArguments`)."""
    # Autograd often hands over expanded (stride-0) gradients; the kernels need dense rows.
    return _ops._softmax_backward_eager(grad_out.contiguous(), out.contiguous(), dim, None, None)


@softmax_backward.register_fake
def _softmax_backward_fake(grad_out, out, dim=-1):
    return out.new_empty(out.shape)


def _softmax_setup(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    ctx.save_for_backward(output)
    ctx.dim = inputs[1]


def _softmax_grad(ctx: Any, grad: torch.Tensor) -> tuple:
    (out,) = ctx.saved_tensors
    return torch.ops.kernel_api.softmax_backward(grad, out, ctx.dim), None


softmax.register_autograd(_softmax_grad, setup_context=_softmax_setup)
