"""Tuning 16 bf16 GEMM shapes on one GPU and on every visible GPU (`kernel_api.tune_shapes`).

    python benchmarks/tune_scale.py                      # 16 shapes, 8 candidates each, 3 rounds
    python benchmarks/tune_scale.py --max-candidates 4 --repeat 20 --rounds 1
    torchrun --standalone --nproc-per-node 2 -m kernel_api.tune \
        --shapes benchmarks/tune_scale_shapes.json --max-candidates 8     # the same shapes, one rank per GPU

The shapes are benchmarks/tune_scale_shapes.json (a ``kernel-api tune --shapes`` file): prefill-
and training-sized projections of a few model widths, and square problems.

1. Compiles each shape's candidates (the best-ranked ``--max-candidates``, PickBest's order) for
   this GPU's cc into the compile cache (`precompile`, timed and reported), so that every tuning
   run finds the same warm disk cache and the wall times compare tuning, not compiling.
2. Pays this process's one-time costs before any timed run (the CuTe DSL's import, a CUDA
   context and cuBLAS handle on every GPU), so that they count against no configuration.
3. ``--rounds`` rounds, each timing every configuration once, in an order rotated per round:
   GPU 0 alone (in this process); every GPU with a thread per GPU (``isolation="threads"``, the
   default); every GPU with a worker process per GPU (``"processes"``, whose start-up is part
   of its time). Before each run the in-memory kernel instances and compiled artifacts are
   dropped, so each run loads its artifacts from the disk cache as a new tuning would, and each
   run writes fresh tuning records.

Prints each configuration's median wall time (and its spread over the rounds), the speedups,
and per shape whether each multi-GPU winner is the single-GPU winner or within 3 % of its time;
the comparison uses the first single-GPU run's own timings of both kernels (every verified
candidate's median is in its record), so both times come from the same GPU. Where the winners differ,
the two kernels are also re-timed head to head on GPU 0 (`arbitrate`: interleaved launches, 3 x
``--arbiter-repeat`` of each) and that ratio is printed in parentheses: the tuning's own samples
are 30 launches per candidate taken seconds apart, noisier than the 3 % the criterion asks. ``--profile`` also
writes a cProfile summary of one extra single-GPU run. JSON to
benchmarks/results/tune_scale-<device>-<n>gpu.json (and $OUT/).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import tempfile
import threading
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from kernel_api import registry  # noqa: E402
from kernel_api.arguments.base import unbound_copy  # noqa: E402
from kernel_api.cli.precompile import entry_arguments, load_shapes  # noqa: E402
from kernel_api.nvrtc import clear_memory_cache  # noqa: E402
from kernel_api.tuning.precompile import precompile  # noqa: E402
from kernel_api.tuning.records import TuningRecords  # noqa: E402
from kernel_api.tuning import policies, scale  # noqa: E402
from kernel_api.tuning.compile_worker import arguments_from_description, describe_arguments  # noqa: E402
from kernel_api.tuning.reference import random_like  # noqa: E402
from kernel_api.tuning.scale import tune_shapes  # noqa: E402
from kernel_api.tuning.timing import rotation_count, time_interleaved  # noqa: E402

SHAPES_FILE = os.path.join(ROOT, "benchmarks", "tune_scale_shapes.json")
WITHIN = 0.03


def warm_up(gpus: int) -> None:
    """This process's one-time costs, paid before any timed run: the CuTe DSL's import, and a
    CUDA context, cuBLAS handle and caching-allocator pool on every GPU."""
    import cutlass.cute  # noqa: F401

    for d in range(gpus):
        with torch.cuda.device(d):
            x = torch.randn(256, 256, device=f"cuda:{d}", dtype=torch.bfloat16)
            (x @ x).sum().item()
            torch.matmul(x.double(), x.double()).sum().item()


def forget_loaded_kernels() -> None:
    """Drop the kernel instances (with the artifacts they loaded) and NVRTC's in-memory compiles,
    so a run loads from the disk cache as a new tuning would."""
    registry.clear_caches()
    clear_memory_cache()


def profile_single_gpu(problems: list, args: argparse.Namespace, scratch: str) -> None:
    """cProfile of one more single-GPU tuning: the top functions by cumulative and own time."""
    forget_loaded_kernels()
    store = TuningRecords(os.path.join(scratch, "profile.sqlite"))
    profiler = cProfile.Profile()
    profiler.enable()
    tune_shapes(problems, [0], max_candidates=args.max_candidates, repeat=args.repeat, num_workers=1, records=store)
    profiler.disable()
    text = io.StringIO()
    for key in ("cumulative", "tottime"):
        pstats.Stats(profiler, stream=text).sort_stats(key).print_stats(40)
    path = os.path.join(os.environ.get("OUT") or os.path.join(ROOT, "benchmarks", "results"), "tune_scale-profile.txt")
    with open(path, "w") as f:
        f.write(text.getvalue())
    print(f"wrote {path}")


class Breakdown:
    """Host time per thread and activity, from wrappers around the tuning's main steps: queueing
    a candidate's timed launches (`QueuedTiming`), waiting for them (GIL released), loading
    artifacts (CuTe DSL and NVRTC), making inputs and references, and finding the candidates.
    What a thread's wall time leaves over is its other host work and its waits for the GIL."""

    STEPS = {"queue": (policies.QueuedTiming, "__init__"), "wait": (policies.QueuedTiming, "samples"),
             "setup": [(policies, "random_like"), (policies, "reference")],
             "discovery": (registry, "get_kernels"),
             "interleaved": (policies, "time_interleaved")}

    def __init__(self) -> None:
        from kernel_api.providers.cuda_src.kernel import CudaSourceKernel
        from kernel_api.providers.cutedsl.kernel import CuteDslKernel

        self.seconds: dict[tuple[str, str], float] = {}
        self.steps = {**self.STEPS, "load": [(CuteDslKernel, "cute_compile"), (CudaSourceKernel, "compile")]}
        self.saved: list[tuple[object, str, object]] = []

    def _wrap(self, owner: object, name: str, label: str) -> None:
        original = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
        seconds = self.seconds

        def timed(*a, **kw):
            began = time.perf_counter()
            try:
                return original(*a, **kw)
            finally:
                key = (threading.current_thread().name, label)
                seconds[key] = seconds.get(key, 0.0) + time.perf_counter() - began

        self.saved.append((owner, name, original))
        setattr(owner, name, timed)

    def __enter__(self) -> "Breakdown":
        for label, where in self.steps.items():
            for owner, name in where if isinstance(where, list) else [where]:
                self._wrap(owner, name, label)
        self._wrap(scale, "tune_shard", "wall")  # one shard per thread: its wall time
        return self

    @property
    def walls(self) -> dict[str, float]:
        return {thread: s for (thread, label), s in self.seconds.items() if label == "wall"}

    def __exit__(self, *exc) -> None:
        for owner, name, original in reversed(self.saved):
            setattr(owner, name, original)

    def table(self) -> list[dict]:
        rows = []
        for thread, wall in sorted(self.walls.items()):
            row = {"thread": thread, "wall_s": wall}
            for label in self.steps:
                row[label + "_s"] = self.seconds.get((thread, label), 0.0)
            row["other_s"] = wall - sum(row[label + "_s"] for label in self.steps)
            rows.append(row)
        return rows


def breakdown_runs(problems: list, args: argparse.Namespace, scratch: str, configurations: list) -> dict:
    """One more run of each configuration but the processes', instrumented (`Breakdown`)."""
    found = {}
    for label, devices, isolation in configurations:
        if isolation == "processes":
            continue
        forget_loaded_kernels()
        store = TuningRecords(os.path.join(scratch, f"breakdown-{label}.sqlite"))
        with Breakdown() as b:
            start = time.perf_counter()
            tune_shapes(problems, devices, max_candidates=args.max_candidates, repeat=args.repeat, num_workers=1,
                        records=store, isolation=isolation.split("-")[0])
            seconds = time.perf_counter() - start
        found[label] = {"seconds": seconds, "threads": b.table()}
        print(f"\nbreakdown of one {label} run: {seconds:.2f} s wall (seconds per thread)")
        print(f"{'thread':>24} " + " ".join(f"{k:>9}" for k in ("wall", *b.steps, "other")))
        for row in found[label]["threads"]:
            print(f"{row['thread']:>24} " + " ".join(f"{row[k + '_s']:9.3f}" for k in ("wall", *b.steps, "other")))
    return found


def arbitrate(problem, names: list[str], repeat: int, rounds: int = 3) -> dict[str, list[float]]:
    """Time the kernels ``names`` against each other on GPU 0 for one problem: ``rounds`` calls of
    `time_interleaved` (``repeat`` launches of each, in turn, the inputs rotating past L2), the
    median per call. The careful measurement of "within 3 % of its time", where the tuning runs'
    own samples (30 launches of each candidate, minutes apart) hold their noise."""
    kind, description = describe_arguments(problem)
    args = arguments_from_description(kind, description, device="cuda:0")
    kernels = {k.metadata.kernel_name: k for k in registry.get_kernels(args) if k.metadata.kernel_name in names}
    sets = rotation_count(sum(t.numel() * t.element_size() for t in args.tensors().values()))
    inputs = [random_like(args) for _ in range(sets)]
    runs = {}
    for name, kernel in kernels.items():
        artifact = kernel.compile(args)
        own = [unbound_copy(a) for a in inputs]  # each kernel binds its own fast launch
        runs[name] = (lambda j, kernel=kernel, own=own, artifact=artifact:
                      kernel.run(own[j], compiled_artifact=artifact, assume_supported_args=True))
    medians: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(rounds):
        for name, got in time_interleaved(runs, sets, repeat=repeat).items():
            if isinstance(got, Exception):
                raise got
            medians[name].append(got["median_ms"])
    return medians


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-candidates", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=30)
    parser.add_argument("--compile-workers", type=int, default=None, help="for the compile step (default: CPUs, <= 16)")
    parser.add_argument("--shapes", default=SHAPES_FILE, help="a shapes file (default: the 16 bf16 GEMMs)")
    parser.add_argument("--rounds", type=int, default=3, help="times each configuration is timed (order rotated)")
    parser.add_argument("--profile", action="store_true", help="cProfile one more single-GPU run ($OUT or results/)")
    parser.add_argument("--sequential", action="store_true",
                        help="PickBest times the candidates one after the other, not in rounds (policies._INTERLEAVE off)")
    parser.add_argument("--breakdown", action="store_true",
                        help="time one more run per in-process configuration by step and thread (Breakdown)")
    parser.add_argument("--tag", default="", help="appended to the JSON file's name")
    parser.add_argument("--no-prefetch", action="store_true",
                        help="PickBest loads each candidate in its turn (not while the GPU times the one before)")
    parser.add_argument("--first-launch-late", action="store_true",
                        help="PickBest's first launch of an artifact is its check, behind the reference "
                             "(policies._FIRST_LAUNCH_EARLY off)")
    parser.add_argument("--arbiter-repeat", type=int, default=200,
                        help="launches of each kernel per interleaved round when re-timing a disagreement (0: off)")
    parser.add_argument("--multi", default="threads,processes",
                        help="multi-GPU runs: threads, processes, threads-si (threads, 0.5 ms switch interval)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("tune_scale.py needs a CUDA GPU")
    policies._PREFETCH_NEXT = not args.no_prefetch
    policies._INTERLEAVE = not args.sequential
    policies._FIRST_LAUNCH_EARLY = not args.first_launch_late
    gpus = torch.cuda.device_count()
    device = torch.cuda.get_device_name(0)
    major, minor = torch.cuda.get_device_capability(0)
    entries = load_shapes(args.shapes)
    problems = [entry_arguments(e, i) for i, e in enumerate(entries)]

    start = time.perf_counter()
    compiled = precompile(problems, major * 10 + minor, top=args.max_candidates,
                          num_workers=args.compile_workers or min(16, os.cpu_count() or 1))
    compile_s = time.perf_counter() - start
    failed = [r for r in compiled if r.failure is not None]
    print(f"compiled {len(compiled) - len(failed)} of {len(compiled)} candidates in {compile_s:.1f} s "
          f"(cc {major}{minor})" + (f"; failed: {[r.kernel_name for r in failed][:5]}" if failed else ""))

    warm_up(gpus)
    configurations = [("1gpu", [0], "threads")]
    if gpus > 1:
        configurations += [(f"{gpus}gpu-{kind}", list(range(gpus)), kind) for kind in args.multi.split(",")]
    runs: dict[str, list[dict]] = {label: [] for label, _, _ in configurations}
    with tempfile.TemporaryDirectory(prefix="tune_scale-") as scratch:
        for round_ in range(args.rounds):
            shift = round_ % len(configurations)
            for label, devices, isolation in configurations[shift:] + configurations[:shift]:
                store = TuningRecords(os.path.join(scratch, f"{label}-{round_}.sqlite"))
                forget_loaded_kernels()
                # num_workers=1: the candidates are in the compile cache already; no compile pools.
                # threads-si: threads with a 0.5 ms interpreter switch interval (an experiment)
                scale._THREAD_SWITCH_INTERVAL_S = 0.0005 if isolation == "threads-si" else None
                with Breakdown() as b:  # a few wrappers: each thread's wall and waits, every round
                    start = time.perf_counter()
                    results = tune_shapes(problems, devices, max_candidates=args.max_candidates,
                                          repeat=args.repeat, num_workers=1, records=store,
                                          isolation=isolation.split("-")[0])
                    seconds = time.perf_counter() - start
                scale._THREAD_SWITCH_INTERVAL_S = None
                threads = b.table()
                runs[label].append({"seconds": seconds, "results": results, "threads": threads})
                bad = [r for r in results if r.failure is not None]
                walls = "; ".join(f"{t['thread'].replace('kernel_api-tune-', '')} {t['wall_s']:.2f} s "
                                  f"(timing {t['wait_s'] + t['interleaved_s']:.2f})" for t in threads)
                print(f"round {round_}: {label}: {seconds:.2f} s for {len(results)} shapes" +
                      (f" [{walls}]" if walls else "") + (f"; {len(bad)} failed: {bad[0].failure}" if bad else ""))
        if args.profile:
            profile_single_gpu(problems, args, scratch)
        breakdown = breakdown_runs(problems, args, scratch, configurations) if args.breakdown else None

    single = runs["1gpu"][0]
    medians = {label: statistics.median(r["seconds"] for r in found) for label, found in runs.items()}
    spreads = {label: [min(r["seconds"] for r in found), max(r["seconds"] for r in found)]
               for label, found in runs.items()}
    speedups = {label: medians["1gpu"] / medians[label] for label in medians if label != "1gpu"}
    rows = []
    agree = {label: 0 for label in speedups}
    agree_arbiter = {label: 0 for label in speedups}
    arbitrated: dict[tuple, dict] = {}
    for i, (e, one) in enumerate(zip(entries, single["results"])):
        row = {"shape": [e["m"], e["n"], e["k"]] if e["op"] == "gemm" else [e["rows"], e["cols"]],
               "single_winner": one.kernel_name, "single_ms": one.median_ms, "failure": one.failure, "multi": {}}
        for label in speedups:
            many = runs[label][0]["results"][i]
            verdict = {"winner": many.kernel_name, "ms": many.median_ms, "device": many.device,
                       "failure": many.failure, "ok": False}
            if one.failure is None and many.failure is None:
                same = one.kernel_name == many.kernel_name
                # The multi-GPU winner's time in the single-GPU run (same GPU as the single winner's).
                theirs = one.median_ms if same else one.record.runners_up.get(many.kernel_name)
                verdict["winner_ms_on_gpu0"] = theirs
                verdict["slower_by"] = None if theirs is None else theirs / one.median_ms - 1.0
                verdict["ok"] = same or (theirs is not None and theirs <= one.median_ms * (1 + WITHIN))
                agree[label] += verdict["ok"]
                if not same and args.arbiter_repeat:
                    pair = (i, one.kernel_name, many.kernel_name)
                    if pair not in arbitrated:
                        try:
                            arbitrated[pair] = arbitrate(problems[i], list(pair[1:]), args.arbiter_repeat)
                        except Exception as exc:  # report it; the rounds' results stand
                            arbitrated[pair] = f"{type(exc).__name__}: {exc}"[:300]
                            print(f"re-timing {pair[1]} against {pair[2]} failed: {arbitrated[pair]}")
                    medians_ms = arbitrated[pair]
                    if isinstance(medians_ms, dict):
                        ratio = statistics.median(medians_ms[many.kernel_name]) / \
                            statistics.median(medians_ms[one.kernel_name])
                        verdict["arbiter_ms"] = medians_ms
                        verdict["arbiter_slower_by"] = ratio - 1.0
                        verdict["ok_arbiter"] = ratio <= 1 + WITHIN
                    else:
                        verdict["arbiter_error"] = medians_ms
                agree_arbiter[label] += same or verdict.get("ok_arbiter", verdict["ok"])
            row["multi"][label] = verdict
        rows.append(row)

    # The noise floor of that criterion: later single-GPU runs judged against the first alike.
    repeat_agree = []
    for later in runs["1gpu"][1:]:
        ok = 0
        for one, again in zip(single["results"], later["results"]):
            if one.failure is None and again.failure is None:
                theirs = one.median_ms if one.kernel_name == again.kernel_name else \
                    one.record.runners_up.get(again.kernel_name)
                ok += theirs is not None and theirs <= one.median_ms * (1 + WITHIN)
        repeat_agree.append(ok)

    labels = list(speedups)
    print(f"\n{'shape':>18} {'1-GPU winner':<58} {'us':>8}  " + "  ".join(f"{label:<30}" for label in labels))
    for r in rows:
        shape = "x".join(map(str, r["shape"]))
        cells = []
        for label in labels:
            v = r["multi"][label]
            verdict = "same" if v["winner"] == r["single_winner"] else (
                f"{v['slower_by'] * 100:+.1f}%" if v.get("slower_by") is not None else "n/a")
            if v.get("arbiter_slower_by") is not None:  # re-timed against each other (arbitrate)
                verdict += f" ({v['arbiter_slower_by'] * 100:+.1f}%{'' if v['ok_arbiter'] else ' FAIL'})"
            cells.append(f"{verdict + ('' if v['ok'] else ' FAIL') + ' GPU ' + str(v['device']):<30}")
        print(f"{shape:>18} {str(r['single_winner'])[:58]:<58} {(r['single_ms'] or 0) * 1e3:8.1f}  " + "  ".join(cells))
    print(f"\ncompile (every run then hits the disk cache): {compile_s:.1f} s; {args.rounds} round(s)")
    if repeat_agree:
        print(f"winners of the later 1-GPU runs the same or within 3% of the first's: {repeat_agree} of {len(rows)}")
    for label in medians:
        extra = "" if label == "1gpu" else (f"; speedup {speedups[label]:.2f}x; {agree[label]} of {len(rows)} "
                                            f"winners the same or within 3%; {agree_arbiter[label]} of "
                                            f"{len(rows)} when disagreements are re-timed head to head")
        print(f"{label:>16}: median {medians[label]:.2f} s [{spreads[label][0]:.2f}-{spreads[label][1]:.2f}]{extra}")

    summary = {"device": device, "gpus": gpus, "max_candidates": args.max_candidates, "repeat": args.repeat,
               "rounds": args.rounds, "prefetch": not args.no_prefetch, "interleave": not args.sequential,
               "first_launch_early": not args.first_launch_late,
               "threads": {k: [r["threads"] for r in v] for k, v in runs.items()},
               "shapes_file": os.path.relpath(args.shapes, ROOT), "compile_s": compile_s,
               "compile_failures": len(failed), "seconds": {k: [r["seconds"] for r in v] for k, v in runs.items()},
               "median_s": medians, "speedup": speedups, "winners_ok": agree,
               "winners_ok_arbitrated": agree_arbiter, "arbiter_repeat": args.arbiter_repeat,
               "winners_ok_1gpu_repeats": repeat_agree, "shapes": rows,
               "torch": torch.__version__, "breakdown": breakdown}
    name = f"tune_scale-{device.replace(' ', '_')}-{gpus}gpu{args.tag and '-' + args.tag}.json"
    paths = [os.path.join(ROOT, "benchmarks", "results", name)]
    if os.environ.get("OUT"):
        paths.append(os.path.join(os.environ["OUT"], name))
    for path in paths:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            json.dump(summary, f, indent=2)
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
