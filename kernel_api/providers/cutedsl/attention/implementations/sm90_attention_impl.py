"""FlashAttention-3-style forward attention for sm_90a (Hopper), written in CuTe DSL.

``out = softmax(scale * q k^T + mask) v`` over FlashAttention's dense layout: q and out are
(batch, seqlen_q, heads_q, head_dim), k and v (batch, seqlen_k, heads_kv, head_dim), head_dim
contiguous, heads_q a multiple of heads_kv (GQA/MQA: q head h reads kv head
h // (heads_q // heads_kv)). 16-bit operands, f32 accumulation, f32 online softmax in base 2
(the scale times log2(e) folded into one FMA per score). ``causal`` is FlashAttention's
bottom-right alignment: query i sees keys j <= i + seqlen_k - seqlen_q; a query that sees no
key gets out 0 and lse -inf. The optional ``lse`` (batch, heads_q, seqlen_q) f32 is the natural
log of the softmax denominator, ``max_j(scale s_ij) + log(sum_j exp(scale s_ij - max))``.

Variable length (``varlen``, compile-time): q and out are packed (total_q, heads_q, head_dim), k
and v (total_k, heads_kv, head_dim), sequence b's rows ``cu_seqlens[b]:cu_seqlens[b + 1]``
(int32 offsets of length batch + 1, read on the device), lse (heads_q, total_q); the causal mask
is aligned per sequence, by its own lengths.

A tile is one block of ``tile_m`` queries of one (batch, head); with variable length the
blocks are those of the longest query sequence (``max_seqlen_q``), and a block at or past its
sequence's end is skipped by the producer and the consumers alike. The grid has one CTA per tile
(linear index: query block fastest, so CTAs running together share K/V in L2; causal launches
walk the query blocks backwards, the ones seeing the most keys first, for balance), or, with
``persistent_ctas``, that many CTAs each looping over tiles. Inside, 1 + tile_m / 64 warpgroups:

- warpgroup 0, the producer, gives its registers away (setmaxnreg) and one of its warps issues
  the TMA loads: the Q tile once, then K and V tiles of ``tile_n`` keys into rings of
  ``num_stages`` shared-memory slots, each slot guarded by a "full" mbarrier (TMA transaction
  bytes) and an "empty" one (one arrive per consumer warp). Key blocks go from the last
  (masked) one down to the first; K of block n-1 is issued before V of block n, the order
  the consumers need them in.
- the other warpgroups, the consumers (setmaxnreg up), each own 64 of the query rows. Per key
  block: S = Q K^T with wgmma from shared memory (SS); the mask (only on the first block, which
  holds the end of the keys, and on the blocks that cross the causal diagonal: a loop of its
  own); online softmax in registers (a row lives on the 4 threads of a quad: shuffles reduce
  the max; the sums stay per-thread until the end); P rounded to the 16-bit type in registers
  (``cvt.rn.{bf16,f16}x2``), where it is the A operand of O += P V, a wgmma taking V from shared
  memory as an MN-major operand (RS). As in FlashAttention-3 the two GEMMs of consecutive
  blocks overlap inside a warpgroup: the S wgmma of block n and the PV wgmma of block n+1 are
  issued together, and the softmax of block n runs while the PV wgmma still executes. The
  consumer warpgroups overlap each other freely, or (``scheduler_barrier``) take turns
  issuing their GEMMs through named barriers, FlashAttention-3's pingpong (measured slower
  here on H200, hence off by default).
- epilogue: O / rowsum rounded to the output type, written with stmatrix per warpgroup into
  its own 64-row shared-memory tile and stored by TMA (which clips rows past seqlen_q); lse
  written by one thread per quad for rows < seqlen_q. With variable length the rows past the
  sequence's end are the next sequence's, so the warpgroup's tile goes from shared memory to
  global memory in 16-byte vectors, row by row, only for rows < the sequence's length (a TMA
  store of the whole tile would race with the CTAs that write the next sequence).

Out-of-bounds: TMA zero-fills rows past the end of Q/K/V; keys j >= seqlen_k are masked to
-inf in the block that contains the end. With variable length the TMA loads start at the
sequence's first row of the packed tensors: rows past its end hold the next sequence's queries
and keys (finite values, or zeros past the tensor's end), which the same key mask gives P = 0,
and whose query rows are never stored. The softmax scale must be positive (the row max is
taken on the unscaled scores).

Calling convention: ``impl(q, k, v, out, lse_or_None, softmax_scale, cu_seqlens_q, cu_seqlens_k,
max_seqlen_q, stream)`` with the tensors as the user holds them, the three lengths None in a
dense layout (a compiled function takes every parameter, so a dense call's recorded launch
passes them as None before the stream); the (seqlen, head_dim, heads, batch) views, or (total,
head_dim, heads) for variable length, and the TMA descriptors are built inside the compiled host
function.
"""

from __future__ import annotations

import math
from typing import Optional, Type

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

_THREADS_PER_WG = 128
_LOG2_E = math.log2(math.e)
# Named barriers (0 is __syncthreads): per consumer warpgroup, one for its epilogue and one
# for its turn to issue GEMMs.
_BAR_EPI = 1
_BAR_SCHED = 4


@cutlass.dsl_user_op
def _pack_f32x2(lo: Float32, hi: Float32, bf16: cutlass.Constexpr, *, loc=None, ip=None) -> Int32:
    """Two f32 rounded to bf16/f16 and packed into one 32-bit register (``lo`` in bits 0-15)."""
    kind = "bf16x2" if bf16 else "f16x2"
    return Int32(llvm.inline_asm(
        Int32.mlir_type, [Float32(hi).ir_value(loc=loc, ip=ip), Float32(lo).ir_value(loc=loc, ip=ip)],
        f"cvt.rn.{kind}.f32 $0, $1, $2;", "=r,f,f", has_side_effects=False, is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT))


class Sm90AttentionForward:
    """The CuTe DSL kernel; every argument is compile-time.

    ``dtype``: cutlass.BFloat16 or cutlass.Float16 (q, k, v and out). ``head_dim``: 64 or 128.
    ``causal``: bottom-right aligned causal mask. ``has_lse``: the launch takes an lse tensor
    (else None). ``tile_m``: query rows per CTA, 64 per consumer warpgroup: 128 (two) or 192
    (three, head_dim 64 only). ``tile_n``: keys per block, 64 or 128. ``num_stages``: K/V ring
    depth. ``scheduler_barrier``: the consumer warpgroups take turns issuing their GEMMs (named
    barriers), so one's softmax runs under another's wgmmas (FlashAttention-3's pingpong).
    ``persistent_ctas``: 0 launches one CTA per tile; n > 0 launches min(tiles, n) CTAs that each
    loop over tiles (round-robin), so a CTA's next Q/K/V loads overlap its epilogue; causal
    persistent launches take the query blocks longest-first across all heads. ``varlen``: the
    packed variable-length layout (see the module docstring), whose launch also takes the
    sequence offsets and the longest query sequence. The interface (sm90_attention.py: `plan`
    and the instances' design) chooses these per problem from measurements recorded there and
    in docs/performance.md.
    """

    def __init__(self, dtype: Type[cutlass.Numeric], head_dim: int, causal: bool, has_lse: bool,
                 *, tile_m: int, tile_n: int, num_stages: int, scheduler_barrier: bool = False,
                 persistent_ctas: int = 0, varlen: bool = False) -> None:
        if dtype not in (cutlass.BFloat16, cutlass.Float16):
            raise TypeError(f"dtype must be cutlass.BFloat16 or cutlass.Float16, got {dtype}")
        if head_dim not in (64, 128):
            raise ValueError(f"head_dim must be 64 or 128, got {head_dim}")
        if tile_m not in (128, 192) or (tile_m == 192 and head_dim != 64):
            raise ValueError(f"tile_m must be 128, or 192 with head_dim 64 (64 rows per consumer warpgroup), "
                             f"got {tile_m}")
        if tile_n not in (64, 128):
            raise ValueError(f"tile_n must be 64 or 128, got {tile_n}")
        if num_stages < 1:
            raise ValueError(f"num_stages must be >= 1, got {num_stages}")
        self.dtype = dtype
        self.head_dim = int(head_dim)
        self.causal = bool(causal)
        self.has_lse = bool(has_lse)
        self.tile_m = int(tile_m)
        self.tile_n = int(tile_n)
        self.num_stages = int(num_stages)
        self.scheduler_barrier = bool(scheduler_barrier)
        if persistent_ctas < 0:
            raise ValueError(f"persistent_ctas must be >= 0, got {persistent_ctas}")
        self.ctas = int(persistent_ctas)
        self.persistent = self.ctas > 0
        self.varlen = bool(varlen)
        self.consumer_wgs = self.tile_m // 64
        self.threads = (1 + self.consumer_wgs) * _THREADS_PER_WG
        # setmaxnreg budgets (64K registers per SM, one CTA per SM)
        self.load_regs, self.mma_regs = (24, 240) if self.consumer_wgs == 2 else (32, 160)

    # ------------------------------------------------------------------ host side
    @staticmethod
    def _view(t: cute.Tensor, order) -> cute.Tensor:
        return cute.make_tensor(t.iterator, cute.select(t.layout, mode=order))

    def _smem_layout(self, rows: int, stages: Optional[int]):
        """Row-major (rows, head_dim[, stages]) tile with the widest swizzle head_dim allows
        (K-major for the S GEMM; its transpose is the MN-major V operand of the PV GEMM)."""
        atom = warpgroup.make_smem_layout_atom(
            sm90_utils.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, self.dtype, self.head_dim), self.dtype)
        if stages is None:
            return cute.tile_to_shape(atom, (rows, self.head_dim), order=(0, 1))
        return cute.tile_to_shape(atom, (rows, self.head_dim, stages), order=(0, 1, 2))

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor,
                 mLSE: Optional[cute.Tensor], softmax_scale: Float32, mCuSeqlensQ: Optional[cute.Tensor],
                 mCuSeqlensK: Optional[cute.Tensor], max_seqlen_q: Optional[Int32], stream: cuda.CUstream):
        for t in (mQ, mK, mV, mO):
            if const_expr(t.element_type != self.dtype):
                raise TypeError(f"q, k, v and out must be {self.dtype}, got {t.element_type}")
        if const_expr(self.has_lse != (mLSE is not None)):
            raise TypeError("lse must be given exactly when the implementation was built with has_lse")
        if const_expr((mCuSeqlensQ is not None, mCuSeqlensK is not None, max_seqlen_q is not None)
                      != (self.varlen,) * 3):
            raise TypeError("cu_seqlens_q, cu_seqlens_k and max_seqlen_q must be given exactly when the "
                            "implementation was built with varlen")
        lse = None
        if const_expr(self.varlen):
            # (t, h, d) -> (t, d, h): every sequence's rows, packed
            q = self._view(mQ, [0, 2, 1])
            k = self._view(mK, [0, 2, 1])
            v = self._view(mV, [0, 2, 1])
            o = self._view(mO, [0, 2, 1])
            if const_expr(self.has_lse):
                lse = self._view(mLSE, [1, 0])    # (h, t) -> (t, h)
        else:
            # (b, s, h, d) -> (s, d, h, b)
            q = self._view(mQ, [1, 3, 2, 0])
            k = self._view(mK, [1, 3, 2, 0])
            v = self._view(mV, [1, 3, 2, 0])
            o = self._view(mO, [1, 3, 2, 0])
            if const_expr(self.has_lse):
                lse = self._view(mLSE, [2, 1, 0])     # (b, h, s) -> (s, h, b)

        d, tm, tn = self.head_dim, self.tile_m, self.tile_n
        k_major = warpgroup.OperandMajorMode.K
        tiled_mma_qk = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, k_major, k_major, Float32, (tm // 64, 1, 1), tiler_mn=(64, tn))
        tiled_mma_pv = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, k_major, warpgroup.OperandMajorMode.MN, Float32, (tm // 64, 1, 1),
            tiler_mn=(64, d), a_source=warpgroup.OperandSource.RMEM)
        # one warpgroup's share of the PV GEMM: its register layout places the epilogue's stores
        tiled_mma_o = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, k_major, warpgroup.OperandMajorMode.MN, Float32, (1, 1, 1),
            tiler_mn=(64, d), a_source=warpgroup.OperandSource.RMEM)

        sQ_layout = self._smem_layout(tm, None)
        sK_layout = self._smem_layout(tn, self.num_stages)
        sV_layout = self._smem_layout(tn, self.num_stages)
        sO_layout = self._smem_layout(64, tm // 64)       # one 64-row tile per consumer warpgroup

        load = cpasync.CopyBulkTensorTileG2SOp()
        tma_atom_q, tma_q = cpasync.make_tiled_tma_atom(load, q, sQ_layout, (tm, d))
        tma_atom_k, tma_k = cpasync.make_tiled_tma_atom(load, k, cute.slice_(sK_layout, (None, None, 0)), (tn, d))
        tma_atom_v, tma_v = cpasync.make_tiled_tma_atom(load, v, cute.slice_(sV_layout, (None, None, 0)), (tn, d))
        # (variable length stores rows < the sequence's length from shared memory instead: a TMA
        # store of a whole 64-row tile would write over the next sequence's rows)
        tma_atom_o, tma_o = None, o
        if const_expr(not self.varlen):
            tma_atom_o, tma_o = cpasync.make_tiled_tma_atom(
                cpasync.CopyBulkTensorTileS2GOp(), o, cute.slice_(sO_layout, (None, None, 0)), (64, d))

        stages = self.num_stages

        @cute.struct
        class SharedStorage:
            mbar_q: cute.struct.MemRange[cutlass.Int64, 2]
            mbar_k: cute.struct.MemRange[cutlass.Int64, stages * 2]
            mbar_v: cute.struct.MemRange[cutlass.Int64, stages * 2]
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sK_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sV_layout)], 1024]
            sO: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sO_layout)], 1024]

        heads_q = q.shape[2]
        heads_kv = k.shape[2]
        qhead_per_kv = heads_q // heads_kv
        if const_expr(self.varlen):
            tiles = (max_seqlen_q + tm - 1) // tm * heads_q * (mCuSeqlensQ.shape[0] - 1)
        else:
            tiles = (q.shape[0] + tm - 1) // tm * heads_q * q.shape[3]
        grid_x = tiles
        if const_expr(self.persistent):
            grid_x = cutlass.min(tiles, self.ctas)

        self.kernel(tma_atom_q, tma_q, tma_atom_k, tma_k, tma_atom_v, tma_v, tma_atom_o, tma_o, lse,
                    tiled_mma_qk, tiled_mma_pv, tiled_mma_o, sQ_layout, sK_layout, sV_layout, sO_layout,
                    softmax_scale, qhead_per_kv, mCuSeqlensQ, mCuSeqlensK, max_seqlen_q, SharedStorage).launch(
            grid=[grid_x, 1, 1],
            block=[self.threads, 1, 1],
            min_blocks_per_mp=1,
            stream=stream,
        )

    # ------------------------------------------------------------------ device side
    @cute.kernel
    def kernel(self, tma_atom_q: cute.CopyAtom, mQ: cute.Tensor, tma_atom_k: cute.CopyAtom, mK: cute.Tensor,
               tma_atom_v: cute.CopyAtom, mV: cute.Tensor, tma_atom_o: Optional[cute.CopyAtom], mO: cute.Tensor,
               mLSE: Optional[cute.Tensor], tiled_mma_qk: cute.TiledMma, tiled_mma_pv: cute.TiledMma,
               tiled_mma_o: cute.TiledMma, sQ_layout: cute.ComposedLayout, sK_layout: cute.ComposedLayout,
               sV_layout: cute.ComposedLayout, sO_layout: cute.ComposedLayout, softmax_scale: Float32,
               qhead_per_kv: Int32, mCuSeqlensQ: Optional[cute.Tensor], mCuSeqlensK: Optional[cute.Tensor],
               max_seqlen_q: Optional[Int32], SharedStorage: cutlass.Constexpr):
        d, tm, tn = self.head_dim, self.tile_m, self.tile_n
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == 0:
            cpasync.prefetch_descriptor(tma_atom_q)
            cpasync.prefetch_descriptor(tma_atom_k)
            cpasync.prefetch_descriptor(tma_atom_v)
            if const_expr(not self.varlen):
                cpasync.prefetch_descriptor(tma_atom_o)

        smem = utils.SmemAllocator()
        storage = smem.allocate(SharedStorage)
        consumer_warps = self.consumer_wgs * 4
        producer = pipeline.CooperativeGroup(pipeline.Agent.Thread)
        consumers = pipeline.CooperativeGroup(pipeline.Agent.Thread, consumer_warps)
        kv_bytes = cute.size_in_bytes(self.dtype, cute.slice_(sK_layout, (None, None, 0)))
        pipe_q = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar_q.data_ptr(), num_stages=1, producer_group=producer,
            consumer_group=consumers, tx_count=cute.size_in_bytes(self.dtype, sQ_layout), defer_sync=True)
        pipe_k = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar_k.data_ptr(), num_stages=self.num_stages, producer_group=producer,
            consumer_group=consumers, tx_count=kv_bytes, defer_sync=True)
        pipe_v = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar_v.data_ptr(), num_stages=self.num_stages, producer_group=producer,
            consumer_group=consumers, tx_count=kv_bytes, defer_sync=True)
        pipeline.pipeline_init_arrive(cluster_shape_mn=(1, 1), is_relaxed=True)

        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sV = storage.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)
        sO = storage.sO.get_tensor(sO_layout.outer, swizzle=sO_layout.inner)
        # V^T as (head_dim, keys, stages): the MN-major B operand of O += P V
        sVt = cute.composition(sV, cute.make_ordered_layout((d, tn, self.num_stages), order=(1, 0, 2)))

        heads_q = mQ.shape[2]
        if const_expr(self.varlen):
            m_blocks = (max_seqlen_q + tm - 1) // tm
            tiles = m_blocks * heads_q * (mCuSeqlensQ.shape[0] - 1)
        else:
            m_blocks = (mQ.shape[0] + tm - 1) // tm
            tiles = m_blocks * heads_q * mQ.shape[3]
        first_tile, _, _ = cute.arch.block_idx()
        tile_stride, _, _ = cute.arch.grid_dim()

        pipeline.pipeline_init_wait(cluster_shape_mn=(1, 1))

        if warp_idx < 4:
            # ---------------------------------------------------------------- producer
            cute.arch.setmaxregister_decrease(self.load_regs)
            if warp_idx == 0:
                kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.num_stages)
                q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
                tile = first_tile
                while tile < tiles:
                    m_block, head, batch = self._tile_coords(tile, m_blocks, heads_q, tiles)
                    head_kv = head // qhead_per_kv
                    offset_q, offset_k, seqlen_q, seqlen_k = self._sequence(batch, mQ, mK, mCuSeqlensQ,
                                                                            mCuSeqlensK)
                    n_blocks, mask_from = self._key_blocks(m_block, seqlen_q, seqlen_k)
                    if const_expr(self.varlen):
                        # a query block at or past its sequence's end loads nothing (its consumers skip it)
                        n_blocks = cutlass.select_(m_block * tm < seqlen_q, n_blocks, Int32(0))
                    if n_blocks > 0:
                        gQ = cute.local_tile(self._rows(mQ, head, batch, offset_q), (tm, d), (m_block, 0))
                        # (tn, d, blocks)
                        gK = cute.local_tile(self._rows(mK, head_kv, batch, offset_k), (tn, d), (None, 0))
                        gV = cute.local_tile(self._rows(mV, head_kv, batch, offset_k), (tn, d), (None, 0))
                        tQs, tQg = cpasync.tma_partition(tma_atom_q, 0, cute.make_layout(1),
                                                         cute.group_modes(sQ, 0, 2), cute.group_modes(gQ, 0, 2))
                        tKs, tKg = cpasync.tma_partition(tma_atom_k, 0, cute.make_layout(1),
                                                         cute.group_modes(sK, 0, 2), cute.group_modes(gK, 0, 2))
                        tVs, tVg = cpasync.tma_partition(tma_atom_v, 0, cute.make_layout(1),
                                                         cute.group_modes(sV, 0, 2), cute.group_modes(gV, 0, 2))
                        # K of the last block first, then Q (once the previous tile's last S GEMM is done)
                        pipe_k.producer_acquire(kv_state)
                        cute.copy(tma_atom_k, tKg[(None, n_blocks - 1)], tKs[(None, kv_state.index)],
                                  tma_bar_ptr=pipe_k.producer_get_barrier(kv_state))
                        pipe_q.producer_acquire(q_state)
                        cute.copy(tma_atom_q, tQg, tQs, tma_bar_ptr=pipe_q.producer_get_barrier(q_state))
                        q_state.advance()
                        for i in cutlass.range(n_blocks - 1, unroll=1):
                            n = n_blocks - 2 - i
                            v_state = kv_state.clone()
                            kv_state.advance()
                            pipe_k.producer_acquire(kv_state)
                            cute.copy(tma_atom_k, tKg[(None, n)], tKs[(None, kv_state.index)],
                                      tma_bar_ptr=pipe_k.producer_get_barrier(kv_state))
                            pipe_v.producer_acquire(v_state)
                            cute.copy(tma_atom_v, tVg[(None, n + 1)], tVs[(None, v_state.index)],
                                      tma_bar_ptr=pipe_v.producer_get_barrier(v_state))
                        pipe_v.producer_acquire(kv_state)
                        cute.copy(tma_atom_v, tVg[(None, 0)], tVs[(None, kv_state.index)],
                                  tma_bar_ptr=pipe_v.producer_get_barrier(kv_state))
                        kv_state.advance()
                    tile += tile_stride
        else:
            # ---------------------------------------------------------------- consumers
            cute.arch.setmaxregister_increase(self.mma_regs)
            cwg = warp_idx // 4 - 1                      # consumer warpgroup: rows 64*cwg..64*cwg+63
            ctid = tidx - _THREADS_PER_WG                # thread index among the consumers
            store_thread = ctid % _THREADS_PER_WG == 0   # issues the warpgroup's TMA stores of O
            wg_qk = tiled_mma_qk.get_slice(cwg * _THREADS_PER_WG)
            wg_pv = tiled_mma_pv.get_slice(cwg * _THREADS_PER_WG)
            tSrQ = tiled_mma_qk.make_fragment_A(wg_qk.partition_A(sQ))         # (MMA, 1, d/16)
            tSrK = tiled_mma_qk.make_fragment_B(wg_qk.partition_B(sK))         # (MMA, 1, d/16, stages)
            tOrV = tiled_mma_pv.make_fragment_B(wg_pv.partition_B(sVt))        # (MMA, 1, tn/16, stages)
            tOrP = tiled_mma_pv.make_fragment_A(wg_pv.partition_shape_A((tm, tn)))   # (MMA, 1, tn/16)
            acc_S = cute.make_rmem_tensor(wg_qk.partition_shape_C((tm, tn)), Float32)
            acc_O = cute.make_rmem_tensor(wg_pv.partition_shape_C((tm, d)), Float32)
            rO = cute.make_rmem_tensor(acc_O.shape, self.dtype)
            # stmatrix of O into this warpgroup's 64-row tile (laid out by one warpgroup's PV MMA)
            st_atom = cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(False, 4), self.dtype)
            thr_st = cute.make_tiled_copy_C(st_atom, tiled_mma_o).get_slice(ctid % _THREADS_PER_WG)
            tOsO_st = thr_st.partition_D(sO[(None, None, cwg)])
            # (row, column) inside the tile of each of this thread's scores: thread 0's (constants)
            # plus this thread's offset (its first score's coordinates; thread 0's first is (0, 0))
            identity_S = cute.make_identity_tensor((tm, tn))
            t0ScS = tiled_mma_qk.get_slice(0).partition_C(identity_S)
            thr_row, thr_col = tiled_mma_qk.get_slice(ctid).partition_C(identity_S)[0]
            row_max = cute.make_rmem_tensor((2,), Float32)
            row_sum = cute.make_rmem_tensor((2,), Float32)
            row_scale = cute.make_rmem_tensor((2,), Float32)
            scale_log2 = softmax_scale * Float32(_LOG2_E)
            q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
            kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.num_stages)
            if const_expr(self.scheduler_barrier):
                # Turns to issue the GEMMs of the main loops go round the consumer warpgroups,
                # warpgroup 0 first. (The last turn's arrive is never waited for: the barrier is
                # left half-arrived at exit, as FlashAttention-3 leaves it.)
                if cwg == 0:
                    cute.arch.barrier_arrive(barrier_id=_BAR_SCHED, number_of_threads=2 * _THREADS_PER_WG)
            tile = first_tile
            if const_expr(self.varlen):
                # 16-byte vectors of a warpgroup's 64-row output tile, d / 8 threads a row: its rows
                # below the sequence's length go from shared memory to global memory
                vector = 128 // self.dtype.width
                row_copy = cute.make_tiled_copy_tv(
                    cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype, num_bits_per_copy=128),
                    cute.make_ordered_layout((_THREADS_PER_WG * vector // d, d // vector), order=(1, 0)),
                    cute.make_layout((1, vector)))
                thr_rows = row_copy.get_slice(ctid % _THREADS_PER_WG)
                tOsO_rows = thr_rows.partition_S(sO[(None, None, cwg)])
                tOcO_rows = thr_rows.partition_S(cute.make_identity_tensor((64, d)))
                tOrO_rows = cute.make_fragment_like(tOsO_rows)
            while tile < tiles:
                m_block, head, batch = self._tile_coords(tile, m_blocks, heads_q, tiles)
                offset_q, offset_k, seqlen_q, seqlen_k = self._sequence(batch, mQ, mK, mCuSeqlensQ, mCuSeqlensK)
                # a query block at or past its sequence's end (variable length) has nothing to compute
                # or store, and its producer loads nothing
                has_rows = True
                if const_expr(self.varlen):
                    has_rows = m_block * tm < seqlen_q
                if has_rows:
                    n_blocks, mask_from = self._key_blocks(m_block, seqlen_q, seqlen_k)
                    offset = seqlen_k - seqlen_q             # query i sees keys j <= i + offset (causal)
                    row_max.fill(-Float32.inf)
                    row_sum.fill(0.0)
                    if n_blocks > 0:
                        pipe_q.consumer_wait(q_state)
                        # first block (the last keys): S, mask, softmax -> P
                        pipe_k.consumer_wait(kv_state)
                        self._gemm(tiled_mma_qk, acc_S, tSrQ, tSrK[(None, None, None, kv_state.index)], False)
                        warpgroup.wait_group(0)
                        pipe_k.consumer_release(kv_state)
                        self._mask(acc_S, t0ScS, m_block * tm + thr_row, n_blocks * tn - tn + thr_col, seqlen_k,
                                   offset)
                        self._online_softmax(acc_S, row_max, row_sum, row_scale, scale_log2, True)
                        self._to_p(acc_S, tOrP)
                        step_args = (n_blocks, pipe_k, pipe_v, tiled_mma_qk, tiled_mma_pv, tSrQ, tSrK, tOrV, tOrP,
                                     acc_S, acc_O, row_max, row_sum, row_scale, scale_log2, cwg, t0ScS,
                                     m_block * tm + thr_row, thr_col, seqlen_k, offset)
                        # blocks n_blocks-2 .. mask_from cross the causal diagonal, the ones below need no
                        # mask (without causality only the first block, which holds the end of the keys, does)
                        n_masked = Int32(0)
                        if const_expr(self.causal):
                            n_masked = cutlass.max(n_blocks - 1 - mask_from, Int32(0))
                            for i in cutlass.range(n_masked, unroll=1):
                                kv_state = self._step(i + 1, kv_state, True, *step_args)
                        for i in cutlass.range(n_blocks - 1 - n_masked, unroll=1):
                            kv_state = self._step(i + 1 + n_masked, kv_state, False, *step_args)
                        # every S GEMM of the tile is done: Q's slot may take the next tile's
                        pipe_q.consumer_release(q_state)
                        q_state.advance()
                        # the last P V
                        pipe_v.consumer_wait(kv_state)
                        self._gemm(tiled_mma_pv, acc_O, tOrP, tOrV[(None, None, None, kv_state.index)], n_blocks > 1)
                        warpgroup.wait_group(0)
                        pipe_v.consumer_release(kv_state)
                        kv_state.advance()
                    else:
                        acc_O.fill(0.0)                      # no key visible: out = 0, lse = -inf

                    # ---- epilogue: normalise, lse, O through shared memory and a TMA store (variable
                    # length: stores of the rows inside the sequence)
                    for r in cutlass.range_constexpr(2):
                        total = row_sum[r]
                        total = total + cute.arch.shuffle_sync_bfly(total, offset=2)
                        total = total + cute.arch.shuffle_sync_bfly(total, offset=1)
                        inv = Float32(0.0)
                        lse_r = -Float32.inf
                        if total > Float32(0.0):
                            inv = Float32(1.0) / total
                            lse_r = row_max[r] * softmax_scale + cute.math.log(total, fastmath=True)
                        row_scale[r] = inv
                        row_sum[r] = lse_r
                    self._rescale(acc_O, row_scale)
                    if const_expr(self.has_lse):
                        if tidx % 4 == 0:
                            for r in cutlass.range_constexpr(2):
                                row = m_block * tm + thr_row + t0ScS[2 * r][0]
                                if row < seqlen_q:
                                    if const_expr(self.varlen):
                                        mLSE[offset_q + row, head] = row_sum[r]
                                    else:
                                        mLSE[row, head, batch] = row_sum[r]
                    self._to_p(acc_O, rO)
                    if const_expr(self.persistent):
                        # the warpgroup's previous store must have read its tile
                        if const_expr(not self.varlen):
                            if store_thread:
                                cute.arch.cp_async_bulk_wait_group(0, read=True)
                        cute.arch.barrier(barrier_id=_BAR_EPI + cwg, number_of_threads=_THREADS_PER_WG)
                    cute.copy(st_atom, thr_st.retile(rO), tOsO_st)
                    if const_expr(self.varlen):
                        cute.arch.barrier(barrier_id=_BAR_EPI + cwg, number_of_threads=_THREADS_PER_WG)
                        cute.autovec_copy(tOsO_rows, tOrO_rows)
                        gO = cute.local_tile(self._rows(mO, head, batch, offset_q), (64, d),
                                             (m_block * (tm // 64) + cwg, 0))
                        tOgO_rows = thr_rows.partition_D(gO)
                        rows_left = seqlen_q - m_block * tm - cwg * 64
                        for m in cutlass.range_constexpr(cute.size(tOgO_rows, mode=[1])):
                            if tOcO_rows[0, m, 0][0] < rows_left:
                                cute.copy(row_copy, tOrO_rows[None, m, None], tOgO_rows[None, m, None])
                    else:
                        # the generic-proxy shared-memory writes, visible to the TMA (async proxy)
                        cute.arch.fence_proxy("async.shared", space="cta")
                        cute.arch.barrier(barrier_id=_BAR_EPI + cwg, number_of_threads=_THREADS_PER_WG)
                        if store_thread:
                            gO = cute.local_tile(mO[None, None, head, batch], (64, d),
                                                 (m_block * (tm // 64) + cwg, 0))
                            tOs, tOg = cpasync.tma_partition(tma_atom_o, 0, cute.make_layout(1),
                                                             cute.group_modes(sO, 0, 2), cute.group_modes(gO, 0, 2))
                            cute.copy(tma_atom_o, tOs[(None, cwg)], tOg)
                            cute.arch.cp_async_bulk_commit_group()
                tile += tile_stride
            if const_expr(not self.varlen):
                if store_thread:
                    cute.arch.cp_async_bulk_wait_group(0, read=True)

    @cute.jit
    def _tile_coords(self, tile: Int32, m_blocks: Int32, heads_q: Int32, tiles: Int32):
        """(query block, head, batch) of a linear tile index. Query blocks go fastest (the CTAs
        running at once share K/V in L2), walked backwards when causal (longest rows first: the
        hardware hands later tiles to the CTAs that finish first). A persistent causal launch
        deals tiles round-robin instead, so there the query block goes slowest, longest first
        (every CTA gets a like share of long and short tiles)."""
        m_block = Int32(0)
        bh = Int32(0)
        if const_expr(self.persistent and self.causal):
            heads_batches = tiles // m_blocks
            m_idx = tile // heads_batches
            bh = tile - m_idx * heads_batches
            m_block = m_blocks - 1 - m_idx
        else:
            bh = tile // m_blocks
            m_block = tile - bh * m_blocks
            if const_expr(self.causal):
                m_block = m_blocks - 1 - m_block
        batch = bh // heads_q
        return m_block, bh - batch * heads_q, batch

    @cute.jit
    def _sequence(self, batch: Int32, mQ: cute.Tensor, mK: cute.Tensor, mCuSeqlensQ: Optional[cute.Tensor],
                  mCuSeqlensK: Optional[cute.Tensor]):
        """(first query row, first key row, query length, key length) of sequence ``batch``: from
        the offsets for variable length, the tensors' extents (and offsets 0) for the dense layout.
        The offsets are trusted (reading them on the host would synchronise), so each sequence is
        clamped to the packed tensors: offsets past their ends, or decreasing, give wrong rows but
        no access outside the tensors. Producer and consumers read the same values, so they agree
        on every tile's key blocks."""
        if const_expr(self.varlen):
            offset_q, end_q = self._clamped(mCuSeqlensQ, batch, mQ.shape[0])
            offset_k, end_k = self._clamped(mCuSeqlensK, batch, mK.shape[0])
            return offset_q, offset_k, end_q - offset_q, end_k - offset_k
        return Int32(0), Int32(0), mQ.shape[0], mK.shape[0]

    @cute.jit
    def _clamped(self, offsets: cute.Tensor, batch: Int32, rows: Int32):
        """Sequence ``batch``'s first row and end from ``offsets``, inside ``[0, rows]`` and the end
        not before the first row."""
        first = cutlass.min(cutlass.max(offsets[batch], Int32(0)), rows)
        return first, cutlass.min(cutlass.max(offsets[batch + 1], first), rows)

    def _rows(self, t: cute.Tensor, head: Int32, batch: Int32, offset: Int32) -> cute.Tensor:
        """The (seqlen, head_dim) rows of one head of sequence ``batch``: for variable length the
        packed tensor from row ``offset`` on (rows past the sequence's end are the next sequence's,
        or past the tensor's end, where TMA loads zeros: the key mask and the row-predicated
        stores keep them out of the results)."""
        if const_expr(self.varlen):
            return cute.domain_offset((offset, 0), t[None, None, head])
        return t[None, None, head, batch]

    @cute.jit
    def _key_blocks(self, m_block: Int32, seqlen_q: Int32, seqlen_k: Int32):
        """(key blocks the query block sees, first block that needs the mask): blocks >= the
        second hold the end of the keys or cross the causal diagonal."""
        tm, tn = self.tile_m, self.tile_n
        n_blocks = (seqlen_k + tn - 1) // tn
        mask_from = n_blocks
        if seqlen_k % tn != 0:
            mask_from = n_blocks - 1
        if const_expr(self.causal):
            offset = seqlen_k - seqlen_q
            last_visible = cutlass.max((m_block + 1) * tm + offset, Int32(0))   # keys < this
            n_blocks = cutlass.min(n_blocks, (last_visible + tn - 1) // tn)
            first_crossing = cutlass.max(m_block * tm + offset + 1, Int32(0)) // tn
            mask_from = cutlass.min(mask_from, first_crossing)
        return n_blocks, mask_from

    # ------------------------------------------------------------------ helpers
    @cute.jit
    def _step(self, j: Int32, kv_state: pipeline.PipelineState, masked: cutlass.Constexpr, n_blocks: Int32,
              pipe_k: pipeline.PipelineAsync, pipe_v: pipeline.PipelineAsync, tiled_mma_qk: cute.TiledMma,
              tiled_mma_pv: cute.TiledMma, tSrQ: cute.Tensor, tSrK: cute.Tensor, tOrV: cute.Tensor,
              tOrP: cute.Tensor, acc_S: cute.Tensor, acc_O: cute.Tensor,
              row_max: cute.Tensor, row_sum: cute.Tensor, row_scale: cute.Tensor, scale_log2: Float32,
              cwg: Int32, t0ScS: cute.Tensor, thr_row0: Int32, thr_col: Int32, seqlen_k: Int32, offset: Int32):
        """The j-th key block after the first one (block n_blocks - 1 - j): S of it and O += P V of
        the block before in flight together, then its softmax while the PV wgmma runs. Returns
        the pipeline state of its K/V slots."""
        n = n_blocks - 1 - j
        v_state = kv_state.clone()
        kv_state.advance()
        pipe_k.consumer_wait(kv_state)
        if const_expr(self.scheduler_barrier):
            # our turn: the previous warpgroup has issued its GEMMs
            cute.arch.barrier(barrier_id=_BAR_SCHED + cwg, number_of_threads=2 * _THREADS_PER_WG)
        self._gemm(tiled_mma_qk, acc_S, tSrQ, tSrK[(None, None, None, kv_state.index)], False)
        pipe_v.consumer_wait(v_state)
        # (the first P V, j = 1, overwrites the accumulator)
        self._gemm(tiled_mma_pv, acc_O, tOrP, tOrV[(None, None, None, v_state.index)], j > 1)
        if const_expr(self.scheduler_barrier):
            # the next warpgroup's turn
            cute.arch.barrier_arrive(barrier_id=_BAR_SCHED + (cwg + 1) % self.consumer_wgs,
                                     number_of_threads=2 * _THREADS_PER_WG)
        warpgroup.wait_group(1)
        pipe_k.consumer_release(kv_state)
        if const_expr(masked):
            self._mask(acc_S, t0ScS, thr_row0, n * self.tile_n + thr_col, seqlen_k, offset)
        self._online_softmax(acc_S, row_max, row_sum, row_scale, scale_log2, False)
        warpgroup.wait_group(0)
        pipe_v.consumer_release(v_state)
        self._to_p(acc_S, tOrP)
        self._rescale(acc_O, row_scale)
        return kv_state

    @cute.jit
    def _gemm(self, tiled_mma: cute.TiledMma, acc: cute.Tensor, tA: cute.Tensor, tB: cute.Tensor,
              accumulate):
        """acc (+)= A B over the k-blocks of the fragments, issued and committed as one wgmma group
        (with an atom of its own: its ACCUMULATE field is set here, inside the caller's loops).
        ``accumulate``: a Python or a runtime bool (False: the first k-block overwrites acc)."""
        atom = cute.make_mma_atom(tiled_mma.op)
        warpgroup.fence()
        atom.set(warpgroup.Field.ACCUMULATE, accumulate)
        for kb in cutlass.range_constexpr(cute.size(tA, mode=[2])):
            cute.gemm(atom, acc, tA[(None, None, kb)], tB[(None, None, kb)], acc)
            atom.set(warpgroup.Field.ACCUMULATE, True)
        warpgroup.commit_group()

    @cute.jit
    def _mask(self, acc_S: cute.Tensor, t0ScS: cute.Tensor, row0: Int32, col0: Int32, seqlen_k: Int32,
              offset: Int32):
        """Scores of keys past the end, or above the causal diagonal, to -inf. ``row0``/``col0``:
        the global (query, key) of this thread's first score; ``t0ScS``: thread 0's coordinates
        (compile-time), which are this thread's relative to its first score."""
        limits = []
        for r in cutlass.range_constexpr(2):
            limit = seqlen_k - col0                                    # relative columns < limit are keys
            if const_expr(self.causal):
                limit = cutlass.min(limit, row0 + t0ScS[2 * r][0] + offset + 1 - col0)
            limits.append(limit)
        for i in cutlass.range_constexpr(cute.size(acc_S)):
            acc_S[i] = cutlass.select_(t0ScS[i][1] >= limits[(i // 2) % 2], -Float32.inf, acc_S[i])

    @cute.jit
    def _online_softmax(self, acc_S: cute.Tensor, row_max: cute.Tensor, row_sum: cute.Tensor,
                        row_scale: cute.Tensor, scale_log2: Float32, first: cutlass.Constexpr):
        """Scores -> exp2(scale_log2 * (s - row max)) in place; the running max and (per-thread)
        sum updated; row_scale = the factor the previous O and sum take. The thread's values
        of accumulator row r are the flat indices i with (i // 2) % 2 == r; a row's other
        values are on the other 3 threads of the quad."""
        size = cute.size(acc_S)
        for r in cutlass.range_constexpr(2):
            mx = row_max[r]
            for i in cutlass.range_constexpr(size):
                if const_expr((i // 2) % 2 == r):
                    mx = cute.arch.fmax(mx, acc_S[i])
            mx = cute.arch.fmax(mx, cute.arch.shuffle_sync_bfly(mx, offset=2))
            mx = cute.arch.fmax(mx, cute.arch.shuffle_sync_bfly(mx, offset=1))
            # a row with nothing visible yet keeps max -inf; subtract 0 then (exp2(-inf) = 0)
            mx_scaled = cutlass.select_(mx == -Float32.inf, Float32(0.0), mx * scale_log2)
            if const_expr(not first):
                row_scale[r] = cute.math.exp2(row_max[r] * scale_log2 - mx_scaled, fastmath=True)
            row_max[r] = mx
            total = Float32(0.0)
            for i in cutlass.range_constexpr(size):
                if const_expr((i // 2) % 2 == r):
                    p = cute.math.exp2(acc_S[i] * scale_log2 - mx_scaled, fastmath=True)
                    acc_S[i] = p
                    total = total + p
            if const_expr(first):
                row_sum[r] = total
            else:
                row_sum[r] = row_sum[r] * row_scale[r] + total

    @cute.jit
    def _to_p(self, acc_S: cute.Tensor, tOrP: cute.Tensor):
        """P (the exponentiated scores) into the A fragment of the PV wgmma, in pairs. The
        fragment's registers hold the accumulator's values in the same order: columns
        16k..16k+15 of a wgmma accumulator are k-block k of an A operand in registers."""
        packed = cute.recast_tensor(tOrP, Int32)
        for i in cutlass.range_constexpr(cute.size(packed)):
            packed[i] = _pack_f32x2(acc_S[2 * i], acc_S[2 * i + 1], self.dtype is cutlass.BFloat16)

    @cute.jit
    def _rescale(self, acc_O: cute.Tensor, row_scale: cute.Tensor):
        for i in cutlass.range_constexpr(cute.size(acc_O)):
            acc_O[i] = acc_O[i] * row_scale[(i // 2) % 2]
