"""Softmax forward/backward: every kernel_api instance against torch, in one process.

    python3 benchmarks/softmax.py [--iters 40] [--dtype bf16] [--out DIR]

Bytes are counted as one read of each input and one write of each output (forward: x and
out; backward: grad_out, out and grad_in). Each timing is the median of CUDA-event timings of
single launches, rotating through input sets larger than L2 (fresh random data per set).
The device-to-device copy rate is measured in the same run, and results are reported as
TB/s, as a fraction of that copy rate, and as a speed-up over torch. Also measured: the host
cost of ``Kernel.run`` with a compiled artifact (per call, on a tiny problem) and the cubin
cache (cold compile vs. disk hit). JSON goes to benchmarks/results/softmax-<device>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import kernel_api  # noqa: E402
from kernel_api import SoftmaxArguments, SoftmaxBackwardArguments  # noqa: E402
from kernel_api.tuning.timing import time_cuda  # noqa: E402

SHAPES = [(32768, 4096), (16384, 16384), (65536, 1024)]
L2_ROTATE_BYTES = 50 * 2**20
DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}


def median_ms(fn, sets: int, iters: int, warmup: int = 5) -> float:
    """Median time of one call, ``fn(i)`` using input set ``i % sets`` (CUDA events)."""
    return time_cuda(fn, sets=sets, warmup=warmup, repeat=iters)["median_ms"]


def copy_rate(iters: int) -> float:
    """Device-to-device copy, bytes read + written, TB/s (1 GiB per copy, two buffer pairs)."""
    n = 2**30 // 2
    pairs = [(torch.randn(n, device="cuda", dtype=torch.bfloat16), torch.empty(n, device="cuda", dtype=torch.bfloat16))
             for _ in range(2)]
    ms = median_ms(lambda i: pairs[i][1].copy_(pairs[i][0]), 2, iters)
    pairs.clear()
    return 2 * n * 2 / (ms * 1e-3) / 1e12


def n_sets(bytes_per_set: int) -> int:
    return max(2, -(-2 * L2_ROTATE_BYTES // bytes_per_set))


def bench_forward(rows: int, cols: int, dtype: torch.dtype, iters: int) -> dict:
    elem = torch.tensor([], dtype=dtype).element_size()
    nbytes = 2 * rows * cols * elem
    sets = n_sets(nbytes)
    xs = [torch.randn(rows, cols, device="cuda", dtype=dtype) * 4 for _ in range(sets)]
    outs = [torch.empty_like(x) for x in xs]
    argsets = [SoftmaxArguments(x, o) for x, o in zip(xs, outs)]
    ref = torch.softmax(xs[0].float(), -1)
    result = {"shape": [rows, cols], "dtype": str(dtype).replace("torch.", ""), "bytes": nbytes, "kernels": {}}
    torch_ms = median_ms(lambda i: torch.softmax(xs[i], -1), sets, iters)
    result["torch_ms"] = torch_ms
    for kernel in kernel_api.get_kernels(argsets[0]):
        name = kernel.metadata.kernel_name
        try:
            art = kernel.compile(argsets[0])
            outs[0].fill_(float("nan"))
            kernel.run(argsets[0], compiled_artifact=art)
            torch.cuda.synchronize()
            err = ((outs[0].float() - ref).norm() / ref.norm()).item()
            ms = median_ms(lambda i: kernel.run(argsets[i], compiled_artifact=art, assume_supported_args=True),
                           sets, iters)
        except Exception as exc:  # report, keep benchmarking the others
            result["kernels"][name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
            continue
        result["kernels"][name] = {"ms": ms, "rel_err": err, "provider": kernel.metadata.provider}
    return result


def bench_backward(rows: int, cols: int, dtype: torch.dtype, iters: int) -> dict:
    elem = torch.tensor([], dtype=dtype).element_size()
    nbytes = 3 * rows * cols * elem
    sets = n_sets(nbytes)
    ys = [torch.softmax(torch.randn(rows, cols, device="cuda"), -1).to(dtype) for _ in range(sets)]
    gs = [torch.randn(rows, cols, device="cuda", dtype=dtype) for _ in range(sets)]
    gis = [torch.empty_like(y) for y in ys]
    argsets = [SoftmaxBackwardArguments(g, y, gi) for g, y, gi in zip(gs, ys, gis)]
    g0, y0 = gs[0].float(), ys[0].float()
    ref = y0 * (g0 - (g0 * y0).sum(-1, keepdim=True))
    result = {"shape": [rows, cols], "dtype": str(dtype).replace("torch.", ""), "bytes": nbytes, "kernels": {}}
    result["torch_ms"] = median_ms(lambda i: torch._softmax_backward_data(gs[i], ys[i], -1, dtype), sets, iters)
    for kernel in kernel_api.get_kernels(argsets[0]):
        name = kernel.metadata.kernel_name
        try:
            art = kernel.compile(argsets[0])
            gis[0].fill_(float("nan"))
            kernel.run(argsets[0], compiled_artifact=art)
            torch.cuda.synchronize()
            err = ((gis[0].float() - ref).norm() / ref.norm()).item()
            ms = median_ms(lambda i: kernel.run(argsets[i], compiled_artifact=art, assume_supported_args=True),
                           sets, iters)
        except Exception as exc:
            result["kernels"][name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
            continue
        result["kernels"][name] = {"ms": ms, "rel_err": err, "provider": kernel.metadata.provider}
    return result


def host_overhead(calls: int = 20000) -> dict:
    """Wall time per call of run() on a tiny problem (the host, not the GPU, is the limit)."""
    x = torch.randn(1, 32, device="cuda")
    out = torch.empty_like(x)
    args = SoftmaxArguments(x, out)
    kernel = kernel_api.get_kernels(args, providers="cuda_src")[0]
    art = kernel.compile(args)
    stream = torch.cuda.current_stream()
    res = {"kernel": kernel.metadata.kernel_name}

    def per_call(fn) -> float:
        for _ in range(200):
            fn()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - t) / calls * 1e6

    launcher = art.compiled_obj
    handle = stream.cuda_stream
    plan = art.extra
    params = (x.data_ptr(), out.data_ptr(), 1, 32, 32, 32)
    res["bare_cuda_core_launch_us"] = per_call(lambda: launcher.launch(handle, 0, 1, plan.threads, 0, params))
    res["run_artifact_unchecked_us"] = per_call(
        lambda: kernel.run(args, compiled_artifact=art, stream=stream, assume_supported_args=True))
    res["run_artifact_unchecked_default_stream_us"] = per_call(
        lambda: kernel.run(args, compiled_artifact=art, assume_supported_args=True))
    res["run_artifact_checked_us"] = per_call(lambda: kernel.run(args, compiled_artifact=art, stream=stream))
    res["args_plus_run_unchecked_us"] = per_call(
        lambda: kernel.run(SoftmaxArguments(x, out), compiled_artifact=art, stream=stream, assume_supported_args=True))
    res["torch_softmax_us"] = per_call(lambda: torch.softmax(x, -1))
    return res


def cache_timing() -> dict:
    """Cold NVRTC compile vs. loading the cubin from the disk cache (memory cache cleared)."""
    from kernel_api.providers.cuda_src import compiler
    from kernel_api.providers.cuda_src.kernels.softmax import CudaSoftmaxForward

    name = "ka_softmax::fwd_block<ka_softmax::BF16, 8, 4, 512>"
    with tempfile.TemporaryDirectory() as d:
        old = os.environ.get("KERNEL_API_CACHE_DIR")
        os.environ["KERNEL_API_CACHE_DIR"] = d
        try:
            compiler.clear_memory_cache()
            t = time.perf_counter()
            cold = compiler.compile_cuda(CudaSoftmaxForward.get_source(), cc=90, name_expressions=[name],
                                         source_name="softmax.cu")
            cold_s = time.perf_counter() - t
            compiler.clear_memory_cache()
            t = time.perf_counter()
            hit = compiler.compile_cuda(CudaSoftmaxForward.get_source(), cc=90, name_expressions=[name],
                                        source_name="softmax.cu")
            hit_s = time.perf_counter() - t
        finally:
            if old is None:
                os.environ.pop("KERNEL_API_CACHE_DIR", None)
            else:
                os.environ["KERNEL_API_CACHE_DIR"] = old
    return {"cold_compile_ms": cold_s * 1e3, "disk_hit_ms": hit_s * 1e3, "hit": hit.cache_hit and not cold.cache_hit}


HINT_VARIANTS = {
    "nc_noalloc+st_cs (default)": {},
    "plain ld+st": {"KA_LD16": '"ld.global.v4.u32"', "KA_ST16": '"st.global.v4.u32"'},
    "nc_noalloc+plain st": {"KA_ST16": '"st.global.v4.u32"'},
    "plain ld+st_cs": {"KA_LD16": '"ld.global.v4.u32"'},
    "nc+plain st": {"KA_LD16": '"ld.global.nc.v4.u32"', "KA_ST16": '"st.global.v4.u32"'},
}


def hint_sweep(dtype: torch.dtype, iters: int) -> list:
    """Time the cuda_src register kernels with each 16-byte load/store cache-hint variant."""
    from kernel_api.providers.cuda_src.compiler import compile_cuda
    from kernel_api.providers.cuda_src.kernels.softmax import CudaSoftmaxBackward, CudaSoftmaxForward
    from kernel_api.providers.cuda_src.launcher import CudaLauncher

    rows_out = []
    cc = torch.cuda.get_device_capability()
    cc = cc[0] * 10 + cc[1]
    for rows, cols in SHAPES:
        for cls in (CudaSoftmaxForward, CudaSoftmaxBackward):
            n_t = 3 if cls.backward else 2
            sets = n_sets(n_t * rows * cols * 2)
            ts = [[torch.randn(rows, cols, device="cuda", dtype=dtype) for _ in range(n_t)] for _ in range(sets)]
            strategy = "block_ept32" if cols > 1024 else "block_ept16"
            name = f"{cls.__name__}_bf16_{strategy}_a8"
            kernel = next(k for k in cls.generate_kernels(None, cc=cc) if k.metadata.kernel_name == name)
            expr, plan = kernel._instance(cols)
            for label, defines in HINT_VARIANTS.items():
                compiled = compile_cuda(cls.get_source(), cc=cc, name_expressions=[expr], defines=defines,
                                        source_name="softmax.cu")
                launcher = CudaLauncher(compiled, expr, name, convert_args=False)
                handle = torch.cuda.current_stream().cuda_stream
                grid = (rows + plan.rows_per_cta - 1) // plan.rows_per_cta

                def call(i, launcher=launcher):
                    t = ts[i]
                    ptrs = tuple(x.data_ptr() for x in t)
                    extra = (rows, cols, cols, cols, cols) if cls.backward else (rows, cols, cols, cols)
                    launcher.launch(handle, 0, grid, plan.threads, 0, ptrs + extra)

                ms = median_ms(call, sets, iters)
                tbs = n_t * rows * cols * 2 / (ms * 1e-3) / 1e12
                rows_out.append({"kernel": name, "shape": [rows, cols], "variant": label, "ms": ms, "tbs": tbs})
                print(f"  sweep {name:42s} {rows}x{cols} {label:28s} {ms*1e3:8.1f} us {tbs:6.3f} TB/s", flush=True)
            ts.clear()
            torch.cuda.empty_cache()
    return rows_out


def summarise(entry: dict, copy_tbs: float) -> None:
    tb = lambda ms: entry["bytes"] / (ms * 1e-3) / 1e12  # noqa: E731
    entry["torch_tbs"] = tb(entry["torch_ms"])
    best = {}
    for name, k in entry["kernels"].items():
        if "ms" in k:
            k["tbs"] = tb(k["ms"])
            k["frac_copy"] = k["tbs"] / copy_tbs
            k["speedup_vs_torch"] = entry["torch_ms"] / k["ms"]
            p = k["provider"]
            if p not in best or k["ms"] < entry["kernels"][best[p]]["ms"]:
                best[p] = name
    entry["best"] = best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=40)
    ap.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    ap.add_argument("--skip-host", action="store_true")
    ap.add_argument("--sweep", action="store_true", help="also compare cache-hint variants of the CUDA kernels")
    ap.add_argument("--only-sweep", action="store_true", help="run only the cache-hint sweep")
    opts = ap.parse_args()
    dtype = DTYPES[opts.dtype]
    props = torch.cuda.get_device_properties(0)
    device = props.name
    report = {"device": device, "sms": props.multi_processor_count, "torch": torch.__version__,
              "dtype": opts.dtype, "iters": opts.iters}
    report["copy_tbs"] = copy_tbs = copy_rate(opts.iters)
    print(f"device {device}: device-to-device copy {copy_tbs:.3f} TB/s", flush=True)
    if opts.sweep or opts.only_sweep:
        report["hint_sweep"] = hint_sweep(dtype, opts.iters)
        if opts.only_sweep:
            return
    report["forward"], report["backward"] = [], []
    for rows, cols in SHAPES:
        for kind, fn in (("forward", bench_forward), ("backward", bench_backward)):
            entry = fn(rows, cols, dtype, opts.iters)
            summarise(entry, copy_tbs)
            report[kind].append(entry)
            torch.cuda.empty_cache()
            for name, k in sorted(entry["kernels"].items(), key=lambda kv: kv[1].get("ms", 1e9)):
                if "ms" in k:
                    print(f"  {kind[:3]} {rows}x{cols} {name:48s} {k['ms']*1e3:8.1f} us {k['tbs']:6.3f} TB/s "
                          f"{k['frac_copy']*100:5.1f}% copy  x{k['speedup_vs_torch']:.2f} torch  err {k['rel_err']:.1e}",
                          flush=True)
                else:
                    print(f"  {kind[:3]} {rows}x{cols} {name:48s} ERROR {k['error']}", flush=True)
    if not opts.skip_host:
        report["host_overhead"] = host_overhead()
        report["cubin_cache"] = cache_timing()
    slug = re.sub(r"[^A-Za-z0-9]+", "-", device).strip("-").lower()
    os.makedirs(opts.out, exist_ok=True)
    path = os.path.join(opts.out, f"softmax-{slug}.json")
    with open(path, "w") as f:
        json.dump(report, f, indent=1)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], f"softmax-{slug}.json"), "w") as f:
            json.dump(report, f, indent=1)
    # ---- the table, last
    print(f"\nSoftmax {opts.dtype} on {device}; copy rate {copy_tbs:.3f} TB/s (read+write); TB/s = bytes/time")
    print(f"{'op':4s} {'shape':>12s} {'torch TB/s':>10s} | {'provider':8s} {'best kernel':44s} {'TB/s':>6s} "
          f"{'%copy':>6s} {'x torch':>7s}")
    for kind in ("forward", "backward"):
        for e in report[kind]:
            shape = f"{e['shape'][0]}x{e['shape'][1]}"
            for prov, name in sorted(e["best"].items()):
                k = e["kernels"][name]
                print(f"{kind[:3]:4s} {shape:>12s} {e['torch_tbs']:10.3f} | {prov:8s} {name:44s} {k['tbs']:6.3f} "
                      f"{k['frac_copy']*100:5.1f}% {k['speedup_vs_torch']:7.2f}")
    if "host_overhead" in report:
        h = report["host_overhead"]
        print("host us/call: " + ", ".join(f"{k}={v:.2f}" for k, v in h.items() if k.endswith("_us")))
        c = report["cubin_cache"]
        print(f"cubin cache: cold compile {c['cold_compile_ms']:.1f} ms, disk hit {c['disk_hit_ms']:.2f} ms")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
