"""Host latency of the call path: what Python costs per launch, next to the bare compiled call.

    python benchmarks/host_latency.py                # 128x128x128 f16 GEMM, table + JSON
    python benchmarks/host_latency.py --profile      # also cProfile of kernel.run and ops.gemm

Measures host time per call (time.perf_counter over ``--calls`` back-to-back calls, few enough
that the launch queue never fills, so the host is timed and not the GPU; median of
``--repeats`` repeats, rows interleaved, the device synchronised between repeats) of:

- the bare compiled function (its positional TVM-FFI function with exactly the arguments the
  kernel's ``_run`` passes, captured once), the same with the GIL released per call (TVM-FFI's
  default, which kernel_api turns off for launches), the same with the operands converted for
  TVM-FFI once, the same through the native entry's bound launch (``kernel_api.native``, as
  ``run`` binds it where it builds), torch.mm and torch.mm(out=);
- ``GemmArguments(...)`` (operands whose metadata it has summarised before: recalled from the
  native entry where it loads) and the same summarised in Python (the first construction for
  operands of new metadata); ``kernel.supports(args)``;
- ``kernel.run(args, compiled_artifact=art, stream=s)`` with and without
  ``assume_supported_args=True``;
- ``ops.gemm(A, B, out=out)`` and ``ops.gemm(A, B)`` (allocating) after warm-up (replayed from C
  by their call key where the native entry points load), and ops' Python fast path, which serves
  them otherwise;
- with a row bias (and gelu), against ``torch.addmm``; and a layer's forward under no_grad,
  torch's ``nn.Linear`` against `kernel_api.nn`'s patch of it.

Writes benchmarks/results/host_latency-<device>[-tag].json (and $OUT/ when set); prints a table last.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import time
from typing import Any, Callable

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

import torch  # noqa: E402

import kernel_api  # noqa: E402
import kernel_api.nn  # noqa: E402
import kernel_api.arguments.gemm as arguments  # noqa: E402  (GemmArguments' summaries: _recall)
from kernel_api import GemmArguments  # noqa: E402
from kernel_api.ops import dispatch as ops  # noqa: E402  (the front door's module: replay_call, _gemm_eager)
from kernel_api.providers.cutedsl.kernel import ffi_function  # noqa: E402

TARGETS_US = {  # over the bare call, except GemmArguments (absolute)
    "GemmArguments(...)": ("abs", 5.0),
    "kernel.run (checks on)": ("over_bare", 0.5),
    "kernel.run (assume_supported_args)": ("over_bare", 0.3),
    "ops.gemm(A, B, out=out)": ("over_bare", 1.0),
}


def _no_grad(layer: Any, x: Any) -> Any:
    with torch.no_grad():
        return layer(x)


def per_call_us(rows: dict[str, Callable[[], Any]], calls: int, repeats: int) -> dict[str, list[float]]:
    """Per row, the mean host time of one call in each repeat, in microseconds.

    Rows are interleaved (each repeat times every row once, in a rotating order), so clock or
    load drift during the run spreads over all rows instead of biasing the ones timed last,
    and each row's sample can be paired with the bare call's sample of the same repeat.
    """
    labels = list(rows)
    for fn in rows.values():
        for _ in range(min(200, calls)):
            fn()
    torch.cuda.synchronize()
    samples: dict[str, list[float]] = {label: [] for label in labels}
    for r in range(repeats):
        for label in labels[r % len(labels):] + labels[:r % len(labels)]:
            fn = rows[label]
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            samples[label].append((time.perf_counter() - t0) / calls * 1e6)
            torch.cuda.synchronize()
    return samples


def over_reference(samples: dict[str, list[float]], reference: str) -> dict[str, float]:
    """Median over repeats of (row - reference) within the same repeat: paired differences
    cancel the host's drift, which on a shared machine exceeds the fractions of a microsecond
    being measured."""
    ref = samples[reference]
    return {label: statistics.median(v - b for v, b in zip(values, ref)) for label, values in samples.items()}


def capture_bare_call(kernel: Any, args: GemmArguments, artifact: Any, stream: Any) -> tuple[Callable, tuple]:
    """The compiled function and the exact positional arguments ``kernel._run`` hands it
    (recorded by swapping a spy in for the artifact's compiled object for one call)."""
    seen: list[tuple] = []
    compiled = artifact.compiled_obj

    def spy(*call_args):
        seen.append(call_args)
        return compiled(*call_args)

    artifact.compiled_obj = spy
    try:
        # fresh arguments: ones that ran before hold a launcher bound to the real compiled function
        fresh = GemmArguments(args.A, args.B, args.out)
        kernel.run(fresh, compiled_artifact=artifact, stream=stream, assume_supported_args=True)
    finally:
        artifact.compiled_obj = compiled
    if not seen:
        raise RuntimeError(f"{kernel.metadata.kernel_name} did not call its compiled function; cannot time the bare call")
    return compiled, seen[0]


def summarised_in_python(A: torch.Tensor, B: torch.Tensor, out: torch.Tensor) -> GemmArguments:
    """GemmArguments as the first construction for operands of new metadata builds them: the
    summary computed in Python (repeats recall it from the native entry where it loads)."""
    recall = arguments._recall
    arguments._recall = None
    try:
        return GemmArguments(A, B, out)
    finally:
        arguments._recall = recall


def profile(fn: Callable[[], Any], calls: int, label: str) -> str:
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(12)
    return f"== cProfile {label} ({calls} calls) ==\n{text.getvalue()}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=128, help="M = N = K")
    # Few calls per repeat: the GPU work of 128^3 takes about as long as a launch on the host,
    # so thousands of back-to-back calls fill the launch queue and then time the GPU instead.
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=101)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--tag", default="", help="suffix of the JSON's name (host_latency-<device>-<tag>.json)")
    parser.add_argument("--providers", default="cutedsl,cuda_src",
                        help="providers ops and PickAny consider (default: ours; the bare call is our kernel's, and "
                             "PickAny ranks cuBLAS first for a problem this small)")
    opts = parser.parse_args()
    with kernel_api.settings(providers=opts.providers.split(",")):
        measure(opts)


def measure(opts: argparse.Namespace) -> None:
    if not torch.cuda.is_available():
        raise SystemExit("host_latency.py needs a CUDA GPU")

    n = opts.size
    torch.manual_seed(0)
    A = torch.randn(n, n, device="cuda", dtype=torch.float16)
    B = torch.randn(n, n, device="cuda", dtype=torch.float16)
    out = torch.empty(n, n, device="cuda", dtype=torch.float16)
    stream = torch.cuda.current_stream()

    args = GemmArguments(A, B, out)
    kernel = kernel_api.PickAny().choose(args, kernel_api.get_kernels(args, providers=opts.providers.split(",")))
    artifact = kernel.compile(args)
    kernel.run(args, compiled_artifact=artifact, stream=stream)
    torch.cuda.synchronize()
    err = ((out.double() - A.double() @ B.double()).abs().max() / (A.double() @ B.double()).abs().max()).item()
    if not err < 1e-2:
        raise SystemExit(f"{kernel.metadata.kernel_name}: wrong result (relative error {err:.2e})")
    compiled, bare_args = capture_bare_call(kernel, args, artifact, stream)
    # The positional TVM-FFI function itself, not a keyword-argument adapter around it.
    function = ffi_function(compiled)
    compiled = function or compiled
    ops.gemm(A, B, out=out)  # warm the dispatch cache (same PickAny choice)
    bias = torch.randn(n, device="cuda", dtype=torch.float16)
    linear = torch.nn.Linear(n, n, device="cuda", dtype=torch.float16)
    patched = kernel_api.nn.patch(torch.nn.Sequential(torch.nn.Linear(n, n, device="cuda", dtype=torch.float16)))[0]

    rows = {
        "bare compiled call": lambda: compiled(*bare_args),
        "torch.mm(A, B)": lambda: torch.mm(A, B),
        "torch.mm(A, B, out=out)": lambda: torch.mm(A, B, out=out),
        "GemmArguments(...)": lambda: GemmArguments(A, B, out),
        "GemmArguments, summarised in Python": lambda: summarised_in_python(A, B, out),
        "kernel.supports(args)": lambda: kernel.supports(args),
        "kernel.run (checks on)": lambda: kernel.run(args, compiled_artifact=artifact, stream=stream),
        "kernel.run (assume_supported_args)": lambda: kernel.run(args, compiled_artifact=artifact, stream=stream,
                                                                 assume_supported_args=True),
        "ops.gemm(A, B, out=out)": lambda: ops.gemm(A, B, out=out),
        "ops.gemm(A, B)": lambda: ops.gemm(A, B),
        # the Python fast path ops falls back to where the native entry points do not load
        "ops.gemm(out=), Python path": lambda: ops._gemm_eager(A, B, out, 1.0, 0.0, None, None, None, None, None),
        # a row bias, alone and with an activation (nn.Linear's call): against torch's addmm
        "torch.addmm(bias, A, B, out=out)": lambda: torch.addmm(bias, A, B, out=out),
        "ops.gemm(out=, bias=)": lambda: ops.gemm(A, B, out=out, bias=bias),
        "ops.gemm(out=, bias=, gelu)": lambda: ops.gemm(A, B, out=out, bias=bias, activation="gelu"),
        "ops.gemm(bias=)": lambda: ops.gemm(A, B, bias=bias),
        # a layer's forward at inference: torch's nn.Linear against kernel_api.nn's patch of it
        "torch nn.Linear, no_grad": lambda: _no_grad(linear, A),
        "kernel_api.nn.Linear, no_grad": lambda: _no_grad(patched, A),
    }
    if function is not None:
        # a second handle on the same function, with TVM-FFI's default of releasing the GIL per call
        import tvm_ffi

        gil_releasing = tvm_ffi.Array([function])[0]
        gil_releasing.release_gil = True
        rows["bare, GIL released per call"] = lambda: gil_releasing(*bare_args)
        # the same call with the operands converted for TVM-FFI once, as run's vouched-for
        # launch holds them: what is left of run's cost over this row is Python
        packed = [tvm_ffi.from_dlpack(a) if isinstance(a, torch.Tensor) else a for a in bare_args]
        rows["bare, operands packed once"] = lambda: function(*packed)
        entry = kernel_api.native.entry()
        if entry is not None:
            # run's bound launch: the C entry reads the live tensors through torch's DLPack
            # exchange API (no allocation) and passes the constants converted once
            n_tensors = next(i for i, a in enumerate(bare_args) if not isinstance(a, torch.Tensor))
            bound = entry.bind(function, tuple(bare_args[:n_tensors]), tuple(bare_args[n_tensors:-1]))
            rows["native bound launch"] = lambda: bound(bare_args[-1])
    if ops.replay_call is None:
        print(f"note: the native entry points are not in use ({kernel_api.native.why_not_entry()}); ops rows time "
              f"the Python path")
    samples = per_call_us(rows, opts.calls, opts.repeats)
    results = {label: statistics.median(values) for label, values in samples.items()}
    over_bare = over_reference(samples, "bare compiled call")
    bare = results["bare compiled call"]

    device = torch.cuda.get_device_name()
    verdicts = {}
    for label, (kind, limit) in TARGETS_US.items():
        value = results[label] if kind == "abs" else over_bare[label]
        verdicts[label] = {"measured_us": round(value, 3), "target_us": limit, "kind": kind, "met": value <= limit}

    if opts.profile:
        print(profile(lambda: kernel.run(args, compiled_artifact=artifact, stream=stream), 5000, "kernel.run"))
        print(profile(lambda: ops.gemm(A, B, out=out), 5000, "ops.gemm(out=)"))

    summary = {
        "benchmark": "host_latency", "device": device, "problem": f"{n}x{n}x{n} f16 row-major",
        "kernel": kernel.metadata.kernel_name, "calls_per_repeat": opts.calls, "repeats": opts.repeats,
        "per_call_us": {k: round(v, 3) for k, v in results.items()},
        "over_bare_us_paired": {k: round(v, 3) for k, v in over_bare.items()}, "targets": verdicts,
        "torch": torch.__version__,
        "torch_has_dlpack_c_exchange_api": hasattr(torch.Tensor, "__dlpack_c_exchange_api__"),
        "ops_replayed_from_c": ops.replay_call is not None,
        "native_entry": kernel_api.native.entry() is not None,
        "gemm_arguments_recalled_natively": arguments._recall is not None,
        "native_entry_unavailable_because": kernel_api.native.why_not_entry(),
    }
    name = f"host_latency-{device.replace(' ', '_')}{'-' + opts.tag if opts.tag else ''}.json"
    paths = [os.path.join(ROOT, "benchmarks", "results", name)]
    if os.environ.get("OUT"):
        paths.append(os.path.join(os.environ["OUT"], name))
    for path in paths:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            json.dump(summary, f, indent=2)

    print(f"\nhost latency per call on {device}, {n}x{n}x{n} f16 GEMM, kernel {kernel.metadata.kernel_name}")
    print(f"{'call':38s} {'us/call':>8s} {'over bare':>10s}  target   (over bare: median of paired per-repeat differences)")
    for label, value in results.items():
        target = ""
        if label in verdicts:
            v = verdicts[label]
            target = (f"<= {v['target_us']} us {'abs' if v['kind'] == 'abs' else 'over bare'}: "
                      f"{'met' if v['met'] else 'MISSED'}")
        print(f"{label:38s} {value:8.2f} {over_bare[label]:+10.2f}  {target}")


if __name__ == "__main__":
    main()
