"""The row-group softmax family's plans swept: variant (CTAs per SM), ring size (shared memory
per CTA) and CTAs per row (S), each point checked against float64 and timed against torch.

    python3 benchmarks/softmax_rowgroup_sweep.py                          # both variants, the plan, rings 14/7/6
    python3 benchmarks/softmax_rowgroup_sweep.py --variants 1 --S plan,8,11,16,22,33,44,66,132 --rings 14   # session 23's

For each dtype, direction and long shape (default 32x1M and 8x4M, as issue #16's goal 6), each
variant of ``--variants`` (1: one CTA of 512 consumers per SM, ``rowgroup``; 2: two CTAs of 256
per SM, ``rowgroup2``), each ring of ``--rings`` chunks of 16 KB (a cap: 14 is the one-CTA
variant's own ring, the two-CTA variant's is 7, so larger values leave it at 7; points whose
ring and S repeat one already run are skipped), each S of ``--S`` (``plan``: `plan_rows`'
choice for that ring and the CTAs it lets reside): the plan launched (S, row groups G, waves,
slice per array, overflow), the relative error against float64, and TB/s (bytes moved once:
read x / write out; backward: dy, y, dx) from the median of ``--iters`` launches alternated
with torch's (`time_cuda_pair`, rotating input sets past L2), ``--repeats`` times. Prints a
table (the best point per case marked) and writes
benchmarks/results/softmax-rowgroup-sweep-<device>[-tag].json (and $OUT/).
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
from typing import Iterator

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import kernel_api  # noqa: E402
from kernel_api.providers.cuda_src.kernels import softmax_rowgroup as rg  # noqa: E402
from kernel_api.tuning.timing import time_cuda_pair  # noqa: E402
from results_io import result_name, write_result  # noqa: E402
from softmax import DTYPES, _case_tensors  # noqa: E402

SHAPES = [(32, 2**20), (8, 2**22)]


def row_group_kernel(args, ctas_per_sm: int = 1, bulk_out: bool | None = None,
                     packed_math: bool | None = None) -> rg._RowGroupBase:
    """The family's instance for ``args`` with ``ctas_per_sm`` CTAs per SM (discovery's); with
    ``bulk_out`` True or False a copy set to that store build (True: RG_BULK_OUT, the storer
    warp's TMA bulk stores; False: stores from the consumer threads)."""
    found = [k for k in kernel_api.get_kernels(args)
             if isinstance(k, rg._RowGroupBase) and k.ctas_per_sm == ctas_per_sm]
    if not found:
        raise RuntimeError(f"no row-group kernel with {ctas_per_sm} CTA(s) per SM for {args}")
    kernel = found[0]
    if (bulk_out is not None and bulk_out != kernel.bulk_out) or (packed_math is not None
                                                                  and packed_math != kernel.packed_math):
        kernel = copy.copy(kernel)
        kernel.bulk_out = kernel.bulk_out if bulk_out is None else bulk_out
        kernel.packed_math = kernel.packed_math if packed_math is None else packed_math
    return kernel


def sweep_case(rows: int, cols: int, dtype: torch.dtype, backward: bool, variants: list[str], rings: list[int],
               splits: list, iters: int, repeats: int, staggers: tuple = (None,)) -> list[dict]:
    nbytes, sets, argsets, outs, ref, torch_fn = _case_tensors(rows, cols, dtype, backward)
    device = torch.cuda.current_device()
    points = []
    for variant, stagger in [(v, s) for v in variants for s in staggers]:
        ctas_per_sm = int(variant.rstrip("btps"))
        store = True if "b" in variant else False if "t" in variant else None
        packed = True if "p" in variant else False if "s" in variant else None
        kernel = row_group_kernel(argsets[0], ctas_per_sm, store, packed)
        if stagger is not None and stagger != kernel.stagger_ns:
            kernel = copy.copy(kernel)
            kernel.stagger_ns = stagger
        artifact = kernel.compile(argsets[0])
        launcher = artifact.compiled_obj
        seen = set()
        try:
            for ring in rings:
                for split in splits:
                    kernel.limit_ring = ring
                    kernel.ctas_per_row = None if split == "plan" else int(split)
                    plan, resident = kernel.group_plan(argsets[0], launcher, device)  # what _run launches
                    if (plan.ring_chunks, split) in seen:
                        continue  # (a ring above the variant's own: the same point again)
                    seen.add((plan.ring_chunks, split))
                    point = {"variant": variant if stagger is None else f"{variant}@{stagger}",
                             "kernel": kernel.metadata.kernel_name, "threads": kernel.threads,
                             "stagger_ns": kernel.stagger_ns,
                             "ring_asked": ring, "ring": plan.ring_chunks, "S_asked": split, "resident_ctas": resident,
                             "S": plan.ctas_per_row, "G": plan.groups, "waves": plan.waves,
                             "slice_kb": plan.slice_vectors * 16 / 1024, "overflow_vectors": plan.overflow_vectors,
                             "ahead": plan.ahead}
                    points.append(_measure(point, kernel, artifact, argsets, outs, ref, torch_fn, sets, nbytes, iters,
                                           repeats))
        finally:
            kernel.limit_ring = kernel.ctas_per_row = None
    return points


def _measure(point: dict, kernel, artifact, argsets, outs, ref, torch_fn, sets: int, nbytes: int, iters: int,
             repeats: int) -> dict:
    """Check one point against float64 and time it against torch (errors reported in the point)."""
    try:
        outs[0].fill_(float("nan"))
        kernel.run(argsets[0], compiled_artifact=artifact)
        torch.cuda.synchronize()
        point["rel_err"] = ((outs[0].double() - ref).norm() / ref.norm()).item()
        if not point["rel_err"] < 1e-2:
            raise RuntimeError(f"wrong result: relative error {point['rel_err']:.2e}")
        ms = [time_cuda_pair(torch_fn, lambda i: kernel.run(argsets[i], compiled_artifact=artifact,
                                                            assume_supported_args=True),
                             sets=sets, repeat=iters) for _ in range(repeats)]
        point["torch_ms"] = statistics.median(t for t, _ in ms)
        point["ms_runs"] = [k for _, k in ms]
        point["ms"] = statistics.median(point["ms_runs"])
        point["tbs"] = nbytes / (point["ms"] * 1e-3) / 1e12
    except Exception as exc:  # report, keep sweeping
        point["error"] = f"{type(exc).__name__}: {exc}"[:300]
    return point


def swept_cases(opts: argparse.Namespace, report: dict, sweep) -> Iterator[tuple[str, list[dict], dict | None]]:
    """For each dtype, direction and shape of ``opts``: ``sweep(rows, cols, dtype, backward)``'s
    points, entered in ``report["cases"]``; yields the case's label, its points and the fastest."""
    for dname in opts.dtypes.split(","):
        for direction in opts.directions.split(","):
            for shape in opts.shapes.split(","):
                rows, cols = map(int, shape.split("x"))
                points = sweep(rows, cols, DTYPES[dname], direction == "bwd")
                report["cases"].append({"dtype": dname, "direction": direction, "shape": [rows, cols],
                                        "points": points})
                timed = [p for p in points if "tbs" in p]
                yield f"{dname} {direction} {rows}x{cols}", points, max(timed, key=lambda p: p["tbs"]) if timed else None


def parse_configs(text: str, fields: int) -> list[tuple[int, ...]]:
    """``--configs`` of the per-family sweeps: comma-separated ``AxB[xC]`` integer tuples of
    ``fields`` values, ``default`` standing for all zeros (the family's own choices)."""
    found = []
    for item in text.split(","):
        values = (0,) * fields if item == "default" else tuple(int(v) for v in item.split("x"))
        if len(values) != fields:
            raise SystemExit(f"--configs {item}: expected {fields} numbers joined by 'x'")
        found.append(values)
    return found


def add_case_arguments(ap: argparse.ArgumentParser, shapes: list[tuple[int, int]]) -> None:
    """The options every softmax sweep takes: dtypes, directions, shapes, iterations, repeats, tag."""
    ap.add_argument("--dtypes", default="bf16,f32")
    ap.add_argument("--directions", default="fwd,bwd")
    ap.add_argument("--shapes", default=",".join(f"{r}x{c}" for r, c in shapes))
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--tag", default="")


def run_sweep(name: str, opts: argparse.Namespace, report: dict, sweep, header: str, line) -> None:
    """Print ``header``, then ``line(case, point, note)`` for every point of every case (the
    note: the point's error, or "best"), and write the report as results/<name>-<device>[-tag].json."""
    print(header)
    for case, points, best in swept_cases(opts, report, sweep):
        for p in points:
            print(line(case, p, p.get("error", "") or ("best" if p is best else "")), flush=True)
    for path in write_result(result_name(name, report["device"], opts.tag), report, indent=2):
        print(f"wrote {path}")


def speed_cells(p: dict) -> tuple[str, str]:
    """A point's TB/s and torch's in the same run, as table cells ('-' for a point not timed)."""
    if "tbs" not in p:
        return f"{'-':>6}", f"{'-':>6}"
    return f"{p['tbs']:6.2f}", f"{p['tbs'] * p['ms'] / p['torch_ms']:6.2f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_case_arguments(ap, SHAPES)
    ap.add_argument("--variants", default="1,2", help="CTAs per SM: 1 (rowgroup), 2 (rowgroup2), each in the "
                    "instance's store build; with a suffix 'b' (1b, 2b) the bulk-store build (RG_BULK_OUT: the "
                    "forward's), 't' the consumer threads' stores (the backward's); and with 'p' / 's' "
                    "packed 16-bit math (RG_PACKED_MATH, the 16-bit forwards') / f32 math")
    ap.add_argument("--rings", default="14,7,6", help="ring chunks per CTA (16 KB each; a cap per variant)")
    ap.add_argument("--S", default="plan", help="CTAs per row: 'plan' and/or numbers")
    ap.add_argument("--stagger", default="", help="ns the upper half of the row groups starts late with 4+ waves "
                    "(RG_STAGGER_NS; 0: none), each value a point, shown after '@' in the variant column; default: "
                    "the instance's own (the forward's STAGGER_NS_FORWARD)")
    opts = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("softmax_rowgroup_sweep.py needs a CUDA GPU")
    variants = opts.variants.split(",")
    if not {int(v.rstrip("btps")) for v in variants} <= set(rg.CONSUMERS_BY_CTAS_PER_SM):
        sys.exit(f"--variants: CTAs per SM among {sorted(rg.CONSUMERS_BY_CTAS_PER_SM)}")
    rings = [int(r) for r in opts.rings.split(",")]
    splits = [s if s == "plan" else int(s) for s in opts.S.split(",")]
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "variants": variants, "cases": []}

    def sweep(rows: int, cols: int, dtype: torch.dtype, backward: bool) -> list[dict]:
        return sweep_case(rows, cols, dtype, backward, variants, rings, splits, opts.iters, opts.repeats,
                          tuple(int(v) for v in opts.stagger.split(",")) if opts.stagger else (None,))

    def line(case: str, p: dict, note: str) -> str:
        tbs, torch_tbs = speed_cells(p)
        note += " (plan)" if p.get("S_asked") == "plan" and not p.get("error") else ""
        return (f"{case:>28} {p['variant']:>3} {p['ring']:4d} {p['S']:4d} {p['G']:3d} {p['waves']:5d} "
                f"{p['slice_kb']:8.0f} {p['overflow_vectors']:6d} {tbs} {torch_tbs}  {note}")

    run_sweep("softmax-rowgroup-sweep", opts, report, sweep,
              f"{'case':>28} {'var':>3} {'ring':>4} {'S':>4} {'G':>3} {'waves':>5} {'slice KB':>8} {'over':>6} "
              f"{'TB/s':>6} {'torch':>6}  note", line)


if __name__ == "__main__":
    main()
