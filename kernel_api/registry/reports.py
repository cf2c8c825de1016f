"""Failure reports: plugins that failed to load, and kernel classes that discovery skips where
they fail (generation, metadata or support checks that raise, duplicate instance names). Each
failure is warned about once; `Registry.plugin_errors` lists them all.
"""

from __future__ import annotations

import warnings
from typing import Any


def class_label(provider: Any, kernel_class: type) -> str:
    """How errors name a class: "provider/Qualname (module)" ("Qualname (module)" without a provider)."""
    prefix = f"{provider.name}/" if provider is not None else ""
    return f"{prefix}{kernel_class.__qualname__} ({kernel_class.__module__})"


def error_text(exc: BaseException) -> str:
    """An exception as one phrase: "TypeName: message"."""
    return f"{type(exc).__name__}: {exc}"


class FailureReports:
    """What failed, by label: plugins ("name (module)") and kernel classes (`class_label`)."""

    def __init__(self) -> None:
        self._plugins: dict[str, str] = {}
        self._classes: dict[str, str] = {}
        self._warned: set[tuple[str, str]] = set()  # (class label, kind of failure) already warned about

    def plugin_failed(self, label: str, exc: BaseException) -> None:
        """Record and warn that the plugin ``label`` failed to load with ``exc`` (it is skipped).

        Args:
            label: the plugin, as "entry point name (module[:attribute])".
            exc: what its import raised.
        """
        text = str(exc)
        message = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
        self._plugins[label] = message
        warnings.warn(f"kernel_api: plugin {label} failed to load and is skipped: {message}", RuntimeWarning,
                      stacklevel=4)

    def class_failed(self, provider: Any, kernel_class: type, kind: str, message: str) -> None:
        """Record that discovery skips (part of) a broken class, warning once per class and kind
        of failure (a check that raises for every instance must not warn for each).

        Args:
            provider: the class's provider (or None).
            kernel_class: the class.
            kind: what failed ("generate", "metadata", "supports", "duplicate").
            message: what went wrong, naming the instance where there is one.
        """
        label = class_label(provider, kernel_class)
        self._classes[label] = message
        if (label, kind) in self._warned:
            return
        self._warned.add((label, kind))
        warnings.warn(f"kernel_api: kernel class {label} is broken and skipped where it fails: {message}",
                      RuntimeWarning, stacklevel=5)

    def forget_class(self, provider: Any, kernel_class: type) -> None:
        """Drop what was reported about a class (it was unregistered or replaced)."""
        label = class_label(provider, kernel_class)
        self._classes.pop(label, None)
        self._warned.difference_update([w for w in self._warned if w[0] == label])

    def forget_plugins(self) -> None:
        """Drop the plugin failures (the plugins are to be loaded again)."""
        self._plugins.clear()

    def as_dict(self) -> dict[str, str]:
        """Every failure: {label: "what went wrong"}, plugins first."""
        return {**self._plugins, **self._classes}
