"""Providers, the registration of kernel classes, and plugins.

A `Provider` groups the kernel classes written with one toolchain; ``Provider.register`` is
the bring-your-own-kernel decorator. Plugins are modules named in the entry-point group
``kernel_api.providers``; they are imported once, on first discovery (or on the first
registration of a class from outside the package, whose names are compared with theirs).
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any, Iterable

from ..core.errors import RegistrationError
from ..kernel import Kernel
from .state import _class_label, _invalidate, _lock, _names, _plugin_errors, _providers, _warned
from .validation import _check_unique_names, _class_key, _is_builtin, _validate_kernel_class

ENTRY_POINT_GROUP = "kernel_api.providers"
# Modules of the package's own providers; loaded even when the package is used from a
# source tree without installed entry points.
_BUILTIN_MODULES = (
    "kernel_api.providers.cutedsl.catalog",
    "kernel_api.providers.cuda_src.catalog",
    "kernel_api.providers.torch_ops.catalog",
)

_plugins_loaded = False  # set once every plugin was imported
_loading = False  # True while the thread holding `_lock` imports them


class Provider:
    """A family of kernel classes built with one toolchain (CuTe DSL, CUDA C++, ...).

    Subclasses set ``name``. Decorating a `Kernel` subclass with ``@MyProvider.register``
    validates it and makes it discoverable.
    """

    name: str = ""
    _classes: list[type[Kernel]] = []

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls._classes = []

    @classmethod
    def register(cls, kernel_class: type) -> type:
        """Class decorator: validate ``kernel_class`` and add it to this provider.

        Raises `RegistrationError` when the class is incomplete (abstract methods, no
        arguments type, a failing ``check_definition()`` classmethod where the class has one)
        or when its instances reuse a kernel name another registered class generates: kernel
        names identify instances in selection and tuning records. Registering a class of the
        same module and qualified name again (a re-run notebook cell) replaces it.
        """
        if cls is Provider:
            raise RegistrationError("register kernels with a concrete provider, e.g. CuTeDSLProvider.register")
        _validate_kernel_class(kernel_class)
        with _lock:
            register_provider(cls)
            if not _is_builtin(kernel_class):
                # Compare names with every class that discovery would load, built-ins included,
                # so that a clash is always charged to the plugin, never to a built-in class.
                _load_plugins()
                _check_unique_names(cls, kernel_class)
            # Re-registering a class of the same qualified name (a re-run notebook cell)
            # replaces the old one instead of listing both.
            key = _class_key(kernel_class)
            for old in [k for k in cls._classes if _class_key(k) == key]:
                _forget_class(cls, old)
            type.__setattr__(kernel_class, "_kernel_api_provider", cls)
            cls._classes.append(kernel_class)
            _invalidate()
        return kernel_class

    @classmethod
    def unregister(cls, kernel_class: type) -> None:
        """Remove a class registered with this provider (tests, notebooks)."""
        with _lock:
            if kernel_class in cls._classes:
                _forget_class(cls, kernel_class)
                _invalidate()

    @classmethod
    def kernel_classes(cls, args_type: type | None = None) -> list[type[Kernel]]:
        """Registered classes, optionally only those accepting ``args_type``."""
        if args_type is None:
            return list(cls._classes)
        return [k for k in cls._classes if issubclass(args_type, k.supported_args_type)]


def _forget_class(provider: type["Provider"], kernel_class: type) -> None:
    provider._classes.remove(kernel_class)
    _names.pop(kernel_class, None)
    label = _class_label(provider, kernel_class)
    _plugin_errors.pop(label, None)
    _warned.difference_update([w for w in _warned if w[0] == label])


def register_provider(provider: type[Provider]) -> type[Provider]:
    """Make a provider class known to discovery (usable as a decorator)."""
    if not (isinstance(provider, type) and issubclass(provider, Provider)) or provider is Provider:
        raise RegistrationError(f"register_provider expects a Provider subclass, got {provider!r}")
    if not provider.name or not isinstance(provider.name, str):
        raise RegistrationError(f"{provider.__name__}.name must be a non-empty string")
    with _lock:
        existing = _providers.get(provider.name)
        if existing is not None and existing is not provider:
            raise RegistrationError(
                f"a provider named {provider.name!r} is already registered ({existing.__module__}.{existing.__qualname__})")
        if existing is None:
            _providers[provider.name] = provider
            _invalidate()
    return provider


def unregister_provider(name: str) -> None:
    """Forget a provider and its classes (tests, notebooks)."""
    with _lock:
        if _providers.pop(name, None) is not None:
            _invalidate()


def _load_plugins() -> None:
    """Import the built-in provider modules and the plugins, once per process.

    Other threads wait on `_lock` until every plugin is imported, so no discovery (and no
    choice the ops dispatch caches) sees part of them. The loading thread itself may call
    discovery from a plugin's import (the lock is re-entrant): it sees what is registered so
    far. Loading counts as done only when it finished; an exception that escapes it (a
    KeyboardInterrupt) leaves the next discovery to try again.
    """
    global _plugins_loaded, _loading
    if _plugins_loaded:
        return
    with _lock:
        if _plugins_loaded or _loading:
            return
        _loading = True
        try:
            targets: list[tuple[str, str]] = [(m, m) for m in _BUILTIN_MODULES]
            try:
                from importlib.metadata import entry_points

                for ep in entry_points(group=ENTRY_POINT_GROUP):
                    if ep.value not in _BUILTIN_MODULES:
                        targets.append((ep.name, ep.value))
            except Exception as exc:  # a broken metadata install must not break discovery
                _report_plugin_error("<entry points>", exc)
            for name, value in targets:
                _load_one(name, value)
        finally:
            _loading = False
        _plugins_loaded = True


def _load_one(name: str, value: str) -> None:
    """Import one plugin (and register its provider, for ``module:Provider``). Whatever its
    import raises is reported in `plugin_errors` and the plugin skipped, BaseExceptions too
    (``sys.exit()``, GeneratorExit...): one plugin must not end the process or stop the
    plugins after it. Except KeyboardInterrupt: a Ctrl-C during loading must stop the program,
    and one the plugin's own code raises cannot be told apart from it, so it propagates
    (loading is tried again by the next discovery)."""
    try:
        module_name, _, attr = value.partition(":")
        obj = importlib.import_module(module_name.strip())
        if attr:
            for part in attr.strip().split("."):
                obj = getattr(obj, part)
            if isinstance(obj, type) and issubclass(obj, Provider):
                register_provider(obj)
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # noqa: BLE001 - see the docstring
        _report_plugin_error(f"{name} ({value})", exc)


def _report_plugin_error(label: str, exc: BaseException) -> None:
    text = str(exc)
    message = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    _plugin_errors[label] = message
    warnings.warn(f"kernel_api: plugin {label} failed to load and is skipped: {message}", RuntimeWarning, stacklevel=3)


def plugin_errors() -> dict[str, str]:
    """Plugins that failed to load, and kernel classes that discovery skips (in part) because
    their generation or support checks raise: {"name (module)" or "provider/Class (module)":
    "what went wrong"}."""
    _load_plugins()
    return dict(_plugin_errors)


def available_providers() -> list[str]:
    """Names of the registered providers, in registration order."""
    _load_plugins()
    return list(_providers)


def get_provider(name: str) -> type[Provider]:
    _load_plugins()
    try:
        return _providers[name]
    except KeyError:
        raise ValueError(f"providers: unknown provider {name!r}; available: {list(_providers)}") from None


def _select_providers(providers: Any) -> tuple[type[Provider], ...]:
    if providers is None:
        return tuple(_providers.values())
    if isinstance(providers, (str, type)):
        providers = [providers]
    if not isinstance(providers, Iterable):
        raise TypeError(f"providers: expected provider names or classes, got {type(providers).__name__}")
    chosen = []
    for p in providers:
        if isinstance(p, str):
            chosen.append(get_provider(p))
        elif isinstance(p, type) and issubclass(p, Provider):
            chosen.append(p)
        else:
            raise TypeError(f"providers: {p!r} is neither a provider name nor a Provider subclass")
    return tuple(chosen)
