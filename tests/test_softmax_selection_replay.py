"""PickAny's softmax choice against the recorded measurements (issue #16, goal 7: within 10 %
of the measured best on every recorded case), replayed on the CPU.

`benchmarks/softmax.py --replay` ranks today's candidates with today's cost model for every
case of the H100/H200 softmax results (benchmarks/results/softmax-NVIDIA_*.json) and takes
the best-ranked kernel that the case measured; its time against the case's fastest is the
ratio checked here. A results file that is missing skips its tests.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
WITHIN = 0.9

#: The recorded files of the results[] structure, replayed in full (a new results file is
#: added here once PickAny has been checked against it).
FILES = [
    "softmax-NVIDIA_H100_80GB_HBM3-s22-h100.json",
    "softmax-NVIDIA_H100_80GB_HBM3-s23-rowgroup.json",
    "softmax-NVIDIA_H100_80GB_HBM3-s24-rowgroup-plan.json",
    "softmax-NVIDIA_H200-s21.json",
    "softmax-NVIDIA_H200-s22-h200.json",
    "softmax-NVIDIA_H200-s25-shared-run.json",
    "softmax-NVIDIA_H200-s25-wide.json",
    "softmax-NVIDIA_H200-s25.json",
    "softmax-NVIDIA_H200-s26-before.json",
    "softmax-NVIDIA_H200-s26-chunkref.json",
    "softmax-NVIDIA_H200-s26-online.json",
    "softmax-NVIDIA_H200-s26-s25kernel.json",
    "softmax-NVIDIA_H200-s34-walk.json",
    "softmax-NVIDIA_H200-s34-final-long.json",
    "softmax-NVIDIA_H200-s35-window.json",
    "softmax-NVIDIA_H100_80GB_HBM3-s35-window.json",
    "softmax-NVIDIA_H200-s36-builds.json",
    "softmax-NVIDIA_H100_80GB_HBM3-s36-builds.json",
    "softmax-NVIDIA_H200-s36-final.json",
    "softmax-NVIDIA_H100_80GB_HBM3-s36-final-h100.json",
    "softmax-NVIDIA_H200-s36-vocab.json",
    "softmax-NVIDIA_H200-s36-vocab2.json",
    "softmax-NVIDIA_H200-s36-vocab-after.json",
    "softmax-NVIDIA_H200-s36-vocab-few.json",
    "softmax-NVIDIA_H100_80GB_HBM3-s36-vocab-h100.json",
]

#: The cases this cost model brought within 10 %: (file, dtype, op, rows, cols, the ratio
#: best ms / choice ms before it, when PickAny took the looped kernel for the f32 backward and
#: the ept32 register kernel for the 8192x32768 forward), and the kernel it takes now.
FIXED = [
    ("softmax-NVIDIA_H100_80GB_HBM3-s22-h100.json", "float32", "bwd", 4096, 50257, 0.672, "split_ept16_c8"),
    ("softmax-NVIDIA_H200-s21.json", "float32", "bwd", 4096, 50257, 0.722, "split_ept16_c8"),
    ("softmax-NVIDIA_H200-s22-h200.json", "float32", "bwd", 4096, 50257, 0.723, "split_ept16_c8"),
    ("softmax-NVIDIA_H200-s25-wide.json", "float32", "bwd", 4096, 50257, 0.729, "split_ept16_c8"),
    ("softmax-NVIDIA_H200-s25-wide.json", "float32", "bwd", 1024, 50257, 0.743, "split_ept16_c8"),
    ("softmax-NVIDIA_H200-s25-wide.json", "float32", "bwd", 8192, 32768, 0.662, "split_ept16_c4"),
    ("softmax-NVIDIA_H200-s25-wide.json", "float32", "fwd", 8192, 32768, 0.869, "_smem_"),
    # (within 10 % before, at 0.902; the shared-memory kernel now, as measured best)
    ("softmax-NVIDIA_H200-s25-wide.json", "bfloat16", "fwd", 8192, 32768, 0.902, "_smem_"),
]

#: Recorded cases outside 10 % that no cost model should follow: what each measured.
NOT_MODEL_MISSES = {
    # The pick's two runs were 0.0470 and 0.0866 ms (their median 0.0668): its fast run is
    # within 1 % of the best, as the f16 case of the same file (0.0474 against 0.0473).
    ("softmax-NVIDIA_H100_80GB_HBM3-s22-h100.json", "bfloat16", "fwd", 8192, 4097): "noisy",
    # Measured before the block kernels' CTAs became warp multiples (commit 49bf0ba): the
    # ept16 kernel then ran 512 threads with half its elements; the same shapes after it
    # (s22-h200, H100 s22) measure today's pick, ept16, best.
    ("softmax-NVIDIA_H200-s21.json", "bfloat16", "bwd", 8192, 4097): "superseded",
    ("softmax-NVIDIA_H200-s21.json", "float16", "bwd", 8192, 4097): "superseded",
    # The pick's two runs were 0.0058 and 0.0152 ms: its fast run is 0.95 of the best (0.0055).
    ("softmax-NVIDIA_H100_80GB_HBM3-s38-shortrows-heldout-f16-h100.json.gz", "float16", "fwd", 96, 10000): "noisy",
}


#: Recorded cases outside 10 % that the cost model does not get right yet (issue #16, goal 7):
#: the ratios the replay gives.
OPEN_MISSES = {
    # (two rows: the window backward 7.0 us against the cluster split's 8.1, a launch's latency apart)
    ("softmax-NVIDIA_H200-s36-vocab-few.json", "float32", "bwd", 2, 128256): "0.86: window on 2 rows",
    # (the two-CTA row-group kernel 19.8 us, the window 22.9: the window's cost is a fixed share of
    # the row-group family's)
    ("softmax-NVIDIA_H200-s36-vocab-few.json", "bfloat16", "bwd", 64, 128256): "0.87: two-CTA row-group",
}

#: Session 36's open misses that session 37's few-row terms brought within 10 %: (file, dtype, op,
#: rows, cols, the ratio before, the family taken now). The cluster splits' waves
#: (`policies.CLUSTER_PACKING`), the smem kernels' lone CTAs (`softmax_smem.LONE_CTA_SHARE`) and
#: the long-row families on 16-47 rows of 128 KB (`softmax_rowgroup.ranks_long_rows`).
FIXED_FEW_ROWS = [
    ("softmax-NVIDIA_H200-s36-vocab-after.json", "bfloat16", "bwd", 64, 100000, 0.65, "SmemYBackward"),
    ("softmax-NVIDIA_H200-s36-vocab-after.json", "float16", "bwd", 64, 100000, 0.66, "SmemYBackward"),
    ("softmax-NVIDIA_H200-s36-vocab-few.json", "bfloat16", "bwd", 32, 100000, 0.74, "WindowBackward"),
    ("softmax-NVIDIA_H200-s36-vocab-few.json", "bfloat16", "fwd", 32, 100000, 0.80, "RowGroupForward"),
    ("softmax-NVIDIA_H200-s36-vocab-few.json", "bfloat16", "fwd", 16, 128256, 0.81, "RowGroupForward"),
    ("softmax-NVIDIA_H100_80GB_HBM3-s36-vocab-h100.json", "bfloat16", "fwd", 32, 100000, 0.73, "RowGroupForward"),
    ("softmax-NVIDIA_H100_80GB_HBM3-s36-vocab-h100.json", "float16", "fwd", 32, 100000, 0.76, "RowGroupForward"),
    ("softmax-NVIDIA_H100_80GB_HBM3-s36-vocab-h100.json", "bfloat16", "bwd", 32, 100000, 0.71, "WindowBackward"),
    ("softmax-NVIDIA_H100_80GB_HBM3-s36-vocab-h100.json", "float16", "bwd", 32, 100000, 0.73, "WindowBackward"),
]

#: Session 37's dense sweeps of few long rows (2-256 rows of 28K-152K elements, H100 and H200)
#: and of few shorter rows (H200),
#: replayed for the cases within 10 % of the measured best and the worst ratio: the terms above were
#: fitted on the ``fewrows`` files and checked on the ``heldout`` ones, measured afterwards on other
#: shapes and f16 (there 450 of 504 within 10 %, against 359 for session 36's model). What is left
#: outside 10 % (0.76-0.90) is close families trading places: row-group against window, the
#: cluster split's variants, the smem kernels against the splits at 36-64 rows.
FEW_ROWS_FILES = {
    "softmax-NVIDIA_H100_80GB_HBM3-s37-fewrows-bf16-h100.json.gz": (170, 182),
    "softmax-NVIDIA_H100_80GB_HBM3-s37-fewrows-f32-h100.json.gz": (91, 100),
    "softmax-NVIDIA_H200-s37-fewrows-bf16.json.gz": (55, 64),
    "softmax-NVIDIA_H200-s37-fewrows-bf16b.json.gz": (115, 118),
    "softmax-NVIDIA_H200-s37-fewrows-f32.json.gz": (94, 100),
    "softmax-NVIDIA_H100_80GB_HBM3-s37-heldout-f16-h100.json.gz": (112, 126),
    "softmax-NVIDIA_H100_80GB_HBM3-s37-heldout-f32-h100.json.gz": (119, 126),
    "softmax-NVIDIA_H200-s37-heldout-f16.json.gz": (111, 126),
    "softmax-NVIDIA_H200-s37-heldout-f32.json.gz": (118, 126),
    # (1-128 rows of 8K-32K elements, measured after session 37's terms were set: 108 of 140,
    # session 36's model 104; the misses were 5-9 us problems where the register kernels' plain
    # launch beat the cluster splits and the smem kernels by 0.5-1.5 us. Session 38's fixed time
    # of the staged designs (`policies.STAGED_ROW_LATENCY_BYTES`) and the register rows' lone
    # CTAs (`policies.REGISTER_ROW_LONE_SHARE`) were fitted here: 132 of 140)
    "softmax-NVIDIA_H200-s37-shortrows-bf16.json.gz": (70, 70),
    "softmax-NVIDIA_H200-s37-shortrows-f32.json.gz": (62, 70),
    # (session 38: 2-96 rows of 2K-28K elements, f16/bf16/f32, H200, measured to check the two
    # terms at 4 MB and then used to set 6: 250 of 252, session 37's model 102)
    "softmax-NVIDIA_H200-s38-shortrows-heldout-bf16.json.gz": (84, 84),
    "softmax-NVIDIA_H200-s38-shortrows-heldout-f16.json.gz": (84, 84),
    "softmax-NVIDIA_H200-s38-shortrows-heldout-f32.json.gz": (82, 84),
    # (session 38, H100, measured after the terms were set: both short-row grids, 379 of 392;
    # session 37's model 198)
    "softmax-NVIDIA_H100_80GB_HBM3-s38-shortrows-bf16-h100.json.gz": (69, 70),
    "softmax-NVIDIA_H100_80GB_HBM3-s38-shortrows-f32-h100.json.gz": (62, 70),
    "softmax-NVIDIA_H100_80GB_HBM3-s38-shortrows-heldout-bf16-h100.json.gz": (84, 84),
    "softmax-NVIDIA_H100_80GB_HBM3-s38-shortrows-heldout-f16-h100.json.gz": (83, 84),
    "softmax-NVIDIA_H100_80GB_HBM3-s38-shortrows-heldout-f32-h100.json.gz": (81, 84),
    # (session 38, H200, measured after the terms were set: 192-1536 rows of 3K-70K elements,
    # where the staged designs' fixed time is 0.005-2.6x the problem's bytes; session 37's model also
    # 75 of 80, its worst 0.79, now 0.87)
    "softmax-NVIDIA_H200-s38-midrows-bf16.json.gz": (37, 40),
    "softmax-NVIDIA_H200-s38-midrows-f32.json.gz": (38, 40),
}
FEW_ROWS_WORST = 0.75


@functools.lru_cache(maxsize=1)
def _bench():
    spec = importlib.util.spec_from_file_location("_softmax_bench", os.path.join(ROOT, "benchmarks", "softmax.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _results_io():
    spec = importlib.util.spec_from_file_location("_results_io", os.path.join(ROOT, "benchmarks", "results_io.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@functools.lru_cache(maxsize=None)
def _replayed(name: str) -> dict:
    path = os.path.join(RESULTS, name)
    if not os.path.exists(path):
        pytest.skip(f"{name} is not in benchmarks/results")
    got = _bench().replay_file(path)
    assert "unusable" not in got, got
    return got


def _case(name: str, dtype: str, op: str, rows: int, cols: int) -> dict:
    found = [c for c in _replayed(name)["cases"]
             if (c["dtype"], c["op"], tuple(c["shape"])) == (dtype, op, (rows, cols))]
    assert len(found) == 1, (name, dtype, op, rows, cols, len(found))
    return found[0]


@pytest.mark.parametrize("name,dtype,op,rows,cols,before,kernel", FIXED)
def test_fixed_cases_choose_within_10_percent(name, dtype, op, rows, cols, before, kernel):
    c = _case(name, dtype, op, rows, cols)
    assert kernel in c["choice"], c
    assert c["ratio"] >= WITHIN, c
    assert c["ratio"] > before


@pytest.mark.parametrize("name,dtype,op,rows,cols,before,family", FIXED_FEW_ROWS)
def test_few_row_cases_fixed_in_session_37(name, dtype, op, rows, cols, before, family):
    c = _case(name, dtype, op, rows, cols)
    assert c["choice"].startswith("CudaSoftmax" + family), c
    assert c["ratio"] >= WITHIN and c["ratio"] > before, c


@pytest.mark.parametrize("name", sorted(FEW_ROWS_FILES))
def test_few_row_sweeps_keep_their_share_within_10_percent(name):
    """The dense few-row sweeps keep at least the cases within 10 % they had when the terms were
    set, and no case below `FEW_ROWS_WORST` (but a noisy measurement, `NOT_MODEL_MISSES`)."""
    within, total = FEW_ROWS_FILES[name]
    cases = [c for c in _replayed(name)["cases"] if c["ratio"] is not None]
    assert len(cases) == total
    got = sum(c["ratio"] >= WITHIN for c in cases)
    worst = min((c for c in cases if (name, c["dtype"], c["op"], *c["shape"]) not in NOT_MODEL_MISSES),
                key=lambda c: c["ratio"])
    assert got >= within, f"{got}/{total} within 10 % (was {within})"
    assert worst["ratio"] >= FEW_ROWS_WORST, worst


@pytest.mark.parametrize("name", FILES)
def test_every_recorded_case_within_10_percent(name):
    """Every case of the file chooses within 10 % of its measured best, but the few whose
    measurement no model should follow (`NOT_MODEL_MISSES`) and the open misses (`OPEN_MISSES`)."""
    outside = []
    for c in _replayed(name)["cases"]:
        key = (name, c["dtype"], c["op"], *c["shape"])
        if c["ratio"] is None:
            continue
        if c["ratio"] < WITHIN and key not in NOT_MODEL_MISSES and key not in OPEN_MISSES:
            outside.append(f"{c['dtype']} {c['op']} {c['shape']}: {c['choice']} at {c['ratio']:.3f} of {c['best']}")
    assert not outside, "\n".join(outside)


def test_replay_leaves_out_unknown_kernels_and_says_when_the_top_was_not_measured(tmp_path):
    """A kernel name no longer registered is left out (and reported); when PickAny's top choice
    was not measured, the first measured kernel in its ranking stands in, flagged; a recorded
    ``ms`` list counts by its median; a file of another structure is reported unusable."""
    import torch
    from kernel_api import get_kernels
    from kernel_api.tuning.policies import rank_candidates

    bench = _bench()
    args = bench._meta_arguments(4096, 50257, torch.float32, True)
    ranked = [k.metadata.kernel_name for k in rank_candidates(get_kernels(args, cc=90), args, sm_count=132)]
    first, second = ranked[1], ranked[2]  # (the top is left unmeasured)
    case = {"shape": [4096, 50257], "dtype": "float32", "op": "bwd", "pick_any": "x",
            "kernels": {second: {"ms": 1.1, "ms_runs": [1.0, 1.2]},
                        first: {"ms": [1.0, 1.4, 1.3]},
                        "CudaSoftmaxBackward_f32_gone_a4": {"ms": 0.5},
                        ranked[3]: {"error": "failed"}}}
    path = tmp_path / "softmax-test.json"
    path.write_text(json.dumps({"device": "test", "results": [case]}))
    got = bench.replay_file(str(path))
    assert got["sms"] == bench.REPLAY_SMS
    (c,) = got["cases"]
    assert c["skipped"] == ["CudaSoftmaxBackward_f32_gone_a4"]
    assert c["top"] == ranked[0] and c["top_unmeasured"]
    assert (c["choice"], c["choice_ms"], c["choice_runs"]) == (first, 1.3, None)
    assert (c["best"], c["best_ms"]) == (second, 1.1)
    assert c["ratio"] == pytest.approx(1.1 / 1.3)
    old = tmp_path / "softmax-old.json"
    old.write_text(json.dumps({"device": "test", "forward": [], "backward": []}))
    assert "unusable" in bench.replay_file(str(old))


def test_lean_report_drops_only_the_derived_fields_and_replays_alike(tmp_path):
    """`softmax.lean_report` (``--lean``) keeps every measured field a replay reads and drops the
    per-kernel ones `summarise` derives from them; a lean file replays as the full one."""
    bench = _bench()
    name = "softmax-NVIDIA_H200-s38-shortrows-heldout-bf16.json.gz"
    full = _results_io().load(os.path.join(RESULTS, name))
    entry = {**full["results"][0], "kernels": {n: {**k, "tbs": 1.0, "tbs_spread": [0.9, 1.1], "frac_copy": 0.3,
                                                   "x_torch": 2.0}
                                               for n, k in full["results"][0]["kernels"].items()}}
    report = {**full, "results": [entry]}
    lean = bench.lean_report(report)
    assert "derived_fields_dropped" in lean and report["results"][0]["kernels"] == entry["kernels"]  # not mutated
    for n, k in lean["results"][0]["kernels"].items():
        assert not set(bench.DERIVED_KERNEL_FIELDS) & set(k), (n, k)
        assert {f: v for f, v in entry["kernels"][n].items() if f not in bench.DERIVED_KERNEL_FIELDS} == k
    paths = []
    for label, doc in (("full", report), ("lean", lean)):
        paths.append(tmp_path / f"softmax-{label}.json")
        paths[-1].write_text(json.dumps(doc))
    a, b = (bench.replay_file(str(p))["cases"] for p in paths)
    assert a == b and a[0]["ratio"] is not None
