"""`SwiGLUMLP`: the forward of transformers' Llama-family MLP through `ops.swiglu`.

Those MLPs (``LlamaMLP``, ``MistralMLP``, ``Qwen2MLP``, ``Qwen3MLP``) compute
``down_proj(act_fn(gate_proj(x)) * up_proj(x))``; with the SiLU activation the middle is
``ops.swiglu(gate, up)``: one pass over the two projections' outputs instead of three. The
projections stay the layer's own children, patched separately (`kernel_api.nn.Linear`).
"""

from __future__ import annotations

import torch

from .. import ops
from .mixin import op_here, ops_take


class SwiGLUMLP(torch.nn.Module):
    """Mixin: ``down_proj(ops.swiglu(gate_proj(x), up_proj(x)))`` for an MLP whose ``act_fn``
    is SiLU (`kernel_api.nn.patch` checks). Projections whose outputs the op does not take
    (another device, mixed dtypes) get ``act_fn(gate) * up``, the layer's own math; so does a
    call under ``torch.compile`` unless ``compile_lowering`` is "kernel_api" (`mixin.op_here`)."""

    compile_lowering = "auto"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_proj(x), self.up_proj(x)
        hidden = ops.swiglu(gate, up) if ops_take(gate, up) and op_here(self) else self.act_fn(gate) * up
        return self.down_proj(hidden)
