"""Why PickBest's timing and the benchmarks' house timing disagree on some pairs of kernels.

    python3 benchmarks/pickbest_timing.py [--repeat 40] [--tag T] [--cases tf32] [--clocks]

PickBest (`kernel_api.tuning.timing.time_interleaved`) times the candidates back to back on
`rotation_count` input sets (one set when a set is past 128 MB); the house timing
(`small_m.time_group`) shuffles them with torch.matmul on at least two sets over 256 MB. On the
H200 the two put the 128x256 cooperative and 128x128 ping-pong tiles in opposite orders at tf32
4096^3 and bf16 4096x50257x4096 (benchmarks/NOTES-realign.md, session 31). Here the same two
kernels per case run under each method with one input set and with three, with and without
torch.matmul in the group, so the cause shows: the input sets, the method, or the company.
JSON and text go to benchmarks/results/pickbest_timing-<device>[-tag].*.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import kernel_api  # noqa: E402
from kernel_api import GemmArguments  # noqa: E402
from kernel_api.tuning.reference import random_like  # noqa: E402
from kernel_api.tuning.timing import time_interleaved  # noqa: E402
from gpu_clocks import ClockSampler  # noqa: E402
from results_io import result_doc, result_name, write_result_with_text  # noqa: E402
from small_m import time_group  # noqa: E402

#: (label, dtype, M, N, K, B column-major, allow tf32, kernel name parts of the two contestants)
CASES = [
    ("tf32 4096^3", torch.float32, 4096, 4096, 4096, True, True,
     {"coop": "tf32_f32acc_tnt_tile128x256x32_cluster2x1_cooperative_swz", "pp": "tf32_f32acc_tnt_tile128x128x32_cluster2x1_pingpong_swz"}),
    ("bf16 4096x50257x4096", torch.bfloat16, 4096, 50257, 4096, False, False,
     {"coop": "Sm90RealignedGemm_bf16bf16_bf16_f32acc_ttt_tile128x256x64_cluster2x1_cooperative_swz",
      "pp": "Sm90RealignedGemm_bf16bf16_bf16_f32acc_ttt_tile128x128x64_cluster2x1_pingpong_swz"}),
]


class Contest:
    """One case's two kernels compiled, three input sets of fresh random data, and `runs`: the
    launch functions of a group (torch.matmul's tf32 setting follows the case while it runs)."""

    def __init__(self, case: tuple) -> None:
        self.label, dtype, M, N, K, b_col, self.tf32, parts = case
        torch.backends.cuda.matmul.allow_tf32 = self.tf32
        A = torch.randn(M, K, device="cuda", dtype=dtype)
        B = (torch.randn(N, K, device="cuda", dtype=dtype).t() if b_col
             else torch.randn(K, N, device="cuda", dtype=dtype))
        args = GemmArguments(A, B, torch.empty(M, N, device="cuda", dtype=dtype))
        self.kernels = {}
        for k in kernel_api.get_kernels(args, cc=90):
            for short, part in parts.items():
                if part in k.metadata.kernel_name and short not in self.kernels:
                    self.kernels[short] = k
        self.artifacts = {short: k.compile(args) for short, k in self.kernels.items()}
        self.sets = [random_like(args) for _ in range(3)]

    def names(self) -> dict:
        return {s: k.metadata.kernel_name for s, k in self.kernels.items()}

    def runs(self, n_sets: int, cublas: bool) -> dict:
        sets = self.sets
        fns = {short: (lambda i, k=k, art=self.artifacts[short]: k.run(sets[i % n_sets], compiled_artifact=art,
                                                                        assume_supported_args=True))
               for short, k in self.kernels.items()}
        if cublas:
            fns["cublas"] = lambda i: torch.matmul(sets[i % n_sets].A, sets[i % n_sets].B, out=sets[i % n_sets].out)
        return fns

    def close(self) -> None:
        torch.backends.cuda.matmul.allow_tf32 = False


def run_case(case: tuple, repeat: int, clocks: ClockSampler | None = None) -> dict:
    contest = Contest(case)
    label = contest.label
    result = {"case": label, "kernels": contest.names(), "ms": {}}
    for n_sets in (1, 3):
        for cublas in (False, True):
            tag = f"sets{n_sets}{'+cublas' if cublas else ''}"
            with clocks.window(f"{label} pickbest {tag}") if clocks else contextlib.nullcontext():
                found = time_interleaved(contest.runs(n_sets, cublas), n_sets, repeat=repeat)
            result["ms"][f"pickbest {tag}"] = {k: v["median_ms"] for k, v in found.items()}
            with clocks.window(f"{label} house {tag}") if clocks else contextlib.nullcontext():
                ms, _ = time_group(contest.runs(n_sets, cublas), repeat)
            result["ms"][f"house {tag}"] = ms
    contest.close()
    return result


def run_bursts(case: tuple, bursts: list[int], clocks: ClockSampler | None = None) -> dict:
    """The house method on three input sets with cuBLAS in the group, once per burst length
    (launches of each kernel, alternating), each burst after a second of idle GPU; the SM clock
    sampled over the burst's own launches (the span after the house method's sleep kernel)."""
    contest = Contest(case)
    fns = contest.runs(3, cublas=True)
    result = {"case": contest.label, "kernels": contest.names(), "bursts": {}}
    for repeat in bursts:
        torch.cuda.synchronize()
        time.sleep(1.0)
        ms, _ = time_group(fns, repeat)
        ended = time.monotonic()
        busy_s = sum(ms.values()) * repeat / 1e3
        entry = {"launches_each": repeat, "busy_ms": busy_s * 1e3, "ms": ms}
        if clocks:
            name = f"{contest.label} burst {repeat}"
            clocks.windows[name] = [(ended - busy_s, ended)]
            entry["clocks"] = clocks.summary()[name]
        result["bursts"][str(repeat)] = entry
    contest.close()
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeat", type=int, default=40)
    p.add_argument("--tag", default="")
    p.add_argument("--cases", nargs="+", help="run only the cases whose label contains one of these")
    p.add_argument("--bursts", nargs="+", type=int,
                   help="instead: the house method at these launch counts per kernel, each after a second idle")
    p.add_argument("--clocks", action="store_true",
                   help="sample the SM clock and power (nvidia-smi) during each method's launches")
    a = p.parse_args()
    doc = result_doc(cases=[])
    device = doc["device"]
    lines = [f"{device}; median ms of {a.repeat} launches; coop / pp (pp/coop); cuBLAS where in the group"
             + ("; median SM MHz and W while the method ran" if a.clocks else "")]
    cases = [c for c in CASES if not a.cases or any(part in c[0] for part in a.cases)]
    with ClockSampler() if a.clocks else contextlib.nullcontext() as clocks:
        if a.bursts:
            lines[0] = (f"{device}; house method, 3 input sets, with cuBLAS; median ms per burst length; coop / pp / "
                        f"cuBLAS" + ("; median SM MHz over the burst's launches" if a.clocks else ""))
            for case in cases:
                r = run_bursts(case, a.bursts, clocks)
                doc["cases"].append(r)
                for repeat, e in r["bursts"].items():
                    ms = e["ms"]
                    lines.append(f"{r['case']:22s} burst {repeat:>5} ({e['busy_ms']:6.0f} ms)  {ms['coop']:.4f} / "
                                 f"{ms['pp']:.4f} / {ms['cublas']:.4f}  cuBLAS/coop {ms['cublas'] / ms['coop']:.3f} "
                                 f"cuBLAS/pp {ms['cublas'] / ms['pp']:.3f}")
                    c = e.get("clocks") or {}
                    if c.get("samples"):
                        lines[-1] += f"  [{c['sm_mhz']:.0f} MHz, {c['samples']} samples]"
                    print(lines[-1], flush=True)
            cases = []
        for case in cases:
            r = run_case(case, a.repeat, clocks)
            doc["cases"].append(r)
            for method, ms in r["ms"].items():
                cub = f"  cuBLAS {ms['cublas']:.4f}" if "cublas" in ms else ""
                lines.append(f"{r['case']:22s} {method:24s} {ms['coop']:.4f} / {ms['pp']:.4f} "
                             f"({ms['pp'] / ms['coop']:.3f}){cub}")
                if clocks:
                    c = clocks.summary().get(f"{r['case']} {method}", {})
                    r.setdefault("clocks", {})[method] = c
                    if c.get("samples"):
                        lines[-1] += f"  [{c['sm_mhz']:.0f} MHz, {c['watts']:.0f} W, {c['samples']} samples]"
                print(lines[-1], flush=True)
    name = result_name("pickbest_timing", device, a.tag)
    write_result_with_text(name, doc, lines)


if __name__ == "__main__":
    main()
