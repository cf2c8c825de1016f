"""Choosing one kernel among the candidates: `PickAny` (analytic, no running; defined in
`pick_any`, from the estimates of `kernel_api.cost`) and `PickBest` (compile in worker
processes, verify, time, record).

``PickBest`` compiles candidates in parallel *worker processes* for the target cc; each
worker fills the on-disk artifact caches, so the parent then loads every candidate in
milliseconds instead of compiling them one after another. The workers are our own entry
point (`kernel_api.tuning.compile_worker`), so tuning from a script without an
``if __name__ == "__main__":`` guard does not re-run the script.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch

from .. import registry
from ..core.arch import device_cc
from ..arguments import GemmArguments, SoftmaxArguments, SoftmaxBackwardArguments
from ..arguments.base import unbound_copy
from ..core.dtypes import DataType
from ..core.errors import NoKernelFoundError
from ..cost import gpu_floor_ms
from ..kernel import Kernel
from ..registry.versions import provider_versions
from .buckets import PREFIX as _BUCKET_PREFIX, Bucket, resolve_bucket
from .pick_any import PickAny, Policy, describe_problem, rank_candidates
from .records import RecordContext, RecordKey, TuningRecord, TuningRecords, record_key, toolchain_versions
from .reference import output_of, random_like, reference, tolerance
from .scope import current
from .timing import (QueuedTiming, check_timing, finite_norm, relative_error_tensor, rotation_count, time_interleaved,
                     time_own_state)

# The analytic model's names stay importable from the policies, which rank by them.
from ..cost import (GEMM_COST_UNITS_PER_SECOND, SKINNY_GEMM, TILE_STREAM_BYTES_PER_SECOND,  # noqa: F401
                    estimated_cost, fixed_row_cost, gemm_bytes, gemm_cost, row_cost, row_problem_bytes,
                    single_trip, streaming_floor, tile_work_cost)
from ..cost.gemm import CLUSTER_ALONG_LONG_SIDE, CLUSTER_PAST_THE_TILES, COOPERATIVE_EPILOGUE_K  # noqa: F401
from ..cost.rows import (CLUSTER_CTA_ALONE, CLUSTER_PACKING, CLUSTER_SYNC_BYTES_PER_THREAD,  # noqa: F401
                         PEELED_ROWS, REGISTER_ROW_ALONE_ELEMENTS, REGISTER_ROW_ALONE_FORWARD,
                         REGISTER_ROW_LONE_SHARE, STAGED_ROW_LATENCY_BYTES)

_log = logging.getLogger(__name__)


#: Whether `PickBest` times its candidates against each other in rounds (`time_interleaved`:
#: drift hits all alike) instead of one after the other. On: measured on 2 H100s
#: (benchmarks/tune_scale.py), later single-GPU tunings agreed with the first on 15-16 of 16
#: winners against 14-15 timed one after the other, in the same wall time.
_INTERLEAVE = True

#: Whether `PickBest` launches each newly loaded artifact once before queueing the reference
#: (`PickBest._first_launches`). On: measured on 2 H100s (benchmarks/tune_scale.py),
#: the 2-GPU rounds went from 1.01-1.29 s (one thread stalled behind the other's first
#: launches) to 1.00-1.15 s, and 0.99-1.05 s in the final run.
_FIRST_LAUNCH_EARLY = True

#: Whether `PickBest` loads the next candidate while the GPU times the current one (a switch
#: for benchmarks/tune_scale.py's comparison).
_PREFETCH_NEXT = True

#: GPU time (ms) of untimed rounds `PickBest` runs before its timed ones (`time_interleaved`'s
#: ``settle_ms``), so it ranks the candidates in the power state of sustained work. Measured on
#: an H200 (docs/performance.md, "Power state"): tf32 4096^3 GEMMs ran 17-22 % slower after
#: ~100 ms back to back than in the first ~40 ms, and the fastest tile differed between the
#: two; rounds that start within that step rank four tiles as a tie.
_SETTLE_MS = 200.0

#: The operations whose candidates `PickBest` compiles in worker processes, one pool per problem:
#: their CuTe DSL tiles take seconds each to compile cold. The other operations' candidates
#: (NVRTC, Triton, QuACK, torch) compile in well under a second each (benchmarks/providers.py's
#: compile_s on an H200: 0.1-0.9 s), less than a worker's start (importing torch and the
#: plugin's library), and the kernels whose compile is not disk-cached (torch's, Triton's) would
#: start one at every new problem; they compile in the tuning process. `tune_shapes` and
#: `precompile`, which start one pool for many problems, take every operation.
WORKER_COMPILED = (GemmArguments, SoftmaxArguments, SoftmaxBackwardArguments)

#: `PickBest`'s timings: the candidates in turn at one shared clock, or each in its own power state.
POWER_STATES = ("shared", "own")
#: `PickBest`'s timing unless told otherwise. "own": over the aligned bf16 group of
#: benchmarks/gemm_shapes.py its choices ran 0.99-1.02x cuBLAS launched in turn with it on an H100
#: and an H200, where "shared"'s ran down to 0.85x on the H100 (a tile that waits on DRAM, ranked
#: first at the low clock of ten power-hungry candidates); each kernel on its own (H200), "own"'s
#: geomean 0.99x, "shared"'s 0.97x (docs/performance.md, "SM90 GEMM tiles").
DEFAULT_POWER_STATE = "own"


def check_power_state(power_state: str) -> str:
    """``power_state`` when it names one of `POWER_STATES`, else a ValueError saying so."""
    if power_state not in POWER_STATES:
        raise ValueError(f"power_state must be 'shared' or 'own', got {power_state!r}")
    return power_state


#: `PickBest`'s timing unless told otherwise (`kernel_api.tuning.timing.TIMINGS`): "as_called"
#: charges each candidate the host time of its calls where that outlasts its kernel, as a loop
#: of `kernel_api.ops` calls is charged. Measured on an H200 at bf16 1x1024x1024 (x @ W.t()): the
#: small-M kernel is the fastest on the GPU (6.2 us; the Sm90 64x64 tiles 6.7-6.9) but its calls
#: through ops take 18.7 us back to back (a cubin launched from Python), the Sm90 tiles' (replayed
#: from C) 7.9-8.0 us; "device" ranks the first ahead, "as_called" the others. "device"
#: remains the choice for code that replays CUDA graphs.
DEFAULT_TIMING = "as_called"

_cublas_allows_tf32 = torch._C._get_cublas_allow_tf32


def math_setting(args: Any) -> str:
    """The math a setting allows for ``args``' kernels (`RecordContext.math`): ``"tf32"`` while
    torch allows TF32 matmuls (``torch.backends.cuda.matmul.allow_tf32``, float32 matmul
    precision "high" or "medium") and ``"f32"`` otherwise, for f32 GEMMs and for any other
    problem with an f32 matrix operand; ``"native"`` for problems no setting changes. Not only
    GEMMs: a kernel of any operation may multiply matrices through torch (the linear
    cross-entropy's chunks, attention's torch kernel), and which kernels do is theirs to know,
    not the arguments'."""
    if isinstance(args, GemmArguments):
        f32 = args.tensor_attributes["A"].dtype is DataType.f32
    else:
        f32 = any(a.dtype is DataType.f32 and len(a.stride) >= 2 for a in args.tensor_attributes.values())
    if f32:
        return "tf32" if _cublas_allows_tf32() else "f32"
    return "native"


@dataclass
class Measurement:
    kernel_name: str
    median_ms: float | None = None
    error: float | None = None
    failure: str | None = None


@dataclass
class TuneResult:
    """What `PickBest.tune` found: the winner, every candidate's measurement, whether it came
    from a tuning record, and the record (found, or written by this tuning; None when the
    policy keeps no records)."""

    winner: Kernel
    measurements: list[Measurement] = field(default_factory=list)
    from_record: bool = False
    record: TuningRecord | None = None


class PickBest(Policy):
    """Compile candidates (in parallel worker processes), verify each on fresh random data
    against a reference, time them with CUDA events (median, rotating inputs), record the
    winner in the tuning records, and reuse a record when one exists.

    Any operation: the inputs are `kernel_api.tuning.reference.random_like`'s (an arguments
    type's own `Arguments.random_like` beyond GEMM and softmax), and every output is compared
    with the float64 `reference` where one is known, else with the torch provider's kernel's
    outputs on the same inputs (`TORCH_PROVIDER`, twice the tolerance), else checked to be
    finite. A candidate whose result is wrong is excluded and logged (a warning naming what it
    was compared with); it is never chosen. ``max_candidates`` keeps the best-ranked
    candidates and every provider's best-ranked one (`shortlist`).

    ``num_workers``: compile processes (default: the `settings` scope's, else up to 8);
    ``compile_timeout``: seconds one compile may take in a worker before it is stopped and the
    kernel reported as failed (None: no limit).

    ``settle_ms`` (default `_SETTLE_MS`, 200): GPU time of untimed launches before the timed
    ones, so the winner is the fastest in the power state of sustained work (a training step's
    GEMMs back to back). On a power-capped GPU that state can rank kernels differently from the
    first tens of ms after idle: at tf32 4096^3 on an H200 the ping-pong tile won the one and
    lost the other by 12 % (docs/performance.md, "Power state"). 0 times from whatever state
    the GPU is in.

    ``power_state``: how the candidates are timed. ``"own"`` (the default,
    `DEFAULT_POWER_STATE`) times each after ``settle_ms`` of its own back-to-back launches
    (`time_own_state`), so each runs at the clock its own power draw allows, and the fastest is
    the one that finishes soonest when it alone runs back to back on a power-capped GPU: for
    large GEMMs in a sustained workload, a kernel that draws more power per cycle slows
    everything at the cap. ``"shared"`` times the candidates in turn after ``settle_ms`` of
    untimed rounds (`time_interleaved`), so all run at one clock and the fastest is the one that
    needs the fewest cycles at the clock their mix sets. The two differ by up to 20 %
    (docs/performance.md, "Power state": on an H100 a bf16 ping-pong tile ran 0.78x cuBLAS on
    its own), and the shared clock depends on which candidates are measured: on an H100 at bf16
    4096x4096x14336, ten tiles mostly of the power-hungry ping-pong kind ranked one first that
    ran 0.85x cuBLAS beside cuBLAS. Over the aligned bf16 group of benchmarks/gemm_shapes.py,
    launched in turn with cuBLAS, ``"own"``'s choices ran 0.99-1.02x cuBLAS on an H100 and an
    H200, ``"shared"``'s 1.00-1.06x on the H200 and 0.85-1.03x on the H100; each kernel on its
    own (H200), geomean 0.99x against 0.97x (docs/performance.md, "SM90 GEMM tiles"). ``"own"``
    costs ``settle_ms`` of GPU time per candidate twice (``"shared"``: once in all): about 5 s
    for 10-24 candidates of a large GEMM, once per shape (the winner is recorded).

    ``timing`` (default `DEFAULT_TIMING`, ``"as_called"``): what a sample holds, in either power
    state (`kernel_api.tuning.timing.TIMINGS`). ``"as_called"`` times runs of back-to-back calls
    through the kernel's recorded launch (its `Launcher`, which `kernel_api.ops` records too),
    nothing queued ahead of them (its own settle launches and earlier samples waited for): a
    kernel whose calls cost the host more than the GPU is charged the host's time, as a loop of
    `kernel_api.ops` calls is, and any other its first call's host latency once per run.
    ``"device"`` times GPU work
    only (each call queued behind a GPU spin): for code that captures its calls in CUDA graphs
    and replays them, where the host's work is done once.

    A record is keyed on everything that changes the candidates or their ranking besides the
    problem (`record_context`): the math torch allows for f32 matrices (TF32), the providers of
    the `kernel_api.settings` scope and their versions (``Provider.version``: a plugin's new
    release re-tunes), ``timing``, ``power_state``, a ``settle_ms`` other than the default and
    ``max_candidates`` where it leaves candidates out. A winner is never reused under a setting
    its measurement did not cover.

    ``bucket`` keys the records by a range of shapes instead of the exact shape (see
    `kernel_api.tuning.buckets`): ``"pow2_m"`` (M, or a softmax's rows, in power-of-two buckets
    65..128, 129..256, ...; everything else exact), ``"module:function"`` or a function
    ``(args) -> bucket label or None``. Lookups try the exact shape's record first, then the
    bucket's. The first shape met in a bucket is tuned with the caller's own arguments and its
    winner recorded for the bucket; a later shape in the bucket reuses it without measuring, as
    long as the winner supports the new arguments. When it does not (a kernel whose
    ``_supports`` limits M, met at an M of the bucket outside that limit), the new shape is
    tuned and recorded under its exact shape, and the bucket's record stays.

    When is a bucket's winner the right one? It is exact when the candidates' relative speed
    does not change within the bucket: every M of the bucket fills the same number of tile rows
    for every candidate (M at most the smallest tile's M, as in decode: buckets up to 64 with
    64-row tiles), or the kernels' time does not depend on M (a small-M GEMM limited by reading
    B). Otherwise it is a heuristic: a tile's utilisation and the wave count (``ceil(M / tile_m)``
    tile rows over the SMs) change within the bucket, so the kernel measured at the bucket's
    first M can be a few percent behind the best one at another M; tune the sizes that matter
    most exactly (``tune_shapes`` or `tune` without a bucket), since exact records win.
    To make a bucket's record independent of traffic order, tune it ahead of time with the
    bucket's largest M (``kernel-api tune --shapes``, ``tune_shapes(..., bucket="pow2_m")``).
    """

    def __init__(self, num_workers: int | None = None, max_candidates: int | None = 24, repeat: int = 30,
                 records: TuningRecords | None = None, use_records: bool = True,
                 progress: Callable[[int, int, str], None] | None = None,
                 compile_timeout: float | None = 900.0, bucket: str | Bucket | None = None,
                 settle_ms: float = _SETTLE_MS, power_state: str = DEFAULT_POWER_STATE,
                 timing: str = DEFAULT_TIMING) -> None:
        self.num_workers = num_workers
        self.settle_ms = settle_ms
        self.power_state = check_power_state(power_state)
        self.timing = check_timing(timing)
        self.bucket = resolve_bucket(bucket)
        self.compile_timeout = compile_timeout
        self.max_candidates = max_candidates
        self.repeat = repeat
        self.records = records
        self.use_records = use_records
        self.progress = progress
        self._loaded: dict[tuple, tuple[Kernel, Any]] = {}
        self._launched: set[int] = set()  # id() of the artifacts in _loaded launched once already

    def choose(self, args: Any, candidates: list[Kernel]) -> Kernel:
        return self.tune(args, candidates).winner

    def _records(self) -> TuningRecords:
        if self.records is None:
            self.records = TuningRecords()
        return self.records

    def _device(self, args: Any) -> tuple[str, int]:
        """(device name, cc) of the GPU that ``args`` run on: the records' key."""
        if not torch.cuda.is_available() or args.device.type != "cuda":
            raise RuntimeError("PickBest needs a CUDA GPU and CUDA tensors; PickAny ranks kernels without one")
        return torch.cuda.get_device_name(args.device), device_cc(args.device.index)

    def record_context(self, args: Any, candidates: Iterable[Kernel] = ()) -> RecordContext:
        """What ``args``' record is keyed on besides the problem.

        Args:
            args: the problem.
            candidates: the kernels chosen among; the providers of any outside the scope (a
                `Registry` of your own) are keyed on too.

        Returns:
            The `RecordContext`: the math allowed (`math_setting`), the providers of the current
            `kernel_api.settings` scope, this policy's timing and power state (and ``settle_ms``
            where it is not the default), the versions of the scope's providers (every
            registered one where the scope names none) and the candidates'
            (`candidate_versions`), and ``max_candidates`` where it leaves candidates out.
        """
        scope = current().providers
        timing = f"{self.timing}/{self.power_state}"
        if self.settle_ms != _SETTLE_MS:
            timing += f"/settle={self.settle_ms:g}"
        candidates = list(candidates)
        limit = self.max_candidates if self.max_candidates is not None and len(candidates) > self.max_candidates \
            else None
        return RecordContext(math_setting(args), scope, timing, candidate_versions(scope, candidates), limit)

    def _record_key(self, args: Any, bucketed: bool = False, candidates: Iterable[Kernel] = ()) -> RecordKey | None:
        """The key of ``args``' record (`kernel_api.tuning.records.record_key` under
        `record_context`), or with ``bucketed`` its bucket's (None: no bucket, or none for them)."""
        if not bucketed:
            return record_key(args, self.record_context(args, candidates))
        label = None if self.bucket is None else self.bucket(args)
        return None if label is None else record_key(args, self.record_context(args, candidates),
                                                     _BUCKET_PREFIX + label)

    def _find_record(self, args: Any, candidates: list[Kernel], device_name: str,
                     cc: int) -> tuple[TuneResult | None, RecordKey]:
        """(the result a usable tuning record gives, or None; the key a new measurement of
        ``args`` is recorded under)."""
        exact = self._record_key(args, candidates=candidates)
        bucket = self._record_key(args, bucketed=True, candidates=candidates)
        store_key = bucket or exact
        if not self.use_records:
            return None, store_key
        for key in (exact, bucket) if bucket else (exact,):
            found = self._records().lookup(device_name, cc, key.operation, key.shape)
            if found is None:
                continue
            kernel = next((k for k in candidates if k.metadata.kernel_name == found.kernel_name), None)
            if kernel is not None and kernel.supports(args):
                _log.debug("PickBest: tuning record %s for %s on %s: %s (%.4f ms)", key.shape, describe_problem(args),
                           device_name, found.kernel_name, found.median_ms)
                return TuneResult(kernel, [Measurement(found.kernel_name, found.median_ms)], from_record=True,
                                  record=found), store_key
            _log.debug("PickBest: the tuning record %s's %s does not support %s; tuning it", key.shape,
                       found.kernel_name, describe_problem(args))
            if key == bucket:
                store_key = exact  # the bucket's winner stays for the shapes it suits
        return None, store_key

    def recorded(self, args: Any, candidates: list[Kernel] | None = None) -> TuneResult | None:
        """What `tune` would take from the tuning records for ``args`` without measuring (the
        exact shape's record, else the bucket's, if its kernel is among ``candidates`` and
        supports ``args``), or None."""
        device_name, cc = self._device(args)
        if candidates is None:
            candidates = self._candidates(args)
        return self._find_record(args, candidates, device_name, cc)[0]

    @staticmethod
    def _candidates(args: Any) -> list[Kernel]:
        """Every kernel supporting ``args`` among the providers of the current `kernel_api.settings`
        scope (those its records are keyed on)."""
        return registry.get_kernels(args, providers=current().providers)

    def tune(self, args: Any, candidates: list[Kernel] | None = None, force: bool = False) -> TuneResult:
        """Choose the fastest correct kernel of ``candidates`` (default: every kernel supporting
        ``args`` among the current `kernel_api.settings` scope's providers) for ``args``: from a
        tuning record when one exists (exact shape first, then the bucket's; ``force`` measures
        anyway), else by measuring them, recording the winner under the bucket's key (or the
        exact shape's, see the class docstring)."""
        device_name, cc = self._device(args)
        if candidates is None:
            candidates = self._candidates(args)
        if not candidates:
            raise registry.no_kernel_error(args)
        if force:  # measure, and record for the bucket (re-tuned with these arguments) or the shape
            store_key = (self._record_key(args, bucketed=True, candidates=candidates)
                         or self._record_key(args, candidates=candidates))
        else:
            found, store_key = self._find_record(args, candidates, device_name, cc)
            if found is not None:
                return found
        ranked = shortlist(rank_candidates(candidates, args), self.max_candidates)
        self._precompile(args, ranked, cc)
        measurements = self._measure(args, ranked)
        good = [m for m in measurements if m.failure is None]
        if not good:
            details = "; ".join(f"{m.kernel_name}: {m.failure}" for m in measurements[:5])
            raise NoKernelFoundError(f"PickBest: every candidate failed to compile or verify ({details})")
        good.sort(key=lambda m: m.median_ms)
        winner = next(k for k in ranked if k.metadata.kernel_name == good[0].kernel_name)
        _log.info("PickBest: %s wins for %s on %s at %.4f ms (%d of %d candidates verified; next: %s)",
                  good[0].kernel_name, describe_problem(args), device_name, good[0].median_ms, len(good),
                  len(measurements), ", ".join(f"{m.kernel_name} {m.median_ms:.4f} ms" for m in good[1:4]) or "none")
        for m in measurements:
            if m.failure is not None:  # a wrong result is news; a kernel that does not build here is not
                level = logging.WARNING if m.error is not None else logging.DEBUG
                _log.log(level, "PickBest: %s excluded for %s: %s", m.kernel_name, describe_problem(args), m.failure)
        record = None
        if self.use_records:
            record = self._records().record(device_name, cc, store_key.operation, store_key.shape,
                                            good[0].kernel_name, good[0].median_ms,
                                            {m.kernel_name: m.median_ms for m in good[1:]}, toolchain_versions())
        return TuneResult(winner, measurements, record=record)

    def _worker_count(self) -> int:
        """This policy's ``num_workers``, else the current `settings`' one, else up to 8 (by CPUs)."""
        if self.num_workers is not None:
            return self.num_workers
        scoped = current().num_workers
        return scoped if scoped is not None else min(8, os.cpu_count() or 1)

    def _precompile(self, args: Any, kernels: list[Kernel], cc: int) -> dict[str, str | None]:
        """Compile ``kernels`` in worker processes into the disk caches (see
        `kernel_api.tuning.compile_worker.compile_in_workers`); returns each worker-compiled kernel's
        failure message or None. Kernels left out are compiled by `_measure` in this process, as
        are all the candidates of operations outside `WORKER_COMPILED`."""
        workers = self._worker_count()
        if workers <= 1 or len(kernels) <= 1 or not isinstance(args, WORKER_COMPILED):
            return {}
        from .compile_worker import compile_in_workers  # not at import: the worker module runs as __main__

        return compile_in_workers(args, kernels, cc, workers, progress=self.progress, timeout=self.compile_timeout)

    def _artifact(self, kernel: Kernel, args: Any) -> Any:
        """``kernel``'s artifact for ``args``: loaded once per policy, device and compile key, so
        tuning many shapes loads each kernel once (a load from the disk cache costs 2-3 ms of
        host time, and the first launch of what it loaded waits for the GPU)."""
        key = (id(kernel), args.device_index, kernel.compile_key(args, device_cc(args.device_index)))
        found = self._loaded.get(key)
        if found is None:
            found = self._loaded[key] = (kernel, kernel.compile(args))
        return found[1]

    def _first_launches(self, kernels: list[Kernel], check: Any, artifacts: dict[int, Any],
                        early: dict[int, Exception], load: Callable[[int], None]) -> None:
        """Launch once each candidate whose artifact has not run on this device yet, before the
        float64 reference is queued: a CuTe DSL artifact's first launch waits for all work queued
        on the GPU, holding the GIL (docs/performance.md, "Tuning at scale"), so behind a reference
        GEMM it would stall every other tuning thread of this process as well."""
        for index, kernel in enumerate(kernels):
            load(index)
            artifact = artifacts.get(index)
            if artifact is None or id(artifact) in self._launched:
                continue
            self._launched.add(id(artifact))
            try:
                kernel.run(unbound_copy(check), compiled_artifact=artifact)
            except Exception as exc:  # reported when the check pass reaches this candidate
                early[index] = exc
                artifacts.pop(index)

    def _verification(self, check: Any, kernels: list[Kernel], artifacts: dict[int, Any],
                      load: Callable[[int], None]) -> _Verification:
        """How each candidate's result on ``check`` is verified (`_Verification`): against
        `reference` (float64) where it knows the operation, else against the outputs of the
        torch provider's kernel (a candidate's, or one found for the purpose), else only for
        finite, written outputs (logged)."""
        expected = reference(check)
        if isinstance(expected, torch.Tensor):
            return _Verification.single(output_of, check, expected.double())
        verification = _Verification.of_outputs(check)
        if expected is not None:
            return verification.against(expected, "the float64 reference")
        found = self._torch_reference(check, kernels, artifacts, load)
        if found is None:
            _log.warning("PickBest: no reference for %s (no float64 one, no torch provider kernel): its candidates "
                         "are checked for finite, written outputs only", describe_problem(check))
            return verification.against({}, "no reference (finite outputs only)")
        kernel, artifact = found
        verification.reset()
        kernel.run(unbound_copy(check), compiled_artifact=artifact)
        outputs = {name: t.double().clone() for name, t in verification.outputs.items()}
        return verification.against(outputs, f"the torch provider's {kernel.metadata.kernel_name}", loosen=2.0)

    def _torch_reference(self, check: Any, kernels: list[Kernel], artifacts: dict[int, Any],
                         load: Callable[[int], None]) -> tuple[Kernel, Any] | None:
        """(kernel, artifact) of the torch provider's kernel for ``check``: a candidate's when
        one is the torch provider's, else the best-ranked the registry has; None when there is
        none or it does not load."""
        for index, kernel in enumerate(kernels):
            if provider_name(kernel) == TORCH_PROVIDER:
                load(index)
                if index in artifacts:
                    return kernel, artifacts[index]
        try:
            found = registry.get_kernels(check, providers=[TORCH_PROVIDER])
        except ValueError:  # no torch provider registered (a registry without it)
            return None
        for kernel in rank_candidates(found, check):
            try:
                return kernel, self._artifact(kernel, check)
            except Exception as exc:
                _log.debug("PickBest: the torch provider's %s does not load as a reference: %s",
                           kernel.metadata.kernel_name, _failure(exc))
        return None

    def _measure(self, args: Any, kernels: list[Kernel]) -> list[Measurement]:
        """Verify and time each of ``kernels`` on fresh random data (see the class docstring).

        In two passes over the candidates, so the GPU waits for the host only in the first:

        1. verify: load each candidate (the next one while the GPU runs this one's check) and
           queue its check (NaN-filled output, one run, the error computed on the GPU and copied
           back without waiting). A kernel's first launch loads its module into the CUDA
           context, which waits for all work queued before it (the whole queue, on an H100:
           docs/performance.md, "Tuning at scale"), so no timed launches are queued yet;
        2. time: with `_INTERLEAVE` (the default), every verified candidate once per round
           (`time_interleaved`), after ``settle_ms`` of untimed rounds, or with ``power_state``
           ``"own"`` each in its own power state (`time_own_state`), either as ``timing`` says
           (each candidate's calls through its bound launch, `Kernel.run` with the arguments it
           ran before: the `Launcher` that `kernel_api.ops` records too); otherwise (GPU time only) each
           candidate's timed launches (`QueuedTiming`) queued while the GPU runs the previous
           ones, at most two candidates ahead (a full launch queue would block the host inside
           a launch), and their samples read.

        With `_FIRST_LAUNCH_EARLY` (the default), artifacts new to this policy are launched once
        before the reference is queued (`_first_launches`).
        """
        sets = rotation_count(sum(t.numel() * t.element_size() for t in args.tensors().values()))
        inputs = [random_like(args) for _ in range(sets)]
        check = random_like(args)
        results: list[Measurement | None] = [None] * len(kernels)
        artifacts: dict[int, Any] = {}
        early: dict[int, Exception] = {}

        def load(index: int) -> None:
            if index < len(kernels) and index not in artifacts and index not in early:
                try:
                    artifacts[index] = self._artifact(kernels[index], check)
                except Exception as exc:  # reported when that candidate's turn comes
                    early[index] = exc

        if _FIRST_LAUNCH_EARLY:
            self._first_launches(kernels, check, artifacts, early, load)
        verify = self._verification(check, kernels, artifacts, load)
        floor_ms = gpu_floor_ms(args)
        # Errors come back through pinned memory: reading a GPU scalar (.item()) would wait for
        # everything queued after it.
        errors = torch.empty(len(kernels), dtype=torch.float64, pin_memory=torch.cuda.is_available())

        def fail(index: int, exc: BaseException) -> None:
            results[index] = Measurement(kernels[index].metadata.kernel_name, failure=_failure(exc))
            artifacts.pop(index, None)

        for index, kernel in enumerate(kernels):  # 1. verify
            load(index)
            try:
                if index in early:
                    raise early[index]
                verify.reset()
                kernel.run(unbound_copy(check), compiled_artifact=artifacts[index])
                errors[index].copy_(verify.error(), non_blocking=True)
            except Exception as exc:
                fail(index, exc)
            if _PREFETCH_NEXT:
                load(index + 1)

        def finish(index: int, summary: Callable[[], dict] | None) -> None:
            """Record candidate ``index`` from ``summary()`` (its timing; None: it failed before)."""
            kernel = kernels[index]
            if summary is not None:
                try:
                    median_ms = summary()["median_ms"]  # may wait for this candidate's last launch
                    err = float(errors[index])  # copied before any timed launch
                    tol = tolerance(check, kernel) * verify.loosen
                    name = kernel.metadata.kernel_name
                    results[index] = (Measurement(name, median_ms, err) if err <= tol else
                                      Measurement(name, error=err,
                                                  failure=f"wrong result: relative error {err:.2e} > {tol:.0e} "
                                                          f"against {verify.source}"))
                except Exception as exc:
                    fail(index, exc)
            if self.progress:
                self.progress(index + 1, len(kernels), kernel.metadata.kernel_name)

        if _INTERLEAVE:  # 2. time, every verified candidate in each round
            timed = {index: _timed_run(kernels[index], [unbound_copy(a) for a in inputs], artifacts[index])
                     for index in range(len(kernels)) if index in artifacts}
            timer = time_own_state if self.power_state == "own" else time_interleaved
            found = timer(timed, sets, repeat=self.repeat, gpu_floor_ms=floor_ms, settle_ms=self.settle_ms,
                          timing=self.timing)
            for index in range(len(kernels)):
                got = found.get(index)
                if isinstance(got, Exception):
                    fail(index, got)
                finish(index, None if got is None or isinstance(got, Exception) else (lambda got=got: got))
            return [m for m in results if m is not None]
        queued: dict[int, QueuedTiming] = {}
        for index, kernel in enumerate(kernels):  # 2. time
            if index in artifacts:
                own = [unbound_copy(a) for a in inputs]  # this kernel binds its own fast launch to them
                try:
                    queued[index] = QueuedTiming(_timed_run(kernel, own, artifacts[index]), sets,
                                                 repeat=self.repeat, gpu_floor_ms=floor_ms)
                except Exception as exc:
                    fail(index, exc)
            if index >= 2:
                waiting = queued.pop(index - 2, None)
                finish(index - 2, waiting and waiting.result)
        for index in range(max(0, len(kernels) - 2), len(kernels)):
            waiting = queued.pop(index, None)
            finish(index, waiting and waiting.result)
        return [m for m in results if m is not None]


#: The provider whose kernels verify candidates where no float64 reference is known: torch's
#: own operators, the semantics every other provider's kernels must match.
TORCH_PROVIDER = "torch"


class _Verification:
    """How `PickBest` verifies each candidate on the check arguments: ``reset()`` before a
    candidate runs (outputs NaN, outputs written in place over an input given the input's values
    back), ``error()`` after (the largest relative error over the compared outputs, a 0-d
    float64 tensor computed without waiting for the GPU; inf for a NaN or inf output). ``loosen``
    scales the tolerance (2 when the expected values are another kernel's, with rounding errors
    of their own); ``source`` names what the outputs are compared with."""

    def __init__(self, outputs: dict[str, torch.Tensor], fills: list[torch.Tensor],
                 restore: list[tuple[torch.Tensor, torch.Tensor]], single: Callable[[], Any] | None = None) -> None:
        self.outputs, self._fills, self._restore, self._single = outputs, fills, restore, single
        self._expected: list[tuple[str | None, torch.Tensor, torch.Tensor]] = []
        self.loosen, self.source = 1.0, ""

    @classmethod
    def single(cls, output_of: Callable[[Any], Any], check: Any, expected: torch.Tensor) -> _Verification:
        """GEMM and softmax: their one output (``output_of(check)``) against float64 ``expected``."""
        return cls({}, [], [], single=lambda: output_of(check)).against({None: expected}, "the float64 reference")

    @classmethod
    def of_outputs(cls, check: Any) -> _Verification:
        """Every output of ``check`` (``output_names``), not yet compared with anything."""
        tensors = check.tensors()
        names = type(check).output_names
        inputs = [t for name, t in tensors.items() if name not in names]
        outputs = {name: tensors[name] for name in names}
        fills, restore = [], []
        for t in outputs.values():
            same = next((i for i in inputs if i.numel() and i.data_ptr() == t.data_ptr() and i.shape == t.shape
                         and i.stride() == t.stride()), None)
            if same is not None:  # written in place over an input: that input's values come back
                restore.append((t, same.clone()))
            elif t.numel():
                fills.append(t)
        return cls(outputs, fills, restore)

    def against(self, expected: dict[Any, torch.Tensor], source: str, loosen: float = 1.0) -> _Verification:
        """This verification comparing each output named in ``expected`` with its value there;
        with none named, only checking that every output is finite."""
        self._expected = []
        for name, value in expected.items():
            value = value.double()
            self._expected.append((name, value, finite_norm(value)))
        self.source, self.loosen = source, loosen
        return self

    def reset(self) -> None:
        if self._single is not None:
            self._single().fill_(float("nan"))
            return
        for t in self._fills:
            t.fill_(float("nan") if t.is_floating_point() else -1)
        for t, values in self._restore:
            t.copy_(values)

    def error(self) -> torch.Tensor:
        if not self._expected:
            finite = [torch.isfinite(t).all() for t in self.outputs.values() if t.is_floating_point()]
            written = torch.stack(finite).all() if finite else torch.tensor(True)
            return torch.where(written, 0.0, float("inf")).double()
        errors = [relative_error_tensor(self._single() if name is None else self.outputs[name], value, norm)
                  for name, value, norm in self._expected]
        return errors[0] if len(errors) == 1 else torch.stack(errors).max()


def provider_name(kernel: Kernel) -> str | None:
    """The name of the provider ``kernel``'s class is registered with (None: none)."""
    return getattr(getattr(kernel, "_kernel_api_provider", None), "name", None)


def shortlist(ranked: list[Kernel], limit: int | None) -> list[Kernel]:
    """The candidates `PickBest` measures: the ``limit`` best-ranked of ``ranked`` (PickAny's
    order), where the best-ranked kernel of every provider is always one, so that the winner is
    never slower than any provider's best by an estimate's mistake (a provider whose kernels the
    analytic model ranks low: a plugin's, timed once at its measured speed). ``limit`` None:
    all. Rank order is kept.

    Args:
        ranked: the candidates, best-ranked first.
        limit: how many to keep (at least one per provider).

    Returns:
        The kept candidates, in ``ranked``'s order.
    """
    if limit is None or len(ranked) <= limit:
        return ranked
    firsts: dict[str | None, int] = {}
    for index, kernel in enumerate(ranked):
        firsts.setdefault(provider_name(kernel), index)
    kept = set(firsts.values())
    for index in range(len(ranked)):
        if len(kept) >= limit:
            break
        kept.add(index)
    return [kernel for index, kernel in enumerate(ranked) if index in kept]


def candidate_versions(scope: tuple[str, ...] | None, candidates: Iterable[Kernel] = ()) -> tuple[tuple[str, str], ...]:
    """The provider versions a tuning record is keyed on (`RecordContext.versions`).

    They are those of every provider whose kernels may be candidates: the scope's (with none
    named, every provider registered in the default registry), since a new release of a provider
    whose kernels lost may now win, and of the ``candidates``' providers outside it. Each
    provider's version is read once per process and the pairs built once per set of providers
    (`kernel_api.registry.versions`), so a lookup reads no installed distribution.

    Args:
        scope: the provider names of the `kernel_api.settings` scope (None: all).
        candidates: the kernels chosen among.

    Returns:
        (name, version) pairs, sorted by name.
    """
    registry.default_registry.load_plugins()  # the providers discovery would search
    chosen = set(registry.select_providers(scope))
    for kernel in candidates:
        provider = getattr(kernel, "_kernel_api_provider", None)
        if provider is not None:
            chosen.add(provider)
    return provider_versions(chosen)


def _timed_run(kernel: Kernel, own: list[Any], artifact: Any) -> Callable[[int], None]:
    """``run(i)``: ``kernel`` on input set ``i`` with checks off (verified before)."""
    return lambda j: kernel.run(own[j], compiled_artifact=artifact, assume_supported_args=True)


def _failure(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc)[:300]}"
