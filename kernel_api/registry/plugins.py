"""Plugins: modules named in an entry-point group (``module`` or ``module:Provider``), imported
into a registry once, on its first discovery. One that fails is reported and skipped.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from typing import Any, Iterable, Protocol, Sequence

from .reports import FailureReports

#: The entry-point group the default registry's plugins are listed in.
ENTRY_POINT_GROUP = "kernel_api.providers"
#: The package's own provider modules: the default registry imports them even when the package
#: is used from a source tree without installed entry points.
BUILTIN_PROVIDER_MODULES = (
    "kernel_api.providers.cutedsl.register_kernels",
    "kernel_api.providers.cuda_src.register_kernels",
    "kernel_api.providers.torch_ops.register_kernels",
)


class EntryPointLike(Protocol):
    """What a plugin is named by: `importlib.metadata.EntryPoint`, or any object with these."""

    name: str
    value: str  # "module" or "module:attribute.path"


class PluginList:
    """The plugins a registry imports by itself, and how far it got.

    ``loaded`` is set once every plugin was imported; ``loading`` while the thread holding the
    registry's lock imports them.
    """

    def __init__(self, entry_point_group: str | None, builtin_modules: Sequence[str]) -> None:
        self.entry_point_group = entry_point_group
        self.builtin_modules = tuple(builtin_modules)
        self.loaded = False
        self.loading = False

    def targets(self, reports: FailureReports) -> list[tuple[str, str]]:
        """(label name, "module[:attribute]") of each plugin: the built-in modules, then the
        entry points installed in the group (a broken metadata install is reported, not raised)."""
        targets = [(m, m) for m in self.builtin_modules]
        if self.entry_point_group is None:
            return targets
        try:
            for ep in importlib.metadata.entry_points(group=self.entry_point_group):
                if ep.value not in self.builtin_modules:
                    targets.append((ep.name, ep.value))
        except Exception as exc:  # noqa: BLE001 - a broken metadata install must not break discovery
            reports.plugin_failed("<entry points>", exc)
        return targets


def entry_point_targets(entry_points: Iterable[EntryPointLike]) -> list[tuple[str, str]]:
    """(name, value) of each of ``entry_points``."""
    return [(ep.name, ep.value) for ep in entry_points]


def import_plugin(value: str) -> Any:
    """Import ``"module"`` or ``"module:attribute.path"``.

    Args:
        value: an entry point's value.

    Returns:
        The module, or the object the attribute path names in it.
    """
    module_name, _, attr = value.partition(":")
    obj: Any = importlib.import_module(module_name.strip())
    if attr:
        for part in attr.strip().split("."):
            obj = getattr(obj, part)
    return obj
