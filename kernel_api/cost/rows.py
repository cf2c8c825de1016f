"""The row-wise (softmax) cost model: `row_cost` in multiples of the time to move the problem's
bytes once at full bandwidth, and the fixed time a design that makes more than one trip per row
adds (`fixed_row_cost`). The constants are fitted to measured runs; each comment says which."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..kernel import Kernel

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
