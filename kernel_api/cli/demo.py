"""``kernel-api demo``: the main job in one command.

Discovers the kernels for a GEMM (default 4096^3 bf16, row-major), compiles the first few
(for ``--cc``, else the local GPU, else sm_90a); on a GPU also runs each, verifies it against
torch in float64-accumulated reference and times it against torch.matmul in the same process.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from .. import registry
from ..arguments import GemmArguments
from ..core.arch import arch_string, normalize_cc
from ..core.dtypes import to_dtype
from ..tuning.timing import relative_error, rotation_count, time_cuda
from .format import format_table


def _one_per_class(kernels: list, limit: int) -> list:
    chosen, seen = [], set()
    for k in kernels:
        if k.metadata.kernel_class not in seen:
            seen.add(k.metadata.kernel_class)
            chosen.append(k)
        if len(chosen) >= limit:
            break
    return chosen


def run_demo(m: int = 4096, n: int = 4096, k: int = 4096, dtype: str = "bf16", max_kernels: int = 4,
             cc: Any = None) -> int:
    """Discover, compile and (on a GPU) run + verify + time GEMM kernels; returns an exit code."""
    torch_dtype = to_dtype(dtype, "--dtype").to_torch()
    on_gpu = torch.cuda.is_available()
    device = "cuda" if on_gpu else "meta"
    if on_gpu:
        A = torch.randn(m, k, device=device, dtype=torch_dtype)
        B = torch.randn(k, n, device=device, dtype=torch_dtype)
    else:
        A = torch.empty(m, k, device=device, dtype=torch_dtype)
        B = torch.empty(k, n, device=device, dtype=torch_dtype)
    out = torch.empty(m, n, device=device, dtype=torch_dtype)
    args = GemmArguments(A, B, out)
    target = normalize_cc(cc, "--cc")
    if target is None and not on_gpu:
        target = 90
    t0 = time.perf_counter()
    kernels = registry.get_kernels(args, cc=target)
    found_ms = (time.perf_counter() - t0) * 1e3
    print(f"{args!r}")
    print(f"{len(kernels)} kernel(s) discovered in {found_ms:.1f} ms"
          f"{'' if on_gpu else f' (no GPU: targeting {arch_string(target)}, compile only)'}")
    if not kernels:
        print(registry.explain(args, cc=target))
        return 1
    chosen = _one_per_class(kernels, max_kernels)
    rows = []
    ref = None
    if on_gpu:
        ref = torch.matmul(A.float(), B.float())
        flops = 2.0 * m * n * k
        sets = rotation_count(3 * A.numel() * A.element_size())
        inputs = [(torch.randn_like(A), torch.randn_like(B)) for _ in range(sets)]
        torch_t = time_cuda(lambda i: torch.matmul(*inputs[i], out=out), sets=sets)["median_ms"]
        rows.append(("torch.matmul", "-", "-", f"{flops / torch_t / 1e9:.1f}", "1.00"))
    for kernel in chosen:
        name = kernel.metadata.kernel_name
        t0 = time.perf_counter()
        try:
            artifact = kernel.compile(args, cc=target)
        except Exception as exc:  # report and go on with the next kernel
            rows.append((name, "compile failed", str(exc)[:60], "-", "-"))
            continue
        compile_s = time.perf_counter() - t0
        if not on_gpu:
            rows.append((name, f"{compile_s:.2f} s", "-", "-", "-"))
            continue
        out.fill_(float("nan"))
        kernel.run(args, compiled_artifact=artifact)
        err = relative_error(out, ref)
        runs = [GemmArguments(a, b, out) for a, b in inputs]
        t = time_cuda(lambda i: kernel.run(runs[i], compiled_artifact=artifact, assume_supported_args=True),
                      sets=sets)["median_ms"]
        rows.append((name, f"{compile_s:.2f} s", f"{err:.1e}", f"{flops / t / 1e9:.1f}", f"{torch_t / t:.2f}"))

    print(format_table(("kernel", "compile", "rel. error", "TFLOP/s", "vs torch"), rows))
    return 0
