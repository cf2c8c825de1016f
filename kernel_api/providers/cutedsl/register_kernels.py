"""Imports the interface modules of the CuTe DSL provider's own kernels (registering them)."""
from .gemm import sm90_warpspecialized  # noqa: F401  Sm90WarpSpecializedGemm
from .gemm import sm90_realigned  # noqa: F401  Sm90RealignedGemm
from .gemm import sm80_tensorop  # noqa: F401  Sm80TensorOpGemm
from .gemm import simt  # noqa: F401  SimtGemm
from .softmax import row_softmax  # noqa: F401  CuteSoftmaxForward / CuteSoftmaxBackward
