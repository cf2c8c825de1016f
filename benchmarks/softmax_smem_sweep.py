"""The shared-memory-row softmax families (`CudaSoftmaxSmem*`) swept over threads per CTA and
commit groups per row, each point checked against float64 and timed against torch.

    python3 benchmarks/softmax_smem_sweep.py                 # GPT-2's rows, bf16 and f32, both directions
    python3 benchmarks/softmax_smem_sweep.py --configs 512x4,512x8,256x4 --shapes 1024x50257 --dtypes bf16

``--configs`` THREADSxSTAGES (0 or ``default``: the family's choice). The backward sweeps the
family PickAny ranks first among the two staging kinds (both rows, or y alone). Per point:
TB/s (bytes moved once: read x, write out; backward dy, y, dx) from the median of ``--iters``
launches alternated with torch's (`time_cuda_pair`, rotating input sets past L2),
``--repeats`` times. JSON: benchmarks/results/softmax-smem-sweep-<device>[-tag].json (and $OUT/).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import kernel_api  # noqa: E402
from kernel_api.providers.cuda_src.kernels import softmax_smem as sm  # noqa: E402
from kernel_api.tuning.policies import rank_candidates  # noqa: E402
from softmax import _case_tensors  # noqa: E402
from softmax_rowgroup_sweep import _measure, add_case_arguments, parse_configs, run_sweep, speed_cells  # noqa: E402

SHAPES = [(1024, 50257), (4096, 50257)]


def _family(args) -> kernel_api.Kernel:
    """The smem-family instance PickAny ranks first for ``args``."""
    found = [k for k in rank_candidates(kernel_api.get_kernels(args), args) if isinstance(k, sm._SmemBase)]
    if not found:
        raise RuntimeError(f"no shared-memory instance takes {args}")
    return found[0]


def sweep_case(rows: int, cols: int, dtype: torch.dtype, backward: bool, configs: list, iters: int,
               repeats: int) -> list[dict]:
    nbytes, sets, argsets, outs, ref, torch_fn = _case_tensors(rows, cols, dtype, backward)
    kernel = _family(argsets[0])
    points = []
    try:
        for threads, stages in configs:
            kernel.threads = threads or None
            kernel.stages = stages or kernel.default_stages
            point = {"kernel": kernel.metadata.kernel_name,
                     "config": f"{kernel.threads_for(cols)}x{kernel.stages}" + ("" if threads or stages else " (default)")}
            points.append(_measure(point, kernel, kernel.compile(argsets[0]), argsets, outs, ref, torch_fn, sets,
                                   nbytes, iters, repeats))
    finally:
        kernel.threads, kernel.stages = None, kernel.default_stages
    return points


def smem_configs(text: str) -> list[tuple[int, int]]:
    found = parse_configs(text, 2)
    for threads, stages in found:
        if stages > 8:
            raise SystemExit(f"--configs {threads}x{stages}: at most 8 commit groups (cp.async.wait_group's immediates)")
    return found


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_case_arguments(ap, SHAPES)
    ap.add_argument("--configs", default="default,0x2,0x8,512x4,1024x4,256x4",
                    help="THREADSxSTAGES, comma-separated; 0 takes the family's choice, default = 0x0")
    opts = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("softmax_smem_sweep.py needs a CUDA GPU")
    configs = smem_configs(opts.configs)
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "cases": []}

    def sweep(rows: int, cols: int, dtype: torch.dtype, backward: bool) -> list[dict]:
        return sweep_case(rows, cols, dtype, backward, configs, opts.iters, opts.repeats)

    def line(case: str, p: dict, note: str) -> str:
        tbs, torch_tbs = speed_cells(p)
        return f"{case:>26} {p['kernel']:>44} {p['config']:>18} {tbs} {torch_tbs}  {note}"

    run_sweep("softmax-smem-sweep", opts, report, sweep,
              f"{'case':>26} {'kernel':>44} {'threads x stages':>18} {'TB/s':>6} {'torch':>6}  note", line)


if __name__ == "__main__":
    main()
