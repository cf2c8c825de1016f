"""Print `softmax_split.REGISTERS`: the registers per thread of every cluster-split instance at each
CTA size it launches with, read from the cubins NVRTC compiles for sm_90a (no GPU needed).

    python3 scripts/split_registers.py

PickAny's wave term (`CudaSoftmaxSplit*.ctas_per_sm`) takes its CTAs per SM from this table;
rerun it when the kernels or the toolkit change (tests/test_softmax_split.py checks the table
against the compiled cubins).
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

from kernel_api import SoftmaxArguments, SoftmaxBackwardArguments  # noqa: E402
from kernel_api.providers.cuda_src.kernels.softmax_split import (  # noqa: E402
    CudaSoftmaxSplitBackward, CudaSoftmaxSplitForward, MAX_THREADS, MIN_THREADS)
from test_softmax_smem import _nv_info  # noqa: E402


def registers() -> dict[tuple, int]:
    """``(backward, ept or "looped", element bytes, threads) -> registers`` for bf16 and f32 (f16
    compiles as bf16 does)."""
    table = {}
    for cls in (CudaSoftmaxSplitForward, CudaSoftmaxSplitBackward):
        for kernel in cls.generate_kernels(None, cc=90):
            dtype = kernel.dtype.to_torch()
            if dtype == torch.float16:
                continue
            kind = "looped" if kernel.looped else kernel.ept
            threads_seen = set()
            top = MAX_THREADS[kernel.ept] if not kernel.looped else MIN_THREADS
            for cols in (kernel.cluster * t * kernel.ept for t in (MIN_THREADS, 256, 512, 1024) if t <= top) \
                    if not kernel.looped else (4096,):
                x = torch.empty(1, cols, dtype=dtype)
                args = (SoftmaxBackwardArguments(x, x, torch.empty_like(x)) if cls.backward
                        else SoftmaxArguments(x, torch.empty_like(x)))
                artifact = kernel.compile(args, cc=90)
                threads = artifact.extra.threads
                if threads in threads_seen:
                    continue
                threads_seen.add(threads)
                compiled = artifact.compiled_obj.compiled
                regs = _nv_info(compiled.cubin)[compiled.symbols[artifact.compiled_obj.name_expression]][0x2f]
                key = (cls.backward, kind, kernel.dtype.bytes, threads)
                table[key] = max(table.get(key, 0), regs)
    return table


if __name__ == "__main__":
    for key, regs in sorted(registers().items(), key=str):
        print(f"    {key!r}: {regs},")
