"""Decode GEMMs (M <= 16): the stream-K family CudaGemmDecode against the split-K family
CudaGemmSmallM and torch.matmul (cuBLAS), in one process with alternating launches.

    python3 benchmarks/decode.py [--check] [--m 1,8,16] [--layouts col,row] [--dtype bf16,f16]
                                 [--sweeps 3] [--repeat 40] [--tag run]

Shapes: M in --m x N, K in {4096, 8192, 14336}. ``col``: B = W.t() for a row-major W[N, K] (the
nn.Linear case); ``row``: B is a row-major K x N matrix. The timing is small_m.py's: contestants
launched alternately (order rotated each repetition) behind a sleep kernel, each launch between
its own CUDA events, every launch on another input set (B's sets exceed 256 MB, so B comes from
HBM), fresh random data, median of --repeat launches, --sweeps sweeps (the spread is reported).
Each contestant's output is checked against float64 before it is timed; the decode kernel runs
with a workspace allocated once per shape (as a framework would hold one). ``--check`` first
runs tests/test_gemm_decode.py's GPU correctness sweep.

Prints one table per (dtype, layout) last: TB/s of B for each contestant and the ratios to
cuBLAS; JSON goes to benchmarks/results/decode-<device>-<tag>.json (and to $OUT when set).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from kernel_api import GemmArguments  # noqa: E402
from kernel_api.providers.cuda_src.kernels.gemm_decode import CudaGemmDecode  # noqa: E402
from results_io import result_name, write_result  # noqa: E402
from small_m import DTYPES, NK_FULL, Shape, copy_rate, geomean, instance, time_group  # noqa: E402


def decode_instance(dtype: str, layout: str, M: int) -> CudaGemmDecode:
    found = [k for k in CudaGemmDecode.generate_kernels(None, cc=90)
             if k.dtype.name == dtype and k.b_kmajor == (layout == "col") and (M <= 8) == (k.config.mp == 8)]
    assert len(found) == 1
    return found[0]


def check_output(out: torch.Tensor, A: torch.Tensor, B: torch.Tensor, what: str) -> None:
    ref = A.double() @ B.double()
    err = ((out.double() - ref).norm() / ref.norm()).item()
    if not err <= 1e-2 or not torch.isfinite(out).all():
        raise AssertionError(f"{what}: relative error {err:.3e} against float64")


def parse_variant(text: str) -> dict:
    """'c2s4' -> ctas_per_sm=2, max_stages=4 ('default': none)."""
    fields = {"s": "max_stages", "c": "ctas_per_sm"}
    out, i = {}, 0
    while text != "default" and i < len(text):
        j = i + 1
        while j < len(text) and text[j].isdigit():
            j += 1
        out[fields[text[i]]] = int(text[i + 1:j])
        i = j
    return out


def bench(shape: Shape, M: int, decs: dict, sm, sm_art, repeat: int) -> dict:
    """Times (ms) of every decode variant, the split-K family and cuBLAS on one shape."""
    As, outs, args = shape.for_m(M)
    sets = shape.sets
    outs_sm = [torch.empty_like(o) for o in outs]
    outs_t = [torch.empty_like(o) for o in outs]
    args_sm = [GemmArguments(a, b, o) for a, b, o in zip(As, shape.Bs, outs_sm)]
    ws = torch.empty(max(d.get_workspace_size(a) for d, _ in decs.values() for a in args[:1]), dtype=torch.uint8,
                     device="cuda")
    fns, targets = {}, {}
    for name, (dec, art) in decs.items():
        fns[name] = (lambda i, dec=dec, art=art: dec.run(args[i % sets], compiled_artifact=art, workspace=ws,
                                                         assume_supported_args=True))
        targets[name] = outs
    fns["small_m"] = lambda i: sm.run(args_sm[i % sets], compiled_artifact=sm_art, assume_supported_args=True)
    fns["cublas"] = lambda i: torch.matmul(As[i % sets], shape.Bs[i % sets], out=outs_t[i % sets])
    targets.update(small_m=outs_sm, cublas=outs_t)
    for name, fn in fns.items():
        targets[name][0].fill_(float("nan"))
        fn(0)
        torch.cuda.synchronize()
        check_output(targets[name][0], As[0], shape.Bs[0], f"{name} M={M} N={shape.N} K={shape.K} {shape.layout}")
    ms, behind = time_group(fns, repeat)
    grids = {name: dec.plan(args[0]).grid for name, (dec, _) in decs.items()}
    return {"ms": ms, "host_bound": behind, "grid": grids}


def run_checks() -> None:
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    import test_gemm_decode as t  # noqa: PLC0415
    from test_gemm_small_m import check_gemm  # noqa: PLC0415

    start = time.perf_counter()
    n = 0
    for dt, layout, M, N, K, padded in t.gpu_cases():
        check_gemm(t.instance(dt, layout, M), M, N, K, padded=padded)
        n += 1
    for layout in ("col", "row"):
        for M, N, K in ((8, 4096, 4096), (16, 8192, 8192), (1, 14336, 4096)):
            check_gemm(t.instance("bf16", layout, M), M, N, K, repeat_identical=True)
            n += 1
    print(f"check: {n} cases passed in {time.perf_counter() - start:.1f} s", flush=True)


_compiled: dict = {}


def compiled(dt: str, layout: str, M: int, variants: list[str]) -> tuple:
    """({"decode" or "decode:<variant>": (kernel, artifact)}, (small-M kernel, artifact)) for
    (dtype, layout, M), compiled once."""
    key = (dt, layout, M)
    if key not in _compiled:
        A = torch.randn(M, 64, device="cuda", dtype=DTYPES[dt])
        B = torch.randn(64, 64, device="cuda", dtype=DTYPES[dt])
        args = GemmArguments(A, B.t() if layout == "col" else B, torch.empty(M, 64, device="cuda", dtype=DTYPES[dt]))
        base, sm = decode_instance(dt, layout, M), instance(dt, layout, M)
        decs = {}
        for v in variants:
            k = base
            if v != "default":
                k = copy.copy(base)  # same family and checks, another template instance
                k.config = dataclasses.replace(base.config, **parse_variant(v))
            decs["decode" if v == "default" else f"decode:{v}"] = (k, k.compile(args))
        _compiled[key] = (decs, (sm, sm.compile(args)))
    return _compiled[key]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true")
    p.add_argument("--m", default="1,8,16")
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--layouts", default="col")
    p.add_argument("--shapes", default=None, help="comma-separated NxK (default: the 9 of N, K in 4096/8192/14336)")
    p.add_argument("--sweeps", type=int, default=3)
    p.add_argument("--repeat", type=int, default=40)
    p.add_argument("--variants", default="default",
                   help="comma-separated decode designs: default, or knobs c<CTAs per SM> s<max stages>, "
                        "e.g. default,c2,c1s8")
    p.add_argument("--tag", default="run")
    opts = p.parse_args()
    variants = opts.variants.split(",")
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    device = torch.cuda.get_device_name()
    t0 = time.perf_counter()
    if opts.check:
        run_checks()
    Ms = [int(m) for m in opts.m.split(",")]
    nks = ([tuple(int(v) for v in s.split("x")) for s in opts.shapes.split(",")] if opts.shapes else NK_FULL)
    bw = copy_rate()
    print(f"{device}: copy {bw:.2f} TB/s (read+write)", flush=True)
    records: dict = {}
    for sweep in range(opts.sweeps):
        for dt in opts.dtype.split(","):
            for layout in opts.layouts.split(","):
                for N, K in nks:
                    shape = Shape(DTYPES[dt], layout, N, K)
                    for M in Ms:
                        decs, (sm, sm_art) = compiled(dt, layout, M, variants)
                        rec = bench(shape, M, decs, sm, sm_art, opts.repeat)
                        key = (dt, layout, M, N, K)
                        r = records.setdefault(key, {"dtype": dt, "layout": layout, "M": M, "N": N, "K": K,
                                                     "grids": rec["grid"], "sweeps": [], "host_bound": False})
                        r["sweeps"].append(rec["ms"])
                        r["host_bound"] |= rec["host_bound"]
                    del shape
                    torch.cuda.empty_cache()
    rows = []
    for (dt, layout, M, N, K), r in records.items():
        b = 2 * N * K
        med = {n: statistics.median(s[n] for s in r["sweeps"]) for n in r["sweeps"][0]}
        first = next(n for n in med if n.startswith("decode"))
        ratios = [s["cublas"] / s[first] for s in r["sweeps"]]
        r["median_ms"] = med
        r["TBps"] = {n: b / (v * 1e-3) / 1e12 for n, v in med.items()}
        r["decode_vs_cublas"] = {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}
        r["decode_vs_small_m"] = med["small_m"] / med[first]
        r["variants_vs_cublas"] = {n: med["cublas"] / v for n, v in med.items() if n.startswith("decode")}
        rows.append(r)
    out = {"device": device, "torch": torch.__version__, "copy_TBps": bw, "options": vars(opts),
           "argv": sys.argv, "timing": "alternating launches behind a sleep kernel, CUDA events per launch, "
           "median of repeat per sweep, median over sweeps", "cases": rows, "seconds": time.perf_counter() - t0}
    paths = write_result(result_name("decode", device, opts.tag), out)
    for dt in opts.dtype.split(","):
        for layout in opts.layouts.split(","):
            sel = [r for r in rows if r["dtype"] == dt and r["layout"] == layout]
            print(f"\n== {dt} B {layout} (TB/s of B; ratio = cuBLAS time / ours) ==")
            names = [n for n in sel[0]["TBps"] if n.startswith("decode")]
            print(f"{'case':>16} " + " ".join(f"{n[:14]:>14}" for n in names) +
                  f" {'small_m':>7} {'cuBLAS':>7}  {names[0][:10] + '/cuBLAS':>22} {'/small_m':>8}")
            for r in sel:
                t, q = r["TBps"], r["decode_vs_cublas"]
                print(f"{r['M']:>4}x{r['N']}x{r['K']:<5} " + " ".join(f"{t[n]:14.2f}" for n in names) +
                      f" {t['small_m']:7.2f} {t['cublas']:7.2f}  {q['median']:5.3f} [{q['min']:.3f}-{q['max']:.3f}] "
                      f"{r['decode_vs_small_m']:8.3f}" + ("  (host-bound?)" if r["host_bound"] else ""))
            for n in names:
                print(f"geomean {n}/cuBLAS {geomean([r['variants_vs_cublas'][n] for r in sel]):.3f}, "
                      f"min {min(r['variants_vs_cublas'][n] for r in sel):.3f}")
            print(f"small_m/cuBLAS {geomean([r['median_ms']['cublas'] / r['median_ms']['small_m'] for r in sel]):.3f}")
    print(f"\n{device}; JSON: {', '.join(paths)}")


if __name__ == "__main__":
    main()
