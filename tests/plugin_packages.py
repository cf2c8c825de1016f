"""The plugin packages under examples/plugins, for the tests: where each lives, its entry points
as its pyproject.toml declares them, and loading it without installing it (its folder on
sys.path), into the default registry or a registry of a test's own."""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import importlib.util
import sys
from pathlib import Path
from typing import Any, Iterator

ROOT = Path(__file__).resolve().parent.parent
PLUGINS = ROOT / "examples" / "plugins"

#: provider name -> (distribution folder, package, library module its import needs)
PACKAGES = {
    "liger": ("kernel-api-liger", "kernel_api_liger", "liger_kernel"),
    "quack": ("kernel-api-quack", "kernel_api_quack", "quack"),
    "flash_attn": ("kernel-api-flash-attn", "kernel_api_flash_attn", "flash_attn.cute"),
    "cutlass_operators": ("kernel-api-cutlass-operators", "kernel_api_cutlass_operators", "cutlass.operators"),
}


def folder(provider: str) -> Path:
    """The plugin's distribution folder (its pyproject.toml and package)."""
    return PLUGINS / PACKAGES[provider][0]


def pyproject(provider: str) -> dict:
    """The plugin's pyproject.toml, parsed."""
    import tomllib

    return tomllib.loads((folder(provider) / "pyproject.toml").read_text())


def entry_points(provider: str) -> list[importlib.metadata.EntryPoint]:
    """The ``kernel_api.providers`` entry points the plugin's pyproject.toml declares."""
    group = "kernel_api.providers"
    declared = pyproject(provider)["project"]["entry-points"][group]
    return [importlib.metadata.EntryPoint(name, value, group) for name, value in declared.items()]


def library(provider: str) -> Any:
    """The plugin's ``library`` module (versions and range), loaded on its own: importing it
    through its package would register the plugin."""
    package = PACKAGES[provider][1]
    spec = importlib.util.spec_from_file_location(f"_{package}_library", folder(provider) / package / "library.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def installed(provider: str) -> bool:
    """Whether the plugin's library is installed (its distribution's metadata: a top-level
    package such as ``cutlass`` can come from another distribution)."""
    try:
        importlib.metadata.version(library(provider).DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def forget_modules(provider: str) -> None:
    """Drop the plugin's modules from sys.modules, so its next import runs (and registers) again."""
    package = PACKAGES[provider][1]
    for name in [m for m in sys.modules if m == package or m.startswith(package + ".")]:
        del sys.modules[name]


@contextlib.contextmanager
def on_path(*providers: str) -> Iterator[None]:
    """The plugins' folders on sys.path (what an editable install gives), their modules fresh."""
    paths = [str(folder(p)) for p in providers]
    for p in providers:
        forget_modules(p)
    sys.path[:0] = paths
    try:
        yield
    finally:
        for path in paths:
            sys.path.remove(path)


def load_into_default(*providers: str) -> dict:
    """Import the plugins into the default registry; {provider: module}. Pair with `unload`."""
    modules = {}
    for p in providers:
        forget_modules(p)
        sys.path.insert(0, str(folder(p)))
        try:
            modules[p] = importlib.import_module(PACKAGES[p][1])
        finally:
            sys.path.remove(str(folder(p)))
    return modules


def unload(*providers: str) -> None:
    """Forget the plugins' providers in the default registry and their modules."""
    from kernel_api.registry import unregister_provider

    for p in providers:
        unregister_provider(p)
        forget_modules(p)
