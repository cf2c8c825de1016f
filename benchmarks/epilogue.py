"""GEMM epilogue functions fused into kernel_api's SM90 GEMM, against the plain GEMM and torch.

For each shape (M, N, K; bf16) and each epilogue below, in one process and in shuffled turns
(`kernel_api.tuning.timing.time_interleaved`, device time of each launch, inputs rotated past
L2, after a settle of back-to-back work), it times:

- ``fused``: the epilogue function fused into the SM90 kernel (one fixed configuration,
  ``--config``), launched through `Kernel.run`;
- ``plain``: the same kernel with the plain epilogue (``out = A @ B``): the cost of fusing is
  ``fused / plain`` (target: at most 1.03 where the epilogue reads at most one (M, N) tensor);
- ``plain_ops``: ``kernel_api.ops.gemm(A, B, out=out)``, the policy's own choice;
- ``fused_ops``: ``kernel_api.ops.gemm(A, B, epilogue=fn, ...)`` (the policy's choice among
  the fusing kernels);
- ``eager``: torch's GEMM and then the epilogue as separate torch ops;
- ``compile``: ``torch.compile`` of the eager function (Inductor fuses the epilogue into its
  GEMM template or a Triton kernel), unless ``--no-compile``;
- ``fused@<config>``: the fused kernel of each other configuration ``--extra-configs`` names.

Every contestant's result is first checked against a float64 reference. Prints ratios against
the anchors and writes JSON to benchmarks/results/ (and $OUT).

    python3 benchmarks/epilogue.py [--shapes 4096x4096x4096,8192x8192x4096] [--epilogues bias_relu,residual]
    python3 benchmarks/epilogue.py --precompile   # no GPU: compile the fused and plain kernels for sm_90a
    python3 benchmarks/epilogue.py --check-only   # compile and check only (parallel warm-ups of the caches)
    python3 benchmarks/epilogue.py --quick        # the two shapes, residual / gelu_gate / gelu_tanh_gate /
                                                  # aux_out, torch.compile at 4096^3, 10 repeats
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import kernel_api  # noqa: E402
import results_io  # noqa: E402
from kernel_api import EpilogueArguments, GemmArguments  # noqa: E402
from kernel_api.epilogue import evaluate, parse  # noqa: E402

SHAPES = [(4096, 4096, 4096), (8192, 8192, 4096)]
CONFIG = "tile128x128x64_cluster2x1_pingpong_swz16m_epi32"
L2_ROTATE_BYTES = 120 * 2**20


# The epilogues: (source, torch function of (acc, operands), operands maker, reads/writes an (M, N) tensor)
def _bias(M, N, dev):
    return {"bias": torch.randn(N, device=dev, dtype=torch.bfloat16)}


def _residual(M, N, dev):
    return {"C": torch.randn(M, N, device=dev, dtype=torch.bfloat16), "alpha": 0.5}


def _gate(M, N, dev):
    return {"up": torch.randn(M, N, device=dev, dtype=torch.bfloat16)}


def _aux(M, N, dev):
    return {"bias": torch.randn(N, device=dev, dtype=torch.bfloat16),
            "z": torch.empty(M, N, device=dev, dtype=torch.bfloat16)}


EPILOGUES = {
    "bias_relu": ("def epi(accum, bias):\n    D = relu(accum + bias)\n    return D",
                  lambda acc, o: torch.relu(acc + o["bias"]), _bias, False),
    "residual": ("def epi(accum, C, alpha):\n    D = alpha * accum + C\n    return D",
                 lambda acc, o: o["alpha"] * acc + o["C"], _residual, True),
    "gelu_gate": ("def epi(accum, up):\n    D = gelu(accum) * up\n    return D",
                  lambda acc, o: F.gelu(acc) * o["up"], _gate, True),
    "gelu_tanh_gate": ("def epi(accum, up):\n    D = gelu_tanh(accum) * up\n    return D",
                       lambda acc, o: F.gelu(acc, approximate="tanh") * o["up"], _gate, True),
    "silu_gate": ("def epi(accum, up):\n    D = silu(accum) * up\n    return D",
                  lambda acc, o: F.silu(acc) * o["up"], _gate, True),
    "aux_out": ("def epi(accum, bias):\n    z = accum + bias\n    D = relu(z)\n    return D, z",
                None, _aux, True),
}


def _eager_fn(name):
    src, fn, _, _ = EPILOGUES[name]
    if name == "aux_out":
        def aux(A, B, o):
            z = A @ B + o["bias"]
            o["z"].copy_(z)
            return torch.relu(z)
        return aux
    return lambda A, B, o: fn(A @ B, o)


def _sm90(args, config):
    from kernel_api.providers.cutedsl.gemm.sm90_warpspecialized import Sm90WarpSpecializedGemm

    found = [k for k in kernel_api.get_kernels(args, cc=90) if type(k) is Sm90WarpSpecializedGemm
             and config in k.name]
    if not found:
        raise RuntimeError(f"no SM90 instance with {config!r} takes {args!r}")
    return found[0]


def precompile(config: str, names: list[str]) -> None:
    """Compile the fused and plain kernels of the benchmark for sm_90a on this machine (small
    CPU tensors: artifacts depend on dtypes and layouts, not sizes)."""
    M = N = K = 256
    A = torch.randn(M, K, dtype=torch.bfloat16)
    B = torch.randn(K, N, dtype=torch.bfloat16)
    out = torch.empty(M, N, dtype=torch.bfloat16)
    plain = GemmArguments(A, B, out)
    _sm90(plain, config).compile(plain, cc=90)
    for name in names:
        src, _, make, _ = EPILOGUES[name]
        args = GemmArguments(A, B, out, epilogue=EpilogueArguments(src, **make(M, N, "cpu")))
        _sm90(args, config).compile(args, cc=90)
        print("compiled", name)


def bench_shape(shape, names, repeat, use_compile, config, check_only=False, extra_configs=()) -> list[dict]:
    from kernel_api.tuning.timing import time_interleaved

    M, N, K = shape
    dev = "cuda"
    per_set = (M * K + K * N + 3 * M * N) * 2
    sets = max(2, math.ceil(L2_ROTATE_BYTES / per_set) + 1)
    As = [torch.randn(M, K, device=dev, dtype=torch.bfloat16) for _ in range(sets)]
    Bs = [torch.randn(K, N, device=dev, dtype=torch.bfloat16) / math.sqrt(K) for _ in range(sets)]
    outs = [torch.empty(M, N, device=dev, dtype=torch.bfloat16) for _ in range(sets)]
    plain_args = [GemmArguments(As[i], Bs[i], outs[i]) for i in range(sets)]
    plain_kernel = _sm90(plain_args[0], config)
    plain_art = plain_kernel.compile(plain_args[0])
    results = []
    for name in names:
        src, _, make, mn_io = EPILOGUES[name]
        operands = [make(M, N, dev) for _ in range(sets)]
        fused_args = [GemmArguments(As[i], Bs[i], outs[i], epilogue=EpilogueArguments(src, **operands[i]))
                      for i in range(sets)]
        kernel = _sm90(fused_args[0], config)
        art = kernel.compile(fused_args[0])
        eager = _eager_fn(name)
        graph = parse(src)
        extra = {k: v for k, v in operands[0].items() if k not in graph.params}

        def ops_fused(i, operands=operands):
            kernel_api.ops.gemm(As[i], Bs[i], out=outs[i], epilogue=src, **operands[i])

        fns = {
            "fused": lambda i, fa=fused_args, k=kernel, a=art: k.run(fa[i % sets], compiled_artifact=a,
                                                                     assume_supported_args=True),
            "plain": lambda i: plain_kernel.run(plain_args[i % sets], compiled_artifact=plain_art,
                                                assume_supported_args=True),
            "plain_ops": lambda i: kernel_api.ops.gemm(As[i % sets], Bs[i % sets], out=outs[i % sets]),
            "fused_ops": lambda i, f=ops_fused: f(i % sets),
            "eager": lambda i, e=eager: e(As[i % sets], Bs[i % sets], operands[i % sets]),
        }
        for other in extra_configs:
            try:
                k_other = _sm90(fused_args[0], other)
                a_other = k_other.compile(fused_args[0])
            except Exception as exc:  # noqa: BLE001 - report, keep the others
                print(f"fused@{other}: {type(exc).__name__}: {exc}"[:300], flush=True)
                continue
            fns[f"fused@{other}"] = lambda i, fa=fused_args, k=k_other, a=a_other: k.run(
                fa[i % sets], compiled_artifact=a, assume_supported_args=True)
        if use_compile:
            compiled = torch.compile(eager)
            fns["compile"] = lambda i, c=compiled: c(As[i % sets], Bs[i % sets], operands[i % sets])
        entry = {"shape": [M, N, K], "dtype": "bf16", "epilogue": name, "reads_or_writes_mn": mn_io,
                 "kernel": kernel.name, "errors": {}, "rel_err": {}, "ms": {}}
        acc = As[0].double() @ Bs[0].double()
        want = evaluate(graph, acc, operands[0])
        live = {}
        for label, fn in fns.items():
            try:
                for t in extra.values():
                    t.fill_(float("nan"))
                outs[0].fill_(float("nan"))
                got = fn(0)
                torch.cuda.synchronize()
                got = got if isinstance(got, torch.Tensor) and label in ("eager", "compile") else outs[0]
                err = ((got.double() - want["D"]).norm() / want["D"].norm()).item()
                for key, t in extra.items():
                    err = max(err, ((t.double() - want[key]).norm() / want[key].norm()).item())
                if label in ("plain", "plain_ops"):
                    err = ((outs[0].double() - acc).norm() / acc.norm()).item()
                if not err < 2e-2:
                    raise RuntimeError(f"wrong result: relative error {err:.3e}")
                entry["rel_err"][label] = err
                live[label] = fn
            except Exception as exc:  # noqa: BLE001 - report, keep the others
                entry["errors"][label] = f"{type(exc).__name__}: {exc}"[:400]
        floor_ms = 2.0 * M * N * K / 1.2e12  # (about the H200's dense bf16 peak: a lower bound)
        if check_only:  # (compiled and checked: what a later timed run loads from the caches)
            print(f"{M}x{N}x{K} {name}: checked {sorted(live)}", entry["errors"] or "", flush=True)
            results.append(entry)
            continue
        timed = time_interleaved(live, sets=sets, warmup=3, repeat=repeat, settle_ms=100.0, gpu_floor_ms=floor_ms)
        for label, summary in timed.items():
            if isinstance(summary, Exception):
                entry["errors"][label] = f"{type(summary).__name__}: {summary}"[:400]
            else:
                entry["ms"][label] = summary["median_ms"] if isinstance(summary, dict) else summary
        ms = entry["ms"]
        ratios = {}
        if "fused" in ms and "plain" in ms:
            ratios["fused_over_plain"] = ms["fused"] / ms["plain"]
        for label in ms:
            if label.startswith("fused@") and "fused" in ms:
                ratios[f"{label}_over_fused"] = ms[label] / ms["fused"]
        for anchor in ("eager", "compile"):
            if "fused" in ms and anchor in ms:
                ratios[f"{anchor}_over_fused"] = ms[anchor] / ms["fused"]
            if "fused_ops" in ms and anchor in ms:
                ratios[f"{anchor}_over_fused_ops"] = ms[anchor] / ms["fused_ops"]
        entry["ratios"] = ratios
        line = " ".join(f"{k}={v:.3f}ms" for k, v in ms.items())
        print(f"{M}x{N}x{K} {name:10s} {line} | " + " ".join(f"{k}={v:.3f}" for k, v in ratios.items()), flush=True)
        if entry["errors"]:
            print("   errors:", entry["errors"], flush=True)
        results.append(entry)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default=",".join("x".join(map(str, s)) for s in SHAPES))
    parser.add_argument("--epilogues", default=",".join(EPILOGUES))
    parser.add_argument("--repeat", type=int, default=30)
    parser.add_argument("--no-compile", action="store_true", help="leave torch.compile out")
    parser.add_argument("--compile-shapes", default="", help="torch.compile only at these shapes (default: all)")
    parser.add_argument("--config", default=CONFIG, help="name part of the SM90 configuration timed")
    parser.add_argument("--extra-configs", default="", help="comma-separated name parts of other SM90 configurations "
                        "whose fused kernels are timed too (fused@<config>)")
    parser.add_argument("--precompile", action="store_true", help="compile for sm_90a only (no GPU needed)")
    parser.add_argument("--check-only", action="store_true",
                        help="compile and check every contestant, time nothing (fills the caches for a timed run)")
    parser.add_argument("--tag", default="")
    parser.add_argument("--quick", action="store_true",
                        help="residual, gelu_gate, gelu_tanh_gate, aux_out at the two shapes, torch.compile at "
                        "4096^3 only, 10 repeats (what --epilogues, --compile-shapes, --repeat do not set)")
    opts = parser.parse_args()
    if opts.quick:
        given = " ".join(sys.argv[1:])
        if "--epilogues" not in given:
            opts.epilogues = "residual,gelu_gate,gelu_tanh_gate,aux_out"
        if "--compile-shapes" not in given:
            opts.compile_shapes = "4096x4096x4096"
        if "--repeat" not in given:
            opts.repeat = 10
    names = opts.epilogues.split(",")
    if opts.precompile:
        precompile(opts.config, names)
        return
    shapes = [tuple(int(x) for x in s.split("x")) for s in opts.shapes.split(",")]
    doc = {"device": torch.cuda.get_device_name(), "config": opts.config, "results": []}
    compile_at = {tuple(int(x) for x in s.split("x")) for s in opts.compile_shapes.split(",") if s}
    for shape in shapes:
        use_compile = not opts.no_compile and (not compile_at or shape in compile_at)
        extra = [c for c in opts.extra_configs.split(",") if c]
        doc["results"] += bench_shape(shape, names, opts.repeat, use_compile, opts.config, opts.check_only, extra)
        if not opts.check_only:  # (after each shape: a run cut short keeps what it measured)
            paths = results_io.write_result(results_io.result_name("epilogue", doc["device"], opts.tag), doc,
                                            indent=1)
    if not opts.check_only:
        print("wrote", ", ".join(paths))


if __name__ == "__main__":
    main()
