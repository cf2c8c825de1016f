"""Tuning across hosts with torch.distributed: ``torchrun ... -m kernel_api.tune --shapes FILE``.

Every rank reads the same problems and splits them the same way (`shard_by_cost` over the
world size, so no rank needs to send work to another); rank ``r`` tunes shard ``r`` on its
local GPU (``LOCAL_RANK``). The winners are all-gathered (`torch.distributed.all_gather_object`),
so every rank merges the full set into its own tuning records (the newer record wins per key:
`TuningRecords.merge`), and rank 0 writes them to the export file, which ``kernel-api records
import`` merges on any other machine.

The process group is initialised from torchrun's environment when the caller has not done it:
NCCL where CUDA is available (``NCCL_NVLS_ENABLE`` defaults to 0: the gathering needs no
NVLink multicast), else gloo.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any, Callable, Sequence

import torch

from ..core.errors import DeviceError
from .buckets import Bucket, bucket_reference
from .compile_worker import DEFAULT_COMPILE_TIMEOUT_S
from .policies import DEFAULT_POWER_STATE
from .records import TuningRecords, records_to_json, write_json_atomically
from .scale import ShapeTuning, TuneOptions, default_workers, describe_shapes, shard_by_cost, tune_shard, tuning_cost

_log = logging.getLogger(__name__)

#: ``shard_tuner(entries, device, options, records) -> results``: tunes ``(index, kind,
#: description)`` entries on a local CUDA device (`kernel_api.tuning.scale.tune_shard`'s
#: signature, without its callback); a test passes a stand-in that needs no GPU.
ShardTuner = Callable[[Sequence[tuple[int, str, dict]], int, TuneOptions, TuningRecords], list[ShapeTuning]]


def tune_distributed(shapes: Sequence[Any], *, export: str | os.PathLike | None = None,
                     max_candidates: int | None = 24, repeat: int = 30, num_workers: int | None = None,
                     force: bool = False, bucket: str | Bucket | None = None,
                     compile_timeout: float | None = DEFAULT_COMPILE_TIMEOUT_S, records: TuningRecords | None = None,
                     progress: Callable[[int, int, str], None] | None = None,
                     shard_tuner: ShardTuner | None = None, power_state: str = DEFAULT_POWER_STATE) -> list[ShapeTuning]:
    """Tune ``shapes`` across the ranks of a torch.distributed job; every rank returns the
    results of all of them and ends with every winner in its tuning records.

    Args:
        shapes: arguments objects, the same list on every rank (see `tune_shapes`).
        export: rank 0 writes every winner (`records_to_json`) to this JSON file.
        max_candidates, repeat, num_workers, force, bucket, compile_timeout, power_state: as in `tune_shapes`
            (``num_workers`` per rank).
        records: the store to read and merge into (default: the cache folder's).
        progress: called as ``progress(done, total, label)`` after each problem of this rank.
        shard_tuner: tunes this rank's shard (default: `tune_shard` on ``LOCAL_RANK``'s GPU).

    Raises:
        DeviceError: the default tuner on a rank without a CUDA GPU.
        RuntimeError: torch.distributed is not available in this torch build.
    """
    import torch.distributed as dist

    if not dist.is_available():
        raise RuntimeError("tune_distributed needs torch.distributed, which this torch build lacks")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if shard_tuner is None and not torch.cuda.is_available():
        raise DeviceError("tuning on the ranks needs a CUDA GPU on each of them (none is visible here)")
    described = describe_shapes(shapes)
    created = False
    if not dist.is_initialized():
        if torch.cuda.is_available():
            os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
            torch.cuda.set_device(local_rank)  # NCCL's object collectives use the current device
        dist.init_process_group(backend="nccl" if torch.cuda.is_available() else "gloo")
        created = True
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        shards = shard_by_cost([tuning_cost(a, repeat) for a in shapes], world)
        mine = [(i, *described[i]) for i in shards[rank]]
        options = TuneOptions(max_candidates, repeat, num_workers or default_workers(1), force,
                              bucket_reference(bucket), compile_timeout, power_state)
        store = records if records is not None else TuningRecords()
        reader = TuningRecords(store.path, toolchain_key=store.toolchain_key, read_only=True)
        if shard_tuner is None:
            done_count = [0]

            def done(result: ShapeTuning) -> None:
                done_count[0] += 1
                if progress is not None:
                    what = result.kernel_name if result.failure is None else f"failed: {result.failure}"
                    progress(done_count[0], len(mine), f"#{result.index}: {what}")

            ours = tune_shard(mine, local_rank, options, reader, done)
        else:
            ours = list(shard_tuner(mine, local_rank, options, reader))
        ours = [dataclasses.replace(r, rank=rank) for r in ours]
        _log.info("rank %d of %d tuned %d of %d problems", rank, world, len(ours), len(shapes))
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, ours)
        results = sorted((r for part in gathered for r in part), key=lambda r: r.index)
        found = [r.record for r in results if r.record is not None]
        if found:
            store.merge(found)
        if rank == 0 and export is not None:
            write_json_atomically(export, records_to_json(found))
        dist.barrier()  # the export exists before any rank returns
        return results
    finally:
        if created:
            dist.destroy_process_group()
