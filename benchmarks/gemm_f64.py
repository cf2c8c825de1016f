"""f64 GEMM on the FP64 tensor cores: candidate `Sm80TensorOpGemm` f64 configurations vs cuBLAS DGEMM.

    python benchmarks/gemm_f64.py                          # 2048^3, 4096^3, 8192^3, every candidate
    python benchmarks/gemm_f64.py --sizes 2048 --candidates 128x128x32_w2x4_s3_k16 --repeats 3

Each candidate is an f64 instance of the family (row-major A, B and out, alignment 2) with a
design that may lie outside the family's generated list: tile, warps, ring stages and the
DMMA shape (k4: m8n8k4, k8: m16n8k8, k16: m16n8k16; the last two sm_90+). Per size, every
candidate is compiled, checked against a float64 product on the GPU (fresh random data, a
NaN-filled output), and timed against torch.matmul in f64 (cuBLAS DGEMM) with alternating
launches, each between its own CUDA events; the ratio is the median over ``--iters`` pairs,
repeated ``--repeats`` times (their spread is reported). Inputs rotate over enough buffer
sets to exceed twice the L2. JSON goes to ``benchmarks/results/gemm_f64-<device>.json``
(``--json`` to name another file); a table is printed last.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

from kernel_api.arguments import GemmArguments  # noqa: E402
from kernel_api.tuning.timing import rotation_count, time_cuda_pair  # noqa: E402

#: (BM, BN, BK), (warps along M, along N), stages, DMMA k (8: m16n8k8, 16: m16n8k16)[, raster group]
CANDIDATES = (
    ((128, 128, 16), (2, 4), 3, 8),   # the family's two configurations before this benchmark
    ((64, 64, 16), (2, 2), 3, 8),
    ((128, 128, 32), (2, 4), 3, 8),
    ((128, 128, 16), (2, 4), 3, 16),
    ((128, 128, 16), (2, 4), 5, 16),
    ((128, 128, 32), (2, 4), 3, 16),
    ((128, 64, 16), (2, 2), 4, 16),   # two CTAs per SM (registers and shared memory)
    ((128, 64, 32), (2, 2), 2, 16),
    ((64, 64, 32), (2, 2), 3, 16),
    ((64, 64, 16), (2, 2), 4, 16),
    # a 1-D grid walked 8 / 16 M-tiles at a time (L2 reuse at 8192^3): measured in sessions 23
    # and 25, no gain (NOTES-f64.md)
    ((128, 128, 16), (2, 4), 3, 16, 8),
    ((128, 128, 16), (2, 4), 3, 16, 16),
)


#: `CudaGemmF64` (cuda_src) configurations, by `F64Config.tag`: candidates ``cuda:<tag>``.
CUDA_CANDIDATES = ("tile128x64x16_warps2x2_stages3", "tile64x64x16_warps2x2_stages4_prefetch")


def candidate_name(tile, warps=None, stages=None, mma_k=None, group: int = 0) -> str:
    if tile == "cuda":
        return f"cuda:{warps}"
    return f"{tile[0]}x{tile[1]}x{tile[2]}_w{warps[0]}x{warps[1]}_s{stages}_k{mma_k}" + (f"_g{group}" if group else "")


def parse_candidate(text: str):
    if text.startswith("cuda:"):
        return ("cuda", text[5:])
    m = re.fullmatch(r"(\d+)x(\d+)x(\d+)_w(\d+)x(\d+)_s(\d+)_k(\d+)(?:_g(\d+))?", text)
    if not m:
        raise argparse.ArgumentTypeError(f"candidate {text!r}: expected BMxBNxBK_wWMxWN_sS_kK[_gG]")
    v = [int(x) if x else 0 for x in m.groups()]
    return (v[0], v[1], v[2]), (v[3], v[4]), v[5], v[6], v[7]


def make_kernel(tile, warps=None, stages=None, mma_k=None, group: int = 0, layouts: str = "ttt", align: int = 2):
    """An f64 `Sm80TensorOpGemm` instance of this design (``layouts``: A, B, out; t = row-major;
    ``group``: M-tiles per rasterisation group, 0 for the (M tiles, N tiles) grid), or for
    ``("cuda", tag)`` the `CudaGemmF64` instance of that configuration and ``layouts``."""
    if tile == "cuda":
        from kernel_api.providers.cuda_src.kernels.gemm_f64 import CudaGemmF64
        found = [k for k in CudaGemmF64.generate_kernels(None)
                 if k.config.tag == warps and k.metadata.kernel_name.split("_")[2] == layouts]
        if found:
            return found[0]
        # a configuration outside the family's CONFIGS, built from its tag
        from kernel_api.providers.cuda_src.kernels.gemm_f64 import F64Config
        try:
            config = F64Config.from_tag(warps)
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"{e} (the family's: {CUDA_CANDIDATES})") from None
        params = dict(a=layouts[0], b=layouts[1], out=layouts[2], config=config)
        return CudaGemmF64(CudaGemmF64.make_metadata(params), params)
    from kernel_api.core.dtypes import DataType
    from kernel_api.metadata import GemmOperandsMetadata, KernelMetadata, TensorAttributes
    from kernel_api.providers.cutedsl.gemm.common import tiled_gemm_metadata
    from kernel_api.providers.cutedsl.gemm.sm80_tensorop import Sm80TensorOpGemm

    row, col = (0, 1), (1, 0)
    sa, sb, so = ((row if c == "t" else col) for c in layouts)
    f64 = DataType.f64
    operands = GemmOperandsMetadata(TensorAttributes(f64, sa, align), TensorAttributes(f64, sb, align),
                                    TensorAttributes(f64, so, 1), accumulator_type=f64)
    md = tiled_gemm_metadata(Sm80TensorOpGemm, "f64f64f64", (sa, sb, so), operands, tile, ("warps", warps), stages,
                             "multistage", min_cc=80)
    extra = (("mma_k", mma_k),) + ((("raster_group", group),) if group else ())
    design = dataclasses.replace(md.design, extra=md.design.extra + extra)
    md = KernelMetadata(f"{md.kernel_name}_k{mma_k}" + (f"_g{group}" if group else ""), Sm80TensorOpGemm,
                        md.operands, design, min_cc=md.min_cc, epilogue=md.epilogue)
    return Sm80TensorOpGemm(md)


def _precompile(cand, cc: int) -> str:
    """Compile one candidate (row-major, rank 2) into the disk cache; run in a worker process."""
    k = make_kernel(*cand)
    A = torch.empty(64, 64, dtype=torch.float64)
    t0 = time.time()
    k.compile(GemmArguments(A, A, torch.empty_like(A)), cc=cc)
    return f"{candidate_name(*cand)} {time.time() - t0:.1f}s"


def precompile(candidates, jobs: int, log) -> None:
    """Fill the compile cache for every candidate with ``jobs`` processes (compiles are CPU-bound;
    the cache is keyed by metadata and signature, so the timed run then loads them)."""
    import concurrent.futures
    import functools
    import multiprocessing

    major, minor = torch.cuda.get_device_capability()
    work = functools.partial(_precompile, cc=major * 10 + minor)
    with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        for line in pool.map(work, candidates):
            log(f"  compiled {line}")


def bench_size(n: int, candidates, iters: int, warmup: int, repeats: int, log) -> dict:
    flops = 2.0 * n ** 3
    per_set = 3 * n * n * 8
    sets = []
    for _ in range(rotation_count(per_set)):
        A = torch.randn(n, n, device="cuda", dtype=torch.float64)
        B = torch.randn(n, n, device="cuda", dtype=torch.float64)
        sets.append((A, B, torch.empty(n, n, device="cuda", dtype=torch.float64),
                     torch.empty(n, n, device="cuda", dtype=torch.float64)))
    arg_sets = [GemmArguments(A, B, out) for A, B, out, _ in sets]

    def torch_launch(i: int) -> None:
        A, B, _, ref = sets[i]
        torch.matmul(A, B, out=ref)

    row = {"size": n, "buffer_sets": len(sets), "candidates": {}}
    A, B = sets[0][0], sets[0][1]
    ref = A @ B  # cuBLAS f64
    ref_rows = slice(0, 64)
    ref_cpu = A[ref_rows].cpu() @ B.cpu()
    for cand in candidates:
        name = candidate_name(*cand)
        k = make_kernel(*cand)
        entry = {"kernel": k.metadata.kernel_name}
        try:
            t0 = time.time()
            art = k.compile(arg_sets[0])
            entry["compile_s"] = round(time.time() - t0, 2)
            out = sets[0][2]
            out.fill_(float("nan"))
            k.run(arg_sets[0], compiled_artifact=art)
            torch.cuda.synchronize()
            entry["rel_err"] = float(torch.linalg.vector_norm(out - ref) / torch.linalg.vector_norm(ref))
            entry["rel_err_cpu"] = float(torch.linalg.vector_norm(out[ref_rows].cpu() - ref_cpu)
                                         / torch.linalg.vector_norm(ref_cpu))
            entry["all_written"] = bool(torch.isfinite(out).all())

            def ours(i: int, k=k, art=art) -> None:
                k.run(arg_sets[i], compiled_artifact=art, assume_supported_args=True)

            runs = []
            for _ in range(repeats):
                torch_ms, ms = time_cuda_pair(torch_launch, ours, len(sets), warmup, iters)
                runs.append({"ms": ms, "torch_ms": torch_ms, "ratio": torch_ms / ms})
            ratios = sorted(r["ratio"] for r in runs)
            ms = statistics.median(r["ms"] for r in runs)
            torch_ms = statistics.median(r["torch_ms"] for r in runs)
            entry.update(ms=ms, tflops=flops / ms / 1e9, torch_ms=torch_ms, torch_tflops=flops / torch_ms / 1e9,
                         ratio=statistics.median(ratios), ratio_min=ratios[0], ratio_max=ratios[-1], runs=runs)
            log(f"  {name:>28}: {entry['tflops']:6.1f} TFLOP/s  cuBLAS {entry['torch_tflops']:6.1f}  "
                f"x{entry['ratio']:.3f} ({ratios[0]:.3f}-{ratios[-1]:.3f})  err {entry['rel_err']:.1e}/"
                f"{entry['rel_err_cpu']:.1e}  written {entry['all_written']}")
        except Exception as exc:  # report, keep benchmarking the others
            entry["error"] = f"{type(exc).__name__}: {exc}"[:2000]
            log(f"  {name:>28}: FAILED {entry['error'][:300]}")
        row["candidates"][name] = entry
    del sets, arg_sets
    torch.cuda.empty_cache()
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", type=int, default=[2048, 4096, 8192], help="square sizes M = N = K")
    parser.add_argument("--candidates", nargs="+", type=parse_candidate,
                        help="BMxBNxBK_wWMxWN_sS_kK or cuda:<CudaGemmF64 tag> (default: all)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=20, help="alternating pairs per timing run")
    parser.add_argument("--repeats", type=int, default=3, help="timing runs per candidate (spread)")
    parser.add_argument("--json", help="output file (default benchmarks/results/gemm_f64-<device>.json)")
    parser.add_argument("--jobs", type=int, default=0, help="compile the candidates first in this many processes")
    opts = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/gemm_f64.py needs a CUDA GPU", file=sys.stderr)
        return 2
    device = torch.cuda.get_device_name()
    torch.manual_seed(0)
    candidates = opts.candidates or list(CANDIDATES) + [("cuda", tag) for tag in CUDA_CANDIDATES]
    if opts.jobs:
        precompile(candidates, opts.jobs, lambda s: print(s, flush=True))
    rows = []
    for n in opts.sizes:
        print(f"{n}^3 f64", flush=True)
        rows.append(bench_size(n, candidates, opts.iters, opts.warmup, opts.repeats, lambda s: print(s, flush=True)))
    slug = re.sub(r"[^a-z0-9]+", "-", device.lower()).strip("-")
    path = opts.json or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", f"gemm_f64-{slug}.json")
    with open(path, "w") as f:
        json.dump({"device": device, "torch": torch.__version__, "cc": torch.cuda.get_device_capability(),
                   "warmup": opts.warmup, "iters": opts.iters, "repeats": opts.repeats,
                   "timing": "paired: torch.matmul (f64) and the kernel launched alternately, each between its own "
                   "CUDA events; median per run, median of runs", "rows": rows}, f, indent=1)
    print(f"\nwrote {path}\n")
    heads = [f"{r['size']}^3 TF/s (x)" for r in rows]
    print(f"{'candidate':>28} " + " ".join(f"{h:>22}" for h in heads))
    for cand in candidates:
        name = candidate_name(*cand)
        cells = []
        for r in rows:
            e = r["candidates"].get(name, {})
            cells.append(f"{e['tflops']:7.1f} ({e['ratio']:.3f})" if "ratio" in e else "failed")
        print(f"{name:>28} " + " ".join(f"{c:>22}" for c in cells))
    cublas = [statistics.median([e["torch_tflops"] for e in r["candidates"].values() if "torch_tflops" in e] or [0])
              for r in rows]
    print(f"{'cuBLAS':>28} " + " ".join(f"{c:>14.1f}{'':>8}" for c in cublas))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
