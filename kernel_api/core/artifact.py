"""What `Kernel.compile` returns: the compiled object plus the kernel it belongs to."""

from __future__ import annotations

from typing import Any


class CompiledArtifact:
    """A compiled kernel ready to launch.

    ``compiled_obj`` is whatever the provider produced (a CuTe DSL compiled function, a
    loaded cubin...); ``kernel`` is the `Kernel` instance that compiled it. Providers may
    attach precomputed launch state in ``extra`` so that ``run`` does no work it could
    have done at compile time.
    """

    __slots__ = ("compiled_obj", "kernel", "cc", "extra")

    def __init__(self, compiled_obj: Any, kernel: Any, cc: int | None = None, extra: Any = None) -> None:
        self.compiled_obj = compiled_obj
        self.kernel = kernel
        self.cc = cc
        self.extra = extra

    def __repr__(self) -> str:
        name = getattr(getattr(self.kernel, "metadata", None), "kernel_name", type(self.kernel).__name__)
        return f"CompiledArtifact({name}, cc={self.cc})"
