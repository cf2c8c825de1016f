"""Clock, power and cycles per GEMM of our kernels against cuBLAS under sustained load (issue #16,
goals 4 and 5): is a gap one of clock (power) or of work per cycle?

    python3 benchmarks/gemm_power.py --dtype f64 --sizes 8192 --candidates cuda:<CudaGemmF64 tag> ...
    python3 benchmarks/gemm_power.py --dtype bf16 --sizes 4096 8192 --candidates tile128x128x64_cluster1x2_pingpong ...

A candidate is ``cuda:<tag>`` (f64: a `CudaGemmF64` configuration, as in gemm_f64.py),
``sm90:TMxTN:CMxCN:schedule[:swzS][:n][:sk][:skkT][:sa]`` (16-bit: an `Sm90WarpSpecializedGemm` design point,
emitted or not; ``n``: raster along N; ``sk``: stream-K; ``skkT``: stream-K splits any last wave at K of at most
T k-tiles; ``sa``: split_all, every tile cut along K over the whole grid) or a piece of an instance name that `kernel_api.get_kernels` offers for
the problem (row-major A and out, B as ``--layouts`` says; the first instance whose name contains it).

Per size, each contestant (cuBLAS, then the candidates, in turn, ``--rounds`` times) runs back to back on rotating fresh random inputs for ``--seconds`` after the same time of
untimed launches (the power controller settles within ~0.1 s, NOTES-sm90.md session 33), while
`gpu_clocks.ClockSampler` samples nvidia-smi's SM clock and power draw. Reported per contestant:
ms per GEMM (CUDA events over the window), TFLOP/s, median SM MHz and watts, and mega-cycles per
GEMM (ms x MHz): equal cycles at a lower clock mean the gap is power; more cycles mean the kernel
itself. JSON to ``benchmarks/results/gemm_power-<device>[-tag].json``; a table is printed last.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import torch  # noqa: E402

import kernel_api  # noqa: E402
from gemm_f64 import make_kernel  # noqa: E402
from gpu_clocks import ClockSampler  # noqa: E402
from kernel_api.arguments import GemmArguments  # noqa: E402
from kernel_api.tuning.policies import gpu_floor_ms  # noqa: E402
from kernel_api.tuning.timing import rotation_count, time_interleaved  # noqa: E402


def run_for(launch, sets: int, seconds: float) -> tuple[float, int]:
    """Launch back to back for about ``seconds`` of GPU time; (ms per launch, launches)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    launch(0)  # one launch to size the batch
    torch.cuda.synchronize()
    start.record()
    launch(1 % sets)
    end.record()
    end.synchronize()
    batch = max(1, int(seconds * 1e3 / max(start.elapsed_time(end), 1e-3)))
    start.record()
    for i in range(batch):
        launch(i % sets)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / batch, batch


DTYPES = {"f64": torch.float64, "f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}


def find_kernel(candidate: str, args: GemmArguments):
    """The kernel a candidate names for ``args`` (see the module's docstring)."""
    if candidate.startswith("cuda:"):
        return make_kernel("cuda", candidate[5:])
    if candidate.startswith("sm90:"):
        from kernel_api.core.dtypes import from_torch
        from kernel_api.metadata import ROW_MAJOR
        from kernel_api.providers.cutedsl.gemm.sm90_warpspecialized import Sm90Config, Sm90WarpSpecializedGemm
        parts = candidate[5:].split(":")
        tile, cluster = (tuple(int(v) for v in p.split("x")) for p in parts[:2])
        swizzle = next((int(p[3:]) for p in parts[3:] if p.startswith("swz")), 1)
        cfg = Sm90Config(tile, cluster, parts[2], swizzle=swizzle, raster_along_m="n" not in parts[3:],
                         stream_k="sk" in parts[3:] or "sa" in parts[3:], split_all="sa" in parts[3:],
                         sk_any_wave_max_k_tiles=next((int(p[3:]) for p in parts[3:] if p.startswith("skk")), 0))
        ab = from_torch(args.A.dtype)
        from kernel_api.metadata import COLUMN_MAJOR
        b_stride = COLUMN_MAJOR if args.B.stride(-2) == 1 else ROW_MAJOR
        return Sm90WarpSpecializedGemm._make(ab, ab, ROW_MAJOR, b_stride, ROW_MAJOR, cfg)
    found = [k for k in kernel_api.get_kernels(args) if candidate in k.metadata.kernel_name]
    if not found:
        raise SystemExit(f"no kernel for this problem has {candidate!r} in its name")
    return found[0]


def bench_size(n: int | tuple[int, int, int], dtype: torch.dtype, candidates, seconds: float, rounds: int, sampler: ClockSampler,
               log, b_column_major: bool = False, interleaved: bool = False) -> dict:
    M, N, K = n if isinstance(n, tuple) else (n, n, n)
    n = f"{M}x{N}x{K}" if isinstance(n, tuple) else n
    flops = 2.0 * M * N * K
    sets = []
    for _ in range(rotation_count((M * K + K * N + M * N) * dtype.itemsize)):
        A = torch.randn(M, K, device="cuda", dtype=dtype)
        B = torch.randn(N, K, device="cuda", dtype=dtype).t() if b_column_major else \
            torch.randn(K, N, device="cuda", dtype=dtype)
        sets.append((A, B, torch.empty(M, N, device="cuda", dtype=dtype)))
    contestants = {"cuBLAS": lambda i: torch.matmul(sets[i][0], sets[i][1], out=sets[i][2])}
    arg_sets = [GemmArguments(A, B, out) for A, B, out in sets]
    for cand in candidates:
        k = find_kernel(cand, arg_sets[0])
        art = k.compile(arg_sets[0])
        A, B, out = sets[0]
        out.fill_(float("nan"))
        k.run(arg_sets[0], compiled_artifact=art)
        ref = (A.double() @ B.double())
        err = float((out.double() - ref).norm() / ref.norm())
        if not err < (1e-12 if dtype == torch.float64 else 1e-2):
            raise SystemExit(f"{k.metadata.kernel_name}: relative error {err:.2e}")
        log(f"  {k.metadata.kernel_name}: relative error {err:.1e}")
        contestants[k.metadata.kernel_name] = (
            lambda i, k=k, art=art, arg_sets=arg_sets: k.run(arg_sets[i], compiled_artifact=art,
                                                             assume_supported_args=True))
    times: dict[str, list[float]] = {name: [] for name in contestants}
    for r in range(rounds):
        if interleaved:  # the contestants in turn, at the clock of their mix (PickBest's default timing)
            with sampler.window(f"{n}:interleaved"):
                found = time_interleaved(contestants, len(sets), repeat=30, gpu_floor_ms=gpu_floor_ms(arg_sets[0]),
                                         settle_ms=1000.0 * seconds)
            for name, got in found.items():
                if isinstance(got, Exception):
                    raise got
                times[name].append(got["median_ms"])
                log(f"  round {r} {name:>50}: {got['median_ms']:.3f} ms (interleaved)")
            continue
        for name, launch in contestants.items():
            run_for(launch, len(sets), seconds)  # settle at this kernel's own power state
            with sampler.window(f"{n}:{name}"):
                ms, count = run_for(launch, len(sets), seconds)
            times[name].append(ms)
            log(f"  round {r} {name:>50}: {ms:.3f} ms ({count} launches)")
    clocks = sampler.summary()
    row = {"size": n, "buffer_sets": len(sets), "contestants": {}}
    for name, runs in times.items():
        c = clocks.get(f"{n}:{'interleaved' if interleaved else name}", {})
        ms = statistics.median(runs)
        mhz = c.get("sm_mhz")
        row["contestants"][name] = {"ms_runs": runs, "ms": ms, "tflops": flops / ms / 1e9, "sm_mhz": mhz,
                                    "watts": c.get("watts"), "samples": c.get("samples"),
                                    "mcycles": ms * mhz / 1e3 if mhz else None}
    del sets
    torch.cuda.empty_cache()
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="*", type=int, default=[8192], help="square sizes (none: --shapes only)")
    parser.add_argument("--shapes", nargs="+", default=[], help="also these MxNxK problems")
    parser.add_argument("--candidates", nargs="+", required=True,
                        help="cuda:<CudaGemmF64 tag> (f64) or a piece of an instance name")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="f64")
    parser.add_argument("--layouts", choices=("ttt", "tnt"), default="ttt",
                        help="A, B, out: t row-major, n column-major (tnt: what the tf32 kernels take)")
    parser.add_argument("--interleaved", action="store_true",
                        help="time the contestants in turn instead (time_interleaved after --seconds of untimed "
                             "rounds, 30 launches each per round): one shared clock; the clock reported is the mix's")
    parser.add_argument("--tf32", action="store_true", help="f32: cuBLAS with TF32 on (torch's allow_tf32)")
    parser.add_argument("--seconds", type=float, default=1.5, help="GPU time per sampled window")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--tag", default="")
    opts = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/gemm_power.py needs a CUDA GPU", file=sys.stderr)
        return 2
    device = torch.cuda.get_device_name()
    torch.manual_seed(0)
    torch.backends.cuda.matmul.allow_tf32 = opts.tf32
    rows = []
    with ClockSampler() as sampler:
        for n in list(opts.sizes) + [tuple(int(v) for v in t.split("x")) for t in opts.shapes]:
            print(f"{n if isinstance(n, tuple) else f'{n}^3'} {opts.dtype}", flush=True)
            rows.append(bench_size(n, DTYPES[opts.dtype], opts.candidates, opts.seconds, opts.rounds, sampler,
                                   lambda s: print(s, flush=True), b_column_major=opts.layouts == "tnt",
                                   interleaved=opts.interleaved))
    slug = re.sub(r"[^A-Za-z0-9]+", "_", device).strip("_")
    path = os.path.join(HERE, "results", f"gemm_power-{slug}{'-' + opts.tag if opts.tag else ''}.json")
    with open(path, "w") as f:
        json.dump({"device": device, "torch": torch.__version__, "argv": sys.argv[1:], "dtype": opts.dtype,
                   "tf32": opts.tf32, "layouts": opts.layouts, "interleaved": opts.interleaved,
                   "seconds": opts.seconds,
                   "rounds": opts.rounds, "sampler": sampler.available, "rows": rows}, f, indent=1)
    print(f"\nwrote {path}\n")
    for r in rows:
        base = r["contestants"]["cuBLAS"]
        print(f"{r['size']}{'^3' if isinstance(r['size'], int) else ''}: {'contestant':>70} {'ms':>7} {'TF/s':>6} {'x':>6} {'MHz':>6} {'W':>6} {'Mcyc':>7}")
        for name, e in r["contestants"].items():
            cyc = f"{e['mcycles']:7.2f}" if e["mcycles"] else "      -"
            print(f"{'':>8}{name[-70:]:>70} {e['ms']:7.3f} {e['tflops']:6.1f} {base['ms'] / e['ms']:6.3f} "
                  f"{e['sm_mhz'] or 0:6.0f} {e['watts'] or 0:6.0f} {cyc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
