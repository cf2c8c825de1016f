"""Tuning many problems on every GPU of a host: `tune_shapes` (``kernel-api tune --shapes``).

The problems are split into one shard per GPU, balanced by their estimated tuning time
(`tuning_cost`, `shard_by_cost`: longest first onto the least loaded GPU), and each shard is
tuned by `PickBest` on its GPU:

- ``isolation="threads"`` (the default): one thread of the calling process per GPU. A GPU's
  measurements wait on that GPU with the GIL released, so the GPUs measure at the same time,
  and nothing is started: a worker process pays the interpreter's, torch's, the DSL's and a
  CUDA context's start-up (5 to 10 s on the H200 and H100 hosts measured, two to four times
  tuning 16 GEMMs on one GPU: docs/performance.md, "Tuning at scale"). Host work (loading artifacts, launching) still takes turns on
  the GIL. CuTe DSL compiles and loads take turns on a lock of their own (the DSL's compiler
  state is process-wide).
- ``isolation="processes"``: one worker process per GPU, ``python -m
  kernel_api.tuning.tune_worker`` with ``CUDA_VISIBLE_DEVICES`` set to its one GPU (like the
  compile workers, it never re-imports the caller's ``__main__``). The host work runs in
  parallel too, which pays off when tuning is long enough to hide the start-up, or when a
  crash in a kernel should take down only its worker.

With one GPU the shard is tuned in the calling thread.

A shard first compiles all its candidates in one pool of compile workers (shared by its
problems, filling the disk caches), then measures its problems one after another. The workers
read the tuning records (a problem already recorded is not measured again, unless ``force``)
but write none: they send their winners to the parent, which merges them into the records in
one transaction (`TuningRecords.merge`), so no two processes write the SQLite file at once.

Across hosts, `kernel_api.tuning.distributed` (``torchrun -m kernel_api.tune``) tunes the
shards on the ranks and all-gathers the records.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import sys
import tempfile
import threading
from typing import Any, Callable, Sequence

import torch

from .. import registry
from ..arguments import GemmArguments
from ..core.errors import DeviceError
from .buckets import Bucket, bucket_reference
from .compile_worker import (DEFAULT_COMPILE_TIMEOUT_S, arguments_from_description, compile_request,
                             compile_requests, describe_arguments, uncached, worker_environment)
from .policies import DEFAULT_POWER_STATE, PickBest, check_power_state, rank_candidates
from .records import TuningRecord, TuningRecords

_log = logging.getLogger(__name__)

#: Seconds of host work per candidate whatever the problem's size (loading the artifact, the
#: verification, queueing the launches): 1.6 ms measured on an H100 (0.21 s for 16 shapes x 8
#: candidates, `benchmarks/tune_scale.py --breakdown`); the GPU's time, which this
#: host work overlaps, is what the shards are balanced by.
_FIXED_S = 0.002
#: Untimed runs per candidate besides the timed ones: the check and the warm-up.
_UNTIMED_RUNS = 6
#: Throughputs for the estimate: about what the best bf16 kernels reach on an H100/H200.
_FLOPS_PER_S = 6e14
_BYTES_PER_S = 3e12


@dataclasses.dataclass(frozen=True)
class ShapeTuning:
    """What `tune_shapes` did for problem ``index``: on which device (its index among the
    visible ones; under torch.distributed the local device of ``rank``), the winner and its
    median time, whether a tuning record gave it, the record (None when it failed), or
    ``failure``'s message."""

    index: int
    device: int
    kernel_name: str | None = None
    median_ms: float | None = None
    from_record: bool = False
    record: TuningRecord | None = None
    failure: str | None = None
    rank: int = 0

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> "ShapeTuning":
        record = data.get("record")
        return cls(**{**data, "record": None if record is None else TuningRecord(**record)})


@dataclasses.dataclass(frozen=True)
class TuneOptions:
    """How each shard is tuned: `PickBest`'s options, plus ``num_workers`` compile processes per
    shard and ``force`` (measure problems that already have a record)."""

    max_candidates: int | None = 24
    repeat: int = 30
    num_workers: int = 1
    force: bool = False
    bucket: Any = None  # a name or "module:function" (what a worker process can resolve), or a function
    compile_timeout: float | None = DEFAULT_COMPILE_TIMEOUT_S
    power_state: str = DEFAULT_POWER_STATE  # PickBest's: the candidates timed at one clock, or each at its own


def tuning_cost(args: Any, repeat: int = 30) -> float:
    """Estimated seconds one candidate of ``args`` takes to tune: a fixed part plus ``repeat``
    timed and the untimed runs at a typical throughput (FLOPs for a GEMM, bytes moved otherwise). Only its ratios
    matter: `shard_by_cost` balances with it."""
    if isinstance(args, GemmArguments):
        seconds = 2.0 * args.M * args.N * args.K * args.L / _FLOPS_PER_S
    else:
        seconds = sum(t.numel() * t.element_size() for t in args.tensors().values()) / _BYTES_PER_S
    return _FIXED_S + (repeat + _UNTIMED_RUNS) * seconds


def shard_by_cost(costs: Sequence[float], count: int) -> list[list[int]]:
    """Split the indices of ``costs`` into ``count`` shards of about equal total cost: the
    costliest first, each onto the shard with the least total so far (ties: the lower index,
    the lower shard). Deterministic; every index lands in exactly one shard, in the order it
    was placed (costliest first).

    Raises:
        ValueError: ``count`` below 1, or a negative or non-finite cost.
    """
    if count < 1:
        raise ValueError(f"count must be >= 1, got {count}")
    for i, c in enumerate(costs):
        if not (c >= 0 and c != float("inf")):
            raise ValueError(f"costs[{i}] must be a finite cost >= 0, got {c!r}")
    shards: list[list[int]] = [[] for _ in range(count)]
    loads = [0.0] * count
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        target = min(range(count), key=lambda s: (loads[s], s))
        shards[target].append(i)
        loads[target] += costs[i]
    return shards


def describe_shapes(shapes: Sequence[Any]) -> list[tuple[str, dict]]:
    """``(kind, description)`` of each problem, as a worker rebuilds it (`describe_arguments`).

    Raises:
        ValueError: naming the first problem a worker cannot rebuild.
    """
    found = []
    for i, args in enumerate(shapes):
        described = describe_arguments(args)
        if described is None:
            raise ValueError(f"shapes[{i}]: {type(args).__name__} cannot be tuned by tune_shapes (a GEMM with an "
                             f"epilogue, or an arguments type a worker cannot rebuild); tune it with PickBest().tune")
        found.append(described)
    return found


def tune_shard(entries: Sequence[tuple[int, str, dict]], device: int, options: TuneOptions,
               records: TuningRecords, done: Callable[[ShapeTuning], None] | None = None) -> list[ShapeTuning]:
    """Tune described problems ``(index, kind, description)`` on CUDA device ``device`` of this
    process: compile every problem's candidates in one pool of ``options.num_workers`` compile
    workers, then measure each problem with `PickBest` (the records' winner when there is one,
    unless ``options.force``). ``records`` is read (pass a read-only store to keep the new
    winners in the results only). ``done`` is called with each problem's result as it ends.
    A problem that fails (no kernel, every candidate failed) is a result with ``failure``."""
    picker = PickBest(num_workers=1, max_candidates=options.max_candidates, repeat=options.repeat,
                      records=records, bucket=options.bucket, compile_timeout=options.compile_timeout,
                      power_state=options.power_state)
    target = f"cuda:{device}"
    problems: list[tuple[int, Any, list]] = []
    results: dict[int, ShapeTuning] = {}

    def finish(result: ShapeTuning) -> None:
        results[result.index] = result
        if done is not None:
            done(result)

    with torch.cuda.device(device):
        cc_major, cc_minor = torch.cuda.get_device_capability(device)
        cc = cc_major * 10 + cc_minor
        requests = []
        for index, kind, description in entries:
            try:
                args = arguments_from_description(kind, description, device=target)
                candidates = registry.get_kernels(args)
                if not candidates:
                    raise registry.no_kernel_error(args)
                found = None if options.force else picker.recorded(args, candidates)
            except Exception as exc:
                finish(ShapeTuning(index, device, failure=_message(exc)))
                continue
            if found is not None:
                finish(_result(index, device, found))
                continue
            problems.append((index, args, candidates))
            if options.num_workers > 1:
                ranked = uncached(rank_candidates(candidates, args)[: options.max_candidates], args, cc)
                requests += [r for r in (compile_request(k, cc, kind, description) for k in ranked) if r is not None]
        if requests:  # the whole shard's compiles in one pool; the measurements load them from the disk cache
            compile_requests(requests, options.num_workers, timeout=options.compile_timeout)
        for index, args, candidates in problems:
            try:
                finish(_result(index, device, picker.tune(args, candidates, force=options.force)))
            except Exception as exc:
                finish(ShapeTuning(index, device, failure=_message(exc)))
    return [results[index] for index, _, _ in entries]


def _message(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


def _result(index: int, device: int, found: Any) -> ShapeTuning:
    best = found.measurements[0] if found.from_record else min(
        (m for m in found.measurements if m.median_ms is not None), key=lambda m: m.median_ms)
    return ShapeTuning(index, device, found.winner.metadata.kernel_name, best.median_ms, found.from_record,
                       found.record)


def _visible_devices(devices: Sequence[int] | None) -> list[int]:
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        raise DeviceError("tune_shapes needs a CUDA GPU (none is visible); `kernel-api precompile` compiles "
                          "without one")
    if devices is None:
        return list(range(count))
    chosen = list(devices)
    if not chosen:
        raise ValueError("devices: expected at least one CUDA device index")
    for d in chosen:
        if type(d) is not int or not 0 <= d < count:
            raise ValueError(f"devices: {d!r} is not a visible CUDA device index (0..{count - 1})")
    if len(set(chosen)) != len(chosen):
        raise ValueError(f"devices: {chosen} names a device twice")
    return chosen


def _worker_device_variable(device: int) -> str:
    """``CUDA_VISIBLE_DEVICES`` for a worker that is to see this process's device ``device`` alone."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None or not visible.strip():
        return str(device)
    return [v.strip() for v in visible.split(",")][device]


def default_workers(gpus: int) -> int:
    """Compile processes per GPU worker: the CPUs shared among the GPUs, at most 8."""
    return max(1, min(8, (os.cpu_count() or 1) // max(1, gpus)))


#: How `tune_shapes` runs the shards of several GPUs.
ISOLATIONS = ("threads", "processes")


def tune_shapes(shapes: Sequence[Any], devices: Sequence[int] | None = None, *, max_candidates: int | None = 24,
                repeat: int = 30, num_workers: int | None = None, force: bool = False,
                bucket: str | Bucket | None = None, compile_timeout: float | None = DEFAULT_COMPILE_TIMEOUT_S,
                records: TuningRecords | None = None,
                progress: Callable[[int, int, str], None] | None = None,
                isolation: str = "threads", power_state: str = DEFAULT_POWER_STATE) -> list[ShapeTuning]:
    """Tune every problem of ``shapes`` with `PickBest`, sharded over the GPUs ``devices``, and
    write the winners to the tuning records.

    Args:
        shapes: arguments objects, one per problem (GEMM without epilogue, softmax forward or
            backward); only their signature counts (shapes, strides, dtypes, alignment), so
            tensors on the ``meta`` device do (``kernel_api.cli.precompile.load_shapes`` and
            ``entry_arguments`` read a shapes file into them).
        devices: CUDA device indices (default: every visible GPU), each tuning one shard (see
            ``isolation``); with one device the shard is tuned in the calling thread.
        max_candidates, repeat, compile_timeout, bucket, power_state: as for `PickBest` (a bucket function
            must be importable by other processes: a module-level function or
            ``"module:function"``).
        num_workers: compile processes per device (default: the CPUs shared among the
            devices, at most 8).
        force: measure problems that already have a tuning record.
        records: the store to read and merge the winners into (default: the cache folder's).
        progress: called as ``progress(done, total, label)`` after each problem (from the
            thread or the reader of the shard that finished it, one call at a time).
        isolation: with several devices, ``"threads"`` (one thread per device in this
            process: no start-up; the kernels are this process's, classes registered at run
            time included) or ``"processes"`` (one worker process per device: the host work in
            parallel too, but each worker's start-up costs seconds, and a worker sees only the
            kernels that register on import: the shipped providers and the plugins' entry
            points). See the module docstring.

    Returns:
        One `ShapeTuning` per problem, in ``shapes``' order; a failed problem (no kernel, every
        candidate failed, a crashed worker) has its ``failure`` and no record.

    Raises:
        DeviceError: no CUDA GPU is visible.
        ValueError: a bad ``devices`` or option, or a problem that cannot be sent to a worker.
    """
    if isolation not in ISOLATIONS:
        raise ValueError(f"isolation must be one of {ISOLATIONS}, got {isolation!r}")
    chosen = _visible_devices(devices)
    if max_candidates is not None and max_candidates < 1:
        raise ValueError(f"max_candidates must be >= 1 or None, got {max_candidates}")
    if repeat < 1:
        raise ValueError(f"repeat must be >= 1, got {repeat}")
    if num_workers is not None and num_workers < 1:
        raise ValueError(f"num_workers must be >= 1, got {num_workers}")
    check_power_state(power_state)
    described = describe_shapes(shapes)
    # A worker process resolves the bucket by name; this process can use any function.
    in_process = len(chosen) == 1 or isolation == "threads"
    options = TuneOptions(max_candidates, repeat, num_workers or default_workers(len(chosen)), force,
                          bucket if in_process else bucket_reference(bucket), compile_timeout, power_state)
    store = records if records is not None else TuningRecords()
    shards = shard_by_cost([tuning_cost(a, repeat) for a in shapes], len(chosen))
    total = len(shapes)
    lock = threading.Lock()
    finished: dict[int, ShapeTuning] = {}

    def done(result: ShapeTuning) -> None:
        with lock:
            finished[result.index] = result
            if progress is not None:
                what = result.kernel_name if result.failure is None else f"failed: {result.failure}"
                progress(len(finished), total, f"#{result.index} GPU {result.device}: {what}")

    reader = TuningRecords(store.path, toolchain_key=store.toolchain_key, read_only=True)
    if len(chosen) == 1:
        tune_shard([(i, *described[i]) for i in shards[0]], chosen[0], options, reader, done)
    elif isolation == "threads":
        _tune_in_threads([(device, [(i, *described[i]) for i in shard]) for device, shard in zip(chosen, shards)
                          if shard], options, reader, done)
    else:
        workers = [_TuneWorker(device, [(i, *described[i]) for i in shard], options, store, done)
                   for device, shard in zip(chosen, shards) if shard]
        try:
            for w in workers:
                w.start()
            for w in workers:
                w.join()
        finally:
            for w in workers:
                w.stop()
    results = [finished[i] for i in range(total)]
    tuned = [r.record for r in results if r.record is not None and not r.from_record]
    if tuned:
        store.merge(tuned)
    return results


#: The interpreter's thread switch interval while tuning threads run (None: left as it is). A
#: thread whose GPU finished waits for the GIL until the holder blocks or this interval ends,
#: its GPU idle meanwhile. 0.5 ms gained 1.61x -> 1.68x without PickBest's loading ahead and
#: nothing with it (2 H100s), so it stays off; tune_scale.py's
#: ``--multi threads-si`` sets it for that comparison.
_THREAD_SWITCH_INTERVAL_S: float | None = None


class _Stopped(Exception):
    """Raised in a tuning thread's progress report once another thread failed: it stops there."""


def _tune_in_threads(jobs: list[tuple[int, list[tuple[int, str, dict]]]], options: TuneOptions,
                     records: TuningRecords, done: Callable[[ShapeTuning], None]) -> None:
    """`tune_shard` of each ``(device, entries)`` job in a thread of its own. The first exception
    of a thread (a failing ``done``, an interrupt) stops the others at their next problem and
    is raised here once all have stopped."""
    stop = threading.Event()
    failures: list[BaseException] = []

    def report(result: ShapeTuning) -> None:
        if stop.is_set():
            raise _Stopped()
        done(result)

    def work(device: int, entries: list[tuple[int, str, dict]]) -> None:
        try:
            tune_shard(entries, device, options, records, report)
        except _Stopped:
            pass
        except BaseException as exc:  # handed to the caller's thread
            failures.append(exc)
            stop.set()

    threads = [threading.Thread(target=work, args=job, daemon=True, name=f"kernel_api-tune-gpu{job[0]}")
               for job in jobs]
    interval = sys.getswitchinterval()
    if _THREAD_SWITCH_INTERVAL_S is not None:
        sys.setswitchinterval(_THREAD_SWITCH_INTERVAL_S)
    for t in threads:
        t.start()
    try:
        for t in threads:
            while t.is_alive():
                t.join(timeout=0.2)  # (a bare join would hold off KeyboardInterrupt until it returns)
    except BaseException:
        stop.set()
        raise
    finally:
        sys.setswitchinterval(interval)
    if failures:
        raise failures[0]


class _TuneWorker:
    """One ``python -m kernel_api.tuning.tune_worker`` process for one GPU, driven by a thread:
    it gets its job as one JSON line on stdin and answers one JSON line per problem (see
    `kernel_api.tuning.tune_worker`). A worker that dies fails its problems not yet answered,
    with the tail of its stderr."""

    def __init__(self, device: int, entries: list[tuple[int, str, dict]], options: TuneOptions,
                 store: TuningRecords, done: Callable[[ShapeTuning], None]) -> None:
        self.device, self.entries, self.done = device, entries, done
        self.job = {"entries": entries, "options": dataclasses.asdict(options), "records": str(store.path),
                    "toolchain_key": store.toolchain_key}
        self.answered: set[int] = set()
        self.process: subprocess.Popen | None = None
        self.stderr = tempfile.TemporaryFile()
        self.thread = threading.Thread(target=self._drive, daemon=True, name=f"kernel_api-tune-gpu{device}")
        self.error: BaseException | None = None

    def start(self) -> None:
        env = worker_environment()
        env["CUDA_VISIBLE_DEVICES"] = _worker_device_variable(self.device)
        flags = ["-P"] if sys.version_info >= (3, 11) else []
        self.process = subprocess.Popen([sys.executable, *flags, "-m", "kernel_api.tuning.tune_worker"],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr,
                                        env=env, close_fds=True)
        self.thread.start()

    def _drive(self) -> None:
        assert self.process is not None
        try:
            self.process.stdin.write((json.dumps(self.job) + "\n").encode())
            self.process.stdin.close()
            for line in self.process.stdout:
                result = ShapeTuning.from_json(json.loads(line))
                self.answered.add(result.index)
                self.done(dataclasses.replace(result, device=self.device))
        except (OSError, ValueError, TypeError) as exc:
            _log.info("tune worker for GPU %d: %s", self.device, exc)
        except BaseException as exc:  # a failing progress callback: re-raised by the caller
            self.error = exc
            self.process.kill()
        finally:
            code = self.process.wait()
            missing = [i for i, _, _ in self.entries if i not in self.answered]
            if missing and self.error is None:
                self.stderr.seek(0)
                tail = self.stderr.read().decode(errors="replace").strip()[-800:]
                # The last line (an exception's message) first: one-line reports show it.
                why = f"the tuning worker for GPU {self.device} exited ({code}) before it finished" + \
                      (f": {tail.splitlines()[-1]}\n{tail}" if tail else "")
                for i in missing:
                    self.done(ShapeTuning(i, self.device, failure=why))

    def join(self) -> None:
        self.thread.join()
        if self.error is not None:
            raise self.error

    def stop(self) -> None:
        """Kill the worker if it still runs (an interrupted tuning) and release its files."""
        if self.process is not None and self.process.poll() is None:
            try:
                self.process.kill()
            except OSError:
                pass
        if self.thread.ident is not None:  # started
            self.thread.join(timeout=10)
        self.stderr.close()
