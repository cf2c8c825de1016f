"""One row-group softmax launch at a time, for Nsight Compute: the in-kernel duration of a lone
1x1M bf16 row (one wave) and of 32x1M (four waves), three launches each.

    ncu --metrics gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,\
launch__registers_per_thread,sm__warps_active.avg.pct_of_peak_sustained_active \
-k regex:rowgroup python3 benchmarks/softmax_rowgroup_ncu.py

(results/ncu-rowgroup-<device>-s24.txt.)
"""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import kernel_api  # noqa: E402
from kernel_api import SoftmaxArguments  # noqa: E402
from kernel_api.providers.cuda_src.kernels import softmax_rowgroup as rg  # noqa: E402

for rows, cols in ((1, 2**20), (32, 2**20)):
    x = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16)
    args = SoftmaxArguments(x, torch.empty_like(x))
    kernel = next(k for k in kernel_api.get_kernels(args) if isinstance(k, rg._RowGroupBase))
    artifact = kernel.compile(args)
    for _ in range(3):
        kernel.run(args, compiled_artifact=artifact)
    torch.cuda.synchronize()
