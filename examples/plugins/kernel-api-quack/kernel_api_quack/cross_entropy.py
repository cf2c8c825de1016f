"""QuACK's cross-entropy (``quack.cross_entropy``), forward (per-row loss and log-sum-exp) and
backward (the gradient from the saved lse), for `CrossEntropyArguments` and
`CrossEntropyBackwardArguments`: a row per CTA or cluster, f32 math.

QuACK has neither label smoothing nor a z-loss: `_supports` takes both at 0. Its forward writes
the gradient only unscaled (``p - onehot``), where kernel_api's forward with ``grad_logits``
weighs it by ``grad_loss``, so the forward is offered without the gradient, and the backward
(which takes the per-row weights) for it. QuACK writes the log-sum-exp of ignored rows too;
kernel_api's definition has 0 there, so the forward zeroes those rows' lse after the kernel (a
masked fill over the rows, one pass over ``target``). Operands are aligned as QuACK compiles
them: the logits (and their gradient) to ``gcd(16 bytes, classes)`` elements, of 4 bytes or more.
"""

from __future__ import annotations

from typing import Any

from cutlass import Int32
from quack.cross_entropy import CrossEntropy, CrossEntropyBackward

from kernel_api import DataType, KernelMetadata, RowReductionDesignMetadata, Status, TensorAttributes
from kernel_api.arguments.cross_entropy import CrossEntropyArguments, CrossEntropyBackwardArguments
from kernel_api.core.status import Reason
from kernel_api.metadata.cross_entropy import CrossEntropyBackwardOperandsMetadata, CrossEntropyOperandsMetadata

from .base import QuackKernel, aligned_rows
from .provider import QuackProvider

#: The most classes offered (Llama 3's 128256 and more)
MAX_CLASSES = 262144
_LOGITS = (DataType.f32, DataType.f16, DataType.bf16)
_TARGETS = (DataType.i64, DataType.i32)


def _plain(args: Any) -> Status:
    """Success when the arguments ask only what QuACK computes."""
    for name in ("label_smoothing", "z_loss"):
        if getattr(args, name):
            return Status.fail(f"{name}: {getattr(args, name):g}, QuACK's cross-entropy has none", kind=Reason.OTHER,
                               operand=name, actual=getattr(args, name), required=0.0)
    return aligned_rows(args, ("logits", "grad_logits"))


def _instances(cls: type, make: Any, metadata_filter: Any, cc: Any) -> list:
    if cc is not None and cc < cls.min_cc:
        return []
    found = []
    for dtype in _LOGITS:
        for target in _TARGETS:
            metadata = KernelMetadata(f"{cls.__name__}_{dtype}_{target}", cls,
                                      make(TensorAttributes(dtype, (0, 1), 1), TensorAttributes(target, (1,), 1),
                                           TensorAttributes(DataType.f32, (1,), 1)),
                                      design=RowReductionDesignMetadata("block", 128, 16, 1, MAX_CLASSES),
                                      min_cc=cls.min_cc)
            if metadata_filter is None or metadata_filter(metadata):
                found.append(cls(metadata))
    return found


@QuackProvider.register
class QuackCrossEntropy(QuackKernel):
    """``quack.cross_entropy.CrossEntropy``: per-row loss and lse (no gradient, no smoothing, no z-loss)."""

    supported_args_type = CrossEntropyArguments

    @classmethod
    def generate_kernels(cls, metadata_filter: Any, epilogue_args: Any = None, cc: int | None = None) -> list:
        if epilogue_args is not None:
            return []
        return _instances(cls, lambda x, t, f: CrossEntropyOperandsMetadata(x, t, f, max_classes=MAX_CLASSES,
                                                                            gradient=False), metadata_filter, cc)

    def _supports(self, args: CrossEntropyArguments) -> Status:
        return _plain(args)

    def build(self, args: Any) -> Any:
        attrs = args.tensor_attributes
        return CrossEntropy.compile(attrs["logits"].dtype.to_cutlass(), attrs["target"].dtype.to_cutlass(), None,
                                    args.cols, True, False, None, None)

    def call(self, function: Any, args: Any) -> None:
        if args.rows:
            self.caller(function, args)(args.logits, args.target, args.loss, args.lse)

    def caller(self, function: Any, args: Any) -> Any:
        if not args.rows:
            return None
        shape, rows, ignore = (args.rows, args.cols), (args.rows,), Int32(args.ignore_index)
        ignore_index = args.ignore_index

        def launch(logits: Any, target: Any, loss: Any, lse: Any) -> None:
            target = target.view(rows)
            lse_rows = lse.view(rows)
            function(logits.view(shape), target, None, loss.view(rows), lse_rows, None, None, ignore)
            lse_rows.masked_fill_(target == ignore_index, 0.0)

        return launch


@QuackProvider.register
class QuackCrossEntropyBackward(QuackKernel):
    """``quack.cross_entropy.CrossEntropyBackward``: ``grad_loss * (p - onehot)`` from the saved lse
    (in place or not; no smoothing, no z-loss)."""

    supported_args_type = CrossEntropyBackwardArguments

    @classmethod
    def generate_kernels(cls, metadata_filter: Any, epilogue_args: Any = None, cc: int | None = None) -> list:
        if epilogue_args is not None:
            return []
        return _instances(cls, lambda x, t, f: CrossEntropyBackwardOperandsMetadata(x, t, f, max_classes=MAX_CLASSES),
                          metadata_filter, cc)

    def _supports(self, args: CrossEntropyBackwardArguments) -> Status:
        return _plain(args)

    def build(self, args: Any) -> Any:
        attrs = args.tensor_attributes
        return CrossEntropyBackward.compile(attrs["logits"].dtype.to_cutlass(), attrs["target"].dtype.to_cutlass(),
                                            args.cols, None)

    def call(self, function: Any, args: Any) -> None:
        if args.rows:
            self.caller(function, args)(*args.tensors().values())

    def caller(self, function: Any, args: Any) -> Any:
        if not args.rows:
            return None
        shape, rows, ignore = (args.rows, args.cols), (args.rows,), Int32(args.ignore_index)

        def launch(grad_loss: Any, logits: Any, target: Any, lse: Any, grad_logits: Any) -> None:
            # (grad_loss: one weight per row, or a broadcast scalar: stride 0 stays a view)
            function(logits.view(shape), target.view(rows), grad_loss.reshape(rows), grad_logits.view(shape),
                     lse.view(rows), None, ignore)

        return launch
