"""Public path of the project"s exception types; the code lives in `kernel_api.core.errors`.

Kept because user code and the CUTLASS API notebook import ``kernel_api.errors``.
"""

from .core.errors import CompilationError, DeviceError, KernelApiError, KernelLaunchError, NoKernelFoundError, RegistrationError, UnsupportedArgumentsError, strip_ansi

__all__ = ["CompilationError", "DeviceError", "KernelApiError", "KernelLaunchError", "NoKernelFoundError", "RegistrationError", "UnsupportedArgumentsError", "strip_ansi"]
