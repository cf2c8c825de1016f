"""Liger's SwiGLU and GeGLU (tanh) forward kernels (one program per row) as `TritonKernel`s, for
`GatedActivationArguments` with ``activation="silu"`` / ``"gelu_tanh"``.

Liger walks rows of the operands' last dimension with one row stride for gate, up and out, the
row length a compile-time constant, its block the next power of two (at most 64K) and its warps
those of `calculate_settings`. It computes ``act(gate)`` in f32, rounds it to up's type and
multiplies in that type: for 16-bit operands one rounding more than kernel_api's definition
(``act(gate) * up`` in f32, rounded once), within the type's tolerance.

The backwards are not offered: Liger's write the gradients over gate and up, where
`GatedActivationBackwardArguments` keeps its inputs.
"""

from __future__ import annotations

from typing import Any

import triton
from liger_kernel.ops.geglu import _geglu_tanh_forward_kernel
from liger_kernel.ops.swiglu import _swiglu_forward_kernel

from kernel_api import DataType, Status, TensorAttributes
from kernel_api.arguments.activations import GatedActivationArguments
from kernel_api.core.status import Reason
from kernel_api.metadata.activations import GatedActivationOperandsMetadata
from kernel_api.providers.triton import TritonKernel

from .norms import MAX_COLS, liger_warps, row_stride
from .provider import LigerProvider


def rows_of(args: Any) -> tuple[int, int, int | None]:
    """The rows Liger walks: over the operands' own last dimension (the arguments merge dense
    operands into one row).

    Args:
        args: gated activation arguments.

    Returns:
        (rows, cols, the row stride gate, up and out share, or None where they differ).
    """
    cols = args.gate.shape[-1]
    rows = args.gate.numel() // cols if cols else 0
    strides = {row_stride(t, rows, cols) for t in (args.gate, args.up, args.out)}
    return rows, cols, strides.pop() if len(strides) == 1 else None


class _LigerGated(TritonKernel):
    """One program per row, Liger's block and warps."""

    configs = [triton.Config({}, num_warps=w) for w in (4, 8, 16, 32)]
    dtypes = (DataType.f32, DataType.f16, DataType.bf16)
    activation = ""
    performance_hint = 0.5

    @classmethod
    def operands_for(cls, dtype: DataType, divisibility: int) -> Any:
        rows = TensorAttributes(dtype, (0, 1), divisibility)
        return GatedActivationOperandsMetadata(rows, rows, rows, activations=(cls.activation,))

    def _supports(self, args: Any) -> Status:
        rows, cols, stride = rows_of(args)
        if cols > MAX_COLS:
            return Status.fail(f"operand gate: rows of {cols} elements, Liger's block takes at most {MAX_COLS}",
                               kind=Reason.SHAPE, operand="gate", actual=cols, required=MAX_COLS)
        if stride is None:
            return Status.fail("operand out: Liger walks gate, up and out with one row stride; theirs differ",
                               kind=Reason.LAYOUT, operand="out")
        warps = liger_warps(cols)
        if self.metadata.design.num_warps != warps:
            return Status.fail(f"operand gate: Liger runs rows of {cols} elements with {warps} warps, this instance "
                               f"with {self.metadata.design.num_warps}", kind=Reason.SHAPE, operand="gate",
                               actual=self.metadata.design.num_warps, required=warps)
        return Status.success()

    def grid(self, args: Any) -> tuple[int, ...]:
        return (rows_of(args)[0],)


@LigerProvider.register
class LigerSwiGLU(_LigerGated):
    """Liger's ``_swiglu_forward_kernel``: ``silu(gate) * up``, one row per program."""

    jit_function = _swiglu_forward_kernel
    supported_args_type = GatedActivationArguments
    activation = "silu"

    def launch_args(self, args: Any) -> tuple:
        _, cols, stride = rows_of(args)
        return (args.gate, args.up, args.out, stride, 1.0, cols), {"BLOCK_SIZE": triton.next_power_of_2(cols)}


@LigerProvider.register
class LigerGeGLU(_LigerGated):
    """Liger's ``_geglu_tanh_forward_kernel``: ``gelu_tanh(gate) * up``, one row per program."""

    jit_function = _geglu_tanh_forward_kernel
    supported_args_type = GatedActivationArguments
    activation = "gelu_tanh"

    def launch_args(self, args: Any) -> tuple:
        _, cols, stride = rows_of(args)
        return (args.gate, args.up, args.out, stride, cols), {"BLOCK_SIZE": triton.next_power_of_2(cols)}
