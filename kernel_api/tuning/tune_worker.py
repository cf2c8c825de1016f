"""The tuning worker of `kernel_api.tuning.scale.tune_shapes`: one process per GPU.

Started as ``python -m kernel_api.tuning.tune_worker`` with ``CUDA_VISIBLE_DEVICES`` naming its
one GPU (so the caller's ``__main__`` is never re-imported). It reads its job, one JSON line on
stdin: ``{"entries": [[index, kind, description], ...], "options": {TuneOptions' fields},
"records": path, "toolchain_key": key}``; tunes the entries on its GPU (`tune_shard`) with a
read-only view of the tuning records; and writes one JSON line per entry to stdout as it ends
(`ShapeTuning.to_json`). Anything libraries print goes to stderr, whose tail the parent reports
if the worker dies. A worker whose parent dies exits too.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time

_PARENT_POLL_S = 0.5


def _exit_with_parent(parent: int) -> None:
    while True:
        time.sleep(_PARENT_POLL_S)
        if os.getppid() != parent:
            os._exit(1)


def main() -> None:
    """Run one job from stdin (see the module docstring)."""
    # The protocol owns the original stdout; compilers and libraries print to stderr.
    reply = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), daemon=True,
                     name="kernel_api-parent-watch").start()
    job = json.loads(sys.stdin.readline())

    from .records import TuningRecords
    from .scale import ShapeTuning, TuneOptions, tune_shard

    records = TuningRecords(job["records"], toolchain_key=job["toolchain_key"], read_only=True)

    def done(result: ShapeTuning) -> None:
        reply.write(json.dumps(result.to_json()) + "\n")

    tune_shard([tuple(e) for e in job["entries"]], 0, TuneOptions(**job["options"]), records, done)
    reply.close()


if __name__ == "__main__":
    main()
