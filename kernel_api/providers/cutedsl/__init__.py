"""CuTe DSL provider: kernels written in NVIDIA's CuTe DSL, compiled with ``cute.compile``.

``@CuTeDSLProvider.register`` makes a `CuteDslKernel` subclass discoverable. cutlass is
imported only when a kernel compiles.
"""

from ...registry import Provider, register_provider
from . import kernel


@register_provider
class CuTeDSLProvider(Provider):
    """Kernels authored in CuTe DSL."""

    name = "cutedsl"


__all__ = ["CuTeDSLProvider", "kernel"]
