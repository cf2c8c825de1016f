"""Sweep of the SM90 warp-specialized GEMM configurations against cuBLAS (torch.matmul).

    python benchmarks/gemm_sm90.py                      # the issue's sweep, bf16, row-major
    python benchmarks/gemm_sm90.py --shapes 8192x8192x8192 --configs cooperative
    python benchmarks/gemm_sm90.py --check              # verify each config first (odd shapes)

For every shape, each `Sm90WarpSpecializedGemm` configuration that discovery offers for
row-major bf16 operands (``--explore``: also the extra design points in EXPLORE) is compiled
(once per signature), verified against a float64 reference on that shape's first buffer set,
and timed with CUDA events against torch.matmul (cuBLAS) on the same buffers: launches
alternate cuBLAS, ours, cuBLAS, ours ... each bracketed by its own events, so clock and power
drift hit both alike; medians over ``--iters`` pairs, inputs rotating over enough random sets
to exceed twice the L2. Writes ``benchmarks/results/gemm_sm90-<device>.json`` and prints a
table last.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import os
import re
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

import kernel_api  # noqa: E402
from kernel_api.providers.cutedsl.gemm.sm90_warpspecialized import (  # noqa: E402
    Sm90Config, Sm90WarpSpecializedGemm)
from kernel_api.dtypes import DataType  # noqa: E402
from kernel_api.metadata import ROW_MAJOR  # noqa: E402
from kernel_api.tuning.timing import L2_FLUSH_BYTES, relative_error, rotation_count  # noqa: E402
from kernel_api.tuning.timing import time_cuda_pair as time_pair  # noqa: E402

SWEEP = ["8192x8192x8192", "4096x4096x4096", "2048x2048x2048", "4096x14336x4096", "4096x4096x14336",
         "128x8192x8192", "16384x1024x16384"]
# Design points tried besides the emitted ones (tuning only; not registered). 2x2 clusters were
# dropped after run 5: 30 clusters of 4 leave 12 of 132 SMs idle (0.80-0.90 of cuBLAS).
EXPLORE = [
    # stream-K of a fuller last wave at K <= 4096, and at any K (emitted configs: never)
    Sm90Config((128, 128), (2, 1), "pingpong", swizzle=8, stream_k=True, sk_any_wave_max_k_tiles=64),
    Sm90Config((128, 128), (1, 2), "pingpong", swizzle=4, raster_along_m=False, stream_k=True,
               sk_any_wave_max_k_tiles=64),
    Sm90Config((128, 128), (2, 1), "pingpong", swizzle=8, stream_k=True, sk_any_wave_max_k_tiles=1 << 20),
    Sm90Config((128, 128), (1, 2), "pingpong", swizzle=4, raster_along_m=False, stream_k=True,
               sk_any_wave_max_k_tiles=1 << 20),
    Sm90Config((256, 128), (1, 2), "cooperative", swizzle=4, raster_along_m=False, stream_k=True),
    Sm90Config((64, 256), (2, 1), "pingpong", swizzle=4, stream_k=True),
    # split_all (every tile cut along K over the grid) with wider tiles (fewer partials per tile)
    # and with A multicast across a 1x2 cluster (session 27)
    Sm90Config((64, 256), (1, 1), "pingpong", stream_k=True, split_all=True),
    Sm90Config((64, 128), (1, 2), "pingpong", raster_along_m=False, stream_k=True, split_all=True),
    # decode-sized M without split-K (session 28; the 64x64 1x2 and 1x4 tiles are emitted): other
    # narrow N tiles, each streaming its B slab over the whole K (as cuBLAS's 64x32 tiles do), A
    # multicast along N, deeper rings of the smaller stages
    Sm90Config((64, 32), (1, 1), "pingpong"),
    Sm90Config((64, 32), (1, 2), "pingpong", raster_along_m=False, max_ab_stages=16),
    Sm90Config((128, 32), (1, 2), "pingpong", raster_along_m=False, max_ab_stages=16),
    Sm90Config((128, 64), (1, 2), "pingpong", raster_along_m=False, max_ab_stages=12),
    # M = 128: both consumer warpgroups on one narrow tile (a 64-row half each)
    Sm90Config((128, 64), (1, 2), "cooperative", raster_along_m=False, max_ab_stages=12),
    Sm90Config((128, 64), (1, 4), "cooperative", raster_along_m=False, max_ab_stages=12),
    Sm90Config((128, 32), (1, 2), "cooperative", raster_along_m=False, max_ab_stages=16),
    Sm90Config((128, 32), (1, 4), "cooperative", raster_along_m=False, max_ab_stages=16),
]
CHECK_SHAPES = [(1, 999, 1000, 136), (3, 264, 520, 72), (1, 128, 8192, 1024), (2, 1032, 264, 2056)]


def parse_shape(text: str) -> tuple[int, int, int]:
    m = re.fullmatch(r"(\d+)x(\d+)x(\d+)", text.strip())
    if not m:
        raise argparse.ArgumentTypeError(f"shape {text!r}: expected MxNxK")
    return int(m.group(1)), int(m.group(2)), int(m.group(3))


def short(kernel) -> str:
    cfg = kernel.config
    return f"{cfg.tag}_st{kernel.ab_stages}"


def check(kernel, artifacts: dict, dtype, layouts: str = "ttt") -> float:
    """Worst relative error of ``kernel`` over CHECK_SHAPES (NaN-poisoned outputs)."""
    worst = 0.0
    for L, M, N, K in CHECK_SHAPES:
        A = torch.randn(L, M, K, device="cuda", dtype=dtype)
        B = torch.randn(L, K, N, device="cuda", dtype=dtype)
        out = torch.full((L, M, N), float("nan"), device="cuda", dtype=dtype)
        args = kernel_api.GemmArguments(A, B, out, accumulator_type=torch.float32)
        key = (kernel.name, args.signature)
        if key not in artifacts:
            artifacts[key] = kernel.compile(args)
        kernel.run(args, compiled_artifact=artifacts[key])
        torch.cuda.synchronize()
        ref = torch.matmul(A.double(), B.double())
        worst = max(worst, relative_error(out, ref))
    return worst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="*", type=parse_shape, default=[parse_shape(s) for s in SWEEP])
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "f16"])
    parser.add_argument("--configs", default="", help="regex on the kernel name")
    parser.add_argument("--iters", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--check", action="store_true", help="verify each config on odd shapes first")
    parser.add_argument("--explore", action="store_true", help="also time the EXPLORE design points")
    parser.add_argument("--confirm", type=int, default=0, metavar="PAIRS",
                        help="after the sweep, re-time each shape's best emitted config against cuBLAS with "
                             "this many alternating pairs (an unbiased ratio for the chosen config)")
    parser.add_argument("--profile", action="store_true",
                        help="launch the selected configs and cuBLAS twice each on the first shape and exit "
                             "(for ncu)")
    parser.add_argument("--sanitize", action="store_true",
                        help="run each selected config once on a small odd batched problem and exit "
                             "(for compute-sanitizer)")
    parser.add_argument("--out", default=None)
    opts = parser.parse_args()

    dtype = {"bf16": torch.bfloat16, "f16": torch.float16}[opts.dtype]
    device = torch.cuda.get_device_name()
    torch.manual_seed(0)
    artifacts: dict = {}
    rows = []
    t0 = time.time()

    ab = DataType.bf16 if opts.dtype == "bf16" else DataType.f16
    extra = [Sm90WarpSpecializedGemm._make(ab, ab, ROW_MAJOR, ROW_MAJOR, ROW_MAJOR, c) for c in EXPLORE] \
        if opts.explore else []

    def candidates(args):
        found = kernel_api.get_kernels(args, metadata_filter=lambda m: m.kernel_class is Sm90WarpSpecializedGemm)
        return [k for k in found + extra if re.search(opts.configs, k.name)]

    if opts.sanitize:
        from kernel_api.providers.cutedsl.gemm import sm90_warpspecialized as iface
        for size in (1, 2, 4):
            print(f"max active clusters of {size}: {iface.max_active_clusters(0, size)}", flush=True)
        print(f"fallbacks: {iface.max_clusters_fallbacks}", flush=True)
        probe = torch.empty(8, 8, device="cuda", dtype=dtype)
        for k in candidates(kernel_api.GemmArguments(probe, probe, probe, accumulator_type=torch.float32)):
            # a small odd batched problem, then one with more cluster tiles than a wave (stream-K splits)
            for L, M, N, K in ((2, 203, 264, 136), (1, 3035, 3064, 520)):
                A = torch.randn(L, M, K, device="cuda", dtype=dtype)
                B = torch.randn(L, K, N, device="cuda", dtype=dtype)
                out = torch.full((L, M, N), float("nan"), device="cuda", dtype=dtype)
                k.run(kernel_api.GemmArguments(A, B, out, accumulator_type=torch.float32))
                torch.cuda.synchronize()
                err = relative_error(out, A.double() @ B.double())
                print(f"sanitize {k.name} {(L, M, N, K)}: rel err {err:.2e}", flush=True)
        return

    checks = {}
    if opts.check:
        probe = torch.empty(8, 8, device="cuda", dtype=dtype)
        for k in candidates(kernel_api.GemmArguments(probe, probe, probe, accumulator_type=torch.float32)):
            checks[short(k)] = err = check(k, artifacts, dtype)
            print(f"check {k.name}: rel err {err:.2e} {'OK' if err < 2e-2 else 'FAIL'}", flush=True)

    if opts.profile:
        M, N, K = opts.shapes[0]
        A = torch.randn(M, K, device="cuda", dtype=dtype)
        B = torch.randn(K, N, device="cuda", dtype=dtype)
        out = torch.empty(M, N, device="cuda", dtype=dtype)
        args = kernel_api.GemmArguments(A, B, out, accumulator_type=torch.float32)
        for k in candidates(args):
            art = k.compile(args)
            for _ in range(2):
                k.run(args, compiled_artifact=art)
            torch.cuda.synchronize()
            print(f"profiled {k.name}", flush=True)
        for _ in range(2):
            torch.matmul(A, B, out=out)
        torch.cuda.synchronize()
        return

    runners: dict = {}
    shape_bufs: dict = {}
    for M, N, K in opts.shapes:
        one = (M * K + K * N + M * N) * 2
        sets = rotation_count(one, 2 * L2_FLUSH_BYTES, cap=8)
        bufs = []
        for _ in range(sets):
            A = torch.randn(M, K, device="cuda", dtype=dtype)
            B = torch.randn(K, N, device="cuda", dtype=dtype)
            out = torch.full((M, N), float("nan"), device="cuda", dtype=dtype)
            bufs.append((A, B, out, kernel_api.GemmArguments(A, B, out, accumulator_type=torch.float32)))
        ref = torch.matmul(bufs[0][0].double(), bufs[0][1].double())
        flops = 2.0 * M * N * K

        def torch_run(i, bufs=bufs):
            A, B, out, _ = bufs[i]
            torch.matmul(A, B, out=out)

        for kernel in candidates(bufs[0][3]):
            key = (kernel.name, bufs[0][3].signature)
            if key not in artifacts:
                artifacts[key] = kernel.compile(bufs[0][3])
            art = artifacts[key]
            bufs[0][2].fill_(float("nan"))
            kernel.run(bufs[0][3], compiled_artifact=art)
            torch.cuda.synchronize()
            err = relative_error(bufs[0][2], ref)

            size = kernel.get_workspace_size(bufs[0][3])
            ws = torch.empty(size, dtype=torch.uint8, device="cuda") if size else None

            def ours(i, kernel=kernel, art=art, ws=ws, bufs=bufs):
                kernel.run(bufs[i][3], compiled_artifact=art, workspace=ws, assume_supported_args=True)

            tb, tk = time_pair(torch_run, ours, sets, opts.warmup, opts.iters)
            runners[(M, N, K, kernel.name)] = ours
            rows.append({"shape": [M, N, K], "dtype": opts.dtype, "kernel": kernel.name, "config": short(kernel),
                         "ms": tk, "tflops": flops / tk / 1e9, "cublas_ms": tb, "cublas_tflops": flops / tb / 1e9,
                         "ratio": tb / tk, "rel_err": err,
                         "emitted": kernel not in extra})
            print(f"{M}x{N}x{K} {short(kernel):60s} {tk:8.4f} ms {flops / tk / 1e9:7.1f} TF/s  "
                  f"cuBLAS {tb:8.4f} ms  ratio {tb / tk:5.3f}  err {err:.1e}", flush=True)
        del ref
        if opts.confirm:
            shape_bufs[(M, N, K)] = (bufs, sets, torch_run)
        else:
            del bufs
            torch.cuda.empty_cache()

    def best_of(rows):
        best = {}
        for r in rows:
            k = tuple(r["shape"])
            if r["rel_err"] < 2e-2 and (k not in best or r["ratio"] > best[k]["ratio"]):
                best[k] = r
        geo = math.exp(sum(math.log(r["ratio"]) for r in best.values()) / max(1, len(best))) if best else float("nan")
        return best, geo

    best_all, geo_all = best_of(rows)
    best, geo = best_of([r for r in rows if r["emitted"]])
    confirm = {}
    if opts.confirm:
        for (M, N, K), r in best.items():
            bufs, sets, torch_run = shape_bufs[(M, N, K)]
            tb, tk = time_pair(torch_run, runners[(M, N, K, r["kernel"])], sets, opts.warmup, opts.confirm)
            flops = 2.0 * M * N * K
            confirm[(M, N, K)] = {"shape": [M, N, K], "kernel": r["kernel"], "config": r["config"], "ms": tk,
                                  "tflops": flops / tk / 1e9, "cublas_ms": tb, "cublas_tflops": flops / tb / 1e9,
                                  "ratio": tb / tk, "pairs": opts.confirm}
        geo_confirm = math.exp(sum(math.log(c["ratio"]) for c in confirm.values()) / len(confirm))
    result = {"device": device, "dtype": opts.dtype, "torch": torch.__version__, "rows": rows, "checks": checks,
              "best": list(best.values()), "geomean_best_ratio": geo,
              "best_incl_explore": list(best_all.values()), "geomean_best_ratio_incl_explore": geo_all,
              "confirm": list(confirm.values()),
              "geomean_confirm_ratio": geo_confirm if confirm else None,
              "seconds": time.time() - t0}
    path = opts.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                    f"gemm_sm90-{re.sub(r'[^A-Za-z0-9]+', '_', device)}.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"\nwrote {path}")
    print(f"\n{'shape':>18} {'best config':52} {'ms':>8} {'TF/s':>7} {'cuBLAS':>8} {'TF/s':>7} {'ratio':>6}")
    for (M, N, K), r in best.items():
        print(f"{f'{M}x{N}x{K}':>18} {r['config']:52} {r['ms']:8.4f} {r['tflops']:7.1f} {r['cublas_ms']:8.4f} "
              f"{r['cublas_tflops']:7.1f} {r['ratio']:6.3f}")
    print(f"geometric mean of best ratios (emitted configs): {geo:.3f}  ({device})")
    if extra:
        print("\nincluding explored design points:")
        for (M, N, K), r in best_all.items():
            print(f"{f'{M}x{N}x{K}':>18} {r['config']:52} {r['ms']:8.4f} {r['tflops']:7.1f} {r['cublas_ms']:8.4f} "
                  f"{r['cublas_tflops']:7.1f} {r['ratio']:6.3f}")
        print(f"geometric mean of best ratios (incl. explored): {geo_all:.3f}")
    if confirm:
        print(f"\nconfirmation: each shape's best emitted config re-timed, {opts.confirm} alternating pairs")
        print(f"{'shape':>18} {'config':52} {'ms':>8} {'TF/s':>7} {'cuBLAS':>8} {'TF/s':>7} {'ratio':>6}")
        for (M, N, K), c in confirm.items():
            print(f"{f'{M}x{N}x{K}':>18} {c['config']:52} {c['ms']:8.4f} {c['tflops']:7.1f} {c['cublas_ms']:8.4f} "
                  f"{c['cublas_tflops']:7.1f} {c['ratio']:6.3f}")
        print(f"geometric mean (confirmation): {geo_confirm:.3f}  min {min(c['ratio'] for c in confirm.values()):.3f}"
              f"  ({device})")


if __name__ == "__main__":
    main()
