"""Public path of `Status`, the outcome of a support check; the code lives in `kernel_api.core.status`.

Kept because user code and the CUTLASS API notebook import ``kernel_api.status``.
"""

from .core.status import Reason, Status

__all__ = ["Reason", "Status"]
