"""Host latency of ``kernel_api.ops.gemm`` where PickAny hands the problem to cuBLAS (`TorchGemm`),
next to ``torch.matmul`` itself: what the front door costs when it does not launch a kernel of ours.

    python3 benchmarks/host_latency_torch.py

`benchmarks/host_latency.py` times the front door on a problem our own kernel takes (a launch from
the C launch table). Here the same method (host time per call, `host_latency.per_call_us`: back-to-back
calls few enough that the launch queue never fills, rows interleaved, median over repeats; paired
differences against ``torch.matmul(A, B, out=out)``) on problems PickAny gives cuBLAS: a small bf16
product and f32 ones (f32 entries are keyed by torch's TF32 flag, which their choice follows).
Rows: ``torch.matmul(out=)``, ``ops.gemm(out=)``, ``ops.gemm`` allocating against ``torch.matmul``
allocating, `TorchGemm.run` on bound arguments; with a row bias, ``ops.gemm`` against
``torch.addmm`` (out= and allocating); and a layer's forward under no_grad, torch's ``nn.Linear``
against `kernel_api.nn`'s patch of it. Writes
benchmarks/results/host_latency_torch-<device>[-tag].json (and $OUT/ when set); prints a table last.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import torch  # noqa: E402

import kernel_api  # noqa: E402
import kernel_api.nn  # noqa: E402
from host_latency import over_reference, per_call_us  # noqa: E402
from kernel_api import GemmArguments  # noqa: E402
from kernel_api.tuning.policies import PickAny  # noqa: E402

CASES = (("bf16", 256), ("bf16", 64), ("f32", 256), ("f32", 64))
DTYPES = {"bf16": torch.bfloat16, "f32": torch.float32}


def rows_for(dtype: torch.dtype, n: int) -> tuple[dict, str]:
    A = torch.randn(n, n, device="cuda", dtype=dtype)
    B = torch.randn(n, n, device="cuda", dtype=dtype)
    out, tout = torch.empty_like(A), torch.empty_like(A)
    args = GemmArguments(A, B, out)
    chosen = PickAny().choose(args, kernel_api.get_kernels(args))
    artifact = chosen.compile(args)
    chosen.run(args, compiled_artifact=artifact)
    kernel_api.ops.gemm(A, B, out=out)
    torch.cuda.synchronize()
    ref = A.double() @ B.double()
    assert torch.allclose(out.double(), ref, rtol=2e-2, atol=2e-2 * n ** 0.5), "ops.gemm: wrong result"
    bias = torch.randn(n, device="cuda", dtype=dtype)
    linear = torch.nn.Linear(n, n, device="cuda", dtype=dtype)
    patched = kernel_api.nn.patch(torch.nn.Sequential(torch.nn.Linear(n, n, device="cuda", dtype=dtype)))[0]
    return {
        "torch.matmul(out=)": lambda: torch.matmul(A, B, out=tout),
        "ops.gemm(out=)": lambda: kernel_api.ops.gemm(A, B, out=out),
        "torch.matmul": lambda: torch.matmul(A, B),
        "ops.gemm": lambda: kernel_api.ops.gemm(A, B),
        "kernel.run (bound, assume_supported_args)": lambda: chosen.run(args, compiled_artifact=artifact,
                                                                        assume_supported_args=True),
        # a row bias (torch.addmm where PickAny gives cuBLAS the product) and a layer's forward
        "torch.addmm(out=)": lambda: torch.addmm(bias, A, B, out=tout),
        "ops.gemm(out=, bias=)": lambda: kernel_api.ops.gemm(A, B, out=out, bias=bias),
        "torch.addmm": lambda: torch.addmm(bias, A, B),
        "ops.gemm(bias=)": lambda: kernel_api.ops.gemm(A, B, bias=bias),
        "torch nn.Linear, no_grad": lambda: _no_grad(linear, A),
        "kernel_api.nn.Linear, no_grad": lambda: _no_grad(patched, A),
    }, chosen.metadata.kernel_name


def _no_grad(layer, x):
    with torch.no_grad():
        return layer(x)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=100)
    p.add_argument("--repeats", type=int, default=51)
    p.add_argument("--tag", default="")
    opts = p.parse_args()
    device = torch.cuda.get_device_name()
    report = {"device": device, "torch": torch.__version__, "argv": sys.argv, "cases": []}
    lines = []
    for dt, n in CASES:
        rows, chosen = rows_for(DTYPES[dt], n)
        samples = per_call_us(rows, opts.calls, opts.repeats)
        over = over_reference(samples, "torch.matmul(out=)")
        medians = {k: statistics.median(v) for k, v in samples.items()}
        report["cases"].append({"case": f"{dt} {n}^3", "pickany": chosen, "median_us": medians,
                                "over_torch_matmul_out_us": over})
        lines.append(f"{dt} {n}^3 (PickAny: {chosen})")
        for k in rows:
            lines.append(f"  {k:<44} {medians[k]:7.2f} us  {over[k]:+6.2f}")
    name = f"host_latency_torch-{device.replace(' ', '_')}{'-' + opts.tag if opts.tag else ''}.json"
    text = json.dumps(report, indent=1)
    for folder in (os.path.join(HERE, "results"), os.environ.get("OUT")):
        if folder:
            with open(os.path.join(folder, name), "w") as f:
                f.write(text)
    print("\n".join(lines))
    print("(host us per call, median over repeats; then the paired difference from torch.matmul(out=))")


if __name__ == "__main__":
    main()
