"""What a registry holds: its providers, by name in registration order, and each provider's
kernel classes in registration order. A plain container: the `Registry` checks, locks and
invalidates its caches around every change.
"""

from __future__ import annotations

from typing import Any, Iterator


def class_key(kernel_class: type) -> tuple[str, str]:
    """(module, qualified name): a class defined again (a re-run notebook cell) has the same key."""
    return (kernel_class.__module__, kernel_class.__qualname__)


class Catalog:
    """Registered providers and their kernel classes.

    ``providers`` is a tuple rebuilt on every change, so discovery reads it without copying.
    """

    def __init__(self) -> None:
        self._by_name: dict[str, Any] = {}
        self._classes: dict[Any, tuple[type, ...]] = {}
        self.providers: tuple[Any, ...] = ()

    def provider(self, name: str) -> Any:
        """The provider registered as ``name``, or None."""
        return self._by_name.get(name)

    def names(self) -> list[str]:
        """The registered providers' names, in registration order."""
        return list(self._by_name)

    def add_provider(self, provider: Any) -> None:
        """Register ``provider`` under its name (the caller checked that the name is free)."""
        self._by_name[provider.name] = provider
        self._classes.setdefault(provider, ())
        self.providers = tuple(self._by_name.values())

    def remove_provider(self, name: str) -> tuple[Any, tuple[type, ...]] | None:
        """Forget the provider ``name`` and its classes.

        Returns:
            (provider, its classes), or None when no provider has that name.
        """
        provider = self._by_name.pop(name, None)
        if provider is None:
            return None
        self.providers = tuple(self._by_name.values())
        return provider, self._classes.pop(provider, ())

    def classes(self, provider: Any) -> tuple[type, ...]:
        """``provider``'s classes in registration order (none for a provider not registered)."""
        return self._classes.get(provider, ())

    def add_class(self, provider: Any, kernel_class: type) -> list[type]:
        """Append ``kernel_class`` to ``provider``'s classes, replacing those of the same `class_key`.

        Returns:
            The classes it replaced.
        """
        key = class_key(kernel_class)
        current = self._classes.get(provider, ())
        replaced = [k for k in current if class_key(k) == key]
        self._classes[provider] = tuple(k for k in current if k not in replaced) + (kernel_class,)
        return replaced

    def remove_class(self, provider: Any, kernel_class: type) -> bool:
        """Remove ``kernel_class`` from ``provider``'s classes; False when it was not there."""
        current = self._classes.get(provider, ())
        if kernel_class not in current:
            return False
        self._classes[provider] = tuple(k for k in current if k is not kernel_class)
        return True

    def registered(self) -> Iterator[tuple[Any, type]]:
        """(provider, class) for every class of every registered provider, in registration order."""
        for provider in self.providers:
            for kernel_class in self._classes.get(provider, ()):
                yield provider, kernel_class
