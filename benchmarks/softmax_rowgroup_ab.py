"""The row-group softmax family against another version of its own source, in one process: each
instance of the working tree paired with the same instance compiled from ``--base-source`` (a
copy of softmax_rowgroup.cu, e.g. ``git show <rev>:kernel_api/providers/cuda_src/kernels/softmax_rowgroup.cu``)
or ``--base-rev`` (read with git, where the checkout has its history), joined to softmax.cu's
helpers: the revision's, ``--base-shared-source``, or the working tree's.

    python3 benchmarks/softmax_rowgroup_ab.py --base-rev HEAD~1 --tag s34-walk
    python3 benchmarks/softmax_rowgroup_ab.py --base-source /tmp/old.cu --dtypes bf16 --directions fwd

Either build may add compile-time defines (``--base-defines``, ``--new-defines``: the source's
experiment switches). Both builds run the same plan (the working tree's `plan_rows`), so only the kernels differ. For
each dtype, direction, shape and variant (1: one CTA per SM, 2: two), each build is checked
against float64 (relative error), then the two are timed against each other with
`time_cuda_pair` (alternating launches, rotating input sets past L2), ``--repeats`` times with
the order swapped every other repeat so that neither holds the first slot. Prints TB/s (bytes
moved once) of each and the ratio new / base, median and range; writes
benchmarks/results/softmax-rowgroup-ab-<device>[-tag].json (and $OUT/).
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import subprocess
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from kernel_api.providers.cuda_src.kernels import softmax as sm  # noqa: E402
from kernel_api.providers.cuda_src.kernels import softmax_rowgroup as rg  # noqa: E402
from kernel_api.tuning.timing import time_cuda_pair  # noqa: E402
from results_io import result_name, write_result  # noqa: E402
from softmax import _case_tensors  # noqa: E402
from softmax_rowgroup_sweep import DTYPES, SHAPES, add_case_arguments, row_group_kernel  # noqa: E402

SOURCE = "kernel_api/providers/cuda_src/kernels/softmax_rowgroup.cu"
SHARED_SOURCE = "kernel_api/providers/cuda_src/kernels/softmax.cu"


def _git_show(rev: str, path: str) -> str:
    return subprocess.run(["git", "show", f"{rev}:{path}"], cwd=ROOT, check=True, capture_output=True,
                          text=True).stdout


def base_source(opts: argparse.Namespace) -> str:
    """The base build's whole source text: softmax.cu (``--base-shared-source``, the revision's
    with ``--base-rev``, else the working tree's) followed by softmax_rowgroup.cu
    (``--base-source`` or ``--base-rev``)."""
    if opts.base_source:
        with open(opts.base_source) as f:
            own = f.read()
    else:
        own = _git_show(opts.base_rev, SOURCE)
    if opts.base_shared_source:
        with open(opts.base_shared_source) as f:
            shared = f.read()
    elif opts.base_rev:
        shared = _git_show(opts.base_rev, SHARED_SOURCE)
    else:
        shared = sm.CudaSoftmaxForward.get_source()
    return shared + "\n" + own


def build(kernel: rg._RowGroupBase, text: str | None = None, defines: dict | None = None,
          consumers: int | None = None) -> rg._RowGroupBase:
    """A copy of ``kernel`` that compiles ``text`` (the whole source: softmax.cu's and the
    family's; default: its own) with ``defines`` added to its own (its own artifact: the compile
    cache keys on the source and the defines), and with ``consumers`` compute threads per CTA
    if given."""
    cls = type(kernel)
    joined = cls.get_source() if text is None else text
    extra = dict(defines or {})
    built_cls = type(f"AB{cls.__name__}", (cls,), {
        "get_source": classmethod(lambda c: joined),
        "defines_for": lambda self, args: {**cls.defines_for(self, args), **extra}})
    copied = copy.copy(kernel)
    copied.__class__ = built_cls
    if consumers:
        copied.consumers = consumers
    return copied


def parse_defines(text: str) -> dict[str, int]:
    """``--*-defines``: comma-separated NAME=integer."""
    return {name: int(value) for name, value in (item.split("=") for item in text.split(",") if item)}


def compare(rows: int, cols: int, dtype: torch.dtype, backward: bool, variant: int, text: str, iters: int,
            repeats: int, base_defines: dict, new_defines: dict, new_consumers: int | None = None) -> dict:
    nbytes, sets, argsets, outs, ref, _ = _case_tensors(rows, cols, dtype, backward)
    new = row_group_kernel(argsets[0], variant)
    builds = {"base": build(new, text, base_defines), "new": build(new, None, new_defines, new_consumers)}
    point = {"variant": variant, "kernel": new.metadata.kernel_name}
    runs = {}
    for name, kernel in builds.items():
        artifact = kernel.compile(argsets[0])
        outs[0].fill_(float("nan"))
        kernel.run(argsets[0], compiled_artifact=artifact)
        torch.cuda.synchronize()
        point[f"{name}_rel_err"] = err = ((outs[0].double() - ref).norm() / ref.norm()).item()
        if not err < 1e-2:
            point["error"] = f"{name}: relative error {err:.2e}"
            return point
        runs[name] = (lambda k, a: lambda i: k.run(argsets[i], compiled_artifact=a, assume_supported_args=True))(
            kernel, artifact)
    base_ms, new_ms = [], []
    for r in range(repeats):
        if r % 2 == 0:
            b, n = time_cuda_pair(runs["base"], runs["new"], sets=sets, repeat=iters)
        else:
            n, b = time_cuda_pair(runs["new"], runs["base"], sets=sets, repeat=iters)
        base_ms.append(b)
        new_ms.append(n)
    ratios = [b / n for b, n in zip(base_ms, new_ms)]
    point.update(base_ms=base_ms, new_ms=new_ms, ratios=ratios, ratio=statistics.median(ratios),
                 base_tbs=nbytes / (statistics.median(base_ms) * 1e-3) / 1e12,
                 new_tbs=nbytes / (statistics.median(new_ms) * 1e-3) / 1e12)
    return point


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_case_arguments(ap, SHAPES)
    ap.add_argument("--variants", default="1,2", help="CTAs per SM (1: rowgroup, 2: rowgroup2)")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--base-source", help="a copy of softmax_rowgroup.cu to compare against")
    src.add_argument("--base-rev", help="a git revision whose softmax_rowgroup.cu to compare against")
    ap.add_argument("--base-shared-source", help="a copy of softmax.cu for the base build (default: the "
                    "--base-rev's, else the working tree's)")
    ap.add_argument("--base-defines", default="", help="NAME=value,... added to the base build's defines")
    ap.add_argument("--new-defines", default="", help="NAME=value,... added to the working tree's build's defines")
    ap.add_argument("--new-consumers", type=int, help="compute threads per CTA of the working tree's build")
    opts = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("softmax_rowgroup_ab.py needs a CUDA GPU")
    text = base_source(opts)
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "base": opts.base_source or opts.base_rev, "base_shared": opts.base_shared_source, "base_defines": parse_defines(opts.base_defines),
              "new_defines": parse_defines(opts.new_defines), "new_consumers": opts.new_consumers, "cases": []}
    print(f"{'case':>26} {'var':>3} {'base TB/s':>9} {'new TB/s':>9} {'new/base':>8} {'range':>13}")
    for dname in opts.dtypes.split(","):
        for direction in opts.directions.split(","):
            for shape in opts.shapes.split(","):
                rows, cols = map(int, shape.split("x"))
                for variant in (int(v) for v in opts.variants.split(",")):
                    p = compare(rows, cols, DTYPES[dname], direction == "bwd", variant, text, opts.iters,
                                opts.repeats, report["base_defines"], report["new_defines"], opts.new_consumers)
                    p.update(dtype=dname, direction=direction, shape=[rows, cols])
                    report["cases"].append(p)
                    case = f"{dname} {direction} {rows}x{cols}"
                    if "error" in p:
                        print(f"{case:>26} {variant:>3}  {p['error']}", flush=True)
                        continue
                    print(f"{case:>26} {variant:>3} {p['base_tbs']:9.2f} {p['new_tbs']:9.2f} {p['ratio']:8.3f} "
                          f"{min(p['ratios']):6.3f}-{max(p['ratios']):.3f}", flush=True)
    for path in write_result(result_name("softmax-rowgroup-ab", report["device"], opts.tag), report, indent=2):
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
