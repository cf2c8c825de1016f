"""CUDA C++ through NVRTC: `compile_cuda` (``compiler``: source -> cubin, cached on disk in the
``cubin`` namespace) and `CudaLauncher` (``cubin_launcher``: load a cubin's kernel once through
the driver API, launch it on any stream; ``kernel_params`` packs its parameters). Shared by the
cuda_src provider's kernels and by the CuTe DSL provider's helper kernels (the realigned GEMM's
line copies), so neither provider imports the other. ``cuda.core`` and NVRTC are imported only
when something compiles (a cache miss); a cached cubin loads and launches without them.
"""

from .compiler import CompiledCuda, clear_memory_cache, compile_cuda, disk_cache, nvrtc_version
from .cubin_launcher import CudaLauncher

__all__ = ["CompiledCuda", "CudaLauncher", "clear_memory_cache", "compile_cuda", "disk_cache", "nvrtc_version"]
