"""CuTe DSL helpers shared by the GEMM implementations: operand views, predicates, and the
``cp.async`` ring that streams A/B k-tiles into shared memory (tile setup, prologue, refill).

The user's operands arrive as A (L, M, K) / B (L, K, N) / out (L, M, N), or the same without
L. `mkl_view` turns them into CuTe's GEMM convention -- A (M, K, L), B (N, K, L),
out/C (M, N, L) -- at trace time, so neither a rank-2 call nor a transposed operand costs
anything at run time.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute

#: mode orders taking (L, R, C) to CuTe's (MN, K, L) convention
A_ORDER = [1, 2, 0]  # (L, M, K) -> (M, K, L)
B_ORDER = [2, 1, 0]  # (L, K, N) -> (N, K, L)
OUT_ORDER = [1, 2, 0]  # (L, M, N) -> (M, N, L)


@cute.jit
def mkl_view(t: cute.Tensor, order: cutlass.Constexpr) -> cute.Tensor:
    """View a rank-2 or rank-3 operand as (MN, K, L) or (M, N, L); a rank-2 one gets L = 1."""
    layout = t.layout
    if cutlass.const_expr(cute.rank(layout) == 2):
        layout = cute.prepend(layout, cute.make_layout(1, stride=0))
    return cute.make_tensor(t.iterator, cute.select(layout, mode=order))


@cute.jit
def mn_predicate(tXcX: cute.Tensor, bound) -> cute.Tensor:
    """Predicates over the (rest_v, CPY_MN, CPY_K) copies of a partitioned (MN, K) tile.

    ``tXcX`` is the identity tensor partitioned like the copy source, ((atom_v, rest_v),
    CPY_MN, CPY_K[, k_tiles]); the result says per vector whether its MN coordinate is
    below ``bound`` (the K extent is handled separately), broadcast along CPY_K.
    """
    pred = cute.make_rmem_tensor(
        cute.make_layout((tXcX.shape[0][1], cute.size(tXcX, mode=[1]), cute.size(tXcX, mode=[2])),
                         stride=(cute.size(tXcX, mode=[1]), 1, 0)),
        cutlass.Boolean)
    for v in cutlass.range_constexpr(pred.shape[0]):
        for i in cutlass.range_constexpr(pred.shape[1]):
            pred[v, i, 0] = cute.elem_less(tXcX[(0, v), i, 0, 0][0], bound)
    return pred


@cute.jit
def grouped_tile_coord(pid, m_tiles, n_tiles, group: cutlass.Constexpr):
    """Map a linear CTA index to an (m, n) tile, walking ``group`` M-tiles down each N column.

    Consecutive CTAs then share B tiles and reuse a band of A tiles from L2, instead of
    streaming the whole of A once per N column.
    """
    per_group = group * n_tiles
    first_m = (pid // per_group) * group
    rows = cutlass.min(m_tiles - first_m, group)
    within = pid - (pid // per_group) * per_group
    return first_m + within % rows, within // rows


def gemm_operands(mA: cute.Tensor, mB: cute.Tensor, mOut: cute.Tensor, mC):
    """A (M, K, L), B (N, K, L), out (M, N, L) and C (M, N, L) or None, via `mkl_view`."""
    C = None
    if mC is not None:  # trace-time choice: C is either a tensor or absent
        C = mkl_view(mC, OUT_ORDER)
    return mkl_view(mA, A_ORDER), mkl_view(mB, B_ORDER), mkl_view(mOut, OUT_ORDER), C


def k_shifted_tiles(A: cute.Tensor, B: cute.Tensor, l, tile, coord, align_bytes: int):
    """This CTA's A/B k-tiles and their coordinate tensors, K shifted so that the *first*
    k-tile is the partial one (the main loop then needs no K checks).

    Returns ``(gA, gB, cA, cB, k_tiles)``; gA/cA are (BM, BK, k_tiles), gB/cB (BN, BK, k_tiles).
    ``align_bytes``: the alignment of A/B the kernel may assume; the shift (a multiple of
    the alignment: K is, for K-major operands, the leading dimension is, otherwise) keeps it.
    """
    M, K, N = A.shape[0], A.shape[1], B.shape[0]
    gA = cute.local_tile(A[None, None, l], tiler=tile, coord=coord, proj=(1, None, 1))
    gB = cute.local_tile(B[None, None, l], tiler=tile, coord=coord, proj=(None, 1, 1))
    cA = cute.local_tile(cute.make_identity_tensor((M, K)), tiler=tile, coord=coord, proj=(1, None, 1))
    cB = cute.local_tile(cute.make_identity_tensor((N, K)), tiler=tile, coord=coord, proj=(None, 1, 1))
    k_tiles = cute.size(gA, mode=[2])
    residue = K - k_tiles * tile[2]
    gA = cute.domain_offset((0, residue, 0), gA)
    gB = cute.domain_offset((0, residue, 0), gB)
    gA = cute.make_tensor(gA.iterator.align(align_bytes), gA.layout)
    gB = cute.make_tensor(gB.iterator.align(align_bytes), gB.layout)
    cA = cute.domain_offset((0, residue, 0), cA)
    cB = cute.domain_offset((0, residue, 0), cB)
    return gA, gB, cA, cB, k_tiles


def partition_g2s(copy: cute.TiledCopy, tidx, g: cute.Tensor, s: cute.Tensor, c: cute.Tensor, bound):
    """One operand's global-to-shared copy for this thread: ``(copy, tXgX, tXsX, tXcX, tXpX)``
    (source, ring destination, coordinates, MN predicates against ``bound``)."""
    thr = copy.get_slice(tidx)
    tXcX = thr.partition_S(c)
    return copy, thr.partition_S(g), thr.partition_D(s), tXcX, mn_predicate(tXcX, bound)


@cute.jit
def load_prologue(a, b, k_tiles, stages: cutlass.Constexpr):
    """Fill ring slots 0 .. stages-2: the partial first k-tile (K-checked per copy), then full
    tiles; one ``cp.async`` group per slot. ``a``/``b``: `partition_g2s` results."""
    copy_A, tAgA, tAsA, tAcA, tApA = a
    copy_B, tBgB, tBsB, tBcB, tBpB = b
    if k_tiles > 0:
        for k in cutlass.range_constexpr(cute.size(tAsA, mode=[2])):
            if cute.elem_less(-1, tAcA[0, 0, k, 0][1]):
                cute.copy(copy_A, tAgA[None, None, k, 0], tAsA[None, None, k, 0], pred=tApA[None, None, k])
        for k in cutlass.range_constexpr(cute.size(tBsB, mode=[2])):
            if cute.elem_less(-1, tBcB[0, 0, k, 0][1]):
                cute.copy(copy_B, tBgB[None, None, k, 0], tBsB[None, None, k, 0], pred=tBpB[None, None, k])
    cute.arch.cp_async_commit_group()
    for s in cutlass.range_constexpr(1, stages - 1):
        if s < k_tiles:
            cute.copy(copy_A, tAgA[None, None, None, s], tAsA[None, None, None, s], pred=tApA)
            cute.copy(copy_B, tBgB[None, None, None, s], tBsB[None, None, None, s], pred=tBpB)
        cute.arch.cp_async_commit_group()


@cute.jit
def next_read_slot(read, stages: cutlass.Constexpr):
    """Advance the ring's read slot and wait until its k-tile has landed for every thread."""
    read = read + 1
    if read == stages:
        read = 0
    cute.arch.cp_async_wait_group(stages - 2)
    cute.arch.sync_threads()
    return read


@cute.jit
def load_next_tile(a, b, next_tile, write, k_tiles, stages: cutlass.Constexpr):
    """Copy k-tile ``next_tile`` (if any) into ring slot ``write`` as one ``cp.async`` group;
    returns the advanced ``(next_tile, write)``."""
    copy_A, tAgA, tAsA, _, tApA = a
    copy_B, tBgB, tBsB, _, tBpB = b
    if next_tile < k_tiles:
        cute.copy(copy_A, tAgA[None, None, None, next_tile], tAsA[None, None, None, write], pred=tApA)
        cute.copy(copy_B, tBgB[None, None, None, next_tile], tBsB[None, None, None, write], pred=tBpB)
    cute.arch.cp_async_commit_group()
    next_tile = next_tile + 1
    write = write + 1
    if write == stages:
        write = 0
    return next_tile, write
