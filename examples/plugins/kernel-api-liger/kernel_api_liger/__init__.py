"""kernel-api-liger: Liger-Kernel's Triton kernels as candidates for kernel_api's operations.

Importing it (kernel_api does, through the ``kernel_api.providers`` entry point) registers the
``liger`` provider and its kernel classes:

- `LigerRMSNorm`, `LigerRMSNormF32Weight`: `RMSNormArguments` without a residual, and
  `LigerFusedAddRMSNorm`, `LigerFusedAddRMSNormF32Weight` with one (the fused residual add);
- `LigerLayerNorm`, `LigerLayerNormF32Weight`: `LayerNormArguments` (no fused residual);
- `LigerSwiGLU`, `LigerGeGLU`: `GatedActivationArguments` (``silu``; ``gelu_tanh``), forward;
- `LigerLinearCrossEntropy`: `LinearCrossEntropyArguments` (loss and gradients in one call).

The norms and activations are `kernel_api.providers.triton.TritonKernel`s naming Liger's jit
functions: kernel_api compiles them for the target cc (no GPU needed) into its own disk cache and
launches them through Triton's launcher. The linear cross-entropy runs Liger's own chunk loop.
Liger outside `library.SUPPORTED` (or absent) raises ImportError here, which kernel_api reports
in ``plugin_errors()``.
"""

from .library import PLUGIN_VERSION as __version__
from .provider import LigerProvider
from .norms import (LigerFusedAddRMSNorm, LigerFusedAddRMSNormF32Weight, LigerLayerNorm, LigerLayerNormF32Weight,
                    LigerRMSNorm, LigerRMSNormF32Weight)
from .activations import LigerGeGLU, LigerSwiGLU
from .linear_cross_entropy import LigerLinearCrossEntropy

__all__ = ["LigerFusedAddRMSNorm", "LigerFusedAddRMSNormF32Weight", "LigerGeGLU", "LigerLayerNorm", "LigerLinearCrossEntropy", "LigerLayerNormF32Weight", "LigerProvider", "LigerRMSNorm",
           "LigerRMSNormF32Weight", "LigerSwiGLU", "__version__"]
