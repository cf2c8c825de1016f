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
import logging
import re
import threading
import typing
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch

from .core.arch import resolve_cc
from .arguments import Arguments, GemmArguments
from .core.errors import NoKernelFoundError, RegistrationError
from .kernel import Kernel, _prepare_class
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
_warned: set[tuple[str, str]] = set()  # (class label, kind of failure) already warned about
_plugins_loaded = False
_lock = threading.RLock()
_generation = 0  # bumped whenever the set of registered classes changes
_instances: dict[tuple, list[Kernel]] = {}
_candidates: dict[tuple, list[Kernel]] = {}
# Why generation failed, per _instances key (the class is skipped for that key).
_generation_errors: dict[tuple, str] = {}
# Instance names of a class at (cc=None, no epilogue), keyed by class, with the generate_kernels
# function they came from (notebooks assign methods after registering).
_names: dict[type, tuple[Any, frozenset[str] | None]] = {}
# Which class owns each instance name, per (arguments type, cc, epilogue key): the first registered.
_owners: dict[tuple, dict[str, type]] = {}
_log = logging.getLogger(__name__)


def _invalidate() -> None:
    global _generation
    _generation += 1
    _instances.clear()
    _candidates.clear()
    _generation_errors.clear()
    _owners.clear()


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


def _class_key(kernel_class: type) -> tuple[str, str]:
    return (kernel_class.__module__, kernel_class.__qualname__)


def _is_builtin(kernel_class: type) -> bool:
    # The package's own classes are known to have unique names (tests/test_hardening_registry.py
    # checks); skipping them keeps generation off the first discovery's critical path.
    return kernel_class.__module__.startswith("kernel_api.")


def _class_label(provider: type["Provider"] | None, kernel_class: type) -> str:
    """How errors name a class: "provider/Qualname (module)"."""
    prefix = f"{provider.name}/" if provider is not None else ""
    return f"{prefix}{kernel_class.__qualname__} ({kernel_class.__module__})"


def _forget_class(provider: type["Provider"], kernel_class: type) -> None:
    provider._classes.remove(kernel_class)
    _names.pop(kernel_class, None)
    label = _class_label(provider, kernel_class)
    _plugin_errors.pop(label, None)
    _warned.difference_update([w for w in _warned if w[0] == label])


def _checked_instances(kernel_class: type, found: Any) -> list[Kernel]:
    """``generate_kernels``' result as a list, or TypeError saying what is wrong with it."""
    if found is None:
        return []
    try:
        found = list(found)
    except TypeError:
        raise TypeError(f"{kernel_class.__qualname__}.generate_kernels returned {type(found).__name__}, "
                        f"not a list of kernel instances") from None
    for i, kernel in enumerate(found):
        if not isinstance(kernel, Kernel):
            raise TypeError(f"{kernel_class.__qualname__}.generate_kernels returned {kernel!r} "
                            f"({type(kernel).__name__}) at index {i}, not a Kernel instance")
        # getattr with a default: a subclass __init__ that skipped Kernel.__init__ has no metadata.
        if not isinstance(getattr(kernel, "metadata", None), KernelMetadata):
            raise TypeError(f"{kernel_class.__qualname__}.generate_kernels returned {type(kernel).__name__} "
                            f"instance {i} without KernelMetadata (does its __init__ call Kernel.__init__?)")
    names: set[str] = set()
    for kernel in found:
        name = kernel.metadata.kernel_name
        if name in names:
            raise TypeError(f"{kernel_class.__qualname__}.generate_kernels returned two instances named "
                            f"{name!r}; kernel names must be unique")
        names.add(name)
    return found


def _names_of(kernel_class: type, strict: bool = False) -> frozenset[str] | None:
    """Instance names at (cc=None, no epilogue); None when generation raises (discovery reports it).

    ``strict`` (the class being registered): instances that are not kernels, or two instances
    of one name, raise `RegistrationError`; otherwise such a class also gives None.
    """
    fn = getattr(kernel_class, "generate_kernels", None)
    token = getattr(fn, "__func__", fn)
    cached = _names.get(kernel_class)
    if cached is not None and cached[0] is token:
        return cached[1]
    names: frozenset[str] | None = None
    try:
        found = kernel_class.generate_kernels(_always, None, None)
    except Exception as exc:  # noqa: BLE001 - methods may be filled in after registration (seed notebook)
        _log.debug("instance names of %s not checked at registration: %s", kernel_class.__qualname__, exc)
    else:
        try:
            names = frozenset(k.metadata.kernel_name for k in _checked_instances(kernel_class, found))
        except TypeError as exc:
            if strict:
                raise RegistrationError(str(exc)) from None
            names = None
    _names[kernel_class] = (token, names)
    return names


def _check_unique_names(provider: type["Provider"], kernel_class: type) -> None:
    """RegistrationError when ``kernel_class`` generates a name another registered class generates."""
    names = _names_of(kernel_class, strict=True)
    if not names:
        return
    key = _class_key(kernel_class)
    for other_provider in list(_providers.values()):
        for other in list(other_provider._classes):
            if other_provider is provider and _class_key(other) == key:
                continue  # the class it replaces
            other_names = _names_of(other)
            clash = sorted(names & other_names) if other_names else ()
            if clash:
                _names.pop(kernel_class, None)  # refused: forget it
                more = f" (and {len(clash) - 1} more)" if len(clash) > 1 else ""
                raise RegistrationError(
                    f"{_class_label(provider, kernel_class)} generates kernel name {clash[0]!r}{more}, which "
                    f"{_class_label(other_provider, other)} already generates; kernel names identify instances "
                    f"in selection and tuning records, so they must be unique (e.g. start them with the class name)")


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
    # Provider base classes (e.g. CudaSourceKernel) may check their class attributes here, so an
    # incomplete class is refused now instead of failing every later discovery.
    check = getattr(kernel_class, "check_definition", None)
    if callable(check):
        try:
            check()
        except Exception as exc:  # noqa: BLE001 - any failure means the class is unusable
            message = str(exc) or type(exc).__name__
            if kernel_class.__name__ not in message:
                message = f"{kernel_class.__name__}: {message}"
            raise RegistrationError(message) from exc


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


def _report_class_error(provider: type[Provider] | None, kernel_class: type, kind: str, message: str) -> None:
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


def _always(_: KernelMetadata) -> bool:
    return True


def _generated(kernel_class: type[Kernel], cc: int | None, epilogue_args: Any, epilogue_key: Any) -> list[Kernel]:
    """The instances of ``kernel_class`` for (cc, epilogue), cached; a class whose generation
    raises or returns something other than uniquely named kernels is reported and gives none."""
    key = (kernel_class, cc, epilogue_key)
    found = _instances.get(key)
    if found is None:
        message = None
        try:
            _prepare_class(kernel_class)  # methods assigned after registration, as notebooks do
            raw = kernel_class.generate_kernels(_always, epilogue_args, cc)
        except Exception as exc:  # noqa: BLE001 - one broken class must not break discovery
            message = f"generate_kernels(cc={cc}) raised {_error_text(exc)}"
        else:
            try:
                found = _checked_instances(kernel_class, raw)
            except TypeError as exc:
                message = str(exc)
        if message is not None:
            found = []
            _generation_errors[key] = message
            _report_class_error(kernel_class._kernel_api_provider, kernel_class, "generate", message)
        _instances[key] = found
    return found


def _name_owners(args_type: type | None, cc: int | None, epilogue_args: Any, epilogue_key: Any) -> dict[str, type]:
    """Instance name -> the class (registered first) whose instance of that name discovery uses,
    over every provider, so a query restricted to some providers agrees with one over all."""
    key = (args_type, cc, epilogue_key)
    owners = _owners.get(key)
    if owners is None:
        owners = {}
        for provider in list(_providers.values()):
            for kernel_class in provider.kernel_classes(args_type):
                for kernel in _generated(kernel_class, cc, epilogue_args, epilogue_key):
                    owners.setdefault(kernel.metadata.kernel_name, kernel_class)
        _owners[key] = owners
    return owners


def _duplicate_owner(kernel: Kernel, kernel_class: type, owners: dict[str, type]) -> type | None:
    """The other class that owns ``kernel``'s name (see `_name_owners`), if any.

    Registration refuses clashing names where it can see them; this catches the rest (names that
    depend on cc or epilogue, methods assigned after registration, classes whose generation
    needs their own module-level name) so that one name always means one instance.
    """
    owner = owners.get(kernel.metadata.kernel_name, kernel_class)
    if owner is kernel_class:
        return None
    _report_class_error(kernel_class._kernel_api_provider, kernel_class, "duplicate",
                        f"instance {kernel.metadata.kernel_name!r} has the name of an instance of "
                        f"{_class_label(owner._kernel_api_provider, owner)}; it is skipped")
    return owner


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
    owners = _name_owners(type(args), cc, epilogue, args.epilogue_signature)
    for provider in chosen:
        for kernel_class in provider.kernel_classes(type(args)):
            for kernel in _generated(kernel_class, cc, epilogue, args.epilogue_signature):
                try:
                    fits = kernel.metadata.supports(args, cc)
                except Exception as exc:  # noqa: BLE001 - one broken instance must not break discovery
                    _report_class_error(provider, kernel_class, "metadata", f"{kernel.metadata.kernel_name}: "
                                        f"metadata.supports raised {_error_text(exc)}")
                    continue
                if fits and _duplicate_owner(kernel, kernel_class, owners) is None:
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
    A kernel class whose generation or support checks raise is skipped where it fails, with
    a warning, and listed in `plugin_errors`.
    """
    _check_query(args, metadata_filter, limit)
    _load_plugins()
    target = resolve_cc(cc, args.device if args is not None else None)
    chosen = _select_providers(providers)
    for provider in chosen:  # methods assigned since (cached) instances were made, as notebooks do
        for kernel_class in provider._classes:
            _prepare_class(kernel_class)
    if args is None:
        owners = _name_owners(None, target, None, None)
        pool = [k for p in chosen for c in p.kernel_classes() for k in _generated(c, target, None, None)
                if _duplicate_owner(k, c, owners) is None]
    else:
        pool = _matching(args, target, chosen)
    result = []
    for kernel in pool:
        if metadata_filter is not None and not metadata_filter(kernel.metadata):
            continue
        if args is not None:
            try:
                status = kernel._supports(args)
            except Exception as exc:  # noqa: BLE001 - one broken instance must not break discovery
                _report_class_error(type(kernel)._kernel_api_provider, type(kernel), "supports",
                                    f"{kernel.metadata.kernel_name}: _supports raised {_error_text(exc)}")
                continue
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


# The messages of TensorAttributes.accepts (metadata.py), recognised to group and shorten them.
_DTYPE_REASON = re.compile(r"operand (\w+): dtype (\S+) but the kernel takes (\S+)$")
_LAYOUT_REASON = re.compile(r"operand (\w+): stride pattern .*\(([\w-]+)\) but the kernel takes .*\(([\w-]+)\)$")
_ALIGN_REASON = re.compile(r"operand (\w+): aligned to (\d+) element\(s\) but the kernel needs (\d+)"
                           r"(?: \([^)]*\))?(?:: (.*))?$")
_GEMM_DIMS = {"A": ("M", "K"), "B": ("K", "N"), "out": ("M", "N")}


def _alignment_detail(args: Any, operand: str, need: int) -> str:
    """Which of ``operand``'s sizes, strides or pointer is not a multiple of ``need`` elements,
    with the problem's values (e.g. "K=4095 not a multiple of 8"); "" when none can be named."""
    t = getattr(args, operand, None)
    if not isinstance(t, torch.Tensor) or t.dim() == 0:
        return ""
    shape, stride, last = tuple(t.shape), t.stride(), t.dim() - 1
    if isinstance(args, GemmArguments) and operand in _GEMM_DIMS and t.dim() >= 2:
        labels = {last - 1: _GEMM_DIMS[operand][0], last: _GEMM_DIMS[operand][1]}
    else:
        labels = {last: "cols"} if hasattr(args, "cols") else {}
    unit = last - 1 if t.dim() > 1 and stride[last] != 1 and stride[last - 1] == 1 else last
    extent = shape[unit]
    bad = []
    if extent % need:
        bad.append(f"{labels.get(unit, f'{operand}.shape[{unit}]')}={extent}")
    for d in range(t.dim()):
        # A dense operand's strides are multiples of its extent: naming them again adds nothing.
        if d == unit or shape[d] <= 1 or not stride[d] % need or (bad and not stride[d] % extent):
            continue
        bad.append(f"{operand}'s {'leading dimension' if d >= last - 1 else 'batch stride'} {stride[d]}")
    if t.device.type != "meta":  # meta tensors count as fully aligned
        boundary = need * t.element_size()
        if t.data_ptr() % boundary:
            bad.append(f"{operand}'s data pointer ({t.data_ptr() % boundary} bytes past a {boundary}-byte boundary)")
    return f"{', '.join(bad)} not a multiple of {need}" if bad else ""


def _with_detail(reason: str, args: Any, cache: dict) -> str:
    """``reason``, plus the problem's values that break an alignment requirement it names."""
    m = _ALIGN_REASON.match(reason)
    if m is None or m.group(4):
        return reason
    key = (m.group(1), int(m.group(3)))
    detail = cache.get(key)
    if detail is None:
        detail = cache[key] = _alignment_detail(args, *key)
    return f"{reason}: {detail}" if detail else reason


def _reason_group(reason: str) -> tuple[tuple, str, str | None]:
    """(group key, short "what would fit" text, a value merged across the group) for summaries."""
    m = _DTYPE_REASON.match(reason)
    if m:
        return ("dtype", m.group(1), m.group(2)), f"needs {m.group(1)} ", m.group(3)
    m = _LAYOUT_REASON.match(reason)
    if m:
        return ("layout",) + m.groups(), f"needs {m.group(1)} {m.group(3)}", None
    m = _ALIGN_REASON.match(reason)
    if m:
        op, need, detail = m.group(1), m.group(3), m.group(4)
        text = f"{op}: {detail}" if detail else f"needs {op} aligned to {need} (is {m.group(2)})"
        return ("align", op, need, detail), text, None
    return ("raw", reason), reason, None


def _clip(line: str, width: int) -> str:
    return line if len(line) <= width else line[:width - 1] + "\u2026"


def _cut(lines: list[str], room: int) -> list[str]:
    """``lines`` in ``room`` lines, the last saying how many were left out."""
    if len(lines) <= room:
        return lines
    keep = max(room - 1, 0)
    return lines[:keep] + [f"  ... {len(lines) - keep} more line(s): .all() lists everything"]


def _fit_name(name: str, class_name: str, width: int) -> str:
    """``name`` in ``width`` columns: the class name it starts with (the heading above) goes first."""
    if len(name) > width and name.startswith(class_name):
        name = "\u2026" + name[len(class_name):]
    return _clip(name, width)


class Explanation(list):
    """A list of `Rejection`s with a readable rendering; ``accepted`` lists the kernels that fit.

    ``str()`` is a summary that fits one screen: the problem, the accepted kernels per class
    (a count and the first few names) and, per class, the reasons for rejection grouped with
    instance counts. ``all()`` is the full text, one line per rejection.
    """

    def __init__(self, rejections: list[Rejection], accepted: list[str], *, problem: str | None = None,
                 cc: int | None = None, accepted_classes: list[tuple[str, str]] | None = None) -> None:
        super().__init__(rejections)
        self.accepted = accepted
        #: ``repr`` of the arguments explained and the target architecture, when known
        self.problem = problem
        self.cc = cc
        # (provider, class) of each accepted name, parallel to ``accepted``
        self._accepted_classes = accepted_classes

    def nearest(self, n: int = 5) -> list[Rejection]:
        return sorted((r for r in self if r.kernel_name is not None), key=lambda r: -r.closeness)[:n]

    def _head(self) -> list[str]:
        if self.problem is None:
            return []
        return [self.problem + ("" if self.cc is None else f" on cc {self.cc}")]

    def all(self) -> str:
        """The full text: every accepted kernel and every rejection with its reason."""
        lines = self._head() + [f"{len(self.accepted)} kernel(s) accepted"]
        classes = self._accepted_classes or [None] * len(self.accepted)
        for name, where in zip(self.accepted, classes):
            lines.append(f"  {where[0]}/{where[1]} {name}" if where else f"  {name}")
        lines.append(f"{len(self)} rejected")
        for r in self:
            where = f"{r.provider}/{r.kernel_class}" + (f" {r.kernel_name}" if r.kernel_name else "")
            lines.append(f"  {where}: {r.reason}")
        return "\n".join(lines)

    def summary(self, max_lines: int = 40, width: int = 120) -> str:
        """At most ``max_lines`` lines of at most ``width`` columns (see the class docstring)."""
        order: dict[tuple[str, str], None] = {}
        accepted: dict[tuple[str, str], list[str]] = {}
        rejected: dict[tuple[str, str], list[Rejection]] = {}
        classes = self._accepted_classes or [("", "")] * len(self.accepted)  # ("", ""): not known
        for name, where in zip(self.accepted, classes):
            order.setdefault(where)
            accepted.setdefault(where, []).append(name)
        for r in self:
            order.setdefault((r.provider, r.kernel_class))
        other_args: dict[str, list[str]] = {}  # arguments type -> classes taking it: one line for all
        class_lines: list[str] = []
        for r in self:
            if r.kernel_name is None:
                if r.reason.startswith("takes "):
                    other_args.setdefault(r.reason[6:].split(",")[0], []).append(r.kernel_class)
                else:
                    class_lines.append(f"  {r.provider}/{r.kernel_class}: {r.reason}")
            else:
                rejected.setdefault((r.provider, r.kernel_class), []).append(r)
        total = {k: len(accepted.get(k, ())) + len(rejected.get(k, ())) for k in order}
        instances = sum(total.values())
        head = self._head()
        if self.accepted:
            head.append(f"{len(self.accepted)} of {instances} kernel instance(s) fit:")
        else:
            head.append(f"no kernel fits ({instances} instance(s) of {len(order)} class(es) considered)")
        reject_lines = [self._rejected_line(k, rs, total[k], width) for k, rs in rejected.items()]
        reject_lines += class_lines
        if other_args:
            reject_lines += [f"  for {k}: {', '.join(v)}" for k, v in other_args.items()]
        if reject_lines:
            reject_lines.insert(0, "Rejected, by class (reasons nearest to fitting first; instance counts):")
        foot = [f"{len(self)} rejection(s): .all() (kernel-api explain --all) lists each"] if len(self) else []
        # As many names per accepted class as the line budget allows (3 at most).
        for per_class in (3, 2, 1, 0):
            accept_lines = []
            for (provider, cls), names in accepted.items():
                shown = names[:per_class]
                which = ":" if len(shown) == len(names) else f", first {len(shown)}:" if shown else f", e.g. {names[0]}"
                label = f"{provider}/{cls}" if cls else "accepted"
                accept_lines.append(f"  {label}: {len(names)} of {total[(provider, cls)]} fit{which}")
                accept_lines += [f"    {_fit_name(n, cls, width - 4)}" for n in shown]
            if len(head) + len(accept_lines) + len(reject_lines) + len(foot) <= max_lines:
                break
        # Still too long (many classes): cut each part, saying how much is left out.
        budget = max(max_lines - len(head) - len(foot), 2)
        keep_rejected = min(len(reject_lines), max(budget // 2, budget - len(accept_lines)))
        accept_lines = _cut(accept_lines, budget - keep_rejected)
        reject_lines = _cut(reject_lines, budget - len(accept_lines))
        return "\n".join(_clip(line, width) for line in head + accept_lines + reject_lines + foot)

    @staticmethod
    def _rejected_line(where: tuple[str, str], rejections: list[Rejection], total: int, width: int) -> str:
        groups: dict[tuple, list] = {}  # key -> [text, merged values, count, closeness]
        for r in rejections:
            key, text, value = _reason_group(r.reason)
            group = groups.setdefault(key, [text, [], 0, r.closeness])
            group[2] += 1
            if value is not None and value not in group[1]:
                group[1].append(value)
        ranked = sorted(groups.values(), key=lambda g: (-g[3], -g[2]))
        pieces = [f"{text}{'/'.join(values)} ({count})" for text, values, count, _ in ranked]
        line = f"  {where[0]}/{where[1]}: {len(rejections)} of {total}: "
        for i, piece in enumerate(pieces):
            rest = len(pieces) - i - 1
            tail = f"; +{rest} more" if rest else ""
            if i and len(line) + len(piece) + len(tail) > width:
                return line.rstrip("; ") + f"; +{len(pieces) - i} more"
            line += piece + ("; " if rest else "")
        return line

    def __str__(self) -> str:
        return self.summary()


def explain(args: Arguments, cc: Any = None, providers: Any = None) -> Explanation:
    """For each registered class and each rejected instance, say why it does not fit ``args``.

    ``str()`` of the result is a one-screen summary; ``.all()`` the full text. Alignment
    reasons name the problem's values that break them (e.g. "K=4095 not a multiple of 8").
    A class whose generation or support check raises is listed with the error (and reported
    as in `get_kernels`) instead of making explain raise.
    """
    _check_query(args, None, None)
    if args is None:
        raise TypeError("explain: args is required")
    _load_plugins()
    target = resolve_cc(cc, args.device)
    rejections: list[Rejection] = []
    accepted: list[str] = []
    accepted_classes: list[tuple[str, str]] = []
    details: dict = {}
    epilogue = getattr(args, "epilogue", None)
    owners = _name_owners(type(args), target, epilogue, args.epilogue_signature)
    for provider in _select_providers(providers):
        for kernel_class in provider.kernel_classes():
            cname = kernel_class.__name__
            if not issubclass(type(args), kernel_class.supported_args_type):
                rejections.append(Rejection(provider.name, cname, None,
                                            f"takes {kernel_class.supported_args_type.__name__}, not {type(args).__name__}"))
                continue
            instances = _generated(kernel_class, target, epilogue, args.epilogue_signature)
            if not instances:
                error = _generation_errors.get((kernel_class, target, args.epilogue_signature))
                what = "with this epilogue" if args.epilogue_signature is not None else ""
                rejections.append(Rejection(provider.name, cname, None, f"broken: {error}" if error else
                                            f"generates no instances for cc={target} {what}".strip()))
                continue
            for kernel in instances:
                name = kernel.metadata.kernel_name
                try:
                    status = kernel.supports(args, target)
                except Exception as exc:  # noqa: BLE001 - one broken instance must not break explain
                    message = f"support check raised {_error_text(exc)}"
                    _report_class_error(provider, kernel_class, "supports", f"{name}: {message}")
                    rejections.append(Rejection(provider.name, cname, name, message))
                    continue
                if not status:
                    rejections.append(Rejection(provider.name, cname, name, _with_detail(status.error, args, details)))
                    continue
                owner = _duplicate_owner(kernel, kernel_class, owners)
                if owner is not None:
                    rejections.append(Rejection(provider.name, cname, name,
                                                f"skipped: {owner.__qualname__} has an instance of this name"))
                    continue
                accepted.append(name)
                accepted_classes.append((provider.name, cname))
    return Explanation(rejections, accepted, problem=repr(args), cc=target, accepted_classes=accepted_classes)


def no_kernel_error(args: Arguments, cc: Any = None) -> NoKernelFoundError:
    """The error to raise when no kernel takes ``args``: it names the nearest misses."""
    nearest = "\n".join(f"  {r.kernel_name or r.kernel_class}: {r.reason}" for r in explain(args, cc).nearest(5))
    return NoKernelFoundError(f"no kernel supports {args!r}" + (f"; nearest misses:\n{nearest}" if nearest else ""))


def clear_caches() -> None:
    """Forget generated instances and cached matches (they are rebuilt on demand)."""
    with _lock:
        _invalidate()
