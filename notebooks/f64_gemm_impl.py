"""The CuTe DSL implementation behind notebook 001: a naive float64 GEMM, one thread per output.

It lives in a module (not a notebook cell) for the same reason the library keeps kernel
interfaces and implementations apart: the interface (notebook cell) imports no DSL code at
definition time, and the DSL reads this file's source when it compiles.
"""

import cutlass
import cutlass.cute as cute


class NaiveF64Gemm:
    """``out[l, m, n] = sum_k a[l, m, k] * b[l, k, n]``; a CTA covers a ``tile_m x tile_n`` block."""

    def __init__(self, tile_m: int, tile_n: int):
        self.tile_m, self.tile_n = tile_m, tile_n

    @cute.jit
    def __call__(self, a: cute.Tensor, b: cute.Tensor, out: cute.Tensor, stream):
        l, m, n = out.shape
        grid = ((m + self.tile_m - 1) // self.tile_m, (n + self.tile_n - 1) // self.tile_n, l)
        self.kernel(a, b, out).launch(grid=grid, block=[self.tile_m, self.tile_n, 1], stream=stream)

    @cute.kernel
    def kernel(self, a: cute.Tensor, b: cute.Tensor, out: cute.Tensor):
        l, m, n = out.shape
        bm, bn, bl = cute.arch.block_idx()
        tx, ty, _ = cute.arch.thread_idx()
        row = bm * self.tile_m + tx
        col = bn * self.tile_n + ty
        if row < m and col < n:
            acc = cutlass.Float64(0)
            for k in range(a.shape[2]):
                acc += a[bl, row, k] * b[bl, k, col]
            out[bl, row, col] = acc
