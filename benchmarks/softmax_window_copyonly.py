"""How much of the L2-window softmax's time is its math: the family's forward against the same kernel
built with WN_COPY_ONLY (no exps in the statistics or the output: the same copies, ring, barriers,
slots and stores, with wrong results), each timed against torch's copy of the same bytes.

    python3 benchmarks/softmax_window_copyonly.py [--shapes 32x1048576,64x1048576] [--dtypes bf16,f32]

Per case: TB/s (one read of x, one write of out) of both builds and of torch's ``out.copy_(x)``,
medians of ``--repeats`` runs of ``--iters`` launches alternated with the copy
(`time_cuda_pair`, rotating input sets past L2). JSON:
benchmarks/results/softmax-window-copyonly-<device>[-tag].json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import kernel_api  # noqa: E402
from kernel_api import SoftmaxArguments  # noqa: E402
from kernel_api.providers.cuda_src.kernels import softmax_window as sw  # noqa: E402
from kernel_api.tuning.timing import time_cuda_pair  # noqa: E402
from results_io import result_name, write_result_with_text  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}
BUILDS = {"softmax": {}, "copy-only": {"WN_COPY_ONLY": 1}}


def measure(rows: int, cols: int, dtype: torch.dtype, iters: int, repeats: int, sets: int = 4) -> dict:
    xs = [torch.randn(rows, cols, device="cuda", dtype=dtype) * 4 for _ in range(sets)]
    outs = [torch.empty_like(x) for x in xs]
    args = [SoftmaxArguments(x, o) for x, o in zip(xs, outs)]
    kernel = next(k for k in kernel_api.get_kernels(args[0]) if isinstance(k, sw._WindowBase))
    nbytes = 2 * rows * cols * xs[0].element_size()
    case = {"shape": [rows, cols], "dtype": str(dtype).split(".")[-1], "kernel": kernel.metadata.kernel_name}
    try:
        for name, defines in BUILDS.items():
            kernel.extra_defines = dict(defines)
            artifact = kernel.compile(args[0])
            runs = [time_cuda_pair(lambda i: outs[i].copy_(xs[i]),
                                   lambda i: kernel.run(args[i], compiled_artifact=artifact,
                                                        assume_supported_args=True),
                                   sets=sets, repeat=iters) for _ in range(repeats)]
            case[name] = {"ms": statistics.median(k for _, k in runs), "copy_ms": statistics.median(c for c, _ in runs)}
            case[name]["tbs"] = nbytes / (case[name]["ms"] * 1e-3) / 1e12
            case[name]["copy_tbs"] = nbytes / (case[name]["copy_ms"] * 1e-3) / 1e12
    finally:
        kernel.extra_defines = {}
    return case


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="32x1048576,64x1048576")
    ap.add_argument("--dtypes", default="bf16,f32")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tag", default="")
    opts = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("softmax_window_copyonly.py needs a CUDA GPU")
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "cases": []}
    lines = [f"{'case':>24} {'softmax':>8} {'copy-only':>9} {'torch copy':>10}  (TB/s, {report['device']})"]
    print(lines[0])
    for dname in opts.dtypes.split(","):
        for shape in opts.shapes.split(","):
            rows, cols = map(int, shape.split("x"))
            case = measure(rows, cols, DTYPES[dname], opts.iters, opts.repeats)
            report["cases"].append(case)
            lines.append(f"{dname + ' ' + shape:>24} {case['softmax']['tbs']:8.2f} {case['copy-only']['tbs']:9.2f} "
                         f"{case['softmax']['copy_tbs']:10.2f}")
            print(lines[-1], flush=True)
    for path in write_result_with_text(result_name("softmax-window-copyonly", report["device"], opts.tag), report,
                                       lines):
        print("wrote", path)


if __name__ == "__main__":
    main()
