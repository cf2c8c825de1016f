"""kernel-api-quack: QuACK's CuTe DSL kernels as candidates for kernel_api's operations.

Importing it (kernel_api does, through the ``kernel_api.providers`` entry point) registers the
``quack`` provider and its kernel classes:

- `QuackSoftmax`, `QuackSoftmaxBackward`: `SoftmaxArguments`, `SoftmaxBackwardArguments`;
- `QuackRMSNorm`, `QuackLayerNorm`: `RMSNormArguments`, `LayerNormArguments` (with the fused
  residual add);
- `QuackCrossEntropy`, `QuackCrossEntropyBackward`: `CrossEntropyArguments` (loss and lse, no
  gradient), `CrossEntropyBackwardArguments` (no label smoothing, no z-loss);
- `QuackGemm`: `GemmArguments` (f16/bf16, sm_90+).

QuACK compiles with its own JIT for the GPU it runs on (``compile`` is that warm-up and refuses
other targets). QuACK outside `library.SUPPORTED` (or absent) raises ImportError here, which
kernel_api reports in ``plugin_errors()``.
"""

from .library import PLUGIN_VERSION as __version__
from .provider import QuackProvider
from .softmax import QuackSoftmax, QuackSoftmaxBackward
from .norms import QuackLayerNorm, QuackRMSNorm
from .cross_entropy import QuackCrossEntropy, QuackCrossEntropyBackward
from .gemm import QuackGemm

__all__ = ["QuackCrossEntropy", "QuackCrossEntropyBackward", "QuackGemm", "QuackLayerNorm", "QuackProvider", "QuackRMSNorm", "QuackSoftmax", "QuackSoftmaxBackward",
           "__version__"]
