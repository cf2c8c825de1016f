"""Where a row-group softmax launch spends its time, from the RG_TRACE build's %globaltimer
stamps (softmax_rowgroup.py's `read_trace`), next to the plain build's kernel time.

    python3 benchmarks/softmax_rowgroup_trace.py --tag s25
    python3 benchmarks/softmax_rowgroup_trace.py --cases 1x1M:bf16 --variants 2 --directions fwd --launches 10
    python3 benchmarks/softmax_rowgroup_trace.py --cases 32x1M:bf16 --variants 1 --directions fwd --S plan,32

Cases (``--cases``, rows x cols:dtype; default 32x1M and 8x4M in bf16 and f32, and 1x1M bf16),
each forward and backward (``--directions``) and for each variant (``--variants``: 1, one CTA of
512 consumers per SM; 2, two CTAs of 256). Per case: ``--warmup`` launches of both builds, the
kernel time of each (median of ``--iters`` launches between CUDA events, L2 flushed before
each), then ``--launches`` traced launches (L2 flushed, trace cleared) whose stamps are
summarised per launch and the median over launches printed, in microseconds from the
earliest CTA's entry:

- entry skew: the spread of the CTAs' entry stamps (how long the launch takes to start them);
  ready: ring initialised; first copy: the producer's first TMA copy issued;
- per wave (med/max over CTAs): stats, its slice's statistics done (chunks arrived, reduced);
  wait = met - stats, the group's partials all seen; store = stored - met, every consumer's
  stores issued; issued, the producer's last copy of the wave issued;
- tail: exit - the last wave's stored; span: the last exit.

The trace records the first 16 waves of each CTA (`TRACE_WAVES`); the traced build adds one
consumer barrier per wave, so compare its kernel time with the plain build's. %globaltimer's
step is estimated from the stamps (``timer_gcd_ns``): where it is coarse (1 us on some
drivers), read the medians, not single stamps. JSON:
benchmarks/results/softmax-rowgroup-trace-<device>[-tag].json (and a copy in $OUT when that is
a directory), with ``--raw`` the first traced launch's per-CTA records too.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from kernel_api import SoftmaxArguments, SoftmaxBackwardArguments  # noqa: E402
from kernel_api.core.arch import device_cc  # noqa: E402
from kernel_api.providers.cuda_src.kernels import softmax_rowgroup as rg  # noqa: E402
from results_io import result_name, write_result  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}
DEFAULT_CASES = "32x1M:bf16,32x1M:f32,8x4M:bf16,8x4M:f32,1x1M:bf16"
_WAVE_KEYS = ("stats", "wait", "store", "issued")


def parse_case(text: str) -> tuple[int, int, str]:
    """``"32x1M:bf16"`` -> (32, 1048576, "bf16"); K and M are 2^10 and 2^20."""
    shape, _, dname = text.partition(":")
    rows, cols = shape.lower().split("x")
    scale = {"k": 2**10, "m": 2**20}.get(cols[-1:], 1)
    cols = int(cols[:-1]) * scale if scale > 1 else int(cols)
    if dname not in DTYPES:
        raise ValueError(f"case {text!r}: dtype must be one of {sorted(DTYPES)}")
    return int(rows), cols, dname


def _med(values: list) -> float:
    return statistics.median(values) if values else float("nan")


def summarise(records: list[dict]) -> dict:
    """One traced launch's phases (microseconds from the earliest entry stamp): scalars with
    ``_med``/``_max`` over CTAs, and per recorded wave the same over the CTAs that took it."""
    t0 = min(r["entry"] for r in records)

    def us(t: int) -> float:
        return (t - t0) / 1000.0

    def both(name: str, values: list) -> dict:
        return {f"{name}_med": _med(values), f"{name}_max": max(values) if values else float("nan")}

    entries = [us(r["entry"]) for r in records]
    out = {"ctas": len(records), "entry_skew": max(entries) - min(entries), "span": max(us(r["exit"]) for r in records)}
    out |= both("ready", [us(r["ready"]) for r in records])
    out |= both("first_copy", [us(r["issue_first"]) for r in records if r["issue_first"]])
    out |= both("first_stats", [us(r["stats"][0]) for r in records if r["stats"]])
    # (a CTA with waves past those recorded has no last stored stamp)
    out |= both("tail", [(r["exit"] - r["stored"][-1]) / 1000.0 for r in records
                         if r["stored"] and r["waves"] == len(r["stored"])])
    waves = []
    for w in range(max(len(r["stats"]) for r in records)):
        took = [r for r in records if len(r["stats"]) > w]
        wave = {"wave": w, "ctas": len(took)}
        wave |= both("stats", [us(r["stats"][w]) for r in took])
        wave |= both("wait", [(r["met"][w] - r["stats"][w]) / 1000.0 for r in took])
        wave |= both("store", [(r["stored"][w] - r["met"][w]) / 1000.0 for r in took])
        wave |= both("issued", [us(r["issued"][w]) for r in took if r["issued"][w]])
        waves.append(wave)
    out["waves"] = waves
    return out


def combine(summaries: list[dict]) -> dict:
    """The median over launches of every number of `summarise` (waves present in all)."""
    out = {k: _med([s[k] for s in summaries]) for k, v in summaries[0].items() if k != "waves"}
    n = min(len(s["waves"]) for s in summaries)
    out["waves"] = [{k: _med([s["waves"][w][k] for s in summaries]) for k in summaries[0]["waves"][w]}
                    for w in range(n)]
    return out


def timer_step_ns(records: list[dict]) -> int:
    """The greatest common divisor of the stamps' offsets from the first: %globaltimer's step
    (or a multiple of it)."""
    stamps = [t for r in records
              for t in (r["entry"], r["ready"], r["exit"], *r["stats"], *r["met"], *r["stored"]) if t]
    t0 = min(stamps)
    g = 0
    for t in stamps:
        g = math.gcd(g, t - t0)
    return g


def _operands(rows: int, cols: int, dtype: torch.dtype, backward: bool) -> tuple:
    """The arguments and the tensor the kernel writes."""
    if backward:
        y = torch.softmax(torch.randn(rows, cols, device="cuda") * 2, -1).to(dtype)
        g = torch.randn(rows, cols, device="cuda", dtype=dtype)
        grad_in = torch.empty_like(y)
        return SoftmaxBackwardArguments(g, y, grad_in), grad_in
    x = (torch.randn(rows, cols, device="cuda") * 4).to(dtype)
    out = torch.empty_like(x)
    return SoftmaxArguments(x, out), out


def _instance(cls: type, dtype: torch.dtype, ctas_per_sm: int, cc: int, trace: bool) -> rg._RowGroupBase:
    """A fresh instance (its trace switch its own, not the registry's)."""
    k = next(k for k in cls.generate_kernels(None, cc=cc)
             if k.dtype.to_torch() == dtype and k.ctas_per_sm == ctas_per_sm)
    k.trace = trace
    return k


def _event_us(fn, flush, iters: int) -> float:
    times = []
    for _ in range(iters):
        flush()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0)
    return statistics.median(times)


def trace_case(rows: int, cols: int, dname: str, backward: bool, ctas_per_sm: int, opts, flush,
               ctas_per_row: int | None = None) -> dict:
    dtype = DTYPES[dname]
    cc = device_cc(None)
    cls = rg.CudaSoftmaxRowGroupBackward if backward else rg.CudaSoftmaxRowGroupForward
    plain, traced = (_instance(cls, dtype, ctas_per_sm, cc, t) for t in (False, True))
    plain.ctas_per_row = traced.ctas_per_row = ctas_per_row  # (None: the plan's)
    args, result = _operands(rows, cols, dtype, backward)
    status = traced.supports(args)
    if not status:
        raise RuntimeError(status.error)
    plain_art, traced_art = plain.compile(args), traced.compile(args)
    device = torch.cuda.current_device()
    plan, resident = traced.group_plan(args, traced_art.compiled_obj, device)
    ws_plain = torch.empty(plain.get_workspace_size(args), dtype=torch.uint8, device="cuda")
    ws = torch.empty(traced.get_workspace_size(args), dtype=torch.uint8, device="cuda")

    def run_plain() -> None:
        plain.run(args, compiled_artifact=plain_art, workspace=ws_plain, assume_supported_args=True)

    def run_traced() -> None:
        traced.run(args, compiled_artifact=traced_art, workspace=ws, assume_supported_args=True)

    for _ in range(opts.warmup):
        run_plain()
        run_traced()
    run_plain()
    torch.cuda.synchronize()
    plain_out = result.clone()
    result.fill_(float("nan"))
    run_traced()
    torch.cuda.synchronize()
    entry = {"dtype": dname, "direction": "bwd" if backward else "fwd", "shape": [rows, cols],
             "variant": ctas_per_sm, "kernel": traced.metadata.kernel_name, "threads": traced.threads,
             "plan": {"S": plan.ctas_per_row, "G": plan.groups, "waves": plan.waves, "grid": plan.grid,
                      "resident": resident, "ring": plan.ring_chunks, "slice_kb": plan.slice_vectors * 16 / 1024,
                      "overflow_vectors": plan.overflow_vectors, "ahead": plan.ahead},
             "matches_plain": bool(torch.equal(result.view(torch.uint8), plain_out.view(torch.uint8))),
             "plain_us": _event_us(run_plain, flush, opts.iters), "traced_us": _event_us(run_traced, flush, opts.iters)}
    summaries, steps, first = [], [], None
    for _ in range(opts.launches):
        flush()
        rg.clear_trace(ws, plan)
        run_traced()
        torch.cuda.synchronize()
        records = rg.read_trace(ws, plan)
        first = first or records
        summaries.append(summarise(records))
        steps.append(timer_step_ns(records))
    entry["timer_gcd_ns"] = min(steps)
    entry["summary"] = combine(summaries)
    if opts.raw:
        entry["records"] = first
    return entry


def print_case(e: dict) -> None:
    p, s = e["plan"], e["summary"]
    print(f"== {e['dtype']} {e['direction']} {e['shape'][0]}x{e['shape'][1]}  {e['kernel']} "
          f"({e['variant']} CTA/SM, {e['threads']} threads): S={p['S']} G={p['G']} waves={p['waves']} "
          f"grid={p['grid']}/{p['resident']} ring={p['ring']} slice={p['slice_kb']:.0f} KB"
          f"{' overflow' if p['overflow_vectors'] else ''}{' ahead' if p['ahead'] else ''}")
    print(f"   kernel (events, L2 flushed): plain {e['plain_us']:.1f} us, traced {e['traced_us']:.1f} us; "
          f"timer step {e['timer_gcd_ns']} ns{'' if e['matches_plain'] else '  OUTPUT DIFFERS FROM PLAIN'}")
    print(f"   us from first entry (med/max over CTAs): entry skew {s['entry_skew']:.2f}  "
          f"ready {s['ready_med']:.2f}/{s['ready_max']:.2f}  first copy {s['first_copy_med']:.2f}/"
          f"{s['first_copy_max']:.2f}  first stats {s['first_stats_med']:.2f}/{s['first_stats_max']:.2f}  "
          f"tail {s['tail_med']:.2f}/{s['tail_max']:.2f}  span {s['span']:.2f}")
    print(f"   {'wave':>4} {'stats':>13} {'wait':>13} {'store':>13} {'issued':>13}")
    for w in s["waves"]:
        cells = " ".join(f"{w[k + '_med']:6.2f}/{w[k + '_max']:<6.2f}" for k in _WAVE_KEYS)
        print(f"   {int(w['wave']):4d} {cells}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default=DEFAULT_CASES, help="rows x cols:dtype, comma-separated")
    ap.add_argument("--directions", default="fwd,bwd")
    ap.add_argument("--variants", default="1,2", help="CTAs per SM: 1 (rowgroup), 2 (rowgroup2)")
    ap.add_argument("--S", default="plan", help="CTAs per row: 'plan' and/or numbers, each a case")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=20, help="launches timed between events, per build")
    ap.add_argument("--launches", type=int, default=5, help="traced launches summarised")
    ap.add_argument("--no-flush", action="store_true", help="keep L2 warm between launches")
    ap.add_argument("--raw", action="store_true", help="keep the first traced launch's per-CTA records")
    ap.add_argument("--tag", default="")
    opts = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("softmax_rowgroup_trace.py needs a CUDA GPU")
    cases = [parse_case(c) for c in opts.cases.split(",")]
    variants = [int(v) for v in opts.variants.split(",")]
    if not set(variants) <= set(rg.CONSUMERS_BY_CTAS_PER_SM):
        sys.exit(f"--variants: CTAs per SM among {sorted(rg.CONSUMERS_BY_CTAS_PER_SM)}")
    scratch = None if opts.no_flush else torch.zeros(256 * 2**20, dtype=torch.uint8, device="cuda")

    def flush() -> None:
        if scratch is not None:
            # 256 MB read through L2: nothing of the last launch stays, and (unlike a write)
            # no dirty lines are left for the next launch's reads to wait behind
            torch.amax(scratch)

    device = torch.cuda.get_device_name()
    report = {"device": device, "torch": torch.__version__, "tag": opts.tag, "trace_waves": rg.TRACE_WAVES,
              "flushed": scratch is not None, "cases": []}
    for rows, cols, dname in cases:
        for direction in opts.directions.split(","):
            for ctas_per_sm, split in [(v, s) for v in variants for s in opts.S.split(",")]:
                try:
                    entry = trace_case(rows, cols, dname, direction == "bwd", ctas_per_sm, opts, flush,
                                       None if split == "plan" else int(split))
                except Exception as exc:  # report, go on with the next case
                    entry = {"dtype": dname, "direction": direction, "shape": [rows, cols], "variant": ctas_per_sm,
                             "error": f"{type(exc).__name__}: {exc}"[:500]}
                    print(f"== {dname} {direction} {rows}x{cols} variant {ctas_per_sm}: {entry['error']}", flush=True)
                else:
                    print_case(entry)
                report["cases"].append(entry)
                torch.cuda.empty_cache()
    for path in write_result(result_name("softmax-rowgroup-trace", device, opts.tag), report):
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
