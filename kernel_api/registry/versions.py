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
import importlib
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


def release(version: str) -> tuple[int, ...]:
    """The release numbers of a version string ("0.8.5.dev1" -> (0, 8, 5)).

    Args:
        version: a PEP 440 version.

    Returns:
        Its leading numeric components.
    """
    numbers = []
    for part in version.split("."):
        digits = len(part) - len(part.lstrip("0123456789"))
        if digits == 0:
            break
        numbers.append(int(part[:digits]))
        if digits != len(part):
            break
    return tuple(numbers)


def require_library(plugin: str, plugin_version: str, distribution: str, supported: tuple[str, str],
                    modules: Iterable[str] = ()) -> str:
    """What a plugin wrapping another library runs at import, before it registers anything: the
    library's installed version, once it is known to be in ``supported`` and its ``modules``
    import. kernel_api reports the ImportError it raises otherwise in ``plugin_errors()`` and
    skips the plugin.

    Args:
        plugin: the plugin's distribution name, for messages ("kernel-api-quack").
        plugin_version: the plugin's own version.
        distribution: the wrapped library's distribution ("quack-kernels").
        supported: (lowest release supported, first release not supported), release numbers only.
        modules: the library's modules the plugin's kernels use.

    Returns:
        The installed version string; ImportError saying what is installed and what is needed
        (or the library's own ImportError).
    """
    low, high = supported
    try:
        found = importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        raise ImportError(f"{plugin} needs {distribution}>={low},<{high}, which is not installed") from None
    if not release(low) <= release(found) < release(high):
        raise ImportError(f"{plugin} {plugin_version} wraps {distribution}>={low},<{high}; {found} is installed")
    for module in modules:
        importlib.import_module(module)
    return found
