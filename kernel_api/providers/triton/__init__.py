"""Triton provider: kernels written as ``@triton.jit`` functions (optional extra ``triton``).

To bring a Triton kernel, subclass `TritonKernel` (``kernel_api.providers.triton.kernel``) and
decorate it with ``@TritonProvider.register``; triton is imported only when a kernel compiles
or launches. The base class implements the `kernel_api.kernel` contract from class
attributes, so a subclass sets:

- ``jit_function``: the ``@triton.jit`` function (an ``@triton.autotune`` one lends its
  ``configs``);
- ``supported_args_type`` (e.g. ``SoftmaxArguments``);
- ``operands``: ``(dtype, divisibility) -> OperandsMetadata`` (e.g. ``softmax_operands``);
- ``launch_args(self, args)``: ``(positional values, constexpr dict)`` for the jit function;
- ``grid(self, args)``: programs along x (, y, z);

and may set ``configs`` (``triton.Config``s), ``dtypes``, ``alignments`` (bytes; default 16
and 1), ``min_cc``/``max_cc``. Each configuration, dtype and alignment is one instance; its
design is a `TritonDesignMetadata` (block sizes, num_warps, num_stages, the alignment the
code assumes). ``compile(args, cc=90)`` builds the cubin without a GPU and caches it in the
disk cache's ``triton`` namespace; launches go through Triton's own launcher (`TritonBinary`).

A jit function that stores something the operation has no operand for (a library kernel's
per-row statistics) gets a `scratch_buffer` in ``launch_args``: recorded launches keep it.

``run`` and ``supports`` are final. Optional hooks, as for every kernel: ``_launcher`` (the
base's records the values ``launch_args`` gives, operands replaced per call), ``compile_key``
(default: the signature, the constexprs, the aligned pointers and cc), ``estimated_cost`` and
``performance_hint``.
"""

import functools
import importlib.metadata
from typing import Any

from ...registry import Provider, register_provider
from ...registry.versions import DefaultVersion
from .design import TritonDesignMetadata
from .kernel import TritonKernel, scratch_buffer


@functools.lru_cache(maxsize=None)
def _triton_version() -> str:
    try:
        return importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        return "absent"


class TritonVersion(DefaultVersion):
    """The provider's version: its package's (kernel_api's) with the installed Triton's, read on
    first use (importing the provider reads no package metadata and imports no triton)."""

    def __get__(self, instance: Any, owner: type) -> str:
        return f"{super().__get__(instance, owner)}+triton-{_triton_version()}"


@register_provider
class TritonProvider(Provider):
    """Kernels written as Triton jit functions, compiled with ``triton.compile`` for a target."""

    name = "triton"
    #: kernel_api's version with Triton's: another Triton compiles other code, so it re-tunes
    version = TritonVersion()


__all__ = ["TritonDesignMetadata", "TritonKernel", "TritonProvider", "scratch_buffer"]
