"""Interface of the row-group softmax kernels (implementation: softmax_rowgroup.cu, compiled
after softmax.cu, whose helpers it uses).

Two registered families, `CudaSoftmaxRowGroupForward` (`SoftmaxArguments`) and
`CudaSoftmaxRowGroupBackward` (`SoftmaxBackwardArguments`), for sm_90 and sm_100: softmax for
rows too long for one CTA (1M, 4M elements), whose input the looped and cluster-split kernels
read twice; this one reads it once. Two instances per dtype (``ctas_per_sm``):
``rowgroup_peel<vec>``, one CTA of 512 consumer threads per SM with the largest ring, and
``rowgroup2_peel<vec>``, two CTAs of 256 consumers per SM (`__launch_bounds__(288, 2)`, 92-96
registers without spills), each with the largest ring that still lets two reside (7 chunks on
an H100 / H200): while one CTA meets its group or stores, the other's copies keep DRAM busy.
Measured (H200): the second is 1-5 % faster on the 32x1M cases and slower on one
lone row; PickAny ranks it just after the first (`estimated_cost`).

Measured (H100, the first version; docs/performance.md, "Softmax"): 1.4-1.9 TB/s on the 64-128 MB
long-row cases, 47-63 % of the copy rate, not yet the bandwidth it aims at; 1.0-2x the
cluster-split kernels in bf16/f16 (2x on one 1M row), about equal in f32. A fit over the
CTAs-per-row sweep puts about 36 us of every launch outside the data's transfer time.

Design:

- A persistent grid of at most as many CTAs as are co-resident (``ctas_per_sm`` per SM: each
  takes the most dynamic shared memory that lets them reside, a ring of 16 KB chunks), launched
  *cooperatively*: the launch fails with a clear error rather than start CTAs that could
  wait on CTAs never scheduled.
- The CTAs are grouped, ``ctas_per_row`` (S) per row: each stages its slice of the row (the
  backward: of dy and y) in shared memory with TMA bulk copies, so the input is read from
  DRAM once. Rows beyond the G = CTAs // S resident at once are processed in waves by the
  same CTAs; a producer warp copies the next waves' slices into the ring while the
  consumers reduce, wait and write the current one, so DRAM stays busy across waves.
- Each CTA publishes its partial statistics (forward: max and sum of exp; backward:
  sum(dy * y)) in the workspace (`get_workspace_size`: four 16-byte slots per CTA, by wave)
  behind a tag of (launch, wave) stored with release semantics; the S CTAs of a row spin
  (acquire loads, nanosleep) until all S tags are current, combine the partials in one order
  (all agree bit for bit) and write their slices. Tags carry a per-launch value (an epoch
  from the host, mixed with %gridid on the device), so the workspace needs no
  initialisation or reset: back-to-back launches, waves and fresh allocations all work.
  Tags rather than per-row arrival counters: a counter must start at zero, which
  `Kernel.run`'s fresh allocation does not promise, and resetting it would need every
  reader to have seen it.
- When the ring holds three waves' chunks (``ahead``), the consumers take and publish wave
  w + 1's statistics before waiting for wave w's group: the meeting's latency (the slowest
  peer, the tags' round trip through L2) hides behind that work instead of stalling every
  wave.
- `plan_rows` (pure Python) picks S for the shape from a small timing model (`estimate_us`):
  larger slices amortise the group's meeting (modelled at 3 us) over more data, but must
  leave ring chunks free for the next waves' copies (and for the look-ahead), and the grid
  should fill the SMs without a ragged last wave. E.g. on 132 SMs with 14-chunk rings:
  32x1M bf16 forward, 33 CTAs per row (4 rows at once, 8 waves of 62 KB slices); 8x4M
  bf16, all 132 CTAs on one row at a time (8 waves).

Fallback for rows whose slice the ring cannot hold (f32 backward of 4M columns: 254 KB of dy
and y per CTA with all 132 SMs on one row): the first ``ring - prefetch_reserve(ring)`` chunks of
the slice are staged, the rest is read by the consumer threads themselves for the
statistics and again for the output. That second read comes from L2: per wave it is at most
the ring's overflow on every SM (about 12 MB on 132 SMs), read a few microseconds earlier,
while the staged copies are marked evict-first. The slices are as large as they can be
(every SM on the row) so that the overflow is the smallest possible share.

Every instance peels rows (16-byte vectors after a scalar head, see softmax.py), so it takes
operands at any alignment whose rows share one offset from a 16-byte boundary, and strided
rows. The artifact (one per dtype, direction and ``ctas_per_sm``) serves every shape; the plan
is made at launch from the device's SM count and shared memory.

Per-phase trace (experiments): with ``kernel.trace = True`` the instance compiles a separate
artifact with ``RG_TRACE`` defined, whose consumer thread 0 and producer lane record
%globaltimer stamps per CTA (entry, ring ready, per wave: statistics done, group met, output
stored, the producer's last copy issued; exit) for the first `TRACE_WAVES` waves, in
`TRACE_CTA_BYTES` per CTA after the workspace slots (`get_workspace_size` grows to hold them).
`clear_trace` before the launch, `read_trace(workspace, plan)` after it. The traced build adds
one consumer barrier per wave (before the "stored" stamp); without ``RG_TRACE`` the cubin is
the same as before the switch existed.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any

import torch

from ....arguments import SoftmaxArguments, SoftmaxBackwardArguments
from ....core.arch import sm_count
from ....core.dtypes import DataType
from ....core.status import Status
from ....core.streams import stream_handle
from ....metadata import KernelMetadata, RowReductionDesignMetadata
from ... import softmax_config
from .. import CudaSourceProvider
from ..kernel import CudaSourceKernel
from .launch_epoch import next_epoch
from .softmax import _TYPES, JoinsSoftmaxSource, peel_status, row_length_status, row_params
from .softmax_smem import max_cols as smem_max_cols

_log = logging.getLogger(__name__)

#: Compute threads per CTA, plus one producer warp (softmax_rowgroup.cu's RG_CONSUMERS), of
#: the one-CTA-per-SM instances.
CONSUMERS = 512
THREADS = CONSUMERS + 32
#: Consumer threads by CTAs per SM: with two, 256 keep the kernels at 92-96 registers without
#: spills (512 would be forced to 56 and spill).
CONSUMERS_BY_CTAS_PER_SM = {1: 512, 2: 256}
#: The most CTAs per SM any plan uses: the workspace (`get_workspace_size`) has room for them.
MAX_CTAS_PER_SM = 2
#: Bytes per ring chunk (one TMA copy, or two for the backward's dy and y) and the most
#: chunks a ring has (the kernel's mbarrier arrays).
CHUNK_BYTES, MAX_CHUNKS = 16384, 16
#: Chunks of a full (`DEFAULT_RING`) ring left free for the next wave's copies when a slice
#: overflows it; smaller rings keep the same share (`prefetch_reserve`).
PREFETCH_CHUNKS = 4
#: Workspace bytes per CTA: four slots of {64-bit tag, two floats} (softmax_rowgroup.cu's RG_SLOTS).
SLOT_BYTES = 64
#: What the plan assumes without a GPU (an H100 / H200): SMs, and dynamic shared memory a
#: CTA may have (227 KB) less the kernel's static barriers and reduction scratch.
DEFAULT_SMS = 132
DEFAULT_RING = (232448 - 1024) // CHUNK_BYTES
#: An H100 / H200 SM's shared memory, what the driver reserves per CTA, and a bound on the
#: kernel's static shared memory (896 bytes): the rings that let several CTAs share an SM.
_SM_SMEM, _CTA_RESERVED_SMEM, _STATIC_SMEM = 233472, 1024, 1024
#: The trace of an ``RG_TRACE`` build (softmax_rowgroup.cu's RG_TRACE_*): per CTA a head of
#: `TRACE_HEAD_WORDS` 64-bit words, then four per wave for the first `TRACE_WAVES` waves
#: (later waves are processed but not recorded); `TRACE_MAGIC` marks a complete record.
TRACE_WAVES = 16
TRACE_HEAD_WORDS = 8
TRACE_WORDS = TRACE_HEAD_WORDS + 4 * TRACE_WAVES
TRACE_CTA_BYTES = 8 * TRACE_WORDS
TRACE_MAGIC = 0x52475452
#: The forward's stagger (RG_STAGGER_NS): with 4+ waves the upper half of the row groups starts
#: this late. Swept on the H200:
#: 1.5-3 us made the forwards of 32 and 64 rows of 1M 3-5 % faster (one CTA per SM; 1-3 %
#: with two), 6-12 us and a ramp over all groups no better or slower; the backward moved 0-2 %.
STAGGER_NS_FORWARD = 3000
#: Rows from this length are what the family is built (and measured) for; below, PickAny
#: ranks it after the register, smem, looped and cluster-split kernels (`estimated_cost`),
#: except for rows too long for one CTA's shared memory (`long_rows_from`) and few long rows
#: of a length it reaches (`ranks_long_rows`).
MIN_COLS = 2**17
MIN_CC, MAX_CC = 90, 100

# The timing model of `estimate_us` (microseconds, bytes): DRAM bandwidth of the whole GPU
# and the most one SM streams, a group's meeting (publish, the slowest peer, the tags'
# round trip through L2), a lone CTA's own reduction, elements per microsecond one SM's
# consumers process from shared memory, and the cost of an overflow byte read again from L2.
_BW, _SM_BW = 3.6e6, 8.0e4
_T_MEET, _T_SOLO = 3.0, 0.3
_RATE = {False: 2.0e4, True: 4.0e4}
_L2_REREAD = 0.5
#: The ranking's hint scale of the two-CTA instances: just after the one-CTA ones (0.98), but
#: ahead of them for 16-bit forwards whose one-CTA plan has `_TWO_CTA_MIN_GROUPS` row groups or
#: more (1.03), whose exps per byte a second CTA's copies overlap: H200 (both at their
#: plans): bf16 forward 2-8 % faster at 8, 32 and 64 rows of 1M (8 groups), slower at 8x4M (2
#: groups) and on a lone 1M row (13-20 %); f32 forward 2-3 % slower, every backward 3-8 % slower.
#: With the forwards' bulk stores and packed math (benchmarks/softmax.py --cases long) the
#: two-CTA instance stays 2-5 % faster at 32 and
#: 64 rows of 1M (4 and 8 waves) but is 8-10 % slower at 8x1M, whose 8 rows are one wave: so it
#: ranks first only where the one-CTA plan also runs `_TWO_CTA_MIN_WAVES` waves or more.
_TWO_CTA_HINT = 0.98
_TWO_CTA_HINT_16BIT_FORWARD = 1.03
_TWO_CTA_MIN_GROUPS = 4
_TWO_CTA_MIN_WAVES = 2


def default_ring(ctas_per_sm: int) -> int:
    """Ring chunks per CTA without a GPU to ask: `DEFAULT_RING` for one CTA per SM, else the
    most that ``ctas_per_sm`` CTAs fit in an H100 / H200 SM's shared memory (7 for two)."""
    if ctas_per_sm <= 1:
        return DEFAULT_RING
    return max(1, min(DEFAULT_RING, (_SM_SMEM // ctas_per_sm - _CTA_RESERVED_SMEM - _STATIC_SMEM) // CHUNK_BYTES))


def prefetch_reserve(ring_chunks: int) -> int:
    """Chunks of a ``ring_chunks`` ring left free for the next wave's copies when a slice
    overflows it: `PREFETCH_CHUNKS` of a full ring, the same share (rounded up) of a smaller
    one, so two CTAs with half rings keep an SM's reserve; at least one chunk stays staged."""
    return min(ring_chunks - 1, -(-PREFETCH_CHUNKS * ring_chunks // DEFAULT_RING))


def chunk_vectors(backward: bool) -> int:
    """16-byte vectors per array in one chunk (the backward's chunk holds dy's and y's)."""
    return CHUNK_BYTES // 16 // (2 if backward else 1)


@dataclass(frozen=True)
class RowGroupPlan:
    """How a launch maps rows onto the persistent grid.

    ``ctas_per_row`` (S) CTAs share each row; ``groups`` (G) rows are processed at once;
    ``waves`` = ceil(rows / G). Each CTA's slice holds at most ``slice_vectors`` 16-byte
    vectors (per array), of which up to ``staged_vectors`` go through the shared-memory
    ring of ``ring_chunks`` chunks; the rest (``overflow_vectors``) is read twice.
    ``ahead``: the consumers take (and publish) a wave's statistics before waiting for the
    previous wave's group, which needs two waves' chunks in the ring (the plan asks for three,
    so that the copies still run ahead). ``estimate_us``: the model's time on an
    H100/H200-like GPU.
    """

    ctas_per_row: int
    groups: int
    waves: int
    slice_vectors: int
    staged_vectors: int
    ring_chunks: int
    backward: bool
    ahead: bool
    estimate_us: float

    @property
    def grid(self) -> int:
        return self.groups * self.ctas_per_row

    @property
    def overflow_vectors(self) -> int:
        return self.slice_vectors - self.staged_vectors

    @property
    def smem_bytes(self) -> int:
        """Dynamic shared memory per CTA: the ring."""
        return self.ring_chunks * CHUNK_BYTES

    @property
    def workspace_bytes(self) -> int:
        """The workspace slots of the grid (a traced build needs `traced_workspace_bytes`)."""
        return self.grid * SLOT_BYTES

    @property
    def traced_workspace_bytes(self) -> int:
        """The slots and, after them, `TRACE_CTA_BYTES` of trace per CTA."""
        return self.grid * (SLOT_BYTES + TRACE_CTA_BYTES)


def row_vectors(cols: int, elem_bytes: int) -> int:
    """The most 16-byte vectors a peeled row of ``cols`` elements has (head 0)."""
    return cols // (16 // elem_bytes)


def slice_bounds(nvec: int, ctas_per_row: int, rank: int) -> tuple[int, int]:
    """The vectors [v0, v1) of a row's ``nvec`` that CTA ``rank`` of its group takes (the
    kernel's `row_slice`: balanced, sizes differ by at most one)."""
    return nvec * rank // ctas_per_row, nvec * (rank + 1) // ctas_per_row


def wave_chunks(staged_vectors: int, backward: bool) -> int:
    """Ring chunks one wave's staged slice takes."""
    return -(-staged_vectors // chunk_vectors(backward))


def looks_ahead(ctas_per_row: int, staged_vectors: int, ring_chunks: int, backward: bool) -> bool:
    """Whether the consumers publish a wave before waiting for the previous one's group: when
    there is a group to wait for and the ring holds three waves' chunks."""
    return ctas_per_row > 1 and 3 * wave_chunks(staged_vectors, backward) <= ring_chunks


def estimate_us(rows: int, cols: int, elem_bytes: int, backward: bool, ctas_per_row: int, groups: int,
                slice_vectors: int, staged_vectors: int, ring_chunks: int) -> float:
    """The model's run time of a plan (microseconds).

    Per wave, a CTA moves its slice (reads and the write; an overflow's second read at half
    a DRAM byte) at its share of the bandwidth (D), and spends its shared-memory passes and
    the group's meeting (C; looking ahead, the meeting overlaps the next wave's statistics,
    about half the passes). With ring chunks free for the next wave's copies the two overlap
    (a wave takes max(D, C)); without, they add. One wave is load, meet, store.
    """
    S, G = ctas_per_row, groups
    waves = -(-rows // G)
    arrays = 2 if backward else 1
    vec = 16 // elem_bytes
    overflow = slice_vectors - staged_vectors
    moved = slice_vectors * 16 * (arrays + 1) + overflow * 16 * arrays * _L2_REREAD
    chunks = max(1, wave_chunks(staged_vectors, backward))
    ahead = looks_ahead(S, staged_vectors, ring_chunks, backward)
    overlap = min(1.0, max(0, ring_chunks - chunks * (2 if ahead else 1)) / chunks)
    work = slice_vectors * vec / _RATE[backward]
    meet = _T_MEET if S > 1 else _T_SOLO
    compute = work + (max(0.0, meet - work / 2) if ahead else meet)

    def wave(active: int) -> float:
        d = moved / min(_BW / (active * S), _SM_BW)
        if waves == 1:
            return d + compute
        return overlap * max(d, compute) + (1.0 - overlap) * (d + compute)

    last = rows - (waves - 1) * G
    total = (waves - 1) * wave(G) + wave(last)
    if waves > 1:
        total += min(compute, moved / min(_BW / (G * S), _SM_BW))  # the first load / last meeting
    return total


# The slices the measured sweeps ran fastest with: the forward's at 124-128 KB, 8 of a 14-chunk
# ring (all six forward cases on an H100; the plan was best or within 2 % on the H200 too);
# the backward's dy and y at 128 KB, 8 chunks (H200: bf16 and f16 at S = 32, f32 at S = 64 were
# fastest for 8, 32 and 64 rows of 1M, 3-20 % ahead of the 12 chunks an H100 sweep of an
# earlier version of the kernel had chosen), or the grid's whole width where that overflows. As
# fractions of the ring,
# so smaller rings (two CTAs per SM, other GPUs, tests) scale alike.
_TARGET_CHUNKS_OF_14 = {False: 8, True: 8}
#: The least share of the co-resident CTAs a plan keeps busy (else more CTAs per row, smaller
#: slices): 128 of 132, as the sweep's fastest plans (S=16, G=8 for 32x1M bf16) did.
_MIN_FILL = 0.965


def pick_ctas_per_row(rows: int, nvec: int, backward: bool, ctas: int, ring_chunks: int) -> int:
    """S for ``rows`` of ``nvec`` vectors: the fewest CTAs per row whose slices stay within the
    measured target share of the ring (`_TARGET_CHUNKS_OF_14`) and whose groups keep at least
    `_MIN_FILL` of the ``ctas`` busy (the most busy when none does); every CTA of the grid
    when even those slices overflow, and all of it shared by the rows when they fit in one wave. The model of `estimate_us` missed the sweep's best S by
    5-17 %; this rule picks it (or one within 3 %) in all twelve cases."""
    most = min(ctas, max(1, nvec))
    target = max(1, -(-ring_chunks * _TARGET_CHUNKS_OF_14[backward] // 14)) * chunk_vectors(backward)
    fewest = min(most, max(1, -(-nvec // target)))
    if ctas // rows >= fewest:  # every row at once: the whole grid on them, slices smaller still
        return min(most, ctas // rows)
    best, best_fill = fewest, 0
    for S in range(fewest, most + 1):
        fill = min(ctas // S, rows) * S
        if fill >= _MIN_FILL * ctas:
            return S
        if fill > best_fill:
            best, best_fill = S, fill
    return best


@functools.lru_cache(maxsize=4096)
def plan_rows(rows: int, cols: int, elem_bytes: int, backward: bool, ctas: int = DEFAULT_SMS,
              ring_chunks: int = DEFAULT_RING, ctas_per_row: int | None = None) -> RowGroupPlan:
    """The plan for ``rows`` x ``cols`` on ``ctas`` co-resident CTAs with rings of
    ``ring_chunks`` chunks: S CTAs per row from `pick_ctas_per_row` (``ctas_per_row`` fixes S,
    at most ``ctas``), as many row groups as fit, `estimate_us` its modelled time."""
    if rows < 1 or cols < 1 or ctas < 1 or not 1 <= ring_chunks <= MAX_CHUNKS:
        raise ValueError(f"plan_rows: no plan for rows={rows}, cols={cols}, ctas={ctas}, ring={ring_chunks}")
    nvec = row_vectors(cols, elem_bytes)
    cv = chunk_vectors(backward)
    reserve = prefetch_reserve(ring_chunks)
    S = (pick_ctas_per_row(rows, nvec, backward, ctas, ring_chunks) if ctas_per_row is None
         else max(1, min(ctas_per_row, ctas)))
    G = min(ctas // S, rows)
    slice_vectors = -(-nvec // S)
    staged = slice_vectors if slice_vectors <= ring_chunks * cv else (ring_chunks - reserve) * cv
    t = estimate_us(rows, cols, elem_bytes, backward, S, G, slice_vectors, staged, ring_chunks)
    return RowGroupPlan(S, G, -(-rows // G), slice_vectors, staged, ring_chunks, backward,
                        looks_ahead(S, staged, ring_chunks, backward), t)


#: The fewest rows between `long_rows_from` and `MIN_COLS` elements the long-row families are
#: ranked for: on an H200 (the "H200 vocab-few" run of tests/data) the cluster splits ran
#: fastest on 2 and 8 such rows, the row-group and window kernels 1.15-1.6x faster from 16.
LONG_ROWS_MIN_ROWS = 16
#: Few rows the smem families reach, ranked for the long-row families too: rows of at least
#: `FEW_ROWS_FROM_BYTES` (82K 16-bit, 41K f32 elements), from `LONG_ROWS_MIN_ROWS` to below
#: `FEW_ROWS_BELOW`. There the one-CTA-per-row smem kernels leave most SMs idle and the cluster
#: splits need two waves or more: on an H100 and an H200 (the few-row sweeps of tests/data)
#: the row-group and window kernels ran fastest on 16-40 rows of 82K-116K 16-bit elements, by up
#: to 1.4x; from 48 rows the smem kernels are as fast or faster.
FEW_ROWS_FROM_BYTES = 128 * 1024
FEW_ROWS_BELOW = 48


def long_rows_from(elem_bytes: int) -> int:
    """The shortest row the long-row families (row-group, window) are ranked for: one
    past what a CTA's shared memory stages (`softmax_smem.max_cols` of the forward and the
    y-staged backward: 116K 16-bit, 58K f32 elements), at most `MIN_COLS`. Between the two the
    register and cluster-split kernels read the row twice; measured on an H200 (2048 and 8192
    rows of 65536-128256 elements; docs/performance.md, "Softmax") the row-group
    and window kernels ran 17-33 % faster there, and within 2 % of the cluster split on f32
    backwards of 65536."""
    dtype = DataType.f32 if elem_bytes == 4 else DataType.bf16
    return min(MIN_COLS, smem_max_cols(dtype, 1) + 1)


def row_group_cost(rows: int, cols: int, elem_bytes: int, backward: bool, sm_count: int, hint: float) -> float:
    """`CudaSoftmaxRowGroup*.estimated_cost` for one-CTA plans on ``sm_count`` SMs with family hint
    ``hint`` (`row_cost`'s units: the plan's `estimate_us` over one pass at full bandwidth); four
    times that plus 100 where the family does not rank (`ranks_long_rows`: rows shorter than
    `MIN_COLS` that the smem or cluster-split families take)."""
    p = plan_rows(max(rows, 1), max(cols, 1), elem_bytes, backward, max(sm_count, 1), DEFAULT_RING)
    ideal = rows * cols * elem_bytes * (3 if backward else 2) / _BW
    cost = p.estimate_us / max(ideal, 1e-9) * 1.02 / hint
    return cost if ranks_long_rows(rows, cols, elem_bytes) else 4.0 * cost + 100.0


def ranks_long_rows(rows: int, cols: int, elem_bytes: int) -> bool:
    """Whether ``rows`` x ``cols`` is a problem the long-row families rank for (`row_group_cost`):
    rows of `MIN_COLS` elements and more; from `long_rows_from` at `LONG_ROWS_MIN_ROWS` rows or
    more; and from `FEW_ROWS_FROM_BYTES` at `LONG_ROWS_MIN_ROWS` up to `FEW_ROWS_BELOW` rows."""
    if cols >= MIN_COLS:
        return True
    if rows < LONG_ROWS_MIN_ROWS:
        return False
    return cols >= long_rows_from(elem_bytes) or (cols * elem_bytes >= FEW_ROWS_FROM_BYTES
                                                  and rows < FEW_ROWS_BELOW)


def clear_trace(workspace: torch.Tensor, plan: RowGroupPlan) -> None:
    """Zero the trace region of ``workspace`` for a traced launch of ``plan`` (so a stamp the
    launch does not write reads 0, and a stale record has no `TRACE_MAGIC`). The slots before
    it are left alone (their tags need no reset)."""
    start = plan.workspace_bytes
    workspace.view(torch.uint8).view(-1)[start:start + plan.grid * TRACE_CTA_BYTES].zero_()


def read_trace(workspace: torch.Tensor, plan: RowGroupPlan) -> list[dict]:
    """The per-CTA records a traced launch of ``plan`` left in ``workspace`` (after the slots):
    one dict per CTA with ``cta``, ``rank``, ``group``, ``sm``, ``waves`` (processed), ``tag``
    (the launch's, equal in all), the stamps ``entry``, ``ready`` (ring initialised), ``exit``,
    ``issue_first`` and ``producer_done`` (the producer's first copy issued, its last), and per
    recorded wave (at most `TRACE_WAVES`) the lists ``stats`` (statistics done), ``met`` (the
    group's partials combined), ``stored`` (every consumer's stores issued), ``issued`` (the
    wave's last copy issued). Stamps are %globaltimer nanoseconds; 0 where none was written
    (a CTA without copies). Raises ValueError where a record is incomplete or stale (not a
    traced build, or a launch that did not finish)."""
    words = workspace.view(torch.uint8).view(-1)
    start, n = plan.workspace_bytes, plan.grid * TRACE_CTA_BYTES
    if words.numel() < start + n:
        raise ValueError(f"read_trace: the workspace holds {words.numel()} bytes, the trace of {plan.grid} CTAs "
                         f"ends at {start + n}")
    raw = words[start:start + n].cpu().view(torch.int64).view(plan.grid, TRACE_WORDS).tolist()
    records, tags = [], set()
    for cta, w in enumerate(raw):
        head = w[0] & 0xFFFFFFFFFFFFFFFF
        if head >> 32 != TRACE_MAGIC:
            raise ValueError(f"read_trace: CTA {cta} left no complete trace record (header {head:#x}): not an "
                             f"RG_TRACE build, or the trace was not cleared before the launch")
        waves = head & 0xFFFFFFFF
        rec = min(waves, TRACE_WAVES)
        per_wave = [w[TRACE_HEAD_WORDS + 4 * i:TRACE_HEAD_WORDS + 4 * i + 4] for i in range(rec)]
        tags.add(w[6])
        records.append(dict(cta=cta, rank=cta % plan.ctas_per_row, group=cta // plan.ctas_per_row, sm=w[7],
                            waves=waves, tag=w[6], entry=w[1], ready=w[2], exit=w[3], issue_first=w[4],
                            producer_done=w[5], stats=[v[0] for v in per_wave], met=[v[1] for v in per_wave],
                            stored=[v[2] for v in per_wave], issued=[v[3] for v in per_wave]))
    if len(tags) > 1:
        raise ValueError(f"read_trace: the records carry {len(tags)} launch tags: CTAs of different launches")
    return records


@dataclass(frozen=True)
class _DeviceFit:
    """A device's room for the grid: co-resident CTAs, chunks per CTA's ring, and SMs."""

    ctas: int
    ring_chunks: int
    sms: int


@dataclass(frozen=True)
class RowGroupBuild:
    """What an artifact was compiled with (``artifact.extra``): consumer threads, the launch
    bounds' CTAs per SM, and whether it records a trace (then its launches need
    `RowGroupPlan.traced_workspace_bytes`)."""

    consumers: int
    ctas_per_sm: int
    traced: bool
    bulk_out: bool = False


class _RowGroupBase(JoinsSoftmaxSource, CudaSourceKernel):
    source_file = "softmax_rowgroup.cu"

    def __init__(self, metadata: KernelMetadata, params: dict) -> None:
        super().__init__(metadata, params)
        self.ctas_per_sm: int = params.get("ctas_per_sm", 1)
        self.consumers: int = CONSUMERS_BY_CTAS_PER_SM[self.ctas_per_sm]
        self._fits: dict[tuple[int, int], _DeviceFit] = {}  # by (device, threads per CTA)
        # Caps on the grid and the ring, and a fixed CTAs-per-row, for tests and experiments
        # (None: the device's room and `plan_rows`' choice).
        self.limit_ctas: int | None = None
        self.limit_ring: int | None = None
        self.ctas_per_row: int | None = None
        # Compile (and size the workspace for) the RG_TRACE build: experiments only.
        self.trace: bool = False
        # The RG_BULK_OUT build (a storer warp writes the staged output with TMA bulk stores):
        # the forward's (`BULK_OUT_FORWARD`); the backward's measured slower, an experiment.
        self.bulk_out: bool = not self.backward
        # RG_PACKED_MATH: the 16-bit forwards' max and (bf16) output scaling two values at a
        # time, 1-7 % faster (H200).
        self.packed_math: bool = not self.backward and self.dtype.bytes == 2
        # RG_STAGGER_NS: with 4+ waves the upper half of the row groups starts this many ns late
        # (0: off); the forward's (`STAGGER_NS_FORWARD`), the backward measured no gain.
        self.stagger_ns: int = 0 if self.backward else STAGGER_NS_FORWARD

    @property
    def threads(self) -> int:
        """Threads per CTA of this instance's build (`threads_of`)."""
        return self.threads_of(self.bulk_out)

    def threads_of(self, bulk_out: bool) -> int:
        """Threads per CTA: the consumers, the producer warp and, in the bulk-store build, the
        storer warp."""
        return self.consumers + 32 + (32 if bulk_out else 0)

    # ---- generation --------------------------------------------------------------------
    @classmethod
    def variant_params(cls) -> list[dict]:
        # (the one-CTA instances first: discovery's order, and what ties in the ranking keep)
        return [dict(dtype=dtype, ctas_per_sm=n) for n in (1, 2) for dtype in softmax_config.DTYPES]

    @classmethod
    def instance_name(cls, params: dict) -> str:
        n = params.get("ctas_per_sm", 1)
        return f"{cls.__name__}_{params['dtype']}_rowgroup{n if n > 1 else ''}_peel{16 // params['dtype'].bytes}"

    @classmethod
    def make_metadata(cls, params: dict) -> KernelMetadata:
        n = params.get("ctas_per_sm", 1)
        consumers = CONSUMERS_BY_CTAS_PER_SM[n]
        design = RowReductionDesignMetadata("rowgroup", consumers, 16, long_rows_from(params["dtype"].bytes), None,
                                            extra=(("peel", True), ("cooperative", True),
                                                   ("chunk_bytes", CHUNK_BYTES), ("consumers", consumers),
                                                   ("ctas_per_sm", n)))
        return cls.family_metadata(params, design, MIN_CC, MAX_CC)

    # ---- support --------------------------------------------------------------------------
    def _supports(self, args: Any) -> Status:
        name = self.metadata.kernel_name
        too_long = row_length_status(name, args.cols)
        if too_long is not None:
            return too_long
        # Any number of rows: the persistent grid takes them in waves.
        return peel_status(name, args, self.vec)

    # ---- compile: one template instance per dtype and direction ---------------------------
    def name_expression(self, args: Any) -> str:
        op = "bwd" if self.backward else "fwd"
        return f"ka_softmax::{op}_rowgroup<{_TYPES[self.dtype]}, {self.vec}>"

    def defines_for(self, args: Any) -> dict[str, int]:
        """The consumer count and launch bounds of this instance, and the trace switch."""
        defines = {"RG_CONSUMERS": self.consumers, "RG_MIN_BLOCKS": self.ctas_per_sm}
        if self.trace:
            defines.update(RG_TRACE=1, RG_TRACE_WAVES=TRACE_WAVES)
        if self.bulk_out:
            defines["RG_BULK_OUT"] = 1
        if self.packed_math:
            defines["RG_PACKED_MATH"] = 1
        if self.stagger_ns:
            defines["RG_STAGGER_NS"] = int(self.stagger_ns)
        return defines

    def launch_plan(self, args: Any, launcher: Any) -> RowGroupBuild:
        """Stored with the artifact: `_run` sizes the workspace by the build, not by `trace`."""
        return RowGroupBuild(self.consumers, self.ctas_per_sm, self.trace, self.bulk_out)

    # ---- plan --------------------------------------------------------------------------------
    def _fit(self, launcher: Any, device: int) -> _DeviceFit:
        """The device's room: the largest ring (at most `MAX_CHUNKS`) that lets `ctas_per_sm`
        CTAs share each SM, and the CTAs that then reside. A full ring takes more than half an
        SM's shared memory, so the CTAs it lets reside are the SMs."""
        fit = self._fits.get((device, self.threads))
        if fit is None:
            full = min(MAX_CHUNKS, launcher.max_dynamic_smem(device) // CHUNK_BYTES)
            if full < 1:
                raise RuntimeError(f"{self.metadata.kernel_name}: device {device} lacks the shared memory "
                                   f"for one {CHUNK_BYTES}-byte chunk per CTA")
            sms = launcher.max_coresident(device, self.threads, full * CHUNK_BYTES)
            ring, ctas = full, sms
            if self.ctas_per_sm > 1:
                want = self.ctas_per_sm * sms
                ring = next((r for r in range(full, 0, -1)
                             if launcher.max_coresident(device, self.threads, r * CHUNK_BYTES) >= want), None)
                if ring is None:  # (registers or threads): still correct, one CTA per SM
                    _log.warning("%s: no ring lets %d CTAs share an SM of device %d; planning for %d CTAs",
                                 self.metadata.kernel_name, self.ctas_per_sm, device, sms)
                    ring = full
                else:
                    ctas = want
            fit = self._fits[(device, self.threads)] = _DeviceFit(ctas, ring, sms)
        return fit

    def plan(self, args: Any, ctas: int | None = None, ring_chunks: int | None = None) -> RowGroupPlan:
        """The plan for ``args`` on ``ctas`` co-resident CTAs with ``ring_chunks``-chunk rings
        (default: an H100 / H200's, `DEFAULT_SMS` x `ctas_per_sm` and `default_ring`)."""
        ctas = DEFAULT_SMS * self.ctas_per_sm if ctas is None else ctas
        ring_chunks = default_ring(self.ctas_per_sm) if ring_chunks is None else ring_chunks
        return plan_rows(max(args.rows, 1), max(args.cols, 1), self.dtype.bytes, self.backward, ctas, ring_chunks,
                         self.ctas_per_row)

    def launch_config(self, args: Any) -> tuple:
        p = self.plan(args)
        return (p.grid, self.threads, p.smem_bytes)

    def get_workspace_size(self, args: Any) -> int:
        """`SLOT_BYTES` per CTA of the largest grid (`MAX_CTAS_PER_SM` per SM), and with `trace`
        `TRACE_CTA_BYTES` more per CTA."""
        per_cta = SLOT_BYTES + (TRACE_CTA_BYTES if self.trace else 0)
        return per_cta * MAX_CTAS_PER_SM * _sm_count(args.device)

    # ---- ranking ---------------------------------------------------------------------------
    def estimated_cost(self, args: Any, sm_count: int) -> float:
        """`row_cost`'s units: the plan's modelled time over one pass at full bandwidth, for
        the peeled edges (1.02) and the family's `performance_hint`. So the cluster-split
        and looped kernels (two reads: 1.5x and more) lose the long rows, and a lone long
        row, which they spread over few SMs, comes here too. Rows shorter than
        `long_rows_from` stay with the families measured there (but the few rows of
        `ranks_long_rows`): four times the cost plus 100,
        past what the generic model gives them (few rows of 64K elements cost the cluster splits
        20-85).

        The model has no term for two CTAs sharing an SM: the two-CTA instances take the
        one-CTA plan's cost over a hint 2 % lower (`_TWO_CTA_HINT`), so PickAny keeps the
        one-CTA instance first and the two-CTA one right after it, except for 16-bit forwards,
        with several row groups in two waves or more, where the two-CTA instances measured
        faster and rank first (`_TWO_CTA_HINT_16BIT_FORWARD`)."""
        two = _TWO_CTA_HINT
        if self.ctas_per_sm > 1 and not self.backward and self.dtype.bytes == 2:
            one_cta = plan_rows(max(args.rows, 1), max(args.cols, 1), 2, False, max(sm_count, 1), DEFAULT_RING)
            if one_cta.groups >= _TWO_CTA_MIN_GROUPS and one_cta.waves >= _TWO_CTA_MIN_WAVES:
                two = _TWO_CTA_HINT_16BIT_FORWARD
        hint = type(self).performance_hint * (two if self.ctas_per_sm > 1 else 1.0)
        return row_group_cost(args.rows, args.cols, self.dtype.bytes, self.backward, sm_count, hint)

    def group_plan(self, args: Any, launcher: Any, device: int) -> tuple[RowGroupPlan, int]:
        """The plan a launch on ``device`` takes and the co-resident CTAs it was made for: the
        device's fit (`_fit`), or with `limit_ring` below its ring the CTAs of that smaller ring
        (more per SM where registers allow, at most `MAX_CTAS_PER_SM`: the workspace's room),
        capped by `limit_ctas`."""
        fit = self._fit(launcher, device)
        ring, resident = fit.ring_chunks, fit.ctas
        if self.limit_ring is not None and self.limit_ring < ring:
            ring = max(1, self.limit_ring)
            resident = min(launcher.max_coresident(device, self.threads, ring * CHUNK_BYTES),
                           MAX_CTAS_PER_SM * fit.sms)
        ctas = resident if self.limit_ctas is None else max(1, min(resident, self.limit_ctas))
        return self.plan(args, ctas, ring), resident

    # ---- launch ------------------------------------------------------------------------------
    def _run(self, args: Any, artifact: Any, stream: Any, workspace: Any = None) -> None:
        if args.rows == 0 or args.cols == 0:
            return
        device = args.device.index
        if device is None:
            device = torch.cuda.current_device()
        launcher = artifact.compiled_obj
        p, resident = self.group_plan(args, launcher, device)
        # (the build, not `trace`, decides: a traced artifact writes its trace past the slots)
        build = getattr(artifact, "extra", None)
        traced = build.traced if isinstance(build, RowGroupBuild) else self.trace
        need = p.traced_workspace_bytes if traced else p.workspace_bytes
        if (workspace is None or workspace.numel() * workspace.element_size() < need
                or workspace.data_ptr() % 16):
            got = "none" if workspace is None else f"{workspace.numel() * workspace.element_size()} bytes at {workspace.data_ptr():#x}"
            raise ValueError(f"{self.metadata.kernel_name}: needs a 16-byte aligned workspace of {need} "
                             f"bytes (get_workspace_size{' with trace' if traced else ''}), got {got}")
        chunks = wave_chunks(p.staged_vectors, self.backward)
        if chunks > p.ring_chunks or (p.ahead and 2 * chunks > p.ring_chunks) or p.grid > resident:
            raise RuntimeError(f"{self.metadata.kernel_name}: inconsistent plan {p} for {resident} co-resident CTAs")  # (the kernel would trap)
        threads = self.threads_of(build.bulk_out if isinstance(build, RowGroupBuild) else self.bulk_out)
        tail = (workspace.data_ptr(), next_epoch(), p.ctas_per_row, p.groups, p.staged_vectors, p.ring_chunks,
                int(p.ahead))
        launcher.launch(stream_handle(stream, device), device, p.grid, threads, p.smem_bytes,
                        row_params(args) + tail, cooperative=True)


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return DEFAULT_SMS * 2  # (a bound for planning without a GPU)
    return sm_count(device)


@CudaSourceProvider.register
class CudaSoftmaxRowGroupForward(_RowGroupBase):
    """``out = softmax(x, dim=-1)`` for long rows: S CTAs per row of a cooperative persistent
    grid, each staging its slice once in shared memory (f32 math)."""

    supported_args_type = SoftmaxArguments
    backward = False


@CudaSourceProvider.register
class CudaSoftmaxRowGroupBackward(_RowGroupBase):
    """``grad_in = out * (grad_out - sum(grad_out * out))`` for long rows, dy's and y's slices
    staged once in shared memory."""

    supported_args_type = SoftmaxBackwardArguments
    backward = True
