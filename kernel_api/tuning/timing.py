"""Measuring GPU work the way our numbers are quoted: CUDA events, median of many runs,
rotating input sets so repeated runs do not measure the L2 cache.

The timings that rank candidates against each other (`time_interleaved`, `time_own_state`)
measure in one of two ways (`TIMINGS`). ``as_called``: each sample is a run of back-to-back
calls between one pair of events, divided by the calls, started on a GPU with nothing queued
(the warm-up's, settle's and previous sample's launches waited for), so a call's host time
shows: all of it where it outlasts the kernel, as a loop of such calls would be charged, and its
first call's latency once per sample otherwise. Behind a backlog, a call whose host work is
shorter than its kernel times as its kernel alone: QuACK's RMSNorm (bf16 16384x4096, H200) 67.6
us against ours 68.2, where from an idle GPU its calls take 79.0 us against ours 70.1 (kernel
times 69.3 and 69.8). ``device``:
each call between its own events, queued behind a GPU spin where the host is slower than the
calls, so the samples hold GPU time only: what a CUDA graph's replay of the kernel costs, where
the host's work is done once at capture."""

from __future__ import annotations

import math
import random
import statistics
import time
from typing import Any, Callable, Sequence

import torch

L2_FLUSH_BYTES = 64 << 20  # larger than the L2 of an H100 (50 MB) / H200 (60 MB)


def rotation_count(bytes_per_set: int, min_bytes: int = 2 * L2_FLUSH_BYTES, cap: int = 16) -> int:
    """How many input sets to rotate through so the sets together exceed the L2 twice."""
    if bytes_per_set <= 0:
        return 1
    return max(1, min(cap, -(-min_bytes // bytes_per_set)))


#: Longest GPU head start (ms) `QueuedTiming` gives: the spin kernel's time is lost to the GPU.
MAX_HEAD_START_MS = 10.0
#: Host time per timed call beyond the call itself: its two event records (measured 5-10 us).
_EVENT_PAIR_MS = 0.012

#: The ways `time_interleaved` and `time_own_state` measure (see the module docstring).
TIMINGS = ("as_called", "device")
#: An ``as_called`` sample's length: enough back-to-back calls for about this many ms (by the
#: warm-up's host time per call and the GPU floor), at most `AS_CALLED_MAX_CALLS`. A sample that
#: starts on an idle GPU holds its first call's host time too; over this many calls that is a
#: percent or two of a call that the GPU bounds.
AS_CALLED_SAMPLE_MS = 0.5
AS_CALLED_MAX_CALLS = 256


def check_timing(timing: str) -> str:
    """``timing`` when it names one of `TIMINGS`, else a ValueError saying so."""
    if timing not in TIMINGS:
        raise ValueError(f"timing must be 'as_called' or 'device', got {timing!r}")
    return timing


def wait_for_queue(stream: Any, last: Any = None) -> None:
    """Wait until the GPU has run everything queued on ``stream``: ``last`` (the event recorded
    last there) or a new event. An ``as_called`` sample starts after it (see the module
    docstring)."""
    if last is None:
        last = torch.cuda.Event()
        last.record(stream)
    last.synchronize()


def calls_per_sample(host_ms: float, gpu_floor_ms: float) -> int:
    """Back-to-back calls in one ``as_called`` sample for a call taking ``host_ms`` of host time
    (warm-up) and at least ``gpu_floor_ms`` of GPU time: `AS_CALLED_SAMPLE_MS` worth."""
    per_call = max(host_ms, gpu_floor_ms, 1e-4)
    return max(1, min(AS_CALLED_MAX_CALLS, math.ceil(AS_CALLED_SAMPLE_MS / per_call)))


_cycles_per_ms: dict[int, float] = {}  # device index -> torch.cuda._sleep cycles per ms


def gpu_sleep(ms: float, stream: torch.cuda.Stream | None = None) -> None:
    """Queue a GPU spin of about ``ms`` milliseconds (calibrated once per device: one sync)."""
    device = torch.cuda.current_device()
    rate = _cycles_per_ms.get(device)
    if rate is None:
        with torch.cuda.stream(stream or torch.cuda.current_stream()):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(1000)
            a.record()
            torch.cuda._sleep(1_000_000)
            b.record()
            b.synchronize()
        rate = _cycles_per_ms[device] = 1_000_000 / max(a.elapsed_time(b), 1e-3)
    with torch.cuda.stream(stream or torch.cuda.current_stream()):
        torch.cuda._sleep(max(1, int(ms * rate)))


def _host_ms_per_call(run: Callable[[int], None], sets: int, warmup: int) -> float | None:
    """Run the ``warmup`` calls; the host's ms per call: the median of the calls after the first
    (which may bind, load or allocate), None without warm-up calls."""
    times = []
    for i in range(warmup):
        began = time.perf_counter()
        run(i % sets)
        times.append(time.perf_counter() - began)
    if not times:
        return None
    return statistics.median(times[1:] or times) * 1e3


def _warm_up_each(runs: dict[Any, Callable[[int], None]], sets: int,
                  warmup: int) -> tuple[dict[Any, float], dict[Any, Exception]]:
    """Each call's ``warmup`` calls alone: (the host's ms per call of each that ran, the
    exception of each that raised)."""
    failures: dict[Any, Exception] = {}
    host_ms: dict[Any, float] = {}
    for key, run in runs.items():
        try:
            host_ms[key] = _host_ms_per_call(run, sets, warmup) or 0.0
        except Exception as exc:
            failures[key] = exc
    return host_ms, failures


def _summary(samples: list[float]) -> dict:
    return {"median_ms": statistics.median(samples), "min_ms": min(samples), "mean_ms": statistics.fmean(samples),
            "samples": len(samples)}


class QueuedTiming:
    """``repeat`` calls of ``run(i)`` (i = index of the input set, cycling over ``sets``) queued
    on ``stream`` after ``warmup`` untimed ones, each timed call between its own CUDA events,
    and not waited for: `result` waits for the last and summarises (median/min/mean in ms).

    Queueing without waiting lets the host do other work (load the next kernel, queue the next
    measurement) while the GPU runs these calls, so the GPU need not idle between measurements.

    ``gpu_floor_ms`` is a lower bound of one call's GPU time (0: unknown). When the host needs
    longer than that per call (measured over the warm-up calls), the GPU would catch up with
    the host and each sample would include the host's gap before its launch; the timed calls
    are then queued behind a GPU spin long enough for the host to queue them all (at most
    `MAX_HEAD_START_MS`), so the samples hold GPU time only.
    """

    __slots__ = ("starts", "ends", "head_start_ms")

    def __init__(self, run: Callable[[int], None], sets: int = 1, warmup: int = 5, repeat: int = 50,
                 stream: torch.cuda.Stream | None = None, gpu_floor_ms: float = 0.0) -> None:
        # The stream looked up once: Event.record() without one asks torch for it every time,
        # which is most of the host time between two short launches (tuning is host-bound there).
        stream = stream or torch.cuda.current_stream()
        host_ms = _host_ms_per_call(run, sets, warmup)
        self.head_start_ms = 0.0
        if host_ms is not None and host_ms + _EVENT_PAIR_MS > gpu_floor_ms:
            # Enough for the host to queue every timed call while the GPU runs them at its floor.
            self.head_start_ms = min(MAX_HEAD_START_MS, 1.25 * repeat * (host_ms + _EVENT_PAIR_MS - gpu_floor_ms) + 0.05)
            gpu_sleep(self.head_start_ms, stream)
        self.starts = [torch.cuda.Event(enable_timing=True) for _ in range(repeat)]
        self.ends = [torch.cuda.Event(enable_timing=True) for _ in range(repeat)]
        for i, (start, end) in enumerate(zip(self.starts, self.ends)):
            start.record(stream)
            run(i % sets)
            end.record(stream)

    def ready(self) -> bool:
        """Whether the GPU has run every timed call (never waits)."""
        return self.ends[-1].query()

    def samples(self) -> list[float]:
        """Each timed call's ms, once the GPU ran them (waits for the last, the GIL released)."""
        self.ends[-1].synchronize()
        return [s.elapsed_time(e) for s, e in zip(self.starts, self.ends)]

    def result(self) -> dict:
        """``{"median_ms", "min_ms", "mean_ms", "samples"}`` (waits for the last call)."""
        return _summary(self.samples())


#: Most untimed launches `time_interleaved` queues to settle the GPU's power state.
MAX_SETTLE_LAUNCHES = 2000


def time_interleaved(runs: dict[Any, Callable[[int], None]], sets: int = 1, warmup: int = 5, repeat: int = 50,
                     gpu_floor_ms: float = 0.0, max_queued: int = 96,
                     settle_ms: float = 0.0, timing: str = "device") -> dict[Any, dict | Exception]:
    """Time several calls against each other: after ``warmup`` calls of each alone, ``repeat``
    rounds in which every call of ``runs`` is launched once, each launch between its own CUDA
    events, in an order shuffled every round (seeded: the same keys and ``repeat`` give the same
    orders). Returns per key `QueuedTiming.result`'s summary, or the exception its call raised
    (it is left out of the later rounds).

    Shuffled, not in a fixed order: a call's time depends on the one launched before it (what
    that one left in L2, its power draw). In a fixed order every call always followed the same
    other one: identical kernels in two slots of one group measured up to 12 % apart, and
    PickBest put the ping-pong stream-K tile 2 % ahead at 4096x50257x4096 where alternating
    shuffled timings measured it 7-8 % behind (H200; docs/performance.md, "Measuring").

    Clock and power drift then hit all the calls alike (timed one after the other, each
    candidate meets the GPU in another state). The input set advances with every launch, not
    every round, so no launch reads what the one before it left in L2 (``sets`` as
    `rotation_count` gives). Rounds are queued in chunks of at most ``max_queued`` launches,
    a chunk only once the one before the last has run (a full launch queue would block the
    host inside a launch), each behind a GPU head start when the host is slower than the
    calls (``gpu_floor_ms``: a lower bound of one call's GPU time, as for `QueuedTiming`).

    ``settle_ms``: before the timed rounds, untimed shuffled rounds of the same calls for at least
    this much GPU time (by ``gpu_floor_ms``; at most `MAX_SETTLE_LAUNCHES` launches), so the
    samples come from the power state of back-to-back work rather than from a GPU that idled
    before: on an H200, tf32 4096^3 GEMMs ran at the top clock for the first ~40 ms of work and
    17-22 % slower after ~100 ms, and which of two kernels was faster flipped
    (docs/performance.md, "Power state"). The timed rounds keep their seeded orders.

    ``timing`` (`TIMINGS`): ``"device"`` as above; ``"as_called"``: a call's turn in a round is
    `calls_per_sample` back-to-back calls between one event pair (its sample: their time over
    the calls), queued behind no head start, so host time that outlasts the kernels counts. Each
    such turn starts once the GPU has run everything before it (the warm-ups, the settle rounds,
    the turn before): queued behind a backlog, a call's host time would be hidden.
    """
    as_called = check_timing(timing) == "as_called"
    stream = torch.cuda.current_stream()
    host_ms, failures = _warm_up_each(runs, sets, warmup)
    live = [key for key in runs if key not in failures]
    calls = {key: calls_per_sample(host_ms[key], gpu_floor_ms) if as_called else 1 for key in live}
    launches = 0
    if settle_ms > 0 and gpu_floor_ms > 0 and live:
        rounds = min(math.ceil(settle_ms / (gpu_floor_ms * len(live))), MAX_SETTLE_LAUNCHES // len(live))
        launches = _untimed_rounds(runs, live, failures, rounds, sets, random.Random(len(runs) * 7919 + repeat))
    order = random.Random(len(runs) * 1000003 + repeat)
    chunks: list[list[tuple[Any, Any, Any]]] = []
    waited = -1
    rounds_per_chunk = max(1, max_queued // max(1, sum(calls[k] for k in live)))
    last_end: Any = None
    done = 0
    while done < repeat and live:
        rounds = min(rounds_per_chunk, repeat - done)
        behind_ms = sum(host_ms[k] + _EVENT_PAIR_MS - gpu_floor_ms for k in live)
        if behind_ms > 0 and not as_called:
            gpu_sleep(min(MAX_HEAD_START_MS, 1.25 * rounds * behind_ms + 0.05), stream)
        chunk = []
        for _ in range(rounds):
            turn = list(live)
            order.shuffle(turn)
            for key in turn:
                if as_called:
                    wait_for_queue(stream, last_end)  # (see the docstring)
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record(stream)
                try:
                    for _ in range(calls[key]):
                        launches += 1
                        runs[key]((launches - 1) % sets)
                except Exception as exc:
                    failures[key] = exc
                    live.remove(key)
                    continue
                end.record(stream)
                chunk.append((key, start, end))
                last_end = end
        chunks.append(chunk)
        done += rounds
        if len(chunks) >= 2 and chunks[-2]:  # the chunk before this one has run: at most two queued
            chunks[-2][-1][2].synchronize()
            waited = len(chunks) - 2
    for i, chunk in enumerate(chunks):
        if i > waited and chunk:
            chunk[-1][2].synchronize()
    samples: dict[Any, list[float]] = {key: [] for key in runs}
    for chunk in chunks:
        for key, start, end in chunk:
            samples[key].append(start.elapsed_time(end) / calls[key])
    return {key: failures[key] if key in failures else _summary(samples[key]) for key in runs}


#: Timed passes `time_own_state` makes over the calls, each in a fresh shuffled order.
OWN_STATE_PASSES = 2


def time_own_state(runs: dict[Any, Callable[[int], None]], sets: int = 1, warmup: int = 5, repeat: int = 50,
                   gpu_floor_ms: float = 0.0, settle_ms: float = 200.0,
                   timing: str = "device") -> dict[Any, dict | Exception]:
    """Time several calls each in its own power state: in `OWN_STATE_PASSES` passes (the order of
    the calls shuffled in each, seeded), each call runs ``settle_ms`` of GPU time of its own
    back-to-back launches untimed (by ``gpu_floor_ms``; at most `MAX_SETTLE_LAUNCHES`), then its
    share of ``repeat`` launches, each between its own CUDA events. Returns what
    `time_interleaved` returns.

    Why: `time_interleaved` launches the calls in turn, so they all run at the one clock their mix
    sets, and a call's time is its cycles at that clock. Run on its own, a power-capped GPU
    clocks each kernel by its own draw: the time is its energy per call over the power limit,
    which is what replacing one kernel by another in a sustained workload changes. On an H200
    and an H100 at the 700 W cap the two rank differently (docs/performance.md, "Power state"):
    bf16 ping-pong tiles took 4-6 % fewer cycles than cuBLAS and ran 0.92-0.97x its speed on
    their own (0.78x on the H100) at 1320-1395 MHz against 1500, while the f64 128x128 tile
    took 2-3 % more cycles than DGEMM and ran 1.03-1.04x on its own at 1755-1815 MHz against
    1650-1695. Drift between the passes is not cancelled as interleaving cancels it; the
    median over both passes halves it. Where the host needs longer per launch than
    ``gpu_floor_ms``, each timed share is queued behind a GPU spin (as in `time_interleaved`), so
    the samples hold GPU time only; such calls cannot keep the GPU at its power cap anyway, and
    rank as they would interleaved.

    ``timing`` (`TIMINGS`): ``"device"`` as above; ``"as_called"``: each sample is
    `calls_per_sample` back-to-back calls between one event pair (their time over the calls),
    queued behind no head start and started once the GPU has run everything before it (the
    call's own settle launches, its sample before), so its host time counts as in
    `time_interleaved`: behind its own settle's backlog, a call whose host work is shorter than
    its kernel would time as its kernel alone.
    """
    as_called = check_timing(timing) == "as_called"
    stream = torch.cuda.current_stream()
    host_ms, failures = _warm_up_each(runs, sets, warmup)
    settle = (min(math.ceil(settle_ms / gpu_floor_ms), MAX_SETTLE_LAUNCHES)
              if settle_ms > 0 and gpu_floor_ms > 0 else 0)
    order = random.Random(len(runs) * 1000003 + repeat)
    samples: dict[Any, list[float]] = {key: [] for key in runs}
    launches = 0
    for p in range(OWN_STATE_PASSES):
        share = repeat // OWN_STATE_PASSES + (1 if p < repeat % OWN_STATE_PASSES else 0)
        turn = [key for key in runs if key not in failures]
        order.shuffle(turn)
        for key in turn:
            run = runs[key]
            calls = calls_per_sample(host_ms[key], gpu_floor_ms) if as_called else 1
            timed = []
            try:
                for _ in range(settle):
                    launches += 1
                    run((launches - 1) % sets)
                behind_ms = share * (host_ms[key] + _EVENT_PAIR_MS - gpu_floor_ms)
                if behind_ms > 0 and not as_called:  # (a host slower than the call: the settle left no queue)
                    gpu_sleep(min(MAX_HEAD_START_MS, 1.25 * behind_ms + 0.05), stream)
                for _ in range(share):
                    if as_called:
                        wait_for_queue(stream, timed[-1][1] if timed else None)
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record(stream)
                    for _ in range(calls):
                        launches += 1
                        run((launches - 1) % sets)
                    end.record(stream)
                    timed.append((start, end))
            except Exception as exc:
                failures[key] = exc
                continue
            if timed:
                timed[-1][1].synchronize()
                samples[key].extend(start.elapsed_time(end) / calls for start, end in timed)
    return {key: failures[key] if key in failures else _summary(samples[key]) for key in runs}


def _untimed_rounds(runs: dict[Any, Callable[[int], None]], live: list, failures: dict, rounds: int, sets: int,
                    shuffle: random.Random) -> int:
    """``rounds`` shuffled rounds of the ``live`` calls, untimed (launch i on input set i % sets);
    a call that raises moves from ``live`` to ``failures``. Returns the launches made."""
    launches = 0
    for _ in range(rounds):
        turn = list(live)
        shuffle.shuffle(turn)
        for key in turn:
            try:
                runs[key](launches % sets)
            except Exception as exc:
                failures[key] = exc
                live.remove(key)
            launches += 1
    return launches


def time_cuda(run: Callable[[int], None], sets: int = 1, warmup: int = 5, repeat: int = 50,
              min_total_ms: float = 0.0, gpu_floor_ms: float = 0.0) -> dict:
    """Time ``run(i)`` (i = index of the input set, cycling over ``sets``) with CUDA events and
    wait for the result: `QueuedTiming` (its head start included) then its `~QueuedTiming.result`.

    Each timed sample is one call bracketed by its own events; returns median/min/mean in ms
    and the samples. ``min_total_ms`` raises ``repeat`` for very short calls.
    """
    timing = QueuedTiming(run, sets, warmup=warmup, repeat=repeat, gpu_floor_ms=gpu_floor_ms)
    samples = timing.samples()
    if min_total_ms and sum(samples) < min_total_ms and repeat < 10000:
        more = int(repeat * min_total_ms / max(sum(samples), 1e-3))
        return time_cuda(run, sets, warmup=1, repeat=min(10000, max(repeat, more)), gpu_floor_ms=gpu_floor_ms)
    return _summary(samples)


def time_cuda_pair(first: Callable[[int], None], second: Callable[[int], None], sets: int = 1, warmup: int = 5,
                   repeat: int = 50) -> tuple[float, float]:
    """Median ms of ``first(i)`` and ``second(i)`` launched alternately (first, second, first...),
    each call between its own events.

    Clock and power drift during the run then hit both alike, which makes the ratio of the two
    medians far more stable than timing one after the other (on a power-capped GPU the clock
    moves by more than the few percent two good GEMMs differ by). The timed calls are queued
    behind a GPU spin sized from the warm-up's host time, so calls shorter than their launch
    overhead are timed without the host's gaps.
    """
    stream = torch.cuda.current_stream()

    def both(i: int) -> None:
        first(i)
        second(i)

    host_ms = _host_ms_per_call(both, sets, warmup)
    if host_ms is not None:  # a head start for the GPU, as QueuedTiming gives: no host gaps in the samples
        gpu_sleep(min(MAX_HEAD_START_MS, 1.25 * repeat * (host_ms + 1.5 * _EVENT_PAIR_MS) + 0.05), stream)
    events = [[torch.cuda.Event(enable_timing=True) for _ in range(3)] for _ in range(repeat)]
    for i, (e0, e1, e2) in enumerate(events):
        e0.record(stream)
        first(i % sets)
        e1.record(stream)
        second(i % sets)
        e2.record(stream)
    torch.cuda.synchronize()
    return (statistics.median(a.elapsed_time(b) for a, b, _ in events),
            statistics.median(b.elapsed_time(c) for _, b, c in events))


def finite_norm(t: torch.Tensor) -> torch.Tensor:
    """||t|| over its finite elements, in float64 (a log-sum-exp's -inf rows left out)."""
    t = t.double()
    return torch.linalg.vector_norm(torch.where(torch.isfinite(t), t, 0.0))


def relative_error_tensor(out: torch.Tensor, ref: torch.Tensor, ref_norm: torch.Tensor | None = None) -> torch.Tensor:
    """||out - ref|| / ||ref|| in float64 as a 0-d tensor on ``out``'s device (inf if ``out`` has
    a NaN or inf where ``ref`` has not the same infinity: the -inf log-sum-exp of a row that sees
    no key matches), computed without waiting for the GPU. ``ref_norm``: `finite_norm` of ref,
    when known."""
    o, r = out.double(), ref.double()
    if ref_norm is None:
        ref_norm = finite_norm(r)
    same = o == r  # (equal infinities too, whose difference is NaN)
    num = torch.linalg.vector_norm(torch.where(same, 0.0, o - r))
    err = torch.where(ref_norm > 0, num / ref_norm, num)
    return torch.where((torch.isfinite(o) | same).all(), err, float("inf"))


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64; inf if out has NaN/inf where ref does not."""
    return float(relative_error_tensor(out, ref))


def tensors_bytes(tensors: Sequence[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)
