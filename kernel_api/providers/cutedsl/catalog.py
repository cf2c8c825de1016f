"""Imports the interface modules of the CuTe DSL provider's own kernels (registering them)."""
from .gemm import simt  # noqa: F401  SimtGemm
from .gemm import sm90_warpspecialized  # noqa: F401  Sm90WarpSpecializedGemm
from .softmax import row_softmax  # noqa: F401  CuteSoftmaxForward / CuteSoftmaxBackward
