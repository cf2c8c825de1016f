"""Providers, plugins and discovery.

A `Provider` groups the kernel classes written with one toolchain; ``Provider.register`` is
the bring-your-own-kernel decorator. Plugins are modules named in the entry-point group
``kernel_api.providers``; they are imported once, on first discovery. `get_kernels` walks
providers → registered classes → generated instances → support checks, caching instance
generation per (class, cc, epilogue kind) and metadata matches per argument signature.
"""

from __future__ import annotations

import importlib
import inspect
import threading
import typing
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from .arch import resolve_cc
from .arguments import Arguments
from .errors import RegistrationError
from .kernel import Kernel
from .metadata import KernelMetadata

ENTRY_POINT_GROUP = "kernel_api.providers"
# Modules of the package's own providers; loaded even when the package is used from a
# source tree without installed entry points.
_BUILTIN_MODULES = (
    "kernel_api.providers.cutedsl.catalog",
    "kernel_api.providers.cuda_src.catalog",
)

_providers: dict[str, type["Provider"]] = {}
_plugin_errors: dict[str, str] = {}
_plugins_loaded = False
_lock = threading.RLock()
_generation = 0  # bumped whenever the set of registered classes changes
_instances: dict[tuple, list[Kernel]] = {}
_candidates: dict[tuple, list[Kernel]] = {}


def _invalidate() -> None:
    global _generation
    _generation += 1
    _instances.clear()
    _candidates.clear()


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
        """Class decorator: validate ``kernel_class`` and add it to this provider."""
        if cls is Provider:
            raise RegistrationError("register kernels with a concrete provider, e.g. CuTeDSLProvider.register")
        _validate_kernel_class(kernel_class)
        with _lock:
            register_provider(cls)
            # Re-registering a class of the same qualified name (a re-run notebook cell)
            # replaces the old one instead of listing both.
            key = (kernel_class.__module__, kernel_class.__qualname__)
            cls._classes[:] = [k for k in cls._classes if (k.__module__, k.__qualname__) != key]
            type.__setattr__(kernel_class, "_kernel_api_provider", cls)
            cls._classes.append(kernel_class)
            _invalidate()
        return kernel_class

    @classmethod
    def unregister(cls, kernel_class: type) -> None:
        """Remove a class registered with this provider (tests, notebooks)."""
        with _lock:
            if kernel_class in cls._classes:
                cls._classes.remove(kernel_class)
                _invalidate()

    @classmethod
    def kernel_classes(cls, args_type: type | None = None) -> list[type[Kernel]]:
        """Registered classes, optionally only those accepting ``args_type``."""
        if args_type is None:
            return list(cls._classes)
        return [k for k in cls._classes if issubclass(args_type, k.supported_args_type)]


def _annotation_args_type(kernel_class: type) -> type | None:
    method = getattr(kernel_class, "_supports", None)
    if method is None:
        return None
    try:
        hints = typing.get_type_hints(method)
    except Exception:
        hints = getattr(method, "__annotations__", {})
    params = list(inspect.signature(method).parameters)
    if len(params) < 2:
        return None
    hint = hints.get(params[1])
    return hint if isinstance(hint, type) and issubclass(hint, Arguments) else None


def _validate_kernel_class(kernel_class: Any) -> None:
    if not isinstance(kernel_class, type):
        raise RegistrationError(f"register expects a class, got {type(kernel_class).__name__} {kernel_class!r}")
    if not issubclass(kernel_class, Kernel):
        raise RegistrationError(f"{kernel_class.__name__} is not a subclass of kernel_api.Kernel")
    missing = sorted(getattr(kernel_class, "__abstractmethods__", ()))
    if missing:
        raise RegistrationError(f"{kernel_class.__name__} does not implement abstract method(s): {', '.join(missing)}")
    args_type = kernel_class.__dict__.get("supported_args_type") or kernel_class.supported_args_type
    if args_type is None:
        args_type = _annotation_args_type(kernel_class)
        if args_type is None:
            raise RegistrationError(
                f"{kernel_class.__name__} must set supported_args_type (e.g. GemmArguments) or annotate "
                f"_supports(self, args: GemmArguments)")
        type.__setattr__(kernel_class, "supported_args_type", args_type)
    if not (isinstance(args_type, type) and issubclass(args_type, Arguments)):
        raise RegistrationError(f"{kernel_class.__name__}.supported_args_type must be an Arguments subclass, got {args_type!r}")


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
    global _plugins_loaded
    if _plugins_loaded:
        return
    with _lock:
        if _plugins_loaded:
            return
        _plugins_loaded = True
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


def _load_one(name: str, value: str) -> None:
    try:
        module_name, _, attr = value.partition(":")
        obj = importlib.import_module(module_name.strip())
        if attr:
            for part in attr.strip().split("."):
                obj = getattr(obj, part)
            if isinstance(obj, type) and issubclass(obj, Provider):
                register_provider(obj)
    except Exception as exc:
        _report_plugin_error(f"{name} ({value})", exc)


def _report_plugin_error(label: str, exc: BaseException) -> None:
    message = f"{type(exc).__name__}: {exc}"
    _plugin_errors[label] = message
    warnings.warn(f"kernel_api: plugin {label} failed to load and is skipped: {message}", RuntimeWarning, stacklevel=3)


def plugin_errors() -> dict[str, str]:
    """Plugins that failed to load: {"name (module)": "ExceptionType: message"}."""
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


def _always(_: KernelMetadata) -> bool:
    return True


def _generated(kernel_class: type[Kernel], cc: int | None, epilogue_args: Any, epilogue_key: Any) -> list[Kernel]:
    key = (kernel_class, cc, epilogue_key)
    found = _instances.get(key)
    if found is None:
        found = kernel_class.generate_kernels(_always, epilogue_args, cc)
        if found is None:
            found = []
        if not isinstance(found, list):
            found = list(found)
        _instances[key] = found
    return found


def _check_query(args: Any, metadata_filter: Any, limit: Any) -> None:
    if args is not None and not isinstance(args, Arguments):
        raise TypeError(
            f"args: expected an arguments object such as GemmArguments or SoftmaxArguments, got {type(args).__name__}")
    if metadata_filter is not None and not callable(metadata_filter):
        raise TypeError(f"metadata_filter: expected a callable taking KernelMetadata, got {type(metadata_filter).__name__}")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
        raise ValueError(f"limit: expected a non-negative int or None, got {limit!r}")


def _matching(args: Any, cc: int | None, chosen: tuple[type[Provider], ...]) -> list[Kernel]:
    """Instances whose metadata accepts ``args`` (cached per signature)."""
    key = (args.signature, cc, chosen)
    found = _candidates.get(key)
    if found is not None:
        return found
    found = []
    epilogue = getattr(args, "epilogue", None)
    for provider in chosen:
        for kernel_class in provider.kernel_classes(type(args)):
            for kernel in _generated(kernel_class, cc, epilogue, args.epilogue_signature):
                if kernel.metadata.supports(args, cc):
                    found.append(kernel)
    _candidates[key] = found
    return found


def get_kernels(args: Arguments | None = None, metadata_filter: Callable[[KernelMetadata], bool] | None = None,
                cc: Any = None, providers: Any = None, limit: int | None = None) -> list[Kernel]:
    """Every kernel instance that can run ``args``, in generation order.

    ``metadata_filter`` keeps instances whose metadata it accepts; ``cc`` targets an
    architecture (default: the arguments' GPU, else the current GPU, else no filtering);
    ``providers`` restricts to provider names/classes; ``limit`` caps the result length.
    With ``args=None``, every generated instance (for ``cc``) passing the filter is returned.
    """
    _check_query(args, metadata_filter, limit)
    _load_plugins()
    target = resolve_cc(cc, args.device if args is not None else None)
    chosen = _select_providers(providers)
    if args is None:
        pool = [k for p in chosen for c in p.kernel_classes() for k in _generated(c, target, None, None)]
    else:
        pool = _matching(args, target, chosen)
    result = []
    for kernel in pool:
        if metadata_filter is not None and not metadata_filter(kernel.metadata):
            continue
        if args is not None:
            status = kernel._supports(args)
            if status is not None and not status:
                continue
        result.append(kernel)
        if limit is not None and len(result) >= limit:
            break
    return result


@dataclass(frozen=True)
class Rejection:
    """Why one kernel class or instance does not fit the arguments."""

    provider: str
    kernel_class: str
    kernel_name: str | None
    reason: str

    @property
    def closeness(self) -> int:
        """Rough distance to fitting: higher is nearer (used to show the nearest misses)."""
        r = self.reason
        if self.kernel_name is None:
            return 0
        if "dtype" in r:
            return 1
        if "stride pattern" in r or "takes" in r:
            return 2
        return 3


class Explanation(list):
    """A list of `Rejection`s with a readable rendering; ``accepted`` lists the kernels that fit."""

    def __init__(self, rejections: list[Rejection], accepted: list[str]) -> None:
        super().__init__(rejections)
        self.accepted = accepted

    def nearest(self, n: int = 5) -> list[Rejection]:
        return sorted((r for r in self if r.kernel_name is not None), key=lambda r: -r.closeness)[:n]

    def __str__(self) -> str:
        lines = [f"{len(self.accepted)} kernel(s) accepted"]
        for r in self:
            where = f"{r.provider}/{r.kernel_class}" + (f" {r.kernel_name}" if r.kernel_name else "")
            lines.append(f"  {where}: {r.reason}")
        return "\n".join(lines)


def explain(args: Arguments, cc: Any = None, providers: Any = None) -> Explanation:
    """For each registered class and each rejected instance, say why it does not fit ``args``."""
    _check_query(args, None, None)
    if args is None:
        raise TypeError("explain: args is required")
    _load_plugins()
    target = resolve_cc(cc, args.device)
    rejections: list[Rejection] = []
    accepted: list[str] = []
    for provider in _select_providers(providers):
        for kernel_class in provider.kernel_classes():
            cname = kernel_class.__name__
            if not issubclass(type(args), kernel_class.supported_args_type):
                rejections.append(Rejection(provider.name, cname, None,
                                            f"takes {kernel_class.supported_args_type.__name__}, not {type(args).__name__}"))
                continue
            instances = _generated(kernel_class, target, args.epilogue if hasattr(args, "epilogue") else None,
                                   args.epilogue_signature)
            if not instances:
                what = "with this epilogue" if args.epilogue_signature is not None else ""
                rejections.append(Rejection(provider.name, cname, None,
                                            f"generates no instances for cc={target} {what}".strip()))
                continue
            for kernel in instances:
                status = kernel.supports(args, target)
                if status:
                    accepted.append(kernel.metadata.kernel_name)
                else:
                    rejections.append(Rejection(provider.name, cname, kernel.metadata.kernel_name, status.error))
    return Explanation(rejections, accepted)


def clear_caches() -> None:
    """Forget generated instances and cached matches (they are rebuilt on demand)."""
    with _lock:
        _invalidate()
