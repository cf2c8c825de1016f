"""Arguments objects: the user's tensors for one operation, validated and summarised.

Construction is on the hot path (a few microseconds): it checks ranks, shapes, devices and
dtypes, and records per operand a `TensorAttributes` (dtype, stride pattern, alignment) plus
a hashable ``signature`` that discovery caches on. No DSL objects, no device sync.

``base`` holds `Arguments` and the operand checks every type shares, ``epilogue`` the fused
GEMM epilogue, ``gemm`` `GemmArguments` (and the summaries `kernel_api.native` recalls),
``softmax`` the softmax family.
"""

from .activations import GatedActivationArguments, GatedActivationBackwardArguments
from .attention import AttentionArguments
from .attention_backward import AttentionBackwardArguments
from .base import Arguments, byte_extent
from .cross_entropy import (CrossEntropyArguments, CrossEntropyBackwardArguments, CrossEntropyReducedArguments,
                            LinearCrossEntropyArguments)
from .epilogue import EpilogueArguments, EpilogueSignature
from .gemm import GemmArguments
from .rope import RopeArguments, RopeBackwardArguments
from .norm import LayerNormArguments, LayerNormBackwardArguments, RMSNormArguments, RMSNormBackwardArguments
from .softmax import SoftmaxArguments, SoftmaxBackwardArguments

__all__ = ["Arguments", "AttentionArguments", "EpilogueArguments", "EpilogueSignature", "GemmArguments",
           "SoftmaxArguments", "SoftmaxBackwardArguments", "byte_extent"]
__all__ += ["AttentionBackwardArguments"]
__all__ += ["LayerNormArguments", "LayerNormBackwardArguments", "RMSNormArguments", "RMSNormBackwardArguments"]
__all__ += ["GatedActivationArguments", "GatedActivationBackwardArguments", "RopeArguments", "RopeBackwardArguments"]
__all__ += ["CrossEntropyArguments", "CrossEntropyBackwardArguments", "CrossEntropyReducedArguments",
            "LinearCrossEntropyArguments"]
