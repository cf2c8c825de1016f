"""CuTe DSL helpers shared by the GEMM implementations: operand views and predicates.

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
