"""Provider versions: what a tuning record is keyed on per provider, so that upgrading a plugin
(a new release of the package its provider comes from) re-tunes the problems it had candidates
for, while its old records count as missing.

A provider's version is its class's ``version`` when it sets one, else the installed version of
the distribution that holds the package its module belongs to (kernel_api's own providers: the
imported kernel_api's version). Reading installed distributions scans them all (milliseconds),
so each module's answer is read once per process, and the (name, version) pairs of a set of
providers are built once per set.
"""

from __future__ import annotations

import functools
import importlib.metadata
import threading
from typing import Any, Iterable

from ..core.toolchain import kernel_api_version

#: The version of a provider whose module belongs to no installed distribution (a notebook, a
#: script, a source tree that is not installed) and that sets none.
UNVERSIONED = "unversioned"

_sets: dict[frozenset, tuple[tuple[str, str], ...]] = {}
_sets_lock = threading.Lock()


@functools.lru_cache(maxsize=1)
def _packages_distributions() -> dict[str, list[str]]:
    """Top-level package -> the distributions that install it (read once per process)."""
    return dict(importlib.metadata.packages_distributions())


@functools.lru_cache(maxsize=None)
def module_version(module: str) -> str:
    """The version of the installed distribution that module ``module`` belongs to.

    Args:
        module: a module name such as ``"liger_kernel.ops.softmax"``.

    Returns:
        kernel_api's version for kernel_api's own modules; else the version of the first
        installed distribution that holds the module's top-level package; else `UNVERSIONED`.
    """
    top = module.partition(".")[0]
    if top == "kernel_api":
        return kernel_api_version()
    for distribution in _packages_distributions().get(top, ()):
        try:
            return importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            continue
    return UNVERSIONED


class DefaultVersion:
    """``Provider.version`` where a provider sets none: its module's distribution version
    (`module_version`), read on first use and then cached for the process."""

    def __get__(self, instance: Any, owner: type) -> str:
        return module_version(owner.__module__)


def provider_versions(providers: Iterable[Any]) -> tuple[tuple[str, str], ...]:
    """(name, version) of each provider, sorted by name; built once per set of providers.

    Args:
        providers: `Provider` subclasses.

    Returns:
        The pairs, as a tuple.
    """
    key = frozenset(providers)
    found = _sets.get(key)
    if found is None:
        found = tuple(sorted((p.name, str(p.version)) for p in key))
        with _sets_lock:
            _sets[key] = found
    return found


def forget_versions() -> None:
    """Forget every version read so far, as a new process would (tests, or after installing a
    new release of a plugin into a running notebook)."""
    with _sets_lock:
        _sets.clear()
    module_version.cache_clear()
    _packages_distributions.cache_clear()
