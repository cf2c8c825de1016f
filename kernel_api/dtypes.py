"""Public path of the element-type vocabulary; the code lives in `kernel_api.core.dtypes`.

Kept because user code and the CUTLASS API notebook import ``kernel_api.dtypes``.
"""

from .core.dtypes import DataType, from_torch, to_dtype

__all__ = ["DataType", "from_torch", "to_dtype"]
