"""PickAny's GEMM choice under today's cost model against recorded GPU measurements, on the CPU
(issue #16, goal 7: within 10 % of the measured best).

    python3 benchmarks/gemm_replay.py                       # every default file
    python3 benchmarks/gemm_replay.py benchmarks/results/gemm_shapes-NVIDIA_H200-s25-f64.json ...

Two kinds of recorded file:

- ``selection_torch-<device>.json`` (`benchmarks/selection.py --torch-evidence`): per case our
  top kernels by the ranking of its day and cuBLAS, timed by PickBest (``times_ms``); the best
  is the fastest of them. The same replay as ``selection.py --replay``.
- ``gemm_shapes-<device>-<tag>.json`` (`benchmarks/gemm_shapes.py`): per case PickBest's timings
  of our best-ranked kernels (``pickbest_measured``) and the house timing (alternating launches
  behind a sleep kernel, `small_m.time_group`) of PickBest's winner, PickAny's choice of its day
  and cuBLAS (``median_ms``). A kernel's time is its house timing where it has one (the mean of
  the two when PickBest and PickAny chose the same kernel), else PickBest's; cuBLAS stands for
  the case's TorchGemm instance.

Today's choice is the best-ranked candidate (meta tensors, 132 SMs: an H100/H200). When the
run did not time it, the choice is reported ``untimed`` (ratio None). In-sample by
construction: the next GPU run is the check.
"""

from __future__ import annotations

import glob
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "results")
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)

import torch  # noqa: E402

import kernel_api  # noqa: E402
from kernel_api.tuning.policies import rank_candidates  # noqa: E402

REPLAY_SMS = 132  # an H100 / H200
WITHIN = 1.1  # a choice within 10 % of the best: its time <= 1.1 x the best's

#: The files replayed by default: the H100 and H200 torch evidence, the H200 session 25
#: gemm_shapes groups (small_m, f32, f64), session 28's M = 64 / 128 group (narrow tiles), its
#: final run of every group (H200) and its H100 decode run (M = 8, 64, 128), and session 29's
#: M <= 16 runs with clusters of 2 at split 2 (H200, H100; rotated and shuffled house timing)
#: and its shuffled H200 runs of the odd, aligned, f32 and f64 groups and of M = 64 / 128;
#: sessions 30 and 31's odd group (31: the staged copies at a 128-byte pitch; then the
#: cooperative stream-K instance added; then PickBest's timing shuffled, odd and aligned groups).
DEFAULT_FILES = ["selection_torch-NVIDIA_H100_80GB_HBM3.json", "selection_torch-NVIDIA_H200.json",
                 "gemm_shapes-NVIDIA_H200-s25-small-m.json", "gemm_shapes-NVIDIA_H200-s25-small-m-pickany.json",
                 "gemm_shapes-NVIDIA_H200-s25-f32.json", "gemm_shapes-NVIDIA_H200-s25-f64.json",
                 "gemm_shapes-NVIDIA_H200-s28-narrow.json", "gemm_shapes-NVIDIA_H200-s28-final.json",
                 "gemm_shapes-NVIDIA_H100_80GB_HBM3-s28-h100.json", "gemm_shapes-NVIDIA_H200-s29-clusters.json",
                 "gemm_shapes-NVIDIA_H100_80GB_HBM3-s29-clusters-h100.json", "gemm_shapes-NVIDIA_H200-s29-shuffled.json",
                 "gemm_shapes-NVIDIA_H100_80GB_HBM3-s29-shuffled-h100.json",
                 "gemm_shapes-NVIDIA_H200-s29-shuffled-final.json", "gemm_shapes-NVIDIA_H200-s29-shuffled-m64.json",
                 "gemm_shapes-NVIDIA_H200-s30-odd.json", "gemm_shapes-NVIDIA_H100_80GB_HBM3-s30-odd-h100.json",
                 "gemm_shapes-NVIDIA_H200-s30-odd-final.json", "gemm_shapes-NVIDIA_H200-s31-odd.json",
                 "gemm_shapes-NVIDIA_H200-s31-odd-sk.json", "gemm_shapes-NVIDIA_H200-s31-shuffled-pickbest.json",
                 "gemm_shapes-NVIDIA_H100_80GB_HBM3-s31-odd-h100.json",
                 # session 37: model shapes and the wave-fitting tiles; session 38: small, batched
                 # and odd-shaped problems, models_more on an H100, 2048^3 after its change
                 "gemm_shapes-NVIDIA_H200-s37-models-a-192.json", "gemm_shapes-NVIDIA_H200-s37-models-b-192.json",
                 "gemm_shapes-NVIDIA_H100_80GB_HBM3-s37-models-192-h100.json",
                 "gemm_shapes-NVIDIA_H200-s37-models-more.json", "gemm_shapes-NVIDIA_H200-s37-wave-fit.json",
                 "gemm_shapes-NVIDIA_H100_80GB_HBM3-s37-wave-fit-h100.json",
                 "gemm_shapes-NVIDIA_H200-s37-wave-fit-224.json",
                 "gemm_shapes-NVIDIA_H100_80GB_HBM3-s37-wave-fit-224-h100.json",
                 "gemm_shapes-NVIDIA_H200-s38-small.json", "gemm_shapes-NVIDIA_H100_80GB_HBM3-s38-small-h100.json",
                 "gemm_shapes-NVIDIA_H100_80GB_HBM3-s38-models-more-h100.json",
                 "gemm_shapes-NVIDIA_H200-s38-batched-oddsmall.json", "gemm_shapes-NVIDIA_H200-s38-odd-sweep.json",
                 "gemm_shapes-NVIDIA_H200-s38-odd-sweep2.json", "gemm_shapes-NVIDIA_H200-s38-odd-tiny.json",
                 "gemm_shapes-NVIDIA_H100_80GB_HBM3-s38-2048-h100.json",
                 "gemm_shapes-NVIDIA_H100_80GB_HBM3-s38-2048-sustained-h100.json",
                 # session 39: small odd problems held out from the alignment-1 models' first fit,
                 # and from their second
                 "gemm_shapes-NVIDIA_H200-s39-odd-heldout.json", "gemm_shapes-NVIDIA_H200-s39-odd-heldout2.json",
                 "gemm_shapes-NVIDIA_H100_80GB_HBM3-s39-odd-h100.json",
                 # and f32 / f64 odd shapes
                 "gemm_shapes-NVIDIA_H200-s39-odd-wide-f32.json", "gemm_shapes-NVIDIA_H200-s39-odd-wide-f64.json",
                 "gemm_shapes-NVIDIA_H200-s39-odd-wide-f64-align1.json",
                 "gemm_shapes-NVIDIA_H200-s39-odd-wide-f64-final.json", "gemm_shapes-NVIDIA_H200-s39-f64-aligned.json",
                 "gemm_shapes-NVIDIA_H100_80GB_HBM3-s39-odd-wide-f32-h100.json",
                 "gemm_shapes-NVIDIA_H100_80GB_HBM3-s39-odd-wide-f64-h100.json",
                 "gemm_shapes-NVIDIA_H200-s39-odd-narrow.json"]


def _selection():
    import selection  # noqa: WPS433 (benchmarks/selection.py: its GPT-2 layouts)
    return selection


def _gemm_shapes():
    import gemm_shapes  # noqa: WPS433
    return gemm_shapes


def _meta_case_args(case) -> kernel_api.GemmArguments:
    """A gemm_shapes case's arguments on meta tensors (layouts and dtype as the run had them)."""
    gs = _gemm_shapes()
    dt = gs.DTYPES[case.dtype]
    lead = () if case.L is None else (case.L,)

    def operand(rows: int, cols: int, column_major: bool) -> torch.Tensor:
        if column_major:
            return torch.empty(*lead, cols, rows, dtype=dt, device="meta").transpose(-1, -2)
        return torch.empty(*lead, rows, cols, dtype=dt, device="meta")

    return gs.case_arguments(case, operand(case.M, case.K, case.layouts[0] == "n"),
                             operand(case.K, case.N, case.layouts[1] == "n"),
                             operand(case.M, case.N, case.layouts[2] == "n"))


def _row(label: str, times: dict[str, float], ranked: list[str], then: str | None) -> dict:
    best_name = min(times, key=times.get)
    choice = ranked[0]
    ms = times.get(choice)
    return dict(case=label, choice=choice, choice_ms=ms, best=best_name, best_ms=times[best_name],
                ratio=None if ms is None else times[best_name] / ms,
                within=None if ms is None else ms <= WITHIN * times[best_name],
                then=then, then_ms=times.get(then) if then else None)


def replay_selection(path: str) -> list[dict]:
    """A ``selection.py --torch-evidence`` file's timed cases, replayed."""
    sel = _selection()
    rows = []
    for r in json.load(open(path)).get("cases", []):
        if "times_ms" not in r:
            continue
        args = sel._meta_evidence_args(r["M"], r["N"], r["K"], r["kind"])
        ranked = [k.metadata.kernel_name for k in rank_candidates(kernel_api.get_kernels(args, cc=90), args,
                                                                   sm_count=REPLAY_SMS)]
        rows.append(_row(r["case"], dict(r["times_ms"]), ranked, r.get("pickany")))
    return rows


def replay_gemm_shapes(path: str) -> list[dict]:
    """A ``gemm_shapes.py`` file's timed cases (every group), replayed."""
    gs = _gemm_shapes()
    rows = []
    for group in json.load(open(path))["groups"].values():
        for r in group["cases"]:
            if "runs" not in r:
                continue
            case = gs.Case(**r["case"])
            args = _meta_case_args(case)
            candidates = gs.case_candidates(case, args)
            ranked = [k.metadata.kernel_name for k in rank_candidates(candidates, args, sm_count=REPLAY_SMS)]
            times = {k: v for k, v in r.get("pickbest_measured", {}).items() if isinstance(v, (int, float))}
            med = r["median_ms"]
            house: dict[str, list[float]] = {}
            for slot in ("pickbest", "pickany"):  # (one kernel in both slots: the mean of its two)
                house.setdefault(r[slot], []).append(med[slot])
            times.update({k: sum(v) / len(v) for k, v in house.items()})
            cublas = next((k.metadata.kernel_name for k in candidates if k.metadata.provider == "torch"), None)
            if cublas is not None:
                times[cublas] = med["cublas"]
            rows.append(_row(r["name"], times, ranked, r["pickany"]))
    return rows


def replay_file(path: str) -> list[dict]:
    return (replay_selection if os.path.basename(path).startswith("selection") else replay_gemm_shapes)(path)


def main(argv: list[str]) -> None:
    paths = argv or [os.path.join(RESULTS, f) for f in DEFAULT_FILES]
    totals = [0, 0]
    for path in paths:
        for p in sorted(glob.glob(path)) or [path]:
            if not os.path.exists(p):
                print(f"{p}: missing")
                continue
            rows = replay_file(p)
            print(f"\n== {os.path.basename(p)}")
            print(f"{'case':28} {'best ms':>8} {'now ms':>8} {'then ms':>8} {'ratio':>6} {'ok':>5}  choice now")
            for r in rows:
                now = f"{r['choice_ms']:8.4f}" if r["choice_ms"] is not None else f"{'untimed':>8}"
                then = f"{r['then_ms']:8.4f}" if r["then_ms"] is not None else f"{'-':>8}"
                ratio = f"{r['ratio']:6.3f}" if r["ratio"] is not None else f"{'-':>6}"
                print(f"{r['case'][:28]:28} {r['best_ms']:8.4f} {now} {then} {ratio} {str(r['within']):>5}  "
                      f"{r['choice'][:70]}")
            timed = [r for r in rows if r["within"] is not None]
            then_ok = sum(1 for r in rows if r["then_ms"] is not None and r["then_ms"] <= WITHIN * r["best_ms"])
            print(f"within 10 % now: {sum(r['within'] for r in timed)}/{len(timed)} timed "
                  f"({len(rows) - len(timed)} untimed); the run's own choice: {then_ok}/{len(rows)}")
            totals[0] += sum(r["within"] for r in timed)
            totals[1] += len(timed)
    print(f"\nall files: {totals[0]}/{totals[1]} timed cases within 10 % of the measured best")


if __name__ == "__main__":
    main(sys.argv[1:])
