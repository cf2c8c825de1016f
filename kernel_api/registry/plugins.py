"""Plugins: modules named in an entry-point group (``module`` or ``module:Provider``), imported
into a registry once, on its first discovery. One that fails is reported and skipped.

A plugin module may declare where its kernels live instead of importing them: a module-level
``KERNEL_MODULES``, a mapping from an arguments type to the modules (absolute, or relative to
the plugin's package) whose import registers the kernel classes that serve it. Discovery then
imports a type's modules the first time it is asked for that type (or for a subclass of it), and
every declared module when it lists all kernels; a plugin that declares nothing is imported
whole, as before. The built-in providers' ``register_kernels`` modules declare theirs, so a
process that only runs softmaxes never imports a GEMM family.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Iterable, Mapping, Protocol, Sequence

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
#: The module attribute that declares a plugin's kernel modules per arguments type.
DECLARATION_ATTRIBUTE = "KERNEL_MODULES"


class EntryPointLike(Protocol):
    """What a plugin is named by: `importlib.metadata.EntryPoint`, or any object with these."""

    name: str
    value: str  # "module" or "module:attribute.path"


@dataclass(frozen=True)
class KernelModules:
    """One plugin's declaration: which modules hold the kernels for which arguments types.

    ``label`` names the plugin in failure reports; ``by_type`` maps an arguments type to
    absolute module names, in the order they are imported.
    """

    label: str
    by_type: Mapping[type, tuple[str, ...]]

    def for_type(self, args_type: type | None) -> list[str]:
        """The modules serving ``args_type`` (any class of its MRO that is declared), in order;
        every declared module for None."""
        keys = self.by_type if args_type is None else [c for c in args_type.__mro__ if c in self.by_type]
        return list(dict.fromkeys(m for key in keys for m in self.by_type[key]))


def read_declaration(label: str, module: ModuleType) -> KernelModules | None:
    """``module``'s `DECLARATION_ATTRIBUTE`, with relative module names resolved.

    Args:
        label: how failures of the plugin are reported.
        module: the imported plugin module.

    Returns:
        The declaration, or None when the module declares nothing (it registered its kernels
        when it was imported). A malformed one raises TypeError naming the attribute.
    """
    table = getattr(module, DECLARATION_ATTRIBUTE, None)
    if table is None:
        return None
    where = f"{module.__name__}.{DECLARATION_ATTRIBUTE}"
    if not isinstance(table, Mapping):
        raise TypeError(f"{where}: expected a mapping from arguments types to module names, "
                        f"got {type(table).__name__}")
    package = module.__package__ or module.__name__
    by_type = {}
    for args_type, names in table.items():
        if not isinstance(args_type, type):
            raise TypeError(f"{where}: key {args_type!r} is not an arguments type")
        if isinstance(names, str) or not all(isinstance(n, str) and n for n in names):
            raise TypeError(f"{where}[{args_type.__name__}]: expected a tuple of module names, got {names!r}")
        by_type[args_type] = tuple(importlib.util.resolve_name(n, package) for n in names)
    return KernelModules(label, by_type)


class PluginList:
    """The plugins a registry imports by itself, and how far it got.

    ``loaded`` is set once every plugin was imported, ``busy`` while the thread holding the
    registry's lock imports plugins or their kernel modules. ``served`` holds the arguments types
    whose declared kernel modules were all imported, ``complete`` is set once every one was.
    """

    def __init__(self, entry_point_group: str | None, builtin_modules: Sequence[str]) -> None:
        self.entry_point_group = entry_point_group
        self.builtin_modules = tuple(builtin_modules)
        self.busy = False
        self.forget()

    def forget(self) -> None:
        """Back to nothing imported (modules already imported are not run again)."""
        self.loaded = False
        self.complete = False
        self.declarations: list[KernelModules] = []
        self.served: set[type] = set()
        self.attempted: set[str] = set()  # kernel modules imported, or whose failure was reported

    def ready(self, args_type: type | None, kernels: bool) -> bool:
        """Whether nothing is left to import for a query about ``args_type`` (None: every kernel;
        ``kernels`` False: the plugins alone, not their declared kernel modules)."""
        return self.complete or (self.loaded and (not kernels or args_type in self.served))

    def declared(self, declarations: Iterable[KernelModules]) -> None:
        """The plugins were imported; these are their declarations."""
        self.declarations = list(declarations)
        self.loaded = True

    def pending(self, args_type: type | None) -> list[tuple[str, str]]:
        """(plugin label, module) of each declared module for ``args_type`` (None: all) not yet
        imported, plugins in order."""
        return [(d.label, m) for d in self.declarations for m in d.for_type(args_type) if m not in self.attempted]

    def served_now(self, args_type: type | None) -> None:
        """Every module declared for ``args_type`` (None: all) was imported."""
        if args_type is None:
            self.complete = True
        else:
            self.served.add(args_type)

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


def import_plugin(value: str) -> tuple[ModuleType, Any]:
    """Import ``"module"`` or ``"module:attribute.path"``.

    Args:
        value: an entry point's value.

    Returns:
        The module, and the object the attribute path names in it (the module itself without one).
    """
    module_name, _, attr = value.partition(":")
    module = importlib.import_module(module_name.strip())
    obj: Any = module
    if attr:
        for part in attr.strip().split("."):
            obj = getattr(obj, part)
    return module, obj
