"""Persistent, warp-specialized TMA + WGMMA GEMM for sm_90a, written in CuTe DSL.

``out = act(alpha * (A @ B) + beta * C + bias)`` with f16/bf16 operands, f32 accumulation and
f16/bf16/f32 output, batched over L. f32 operands run in tf32 (``wgmma ... .tf32``, K tile 32,
A and B K-major: the tf32 wgmma cannot transpose 32-bit operands in shared memory), or, with
``split3``, as 3xTF32: a pre-pass (`_split_kernel`) writes ``[small | big | big]`` of A and
``[big | small | big]`` of B along K into the workspace (big = the operand rounded to tf32,
small = the remainder rounded to tf32), and the same kernel multiplies those with K' = 3K, so
``big_a big_b + big_a small_b + small_a big_b`` is summed in f32, the small products first.

The tensor cores' f32 accumulation is not IEEE (partial sums are truncated, not rounded), so
an accumulator carried through a long K chain drifts linearly with K: 3xTF32 measured 9.6e-6
norm-wise at K = 4096, 8x cuBLAS FP32. ``promote_every = n`` keeps the wgmma accumulator to n
k-tiles: it restarts from zero (scale-d = 0) every n k-tiles and, once those wgmmas are done
(``wgmma.wait_group 0``), is added into a second f32 register accumulator with ordinary
(round-to-nearest) FADDs, as FP8 GEMMs promote their partial sums. It needs twice the
accumulator registers (64 x N x 2 words per warpgroup), so only tiles whose warpgroup share is
64 x 128 take it.

Structure of one CTA (384 threads, one CTA per SM, grid = as many clusters as fit at once):

- warpgroup 0 is the producer: its first warp walks the CTA's tiles and issues TMA loads of
  A and B k-tiles into a ring of ``ab_stages`` shared-memory stages, each guarded by a "full"
  mbarrier (TMA transaction count) and an "empty" mbarrier (consumer release). With a 2x1 or
  1x2 cluster, each CTA loads a slice of the operand its cluster peers share and multicasts
  it to them. The warpgroup gives most of its registers away (setmaxnreg).
- warpgroups 1 and 2 are consumers issuing ``wgmma`` straight from shared memory.
  *cooperative*: both work on one tile, split along M (each owns half the accumulator).
  *pingpong*: each works on its own tile; an ordered pair of named barriers lets only one of
  them run its main loop at a time, so one warpgroup's epilogue hides under the other's MMAs.
- epilogue: accumulators -> (alpha, beta*C, bias, activation in f32) -> output type ->
  ``stmatrix`` into a small swizzled shared-memory ring -> TMA bulk store. TMA clips the
  ragged edges of M and N, and zero-fills out-of-bounds loads, so any M, N, K works.
  An epilogue function (`Sm90FusedEpilogueGemmImpl`) has its whole (M, N) inputs that TMA can
  load (16-byte aligned, one unit stride) come the same way backwards: the consumer's store warp
  issues TMA loads of a tile's first ``in_stages`` epilogue subtiles into a per-warpgroup ring
  before the tile's main loop (so they land under it), and refills each slot with the subtile
  ``in_stages`` ahead once every thread has read it; each slot completes on its own mbarrier,
  and the values reach registers laid out as the accumulator subtile (``ldmatrix`` for 16-bit
  inputs of D's majorness). Its extra (M, N) outputs TMA can store go out as D does, from rings
  beside D's, in D's bulk group. Other operands are read or written element-wise.

Tiles are visited in a rasterised order (``swizzle`` consecutive clusters share an N column
band, or an M band) so concurrently running CTAs reuse A/B tiles in L2. With ``stream_k``, a
last wave at most a quarter full is avoided by cutting the last waves' tiles along K into equal
per-cluster shares; a split tile is finished by the cluster holding its first k-tile, which adds
the partial accumulators the following clusters left in the workspace, in cluster order
(flagged with a per-launch epoch). ``split_all`` (with ``stream_k``) does that for every tile
over the whole co-resident grid, for outputs of fewer tiles than SMs: a tile's pieces may then
come from several clusters, and a cluster's share may lie inside one tile.

The calling convention is ``impl(A, B, out, C_or_None, bias_or_None, alpha, beta,
max_active_clusters, workspace_or_None, epoch, stream)`` with A (L,M,K)/(M,K), B (L,K,N)/(K,N), out and C
(L,M,N)/(M,N) as the user passed them: the views the kernel needs ((M,K,L), (N,K,L),
(M,N,L)) are built inside the compiled host function, so a call costs no extra torch work.
"""

from __future__ import annotations

from typing import Optional

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils as utils
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.tensor_utils import LayoutEnum
from cutlass._mlir.dialects import llvm
import cutlass._mlir.dialects.cute_nvgpu as _cute_nvgpu_ir
from cutlass.cute.core import _pack_shape
from cutlass.cute.atom import make_atom

from . import fusion

# Named barrier ids (0 is __syncthreads).
_BAR_EPI = 1            # cooperative epilogue: both consumer warpgroups
_BAR_EPI_WG = 2         # pingpong epilogue: 2 + warpgroup
_BAR_ORDER = 4          # pingpong main-loop turn: 4 + warpgroup

_THREADS_PER_WG = 128
# 3xTF32 split pre-pass: threads per CTA, elements per thread, grid rows (grid-stride beyond).
_SPLIT_THREADS = 256
_SPLIT_VEC = 8
_SPLIT_MAX_ROWS = 65535
# Stream-K workspace: 64-bit completion flags (one per CTA slot) first, partial tiles after.
_FLAG_BYTES = 8192


class _MmaTF32Op(warpgroup.mma.MmaOp):
    """``wgmma.mma_async ... .f32.tf32.tf32`` (m64nNk8) with both operands K-major in shared
    memory. The DSL's `make_trivial_tiled_mma` offers no tf32 op; the SM90 MMA atom type takes
    the tf32 element type as it takes f16/bf16."""

    descriptive_name = "warpgroup TF32 MMA Operation"

    def __init__(self, tile_n: int) -> None:
        k_major = cute.nvgpu.OperandMajorMode.K
        super().__init__(cutlass.TFloat32, cutlass.TFloat32, Float32, (64, tile_n, 8),
                         warpgroup.OperandSource.SMEM, k_major, k_major)

    def _make_trait(self, *, loc=None, ip=None, **kwargs):
        shape_mnk = _pack_shape(self.shape_mnk, loc=loc, ip=ip)
        ty = _cute_nvgpu_ir.MmaAtomSM90Type.get(
            shape_mnk.type.attribute, self.a_major_mode._to_ir(), self.b_major_mode._to_ir(),
            self.a_dtype.mlir_type, self.b_dtype.mlir_type, self.acc_dtype.mlir_type, self.a_src._to_ir())
        return warpgroup.mma.MmaF16BF16Trait(make_atom(ty, [cutlass.Boolean(False).ir_value(loc=loc, ip=ip)],
                                                       loc=loc, ip=ip))


@cutlass.dsl_user_op
def _tf32_small_bits(a: Float32, big_bits: Int32, *, loc=None, ip=None) -> Int32:
    """tf32(a - big) (round to nearest, ties away) as bits, ``big_bits`` being tf32(a)."""
    return Int32(llvm.inline_asm(
        Int32.mlir_type, [Float32(a).ir_value(loc=loc, ip=ip), Int32(big_bits).ir_value(loc=loc, ip=ip)],
        "{ .reg .f32 b, s; mov.b32 b, $2; sub.f32 s, $1, b; cvt.rna.tf32.f32 $0, s; }",
        "=r,f,r", has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT))


class Sm90WarpSpecializedGemmImpl:
    """The CuTe DSL kernel; one object per configuration (all arguments are compile-time).

    ``tile_mn``: CTA tile (M, N); ``k_tile``: 64 for 16-bit operands, 32 for f32 (tf32: 128
    bytes, the swizzle width). ``split3``: f32 operands as 3xTF32 through the workspace.
    ``promote_every``: add the wgmma accumulator into a register f32 accumulator every that many
    k-tiles (0: accumulate in the wgmma accumulator only). ``cluster_mn``: (2, 1) multicasts B across the
    two CTAs of a cluster, (1, 2) multicasts A. ``schedule``: "cooperative" or "pingpong".
    ``swizzle``: clusters per raster band; ``raster_along_m``: walk M fastest.
    ``ab_stages``/``epi_stages``: shared-memory ring depths (the interface sizes them).
    ``epilogue``: an object with ``scaled``, ``has_c``, ``bias`` and ``activation``.
    """

    def __init__(self, tile_mn: tuple[int, int], cluster_mn: tuple[int, int], schedule: str, swizzle: int,
                 raster_along_m: bool, ab_stages: int, epi_stages: int, epilogue, epi_n: int = 32,
                 stream_k: bool = False, sk_any_wave_max_k_tiles: int = 0, k_tile: int = 64,
                 split3: bool = False, promote_every: int = 0, split_all: bool = False,
                 acc_f16: bool = False) -> None:
        if schedule not in ("cooperative", "pingpong"):
            raise ValueError(f"schedule must be 'cooperative' or 'pingpong', got {schedule!r}")
        self.tile_m, self.tile_n = tile_mn
        self.cluster_m, self.cluster_n = cluster_mn
        self.pingpong = schedule == "pingpong"
        self.swizzle = int(swizzle)
        self.raster_along_m = bool(raster_along_m)
        self.ab_stages = ab_stages
        self.epi_stages = epi_stages
        self.stream_k = bool(stream_k)
        self.sk_any_wave_max_k_tiles = int(sk_any_wave_max_k_tiles)
        self.k_tile = int(k_tile)
        self.split_all = bool(split_all)
        if self.split_all and not self.stream_k:
            raise ValueError("split_all spreads every tile's k-iterations over the grid with stream-K's fixup: "
                             "it needs stream_k")
        self.split3 = bool(split3)
        if self.split3 and self.stream_k:
            raise ValueError("3xTF32 (split3) uses the workspace for the split operands: no stream-K")
        self.promote_every = int(promote_every)
        if self.promote_every < 0:
            raise ValueError(f"promote_every must be >= 0, got {promote_every}")
        self.scaled = bool(epilogue.scaled)
        self.has_c = bool(epilogue.has_c)
        self.bias = epilogue.bias
        self.activation = epilogue.activation
        self.fusion = None  # (an epilogue function: `Sm90FusedEpilogueGemmImpl`)
        self.staged = ()    # (its inputs loaded by TMA, and their ring depth)
        self.in_stages = 0
        self.staged_out = ()  # (its extra outputs stored by TMA, through rings like D's)
        # f16 accumulation (f16 operands; asked for by the caller): the wgmma accumulates in f16,
        # the epilogue computes in f32 from it
        self.acc_dtype = cutlass.Float16 if acc_f16 else Float32
        if acc_f16 and (self.stream_k or self.promote_every or self.split3):
            raise ValueError("f16 accumulation takes neither stream-K, promotion nor 3xTF32 (f32 partial sums)")
        if self.pingpong:
            # one warpgroup owns a whole tile: a 64 x N wgmma atom repeated over M
            self.atom_layout = (1, 1, 1)
            self.epi_tile = (64, epi_n)
        else:
            # two warpgroups split the tile's M (each a 64 x N atom, repeated for M = 256)
            self.atom_layout = (2, 1, 1)
            self.epi_tile = (128, epi_n)
        mma_m = 64 * self.atom_layout[0]
        if self.tile_m % mma_m or self.tile_n % epi_n:
            raise ValueError(f"tile {tile_mn} does not fit schedule {schedule}")
        self.num_consumer_wgs = 2
        self.threads = _THREADS_PER_WG * (1 + self.num_consumer_wgs)
        # Threads that sync around one epilogue store: both warpgroups (cooperative) or one.
        self.epi_threads = _THREADS_PER_WG * (1 if self.pingpong else 2)
        # Per-warpgroup epilogue rings in pingpong, one shared ring in cooperative.
        self.epi_rings = 2 if self.pingpong else 1
        heavy = self.tile_m * self.tile_n // (_THREADS_PER_WG * (1 if self.pingpong else 2)) >= 256
        self.load_regs, self.mma_regs = (24, 240) if heavy else (40, 232)

    # ------------------------------------------------------------------ host side
    @staticmethod
    def _mnl_view(t: cute.Tensor, transpose: bool) -> cute.Tensor:
        """(L, R, C) or (R, C) -> (R, C, L) view; ``transpose`` gives (C, R, L)."""
        if const_expr(cute.rank(t.layout) == 3):
            l, r, c = t.shape
            sl, sr, sc = t.stride
        else:
            r, c = t.shape
            sr, sc = t.stride
            l, sl = 1, 0
        if const_expr(transpose):
            return cute.make_tensor(t.iterator, cute.make_layout((c, r, l), stride=(sc, sr, sl)))
        return cute.make_tensor(t.iterator, cute.make_layout((r, c, l), stride=(sr, sc, sl)))

    @cute.jit
    def __call__(self, mA: cute.Tensor, mB: cute.Tensor, mOut: cute.Tensor, mC: Optional[cute.Tensor],
                 mBias: Optional[cute.Tensor], alpha: Float32, beta: Float32, max_active_clusters: Int32,
                 mWorkspace: Optional[cute.Tensor], epoch: cutlass.Int64, stream: cuda.CUstream):
        self._host(mA, mB, mOut, mC, mBias, alpha, beta, max_active_clusters, mWorkspace, epoch, None, stream)

    @cute.jit
    def _host(self, mA: cute.Tensor, mB: cute.Tensor, mOut: cute.Tensor, mC: Optional[cute.Tensor],
              mBias: Optional[cute.Tensor], alpha: Float32, beta: Float32, max_active_clusters: Int32,
              mWorkspace: Optional[cute.Tensor], epoch: cutlass.Int64, epi_operands, stream: cuda.CUstream):
        """The host side of a launch; ``epi_operands`` is the operand tuple of a fused epilogue
        function (`Sm90FusedEpilogueGemmImpl`), None otherwise."""
        a = self._mnl_view(mA, False)      # (M, K, L)
        b = self._mnl_view(mB, True)       # (N, K, L)
        d = self._mnl_view(mOut, False)    # (M, N, L)
        c = None
        if const_expr(self.has_c):
            c = self._mnl_view(mC, False)
        tf32 = const_expr(a.element_type == Float32)
        if const_expr(a.element_type != b.element_type or (a.element_type.width != 16 and not tf32)):
            raise TypeError(f"A and B must share a 16-bit type or f32, got {a.element_type} and {b.element_type}")
        if const_expr(self.split3 and not tf32):
            raise TypeError("split3 (3xTF32) needs f32 operands")
        # (3xTF32 reads A and B in any layout: the pre-pass writes K-major copies)
        if const_expr(tf32 and not self.split3 and (LayoutEnum.from_tensor(a) != LayoutEnum.ROW_MAJOR
                                                    or LayoutEnum.from_tensor(b) != LayoutEnum.ROW_MAJOR)):
            raise TypeError("tf32 wgmma needs K-major A (row-major) and K-major B (column-major)")
        if const_expr(self.split3):
            a, b = self._split_operands(a, b, mWorkspace, stream)
            mWorkspace = None
        elif const_expr(tf32):
            # TMA moves the f32 bits as they are; the tf32 wgmma ignores the low 13 mantissa bits
            a = cute.make_tensor(cute.recast_ptr(a.iterator, dtype=cutlass.TFloat32), a.layout)
            b = cute.make_tensor(cute.recast_ptr(b.iterator, dtype=cutlass.TFloat32), b.layout)
        self.a_dtype = a.element_type
        self.b_dtype = b.element_type
        self.d_dtype = d.element_type
        self.a_layout = LayoutEnum.from_tensor(a)
        self.b_layout = LayoutEnum.from_tensor(b)
        self.d_layout = LayoutEnum.from_tensor(d)

        tile_mnk = (self.tile_m, self.tile_n, self.k_tile)
        if const_expr(tf32):
            tiled_mma = cute.make_tiled_mma(cute.make_mma_atom(_MmaTF32Op(self.tile_n)), self.atom_layout)
        else:
            tiled_mma = sm90_utils.make_trivial_tiled_mma(
                self.a_dtype, self.b_dtype, self.a_layout.sm90_mma_major_mode(),
                self.b_layout.sm90_mma_major_mode(), self.acc_dtype, self.atom_layout, tiler_mn=(64, self.tile_n))
        a_smem = sm90_utils.make_smem_layout_a(self.a_layout, tile_mnk, self.a_dtype, self.ab_stages)
        b_smem = sm90_utils.make_smem_layout_b(self.b_layout, tile_mnk, self.b_dtype, self.ab_stages)
        epi_smem = sm90_utils.make_smem_layout_epi(self.d_dtype, self.d_layout, self.epi_tile,
                                                   self.epi_stages * self.epi_rings)

        a_op = cpasync.CopyBulkTensorTileG2SMulticastOp() if const_expr(self.cluster_n > 1) \
            else cpasync.CopyBulkTensorTileG2SOp()
        b_op = cpasync.CopyBulkTensorTileG2SMulticastOp() if const_expr(self.cluster_m > 1) \
            else cpasync.CopyBulkTensorTileG2SOp()
        tma_atom_a, tma_a = cpasync.make_tiled_tma_atom(
            a_op, a, cute.slice_(a_smem, (None, None, 0)), (self.tile_m, self.k_tile), num_multicast=self.cluster_n)
        tma_atom_b, tma_b = cpasync.make_tiled_tma_atom(
            b_op, b, cute.slice_(b_smem, (None, None, 0)), (self.tile_n, self.k_tile), num_multicast=self.cluster_m)
        tma_atom_d, tma_d = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileS2GOp(), d, cute.slice_(epi_smem, (None, None, 0)), self.epi_tile)

        # Work decomposition: clusters of CTA tiles, visited by a persistent grid.
        m, n, l = d.shape
        tiles_m = (m + self.tile_m - 1) // self.tile_m
        tiles_n = (n + self.tile_n - 1) // self.tile_n
        clusters_m = (tiles_m + self.cluster_m - 1) // self.cluster_m
        clusters_n = (tiles_n + self.cluster_n - 1) // self.cluster_n
        total_clusters = clusters_m * clusters_n * l
        grid_clusters = cutlass.min(total_clusters, max_active_clusters)
        if const_expr(self.split_all):
            # every co-resident cluster, as long as each gets a k-iteration
            k_iters = (a.shape[1] + self.k_tile - 1) // self.k_tile
            grid_clusters = cutlass.min(total_clusters * k_iters, max_active_clusters)

        ab_stages, epi_slots = self.ab_stages, self.epi_stages * self.epi_rings

        in_atoms, in_tensors, in_smems = (), (), ()
        out_atoms, out_tensors, out_smems = (), (), ()
        if const_expr(len(self.staged) + len(self.staged_out) > 0):
            in_atoms, in_tensors, in_smems = self._staged_tma(epi_operands, self.staged, self.in_stages,
                                                              cpasync.CopyBulkTensorTileG2SOp())
            out_atoms, out_tensors, out_smems = self._staged_tma(epi_operands, self.staged_out, self.epi_stages,
                                                                 cpasync.CopyBulkTensorTileS2GOp())
            fields = {"mbar": cute.struct.MemRange[cutlass.Int64, ab_stages * 2]}
            if const_expr(len(self.staged) > 0):
                fields["in_mbar"] = cute.struct.MemRange[cutlass.Int64, self.in_stages * self.epi_rings]
            fields["sA"] = cute.struct.Align[cute.struct.MemRange[self.a_dtype, cute.cosize(a_smem)], 1024]
            fields["sB"] = cute.struct.Align[cute.struct.MemRange[self.b_dtype, cute.cosize(b_smem)], 1024]
            fields["sD"] = cute.struct.Align[cute.struct.MemRange[self.d_dtype, cute.cosize(epi_smem)], 1024]
            for name, slots, layouts in (("sIn", self.staged, in_smems), ("sOut", self.staged_out, out_smems)):
                for i, (slot, layout) in enumerate(zip(slots, layouts)):
                    fields[f"{name}{i}"] = cute.struct.Align[
                        cute.struct.MemRange[epi_operands[slot].element_type, cute.cosize(layout)], 1024]
            self.shared_storage = cute.struct(type("SharedStorage", (), {"__annotations__": fields}))
        else:
            @cute.struct
            class SharedStorage:
                mbar: cute.struct.MemRange[cutlass.Int64, ab_stages * 2]
                sA: cute.struct.Align[cute.struct.MemRange[self.a_dtype, cute.cosize(a_smem)], 1024]
                sB: cute.struct.Align[cute.struct.MemRange[self.b_dtype, cute.cosize(b_smem)], 1024]
                sD: cute.struct.Align[cute.struct.MemRange[self.d_dtype, cute.cosize(epi_smem)], 1024]

            self.shared_storage = SharedStorage
        del epi_slots

        self.kernel(tma_atom_a, tma_a, tma_atom_b, tma_b, tma_atom_d, tma_d, tiled_mma, a_smem, b_smem, epi_smem,
                    c, mBias, alpha, beta, clusters_m, clusters_n, total_clusters, mWorkspace, epoch,
                    epi_operands, in_atoms, in_tensors, in_smems, out_atoms, out_tensors, out_smems).launch(
            grid=(self.cluster_m, self.cluster_n, grid_clusters),
            block=[self.threads, 1, 1],
            cluster=(self.cluster_m, self.cluster_n, 1),
            min_blocks_per_mp=1,
            stream=stream,
        )

    def _staged_tma(self, epi_operands, slots, stages: int, op):
        """TMA atoms (``op``: load or store), their (M, N[, L]) tensors and staged shared-memory
        layouts (one epilogue subtile per stage, ``stages`` per epilogue ring) of the operands
        at ``slots`` the fused epilogue loads or stores in tiles (`fusion.FusionPlan.staged`,
        ``staged_out``). An input broadcast over the batch (stride 0) is described as (M, N):
        every batch reads the same tile."""
        atoms, tensors, smems = [], [], []
        for slot in slots:
            t = epi_operands[slot]
            _, m, n = t.shape
            s_l, s_m, s_n = t.stride
            if const_expr(self.fusion.operands[slot].pattern[0] == 0):
                view = cute.make_tensor(t.iterator, cute.make_layout((m, n), stride=(s_m, s_n)))
            else:
                view = cute.make_tensor(t.iterator, cute.make_layout((m, n, t.shape[0]), stride=(s_m, s_n, s_l)))
            layout = LayoutEnum.ROW_MAJOR if const_expr(self.fusion.operands[slot].pattern[2] == 1) \
                else LayoutEnum.COL_MAJOR
            smem = sm90_utils.make_smem_layout_epi(view.element_type, layout, self.epi_tile, stages * self.epi_rings)
            atom, tensor = cpasync.make_tiled_tma_atom(op, view, cute.slice_(smem, (None, None, 0)), self.epi_tile)
            atoms.append(atom)
            tensors.append(tensor)
            smems.append(smem)
        return tuple(atoms), tuple(tensors), tuple(smems)

    # ------------------------------------------------------------------ 3xTF32 split
    @cute.jit
    def _split_operands(self, a: cute.Tensor, b: cute.Tensor, mWorkspace: cute.Tensor, stream: cuda.CUstream):
        """Launch the split pre-pass of A (M, K, L) and B (N, K, L), both K-major, into the
        workspace; return the tf32 views (M, 3K, L) and (N, 3K, L) the GEMM reads.

        Workspace: A's rows, then B's, each row 3K words padded to 4 (TMA's 16-byte strides)."""
        m, k, l = a.shape
        n = b.shape[0]
        k3 = k * 3
        ldw = cute.assume((k3 + 3) // 4 * 4, divby=4)
        ld64 = cutlass.Int64(ldw)
        words = cute.recast_ptr(mWorkspace.iterator, dtype=Int32)
        a_ws = cute.make_tensor(words, cute.make_layout((m, k3, l), stride=(ld64, 1, ld64 * m)))
        b_words = words + ld64 * m * l
        b_ws = cute.make_tensor(b_words, cute.make_layout((n, k3, l), stride=(ld64, 1, ld64 * n)))
        per_cta = _SPLIT_THREADS * _SPLIT_VEC
        self._split_kernel(a, a_ws, 0).launch(
            grid=((k + per_cta - 1) // per_cta, cutlass.min(m * l, _SPLIT_MAX_ROWS), 1),
            block=[_SPLIT_THREADS, 1, 1], stream=stream)
        self._split_kernel(b, b_ws, 1).launch(
            grid=((k + per_cta - 1) // per_cta, cutlass.min(n * l, _SPLIT_MAX_ROWS), 1),
            block=[_SPLIT_THREADS, 1, 1], stream=stream)
        a_tf = cute.make_tensor(cute.recast_ptr(words, dtype=cutlass.TFloat32), a_ws.layout)
        b_tf = cute.make_tensor(cute.recast_ptr(b_words, dtype=cutlass.TFloat32), b_ws.layout)
        return a_tf, b_tf

    @cute.kernel
    def _split_kernel(self, src: cute.Tensor, dst: cute.Tensor, small_segment: cutlass.Constexpr):
        """dst[r, s*K + k, l] = tf32 bits of big (segments != small_segment) or small (==)
        of src[r, k, l]; rows r walk the grid's y (grid-stride), k the x (coalesced)."""
        tidx, _, _ = cute.arch.thread_idx()
        bx, by, _ = cute.arch.block_idx()
        _, gy, _ = cute.arch.grid_dim()
        r_ext, k_ext, l_ext = src.shape
        rows = r_ext * l_ext
        row = by
        k0 = bx * (_SPLIT_THREADS * _SPLIT_VEC) + tidx
        vals = cute.make_rmem_tensor((_SPLIT_VEC,), Float32)
        while row < rows:
            batch = row // r_ext
            r = row - batch * r_ext
            # all loads first: several in flight per thread (stores might alias them otherwise)
            for j in cutlass.range_constexpr(_SPLIT_VEC):
                if k0 + j * _SPLIT_THREADS < k_ext:
                    vals[j] = src[r, k0 + j * _SPLIT_THREADS, batch]
            for j in cutlass.range_constexpr(_SPLIT_VEC):
                kk = k0 + j * _SPLIT_THREADS
                if kk < k_ext:
                    x = vals[j]
                    big = Int32(cute.arch.cvt_f32_tf32(x))
                    small = _tf32_small_bits(x, big)
                    for seg in cutlass.range_constexpr(3):
                        if const_expr(seg == small_segment):
                            dst[r, kk + seg * k_ext, batch] = small
                        else:
                            dst[r, kk + seg * k_ext, batch] = big
            row = row + gy

    # ------------------------------------------------------------------ device side
    @cute.jit
    def _cluster_coord(self, linear: Int32, clusters_m: Int32, clusters_n: Int32):
        """Linear cluster index -> (cluster m, cluster n, batch), rasterised in bands of
        ``swizzle`` clusters so that neighbours in time share operand tiles in L2."""
        per_batch = clusters_m * clusters_n
        batch = linear // per_batch
        r = linear - batch * per_batch
        if const_expr(self.raster_along_m):
            fast_ext, slow_ext = clusters_m, clusters_n
        else:
            fast_ext, slow_ext = clusters_n, clusters_m
        fast = Int32(0)
        slow = Int32(0)
        if const_expr(self.swizzle == 1):
            fast = r % fast_ext
            slow = r // fast_ext
        else:
            g = self.swizzle
            # bands of g slow-axis columns; inside a band, walk the g columns first
            full_cols = (slow_ext // g) * g
            in_full = r < full_cols * fast_ext
            if in_full:
                band = r // (g * fast_ext)
                rr = r - band * (g * fast_ext)
                fast = rr // g
                slow = band * g + rr % g
            else:
                rem = slow_ext - full_cols
                rt = r - full_cols * fast_ext
                fast = rt // rem
                slow = full_cols + rt % rem
        cm = fast
        cn = slow
        if const_expr(not self.raster_along_m):
            cm = slow
            cn = fast
        return cm, cn, batch

    @cute.jit
    def _next_unit(self, dp_next: Int32, sk_cur: Int32, dp_tiles: Int32, sk_begin: Int32, sk_end: Int32,
                   grid_clusters: Int32, k_tiles: Int32):
        """The next unit of work after the cursors: (valid, cluster tile, first k-tile, end k-tile,
        new cursors). Data-parallel tiles come first (cluster c takes c, c + grid, ...), then the
        pieces of this cluster's stream-K share [sk_begin, sk_end) of k-iterations (tile-major,
        k-minor; ``sk_cur`` counts pieces): its whole tiles first, then the tail of the tile it
        shares with the previous cluster, then the head of the one it shares with the next. Whole
        tiles first keeps the clusters k-aligned (neighbours reading the same A/B k-slices from
        L2) for as long as possible; only the split pieces run at scattered k offsets."""
        valid = Int32(0)
        tile = Int32(0)
        kb = Int32(0)
        ke = Int32(0)
        if dp_next < dp_tiles:
            valid = Int32(1)
            tile = dp_next
            ke = k_tiles
            dp_next = dp_next + grid_clusters
        else:
            if const_expr(self.stream_k):
                if sk_begin < sk_end:
                    t_first = sk_begin // k_tiles
                    kb_first = sk_begin - t_first * k_tiles
                    t_end = sk_end // k_tiles
                    ke_last = sk_end - t_end * k_tiles
                    has_tail = cutlass.select_(kb_first > 0, Int32(1), Int32(0))
                    full_start = t_first + has_tail
                    n_full = t_end - full_start
                    if t_first == t_end and kb_first > 0:
                        # (split_all) the whole share inside one tile: one middle piece
                        if sk_cur == 0:
                            valid = Int32(1)
                            tile = dp_tiles + t_first
                            kb = kb_first
                            ke = ke_last
                    elif sk_cur < n_full:
                        valid = Int32(1)
                        tile = dp_tiles + full_start + sk_cur
                        ke = k_tiles
                    elif sk_cur < n_full + has_tail:
                        valid = Int32(1)
                        tile = dp_tiles + t_first
                        kb = kb_first
                        ke = k_tiles
                    elif sk_cur == n_full + has_tail and ke_last > 0:
                        valid = Int32(1)
                        tile = dp_tiles + t_end
                        ke = ke_last
                    sk_cur = sk_cur + valid
        return valid, tile, kb, ke, dp_next, sk_cur

    @cute.jit
    def _promote(self, acc: cute.Tensor, acc_sum: cute.Tensor):
        """acc_sum += acc once the committed wgmmas are done; then a wgmma fence, as the next
        wgmma writes registers this thread just read."""
        warpgroup.wait_group(0)
        for v in cutlass.range_constexpr(cute.size(acc)):
            acc_sum[v] = acc_sum[v] + acc[v]
        warpgroup.fence()

    @cute.jit
    def _activate(self, x: Float32) -> Float32:
        y = x
        if const_expr(self.activation == "relu"):
            y = cute.arch.fmax(x, Float32(0.0))
        elif const_expr(self.activation == "gelu"):
            inner = Float32(0.7978845608028654) * (x + Float32(0.044715) * x * x * x)
            y = Float32(0.5) * x * (Float32(1.0) + cute.math.tanh(inner, fastmath=True))
        elif const_expr(self.activation == "silu"):
            y = x / (Float32(1.0) + cute.math.exp(-x, fastmath=True))
        return y

    def _staged_partitions(self, copy_c_atom, etid, sIns, rD_shape):
        """Per staged input: (tiled shared->register copy, this thread's shared-memory partition,
        its register fragment laid out as the accumulator subtile, that fragment's copy view).
        16-bit inputs of D's majorness are read with ldmatrix (the inverse of D's stmatrix),
        the others element by element."""
        found = []
        for i, sIn in enumerate(sIns):
            dtype = sIn.element_type
            key = self.fusion.operands[self.staged[i]]
            m_major = key.pattern[1] == 1
            if const_expr(dtype.width == 16 and m_major == self.d_layout.is_m_major_c()):
                atom = cute.make_copy_atom(cute.nvgpu.warp.LdMatrix8x8x16bOp(m_major, 4), dtype)
            else:
                atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), dtype)
            tiled_s2r = cute.make_tiled_copy_S(atom, copy_c_atom)
            thr_s2r = tiled_s2r.get_slice(etid)
            rIn = cute.make_rmem_tensor(rD_shape, dtype)
            found.append((tiled_s2r, thr_s2r.partition_S(sIn), rIn, thr_s2r.retile(rIn)))
        return tuple(found)

    def _staged_out_partitions(self, copy_c_atom, etid, sOuts, rD_shape):
        """Per staged extra output: (tiled register->shared copy, this thread's shared-memory
        partition, its register fragment laid out as the accumulator subtile, that fragment's
        copy view). 16-bit outputs of D's majorness are written with stmatrix as D is, the
        others element by element."""
        found = []
        for i, sOut in enumerate(sOuts):
            dtype = sOut.element_type
            key = self.fusion.operands[self.staged_out[i]]
            m_major = key.pattern[1] == 1
            if const_expr(dtype.width == 16 and m_major == self.d_layout.is_m_major_c()):
                atom = cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(m_major, 4), dtype)
            else:
                atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), dtype)
            tiled = cute.make_tiled_copy_S(atom, copy_c_atom)
            thr = tiled.get_slice(etid)
            rOut = cute.make_rmem_tensor(rD_shape, dtype)
            found.append((tiled, thr.partition_D(sOut), rOut, thr.retile(rOut)))
        return tuple(found)

    def _store_staged(self, out_atoms, out_tensors, sOuts, slot, sub_crd, tile_m, tile_n, batch):
        """Issue the TMA stores of every staged extra output's subtile ``sub_crd`` of tile
        (tile_m, tile_n, batch) from shared-memory slot ``slot`` (in D's bulk group)."""
        for atom, tensor, sOut in zip(out_atoms, out_tensors, sOuts):
            if const_expr(cute.rank(tensor.layout) == 3):
                gOut = cute.local_tile(tensor, (self.tile_m, self.tile_n), (None, None, None))[
                    (None, None, tile_m, tile_n, batch)]
            else:
                gOut = cute.local_tile(tensor, (self.tile_m, self.tile_n), (None, None))[(None, None, tile_m, tile_n)]
            s_part, g_part = cpasync.tma_partition(atom, 0, cute.make_layout(1), cute.group_modes(sOut, 0, 2),
                                                   cute.zipped_divide(gOut, self.epi_tile))
            cute.copy(atom, s_part[(None, slot)], g_part[(None, sub_crd)])

    def _load_staged(self, in_atoms, in_tensors, sIns, in_bar, in_base, count, sub: int, tile_m, tile_n, batch):
        """Issue the TMA loads of subtile ``sub`` (static) of tile (tile_m, tile_n, batch) of every
        staged input into slot ``count`` mod ``in_stages`` of the ring at ``in_base``, all
        completing on that slot's mbarrier. Called by the store warp."""
        slot = in_base + count % self.in_stages
        bar = in_bar + slot
        nbytes = 0
        for sIn in sIns:
            nbytes += cute.size_in_bytes(sIn.element_type, cute.slice_(sIn.layout, (None, None, 0)))
        with cute.arch.elect_one():
            cute.arch.mbarrier_arrive_and_expect_tx(bar, nbytes)
        sub_n = self.tile_n // self.epi_tile[1]
        sub_crd = (sub // sub_n, sub % sub_n)
        for atom, tensor, sIn in zip(in_atoms, in_tensors, sIns):
            if const_expr(cute.rank(tensor.layout) == 3):
                gIn = cute.local_tile(tensor, (self.tile_m, self.tile_n), (None, None, None))[
                    (None, None, tile_m, tile_n, batch)]
            else:
                gIn = cute.local_tile(tensor, (self.tile_m, self.tile_n), (None, None))[(None, None, tile_m, tile_n)]
            s_part, g_part = cpasync.tma_partition(atom, 0, cute.make_layout(1), cute.group_modes(sIn, 0, 2),
                                                   cute.zipped_divide(gIn, self.epi_tile))
            cute.copy(atom, g_part[(None, sub_crd)], s_part[(None, slot)], tma_bar_ptr=bar)

    def _read_staged(self, staged, in_bar, in_base, count):
        """Wait for slot ``count`` mod ``in_stages`` and copy every staged input's subtile into
        its register fragment; returns parameter index -> fragment (`fusion.apply_fragment`)."""
        slot = in_base + count % self.in_stages
        cute.arch.mbarrier_wait(in_bar + slot, (count // self.in_stages) % 2)
        values = {}
        for i, (tiled_s2r, sIn_part, rIn, rIn_view) in enumerate(staged):
            cute.copy(tiled_s2r, sIn_part[(None, None, None, slot)], rIn_view)
            values[self.staged[i]] = rIn
        return values

    @cute.kernel
    def kernel(self, tma_atom_a: cute.CopyAtom, mA_mkl: cute.Tensor, tma_atom_b: cute.CopyAtom,
               mB_nkl: cute.Tensor, tma_atom_d: cute.CopyAtom, mD_mnl: cute.Tensor, tiled_mma: cute.TiledMma,
               a_smem_staged: cute.ComposedLayout, b_smem_staged: cute.ComposedLayout,
               epi_smem_staged: cute.ComposedLayout, mC_mnl: Optional[cute.Tensor], mBias: Optional[cute.Tensor],
               alpha: Float32, beta: Float32, clusters_m: Int32, clusters_n: Int32, total_clusters: Int32,
               mWorkspace: Optional[cute.Tensor], epoch: cutlass.Int64, epi_operands, in_atoms, in_tensors,
               in_smems, out_atoms, out_tensors, out_smems):
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == 0:
            cpasync.prefetch_descriptor(tma_atom_a)
            cpasync.prefetch_descriptor(tma_atom_b)
            cpasync.prefetch_descriptor(tma_atom_d)
            if const_expr(len(self.staged) + len(self.staged_out) > 0):
                for atom in in_atoms + out_atoms:
                    cpasync.prefetch_descriptor(atom)

        cluster_layout = cute.make_layout((self.cluster_m, self.cluster_n, 1))
        cta_rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
        cta_coord = cluster_layout.get_flat_coord(cta_rank)
        # A is shared by the CTAs of one cluster row (same m), B by one column (same n).
        a_mcast_mask = cute.make_layout_image_mask(cluster_layout, cta_coord, mode=1)
        b_mcast_mask = cute.make_layout_image_mask(cluster_layout, cta_coord, mode=0)
        a_mcast_mask = a_mcast_mask if const_expr(self.cluster_n > 1) else 0
        b_mcast_mask = b_mcast_mask if const_expr(self.cluster_m > 1) else 0

        smem = utils.SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        a_smem = cute.slice_(a_smem_staged, (None, None, 0))
        b_smem = cute.slice_(b_smem_staged, (None, None, 0))
        tx_bytes = cute.size_in_bytes(self.a_dtype, a_smem) + cute.size_in_bytes(self.b_dtype, b_smem)
        # One release per consumer warp per CTA that multicasts into this one.
        consumer_warps = 4 * (1 if const_expr(self.pingpong) else 2)
        mcast_peers = self.cluster_m + self.cluster_n - 1
        ab_pipe = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar.data_ptr(),
            num_stages=self.ab_stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, consumer_warps * mcast_peers),
            tx_count=tx_bytes,
            cta_layout_vmnk=cute.make_layout((1, self.cluster_m, self.cluster_n, 1)),
            defer_sync=True,
        )
        in_bar = None
        sIns = ()
        if const_expr(self.staged):
            # one "full" mbarrier per staged-input slot (every staged input's subtile lands on it)
            in_bar = storage.in_mbar.data_ptr()
            if warp_idx == 0:
                with cute.arch.elect_one():
                    for s in cutlass.range_constexpr(self.in_stages * self.epi_rings):
                        cute.arch.mbarrier_init(in_bar + s, 1)
            sIns = tuple(getattr(storage, f"sIn{i}").get_tensor(layout.outer, swizzle=layout.inner)
                         for i, layout in enumerate(in_smems))
        sOuts = ()
        if const_expr(len(self.staged_out) > 0):
            sOuts = tuple(getattr(storage, f"sOut{i}").get_tensor(layout.outer, swizzle=layout.inner)
                          for i, layout in enumerate(out_smems))
        pipeline.pipeline_init_arrive(cluster_shape_mn=(self.cluster_m, self.cluster_n), is_relaxed=True)

        sA = storage.sA.get_tensor(a_smem_staged.outer, swizzle=a_smem_staged.inner)
        sB = storage.sB.get_tensor(b_smem_staged.outer, swizzle=b_smem_staged.inner)
        sD = storage.sD.get_tensor(epi_smem_staged.outer, swizzle=epi_smem_staged.inner)

        # (bM, bK, tiles M, tiles K, L) and friends
        gA = cute.local_tile(mA_mkl, (self.tile_m, self.k_tile), (None, None, None))
        gB = cute.local_tile(mB_nkl, (self.tile_n, self.k_tile), (None, None, None))
        gD = cute.local_tile(mD_mnl, (self.tile_m, self.tile_n), (None, None, None))
        k_tiles = cute.size(gA, mode=[3])

        tAsA, tAgA = cpasync.tma_partition(tma_atom_a, cta_coord[1], cute.make_layout(self.cluster_n),
                                           cute.group_modes(sA, 0, 2), cute.group_modes(gA, 0, 2))
        tBsB, tBgB = cpasync.tma_partition(tma_atom_b, cta_coord[0], cute.make_layout(self.cluster_m),
                                           cute.group_modes(sB, 0, 2), cute.group_modes(gB, 0, 2))

        grid_clusters = cute.arch.grid_dim()[2]
        first_cluster = cute.arch.block_idx()[2]
        wg_idx = cute.arch.make_warp_uniform(tidx // _THREADS_PER_WG)

        # Work split. Without stream-K every cluster tile is one unit (data-parallel). With
        # stream-K, when the cluster tiles leave the last wave at most a quarter full, the last
        # (remainder + one full wave) tiles are cut along K into equal per-cluster shares of
        # k-iterations: a tile split between clusters c and c+1 is finished by c (it holds
        # k = 0 and reaches the tile last), which adds the partial accumulator c+1 left in the
        # workspace. (A fuller last wave gains less than the split costs: clusters then run at
        # scattered k offsets and lose the L2 reuse of k-aligned neighbours; measured on H200.)
        dp_tiles = total_clusters
        sk_begin = Int32(0)
        sk_end = Int32(0)
        if const_expr(self.split_all):
            # Skinny outputs (fewer tiles than SMs): every tile is cut along K, the whole grid
            # sharing all tiles' k-iterations equally (a tile may span several clusters).
            dp_tiles = Int32(0)
            work = cutlass.Int64(total_clusters) * cutlass.Int64(k_tiles)
            sk_begin = Int32(cutlass.Int64(first_cluster) * work // cutlass.Int64(grid_clusters))
            sk_end = Int32(cutlass.Int64(first_cluster + 1) * work // cutlass.Int64(grid_clusters))
        elif const_expr(self.stream_k):
            rem = total_clusters % grid_clusters
            # Optionally (sk_any_wave_max_k_tiles > 0) split a fuller last wave too at short K, once
            # 4+ whole waves come before it (with fewer, the split pieces dominate).
            any_wave = (k_tiles <= self.sk_any_wave_max_k_tiles) & (total_clusters >= 4 * grid_clusters)
            limit = cutlass.select_(any_wave, grid_clusters, grid_clusters // 4)
            rem = cutlass.select_(rem <= limit, rem, Int32(0))
            sk_tiles = cutlass.select_(rem > 0, rem + grid_clusters, Int32(0))
            dp_tiles = total_clusters - sk_tiles
            work = cutlass.Int64(sk_tiles) * cutlass.Int64(k_tiles)
            sk_begin = Int32(cutlass.Int64(first_cluster) * work // cutlass.Int64(grid_clusters))
            sk_end = Int32(cutlass.Int64(first_cluster + 1) * work // cutlass.Int64(grid_clusters))

        pipeline.pipeline_init_wait(cluster_shape_mn=(self.cluster_m, self.cluster_n))

        if wg_idx == 0:
            # ---------------------------------------------------------------- producer
            cute.arch.setmaxregister_decrease(self.load_regs)
            if warp_idx == 0:
                state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.ab_stages)
                valid, unit_tile, kb, ke, dp_next, sk_cur = self._next_unit(
                    first_cluster, Int32(0), dp_tiles, sk_begin, sk_end, grid_clusters, k_tiles)
                while valid > 0:
                    cl_m, cl_n, batch = self._cluster_coord(unit_tile, clusters_m, clusters_n)
                    tile_m = cl_m * self.cluster_m + cta_coord[0]
                    tile_n = cl_n * self.cluster_n + cta_coord[1]
                    tAgA_t = tAgA[(None, tile_m, None, batch)]
                    tBgB_t = tBgB[(None, tile_n, None, batch)]
                    for k in range(kb, ke):
                        ab_pipe.producer_acquire(state)
                        bar = ab_pipe.producer_get_barrier(state)
                        cute.copy(tma_atom_a, tAgA_t[(None, k)], tAsA[(None, state.index)], tma_bar_ptr=bar,
                                  mcast_mask=a_mcast_mask)
                        cute.copy(tma_atom_b, tBgB_t[(None, k)], tBsB[(None, state.index)], tma_bar_ptr=bar,
                                  mcast_mask=b_mcast_mask)
                        ab_pipe.producer_commit(state)
                        state.advance()
                    valid, unit_tile, kb, ke, dp_next, sk_cur = self._next_unit(
                        dp_next, sk_cur, dp_tiles, sk_begin, sk_end, grid_clusters, k_tiles)
                # Keep the CTA alive until every peer has released what we multicast to it.
                ab_pipe.producer_tail(state)
        else:
            # ---------------------------------------------------------------- consumers
            cute.arch.setmaxregister_increase(self.mma_regs)
            cwg = wg_idx - 1                                  # consumer warpgroup 0/1
            ctid = tidx - _THREADS_PER_WG                     # 0..255
            etid = ctid                                       # thread index inside the epilogue group
            if const_expr(self.pingpong):
                etid = ctid - cwg * _THREADS_PER_WG
            mma_slice = cwg * _THREADS_PER_WG
            if const_expr(self.pingpong):
                mma_slice = 0
            thr_mma = tiled_mma.get_slice(mma_slice)
            tCsA = thr_mma.partition_A(sA)
            tCsB = thr_mma.partition_B(sB)
            tCrA = tiled_mma.make_fragment_A(tCsA)
            tCrB = tiled_mma.make_fragment_B(tCsB)
            acc_shape = thr_mma.partition_shape_C((self.tile_m, self.tile_n))
            acc = cute.make_rmem_tensor(acc_shape, self.acc_dtype)
            # what the epilogue (and stream-K) reads: the promoted sum, or the wgmma accumulator
            acc_sum = acc
            if const_expr(self.promote_every > 0):
                acc_sum = cute.make_rmem_tensor(acc_shape, self.acc_dtype)
            k_blocks = cute.size(tCrA, mode=[2])

            # epilogue partitions: accumulator fragment -> (stmatrix) -> swizzled smem subtile
            r2s_atom = sm90_utils.get_smem_store_op(self.d_layout, self.d_dtype, Float32)
            # the stmatrix atom only shapes the thread-value layout; its type is irrelevant
            shape_atom = cute.make_copy_atom(
                cute.nvgpu.warp.StMatrix8x8x16bOp(self.d_layout.is_m_major_c(), 4), cutlass.Float16)
            copy_c_atom = cute.make_tiled_copy_C_atom(shape_atom, tiled_mma)
            tiled_r2s = cute.make_tiled_copy_S(r2s_atom, copy_c_atom)
            thr_r2s = tiled_r2s.get_slice(etid)
            tRS_sD = thr_r2s.partition_D(sD)                               # (R2S, R2S_M, R2S_N, slot)
            tRS_acc = tiled_r2s.retile(acc_sum)
            rD_shape = cute.shape(thr_r2s.partition_S(sD))[:3]
            tRS_rD = cute.make_rmem_tensor(rD_shape, Float32)  # the epilogue's math is f32
            tRS_rOut = cute.make_rmem_tensor(rD_shape, self.d_dtype)
            rD_size = cute.size(tRS_rD)
            # coordinates (m, n) inside a subtile of each *source* register value (with stmatrix the
            # destination partition is the addresses a thread supplies, not where its values land)
            tRS_cD = thr_r2s.partition_S(cute.make_identity_tensor(self.epi_tile))
            epi_m, epi_n = self.epi_tile
            sub_n = self.tile_n // epi_n
            sub_count = (self.tile_m // epi_m) * sub_n
            epi_bar = pipeline.NamedBarrier(barrier_id=_BAR_EPI, num_threads=self.epi_threads)
            slot_base = 0
            if const_expr(self.pingpong):
                epi_bar = pipeline.NamedBarrier(barrier_id=_BAR_EPI_WG + cwg, num_threads=self.epi_threads)
                slot_base = cwg * self.epi_stages
            store_warp = warp_idx == 4
            if const_expr(self.pingpong):
                store_warp = warp_idx == 4 + 4 * cwg
            m_total, n_total, _ = mD_mnl.shape
            staged = None
            if const_expr(self.staged):
                staged = self._staged_partitions(copy_c_atom, etid, sIns, rD_shape)
                in_base = cwg * self.in_stages if const_expr(self.pingpong) else 0
            staged_out = None
            if const_expr(len(self.staged_out) > 0):
                staged_out = self._staged_out_partitions(copy_c_atom, etid, sOuts, rD_shape)

            read_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.ab_stages)
            release_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.ab_stages)
            if const_expr(self.stream_k):
                # partial accumulators: one slot per CTA, each thread's values strided by the group size
                slot_elems = self.tile_m * self.tile_n
                cluster_size = self.cluster_m * self.cluster_n
                flags = cute.make_tensor(cute.recast_ptr(mWorkspace.iterator, dtype=cutlass.Int64),
                                         cute.make_layout(_FLAG_BYTES // 8))
                partials = cute.make_tensor(cute.recast_ptr(mWorkspace.iterator + _FLAG_BYTES, dtype=Float32),
                                            cute.make_layout((cute.size(mWorkspace) - _FLAG_BYTES) // 4))
                my_slot = first_cluster * cluster_size + cta_rank
            dp_next = first_cluster
            sk_cur = Int32(0)
            if const_expr(self.pingpong):
                # warpgroup w takes units w, w+2, ... of this CTA's sequence; warpgroup 1 first skips unit 0
                if cwg == 1:
                    v0, t0, kb0, ke0, dp_next, sk_cur = self._next_unit(
                        dp_next, sk_cur, dp_tiles, sk_begin, sk_end, grid_clusters, k_tiles)
                    if v0 > 0:
                        read_state.advance(ke0 - kb0)
                        release_state.advance(ke0 - kb0)
            valid, unit_tile, kb, ke, dp_next, sk_cur = self._next_unit(
                dp_next, sk_cur, dp_tiles, sk_begin, sk_end, grid_clusters, k_tiles)
            epi_count = Int32(0)
            unit_no = Int32(0)
            while valid > 0:
                cl_m, cl_n, batch = self._cluster_coord(unit_tile, clusters_m, clusters_n)
                tile_m = cl_m * self.cluster_m + cta_coord[0]
                tile_n = cl_n * self.cluster_n + cta_coord[1]
                n_k = ke - kb

                if const_expr(self.staged):
                    # the staged inputs' first subtiles load under this unit's main loop (a stream-K
                    # tail, kb > 0, runs no epilogue and loads none)
                    if store_warp and kb == 0:
                        for sub in cutlass.range_constexpr(min(self.in_stages, sub_count)):
                            self._load_staged(in_atoms, in_tensors, sIns, in_bar, in_base, epi_count + sub, sub,
                                              tile_m, tile_n, batch)

                if const_expr(self.pingpong):
                    # wait for our turn on the tensor cores (the very first unit goes straight in)
                    if cwg == 1 or unit_no > 0:
                        cute.arch.barrier(barrier_id=_BAR_ORDER + cwg, number_of_threads=2 * _THREADS_PER_WG)

                # ------------------------------------------------------------ main loop
                # the first k-block overwrites the accumulators (scale-d = 0): no zero fill, which
                # would make ptxas serialise the first wgmmas behind the register moves
                tiled_mma.set(warpgroup.Field.ACCUMULATE, False)
                if const_expr(self.promote_every > 0):
                    acc_sum.fill(0.0)  # (its own registers: no wait on the wgmma accumulator)
                ab_pipe.consumer_wait(read_state)
                warpgroup.fence()
                for kb_i in cutlass.range_constexpr(k_blocks):
                    cute.gemm(tiled_mma, acc, tCrA[(None, None, kb_i, read_state.index)],
                              tCrB[(None, None, kb_i, read_state.index)], acc)
                    tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
                warpgroup.commit_group()
                read_state.advance()
                if const_expr(self.promote_every == 1):
                    self._promote(acc, acc_sum)
                for k in range(1, n_k):
                    ab_pipe.consumer_wait(read_state)
                    # with promotion, a new group of k-tiles restarts the wgmma accumulator
                    if const_expr(self.promote_every == 1):
                        tiled_mma.set(warpgroup.Field.ACCUMULATE, False)
                    elif const_expr(self.promote_every > 1):
                        tiled_mma.set(warpgroup.Field.ACCUMULATE, k % self.promote_every != 0)
                    for kb_i in cutlass.range_constexpr(k_blocks):
                        cute.gemm(tiled_mma, acc, tCrA[(None, None, kb_i, read_state.index)],
                                  tCrB[(None, None, kb_i, read_state.index)], acc)
                        if const_expr(self.promote_every > 0):
                            tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
                    warpgroup.commit_group()
                    if const_expr(self.promote_every == 1):
                        self._promote(acc, acc_sum)  # (waits for this k-tile's wgmmas)
                    elif const_expr(self.promote_every > 1):
                        if (k + 1) % self.promote_every == 0:
                            self._promote(acc, acc_sum)
                        else:
                            warpgroup.wait_group(1)
                    else:
                        # keep one k-tile of wgmma in flight; the one before it is done with its stage
                        warpgroup.wait_group(1)
                    ab_pipe.consumer_release(release_state)
                    release_state.advance()
                    read_state.advance()
                if const_expr(self.pingpong):
                    # the other warpgroup's unit follows ours: hand it the tensor cores, skip its stages
                    v1, t1, kb1, ke1, dp_next, sk_cur = self._next_unit(
                        dp_next, sk_cur, dp_tiles, sk_begin, sk_end, grid_clusters, k_tiles)
                    if v1 > 0:
                        cute.arch.barrier_arrive(barrier_id=_BAR_ORDER + 1 - cwg,
                                                 number_of_threads=2 * _THREADS_PER_WG)
                warpgroup.wait_group(0)
                if const_expr(self.promote_every > 1):
                    if n_k % self.promote_every != 0:
                        self._promote(acc, acc_sum)  # the last, partial group
                ab_pipe.consumer_release(release_state)
                release_state.advance()
                if const_expr(self.pingpong):
                    if v1 > 0:
                        read_state.advance(ke1 - kb1)
                        release_state.advance(ke1 - kb1)

                do_epilogue = Int32(1)
                if const_expr(self.stream_k):
                    if kb > 0:
                        # the tail of a tile whose head another cluster owns: leave the partial sum
                        base = my_slot * slot_elems + etid
                        for v in cutlass.range_constexpr(cute.size(acc_sum)):
                            partials[base + v * self.epi_threads] = acc_sum[v]
                        epi_bar.arrive_and_wait()
                        if etid == 0:
                            cute.arch.fence_acq_rel_gpu()
                            cute.arch.store(flags.iterator + my_slot, epoch, sem="release", scope="gpu")
                        do_epilogue = Int32(0)
                    elif ke < k_tiles:
                        # the head of a split tile: add the tails the following clusters left, in
                        # cluster order (so a shape always sums alike). The tile's last k-iteration
                        # lies in cluster ceil(end * G / work) - 1; stream-K's 2-way splits stop at
                        # the next cluster, split_all's may span several.
                        tile_end = cutlass.Int64(unit_tile - dp_tiles + 1) * cutlass.Int64(k_tiles)
                        last_cluster = Int32((tile_end * cutlass.Int64(grid_clusters) + work - 1) // work - 1)
                        for contributor in range(first_cluster + 1, last_cluster + 1):
                            slot = contributor * cluster_size + cta_rank
                            if etid == 0:
                                seen = cute.arch.load(flags.iterator + slot, cutlass.Int64, sem="acquire",
                                                      scope="gpu")
                                while seen != epoch:
                                    seen = cute.arch.load(flags.iterator + slot, cutlass.Int64, sem="acquire",
                                                          scope="gpu")
                                cute.arch.store(flags.iterator + slot, cutlass.Int64(0), sem="relaxed",
                                                scope="gpu")
                            epi_bar.arrive_and_wait()
                            base = slot * slot_elems + etid
                            for v in cutlass.range_constexpr(cute.size(acc_sum)):
                                acc_sum[v] = acc_sum[v] + partials[base + v * self.epi_threads]

                # ------------------------------------------------------------ epilogue
                if do_epilogue > 0:
                    gD_tile = gD[(None, None, tile_m, tile_n, batch)]
                    gD_epi = cute.zipped_divide(gD_tile, self.epi_tile)        # ((em, en), (sub m, sub n))
                    bSG_sD, bSG_gD = cpasync.tma_partition(tma_atom_d, 0, cute.make_layout(1),
                                                           cute.group_modes(sD, 0, 2), gD_epi)
                    row0 = tile_m * self.tile_m
                    col0 = tile_n * self.tile_n
                    for sub in cutlass.range_constexpr(sub_count):
                        for v in cutlass.range_constexpr(rD_size):
                            if const_expr(self.acc_dtype == Float32):
                                tRS_rD[v] = tRS_acc[sub * rD_size + v]
                            else:
                                tRS_rD[v] = tRS_acc[sub * rD_size + v].to(Float32)
                        if const_expr(self.fusion is not None):
                            values = None
                            if const_expr(self.staged):
                                values = self._read_staged(staged, in_bar, in_base, epi_count + sub)
                            outputs = None
                            if const_expr(len(self.staged_out) > 0):
                                outputs = {slot: part[2] for slot, part in zip(self.staged_out, staged_out)}
                            fusion.apply_fragment(self.fusion, tRS_rD, tRS_cD, row0 + (sub // sub_n) * epi_m,
                                                  col0 + (sub % sub_n) * epi_n, batch, m_total, n_total,
                                                  epi_operands, values, outputs)
                        elif const_expr(self.scaled or self.has_c or self.bias is not None
                                        or self.activation is not None):
                            sub_row = row0 + (sub // sub_n) * epi_m
                            sub_col = col0 + (sub % sub_n) * epi_n
                            for v in cutlass.range_constexpr(rD_size):
                                x = tRS_rD[v]
                                if const_expr(self.scaled):
                                    x = x * alpha
                                crd = tRS_cD[v]
                                gm = sub_row + crd[0]
                                gn = sub_col + crd[1]
                                if const_expr(self.has_c):
                                    if gm < m_total and gn < n_total:
                                        x = x + beta * mC_mnl[gm, gn, batch].to(Float32)
                                if const_expr(self.bias == "row"):
                                    if gn < n_total:
                                        x = x + mBias[gn].to(Float32)
                                if const_expr(self.bias == "column"):
                                    if gm < m_total:
                                        x = x + mBias[gm].to(Float32)
                                if const_expr(self.activation is not None):
                                    x = self._activate(x)
                                tRS_rD[v] = x
                        tRS_rOut.store(tRS_rD.load().to(self.d_dtype))
                        slot = slot_base + (epi_count + sub) % self.epi_stages
                        cute.copy(tiled_r2s, tRS_rOut, tRS_sD[(None, None, None, slot)])
                        if const_expr(len(self.staged_out) > 0):
                            for tiled_o, part_o, _, rO_view in staged_out:
                                cute.copy(tiled_o, rO_view, part_o[(None, None, None, slot)])
                        # make the generic-proxy smem writes visible to the TMA (async proxy)
                        cute.arch.fence_proxy("async.shared", space="cta")
                        if store_warp:
                            # the slot the next subtile writes must have been read by its old store
                            cute.arch.cp_async_bulk_wait_group(self.epi_stages - 2, read=True)
                        epi_bar.arrive_and_wait()
                        if store_warp:
                            sub_crd = cute.make_layout((self.tile_m // epi_m, sub_n), stride=(sub_n, 1)).get_hier_coord(sub)
                            cute.copy(tma_atom_d, bSG_sD[(None, slot)], bSG_gD[(None, sub_crd)])
                            if const_expr(len(self.staged_out) > 0):
                                self._store_staged(out_atoms, out_tensors, sOuts, slot, sub_crd, tile_m, tile_n,
                                                   batch)
                            cute.arch.cp_async_bulk_commit_group()
                            if const_expr(sub + self.in_stages < sub_count and len(self.staged) > 0):
                                # every thread has read this subtile's staged slot (the barrier above):
                                # refill it with the subtile in_stages ahead
                                self._load_staged(in_atoms, in_tensors, sIns, in_bar, in_base,
                                                  epi_count + sub + self.in_stages, sub + self.in_stages,
                                                  tile_m, tile_n, batch)
                    epi_count += sub_count
                unit_no += 1
                valid, unit_tile, kb, ke, dp_next, sk_cur = self._next_unit(
                    dp_next, sk_cur, dp_tiles, sk_begin, sk_end, grid_clusters, k_tiles)
            if store_warp:
                cute.arch.cp_async_bulk_wait_group(0)


class Sm90FusedEpilogueGemmImpl(Sm90WarpSpecializedGemmImpl):
    """The kernel with an epilogue function (`kernel_api.epilogue`) emitted into its epilogue:
    each accumulator element goes through `fusion.element` (loads of the extra inputs, the
    DAG's math, stores of the extra outputs and reductions) before the conversion to the
    output type, the stmatrix and the TMA store of ``D``, as the named epilogue's math does.
    The launch takes the operand tuple after the epoch. ``epilogue.fusion`` is the bound
    epilogue's key (`FusedEpilogueSignature.key`). ``in_stages`` (> 0): the inputs of
    `fusion.FusionPlan.staged` are loaded by TMA through rings of that many subtiles;
    ``stage_outputs``: the outputs of ``staged_out`` are stored by TMA (the interface sizes
    both with `plan_staged`)."""

    def __init__(self, *args, in_stages: int = 0, stage_outputs: bool = False, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        epilogue = args[7] if len(args) > 7 else kwargs["epilogue"]
        self.fusion = fusion.FusionPlan(epilogue.fusion)
        if in_stages > 0 and self.fusion.staged:
            self.staged = self.fusion.staged
            self.in_stages = int(in_stages)
        if stage_outputs:
            self.staged_out = self.fusion.staged_out

    @cute.jit
    def __call__(self, mA: cute.Tensor, mB: cute.Tensor, mOut: cute.Tensor, mC: Optional[cute.Tensor],
                 mBias: Optional[cute.Tensor], alpha: Float32, beta: Float32, max_active_clusters: Int32,
                 mWorkspace: Optional[cute.Tensor], epoch: cutlass.Int64, epi_operands: tuple,
                 stream: cuda.CUstream):
        self._host(mA, mB, mOut, mC, mBias, alpha, beta, max_active_clusters, mWorkspace, epoch, epi_operands,
                   stream)
