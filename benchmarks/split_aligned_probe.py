"""Does a k-aligned split beat the stream-K split on outputs of fewer tiles than SMs? (session 38)

The ``_splitall_`` instances share all tiles' k-iterations over every co-resident cluster, so
with T tiles on G clusters a cluster's share starts at an arbitrary k offset: clusters that read
the same A rows or B columns do it at different times, and L2 reuse is lost (at 256x3584x18944
the 128x128 split instance ran 129 us against the data-parallel 64x128 tile's 75 on an H100).
With G a multiple of T, every share is one whole k-part of one tile (tile c // s, part c % s of
s = G / T) and all clusters walk their parts in step. The grid is a launch argument, so this
probe forces it (``kernel._clusters``) on the shipped instances: no new kernel.

    python3 benchmarks/split_aligned_probe.py --shapes 256x3584x18944,512x768x3072 --tag s38

Per shape: cuBLAS, PickAny's choice, each ``_splitall_`` instance with its own grid and with the
largest multiple of its tile count that fits (when that is at least two parts), timed with the
house method (`small_m.time_group`: alternating shuffled launches, CUDA events, rotated inputs
past 256 MB), each output checked against float64 first. JSON and a table to
benchmarks/results/split-aligned-probe-<device>-<tag>.*.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import kernel_api  # noqa: E402
from kernel_api.providers.cutedsl.gemm.sm90_warpspecialized import max_active_clusters  # noqa: E402
from kernel_api.tuning.policies import PickAny  # noqa: E402
from gemm_shapes import Case, case_arguments, case_candidates, make_sets, rel_error  # noqa: E402
from results_io import result_name, write_result_with_text  # noqa: E402
from small_m import time_group  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", required=True, help="MxNxK,... (bf16, A row-major, B column-major: tnt)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--repeat", type=int, default=30)
    ap.add_argument("--tag", default="run")
    opts = ap.parse_args()
    device = torch.cuda.get_device_name()
    rows, lines = [], []
    for text in opts.shapes.split(","):
        M, N, K = (int(v) for v in text.split("x"))
        case = Case(M, N, K, "bf16", "tnt")
        sets = make_sets(case)
        args = [case_arguments(case, A, B, out) for A, B, out, _ in sets]
        n = len(sets)
        cands = case_candidates(case, args[0])
        pick = PickAny().choose(args[0], cands)
        fns, errors, grids = {}, {}, {}

        def add(label, kernel, clusters=None):
            artifact = kernel.compile(args[0])
            if clusters is not None:
                kernel._clusters[args[0].device_index] = clusters
            workspaces = [torch.empty(max(kernel.get_workspace_size(a), 1), dtype=torch.uint8, device="cuda")
                          for a in args]

            def run(i, kernel=kernel, artifact=artifact, clusters=clusters):
                if clusters is not None:
                    kernel._clusters[args[0].device_index] = clusters
                kernel.run(args[i % n], compiled_artifact=artifact, workspace=workspaces[i % n])
            A, B, out, _ = sets[0]
            out.fill_(float("nan"))
            run(0)
            torch.cuda.synchronize()
            errors[label] = rel_error(out, A, B)
            fns[label] = run

        fns["cublas"] = lambda i: torch.matmul(sets[i % n][0], sets[i % n][1], out=sets[i % n][3])
        add("pickany", pick)
        for k in cands:
            name = k.metadata.kernel_name
            if "_splitall_" not in name or k.metadata.provider == "torch":
                continue
            tm, tn = k.config.tile_mn
            tiles = -(-M // tm) * -(-N // tn)
            resident = max_active_clusters(0, 1)
            short = f"split{tm}x{tn}"
            # a fresh instance per grid: the cached cluster count is per instance
            add(short + "_streamk", type(k)(k.metadata, k.config, k.ab_stages, k.epi_stages))
            parts = min(resident // tiles, -(-K // 64))
            if parts >= 2:
                add(short + f"_aligned{parts}", type(k)(k.metadata, k.config, k.ab_stages, k.epi_stages), tiles * parts)
                grids[short] = (tiles, parts, resident)
        runs = [time_group(fns, opts.repeat)[0] for _ in range(opts.repeats)]
        med = {k: statistics.median(r[k] for r in runs) for k in fns}
        rows.append({"shape": [M, N, K], "pickany": pick.metadata.kernel_name, "ms": med, "runs": runs,
                     "rel_error": errors, "grids": grids})
        cub = med["cublas"]
        line = f"bf16 {M}x{N}x{K} tnt: " + ", ".join(f"{k} {v * 1e3:.1f} us ({cub / v:.2f}x)" for k, v in
                                                      sorted(med.items(), key=lambda kv: kv[1]))
        print(line, flush=True)
        lines.append(line)
        bad = {k: v for k, v in errors.items() if not v < 1e-2}
        if bad:
            print(f"  WRONG: {bad}", flush=True)
            lines.append(f"  WRONG: {bad}")
        del sets, args
        torch.cuda.empty_cache()
    doc = {"device": device, "argv": sys.argv, "results": rows}
    write_result_with_text(result_name("split-aligned-probe", device, opts.tag), doc, lines)


if __name__ == "__main__":
    main()
