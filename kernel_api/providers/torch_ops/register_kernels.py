"""Where the torch provider's kernels live: the modules whose import registers the kernel
classes serving each arguments type. Discovery imports a type's modules the first time it is
asked for that type, and all of them when it lists every kernel (`kernel_api.registry.plugins`);
importing this module imports no kernel."""

from ...arguments import CrossEntropyReducedArguments
from ...arguments import (AttentionArguments, AttentionBackwardArguments, CrossEntropyArguments,
                          CrossEntropyBackwardArguments, GatedActivationArguments, GatedActivationBackwardArguments,
                          GemmArguments, LayerNormArguments, LayerNormBackwardArguments, LinearCrossEntropyArguments,
                          RMSNormArguments, RMSNormBackwardArguments, RopeArguments, RopeBackwardArguments,
                          SoftmaxArguments, SoftmaxBackwardArguments)

_KERNELS = (".kernels",)  # TorchGemm, TorchSoftmax, TorchSoftmaxBackward
_NORMS = (".norms",)  # TorchRMSNorm, TorchLayerNorm and their backwards
_POINTWISE = (".pointwise",)  # TorchGatedActivation, TorchRope and their backwards
_CROSS_ENTROPY = (".cross_entropy",)  # TorchCrossEntropy(Reduced), its backward, TorchLinearCrossEntropy

KERNEL_MODULES = {
    GemmArguments: _KERNELS,
    SoftmaxArguments: _KERNELS,
    SoftmaxBackwardArguments: _KERNELS,
    RMSNormArguments: _NORMS,
    LayerNormArguments: _NORMS,
    RMSNormBackwardArguments: _NORMS,
    LayerNormBackwardArguments: _NORMS,
    AttentionArguments: (".attention",),  # TorchAttention
    AttentionBackwardArguments: (".attention_backward",),  # TorchAttentionBackward
    GatedActivationArguments: _POINTWISE,
    GatedActivationBackwardArguments: _POINTWISE,
    RopeArguments: _POINTWISE,
    RopeBackwardArguments: _POINTWISE,
    CrossEntropyArguments: _CROSS_ENTROPY,
    CrossEntropyReducedArguments: _CROSS_ENTROPY,
    CrossEntropyBackwardArguments: _CROSS_ENTROPY,
    LinearCrossEntropyArguments: _CROSS_ENTROPY,
}
