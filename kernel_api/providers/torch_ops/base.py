"""`TorchKernel`: what every kernel of the torch provider shares. Torch's operators need no
compile and no workspace, and their support is decided by the operands metadata alone."""

from __future__ import annotations

from typing import Any

from ...core.artifact import CompiledArtifact
from ...core.status import Status
from ...kernel import Kernel


class TorchKernel(Kernel):
    """Base of the torch provider's kernels: nothing to compile, no workspace, no checks beyond
    the metadata's. Subclasses give ``generate_kernels`` and ``_run`` (and may offer a
    ``_launcher``)."""

    workspace_free = True
    compiles_from_cache_only = True  # (nothing to compile)

    def compile(self, args: Any, cc: int | None = None) -> CompiledArtifact:
        return CompiledArtifact(None, self)

    def get_workspace_size(self, args: Any) -> int:
        return 0

    def _supports(self, args: Any) -> Status:
        return Status.success()


__all__ = ["TorchKernel"]
