"""PickAny's softmax choice against recorded measurements (the goal: within 10 % of the
measured best on every recorded case), replayed on the CPU.

`kernel_api.tuning.replay` ranks today's candidates with today's cost model for every case of
``tests/data/measured_softmax_times.json`` (H100 and H200 runs of benchmarks/softmax.py) and
takes the best-ranked kernel that the case measured; its time against the case's fastest is the
ratio checked here. ``benchmarks/softmax.py --replay`` prints the same replay for result files.
"""

from __future__ import annotations

import functools
import json
import os

import pytest

from kernel_api.tuning.replay import REPLAY_SMS, Replayed, SoftmaxProblem, ranked_names, replay_softmax

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "measured_softmax_times.json")
WITHIN = 0.9


@functools.lru_cache(maxsize=1)
def _runs() -> dict:
    with open(DATA) as f:
        return json.load(f)["runs"]


@functools.lru_cache(maxsize=None)
def _replayed(run: str) -> tuple[tuple[tuple, Replayed], ...]:
    """``((dtype, op, rows, cols), Replayed)`` per case of the run."""
    doc = _runs()[run]
    out = []
    for c in doc["cases"]:
        times = {k: ms for k, ms in zip(doc["kernels"], c["ms"]) if ms is not None}
        problem = SoftmaxProblem(*c["shape"], c["dtype"], c["op"])
        out.append(((c["dtype"], c["op"], *c["shape"]), replay_softmax(problem, times, sm_count=doc["sms"])))
    return tuple(out)


def _case(run: str, dtype: str, op: str, rows: int, cols: int) -> Replayed:
    found = [r for key, r in _replayed(run) if key == (dtype, op, rows, cols)]
    assert len(found) == 1, (run, dtype, op, rows, cols, len(found))
    return found[0]


#: The cases this cost model brought within 10 %: (run, dtype, op, rows, cols, the ratio
#: best ms / choice ms before it, when PickAny took the looped kernel for the f32 backward and
#: the ept32 register kernel for the 8192x32768 forward), and the kernel it takes now.
FIXED = [
    ("H100", "float32", "bwd", 4096, 50257, 0.672, "split_ept16_c8"),
    ("H200", "float32", "bwd", 4096, 50257, 0.722, "split_ept16_c8"),
    ("H200 (b)", "float32", "bwd", 4096, 50257, 0.723, "split_ept16_c8"),
    ("H200 wide", "float32", "bwd", 4096, 50257, 0.729, "split_ept16_c8"),
    ("H200 wide", "float32", "bwd", 1024, 50257, 0.743, "split_ept16_c8"),
    ("H200 wide", "float32", "bwd", 8192, 32768, 0.662, "split_ept16_c4"),
    ("H200 wide", "float32", "fwd", 8192, 32768, 0.869, "_smem_"),
    # (within 10 % before, at 0.902; the shared-memory kernel now, as measured best)
    ("H200 wide", "bfloat16", "fwd", 8192, 32768, 0.902, "_smem_"),
]

#: Recorded cases outside 10 % that no cost model should follow: what each measured.
NOT_MODEL_MISSES = {
    # The pick's two runs were 0.0470 and 0.0866 ms (their median 0.0668): its fast run is
    # within 1 % of the best, as the f16 case of the same run (0.0474 against 0.0473).
    ("H100", "bfloat16", "fwd", 8192, 4097): "noisy",
    # Measured before the block kernels' CTAs became warp multiples (commit 49bf0ba): the
    # ept16 kernel then ran 512 threads with half its elements; the same shapes after it
    # ("H200 (b)", "H100") measure today's pick, ept16, best.
    ("H200", "bfloat16", "bwd", 8192, 4097): "superseded",
    ("H200", "float16", "bwd", 8192, 4097): "superseded",
    # The pick's two runs were 0.0058 and 0.0152 ms: its fast run is 0.95 of the best (0.0055).
    ("H100 shortrows-heldout-f16", "float16", "fwd", 96, 10000): "noisy",
}

#: Recorded cases outside 10 % that the cost model does not get right yet (the goal: within 10 %):
#: the ratios the replay gives.
OPEN_MISSES = {
    # (two rows: the window backward 7.0 us against the cluster split's 8.1, a launch's latency apart)
    ("H200 vocab-few", "float32", "bwd", 2, 128256): "0.86: window on 2 rows",
    # (the two-CTA row-group kernel 19.8 us, the window 22.9: the window's cost is a fixed share of
    # the row-group family's)
    ("H200 vocab-few", "bfloat16", "bwd", 64, 128256): "0.87: two-CTA row-group",
}

#: Few-row cases that the few-row terms brought within 10 %: (run, dtype, op, rows, cols, the
#: ratio before, the family taken now). The cluster splits' waves (`policies.CLUSTER_PACKING`),
#: the smem kernels' lone CTAs (`softmax_smem.LONE_CTA_SHARE`) and the long-row families on
#: 16-47 rows of 128 KB (`softmax_rowgroup.ranks_long_rows`).
FIXED_FEW_ROWS = [
    ("H200 vocab-after", "bfloat16", "bwd", 64, 100000, 0.65, "SmemYBackward"),
    ("H200 vocab-after", "float16", "bwd", 64, 100000, 0.66, "SmemYBackward"),
    ("H200 vocab-few", "bfloat16", "bwd", 32, 100000, 0.74, "WindowBackward"),
    ("H200 vocab-few", "bfloat16", "fwd", 32, 100000, 0.80, "RowGroupForward"),
    ("H200 vocab-few", "bfloat16", "fwd", 16, 128256, 0.81, "RowGroupForward"),
    ("H100 vocab", "bfloat16", "fwd", 32, 100000, 0.73, "RowGroupForward"),
    ("H100 vocab", "float16", "fwd", 32, 100000, 0.76, "RowGroupForward"),
    ("H100 vocab", "bfloat16", "bwd", 32, 100000, 0.71, "WindowBackward"),
    ("H100 vocab", "float16", "bwd", 32, 100000, 0.73, "WindowBackward"),
]

#: Dense sweeps of few long rows (2-256 rows of 28K-152K elements, H100 and H200) and of few
#: shorter rows, replayed for the cases within 10 % of the measured best and the worst ratio:
#: (cases within 10 %, cases). The few-row terms above were fitted on the ``fewrows`` runs and
#: checked on the ``heldout`` ones, measured afterwards on other shapes and f16 (450 of 504
#: within 10 %, against 359 without the terms). What is left outside 10 % (0.76-0.90) is close
#: families trading places: row-group against window, the cluster split's variants, the smem
#: kernels against the splits at 36-64 rows.
FEW_ROWS = {
    "H100 fewrows-bf16": (170, 182),
    "H100 fewrows-f32": (91, 100),
    "H200 fewrows-bf16": (55, 64),
    "H200 fewrows-bf16b": (115, 118),
    "H200 fewrows-f32": (94, 100),
    "H100 heldout-f16": (112, 126),
    "H100 heldout-f32": (119, 126),
    "H200 heldout-f16": (111, 126),
    "H200 heldout-f32": (118, 126),
    # (1-128 rows of 8K-32K elements, measured after the few-row terms: 108 of 140 then; the
    # misses were 5-9 us problems where the register kernels' plain launch beat the cluster
    # splits and the smem kernels by 0.5-1.5 us. The staged designs' fixed time
    # (`policies.STAGED_ROW_LATENCY_BYTES`) and the register rows' lone CTAs
    # (`policies.REGISTER_ROW_LONE_SHARE`) are fitted here: 132 of 140)
    "H200 shortrows-bf16": (70, 70),
    "H200 shortrows-f32": (62, 70),
    # (2-96 rows of 2K-28K elements, f16/bf16/f32, H200, measured to check those two terms at
    # 4 MB and then used to set them: 250 of 252, without them 102)
    "H200 shortrows-heldout-bf16": (84, 84),
    "H200 shortrows-heldout-f16": (84, 84),
    "H200 shortrows-heldout-f32": (82, 84),
    # (H100, measured after the terms were set: both short-row grids, 379 of 392; without them 198)
    "H100 shortrows-bf16": (69, 70),
    "H100 shortrows-f32": (62, 70),
    "H100 shortrows-heldout-bf16": (84, 84),
    "H100 shortrows-heldout-f16": (83, 84),
    "H100 shortrows-heldout-f32": (81, 84),
    # (H200, measured after the terms were set: 192-1536 rows of 3K-70K elements, where the
    # staged designs' fixed time is 0.005-2.6x the problem's bytes; 75 of 80 without the terms
    # too, their worst 0.79, now 0.87)
    "H200 midrows-bf16": (37, 40),
    "H200 midrows-f32": (38, 40),
}
FEW_ROWS_WORST = 0.75

#: The other recorded runs, replayed in full.
RUNS = sorted(set(_runs()) - set(FEW_ROWS))


@pytest.mark.parametrize("name,dtype,op,rows,cols,before,kernel", FIXED)
def test_fixed_cases_choose_within_10_percent(name, dtype, op, rows, cols, before, kernel):
    c = _case(name, dtype, op, rows, cols)
    assert kernel in c.choice, c
    assert c.ratio >= WITHIN, c
    assert c.ratio > before


@pytest.mark.parametrize("name,dtype,op,rows,cols,before,family", FIXED_FEW_ROWS)
def test_few_row_cases_fixed(name, dtype, op, rows, cols, before, family):
    c = _case(name, dtype, op, rows, cols)
    assert c.choice.startswith("CudaSoftmax" + family), c
    assert c.ratio >= WITHIN and c.ratio > before, c


@pytest.mark.parametrize("name", sorted(FEW_ROWS))
def test_few_row_sweeps_keep_their_share_within_10_percent(name):
    """The dense few-row sweeps keep at least the cases within 10 % they had when the terms were
    set, and no case below `FEW_ROWS_WORST` (but a noisy measurement, `NOT_MODEL_MISSES`)."""
    within, total = FEW_ROWS[name]
    cases = [(key, c) for key, c in _replayed(name) if c.ratio is not None]
    assert len(cases) == total
    got = sum(c.ratio >= WITHIN for _, c in cases)
    worst = min((c for key, c in cases if (name, *key) not in NOT_MODEL_MISSES), key=lambda c: c.ratio)
    assert got >= within, f"{got}/{total} within 10 % (was {within})"
    assert worst.ratio >= FEW_ROWS_WORST, worst


@pytest.mark.parametrize("name", RUNS)
def test_every_recorded_case_within_10_percent(name):
    """Every case of the run chooses within 10 % of its measured best, but the few whose
    measurement no model should follow (`NOT_MODEL_MISSES`) and the open misses (`OPEN_MISSES`)."""
    outside = []
    for key, c in _replayed(name):
        if c.ratio is None:
            continue
        if c.ratio < WITHIN and (name, *key) not in NOT_MODEL_MISSES and (name, *key) not in OPEN_MISSES:
            outside.append(f"{key}: {c.choice} at {c.ratio:.3f} of {c.best}")
    assert not outside, "\n".join(outside)


def test_every_named_case_is_recorded():
    for name, dtype, op, rows, cols, *_ in FIXED + FIXED_FEW_ROWS:
        _case(name, dtype, op, rows, cols)
    for key in list(NOT_MODEL_MISSES) + list(OPEN_MISSES):
        _case(*key)


def test_replay_leaves_out_unknown_kernels_and_stands_in_when_the_top_was_not_measured():
    """A kernel name that is not a candidate now is left out (and reported); when PickAny's top
    choice was not measured, the first measured kernel in its ranking stands in, flagged."""
    problem = SoftmaxProblem(4096, 50257, "float32", "bwd")
    ranked = ranked_names(problem.arguments(), sm_count=REPLAY_SMS)
    first, second = ranked[1], ranked[2]  # (the top is left unmeasured)
    c = replay_softmax(problem, {second: 1.1, first: 1.3, "CudaSoftmaxBackward_f32_gone_a4": 0.5})
    assert c.skipped == ("CudaSoftmaxBackward_f32_gone_a4",)
    assert c.top == ranked[0] and c.top_unmeasured
    assert (c.choice, c.choice_ms) == (first, 1.3)
    assert (c.best, c.best_ms) == (second, 1.1)
    assert c.ratio == pytest.approx(1.1 / 1.3)
    assert replay_softmax(problem, {}).ratio is None
