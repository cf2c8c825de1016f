"""Torch's tracing guards, which the front door reads on every call: bound once here, so a read
costs one global lookup and the C call, with no Python frame of ours.

- `is_compiling`: Dynamo, ``torch.export`` or AOT tracing is active (three calls inside torch).
- `is_dynamo_compiling`: Dynamo alone; cheaper, and Dynamo folds it to True, so it traces nothing
  after it. The other tracers (``make_fx``, non-strict export, ``FakeTensorMode``) run under
  torch dispatch modes, which `dispatch_mode_depth` counts; calls made under them go through the
  ``torch.library`` ops so that the modes see them.
- `assume_constant_result`: what ``torch.compiler.assume_constant_result`` does to a function,
  without importing Dynamo (about 1 s) when kernel_api is imported.
"""

from __future__ import annotations

from typing import Callable

import torch

is_compiling = torch.compiler.is_compiling
is_dynamo_compiling = getattr(torch.compiler, "is_dynamo_compiling", is_compiling)
dispatch_mode_depth = getattr(torch._C, "_len_torch_dispatch_stack", lambda: 0)



def assume_constant_result(fn: Callable) -> Callable:
    """Mark ``fn`` as ``torch.compiler.assume_constant_result`` does: Dynamo calls it while
    tracing and takes its answer as a constant (no guard, no graph break). Set here rather than
    through torch's decorator, which imports Dynamo; tests/test_cold_start.py checks that torch
    still marks functions this way."""
    fn._dynamo_marked_constant = True  # type: ignore[attr-defined]
    return fn


__all__ = ["assume_constant_result", "dispatch_mode_depth", "is_compiling", "is_dynamo_compiling"]
