"""kernel-api-cutlass-operators: NVIDIA cutlass.operators' Hopper GEMMs as kernel_api candidates.

Importing it (kernel_api does, through the ``kernel_api.providers`` entry point) registers the
``cutlass_operators`` provider and `CutlassOperatorsSm90Gemm`: each of nvidia-cutlass-operators'
``Sm90StaticPersistentGemmOperator`` configurations for f16/bf16 `GemmArguments` (sm_90 only).
nvidia-cutlass-operators outside `library.SUPPORTED` (or absent) raises ImportError here, which
kernel_api reports in ``plugin_errors()``.
"""

from .library import PLUGIN_VERSION as __version__
from .provider import CutlassOperatorsProvider
from .gemm import CutlassOperatorsSm90Gemm

__all__ = ["CutlassOperatorsProvider", "CutlassOperatorsSm90Gemm", "__version__"]
