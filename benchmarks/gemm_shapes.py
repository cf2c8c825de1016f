"""GEMM on the shapes users have: for each case, our PickBest winner,
PickAny's choice, ``kernel_api.ops.gemm`` and cuBLAS (``torch.matmul``), in one process.

    python3 benchmarks/gemm_shapes.py --group odd --repeats 3        # the four odd shapes, 3 runs
    python3 benchmarks/gemm_shapes.py --group odd,aligned --tag mine
    python3 benchmarks/gemm_shapes.py --list                          # the groups and their cases

Groups (`GROUPS`): ``odd`` (odd extents and leading dimensions), ``aligned`` (the seven
16-byte aligned bf16 shapes), ``small_m`` (M in 1..128 against N, K in 4096..14336, B
column-major as an nn.Linear weight), ``f32`` (against torch's default FP32) and
``f64`` (against DGEMM), ``models`` (a Llama-3-8B layer's projections at 512-8192 tokens and
its lm_head: PickAny beyond the groups above), ``models_more`` (Qwen2-7B's and Llama-3-70B's at 256
and 1024 tokens), ``wave_fit`` (outputs that fill whole waves only with the 128x160, 128x192 or 128x224 tiles),
``small`` (5-30 us problems: small squares and a GPT-2-small layer at 128 and 512 tokens), ``gpt2_prefill``
(the same layer at 8 x 1024 tokens), ``batched``
(attention's batched products at head dims 64 and 128, MoE experts), ``odd_small`` (small problems
with odd extents), ``odd_sweep``, ``odd_sweep2``, ``odd_tiny``, ``odd_heldout``, ``odd_heldout2``, ``odd_wide`` and ``odd_narrow`` (grids of them, down to a few
microseconds).
A case is (M, N, K, dtype, layouts, L); add one to a group's list
to run it. ``--cases REGEX`` runs the matching cases only.

Per case:
- **PickBest**: `kernel_api.tuning.PickBest` over our own kernels (every provider but torch's),
  ``--max-candidates`` best ranked, measured afresh (no tuning record reused);
- **PickAny**: the analytic choice over every candidate ``ops.gemm`` would see (torch's included);
- **ops.gemm**: the front door under the default policy (PickAny), with ``out=``;
- **cuBLAS**: ``torch.matmul(A, B, out=...)``.

Timing (the house method, benchmarks/house_timing.py's ``time_group``): the
contestants run in alternating order in one process, shuffled each repetition, each launch between
its own CUDA events, behind a sleep kernel so the host queues ahead of the GPU; medians of
``--repeat`` launches. Inputs are fresh random data, rotated over enough sets to exceed 256 MB
(the H200's L2 is 50-60 MB). ``--repeats N`` repeats the timing N times and reports the median
and the spread of each ratio. Every contestant's output is checked against float64 first.
``--sustained-ms T`` times after T ms of untimed back-to-back launches instead of after the
sleep kernel: short timed bursts after an idle GPU run at the top clock, sustained GEMM work
does not, and some kernels lose more to that than others (docs/performance.md, "Power state").
``--own-state-ms T`` times each contestant in its own power state instead (`house_timing.time_own_state`:
T ms of its own untimed back-to-back launches, then ``--repeat`` timed ones, the contestants in a
shuffled order per run): under the power cap a kernel that draws less runs at a higher clock, which
interleaved launches hide (docs/performance.md, "f64 and f32 GEMM").
PickBest's own timing runs after 200 ms of untimed launches (`PickBest`'s ``settle_ms``), in the
sustained state, each candidate in its own power state (``--pickbest-power-state own``, the library's
default) or the candidates in turn (``shared``).

Prints one table per group last; JSON goes to benchmarks/results/gemm_shapes-<device>-<tag>.json
(and to $OUT when that folder exists).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import time
from dataclasses import asdict, dataclass

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import kernel_api  # noqa: E402
from kernel_api.ops.dispatch import allowed_math  # noqa: E402
from kernel_api import GemmArguments  # noqa: E402
from kernel_api.tuning.policies import DEFAULT_POWER_STATE, POWER_STATES, PickAny, PickBest  # noqa: E402
from results_io import result_name, write_result  # noqa: E402
from house_timing import geomean, time_group, time_own_state  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32, "f64": torch.float64}
ROTATE_BYTES = 256 << 20


@dataclass(frozen=True)
class Case:
    """One problem: ``layouts`` is A, B, out each 't' (row-major) or 'n' (column-major)."""

    M: int
    N: int
    K: int
    dtype: str = "bf16"
    layouts: str = "ttt"
    L: int | None = None
    #: f32 only: run with torch.backends.cuda.matmul.allow_tf32 on (cuBLAS TF32, and our tf32 /
    #: 3xTF32 kernels become candidates, as for ops.gemm); off: FP32 precision on both sides
    tf32: bool = False

    @property
    def name(self) -> str:
        batch = f"{self.L}x" if self.L else ""
        return f"{self.dtype} {batch}{self.M}x{self.N}x{self.K} {self.layouts}" + (" tf32" if self.tf32 else "")

    @property
    def flops(self) -> float:
        return 2.0 * self.M * self.N * self.K * (self.L or 1)


GROUPS: dict[str, list[Case]] = {
    # odd sizes and leading dimensions (every operand contiguous, row-major)
    "odd": [Case(4096, 50257, 4096), Case(4095, 4096, 4095), Case(4097, 4097, 4097, "f16"),
            Case(2000, 3000, 1001)],
    # the seven 16-byte aligned bf16 shapes
    "aligned": [Case(8192, 8192, 8192), Case(4096, 4096, 4096), Case(2048, 2048, 2048), Case(4096, 14336, 4096),
                Case(4096, 4096, 14336), Case(128, 8192, 8192), Case(16384, 1024, 16384)],
    # decode and prefill tails, every M x (N, K); B column-major as an
    # nn.Linear weight is (out = x @ W.T)
    "small_m": [Case(M, N, K, "bf16", "tnt") for M in (1, 8, 16, 64, 128)
                for N in (4096, 8192, 14336) for K in (4096, 8192, 14336)],
    # f32 at torch's default precision (cuBLAS FP32; only f32-math kernels may be chosen,
    # as ops.gemm does) and with TF32 allowed (cuBLAS TF32 against our tf32 / 3xTF32 kernels);
    # (each tf32 and 3xTF32 configuration is a PickBest candidate here)
    "f32": [Case(n, n, n, "f32", "tnt", tf32=tf32) for tf32 in (False, True) for n in (4096, 8192)],
    # f64 on the FP64 tensor cores against cuBLAS DGEMM
    "f64": [Case(2048, 2048, 2048, "f64"), Case(8192, 8192, 8192, "f64")],
    # a Llama-3-8B layer's projections (hidden 4096; q, k, v
    # fused to 6144; the MLP's gate and up fused to 28672; down from 14336) at 512, 2048 and 8192
    # tokens, and its 128256-token lm_head; B column-major as nn.Linear weights are
    "models": [Case(M, N, K, "bf16", "tnt") for M in (512, 2048, 8192)
               for N, K in ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336))]
              + [Case(2048, 128256, 4096, "bf16", "tnt")],
    # and two other widths at 256 and 1024 tokens: Qwen2-7B (hidden 3584; qkv 4608; gate and up
    # 37888; down from 18944) and Llama-3-70B (hidden 8192; qkv 10240; gate and up 57344; down
    # from 28672)
    "models_more": [Case(M, N, K, "bf16", "tnt") for M in (256, 1024)
                    for N, K in ((4608, 3584), (3584, 3584), (37888, 3584), (3584, 18944),
                                 (10240, 8192), (8192, 8192), (57344, 8192), (8192, 28672))],
    # outputs whose tiles fill whole waves only at 160, 192 or 224 columns: GPT-2's weight
    # gradients (A a column-major view of the activations), Llama-3-70B's qkv at 256 and 1024
    # tokens, Qwen2-7B's o and down projections at 1024 tokens
    "wave_fit": [Case(768, 3072, 8192, "bf16", "ntt"), Case(3072, 768, 8192, "bf16", "ntt"),
                 Case(256, 10240, 8192, "bf16", "tnt"), Case(1024, 10240, 8192, "bf16", "tnt"),
                 Case(768, 2304, 8192, "bf16", "ntt"), Case(1024, 3584, 3584, "bf16", "tnt"),
                 Case(1024, 3584, 18944, "bf16", "tnt")],
    # problems of 5-30 us, where launch and pipeline fill weigh as much as the math: squares of
    # 256-2048, and a GPT-2-small / BERT-base layer (hidden 768; qkv 2304; MLP 3072) at 128 and
    # 512 tokens
    "small": [Case(n, n, n) for n in (256, 512, 1024, 2048)]
             + [Case(M, N, K, "bf16", "tnt") for M in (128, 512)
                for N, K in ((2304, 768), (768, 768), (3072, 768), (768, 3072))],
    # GPT-2-small's projections in an 8 x 1024-token prefill, weights stored (in, out) as its
    # Conv1D keeps them: qkv, attention output, MLP up and down
    "gpt2_prefill": [Case(8192, N, K, "bf16", "ttt") for N, K in ((2304, 768), (768, 768), (3072, 768), (768, 3072))],
    # batched products as attention runs them outside a fused kernel (L = batch x heads): scores
    # Q K^T (K stored row-major: B column-major) and P V, head dims 64 and 128; and eight MoE
    # experts' up projections at 512 tokens each
    "batched": [Case(512, 512, 64, "bf16", "tnt", 32), Case(512, 64, 512, "bf16", "ttt", 32),
                Case(1024, 1024, 128, "bf16", "tnt", 32), Case(1024, 128, 1024, "bf16", "ttt", 32),
                Case(256, 256, 64, "bf16", "tnt", 64), Case(256, 64, 256, "bf16", "ttt", 64),
                Case(512, 2048, 1024, "bf16", "tnt", 8)],
    # small problems with odd extents (the realigned and staged paths at a few microseconds)
    "odd_small": [Case(1000, 1000, 1000), Case(777, 1333, 555), Case(4095, 1024, 511, "f16"),
                  Case(100, 5000, 3001, "bf16", "tnt")],
    # grids of odd extents at 0.1-45 GFLOP, where cuBLAS's alignment-1 path and our staged
    # copies both pay fixed times (docs/performance.md, "Realigned GEMM")
    "odd_sweep": [Case(M, N, K) for M in (100, 777, 1500, 3000) for N in (1333, 5001) for K in (555, 3001)],
    # tiny odd problems (launch-bound: which single-launch kernel, if any, beats cuBLAS's
    # alignment-1 path there)
    "odd_tiny": [Case(37, 53, 29), Case(37, 53, 29, "f16"), Case(129, 257, 65), Case(333, 333, 333),
                 Case(61, 1025, 513, "bf16", "tnt")],
    "odd_sweep2": [Case(M, N, K, "bf16", lay) for M, N, K, lay in
                   ((250, 2999, 999, "ttt"), (450, 777, 4001, "ttt"), (1111, 1111, 1111, "ttt"),
                    (2222, 3333, 777, "ttt"), (63, 9001, 2047, "tnt"), (1025, 4099, 1537, "tnt"),
                    (3001, 999, 333, "ttt"), (600, 7000, 1000, "tnt"))],
    # held out from the fit of the alignment-1 models (cuBLAS's path, SimtGemm, the
    # staged kernels): tiny f16 / bf16 pairs, 0.1-20 GFLOP, batched, and GPT-2's vocabulary at
    # decode (M = 1, 8, 64) and prefill
    "odd_heldout": [Case(45, 77, 31), Case(45, 77, 31, "f16"), Case(200, 129, 97), Case(200, 129, 97, "f16"),
                    Case(257, 513, 127, "f16"), Case(95, 1000, 300), Case(300, 2000, 700),
                    Case(555, 3333, 1201), Case(129, 7777, 999, "bf16", "tnt"), Case(2000, 1999, 257),
                    Case(900, 900, 2999), Case(50, 20001, 1500), Case(1200, 3001, 1800),
                    Case(3333, 777, 2222, "bf16", "tnt"), Case(40, 4097, 4097), Case(257, 129, 99, "bf16", "ttt", 16),
                    Case(1, 50257, 768), Case(8, 50257, 4096), Case(64, 50257, 768), Case(2048, 50257, 768)],
    # held out from their second fit (with odd_heldout), and nn.Linear's layout at GPT-2's
    # vocabulary (B column-major: only the output's rows are odd)
    "odd_heldout2": [Case(33, 65, 17), Case(33, 65, 17, "f16"), Case(150, 300, 45), Case(400, 250, 99, "f16"),
                     Case(120, 2222, 640), Case(700, 900, 1100), Case(1000, 3000, 500, "f16"),
                     Case(256, 6000, 999, "bf16", "tnt"), Case(80, 12000, 800), Case(30, 8000, 2000),
                     Case(500, 500, 5000), Case(1800, 2500, 400), Case(3500, 3500, 900, "f16"),
                     Case(5000, 1000, 3001, "bf16", "ntt"), Case(300, 301, 257, "bf16", "ttt", 8),
                     Case(8, 50257, 768, "bf16", "tnt"), Case(64, 50257, 768, "bf16", "tnt"),
                     Case(2048, 50257, 768, "bf16", "tnt")],
    # f32 (FP32 and TF32) and f64 with odd extents and leading dimensions: no run had measured
    # cuBLAS's path there before, which PickAny rates at `TORCH_UNALIGNED_FACTOR`
    "odd_wide": [Case(M, N, K, dt, lay, tf32=tf32)
                 for dt, tf32 in (("f32", False), ("f32", True), ("f64", False))
                 for M, N, K, lay in ((333, 333, 333, "ttt"), (777, 1333, 555, "ttt"), (1000, 1000, 999, "ttt"),
                                      (2000, 3000, 1001, "ttt"), (4095, 4096, 4095, "ttt"), (64, 50257, 768, "tnt"))],
    # narrow odd outputs (17-128 rows against thousands of columns), held out from a narrow-output
    # factor on cuBLAS's alignment-1 estimate, which they showed did not hold
    "odd_narrow": [Case(32, 6001, 1001), Case(48, 30001, 512), Case(20, 12289, 2049), Case(64, 9999, 4095),
                   Case(56, 4097, 777, "bf16", "tnt"), Case(24, 32001, 4096, "bf16", "tnt"), Case(33, 8191, 1537, "f16"),
                   Case(128, 6001, 1001)],
}


def operand(rows: int, cols: int, L: int | None, dtype: torch.dtype, column_major: bool) -> torch.Tensor:
    lead = () if L is None else (L,)
    if column_major:
        return torch.randn(*lead, cols, rows, device="cuda", dtype=torch.float32).to(dtype).transpose(-1, -2)
    return torch.randn(*lead, rows, cols, device="cuda", dtype=torch.float32).to(dtype)


def make_sets(case: Case) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Rotating (A, B, out, torch_out) sets of fresh random data, together past ROTATE_BYTES."""
    dt = DTYPES[case.dtype]
    size = torch.empty((), dtype=dt).element_size()
    per_set = (case.M * case.K + case.K * case.N + 2 * case.M * case.N) * size * (case.L or 1)
    sets = []
    for _ in range(max(1, min(16, -(-ROTATE_BYTES // per_set)))):
        A = operand(case.M, case.K, case.L, dt, case.layouts[0] == "n")
        B = operand(case.K, case.N, case.L, dt, case.layouts[1] == "n")
        out = operand(case.M, case.N, case.L, dt, case.layouts[2] == "n")
        sets.append((A, B, out, torch.empty_like(out)))
    return sets


def case_arguments(case: Case, A: torch.Tensor, B: torch.Tensor, out: torch.Tensor) -> GemmArguments:
    """The case's GEMM: f64 accumulates in f64 (no f64 kernel takes an f32 accumulator), the rest in f32."""
    return GemmArguments(A, B, out, accumulator_type=torch.float64 if case.dtype == "f64" else torch.float32)


def case_candidates(case: Case, args: GemmArguments) -> list:
    """The kernels ops.gemm would weigh for the case: tf32 / 3xTF32 math only with TF32 on."""
    return allowed_math(kernel_api.get_kernels(args), case.tf32)


def rel_error(out: torch.Tensor, A: torch.Tensor, B: torch.Tensor) -> float:
    """Norm-wise relative error against float64 on the first 256 rows (cheap at any size)."""
    rows = slice(0, min(256, A.shape[-2]))
    ref = A[..., rows, :].double() @ B.double()
    got = out[..., rows, :].double()
    return float(torch.linalg.vector_norm(got - ref) / torch.linalg.vector_norm(ref))


def short(name: str) -> str:
    return name if len(name) <= 90 else name[:87] + "..."


def bench_case(case: Case, opts: argparse.Namespace) -> dict:
    """`_bench_case` with torch's TF32 switch set as the case asks (and restored)."""
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = case.tf32
    try:
        return _bench_case(case, opts)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved


def _bench_case(case: Case, opts: argparse.Namespace) -> dict:
    t0 = time.perf_counter()
    sets = make_sets(case)
    args = [case_arguments(case, A, B, out) for A, B, out, _ in sets]
    candidates = case_candidates(case, args[0])
    ours = [k for k in candidates if k.metadata.provider != "torch"]
    rec: dict = {"case": asdict(case), "name": case.name, "buffer_sets": len(sets), "candidates": len(candidates)}
    if not ours:
        rec["error"] = "no kernel of ours takes it"
        return rec
    tuned = PickBest(max_candidates=opts.max_candidates, use_records=False, repeat=opts.repeat,
                     power_state=opts.pickbest_power_state).tune(args[0], ours)
    best = tuned.winner
    rec["pickbest"] = best.name
    rec["pickbest_measured"] = {m.kernel_name: (m.median_ms if m.failure is None else m.failure)
                                for m in tuned.measurements}
    anyk = PickAny().choose(args[0], candidates)
    rec["pickany"] = anyk.name
    artifacts = {best.name: best.compile(args[0])}
    if anyk.name not in artifacts:
        artifacts[anyk.name] = anyk.compile(args[0])
    n = len(sets)

    def run_with(kernel):
        artifact = artifacts[kernel.name]
        return lambda i: kernel.run(args[i % n], compiled_artifact=artifact)

    fns = {"pickbest": run_with(best), "pickany": run_with(anyk),
           "ops": lambda i: kernel_api.ops.gemm(sets[i % n][0], sets[i % n][1], out=sets[i % n][2]),
           "cublas": lambda i: torch.matmul(sets[i % n][0], sets[i % n][1], out=sets[i % n][3])}
    errors = {}
    for name, fn in fns.items():
        A, B, out, tout = sets[0]
        (tout if name == "cublas" else out).fill_(float("nan"))
        fn(0)
        torch.cuda.synchronize()
        errors[name] = rel_error(tout if name == "cublas" else out, A, B)
    rec["rel_error"] = errors
    tol = 1e-2
    bad = {k: v for k, v in errors.items() if not v < tol}
    if bad:
        rec["error"] = f"wrong results: {bad}"
        print(f"{case.name}: WRONG RESULTS {bad}", flush=True)
    runs = []
    for run in range(opts.repeats):
        if opts.own_state_ms:
            runs.append({"ms": time_own_state(fns, opts.repeat, opts.own_state_ms, seed=run), "host_bound": False})
            continue
        ms, behind = time_group(fns, opts.repeat, sustained_ms=opts.sustained_ms)
        runs.append({"ms": ms, "host_bound": behind})
    rec["runs"] = runs
    med = {k: statistics.median(r["ms"][k] for r in runs) for k in fns}
    rec["median_ms"] = med
    rec["tflops"] = {k: case.flops / (v * 1e-3) / 1e12 for k, v in med.items()}
    for k in ("pickbest", "pickany", "ops"):
        ratios = [r["ms"]["cublas"] / r["ms"][k] for r in runs]
        rec[f"{k}_vs_cublas"] = {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}
    rec["pickany_vs_pickbest"] = med["pickbest"] / med["pickany"]
    rec["seconds"] = time.perf_counter() - t0
    print(f"{case.name}: PickBest {rec['tflops']['pickbest']:.0f} TFLOP/s ({rec['pickbest_vs_cublas']['median']:.2f}x "
          f"cuBLAS {rec['tflops']['cublas']:.0f}), PickAny {rec['pickany_vs_cublas']['median']:.2f}x, "
          f"ops.gemm {rec['ops_vs_cublas']['median']:.2f}x  [{short(best.name)}] ({rec['seconds']:.0f} s)", flush=True)
    del args, sets
    torch.cuda.empty_cache()
    return rec


def summarise(rows: list[dict]) -> dict:
    good = [r for r in rows if "runs" in r]
    if not good:
        return {}
    out = {"cases": len(rows), "timed": len(good)}
    for k in ("pickbest", "pickany", "ops"):
        meds = [r[f"{k}_vs_cublas"]["median"] for r in good]
        out[f"geomean_{k}_vs_cublas"] = geomean(meds)
        out[f"min_{k}_vs_cublas"] = min(meds)
    out["min_pickany_vs_pickbest"] = min(r["pickany_vs_pickbest"] for r in good)
    return out


def print_table(group: str, rows: list[dict], summary: dict) -> None:
    print(f"\n== group {group} ==")
    print(f"{'case':<28} {'PickBest':>9} {'PickAny':>9} {'ops.gemm':>9} {'cuBLAS':>9}   "
          f"{'best/cuBLAS':>18} {'any/cuBLAS':>10} {'any/best':>8}  winner (PickAny's if other)")
    for r in rows:
        if "runs" not in r:
            print(f"{r['name']:<28} {r.get('error', 'not timed')}")
            continue
        t = r["tflops"]
        b = r["pickbest_vs_cublas"]
        spread = f"{b['median']:.2f} [{b['min']:.2f}-{b['max']:.2f}]"
        other = "" if r["pickany"] == r["pickbest"] else f"  (any: {short(r['pickany'])})"
        print(f"{r['name']:<28} {t['pickbest']:>9.0f} {t['pickany']:>9.0f} {t['ops']:>9.0f} {t['cublas']:>9.0f}   "
              f"{spread:>18} {r['pickany_vs_cublas']['median']:>10.2f} {r['pickany_vs_pickbest']:>8.2f}  "
              f"{short(r['pickbest'])}{other}")
    if summary:
        print(f"geomean vs cuBLAS: PickBest {summary['geomean_pickbest_vs_cublas']:.2f}x (min "
              f"{summary['min_pickbest_vs_cublas']:.2f}), PickAny {summary['geomean_pickany_vs_cublas']:.2f}x (min "
              f"{summary['min_pickany_vs_cublas']:.2f}), ops.gemm {summary['geomean_ops_vs_cublas']:.2f}x; "
              f"PickAny within {100 * (1 - summary['min_pickany_vs_pickbest']):.0f}% of PickBest at worst")
    print("(TFLOP/s; ratios are cuBLAS time / ours, median over --repeats runs [min-max])")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--group", default="odd", help=f"comma-separated groups: {', '.join(GROUPS)}")
    p.add_argument("--repeats", type=int, default=1, help="timing runs per case (the spread is reported)")
    p.add_argument("--repeat", type=int, default=30, help="launches per contestant per timing run")
    p.add_argument("--sustained-ms", type=float, default=0.0,
                   help="time after this many ms of untimed back-to-back launches of the group instead of after "
                        "an idle sleep kernel (the power state of sustained work; house_timing.time_group)")
    p.add_argument("--own-state-ms", type=float, default=0.0,
                   help="time each contestant on its own after this many ms of its own untimed launches (its own "
                        "power state; house_timing.time_own_state) instead of interleaved")
    p.add_argument("--pickbest-power-state", choices=POWER_STATES, default=DEFAULT_POWER_STATE,
                   help="PickBest's timing: each candidate in its own power state (own, the library's default) "
                        "or the candidates in turn at one clock (shared; PickBest's power_state)")
    p.add_argument("--max-candidates", type=int, default=6, help="PickBest: best-ranked candidates measured")
    p.add_argument("--tag", default="run")
    p.add_argument("--cases", default=None, help="regular expression: only the cases whose name matches "
                                                  "(e.g. '^bf16 (1|64)x')")
    p.add_argument("--list", action="store_true", help="print the groups and their cases, and exit")
    opts = p.parse_args()
    groups = opts.group.split(",")
    unknown = [g for g in groups if g not in GROUPS]
    if unknown:
        sys.exit(f"unknown group(s) {unknown}; known: {', '.join(GROUPS)}")
    if opts.list:
        for g in GROUPS:
            print(f"{g}: {', '.join(c.name for c in GROUPS[g]) or '(no cases yet)'}")
        return
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    device = torch.cuda.get_device_name()
    t0 = time.perf_counter()
    results = {}
    for g in groups:
        if not GROUPS[g]:
            print(f"group {g}: no cases yet", flush=True)
        picked = [c for c in GROUPS[g] if opts.cases is None or re.search(opts.cases, c.name)]
        rows = [bench_case(case, opts) for case in picked]
        results[g] = {"cases": rows, "summary": summarise(rows)}
    doc = {"device": device, "torch": torch.__version__, "options": vars(opts), "argv": sys.argv,
           "timing": (f"each contestant on its own, after {opts.own_state_ms:g} ms of its own untimed launches, "
                      "the contestants in a shuffled order per run (house_timing.time_own_state), CUDA events per launch, "
                      "median of --repeat per run, median over --repeats runs" if opts.own_state_ms else
                      "alternating launches behind " + (f"{opts.sustained_ms:g} ms of untimed back-to-back launches "
                      "of the group" if opts.sustained_ms else "a sleep kernel") + " (house_timing.time_group), CUDA "
                      "events per launch, median of --repeat per run, median over --repeats runs"),
           "groups": results, "seconds": time.perf_counter() - t0}
    paths = write_result(result_name("gemm_shapes", device, opts.tag), doc)
    for g in groups:
        print_table(g, results[g]["cases"], results[g]["summary"])
    print(f"\n{device}; JSON: {', '.join(paths)}")


if __name__ == "__main__":
    main()
