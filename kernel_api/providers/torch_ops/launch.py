"""`LaunchedKernel`: a torch kernel whose every launch is one function of the arguments' tensors
(the norms, the pointwise kernels, cross-entropy), and the launch stream of such functions.

`Kernel._run` and `Kernel._launcher` both call the function `_launch_parts` names, so a launch
that `kernel_api.ops` replays (`Launcher`) is the kernel's own, computed the same way.

The kernels are torch's operators, which run on torch's current stream. A launch function gets
the launch stream last, as every `kernel_api.launcher.Launcher` function does: None from `_run`
callers and replays on the current stream, a CUstream from kernel_api's launch paths, or any
spelling `Kernel.run` accepts. `switch` says whether torch's current stream must change for it,
cheaply when it need not (the common case, and any tensor off CUDA).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from ...core.artifact import CompiledArtifact
from ...core.streams import current_raw_stream, stream_context
from ...launcher import Launcher, raw_stream
from .base import TorchKernel


def switch(t: torch.Tensor, stream: Any) -> Any | None:
    """A context manager making ``stream`` torch's current stream on ``t``'s device, or None
    when there is nothing to do (``stream`` None or already current, ``t`` not on CUDA).

    Args:
        t: an operand of the launch (its device is the launch's).
        stream: the launch stream.
    """
    if stream is None or not t.is_cuda:
        return None
    index = t.get_device()
    if current_raw_stream is not None and raw_stream(stream, index) == current_raw_stream(index):
        return None
    return stream_context(t.device, stream)


def in_type(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t.to(dtype)``, without the call when ``t`` has that dtype already (``to`` returns ``t``
    itself then, after parsing its arguments: a large part of a tiny launch's host time)."""
    return t if t.dtype is dtype else t.to(dtype)


class LaunchedKernel(TorchKernel):
    """A torch kernel launched by one function: ``function(*tensors, *tail, stream)``, the
    arguments' tensors in ``tensor_attributes`` order, the constants ``tail`` fixed by their
    metadata and scalars (`_launch_parts`)."""

    def _launch_parts(self, args: Any) -> tuple[Callable[..., None], tuple]:
        """``(function, tail)`` for ``args``."""
        raise NotImplementedError

    def _run(self, args: Any, artifact: CompiledArtifact, stream: Any, workspace: Any = None) -> None:
        function, tail = self._launch_parts(args)
        function(*[getattr(args, name) for name in args.tensor_attributes], *tail, stream)

    def _launcher(self, args: Any, artifact: CompiledArtifact) -> Launcher:
        function, tail = self._launch_parts(args)
        return Launcher(function, tail)


__all__ = ["LaunchedKernel", "in_type", "switch"]
