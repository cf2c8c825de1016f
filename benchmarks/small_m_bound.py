"""The ceiling of issue #16's goal 2 (small-M GEMMs at 1.2x cuBLAS): a GEMM with M of 1-16 must
read all of B, so its time is at least B's bytes over the GPU's read rate. This measures that read
rate (a streaming read kernel that folds every 16-byte vector, no writes) and cuBLAS's effective
rate on B (``torch.matmul``, M = 1 and 16) in the same process, and prints the most any kernel
could gain on cuBLAS per shape: read rate / cuBLAS's rate.

    python3 benchmarks/small_m_bound.py [--repeats 3] [--iters 30] [--tag TAG]

Read rate: median TB/s over ``--repeats`` runs of ``--iters`` launches each, buffers of 256 MB in
all in turn (each out of L2 when it comes back), for 64-512 MiB and the B sizes of the shapes;
cuBLAS: `time_cuda_pair` against the read kernel on buffers of B's size (not B itself), as many
(A, B) sets. bf16, B row-major [K, N] (``row`` layout of
small_m.py). JSON: benchmarks/results/small-m-bound-<device>[-tag].json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from kernel_api.core.streams import stream_handle  # noqa: E402
from kernel_api.nvrtc.compiler import compile_cuda  # noqa: E402
from kernel_api.nvrtc.launcher import CudaLauncher  # noqa: E402
from kernel_api.tuning.timing import time_cuda_pair  # noqa: E402
from results_io import result_name, write_result_with_text  # noqa: E402

SOURCE = r"""
// Reads n 16-byte vectors, UNROLL loads in flight per thread and iteration, folding them into one
// word that is stored only when it equals a value no random input makes (so no load is dropped).
template <int UNROLL>
__global__ void __launch_bounds__(256) read_fold(const uint4* __restrict__ p, long long n, unsigned* sink) {
  const long long stride = (long long)gridDim.x * blockDim.x * UNROLL;
  unsigned acc = 0;
  for (long long i = (long long)blockIdx.x * blockDim.x * UNROLL + threadIdx.x; i < n; i += stride) {
    uint4 v[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const long long k = i + (long long)u * blockDim.x;
      v[u] = k < n ? __ldcs(p + k) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
  }
  if (acc == 0x9E3779B9u && threadIdx.x == 1023) sink[0] = acc;
}
"""
UNROLLS = (4, 8)
SHAPES = [(n, k) for n in (4096, 8192, 14336) for k in (4096, 8192, 14336)]


class Reader:
    """The read kernel at its best unroll and grid for this device."""

    def __init__(self, device: int) -> None:
        cc = torch.cuda.get_device_capability(device)
        compiled = compile_cuda(SOURCE, cc=cc, name_expressions=[f"read_fold<{u}>" for u in UNROLLS],
                                source_name="small_m_bound.cu")
        self.launchers = {u: CudaLauncher(compiled, f"read_fold<{u}>", f"read_fold<{u}>") for u in UNROLLS}
        self.sms = torch.cuda.get_device_properties(device).multi_processor_count
        self.sink = torch.zeros(1, dtype=torch.int32, device="cuda")
        self.stream = stream_handle(torch.cuda.current_stream(), device)
        self.device = device

    def run(self, buf: torch.Tensor, unroll: int, ctas_per_sm: int) -> None:
        self.launchers[unroll].launch(self.stream, self.device, self.sms * ctas_per_sm, 256, 0,
                                      (buf.data_ptr(), buf.numel() * buf.element_size() // 16, self.sink.data_ptr()))


def buffer_sets(nbytes: int) -> int:
    """Buffers to rotate so that a set is out of L2 when its turn comes back (256 MB in all)."""
    return max(2, -(-(256 << 20) // nbytes))


def read_buffers(nbytes: int) -> list[torch.Tensor]:
    return [torch.randint(-2**31, 2**31 - 1, (nbytes // 4,), dtype=torch.int32, device="cuda")
            for _ in range(buffer_sets(nbytes))]


def read_rate(reader: Reader, nbytes: int, iters: int, repeats: int) -> dict:
    """The best (unroll, CTAs per SM) of the read kernel on ``nbytes``: its median TB/s and runs."""
    bufs = read_buffers(nbytes)
    best = None
    for unroll in UNROLLS:
        for per_sm in (4, 8, 16):
            runs = []
            for _ in range(repeats):
                _, ms = time_cuda_pair(lambda i: None, lambda i: reader.run(bufs[i], unroll, per_sm),
                                       sets=len(bufs), repeat=iters)
                runs.append(nbytes / (ms * 1e-3) / 1e12)
            point = {"unroll": unroll, "ctas_per_sm": per_sm, "tbs_runs": runs, "tbs": statistics.median(runs)}
            if best is None or point["tbs"] > best["tbs"]:
                best = point
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tag", default="")
    opts = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("small_m_bound.py needs a CUDA GPU")
    device = torch.cuda.current_device()
    reader = Reader(device)
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "read": [], "shapes": []}
    lines = [f"Read rate and cuBLAS's rate on B, bf16 row-major B ({report['device']})"]
    for mib in (64, 128, 256, 512):
        r = read_rate(reader, mib << 20, opts.iters, opts.repeats)
        report["read"].append({"mbytes": mib, **r})
        lines.append(f"read {mib:4d} MiB: {r['tbs']:.2f} TB/s [{min(r['tbs_runs']):.2f}-{max(r['tbs_runs']):.2f}] "
                     f"(unroll {r['unroll']}, {r['ctas_per_sm']} CTAs/SM)")
        print(lines[-1], flush=True)
    lines.append(f"{'N x K':>13} {'B MB':>6} {'read':>6} | {'M':>3} {'cuBLAS us':>9} {'TB/s':>5} {'ceiling':>8}")
    for n, k in SHAPES:
        nbytes = n * k * 2
        r = read_rate(reader, nbytes, opts.iters, opts.repeats)
        entry = {"N": n, "K": k, "b_bytes": nbytes, "read": r, "cublas": []}
        reads = read_buffers(nbytes)  # (not B: the read right after a GEMM on the same B would hit L2)
        for m in (1, 16):
            sets = [(torch.randn(m, k, device="cuda", dtype=torch.bfloat16),
                     torch.randn(k, n, device="cuda", dtype=torch.bfloat16)) for _ in range(len(reads))]
            outs = [torch.empty(m, n, device="cuda", dtype=torch.bfloat16) for _ in range(len(reads))]
            runs = [time_cuda_pair(lambda i: torch.matmul(sets[i][0], sets[i][1], out=outs[i]),
                                   lambda i: reader.run(reads[i], r["unroll"], r["ctas_per_sm"]), sets=len(reads),
                                   repeat=opts.iters) for _ in range(opts.repeats)]
            cublas_us = statistics.median(c for c, _ in runs) * 1e3
            read_us = statistics.median(t for _, t in runs) * 1e3
            rate = nbytes / (cublas_us * 1e-6) / 1e12
            entry["cublas"].append({"M": m, "us": cublas_us, "tbs": rate, "read_us_same_run": read_us,
                                    "ceiling": cublas_us / read_us})
            lines.append(f"{n:>6} x {k:<6} {nbytes / 1e6:6.0f} {r['tbs']:6.2f} | {m:3d} {cublas_us:9.1f} {rate:5.2f} "
                         f"{cublas_us / read_us:7.2f}x")
            print(lines[-1], flush=True)
        report["shapes"].append(entry)
    lines.append("ceiling: cuBLAS's time / the read kernel's time on B's bytes in the same run (the most any "
                 "kernel that reads B once can gain)")
    for path in write_result_with_text(result_name("small-m-bound", report["device"], opts.tag), report, lines):
        print("wrote", path)


if __name__ == "__main__":
    main()
