"""`RMSNorm`: the forward of transformers' Llama-family RMSNorm layers through `ops.rms_norm`;
`LayerNorm`: ``torch.nn.LayerNorm``'s through `ops.layer_norm`.

Those layers (``LlamaRMSNorm``, ``MistralRMSNorm``, ``Qwen2RMSNorm``, ``Qwen3RMSNorm``) compute
``weight * (x / sqrt(mean(x**2) + eps))`` over the last dimension, in f32, the normalised rows
cast back to x's dtype before the weight. `ops.rms_norm` computes the same in f32 and rounds
once. `kernel_api.nn.patch` puts these mixins in front of the layer's class (`mixin.adopt`).
"""

from __future__ import annotations

import torch

from .. import ops
from .mixin import forward_behind, op_here, ops_take


class RMSNorm(torch.nn.Module):
    """Mixin: ``ops.rms_norm(x, self.weight, self.variance_epsilon)``. An input in another dtype
    than the weight (whose product torch would promote), or on a device kernel_api does not
    launch on, runs the layer's own forward; so does a call under ``torch.compile`` unless
    ``compile_lowering`` is "kernel_api" (`mixin.op_here`)."""

    compile_lowering = "auto"

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        # (op_here first: under torch.compile its compile_lowering is all the forward behind
        # reads of the layer beyond its own reads, so the graph guards little more)
        weight = self.weight
        if not op_here(self) or not ops_take(hidden_states, weight):
            return forward_behind(self, RMSNorm)(self, hidden_states)
        return ops.rms_norm(hidden_states, weight, self.variance_epsilon)


class LayerNorm(torch.nn.Module):
    """Mixin for ``torch.nn.LayerNorm`` over the last dimension with a weight and a bias:
    ``ops.layer_norm(x, self.weight, self.bias, self.eps)``. Other inputs (another dtype or
    device, or under ``torch.compile`` as for `RMSNorm`) run torch's forward."""

    compile_lowering = "auto"

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not op_here(self):
            return forward_behind(self, LayerNorm)(self, input)
        weight, bias = self.weight, self.bias
        if weight is None or bias is None or len(self.normalized_shape) != 1 or not ops_take(input, weight, bias):
            return forward_behind(self, LayerNorm)(self, input)
        return ops.layer_norm(input, weight, bias, self.eps)
