"""`RMSNorm`: the forward of transformers' Llama-family RMSNorm layers through `ops.rms_norm`.

Those layers (``LlamaRMSNorm``, ``MistralRMSNorm``, ``Qwen2RMSNorm``, ``Qwen3RMSNorm``) compute
``weight * (x / sqrt(mean(x**2) + eps))`` over the last dimension, in f32, the normalised rows
cast back to x's dtype before the weight. `ops.rms_norm` computes the same in f32 and rounds
once. `kernel_api.nn.patch` puts this mixin in front of the layer's class (`mixin.adopt`).
"""

from __future__ import annotations

import torch

from .. import ops
from .mixin import ops_take


class RMSNorm(torch.nn.Module):
    """Mixin: ``ops.rms_norm(x, self.weight, self.variance_epsilon)``. An input in another dtype
    than the weight (whose product torch would promote), or on a device kernel_api does not
    launch on, runs the layer's own forward."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if not ops_take(hidden_states, weight):
            return super().forward(hidden_states)
        return ops.rms_norm(hidden_states, weight, self.variance_epsilon)
