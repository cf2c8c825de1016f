"""Compiling the best-ranked kernels for known problems ahead of time, into the disk caches.

A server that knows its shapes compiles their kernels once (``kernel-api precompile``, or
`precompile` here), on any machine with the same toolchain and no GPU needed, and every later
process loads them from the cache in milliseconds. The candidates are ranked as `PickAny`
ranks them (`rank_candidates`), so the kernel `PickAny` will choose is the first compiled.
The compiles run in worker processes (`kernel_api.tuning.compile_worker`), never in processes
that re-import the caller's ``__main__``, and a worker whose kernel is in the disk caches
already only loads it; the results say which were (as this process finds them). Since
compiling is only worth what the caches keep, a cache that is off, a cache folder that cannot
be written, and a cache or namespace folder that fails the permission rule (its entries would
never be loaded) are refused before anything compiles (the workers would otherwise keep their
artifacts in memory and exit).
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from .. import registry
from ..core.arch import normalize_cc
from ..core.cache import (ENV_DIR, ENV_ENABLE, NAMESPACES, UntrustedCacheError, cache_dir, cache_enabled,
                          untrusted_folders)
from ..core.errors import KernelApiError
from ..kernel import compile_from_cache_only
from .compile_worker import compile_request, compile_requests, describe_arguments
from .policies import rank_candidates


class CacheNotWritableError(KernelApiError):
    """The disk cache cannot keep what precompiling would build; the message names the folder."""


@dataclass(frozen=True)
class PrecompileResult:
    """One kernel compiled (``failure`` None) or not (its message) for entry ``entry``.
    ``cached``: the disk caches held its artifact before the call, so its worker only loaded it
    (as this process found it: an artifact it had compiled or loaded earlier counts too; a
    vendor kernel such as the torch provider's has nothing to compile and counts as cached)."""

    entry: int
    kernel_name: str
    failure: str | None = None
    cached: bool = False


def default_workers() -> int:
    """min(4, CPU count): compiles are CPU- and memory-heavy (several GB per CuTe DSL compile)."""
    return max(1, min(4, os.cpu_count() or 1))


def check_cache_writable() -> None:
    """Raise unless the disk cache is on, its folder (created when missing) takes a new file, and
    it and its namespace folders pass the permission rule (entries in a folder another user could
    write are never loaded, so the disk cache keeps nothing there).

    Raises:
        CacheNotWritableError: the cache is off or its folder cannot be written, naming the reason.
        UntrustedCacheError: the cache folder or a namespace folder fails the permission rule
            (`kernel_api.core.cache.untrusted_folders`), naming the folder and why.
    """
    if not cache_enabled():
        raise CacheNotWritableError(f"the disk cache is off ({ENV_ENABLE}={os.environ.get(ENV_ENABLE)}): "
                                    f"precompiled kernels would not be saved")
    root = cache_dir()
    try:
        root.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=root, prefix=".kernel_api-probe-", suffix=".part"):
            pass
    except OSError as exc:
        raise CacheNotWritableError(f"cache folder {root} is not writable ({exc.strerror or exc}): precompiled "
                                    f"kernels would not be saved; set {ENV_DIR} to a writable folder") from None
    problem = next(iter(untrusted_folders(root, NAMESPACES).values()), None)
    if problem is not None:
        raise UntrustedCacheError(f"{problem}: precompiled kernels would never be loaded from it; chmod go-w it "
                                  f"or chown it to yourself (docs/security.md)")


def precompile(arguments: list[Any], cc: int | str, top: int = 1, num_workers: int | None = None,
               progress: Callable[[int, int, str], None] | None = None,
               timeout: float | None = None, providers: Sequence[str] | None = None) -> list[PrecompileResult]:
    """Compile the ``top`` best-ranked candidates (PickAny's order) of each arguments object for
    ``cc`` into the disk caches, in worker processes.

    Args:
        arguments: arguments objects (on the ``meta`` device or any other: only their
            signature counts), one per problem.
        cc: the target compute capability (no GPU is needed).
        top: how many candidates per problem, best-ranked first.
        num_workers: worker processes (default `default_workers`).
        progress: called as ``progress(done, total, label)`` after each compile.
        timeout: seconds one compile may take before its worker is stopped (None: no limit).
        providers: only these providers' kernels are ranked (None: every provider). Vendor
            kernels (the ``torch`` provider) compile nothing ahead of time, so a problem whose
            best-ranked kernel is one of them leaves nothing in the cache; name our providers
            (``["cutedsl", "cuda_src"]``) to warm our kernels for it regardless.

    Returns:
        One `PrecompileResult` per kernel tried, in the problems' order. A problem no kernel
        supports gets one result with an empty kernel name and the reason.

    Raises:
        ValueError: ``top`` or ``num_workers`` below 1, or a ``cc`` that is not one.
        CacheNotWritableError: the disk cache is off or its folder cannot be written
            (`check_cache_writable`); nothing is compiled then.
        UntrustedCacheError: the cache folder or a namespace folder fails the permission rule
            (`check_cache_writable`); nothing is compiled then.
    """
    target = normalize_cc(cc, "cc")
    if target is None:
        raise ValueError("precompile needs a target cc, e.g. 90")
    if top < 1:
        raise ValueError(f"top must be >= 1, got {top}")
    workers = default_workers() if num_workers is None else num_workers
    if workers < 1:
        raise ValueError(f"num_workers must be >= 1, got {workers}")
    check_cache_writable()
    results: list[PrecompileResult | None] = []
    requests, slots = [], []
    for index, args in enumerate(arguments):
        kernels = registry.get_kernels(args, cc=target, providers=providers)
        if not kernels:
            results.append(PrecompileResult(index, "", f"no kernel for {args!r} at cc {target} "
                                                       f"(`kernel-api explain` says why)"))
            continue
        described = describe_arguments(args)
        if described is None:
            results.append(PrecompileResult(index, "", f"{args!r}: a worker cannot rebuild these arguments"))
            continue
        for kernel in rank_candidates(kernels, args)[:top]:
            request = compile_request(kernel, target, *described)
            if request is None:
                results.append(PrecompileResult(index, kernel.metadata.kernel_name,
                                                 "its class cannot be imported by a worker (defined in __main__ "
                                                 "or in a function)"))
                continue
            slots.append(len(results))
            results.append(None)
            # For the report only: the workers compile it regardless, since an artifact this
            # process holds in memory (NVRTC keeps its compiles by key) may be missing on disk.
            requests.append((index, request, compile_from_cache_only(kernel, args, target) is not None))
    failures = compile_requests([r for _, r, _ in requests], workers, progress=progress, timeout=timeout)
    for slot, (index, request, cached), failure in zip(slots, requests, failures):
        results[slot] = PrecompileResult(index, request.kernel_name, failure, cached and failure is None)
    return results  # type: ignore[return-value]
