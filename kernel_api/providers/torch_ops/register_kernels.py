"""Imports the torch provider's kernels (registering them)."""

from . import kernels  # noqa: F401  (registers TorchGemm, TorchSoftmax, TorchSoftmaxBackward)
from . import norms  # noqa: F401  (registers TorchRMSNorm, TorchLayerNorm and their backwards)
from . import attention  # noqa: F401  (registers TorchAttention)
from . import attention_backward  # noqa: F401  (registers TorchAttentionBackward)
from . import pointwise  # noqa: F401  (registers TorchGatedActivation, TorchRope and their backwards)
from . import cross_entropy  # noqa: F401  (registers TorchCrossEntropy, its backward and TorchLinearCrossEntropy)
