"""Softmax forward/backward: kernel_api's public path, PickBest's winner and PickAny's choice against torch, in one process.

    python3 benchmarks/softmax.py [--dtypes bf16,f16,f32] [--cases aligned,odd,long,small] [--repeats 3]
    python3 benchmarks/softmax.py --public-only        # the public path against torch, every case
    python3 benchmarks/softmax.py --replay [FILE ...]   # no GPU: PickAny now vs. recorded times

The public path first (`public_case`): back-to-back calls of ``kernel_api.ops.softmax(x)`` against
``torch.softmax(x, -1)``, ``kernel_api.ops.softmax_backward(g, y)`` against
``torch._softmax_backward_data(g, y, -1, dtype)``, and a step through autograd
(``torch.autograd.grad`` of ``ops.softmax(x)`` against that of ``torch.softmax(x, -1)``): host cost
included, as a loop of such calls pays it (`kernel_api.tuning.timing.time_interleaved` with
``timing="as_called"``: samples of back-to-back calls between one event pair, torch and ours in
shuffled turns, rotating input sets, median). ``x torch`` is torch's time over ours: at least 1.0
on every case is the target. Then, unless ``--public-only``, the kernels themselves:

Per dtype, case (aligned shapes of at least 64 MB; odd row lengths such as 4096x50257;
rows too long for one CTA such as 1x1M, 8x1M, 32x1M, 8x4M; small problems, where the host's
work per call matters, such as 8192x128 and 128x32000) and direction, every candidate of
``--providers`` (default cuda_src) and PickAny's choice are checked against a float64
reference and timed against torch with alternating launches (CUDA events, median, rotating
input sets larger than L2 with fresh random data). PickBest's winner is the fastest
verified kernel (what `PickBest` measures and records). ``--repeats`` measurements give the
spread. Bytes are one read of each input and one write of each output (forward: x, out;
backward: grad_out, out, grad_in). Also measured: the copy rate, the host cost of
``Kernel.run`` and the cubin cache. JSON: benchmarks/results/softmax-<device>-<tag>.json.

``--replay`` needs no GPU: for every case of recorded JSONs (default: the softmax results in
benchmarks/results) it ranks the currently registered candidates with the current cost model
(cc 90, the file's SM count) and compares the best-ranked measured one with the measured best
(`replay_case`, on `kernel_api.tuning.replay`). The tests replay the curated cases of
tests/data/measured_softmax_times.json the same way.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import kernel_api  # noqa: E402
import results_io  # noqa: E402
from typing import Any  # noqa: E402

from kernel_api import SoftmaxArguments, SoftmaxBackwardArguments  # noqa: E402
from kernel_api.tuning.timing import time_cuda  # noqa: E402

SHAPES = [(32768, 4096), (16384, 16384), (65536, 1024)]  # the aligned shapes (also the --sweep's)
#: (rows, cols) per case: aligned shapes of at least 64 MB, odd row lengths, rows too long for one CTA.
CASES = {
    "aligned": SHAPES,
    "odd": [(4096, 50257), (8192, 4097), (16384, 4095)],
    "long": [(1, 2**20), (8, 2**20), (32, 2**20), (8, 2**22)],
    # small problems, where the host's work per call shows in the public path, and few long rows
    "small": [(8192, 128), (128, 32000), (32, 131072), (16384, 1024)],
}
L2_ROTATE_BYTES = 50 * 2**20
DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}


def median_ms(fn, sets: int, iters: int, warmup: int = 5) -> float:
    """Median time of one call, ``fn(i)`` using input set ``i % sets`` (CUDA events)."""
    return time_cuda(fn, sets=sets, warmup=warmup, repeat=iters)["median_ms"]


def copy_rate(iters: int) -> float:
    """Device-to-device copy, bytes read + written, TB/s (1 GiB per copy, two buffer pairs)."""
    n = 2**30 // 2
    pairs = [(torch.randn(n, device="cuda", dtype=torch.bfloat16), torch.empty(n, device="cuda", dtype=torch.bfloat16))
             for _ in range(2)]
    ms = median_ms(lambda i: pairs[i][1].copy_(pairs[i][0]), 2, iters)
    pairs.clear()
    return 2 * n * 2 / (ms * 1e-3) / 1e12


def n_sets(bytes_per_set: int) -> int:
    return max(2, -(-2 * L2_ROTATE_BYTES // bytes_per_set))


def _case_tensors(rows: int, cols: int, dtype: torch.dtype, backward: bool) -> tuple:
    """Rotating argument sets (fresh random data each), the torch call, and a float64 check."""
    elem = torch.tensor([], dtype=dtype).element_size()
    nbytes = (3 if backward else 2) * rows * cols * elem
    sets = n_sets(nbytes)
    if backward:
        ys = [torch.softmax(torch.randn(rows, cols, device="cuda") * 2, -1).to(dtype) for _ in range(sets)]
        gs = [torch.randn(rows, cols, device="cuda", dtype=dtype) for _ in range(sets)]
        outs = [torch.empty_like(y) for y in ys]
        argsets = [SoftmaxBackwardArguments(g, y, gi) for g, y, gi in zip(gs, ys, outs)]
        g0, y0 = gs[0].double(), ys[0].double()
        ref = y0 * (g0 - (g0 * y0).sum(-1, keepdim=True))
        torch_fn = lambda i: torch._softmax_backward_data(gs[i], ys[i], -1, dtype)  # noqa: E731
    else:
        xs = [torch.randn(rows, cols, device="cuda", dtype=dtype) * 4 for _ in range(sets)]
        outs = [torch.empty_like(x) for x in xs]
        argsets = [SoftmaxArguments(x, o) for x, o in zip(xs, outs)]
        ref = torch.softmax(xs[0].double(), -1)
        torch_fn = lambda i: torch.softmax(xs[i], -1)  # noqa: E731
    return nbytes, sets, argsets, outs, ref, torch_fn


def _meta_arguments(rows: int, cols: int, dtype: torch.dtype, backward: bool) -> Any:
    """Look-alike arguments on the meta device (no memory): what discovery and ranking need."""
    x = torch.empty(rows, cols, dtype=dtype, device="meta")
    if backward:
        return SoftmaxBackwardArguments(x, torch.empty_like(x), torch.empty_like(x))
    return SoftmaxArguments(x, torch.empty_like(x))


def timed_kernels(args: Any, cc: int, providers: tuple[str, ...], top: int) -> tuple[list, Any]:
    """The kernels a case times: PickAny's ``top`` best-ranked candidates of ``providers`` (as
    PickBest caps its candidates) plus PickAny's own choice; and that choice."""
    from kernel_api.tuning.policies import rank_candidates

    ranked = rank_candidates(kernel_api.get_kernels(args, cc=cc), args)
    mine = [k for k in ranked if k.metadata.provider in providers and k.metadata.provider != "torch"][:top]
    if ranked[0] not in mine:
        mine.append(ranked[0])
    return mine, ranked[0]


#: The sm count a replay assumes when a results file does not record one (an H100 / H200).
REPLAY_SMS = 132
_SHORT_DTYPES = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}


def _measured_ms(kernel: dict) -> float | None:
    """A recorded kernel's time (ms): its ``ms`` (a median already, or a list to take the median
    of), else the median of its ``ms_runs``; None for a kernel that failed."""
    ms = kernel.get("ms")
    if isinstance(ms, list):
        return statistics.median(ms) if ms else None
    if ms is None and kernel.get("ms_runs"):
        return statistics.median(kernel["ms_runs"])
    return ms


def replay_case(entry: dict, sms: int = REPLAY_SMS, cc: int = 90) -> dict:
    """PickAny's choice *now* for one recorded case (``results[i]`` of a benchmark JSON), from
    the currently registered candidates and cost model, against what the case measured
    (`kernel_api.tuning.replay.replay_softmax`: the best-ranked measured candidate).

    A kernel's time is its ``ms`` (`_measured_ms`); torch's (the median of ``torch_ms``) counts
    as its softmax kernel's. ``ratio``: best ms / choice ms (1.0: the choice is the fastest
    measured); ``choice_runs``: the fastest and slowest of the choice's repeated measurements
    (None with one)."""
    from kernel_api.tuning.replay import SoftmaxProblem, candidates, replay_ranking
    from kernel_api.tuning.policies import rank_candidates

    rows, cols = entry["shape"]
    args = SoftmaxProblem(rows, cols, entry["dtype"], entry["op"]).arguments()
    ranked = rank_candidates(candidates(args, cc=cc), args, sm_count=sms)
    names = [k.metadata.kernel_name for k in ranked]
    measured = {n: ms for n, k in entry["kernels"].items() for ms in [_measured_ms(k)] if ms is not None}
    torch_name = next((n for n, k in zip(names, ranked) if k.metadata.provider == "torch"), None)
    if torch_name is not None and entry.get("torch_ms"):
        measured.setdefault(torch_name, statistics.median(entry["torch_ms"]))
    r = replay_ranking(names, measured, stand_in=True)
    runs = entry["kernels"].get(r.choice, {}).get("ms_runs") or [] if r.choice else []
    return {"shape": [rows, cols], "dtype": entry["dtype"], "op": entry["op"], "skipped": list(r.skipped),
            "top": r.top, "choice": r.choice, "choice_ms": r.choice_ms, "best": r.best, "best_ms": r.best_ms,
            "ratio": r.ratio, "top_unmeasured": r.top_unmeasured, "recorded_pick": entry.get("pick_any"),
            "choice_runs": [min(runs), max(runs)] if len(runs) > 1 else None}


def replay_file(path: str, cc: int = 90) -> dict:
    """`replay_case` for every case of a softmax benchmark JSON: ``{"file", "sms", "cases"}``,
    or ``{"file", "unusable": why}`` for a file of another structure (the older
    ``forward``/``backward`` reports)."""
    report = results_io.load(path)
    results = report.get("results") if isinstance(report, dict) else None
    if not isinstance(results, list) or not all(
            isinstance(e, dict) and {"shape", "dtype", "op", "kernels"} <= e.keys() for e in results):
        keys = sorted(report)[:8] if isinstance(report, dict) else type(report).__name__
        return {"file": path, "unusable": f"no results[] of shape/dtype/op/kernels (keys: {keys})"}
    sms = report.get("sms") or REPLAY_SMS
    return {"file": path, "sms": sms, "device": report.get("device"),
            "cases": [replay_case(e, sms, cc) for e in results]}


def replay(paths: list[str], within: float = 0.9) -> list[dict]:
    """Print, per file and case, PickAny's choice now against the measured best, and a summary."""
    found = []
    everything = []
    for path in paths:
        got = replay_file(path)
        found.append(got)
        name = os.path.basename(path)
        if "unusable" in got:
            print(f"{name}: skipped, {got['unusable']}")
            continue
        print(f"\n{name} ({got['device']}, {got['sms']} SMs): PickAny now vs. the measured best")
        print(f"  {'dtype':4s} {'op':3s} {'shape':>12s}  {'choice now':52s} {'ms':>8s}  "
              f"{'measured best':52s} {'ms':>8s}  best/choice")
        skipped = set()
        for c in got["cases"]:
            skipped.update(c["skipped"])
            shape = f"{c['shape'][0]}x{c['shape'][1]}"
            dt = _SHORT_DTYPES.get(c["dtype"], c["dtype"])
            if c["choice"] is None:
                print(f"  {dt:4s} {c['op']:3s} {shape:>12s}  nothing measured is a candidate now")
                continue
            runs = c["choice_runs"]
            flags = ("" if c["ratio"] >= within else "  <-- outside 10 %") + (
                f"  (PickAny's top {c['top']} was not measured)" if c["top_unmeasured"] else "") + (
                f"  (noisy: the choice's runs {runs[0]:.4f}-{runs[1]:.4f} ms)"
                if runs and runs[1] > 1.1 * runs[0] else "")
            print(f"  {dt:4s} {c['op']:3s} {shape:>12s}  {c['choice']:52s} {c['choice_ms']:8.4f}  "
                  f"{c['best']:52s} {c['best_ms']:8.4f}  {c['ratio']:5.3f}{flags}")
        usable = [c for c in got["cases"] if c["ratio"] is not None]
        everything += [(name, c) for c in usable]
        _replay_summary(name, usable, within)
        print(f"  {len(skipped)} measured kernel name(s) not candidates now, left out"
              + (": " + ", ".join(sorted(skipped)[:6]) + (" ..." if len(skipped) > 6 else "") if skipped else ""))
    if everything:
        print()
        _replay_summary("all files", [c for _, c in everything], within)
    return found


def _replay_summary(label: str, cases: list[dict], within: float) -> None:
    if not cases:
        print(f"  {label}: no case to replay")
        return
    good = sum(c["ratio"] >= within for c in cases)
    worst = min(cases, key=lambda c: c["ratio"])
    unmeasured = sum(c["top_unmeasured"] for c in cases)
    print(f"  {label}: {good}/{len(cases)} cases within {100 * (1 - within):.0f} % of the measured best; worst "
          f"{worst['ratio']:.3f} ({_SHORT_DTYPES.get(worst['dtype'], worst['dtype'])} {worst['op']} "
          f"{worst['shape'][0]}x{worst['shape'][1]}: {worst['choice']} vs. {worst['best']})"
          + (f"; {unmeasured} case(s) whose top choice was not measured" if unmeasured else ""))


def default_replay_files() -> list[str]:
    """The H100 / H200 softmax results: softmax-NVIDIA_*.json[.gz] and softmax-nvidia-h200.json."""
    import glob

    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
    return sorted(glob.glob(os.path.join(here, "softmax-NVIDIA_*.json")) + glob.glob(
        os.path.join(here, "softmax-NVIDIA_*.json.gz"))) + sorted(glob.glob(os.path.join(here, "softmax-nvidia-h200.json")))


def precompile(plan: list, cc: int, workers: int) -> None:
    """Compile every case's kernels at once in worker processes (filling the disk caches)."""
    from kernel_api.tuning.compile_worker import compile_request, compile_requests, describe_arguments

    requests = []
    for args, kernels in plan:
        kind, description = describe_arguments(args)
        requests += [r for k in kernels if k.metadata.provider != "torch"
                     for r in [compile_request(k, cc, kind, description)] if r is not None]
    t0 = time.perf_counter()
    failures = [f for f in compile_requests(requests, workers) if f]
    print(f"precompiled {len(requests)} kernels in {time.perf_counter() - t0:.0f} s"
          + (f"; {len(failures)} failed, first: {failures[0][:300]}" if failures else ""), flush=True)


def bench_case(rows: int, cols: int, dtype: torch.dtype, backward: bool, iters: int, repeats: int,
               names: set[str]) -> dict:
    """The kernels ``names`` (PickAny's choice among them), each checked against float64 and timed
    against torch with alternating launches, ``repeats`` times; the fastest is PickBest's winner."""
    from kernel_api.tuning.policies import rank_candidates
    from kernel_api.tuning.timing import time_cuda_pair

    nbytes, sets, argsets, outs, ref, torch_fn = _case_tensors(rows, cols, dtype, backward)
    args0 = argsets[0]
    candidates = kernel_api.get_kernels(args0)
    pick_any = rank_candidates(candidates, args0)[0]
    timed = [k for k in candidates if k.metadata.kernel_name in names]
    if pick_any not in timed:
        timed.append(pick_any)
    result = {"shape": [rows, cols], "dtype": str(dtype).replace("torch.", ""), "op": "bwd" if backward else "fwd",
              "bytes": nbytes, "pick_any": pick_any.metadata.kernel_name, "kernels": {}, "torch_ms": []}
    for kernel in timed:
        name = kernel.metadata.kernel_name
        try:
            art = kernel.compile(args0)
            outs[0].fill_(float("nan"))
            kernel.run(args0, compiled_artifact=art)
            torch.cuda.synchronize()
            o = outs[0].double()
            err = ((o - ref).norm() / ref.norm()).item()
            if not err < 1e-2:  # (NaN fails too)
                raise RuntimeError(f"wrong result: relative error {err:.3e}")
            samples = []
            for _ in range(repeats):
                t_ms, k_ms = time_cuda_pair(torch_fn, lambda i: kernel.run(argsets[i], compiled_artifact=art,
                                                                           assume_supported_args=True),
                                            sets=sets, repeat=iters)
                result["torch_ms"].append(t_ms)
                samples.append(k_ms)
        except Exception as exc:  # report, keep benchmarking the others
            result["kernels"][name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
            print(f"    {name}: ERROR {result['kernels'][name]['error']}", flush=True)
            continue
        result["kernels"][name] = {"ms": statistics.median(samples), "ms_runs": samples, "rel_err": err,
                                   "provider": kernel.metadata.provider}
    argsets.clear()
    outs.clear()
    return result


PUBLIC_OPS = ("fwd", "bwd", "autograd")


def _wrapped_softmax(x: torch.Tensor) -> torch.Tensor:
    return torch.softmax(x, -1)


def _wrapped_softmax_backward(g: torch.Tensor, y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch._softmax_backward_data(g, y, -1, dtype)


def public_case(rows: int, cols: int, dtype: torch.dtype, repeat: int = 60, ops_timed: tuple = PUBLIC_OPS) -> list[dict]:
    """The public path against torch on one shape, per `PUBLIC_OPS`: back-to-back calls (host
    cost included), torch's and ours in shuffled turns (`time_interleaved`, ``as_called``), each
    result checked against float64 first. Returns one entry per op: ``torch_ms``, ``ops_ms``
    (medians), ``x_torch`` (torch's time over ours) and the kernel PickAny chose."""
    from kernel_api.ops import dispatch as ops_module
    from kernel_api.tuning.timing import time_interleaved

    elem = torch.tensor([], dtype=dtype).element_size()
    sets = n_sets(3 * rows * cols * elem)
    xs = [torch.randn(rows, cols, device="cuda", dtype=dtype) * 4 for _ in range(sets)]
    ys = [torch.softmax(x.float(), -1).to(dtype) for x in xs]
    gs = [torch.randn(rows, cols, device="cuda", dtype=dtype) for _ in range(sets)]
    leaves = [x.clone().requires_grad_() for x in xs]
    x64, y64, g64 = xs[0].double(), ys[0].double(), gs[0].double()
    refs = {"fwd": torch.softmax(x64, -1), "bwd": y64 * (g64 - (g64 * y64).sum(-1, keepdim=True))}
    ops = kernel_api.ops
    ops.clear_dispatch_cache()
    calls = {
        "fwd": (lambda i: torch.softmax(xs[i], -1), lambda i: ops.softmax(xs[i])),
        "bwd": (lambda i: torch._softmax_backward_data(gs[i], ys[i], -1, dtype),
                lambda i: ops.softmax_backward(gs[i], ys[i])),
        "autograd": (lambda i: torch.autograd.grad(torch.softmax(leaves[i], -1), leaves[i], gs[i]),
                     lambda i: torch.autograd.grad(ops.softmax(leaves[i]), leaves[i], gs[i])),
    }
    # torch's call behind one Python function: the host cost of any Python front door (the
    # floor ours is measured against as ``x_wrapped``)
    wrapped = {"fwd": _wrapped_softmax, "bwd": _wrapped_softmax_backward}
    floors = {
        "fwd": lambda i: wrapped["fwd"](xs[i]),
        "bwd": lambda i: wrapped["bwd"](gs[i], ys[i], dtype),
        "autograd": lambda i: torch.autograd.grad(wrapped["fwd"](leaves[i]), leaves[i], gs[i]),
    }
    soft = refs["fwd"]  # the autograd step's reference: the gradient through softmax(x)
    refs["autograd"] = soft * (g64 - (g64 * soft).sum(-1, keepdim=True))
    found = []
    for op, (theirs, ours) in calls.items():
        if op not in ops_timed:
            continue
        entry = {"shape": [rows, cols], "dtype": str(dtype).replace("torch.", ""), "op": op}
        try:
            for _ in range(3):  # the first calls choose and record; the later ones replay
                got = ours(0)
            got = got[0] if isinstance(got, tuple) else got
            err = ((got.double() - refs[op]).norm() / refs[op].norm()).item()
            if not err < 1e-2:
                raise RuntimeError(f"wrong result: relative error {err:.3e}")
            floor = (3 if op != "fwd" else 2) * rows * cols * elem / 3.0e12 * 1e3
            timed = time_interleaved({"torch": theirs, "ops": ours, "wrapped": floors[op]}, sets=sets, warmup=5,
                                     repeat=repeat, gpu_floor_ms=floor, timing="as_called")
            for name, t in timed.items():
                if isinstance(t, Exception):
                    raise t
            entry.update(torch_ms=timed["torch"]["median_ms"], ops_ms=timed["ops"]["median_ms"], rel_err=err)
            entry["x_torch"] = entry["torch_ms"] / entry["ops_ms"]
            entry["wrapped_ms"] = timed["wrapped"]["median_ms"]
            entry["x_wrapped"] = entry["wrapped_ms"] / entry["ops_ms"]
            # the choices made for this case (the dispatch dict is emptied per shape and dtype)
            wanted = {"fwd": ("softmax",), "bwd": ("softmax_bwd",), "autograd": ("softmax", "softmax_bwd")}[op]
            entry["kernels"] = sorted(k.metadata.kernel_name for problem, k in ops_module.chosen_kernels()
                                      if problem[0][0] in wanted)
        except Exception as exc:  # report, keep benchmarking the others
            entry["error"] = f"{type(exc).__name__}: {exc}"[:300]
        found.append(entry)
    leaves.clear()
    return found


def _public_row(e: dict) -> str:
    dt = {"bfloat16": "bf16", "float16": "f16", "float32": "f32"}.get(e["dtype"], e["dtype"])
    shape = f"{e['shape'][0]}x{e['shape'][1]}"
    if "error" in e:
        return f"{dt:5s} {e['op']:8s} {shape:>13s} | ERROR {e['error']}"
    wrapped = f" | x wrapped {e['x_wrapped']:5.2f}" if "x_wrapped" in e else ""
    return (f"{dt:5s} {e['op']:8s} {shape:>13s} | torch {e['torch_ms'] * 1e3:9.1f} us | ops {e['ops_ms'] * 1e3:9.1f} us | "
            f"{e['x_torch']:5.2f}x{wrapped} | {', '.join(e.get('kernels', []))}")


def _public_table(entries: list[dict]) -> str:
    """One line per dtype and shape: x torch of the forward, the backward and the autograd step
    (``torch.autograd.grad`` through ``ops.softmax`` against through ``torch.softmax``)."""
    rows: dict[tuple, dict] = {}
    for e in entries:
        rows.setdefault((e["dtype"], e["shape"][0], e["shape"][1]), {})[e["op"]] = e
    lines = ["x torch per op (torch's time / ours; >= 1.00 is the target)",
             f"{'dtype':9s} {'shape':>13s} | {'forward':>7s} | {'backward':>8s} | {'autograd step':>13s}"]
    for (dtype, r, c), ops in rows.items():
        cells = [f"{ops[op]['x_torch']:.2f}x" if "x_torch" in ops.get(op, {}) else "error" if op in ops else "-"
                 for op in PUBLIC_OPS]
        lines.append(f"{dtype:9s} {f'{r}x{c}':>13s} | {cells[0]:>7s} | {cells[1]:>8s} | {cells[2]:>13s}")
    return "\n".join(lines)


def summarise(entry: dict, copy_tbs: float) -> None:
    """TB/s, ratios, PickBest's winner (fastest verified) and PickAny's choice."""
    tb = lambda ms: entry["bytes"] / (ms * 1e-3) / 1e12  # noqa: E731
    entry["torch_tbs"] = tb(statistics.median(entry["torch_ms"])) if entry["torch_ms"] else None
    ok = {n: k for n, k in entry["kernels"].items() if "ms" in k}
    for k in ok.values():
        k["tbs"] = tb(k["ms"])
        k["tbs_spread"] = [tb(max(k["ms_runs"])), tb(min(k["ms_runs"]))]
        k["frac_copy"] = k["tbs"] / copy_tbs
        if entry["torch_tbs"]:
            k["x_torch"] = k["tbs"] / entry["torch_tbs"]
    entry["best"] = min(ok, key=lambda n: ok[n]["ms"]) if ok else None
    any_ = ok.get(entry["pick_any"])
    entry["pick_any_over_best"] = (ok[entry["best"]]["ms"] / any_["ms"]) if any_ and entry["best"] else None


#: Per-kernel fields `summarise` derives from the measured ones; `lean_report` drops them.
DERIVED_KERNEL_FIELDS = ("tbs", "tbs_spread", "frac_copy", "x_torch")


def lean_report(report: dict) -> dict:
    """``report`` without the per-kernel `DERIVED_KERNEL_FIELDS` (they follow from ``ms``,
    ``ms_runs``, ``bytes``, ``copy_tbs`` and ``torch_ms``), for sweeps of many small cases whose
    files travel with the tree; marked ``derived_fields_dropped``."""
    lean = {k: v for k, v in report.items() if k != "results"}
    lean["derived_fields_dropped"] = ("per kernel " + ", ".join(DERIVED_KERNEL_FIELDS[:-1]) + " and "
                                      + DERIVED_KERNEL_FIELDS[-1] + " (they follow from ms, ms_runs, bytes, "
                                      "copy_tbs and torch_ms)")
    lean["results"] = [{**e, "kernels": {n: {f: v for f, v in k.items() if f not in DERIVED_KERNEL_FIELDS}
                                         for n, k in e["kernels"].items()}} for e in report.get("results", [])]
    return lean


def host_overhead(calls: int = 20000) -> dict:
    """Wall time per call of run() on a tiny problem (the host, not the GPU, is the limit)."""
    x = torch.randn(1, 32, device="cuda")
    out = torch.empty_like(x)
    args = SoftmaxArguments(x, out)
    kernel = kernel_api.get_kernels(args, providers="cuda_src")[0]
    art = kernel.compile(args)
    stream = torch.cuda.current_stream()
    res = {"kernel": kernel.metadata.kernel_name}

    def per_call(fn) -> float:
        for _ in range(200):
            fn()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - t) / calls * 1e6

    launcher = art.compiled_obj
    handle = stream.cuda_stream
    plan = art.extra
    params = (x.data_ptr(), out.data_ptr(), 1, 32, 32, 32)
    res["bare_cuda_core_launch_us"] = per_call(lambda: launcher.launch(handle, 0, 1, plan.threads, 0, params))
    res["run_artifact_unchecked_us"] = per_call(
        lambda: kernel.run(args, compiled_artifact=art, stream=stream, assume_supported_args=True))
    res["run_artifact_unchecked_default_stream_us"] = per_call(
        lambda: kernel.run(args, compiled_artifact=art, assume_supported_args=True))
    res["run_artifact_checked_us"] = per_call(lambda: kernel.run(args, compiled_artifact=art, stream=stream))
    res["args_plus_run_unchecked_us"] = per_call(
        lambda: kernel.run(SoftmaxArguments(x, out), compiled_artifact=art, stream=stream, assume_supported_args=True))
    res["torch_softmax_us"] = per_call(lambda: torch.softmax(x, -1))
    return res


def cache_timing() -> dict:
    """Cold NVRTC compile vs. loading the cubin from the disk cache (memory cache cleared)."""
    from kernel_api.nvrtc import compiler
    from kernel_api.providers.cuda_src.kernels.softmax import CudaSoftmaxForward

    name = "ka_softmax::fwd_block<ka_softmax::BF16, 8, 4, 512>"
    with tempfile.TemporaryDirectory() as d:
        old = os.environ.get("KERNEL_API_CACHE_DIR")
        os.environ["KERNEL_API_CACHE_DIR"] = d
        try:
            compiler.clear_memory_cache()
            t = time.perf_counter()
            cold = compiler.compile_cuda(CudaSoftmaxForward.get_source(), cc=90, name_expressions=[name],
                                         source_name="softmax.cu")
            cold_s = time.perf_counter() - t
            compiler.clear_memory_cache()
            t = time.perf_counter()
            hit = compiler.compile_cuda(CudaSoftmaxForward.get_source(), cc=90, name_expressions=[name],
                                        source_name="softmax.cu")
            hit_s = time.perf_counter() - t
        finally:
            if old is None:
                os.environ.pop("KERNEL_API_CACHE_DIR", None)
            else:
                os.environ["KERNEL_API_CACHE_DIR"] = old
    return {"cold_compile_ms": cold_s * 1e3, "disk_hit_ms": hit_s * 1e3, "hit": hit.cache_hit and not cold.cache_hit}


HINT_VARIANTS = {
    "nc_noalloc+st_cs (default)": {},
    "plain ld+st": {"KA_LD16": '"ld.global.v4.u32"', "KA_ST16": '"st.global.v4.u32"'},
    "nc_noalloc+plain st": {"KA_ST16": '"st.global.v4.u32"'},
    "plain ld+st_cs": {"KA_LD16": '"ld.global.v4.u32"'},
    "nc+plain st": {"KA_LD16": '"ld.global.nc.v4.u32"', "KA_ST16": '"st.global.v4.u32"'},
}


def hint_sweep(dtype: torch.dtype, iters: int) -> list:
    """Time the cuda_src register kernels with each 16-byte load/store cache-hint variant."""
    from kernel_api.nvrtc import compile_cuda
    from kernel_api.providers.cuda_src.kernels.softmax import CudaSoftmaxBackward, CudaSoftmaxForward
    from kernel_api.nvrtc import CudaLauncher

    rows_out = []
    cc = torch.cuda.get_device_capability()
    cc = cc[0] * 10 + cc[1]
    for rows, cols in SHAPES:
        for cls in (CudaSoftmaxForward, CudaSoftmaxBackward):
            n_t = 3 if cls.backward else 2
            sets = n_sets(n_t * rows * cols * 2)
            ts = [[torch.randn(rows, cols, device="cuda", dtype=dtype) for _ in range(n_t)] for _ in range(sets)]
            strategy = "block_ept32" if cols > 1024 else "block_ept16"
            name = f"{cls.__name__}_bf16_{strategy}_a8"
            kernel = next(k for k in cls.generate_kernels(None, cc=cc) if k.metadata.kernel_name == name)
            expr, plan = kernel._instance(cols)
            for label, defines in HINT_VARIANTS.items():
                compiled = compile_cuda(cls.get_source(), cc=cc, name_expressions=[expr], defines=defines,
                                        source_name="softmax.cu")
                launcher = CudaLauncher(compiled, expr, name, convert_args=False)
                handle = torch.cuda.current_stream().cuda_stream
                grid = (rows + plan.rows_per_cta - 1) // plan.rows_per_cta

                def call(i, launcher=launcher):
                    t = ts[i]
                    ptrs = tuple(x.data_ptr() for x in t)
                    extra = (rows, cols, cols, cols, cols) if cls.backward else (rows, cols, cols, cols)
                    launcher.launch(handle, 0, grid, plan.threads, 0, ptrs + extra)

                ms = median_ms(call, sets, iters)
                tbs = n_t * rows * cols * 2 / (ms * 1e-3) / 1e12
                rows_out.append({"kernel": name, "shape": [rows, cols], "variant": label, "ms": ms, "tbs": tbs})
                print(f"  sweep {name:42s} {rows}x{cols} {label:28s} {ms*1e3:8.1f} us {tbs:6.3f} TB/s", flush=True)
            ts.clear()
            torch.cuda.empty_cache()
    return rows_out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=40, help="timed launches per measurement")
    ap.add_argument("--repeats", type=int, default=1, help="measurements per kernel (the spread is reported)")
    ap.add_argument("--dtypes", default="bf16,f16,f32")
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    ap.add_argument("--shapes", default=None, help="ROWSxCOLS,... instead of the cases' shapes")
    ap.add_argument("--providers", default="cuda_src", help="providers whose every candidate is timed "
                    "(PickAny's choice and torch always are)")
    ap.add_argument("--workers", type=int, default=min(14, os.cpu_count() or 1), help="compile worker processes")
    ap.add_argument("--top", type=int, default=10, help="candidates timed per case, best ranked by PickAny first")
    ap.add_argument("--tag", default="run", help="suffix of the JSON file name")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    ap.add_argument("--skip-host", action="store_true")
    ap.add_argument("--public-only", action="store_true", help="time only the public path against torch")
    ap.add_argument("--skip-public", action="store_true", help="time only the kernels (Kernel.run) against torch")
    ap.add_argument("--public-repeat", type=int, default=60, help="samples per call of the public path")
    ap.add_argument("--public-ops", default=",".join(PUBLIC_OPS), help=f"of {', '.join(PUBLIC_OPS)}: the public "
                    "path's calls timed")
    ap.add_argument("--autograd-native-max", type=int, default=None, help="ops.dispatch.AUTOGRAD_NATIVE_MAX_ELEMENTS "
                    "for this run: differentiable softmaxes of more elements run kernel_api's kernels (0: all)")
    ap.add_argument("--lean", action="store_true", help="write the JSON without the per-kernel fields derived "
                    "from the timings (`lean_report`): for sweeps of many cases")
    ap.add_argument("--sweep", action="store_true", help="also compare cache-hint variants of the CUDA kernels")
    ap.add_argument("--only-sweep", action="store_true", help="run only the cache-hint sweep")
    ap.add_argument("--replay", nargs="*", metavar="FILE", default=None,
                    help="no GPU: PickAny's choice now (current candidates and cost model) for every case of "
                         "these softmax JSONs against what they measured (none: the H100/H200 softmax results)")
    opts = ap.parse_args()
    public_ops = tuple(o for o in opts.public_ops.split(",") if o)
    if opts.autograd_native_max is not None:
        from kernel_api.ops import dispatch as ops_module

        ops_module.AUTOGRAD_NATIVE_MAX_ELEMENTS = opts.autograd_native_max
    if opts.replay is not None:
        replay(opts.replay or default_replay_files())
        return
    props = torch.cuda.get_device_properties(0)
    device = props.name
    report = {"device": device, "sms": props.multi_processor_count, "torch": torch.__version__,
              "iters": opts.iters, "repeats": opts.repeats, "command": " ".join(sys.argv)}
    report["copy_tbs"] = copy_tbs = copy_rate(opts.iters)
    print(f"device {device}: device-to-device copy {copy_tbs:.3f} TB/s", flush=True)
    if opts.sweep or opts.only_sweep:
        report["hint_sweep"] = hint_sweep(torch.bfloat16, opts.iters)
        if opts.only_sweep:
            return
    if opts.shapes:
        shapes = [("custom", tuple(int(v) for v in s.split("x"))) for s in opts.shapes.split(",")]
    else:
        shapes = [(c, shape) for c in opts.cases.split(",") for shape in CASES[c]]
    providers = tuple(p.strip() for p in opts.providers.split(","))
    cap = torch.cuda.get_device_capability()
    cc = cap[0] * 10 + cap[1]
    cases = [(dname, case, rows, cols, backward) for dname in opts.dtypes.split(",") for case, (rows, cols) in shapes
             for backward in (False, True)]
    plan = []
    for dname, case, rows, cols, backward in cases:
        args = _meta_arguments(rows, cols, DTYPES[dname], backward)
        plan.append((args, timed_kernels(args, cc, providers, 0 if opts.public_only else opts.top)[0]))
    if opts.workers > 1:
        precompile(plan, cc, opts.workers)
    slug = re.sub(r"[^A-Za-z0-9]+", "_", device).strip("_")
    os.makedirs(opts.out, exist_ok=True)
    name = f"softmax-{slug}-{opts.tag}.json"
    path = os.path.join(opts.out, name)

    def save() -> None:  # after every case, so that a run cut short keeps what it measured
        for target in [path] + ([os.path.join(os.environ["OUT"], name)] if os.environ.get("OUT") else []):
            with open(target, "w") as f:
                results_io.dump(lean_report(report) if opts.lean else report, f)

    if not opts.skip_public:
        report["public"] = []
        print("public path, back-to-back calls (host cost included); x torch = torch's time / ours", flush=True)
        for dname in opts.dtypes.split(","):
            for case, (rows, cols) in shapes:
                for entry in public_case(rows, cols, DTYPES[dname], opts.public_repeat, public_ops):
                    entry["case"] = case
                    report["public"].append(entry)
                    print(_public_row(entry), flush=True)
                torch.cuda.empty_cache()
                save()
        timed = [e for e in report["public"] if "x_torch" in e]
        behind = [e for e in timed if e["x_torch"] < 1.0]
        report["public_summary"] = {"cases": len(report["public"]), "timed": len(timed), "behind_torch": len(behind)}
        if opts.public_only:
            print("\npublic path against torch (x torch = torch's time / ours)")
            for e in report["public"]:
                print(_public_row(e))
            print(f"{len(timed) - len(behind)}/{len(report['public'])} cases at 1.0x torch or better"
                  + ("; behind: " + ", ".join(f"{e['dtype']} {e['op']} {e['shape'][0]}x{e['shape'][1]} "
                                              f"{e['x_torch']:.2f}x (x wrapped {e.get('x_wrapped', 0):.2f})"
                                              for e in behind) if behind else ""))
            print("(x wrapped: torch's call behind one Python function, the floor of a Python front door)")
            print(_public_table(report["public"]))
            print(f"wrote {path}")
            return
    report["results"] = []
    print(_HEADER, flush=True)
    for (dname, case, rows, cols, backward), (_, kernels) in zip(cases, plan):
        t0 = time.perf_counter()
        entry = bench_case(rows, cols, DTYPES[dname], backward, opts.iters, opts.repeats,
                           {k.metadata.kernel_name for k in kernels})
        entry["case"] = case
        summarise(entry, copy_tbs)
        report["results"].append(entry)
        torch.cuda.empty_cache()
        print(_row(entry) + f"  ({time.perf_counter() - t0:.0f} s)", flush=True)
        save()
    if not opts.skip_host:
        report["host_overhead"] = host_overhead()
        report["cubin_cache"] = cache_timing()
    save()
    # ---- the table, last
    print(f"\nSoftmax on {device}; copy rate {copy_tbs:.3f} TB/s (read+write); TB/s = bytes moved once / time; "
          f"median of {opts.repeats} run(s) [min-max]")
    print(_HEADER)
    for e in report["results"]:
        print(_row(e))
    if report.get("public"):
        print("\npublic path against torch (x torch = torch's time / ours)")
        for e in report["public"]:
            print(_public_row(e))
        summary = report["public_summary"]
        print(f"{summary['timed'] - summary['behind_torch']}/{summary['cases']} cases at 1.0x torch or better")
    if "host_overhead" in report:
        h = report["host_overhead"]
        print("host us/call: " + ", ".join(f"{k}={v:.2f}" for k, v in h.items() if k.endswith("_us")))
        c = report["cubin_cache"]
        print(f"cubin cache: cold compile {c['cold_compile_ms']:.1f} ms, disk hit {c['disk_hit_ms']:.2f} ms")
    print(f"wrote {path}")


_HEADER = (f"{'dtype':5s} {'op':3s} {'shape':>13s} {'MB':>6s} | {'torch':>5s} | {'PickBest':>5s} {'spread':>11s} "
           f"{'x torch':>7s} | {'PickAny':>5s} {'any/best':>8s} | winner (PickAny's choice if different)")


def _row(e: dict) -> str:
    shape = f"{e['shape'][0]}x{e['shape'][1]}"
    mb = e["bytes"] / (3 if e["op"] == "bwd" else 2) / 2**20
    torch_tbs = e["torch_tbs"] or float("nan")
    best = e["kernels"].get(e["best"], {}) if e["best"] else {}
    any_ = e["kernels"].get(e["pick_any"], {})
    spread = best.get("tbs_spread", [float("nan")] * 2)
    dt = {"bfloat16": "bf16", "float16": "f16", "float32": "f32"}.get(e["dtype"], e["dtype"])
    text = (f"{dt:5s} {e['op']:3s} {shape:>13s} {mb:6.0f} | {torch_tbs:5.2f} | {best.get('tbs', float('nan')):5.2f} "
            f"[{spread[0]:4.2f}-{spread[1]:4.2f}] {best.get('x_torch', float('nan')):7.2f} | "
            f"{any_.get('tbs', float('nan')):5.2f} {e['pick_any_over_best'] or float('nan'):8.2f} | {e['best']}")
    if e["pick_any"] != e["best"]:
        text += f" ({e['pick_any']})"
    return text


if __name__ == "__main__":
    main()
