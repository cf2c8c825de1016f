"""Checks of kernel classes: what registration refuses (incomplete classes, kernel names that
another registered class already generates) and the checks of what ``generate_kernels`` returns.
"""

from __future__ import annotations

import inspect
import logging
import types
import typing
from typing import Any

from ..arguments import Arguments
from ..core.errors import RegistrationError
from ..kernel import Kernel
from ..metadata import KernelMetadata
from .state import _class_label, _names, _providers

_log = logging.getLogger(__name__)


def _class_key(kernel_class: type) -> tuple[str, str]:
    return (kernel_class.__module__, kernel_class.__qualname__)


def _is_builtin(kernel_class: type) -> bool:
    # The package's own classes are known to have unique names (tests/test_hardening_registry.py
    # checks); skipping them keeps generation off the first discovery's critical path.
    return kernel_class.__module__.startswith("kernel_api.")


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
        found = _own_name_bound(kernel_class, fn)(_always, None, None)
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


def _own_name_bound(kernel_class: type, method: Any) -> Any:
    """``kernel_class.generate_kernels`` with the class's name resolving to the class.

    A class decorator runs before the class's name is bound, so a ``generate_kernels`` that
    makes its instances by that name (``return [MyGemm(md)]``, usual in a static method) would
    raise NameError at registration, or, in a re-run notebook cell, make instances of the class
    being replaced. This calls a copy of the function whose globals (a copy of them) or empty
    closure cell bind the name to ``kernel_class``; nothing the module sees changes.
    """
    func = getattr(method, "__func__", method)
    if not isinstance(func, types.FunctionType):
        return method
    name, code = kernel_class.__name__, func.__code__
    namespace = func.__globals__
    rebind_global = name in code.co_names and namespace.get(name) is not kernel_class
    closure = func.__closure__
    if closure and name in code.co_freevars:
        cell = closure[code.co_freevars.index(name)]
        try:
            cell.cell_contents
        except ValueError:  # the class's own, not assigned yet
            closure = tuple(types.CellType(kernel_class) if c is cell else c for c in closure)
    if not rebind_global and closure is func.__closure__:
        return method
    copy = types.FunctionType(code, dict(namespace, **{name: kernel_class}) if rebind_global else namespace,
                              func.__name__, func.__defaults__, closure)
    copy.__kwdefaults__ = func.__kwdefaults__
    owner = getattr(method, "__self__", None)  # a classmethod's class
    return types.MethodType(copy, owner) if owner is not None else copy


def _check_unique_names(provider: type, kernel_class: type) -> None:
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


def _always(_: KernelMetadata) -> bool:
    return True
