"""Torch's tracing guards, which the front door reads on every call: bound once here, so a read
costs one global lookup and the C call, with no Python frame of ours.

- `is_compiling`: Dynamo, ``torch.export`` or AOT tracing is active (three calls inside torch).
- `is_dynamo_compiling`: Dynamo alone; cheaper, and Dynamo folds it to True, so it traces nothing
  after it. The other tracers (``make_fx``, non-strict export, ``FakeTensorMode``) run under
  torch dispatch modes, which `dispatch_mode_depth` counts; calls made under them go through the
  ``torch.library`` ops so that the modes see them.
- `graph_uses_cuda_graphs`: while Dynamo traces, whether the graph it traces is compiled with
  CUDA graphs (``mode="reduce-overhead"`` or Inductor's ``triton.cudagraphs``).
- `assume_constant_result`: what ``torch.compiler.assume_constant_result`` does to a function,
  without importing Dynamo (about 1 s) when kernel_api is imported.
"""

from __future__ import annotations

import sys
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


def graph_uses_cuda_graphs() -> bool:
    """While Dynamo traces a frame: whether its compiler replays the graph as CUDA graphs
    (Inductor's ``triton.cudagraphs``, which ``mode="reduce-overhead"`` and "max-autotune" set),
    read from the compiler's configuration. False outside Dynamo, for other backends, and where
    the running torch does not expose the configuration this way (Dynamo's private structures:
    the answer then errs on the side of the host-cheaper choice)."""
    # (Called from a function Dynamo runs while tracing, where is_dynamo_compiling() reads False.)
    convert = sys.modules.get("torch._dynamo.symbolic_convert")
    if convert is None:
        return False
    try:
        tx = getattr(convert.InstructionTranslator, "current_tx", lambda: None)()
        compiler = tx.output.compiler_fn if tx is not None else None
        read = None
        for _ in range(4):  # (Dynamo's wrappers of the backend: WrapBackendDebug and the like)
            read = getattr(compiler, "get_compiler_config", None)
            if read is not None or compiler is None:
                break
            compiler = getattr(compiler, "compiler_fn", None)
        config = read() if read is not None else None
    except Exception:  # noqa: BLE001 - a torch without these structures: not known
        return False
    return bool(isinstance(config, dict) and config.get("triton.cudagraphs"))


__all__ = ["assume_constant_result", "dispatch_mode_depth", "graph_uses_cuda_graphs", "is_compiling",
           "is_dynamo_compiling"]
