"""Where the L2-window softmax's time goes: the family's forward against diagnostic builds of the
same kernel (wrong results), each timed against torch's copy of the same bytes. Builds
(``--builds``): ``copy-only`` (WN_COPY_ONLY: no exps in the statistics or the output; the same
copies, ring, barriers, slots and stores), ``no-wait`` (also WN_NO_WAIT: the output takes its row's
slot as it finds it, never waiting), ``no-combine`` (also WN_NO_COMBINE: no row combinations).

    python3 benchmarks/softmax_window_copyonly.py [--shapes 32x1048576,64x1048576] [--dtypes bf16,f32]
        [--builds softmax,copy-only,no-wait,no-combine] [--set delay_rounds=0.2 ...]

Per case: TB/s (one read of x, one write of out) of each build and of torch's ``out.copy_(x)``,
medians of ``--repeats`` runs of ``--iters`` launches alternated with the copy
(`time_cuda_pair`, rotating input sets past L2). JSON:
benchmarks/results/softmax-window-copyonly-<device>[-tag].json.
"""

from __future__ import annotations

import argparse
import ast
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
BUILDS = {"softmax": {}, "copy-only": {"WN_COPY_ONLY": 1},
          "no-wait": {"WN_COPY_ONLY": 1, "WN_NO_WAIT": 1},
          "no-combine": {"WN_COPY_ONLY": 1, "WN_NO_WAIT": 1, "WN_NO_COMBINE": 1}}


def measure(rows: int, cols: int, dtype: torch.dtype, iters: int, repeats: int, builds: list[str],
            settings: dict, sets: int = 4) -> dict:
    xs = [torch.randn(rows, cols, device="cuda", dtype=dtype) * 4 for _ in range(sets)]
    outs = [torch.empty_like(x) for x in xs]
    args = [SoftmaxArguments(x, o) for x, o in zip(xs, outs)]
    kernel = next(k for k in kernel_api.get_kernels(args[0]) if isinstance(k, sw._WindowBase))
    nbytes = 2 * rows * cols * xs[0].element_size()
    for attr, value in settings.items():
        setattr(kernel, attr, value)
    case = {"shape": [rows, cols], "dtype": str(dtype).split(".")[-1], "kernel": kernel.metadata.kernel_name,
            "settings": settings}
    try:
        for name in builds:
            defines = BUILDS[name]
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
    ap.add_argument("--builds", default="softmax,copy-only", help=f"comma-separated, of {', '.join(BUILDS)}")
    ap.add_argument("--set", action="append", default=[], metavar="ATTR=VALUE",
                    help="a window kernel attribute for every build (e.g. delay_rounds=0.2, nslot=4)")
    ap.add_argument("--tag", default="")
    opts = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("softmax_window_copyonly.py needs a CUDA GPU")
    settings = {}
    for item in opts.set:
        attr, value = item.split("=", 1)
        settings[attr] = ast.literal_eval(value)
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "cases": []}
    builds = opts.builds.split(",")
    lines = [f"{'case':>24} " + " ".join(f"{b:>10}" for b in builds) + f" {'torch copy':>10}  (TB/s, {report['device']})"]
    print(lines[0])
    for dname in opts.dtypes.split(","):
        for shape in opts.shapes.split(","):
            rows, cols = map(int, shape.split("x"))
            case = measure(rows, cols, DTYPES[dname], opts.iters, opts.repeats, builds, settings)
            report["cases"].append(case)
            lines.append(f"{dname + ' ' + shape:>24} " + " ".join(f"{case[b]['tbs']:10.2f}" for b in builds)
                         + f" {case[builds[0]]['copy_tbs']:10.2f}")
            print(lines[-1], flush=True)
    for path in write_result_with_text(result_name("softmax-window-copyonly", report["device"], opts.tag), report,
                                       lines):
        print("wrote", path)


if __name__ == "__main__":
    main()
