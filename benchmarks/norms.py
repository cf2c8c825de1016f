"""RMSNorm and LayerNorm: kernel_api's ops against torch eager, torch.compile and Liger.

Each case times, in one process and in shuffled turns (`kernel_api.tuning.timing.time_interleaved`,
``as_called``: back-to-back calls, host time included, inputs rotated past L2), the forward and
the forward+backward (``torch.autograd.grad`` of x and weight, and bias / residual) of:

- ``ours``: ``kernel_api.ops.rms_norm`` / ``layer_norm`` with the policy in force (PickAny);
- ``eager``: ``torch.nn.functional.rms_norm`` / ``layer_norm`` (after ``x + residual``);
- ``compile``: ``torch.compile`` of the eager function;
- ``liger``: Liger's autograd functions, where ``liger_kernel`` imports;
- ``quack``: QuACK's ``rmsnorm`` (RMSNorm without the residual), where it imports.

Every result is first checked against float64. Rates are effective TB/s: the forward moves
x and y (and residual, s), the forward+backward 5 tensors of the rows' type (x and y, then x,
dy and dx; the residual variant 8). Prints our ratio against each anchor, writes JSON to
benchmarks/results/ (and $OUT). ``--sweep`` times, in device time, our RMSNorm kernels at every row mapping of
`SWEEP_FORWARD` / `SWEEP_BACKWARD` (`norm_plan` bytes per thread; the backward's threads per
SM and shared-memory stages) against eager, Liger and QuACK (`sweep_case`).

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
    quack = _quack_rmsnorm() if variant == "rms" else None
    if quack is not None:
        fns["quack"] = lambda x, w, b, r: quack(x, w, eps=EPS)
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


#: The sweep's row mappings, (bytes of a row per thread, resident threads per SM, stages, staged):
#: the forward's bytes per thread, its rows in registers or staged in shared memory; the backward's
#: bytes per thread x threads per SM x shared-memory stages (0: the next row in registers).
SWEEP_FORWARD = tuple((b, 0, 0, staged) for b in (16, 32, 64, 128) for staged in (False, True))
SWEEP_BACKWARD = tuple((b, t, s, False) for b in (16, 32, 64) for t in (512, 1024) for s in (0, 2, 3, 4, 5))


def _quack_rmsnorm():
    try:
        from quack import rmsnorm  # (the package's function, not its module of the same name)
    except Exception:  # noqa: BLE001 - not installed here: no QuACK anchor
        return None
    return rmsnorm


def _sweep_kernels(cols: int, backward: bool, residual: bool, meta: bool, defaults: bool = False):
    """(knobs, kernel, args) of our bf16 RMSNorm at each sweep mapping, one per distinct launch
    (mappings that give the same template and launch are timed once); ``meta``: on meta tensors
    (to compile without a GPU); ``defaults``: only the shipped mapping (knobs None)."""
    from kernel_api.arguments.norm import RMSNormArguments, RMSNormBackwardArguments
    from kernel_api.providers.cuda_src.kernels import norm_plan
    from kernel_api.providers.cuda_src.kernels.norm import CudaRMSNorm, CudaRMSNormBackward

    device = "meta" if meta else "cuda"
    x = torch.empty(2, cols, dtype=torch.bfloat16, device=device)
    w = torch.empty(cols, dtype=torch.bfloat16, device=device)
    if backward:
        cls, args = CudaRMSNormBackward, RMSNormBackwardArguments(x, x, w, torch.empty_like(x), torch.empty_like(w))
        knobs = SWEEP_BACKWARD
    else:
        cls = CudaRMSNorm
        extra = dict(residual=torch.empty_like(x), residual_out=torch.empty_like(x)) if residual else {}
        args = RMSNormArguments(x, w, torch.empty_like(x), **extra)
        knobs = SWEEP_FORWARD
    name = f"{cls.__name__}_bf16_block_a8"
    if defaults:
        return [(None, next(k for k in cls.generate_kernels(None, cc=90) if k.metadata.kernel_name == name), args)]
    seen, found = set(), []
    for bpt, tps, stages, staged in knobs:
        k = next(k for k in cls.generate_kernels(None, cc=90) if k.metadata.kernel_name == name)
        k.bytes_per_thread, k.stages, k.staged = bpt, stages, staged
        if tps:
            k.threads_per_sm = tps
        shape = k.shape_for(cols)
        if shape is None or not k.supports(args, 90):
            continue
        threads = norm_plan.cta_threads(shape, cols, backward)
        # (what decides the launch: the template, the CTA, CTAs per SM and the ring)
        same = (shape, threads, max(1, tps // threads) if backward else 0, k._stages() if backward else 0,
                k._staged(args, shape))
        if same in seen:
            continue
        seen.add(same)
        found.append(((bpt, tps, stages, staged), k, args))
    return found


def _knob_text(k, cols: int, backward: bool) -> str:
    """A mapping as timed: the bytes of a row a thread holds (as the template takes them), and
    the backward's threads per SM and stages or the forward's rows in registers or staged."""
    shape = k.shape_for(cols)
    held = f"bytes/thread={shape.nv * shape.vec * k.dtype.bytes}"
    if backward:
        return f"{held} threads/SM={k.threads_per_sm} stages={k._stages()}"
    return f"{held} " + ("staged" if k.staged else "registers")


def _precompile_one(job: tuple) -> int:
    cols, backward, residual, defaults, index = job
    found = _sweep_kernels(cols, backward, residual, meta=True, defaults=defaults)
    if index >= len(found):
        return 0
    _, k, args = found[index]
    k.compile(args, cc=90)
    return 1


def precompile(shapes: list, workers: int, defaults: bool = False) -> int:
    """NVRTC compiles of every sweep mapping (``defaults``: the shipped ones), in ``workers``
    processes, into the disk cache."""
    from concurrent.futures import ProcessPoolExecutor
    import multiprocessing

    kinds = sorted({(cols, bwd, res) for _, cols in shapes for bwd, res in ((False, False), (False, True),
                                                                             (True, False))})
    most = 1 if defaults else max(len(SWEEP_FORWARD), len(SWEEP_BACKWARD))
    jobs = [(cols, bwd, res, defaults, i) for cols, bwd, res in kinds for i in range(most)]
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        return sum(pool.map(_precompile_one, jobs, chunksize=4))


def sweep_case(rows: int, cols: int, repeat: int, use_quack: bool, defaults: bool = False) -> list[dict]:
    """Device time (`time_interleaved`, ``timing="device"``: host time hidden behind a GPU head
    start; inputs rotated past L2) of our bf16 RMSNorm kernels at every sweep mapping, each
    through `Kernel.run` with its compiled artifact and workspace kept, alternating in one
    process with the anchors: the forward (and the residual form) against ``F.rms_norm``,
    Liger and QuACK; the backward (ours: both launches) against each anchor's
    ``torch.autograd.grad`` of x and the weight on a graph its forward recorded. ``defaults``:
    only our shipped mappings."""
    elem = 2
    touched = rows * cols * elem * 2  # (the least a call reads and writes: x and y)
    sets = max(2, math.ceil(L2_ROTATE_BYTES / touched) + 1)
    new = lambda: torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16)  # noqa: E731
    xs, rs, dys = [new() for _ in range(sets)], [new() for _ in range(sets)], [new() for _ in range(sets)]
    outs, souts, dxs = ([torch.empty_like(xs[0]) for _ in range(sets)] for _ in range(3))
    w = (1 + 0.1 * torch.randn(cols, device="cuda")).to(torch.bfloat16)
    gw = torch.empty_like(w)
    liger = _liger()
    quack = _quack_rmsnorm() if use_quack else None
    found: list[dict] = []
    tensors = {"fwd": 2, "fwd_residual": 4, "bwd": 3}

    def record(phase: str, timed: dict, labels: dict) -> None:
        for key, t in timed.items():
            entry = {"phase": phase, "shape": [rows, cols], "who": labels[key][0], "config": labels[key][1]}
            if isinstance(t, Exception):
                entry["error"] = f"{type(t).__name__}: {t}"[:200]
            else:
                entry["us"] = t["median_ms"] * 1e3
                entry["tbs"] = tensors[phase] * rows * cols * elem / t["median_ms"] / 1e9
            found.append(entry)

    def ours(backward: bool, residual: bool) -> tuple[dict, dict]:
        from kernel_api.arguments.norm import RMSNormArguments, RMSNormBackwardArguments

        if backward:
            per_set = [RMSNormBackwardArguments(dys[i], xs[i], w, dxs[i], gw, eps=EPS) for i in range(sets)]
        else:
            extra = (lambda i: dict(residual=rs[i], residual_out=souts[i])) if residual else (lambda i: {})
            per_set = [RMSNormArguments(xs[i], w, outs[i], eps=EPS, **extra(i)) for i in range(sets)]
        runs, labels = {}, {}
        for knobs, k, _ in _sweep_kernels(cols, backward, residual, meta=False, defaults=defaults):
            art = k.compile(per_set[0])
            size = k.get_workspace_size(per_set[0]) if backward else 0
            ws = torch.empty(max(size, 16), dtype=torch.uint8, device="cuda") if backward else None
            key = ("ours", knobs)
            runs[key] = (lambda i, k=k, art=art, ws=ws: k.run(per_set[i % sets], compiled_artifact=art, workspace=ws))
            labels[key] = ("ours", "shipped: " * (knobs is None) + _knob_text(k, cols, backward))
        return runs, labels

    def forward_anchors(residual: bool) -> tuple[dict, dict]:
        fns = {"eager": _eager("rms_residual" if residual else "rms")}
        if liger:
            fns["liger"] = liger["rms_residual" if residual else "rms"]
        if quack is not None and not residual:  # (its residual form: one more compile of a few seconds)
            fns["quack"] = lambda x, w, b, r: quack(x, w, eps=EPS)
        runs = {}
        for name, fn in fns.items():
            def call(i, fn=fn):
                with torch.no_grad():
                    fn(xs[i % sets], w, None, rs[i % sets] if residual else None)
            runs[name] = call
        labels = {n: (n, "") for n in runs}
        if not residual:  # the limit: torch's copy of x into y (the same 2 tensors' traffic)
            runs["copy"] = lambda i: outs[i % sets].copy_(xs[i % sets])
            labels["copy"] = ("copy", "limit: torch copy of x")
        return runs, labels

    def backward_anchors() -> tuple[dict, dict]:
        fns = {"eager": _eager("rms")}
        if liger:
            fns["liger"] = liger["rms"]
        if quack is not None:
            fns["quack"] = lambda x, w, b, r: quack(x, w, eps=EPS)
        runs = {}
        wg = w.detach().clone().requires_grad_()
        for name, fn in fns.items():
            try:
                graphs = []
                for i in range(sets):
                    xg = xs[i].detach().requires_grad_()
                    graphs.append((fn(xg, wg, None, None), xg))
            except Exception as exc:  # noqa: BLE001 - reported as this anchor's result
                runs[name] = (lambda i, exc=exc: (_ for _ in ()).throw(exc))
                continue
            runs[name] = (lambda i, graphs=graphs: torch.autograd.grad(
                graphs[i % sets][0], [graphs[i % sets][1], wg], dys[i % sets], retain_graph=True))
        return runs, {n: (n, "") for n in runs}

    floor = {"fwd": 2 * rows * cols * elem / 4.8e12 * 1e3, "fwd_residual": 4 * rows * cols * elem / 4.8e12 * 1e3,
             "bwd": 3 * rows * cols * elem / 4.8e12 * 1e3}
    for phase in ("fwd", "fwd_residual", "bwd"):
        if phase == "bwd":
            a_runs, a_labels = backward_anchors()
            o_runs, o_labels = ours(True, False)
        else:
            a_runs, a_labels = forward_anchors(phase == "fwd_residual")
            o_runs, o_labels = ours(False, phase == "fwd_residual")
        runs, labels = {**o_runs, **a_runs}, {**o_labels, **a_labels}
        timed = time_interleaved(runs, sets=sets, warmup=3, repeat=repeat, gpu_floor_ms=floor[phase])
        record(phase, timed, labels)
        if phase == "bwd":
            found.extend(_reduce_alone(rows, cols, sets, xs, dys, dxs, w, gw, repeat))
    return found


def _reduce_alone(rows, cols, sets, xs, dys, dxs, w, gw, repeat) -> list[dict]:
    """Device time of the default backward's column sums (reduce_cols) alone."""
    from kernel_api.arguments.norm import RMSNormBackwardArguments
    from kernel_api.providers.cuda_src.kernels import norm_plan
    from kernel_api.providers.cuda_src.kernels.norm import CudaRMSNormBackward

    k = next(k for k in CudaRMSNormBackward.generate_kernels(None, cc=90)
             if k.metadata.kernel_name == "CudaRMSNormBackward_bf16_block_a8")
    args = RMSNormBackwardArguments(dys[0], xs[0], w, dxs[0], gw, eps=EPS)
    art = k.compile(args)
    shape = art.extra.shape
    launch = norm_plan.backward_launch(shape, rows, cols, torch.cuda.get_device_properties(0).multi_processor_count,
                                       k.threads_per_sm)
    ws = torch.zeros(launch.units * cols, device="cuda")
    grid = norm_plan.reduce_grid(cols, 1)
    stream = torch.cuda.current_stream().cuda_stream
    run = lambda i: art.extra.reduce.launch(stream, 0, grid, norm_plan.REDUCE_THREADS, 0,  # noqa: E731
                                            (ws.data_ptr(), gw.data_ptr(), 0, launch.units, cols))
    t = time_interleaved({"reduce": run}, sets=1, warmup=3, repeat=repeat)["reduce"]
    entry = {"phase": "bwd_column_sums", "shape": [rows, cols], "who": "ours", "config": f"units={launch.units}"}
    if isinstance(t, Exception):
        return [dict(entry, error=str(t)[:200])]
    return [dict(entry, us=t["median_ms"] * 1e3, tbs=launch.units * cols * 4 / t["median_ms"] / 1e9)]


def sweep_lines(found: list[dict]) -> list[str]:
    """One line per shape, phase and configuration: device us, effective TB/s, and for ours the
    ratio of the best anchor's time (eager, Liger) to ours (above 1: faster than each) and of
    QuACK's."""
    lines = []
    groups: dict = {}
    for f in found:
        groups.setdefault((tuple(f["shape"]), f["phase"]), []).append(f)
    for (shape, phase), entries in groups.items():
        anchors = [e["us"] for e in entries if e["who"] not in ("ours", "copy", "quack") and "us" in e]
        best = min(anchors) if anchors else None
        quack = [e["us"] for e in entries if e["who"] == "quack" and "us" in e]
        for e in sorted(entries, key=lambda e: e.get("us", 1e18)):
            head = f"sweep {phase:<13} {shape[0]}x{shape[1]:<6} {e['who']:<6} {e['config']:<44}"
            if "us" not in e:
                lines.append(f"{head} {e['error']}")
                continue
            ratio = f" x_best_anchor={best / e['us']:.2f}" if best and e["who"] == "ours" else ""
            ratio += f" x_quack={quack[0] / e['us']:.2f}" if quack and e["who"] == "ours" else ""
            lines.append(f"{head} {e['us']:8.1f} us {e['tbs']:5.2f} TB/s{ratio}")
    lines.extend(_forward_backward_lines(groups))
    return lines


def _forward_backward_lines(groups: dict) -> list[str]:
    """Forward + backward per shape: each anchor's two times added, and ours at the fastest
    forward and backward mappings (5 tensors of traffic)."""
    lines = []
    for shape in dict.fromkeys(shape for shape, _ in groups):
        fwd, bwd = groups.get((shape, "fwd"), []), groups.get((shape, "bwd"), [])
        total = {}
        for who in dict.fromkeys(e["who"] for e in fwd + bwd):
            f = [e for e in fwd if e["who"] == who and "us" in e]
            b = [e for e in bwd if e["who"] == who and "us" in e]
            if f and b:
                f, b = min(f, key=lambda e: e["us"]), min(b, key=lambda e: e["us"])
                total[who] = (f["us"] + b["us"], f"{f['config']} + {b['config']}" if who == "ours" else "")
        anchors = [us for who, (us, _) in total.items() if who not in ("ours", "quack")]
        for who, (us, config) in sorted(total.items(), key=lambda kv: kv[1][0]):
            ratio = f" x_best_anchor={min(anchors) / us:.2f}" if anchors and who == "ours" else ""
            ratio += f" x_quack={total['quack'][0] / us:.2f}" if "quack" in total and who == "ours" else ""
            tbs = 5 * shape[0] * shape[1] * 2 / us / 1e6
            lines.append(f"sweep {'fwd+bwd':<13} {shape[0]}x{shape[1]:<6} {who:<6} {config[:90]} {us:8.1f} us "
                         f"{tbs:5.2f} TB/s{ratio}")
    return lines


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
    p.add_argument("--sweep-repeat", type=int, default=30, help="timed rounds of the sweep")
    p.add_argument("--no-quack", action="store_true", help="leave out the QuACK anchor of the sweep")
    p.add_argument("--sweep-defaults", action="store_true", help="the sweep times only our shipped mappings")
    p.add_argument("--precompile", type=int, default=0, metavar="N",
                   help="first compile every sweep mapping in N processes (into the disk cache)")
    opts = p.parse_args()
    shapes = [tuple(int(v) for v in s.split("x")) for s in opts.shapes.split(",") if s]
    variants = [v for v in opts.variants.split(",") if v]
    if opts.sweep and opts.precompile:
        began = time.perf_counter()
        done = precompile(shapes, opts.precompile, opts.sweep_defaults)
        print(f"precompiled {done} in {time.perf_counter() - began:.1f} s", flush=True)
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
                doc.setdefault("skipped", []).append(["sweep", rows, cols])
                continue
            found = sweep_case(rows, cols, opts.sweep_repeat, not opts.no_quack, opts.sweep_defaults)
            doc["sweep"].extend(found)
            for line in sweep_lines(found):
                lines.append(line)
                print(line, flush=True)
            results_io.write_result_with_text(name, doc, lines)
    results_io.write_result_with_text(name, doc, lines)


if __name__ == "__main__":
    main()
