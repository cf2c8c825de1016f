"""Where the CuTe DSL provider's own kernels live: the interface modules whose import registers
the kernel classes serving each arguments type. Discovery imports a type's modules the first
time it is asked for that type, and all of them when it lists every kernel
(`kernel_api.registry.plugins`); importing this module imports no kernel."""

from ...arguments import AttentionArguments, GemmArguments, SoftmaxArguments, SoftmaxBackwardArguments

_SOFTMAX = (".softmax.row_softmax",)  # CuteSoftmaxForward / CuteSoftmaxBackward

KERNEL_MODULES = {
    # Sm90WarpSpecializedGemm, Sm90RealignedGemm, Sm80TensorOpGemm, SimtGemm
    GemmArguments: (".gemm.sm90_warpspecialized", ".gemm.sm90_realigned", ".gemm.sm80_tensorop", ".gemm.simt"),
    SoftmaxArguments: _SOFTMAX,
    SoftmaxBackwardArguments: _SOFTMAX,
    AttentionArguments: (".attention.sm90_attention",),  # Sm90Attention
}
