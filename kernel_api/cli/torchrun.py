"""``python -m kernel_api.tune`` (under torchrun): the command line of
`kernel_api.tuning.distributed.tune_distributed`; see `kernel_api.tune`."""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Sequence

from ..tuning.distributed import ShardTuner, tune_distributed
from .errors import exit_status, one_line
from .precompile import entry_arguments, load_shapes, report_tuning


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m kernel_api.tune",
                                     description="Tune a shapes file on every rank of a torchrun job.")
    parser.add_argument("--shapes", required=True, help="JSON list of problems (the format of "
                                                        "`kernel-api precompile --shapes`)")
    parser.add_argument("--export", default=None, help="rank 0 writes every winner's tuning record here (JSON)")
    parser.add_argument("--max-candidates", type=int, default=24, help="candidates per problem (default 24)")
    parser.add_argument("--repeat", type=int, default=30, help="timed runs per candidate (default 30)")
    parser.add_argument("--workers", type=int, default=None, help="compile processes per rank")
    parser.add_argument("--force", action="store_true", help="measure problems that already have a record")
    parser.add_argument("--bucket", default=None, help="record per shape bucket, e.g. pow2_m")
    parser.add_argument("--debug", action="store_true", help="on an error, the traceback")
    return parser


def main(argv: Sequence[str] | None = None, shard_tuner: ShardTuner | None = None) -> int:
    """Run one rank; returns its exit status (1 when a problem failed). ``shard_tuner`` replaces
    the GPU tuning of this rank's shard (`tune_distributed`)."""
    ns = make_parser().parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    try:
        if ns.max_candidates < 1 or ns.repeat < 1 or (ns.workers is not None and ns.workers < 1):
            raise ValueError("--max-candidates, --repeat and --workers must be >= 1")
        entries = load_shapes(ns.shapes)
        arguments = [entry_arguments(e, i, f"shapes file {ns.shapes}") for i, e in enumerate(entries)]
        progress = None
        if os.environ.get("LOCAL_RANK", "0") == "0":
            from .progress import progress as make_progress

            progress = make_progress(f"tune (rank {rank})")
        start = time.perf_counter()
        results = tune_distributed(arguments, export=ns.export, max_candidates=ns.max_candidates, repeat=ns.repeat,
                                   num_workers=ns.workers, force=ns.force, bucket=ns.bucket, progress=progress,
                                   shard_tuner=shard_tuner)
        seconds = time.perf_counter() - start
    except Exception as exc:
        status = exit_status(exc)
        if status is None or ns.debug:
            raise
        print(f"[rank {rank}] {one_line(exc)}", file=sys.stderr)
        return status
    failed = sum(r.failure is not None for r in results)
    if rank == 0:
        report_tuning(entries, results)
        ranks = len({r.rank for r in results})
        print(f"tuned {len(results) - failed} of {len(results)} problem(s) on {ranks} rank(s) in {seconds:.1f} s; "
              f"every rank merged the winners into its tuning records"
              + (f"; exported to {ns.export}" if ns.export else ""))
    return 1 if failed else 0

