"""Why PickBest's timing and the benchmarks' house timing disagree on some pairs of kernels.

    python3 benchmarks/pickbest_timing.py [--repeat 40] [--tag T]

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
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import kernel_api  # noqa: E402
from kernel_api import GemmArguments  # noqa: E402
from kernel_api.tuning.reference import random_like  # noqa: E402
from kernel_api.tuning.timing import time_interleaved  # noqa: E402
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


def run_case(case: tuple, repeat: int) -> dict:
    label, dtype, M, N, K, b_col, tf32, parts = case
    torch.backends.cuda.matmul.allow_tf32 = tf32
    A = torch.randn(M, K, device="cuda", dtype=dtype)
    B = torch.randn(N, K, device="cuda", dtype=dtype).t() if b_col else torch.randn(K, N, device="cuda", dtype=dtype)
    args = GemmArguments(A, B, torch.empty(M, N, device="cuda", dtype=dtype))
    kernels = {}
    for k in kernel_api.get_kernels(args, cc=90):
        for short, part in parts.items():
            if part in k.metadata.kernel_name and short not in kernels:
                kernels[short] = k
    artifacts = {short: k.compile(args) for short, k in kernels.items()}
    sets = [random_like(args) for _ in range(3)]
    result = {"case": label, "kernels": {s: k.metadata.kernel_name for s, k in kernels.items()}, "ms": {}}

    def runs(n_sets: int, cublas: bool) -> dict:
        fns = {short: (lambda i, k=k, art=artifacts[short]: k.run(sets[i % n_sets], compiled_artifact=art,
                                                                   assume_supported_args=True))
               for short, k in kernels.items()}
        if cublas:
            fns["cublas"] = lambda i: torch.matmul(sets[i % n_sets].A, sets[i % n_sets].B, out=sets[i % n_sets].out)
        return fns

    for n_sets in (1, 3):
        for cublas in (False, True):
            tag = f"sets{n_sets}{'+cublas' if cublas else ''}"
            found = time_interleaved(runs(n_sets, cublas), n_sets, repeat=repeat)
            result["ms"][f"pickbest {tag}"] = {k: v["median_ms"] for k, v in found.items()}
            ms, _ = time_group(runs(n_sets, cublas), repeat)
            result["ms"][f"house {tag}"] = ms
    torch.backends.cuda.matmul.allow_tf32 = False
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeat", type=int, default=40)
    p.add_argument("--tag", default="")
    a = p.parse_args()
    doc = result_doc(cases=[])
    device = doc["device"]
    lines = [f"{device}; median ms of {a.repeat} launches; coop / pp (pp/coop); cuBLAS where in the group"]
    for case in CASES:
        r = run_case(case, a.repeat)
        doc["cases"].append(r)
        for method, ms in r["ms"].items():
            cub = f"  cuBLAS {ms['cublas']:.4f}" if "cublas" in ms else ""
            lines.append(f"{r['case']:22s} {method:24s} {ms['coop']:.4f} / {ms['pp']:.4f} ({ms['pp'] / ms['coop']:.3f}){cub}")
            print(lines[-1], flush=True)
    name = result_name("pickbest_timing", device, a.tag)
    write_result_with_text(name, doc, lines)


if __name__ == "__main__":
    main()
