"""How the CUDA C++ row norms (norm.cu) map rows onto the machine: pure arithmetic on the row
length, the element sizes and the SM count, shared by the interface (norm.py), its tests and
the benchmarks.

Three strategies:

- ``warp``: one warp per row, `WARPS_PER_CTA` rows per CTA, the row in registers (``nv``
  vectors per lane): rows of up to 32 x `max_elements` elements;
- ``block``: one CTA per row, ``threads`` sized to the row (a multiple of 32, at most
  `MAX_THREADS`), the row in registers or, for 16-byte vectors, staged in shared memory
  (`FORWARD_STAGED`, `staged_forward_shape`): rows of up to `MAX_THREADS` x `max_elements`
  elements;
- ``looped``: one CTA of `LOOPED_THREADS` per row of any length, a pass over the row per
  statistic.

A thread of a register strategy holds ``nv`` vectors of ``vec`` elements of each row it keeps
(the forward: the row; the backward: x and dy). ``nv`` is a template parameter of the compiled
kernel (so its compile key follows it); the CTA size is chosen at launch from ``nv``.

The backwards are persistent: ``units`` warps (``warp``) or CTAs walk the rows, each keeping
its column sums of dy * xhat (and dy) and writing them to its own row of an f32 workspace
(planes x units x cols), which a second launch sums per column (no second pass over the rows).
Later rows come through a ring of shared memory (`BACKWARD_STAGES`). The workspace holds about
(resident threads x elements per thread) floats per plane, whatever the row length, so the
backward keeps `BACKWARD_THREADS_PER_SM` threads resident per SM: enough loads in flight,
few partial sums.

The planning functions are pure and cached: a launch looks its plan up instead of computing it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

#: Elements one thread holds per row, at most (registers: the forward holds one row, the
#: backward two plus its column sums), by (backward, single-element accesses or 4-byte rows).
#: Past these the sm_90a cubins spill (ptxas -v): the forward of single elements at 32 (each
#: element its own 64-bit address), the backward of f32 or single elements at 16.
MAX_ELEMENTS = {(False, False): 32, (False, True): 16, (True, False): 16, (True, True): 8}
#: Bytes of a row one thread takes, at most, when its rows are staged in shared memory (read back
#: at each use, not held across the row reduction), by backward: the staged forward 128 (ptxas -v
#: on the sm_90a cubins: 32-52 registers), the backward's ring 64 (125-128 registers for 16-bit
#: rows, 93 for f32, no spills; at 32 bytes the RMSNorm backward takes 64 registers, against 112
#: with the rows held). 16-byte vectors only.
STAGED_MAX_BYTES = {False: 128, True: 64}
#: Bytes of a row one thread holds, the target, by backward. The forward's register rows 64 (bf16:
#: 32 elements, f32: 16): bf16 RMSNorm on an H200 in device time, 64 / 32 / 16 bytes: 72.7 / 74.8
#: / 79.1 us at 16384x4096, 274.6 / 282.0 / 355.5 at 32768x8192. The backward 32 per row (bf16:
#: 16, f32: 8): with the ring of 3 stages 111.1 us at 16384x4096 against 122.2 at 16 bytes and
#: 119.9 at 64; 400.3 at 32768x8192 against 424.2 at 64 (the sweep of
#: `python3 benchmarks/norms.py --variants "" --sweep`, which reproduces every number here).
BYTES_PER_THREAD = {False: 64, True: 32}
#: Bytes of a row one thread of the staged forward takes, the target: 32. bf16 RMSNorm, 32 / 64 /
#: 16 bytes, device time on an H200: 69.8 / 69.0 / 81.1 us at 16384x4096, 260.6 / 263.7 / 372.9
#: at 32768x8192, 13.3 / 13.7 / 14.0 at 4096x2048; with the residual 134.0 / 134.2 / 133.5,
#: 525.8 / 524.0 / 517.5 and 21.2 / 22.7 / 21.4 (the sweep, as above).
STAGED_BYTES_PER_THREAD = 32
#: Threads of a ``block`` CTA, at most: the backward's launch bounds leave it 128 registers.
MAX_THREADS = {False: 1024, True: 512}
WARPS_PER_CTA = 4
LOOPED_THREADS = 512
#: Resident threads per SM the backward's persistent grid is sized for (cut to what registers and
#: the ring let reside: `resident_launch`). 512: at 32 bytes a thread and 3 stages, 111.1 us at
#: 16384x4096 and 400.3 at 32768x8192 against 121.4 and 419.6 at 1024 (bf16 RMSNorm, H200, the
#: sweep): more rows in flight per SM did not help.
BACKWARD_THREADS_PER_SM = 512
#: The backward register rows' stages of shared memory for later rows (0: the next row held in
#: registers instead; `ring_bytes`). bf16 RMSNorm backward on an H200 in device time (32 bytes a
#: thread, 512 threads per SM), stages 0 / 2 / 3 / 4 / 5: 158.8 / 109.9 / 111.1 / 112.4 / 114.4 us
#: at 16384x4096, 686.8 / 397.5 / 400.3 / 413.1 / 409.7 at 32768x8192, 32.2 / 27.1 /
#: 26.6 / 26.6 / 27.4 at 4096x2048 (the sweep). Three: within 1.1 % of two at 64 MB and more,
#: 2 % ahead at 4096x2048, and two rows ahead for LayerNorm's longer rows of work (two reductions
#: a row; not timed apart).
BACKWARD_STAGES = 3
#: The forward's block rows of 16-byte vectors staged in shared memory (norm.cu ``fwd_staged``:
#: cp.async copies read back at each use, 32-52 registers a thread) instead of held in registers
#: (``fwd_reg``: up to 64 registers a thread, about 64 KB of loads in flight per SM). bf16 RMSNorm
#: on an H200, device time, staged (32 bytes) against the best register rows: 69.8 / 72.7 us at
#: 16384x4096, 260.6 / 274.6 at 32768x8192 (torch's copy of x: 68.5 and 259.7), with the residual
#: 134.0 / 139.8 and 525.8 / 546.7 (the sweep).
FORWARD_STAGED = True
#: The most dynamic shared memory a staged forward CTA takes (`stage_bytes`): within the 48 KB a
#: kernel gets without opting in to more (less its static shared memory, 1.3 KB), so its recorded
#: launch needs no opt-in; longer rows take the register rows.
STAGE_LIMIT = 46 * 1024
#: The fewest rows each backward unit takes (fewer, larger partial sums on small problems).
MIN_ROWS_PER_UNIT = 2
STRATEGIES = ("warp", "block", "looped")


def max_elements(backward: bool, vec: int, elem_bytes: int, staged: bool = False) -> int:
    """`MAX_ELEMENTS` for a direction, vector width and element size (``staged``: rows of 16-byte
    vectors staged in shared memory, `STAGED_MAX_BYTES`)."""
    if staged and vec * elem_bytes == 16:
        return STAGED_MAX_BYTES[backward] // elem_bytes
    return MAX_ELEMENTS[backward, vec == 1 or (backward and elem_bytes == 4)]


def max_cols(strategy: str, backward: bool, vec: int, elem_bytes: int) -> int | None:
    """The longest row a strategy takes (None: any)."""
    if strategy == "warp":
        return 32 * max_elements(backward, vec, elem_bytes)
    if strategy == "block":
        return MAX_THREADS[backward] * max_elements(backward, vec, elem_bytes)
    return None


@dataclass(frozen=True)
class Shape:
    """The template's vectors per thread (``nv``, 0 for ``looped``) for a row length."""

    strategy: str
    nv: int
    vec: int


@dataclass(frozen=True)
class Launch:
    """One launch: ``grid`` CTAs of ``threads``; ``units`` the backward's persistent workers."""

    grid: int
    threads: int
    units: int


@functools.lru_cache(maxsize=4096)
def template_shape(strategy: str, backward: bool, cols: int, vec: int, elem_bytes: int,
                   bytes_per_thread: int | None = None, staged: bool = False) -> Shape | None:
    """The vectors per thread a strategy compiles for rows of ``cols`` elements, or None when
    the strategy does not take them. ``bytes_per_thread``: the block strategy's target
    (default `BYTES_PER_THREAD`); ``staged``: rows staged in shared memory (the backward's ring,
    the staged forward), `STAGED_MAX_BYTES` a thread."""
    if strategy == "looped":
        return Shape("looped", 0, vec)
    nvec = max(1, -(-cols // vec))
    most = max(1, max_elements(backward, vec, elem_bytes, staged) // vec)
    if strategy == "warp":
        nv = -(-nvec // 32)
        return Shape("warp", nv, vec) if nv <= most else None
    target = bytes_per_thread or BYTES_PER_THREAD[backward]
    nv = min(most, max(1, target // elem_bytes // vec), -(-nvec // 32))
    limit = MAX_THREADS[backward]
    if -(-nvec // nv) > limit:
        nv = -(-nvec // limit)
        if nv > most:
            return None
    return Shape("block", nv, vec)


@functools.lru_cache(maxsize=4096)
def cta_threads(shape: Shape, cols: int, backward: bool) -> int | None:
    """Threads per CTA for ``cols`` on a kernel compiled for ``shape``; None when it cannot
    take the row (too long for its registers)."""
    if shape.strategy == "looped":
        return LOOPED_THREADS
    nvec = max(1, -(-cols // shape.vec))
    if shape.strategy == "warp":
        return 32 * WARPS_PER_CTA if nvec <= 32 * shape.nv else None
    threads = 32 * -(-nvec // (32 * shape.nv))
    return threads if threads <= MAX_THREADS[backward] else None


@functools.lru_cache(maxsize=4096)
def forward_launch(shape: Shape, rows: int, cols: int) -> Launch | None:
    """The forward's launch: a CTA per row (``warp``: per `WARPS_PER_CTA` rows)."""
    threads = cta_threads(shape, cols, False)
    if threads is None:
        return None
    per_cta = WARPS_PER_CTA if shape.strategy == "warp" else 1
    grid = -(-rows // per_cta)
    return Launch(grid, threads, grid * per_cta)


@functools.lru_cache(maxsize=4096)
def backward_launch(shape: Shape, rows: int, cols: int, sm_count: int,
                    threads_per_sm: int = BACKWARD_THREADS_PER_SM) -> Launch | None:
    """The backward's persistent launch: about ``threads_per_sm`` resident threads per SM, no
    more units than rows / `MIN_ROWS_PER_UNIT` (at least one, so an empty problem still writes
    zero gradients)."""
    threads = cta_threads(shape, cols, True)
    if threads is None:
        return None
    per_cta = WARPS_PER_CTA if shape.strategy == "warp" else 1
    ctas_per_sm = max(1, threads_per_sm // threads)
    wanted = -(-max(rows, 1) // (per_cta * MIN_ROWS_PER_UNIT))
    grid = max(1, min(wanted, sm_count * ctas_per_sm))
    return Launch(grid, threads, grid * per_cta)


def resident_launch(launch: Launch, strategy: str, resident: int) -> Launch:
    """``launch`` with its persistent grid cut to the CTAs that can be resident at once
    (``resident``: the occupancy query's count for its threads and shared memory): a grid sized by
    `backward_launch`'s threads per SM that registers or the ring's shared memory do not let
    reside would run a second wave of units after the first, doubling the time."""
    if resident <= 0 or launch.grid <= resident:
        return launch
    per_cta = WARPS_PER_CTA if strategy == "warp" else 1
    return Launch(resident, launch.threads, resident * per_cta)


def workspace_bytes(launch: Launch, cols: int, planes: int) -> int:
    """The backward's f32 partial sums: ``planes`` x units x cols."""
    return 4 * planes * launch.units * cols


def ring_bytes(stages: int, shape: Shape, threads: int) -> int:
    """Dynamic shared memory of a backward launch: ``stages`` rows of x and dy, ``nv`` 16-byte
    chunks of each per thread (0 without stages)."""
    return stages * 2 * shape.nv * 16 * threads if stages else 0


def stage_bytes(shape: Shape, threads: int, residual: bool) -> int:
    """Dynamic shared memory of a staged forward CTA: ``nv`` 16-byte chunks of the row per
    thread, and of the residual."""
    return shape.nv * 16 * threads * (2 if residual else 1)


@functools.lru_cache(maxsize=4096)
def staged_forward_shape(cols: int, vec: int, elem_bytes: int, bytes_per_thread: int | None = None) -> Shape | None:
    """The staged forward's block rows for ``cols`` (``bytes_per_thread``, default
    `STAGED_BYTES_PER_THREAD`; up to `STAGED_MAX_BYTES`), or None where their stage with the
    residual's would exceed `STAGE_LIMIT` (the same choice for both forms, so that it follows the
    row length alone)."""
    shape = template_shape("block", False, cols, vec, elem_bytes, bytes_per_thread or STAGED_BYTES_PER_THREAD,
                           staged=True)
    if shape is None:
        return None
    threads = cta_threads(shape, cols, False)
    return shape if threads is not None and stage_bytes(shape, threads, True) <= STAGE_LIMIT else None


REDUCE_THREADS = 512
REDUCE_COLUMNS = 32  # columns per CTA of reduce_cols (its lanes)


def reduce_grid(cols: int, planes: int) -> tuple[int, int, int]:
    """reduce_cols' grid: 32 columns per CTA, a plane per grid row."""
    return (-(-cols // REDUCE_COLUMNS), planes, 1)
