"""RMSNorm and LayerNorm: kernel_api's ops against torch eager, torch.compile and Liger.

Each case times, in one process and in shuffled turns (`kernel_api.tuning.timing.time_interleaved`,
``as_called``: back-to-back calls, host time included, inputs rotated past L2), the forward and
the forward+backward (``torch.autograd.grad`` of x and weight, and bias / residual) of:

- ``ours``: ``kernel_api.ops.rms_norm`` / ``layer_norm`` with the policy in force (PickAny);
- ``eager``: ``torch.nn.functional.rms_norm`` / ``layer_norm`` (after ``x + residual``);
- ``compile``: ``torch.compile`` of the eager function;
- ``liger``: Liger's autograd functions, where ``liger_kernel`` imports.

Every result is first checked against float64. Rates are effective TB/s: the forward moves
x and y (and residual, s), the forward+backward 5 tensors of the rows' type (x and y, then x,
dy and dx; the residual variant 8). Prints our ratio against each anchor, writes JSON to
benchmarks/results/ (and $OUT). ``--sweep`` also times our kernels alone (device time) at other
row mappings (`norm_plan` bytes per thread; the backward's threads per SM and shared-memory stages).

    python3 benchmarks/norms.py [--shapes 16384x4096,32768x8192,4096x2048] [--variants rms,rms_residual,layer]
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import kernel_api  # noqa: E402
import results_io  # noqa: E402
from kernel_api.tuning.timing import time_interleaved  # noqa: E402

SHAPES = [(16384, 4096), (32768, 8192), (4096, 2048)]
VARIANTS = ("rms", "rms_residual", "layer")
L2_ROTATE_BYTES = 100 * 2**20
EPS = 1e-6


def _liger() -> dict:
    try:
        from liger_kernel.ops.fused_add_rms_norm import LigerFusedAddRMSNormFunction
        from liger_kernel.ops.layer_norm import LigerLayerNormFunction
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction
    except Exception:  # noqa: BLE001 - not installed here: no Liger anchor
        return {}
    return {"rms": lambda x, w, b, r: LigerRMSNormFunction.apply(x, w, EPS, 0.0, "llama", False),
            "rms_residual": lambda x, w, b, r: LigerFusedAddRMSNormFunction.apply(x, r, w, EPS),
            "layer": lambda x, w, b, r: LigerLayerNormFunction.apply(x, w, b, EPS)}


def _eager(variant: str):
    if variant == "layer":
        return lambda x, w, b, r: F.layer_norm(x, (x.shape[-1],), w, b, EPS)
    if variant == "rms_residual":
        def fused(x, w, b, r):
            s = x + r
            return F.rms_norm(s, (x.shape[-1],), w, EPS), s
        return fused
    return lambda x, w, b, r: F.rms_norm(x, (x.shape[-1],), w, EPS)


def _ours(variant: str):
    ops = kernel_api.ops
    if variant == "layer":
        return lambda x, w, b, r: ops.layer_norm(x, w, b, EPS)
    if variant == "rms_residual":
        return lambda x, w, b, r: ops.rms_norm(x, w, EPS, r)
    return lambda x, w, b, r: ops.rms_norm(x, w, EPS)


def _reference(variant: str, x, w, b, r):
    s = x.double() + (r.double() if r is not None else 0)
    if variant == "layer":
        c = s - s.mean(-1, keepdim=True)
        return c / torch.sqrt(c.square().mean(-1, keepdim=True) + EPS) * w.double() + b.double()
    return s / torch.sqrt(s.square().mean(-1, keepdim=True) + EPS) * w.double()


def _first(out):
    return out[0] if isinstance(out, tuple) else out


def bench_case(rows: int, cols: int, variant: str, repeat: int, anchors: dict, use_compile: bool) -> dict:
    dtype = torch.bfloat16
    elem = 2
    residual = variant == "rms_residual"
    per_set = rows * cols * elem * (3 if residual else 2)
    sets = max(2, math.ceil(L2_ROTATE_BYTES / per_set) + 1)
    xs = [torch.randn(rows, cols, device="cuda", dtype=dtype).requires_grad_() for _ in range(sets)]
    rs = [torch.randn(rows, cols, device="cuda", dtype=dtype).requires_grad_() if residual else None
          for _ in range(sets)]
    dys = [torch.randn(rows, cols, device="cuda", dtype=dtype) for _ in range(sets)]
    w = (1 + 0.1 * torch.randn(cols, device="cuda")).to(dtype).requires_grad_()
    b = torch.randn(cols, device="cuda").to(dtype).requires_grad_() if variant == "layer" else None
    fns = {"ours": _ours(variant), "eager": _eager(variant)}
    if use_compile:
        fns["compile"] = torch.compile(_eager(variant))
    if variant in anchors:
        fns["liger"] = anchors[variant]
    ref = _reference(variant, xs[0].detach(), w.detach(), None if b is None else b.detach(),
                     None if rs[0] is None else rs[0].detach())
    entry: dict = {"shape": [rows, cols], "dtype": "bf16", "variant": variant, "errors": {}, "rel_err": {}}
    live = {}
    for name, fn in fns.items():
        try:
            with torch.no_grad():
                got = _first(fn(xs[0], w, b, rs[0]))
            err = ((got.double() - ref).norm() / ref.norm()).item()
            if not err < 1e-2:
                raise RuntimeError(f"wrong result: relative error {err:.3e}")
            entry["rel_err"][name] = err
            live[name] = fn
        except Exception as exc:  # noqa: BLE001 - report, keep the others
            entry["errors"][name] = f"{type(exc).__name__}: {exc}"[:300]

    def forward(fn):
        def call(i):
            with torch.no_grad():
                fn(xs[i % sets], w, b, rs[i % sets])
        return call

    def forward_backward(fn):
        def call(i):
            k = i % sets
            inputs = [xs[k], w] + ([b] if b is not None else []) + ([rs[k]] if residual else [])
            out = fn(xs[k], w, b, rs[k])
            outs = list(out) if isinstance(out, tuple) else [out]
            torch.autograd.grad(outs, inputs, [dys[k]] * len(outs))
        return call

    traffic = {"fwd": (4 if residual else 2) * rows * cols * elem,
               "fwd_bwd": (8 if residual else 5) * rows * cols * elem}
    for phase, make in (("fwd", forward), ("fwd_bwd", forward_backward)):
        floor_ms = traffic[phase] / 4.8e12 * 1e3
        timed = time_interleaved({name: make(fn) for name, fn in live.items()}, sets=sets, warmup=5, repeat=repeat,
                                 gpu_floor_ms=floor_ms, timing="as_called")
        for name, t in timed.items():
            if isinstance(t, Exception):
                entry["errors"][f"{name}_{phase}"] = f"{type(t).__name__}: {t}"[:300]
                continue
            ms = t["median_ms"]
            entry.setdefault(phase, {})[name] = {"ms": ms, "tbs": traffic[phase] / ms / 1e9}
    chosen = sorted({k.metadata.kernel_name for _, k in kernel_api.ops.dispatch.chosen_kernels()})
    entry["kernels"] = [n for n in chosen if "Norm" in n]
    for phase in ("fwd", "fwd_bwd"):
        rates = entry.get(phase, {})
        if "ours" in rates:
            entry.setdefault("ratios", {})[phase] = {a: rates["ours"]["tbs"] / r["tbs"] for a, r in rates.items()
                                                     if a != "ours"}
    return entry


def sweep_case(rows: int, cols: int) -> list[dict]:
    """Our RMSNorm kernels alone (device time, no host cost) at other row mappings."""
    from kernel_api.arguments.norm import RMSNormArguments, RMSNormBackwardArguments
    from kernel_api.providers.cuda_src.kernels.norm import CudaRMSNorm, CudaRMSNormBackward

    x = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16)
    dy, w = torch.randn_like(x), torch.randn(cols, device="cuda", dtype=torch.bfloat16)
    fwd = RMSNormArguments(x, w, torch.empty_like(x), eps=EPS)
    bwd = RMSNormBackwardArguments(dy, x, w, torch.empty_like(x), torch.empty_like(w), eps=EPS)
    found = []
    backward_knobs = [(b, t, s) for b in (16, 32) for t in (512, 1024) for s in (0, 3)]
    for cls, args, knobs in ((CudaRMSNorm, fwd, [(b, 0, 0) for b in (16, 32, 64)]),
                             (CudaRMSNormBackward, bwd, backward_knobs)):
        name = f"{cls.__name__}_bf16_block_a8"
        runs = {}
        for bpt, tps, stages in knobs:
            k = next(k for k in cls.generate_kernels(None, cc=90) if k.metadata.kernel_name == name)
            k.bytes_per_thread, k.stages = bpt, stages
            if tps:
                k.threads_per_sm = tps
            if not k.supports(args):
                continue
            art = k.compile(args)
            size = k.get_workspace_size(args)
            ws = torch.empty(max(size, 16), dtype=torch.uint8, device="cuda") if size else None
            runs[(bpt, tps, stages)] = (lambda i, k=k, art=art, ws=ws: k.run(args, compiled_artifact=art, workspace=ws))
        elem_traffic = (3 if cls is CudaRMSNormBackward else 2) * rows * cols * 2
        # (the floor gives the GPU a head start, so host time between launches stays out of the samples)
        timed = time_interleaved(runs, sets=1, warmup=5, repeat=30, gpu_floor_ms=elem_traffic / 4.8e12 * 1e3)
        for (bpt, tps, stages), t in timed.items():
            knob = {"kernel": name, "shape": [rows, cols], "bytes_per_thread": bpt, "threads_per_sm": tps,
                    "stages": stages}
            if isinstance(t, Exception):
                found.append(dict(knob, error=str(t)[:200]))
                continue
            found.append(dict(knob, ms=t["median_ms"], tbs=elem_traffic / t["median_ms"] / 1e9))
    return found


def _row(e: dict) -> str:
    head = f"{e['variant']:>13} {e['shape'][0]:>6}x{e['shape'][1]:<6}"
    parts = []
    for phase in ("fwd", "fwd_bwd"):
        rates = e.get(phase, {})
        if not rates:
            continue
        text = " ".join(f"{n}={r['tbs']:.2f}" for n, r in rates.items())
        ratios = " ".join(f"x{a}={v:.2f}" for a, v in e.get("ratios", {}).get(phase, {}).items())
        parts.append(f"{phase}: {text} TB/s [{ratios}]")
    if e["errors"]:
        parts.append(f"errors: {e['errors']}")
    return head + " | " + " | ".join(parts)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default=",".join(f"{r}x{c}" for r, c in SHAPES))
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--repeat", type=int, default=40)
    p.add_argument("--no-compile", action="store_true", help="leave out the torch.compile anchor")
    p.add_argument("--sweep", action="store_true", help="also time our kernels at other row mappings")
    p.add_argument("--budget-s", type=float, default=1e9, help="skip the cases left after this many seconds")
    p.add_argument("--tag", default="", help="a suffix of the result file's name")
    opts = p.parse_args()
    shapes = [tuple(int(v) for v in s.split("x")) for s in opts.shapes.split(",") if s]
    variants = [v for v in opts.variants.split(",") if v]
    anchors = _liger()
    doc = results_io.result_doc(liger=bool(anchors), cases=[], sweep=[])
    start = time.perf_counter()
    lines = [f"device: {doc['device']}  torch {doc['torch']}  liger: {'yes' if anchors else 'no'}"]
    print(lines[0], flush=True)
    name = results_io.result_name("norms", doc["device"], opts.tag)
    for variant in variants:
        for rows, cols in shapes:
            if time.perf_counter() - start > opts.budget_s:
                doc.setdefault("skipped", []).append([variant, rows, cols])
                continue
            kernel_api.ops.clear_dispatch_cache()
            torch._dynamo.reset()
            entry = bench_case(rows, cols, variant, opts.repeat, anchors, not opts.no_compile)
            doc["cases"].append(entry)
            lines.append(_row(entry))
            print(lines[-1], flush=True)
            results_io.write_result_with_text(name, doc, lines)
    if opts.sweep:
        for rows, cols in shapes:
            if time.perf_counter() - start > opts.budget_s:
                break
            found = sweep_case(rows, cols)
            doc["sweep"].extend(found)
            for f in found:
                line = (f"sweep {f['kernel']} {rows}x{cols} bytes/thread={f['bytes_per_thread']} "
                        f"threads/SM={f['threads_per_sm']} stages={f['stages']}: "
                        + (f"{f['tbs']:.2f} TB/s" if "tbs" in f else f["error"]))
                lines.append(line)
                print(line, flush=True)
            results_io.write_result_with_text(name, doc, lines)
    results_io.write_result_with_text(name, doc, lines)


if __name__ == "__main__":
    main()
