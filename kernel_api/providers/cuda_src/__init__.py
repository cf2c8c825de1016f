"""CUDA C++ source provider: kernels compiled at run time with NVRTC (no build step).

``@CudaSourceProvider.register`` makes a `CudaSourceKernel` subclass discoverable.
cuda.core is imported only when a kernel compiles or launches.
"""

from ...registry import Provider, register_provider


@register_provider
class CudaSourceProvider(Provider):
    """Kernels written as CUDA C++ source and compiled with NVRTC."""

    name = "cuda_src"


__all__ = ["CudaSourceProvider"]
