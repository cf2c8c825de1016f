"""Interface of the CUDA C++ cross-entropy kernels (implementation: cross_entropy.cu beside this
file).

Four registered families, each one instance per logits dtype (f32, f16, bf16) and class index
type (int64, int32), every row length and element alignment (rows are peeled to 16-byte
vectors):

- `CudaCrossEntropy` (`CrossEntropyArguments`): one pass over each row for the loss and lse;
  with ``grad_logits``, a second pass (from L2) writes the gradient, in place or not;
- `CudaCrossEntropyReduced` (`CrossEntropyReducedArguments`): the same kernel reducing the mean
  or the sum in its launch (the last CTA to finish adds the rows' losses, in a fixed order), so
  a reduced call is one recorded launch too;
- `CudaCrossEntropyBackward` (`CrossEntropyBackwardArguments`): the gradient from the saved lse,
  one read and one write of each row;
- `CudaLinearCrossEntropy` (`LinearCrossEntropyArguments`): the chunk loop of
  `kernel_api.arguments.cross_entropy_math` (torch's GEMMs, cuBLAS) with the first family's
  kernel on each chunk, the gradient replacing the chunk's logits in place: the chunk's only
  buffer, in the inputs' dtype.

One CTA per row, its size by the row's bytes (`ROW_THREADS`). The template instance depends on
the row length's bucket, whether the gradient is written and the reduction, so all three are in
the compile key (`name_expression`). The row kernels' launches are recorded (`_launcher`: a
``kernel_api.native.cuda_launch`` function, the row strides and the loss's scalars fixed by the
operands' metadata and the arguments' values), so `kernel_api.ops` replays repeated calls from C.
"""

from __future__ import annotations

import struct
from typing import Any

import numpy as np
import torch

from .... import native

from ....arguments.cross_entropy import (CrossEntropyArguments, CrossEntropyBackwardArguments,
                                         CrossEntropyReducedArguments, LinearCrossEntropyArguments, row_stride)
from ....arguments.cross_entropy_math import linear_cross_entropy_chunks
from ....core.dtypes import DataType
from ....core.status import Status
from ....core.streams import stream_handle
from ....launcher import Launcher
from ....metadata import KernelMetadata, RowReductionDesignMetadata, TensorAttributes
from ....metadata.cross_entropy import (CrossEntropyBackwardOperandsMetadata, CrossEntropyOperandsMetadata,
                                        CrossEntropyReducedOperandsMetadata, LinearCrossEntropyOperandsMetadata)
from ....utils import MAX_GRID_X
from .. import CudaSourceProvider
from ..kernel import CudaSourceKernel

_TYPES = {DataType.f32: "ka_ce::F32", DataType.f16: "ka_ce::F16", DataType.bf16: "ka_ce::BF16"}
_INDEX = {DataType.i64: "long long", DataType.i32: "int"}
_ROWS, _UNIT = (0, 1), (1,)
#: The kernel's REDUCE per reduction.
_REDUCE = {"sum": 1, "mean": 2}
#: The longest row the kernel indexes with 32-bit ints.
MAX_COLS = 2**31 - 1
#: Recorded launches kept per instance (one per operand layout, row count and scalars).
_RECORDED_LIMIT = 256
#: Threads per CTA by row size: (the fewest bytes a row has, threads), first match. Rows past
#: 96 KB get one 1024-thread CTA per SM: the rows in flight (132 of them, 34 MB at 256 KB) stay
#: in L2 for the gradient's pass, and a row's transfers are long enough beside the turn between
#: its passes. Shorter rows get 512 threads, two or three CTAs per SM (40 registers a thread),
#: so one row's reduction and turn overlap another's transfers. Measured (H200, loss and
#: in-place gradient, 1024 rows, DRAM read + write): bf16 rows of 128256 (256 KB) 2.86 TB/s at
#: 1024 threads, 2.58 at 512, 2.30 at 256; rows of 32000 (64 KB) 1.98 at 1024, 2.78 at 512, 2.64
#: at 256. Under 32 KB, 256.
ROW_THREADS = ((96 << 10, 1024), (32 << 10, 512), (0, 256))


def threads_for(cols: int, vec: int) -> int:
    """Threads of the CTA that takes one row of ``cols`` elements (``vec`` per 16 bytes)."""
    row_bytes = cols * (16 // vec)
    return next(threads for least, threads in ROW_THREADS if row_bytes >= least)


def _vec(dtype: DataType) -> int:
    return 16 // dtype.bytes


class _CrossEntropyCuda(CudaSourceKernel):
    source_file = "cross_entropy.cu"
    performance_hint = 1.0

    def __init__(self, metadata: KernelMetadata, params: dict) -> None:
        super().__init__(metadata, params)
        self.dtype: DataType = params["dtype"]
        self.index: DataType = params["index"]

    @classmethod
    def variant_params(cls) -> list[dict]:
        return [dict(dtype=dt, index=it) for dt in _TYPES for it in _INDEX]

    @classmethod
    def instance_name(cls, params: dict) -> str:
        return f"{cls.__name__}_{params['dtype']}_{params['index']}"

    @classmethod
    def check_definition(cls) -> None:
        pass  # names come from name_expression, not kernel_name

    @classmethod
    def make_metadata(cls, params: dict) -> KernelMetadata:
        dt, it = params["dtype"], params["index"]
        design = RowReductionDesignMetadata("block", 1024, 16, 1, None, extra=(("passes", 2), ("peel", True)))
        return KernelMetadata(cls.instance_name(params), cls,
                              cls._operands(TensorAttributes(dt, _ROWS, 1), TensorAttributes(it, _UNIT, 1),
                                            TensorAttributes(DataType.f32, _UNIT, 1)), design=design)

    @staticmethod
    def _operands(x: TensorAttributes, target: TensorAttributes, loss: TensorAttributes) -> Any:
        raise NotImplementedError

    def _mode(self, args: Any) -> int:
        raise NotImplementedError

    def _classes(self, args: Any) -> int:
        return args.cols

    def _reduce(self, args: Any) -> int:
        """The kernel's REDUCE: 0 (none), 1 (sum) or 2 (mean)."""
        return 0

    def name_expression(self, args: Any) -> str:
        vec = _vec(self.dtype)
        threads = threads_for(self._classes(args), vec)
        return (f"ka_ce::ce_rows<{_TYPES[self.dtype]}, {_INDEX[self.index]}, {vec}, {threads}, {self._mode(args)}, "
                f"{self._reduce(args)}>")

    def launch_config(self, args: Any) -> tuple:
        return (max(args.rows, 1), threads_for(self._classes(args), _vec(self.dtype)))

    def launch_plan(self, args: Any, launcher: Any) -> int:
        """The threads per CTA the compiled template takes (its launches use them, whatever
        `threads_for` says later)."""
        return threads_for(self._classes(args), _vec(self.dtype))

    def _supports(self, args: Any) -> Status:
        name = self.metadata.kernel_name
        if args.device.type == "cpu":  # (meta tensors plan and compile like CUDA ones)
            return Status.fail(f"{name}: the operands are on the CPU; the kernel runs on CUDA tensors")
        if self._classes(args) > MAX_COLS:
            return Status.fail(f"{name}: rows of {self._classes(args):,} classes exceed its 2^31-1")
        if args.rows > MAX_GRID_X:
            return Status.fail(f"{name}: {args.rows:,} rows exceed the grid's x limit of 2^31-1")
        return Status.success()

    def estimated_cost(self, args: Any, sm_count: int) -> float:
        return (1.5 if self._mode(args) == 1 else 1.0) / self.performance_hint

    def _launch(self, artifact: Any, stream: int, device: int, rows: int, classes: int, params: tuple) -> None:
        if rows == 0:
            return
        artifact.compiled_obj.launch(stream, device, rows, artifact.extra, 0, params)


def _grad_loss_stride(grad_loss: torch.Tensor) -> int:
    return grad_loss.reshape(-1).stride(0) if grad_loss.numel() > 1 else 0


def _scalars(args: Any) -> tuple:
    """The kernel's last parameters: ignore_index (64-bit), label smoothing and z-loss (f32)."""
    return args.ignore_index, np.float32(args.label_smoothing), np.float32(args.z_loss)


def _device(args: Any) -> int:
    device = args.device.index
    return torch.cuda.current_device() if device is None else device


def _f32_bits(value: float) -> int:
    """A float kernel parameter as `native.cuda_launch` takes a 4-byte constant: its bits."""
    return struct.unpack("<I", struct.pack("<f", value))[0]


def _recorded(kernel: _CrossEntropyCuda, args: Any, artifact: Any, parameters: tuple) -> Launcher | None:
    """The `Launcher` of one row kernel launch with ``parameters`` (`native.cuda_launch`'s
    layout, the tensors in ``args.tensor_attributes`` order), or None for an empty problem (no
    launch) or where no launch can be recorded. Kept per instance, for the artifact and the
    parameters."""
    if args.rows == 0:
        return None
    key = (id(artifact), args.rows, parameters)
    recorded = kernel.__dict__.setdefault("_recorded", {})
    found = recorded.get(key)
    if found is None:
        function = native.cuda_launch(int(artifact.compiled_obj.kernel.handle), len(args.tensor_attributes),
                                      (args.rows, 1, 1), (artifact.extra, 1, 1), 0, parameters)
        if function is None:
            return None
        if len(recorded) >= _RECORDED_LIMIT:
            recorded.clear()
        found = recorded[key] = (Launcher(function), artifact)  # (the artifact kept alive: its id stays unique)
    return found[0]


def _scalar_parameters(args: Any) -> tuple:
    """`_scalars` in `native.cuda_launch`'s layout: ignore_index 64-bit, the floats 32-bit."""
    return (8, args.ignore_index), (4, _f32_bits(args.label_smoothing)), (4, _f32_bits(args.z_loss))


@CudaSourceProvider.register
class CudaCrossEntropy(_CrossEntropyCuda):
    """Per-row cross-entropy loss and lse in one pass over each row; with ``grad_logits`` the
    gradient in a second pass (in place or not). f32 math."""

    supported_args_type = CrossEntropyArguments

    @staticmethod
    def _operands(x: TensorAttributes, target: TensorAttributes, loss: TensorAttributes) -> Any:
        return CrossEntropyOperandsMetadata(x, target, loss)

    def _mode(self, args: Any) -> int:
        return 0 if args.grad_logits is None else 1

    def _run(self, args: CrossEntropyArguments, artifact: Any, stream: Any, workspace: Any = None) -> None:
        device = _device(args)
        grad, gl, lse = args.grad_logits, args.grad_loss, args.lse
        params = (args.logits.data_ptr(), row_stride(args.logits, args.cols), args.target.data_ptr(), args.cols,
                  args.loss.data_ptr(), 0 if lse is None else lse.data_ptr(), 0 if grad is None else grad.data_ptr(),
                  0 if grad is None else row_stride(grad, args.cols), 0 if gl is None else gl.data_ptr(),
                  0 if gl is None else _grad_loss_stride(gl), *_scalars(args))
        self._launch(artifact, stream_handle(stream, device), device, args.rows, args.cols, params)

    def _launcher(self, args: CrossEntropyArguments, artifact: Any) -> Launcher | None:
        """`_run`'s launch recorded: the tensors of ``args.tensor_attributes`` in order (logits,
        target, loss[, lse][, grad_logits, grad_loss])."""
        T, cols, grad, gl = native.TENSOR, args.cols, args.grad_logits, args.grad_loss
        at = {name: (T, i) for i, name in enumerate(args.tensor_attributes)}
        parameters = (at["logits"], (8, row_stride(args.logits, cols)), at["target"], (8, cols), at["loss"],
                      at.get("lse", (8, 0)), at.get("grad_logits", (8, 0)),
                      (8, 0 if grad is None else row_stride(grad, cols)), at.get("grad_loss", (8, 0)),
                      (8, 0 if gl is None else _grad_loss_stride(gl)), *_scalar_parameters(args))
        return _recorded(self, args, artifact, parameters)


@CudaSourceProvider.register
class CudaCrossEntropyReduced(CudaCrossEntropy):
    """`CudaCrossEntropy` reducing the mean or the sum in its launch: each CTA leaves its row's
    loss in the loss buffer's workspace, the last to finish adds them in a fixed order."""

    supported_args_type = CrossEntropyReducedArguments

    @staticmethod
    def _operands(x: TensorAttributes, target: TensorAttributes, loss: TensorAttributes) -> Any:
        return CrossEntropyReducedOperandsMetadata(x, target, loss)

    def _reduce(self, args: Any) -> int:
        return _REDUCE[args.reduction]

    def _supports(self, args: Any) -> Status:
        if args.loss.data_ptr() % 8:
            return Status.fail(f"{self.metadata.kernel_name}: operand loss: its workspace's 64-bit counter needs "
                               f"an 8-byte aligned buffer, got address {args.loss.data_ptr():#x}")
        return super()._supports(args)

    def _run(self, args: CrossEntropyReducedArguments, artifact: Any, stream: Any, workspace: Any = None) -> None:
        if args.rows == 0:  # (no CTA to write it: the mean of nothing, or an empty sum)
            device = _device(args)
            with torch.cuda.stream(torch.cuda.ExternalStream(stream_handle(stream, device), device=device)):
                args.loss.zero_()
                if args.reduction == "mean":
                    args.loss[0] = float("nan")
            return
        super()._run(args, artifact, stream, workspace)


@CudaSourceProvider.register
class CudaCrossEntropyBackward(_CrossEntropyCuda):
    """Cross-entropy's gradient from the saved lse: one read and one write of each row. f32 math."""

    supported_args_type = CrossEntropyBackwardArguments

    @staticmethod
    def _operands(x: TensorAttributes, target: TensorAttributes, loss: TensorAttributes) -> Any:
        return CrossEntropyBackwardOperandsMetadata(x, target, loss)

    def _mode(self, args: Any) -> int:
        return 2

    def estimated_cost(self, args: Any, sm_count: int) -> float:
        return 1.0 / self.performance_hint

    def _run(self, args: CrossEntropyBackwardArguments, artifact: Any, stream: Any, workspace: Any = None) -> None:
        device = _device(args)
        grad, gl = args.grad_logits, args.grad_loss
        params = (args.logits.data_ptr(), row_stride(args.logits, args.cols), args.target.data_ptr(), args.cols,
                  0, args.lse.data_ptr(), grad.data_ptr(), row_stride(grad, args.cols), gl.data_ptr(),
                  _grad_loss_stride(gl), *_scalars(args))
        self._launch(artifact, stream_handle(stream, device), device, args.rows, args.cols, params)

    def _launcher(self, args: CrossEntropyBackwardArguments, artifact: Any) -> Launcher | None:
        """`_run`'s launch recorded: (grad_loss, logits, target, lse, grad_logits)."""
        T, cols = native.TENSOR, args.cols
        parameters = ((T, 1), (8, row_stride(args.logits, cols)), (T, 2), (8, cols), (8, 0), (T, 3), (T, 4),
                      (8, row_stride(args.grad_logits, cols)), (T, 0), (8, _grad_loss_stride(args.grad_loss)),
                      *_scalar_parameters(args))
        return _recorded(self, args, artifact, parameters)


@CudaSourceProvider.register
class CudaLinearCrossEntropy(_CrossEntropyCuda):
    """The fused linear cross-entropy: cuBLAS GEMMs (through torch) over token chunks, this
    provider's row kernel on each chunk, writing the gradient over the chunk's logits."""

    supported_args_type = LinearCrossEntropyArguments

    @staticmethod
    def _operands(x: TensorAttributes, target: TensorAttributes, loss: TensorAttributes) -> Any:
        return LinearCrossEntropyOperandsMetadata(x, x, target, loss)

    def _mode(self, args: Any) -> int:
        return 1 if args.wants_gradient else 0

    def _classes(self, args: Any) -> int:
        return args.vocab

    def estimated_cost(self, args: Any, sm_count: int) -> float:
        gemms = 1 + (args.grad_hidden is not None) + (args.grad_weight is not None)
        return (1.0 + gemms * args.cols / 64.0) / self.performance_hint

    def _run(self, args: LinearCrossEntropyArguments, artifact: Any, stream: Any, workspace: Any = None) -> None:
        device = _device(args)
        handle = stream_handle(stream, device)
        vocab = args.vocab
        scalars = _scalars(args)

        def rows(logits: torch.Tensor, target: torch.Tensor, loss: torch.Tensor, grad_loss: Any) -> None:
            grad = 0 if grad_loss is None else logits.data_ptr()
            params = (logits.data_ptr(), vocab, target.data_ptr(), vocab, loss.data_ptr(), 0, grad, vocab,
                      0 if grad_loss is None else grad_loss.data_ptr(),
                      0 if grad_loss is None else _grad_loss_stride(grad_loss), *scalars)
            self._launch(artifact, handle, device, logits.shape[0], vocab, params)

        if stream is None or isinstance(stream, torch.cuda.Stream):
            context = torch.cuda.stream(stream)
        else:
            context = torch.cuda.stream(torch.cuda.ExternalStream(handle, device=device))
        with context:
            linear_cross_entropy_chunks(args, rows)
