"""SIMT (CUDA-core FMA) GEMM in CuTe DSL: the fallback that runs any dtype, layout, alignment.

One CTA computes a (BM, BN) tile of one batch. A and B tiles go through a ``stages``-deep
shared-memory ring: ``cp.async`` when an operand's copy vector is 4, 8 or 16 bytes,
ordinary loads/stores otherwise (16-bit types at alignment 1, or K-major 16-bit operands,
whose elements land transposed in shared memory). Shared memory is M-/N-major (padded by
16 bytes per K row when the global operand is K-major, against bank conflicts), so each
thread reads its fragment with vector loads. Threads hold a (BM/TM) x (BN/TN) register
tile made of 16-byte chunks spread over the CTA tile; 16-bit operands are widened to f32
in registers. The K remainder is handled by making the *first* k-tile the partial one.
The fused epilogue is `epilogue.store_fragment`.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import cpasync

from .epilogue import store_fragment, store_fused
from .fusion import FusionPlan
from .gemm_utils import gemm_operands, k_shifted_tiles, load_next_tile, load_prologue, next_read_slot, partition_g2s


class SimtGemmImpl:
    """Compile-time configuration of one SIMT GEMM instance.

    ``ab_dtype``/``out_dtype``/``acc_dtype``: cutlass numeric types; ``tile``: (BM, BN, BK);
    ``threads_mn``: the CTA's thread grid (TM, TN); ``stages``: shared-memory ring depth;
    ``a_k_major``/``b_k_major``/``out_n_major``: operand layouts; ``align``: element
    alignment the kernel may assume of A and B (pointer, leading dimension, contiguous
    extent); ``spec``: the `EpilogueSpec`.
    """

    def __init__(self, ab_dtype, out_dtype, acc_dtype, tile, threads_mn, stages, a_k_major: bool,
                 b_k_major: bool, out_n_major: bool, align: int, spec) -> None:
        self.ab_dtype, self.out_dtype, self.acc_dtype = ab_dtype, out_dtype, acc_dtype
        self.tile = tuple(tile)
        self.threads_mn = tuple(threads_mn)
        self.num_threads = threads_mn[0] * threads_mn[1]
        self.stages = stages
        self.a_k_major, self.b_k_major, self.out_n_major = a_k_major, b_k_major, out_n_major
        self.align = align
        self.spec = spec
        self.fusion = None  # (an epilogue function: the fused subclass sets it)
        bytes_per = ab_dtype.width // 8
        # elements per 16 bytes: the unit of a thread's fragment chunks and of the K-row padding
        self.chunk16 = 16 // bytes_per
        BM, BN, BK = self.tile
        TM, TN = self.threads_mn
        self.frag_chunk_m = min(self.chunk16, BM // TM)
        self.frag_chunk_n = min(self.chunk16, BN // TN)
        assert BM % (TM * self.frag_chunk_m) == 0 and BN % (TN * self.frag_chunk_n) == 0

    # ---- host side ---------------------------------------------------------------------
    def _smem_layout(self, mn: int, k_major: bool) -> cute.Layout:
        pad = self.chunk16 if k_major else 0
        BK = self.tile[2]
        return cute.make_layout((mn, BK, self.stages), stride=(1, mn + pad, BK * (mn + pad)))

    def _g2s_copy(self, mn: int, k_major: bool):
        """Tiled copy of a (mn, BK) tile from global to M/N-major shared memory."""
        BK = self.tile[2]
        width = self.ab_dtype.width
        if k_major:
            # Elements along K land in different smem columns: one element per copy.
            vec = 1
            thr = cute.make_layout((self.num_threads // BK, BK), stride=(BK, 1))
            val = cute.make_layout((1, 1))
        else:
            vec = min(self.align, 128 // width, mn * BK // self.num_threads)
            along = mn // vec
            thr = cute.make_layout((along, self.num_threads // along), stride=(1, along))
            val = cute.make_layout((vec, 1))
        bits = vec * width
        if bits in (32, 64, 128):
            atom = cute.make_copy_atom(cpasync.CopyG2SOp(), self.ab_dtype, num_bits_per_copy=bits)
        else:
            atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.ab_dtype, num_bits_per_copy=bits)
        return cute.make_tiled_copy_tv(atom, thr, val)

    @cute.jit
    def __call__(self, mA: cute.Tensor, mB: cute.Tensor, mOut: cute.Tensor, mC, mBias, alpha, beta, stream):
        self._host(mA, mB, mOut, mC, mBias, alpha, beta, None, stream)

    @cute.jit
    def _host(self, mA: cute.Tensor, mB: cute.Tensor, mOut: cute.Tensor, mC, mBias, alpha, beta, epi_operands,
              stream):
        """The host side of a launch; ``epi_operands``: an epilogue function's operand tuple, or None."""
        A, B, O, C = gemm_operands(mA, mB, mOut, mC)
        BM, BN, BK = self.tile
        TM, TN = self.threads_mn
        sA_layout = self._smem_layout(BM, self.a_k_major)
        sB_layout = self._smem_layout(BN, self.b_k_major)
        copy_A = self._g2s_copy(BM, self.a_k_major)
        copy_B = self._g2s_copy(BN, self.b_k_major)
        # Thread grid fastest along the output's contiguous mode, for the stores' sake.
        if cutlass.const_expr(self.out_n_major):
            thr = cute.make_layout((TM, TN, 1), stride=(TN, 1, 0))
        else:
            thr = cute.make_layout((TM, TN, 1), stride=(1, TM, 0))
        perm_m = cute.make_layout((TM, self.frag_chunk_m), stride=(self.frag_chunk_m, 1))
        perm_n = cute.make_layout((TN, self.frag_chunk_n), stride=(self.frag_chunk_n, 1))
        tiled_mma = cute.make_tiled_mma(cute.nvgpu.MmaUniversalOp(self.acc_dtype), thr,
                                        permutation_mnk=(perm_m, perm_n, None))
        grid = cute.ceil_div(O.shape, (BM, BN, 1))
        self.kernel(A, B, O, C, mBias, alpha, beta, sA_layout, sB_layout, copy_A, copy_B, tiled_mma,
                    epi_operands).launch(
            grid=[cute.size(grid[0]), cute.size(grid[1]), cute.size(grid[2])],
            block=[self.num_threads, 1, 1], stream=stream)

    # ---- device side -------------------------------------------------------------------
    @cute.kernel
    def kernel(self, A: cute.Tensor, B: cute.Tensor, O: cute.Tensor, C, bias, alpha, beta,
               sA_layout: cute.Layout, sB_layout: cute.Layout, copy_A: cute.TiledCopy, copy_B: cute.TiledCopy,
               tiled_mma: cute.TiledMma, epi_operands):
        BM, BN, BK = self.tile
        S = self.stages
        tidx, _, _ = cute.arch.thread_idx()
        bm, bn, l = cute.arch.block_idx()
        M = A.shape[0]
        N = B.shape[0]

        gA, gB, cA, cB, k_tiles = k_shifted_tiles(A, B, l, self.tile, (bm, bn, None),
                                                  self.align * self.ab_dtype.width // 8)

        smem = cutlass.memory.SmemAllocator()
        sA = smem.allocate_tensor(self.ab_dtype, sA_layout, 16)
        sB = smem.allocate_tensor(self.ab_dtype, sB_layout, 16)
        g2s_A = partition_g2s(copy_A, tidx, gA, sA, cA, M)
        g2s_B = partition_g2s(copy_B, tidx, gB, sB, cB, N)

        # Out-of-range elements are never copied: zero the ring once so they read as 0.
        g2s_A[2].fill(0)
        g2s_B[2].fill(0)
        cute.arch.sync_threads()
        load_prologue(g2s_A, g2s_B, k_tiles, S)

        thr_mma = tiled_mma.get_slice(tidx)
        tCsA = thr_mma.partition_A(sA)  # (1, FRAG_M, BK, S)
        tCsB = thr_mma.partition_B(sB)  # (1, FRAG_N, BK, S)
        tCcO = thr_mma.partition_C(cute.local_tile(cute.make_identity_tensor((M, N)), tiler=self.tile,
                                                   coord=(bm, bn, None), proj=(1, 1, None)))
        acc = cute.make_rmem_tensor(tCcO.shape, self.acc_dtype)
        acc.fill(0.0)
        # Register double buffer of fragments, in the accumulator type.
        rA = cute.make_rmem_tensor(cute.append(tCsA[None, None, 0, 0].shape, 2), self.acc_dtype)
        rB = cute.make_rmem_tensor(cute.append(tCsB[None, None, 0, 0].shape, 2), self.acc_dtype)

        read = 0
        write = S - 1
        next_tile = S - 1
        cute.arch.cp_async_wait_group(S - 2)
        cute.arch.sync_threads()
        rA[None, None, 0].store(tCsA[None, None, 0, 0].load().to(self.acc_dtype))
        rB[None, None, 0].store(tCsB[None, None, 0, 0].load().to(self.acc_dtype))

        for kt in range(k_tiles):
            for kb in cutlass.range_constexpr(BK):
                if cutlass.const_expr(kb == BK - 1):
                    # Next k-tile: wait for its copies, and make everyone's visible.
                    read = next_read_slot(read, S)
                kn = (kb + 1) % BK
                rA[None, None, (kb + 1) % 2].store(tCsA[None, None, kn, read].load().to(self.acc_dtype))
                rB[None, None, (kb + 1) % 2].store(tCsB[None, None, kn, read].load().to(self.acc_dtype))
                if cutlass.const_expr(kb == 0):
                    next_tile, write = load_next_tile(g2s_A, g2s_B, next_tile, write, k_tiles, S)
                cute.gemm(tiled_mma, acc, rA[None, None, kb % 2], rB[None, None, kb % 2], acc)

        cute.arch.cp_async_wait_group(0)
        mO = O[None, None, l]
        mC = None
        if cutlass.const_expr(self.spec.has_c):
            mC = C[None, None, l]
        if cutlass.const_expr(self.fusion is not None):
            store_fused(self.fusion, acc, tCcO, mO, l, epi_operands, M, N)
        else:
            store_fragment(self.spec, acc, tCcO, mO, mC, bias, alpha, beta, M, N)


class SimtGemmFusedImpl(SimtGemmImpl):
    """The kernel with an epilogue function (``spec.fusion``) emitted into its epilogue
    (`store_fused`); the launch takes the function's operand tuple before the stream."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.fusion = FusionPlan(self.spec.fusion)

    @cute.jit
    def __call__(self, mA: cute.Tensor, mB: cute.Tensor, mOut: cute.Tensor, mC, mBias, alpha, beta,
                 epi_operands: tuple, stream):
        self._host(mA, mB, mOut, mC, mBias, alpha, beta, epi_operands, stream)
