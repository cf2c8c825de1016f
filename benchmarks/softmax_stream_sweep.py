"""The two-launch streaming softmax (`CudaSoftmaxStream*`) swept over its CTA shape and part size,
next to the row-group family's plan, each point checked against float64 and timed against torch.

    python3 benchmarks/softmax_stream_sweep.py                      # the long shapes, bf16 and f32, both directions
    python3 benchmarks/softmax_stream_sweep.py --configs 512x4x64,256x8x64 --shapes 32x1048576 --dtypes bf16

``--configs`` THREADSxUNROLLxPART_KB (threads per CTA, 16-byte vectors per thread and array in
one loop step, KB of each input per part; 0 or ``default``: the family's). Per point: TB/s (bytes moved
once: read x, write out; backward dy, y, dx) from the median of ``--iters`` launches alternated
with torch's (`time_cuda_pair`, rotating input sets past L2), ``--repeats`` times, and the
relative error against float64. The row-group family's one-CTA instance under its own plan is
timed the same way as the reference point. JSON:
benchmarks/results/softmax-stream-sweep-<device>[-tag].json (and $OUT/).
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
from kernel_api.providers.cuda_src.kernels import softmax_rowgroup as rg  # noqa: E402
from kernel_api.providers.cuda_src.kernels import softmax_stream as ss  # noqa: E402
from softmax import _case_tensors  # noqa: E402
from softmax_rowgroup_sweep import _measure, add_case_arguments, parse_configs, run_sweep, speed_cells  # noqa: E402

SHAPES = [(32, 2**20), (8, 2**22)]


def _family(args, cls: type) -> kernel_api.Kernel:
    found = [k for k in kernel_api.get_kernels(args) if isinstance(k, cls)
             and getattr(k, "ctas_per_sm", 1) == 1]
    if not found:
        raise RuntimeError(f"no {cls.__name__} instance for {args}")
    return found[0]


def sweep_case(rows: int, cols: int, dtype: torch.dtype, backward: bool, configs: list, iters: int,
               repeats: int) -> list[dict]:
    nbytes, sets, argsets, outs, ref, torch_fn = _case_tensors(rows, cols, dtype, backward)
    points = []
    row_group = _family(argsets[0], rg._RowGroupBase)
    points.append(_measure({"kernel": row_group.metadata.kernel_name, "config": "row-group plan"}, row_group,
                           row_group.compile(argsets[0]), argsets, outs, ref, torch_fn, sets, nbytes, iters, repeats))
    kernel = _family(argsets[0], ss._StreamBase)
    try:
        for threads, unroll, part_kb in configs:
            kernel.threads = threads or ss.THREADS
            kernel.unroll = unroll or ss.default_unroll(backward, kernel.dtype.bytes)
            kernel.part_bytes = (part_kb or ss.PART_BYTES // 1024) * 1024
            p = kernel.plan(argsets[0])
            point = {"kernel": kernel.metadata.kernel_name,
                     "config": f"{kernel.threads}x{kernel.unroll}x{kernel.part_bytes // 1024}",
                     "parts_per_row": p.parts_per_row, "part_kb": p.part_vectors * 16 / 1024, "grid": p.grid}
            points.append(_measure(point, kernel, kernel.compile(argsets[0]), argsets, outs, ref, torch_fn, sets,
                                   nbytes, iters, repeats))
    finally:
        kernel.threads, kernel.unroll, kernel.part_bytes = (ss.THREADS, ss.default_unroll(backward, kernel.dtype.bytes),
                                                            ss.PART_BYTES)
    return points


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_case_arguments(ap, SHAPES)
    ap.add_argument("--configs", default="default,0x0x32,0x0x128,512x4x64,512x2x64,512x1x64,256x4x64",
                    help="THREADSxUNROLLxPART_KB, comma-separated; 0 takes the family's default, default = 0x0x0")
    opts = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("softmax_stream_sweep.py needs a CUDA GPU")
    configs = parse_configs(opts.configs, 3)
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "cases": []}

    def sweep(rows: int, cols: int, dtype: torch.dtype, backward: bool) -> list[dict]:
        return sweep_case(rows, cols, dtype, backward, configs, opts.iters, opts.repeats)

    def line(case: str, p: dict, note: str) -> str:
        tbs, torch_tbs = speed_cells(p)
        part_kb = f"{p['part_kb']:7.0f}" if "part_kb" in p else f"{'':>7}"
        return f"{case:>26} {p['config']:>22} {p.get('parts_per_row', '')!s:>6} {part_kb} {tbs} {torch_tbs}  {note}"

    run_sweep("softmax-stream-sweep", opts, report, sweep,
              f"{'case':>26} {'kernel config':>22} {'parts':>6} {'part KB':>7} {'TB/s':>6} {'torch':>6}  note", line)


if __name__ == "__main__":
    main()
