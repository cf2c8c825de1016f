"""f32 GEMM on Hopper: our tf32 and 3xTF32 wgmma kernels against cuBLAS TF32 and FP32.

    python benchmarks/gemm_f32.py                       # 4096^3, 8192^3, 4096x14336x4096
    python benchmarks/gemm_f32.py --shapes 4096x4096x4096 --repeats 50

For every shape (A row-major, B column-major: both K-major, the layout the tf32 wgmma reads;
``--b-row-major`` times 3xTF32 with a row-major B too), each `Sm90WarpSpecializedGemm` instance
of math type tf32 is timed against cuBLAS TF32 (``allow_tf32=True``) and each tf32x3 instance
against cuBLAS FP32 (``allow_tf32=False``) and cuBLAS TF32: launches alternate (cuBLAS, ours,
cuBLAS, ours ...), each bracketed by CUDA events, medians over ``--repeats`` pairs, inputs
rotating over enough random sets to exceed twice the L2. Every result's relative error against
float64 (on the first set) is recorded for ours and for cuBLAS. ``--promote 0 1 2 4`` also times
each emitted 3xTF32 configuration with those accumulator promotion intervals (k-tiles per
promotion; 0: none) and, with ``--previous``, the 128x256 cooperative tile without promotion
(the first 3xTF32 design). ``--compile-only`` fills the disk cache and exits (``--shard i/n``
takes every n-th kernel, so several processes can compile at once). Writes
``benchmarks/results/gemm_f32-<device>-s21.json`` (``--out``) and prints a table last.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

import kernel_api  # noqa: E402
from kernel_api.dtypes import DataType  # noqa: E402
from kernel_api.metadata import COLUMN_MAJOR, ROW_MAJOR  # noqa: E402
from kernel_api.providers.cutedsl.gemm.sm90_warpspecialized import (  # noqa: E402
    CONFIGS, TF32X3_CONFIGS, Sm90WarpSpecializedGemm)
from kernel_api.tuning.timing import L2_FLUSH_BYTES, relative_error, rotation_count  # noqa: E402
from kernel_api.tuning.timing import time_cuda_pair as time_pair  # noqa: E402

SHAPES = ["4096x4096x4096", "8192x8192x8192", "4096x14336x4096"]


def parse_shape(text: str) -> tuple[int, int, int]:
    m = re.fullmatch(r"(\d+)x(\d+)x(\d+)", text.strip())
    if not m:
        raise argparse.ArgumentTypeError(f"shape {text!r}: expected MxNxK")
    return tuple(int(g) for g in m.groups())


def make_sets(M: int, N: int, K: int, b_row_major: bool) -> list:
    """Rotating (A, B, out, args) sets: A row-major, B column-major (or row-major), out NaN."""
    sets = rotation_count((M * K + K * N + M * N) * 4, 2 * L2_FLUSH_BYTES, cap=8)
    bufs = []
    for _ in range(sets):
        A = torch.randn(M, K, device="cuda")
        B = torch.randn(K, N, device="cuda") if b_row_major else torch.randn(N, K, device="cuda").t()
        out = torch.full((M, N), float("nan"), device="cuda")
        bufs.append((A, B, out, kernel_api.GemmArguments(A, B, out, accumulator_type=torch.float32)))
    return bufs


#: tf32 design points beyond the emitted ones (``--tf32-extra``): the 128x256 cooperative tile
#: (the 4096^3 winner) with the other cluster, a wider raster band, the last wave split by
#: stream-K at any fullness, and the 256x128 / 128x128 cooperative tiles.
TF32_EXTRA: tuple = (
    CONFIGS[1],
    dataclasses.replace(CONFIGS[0], cluster_mn=(1, 2), raster_along_m=False),
    dataclasses.replace(CONFIGS[0], swizzle=8),
    dataclasses.replace(CONFIGS[0], stream_k=True, sk_any_wave_max_k_tiles=1 << 20),
    dataclasses.replace(CONFIGS[0], tile_mn=(128, 128), swizzle=8),
)


def variants(promote: list[int], previous: bool, b_row_major: bool, tf32_extra: bool = False) -> list:
    """Instances beyond the emitted ones: 3xTF32 with each emitted configuration at the given
    promotion intervals, (``previous``) the 128x256 cooperative 3xTF32 tile without promotion,
    and (``tf32_extra``) tf32 at the `TF32_EXTRA` design points."""
    cfgs = [dataclasses.replace(c, promote_every=n) for c in TF32X3_CONFIGS for n in promote]
    if previous:
        cfgs.append(CONFIGS[0])
    f32 = DataType.f32
    stride_b = ROW_MAJOR if b_row_major else COLUMN_MAJOR
    made = [Sm90WarpSpecializedGemm._make(f32, f32, ROW_MAJOR, stride_b, ROW_MAJOR, c, DataType.tf32x3) for c in cfgs]
    if tf32_extra:
        made += [Sm90WarpSpecializedGemm._make(f32, f32, ROW_MAJOR, stride_b, ROW_MAJOR, c, DataType.tf32)
                 for c in TF32_EXTRA]
    return made


def candidates(args, opts, b_row_major: bool) -> list:
    """The emitted tf32/tf32x3 instances for ``args`` and the requested variants, filtered by
    ``--configs``."""
    found = kernel_api.get_kernels(args, metadata_filter=lambda m: (
        m.kernel_class is Sm90WarpSpecializedGemm and m.operands.math_type in (DataType.tf32, DataType.tf32x3)))
    names = {k.name for k in found}
    found += [k for k in variants(opts.promote, opts.previous, b_row_major, opts.tf32_extra) if k.name not in names and k.supports(args)]
    return [k for k in found if re.search(opts.configs, k.name)]


def cublas(bufs: list, tf32: bool):
    def run(i: int) -> None:
        A, B, out, _ = bufs[i]
        torch.matmul(A, B, out=out)
    return run


def cublas_error(bufs: list, ref: torch.Tensor, tf32: bool) -> float:
    torch.backends.cuda.matmul.allow_tf32 = tf32
    A, B, out, _ = bufs[0]
    out.fill_(float("nan"))
    torch.matmul(A, B, out=out)
    torch.cuda.synchronize()
    return relative_error(out, ref)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", type=parse_shape, default=[parse_shape(s) for s in SHAPES])
    parser.add_argument("--repeats", type=int, default=20, help="timed pairs per measurement (median)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--configs", default=".", help="regex on kernel names")
    parser.add_argument("--b-row-major", action="store_true", help="also time 3xTF32 with a row-major B")
    parser.add_argument("--promote", nargs="*", type=int, default=[],
                        help="also time 3xTF32 with these promotion intervals (k-tiles; 0 = none)")
    parser.add_argument("--previous", action="store_true",
                        help="also time the 128x256 cooperative 3xTF32 without promotion")
    parser.add_argument("--tf32-extra", action="store_true",
                        help="also time tf32 at the TF32_EXTRA design points (other clusters, bands, stream-K)")
    parser.add_argument("--compile-only", action="store_true", help="compile (fill the disk cache) and exit")
    parser.add_argument("--shard", default="0/1", help="i/n: compile-only takes every n-th kernel from i")
    parser.add_argument("--out", default=None)
    opts = parser.parse_args()
    device = torch.cuda.get_device_name()
    torch.manual_seed(0)
    if opts.compile_only:
        i, n = (int(x) for x in opts.shard.split("/"))
        for b_row in ([False, True] if opts.b_row_major else [False]):
            # (the compile-time signature: dtypes, layouts, alignment; any shape with 16-byte strides)
            args = make_sets(256, 256, 256, b_row)[0][3]
            for kernel in candidates(args, opts, b_row)[i::n]:
                kernel.compile(args)
                print("compiled", kernel.name, flush=True)
        return
    saved = torch.backends.cuda.matmul.allow_tf32
    artifacts: dict = {}
    rows = []
    try:
        layouts = [False, True] if opts.b_row_major else [False]
        for M, N, K in opts.shapes:
            flops = 2.0 * M * N * K
            for b_row in layouts:
                bufs = make_sets(M, N, K, b_row)
                ref = bufs[0][0].double() @ bufs[0][1].double()
                errs = {"cublas_tf32": cublas_error(bufs, ref, True), "cublas_fp32": cublas_error(bufs, ref, False)}
                for kernel in candidates(bufs[0][3], opts, b_row):
                    math = kernel.metadata.operands.math_type
                    key = (kernel.name, bufs[0][3].signature)
                    if key not in artifacts:
                        artifacts[key] = kernel.compile(bufs[0][3])
                    art = artifacts[key]
                    size = kernel.get_workspace_size(bufs[0][3])
                    ws = torch.empty(size, dtype=torch.uint8, device="cuda") if size else None
                    bufs[0][2].fill_(float("nan"))
                    kernel.run(bufs[0][3], compiled_artifact=art, workspace=ws)
                    torch.cuda.synchronize()
                    err = relative_error(bufs[0][2], ref)

                    def ours(i: int, kernel=kernel, art=art, ws=ws, bufs=bufs) -> None:
                        kernel.run(bufs[i][3], compiled_artifact=art, workspace=ws, assume_supported_args=True)

                    row = {"shape": [M, N, K], "layout": "tt" if b_row else "tn", "math": str(math),
                           "promote_every": kernel.config.promote_every,
                           "kernel": kernel.name, "rel_err": err, "cublas_tf32_err": errs["cublas_tf32"],
                           "cublas_fp32_err": errs["cublas_fp32"], "workspace_bytes": size}
                    torch.backends.cuda.matmul.allow_tf32 = True
                    tb, tk = time_pair(cublas(bufs, True), ours, len(bufs), opts.warmup, opts.repeats)
                    row.update(ms=tk, tflops=flops / tk / 1e9, cublas_tf32_ms=tb, cublas_tf32_tflops=flops / tb / 1e9,
                               vs_cublas_tf32=tb / tk)
                    if math is DataType.tf32x3:
                        torch.backends.cuda.matmul.allow_tf32 = False
                        tb32, tk2 = time_pair(cublas(bufs, False), ours, len(bufs), opts.warmup, opts.repeats)
                        row.update(ms_fp32_pair=tk2, cublas_fp32_ms=tb32, cublas_fp32_tflops=flops / tb32 / 1e9,
                                   vs_cublas_fp32=tb32 / tk2)
                    rows.append(row)
                    print(f"{M}x{N}x{K} {row['layout']} {kernel.name}: {row['tflops']:.1f} TF/s err {err:.2e} | "
                          f"cuBLAS TF32 {row['cublas_tf32_tflops']:.1f} ({row['vs_cublas_tf32']:.3f}x, err "
                          f"{errs['cublas_tf32']:.2e})" + (f" | cuBLAS FP32 {row['cublas_fp32_tflops']:.1f} "
                                                         f"({row['vs_cublas_fp32']:.3f}x, err {errs['cublas_fp32']:.2e})"
                                                         if "vs_cublas_fp32" in row else ""), flush=True)
                del bufs, ref
                torch.cuda.empty_cache()
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved

    path = opts.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                    f"gemm_f32-{device.replace(' ', '_')}-s21.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump({"device": device, "torch": torch.__version__, "command": " ".join(sys.argv), "rows": rows}, f,
                  indent=1)
    print(f"\nwrote {path}\n")
    print(f"{'shape':16s} {'lay':3s} {'math':6s} {'best config':52s} {'TF/s':>7s} {'err':>8s} {'xTF32':>6s} "
          f"{'xFP32':>6s} {'cuTF32':>7s} {'cuFP32':>7s} {'errTF32':>8s} {'errFP32':>8s}")
    best: dict = {}
    for r in rows:
        k = (tuple(r["shape"]), r["layout"], r["math"])
        if k not in best or r["tflops"] > best[k]["tflops"]:
            best[k] = r
    for (shape, lay, math), r in best.items():
        cfg = re.sub(r"^.*?_f32acc_\w{3}_", "", r["kernel"])[:52]
        print(f"{'x'.join(map(str, shape)):16s} {lay:3s} {math:6s} {cfg:52s} {r['tflops']:7.1f} {r['rel_err']:8.1e} "
              f"{r['vs_cublas_tf32']:6.3f} {r.get('vs_cublas_fp32', float('nan')):6.3f} "
              f"{r['cublas_tf32_tflops']:7.1f} {r.get('cublas_fp32_tflops', float('nan')):7.1f} "
              f"{r['cublas_tf32_err']:8.1e} {r['cublas_fp32_err']:8.1e}")
    print(f"\n3xTF32, every instance: error as a multiple of cuBLAS FP32's on the same data\n"
          f"{'shape':16s} {'lay':3s} {'config':60s} {'TF/s':>7s} {'xFP32':>6s} {'err':>8s} {'err/FP32':>8s}")
    for r in rows:
        if r["math"] == "tf32x3":
            cfg = re.sub(r"^.*?_f32acc_\w{3}_", "", r["kernel"])[:60]
            print(f"{'x'.join(map(str, r['shape'])):16s} {r['layout']:3s} {cfg:60s} {r['tflops']:7.1f} "
                  f"{r['vs_cublas_fp32']:6.3f} {r['rel_err']:8.1e} {r['rel_err'] / r['cublas_fp32_err']:8.2f}")


if __name__ == "__main__":
    main()
