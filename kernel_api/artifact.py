"""Public path of `CompiledArtifact`, what `Kernel.compile` returns; the code lives in `kernel_api.core.artifact`.

Kept because user code and the CUTLASS API notebook import ``kernel_api.artifact``.
"""

from .core.artifact import CompiledArtifact

__all__ = ["CompiledArtifact"]
