"""The NVRTC compiler of CUDA source kernels; it lives in `kernel_api.nvrtc.compiler` (shared with
the CuTe DSL provider) and this module keeps the names kernel authors import from here."""

from ...nvrtc.compiler import (CompiledCuda, clear_memory_cache, compile_cuda, default_include_dirs, disk_cache,
                               nvrtc_version)

__all__ = ["CompiledCuda", "clear_memory_cache", "compile_cuda", "default_include_dirs", "disk_cache",
           "nvrtc_version"]
