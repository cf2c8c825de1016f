"""The front door: call an operation, let the policy in force choose the kernel.

After the first call for a (policy, signature, problem shape), the choice and its compiled
artifact come from a dictionary; the call then costs argument construction plus the launch.
"""

from __future__ import annotations

from typing import Any

import torch

from . import registry
from .arguments import EpilogueArguments, GemmArguments, SoftmaxArguments, SoftmaxBackwardArguments
from .errors import DeviceError
from .selection import _no_kernel
from .settings import current

_dispatch: dict[tuple, tuple] = {}


def _launch(args: Any, stream: Any = None) -> None:
    policy = current().policy
    shape = getattr(args, "problem_shape", None) or (getattr(args, "rows", 0), getattr(args, "cols", 0))
    key = (id(policy), args.signature, shape, args.device.index)
    found = _dispatch.get(key)
    if found is None:
        if args.device.type != "cuda":
            name = next(iter(args.tensor_attributes))
            raise DeviceError(f"operand {name} is on {args.device}; kernel_api.ops run on CUDA tensors")
        candidates = registry.get_kernels(args)
        if not candidates:
            raise _no_kernel(args)
        kernel = policy.choose(args, candidates)
        found = _dispatch[key] = (kernel, kernel.compile(args), policy)  # keep policy alive: id() stays unique
    kernel, artifact, _ = found
    kernel.run(args, compiled_artifact=artifact, stream=stream, assume_supported_args=True)


def gemm(A: torch.Tensor, B: torch.Tensor, out: torch.Tensor | None = None, *, alpha: float = 1.0,
         beta: float = 0.0, C: torch.Tensor | None = None, bias: torch.Tensor | None = None,
         activation: str | None = None, accumulator_type: Any = None, stream: Any = None) -> torch.Tensor:
    """``out = activation(alpha * A @ B + beta * C + bias)`` with the kernel the policy picks.

    ``out`` defaults to a new tensor of A's dtype, shape (..., M, N).
    """
    if out is None:
        if not isinstance(A, torch.Tensor) or not isinstance(B, torch.Tensor):
            raise TypeError("gemm: A and B must be torch tensors")
        out = torch.empty((*A.shape[:-1], B.shape[-1]), dtype=A.dtype, device=A.device)
    epilogue = None
    if alpha != 1.0 or beta != 0.0 or bias is not None or activation is not None:
        epilogue = EpilogueArguments(alpha=alpha, beta=beta, C=C, bias=bias, activation=activation)
    _launch(GemmArguments(A, B, out, accumulator_type=accumulator_type, epilogue=epilogue), stream)
    return out


def softmax(x: torch.Tensor, dim: int = -1, out: torch.Tensor | None = None, stream: Any = None) -> torch.Tensor:
    """``softmax(x, dim)`` over the last dimension."""
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch(SoftmaxArguments(x, out, dim=dim), stream)
    return out


def softmax_backward(grad_out: torch.Tensor, out: torch.Tensor, dim: int = -1,
                     grad_in: torch.Tensor | None = None, stream: Any = None) -> torch.Tensor:
    """Gradient of softmax: ``out * (grad_out - sum(grad_out * out, dim))``."""
    if grad_in is None:
        grad_in = torch.empty(out.shape, dtype=out.dtype, device=out.device)
    _launch(SoftmaxBackwardArguments(grad_out, out, grad_in, dim=dim), stream)
    return grad_in


def clear_dispatch_cache() -> None:
    _dispatch.clear()
