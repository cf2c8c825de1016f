"""Choosing one kernel among the candidates: `PickAny` (analytic, no running) and `PickBest`
(compile in worker processes, verify, time, record).

``PickBest`` compiles candidates in parallel *worker processes* for the target cc; each
worker fills the on-disk artifact caches, so the parent then loads every candidate in
milliseconds instead of compiling them one after another. The workers are our own entry
point (`kernel_api.tuning.compile_worker`), so tuning from a script without an
``if __name__ == "__main__":`` guard does not re-run the script.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from .. import registry
from ..core.arch import device_cc, planning_sm_count
from ..arguments import GemmArguments
from ..arguments.base import unbound_copy
from ..core.dtypes import DataType
from ..core.errors import NoKernelFoundError
from ..kernel import Kernel
from .buckets import PREFIX as _BUCKET_PREFIX, Bucket, resolve_bucket
from .records import RecordContext, RecordKey, TuningRecord, TuningRecords, record_key, toolchain_versions
from .reference import output_of, random_like, reference, tolerance
from .timing import (QueuedTiming, check_timing, relative_error_tensor, rotation_count, time_interleaved,
                     time_own_state)

_log = logging.getLogger(__name__)


#: gemm_cost's units per second: the rate the Sm90 family's cost showed on the H200 at
#: 64x8192x8192 (issue #16: 43.8 us for 114.3M units of its 64x128 tile).
GEMM_COST_UNITS_PER_SECOND = 2.61e12
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
#: faster. Bounded above by the issue #16 sweep (K >= 4096, cooperative 0.94-1.04x): from 100
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


#: The cluster barrier's cost in `row_cost`, as the bytes per thread a row's slice must move for
#: the barrier to cost as much again (the cluster term is 1 + this / bytes per thread, bytes
#: being the CTA's slice read and written once over its threads). Fitted to the register
#: split (``split_ept*``) on the H200 (benchmarks/softmax.py on the regular and wide shapes): the
#: backward, one block reduction before its cluster exchange, 1.09-1.23x
#: the copy rate at 192 bytes per thread (f32 4096-32768 columns), 1.36-1.40x at 147 (f32
#: 50257, 8 CTAs), 1.8-2.2x at 48-74 (bf16/f16 50257, f32 and bf16 4097) and 4.2x at 24 (bf16
#: 4097, 8 CTAs); the forward, which takes a row's max and then its sum of exponentials
#: before the exchange, 2-3x as costly (1.3-2.7x at 98-256 bytes per thread, 3.4-8x at
#: 16-32); 128 keeps its 50257 rows behind the looped kernels, as measured (1.19-1.39x of
#: them). The backward's 45 puts its f32 50257 rows on 8 CTAs of 512 threads (0.67-0.74x
#: the looped kernel's time on the H100 and H200) and keeps bf16's on the shared-memory
#: kernel (1.4-1.8x faster than the split). Any value from 20 to 60 (backward) and from 100 up
#: (forward) ranks the recorded cases alike (benchmarks/softmax.py --replay).
CLUSTER_SYNC_BYTES_PER_THREAD = {False: 128.0, True: 45.0}
#: A cluster CTA of 1024 threads (56-64 registers each in the sm_90 cubins) has its SM to
#: itself: no other CTA's loads overlap its barrier waits. Measured (H100 and H200)
#: 1.04-1.12x the time of the 512-thread CTAs of a cluster twice as large at the same bytes
#: per thread (f32 and bf16 backward 50257 and 32768, f32 forward 50257).
CLUSTER_CTA_ALONE = 1.1
#: The share of the SMs whose CTAs a wave of thread-block clusters fills, in `row_cost`'s wave
#: term: clusters must fit in one GPC, and on the H100/H200 (132 SMs) the 8-CTA clusters of
#: 1024-thread CTAs (one per SM) ran 12 rows in one wave and 16 in two
#: (the few-row sweeps of tests/data: the split kernels' times step at 16, 24-32, ...
#: rows), 0.73-0.79 of the SMs. 0.75 ranks the recorded few-row cases best (0.6-0.8 within 1 %).
CLUSTER_PACKING = 0.75
#: A peeled kernel (scalar row head and tail, 16-byte vectors between) against the same
#: configuration for aligned rows, on aligned rows: the head and tail are empty there, and the
#: peeled kernels measured as fast or faster. 168 same-run pairs of the H100/H200 softmax runs
#: (benchmarks/softmax.py): aligned/peeled time ratio median 1.00,
#: the aligned kernel 9-13 % slower on every 65536x1024 forward (all dtypes, ept16) and f32
#: 16384-column ept32 backward, up to 6 % faster on 16-bit 16384^2 forwards; the cause is not
#: known (their SASS differs only by the peeled edges). Below 1, so peeled kernels win ties:
#: PickAny's f32 65536x1024 forward goes from the aligned kernel's 3.57 TB/s to the peeled one's
#: 3.91 (H200; the replay of the recorded runs unchanged).
PEELED_ROWS = 0.99
#: Forward register rows (``block``) of more than this many elements: the CTA's registers
#: (56-63 per thread at 1024 threads in the sm_90 cubins of ept32) let one CTA reside per SM,
#: and between its loads and its stores come two block reductions and the exponentials,
#: when the SM's memory pipe idles. Measured (H200, benchmarks/softmax.py on wide rows): the
#: ept32 kernels at 8192x32768 1.19-1.35x the copy rate, 1.11-1.15x the time of the
#: shared-memory kernel, against 1.08-1.10x for ept32 at 4096-16384 columns (512 threads or
#: fewer). (The backward, one reduction, alone on its SM at 16384 columns, ept16 at 1024
#: threads with 42-54 registers, stays at 1.05-1.07x: no term.)
REGISTER_ROW_ALONE_ELEMENTS = 16384
REGISTER_ROW_ALONE_FORWARD = 1.15
#: The bandwidth a one-pass register row CTA (``block``) alone on its SM streams, in shares of
#: the GPU's over the SMs (`row_cost`'s ``lone_cta_share``): its loads are all in flight at
#: once, so with fewer rows than SMs its time grows with the row, not with the idle SMs. On the
#: H200 (the short-row sweeps of tests/data) 1-64 rows of 8192 16-bit elements
#: ran 4.8-5.0 us, and one row's time grew by 2.3 us from 16K to 32K elements: 56 GB/s, 2.0
#: shares of 3.6 TB/s over 132 SMs.
REGISTER_ROW_LONE_SHARE = 2.0
#: A row-wise kernel whose rows make more than one trip to memory or to other CTAs before their
#: stores (a second pass, a shared-memory staging step, a cluster exchange, partials combined
#: through a workspace) takes longer than a one-pass register row (``block`` or ``warp``) by a
#: fixed time, whatever the problem's size: the bytes the GPU streams meanwhile at full
#: bandwidth, here 6 MB (1.7 us at 3.6 TB/s; with `REGISTER_ROW_LONE_SHARE` it is what the
#: register rows' lead comes to on problems that leave SMs idle). Measured on the H200 (a sweep of
#: 1-128 rows of 8K-32K elements): one row of 8K-32K elements took 5.3-5.7 us
#: on the cluster splits, 4.8-7.1 us on the register rows; 32-64 rows of 8192 took 6.3 us on the
#: shared-memory kernel and 5.0 on the register rows. Fitted on those and on a held-out H200
#: sweep (2-96 rows of 2K-28K elements, f16/bf16/f32: 6-8 MB rank it alike, 250 of
#: 252 within 10 %; 4 MB 239), checked on an H100's sweeps of both grids measured afterwards
#: (379 of 392 within 10 %, 198 without this term and `REGISTER_ROW_LONE_SHARE`; the short-row
#: runs of tests/data).
STAGED_ROW_LATENCY_BYTES = 6.0e6


def row_cost(kernel: Kernel, args: Any, sm_count: int, cta_threads: int | None = None,
             ctas_per_sm: int | None = None, lone_cta_share: float | None = None) -> float:
    """Estimated time of a row-wise (softmax) kernel: prefers the strategy sized for the row,
    16-byte accesses over scalar ones, one pass over two, and enough CTAs to fill the SMs;
    charges a cluster split its barrier per row over the bytes each thread moves
    (`CLUSTER_SYNC_BYTES_PER_THREAD`, `CLUSTER_CTA_ALONE`) and its waves of clusters
    (`CLUSTER_PACKING`), and a forward register row that leaves one CTA per SM
    (`REGISTER_ROW_ALONE_FORWARD`).

    Read from the `RowReductionDesignMetadata`: ``strategy``, ``threads_per_row``,
    ``vector_bytes``, the row range, and ``extra``'s ``passes`` (reads of the input),
    ``peel`` (scalar row edges), ``rows_per_cta`` (warp) and ``cluster`` (CTAs per row).
    ``cta_threads``: the threads of one CTA for these arguments, where the kernel sizes its
    CTA to the row (the cluster splits); default ``threads_per_row / cluster``.
    ``ctas_per_sm``: how many of a cluster kernel's CTAs one SM holds for these arguments
    (None: no wave term). ``lone_cta_share``: the bandwidth a CTA alone on its SM streams, in
    shares of the GPU's over ``sm_count`` (1: an SM without a CTA is bandwidth lost); default
    `REGISTER_ROW_LONE_SHARE` for one-pass register rows (``block``), else 1.
    """
    design = kernel.metadata.design
    cols = getattr(args, "cols", 1)
    rows = getattr(args, "rows", 1)
    backward = hasattr(args, "grad_out")
    strategy = getattr(design, "strategy", "block")
    lo, hi = getattr(design, "min_cols", 1), getattr(design, "max_cols", None)
    penalty = 1.0 if (cols >= lo and (hi is None or cols <= hi)) else 4.0
    threads = getattr(design, "threads_per_row", 32)
    if strategy == "warp":
        # (at 1024 a CTA per row is faster already: 4.00 against 3.54 TB/s, bf16 65536x1024 on an H200)
        penalty *= 1.0 if cols < 1024 else 3.0
    elif cols < min(threads, 256) * 4:
        # A short row on a CTA: few loads in flight per CTA (the register kernels size their
        # CTA to the row, so a wide design alone idles no threads).
        penalty *= 2.0
    extra = dict(getattr(design, "extra", ()) or ())
    if getattr(design, "vector_bytes", 16) < 16:
        penalty *= 1.15  # scalar accesses: more instructions per byte (measured 5-30 % slower)
    if extra.get("peel"):
        penalty *= PEELED_ROWS  # (see its comment)
    penalty *= 1.0 + 0.5 * (extra.get("passes", 1) - 1)  # the input read again (partly from L2)
    ept = extra.get("elements_per_thread")
    elem = _row_element_bytes(args)
    if ept:
        # Register rows: 64 bytes per thread and row held measured best (bf16 forward: 32
        # elements; f32 forward and bf16 backward, which holds two rows: 16). The cluster
        # splits' slices too: over the 501 f32 forward pairs of the few-row sweeps (2-256 rows
        # of 8K-128K elements, H100 and H200) 32 elements a thread
        # took a median 1.02x the time of 16 (10th-90th percentile 0.94-1.11x).
        if ept * elem * (2 if backward else 1) != 64:
            penalty *= 1.03
        if strategy == "block" and not backward and cols > REGISTER_ROW_ALONE_ELEMENTS:
            penalty *= REGISTER_ROW_ALONE_FORWARD
    cluster = extra.get("cluster", 1)
    if cluster > 1:
        # Each row waits on a cluster barrier, which its slice's transfers must amortise:
        # bytes per thread (the slice read and written once, over the CTA's threads).
        cta = cta_threads or max(1, threads // cluster)
        per_thread = max(cols, 1) * elem * (3 if backward else 2) / (cluster * cta)
        penalty *= 1.0 + CLUSTER_SYNC_BYTES_PER_THREAD[backward] / per_thread
        if cta >= 1024:
            penalty *= CLUSTER_CTA_ALONE
    if strategy == "warp":
        ctas = rows / extra.get("rows_per_cta", 4)
    else:
        ctas = rows * extra.get("cluster", 1)
    if lone_cta_share is None:
        lone_cta_share = REGISTER_ROW_LONE_SHARE if strategy == "block" and single_trip(design) else 1.0
    if cluster > 1 and ctas_per_sm is not None:
        # A wave of clusters takes about as long however few rows it holds (each CTA's slice
        # and barriers are latency-bound there), so the cost is per wave, not per row.
        per_wave = max(1, int(sm_count * ctas_per_sm * CLUSTER_PACKING / cluster))
        penalty *= max(1.0, -(-rows // per_wave) * sm_count / max(ctas, 1))
    elif ctas * lone_cta_share < sm_count:
        # Memory-bound: with fewer CTAs than SMs, the idle SMs' share of the bandwidth is lost
        # (beyond what a lone CTA streams more than its share).
        penalty *= sm_count / max(ctas * lone_cta_share, 1)
    return penalty / kernel.metadata.kernel_class.performance_hint


def single_trip(design: Any) -> bool:
    """Whether a row-wise design reads its rows once into registers and stores them without
    waiting on a second pass, shared-memory staging or other CTAs: ``block`` or ``warp``, one
    pass, no cluster (`STAGED_ROW_LATENCY_BYTES`)."""
    extra = dict(getattr(design, "extra", ()) or ())
    return (getattr(design, "strategy", "block") in ("block", "warp") and extra.get("passes", 1) == 1
            and extra.get("cluster", 1) == 1)


def _row_element_bytes(args: Any) -> int:
    """Bytes of one element of a row-wise problem's operands (4 where the arguments carry none)."""
    return next(iter(args.tensor_attributes.values())).dtype.bytes if hasattr(args, "tensor_attributes") else 4


def row_problem_bytes(args: Any) -> int:
    """Bytes a row-wise (softmax) problem moves at the least: its operands read and written once
    (forward: x and out; backward: y, dy and dx)."""
    rows, cols = getattr(args, "rows", 1), getattr(args, "cols", 1)
    return max(rows * cols * _row_element_bytes(args) * (3 if hasattr(args, "grad_out") else 2), 1)


def fixed_row_cost(kernel: Kernel, args: Any) -> float:
    """The fixed time a row-wise kernel adds to its estimate, in `row_cost`'s units (multiples
    of the problem's bytes at full bandwidth): `STAGED_ROW_LATENCY_BYTES` for every design but
    a one-pass register row (`single_trip`), 0 for that."""
    if single_trip(kernel.metadata.design):
        return 0.0
    return STAGED_ROW_LATENCY_BYTES / row_problem_bytes(args)


def estimated_cost(kernel: Kernel, args: Any, sm_count: int) -> float:
    """The kernel's own estimate (`Kernel.estimated_cost`) or else the generic model's; for a
    row-wise problem plus the design's fixed time (`fixed_row_cost`), which decides the
    problems too small to fill the GPU."""
    own = kernel.estimated_cost(args, sm_count)
    if isinstance(args, GemmArguments):
        return gemm_cost(kernel, args, sm_count) if own is None else own
    return (row_cost(kernel, args, sm_count) if own is None else own) + fixed_row_cost(kernel, args)


def _problem(args: Any) -> str:
    """A short description of a problem for log records (GEMM MxNxK, else rows x cols)."""
    if isinstance(args, GemmArguments):
        return f"GEMM M={args.M} N={args.N} K={args.K}" + (f" L={args.L}" if args.L != 1 else "")
    return f"{type(args).__name__} {getattr(args, 'rows', '?')}x{getattr(args, 'cols', '?')}"


def rank_candidates(kernels: list[Kernel], args: Any, sm_count: int | None = None) -> list[Kernel]:
    """Candidates ordered by the analytic heuristic (cheapest first, generation order on ties),
    for ``sm_count`` SMs (default: the arguments' device's, else an H100/H200's)."""
    sm = planning_sm_count(getattr(args, "device", None)) if sm_count is None else sm_count
    return [k for _, _, k in sorted((estimated_cost(k, args, sm), i, k) for i, k in enumerate(kernels))]


#: Whether `PickBest` times its candidates against each other in rounds (`time_interleaved`:
#: drift hits all alike) instead of one after the other. On: measured on 2 H100s
#: (benchmarks/tune_scale.py), later single-GPU tunings agreed with the first on 15-16 of 16
#: winners against 14-15 timed one after the other, in the same wall time.
_INTERLEAVE = True

#: Whether `PickBest` launches each newly loaded artifact once before queueing the reference
#: (`PickBest._first_launches`). On: measured on 2 H100s (benchmarks/tune_scale.py),
#: the 2-GPU rounds went from 1.01-1.29 s (one thread stalled behind the other's first
#: launches) to 1.00-1.15 s, and 0.99-1.05 s in the final run.
_FIRST_LAUNCH_EARLY = True

#: Whether `PickBest` loads the next candidate while the GPU times the current one (a switch
#: for benchmarks/tune_scale.py's comparison).
_PREFETCH_NEXT = True

#: GPU time (ms) of untimed rounds `PickBest` runs before its timed ones (`time_interleaved`'s
#: ``settle_ms``), so it ranks the candidates in the power state of sustained work. Measured on
#: an H200 (docs/performance.md, "Power state"): tf32 4096^3 GEMMs ran 17-22 % slower after
#: ~100 ms back to back than in the first ~40 ms, and the fastest tile differed between the
#: two; PickBest's rounds used to start near that step, its samples of four tiles tying there.
_SETTLE_MS = 200.0

#: `PickBest`'s timings: the candidates in turn at one shared clock, or each in its own power state.
POWER_STATES = ("shared", "own")
#: `PickBest`'s timing unless told otherwise. "own": over the aligned bf16 group of
#: benchmarks/gemm_shapes.py its choices ran 0.99-1.02x cuBLAS launched in turn with it on an H100
#: and an H200, where "shared"'s ran down to 0.85x on the H100 (a tile that waits on DRAM, ranked
#: first at the low clock of ten power-hungry candidates); each kernel on its own (H200), "own"'s
#: geomean 0.99x, "shared"'s 0.97x (docs/performance.md, "SM90 GEMM tiles").
DEFAULT_POWER_STATE = "own"


def check_power_state(power_state: str) -> str:
    """``power_state`` when it names one of `POWER_STATES`, else a ValueError saying so."""
    if power_state not in POWER_STATES:
        raise ValueError(f"power_state must be 'shared' or 'own', got {power_state!r}")
    return power_state


#: `PickBest`'s timing unless told otherwise (`kernel_api.tuning.timing.TIMINGS`): "as_called"
#: charges each candidate the host time of its calls where that outlasts its kernel, as a loop
#: of `kernel_api.ops` calls is charged. Measured on an H200 at bf16 1x1024x1024 (x @ W.t()): the
#: small-M kernel is the fastest on the GPU (6.2 us; the Sm90 64x64 tiles 6.7-6.9) but its calls
#: through ops take 18.7 us back to back (a cubin launched from Python), the Sm90 tiles' (from the
#: C launch table) 7.9-8.0 us; "device" ranks the first ahead, "as_called" the others. "device"
#: remains the choice for code that replays CUDA graphs.
DEFAULT_TIMING = "as_called"

_cublas_allows_tf32 = torch._C._get_cublas_allow_tf32


def math_setting(args: Any) -> str:
    """The math a setting allows for ``args``' kernels (`RecordContext.math`): for f32 GEMMs
    ``"tf32"`` while torch allows TF32 matmuls (``torch.backends.cuda.matmul.allow_tf32``,
    float32 matmul precision "high" or "medium") and ``"f32"`` otherwise; ``"native"`` for
    problems no setting changes."""
    if isinstance(args, GemmArguments) and args.tensor_attributes["A"].dtype is DataType.f32:
        return "tf32" if _cublas_allows_tf32() else "f32"
    return "native"


class Policy:
    """Chooses one kernel for an arguments object."""

    def choose(self, args: Any, candidates: list[Kernel]) -> Kernel:
        raise NotImplementedError


class PickAny(Policy):
    """The best-ranked supported kernel by the analytic heuristic; runs nothing."""

    def choose(self, args: Any, candidates: list[Kernel]) -> Kernel:
        if not candidates:
            raise NoKernelFoundError(f"PickAny.choose: no candidates given for {args!r} (pass "
                                     f"kernel_api.get_kernels(args); kernel_api.explain(args) says why it is empty)")
        chosen = rank_candidates(candidates, args)[0]
        _log.debug("PickAny chose %s (best ranked of %d candidates) for %s", chosen.metadata.kernel_name,
                   len(candidates), _problem(args))
        return chosen


@dataclass
class Measurement:
    kernel_name: str
    median_ms: float | None = None
    error: float | None = None
    failure: str | None = None


@dataclass
class TuneResult:
    """What `PickBest.tune` found: the winner, every candidate's measurement, whether it came
    from a tuning record, and the record (found, or written by this tuning; None when the
    policy keeps no records)."""

    winner: Kernel
    measurements: list[Measurement] = field(default_factory=list)
    from_record: bool = False
    record: TuningRecord | None = None


class PickBest(Policy):
    """Compile candidates (in parallel worker processes), verify each on fresh random data
    against a reference, time them with CUDA events (median, rotating inputs), record the
    winner in the tuning records, and reuse a record when one exists.

    ``num_workers``: compile processes (default: the `settings` scope's, else up to 8);
    ``compile_timeout``: seconds one compile may take in a worker before it is stopped and the
    kernel reported as failed (None: no limit).

    ``settle_ms`` (default `_SETTLE_MS`, 200): GPU time of untimed launches before the timed
    ones, so the winner is the fastest in the power state of sustained work (a training step's
    GEMMs back to back). On a power-capped GPU that state can rank kernels differently from the
    first tens of ms after idle: at tf32 4096^3 on an H200 the ping-pong tile won the one and
    lost the other by 12 % (docs/performance.md, "Power state"). 0 times from whatever state
    the GPU is in.

    ``power_state``: how the candidates are timed. ``"own"`` (the default,
    `DEFAULT_POWER_STATE`) times each after ``settle_ms`` of its own back-to-back launches
    (`time_own_state`), so each runs at the clock its own power draw allows, and the fastest is
    the one that finishes soonest when it alone runs back to back on a power-capped GPU: for
    large GEMMs in a sustained workload, a kernel that draws more power per cycle slows
    everything at the cap. ``"shared"`` times the candidates in turn after ``settle_ms`` of
    untimed rounds (`time_interleaved`), so all run at one clock and the fastest is the one that
    needs the fewest cycles at the clock their mix sets. The two differ by up to 20 %
    (docs/performance.md, "Power state": on an H100 a bf16 ping-pong tile ran 0.78x cuBLAS on
    its own), and the shared clock depends on which candidates are measured: on an H100 at bf16
    4096x4096x14336, ten tiles mostly of the power-hungry ping-pong kind ranked one first that
    ran 0.85x cuBLAS beside cuBLAS. Over the aligned bf16 group of benchmarks/gemm_shapes.py,
    launched in turn with cuBLAS, ``"own"``'s choices ran 0.99-1.02x cuBLAS on an H100 and an
    H200, ``"shared"``'s 1.00-1.06x on the H200 and 0.85-1.03x on the H100; each kernel on its
    own (H200), geomean 0.99x against 0.97x (docs/performance.md, "SM90 GEMM tiles"). ``"own"``
    costs ``settle_ms`` of GPU time per candidate twice (``"shared"``: once in all): about 5 s
    for 10-24 candidates of a large GEMM, once per shape (the winner is recorded).

    ``timing`` (default `DEFAULT_TIMING`, ``"as_called"``): what a sample holds, in either power
    state (`kernel_api.tuning.timing.TIMINGS`). ``"as_called"`` times runs of back-to-back calls
    through the kernel's recorded launch (its `Launcher`, which `kernel_api.ops` records too),
    nothing queued ahead of them: a kernel whose calls cost the host more than the GPU is
    charged the host's time, as a loop of `kernel_api.ops` calls is. ``"device"`` times GPU work
    only (each call queued behind a GPU spin): for code that captures its calls in CUDA graphs
    and replays them, where the host's work is done once.

    A record is keyed on everything that changes the candidates or their ranking besides the
    problem (`record_context`): the math torch allows for f32 GEMMs (TF32), the providers of the
    `kernel_api.settings` scope, ``timing`` and ``power_state``. A winner is never reused under
    a setting its measurement did not cover.

    ``bucket`` keys the records by a range of shapes instead of the exact shape (see
    `kernel_api.tuning.buckets`): ``"pow2_m"`` (M, or a softmax's rows, in power-of-two buckets
    65..128, 129..256, ...; everything else exact), ``"module:function"`` or a function
    ``(args) -> bucket label or None``. Lookups try the exact shape's record first, then the
    bucket's. The first shape met in a bucket is tuned with the caller's own arguments and its
    winner recorded for the bucket; a later shape in the bucket reuses it without measuring, as
    long as the winner supports the new arguments. When it does not (a kernel whose
    ``_supports`` limits M, met at an M of the bucket outside that limit), the new shape is
    tuned and recorded under its exact shape, and the bucket's record stays.

    When is a bucket's winner the right one? It is exact when the candidates' relative speed
    does not change within the bucket: every M of the bucket fills the same number of tile rows
    for every candidate (M at most the smallest tile's M, as in decode: buckets up to 64 with
    64-row tiles), or the kernels' time does not depend on M (a small-M GEMM limited by reading
    B). Otherwise it is a heuristic: a tile's utilisation and the wave count (``ceil(M / tile_m)``
    tile rows over the SMs) change within the bucket, so the kernel measured at the bucket's
    first M can be a few percent behind the best one at another M; tune the sizes that matter
    most exactly (``tune_shapes`` or `tune` without a bucket), since exact records win.
    To make a bucket's record independent of traffic order, tune it ahead of time with the
    bucket's largest M (``kernel-api tune --shapes``, ``tune_shapes(..., bucket="pow2_m")``).
    """

    def __init__(self, num_workers: int | None = None, max_candidates: int | None = 24, repeat: int = 30,
                 records: TuningRecords | None = None, use_records: bool = True,
                 progress: Callable[[int, int, str], None] | None = None,
                 compile_timeout: float | None = 900.0, bucket: str | Bucket | None = None,
                 settle_ms: float = _SETTLE_MS, power_state: str = DEFAULT_POWER_STATE,
                 timing: str = DEFAULT_TIMING) -> None:
        self.num_workers = num_workers
        self.settle_ms = settle_ms
        self.power_state = check_power_state(power_state)
        self.timing = check_timing(timing)
        self.bucket = resolve_bucket(bucket)
        self.compile_timeout = compile_timeout
        self.max_candidates = max_candidates
        self.repeat = repeat
        self.records = records
        self.use_records = use_records
        self.progress = progress
        self._loaded: dict[tuple, tuple[Kernel, Any]] = {}
        self._launched: set[int] = set()  # id() of the artifacts in _loaded launched once already

    def choose(self, args: Any, candidates: list[Kernel]) -> Kernel:
        return self.tune(args, candidates).winner

    def _records(self) -> TuningRecords:
        if self.records is None:
            self.records = TuningRecords()
        return self.records

    def _device(self, args: Any) -> tuple[str, int]:
        """(device name, cc) of the GPU that ``args`` run on: the records' key."""
        if not torch.cuda.is_available() or args.device.type != "cuda":
            raise RuntimeError("PickBest needs a CUDA GPU and CUDA tensors; PickAny ranks kernels without one")
        return torch.cuda.get_device_name(args.device), device_cc(args.device.index)

    def record_context(self, args: Any) -> RecordContext:
        """What ``args``' record is keyed on besides the problem: the math allowed
        (`math_setting`), the providers of the current `kernel_api.settings` scope and this
        policy's timing and power state."""
        from .settings import current  # settings imports this module

        return RecordContext(math_setting(args), current().providers, f"{self.timing}/{self.power_state}")

    def _record_key(self, args: Any, bucketed: bool = False) -> RecordKey | None:
        """The key of ``args``' record (`kernel_api.tuning.records.record_key` under
        `record_context`), or with ``bucketed`` its bucket's (None: no bucket, or none for them)."""
        if not bucketed:
            return record_key(args, self.record_context(args))
        label = None if self.bucket is None else self.bucket(args)
        return None if label is None else record_key(args, self.record_context(args), _BUCKET_PREFIX + label)

    def _find_record(self, args: Any, candidates: list[Kernel], device_name: str,
                     cc: int) -> tuple[TuneResult | None, RecordKey]:
        """(the result a usable tuning record gives, or None; the key a new measurement of
        ``args`` is recorded under)."""
        exact = self._record_key(args)
        bucket = self._record_key(args, bucketed=True)
        store_key = bucket or exact
        if not self.use_records:
            return None, store_key
        for key in (exact, bucket) if bucket else (exact,):
            found = self._records().lookup(device_name, cc, key.operation, key.shape)
            if found is None:
                continue
            kernel = next((k for k in candidates if k.metadata.kernel_name == found.kernel_name), None)
            if kernel is not None and kernel.supports(args):
                _log.debug("PickBest: tuning record %s for %s on %s: %s (%.4f ms)", key.shape, _problem(args),
                           device_name, found.kernel_name, found.median_ms)
                return TuneResult(kernel, [Measurement(found.kernel_name, found.median_ms)], from_record=True,
                                  record=found), store_key
            _log.debug("PickBest: the tuning record %s's %s does not support %s; tuning it", key.shape,
                       found.kernel_name, _problem(args))
            if key == bucket:
                store_key = exact  # the bucket's winner stays for the shapes it suits
        return None, store_key

    def recorded(self, args: Any, candidates: list[Kernel] | None = None) -> TuneResult | None:
        """What `tune` would take from the tuning records for ``args`` without measuring (the
        exact shape's record, else the bucket's, if its kernel is among ``candidates`` and
        supports ``args``), or None."""
        device_name, cc = self._device(args)
        if candidates is None:
            candidates = self._candidates(args)
        return self._find_record(args, candidates, device_name, cc)[0]

    @staticmethod
    def _candidates(args: Any) -> list[Kernel]:
        """Every kernel supporting ``args`` among the providers of the current `kernel_api.settings`
        scope (those its records are keyed on)."""
        from .settings import current  # settings imports this module

        return registry.get_kernels(args, providers=current().providers)

    def tune(self, args: Any, candidates: list[Kernel] | None = None, force: bool = False) -> TuneResult:
        """Choose the fastest correct kernel of ``candidates`` (default: every kernel supporting
        ``args`` among the current `kernel_api.settings` scope's providers) for ``args``: from a
        tuning record when one exists (exact shape first, then the bucket's; ``force`` measures
        anyway), else by measuring them, recording the winner under the bucket's key (or the
        exact shape's, see the class docstring)."""
        device_name, cc = self._device(args)
        if candidates is None:
            candidates = self._candidates(args)
        if not candidates:
            raise registry.no_kernel_error(args)
        if force:  # measure, and record for the bucket (re-tuned with these arguments) or the shape
            store_key = self._record_key(args, bucketed=True) or self._record_key(args)
        else:
            found, store_key = self._find_record(args, candidates, device_name, cc)
            if found is not None:
                return found
        ranked = rank_candidates(candidates, args)
        if self.max_candidates is not None:
            ranked = ranked[: self.max_candidates]
        self._precompile(args, ranked, cc)
        measurements = self._measure(args, ranked)
        good = [m for m in measurements if m.failure is None]
        if not good:
            details = "; ".join(f"{m.kernel_name}: {m.failure}" for m in measurements[:5])
            raise NoKernelFoundError(f"PickBest: every candidate failed to compile or verify ({details})")
        good.sort(key=lambda m: m.median_ms)
        winner = next(k for k in ranked if k.metadata.kernel_name == good[0].kernel_name)
        _log.info("PickBest: %s wins for %s on %s at %.4f ms (%d of %d candidates verified; next: %s)",
                  good[0].kernel_name, _problem(args), device_name, good[0].median_ms, len(good),
                  len(measurements), ", ".join(f"{m.kernel_name} {m.median_ms:.4f} ms" for m in good[1:4]) or "none")
        for m in measurements:
            if m.failure is not None:
                _log.debug("PickBest: %s failed: %s", m.kernel_name, m.failure)
        record = None
        if self.use_records:
            record = self._records().record(device_name, cc, store_key.operation, store_key.shape,
                                            good[0].kernel_name, good[0].median_ms,
                                            {m.kernel_name: m.median_ms for m in good[1:]}, toolchain_versions())
        return TuneResult(winner, measurements, record=record)

    def _worker_count(self) -> int:
        """This policy's ``num_workers``, else the current `settings`' one, else up to 8 (by CPUs)."""
        if self.num_workers is not None:
            return self.num_workers
        from .settings import current  # settings imports this module

        scoped = current().num_workers
        return scoped if scoped is not None else min(8, os.cpu_count() or 1)

    def _precompile(self, args: Any, kernels: list[Kernel], cc: int) -> dict[str, str | None]:
        """Compile ``kernels`` in worker processes into the disk caches (see
        `kernel_api.tuning.compile_worker.compile_in_workers`); returns each worker-compiled kernel's
        failure message or None. Kernels left out are compiled by `_measure` in this process."""
        workers = self._worker_count()
        if workers <= 1 or len(kernels) <= 1:
            return {}
        from .compile_worker import compile_in_workers  # not at import: the worker module runs as __main__

        return compile_in_workers(args, kernels, cc, workers, progress=self.progress, timeout=self.compile_timeout)

    def _artifact(self, kernel: Kernel, args: Any) -> Any:
        """``kernel``'s artifact for ``args``: loaded once per policy, device and compile key, so
        tuning many shapes loads each kernel once (a load from the disk cache costs 2-3 ms of
        host time, and the first launch of what it loaded waits for the GPU)."""
        key = (id(kernel), args.device_index, kernel.compile_key(args, device_cc(args.device_index)))
        found = self._loaded.get(key)
        if found is None:
            found = self._loaded[key] = (kernel, kernel.compile(args))
        return found[1]

    def _first_launches(self, kernels: list[Kernel], check: Any, artifacts: dict[int, Any],
                        early: dict[int, Exception], load: Callable[[int], None]) -> None:
        """Launch once each candidate whose artifact has not run on this device yet, before the
        float64 reference is queued: a CuTe DSL artifact's first launch waits for all work queued
        on the GPU, holding the GIL (docs/performance.md, "Tuning at scale"), so behind a reference
        GEMM it would stall every other tuning thread of this process as well."""
        for index, kernel in enumerate(kernels):
            load(index)
            artifact = artifacts.get(index)
            if artifact is None or id(artifact) in self._launched:
                continue
            self._launched.add(id(artifact))
            try:
                kernel.run(unbound_copy(check), compiled_artifact=artifact)
            except Exception as exc:  # reported when the check pass reaches this candidate
                early[index] = exc
                artifacts.pop(index)

    def _measure(self, args: Any, kernels: list[Kernel]) -> list[Measurement]:
        """Verify and time each of ``kernels`` on fresh random data (see the class docstring).

        In two passes over the candidates, so the GPU waits for the host only in the first:

        1. verify: load each candidate (the next one while the GPU runs this one's check) and
           queue its check (NaN-filled output, one run, the error computed on the GPU and copied
           back without waiting). A kernel's first launch loads its module into the CUDA
           context, which waits for all work queued before it (the whole queue, on an H100:
           docs/performance.md, "Tuning at scale"), so no timed launches are queued yet;
        2. time: with `_INTERLEAVE` (the default), every verified candidate once per round
           (`time_interleaved`), after ``settle_ms`` of untimed rounds, or with ``power_state``
           ``"own"`` each in its own power state (`time_own_state`), either as ``timing`` says
           (each candidate's calls through its bound launch, `Kernel.run` with the arguments it
           ran before: the `Launcher` that `kernel_api.ops` records too); otherwise (GPU time only) each
           candidate's timed launches (`QueuedTiming`) queued while the GPU runs the previous
           ones, at most two candidates ahead (a full launch queue would block the host inside
           a launch), and their samples read.

        With `_FIRST_LAUNCH_EARLY` (the default), artifacts new to this policy are launched once
        before the reference is queued (`_first_launches`).
        """
        sets = rotation_count(sum(t.numel() * t.element_size() for t in args.tensors().values()))
        inputs = [random_like(args) for _ in range(sets)]
        check = random_like(args)
        results: list[Measurement | None] = [None] * len(kernels)
        artifacts: dict[int, Any] = {}
        early: dict[int, Exception] = {}

        def load(index: int) -> None:
            if index < len(kernels) and index not in artifacts and index not in early:
                try:
                    artifacts[index] = self._artifact(kernels[index], check)
                except Exception as exc:  # reported when that candidate's turn comes
                    early[index] = exc

        if _FIRST_LAUNCH_EARLY:
            self._first_launches(kernels, check, artifacts, early, load)
        expected = reference(check).double()
        expected_norm = torch.linalg.vector_norm(expected)
        floor_ms = gpu_floor_ms(args)
        # Errors come back through pinned memory: reading a GPU scalar (.item()) would wait for
        # everything queued after it.
        errors = torch.empty(len(kernels), dtype=torch.float64, pin_memory=torch.cuda.is_available())

        def fail(index: int, exc: BaseException) -> None:
            results[index] = Measurement(kernels[index].metadata.kernel_name, failure=_failure(exc))
            artifacts.pop(index, None)

        for index, kernel in enumerate(kernels):  # 1. verify
            load(index)
            try:
                if index in early:
                    raise early[index]
                output_of(check).fill_(float("nan"))
                kernel.run(unbound_copy(check), compiled_artifact=artifacts[index])
                errors[index].copy_(relative_error_tensor(output_of(check), expected, expected_norm),
                                    non_blocking=True)
            except Exception as exc:
                fail(index, exc)
            if _PREFETCH_NEXT:
                load(index + 1)

        def finish(index: int, summary: Callable[[], dict] | None) -> None:
            """Record candidate ``index`` from ``summary()`` (its timing; None: it failed before)."""
            kernel = kernels[index]
            if summary is not None:
                try:
                    median_ms = summary()["median_ms"]  # may wait for this candidate's last launch
                    err = float(errors[index])  # copied before any timed launch
                    tol = tolerance(check, kernel)
                    name = kernel.metadata.kernel_name
                    results[index] = (Measurement(name, median_ms, err) if err <= tol else
                                      Measurement(name, error=err,
                                                  failure=f"wrong result: relative error {err:.2e} > {tol:.0e}"))
                except Exception as exc:
                    fail(index, exc)
            if self.progress:
                self.progress(index + 1, len(kernels), kernel.metadata.kernel_name)

        if _INTERLEAVE:  # 2. time, every verified candidate in each round
            timed = {index: _timed_run(kernels[index], [unbound_copy(a) for a in inputs], artifacts[index])
                     for index in range(len(kernels)) if index in artifacts}
            timer = time_own_state if self.power_state == "own" else time_interleaved
            found = timer(timed, sets, repeat=self.repeat, gpu_floor_ms=floor_ms, settle_ms=self.settle_ms,
                          timing=self.timing)
            for index in range(len(kernels)):
                got = found.get(index)
                if isinstance(got, Exception):
                    fail(index, got)
                finish(index, None if got is None or isinstance(got, Exception) else (lambda got=got: got))
            return [m for m in results if m is not None]
        queued: dict[int, QueuedTiming] = {}
        for index, kernel in enumerate(kernels):  # 2. time
            if index in artifacts:
                own = [unbound_copy(a) for a in inputs]  # this kernel binds its own fast launch to them
                try:
                    queued[index] = QueuedTiming(_timed_run(kernel, own, artifacts[index]), sets,
                                                 repeat=self.repeat, gpu_floor_ms=floor_ms)
                except Exception as exc:
                    fail(index, exc)
            if index >= 2:
                waiting = queued.pop(index - 2, None)
                finish(index - 2, waiting and waiting.result)
        for index in range(max(0, len(kernels) - 2), len(kernels)):
            waiting = queued.pop(index, None)
            finish(index, waiting and waiting.result)
        return [m for m in results if m is not None]


def _timed_run(kernel: Kernel, own: list[Any], artifact: Any) -> Callable[[int], None]:
    """``run(i)``: ``kernel`` on input set ``i`` with checks off (verified before)."""
    return lambda j: kernel.run(own[j], compiled_artifact=artifact, assume_supported_args=True)


def _failure(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc)[:300]}"


def gpu_floor_ms(args: Any) -> float:
    """A lower bound of one run's GPU time for ``args`` (ms): its FLOPs at more than an H200's
    dense tensor-core peak for its dtype, or its bytes at more than its memory bandwidth. Tells
    `QueuedTiming` when the host may be slower than the GPU."""
    if isinstance(args, GemmArguments):
        dtype = args.tensor_attributes["A"].dtype
        flops_per_ms = 7e10 if dtype is DataType.f64 else 5e11 if dtype is DataType.f32 else 1e12
        return 2.0 * args.M * args.N * args.K * args.L / flops_per_ms
    return sum(t.numel() * t.element_size() for t in args.tensors().values()) / 5e9
