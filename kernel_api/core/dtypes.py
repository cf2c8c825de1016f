"""One vocabulary of element types.

`DataType` values are canonical. `to_dtype` accepts torch dtypes, CuTe DSL numeric types
(``cutlass.Float64`` and friends, recognised by name so that cutlass is never imported
here), canonical names ("bf16") and common aliases ("bfloat16", "float"). Conversions back
to torch or cutlass types happen on demand.
"""

from __future__ import annotations

import enum
from typing import Any

import torch


class DataType(enum.Enum):
    """Canonical element types. The value is the short name used in kernel names."""

    f64 = "f64"
    f32 = "f32"
    tf32 = "tf32"
    #: a math type only: f32 operands as three tf32 products (big*big + big*small + small*big),
    #: about f32 accuracy (kernel metadata's ``math_type``; stored as float32)
    tf32x3 = "tf32x3"
    f16 = "f16"
    bf16 = "bf16"
    e4m3 = "e4m3"
    e5m2 = "e5m2"
    i64 = "i64"
    i32 = "i32"
    i8 = "i8"
    u8 = "u8"

    @property
    def bits(self) -> int:
        return _BITS[self]

    @property
    def bytes(self) -> int:
        return _BITS[self] // 8

    @property
    def is_float(self) -> bool:
        return self in _FLOATS

    def to_torch(self) -> torch.dtype:
        """The torch dtype that stores this type (tf32 is stored as float32)."""
        return _TO_TORCH[self]

    def to_cutlass(self) -> Any:
        """The CuTe DSL numeric type; imports cutlass, so only call it when compiling."""
        import cutlass

        return getattr(cutlass, _CUTLASS_NAMES[self])

    # Members are singletons: identity hashing is correct and, unlike Enum's default
    # (hash of the name, in Python), runs in C. Signatures holding dtypes are hashed on
    # every discovery and run.
    __hash__ = object.__hash__

    def __repr__(self) -> str:
        return f"DataType.{self.name}"

    def __str__(self) -> str:
        return self.value


_BITS = {
    DataType.f64: 64, DataType.f32: 32, DataType.tf32: 32, DataType.tf32x3: 32, DataType.f16: 16, DataType.bf16: 16,
    DataType.e4m3: 8, DataType.e5m2: 8, DataType.i64: 64, DataType.i32: 32, DataType.i8: 8,
    DataType.u8: 8,
}
_FLOATS = frozenset({DataType.f64, DataType.f32, DataType.tf32, DataType.tf32x3, DataType.f16, DataType.bf16,
                     DataType.e4m3, DataType.e5m2})
_TO_TORCH = {
    DataType.f64: torch.float64, DataType.f32: torch.float32, DataType.tf32: torch.float32,
    DataType.tf32x3: torch.float32,
    DataType.f16: torch.float16, DataType.bf16: torch.bfloat16,
    DataType.e4m3: torch.float8_e4m3fn, DataType.e5m2: torch.float8_e5m2,
    DataType.i64: torch.int64, DataType.i32: torch.int32, DataType.i8: torch.int8,
    DataType.u8: torch.uint8,
}
_CUTLASS_NAMES = {
    DataType.f64: "Float64", DataType.f32: "Float32", DataType.tf32: "TFloat32",
    DataType.f16: "Float16", DataType.bf16: "BFloat16", DataType.e4m3: "Float8E4M3FN",
    DataType.e5m2: "Float8E5M2", DataType.i64: "Int64", DataType.i32: "Int32",
    DataType.i8: "Int8", DataType.u8: "Uint8",
}
_FROM_TORCH = {v: k for k, v in _TO_TORCH.items() if k not in (DataType.tf32, DataType.tf32x3)}
_FROM_CUTLASS_NAME = {v: k for k, v in _CUTLASS_NAMES.items()}
_FROM_NAME = {
    **{d.value: d for d in DataType},
    "float64": DataType.f64, "double": DataType.f64, "fp64": DataType.f64,
    "float32": DataType.f32, "float": DataType.f32, "fp32": DataType.f32,
    "tfloat32": DataType.tf32, "3xtf32": DataType.tf32x3,
    "float16": DataType.f16, "half": DataType.f16, "fp16": DataType.f16,
    "bfloat16": DataType.bf16,
    "float8_e4m3fn": DataType.e4m3, "fp8_e4m3": DataType.e4m3,
    "float8_e5m2": DataType.e5m2, "fp8_e5m2": DataType.e5m2,
    "int64": DataType.i64, "int32": DataType.i32, "int8": DataType.i8, "uint8": DataType.u8,
}


def to_dtype(value: Any, what: str = "dtype") -> DataType:
    """Map a torch dtype, a CuTe DSL numeric type, a name or a `DataType` to a `DataType`.

    ``what`` names the operand in the error message, e.g. ``"accumulator_type"``.
    Raises ``TypeError`` for values of the wrong kind and ``ValueError`` for unknown names.
    """
    if isinstance(value, DataType):
        return value
    if isinstance(value, torch.dtype):
        found = _FROM_TORCH.get(value)
        if found is None:
            raise ValueError(f"{what}: torch dtype {value} is not supported by kernel_api")
        return found
    if isinstance(value, str):
        found = _FROM_NAME.get(value.strip().lower().removeprefix("torch."))
        if found is None:
            raise ValueError(
                f"{what}: unknown type name {value!r}; expected one of "
                f"{sorted(d.value for d in DataType)}")
        return found
    # CuTe DSL numeric types are classes such as cutlass.Float64, defined in a module of
    # the cutlass package; recognising them by name keeps cutlass out of this import.
    if isinstance(value, type) and getattr(value, "__module__", "").startswith("cutlass"):
        found = _FROM_CUTLASS_NAME.get(value.__name__)
        if found is None:
            raise ValueError(f"{what}: CuTe DSL type {value.__name__} is not supported by kernel_api")
        return found
    raise TypeError(
        f"{what}: expected a torch dtype, a CuTe DSL numeric type or a type name, "
        f"got {type(value).__name__} {value!r}")


def from_torch(dtype: torch.dtype) -> DataType:
    """Fast path for torch dtypes (used on the hot path of argument construction)."""
    found = _FROM_TORCH.get(dtype)
    if found is None:
        raise ValueError(f"torch dtype {dtype} is not supported by kernel_api")
    return found
