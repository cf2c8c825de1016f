"""Cold start: what a new process pays before its first GEMM and softmax, with a warm cache.

    python benchmarks/cold_start.py                  # 5 processes per row, bf16 4096^3 GEMM
    python benchmarks/cold_start.py --repeats 3 --cache-dir /tmp/kc

One process warms a fresh cache folder (its first calls compile: the cold numbers). Then each
row starts new processes with that cache and times, with perf_counter and CUDA synchronised:

- ``import torch`` and ``import kernel_api`` after it;
- the first ``kernel_api.ops.gemm(A, B)`` (bf16, 4096^3) and the first ``ops.softmax(x)``
  (bf16, 4096 x 4096 rows), each also called once more (the steady state, for scale), with the
  operands already on the GPU (CUDA initialised outside the timing);
- whether ``cutlass`` and ``cuda.core`` were imported by then (a cached CuTe DSL GEMM loads
  without the DSL, a cached NVRTC cubin through the driver API without cuda.core), and what
  the logs say was compiled or loaded.

kernel_api's bytecode is compiled once before the rows, as an installed package's is.

Rows: ``gemm-first`` (the GEMM, then the softmax), ``softmax-first``, and ``clusters-first``:
the GEMM after ``sm90_warpspecialized.max_active_clusters`` has answered for cluster sizes 1, 2
and 4 (its DSL query, timed apart), which shows the first call without that query; the
``probe`` row times `cluster_occupancy.max_active_clusters`, the query without the DSL, and
checks its answers against the DSL's. One more process profiles the first GEMM (``profile``), and
``profile-softmax`` the first softmax (cProfile, the 25 slowest entries by cumulative time). Each
row also counts the modules under ``kernel_api.providers`` imported by the end of each first call
(discovery imports only the kernel modules declared for the operation's arguments type).

Prints each process's numbers as it ends; reports medians; writes (after each row)
benchmarks/results/cold_start-<device>.json (and $OUT/ when set), with the table and the profile
in a .txt beside it. A process takes seconds (importing torch, starting CUDA): the default run is
about 20 processes; ``--budget-s`` stops starting them after that many seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from results_io import result_name, write_result_with_text  # noqa: E402

# One new process: ``python -c CHILD <row> <size>``; its last stdout line is a JSON object.
CHILD = r"""
import json, logging, sys, time
t0 = time.perf_counter()
import torch
t1 = time.perf_counter()
import kernel_api
t2 = time.perf_counter()
row, n = sys.argv[1], int(sys.argv[2])
result = {"row": row, "import_torch_s": t1 - t0, "import_kernel_api_s": t2 - t1,
          "cutlass_after_import": "cutlass" in sys.modules}


class Collect(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines = []

    def emit(self, record):
        text = record.getMessage()
        if text.startswith(("compiled ", "remembered compile", "CuTe DSL artifact", "compile of")):
            self.lines.append(text[:200])


logs = Collect()
for name, level in (("kernel_api.kernel", logging.INFO), ("kernel_api.providers.cutedsl.kernel", logging.DEBUG)):
    logging.getLogger(name).addHandler(logs)
    logging.getLogger(name).setLevel(level)

gen = torch.Generator(device="cuda").manual_seed(0)
A = torch.randn(n, n, device="cuda", dtype=torch.bfloat16, generator=gen)
B = torch.randn(n, n, device="cuda", dtype=torch.bfloat16, generator=gen)
x = torch.randn(n, n, device="cuda", dtype=torch.bfloat16, generator=gen)
torch.cuda.synchronize()
result["cuda_init_s"] = time.perf_counter() - t2

if row == "clusters-first":
    from kernel_api.providers.cutedsl.gemm import sm90_warpspecialized as sm90
    start = time.perf_counter()
    result["dsl_clusters"] = {s: sm90.max_active_clusters(0, s) for s in (1, 2, 4)}
    result["dsl_cluster_query_s"] = time.perf_counter() - start
    result["dsl_cluster_fallbacks"] = {str(k): v for k, v in sm90.max_clusters_fallbacks.items()}
if row == "probe":
    from kernel_api.providers.cutedsl import cluster_occupancy
    start = time.perf_counter()
    result["clusters"] = {s: cluster_occupancy.max_active_clusters(0, s) for s in (1, 2, 4)}
    result["cluster_query_s"] = time.perf_counter() - start
    result["cutlass_after_probe"] = "cutlass" in sys.modules
    from kernel_api.providers.cutedsl.gemm import sm90_warpspecialized as sm90
    result["dsl_clusters"] = {s: sm90.max_active_clusters(0, s) for s in (1, 2, 4)}
    result["dsl_cluster_fallbacks"] = {str(k): v for k, v in sm90.max_clusters_fallbacks.items()}


def gemm():
    return kernel_api.ops.gemm(A, B)


def softmax():
    return kernel_api.ops.softmax(x)


ops = {"gemm": gemm, "softmax": softmax}
order = ["softmax", "gemm"] if row == "softmax-first" else ["gemm", "softmax"]
if row in ("probe",):
    order = []
if row.startswith("profile"):
    import cProfile, io, pstats
    op = "softmax" if row == "profile-softmax" else "gemm"
    profile = cProfile.Profile()
    start = time.perf_counter()
    profile.enable()
    ops[op]()
    torch.cuda.synchronize()
    profile.disable()
    result[op + "_first_s"] = time.perf_counter() - start
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("cumulative").print_stats(25)
    result["profile"] = text.getvalue()
    order = []
outputs = {}
for op in order:
    start = time.perf_counter()
    outputs[op] = ops[op]()
    torch.cuda.synchronize()
    result[op + "_first_s"] = time.perf_counter() - start
    result["cutlass_after_" + op] = "cutlass" in sys.modules
    result["cuda_core_after_" + op] = "cuda.core" in sys.modules
    result["kernel_modules_after_" + op] = sum(m.startswith("kernel_api.providers.") for m in sys.modules)
    start = time.perf_counter()
    ops[op]()
    torch.cuda.synchronize()
    result[op + "_second_s"] = time.perf_counter() - start
if "gemm" in outputs:
    ref = A.float() @ B.float()
    result["gemm_rel_error"] = float((outputs["gemm"].float() - ref).norm() / ref.norm())
if "softmax" in outputs:
    ref = torch.softmax(x.float(), dim=-1)
    result["softmax_max_error"] = float((outputs["softmax"].float() - ref).abs().max())
result["logs"] = logs.lines
print(json.dumps(result))
"""


def child_environment(cache: str, pycache: str) -> dict:
    """The children's environment: the cache folder, this checkout first on the path, and
    kernel_api's bytecode compiled once into ``pycache`` (as ``pip install`` compiles a
    package), whatever PYTHONDONTWRITEBYTECODE says: a source checkout's first import otherwise
    compiles every module in every process, which no installed package pays."""
    env = dict(os.environ, KERNEL_API_CACHE_DIR=cache, PYTHONPYCACHEPREFIX=pycache, PYTHONPATH=os.pathsep.join(
        p for p in (os.path.abspath(ROOT), os.environ.get("PYTHONPATH", "")) if p))
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    return env


def compile_bytecode(env: dict) -> None:
    subprocess.run([sys.executable, "-m", "compileall", "-q", os.path.join(os.path.abspath(ROOT), "kernel_api")],
                   env=env, check=True, capture_output=True)


#: Where the children's bytecode lives (compiled once by `compile_bytecode`).
PYCACHE = tempfile.mkdtemp(prefix="kernel_api-cold-start-pycache-")


def run_child(row: str, n: int, cache: str, timeout: float) -> dict:
    env = child_environment(cache, PYCACHE)
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", CHILD, row, str(n)], env=env, capture_output=True, text=True,
                          timeout=timeout)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        return {"row": row, "error": done.stderr[-4000:], "process_s": wall}
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["process_s"] = wall
    return result


def median(results: list[dict], field: str) -> float | None:
    values = [r[field] for r in results if isinstance(r.get(field), (int, float))]
    return statistics.median(values) if values else None


def summarise(rows: dict, repeats: int, size: int) -> tuple[dict, list[str]]:
    fields = ("import_torch_s", "import_kernel_api_s", "cuda_init_s", "dsl_cluster_query_s", "cluster_query_s",
              "gemm_first_s", "gemm_second_s", "softmax_first_s", "softmax_second_s", "process_s")
    summary = {row: {f: median(results, f) for f in fields if median(results, f) is not None}
               for row, results in rows.items()}
    lines = [f"cold start, {size}^3 bf16 GEMM and {size} x {size} bf16 softmax; medians of up to {repeats} "
             f"processes per row (ms)"]
    for row, values in summary.items():
        marks = ""
        for module in ("cutlass", "cuda_core"):
            seen = {k[len(module) + 7:]: v for r in rows[row] for k, v in r.items() if k.startswith(module + "_after_")}
            after = sorted(k for k, v in seen.items() if v)
            if after:
                marks += f"  [{module.replace('_', '.')} imported after: {', '.join(after)}]"
            elif seen:
                marks += f"  [no {module.replace('_', '.')}]"
        lines.append(f"{row:22s} n={len(rows[row])} " + "  ".join(f"{k[:-2]}={v * 1e3:.1f}" for k, v in values.items())
                     + marks)
        errors = [r["error"] for r in rows[row] if "error" in r]
        if errors:
            lines.append(f"    error: {errors[0][-1500:]}")
        for key in ("kernel_modules_after_gemm", "kernel_modules_after_softmax", "gemm_rel_error",
                    "softmax_max_error", "clusters", "dsl_clusters", "dsl_cluster_fallbacks"):
            found = [r[key] for r in rows[row] if key in r]
            if found:
                lines.append(f"    {key}: {found[0]}")
        logs = next((r.get("logs") for r in rows[row] if r.get("logs")), None)
        if logs:
            lines.extend(f"    log: {line}" for line in logs[:8])
    return summary, lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5, help="new processes per row (default 5)")
    parser.add_argument("--size", type=int, default=4096, help="GEMM M = N = K and softmax rows x cols")
    parser.add_argument("--cache-dir", default=None, help="cache folder (default: a new temporary one)")
    parser.add_argument("--rows", default="gemm-first,softmax-first,probe,clusters-first,profile",
                        help="rows, in the order they run")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per process")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="start no new process after this many seconds (rows keep what they have)")
    options = parser.parse_args()
    cache = options.cache_dir or tempfile.mkdtemp(prefix="kernel_api-cold-start-")
    compile_bytecode(child_environment(cache, PYCACHE))
    import torch

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    started = time.perf_counter()
    plan = [("warm-up (cold cache)", "gemm-first", 1)]
    plan += [(row, row, 1 if row.startswith("profile") or row == "probe" else options.repeats)
             for row in options.rows.split(",")]
    rows: dict[str, list[dict]] = {}
    for label, row, count in plan:
        for _ in range(count):
            if options.budget_s is not None and time.perf_counter() - started > options.budget_s:
                break
            result = run_child(row, options.size, cache, options.timeout)
            rows.setdefault(label, []).append(result)
            shown = {k: (round(v * 1e3, 1) if k.endswith("_s") else v) for k, v in result.items()
                     if k not in ("profile", "logs", "error")}
            print(label, json.dumps(shown), ("ERROR " + result["error"][-800:]) if "error" in result else "",
                  flush=True)
        summary, lines = summarise(rows, options.repeats, options.size)
        profile = "\n".join(r["profile"] for label in ("profile", "profile-softmax") for r in rows.get(label, [])
                            if "profile" in r)
        doc = {"device": device, "torch": torch.__version__, "argv": sys.argv, "cache_dir": cache,
               "summary": summary, "processes": rows}
        paths = write_result_with_text(result_name("cold_start", device), doc, lines + ["", profile])
    print("\n".join(lines))
    print(profile)
    print("wrote", ", ".join(paths))


if __name__ == "__main__":
    main()
