"""Host latency of ``kernel_api.ops.gemm`` where PickAny hands the problem to cuBLAS (`TorchGemm`),
next to ``torch.matmul`` itself: what the front door costs when it does not launch a kernel of ours.

    python3 benchmarks/host_latency_torch.py

`benchmarks/host_latency.py` times the front door on a problem our own kernel takes (a launch from
C by its call key). Here the same method (host time per call, `host_latency.per_call_us`: back-to-back
calls few enough that the launch queue never fills, rows interleaved, median over repeats; paired
differences against ``torch.matmul(A, B, out=out)``) on problems PickAny gives cuBLAS: a small bf16
product and f32 ones (f32 entries are keyed by torch's TF32 flag, which their choice follows).
Rows: ``torch.matmul(out=)``, ``ops.gemm(out=)``, ``ops.gemm`` allocating against ``torch.matmul``
allocating (``torch.mm`` beside each: the cheaper of torch's two calls for a 2-D product), `TorchGemm.run` on bound arguments; with a row bias, ``ops.gemm`` against
``torch.addmm`` (out= and allocating); and a layer's forward under no_grad, torch's ``nn.Linear``
against `kernel_api.nn`'s patch of it. Writes
benchmarks/results/host_latency_torch-<device>[-tag].json (and $OUT/ when set); prints a table last.

    python3 benchmarks/host_latency_torch.py --linear   # decode-sized layers, batch 1 to 16

``--linear``: bf16 layers of LLM sizes (4096->4096, 4096->11008, 768->3072) at batch 1 to 16 under
no_grad, torch's ``nn.Linear`` against `kernel_api.nn.patch` of it (whatever PickAny chooses: cuBLAS
through torch, or a kernel of ours): back-to-back forwards with the host cost included
(`kernel_api.tuning.timing.time_interleaved`, ``as_called``: the two in shuffled turns, layers
rotated so the weights come from DRAM as in a model, median), and the host time per forward
(`host_latency.per_call_us`). ``x torch`` is torch's time over ours.
"""

from __future__ import annotations

import argparse
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
from results_io import write_result  # noqa: E402

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
        "torch.mm(out=)": lambda: torch.mm(A, B, out=tout),
        "ops.gemm(out=)": lambda: kernel_api.ops.gemm(A, B, out=out),
        "torch.matmul": lambda: torch.matmul(A, B),
        "torch.mm": lambda: torch.mm(A, B),
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


LINEAR_SHAPES = ((4096, 4096), (4096, 11008), (768, 3072))
LINEAR_BATCHES = (1, 2, 4, 8, 16)


def linear_rows(calls: int, repeats: int, samples: int = 60) -> list[dict]:
    """torch.nn.Linear against its kernel_api.nn patch, per shape and batch (see ``--linear``)."""
    from kernel_api.tuning.timing import rotation_count, time_interleaved

    found = []
    dtype = torch.bfloat16
    for K, N in LINEAR_SHAPES:
        sets = rotation_count(2 * K * N)  # layers, so that the weights are read from DRAM
        layers = [torch.nn.Linear(K, N, device="cuda", dtype=dtype) for _ in range(sets)]
        patched = [kernel_api.nn.patch(torch.nn.Sequential(torch.nn.Linear(K, N, device="cuda", dtype=dtype)))[0]
                   for _ in range(sets)]
        with torch.no_grad():
            for layer, mine in zip(layers, patched):
                mine.weight.copy_(layer.weight)
                mine.bias.copy_(layer.bias)
            for M in LINEAR_BATCHES:
                xs = [torch.randn(M, K, device="cuda", dtype=dtype) for _ in range(sets)]
                for i in range(sets):
                    for _ in range(3):  # the first call chooses and records; the later ones replay
                        got = patched[i](xs[i])
                    want = layers[i](xs[i]).double()
                    err = ((got.double() - want).norm() / want.norm()).item()
                    assert err < 2e-2, f"{K}->{N} M={M}: relative error {err:.3e}"
                runs = {"torch": lambda i: layers[i](xs[i]), "kernel_api": lambda i: patched[i](xs[i])}
                floor = 2 * K * N / 4.0e12 * 1e3
                timed = time_interleaved(runs, sets=sets, warmup=5, repeat=samples, gpu_floor_ms=floor,
                                         timing="as_called")
                host = per_call_us({"torch": lambda: layers[0](xs[0]), "kernel_api": lambda: patched[0](xs[0])},
                                   calls, repeats)
                over = over_reference(host, "torch")
                names = sorted({k.metadata.kernel_name for problem, k in kernel_api.ops.chosen_kernels()
                                if problem[1:4] == (M, N, K)})
                row = {"K": K, "N": N, "M": M, "torch_us": timed["torch"]["median_ms"] * 1e3,
                       "kernel_api_us": timed["kernel_api"]["median_ms"] * 1e3,
                       "host_torch_us": statistics.median(host["torch"]),
                       "host_kernel_api_us": statistics.median(host["kernel_api"]),
                       "host_over_torch_us": over["kernel_api"], "kernels": names}
                row["x_torch"] = row["torch_us"] / row["kernel_api_us"]
                found.append(row)
                print(_linear_row(row), flush=True)
    return found


def _linear_row(r: dict) -> str:
    return (f"{r['K']:>5}->{r['N']:<6} M={r['M']:<3} torch {r['torch_us']:7.2f} us  kernel_api {r['kernel_api_us']:7.2f} us"
            f"  {r['x_torch']:5.2f}x | host {r['host_torch_us']:6.2f} / {r['host_kernel_api_us']:6.2f} us "
            f"({r['host_over_torch_us']:+5.2f}) | {', '.join(r['kernels'])}")


def _commas(text: str) -> str:
    return ",".join(part.strip() for part in text.split(","))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=100)
    p.add_argument("--repeats", type=int, default=51)
    p.add_argument("--tag", default="")
    p.add_argument("--linear", action="store_true", help="only the decode-sized layers, batch 1 to 16")
    p.add_argument("--only", default="", help="comma-separated row labels (torch.matmul(out=) is always timed)")
    p.add_argument("--cases", default="", help="comma-separated cases such as bf16:64,f32:256 (default: all)")
    opts = p.parse_args()
    device = torch.cuda.get_device_name()
    if opts.linear:
        rows = linear_rows(opts.calls, opts.repeats)
        name = f"host_latency_linear-{device.replace(' ', '_')}{'-' + opts.tag if opts.tag else ''}.json"
        write_result(name, {"device": device, "torch": torch.__version__, "argv": sys.argv, "rows": rows}, indent=1)
        print("\nbf16 nn.Linear forward under no_grad, back-to-back (host included); host = host time per call")
        for r in rows:
            print(_linear_row(r))
        behind = [r for r in rows if r["x_torch"] < 1.0]
        print(f"{len(rows) - len(behind)}/{len(rows)} at 1.0x torch or better")
        return
    report = {"device": device, "torch": torch.__version__, "argv": sys.argv, "cases": []}
    lines = []
    # (a row's label may hold a comma itself, "ops.gemm(out=, bias=)": labels are matched whole,
    # spaces after commas aside)
    only = f",{_commas(opts.only)},"
    cases = [(c.split(":")[0], int(c.split(":")[1])) for c in opts.cases.split(",") if c.strip()] or CASES
    for dt, n in cases:
        rows, chosen = rows_for(DTYPES[dt], n)
        if opts.only.strip():
            rows = {k: f for k, f in rows.items() if f",{_commas(k)}," in only or k == "torch.matmul(out=)"}
        samples = per_call_us(rows, opts.calls, opts.repeats)
        over = over_reference(samples, "torch.matmul(out=)")
        medians = {k: statistics.median(v) for k, v in samples.items()}
        report["cases"].append({"case": f"{dt} {n}^3", "pickany": chosen, "median_us": medians,
                                "over_torch_matmul_out_us": over})
        lines.append(f"{dt} {n}^3 (PickAny: {chosen})")
        for k in rows:
            lines.append(f"  {k:<44} {medians[k]:7.2f} us  {over[k]:+6.2f}")
    name = f"host_latency_torch-{device.replace(' ', '_')}{'-' + opts.tag if opts.tag else ''}.json"
    write_result(name, report, indent=1)
    print("\n".join(lines))
    print("(host us per call, median over repeats; then the paired difference from torch.matmul(out=))")


if __name__ == "__main__":
    main()
