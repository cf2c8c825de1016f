"""``kernel-api precompile --shapes FILE --cc 90``, ``kernel-api tune --shapes FILE`` and
``kernel-api bundle create/install``: the shapes file and the commands.

The shapes file is a JSON list of problems::

    [{"op": "gemm", "m": 4096, "n": 4096, "k": 4096, "dtype": "bf16", "layout": "ttt"},
     {"op": "softmax", "rows": 32768, "cols": 4096, "dtype": "bf16"},
     {"op": "attention", "batch": 4, "heads": 32, "kv_heads": 8, "seqlen_q": 2048, "head_dim": 128,
      "causal": true}]

Every operation of `kernel_api.cli.problems.all_problems` has its fields there, with their defaults
(``dtype`` bf16, ``layout`` ttt, ``batch`` optional for a GEMM); ``kernel-api list OP --help``
shows them as options. Arguments are built on the ``meta`` device, so no GPU and no memory are
needed.
"""

from __future__ import annotations

import os
import sys
import tempfile
from typing import Any, Callable

from ..core.errors import KernelApiError
from ..core.files import read_json
from .problems import all_problems


class ShapesFileError(KernelApiError, ValueError):
    """A shapes file that cannot be used; the message names the file, the entry and the field."""


def load_shapes(path: str | os.PathLike) -> list[dict]:
    """The entries of a shapes file, checked and with defaults filled in: each an object with
    ``op`` (a name of `kernel_api.cli.problems.all_problems`) and that operation's fields.

    Raises:
        ShapesFileError: naming the file, the entry's index and the field at fault.
    """
    source = f"shapes file {os.fspath(path)}"
    document = read_json(path, source, ShapesFileError)
    if not isinstance(document, list) or not document:
        raise ShapesFileError(f"{source}: expected a non-empty JSON list of problems")
    entries = []
    for i, item in enumerate(document):
        if not isinstance(item, dict):
            raise ShapesFileError(f"{source}: entry {i} must be an object, got {type(item).__name__}")
        op = item.get("op")
        problem = all_problems().get(op) if isinstance(op, str) else None
        if problem is None:
            raise ShapesFileError(f"{source}: entry {i}: field 'op' must be one of {sorted(all_problems())}, "
                                  f"got {op!r}")
        unknown = sorted(set(item) - {"op", *(f.name for f in problem.fields)})
        if unknown:
            raise ShapesFileError(f"{source}: entry {i} ({op}): unknown field(s) {', '.join(map(repr, unknown))}")
        try:
            values = problem.values(item, lambda f: f"field {f.name!r}")
        except ValueError as exc:
            raise ShapesFileError(f"{source}: entry {i} ({op}): {exc}") from None
        entries.append({"op": op, **values})
    return entries


def entry_arguments(entry: dict, index: int, source: str = "shapes file") -> Any:
    """Arguments on the ``meta`` device for one checked entry of `load_shapes`."""
    try:
        return all_problems()[entry["op"]].arguments({k: v for k, v in entry.items() if k != "op"})
    except (ValueError, TypeError) as exc:  # fields are checked by load_shapes: the combination is at fault
        raise ShapesFileError(f"{source}: entry {index} ({entry['op']}): {str(exc).splitlines()[0]}") from None


def run_precompile(shapes: str, cc: Any, top: int, workers: int | None,
                   show: Callable[..., Any] = print, providers: list[str] | None = None) -> int:
    """``precompile``: compile, report (which kernels were cached already), and return the exit
    status (1 when anything failed). A cache that cannot keep the kernels raises before anything
    compiles: `kernel_api.tuning.precompile.CacheNotWritableError` (off, or a folder that cannot
    be written) or `kernel_api.core.cache.UntrustedCacheError` (a folder that fails the permission
    rule, whose entries would never load)."""
    from ..core.arch import normalize_cc
    from ..core.cache import cache_dir
    from ..tuning.precompile import default_workers, precompile
    from .progress import progress

    target = normalize_cc(cc, "--cc")
    if target is None:
        raise ValueError("--cc is required, e.g. --cc 90")
    if top < 1:
        raise ValueError(f"--top must be >= 1, got {top}")
    if workers is not None and workers < 1:
        raise ValueError(f"--workers must be >= 1, got {workers}")
    entries = load_shapes(shapes)
    arguments = [entry_arguments(e, i, f"shapes file {shapes}") for i, e in enumerate(entries)]
    results = precompile(arguments, target, top=top, num_workers=workers or default_workers(),
                         progress=progress("precompile"), providers=providers)
    failed = [r for r in results if r.failure is not None]
    cached = [r for r in results if r.cached]
    for r in failed:
        show(f"entry {r.entry}: {r.kernel_name or 'no kernel'}: {r.failure.splitlines()[0]}", file=sys.stderr)
    for r in cached:
        show(f"entry {r.entry}: {r.kernel_name}: already cached")
    compiled = len(results) - len(failed) - len(cached)
    show(f"precompiled {len(results) - len(failed)} kernel(s) for {len(entries)} problem(s), cc {target}, "
         f"into {cache_dir()}: {compiled} compiled, {len(cached)} already cached"
         + (f"; {len(failed)} failed" if failed else ""))
    return 1 if failed else 0


def run_bundle_create(path: str, shapes: str | None, cc: Any, top: int, workers: int | None,
                      show: Callable[..., Any] = print, providers: list[str] | None = None,
                      sign_with: str | None = None) -> int:
    """``bundle create``: pack the cache and the tuning records; with ``shapes``, compile those
    shapes into a temporary cache folder first and pack only its kernels; with ``sign_with``,
    sign the manifest with that private key."""
    from ..core.cache import ENV_DIR, cache_dir
    from ..core.trust import sign_manifest
    from ..tuning.bundle import create_bundle
    from ..tuning.records import TuningRecords

    if shapes is None:
        if cc is not None:
            raise ValueError("--cc is for --shapes (it picks the architecture they are compiled for)")
        manifest = create_bundle(path, sign_with=sign_with)
    else:
        if sign_with is not None:
            sign_manifest(b"", sign_with)  # an unusable key fails now, not after the compiles
        records = TuningRecords(cache_dir() / "tuning.sqlite")
        with tempfile.TemporaryDirectory(prefix="kernel_api-bundle-") as scratch:
            # The workers inherit the environment: they compile into the scratch folder.
            previous = os.environ.get(ENV_DIR)
            os.environ[ENV_DIR] = scratch
            try:
                status = run_precompile(shapes, cc, top, workers, show=show, providers=providers)
            finally:
                if previous is None:
                    del os.environ[ENV_DIR]
                else:
                    os.environ[ENV_DIR] = previous
            if status != 0:
                raise KernelApiError(f"bundle {path} not written: some kernels of {shapes} failed to compile")
            manifest = create_bundle(path, cache_root=scratch, records=records, sign_with=sign_with)
    from ..core.cache import KERNEL_NAMESPACES

    kernels = sum(name.split("/")[0] in KERNEL_NAMESPACES for name in manifest["files"])
    show(f"wrote {path}: {kernels} compiled kernel(s) and the tuning records, for "
         + ", ".join(f"{k} {v}" for k, v in manifest["toolchain"].items())
         + ("; signed" if sign_with is not None else ""))
    return 0


def run_bundle_install(path: str, show: Callable[..., Any] = print, trusted: bool = False) -> int:
    """``bundle install``: check the bundle and install it into the cache and the records;
    ``trusted`` is ``--trust`` (see `kernel_api.tuning.bundle.install_bundle`)."""
    from ..core.cache import cache_dir
    from ..tuning.bundle import install_bundle

    counts = install_bundle(path, trusted=trusted)
    show(f"installed {path} into {cache_dir()}: {counts.files_added} cache file(s) added, {counts.files_present} "
         f"already present; records: {counts.records.added} added, {counts.records.replaced} replaced, "
         f"{counts.records.kept} kept (the local record was as new or newer)")
    return 0


def parse_devices(text: str | None) -> list[int] | None:
    """``--devices 0,1`` -> [0, 1]; None -> None (every visible GPU)."""
    if text is None:
        return None
    try:
        devices = [int(part) for part in text.split(",")]
    except ValueError:
        raise ValueError(f"--devices: expected comma-separated GPU indices such as 0,1, got {text!r}") from None
    if any(d < 0 for d in devices):
        raise ValueError(f"--devices: GPU indices are >= 0, got {text!r}")
    return devices


def _describe(entry: dict) -> str:
    return all_problems()[entry["op"]].describe(entry)


def report_tuning(entries: list[dict], results: list, show: Callable[..., Any] = print) -> int:
    """Print one line per problem (failures on stderr); returns the number of failures."""
    failed = 0
    for entry, r in zip(entries, results):
        if r.failure is not None:
            failed += 1
            show(f"entry {r.index} ({_describe(entry)}): {r.failure.splitlines()[0]}", file=sys.stderr)
            continue
        source = "tuning record" if r.from_record else f"measured on GPU {r.device}"
        show(f"entry {r.index} ({_describe(entry)}): {r.kernel_name} {r.median_ms * 1e3:.1f} us ({source})")
    return failed


def run_tune_shapes(shapes: str, devices: str | None, export: str | None, max_candidates: int | None,
                    repeat: int, workers: int | None, force: bool, bucket: str | None,
                    show: Callable[..., Any] = print, isolation: str | None = None,
                    power_state: str | None = None) -> int:
    """``tune --shapes``: tune every problem of the file on the GPUs, record the winners, report;
    returns the exit status (1 when any problem failed)."""
    import time

    from ..tuning.policies import DEFAULT_POWER_STATE
    from ..tuning.records import records_to_json, write_json_atomically
    from ..tuning.scale import tune_shapes
    from .progress import progress

    if max_candidates is not None and max_candidates < 1:
        raise ValueError(f"--max-candidates must be >= 1, got {max_candidates}")
    if repeat < 1:
        raise ValueError(f"--repeat must be >= 1, got {repeat}")
    if workers is not None and workers < 1:
        raise ValueError(f"--workers must be >= 1, got {workers}")
    entries = load_shapes(shapes)
    arguments = [entry_arguments(e, i, f"shapes file {shapes}") for i, e in enumerate(entries)]
    chosen = parse_devices(devices)
    start = time.perf_counter()
    results = tune_shapes(arguments, chosen, max_candidates=max_candidates, repeat=repeat, num_workers=workers,
                          force=force, bucket=bucket, progress=progress("tune"), isolation=isolation or "threads",
                          power_state=power_state or DEFAULT_POWER_STATE)
    seconds = time.perf_counter() - start
    failed = report_tuning(entries, results, show)
    gpus = len({r.device for r in results})
    show(f"tuned {len(results) - failed} of {len(results)} problem(s) on {gpus} GPU(s) in {seconds:.1f} s; "
         f"winners in the tuning records")
    if export is not None:
        found = [r.record for r in results if r.record is not None]
        write_json_atomically(export, records_to_json(found))
        show(f"exported {len(found)} tuning record(s) to {export}")
    return 1 if failed else 0
