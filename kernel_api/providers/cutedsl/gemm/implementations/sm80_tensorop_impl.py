"""Ampere-style tensor-core GEMM in CuTe DSL (``mma.sync``), for every cc >= 80.

One CTA computes a (BM, BN) tile with WM x WN warps. A and B tiles stream through a
``stages``-deep ring of swizzled shared memory with 16-byte ``cp.async`` copies (so operands
must be 16-byte aligned: 8 half-precision or 4 f32 elements); warps read them with
``ldmatrix`` (transposing for M-/N-major operands) into double-buffered register fragments
and issue ``mma.sync`` m16n8k16 (f16/bf16) or m16n8k8 (tf32, for f32 operands; their low
mantissa bits are ignored by the tensor cores). CTAs walk the tiles in groups of 8 M-tiles
per N column for L2 reuse; the partial K tile is loaded first, so the main loop has no K
checks. The fused epilogue is `epilogue.store_fragment`.
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import cpasync, warp

from .epilogue import store_fragment, store_fused
from .fusion import FusionPlan
from .gemm_utils import (gemm_operands, k_shifted_tiles, load_next_tile, load_prologue, next_read_slot,
                         partition_g2s, grouped_tile_coord)


class Sm80TensorOpGemmImpl:
    """Compile-time configuration of one tensor-core GEMM instance.

    ``ab_dtype``: Float16, BFloat16 or Float32 (then ``tf32`` math); ``out_dtype``;
    ``tile``: (BM, BN, BK); ``warps``: (WM, WN); ``stages``; ``a_k_major``/``b_k_major``/``out_n_major``;
    ``spec``: the `EpilogueSpec`; ``group``: M-tiles per rasterisation group; ``acc_f16``:
    accumulate in f16 (f16 operands; the epilogue then computes in f32 from it).
    """

    def __init__(self, ab_dtype, out_dtype, tile, warps, stages, a_k_major: bool, b_k_major: bool,
                 out_n_major: bool, spec, group: int = 8, acc_f16: bool = False) -> None:
        self.ab_dtype, self.out_dtype = ab_dtype, out_dtype
        self.tf32 = ab_dtype is cutlass.Float32
        self.mma_dtype = cutlass.TFloat32 if self.tf32 else ab_dtype
        self.inst = (16, 8, 8) if self.tf32 else (16, 8, 16)
        self.tile = tuple(tile)
        self.warps = tuple(warps)
        self.num_threads = 32 * warps[0] * warps[1]
        self.stages = stages
        self.a_k_major, self.b_k_major, self.out_n_major = a_k_major, b_k_major, out_n_major
        self.spec = spec
        self.fusion = None  # (an epilogue function: the fused subclass sets it)
        self.group = group
        self.acc_dtype = cutlass.Float16 if acc_f16 else cutlass.Float32
        self.vec = 128 // ab_dtype.width  # elements per 16-byte copy
        BM, BN, BK = self.tile
        assert BM % (16 * warps[0]) == 0 and BN % (16 * warps[1]) == 0 and BK % self.inst[2] == 0

    # ---- host side ---------------------------------------------------------------------
    def _smem_layout(self, mn: int, k_major: bool):
        """(mn, BK, stages) swizzled so 16-byte chunks of 8 consecutive rows hit distinct banks."""
        BK = self.tile[2]
        if cutlass.const_expr(self.tf32 and not k_major):
            # ldmatrix cannot transpose 32-bit elements, so M/N-major tf32 fragments are read
            # with 32-bit loads from a plain layout padded by 8 elements per K line, which
            # spreads one warp's reads over all 32 banks.
            return cute.make_layout((mn, BK, self.stages), stride=(1, mn + 8, BK * (mn + 8)))
        row_elems = 1024 // self.mma_dtype.width  # elements in 128 bytes
        base = int(math.log2(self.vec))
        if k_major:
            width = min(BK, row_elems)
            outer = cute.make_layout((8, width), stride=(width, 1))
        else:
            width = min(mn, row_elems)
            outer = cute.make_layout((width, 8), stride=(1, width))
        bits = min(int(math.log2(width // self.vec)), 3)
        atom = cute.make_composed_layout(cute.make_swizzle(bits, base, 3), 0, outer)
        return cute.tile_to_shape(atom, (mn, BK, self.stages), (0, 1, 2))

    def _g2s_copy(self, mn: int, k_major: bool):
        BK = self.tile[2]
        atom = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), self.mma_dtype,
                                   num_bits_per_copy=128)
        if k_major:
            along = BK // self.vec
            thr = cute.make_layout((self.num_threads // along, along), stride=(along, 1))
            val = cute.make_layout((1, self.vec))
        else:
            along = mn // self.vec
            thr = cute.make_layout((along, self.num_threads // along), stride=(1, along))
            val = cute.make_layout((self.vec, 1))
        return cute.make_tiled_copy_tv(atom, thr, val)

    def _s2r_atom(self, k_major: bool):
        if self.tf32 and not k_major:
            return cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.mma_dtype, num_bits_per_copy=32)
        return cute.make_copy_atom(warp.LdMatrix8x8x16bOp(not k_major, 4), self.mma_dtype)

    @cute.jit
    def __call__(self, mA: cute.Tensor, mB: cute.Tensor, mOut: cute.Tensor, mC, mBias, alpha, beta, stream):
        self._host(mA, mB, mOut, mC, mBias, alpha, beta, None, stream)

    @cute.jit
    def _host(self, mA: cute.Tensor, mB: cute.Tensor, mOut: cute.Tensor, mC, mBias, alpha, beta, epi_operands,
              stream):
        """The host side of a launch; ``epi_operands``: an epilogue function's operand tuple, or None."""
        A, B, O, C = gemm_operands(mA, mB, mOut, mC)
        if cutlass.const_expr(self.tf32):
            A = cute.make_tensor(cute.recast_ptr(A.iterator, dtype=cutlass.TFloat32), A.layout)
            B = cute.make_tensor(cute.recast_ptr(B.iterator, dtype=cutlass.TFloat32), B.layout)
        BM, BN, BK = self.tile
        WM, WN = self.warps
        if cutlass.const_expr(self.tf32):
            op = warp.MmaTF32Op(self.inst)
        else:
            op = warp.MmaF16BF16Op(self.ab_dtype, self.acc_dtype, self.inst)
        # N doubled per warp so that one ldmatrix.x4 feeds two n8 MMAs of B.
        tiled_mma = cute.make_tiled_mma(op, cute.make_layout((WM, WN, 1)),
                                        permutation_mnk=(WM * 16, WN * 16, self.inst[2]))
        m_tiles = (O.shape[0] + BM - 1) // BM
        n_tiles = (O.shape[1] + BN - 1) // BN
        self.kernel(A, B, O, C, mBias, alpha, beta, self._smem_layout(BM, self.a_k_major),
                    self._smem_layout(BN, self.b_k_major), self._g2s_copy(BM, self.a_k_major),
                    self._g2s_copy(BN, self.b_k_major), tiled_mma, epi_operands).launch(
            grid=[m_tiles * n_tiles, 1, O.shape[2]], block=[self.num_threads, 1, 1], stream=stream)

    # ---- device side -------------------------------------------------------------------
    @cute.kernel
    def kernel(self, A: cute.Tensor, B: cute.Tensor, O: cute.Tensor, C, bias, alpha, beta, sA_layout, sB_layout,
               copy_A: cute.TiledCopy, copy_B: cute.TiledCopy, tiled_mma: cute.TiledMma, epi_operands):
        BM, BN, BK = self.tile
        S = self.stages
        tidx, _, _ = cute.arch.thread_idx()
        pid, _, l = cute.arch.block_idx()
        M = A.shape[0]
        N = B.shape[0]
        bm, bn = grouped_tile_coord(pid, (M + BM - 1) // BM, (N + BN - 1) // BN, self.group)
        coord = (bm, bn, None)

        gA, gB, cA, cB, k_tiles = k_shifted_tiles(A, B, l, self.tile, coord, self.vec * self.ab_dtype.width // 8)

        smem = cutlass.memory.SmemAllocator()
        sA = smem.allocate_tensor(self.mma_dtype, sA_layout, 128)
        sB = smem.allocate_tensor(self.mma_dtype, sB_layout, 128)

        g2s_A = partition_g2s(copy_A, tidx, gA, sA, cA, M)
        g2s_B = partition_g2s(copy_B, tidx, gB, sB, cB, N)
        tAsA, tBsB = g2s_A[2], g2s_B[2]

        if cutlass.const_expr(self.tf32):
            # (filling a TFloat32 tensor crashes the DSL 4.8 compiler: fill its f32 view)
            cute.make_tensor(cute.recast_ptr(tAsA.iterator, dtype=cutlass.Float32), tAsA.layout).fill(0)
            cute.make_tensor(cute.recast_ptr(tBsB.iterator, dtype=cutlass.Float32), tBsB.layout).fill(0)
        else:
            tAsA.fill(0)
            tBsB.fill(0)
        cute.arch.sync_threads()
        load_prologue(g2s_A, g2s_B, k_tiles, S)

        thr_mma = tiled_mma.get_slice(tidx)
        tCrA = tiled_mma.make_fragment_A(thr_mma.partition_A(sA)[None, None, None, 0])
        tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(sB)[None, None, None, 0])
        tCcO = thr_mma.partition_C(cute.local_tile(cute.make_identity_tensor((M, N)), tiler=self.tile,
                                                   coord=coord, proj=(1, 1, None)))
        acc = tiled_mma.make_fragment_C(tiled_mma.partition_shape_C((BM, BN)))
        acc.fill(0.0)

        s2r_A = cute.make_tiled_copy_A(self._s2r_atom(self.a_k_major), tiled_mma)
        s2r_B = cute.make_tiled_copy_B(self._s2r_atom(self.b_k_major), tiled_mma)
        thr_s2r_A = s2r_A.get_slice(tidx)
        thr_s2r_B = s2r_B.get_slice(tidx)
        tXsA = thr_s2r_A.partition_S(sA)
        tXrA = thr_s2r_A.retile(tCrA)
        tXsB = thr_s2r_B.partition_S(sB)
        tXrB = thr_s2r_B.retile(tCrB)
        KB = cute.size(tCrA, mode=[2])

        read = 0
        write = S - 1
        next_tile = S - 1
        cute.arch.cp_async_wait_group(S - 2)
        cute.arch.sync_threads()
        cute.copy(s2r_A, tXsA[None, None, 0, 0], tXrA[None, None, 0])
        cute.copy(s2r_B, tXsB[None, None, 0, 0], tXrB[None, None, 0])

        for kt in range(k_tiles):
            for kb in cutlass.range_constexpr(KB):
                if cutlass.const_expr(kb == KB - 1):
                    read = next_read_slot(read, S)
                kn = (kb + 1) % KB
                cute.copy(s2r_A, tXsA[None, None, kn, read], tXrA[None, None, kn])
                cute.copy(s2r_B, tXsB[None, None, kn, read], tXrB[None, None, kn])
                if cutlass.const_expr(kb == 0):
                    next_tile, write = load_next_tile(g2s_A, g2s_B, next_tile, write, k_tiles, S)
                cute.gemm(tiled_mma, acc, tCrA[None, None, kb], tCrB[None, None, kb], acc)

        cute.arch.cp_async_wait_group(0)
        if cutlass.const_expr(self.acc_dtype != cutlass.Float32):
            # f16 accumulation: the epilogue computes in f32
            acc32 = cute.make_rmem_tensor(acc.layout, cutlass.Float32)
            acc32.store(acc.load().to(cutlass.Float32))
            acc = acc32
        mC = None
        if cutlass.const_expr(self.spec.has_c):
            mC = C[None, None, l]
        # Accumulator pairs are adjacent along N: vector stores for a row-major output.
        if cutlass.const_expr(self.fusion is not None):
            store_fused(self.fusion, acc, tCcO, O[None, None, l], l, epi_operands, M, N)
        else:
            store_fragment(self.spec, acc, tCcO, O[None, None, l], mC, bias, alpha, beta, M, N,
                           pairs=self.out_n_major)


class Sm80TensorOpGemmFusedImpl(Sm80TensorOpGemmImpl):
    """The kernel with an epilogue function (``spec.fusion``) emitted into its epilogue
    (`store_fused`); the launch takes the function's operand tuple before the stream."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.fusion = FusionPlan(self.spec.fusion)

    @cute.jit
    def __call__(self, mA: cute.Tensor, mB: cute.Tensor, mOut: cute.Tensor, mC, mBias, alpha, beta,
                 epi_operands: tuple, stream):
        self._host(mA, mB, mOut, mC, mBias, alpha, beta, epi_operands, stream)
