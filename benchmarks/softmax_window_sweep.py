"""The L2-window softmax (`CudaSoftmaxWindow*`) swept over its part size, ring, CTAs per SM and schedule,
next to the row-group family's plan, the stream family and the family's own build for the problem
(``by problem``: `choose_build`, what PickAny runs), each point checked against float64 and timed
against torch. The configs fix the build (``by_problem`` off).

    python3 benchmarks/softmax_window_sweep.py                      # the long shapes, bf16 and f32, both directions
    python3 benchmarks/softmax_window_sweep.py --configs 256x8x2x2x5x5,512x4x2x2x5x5 --shapes 32x1048576 --dtypes bf16

``--configs`` THREADSxUNROLLxNSLOTxMIN_BLOCKSxDELAY10xSLACK10[xALIGN[xPREFETCH]] (threads per CTA;
16-byte vectors per thread and part; ring steps; the launch bounds' CTAs per SM; the schedule's
delay and slack in tenths of a grid; the lag a whole number of grids, 1 off, 2 on; steps the copies
run ahead; 0 or ``default``: the family's). Per point: TB/s (bytes
moved once: read x, write out; backward dy, y, dx) from the median of ``--iters`` launches
alternated with torch's (`time_cuda_pair`, rotating input sets past L2), ``--repeats`` times,
and the relative error against float64; the plan's parts per row, grid and L2 window. The
row-group family's one-CTA instance under its own plan and the stream family's default are the
reference points. JSON: benchmarks/results/softmax-window-sweep-<device>[-tag].json (and $OUT/).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from kernel_api.providers.cuda_src.kernels import softmax_rowgroup as rg  # noqa: E402
from kernel_api.providers.cuda_src.kernels import softmax_stream as ss  # noqa: E402
from kernel_api.providers.cuda_src.kernels import softmax_window as sw  # noqa: E402
from softmax import _case_tensors  # noqa: E402
from softmax_rowgroup_sweep import _measure, add_case_arguments, parse_configs, run_sweep, speed_cells  # noqa: E402


def parse_configs_any(text: str, lengths: tuple[int, ...]) -> list[tuple[int, ...]]:
    """`parse_configs` taking any of ``lengths`` numbers per config."""
    found = []
    for item in text.split(","):
        n = len(item.split("x"))
        found += parse_configs(item, n if n in lengths else lengths[0])
    return found
from softmax_stream_sweep import _family  # noqa: E402

SHAPES = [(32, 2**20), (8, 2**22)]


#: ``--defines`` sets: compile-time defines each config is also measured with (softmax.cu's store hint;
#: late / peek: the row combination after the step's output (WN_COMBINE_LATE) / its partials asked for
#: at the top of the step (WN_PEEKS per thread). (The polyK sets of results/...-s36-poly.json: commit cf13d90.)
DEFINE_SETS = {"cs": {}, "wb": {"KA_ST16": '"st.global.v4.u32"'}, "na": {"KA_ST16": '"st.global.L1::no_allocate.v4.u32"'},
               "late": {"WN_COMBINE_LATE": 1}, "peek": {"WN_PEEKS": 1}, "peeklate": {"WN_PEEKS": 1, "WN_COMBINE_LATE": 1},
               "peek2": {"WN_PEEKS": 2}, "peek2late": {"WN_PEEKS": 2, "WN_COMBINE_LATE": 1}}


def sweep_case(rows: int, cols: int, dtype: torch.dtype, backward: bool, configs: list, iters: int,
               repeats: int, define_sets: tuple[str, ...] = ("cs",), ctas_per_sm: int | None = None) -> list[dict]:
    nbytes, sets, argsets, outs, ref, torch_fn = _case_tensors(rows, cols, dtype, backward)
    points = []
    for cls, label in ((rg._RowGroupBase, "row-group plan"), (ss._StreamBase, "stream default")):
        ref_kernel = _family(argsets[0], cls)
        points.append(_measure({"kernel": ref_kernel.metadata.kernel_name, "config": label}, ref_kernel,
                               ref_kernel.compile(argsets[0]), argsets, outs, ref, torch_fn, sets, nbytes, iters,
                               repeats))
    kernel = _family(argsets[0], sw._WindowBase)
    device = torch.cuda.current_device()
    kernel.max_ctas_per_sm = ctas_per_sm
    b = kernel.build(argsets[0])  # (the family's own choice for the problem: what PickAny runs)
    points.append(_measure({"kernel": kernel.metadata.kernel_name,
                            "config": f"by problem {b.unroll}x{b.nslot}x{round(b.delay_rounds * 10)}"
                                      + (f" peeks {b.peeks}" if b.peeks else "")},
                           kernel, kernel.compile(argsets[0]), argsets, outs, ref, torch_fn, sets, nbytes, iters,
                           repeats))
    kernel.by_problem = False
    try:
        for (threads, unroll, nslot, min_blocks, delay10, slack10, align, prefetch), dset in (
                (c, d) for c in configs for d in define_sets):
            kernel.extra_defines = dict(DEFINE_SETS[dset])
            kernel.threads = threads or sw.THREADS
            kernel.unroll = unroll or sw.UNROLL[backward]
            kernel.nslot = nslot or sw.NSLOT
            kernel.min_blocks = min_blocks or sw.MIN_BLOCKS
            kernel.delay_rounds = delay10 / 10 if delay10 else sw.DELAY_ROUNDS
            kernel.slack_rounds = slack10 / 10 if slack10 else sw.SLACK_ROUNDS
            kernel.align = align == 2 if align else sw.ALIGN
            kernel.prefetch = prefetch or sw.PREFETCH
            kernel.max_ctas_per_sm = ctas_per_sm
            point = {"kernel": kernel.metadata.kernel_name,
                     "config": f"{kernel.threads}x{kernel.unroll}x{kernel.nslot}x{kernel.min_blocks}"
                               f"x{round(kernel.delay_rounds * 10)}x{round(kernel.slack_rounds * 10)}"
                               f"x{1 + kernel.align}x{kernel.prefetch}" + ("" if dset == "cs" else f" {dset}")}
            try:  # (a ring past the SM's shared memory: reported, the sweep goes on)
                artifact = kernel.compile(argsets[0])
                p = kernel.plan(argsets[0], kernel.resident_ctas(artifact.compiled_obj, device))
            except Exception as exc:  # noqa: BLE001
                points.append({**point, "error": f"{type(exc).__name__}: {exc}"[:300]})
                continue
            point.update(parts_per_row=p.parts_per_row, part_kb=p.part_vectors * 16 / 1024, grid=p.grid, lag=p.lag,
                         window_mb=p.window_bytes(backward) / 2**20)
            points.append(_measure(point, kernel, artifact, argsets, outs, ref, torch_fn, sets, nbytes, iters,
                                   repeats))
    finally:
        kernel.threads, kernel.unroll, kernel.nslot = sw.THREADS, sw.UNROLL[backward], sw.NSLOT
        kernel.min_blocks = sw.MIN_BLOCKS
        kernel.delay_rounds, kernel.slack_rounds = sw.DELAY_ROUNDS, sw.SLACK_ROUNDS
        kernel.align, kernel.prefetch = sw.ALIGN, sw.PREFETCH
        kernel.max_ctas_per_sm = None
        kernel.by_problem = True
        kernel.extra_defines = {}
    return points


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_case_arguments(ap, SHAPES)
    ap.add_argument("--configs", default="default,512x4x0x0x0x0,0x0x3x0x0x0,0x0x0x0x7x7",
                    help="THREADSxUNROLLxNSLOTxMIN_BLOCKSxDELAY10xSLACK10, comma-separated; 0 takes the "
                         "family's default, default = 0x0x0x0x0x0")
    ap.add_argument("--defines", default="cs", help=f"comma-separated define sets of {sorted(DEFINE_SETS)} "
                    "each config is measured with (cs: the family's own)")
    ap.add_argument("--ctas-per-sm", type=int, default=None,
                    help="cap the CTAs per SM (default: every co-resident one; a smaller ring lets more reside)")
    opts = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("softmax_window_sweep.py needs a CUDA GPU")
    configs = [c + (0,) * (8 - len(c)) for c in parse_configs_any(opts.configs, (6, 7, 8))]
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "cases": []}

    def sweep(rows: int, cols: int, dtype: torch.dtype, backward: bool) -> list[dict]:
        return sweep_case(rows, cols, dtype, backward, configs, opts.iters, opts.repeats,
                          tuple(opts.defines.split(",")), opts.ctas_per_sm)

    def line(case: str, p: dict, note: str) -> str:
        tbs, torch_tbs = speed_cells(p)
        grid = f"{p['grid']:>5} {p['window_mb']:6.1f}" if "grid" in p else f"{'':>5} {'':>6}"
        return f"{case:>26} {p['config']:>20} {p.get('parts_per_row', '')!s:>6} {grid} {tbs} {torch_tbs}  {note}"

    run_sweep("softmax-window-sweep", opts, report, sweep,
              f"{'case':>26} {'kernel config':>20} {'parts':>6} {'grid':>5} {'win MB':>6} {'TB/s':>6} {'torch':>6}  "
              f"note", line)


if __name__ == "__main__":
    main()
