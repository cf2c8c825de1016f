"""Row softmax forward and backward in CuTe DSL, the row held in registers.

A CTA handles ``rows_per_cta`` rows with ``threads_per_row`` threads each (one warp per row
for short rows, the whole CTA for long ones). A thread's share of its row is ``nv`` vectors
of ``vec`` elements, spaced one row-group of threads apart, so a warp's accesses are
contiguous; ``vec`` is 16 bytes' worth when the operands are 16-byte aligned. Each input is
read once and each output written once; the math is f32. Elements past the row's end are
never loaded (predicated copies) and read as -inf (forward) or 0 (backward).
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute

LOG2E = 1.4426950408889634


class _RowKernelBase:
    """Compile-time configuration shared by the forward and backward kernels."""

    def __init__(self, dtype, vec: int, nv: int, threads_per_row: int, rows_per_cta: int) -> None:
        self.dtype = dtype
        self.vec = vec
        self.nv = nv
        self.threads_per_row = threads_per_row
        self.rows_per_cta = rows_per_cta
        self.threads = threads_per_row * rows_per_cta
        self.warps_per_row = max(1, threads_per_row // 32)
        self.tile = (rows_per_cta, threads_per_row * vec * nv)

    def _tiled_copy(self):
        atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype,
                                   num_bits_per_copy=self.vec * self.dtype.width)
        thr = cute.make_layout((self.rows_per_cta, self.threads_per_row), stride=(self.threads_per_row, 1))
        val = cute.make_layout((1, self.vec))
        return cute.make_tiled_copy_tv(atom, thr, val)

    @cute.jit
    def _predicate(self, tXcX: cute.Tensor, shape):
        """Per copy vector: is its first element inside the (rows, cols) tensor?"""
        pred = cute.make_rmem_tensor(
            cute.make_layout((1, cute.size(tXcX, mode=[1]), cute.size(tXcX, mode=[2])),
                             stride=(0, cute.size(tXcX, mode=[2]), 1)),
            cutlass.Boolean)
        for i in cutlass.range_constexpr(cute.size(tXcX, mode=[1])):
            for j in cutlass.range_constexpr(cute.size(tXcX, mode=[2])):
                pred[0, i, j] = cute.elem_less(tXcX[0, i, j], shape)
        return pred

    @cute.jit
    def _row_reduce(self, value: cutlass.Float32, red: cute.Tensor, slot: cutlass.Constexpr, is_max: cutlass.Constexpr):
        """Reduce over the threads of a row: shuffles within a warp, then shared memory."""
        if cutlass.const_expr(is_max):
            value = cute.arch.warp_reduction(value, lambda a, b: cute.arch.fmax(a, b))
        else:
            value = cute.arch.warp_reduction(value, lambda a, b: a + b)
        if cutlass.const_expr(self.warps_per_row > 1):
            tidx, _, _ = cute.arch.thread_idx()
            lane = tidx % 32
            warp = tidx // 32
            if lane == 0:
                red[slot, warp] = value
            cute.arch.sync_threads()
            other = cutlass.Float32(-math.inf) if cutlass.const_expr(is_max) else cutlass.Float32(0.0)
            if lane < self.warps_per_row:
                other = red[slot, lane]
            if cutlass.const_expr(is_max):
                value = cute.arch.warp_reduction(other, lambda a, b: cute.arch.fmax(a, b))
            else:
                value = cute.arch.warp_reduction(other, lambda a, b: a + b)
        return value


class RowSoftmaxForward(_RowKernelBase):
    """``out = softmax(x, dim=-1)`` for 2-D (rows, cols) tensors with unit column stride."""

    @cute.jit
    def __call__(self, mX: cute.Tensor, mO: cute.Tensor, stream):
        tiled = self._tiled_copy()
        grid = cute.ceil_div(mX.shape[0], self.rows_per_cta)
        self.kernel(mX, mO, tiled).launch(grid=[grid, 1, 1], block=[self.threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mO: cute.Tensor, tiled: cute.TiledCopy):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        smem = cutlass.memory.SmemAllocator()
        red = smem.allocate_tensor(cutlass.Float32, cute.make_layout((2, 32), stride=(32, 1)), 16)

        gX = cute.local_tile(mX, self.tile, (bidx, 0))
        gO = cute.local_tile(mO, self.tile, (bidx, 0))
        cX = cute.local_tile(cute.make_identity_tensor(mX.shape), self.tile, (bidx, 0))
        thr = tiled.get_slice(tidx)
        tXgX = thr.partition_S(gX)
        tXgO = thr.partition_D(gO)
        tXcX = thr.partition_S(cX)
        pred = self._predicate(tXcX, mX.shape)

        frag = cute.make_fragment_like(tXgX)
        frag.fill(-math.inf)
        cute.copy(tiled, tXgX, frag, pred=pred)
        x = frag.load().to(cutlass.Float32)
        row_max = self._row_reduce(x.reduce(cute.ReductionOp.MAX, -math.inf, 0), red, 0, True)
        e = cute.math.exp2((x - row_max) * LOG2E, fastmath=True)
        total = self._row_reduce(e.reduce(cute.ReductionOp.ADD, 0.0, 0), red, 1, False)
        frag.store((e * (1.0 / total)).to(self.dtype))
        cute.copy(tiled, frag, tXgO, pred=pred)


class RowSoftmaxBackward(_RowKernelBase):
    """``grad_in = out * (grad_out - sum(grad_out * out, dim=-1))`` for 2-D tensors."""

    @cute.jit
    def __call__(self, mG: cute.Tensor, mY: cute.Tensor, mD: cute.Tensor, stream):
        tiled = self._tiled_copy()
        grid = cute.ceil_div(mY.shape[0], self.rows_per_cta)
        self.kernel(mG, mY, mD, tiled).launch(grid=[grid, 1, 1], block=[self.threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mG: cute.Tensor, mY: cute.Tensor, mD: cute.Tensor, tiled: cute.TiledCopy):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        smem = cutlass.memory.SmemAllocator()
        red = smem.allocate_tensor(cutlass.Float32, cute.make_layout((2, 32), stride=(32, 1)), 16)

        gG = cute.local_tile(mG, self.tile, (bidx, 0))
        gY = cute.local_tile(mY, self.tile, (bidx, 0))
        gD = cute.local_tile(mD, self.tile, (bidx, 0))
        cY = cute.local_tile(cute.make_identity_tensor(mY.shape), self.tile, (bidx, 0))
        thr = tiled.get_slice(tidx)
        tGgG = thr.partition_S(gG)
        tYgY = thr.partition_S(gY)
        tDgD = thr.partition_D(gD)
        pred = self._predicate(thr.partition_S(cY), mY.shape)

        fg = cute.make_fragment_like(tGgG)
        fy = cute.make_fragment_like(tYgY)
        fg.fill(0.0)
        fy.fill(0.0)
        cute.copy(tiled, tGgG, fg, pred=pred)
        cute.copy(tiled, tYgY, fy, pred=pred)
        g = fg.load().to(cutlass.Float32)
        y = fy.load().to(cutlass.Float32)
        dot = self._row_reduce((g * y).reduce(cute.ReductionOp.ADD, 0.0, 0), red, 0, False)
        fg.store((y * (g - dot)).to(self.dtype))
        cute.copy(tiled, fg, tDgD, pred=pred)
