"""Torch's tracing guards, which the front door reads on every call: bound once here, so a read
costs one global lookup and the C call, with no Python frame of ours.

- `is_compiling`: Dynamo, ``torch.export`` or AOT tracing is active (three calls inside torch).
- `is_dynamo_compiling`: Dynamo alone; cheaper, and Dynamo folds it to True, so it traces nothing
  after it. The other tracers (``make_fx``, non-strict export, ``FakeTensorMode``) run under
  torch dispatch modes, which `dispatch_mode_depth` counts; calls made under them go through the
  ``torch.library`` ops so that the modes see them.
"""

from __future__ import annotations

import torch

is_compiling = torch.compiler.is_compiling
is_dynamo_compiling = getattr(torch.compiler, "is_dynamo_compiling", is_compiling)
dispatch_mode_depth = getattr(torch._C, "_len_torch_dispatch_stack", lambda: 0)

__all__ = ["dispatch_mode_depth", "is_compiling", "is_dynamo_compiling"]
