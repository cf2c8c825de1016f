"""Small-M GEMM (decode and prefill tails): CudaGemmSmallM and ops.gemm (PickAny) against torch.matmul.

    python3 benchmarks/small_m.py --quick            # 4 (N, K) x 5 M, B column-major (x @ W.t())
    python3 benchmarks/small_m.py --check            # correctness sweep first, then the full benchmark
    python3 benchmarks/small_m.py [--dtype bf16,f16] [--layouts col,row] [--sweeps 3] [--repeat 40] [--tag run1]

Shapes: M in {1, 8, 16, 64, 128} x N, K in {4096, 8192, 14336} (``--quick``: (N, K) in (4096, 4096),
(8192, 8192), (14336, 4096), (4096, 14336)). ``col``: B = W.t() for a row-major W[N, K], as
nn.Linear computes ``x @ W.t()`` (the decode case); ``row``: B is a row-major K x N matrix.

How it times (see benchmarks/NOTES-small-m.md):
- Contestants run in ALTERNATING order in one process (kernel, ops.gemm, torch, and the kernel at
  every forced split-K count), shuffled each repetition, each launch between its own CUDA events.
- A sleep kernel is queued first so the host enqueues the whole group ahead of the GPU: the events
  then time the kernels back to back, not the host's launch latency (these kernels last 8-120 us).
- Every launch reads another input set; the sets of B together exceed 256 MB (the H200's L2 is
  50-60 MB), so B always comes from HBM. Inputs are fresh random data (never zeros).
- Median of ``--repeat`` launches per contestant; the whole sweep is repeated ``--sweeps`` times and
  the spread across sweeps is reported. Before timing, every contestant's output is checked
  against torch's in float64.

Prints one table per (dtype, layout) last; JSON goes to benchmarks/results/small_m-<device>-<tag>.json
(and to $OUT when that folder exists).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import random
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import kernel_api  # noqa: E402
from kernel_api import GemmArguments  # noqa: E402
from kernel_api.providers.cuda_src.kernels.gemm_small_m import (CLUSTER, MIN_M, SPLITS, CudaGemmSmallM,  # noqa: E402
                                                                 SmallMConfig)

M_VALUES = (1, 8, 16, 64, 128)
NK_FULL = [(n, k) for n in (4096, 8192, 14336) for k in (4096, 8192, 14336)]
NK_QUICK = [(4096, 4096), (8192, 8192), (14336, 4096), (4096, 14336)]
DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16}
ROTATE_BYTES = 256 << 20


def instance(dtype: str, layout: str, M: int) -> CudaGemmSmallM:
    found = [k for k in CudaGemmSmallM.generate_kernels(None, cc=90)
             if k.dtype.name == dtype and k.b_kmajor == (layout == "col") and MIN_M[k.config.mp] <= M <= k.config.mp]
    assert len(found) == 1
    return found[0]


def copy_rate() -> float:
    """Device-to-device copy of 1 GiB, bytes read + written, TB/s (median of 10)."""
    n = 2**29
    src, dst = torch.randn(n, device="cuda", dtype=torch.bfloat16), torch.empty(n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(10):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    del src, dst
    return 2 * n * 2 / (statistics.median(times) * 1e-3) / 1e12


_cycles_per_ms: list[float] = []


def sleep_ms(ms: float) -> None:
    """Queue a GPU busy-wait of about ``ms`` milliseconds on the current stream."""
    if not _cycles_per_ms:
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(1000)
        a.record()
        torch.cuda._sleep(2_000_000)
        b.record()
        torch.cuda.synchronize()
        _cycles_per_ms.append(2_000_000 / max(a.elapsed_time(b), 1e-3))
    torch.cuda._sleep(int(ms * _cycles_per_ms[0]))


def time_group(fns: dict, repeat: int, sustained_ms: float = 0.0) -> tuple[dict[str, float], bool]:
    """Median ms of each ``fns[name](launch_index)``, launched alternately (order shuffled each
    repetition, seeded) behind a sleep kernel, every launch between its own events. Also returns
    whether the host may still have fallen behind the GPU (then launch gaps are in the times).

    ``sustained_ms``: instead of the sleep kernel (an idle GPU, whose power state lets the first
    ~50 ms of work run at the top clock), untimed shuffled rounds of the same launches, at least
    this many ms of GPU work, so the timed rounds run in the power state of back-to-back work
    (on an H200, tf32 4096^3 GEMMs ran 17 % slower after ~100 ms of it: NOTES-sm90.md, session 33).

    The order is shuffled, not rotated: rotated, each contestant always followed the same one,
    and what ran before showed in the time (session 29: the same kernel in two slots of one
    group measured 33.5 and 36.4 us, results/small_m-NVIDIA_H200-s29-clusters-after.json)."""
    names = list(fns)
    rng = random.Random(len(names) * 1000003 + repeat)
    counter = 0
    start = time.perf_counter()
    for _ in range(2):
        for name in names:
            fns[name](counter)
            counter += 1
    torch.cuda.synchronize()
    per_launch_ms = (time.perf_counter() - start) * 1e3 / (2 * len(names))  # host + GPU: an upper bound
    budget = min(200.0, 1.5 * per_launch_ms * repeat * len(names) + 2.0)
    behind = True
    for _attempt in range(3):
        events = [[torch.cuda.Event(enable_timing=True) for _ in range(len(names) + 1)] for _ in range(repeat)]
        if sustained_ms > 0:
            # per_launch_ms (host + GPU) bounds a launch's GPU time from above: queue rounds for at
            # least the head start and the sustained span at half that rate
            rounds = max(1, math.ceil(2 * max(budget, sustained_ms) / (per_launch_ms * len(names))))
            for _ in range(rounds):
                order = names[:]
                rng.shuffle(order)
                for name in order:
                    fns[name](counter)
                    counter += 1
            head_done = torch.cuda.Event()
            head_done.record()
        else:
            sleep_ms(budget)
        start = time.perf_counter()
        orders = []
        for r in range(repeat):
            order = names[:]
            rng.shuffle(order)
            orders.append(order)
            ev = events[r]
            ev[0].record()
            for j, name in enumerate(order):
                fns[name](counter)
                counter += 1
                ev[j + 1].record()
        host_ms = (time.perf_counter() - start) * 1e3
        # sustained: gaps were possible only if the GPU ran out of untimed rounds before the last
        # timed launch was queued
        behind = head_done.query() if sustained_ms > 0 else host_ms > 0.9 * budget
        torch.cuda.synchronize()
        if not behind or budget >= 200.0:
            break
        budget = min(200.0, 2 * host_ms + 2.0)  # the host fell behind the queue: sleep longer, redo
    samples: dict[str, list[float]] = {n: [] for n in names}
    for r, order in enumerate(orders):
        for j, name in enumerate(order):
            samples[name].append(events[r][j].elapsed_time(events[r][j + 1]))
    return {n: statistics.median(v) for n, v in samples.items()}, behind


def time_own_state(fns: dict, repeat: int, settle_ms: float, seed: int = 0) -> dict[str, float]:
    """Median ms of each ``fns[name](launch_index)``, each contestant timed in its own power state.

    `time_group` times the contestants' launches interleaved, so all of them run at the clock their
    mix sets. Under the power cap a kernel that draws less runs at a higher clock when it runs on
    its own (f64 at 8192^3: our 128x128 tile at 1725 MHz, cuBLAS DGEMM at 1635, both at the cap;
    NOTES-f64.md, session 40). Here, in a shuffled order, each contestant first runs ``settle_ms``
    of GPU time of its own back-to-back launches untimed, then ``repeat`` more, each between its
    own CUDA events. Meant for problems of 0.1 ms and more: shorter launches leave the GPU waiting
    on the host, whose gaps let the clock rise."""
    names = list(fns)
    random.Random(seed * 1000003 + len(names)).shuffle(names)
    counter = 0
    out = {}
    for name in names:
        fn = fns[name]
        probe = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
        fn(counter)
        counter += 1
        probe[0].record()
        fn(counter)
        counter += 1
        probe[1].record()
        probe[1].synchronize()
        launches = max(1, min(100000, math.ceil(settle_ms / max(probe[0].elapsed_time(probe[1]), 1e-3))))
        for _ in range(launches):
            fn(counter)
            counter += 1
        events = [torch.cuda.Event(enable_timing=True) for _ in range(repeat + 1)]
        events[0].record()
        for r in range(repeat):
            fn(counter)
            counter += 1
            events[r + 1].record()
        events[-1].synchronize()
        out[name] = statistics.median(events[r].elapsed_time(events[r + 1]) for r in range(repeat))
    return out


class Shape:
    """Input sets for one (dtype, layout, N, K): B rotated over >= 256 MB; A and out per M."""

    def __init__(self, dtype: torch.dtype, layout: str, N: int, K: int) -> None:
        self.dtype, self.layout, self.N, self.K = dtype, layout, N, K
        self.b_bytes = 2 * N * K
        self.sets = max(2, -(-ROTATE_BYTES // self.b_bytes))
        if layout == "col":
            self.Bs = [torch.randn(N, K, device="cuda", dtype=dtype).t() for _ in range(self.sets)]
        else:
            self.Bs = [torch.randn(K, N, device="cuda", dtype=dtype) for _ in range(self.sets)]

    def for_m(self, M: int) -> tuple[list, list, list]:
        As = [torch.randn(M, self.K, device="cuda", dtype=self.dtype) for _ in range(self.sets)]
        outs = [torch.empty(M, self.N, device="cuda", dtype=self.dtype) for _ in range(self.sets)]
        args = [GemmArguments(a, b, o) for a, b, o in zip(As, self.Bs, outs)]
        return As, outs, args


def check_output(out: torch.Tensor, A: torch.Tensor, B: torch.Tensor, what: str) -> float:
    ref = A.double() @ B.double()
    err = ((out.double() - ref).norm() / ref.norm()).item()
    if not err <= 1e-2 or not torch.isfinite(out).all():
        raise AssertionError(f"{what}: relative error {err:.3e} against float64")
    return err


def bench_shape(shape: Shape, M: int, kernel: CudaGemmSmallM, artifact, repeat: int, splits: bool,
                use_ops: bool, check: bool) -> dict:
    """Times (ms) of every contestant on one shape, outputs checked first when ``check``."""
    As, outs, args = shape.for_m(M)
    torch_outs = [torch.empty_like(o) for o in outs]
    ops_outs = [torch.empty_like(o) for o in outs]
    sets = shape.sets
    rec: dict = {"M": M, "N": shape.N, "K": shape.K, "sets": sets, "split": kernel.split_for(M, shape.N, shape.K, 1,
                                                                                          _sm_count())}
    pick = kernel_api.PickAny().choose(args[0], kernel_api.get_kernels(args[0]))
    rec["pickany"] = pick.metadata.kernel_name

    def run_kernel(i: int) -> None:
        kernel.run(args[i % sets], compiled_artifact=artifact, assume_supported_args=True)

    def run_torch(i: int) -> None:
        torch.matmul(As[i % sets], shape.Bs[i % sets], out=torch_outs[i % sets])

    def run_ops(i: int) -> None:
        kernel_api.ops.gemm(As[i % sets], shape.Bs[i % sets], out=ops_outs[i % sets])

    fns = {"kernel": run_kernel, "torch": run_torch}
    if use_ops:
        fns["ops"] = run_ops
    if splits:
        for s in SPLITS:
            def run_split(i: int, s: int = s) -> None:
                kernel.split_k = s
                try:
                    kernel.run(args[i % sets], compiled_artifact=artifact, assume_supported_args=True)
                finally:
                    kernel.split_k = None
            fns[f"split{s}"] = run_split
    # Each contestant's output against float64 (fail loudly: never time a wrong kernel).
    for name, fn in list(fns.items()) if check else ():
        target = {"kernel": outs, "torch": torch_outs, "ops": ops_outs}.get(name, outs)
        target[0].fill_(float("nan"))
        try:
            fn(0)
            torch.cuda.synchronize()
            check_output(target[0], As[0], shape.Bs[0], f"{name} M={M} N={shape.N} K={shape.K} {shape.layout}")
        except Exception as exc:
            if name != "ops":
                raise
            # ops.gemm may have chosen another family (compiled here): report it, time the rest.
            rec["ops_error"] = f"{type(exc).__name__}: {exc}"[:300]
            fns.pop("ops")
    rec["ms"], rec["host_bound"] = time_group(fns, repeat)
    return rec


_sms: list[int] = []


def _sm_count() -> int:
    if not _sms:
        _sms.append(torch.cuda.get_device_properties(0).multi_processor_count)
    return _sms[0]


def run_checks() -> None:
    """The GPU correctness sweep of tests/test_gemm_small_m.py, in this process; raises on failure."""
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    import test_gemm_small_m as t  # noqa: PLC0415

    start = time.perf_counter()
    n = 0
    for dt, layout, M, N, K, padded in t.gpu_cases():
        t.check_gemm(t.instance(dt, layout, M), M, N, K, padded=padded)
        n += 1
    for layout in ("col", "row"):
        for M, K, split in t.SPLIT_CASES:
            t.check_gemm(t.instance("bf16", layout, M), M, 520, K, split=split, repeat_identical=True)
            n += 1
        for dt in t.DTYPES:
            for M in (8, 100):
                t.check_gemm(t.instance(dt, layout, M), M, 1000, 1656, L=2, padded=True)
                n += 1
    print(f"check: {n} cases passed in {time.perf_counter() - start:.1f} s (float64 reference, sentinel buffers, "
          f"forced splits bit-identical twice)", flush=True)


# --explore: other tiles/pipelines per padded M (B column-major), each timed against the shipped config.
ALT_CONFIGS = {
    # (session 29: longer k per row piece, 512 bytes to 1 KB of each B row per stage, in case
    # DRAM row locality is what holds N = 8192 at 3.4 TB/s; session 27's 128x128, 64x64x8-stage
    # and 32-column alternatives were within 3 % or slower: results/small_m-NVIDIA_H200-s27-explore.json)
    8: [SmallMConfig(8, 64, 256, 3, 4, 1, 2), SmallMConfig(8, 64, 512, 3, 4, 1, 1), SmallMConfig(8, 32, 512, 2, 2, 1, 2),
        SmallMConfig(8, 32, 256, 3, 2, 1, 3)],
    16: [SmallMConfig(16, 64, 256, 4, 4, 1, 1), SmallMConfig(16, 64, 512, 2, 4, 1, 1),
         SmallMConfig(16, 32, 512, 2, 2, 1, 2), SmallMConfig(16, 32, 256, 3, 2, 1, 3)],
    # (8 warps per CTA: two per scheduler at 2 CTAs per SM, for the latency-bound M = 64 / 128; session 27)
    64: [SmallMConfig(64, 64, 128, 3, 2, 2, 2), SmallMConfig(64, 128, 64, 6, 2, 2, 1),
         SmallMConfig(64, 128, 64, 4, 4, 2, 2), SmallMConfig(64, 128, 64, 4, 2, 4, 2)],
    128: [SmallMConfig(128, 128, 64, 4, 2, 2, 1), SmallMConfig(128, 256, 64, 3, 4, 2, 1),
          SmallMConfig(128, 128, 64, 3, 4, 2, 2)],
}
EXPLORE_SHAPES = [(M, N, K) for M in (1, 16, 64, 128) for N, K in ((4096, 4096), (8192, 8192), (14336, 4096))]


def explore(repeat: int, ms: tuple[int, ...] | None = None) -> list[dict]:
    """Each alternative config against the shipped one and torch (alternating), bf16, B column-major;
    ``ms``: only these M of `EXPLORE_SHAPES`."""
    found = []
    shapes: dict = {}
    for M, N, K in EXPLORE_SHAPES:
        if ms and M not in ms:
            continue
        shape = shapes.get((N, K))
        if shape is None:
            shapes.clear()
            shape = shapes[(N, K)] = Shape(torch.bfloat16, "col", N, K)
        base = instance("bf16", "col", M)
        As, outs, args = shape.for_m(M)
        torch_outs = [torch.empty_like(o) for o in outs]
        base_art = base.compile(args[0])
        sets = shape.sets
        for alt in ALT_CONFIGS[base.config.mp]:
            rec = {"M": M, "N": N, "K": K, "config": vars(alt).copy(), "shipped": vars(base.config).copy()}
            try:
                k = copy.copy(base)  # same family and checks, another template instance
                k.config = alt
                art = k.compile(args[0])
                outs[0].fill_(float("nan"))
                k.run(args[0], compiled_artifact=art)
                torch.cuda.synchronize()
                check_output(outs[0], As[0], shape.Bs[0], f"explore {alt} M={M} N={N} K={K}")
                rec["split"] = k.split_for(M, N, K, 1, _sm_count())
                fns = {"alt": lambda i, k=k, art=art: k.run(args[i % sets], compiled_artifact=art,
                                                             assume_supported_args=True),
                       "shipped": lambda i: base.run(args[i % sets], compiled_artifact=base_art,
                                                     assume_supported_args=True),
                       "torch": lambda i: torch.matmul(As[i % sets], shape.Bs[i % sets], out=torch_outs[i % sets])}
                rec["ms"], rec["host_bound"] = time_group(fns, repeat)
                rec["alt_vs_shipped"] = rec["ms"]["shipped"] / rec["ms"]["alt"]
            except Exception as exc:  # report and go on: exploration must not stop the run
                rec["error"] = f"{type(exc).__name__}: {exc}"[:300]
            found.append(rec)
    shapes.clear()
    torch.cuda.empty_cache()
    return found


#: --explore-clusters' designs: (CTAs per cluster, split); clusters of 8 at split 2 is the
#: family's launch before session 29.
CLUSTER_VARIANTS = ((1, 1), (2, 2), (4, 4), (8, 2))


def _cluster_label(c: int, split: int) -> str:
    return f"c{c}" if c == split else f"c{c}s{split}"


def explore_clusters(repeat: int, ms: tuple[int, ...] | None = None) -> list[dict]:
    """The shipped configuration with clusters of c = 1, 2, 4 CTAs at split c and of 8 at split 2
    (`CLUSTER_VARIANTS`), against the shipped instance (its split; clusters of 8, of 2 at split 2
    since session 29) and torch,
    alternating; bf16, B column-major, M in ``ms`` (default 1, 16) x every (N, K) of `NK_FULL`
    (at M > 16 the instance gets a companion kernel for each cluster size timed)."""
    found = []
    for M, N, K in [(M, N, K) for N, K in NK_FULL for M in (ms or (1, 16))]:
        shape = Shape(torch.bfloat16, "col", N, K)
        base = instance("bf16", "col", M)
        As, outs, args = shape.for_m(M)
        torch_outs = [torch.empty_like(o) for o in outs]
        base_art = base.compile(args[0])
        sets, Bs = shape.sets, shape.Bs
        fns = {"shipped": lambda i: base.run(args[i % sets], compiled_artifact=base_art, assume_supported_args=True),
               "torch": lambda i: torch.matmul(As[i % sets], Bs[i % sets], out=torch_outs[i % sets])}
        rec = {"M": M, "N": N, "K": K, "shipped_split": base.split_for(M, N, K, 1, _sm_count())}
        for c, split in CLUSTER_VARIANTS:
            k = copy.copy(base)  # the same instance with a companion kernel for clusters of c
            k.cluster_sizes = lambda c=c: (CLUSTER, c)
            k.cluster, k.split_k = c, split
            art = k.compile(args[0])
            outs[0].fill_(float("nan"))
            k.run(args[0], compiled_artifact=art)
            torch.cuda.synchronize()
            check_output(outs[0], As[0], Bs[0], f"cluster {c} split {split} M={M} N={N} K={K}")
            fns[_cluster_label(c, split)] = lambda i, k=k, art=art: k.run(args[i % sets], compiled_artifact=art,
                                                                         assume_supported_args=True)
        rec["ms"], rec["host_bound"] = time_group(fns, repeat)
        found.append(rec)
        torch.cuda.empty_cache()
    return found


def geomean(xs: list[float]) -> float:
    xs = [x for x in xs if x and x > 0]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="4 (N, K) pairs, column-major B only")
    p.add_argument("--check", action="store_true", help="run the correctness sweep first (fails loudly)")
    p.add_argument("--check-only", action="store_true", help="only the correctness sweep")
    p.add_argument("--dtype", default="bf16", help="comma-separated: bf16,f16")
    p.add_argument("--layouts", default=None, help="comma-separated: col,row (default: col,row; --quick: col)")
    p.add_argument("--sweeps", type=int, default=3)
    p.add_argument("--repeat", type=int, default=40)
    p.add_argument("--no-splits", action="store_true", help="skip timing every forced split-K count")
    p.add_argument("--no-ops", action="store_true", help="skip ops.gemm (PickAny)")
    p.add_argument("--explore", action="store_true", help="also time alternative tiles/pipelines (bf16, col)")
    p.add_argument("--explore-m", default=None, help="comma-separated M of the explored shapes (default: all)")
    p.add_argument("--explore-only", action="store_true", help="skip the benchmark sweeps (explorations only)")
    p.add_argument("--explore-clusters", action="store_true",
                   help="also time the instances of --explore-m's M with other clusters (CLUSTER_VARIANTS)")
    p.add_argument("--tag", default="run")
    opts = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    device = torch.cuda.get_device_name()
    t0 = time.perf_counter()
    if opts.check or opts.check_only:
        run_checks()
        if opts.check_only:
            return
    dtypes = opts.dtype.split(",")
    layouts = (opts.layouts or ("col" if opts.quick else "col,row")).split(",")
    nks = NK_QUICK if opts.quick else NK_FULL
    # Compile every instance needed, up front (NVRTC, cached on disk and in this process).
    compiled = {}
    ct = time.perf_counter()
    for dt in dtypes:
        for layout in layouts:
            for M in M_VALUES:
                k = instance(dt, layout, M)
                A = torch.randn(M, 64, device="cuda", dtype=DTYPES[dt])
                B = torch.randn(64, 64, device="cuda", dtype=DTYPES[dt])
                B = B.t() if layout == "col" else B
                compiled[(dt, layout, M)] = (k, k.compile(GemmArguments(A, B, torch.empty(M, 64, device="cuda",
                                                                                        dtype=DTYPES[dt]))))
    compile_s = time.perf_counter() - ct
    bw = copy_rate()
    print(f"{device}: copy {bw:.2f} TB/s (read+write); compiled {len(compiled)} instances in {compile_s:.1f} s",
          flush=True)
    records = {}
    for sweep in range(0 if opts.explore_only else opts.sweeps):
        for dt in dtypes:
            for layout in layouts:
                for N, K in nks:
                    shape = Shape(DTYPES[dt], layout, N, K)
                    for M in M_VALUES:
                        k, art = compiled[(dt, layout, M)]
                        key = (dt, layout, M, N, K)
                        rec = bench_shape(shape, M, k, art, opts.repeat, splits=not opts.no_splits,
                                          use_ops=not opts.no_ops and "ops_error" not in records.get(key, {}),
                                          check=sweep == 0)
                        if key not in records:
                            records[key] = {k2: v for k2, v in rec.items() if k2 not in ("ms", "host_bound")}
                            records[key].update(dtype=dt, layout=layout, sweeps=[])
                        records[key]["sweeps"].append(rec["ms"])
                        records[key]["host_bound"] = records[key].get("host_bound", False) or rec["host_bound"]
                        if "ops_error" in rec:
                            records[key]["ops_error"] = rec["ops_error"]
                    del shape
                    torch.cuda.empty_cache()
        print(f"sweep {sweep + 1}/{opts.sweeps} done at {time.perf_counter() - t0:.0f} s", flush=True)
    explore_ms = tuple(int(m) for m in opts.explore_m.split(",")) if opts.explore_m else None
    explored = explore(opts.repeat, explore_ms) if opts.explore else []
    clusters = explore_clusters(opts.repeat, explore_ms) if opts.explore_clusters else []
    # Summaries.
    rows = []
    for key, rec in records.items():
        dt, layout, M, N, K = key
        b_bytes = 2 * N * K
        med = {name: statistics.median(s[name] for s in rec["sweeps"]) for name in rec["sweeps"][-1]}
        rec["median_ms"] = med
        ratio = [s["torch"] / s["kernel"] for s in rec["sweeps"]]
        rec["speedup_vs_torch"] = {"median": statistics.median(ratio), "min": min(ratio), "max": max(ratio)}
        rec["kernel_TBps"] = b_bytes / (med["kernel"] * 1e-3) / 1e12
        rec["torch_TBps"] = b_bytes / (med["torch"] * 1e-3) / 1e12
        if "ops" in med:
            rec["ops_speedup_vs_torch"] = med["torch"] / med["ops"]
        splits = {s: med[f"split{s}"] for s in SPLITS if f"split{s}" in med}
        if splits:
            best = min(splits, key=splits.get)
            rec["best_split"] = best
            rec["heuristic_vs_best_split"] = med[f"split{rec['split']}"] / splits[best]
        rows.append(rec)
    summary = {}
    for dt in dtypes:
        for layout in layouts:
            sel = [r for r in rows if r["dtype"] == dt and r["layout"] == layout]
            if not sel:
                continue
            summary[f"{dt}_{layout}"] = {
                "geomean_speedup_kernel": geomean([r["speedup_vs_torch"]["median"] for r in sel]),
                "geomean_speedup_ops": geomean([r.get("ops_speedup_vs_torch", 0) for r in sel]),
                "min_speedup_kernel": min(r["speedup_vs_torch"]["median"] for r in sel),
                "shapes_at_1.2x": sum(r["speedup_vs_torch"]["median"] >= 1.2 for r in sel),
                "shapes_at_3.5TBps": sum(r["kernel_TBps"] >= 3.5 for r in sel), "shapes": len(sel),
                "geomean_sweep_spread": geomean([r["speedup_vs_torch"]["max"] / r["speedup_vs_torch"]["min"]
                                                 for r in sel]),
            }
    result = {"device": device, "torch": torch.__version__, "sm_count": _sm_count(), "copy_TBps": bw,
              "compile_seconds": compile_s, "options": vars(opts), "timing": "alternating launches behind a sleep "
              "kernel, CUDA events per launch, median of repeat per sweep, median over sweeps",
              "summary": summary, "shapes": rows, "explore": explored, "explore_clusters": clusters,
              "seconds": time.perf_counter() - t0}
    os.makedirs(os.path.join(ROOT, "benchmarks", "results"), exist_ok=True)
    name = f"small_m-{device.replace(' ', '_')}-{opts.tag}.json"
    paths = [os.path.join(ROOT, "benchmarks", "results", name)]
    if os.environ.get("OUT") and os.path.isdir(os.environ["OUT"]):
        paths.append(os.path.join(os.environ["OUT"], name))
    for path in paths:
        with open(path, "w") as f:
            json.dump(result, f, indent=1, default=str)
    if explored:
        print("\nexplore (bf16, B column-major): alternative config vs shipped, alternating; >1 = alternative faster")
        for r in explored:
            c = r["config"]
            tag = f"bn{c['bn']} bk{c['bk']} st{c['stages']} w{c['wn']}x{c['wm']}"
            res = (f"{r['alt_vs_shipped']:5.2f}  ({r['ms']['alt'] * 1e3:7.1f} us vs {r['ms']['shipped'] * 1e3:7.1f}, "
                   f"torch {r['ms']['torch'] * 1e3:7.1f}; split {r['split']})" if "error" not in r else r["error"][:80])
            print(f"{r['M']:>4} {r['N']:>6} {r['K']:>6}  {tag:<24} {res}")
    if clusters:
        print("\nclusters (bf16, B column-major): us, alternating; c<n>: clusters of n CTAs at split n, "
              "c<n>s<k>: at split k")
        for r in clusters:
            t = r["ms"]
            print(f"{r['M']:>4} {r['N']:>6} {r['K']:>6}  shipped {t['shipped'] * 1e3:6.1f} (split {r['shipped_split']})  "
                  + "  ".join(f"{_cluster_label(c, s)} {t[_cluster_label(c, s)] * 1e3:6.1f}"
                              for c, s in CLUSTER_VARIANTS if _cluster_label(c, s) in t)
                  + f"  torch {t['torch'] * 1e3:6.1f}")
    # The tables, last (B column-major, the decode case, at the very end).
    for dt in dtypes:
        for layout in sorted(layouts, key=lambda x: x == "col"):
            sel = [r for r in rows if r["dtype"] == dt and r["layout"] == layout]
            if not sel:
                continue
            what = "x @ W.t(), B column-major" if layout == "col" else "A @ B, B row-major"
            print(f"\n{dt} {layout} ({what}); us = median over {opts.sweeps} sweeps of medians of {opts.repeat}; "
                  f"speed-up = torch / ours [sweep min-max]")
            print(f"{'M':>4} {'N':>6} {'K':>6} | {'kern us':>8} {'TB/s':>5} {'x torch':>17} | {'ops us':>8} "
                  f"{'x':>5} | {'torch us':>8} {'TB/s':>5} | sp best hx  pick")
            for r in sel:
                med, sp = r["median_ms"], r["speedup_vs_torch"]
                ops = f"{med['ops'] * 1e3:8.1f} {r['ops_speedup_vs_torch']:5.2f}" if "ops" in med else f"{'-':>8} {'-':>5}"
                pick = "small_m" if r["pickany"].startswith("CudaGemmSmallM") else r["pickany"][:14]
                splits = (f"{r['split']:>2} {r.get('best_split', '-'):>4} {r.get('heuristic_vs_best_split', 1):4.2f}"
                          if "best_split" in r else f"{r['split']:>2}")
                print(f"{r['M']:>4} {r['N']:>6} {r['K']:>6} | {med['kernel'] * 1e3:8.1f} {r['kernel_TBps']:5.2f} "
                      f"{sp['median']:5.2f} [{sp['min']:4.2f}-{sp['max']:4.2f}] | {ops} | {med['torch'] * 1e3:8.1f} "
                      f"{r['torch_TBps']:5.2f} | {splits}  {pick}")
            s = summary[f"{dt}_{layout}"]
            print(f"geomean x torch: kernel {s['geomean_speedup_kernel']:.3f} (min {s['min_speedup_kernel']:.2f}), "
                  f"ops {s['geomean_speedup_ops']:.3f}; >= 1.2x on {s['shapes_at_1.2x']}/{s['shapes']}; "
                  f">= 3.5 TB/s on {s['shapes_at_3.5TBps']}/{s['shapes']}; sweep spread {s['geomean_sweep_spread']:.3f}")
    print(f"\n{device}, copy {bw:.2f} TB/s; JSON: {paths[0]}; {time.perf_counter() - t0:.0f} s total")


if __name__ == "__main__":
    main()
