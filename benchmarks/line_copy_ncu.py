"""The realigned GEMM's line copy alone, for Nsight Compute: bf16 operands into padded copies,
three launches each of 4097x4097 (8 KB lines, launches 0-2), 4096x50257 (100 KB lines, 3-5) and
8192x8193 (16 KB lines, 6-8):

    ncu --kernel-name regex:line_copy --launch-skip 2 --launch-count 1 --section SpeedOfLight \
--section MemoryWorkloadAnalysis --section Occupancy --section WarpStateStats \
--section SchedulerStats python3 benchmarks/line_copy_ncu.py

(--launch-skip 5 for the 100 KB lines, 8 for the 16 KB ones; benchmarks/NOTES-realign.md.)
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

from kernel_api.providers.cutedsl.gemm.implementations.line_copy import copy_lines  # noqa: E402

stream = torch.cuda.current_stream().cuda_stream
for rows, cols in ((4097, 4097), (4096, 50257), (8192, 8192 + 1)):
    src = torch.randn(rows, cols, device="cuda").to(torch.bfloat16)
    dst = torch.empty(rows, -(-cols // 8) * 8, device="cuda", dtype=torch.bfloat16)[:, :cols]
    for _ in range(3):
        assert copy_lines(dst, src, True, stream, torch.cuda.current_device())
    torch.cuda.synchronize()
    assert torch.equal(dst, src)
print("ok")
