"""PickAny's GEMM choice under today's cost model against recorded GPU measurements, on the CPU
(the goal: within 10 % of the measured best).

    python3 benchmarks/gemm_replay.py                     # every gemm_shapes / selection_torch result
    python3 benchmarks/gemm_replay.py benchmarks/results/gemm_shapes-NVIDIA_H200-mine.json ...

Two kinds of result file:

- ``gemm_shapes-<device>-<tag>.json`` (`benchmarks/gemm_shapes.py`): per case PickBest's timings
  of our best-ranked kernels (``pickbest_measured``) and the house timing of PickBest's winner,
  PickAny's choice of its day and cuBLAS (``median_ms``). A kernel's time is its house timing
  where it has one (the mean of the two when PickBest and PickAny chose the same kernel), else
  PickBest's; cuBLAS stands for the case's TorchGemm instance.
- ``selection_torch-<device>.json`` (older runs: GPT-2's GEMMs in their layouts and the
  sweep, each with our top kernels and cuBLAS timed by PickBest, ``times_ms``).

The replay itself is `kernel_api.tuning.replay` (meta tensors, cc 90, 132 SMs: an H100 / H200);
a choice the run did not time is reported ``untimed``. In-sample by construction: the next GPU
run is the check. Prints per case the ratio best / choice; writes the rows to
``benchmarks/results/gemm_replay.json``. The tests replay the curated cases of
``tests/data/measured_gemm_times.json`` the same way.
"""

from __future__ import annotations

import glob
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from kernel_api.tuning.replay import GemmProblem, candidates, replay_gemm  # noqa: E402
from results_io import RESULTS, write_result  # noqa: E402

#: GPT-2's layouts in the selection files: Conv1D weights (K, N) row-major with a row bias;
#: the lm_head's weight read transposed (its aligned part written into ops.gemm's padded rows);
#: dX = dY @ W^T (B column-major); dW = X^T @ dY (A column-major); "plain": row-major.
SELECTION_KINDS = {"conv1d": dict(bias=True), "conv1d_gelu": dict(bias=True, activation="gelu"),
                   "lm_head": dict(layouts="tnt"), "lm_head_head": dict(layouts="tnt", out_ld=50304),
                   "dX": dict(layouts="tnt"), "dW": dict(layouts="ntt"), "plain": {}}


def measured_cases(path: str) -> list[tuple[str, GemmProblem, dict[str, float]]]:
    """``(case, problem, times in ms)`` for every timed case of a result file."""
    with open(path) as f:
        doc = json.load(f)
    if os.path.basename(path).startswith("selection"):
        return [(r["case"], GemmProblem(r["M"], r["N"], r["K"], **SELECTION_KINDS[r["kind"]]), dict(r["times_ms"]))
                for r in doc.get("cases", []) if "times_ms" in r]
    found = []
    for group in doc["groups"].values():
        for r in group["cases"]:
            if "runs" not in r:
                continue
            problem = GemmProblem(**r["case"])
            times = {k: v for k, v in r.get("pickbest_measured", {}).items() if isinstance(v, (int, float))}
            house: dict[str, list[float]] = {}
            for slot in ("pickbest", "pickany"):  # (one kernel in both slots: the mean of its two)
                house.setdefault(r[slot], []).append(r["median_ms"][slot])
            times.update({k: sum(v) / len(v) for k, v in house.items()})
            cublas = next((k.metadata.kernel_name for k in candidates(problem.arguments(), tf32=problem.tf32)
                           if k.metadata.provider == "torch"), None)
            if cublas is not None:
                times[cublas] = r["median_ms"]["cublas"]
            found.append((r["name"], problem, times))
    return found


def main(argv: list[str]) -> None:
    paths = argv or sorted(glob.glob(os.path.join(RESULTS, "gemm_shapes-*.json"))
                           + glob.glob(os.path.join(RESULTS, "selection_torch-*.json")))
    if not paths:
        sys.exit(f"no result files in {RESULTS}: run benchmarks/gemm_shapes.py first, or name files")
    totals, report = [0, 0], {}
    for path in paths:
        rows = []
        for case, problem, times in measured_cases(path):
            r = replay_gemm(problem, times)
            rows.append(dict(case=case, choice=r.choice, choice_ms=r.choice_ms, best=r.best, best_ms=r.best_ms,
                             ratio=r.ratio, within=r.within))
        report[os.path.basename(path)] = rows
        print(f"\n== {os.path.basename(path)}")
        print(f"{'case':28} {'best ms':>8} {'now ms':>8} {'ratio':>6} {'ok':>5}  choice now")
        for r in rows:
            now = f"{r['choice_ms']:8.4f}" if r["choice_ms"] is not None else f"{'untimed':>8}"
            ratio = f"{r['ratio']:6.3f}" if r["ratio"] is not None else f"{'-':>6}"
            print(f"{r['case'][:28]:28} {r['best_ms']:8.4f} {now} {ratio} {str(r['within']):>5}  {r['choice'][:70]}")
        timed = [r for r in rows if r["within"] is not None]
        print(f"within 10 % now: {sum(r['within'] for r in timed)}/{len(timed)} timed ({len(rows) - len(timed)} untimed)")
        totals[0] += sum(r["within"] for r in timed)
        totals[1] += len(timed)
    print(f"\nall files: {totals[0]}/{totals[1]} timed cases within 10 % of the measured best")
    print("wrote", ", ".join(write_result("gemm_replay.json", {"files": report, "within": totals})))


if __name__ == "__main__":
    main(sys.argv[1:])
