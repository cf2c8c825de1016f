"""QuACK's softmax, forward and backward (``quack.softmax``): a row per CTA or cluster, held in
registers, f32 math.

QuACK compiles one function per dtype and row length N, for rows of whole 16-byte vectors with
pointers and row stride aligned to them; `_supports` checks that (the metadata accepts any
alignment). Rows of any leading shape are seen as (rows, N).
"""

from __future__ import annotations

from typing import Any, Callable

from quack.softmax import Softmax, SoftmaxBackward

from kernel_api import (DataType, KernelMetadata, RowReductionDesignMetadata, SoftmaxArguments,
                        SoftmaxBackwardArguments, Status, TensorAttributes)
from kernel_api.core.status import Reason
from kernel_api.metadata import SoftmaxBackwardOperandsMetadata, SoftmaxOperandsMetadata

from .base import QuackKernel, aligned_rows
from .provider import QuackProvider

DTYPES = (DataType.f32, DataType.f16, DataType.bf16)
#: The longest row offered: QuACK holds a row in one CTA's or cluster's registers
MAX_COLS = 65536


def row_limit(args: Any) -> Status:
    """Whether the rows are at most `MAX_COLS` long.

    Args:
        args: softmax arguments (forward or backward).

    Returns:
        Success, or a failure naming x.
    """
    if args.cols > MAX_COLS:
        return Status.fail(f"operand x: rows of {args.cols} elements, QuACK's softmax is offered up to {MAX_COLS}",
                           kind=Reason.SHAPE, operand="x", actual=args.cols, required=MAX_COLS)
    return Status.success()


def _instances(cls: type, make: Callable[[TensorAttributes], Any],
               metadata_filter: Callable[[KernelMetadata], bool] | None) -> list:
    found = []
    for dtype in DTYPES:
        rows = TensorAttributes(dtype, (0, 1), 1)
        metadata = KernelMetadata(f"{cls.__name__}_{dtype}", cls, make(rows),
                                  design=RowReductionDesignMetadata("block", 128, 16, 1, MAX_COLS),
                                  min_cc=cls.min_cc)
        if metadata_filter is None or metadata_filter(metadata):
            found.append(cls(metadata))
    return found


@QuackProvider.register
class QuackSoftmax(QuackKernel):
    """``quack.softmax.Softmax``: softmax over the last dimension, f32/f16/bf16."""

    supported_args_type = SoftmaxArguments

    @classmethod
    def generate_kernels(cls, metadata_filter: Any, epilogue_args: Any = None, cc: int | None = None) -> list:
        if epilogue_args is not None or (cc is not None and cc < cls.min_cc):
            return []
        return _instances(cls, lambda rows: SoftmaxOperandsMetadata(rows, rows), metadata_filter)

    def _supports(self, args: SoftmaxArguments) -> Status:
        return row_limit(args) and aligned_rows(args, ("x", "out"), whole_vectors=True)

    def build(self, args: Any) -> Any:
        dtype = args.tensor_attributes["x"].dtype.to_cutlass()
        return Softmax.compile(dtype, dtype, args.cols)

    def call(self, function: Any, args: Any) -> None:
        if args.rows:
            function(args.x.view(args.rows, args.cols), args.out.view(args.rows, args.cols))

    def caller(self, function: Any, args: Any) -> Any:
        shape = (args.rows, args.cols)
        if not args.rows:
            return None
        return lambda x, out: function(x.view(shape), out.view(shape))


@QuackProvider.register
class QuackSoftmaxBackward(QuackKernel):
    """``quack.softmax.SoftmaxBackward``: ``grad_in = out * (grad_out - sum(grad_out * out))``."""

    supported_args_type = SoftmaxBackwardArguments

    @classmethod
    def generate_kernels(cls, metadata_filter: Any, epilogue_args: Any = None, cc: int | None = None) -> list:
        if epilogue_args is not None or (cc is not None and cc < cls.min_cc):
            return []
        return _instances(cls, lambda rows: SoftmaxBackwardOperandsMetadata(rows, rows, rows), metadata_filter)

    def _supports(self, args: SoftmaxBackwardArguments) -> Status:
        return row_limit(args) and aligned_rows(args, ("grad_out", "out", "grad_in"), whole_vectors=True)

    def build(self, args: Any) -> Any:
        dtype = args.tensor_attributes["out"].dtype.to_cutlass()
        return SoftmaxBackward.compile(dtype, dtype, dtype, args.cols)

    def call(self, function: Any, args: Any) -> None:
        if args.rows:
            shape = (args.rows, args.cols)
            function(args.grad_out.view(shape), args.out.view(shape), args.grad_in.view(shape))

    def caller(self, function: Any, args: Any) -> Any:
        shape = (args.rows, args.cols)
        if not args.rows:
            return None
        return lambda dy, y, dx: function(dy.view(shape), y.view(shape), dx.view(shape))
