"""Measuring GPU work the way our numbers are quoted: CUDA events, median of many runs,
rotating input sets so repeated runs do not measure the L2 cache."""

from __future__ import annotations

import statistics
from typing import Callable, Sequence

import torch

L2_FLUSH_BYTES = 64 << 20  # larger than the L2 of an H100 (50 MB) / H200 (60 MB)


def rotation_count(bytes_per_set: int, min_bytes: int = 2 * L2_FLUSH_BYTES, cap: int = 16) -> int:
    """How many input sets to rotate through so the sets together exceed the L2 twice."""
    if bytes_per_set <= 0:
        return 1
    return max(1, min(cap, -(-min_bytes // bytes_per_set)))


def time_cuda(run: Callable[[int], None], sets: int = 1, warmup: int = 5, repeat: int = 50,
              min_total_ms: float = 0.0, while_waiting: Callable[[], None] | None = None) -> dict:
    """Time ``run(i)`` (i = index of the input set, cycling over ``sets``) with CUDA events.

    Each timed sample is one call bracketed by its own events; returns median/min/mean in ms
    and the samples. ``min_total_ms`` raises ``repeat`` for very short calls.
    ``while_waiting`` is called once after the timed calls are queued and before waiting for
    them: host work that overlaps the GPU's (the samples are event times, which host work done
    meanwhile does not change).
    """
    for i in range(warmup):
        run(i % sets)
    torch.cuda.synchronize()
    # The stream looked up once: Event.record() without one asks torch for it every time,
    # which is most of the host time between two short launches (tuning is host-bound there).
    stream = torch.cuda.current_stream()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(repeat)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(repeat)]
    for i in range(repeat):
        starts[i].record(stream)
        run(i % sets)
        ends[i].record(stream)
    if while_waiting is not None:
        while_waiting()
    torch.cuda.synchronize()
    samples = [s.elapsed_time(e) for s, e in zip(starts, ends)]
    if min_total_ms and sum(samples) < min_total_ms and repeat < 10000:
        more = int(repeat * min_total_ms / max(sum(samples), 1e-3))
        return time_cuda(run, sets, warmup=0, repeat=min(10000, max(repeat, more)))
    return {"median_ms": statistics.median(samples), "min_ms": min(samples),
            "mean_ms": statistics.fmean(samples), "samples": len(samples)}


def time_cuda_pair(first: Callable[[int], None], second: Callable[[int], None], sets: int = 1, warmup: int = 5,
                   repeat: int = 50) -> tuple[float, float]:
    """Median ms of ``first(i)`` and ``second(i)`` launched alternately (first, second, first...),
    each call between its own events.

    Clock and power drift during the run then hit both alike, which makes the ratio of the two
    medians far more stable than timing one after the other (on a power-capped GPU the clock
    moves by more than the few percent two good GEMMs differ by).
    """
    for i in range(warmup):
        first(i % sets)
        second(i % sets)
    torch.cuda.synchronize()
    stream = torch.cuda.current_stream()
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


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64; inf if out has NaN/inf where ref does not."""
    o, r = out.double(), ref.double()
    if not torch.isfinite(o).all():
        return float("inf")
    denom = torch.linalg.vector_norm(r).item()
    num = torch.linalg.vector_norm(o - r).item()
    return num / denom if denom else num


def tensors_bytes(tensors: Sequence[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)
