"""Host cost of a Triton kernel launched through kernel_api against Triton's own launch, and
the kernel's time either way (the target: at most Triton's launch + 1 us on the host, the
kernel time unchanged).

The kernel is Liger's RMSNorm forward (``_rms_norm_forward_kernel``) as the kernel-api-liger
plugin registers it (a `TritonKernel`), with the values the plugin passes. Host rows (per call,
``--calls`` back-to-back calls that never fill the launch queue, median of ``--repeats``
interleaved repeats, paired differences against Triton's own launch):

- ``triton``: ``jit_fn[grid](*values, num_warps=..)``, Triton's JIT launch (binding, cache key,
  launch);
- ``binary.launch``: kernel_api's `TritonBinary` launch of the compiled kernel (the floor);
- ``kernel.run``: ``Kernel.run(args, compiled_artifact=art)`` with the same arguments each call
  (their bound launch);
- ``ops.call``: ``kernel_api.ops.call(args)`` and ``ops.rms_norm(x, w, out=out)``, the policy
  restricted to the liger provider.

Kernel time: CUDA events around each launch of ``triton`` and ``kernel.run`` at 16384x4096, in
one shuffled group (`time_group`). Writes benchmarks/results/triton_launch-<device>.json.

    python3 benchmarks/triton_launch.py [--rows 64] [--cols 4096] [--calls 200] [--repeats 40]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "examples", "plugins", "kernel-api-liger"))

import kernel_api  # noqa: E402
import results_io  # noqa: E402
from host_latency import over_reference, per_call_us  # noqa: E402
from house_timing import time_group  # noqa: E402
from kernel_api import RMSNormArguments, ops  # noqa: E402
from kernel_api.providers.triton.kernel import jit_function_of  # noqa: E402


def setup(rows: int, cols: int) -> tuple:
    import kernel_api_liger  # noqa: F401 - registers the liger provider

    x = torch.randn(rows, cols, device="cuda").to(torch.bfloat16)
    w = torch.randn(cols, device="cuda").to(torch.bfloat16)
    out = torch.empty_like(x)
    args = RMSNormArguments(x, w, out)
    [kernel] = [k for k in kernel_api.get_kernels(args, providers="liger") if k.metadata.design.alignment == 16]
    artifact = kernel.compile(args)
    bound = kernel._bound(args)
    fn = jit_function_of(type(kernel))
    design = kernel.metadata.design
    grid = (args.rows,)
    values = tuple(bound.values())

    def triton_launch() -> None:
        fn[grid](*values, num_warps=design.num_warps, num_stages=design.num_stages)

    binary = artifact.compiled_obj
    device = torch.cuda.current_device()
    stream = torch.cuda.current_stream().cuda_stream
    runtime = kernel._checked_values(args, binary)

    def binary_launch() -> None:
        binary.launch(device, (args.rows, 1, 1), stream, runtime, "liger")

    return args, kernel, artifact, triton_launch, binary_launch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--cols", type=int, default=4096)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--tag", default="")
    opts = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/triton_launch.py needs a CUDA GPU")

    args, kernel, artifact, triton_launch, binary_launch = setup(opts.rows, opts.cols)
    triton_launch()
    kernel.run(args, compiled_artifact=artifact)
    torch.cuda.synchronize()
    same = torch.empty_like(args.out)
    same.copy_(args.out)
    triton_launch()
    torch.cuda.synchronize()
    torch.testing.assert_close(args.out, same, rtol=1e-2, atol=1e-2)  # (the same kernel, launched either way)

    rows = {"triton": triton_launch, "binary.launch": binary_launch,
            "kernel.run": lambda: kernel.run(args, compiled_artifact=artifact),
            "ops.call": lambda: ops.call(args),
            "ops.rms_norm": lambda: ops.rms_norm(args.x, args.weight, 1e-6, out=args.out)}
    with contextlib.ExitStack() as scope:
        scope.enter_context(kernel_api.settings(providers=["liger"]))
        ops.clear_dispatch_cache()
        samples = per_call_us(rows, opts.calls, opts.repeats)
    medians = {k: statistics.median(v) for k, v in samples.items()}
    over = over_reference(samples, "triton")

    big, kernel_big, artifact_big, triton_big, _ = setup(16384, opts.cols)
    device_ms, behind = time_group({"triton": lambda i: triton_big(),
                                    "kernel.run": lambda i: kernel_big.run(big, compiled_artifact=artifact_big)}, 50)

    lines = [f"Liger RMSNorm bf16 {opts.rows}x{opts.cols}: host us per call (median), and over Triton's own launch"]
    for k in rows:
        lines.append(f"  {k:<14} {medians[k]:7.2f} us   {over[k]:+6.2f} us")
    lines.append(f"kernel time at 16384x{opts.cols}: triton {device_ms['triton'] * 1e3:.1f} us, kernel.run "
                 f"{device_ms['kernel.run'] * 1e3:.1f} us (ratio {device_ms['kernel.run'] / device_ms['triton']:.3f})"
                 + (" (host fell behind)" if behind else ""))
    print("\n".join(lines))
    doc = results_io.result_doc(rows=opts.rows, cols=opts.cols, host_us=medians, over_triton_us=over,
                                device_ms=device_ms, host_behind=behind, kernel=kernel.metadata.kernel_name)
    results_io.write_result_with_text(results_io.result_name("triton_launch", doc["device"], opts.tag), doc, lines)


if __name__ == "__main__":
    main()
