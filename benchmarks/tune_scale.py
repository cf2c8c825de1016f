"""Tuning 16 bf16 GEMM shapes on one GPU and on every visible GPU (`kernel_api.tune_shapes`).

    python benchmarks/tune_scale.py                      # 16 shapes, 8 candidates each
    python benchmarks/tune_scale.py --max-candidates 4 --repeat 20
    torchrun --standalone --nproc-per-node 2 -m kernel_api.tune \
        --shapes benchmarks/tune_scale_shapes.json --max-candidates 8     # the same shapes, one rank per GPU

The shapes are benchmarks/tune_scale_shapes.json (a ``kernel-api tune --shapes`` file): prefill-
and training-sized projections of a few model widths, and square problems.

1. Compiles each shape's candidates (the best-ranked ``--max-candidates``, PickBest's order) for
   this GPU's cc into the compile cache (`precompile`, timed and reported), so that both tuning
   runs find the same warm cache and their wall times compare tuning, not compiling.
2. Tunes the 16 shapes on GPU 0 alone (in this process, as `tune_shapes` does with one device),
   with fresh tuning records.
3. Tunes them on every visible GPU (one worker process per GPU, the shards balanced by
   estimated cost), with other fresh tuning records.

Prints both wall times and the speedup, and per shape whether the multi-GPU winner is the
single-GPU winner or within 3 % of its time; the comparison uses the single-GPU run's own
timings of both kernels (every verified candidate's median is in its record), so both times
come from the same GPU. JSON to benchmarks/results/tune_scale-<device>-<n>gpu.json (and $OUT/).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from kernel_api.cli.precompile import entry_arguments, load_shapes  # noqa: E402
from kernel_api.tuning.precompile import precompile  # noqa: E402
from kernel_api.tuning.records import TuningRecords  # noqa: E402
from kernel_api.tuning.scale import tune_shapes  # noqa: E402

SHAPES_FILE = os.path.join(ROOT, "benchmarks", "tune_scale_shapes.json")
WITHIN = 0.03


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-candidates", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=30)
    parser.add_argument("--compile-workers", type=int, default=None, help="for the compile step (default: CPUs, <= 16)")
    parser.add_argument("--shapes", default=SHAPES_FILE, help="a shapes file (default: the 16 bf16 GEMMs)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("tune_scale.py needs a CUDA GPU")
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

    runs = {}
    with tempfile.TemporaryDirectory(prefix="tune_scale-") as scratch:
        for label, devices in (("1gpu", [0]), (f"{gpus}gpu", list(range(gpus)))):
            store = TuningRecords(os.path.join(scratch, f"{label}.sqlite"))
            start = time.perf_counter()
            # num_workers=1: the candidates are in the compile cache already; no compile pools.
            results = tune_shapes(problems, devices, max_candidates=args.max_candidates, repeat=args.repeat,
                                  num_workers=1, records=store)
            seconds = time.perf_counter() - start
            runs[label] = {"seconds": seconds, "results": results}
            bad = [r for r in results if r.failure is not None]
            print(f"{label}: {seconds:.1f} s for {len(results)} shapes" +
                  (f"; {len(bad)} failed: {bad[0].failure}" if bad else ""))
            if gpus == 1:
                break

    single = runs["1gpu"]
    multi = runs.get(f"{gpus}gpu", single)
    speedup = single["seconds"] / multi["seconds"]
    rows, agree = [], 0
    for e, one, many in zip(entries, single["results"], multi["results"]):
        row = {"shape": [e["m"], e["n"], e["k"]] if e["op"] == "gemm" else [e["rows"], e["cols"]],
               "single_winner": one.kernel_name, "single_ms": one.median_ms,
               "multi_winner": many.kernel_name, "multi_ms": many.median_ms, "multi_device": many.device,
               "failure": one.failure or many.failure}
        if one.failure is None and many.failure is None:
            same = one.kernel_name == many.kernel_name
            # The multi-GPU winner's time in the single-GPU run (same GPU as the single winner's).
            theirs = one.median_ms if same else one.record.runners_up.get(many.kernel_name)
            row["multi_winner_ms_on_gpu0"] = theirs
            row["slower_by"] = None if theirs is None else theirs / one.median_ms - 1.0
            row["ok"] = same or (theirs is not None and theirs <= one.median_ms * (1 + WITHIN))
            agree += row["ok"]
        else:
            row["ok"] = False
        rows.append(row)

    print(f"\n{'shape':>18} {'1-GPU winner':<58} {'us':>8}  {'same / within 3%':<18} GPU")
    for r in rows:
        shape = "x".join(map(str, r["shape"]))
        verdict = "same" if r["single_winner"] == r["multi_winner"] else (
            f"{r['slower_by'] * 100:+.1f}%" if r.get("slower_by") is not None else "n/a")
        print(f"{shape:>18} {str(r['single_winner'])[:58]:<58} {(r['single_ms'] or 0) * 1e3:8.1f}  "
              f"{verdict + ('' if r['ok'] else ' FAIL'):<18} {r['multi_device']}")
    print(f"\ncompile (both runs then hit the cache): {compile_s:.1f} s")
    print(f"tuning on 1 GPU: {single['seconds']:.1f} s; on {gpus} GPUs: {multi['seconds']:.1f} s; "
          f"speedup {speedup:.2f}x; {agree} of {len(rows)} winners the same or within 3%")

    summary = {"device": device, "gpus": gpus, "max_candidates": args.max_candidates, "repeat": args.repeat,
               "shapes_file": os.path.relpath(args.shapes, ROOT), "compile_s": compile_s, "compile_failures": len(failed),
               "single_gpu_s": single["seconds"], "multi_gpu_s": multi["seconds"], "speedup": speedup,
               "winners_ok": agree, "shapes": rows, "torch": torch.__version__}
    name = f"tune_scale-{device.replace(' ', '_')}-{gpus}gpu.json"
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
