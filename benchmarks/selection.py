"""Selection on the GPU: PickBest tunes and records; a second process reuses the record;
warm (disk-cached) compile time; and how well PickAny's heuristic ranks kernels.

    python benchmarks/selection.py [--shapes 4096x4096x4096,...] [--workers 16] [--max-candidates 24]
    python benchmarks/selection.py --torch-evidence [--top 4] [--budget-s 120]
    python benchmarks/selection.py --replay benchmarks/results/selection_torch-<device>.json   # no GPU needed

Prints a table last and writes benchmarks/results/selection-<device>.json.

``--torch-evidence``: the torch (cuBLAS) provider's PickAny cost against measurement, for GPT-2's
GEMMs (prefill M = 8192 with the model's layouts and fused bias / gelu, the lm_head's aligned
50256 columns and its whole 50257, decode M = 64, the backward's dX and dW) and the issue #16
sweep shapes: PickAny's choice with and without the torch provider, PickBest's winner among our
top ``--top`` kernels by PickAny's ranking plus cuBLAS (each timed, CUDA events, median), and
whether PickAny's choice is within 10% of PickBest's winner. Writes
benchmarks/results/selection_torch-<device>.json.

``--replay FILE``: PickAny's choice under the current cost model for each case of a recorded
``--torch-evidence`` run, looked up in that run's timings (on meta tensors, for the 132 SMs of an
H100/H200: no GPU needed). A cost-model change can be checked against the measurements that
prompted it; a choice the run did not time is reported as such. In-sample by construction: the
next GPU run is the check.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

import torch  # noqa: E402

import kernel_api  # noqa: E402
from kernel_api.core.arch import planning_sm_count  # noqa: E402
from kernel_api.ops.dispatch import padded_output  # noqa: E402
from kernel_api.tuning.policies import PickBest, estimated_cost  # noqa: E402

SWEEP = ["8192x8192x8192", "4096x4096x4096", "2048x2048x2048", "4096x14336x4096", "4096x4096x14336",
         "128x8192x8192", "16384x1024x16384"]

SECOND_PROCESS = """
import sys, time; sys.path.insert(0, {root!r})
import torch, kernel_api
from kernel_api.tuning.policies import PickBest
A = torch.randn({m}, {k}, device="cuda", dtype=torch.bfloat16)
B = torch.randn({k}, {n}, device="cuda", dtype=torch.bfloat16)
picker = PickBest(num_workers=1)
t0 = time.perf_counter()
with kernel_api.settings(policy=picker):
    out = kernel_api.ops.gemm(A, B)
torch.cuda.synchronize()
elapsed = time.perf_counter() - t0
args = kernel_api.GemmArguments(A, B, out)
result = picker.tune(args)
err = ((out.double() - A.double() @ B.double()).norm() / (A.double() @ B.double()).norm()).item()
print("RESULT", result.from_record, result.winner.metadata.kernel_name, elapsed, err)
"""

WARM_COMPILE = """
import sys, time; sys.path.insert(0, {root!r})
import torch, kernel_api
A = torch.randn({m}, {k}, device="cuda", dtype=torch.bfloat16)
B = torch.randn({k}, {n}, device="cuda", dtype=torch.bfloat16)
out = torch.empty({m}, {n}, device="cuda", dtype=torch.bfloat16)
args = kernel_api.GemmArguments(A, B, out)
kernel = [k for k in kernel_api.get_kernels(args) if k.metadata.kernel_name == {name!r}][0]
import cutlass, tvm_ffi  # toolchain import is a once-per-process cost, reported apart
t0 = time.perf_counter(); art = kernel.compile(args); t1 = time.perf_counter()
kernel.run(args, compiled_artifact=art); torch.cuda.synchronize()
print("COMPILE", t1 - t0)
"""


def spearman(xs: list[float], ys: list[float]) -> float:
    def ranks(v):
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for t in range(i, j + 1):
                r[order[t]] = (i + j) / 2
            i = j + 1
        return r
    rx, ry = ranks(xs), ranks(ys)
    n = len(xs)
    mx, my = sum(rx) / n, sum(ry) / n
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    vx = sum((a - mx) ** 2 for a in rx) ** 0.5
    vy = sum((b - my) ** 2 for b in ry) ** 0.5
    return cov / (vx * vy) if vx and vy else float("nan")


# (label, M, N, K, kind): the operands as GPT-2 has them (kinds in _evidence_args).
GPT2_GEMMS = [("c_attn", 8192, 2304, 768, "conv1d"), ("attn.c_proj", 8192, 768, 768, "conv1d"),
              ("c_fc+gelu", 8192, 3072, 768, "conv1d_gelu"), ("mlp.c_proj", 8192, 768, 3072, "conv1d"),
              ("lm_head aligned part", 8192, 50256, 768, "lm_head_head"), ("lm_head whole", 8192, 50257, 768, "lm_head"),
              ("c_attn M=64", 64, 2304, 768, "conv1d"), ("c_fc+gelu M=64", 64, 3072, 768, "conv1d_gelu"),
              ("mlp.c_proj M=64", 64, 768, 3072, "conv1d"), ("lm_head M=64", 64, 50257, 768, "lm_head"),
              ("c_attn dX", 8192, 768, 2304, "dX"), ("c_fc dX", 8192, 768, 3072, "dX"),
              ("mlp.c_proj dX", 8192, 3072, 768, "dX"), ("c_attn dW", 768, 2304, 8192, "dW"),
              ("c_fc dW", 768, 3072, 8192, "dW"), ("mlp.c_proj dW", 3072, 768, 8192, "dW")]


def _evidence_args(M: int, N: int, K: int, kind: str):
    """GemmArguments with GPT-2's layouts: Conv1D weights (K, N) row-major with a row bias;
    the lm_head's weight (vocab, 768) read transposed (column-major B); dX = dY @ W^T (B a
    column-major view); dW = X^T @ dY (A a column-major view); "plain": row-major A and B."""
    bf = dict(device="cuda", dtype=torch.bfloat16)
    epilogue = None
    if kind.startswith("conv1d"):
        A, B = torch.randn(M, K, **bf), torch.randn(K, N, **bf) * 0.05
        epilogue = kernel_api.EpilogueArguments(bias=torch.randn(N, **bf),
                                                activation="gelu" if kind.endswith("gelu") else None)
        out = torch.empty(M, N, **bf)
    elif kind in ("lm_head", "lm_head_head"):
        A, B = torch.randn(M, K, **bf), torch.randn(50257, K, **bf).t()[:, :N]
        # the aligned part is written into the padded rows ops.gemm allocates (50264 elements
        # before session 31, 50304 since: `dispatch.padded_output`)
        out = padded_output(A, 50257)[:, :N] if kind == "lm_head_head" else torch.empty(M, N, **bf)
    elif kind == "dX":
        A, B = torch.randn(M, K, **bf), torch.randn(N, K, **bf).t()
        out = torch.empty(M, N, **bf)
    elif kind == "dW":
        A, B = torch.randn(K, M, **bf).t(), torch.randn(K, N, **bf)
        out = torch.empty(M, N, **bf)
    else:
        A, B, out = torch.randn(M, K, **bf), torch.randn(K, N, **bf), torch.empty(M, N, **bf)
    return kernel_api.GemmArguments(A, B, out, epilogue=epilogue)


def torch_evidence(ns) -> None:
    """The ``--torch-evidence`` report (see the module docstring)."""
    from kernel_api.tuning.policies import rank_candidates
    device = torch.cuda.get_device_name()
    cases = GPT2_GEMMS + [(f"sweep {s}", *map(int, s.split("x")), "plain") for s in SWEEP]
    rows, t_start = [], time.perf_counter()
    path = os.path.join(ROOT, "benchmarks", "results", f"selection_torch-{device.replace(' ', '_')}.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)

    def save(done: bool) -> None:
        within = [r["pickany_within_10pct"] for r in rows if "pickany_within_10pct" in r]
        summary = dict(device=device, torch=torch.__version__, top=ns.top, complete=done, cases=rows,
                       pickany_within_10pct=f"{sum(within)}/{len(within)}")
        for target in [path] + ([os.path.join(os.environ["OUT"], os.path.basename(path))] if os.environ.get("OUT") else []):
            with open(target, "w") as f:
                json.dump(summary, f, indent=2)

    for label, M, N, K, kind in cases:
        if ns.budget_s and time.perf_counter() - t_start > ns.budget_s:
            rows.append(dict(case=label, skipped=f"past --budget-s {ns.budget_s:g}"))
            continue
        try:
            args = _evidence_args(M, N, K, kind)
            every = kernel_api.get_kernels(args)
            ours = [k for k in every if k.metadata.provider != "torch"]
            theirs = [k for k in every if k.metadata.provider == "torch"]
            ranked = rank_candidates(every, args)
            any_with = ranked[0].metadata.kernel_name
            any_without = rank_candidates(ours, args)[0].metadata.kernel_name if ours else None
            measured = rank_candidates(ours, args)[: ns.top] + theirs[:1]
            picker = PickBest(num_workers=ns.workers, max_candidates=None, use_records=False)
            result = picker.tune(args, candidates=measured, force=True)
            times = {m.kernel_name: m.median_ms for m in result.measurements if m.median_ms is not None}
            best = min(times.values())
            row = dict(case=label, M=M, N=N, K=K, kind=kind, pickany=any_with, pickany_ours_only=any_without,
                       pickbest=result.winner.metadata.kernel_name, pickbest_ms=best, times_ms=times,
                       failed={m.kernel_name: m.failure for m in result.measurements if m.failure},
                       torch_ms=next((v for k, v in times.items() if k.startswith("TorchGemm")), None),
                       pickany_ms=times.get(any_with), pickany_ours_only_ms=times.get(any_without))
            if row["pickany_ms"] is not None:
                row["pickany_within_10pct"] = row["pickany_ms"] <= 1.1 * best
        except Exception as exc:  # noqa: BLE001 - report and go on
            row = dict(case=label, error=f"{type(exc).__name__}: {str(exc)[:300]}")
        rows.append(row)
        if "error" in row or "skipped" in row:
            print(f"{label}: {row.get('error') or row.get('skipped')}", flush=True)
        else:
            print(f"{label}: PickAny {row['pickany']} ({row['pickany_ms']}), ours-only {row['pickany_ours_only']} "
                  f"({row['pickany_ours_only_ms']}), PickBest {row['pickbest']} {best:.4f} ms, torch {row['torch_ms']}",
                  flush=True)
        save(False)
    save(True)
    print(f"\ndevice {device}; PickBest among our top {ns.top} by PickAny's ranking and cuBLAS")
    print(f"{'case':26} {'best ms':>8} {'torch ms':>8} {'any ms':>8} {'ours1 ms':>8} {'any<=1.1x':>9}  PickAny / PickBest")
    fmt = lambda v: f"{v:8.4f}" if isinstance(v, float) else f"{'-':>8}"  # noqa: E731
    for r in rows:
        if "pickbest_ms" not in r:
            print(f"{r['case']:26} {r.get('error') or r.get('skipped')}")
            continue
        print(f"{r['case']:26} {fmt(r['pickbest_ms'])} {fmt(r['torch_ms'])} {fmt(r['pickany_ms'])} "
              f"{fmt(r['pickany_ours_only_ms'])} {str(r.get('pickany_within_10pct', '-')):>9}  "
              f"{r['pickany'][:40]} / {r['pickbest'][:40]}")
    within = [r["pickany_within_10pct"] for r in rows if "pickany_within_10pct" in r]
    print(f"PickAny within 10% of PickBest's winner on {sum(within)}/{len(within)} cases; wrote {path}")


def _meta_evidence_args(M: int, N: int, K: int, kind: str):
    """`_evidence_args` with every tensor on the meta device (shapes, strides, dtypes only)."""
    real_randn, real_empty = torch.randn, torch.empty
    try:
        torch.randn = lambda *a, **k: real_randn(*a, **{**k, "device": "meta"})
        torch.empty = lambda *a, **k: real_empty(*a, **{**k, "device": "meta"})
        return _evidence_args(M, N, K, kind)
    finally:
        torch.randn, torch.empty = real_randn, real_empty


def replay(path: str) -> None:
    """The ``--replay`` report (see the module docstring)."""
    from kernel_api.tuning.policies import rank_candidates

    recorded = json.load(open(path))
    print(f"replaying {path} ({recorded.get('device')}): PickAny now, in that run's timings")
    print(f"{'case':26} {'best ms':>8} {'now ms':>8} {'then ms':>8} {'now<=1.1x':>9}  PickAny now")
    within, timed = 0, 0
    for r in recorded.get("cases", []):
        if "times_ms" not in r:
            continue
        args = _meta_evidence_args(r["M"], r["N"], r["K"], r["kind"])
        choice = rank_candidates(kernel_api.get_kernels(args, cc=90), args)[0].metadata.kernel_name
        now = r["times_ms"].get(choice)
        ok = None if now is None else now <= 1.1 * r["pickbest_ms"]
        timed += now is not None
        within += bool(ok)
        shown = f"{now:8.4f}" if now is not None else f"{'untimed':>8}"
        then = r.get("pickany_ms")
        print(f"{r['case']:26} {r['pickbest_ms']:8.4f} {shown} {then if then is None else f'{then:8.4f}'} "
              f"{str(ok if ok is not None else '-'):>9}  {choice[:60]}")
    print(f"PickAny now within 10% of the run's PickBest winner on {within}/{timed} timed cases "
          f"(the run itself: {recorded.get('pickany_within_10pct')})")


def run_child(code: str, env: dict) -> str:
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900).stdout


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default=",".join(SWEEP))
    p.add_argument("--workers", type=int, default=min(16, os.cpu_count() or 1))
    p.add_argument("--max-candidates", type=int, default=24)
    p.add_argument("--torch-evidence", action="store_true", help="the torch provider's PickAny cost against "
                   "measurement on GPT-2's and the sweep's GEMMs (see the module docstring)")
    p.add_argument("--top", type=int, default=4, help="--torch-evidence: our kernels measured per case")
    p.add_argument("--budget-s", type=float, default=0, help="--torch-evidence: skip cases not started within "
                   "this many seconds (0: no limit)")
    p.add_argument("--replay", default=None, help="a --torch-evidence JSON: PickAny's choices now, in its timings")
    ns = p.parse_args()
    if ns.replay:
        replay(ns.replay)
        return
    if ns.torch_evidence:
        torch_evidence(ns)
        return
    cache = tempfile.mkdtemp(prefix="kernel_api_sel_")
    os.environ["KERNEL_API_CACHE_DIR"] = cache
    env = dict(os.environ)
    device = torch.cuda.get_device_name()
    sm = planning_sm_count(torch.device("cuda"))
    per_shape = []
    for shape in ns.shapes.split(","):
        m, n, k = map(int, shape.split("x"))
        A = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        B = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
        out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        args = kernel_api.GemmArguments(A, B, out)
        picker = PickBest(num_workers=ns.workers, max_candidates=ns.max_candidates)
        t0 = time.perf_counter()
        result = picker.tune(args, force=True)
        tune_s = time.perf_counter() - t0
        good = [m_ for m_ in result.measurements if m_.median_ms is not None]
        failed = [(m_.kernel_name, m_.failure) for m_ in result.measurements if m_.failure]
        by_name = {k_.metadata.kernel_name: k_ for k_ in kernel_api.get_kernels(args)}
        costs = [estimated_cost(by_name[m_.kernel_name], args, sm) for m_ in good]
        times = [m_.median_ms for m_ in good]
        rho = spearman(costs, times) if len(good) > 2 else float("nan")
        best = min(times)
        top_pick_ms = times[costs.index(min(costs))]
        per_shape.append(dict(shape=shape, candidates=len(result.measurements), verified=len(good), failed=failed,
                              winner=result.winner.metadata.kernel_name, best_ms=best, tune_s=tune_s, spearman=rho,
                              heuristic_pick_ms=top_pick_ms, heuristic_within_10pct=top_pick_ms <= 1.1 * best))
        print(f"{shape}: {len(good)}/{len(result.measurements)} verified, winner {result.winner.metadata.kernel_name} "
              f"{best * 1e3:.0f} us, spearman {rho:.2f}, tune {tune_s:.1f} s", flush=True)
    first = per_shape[0]
    m, n, k = map(int, first["shape"].split("x"))
    second = run_child(SECOND_PROCESS.format(root=ROOT, m=m, n=n, k=k), env)
    line = next((ln for ln in second.splitlines() if ln.startswith("RESULT")), "RESULT ? ? nan nan").split()
    reuse = dict(from_record=line[1] == "True", kernel=line[2], first_call_s=float(line[3]), rel_error=float(line[4]))
    warm = run_child(WARM_COMPILE.format(root=ROOT, m=m, n=n, k=k, name=first["winner"]), env)
    warm_s = float(next((ln.split()[1] for ln in warm.splitlines() if ln.startswith("COMPILE")), "nan"))
    rhos = [s["spearman"] for s in per_shape if s["spearman"] == s["spearman"]]
    summary = dict(device=device, shapes=per_shape, second_process=reuse, warm_compile_s=warm_s,
                   mean_spearman=sum(rhos) / len(rhos) if rhos else float("nan"),
                   heuristic_top_within_10pct=sum(s["heuristic_within_10pct"] for s in per_shape) / len(per_shape))
    path = os.path.join(ROOT, "benchmarks", "results", f"selection-{device.replace(' ', '_')}.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(summary, f, indent=2)
    out_dir = os.environ.get("OUT")
    if out_dir:
        with open(os.path.join(out_dir, os.path.basename(path)), "w") as f:
            json.dump(summary, f, indent=2)
    print(f"\ndevice {device}")
    print(f"{'shape':<18} {'verified':>9} {'best us':>9} {'spearman':>9} {'top pick<=1.1x':>15}  winner")
    for s in per_shape:
        print(f"{s['shape']:<18} {s['verified']:>4}/{s['candidates']:<4} {s['best_ms'] * 1e3:>9.0f} {s['spearman']:>9.2f} "
              f"{str(s['heuristic_within_10pct']):>15}  {s['winner']}")
    print(f"mean spearman {summary['mean_spearman']:.2f} (target >= 0.7); heuristic top pick within 10% of best on "
          f"{summary['heuristic_top_within_10pct'] * 100:.0f}% of shapes")
    print(f"second process: used record={reuse['from_record']} ({reuse['kernel']}), first ops.gemm call "
          f"{reuse['first_call_s'] * 1e3:.0f} ms, rel. error {reuse['rel_error']:.1e}")
    print(f"warm compile (disk cache hit) in a new process: {warm_s * 1e3:.1f} ms (target <= 20 ms)")


if __name__ == "__main__":
    main()
