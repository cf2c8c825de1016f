"""The cubin launcher of CUDA source kernels; it lives in `kernel_api.nvrtc.launcher` (shared with
the CuTe DSL provider) and this module keeps the name kernel authors import from here."""

from ...nvrtc.launcher import CudaLauncher

__all__ = ["CudaLauncher"]
