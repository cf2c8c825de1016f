"""Every provider's best kernel side by side, per operation and shape: ours (cutedsl, cuda_src),
torch, and the plugins under examples/plugins (quack, flash_attn, liger, cutlass_operators); the
winner; and what PickBest over all of them chooses, with its ratio to the fastest (the target:
within 3 %, and never slower than any single provider's best).

For each case, each provider's candidates are ranked by PickAny's estimate and the first
``--per-provider`` compiled and timed through `Kernel.run` on inputs rotated past L2, all of
them in one `time_group` (shuffled turns behind a sleep kernel, CUDA events around each launch:
device time). A provider's best is its fastest timed instance. PickBest then tunes the case over
every provider's candidates (``force``: a fresh measurement, its own timing) and the instance it
chooses is timed in the same group as the rest, as is PickAny's choice (the analytic ranking,
the default policy). The same instances are timed once more as called (back-to-back calls from
an idle GPU, host time included: PickBest's default timing), and PickBest's ratio to the
fastest is given both ways. PickBest tunes every operation (against a float64 reference where kernel_api
knows one, else the torch provider's kernel); the candidates it excluded as wrong are listed.

Plugins are imported from examples/plugins when they are not installed; one whose library is
missing is listed with the reason. Writes JSON (and a text table) to benchmarks/results/ (and
$OUT) after each case, so a run cut short keeps what it measured.

    python3 benchmarks/providers.py [--ops softmax,rms_norm,attention,gemm] [--per-provider 3] [--repeat 30]
                                    [--pickbest-candidates 8] [--workers N] [--cases "16384x1024,s4096"]
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys
import time
from typing import Any, Callable

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)

import kernel_api  # noqa: E402
import results_io  # noqa: E402
from house_timing import time_group  # noqa: E402
from kernel_api import (AttentionArguments, GemmArguments, PickAny, PickBest, RMSNormArguments,  # noqa: E402
                        SoftmaxArguments)
from kernel_api.registry import default_registry  # noqa: E402
from kernel_api.tuning.pick_any import rank_candidates  # noqa: E402
from kernel_api.cost import gpu_floor_ms  # noqa: E402
from kernel_api.tuning import timing  # noqa: E402
from kernel_api.tuning.timing import rotation_count  # noqa: E402

PLUGINS = os.path.join(ROOT, "examples", "plugins")


def load_plugins() -> dict[str, str]:
    """Import every plugin package under examples/plugins (its folder put on sys.path when it is
    not installed); {package: why it did not load}."""
    failed = {}
    for folder in sorted(os.listdir(PLUGINS)):
        path = os.path.join(PLUGINS, folder)
        package = folder.replace("-", "_")
        if not os.path.isdir(os.path.join(path, package)):
            continue
        if importlib.util.find_spec(package) is None:
            sys.path.insert(0, path)
        try:
            importlib.import_module(package)
        except Exception as exc:  # noqa: BLE001 - a plugin whose library is missing is reported, not fatal
            failed[package] = f"{type(exc).__name__}: {exc}"
    return failed


def _rows(shape: tuple, dtype: torch.dtype) -> Callable[[], Any]:
    def make() -> SoftmaxArguments:
        x = 4 * torch.randn(shape, device="cuda").to(dtype)
        return SoftmaxArguments(x, torch.empty_like(x))
    return make


def _rms(shape: tuple, dtype: torch.dtype) -> Callable[[], Any]:
    def make() -> RMSNormArguments:
        x = torch.randn(shape, device="cuda").to(dtype)
        return RMSNormArguments(x, torch.randn(shape[-1], device="cuda").to(dtype), torch.empty_like(x))
    return make


def _attention(b: int, h: int, s: int, d: int, causal: bool) -> Callable[[], Any]:
    def make() -> AttentionArguments:
        q, k, v = (torch.randn(b, s, h, d, device="cuda").to(torch.bfloat16) for _ in range(3))
        return AttentionArguments(q, k, v, torch.empty_like(q), causal=causal)
    return make


def _gemm(m: int, n: int, k: int) -> Callable[[], Any]:
    def make() -> GemmArguments:
        A = torch.randn(m, k, device="cuda").to(torch.bfloat16)
        B = torch.randn(k, n, device="cuda").to(torch.bfloat16)
        return GemmArguments(A, B, torch.empty(m, n, device="cuda", dtype=torch.bfloat16))
    return make


CASES = {
    "softmax": [("4096x32000 f32", _rows((4096, 32000), torch.float32)),
                ("16384x1024 f32", _rows((16384, 1024), torch.float32)),
                ("8192x128 bf16", _rows((8192, 128), torch.bfloat16)),
                ("4096x32000 bf16", _rows((4096, 32000), torch.bfloat16))],
    "rms_norm": [("16384x4096 bf16", _rms((16384, 4096), torch.bfloat16))],
    "attention": [("b4 h32 s4096 d128 causal", _attention(4, 32, 4096, 128, True)),
                  ("b16 h16 s1024 d64 causal", _attention(16, 16, 1024, 64, True))],
    "gemm": [("4096x4096x4096 bf16", _gemm(4096, 4096, 4096)),
             ("odd 3000x5000x2000 bf16", _gemm(3000, 5000, 2000))],
}


def provider_of(kernel: Any) -> str:
    """The name of the provider ``kernel``'s class is registered with."""
    for name in kernel_api.available_providers():
        provider = default_registry.get_provider(name)
        if type(kernel) in provider.kernel_classes():
            return name
    return "?"


def run_case(op: str, label: str, make: Callable[[], Any], per_provider: int, repeat: int, pick_candidates: int,
             workers: int | None = None) -> dict:
    args = make()
    sets = [args] + [make() for _ in range(rotation_count(sum(t.numel() * t.element_size()
                                                                for t in args.tensors().values())) - 1)]
    row: dict = {"op": op, "case": label, "providers": {}, "failures": {}}
    timed: dict[str, tuple[str, Any, Any]] = {}
    for provider in kernel_api.available_providers():
        candidates = kernel_api.get_kernels(args, providers=[provider])
        if not candidates:
            continue
        for kernel in rank_candidates(candidates, args)[:per_provider]:
            name = kernel.metadata.kernel_name
            try:
                start = time.perf_counter()
                artifact = kernel.compile(args)
                kernel.run(args, compiled_artifact=artifact)
                torch.cuda.synchronize()
                row.setdefault("compile_s", {})[name] = round(time.perf_counter() - start, 2)
                timed[name] = (provider, kernel, artifact)
            except Exception as exc:  # noqa: BLE001 - one failing candidate is reported, the rest timed
                row["failures"][name] = f"{type(exc).__name__}: {str(exc)[:300]}"
    every = kernel_api.get_kernels(args)
    any_pick = PickAny().choose(args, every)
    any_name = any_pick.metadata.kernel_name
    if any_name not in timed:
        try:
            timed[any_name] = (provider_of(any_pick), any_pick, any_pick.compile(args))
        except Exception as exc:  # noqa: BLE001
            row["failures"][any_name] = f"{type(exc).__name__}: {str(exc)[:300]}"
    pick = None
    try:
        policy = PickBest(max_candidates=pick_candidates, repeat=10, num_workers=workers)
        result = policy.tune(args, every, force=True)
        winner = result.winner
        pick = winner.metadata.kernel_name
        row["pickbest_excluded"] = {m.kernel_name: m.failure for m in result.measurements
                                    if m.failure and m.error is not None}
        if pick not in timed:
            artifact = winner.compile(args)
            timed[pick] = (provider_of(winner), winner, artifact)
    except Exception as exc:  # noqa: BLE001
        row["pickbest_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"

    def launcher(kernel: Any, artifact: Any) -> Callable[[int], None]:
        return lambda i: kernel.run(sets[i % len(sets)], compiled_artifact=artifact, assume_supported_args=True)

    medians, behind = time_group({n: launcher(k, a) for n, (_, k, a) in timed.items()}, repeat)
    row["host_behind"] = behind
    # as called: back-to-back calls from an idle GPU, host time included (PickBest's default timing)
    called = timing.time_interleaved({n: launcher(k, a) for n, (_, k, a) in timed.items()}, len(sets),
                                     repeat=repeat, gpu_floor_ms=gpu_floor_ms(args), settle_ms=50.0,
                                     timing="as_called")
    row["as_called_ms"] = {n: r["median_ms"] for n, r in called.items() if isinstance(r, dict)}
    for name, ms in medians.items():
        provider = timed[name][0]
        best = row["providers"].get(provider)
        if best is None or ms < best["ms"]:
            row["providers"][provider] = {"kernel": name, "ms": ms}
    row["all_ms"] = medians
    if row["providers"]:
        winner = min(row["providers"], key=lambda p: row["providers"][p]["ms"])
        row["winner"] = winner
        fastest = row["providers"][winner]["ms"]
        if "torch" in row["providers"]:
            row["vs_torch"] = {p: row["providers"]["torch"]["ms"] / v["ms"] for p, v in row["providers"].items()}
        if pick is not None:
            row["pickbest"] = {"kernel": pick, "provider": timed[pick][0], "ms": medians[pick],
                               "ratio_to_fastest": medians[pick] / fastest}
            called = row["as_called_ms"]
            if pick in called:
                row["pickbest"]["ratio_to_fastest_as_called"] = called[pick] / min(called.values())
        if any_name in medians:
            row["pickany"] = {"kernel": any_name, "provider": timed[any_name][0], "ms": medians[any_name],
                              "ratio_to_fastest": medians[any_name] / fastest}
    return row


def table(rows: list[dict]) -> list[str]:
    providers = sorted({p for r in rows for p in r["providers"]})
    lines = ["op        case                          " + "".join(f"{p:>18}" for p in providers)
             + "  winner            PickAny (x fastest)                PickBest (x fastest)"]
    for r in rows:
        cells = "".join(f"{r['providers'][p]['ms'] * 1e3:>16.1f}us" if p in r["providers"] else f"{'-':>18}"
                        for p in providers)
        chosen = []
        for key in ("pickany", "pickbest"):
            pick = r.get(key)
            called = f", {pick['ratio_to_fastest_as_called']:.3f} as called" if pick and \
                "ratio_to_fastest_as_called" in pick else ""
            chosen.append(f"{pick['provider']}:{pick['kernel'][:20]} ({pick['ratio_to_fastest']:.3f}{called})" if pick
                          else r.get(f"{key}_error", "-")[:34])
        lines.append(f"{r['op']:<9} {r['case']:<29} {cells}  {r.get('winner', '-'):<16}  {chosen[0]:<34} {chosen[1]}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", default=",".join(CASES))
    parser.add_argument("--per-provider", type=int, default=3)
    parser.add_argument("--repeat", type=int, default=30)
    parser.add_argument("--pickbest-candidates", type=int, default=8,
                        help="PickBest's max_candidates (the best-ranked by PickAny's estimate)")
    parser.add_argument("--workers", type=int, default=None,
                        help="PickBest's compile workers (default: its own; 1 compiles in this process)")
    parser.add_argument("--cases", default="", help="only cases whose label contains one of these (comma-separated)")
    parser.add_argument("--tag", default="")
    opts = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/providers.py needs a CUDA GPU")
    wanted = [c for c in opts.cases.split(",") if c]
    failed = load_plugins()
    doc = results_io.result_doc(plugin_failures=failed, providers={
        n: str(default_registry.get_provider(n).version) for n in kernel_api.available_providers()},
        rows=[])
    name = results_io.result_name("providers", doc["device"], opts.tag)
    for package, why in failed.items():
        print(f"plugin {package} not loaded: {why}")
    for op in opts.ops.split(","):
        for label, make in CASES[op]:
            if wanted and not any(w in label for w in wanted):
                continue
            start = time.perf_counter()
            row = run_case(op, label, make, opts.per_provider, opts.repeat, opts.pickbest_candidates, opts.workers)
            row["seconds"] = round(time.perf_counter() - start, 1)
            doc["rows"].append(row)
            lines = table(doc["rows"])
            print(lines[0] if len(doc["rows"]) == 1 else "", lines[-1], sep="\n" if len(doc["rows"]) == 1 else "")
            for kernel, why in row["failures"].items():
                print(f"   failed: {kernel}: {why}")
            if "pickbest_error" in row:
                print(f"   PickBest: {row['pickbest_error']}")
            results_io.write_result_with_text(name, doc, lines)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
