"""Whether loading a kernel or its first launch waits for the GPU: host time of the load (from
the disk cache), the first and the second launch of fresh kernels, with the GPU idle and with
50 ms of GPU work queued ahead of them.

    python benchmarks/first_launch_wait.py [--kernels 3]
    CUDA_MODULE_LOADING=EAGER python benchmarks/first_launch_wait.py   # modules loaded at load time

A first launch loads the kernel's module into the CUDA context (lazy loading). If that waits for
the queued work, a tuner that queues the next candidate before the GPU finished the current one
stalls there, holding the GIL (`PickBest._measure` therefore loads while the GPU is idle).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

from kernel_api import registry  # noqa: E402
from kernel_api.arguments import GemmArguments  # noqa: E402
from kernel_api.tuning.timing import gpu_sleep  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kernels", type=int, default=3, help="kernels per condition (each loaded once)")
    opts = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("first_launch_wait.py needs a CUDA GPU")
    n = 2048
    A = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    B = torch.randn(n, n, device="cuda", dtype=torch.bfloat16).t()
    args = GemmArguments(A, B, torch.empty(n, n, device="cuda", dtype=torch.bfloat16))
    kernels = [k for k in registry.get_kernels(args) if type(k).__module__.split(".")[2] != "torch_ops"]
    kernels = kernels[: 2 * opts.kernels]
    for kernel in kernels:  # into the disk cache, so the timed loads below read it
        kernel.compile(args)
    registry.clear_caches()
    kernels = [k for k in registry.get_kernels(args) if type(k).__module__.split(".")[2] != "torch_ops"]
    kernels = kernels[: 2 * opts.kernels]
    print(f"CUDA_MODULE_LOADING={os.environ.get('CUDA_MODULE_LOADING', '(default)')}")
    print(f"{'kernel':<60} {'GPU':>5} {'load ms':>8} {'1st ms':>8} {'2nd ms':>8}")
    for i, kernel in enumerate(kernels):
        busy = i >= opts.kernels
        torch.cuda.synchronize()
        if busy:
            gpu_sleep(50.0)
        began = time.perf_counter()
        artifact = kernel.compile(args)
        load = time.perf_counter() - began
        began = time.perf_counter()
        kernel.run(args, compiled_artifact=artifact)
        first = time.perf_counter() - began
        began = time.perf_counter()
        kernel.run(args, compiled_artifact=artifact)
        second = time.perf_counter() - began
        torch.cuda.synchronize()
        print(f"{kernel.metadata.kernel_name[:60]:<60} {'busy' if busy else 'idle':>5} {load * 1e3:8.2f} "
              f"{first * 1e3:8.2f} {second * 1e3:8.2f}")


if __name__ == "__main__":
    main()
