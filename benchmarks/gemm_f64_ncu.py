"""One f64 GEMM launch of ours and one of cuBLAS DGEMM at 2048^3, for Nsight Compute: what
limits the FP64 tensor-core kernel (issue #16 goal 4, benchmarks/NOTES-f64.md "Next", item 2).

    ncu --clock-control none --section SpeedOfLight --section ComputeWorkloadAnalysis \
--section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis \
--section Occupancy --section LaunchStats --launch-skip 2 --launch-count 2 \
python3 benchmarks/gemm_f64_ncu.py [--candidate 128x128x16_w2x4_s3_k16] [--size 2048]

The script launches ours, then cuBLAS, twice each, after one untimed pair: with
``--launch-skip 2 --launch-count 2`` ncu profiles the second pair (both kernels warm).
cuBLAS's kernel name in the report names its design (tile, stages).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

from gemm_f64 import make_kernel, parse_candidate  # noqa: E402
from kernel_api.arguments import GemmArguments  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--candidate", type=parse_candidate, default=parse_candidate("128x128x16_w2x4_s3_k16"))
    p.add_argument("--size", type=int, default=2048)
    opts = p.parse_args()
    n = opts.size
    A = torch.randn(n, n, device="cuda", dtype=torch.float64)
    B = torch.randn(n, n, device="cuda", dtype=torch.float64)
    out, ref = torch.empty_like(A), torch.empty_like(A)
    args = GemmArguments(A, B, out, accumulator_type=torch.float64)
    kernel = make_kernel(*opts.candidate)
    artifact = kernel.compile(args)
    for _ in range(2):  # an untimed pair, then the profiled one
        kernel.run(args, compiled_artifact=artifact)
        torch.matmul(A, B, out=ref)
    torch.cuda.synchronize()
    err = float((out - ref).abs().max() / ref.abs().max())
    print(f"{kernel.metadata.kernel_name}: max |ours - cuBLAS| / max |cuBLAS| = {err:.2e}")


if __name__ == "__main__":
    main()
