"""`SwiGLUMLP`: the forward of transformers' Llama-family MLP through `ops.swiglu`, or with the
gate multiply in the up projection's epilogue.

Those MLPs (``LlamaMLP``, ``MistralMLP``, ``Qwen2MLP``, ``Qwen3MLP``) compute
``down_proj(act_fn(gate_proj(x)) * up_proj(x))``. With the SiLU activation the middle is either

- the up projection's GEMM with the epilogue ``accum * silu(gate)``, reading the gate
  projection's output (`kernel_api.nn.fusion.FusedProjection`: inference GEMMs of at least
  `fusion.FUSE_MIN_ROWS` rows, the same rule under ``torch.compile``): the up projection's output
  is never written, nor read back; or
- ``ops.swiglu(gate, up)``: one pass over the two projections' outputs instead of three.

The projections stay the layer's own children, patched separately (`kernel_api.nn.Linear`).
"""

from __future__ import annotations

import torch

from .. import ops
from .fusion import FusedProjection, armed, worth_arming
from .mixin import op_here, ops_take


class SwiGLUMLP(torch.nn.Module):
    """Mixin: ``down_proj(act_fn(gate_proj(x)) * up_proj(x))`` for an MLP whose ``act_fn`` is
    SiLU (`kernel_api.nn.patch` checks), the gate multiply in ``up_proj``'s epilogue where it
    takes it (`FusedProjection.takes`), else ``ops.swiglu``. Projections whose outputs the op
    does not take (another device, mixed dtypes) get ``act_fn(gate) * up``, the layer's own math;
    so does a call under ``torch.compile`` unless ``compile_lowering`` is "kernel_api"
    (`mixin.op_here`)."""

    compile_lowering = "auto"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up_proj = self.gate_proj(x), self.up_proj
        if isinstance(up_proj, FusedProjection) and worth_arming(gate, (up_proj,)) and up_proj.takes(x, gate=gate):
            with armed(up_proj, gate=gate):
                hidden = up_proj(x)
            return self.down_proj(hidden)
        up = up_proj(x)
        hidden = ops.swiglu(gate, up) if ops_take(gate, up) and op_here(self) else self.act_fn(gate) * up
        return self.down_proj(hidden)
