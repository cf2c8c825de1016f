"""One bf16 64x4096x4096 product (B column-major, as nn.Linear) by the Sm90 split_all 64x128
instance (twice), the data-parallel 64x128 2x1 instance and cuBLAS, for Nsight Compute:

    ncu --clock-control none --section SpeedOfLight --section LaunchStats --section Occupancy \
--section WarpStateStats --section MemoryWorkloadAnalysis python3 benchmarks/split_all_ncu.py

(benchmarks/NOTES-small-m.md, session 27: where split_all's fixed cost goes.)
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch, kernel_api
from kernel_api import GemmArguments
M, N, K = 64, 4096, 4096
A = torch.randn(M, K, device="cuda").to(torch.bfloat16)
W = torch.randn(N, K, device="cuda").to(torch.bfloat16)
out = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
args = GemmArguments(A, W.t(), out)
ks = {k.metadata.kernel_name: k for k in kernel_api.get_kernels(args)}
split = next(k for n, k in ks.items() if "tile64x128x64_cluster1x1_pingpong_splitall" in n)
dp = next(k for n, k in ks.items() if "tile64x128x64_cluster2x1_pingpong_swz1m" in n)
ws = torch.empty(split.get_workspace_size(args), dtype=torch.uint8, device="cuda")
for k in (split, dp):
    k.compile(args)
for _ in range(2):
    split.run(args, workspace=ws)
torch.cuda.synchronize()
dp.run(args)
torch.matmul(A, W.t(), out=out)
torch.cuda.synchronize()
print("done")
