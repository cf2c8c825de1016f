"""Imports the interface modules of the cuda_src provider's own kernels (registering them)."""

from .kernels import softmax  # noqa: F401,E402  (registers CudaSoftmaxForward / CudaSoftmaxBackward)
from .kernels import gemm_small_m  # noqa: F401,E402  (registers CudaGemmSmallM)
from .kernels import gemm_f64  # noqa: F401,E402  (registers CudaGemmF64)
from .kernels import softmax_split  # noqa: F401,E402  (registers CudaSoftmaxSplitForward / CudaSoftmaxSplitBackward)
from .kernels import softmax_smem  # noqa: F401,E402  (registers the CudaSoftmaxSmem* families)
from .kernels import softmax_rowgroup  # noqa: F401,E402  (registers CudaSoftmaxRowGroupForward / CudaSoftmaxRowGroupBackward)
from .kernels import softmax_window  # noqa: F401,E402  (registers CudaSoftmaxWindowForward / CudaSoftmaxWindowBackward)
from .kernels import norm  # noqa: F401,E402  (registers CudaRMSNorm, CudaLayerNorm and their backwards)
from .kernels import swiglu  # noqa: F401,E402  (registers CudaGatedActivation / CudaGatedActivationBackward)
from .kernels import rope  # noqa: F401,E402  (registers CudaRope / CudaRopeBackward)
from .kernels import cross_entropy  # noqa: F401,E402  (registers CudaCrossEntropy, its backward and CudaLinearCrossEntropy)
from .kernels import attention_decode  # noqa: F401,E402  (registers CudaAttentionDecode)
