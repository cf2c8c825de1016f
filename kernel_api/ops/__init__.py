"""The front door: call an operation, let the policy in force choose the kernel.

    kernel_api.ops.gemm(A, B, out=out)
    kernel_api.ops.softmax(x)

``dispatch`` holds the functions, the choice cache and the launch records; ``library`` the
``torch.ops.kernel_api.*`` custom ops that ``dispatch`` routes to under tracing and autograd.
``library`` is imported after ``dispatch`` (it registers ops that call into it); ``dispatch``
reaches the custom ops through ``torch.ops.kernel_api`` at call time, so it imports nothing
from ``library``.
"""

from .dispatch import clear_dispatch_cache, gemm, softmax, softmax_backward
from . import library  # noqa: E402,F401  (registers torch.ops.kernel_api.*)

__all__ = ["clear_dispatch_cache", "gemm", "softmax", "softmax_backward"]
