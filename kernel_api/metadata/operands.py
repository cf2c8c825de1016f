"""What a kernel instance is and what it accepts, as plain data.

Discovery compares these descriptions with the `TensorAttributes` that an arguments object
records for its operands; nothing here touches a GPU or imports a DSL.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from ..core.dtypes import DataType, to_dtype
from ..core.status import Status

ROW_MAJOR = (0, 0, 1)
COLUMN_MAJOR = (0, 1, 0)


def _normalize_stride_pattern(stride: Any) -> tuple[int, ...]:
    if not isinstance(stride, (tuple, list)) or not stride:
        raise TypeError(f"stride pattern must be a non-empty tuple such as (0, 0, 1), got {stride!r}")
    pattern = tuple(int(s) for s in stride)
    if any(s not in (0, 1) for s in pattern) or sum(pattern) != 1:
        raise ValueError(
            f"stride pattern {stride!r} must mark exactly one contiguous mode with 1 and the rest "
            f"with 0, e.g. (0, 0, 1) for row-major or (0, 1, 0) for column-major")
    return pattern


def pad_pattern(pattern: tuple[int, ...], rank: int) -> tuple[int, ...]:
    """Left-pad a stride pattern with batch modes, so (0, 1) compares equal to (0, 0, 1)."""
    if len(pattern) >= rank:
        return pattern
    return (0,) * (rank - len(pattern)) + pattern


class TensorAttributes:
    """An operand's element type, stride pattern and alignment.

    ``dtype``: a `DataType`, torch dtype, CuTe DSL type (``cutlass.Float64``) or name.
    ``stride``: which mode is contiguous, e.g. ``(0, 0, 1)`` (row-major) or ``(0, 1, 0)``
    (column-major); a rank-2 pattern is compared as if a batch mode were prepended.
    ``divisibility``: in kernel metadata, the element alignment the kernel requires of the
    base pointer, the leading dimensions and the contiguous extent; in arguments, the
    alignment those actually have (a power of two).
    """

    __slots__ = ("dtype", "stride", "divisibility", "_key")

    def __init__(self, dtype: Any, stride: Any, divisibility: int = 1) -> None:
        self.dtype = to_dtype(dtype, "TensorAttributes.dtype")
        self.stride = _normalize_stride_pattern(stride)
        if not isinstance(divisibility, int) or divisibility < 1:
            raise ValueError(f"TensorAttributes.divisibility must be a positive int, got {divisibility!r}")
        self.divisibility = divisibility
        self._key = (self.dtype, self.stride, divisibility)

    @classmethod
    def _trusted(cls, dtype: DataType, stride: tuple[int, ...], divisibility: int) -> "TensorAttributes":
        # Hot path for arguments: the values were computed by us, skip validation.
        obj = object.__new__(cls)
        obj.dtype = dtype
        obj.stride = stride
        obj.divisibility = divisibility
        obj._key = (dtype, stride, divisibility)
        return obj

    @property
    def layout(self) -> str:
        """'t' when the last mode is contiguous (row-major), 'n' otherwise."""
        return "t" if self.stride[-1] == 1 else "n"

    def key(self) -> tuple:
        return self._key

    def accepts(self, actual: "TensorAttributes", operand: str) -> Status:
        """Does a tensor with ``actual`` attributes fit a kernel requiring ``self``?"""
        if actual.dtype is not self.dtype:
            return Status.fail(f"operand {operand}: dtype {actual.dtype} but the kernel takes {self.dtype}")
        rank = max(len(actual.stride), len(self.stride))
        if pad_pattern(actual.stride, rank) != pad_pattern(self.stride, rank):
            return Status.fail(
                f"operand {operand}: stride pattern {actual.stride} ({_layout_word(actual.stride)}) but the "
                f"kernel takes {self.stride} ({_layout_word(self.stride)})")
        if actual.divisibility % self.divisibility:
            return Status.fail(
                f"operand {operand}: aligned to {actual.divisibility} element(s) but the kernel needs "
                f"{self.divisibility} (pointer, leading dimension and contiguous extent)")
        return Status.success()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TensorAttributes) and self.key() == other.key()

    def __hash__(self) -> int:
        return hash(self.key())

    def __repr__(self) -> str:
        return f"TensorAttributes({self.dtype}, stride={self.stride}, divisibility={self.divisibility})"


def _layout_word(pattern: tuple[int, ...]) -> str:
    return "row-major" if pattern[-1] == 1 else "column-major" if len(pattern) > 1 and pattern[-2] == 1 else "batch-contiguous"


class OperandsMetadata:
    """Base of per-operation operand descriptions. Subclasses list their tensor operands."""

    operand_names: ClassVar[tuple[str, ...]] = ()
    arguments_type_name: ClassVar[str] = ""

    def tensor_attributes(self) -> dict[str, TensorAttributes]:
        return {name: getattr(self, name) for name in self.operand_names}

    def supports(self, args: Any) -> Status:
        """Compare each operand's attributes and the scalar types with those of ``args``."""
        for name in self.operand_names:
            status = getattr(self, name).accepts(args.tensor_attributes[name], name)
            if not status:
                return status
        return self._supports_scalars(args)

    def _supports_scalars(self, args: Any) -> Status:
        return Status.success()


class GemmOperandsMetadata(OperandsMetadata):
    """Operands of ``out = A @ B``: attributes of A, B, out and the accumulator type.

    ``math_type`` is the type the multiply runs in when it differs from A's, e.g.
    ``tf32`` for f32 operands on tensor cores, so users can filter such kernels out.
    """

    operand_names = ("A", "B", "out")
    arguments_type_name = "GemmArguments"

    def __init__(self, A: TensorAttributes, B: TensorAttributes, out: TensorAttributes,
                 accumulator_type: Any, math_type: Any = None) -> None:
        for name, value in (("A", A), ("B", B), ("out", out)):
            if not isinstance(value, TensorAttributes):
                raise TypeError(f"GemmOperandsMetadata.{name} must be TensorAttributes, got {type(value).__name__}")
        self.A, self.B, self.out = A, B, out
        self.accumulator_type = to_dtype(accumulator_type, "accumulator_type")
        self.math_type = A.dtype if math_type is None else to_dtype(math_type, "math_type")

    def _supports_scalars(self, args: Any) -> Status:
        if args.accumulator_type is not self.accumulator_type:
            return Status.fail(
                f"accumulator_type {args.accumulator_type} but the kernel accumulates in {self.accumulator_type}")
        return Status.success()

    def __repr__(self) -> str:
        return (f"GemmOperandsMetadata(A={self.A}, B={self.B}, out={self.out}, "
                f"accumulator_type={self.accumulator_type}, math_type={self.math_type})")


class SoftmaxOperandsMetadata(OperandsMetadata):
    """Operands of ``out = softmax(x, dim=-1)``; math in ``accumulator_type`` (f32)."""

    operand_names = ("x", "out")
    arguments_type_name = "SoftmaxArguments"

    def __init__(self, x: TensorAttributes, out: TensorAttributes, accumulator_type: Any = DataType.f32) -> None:
        self.x, self.out = x, out
        self.accumulator_type = to_dtype(accumulator_type, "accumulator_type")

    def __repr__(self) -> str:
        return f"SoftmaxOperandsMetadata(x={self.x}, out={self.out}, accumulator_type={self.accumulator_type})"


class SoftmaxBackwardOperandsMetadata(OperandsMetadata):
    """Operands of ``grad_in = out * (grad_out - sum(grad_out * out, dim=-1))``."""

    operand_names = ("grad_out", "out", "grad_in")
    arguments_type_name = "SoftmaxBackwardArguments"

    def __init__(self, grad_out: TensorAttributes, out: TensorAttributes, grad_in: TensorAttributes,
                 accumulator_type: Any = DataType.f32) -> None:
        self.grad_out, self.out, self.grad_in = grad_out, out, grad_in
        self.accumulator_type = to_dtype(accumulator_type, "accumulator_type")

    def __repr__(self) -> str:
        return (f"SoftmaxBackwardOperandsMetadata(grad_out={self.grad_out}, out={self.out}, "
                f"grad_in={self.grad_in}, accumulator_type={self.accumulator_type})")


def softmax_operands(dtype: Any, divisibility: int, backward: bool = False) -> OperandsMetadata:
    """Operands of a softmax forward (x, out) or backward (grad_out, out, grad_in) kernel whose
    tensors are all row-major of one ``dtype`` and aligned to ``divisibility`` elements; f32 math."""
    attrs = TensorAttributes(dtype, (0, 1), divisibility)
    if backward:
        return SoftmaxBackwardOperandsMetadata(attrs, attrs, attrs, DataType.f32)
    return SoftmaxOperandsMetadata(attrs, attrs, DataType.f32)


@dataclass(frozen=True)
class BLASDesignMetadata:
    """Design knobs of a GEMM kernel instance.

    ``tile_shape`` is the CTA tile (M, N, K); ``cluster_shape`` the thread-block cluster
    (M, N, K). Optional: pipeline ``stages``, a ``schedule`` name (e.g. "cooperative",
    "pingpong", "multistage", "simt"), a rasterisation ``swizzle`` and free-form ``extra``.
    """

    tile_shape: tuple[int, ...]
    cluster_shape: tuple[int, ...] = (1, 1, 1)
    stages: int | None = None
    schedule: str | None = None
    swizzle: int | None = None
    extra: tuple = field(default=())

    def __post_init__(self) -> None:
        object.__setattr__(self, "tile_shape", tuple(self.tile_shape))
        object.__setattr__(self, "cluster_shape", tuple(self.cluster_shape))


@dataclass(frozen=True)
class RowReductionDesignMetadata:
    """Design of a row-wise kernel (softmax): how rows map onto the machine.

    ``strategy``: "warp" (one warp per row), "block" (one CTA per row) or "cluster".
    ``threads_per_row``, ``vector_bytes`` per access, and the row lengths it handles well
    (``min_cols``..``max_cols``; None = unbounded).
    """

    strategy: str
    threads_per_row: int
    vector_bytes: int = 16
    min_cols: int = 1
    max_cols: int | None = None
    extra: tuple = field(default=())


ACTIVATIONS = ("relu", "gelu", "silu")


@dataclass(frozen=True)
class EpilogueMetadata:
    """What a kernel's fused epilogue can do: ``out = act(alpha*acc + beta*C + bias)``.

    ``alpha_beta``: scales (and a C operand when beta != 0) supported; ``bias``: the bias
    kinds supported ("row": one value per output column n, "column": one per row m);
    ``activations``: names from `ACTIVATIONS`.
    """

    alpha_beta: bool = True
    bias: frozenset = frozenset({"row", "column"})
    activations: frozenset = frozenset(ACTIVATIONS)

    def supports(self, epilogue_signature: tuple | None) -> Status:
        if epilogue_signature is None:
            return Status.success()
        scaled, has_c, bias_kind, activation = epilogue_signature[:4]
        if (scaled or has_c) and not self.alpha_beta:
            return Status.fail("epilogue: alpha/beta/C requested but the kernel's epilogue has no scaling")
        if bias_kind is not None and bias_kind not in self.bias:
            return Status.fail(f"epilogue: {bias_kind} bias requested but the kernel supports {sorted(self.bias) or 'none'}")
        if activation is not None and activation not in self.activations:
            return Status.fail(f"epilogue: activation {activation!r} not among the kernel's {sorted(self.activations)}")
        return Status.success()


class KernelMetadata:
    """Everything that identifies a kernel instance and what it accepts.

    ``kernel_name`` encodes what distinguishes the instance; ``kernel_class`` is the
    registered `Kernel` subclass; ``operands`` an `OperandsMetadata`; ``design`` the
    kernel's knobs (e.g. `BLASDesignMetadata`); ``min_cc``/``max_cc`` the architectures it
    runs on; ``epilogue`` an `EpilogueMetadata` or None (no fused epilogue).
    ``provider`` is the name of the provider the class was registered with.
    """

    __slots__ = ("kernel_name", "kernel_class", "operands", "design", "min_cc", "max_cc", "epilogue")

    def __init__(self, kernel_name: str, kernel_class: type, operands: OperandsMetadata, design: Any = None,
                 min_cc: int = 0, max_cc: int | None = None, epilogue: EpilogueMetadata | None = None) -> None:
        if not isinstance(kernel_name, str) or not kernel_name:
            raise TypeError("KernelMetadata.kernel_name must be a non-empty string")
        if not isinstance(operands, OperandsMetadata):
            raise TypeError(f"KernelMetadata.operands must be an OperandsMetadata, got {type(operands).__name__}")
        self.kernel_name = kernel_name
        self.kernel_class = kernel_class
        self.operands = operands
        self.design = design
        self.min_cc = int(min_cc or 0)
        self.max_cc = None if max_cc is None else int(max_cc)
        self.epilogue = epilogue

    @property
    def provider(self) -> str | None:
        provider = getattr(self.kernel_class, "_kernel_api_provider", None)
        return None if provider is None else provider.name

    def supports_cc(self, cc: int | None) -> Status:
        if cc is None:
            return Status.success()
        if cc < self.min_cc:
            return Status.fail(f"needs compute capability >= {self.min_cc}, target is {cc}")
        if self.max_cc is not None and cc > self.max_cc:
            return Status.fail(f"runs on compute capability <= {self.max_cc}, target is {cc}")
        return Status.success()

    def supports(self, args: Any, cc: int | None = None) -> Status:
        """Metadata-level check: operand types, layouts, alignment, epilogue, architecture."""
        expected = self.operands.arguments_type_name
        if expected and type(args).__name__ != expected and not any(
                c.__name__ == expected for c in type(args).__mro__):
            return Status.fail(f"kernel takes {expected}, got {type(args).__name__}")
        status = self.operands.supports(args)
        if not status:
            return status
        epilogue_signature = getattr(args, "epilogue_signature", None)
        if epilogue_signature is not None:
            if self.epilogue is None:
                return Status.fail("epilogue requested but the kernel has no fused epilogue")
            status = self.epilogue.supports(epilogue_signature)
            if not status:
                return status
        return self.supports_cc(cc)

    def __repr__(self) -> str:
        return f"KernelMetadata({self.kernel_name!r}, provider={self.provider!r}, design={self.design!r})"
