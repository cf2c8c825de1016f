"""The vector add's one description (`VECTOR_ADD`) and the function kernel_api generates from it.

Importing this module defines ``torch.ops.kernel_api_examples.vector_add`` (its fake
implementation and autograd formula included) and `add`, its front door: eager calls run
``kernel_api.ops.call(VectorAddArguments(x, y, out))``, traced ones (``torch.compile``,
``make_fx``, FakeTensorMode) and those needing a gradient go through the torch op. Nothing in
kernel_api names this operation.
"""

from __future__ import annotations

from typing import Any

import torch

from kernel_api.ops import Operation, define_operation, like_input

from .arguments import VectorAddArguments


def _backward(saved: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # d(x + y)/dx = d(x + y)/dy = 1: the output's gradient passes to both inputs.
    return grad, grad


VECTOR_ADD = Operation(
    name="kernel_api_examples::vector_add",
    schema="(Tensor x, Tensor y) -> Tensor",
    arguments=VectorAddArguments,  # VectorAddArguments(x, y, out=out)
    outputs=("out",),
    fake=like_input(0),  # out: x's shape, dtype and device, dense
    backward=_backward,
    saved=(),  # the backward reads nothing but the gradient
)

#: ``add(x, y, *, out=None, stream=None) -> out``: ``out = x + y`` through kernel_api.
add = define_operation(VECTOR_ADD)
