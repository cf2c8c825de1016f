"""Reference results and fresh random look-alike arguments, for verification and tuning."""

from __future__ import annotations

import math
from typing import Any

import torch

from ..arguments import EpilogueArguments, GemmArguments, SoftmaxArguments, SoftmaxBackwardArguments
from ..core.dtypes import DataType

# Relative Frobenius-norm error allowed per output dtype (tf32 math gets its own entry).
TOLERANCE = {DataType.f64: 1e-12, DataType.f32: 1e-5, DataType.tf32: 5e-3, DataType.f16: 1e-2,
             DataType.bf16: 1e-2}


def _activation(x: torch.Tensor, name: str | None) -> torch.Tensor:
    if name is None:
        return x
    if name == "relu":
        return torch.relu(x)
    if name == "gelu":
        return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))
    if name == "silu":
        return x * torch.sigmoid(x)
    raise ValueError(f"unknown activation {name!r}")


def gemm_reference(args: GemmArguments) -> torch.Tensor:
    """``act(alpha * A @ B + beta * C + bias)`` in float64, shaped like ``args.out``."""
    acc = torch.matmul(args.A.double(), args.B.double())
    epi = args.epilogue
    if epi is None:
        return acc
    acc = epi.alpha * acc
    if epi.C is not None and epi.beta != 0:
        acc = acc + epi.beta * epi.C.double()
    if epi.bias is not None:
        b = epi.bias.double()
        acc = acc + (b.view(-1, 1) if epi.bias_kind == "column" else b.view(1, -1))
    return _activation(acc, epi.activation)


def softmax_reference(args: SoftmaxArguments) -> torch.Tensor:
    return torch.softmax(args.x.float(), dim=-1)


def softmax_backward_reference(args: SoftmaxBackwardArguments) -> torch.Tensor:
    y, dy = args.out.float(), args.grad_out.float()
    return y * (dy - (dy * y).sum(dim=-1, keepdim=True))


def reference(args: Any) -> torch.Tensor:
    """The expected output of ``args`` computed with torch in high precision."""
    if isinstance(args, GemmArguments):
        return gemm_reference(args)
    if isinstance(args, SoftmaxArguments):
        return softmax_reference(args)
    if isinstance(args, SoftmaxBackwardArguments):
        return softmax_backward_reference(args)
    raise TypeError(f"no reference for {type(args).__name__}")


def output_of(args: Any) -> torch.Tensor:
    return args.grad_in if isinstance(args, SoftmaxBackwardArguments) else args.out


def tolerance(args: Any, kernel: Any = None) -> float:
    """Allowed relative error: by output dtype, loosened for tf32 math and long reductions."""
    out_dtype = args.tensor_attributes["grad_in" if isinstance(args, SoftmaxBackwardArguments) else "out"].dtype
    tol = TOLERANCE.get(out_dtype, 1e-2)
    math_type = getattr(getattr(getattr(kernel, "metadata", None), "operands", None), "math_type", None)
    if math_type is DataType.tf32:
        tol = max(tol, TOLERANCE[DataType.tf32])
    if isinstance(args, GemmArguments) and out_dtype is DataType.f32:
        in_dtype = args.tensor_attributes["A"].dtype
        if in_dtype in (DataType.f16, DataType.bf16):
            tol = max(tol, 1e-3)  # inputs rounded to 16 bits, output kept in f32
    return tol


def _random_like(t: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """A tensor with t's shape, strides, dtype, device and pointer alignment, random values."""
    span = 1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride())) if t.numel() else 0
    itemsize = t.element_size()
    offset = (t.data_ptr() // itemsize) % 128 if t.data_ptr() else 0
    storage = torch.empty(span + offset, dtype=t.dtype, device=t.device)
    if t.is_floating_point():
        storage.normal_(generator=generator)
    else:
        storage.random_(-8, 8, generator=generator)
    return storage.as_strided(t.shape, t.stride(), offset)


def random_like(args: Any, generator: torch.Generator | None = None) -> Any:
    """New arguments of the same signature (dtypes, layouts, alignment) with fresh random data.

    Outputs are poisoned with NaN so unwritten elements are caught.
    """
    if isinstance(args, GemmArguments):
        epi = args.epilogue
        new_epi = None
        if epi is not None:
            bias = None if epi.bias is None else _random_like(epi.bias, generator)
            if bias is not None and epi.bias_kind == "column":
                bias = bias.view(-1, 1)  # (M, 1): a column bias whatever M and N are
            new_epi = EpilogueArguments(alpha=epi.alpha, beta=epi.beta,
                                        C=None if epi.C is None else _random_like(epi.C, generator),
                                        bias=bias, activation=epi.activation)
        out = _random_like(args.out, generator).fill_(float("nan"))
        return GemmArguments(_random_like(args.A, generator), _random_like(args.B, generator), out,
                             accumulator_type=args.accumulator_type, epilogue=new_epi)
    if isinstance(args, SoftmaxArguments):
        out = torch.full_like(args.out, float("nan"))
        return SoftmaxArguments(_random_like(args.x, generator) * 4, out, dim=args.dim)
    if isinstance(args, SoftmaxBackwardArguments):
        y = torch.softmax(_random_like(args.out, generator).float(), dim=-1).to(args.out.dtype)
        return SoftmaxBackwardArguments(_random_like(args.grad_out, generator), y,
                                        torch.full_like(args.grad_in, float("nan")), dim=args.dim)
    raise TypeError(f"cannot make random arguments like {type(args).__name__}")


def input_bytes(args: Any) -> int:
    return sum(t.numel() * t.element_size() for t in args.tensors().values())
