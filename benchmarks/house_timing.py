"""The benchmarks' house timing: contestants launched in a shuffled order in one process, each
launch between its own CUDA events, behind a sleep kernel so that the host queues ahead of the
GPU (`time_group`), or each in its own power state (`time_own_state`); medians in ms."""

from __future__ import annotations

import math
import random
import statistics
import time

import torch

_cycles_per_ms: list[float] = []


def sleep_ms(ms: float) -> None:
    """Queue a GPU busy-wait of about ``ms`` milliseconds on the current stream."""
    if not _cycles_per_ms:
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(1000)
        a.record()
        torch.cuda._sleep(2_000_000)
        b.record()
        torch.cuda.synchronize()
        _cycles_per_ms.append(2_000_000 / max(a.elapsed_time(b), 1e-3))
    torch.cuda._sleep(int(ms * _cycles_per_ms[0]))


def time_group(fns: dict, repeat: int, sustained_ms: float = 0.0) -> tuple[dict[str, float], bool]:
    """Median ms of each ``fns[name](launch_index)``, launched alternately (order shuffled each
    repetition, seeded) behind a sleep kernel, every launch between its own events. Also returns
    whether the host may still have fallen behind the GPU (then launch gaps are in the times).

    ``sustained_ms``: instead of the sleep kernel (an idle GPU, whose power state lets the first
    ~50 ms of work run at the top clock), untimed shuffled rounds of the same launches, at least
    this many ms of GPU work, so the timed rounds run in the power state of back-to-back work
    (on an H200, tf32 4096^3 GEMMs run 17 % slower after ~100 ms of it: docs/performance.md,
    "Power state").

    The order is shuffled, not rotated: rotated, each contestant always follows the same one,
    and what ran before shows in the time (on an H200 the same kernel in two slots of one
    rotated group measured 33.5 and 36.4 us)."""
    names = list(fns)
    rng = random.Random(len(names) * 1000003 + repeat)
    counter = 0
    start = time.perf_counter()
    for _ in range(2):
        for name in names:
            fns[name](counter)
            counter += 1
    torch.cuda.synchronize()
    per_launch_ms = (time.perf_counter() - start) * 1e3 / (2 * len(names))  # host + GPU: an upper bound
    budget = min(200.0, 1.5 * per_launch_ms * repeat * len(names) + 2.0)
    behind = True
    for _attempt in range(3):
        events = [[torch.cuda.Event(enable_timing=True) for _ in range(len(names) + 1)] for _ in range(repeat)]
        if sustained_ms > 0:
            # per_launch_ms (host + GPU) bounds a launch's GPU time from above: queue rounds for at
            # least the head start and the sustained span at half that rate
            rounds = max(1, math.ceil(2 * max(budget, sustained_ms) / (per_launch_ms * len(names))))
            for _ in range(rounds):
                order = names[:]
                rng.shuffle(order)
                for name in order:
                    fns[name](counter)
                    counter += 1
            head_done = torch.cuda.Event()
            head_done.record()
        else:
            sleep_ms(budget)
        start = time.perf_counter()
        orders = []
        for r in range(repeat):
            order = names[:]
            rng.shuffle(order)
            orders.append(order)
            ev = events[r]
            ev[0].record()
            for j, name in enumerate(order):
                fns[name](counter)
                counter += 1
                ev[j + 1].record()
        host_ms = (time.perf_counter() - start) * 1e3
        # sustained: gaps were possible only if the GPU ran out of untimed rounds before the last
        # timed launch was queued
        behind = head_done.query() if sustained_ms > 0 else host_ms > 0.9 * budget
        torch.cuda.synchronize()
        if not behind or budget >= 200.0:
            break
        budget = min(200.0, 2 * host_ms + 2.0)  # the host fell behind the queue: sleep longer, redo
    samples: dict[str, list[float]] = {n: [] for n in names}
    for r, order in enumerate(orders):
        for j, name in enumerate(order):
            samples[name].append(events[r][j].elapsed_time(events[r][j + 1]))
    return {n: statistics.median(v) for n, v in samples.items()}, behind


def time_own_state(fns: dict, repeat: int, settle_ms: float, seed: int = 0) -> dict[str, float]:
    """Median ms of each ``fns[name](launch_index)``, each contestant timed in its own power state.

    `time_group` times the contestants' launches interleaved, so all of them run at the clock their
    mix sets. Under the power cap a kernel that draws less runs at a higher clock when it runs on
    its own (f64 at 8192^3 on an H200: our 128x128 tile at 1725 MHz, cuBLAS DGEMM at 1635, both
    at the cap; docs/performance.md, "f64 and f32 GEMM"). Here, in a shuffled order, each contestant first runs ``settle_ms``
    of GPU time of its own back-to-back launches untimed, then ``repeat`` more, each between its
    own CUDA events. Meant for problems of 0.1 ms and more: shorter launches leave the GPU waiting
    on the host, whose gaps let the clock rise."""
    names = list(fns)
    random.Random(seed * 1000003 + len(names)).shuffle(names)
    counter = 0
    out = {}
    for name in names:
        fn = fns[name]
        probe = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
        fn(counter)
        counter += 1
        probe[0].record()
        fn(counter)
        counter += 1
        probe[1].record()
        probe[1].synchronize()
        launches = max(1, min(100000, math.ceil(settle_ms / max(probe[0].elapsed_time(probe[1]), 1e-3))))
        for _ in range(launches):
            fn(counter)
            counter += 1
        events = [torch.cuda.Event(enable_timing=True) for _ in range(repeat + 1)]
        events[0].record()
        for r in range(repeat):
            fn(counter)
            counter += 1
            events[r + 1].record()
        events[-1].synchronize()
        out[name] = statistics.median(events[r].elapsed_time(events[r + 1]) for r in range(repeat))
    return out


def geomean(xs: list[float]) -> float:
    xs = [x for x in xs if x and x > 0]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")
