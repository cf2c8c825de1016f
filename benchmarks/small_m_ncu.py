"""Small-M GEMM launches for Nsight Compute, and the cluster residency of every instance:
why the M = 64 / 128 instances of `CudaGemmSmallM` run at half the speed of M = 16 on the
same B (benchmarks/NOTES-small-m.md).

    python3 benchmarks/small_m_ncu.py --occupancy          # CTAs per SM and clusters counted on, per instance
    ncu --clock-control none --section SpeedOfLight --section WarpStateStats --section Occupancy \
--section LaunchStats --section MemoryWorkloadAnalysis \
python3 benchmarks/small_m_ncu.py --cases 16x4096x4096:4 64x4096x4096:4 64x4096x4096:8

Each case ``MxNxK:split`` (bf16, B column-major as nn.Linear) runs once untimed and once more,
then cuBLAS (torch.matmul) on the same operands once, and its output is checked against
cuBLAS's. Under ncu, filter with ``--kernel-name regex:gemm_small_m|gemm`` as needed.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from small_m import instance  # noqa: E402
from kernel_api.arguments import GemmArguments  # noqa: E402
from kernel_api.providers.cuda_src.kernels.gemm_small_m import CLUSTER, CONFIGS  # noqa: E402


def parse_case(text: str) -> tuple[int, int, int, int]:
    shape, _, split = text.partition(":")
    m, n, k = (int(v) for v in shape.split("x"))
    return m, n, k, int(split or 0)


def occupancy() -> None:
    """Per instance: CTAs per SM (the plan's and the driver's) and the clusters of 8 the split
    rule counts on (`max_clusters`); ncu's Occupancy section ("Max Active Clusters") gives the
    driver's number for the launched grid."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for mp in CONFIGS:
        kernel = instance("bf16", "col", mp)
        A = torch.randn(mp, 4096, device="cuda", dtype=torch.bfloat16)
        W = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
        args = GemmArguments(A, W.t(), torch.empty(mp, 4096, device="cuda", dtype=torch.bfloat16))
        artifact = kernel.compile(args)
        kernel.run(args, compiled_artifact=artifact)  # loads the cubin
        c = kernel.config
        per_sm = artifact.compiled_obj.kernel.occupancy.max_active_blocks_per_multiprocessor(c.threads, c.smem_bytes)
        print(f"MP={mp:3d} threads={c.threads} smem={c.smem_bytes} planned CTAs/SM={c.ctas_per_sm} "
              f"driver CTAs/SM={per_sm}; clusters of {CLUSTER} the split rule counts on: "
              f"{kernel.max_clusters(sms)} (without packing loss {per_sm * sms // CLUSTER})", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", nargs="*", type=parse_case, default=[])
    p.add_argument("--occupancy", action="store_true")
    opts = p.parse_args()
    if opts.occupancy:
        occupancy()
    for m, n, k, split in opts.cases:
        kernel = instance("bf16", "col", m)
        kernel.split_k = split or None
        A = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        W = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        out, ref = torch.empty(m, n, device="cuda", dtype=torch.bfloat16), torch.empty(m, n, device="cuda",
                                                                                      dtype=torch.bfloat16)
        args = GemmArguments(A, W.t(), out)
        artifact = kernel.compile(args)
        for _ in range(2):
            kernel.run(args, compiled_artifact=artifact)
        torch.matmul(A, W.t(), out=ref)
        torch.cuda.synchronize()
        err = float((out.double() - ref.double()).abs().max() / ref.double().abs().max())
        print(f"{m}x{n}x{k} split {kernel.split_for(m, n, k, 1)}: {kernel.metadata.kernel_name} "
              f"max |ours - cuBLAS| / max |cuBLAS| = {err:.1e}", flush=True)


if __name__ == "__main__":
    main()
