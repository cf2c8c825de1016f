"""What the registry holds: the registered providers, the discovery caches and the reports of
plugins and kernel classes that failed. The other registry modules share these objects (they
mutate them, never rebind them), and `_invalidate` empties every cache derived from them.
"""

from __future__ import annotations

import threading
import warnings
from typing import Any

from ..kernel import Kernel

_providers: dict[str, type] = {}  # name -> Provider subclass
_plugin_errors: dict[str, str] = {}
_warned: set[tuple[str, str]] = set()  # (class label, kind of failure) already warned about
_lock = threading.RLock()
_instances: dict[tuple, list[Kernel]] = {}
_candidates: dict[tuple, list[Kernel]] = {}
# Why generation failed, per _instances key (the class is skipped for that key).
_generation_errors: dict[tuple, str] = {}
# Instance names of a class at (cc=None, no epilogue), keyed by class, with the generate_kernels
# function they came from (notebooks assign methods after registering).
_names: dict[type, tuple[Any, frozenset[str] | None]] = {}
# Which class owns each instance name, per (arguments type, cc, epilogue key): the first registered.
_owners: dict[tuple, dict[str, type]] = {}


def _invalidate() -> None:
    _instances.clear()
    _candidates.clear()
    _generation_errors.clear()
    _owners.clear()


def _class_label(provider: type | None, kernel_class: type) -> str:
    """How errors name a class: "provider/Qualname (module)"."""
    prefix = f"{provider.name}/" if provider is not None else ""
    return f"{prefix}{kernel_class.__qualname__} ({kernel_class.__module__})"


def _report_class_error(provider: type | None, kernel_class: type, kind: str, message: str) -> None:
    """Record that discovery skips (part of) a broken class, warning once per class and ``kind``
    of failure (a check that raises for every instance must not warn for each)."""
    label = _class_label(provider, kernel_class)
    _plugin_errors[label] = message
    if (label, kind) in _warned:
        return
    _warned.add((label, kind))
    warnings.warn(f"kernel_api: kernel class {label} is broken and skipped where it fails: {message}",
                  RuntimeWarning, stacklevel=4)


def _error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"
