"""Rotary position embeddings for transformers models through `ops.rope`.

The Llama family's attention layers call their modeling module's ``apply_rotary_pos_emb(q, k,
cos, sin, unsqueeze_dim=1)`` (q, k: (batch, heads, seqlen, head_dim); cos, sin: (batch,
seqlen, head_dim)), a module-level function, so `kernel_api.nn.patch` replaces that function
in the module (`edits.GLOBAL_HOOKS`: while at least one patched model uses it) by
`rope_function(original)`. The replacement computes the same rotation (`ops.rope` follows the
same rotate-half convention), so other models of the family in the process are unaffected; it
hands anything `ops.rope` does not take (partial rotary, mixed dtypes, a device kernel_api
does not launch on, extra arguments) to the original, and so it does under ``torch.compile``,
where Inductor generates the rotation and fuses it with its neighbours (as `mixin.op_here`
decides for the memory-bound layers by default).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch

from .. import ops
from ..core import tracing
from .mixin import ops_take

#: The module-level function the family's attention layers call.
FUNCTION_NAME = "apply_rotary_pos_emb"


def rope_function(original: Callable) -> Callable:
    """``apply_rotary_pos_emb`` through `ops.rope`, falling back to ``original``."""

    @functools.wraps(original)
    def apply_rotary_pos_emb(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                             unsqueeze_dim: int = 1, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if (args or kwargs or tracing.is_dynamo_compiling() or unsqueeze_dim not in (1, 2) or q.dim() != 4 or k.dim() != 4 or cos.dim() != 3
                or cos.shape[-1] != q.shape[-1] or k.shape[-1] != q.shape[-1] or not ops_take(q, k, cos, sin)):
            return original(q, k, cos, sin, unsqueeze_dim, *args, **kwargs)
        return ops.rope(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)

    apply_rotary_pos_emb.kernel_api_original = original
    return apply_rotary_pos_emb
