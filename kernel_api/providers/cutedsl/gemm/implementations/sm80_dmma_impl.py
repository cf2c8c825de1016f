"""f64 tensor-core GEMM (DMMA: ``mma.sync`` m16n8k16 or m16n8k8 on sm_90+, m8n8k4 before) in CuTe DSL.

The f64 mode of `Sm80TensorOpGemm`. Global-to-shared movement is the SIMT kernel's
(``cp.async`` of 8 or 16 bytes into an M-/N-major ring, any alignment; K-major operands 4
threads along K, see `Sm80DmmaGemmImpl._g2s_copy`); the math is warp-level: each of WM x WN
warps owns a (BM/WM) x (BN/WN) block of DMMA tiles (16x8 with k16 or k8 steps on sm_90+,
8x8 with k4 steps before). Per k step a lane loads its A values per row tile (rows lane/4
[+8], columns lane%4 [+4, +8, +12]) and B values per column tile into registers (k8/k4:
the whole step double-buffered; k16: see `Sm80DmmaGemmImpl._mainloop_k16`), and issues
one DMMA per tile pair.
Shared-memory lines are padded to 64 bytes modulo 128, so the four K rows a warp reads
fall into two 128-byte wavefronts, the minimum for 256 bytes. The DSL has no f64 MMA atom,
so the instruction is emitted as inline PTX. The fused epilogue is `epilogue.store_fragment`.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass._mlir.dialects import llvm
from cutlass.cute.nvgpu import cpasync
from cutlass.cutlass_dsl import T, dsl_user_op

from .epilogue import store_fragment
from .gemm_utils import (gemm_operands, grouped_tile_coord, k_shifted_tiles, load_next_tile, load_prologue,
                         next_read_slot, partition_g2s)
from .simt_impl import SimtGemmImpl


@dsl_user_op
def dmma_m8n8k4(a, b, c0, c1, *, loc=None, ip=None):
    """One warp-wide ``D = A(8x4) @ B(4x8) + C`` in f64; returns this lane's two D values."""
    res = llvm.inline_asm(
        llvm.StructType.get_literal([T.f64(), T.f64()]),
        [cutlass.Float64(a).ir_value(loc=loc, ip=ip), cutlass.Float64(b).ir_value(loc=loc, ip=ip),
         cutlass.Float64(c0).ir_value(loc=loc, ip=ip), cutlass.Float64(c1).ir_value(loc=loc, ip=ip)],
        "mma.sync.aligned.m8n8k4.row.col.f64.f64.f64.f64 {$0, $1}, {$2}, {$3}, {$4, $5};",
        "=d,=d,d,d,d,d",
        has_side_effects=False,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )
    return (cutlass.Float64(llvm.extractvalue(T.f64(), res, [0], loc=loc, ip=ip)),
            cutlass.Float64(llvm.extractvalue(T.f64(), res, [1], loc=loc, ip=ip)))


@dsl_user_op
def dmma_m16n8k16(a, b, c, *, loc=None, ip=None):
    """``D = A(16x16) @ B(16x8) + C`` in f64 (sm_90+): ``a`` 8 values, ``b`` 4, ``c`` 4 (this
    lane's); returns this lane's four D values."""
    ins = [cutlass.Float64(v).ir_value(loc=loc, ip=ip) for v in (*a, *b, *c)]
    res = llvm.inline_asm(
        llvm.StructType.get_literal([T.f64()] * 4),
        ins,
        "mma.sync.aligned.m16n8k16.row.col.f64.f64.f64.f64 {$0, $1, $2, $3}, {$4, $5, $6, $7, $8, $9, $10, $11}, "
        "{$12, $13, $14, $15}, {$16, $17, $18, $19};",
        "=d,=d,=d,=d," + ",".join(["d"] * 16),
        has_side_effects=False,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )
    return tuple(cutlass.Float64(llvm.extractvalue(T.f64(), res, [i], loc=loc, ip=ip)) for i in range(4))


@dsl_user_op
def dmma_m16n8k8(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3, *, loc=None, ip=None):
    """``D = A(16x8) @ B(8x8) + C`` in f64 (sm_90+); returns this lane's four D values."""
    ins = [cutlass.Float64(v).ir_value(loc=loc, ip=ip) for v in (a0, a1, a2, a3, b0, b1, c0, c1, c2, c3)]
    res = llvm.inline_asm(
        llvm.StructType.get_literal([T.f64()] * 4),
        ins,
        "mma.sync.aligned.m16n8k8.row.col.f64.f64.f64.f64 {$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, "
        "{$10, $11, $12, $13};",
        "=d,=d,=d,=d,d,d,d,d,d,d,d,d,d,d",
        has_side_effects=False,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )
    return tuple(cutlass.Float64(llvm.extractvalue(T.f64(), res, [i], loc=loc, ip=ip)) for i in range(4))


class Sm80DmmaGemmImpl(SimtGemmImpl):
    """Compile-time configuration: ``tile`` (BM, BN, BK), ``warps`` (WM, WN), ``stages``,
    operand layouts, ``align`` (elements of A/B: 1 or 2), the epilogue ``spec``, the target
    ``cc``, ``mma_k``: 16 (m16n8k16, the default) or 8 (m16n8k8) on sm_90+, and ``group``:
    0 for an (M tiles, N tiles, L) grid, else a 1-D tile grid walked ``group`` M-tiles at a
    time (`grouped_tile_coord`: better L2 reuse on large problems)."""

    def __init__(self, tile, warps, stages, a_k_major: bool, b_k_major: bool, out_n_major: bool, align: int,
                 spec, cc: int = 80, mma_k: int | None = None, group: int = 0) -> None:
        # Only the attributes the inherited copy/layout helpers read.
        self.ab_dtype = self.out_dtype = self.acc_dtype = cutlass.Float64
        self.tile = tuple(tile)
        self.warps = tuple(warps)
        self.num_threads = 32 * warps[0] * warps[1]
        self.stages = stages
        self.a_k_major, self.b_k_major, self.out_n_major = a_k_major, b_k_major, out_n_major
        self.align = align
        self.spec = spec
        self.chunk16 = 2
        # sm_90 added the m16n8k8 and m16n8k16 f64 MMAs: four and eight times the work per
        # instruction of m8n8k4 (the only one before). ``mma_k`` picks one for sm_90+.
        self.mma_k = (mma_k or 16) if cc >= 90 else 4
        self.group = group
        assert self.mma_k in (4, 8, 16), self.mma_k
        self.m16 = self.mma_k >= 8
        BM, BN, BK = self.tile
        assert BM % (16 * warps[0]) == 0 and BN % (8 * warps[1]) == 0 and BK % max(8, self.mma_k) == 0 and BK >= 16
        # K-major operands copy (threads / 4) rows at a time (`_g2s_copy`)
        rows = self.num_threads // 4
        assert (not a_k_major or BM % rows == 0) and (not b_k_major or BN % rows == 0)

    def _smem_layout(self, mn: int, k_major: bool) -> cute.Layout:
        line = mn + (8 if mn % 16 == 0 else 0)  # 64 bytes modulo 128: see the module docstring
        BK = self.tile[2]
        return cute.make_layout((mn, BK, self.stages), stride=(1, line, BK * line))

    def _g2s_copy(self, mn: int, k_major: bool):
        """As `SimtGemmImpl._g2s_copy`, but a K-major operand's single-element copies run 4
        along K by (threads / 4) along M/N: a warp reads 8 rows' 32-byte sectors whole, and
        its 32 stores land in 8 consecutive M/N elements of 4 smem lines, the minimum two
        wavefronts for 256 bytes with lines of 64 bytes modulo 128. (A warp along K of one
        row would hit two bank groups 16 times.)"""
        if not k_major:
            return super()._g2s_copy(mn, k_major)
        thr = cute.make_layout((self.num_threads // 4, 4), stride=(4, 1))
        atom = cute.make_copy_atom(cpasync.CopyG2SOp(), self.ab_dtype, num_bits_per_copy=self.ab_dtype.width)
        return cute.make_tiled_copy_tv(atom, thr, cute.make_layout((1, 1)))

    @cute.jit
    def __call__(self, mA: cute.Tensor, mB: cute.Tensor, mOut: cute.Tensor, mC, mBias, alpha, beta, stream):
        A, B, O, C = gemm_operands(mA, mB, mOut, mC)
        BM, BN, BK = self.tile
        grid = cute.ceil_div(O.shape, (BM, BN, 1))
        grid = [cute.size(grid[0]), cute.size(grid[1]), cute.size(grid[2])]
        if cutlass.const_expr(self.group > 0):
            grid = [grid[0] * grid[1], 1, grid[2]]  # tiles in `grouped_tile_coord` order
        self.kernel(A, B, O, C, mBias, alpha, beta, self._smem_layout(BM, self.a_k_major),
                    self._smem_layout(BN, self.b_k_major), self._g2s_copy(BM, self.a_k_major),
                    self._g2s_copy(BN, self.b_k_major)).launch(grid=grid, block=[self.num_threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, A: cute.Tensor, B: cute.Tensor, O: cute.Tensor, C, bias, alpha, beta, sA_layout: cute.Layout,
               sB_layout: cute.Layout, copy_A: cute.TiledCopy, copy_B: cute.TiledCopy):
        BM, BN, BK = self.tile
        WM, WN = self.warps
        TJ = BN // WN // 8  # 8-column DMMA tiles per warp
        S = self.stages
        tidx, _, _ = cute.arch.thread_idx()
        bm, bn, l = cute.arch.block_idx()
        M = A.shape[0]
        N = B.shape[0]
        if cutlass.const_expr(self.group > 0):
            bm, bn = grouped_tile_coord(bm, (M + BM - 1) // BM, (N + BN - 1) // BN, self.group)

        gA, gB, cA, cB, k_tiles = k_shifted_tiles(A, B, l, self.tile, (bm, bn, None), 8 * self.align)

        smem = cutlass.memory.SmemAllocator()
        sA = smem.allocate_tensor(cutlass.Float64, sA_layout, 16)
        sB = smem.allocate_tensor(cutlass.Float64, sB_layout, 16)
        g2s_A = partition_g2s(copy_A, tidx, gA, sA, cA, M)
        g2s_B = partition_g2s(copy_B, tidx, gB, sB, cB, N)
        tAsA, tBsB = g2s_A[2], g2s_B[2]
        tAsA.fill(0)
        tBsB.fill(0)
        cute.arch.sync_threads()
        load_prologue(g2s_A, g2s_B, k_tiles, S)

        warp = tidx // 32
        lane = tidx % 32
        g = lane // 4
        t = lane % 4
        m0 = (warp % WM) * (BM // WM) + g
        n0 = (warp // WM) * (BN // WN) + g
        TI = BM // WM // (16 if cutlass.const_expr(self.m16) else 8)
        V = 4 if cutlass.const_expr(self.m16) else 2
        acc = cute.make_rmem_tensor(cute.make_layout((V, TI, TJ)), cutlass.Float64)
        acc.fill(0.0)
        if cutlass.const_expr(self.mma_k == 16):
            self._mainloop_k16(sA, sB, acc, g2s_A, g2s_B, k_tiles, m0, n0, t)
        else:
            # Per k step a lane holds R rows' worth of A (row halves x k halves) and KH of B.
            KS = BK // 8 if cutlass.const_expr(self.m16) else BK // 4
            R = 4 if cutlass.const_expr(self.m16) else 1
            KH = 2 if cutlass.const_expr(self.m16) else 1
            fa = cute.make_rmem_tensor(cute.make_layout((R, TI, 2)), cutlass.Float64)
            fb = cute.make_rmem_tensor(cute.make_layout((KH, TJ, 2)), cutlass.Float64)

            read = 0
            write = S - 1
            next_tile = S - 1
            cute.arch.cp_async_wait_group(S - 2)
            cute.arch.sync_threads()
            self._load_fragments(sA, sB, fa, fb, m0, n0, t, 0, 0, 0)

            for kt in range(k_tiles):
                for s in cutlass.range_constexpr(KS):
                    if cutlass.const_expr(s == KS - 1):
                        read = next_read_slot(read, S)
                    self._load_fragments(sA, sB, fa, fb, m0, n0, t, (s + 1) % KS, read, (s + 1) % 2)
                    if cutlass.const_expr(s == 0):
                        next_tile, write = load_next_tile(g2s_A, g2s_B, next_tile, write, k_tiles, S)
                    b = s % 2
                    for i in cutlass.range_constexpr(TI):
                        for j in cutlass.range_constexpr(TJ):
                            if cutlass.const_expr(self.m16):
                                d = dmma_m16n8k8(fa[0, i, b], fa[1, i, b], fa[2, i, b], fa[3, i, b], fb[0, j, b],
                                                 fb[1, j, b], acc[0, i, j], acc[1, i, j], acc[2, i, j], acc[3, i, j])
                            else:
                                d = dmma_m8n8k4(fa[0, i, b], fb[0, j, b], acc[0, i, j], acc[1, i, j])
                            for v in cutlass.range_constexpr(V):
                                acc[v, i, j] = d[v]

        cute.arch.cp_async_wait_group(0)
        # This lane's accumulators, as offsets in the column-major (BM, BN) tile from its first
        # one at (m0, n-block + 2t): v -> n + v (and m + 8 for v >= 2 with m16), i -> m + 8 or 16
        # per tile, j -> n + 8 per tile.
        cO = cute.local_tile(cute.make_identity_tensor((M, N)), tiler=self.tile, coord=(bm, bn, None),
                             proj=(1, 1, None))
        cO = cute.domain_offset((m0, n0 - g + 2 * t), cO)
        if cutlass.const_expr(self.m16):
            tCcO = cute.composition(cO, cute.make_layout(((2, 2), TI, TJ), stride=((BM, 8), 16, 8 * BM)))
        else:
            tCcO = cute.composition(cO, cute.make_layout((2, TI, TJ), stride=(BM, 8, 8 * BM)))
        mC = None
        if cutlass.const_expr(self.spec.has_c):
            mC = C[None, None, l]
        store_fragment(self.spec, acc, tCcO, O[None, None, l], mC, bias, alpha, beta, M, N, pairs=self.out_n_major)

    @cute.jit
    def _mainloop_k16(self, sA, sB, acc, g2s_A, g2s_B, k_tiles, m0, n0, t):
        """The main loop with m16n8k16 (sm_90+): ``acc`` (4, TI, TJ) += this CTA's A @ B.

        A whole k step's fragments for a 64x32 warp block would double-buffer into 192
        registers on top of the 128 of the accumulators, so only B (one k step, every column
        tile) and A (one 16-row tile) are double-buffered: A of the next row tile (or step)
        loads while a row's DMMAs run, B of the next step during the last row. The ring's
        barrier follows the DMMAs of a k-tile's last row (every read of its slot is issued by
        then); the next k-tile's first fragments load after it. Where a buffer count per
        k-tile is odd (e.g. one k step per tile), that operand has a single buffer and its next
        fragments load after the DMMAs that read the current ones.
        """
        BK = self.tile[2]
        S = self.stages
        TI = cute.size(acc, mode=[1])
        TJ = cute.size(acc, mode=[2])
        KS = BK // 16
        a_bufs = 2 if cutlass.const_expr(KS * TI % 2 == 0) else 1
        b_bufs = 2 if cutlass.const_expr(KS % 2 == 0) else 1
        fa = cute.make_rmem_tensor(cute.make_layout((8, a_bufs)), cutlass.Float64)
        fb = cute.make_rmem_tensor(cute.make_layout((4, TJ, b_bufs)), cutlass.Float64)

        read = 0
        write = S - 1
        next_tile = S - 1
        cute.arch.cp_async_wait_group(S - 2)
        cute.arch.sync_threads()
        self._load_a16(sA, fa, m0, t, 0, 0, 0, 0)
        self._load_b16(sB, fb, n0, t, 0, 0, 0)
        for kt in range(k_tiles):
            for s in cutlass.range_constexpr(KS):
                for i in cutlass.range_constexpr(TI):
                    ca = (s * TI + i) % a_bufs
                    na = (s * TI + i + 1) % a_bufs
                    cb = s % b_bufs
                    nb = (s + 1) % b_bufs
                    last_row = i == TI - 1
                    # The k-tile's last row: its DMMAs go first, so the pipe has them while the
                    # warp waits at the barrier; then the next k-tile's first fragments load.
                    tile_end = last_row and s == KS - 1
                    # the A row tile (and step) to prefetch: the next row, or row 0 of the next step
                    a_step = s if cutlass.const_expr(i + 1 < TI) else (s + 1) % KS
                    a_row = (i + 1) % TI
                    a_first = na != ca and not tile_end
                    b_first = last_row and nb != cb and not tile_end
                    if cutlass.const_expr(a_first):
                        self._load_a16(sA, fa, m0, t, a_step, a_row, read, na)
                    if cutlass.const_expr(b_first):
                        self._load_b16(sB, fb, n0, t, (s + 1) % KS, read, nb)
                    if cutlass.const_expr(s == 0 and i == 0):
                        next_tile, write = load_next_tile(g2s_A, g2s_B, next_tile, write, k_tiles, S)
                    for j in cutlass.range_constexpr(TJ):
                        d = dmma_m16n8k16([fa[v, ca] for v in range(8)], [fb[v, j, cb] for v in range(4)],
                                          [acc[v, i, j] for v in range(4)])
                        for v in cutlass.range_constexpr(4):
                            acc[v, i, j] = d[v]
                    if cutlass.const_expr(tile_end):
                        read = next_read_slot(read, S)
                    if cutlass.const_expr(not a_first):
                        self._load_a16(sA, fa, m0, t, a_step, a_row, read, na)
                    if cutlass.const_expr(last_row and not b_first):
                        self._load_b16(sB, fb, n0, t, (s + 1) % KS, read, nb)

    @cute.jit
    def _load_a16(self, sA, fa, m0, t, step: cutlass.Constexpr, row: cutlass.Constexpr, stage,
                  buf: cutlass.Constexpr):
        """m16n8k16 A fragment of 16-row tile ``row``, k step ``step``, ring slot ``stage``:
        value v at row g + 8 (v % 2), k t + 4 (v // 2)."""
        k = step * 16 + t
        for v in cutlass.range_constexpr(8):
            fa[v, buf] = sA[m0 + 16 * row + 8 * (v % 2), k + 4 * (v // 2), stage]

    @cute.jit
    def _load_b16(self, sB, fb, n0, t, step: cutlass.Constexpr, stage, buf: cutlass.Constexpr):
        """m16n8k16 B fragments of every 8-column tile: value v at column g, k t + 4 v."""
        k = step * 16 + t
        for j in cutlass.range_constexpr(cute.size(fb, mode=[1])):
            for v in cutlass.range_constexpr(4):
                fb[v, j, buf] = sB[n0 + 8 * j, k + 4 * v, stage]

    @cute.jit
    def _load_fragments(self, sA, sB, fa, fb, m0, n0, t, step: cutlass.Constexpr, stage, buf: cutlass.Constexpr):
        """Fragments of k step ``step`` of ring slot ``stage`` into register buffer ``buf``.

        m8n8k4: A (row g, k t) per 8-row tile, B (k t, column g) per 8-column tile.
        m16n8k8: A rows g, g+8 at k t, t+4 per 16-row tile; B k t, t+4 per 8-column tile.
        """
        TI = cute.size(fa, mode=[1])
        TJ = cute.size(fb, mode=[1])
        if cutlass.const_expr(self.m16):
            k = step * 8 + t
            for i in cutlass.range_constexpr(TI):
                fa[0, i, buf] = sA[m0 + 16 * i, k, stage]
                fa[1, i, buf] = sA[m0 + 16 * i + 8, k, stage]
                fa[2, i, buf] = sA[m0 + 16 * i, k + 4, stage]
                fa[3, i, buf] = sA[m0 + 16 * i + 8, k + 4, stage]
            for j in cutlass.range_constexpr(TJ):
                fb[0, j, buf] = sB[n0 + 8 * j, k, stage]
                fb[1, j, buf] = sB[n0 + 8 * j, k + 4, stage]
        else:
            k = step * 4 + t
            for i in cutlass.range_constexpr(TI):
                fa[0, i, buf] = sA[m0 + 8 * i, k, stage]
            for j in cutlass.range_constexpr(TJ):
                fb[0, j, buf] = sB[n0 + 8 * j, k, stage]
