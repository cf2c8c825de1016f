"""``out = x + y`` for 1-D tensors in CuTe DSL: each thread adds one vector of ``vec`` elements.

The vector is a ``(vec,)`` tile of the operands (``cute.zipped_divide``), loaded and stored whole;
with ``vec`` elements of 16 bytes and operands aligned to them (what the interface file's
metadata requires), those are 128-bit accesses. The length must be a multiple of ``vec``
(the metadata's divisibility covers it), so no vector is partly outside the tensor; threads past
the last vector do nothing.
"""

from __future__ import annotations

import cutlass.cute as cute


class VectorAddImpl:
    """Compile-time configuration: ``vec`` elements per thread, ``threads`` per CTA."""

    def __init__(self, vec: int, threads: int) -> None:
        self.vec = vec
        self.threads = threads

    @cute.jit
    def __call__(self, mX: cute.Tensor, mY: cute.Tensor, mO: cute.Tensor, stream):
        # ((vec), (vectors)): mode 0 one thread's vector, mode 1 which vector.
        gX = cute.zipped_divide(mX, (self.vec,))
        gY = cute.zipped_divide(mY, (self.vec,))
        gO = cute.zipped_divide(mO, (self.vec,))
        grid = cute.ceil_div(cute.size(gO, mode=[1]), self.threads)
        self.kernel(gX, gY, gO).launch(grid=[grid, 1, 1], block=[self.threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, gX: cute.Tensor, gY: cute.Tensor, gO: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        i = bidx * self.threads + tidx
        if i < cute.size(gO, mode=[1]):
            gO[(None, i)].store(gX[(None, i)].load() + gY[(None, i)].load())
