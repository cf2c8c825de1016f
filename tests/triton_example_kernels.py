"""Example Triton kernels for the tests: row softmaxes over `SoftmaxArguments`, registered with
``@TritonProvider.register`` by `define_kernels` (so a test registers them for its own duration
and unregisters them after: other tests' choices never see them).

- `row_softmax`: one program per row, the whole row in one block (rows of up to `MAX_COLS`);
  its configurations are given as ``triton.Config``s (num_warps 4 and 8).
- `looped_softmax`: one program per row, any row length, in blocks of ``BLOCK`` (an online
  max and sum, then a second pass); its configurations come from its ``@triton.autotune``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kernel_api import SoftmaxArguments
from kernel_api.core.status import Status
from kernel_api.metadata import softmax_operands
from kernel_api.providers.triton import TritonKernel, TritonProvider

MAX_COLS = 16384  # the single-block kernel's longest row (its registers)


@triton.jit
def row_softmax(out_ptr, x_ptr, x_row_stride, out_row_stride, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=-float("inf")).to(tl.float32)
    num = tl.exp(x - tl.max(x, axis=0))
    y = num / tl.sum(num, axis=0)
    tl.store(out_ptr + row * out_row_stride + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.autotune(configs=[triton.Config({"BLOCK": 512}, num_warps=4, num_stages=2),
                          triton.Config({"BLOCK": 2048}, num_warps=8, num_stages=3)], key=["n_cols"])
@triton.jit
def looped_softmax(out_ptr, x_ptr, x_row_stride, out_row_stride, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * x_row_stride
    m_i = tl.full([BLOCK], -float("inf"), tl.float32)
    l_i = tl.zeros([BLOCK], tl.float32)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(x_row + cols, mask=cols < n_cols, other=-float("inf")).to(tl.float32)
        m_new = tl.maximum(m_i, x)
        alpha = tl.where(m_i == -float("inf"), 0.0, tl.exp(m_i - m_new))
        p = tl.where(x == -float("inf"), 0.0, tl.exp(x - m_new))
        l_i = l_i * alpha + p
        m_i = m_new
    m = tl.max(m_i, axis=0)
    l = tl.sum(tl.where(m_i == -float("inf"), 0.0, l_i * tl.exp(m_i - m)), axis=0)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(x_row + cols, mask=mask, other=-float("inf")).to(tl.float32)
        y = tl.exp(x - m) / l
        tl.store(out_ptr + row * out_row_stride + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def row_strides(args: SoftmaxArguments) -> tuple[int, int]:
    """The row strides (elements) of x and out; rows are evenly spaced (`SoftmaxArguments`)."""
    if args.rows <= 1 or args.cols == 0:
        return args.cols, args.cols
    return args.x.view(args.rows, args.cols).stride(0), args.cols


def define_kernels() -> tuple[type, type]:
    """Define and register both example families (again: a class of the same qualified name
    registered again replaces the old one).

    Returns:
        ``(TritonRowSoftmax, TritonLoopedSoftmax)``.
    """

    @TritonProvider.register
    class TritonRowSoftmax(TritonKernel):
        """softmax(x, dim=-1), a row per program, the row in one block."""

        jit_function = row_softmax
        configs = [triton.Config({}, num_warps=4), triton.Config({}, num_warps=8)]
        supported_args_type = SoftmaxArguments
        operands = softmax_operands

        def launch_args(self, args):
            return (args.out, args.x, *row_strides(args), args.cols), {"BLOCK": triton.next_power_of_2(args.cols)}

        def grid(self, args):
            return (args.rows,)

        def _supports(self, args):
            if args.cols > MAX_COLS:
                return Status.fail(f"{self.metadata.kernel_name}: rows of {args.cols} elements exceed its {MAX_COLS}")
            return Status.success()

    @TritonProvider.register
    class TritonLoopedSoftmax(TritonKernel):
        """softmax(x, dim=-1), a row per program, in blocks of BLOCK (configs of its autotuner)."""

        jit_function = looped_softmax
        supported_args_type = SoftmaxArguments
        operands = softmax_operands

        def launch_args(self, args):
            return (args.out, args.x, *row_strides(args), args.cols), {}

        def grid(self, args):
            return (args.rows,)

    return TritonRowSoftmax, TritonLoopedSoftmax


def unregister(*classes: type) -> None:
    """Unregister the example families."""
    for cls in classes:
        TritonProvider.unregister(cls)
