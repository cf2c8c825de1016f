"""Where the cuda_src provider's own kernels live: the interface modules whose import registers
the kernel classes serving each arguments type. Discovery imports a type's modules the first
time it is asked for that type, and all of them when it lists every kernel
(`kernel_api.registry.plugins`); importing this module imports no kernel."""

from ...arguments import AttentionArguments
from ...arguments import CrossEntropyReducedArguments
from ...arguments import (CrossEntropyArguments, CrossEntropyBackwardArguments, GatedActivationArguments,
                          GatedActivationBackwardArguments, GemmArguments, LayerNormArguments,
                          LayerNormBackwardArguments, LinearCrossEntropyArguments, RMSNormArguments,
                          RMSNormBackwardArguments, RopeArguments, RopeBackwardArguments, SoftmaxArguments,
                          SoftmaxBackwardArguments)

# Each softmax module registers a forward and a backward family (softmax_smem: two backwards).
_SOFTMAX = (".kernels.softmax", ".kernels.softmax_split", ".kernels.softmax_smem", ".kernels.softmax_rowgroup",
            ".kernels.softmax_window")
_NORM = (".kernels.norm",)  # CudaRMSNorm, CudaLayerNorm and their backwards
_CROSS_ENTROPY = (".kernels.cross_entropy",)  # CudaCrossEntropy(Reduced), its backward, CudaLinearCrossEntropy

KERNEL_MODULES = {
    SoftmaxArguments: _SOFTMAX,
    SoftmaxBackwardArguments: _SOFTMAX,
    GemmArguments: (".kernels.gemm_small_m", ".kernels.gemm_f64"),  # CudaGemmSmallM, CudaGemmF64
    RMSNormArguments: _NORM,
    LayerNormArguments: _NORM,
    RMSNormBackwardArguments: _NORM,
    LayerNormBackwardArguments: _NORM,
    GatedActivationArguments: (".kernels.swiglu",),  # CudaGatedActivation
    GatedActivationBackwardArguments: (".kernels.swiglu",),  # CudaGatedActivationBackward
    RopeArguments: (".kernels.rope",),  # CudaRope
    RopeBackwardArguments: (".kernels.rope",),  # CudaRopeBackward
    CrossEntropyArguments: _CROSS_ENTROPY,
    CrossEntropyReducedArguments: _CROSS_ENTROPY,
    CrossEntropyBackwardArguments: _CROSS_ENTROPY,
    LinearCrossEntropyArguments: _CROSS_ENTROPY,
    AttentionArguments: (".kernels.attention_decode",),  # CudaAttentionDecode
}
