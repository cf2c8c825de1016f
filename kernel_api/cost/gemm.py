"""The GEMM cost model: a tile model with wave quantisation, cluster and schedule terms, and a
streaming floor for skinny problems, in `kernel_api.cost.units` (`GEMM_COST_UNITS_PER_SECOND`)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from ..arguments import GemmArguments
from .units import GEMM_COST_UNITS_PER_SECOND

if TYPE_CHECKING:
    from ..kernel import Kernel

#: Skinny GEMMs (min(M, N) at most this) are bound by streaming the large operand, which the
#: tile model does not see: whole-tile kernels get a floor of their bytes at
#: `TILE_STREAM_BYTES_PER_SECOND`, fitted to the Sm90 family's 64x128 and 128x128 tiles on the
#: H200 at M = 1 and 16 (1.4-2.7 TB/s effective: 57.7 us at 1x8192x8192, 150-174 us at
#: 1x14336x14336; gemm_shapes.py --group small_m), where the tile
#: model alone predicted 22 us for 117 MB.
SKINNY_GEMM = 128
#: A two-CTA cluster along the output's longer side of tiles (2x1 on a tall output, 1x2 on a
#: wide one) against the same tile clustered along the shorter side: measured 1.04-1.22x the
#: time on the tall outputs of GPT-2's prefill and its backward (H100 and H200: c_attn, attn and
#: mlp c_proj, the dX products; 8192x1024x4096, 4096x512x4096, 16384x1024x16384 in the tuning
#: records) and 1.02-1.12x on wide ones (lm_head, c_attn dW, 1024x8192x8192, 4096x11008x4096);
#: the "GPT-2 and sweep" runs of tests/data/measured_gemm_times.json. Square outputs: no term.
CLUSTER_ALONG_LONG_SIDE = 1.05
#: A cooperative schedule (both consumer warpgroups on one tile) stores each tile's epilogue
#: while no MMA runs; ping-pong overlaps it with the other warpgroup's main loop. The stall is
#: a fixed share of a tile's work in k-steps: the efficiency over 1 + this / K. Fitted to
#: GPT-2's lm_head (8192 x 50256 x 768): the 128x256 cooperative tile at 1.08x (H100) and
#: 1.26x (H200) the 128x128 ping-pong tile's time, where the intensity term alone rates it 9 %
#: faster. Bounded above by the aligned-shape sweep (K >= 4096, cooperative 0.94-1.04x): from 100
#: on, cuBLAS would outrank our tiles at 4096^3 and 8192^3, where they are measured faster
#: (the "GPT-2 and sweep" runs of tests/data). 60 leaves the H200's lm_head on the
#: cooperative tile (0.80 of the best). 75, not 80, for 2048^3, where the two
#: tiles' costs tied (one wave of 128x256 tiles against two of 128x128) and the generation
#: order took the ping-pong tile: on an H100 the 128x256 cooperative tile ran 0.894x its time
#: in PickBest's settled timing and 0.85x in the burst one (gemm_shapes.py --group small), on
#: H200s 0.997-1.004x (three runs). One case measured later moved the other way: the staged
#: kernels' 777x5001x555 (the odd_sweep group), where the two tiles'
#: costs are within 0.3 %, went to the cooperative tile at 0.86x the 64x128 one.
COOPERATIVE_EPILOGUE_K = 75.0
#: A cluster longer than the output's tiles along its dimension (2x1 on a one-tile M: the
#: grid's second CTA of every cluster has no rows) against the same tile clustered the other
#: way: 1.24-1.96x the time at M = 1-128 (H200, gemm_shapes.py --group small_m; H100
#: 128x8192x8192 1.27-1.29x), although the SMs are not all busy: the
#: empty CTA still takes its multicast share and paces its partner. Not a wave effect, so a
#: factor on the whole cost, streaming floor included.
CLUSTER_PAST_THE_TILES = 1.3
TILE_STREAM_BYTES_PER_SECOND = 2.5e12


def gemm_bytes(args: GemmArguments) -> int:
    """Bytes of A and B read and out written once."""
    attrs = args.tensor_attributes
    L = max(args.L, 1)
    return L * (args.M * args.K * attrs["A"].dtype.bytes + args.K * args.N * attrs["B"].dtype.bytes
                + args.M * args.N * attrs["out"].dtype.bytes)


def gemm_cost(kernel: Kernel, args: GemmArguments, sm_count: int) -> float:
    """Estimated run time (arbitrary units) of a GEMM kernel instance on ``args``.

    The busiest SM sets the time: it runs ceil(tiles / SMs) tiles (wave quantisation), each
    costing a full tile's work (edge tiles pay full price: tile utilisation) at an efficiency
    that grows with the tile's arithmetic intensity tm*tn/(tm+tn) and the family's
    `Kernel.performance_hint` (`tile_work_cost`); for skinny problems (`SKINNY_GEMM`) at least
    the time to stream the operands at `TILE_STREAM_BYTES_PER_SECOND`. A kernel whose time this
    tile model cannot describe (split-K, memory-bound) gives its own estimate in these units:
    `Kernel.estimated_cost`.
    """
    cost = max(tile_work_cost(kernel, args, sm_count), streaming_floor(args))
    tm, tn, cm, cn = _tile_and_cluster(kernel)
    if cm > math.ceil(args.M / tm) or cn > math.ceil(args.N / tn):
        cost *= CLUSTER_PAST_THE_TILES  # (see its comment)
    return cost


def streaming_floor(args: GemmArguments) -> float:
    """`gemm_cost`'s floor for skinny problems (`SKINNY_GEMM`): the operands' bytes at
    `TILE_STREAM_BYTES_PER_SECOND`, in its units; 0 for the others."""
    if min(args.M, args.N) > SKINNY_GEMM:
        return 0.0
    return gemm_bytes(args) / TILE_STREAM_BYTES_PER_SECOND * GEMM_COST_UNITS_PER_SECOND


def _tile_and_cluster(kernel: Kernel) -> tuple[int, int, int, int]:
    design = kernel.metadata.design
    tile = getattr(design, "tile_shape", None) or (64, 64, 8)
    cluster = getattr(design, "cluster_shape", (1, 1, 1))
    return tile[0], tile[1], max(1, cluster[0]), max(1, cluster[1])


def tile_work_cost(kernel: Kernel, args: GemmArguments, sm_count: int) -> float:
    """`gemm_cost`'s tile model alone: the busiest SM's tiles of MMA work, no streaming floor."""
    design = kernel.metadata.design
    tm, tn, cm, cn = _tile_and_cluster(kernel)
    m_tiles, n_tiles = math.ceil(args.M / tm), math.ceil(args.N / tn)
    # The grid is whole clusters: a cluster along M on a one-tile M (decode) runs an empty CTA.
    tiles = math.ceil(m_tiles / cm) * cm * math.ceil(n_tiles / cn) * cn * args.L
    # Clusters are placed whole, so a GPC's leftover SMs may idle with large clusters.
    cluster_size = cm * cn
    usable_sms = max(1, sm_count - sm_count % cluster_size)
    tiles_per_sm = math.ceil(tiles / usable_sms)  # wave quantisation: the busiest SM sets the time
    intensity = tm * tn / (tm + tn)
    efficiency = kernel.metadata.kernel_class.performance_hint * intensity / (intensity + 32)
    if cluster_size > 1:
        efficiency *= 1.0 + 0.03 * math.log2(cluster_size)  # multicast cuts operand traffic
    if (cm > cn and m_tiles > n_tiles >= cn) or (cn > cm and n_tiles > m_tiles >= cm):
        efficiency /= CLUSTER_ALONG_LONG_SIDE  # (see its comment)
    if getattr(design, "schedule", None) == "cooperative":
        efficiency /= 1.0 + COOPERATIVE_EPILOGUE_K / max(args.K, 1)  # (see its comment)
    return tiles_per_sm * tm * tn * max(args.K, 1) / max(efficiency, 1e-6)
