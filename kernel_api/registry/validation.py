"""Checks of kernel classes: what registration refuses in a class (abstract methods left, no
arguments type, a failing ``check_definition``) and the checks of what ``generate_kernels``
returns. Stateless: the kernel names classes generate are compared in `names`.
"""

from __future__ import annotations

import inspect
import types
import typing
from typing import Any

from ..arguments import Arguments
from ..core.errors import RegistrationError
from ..kernel import Kernel
from ..metadata import KernelMetadata


def accept_all(_: KernelMetadata) -> bool:
    """The metadata filter that keeps every instance."""
    return True


def is_builtin(kernel_class: type) -> bool:
    """Whether ``kernel_class`` is one of the package's own.

    Their names are known to be unique (tests/test_hardening_registry.py checks), so
    registration skips generating them, which keeps generation off the first discovery's
    critical path.
    """
    return kernel_class.__module__.startswith("kernel_api.")


def checked_instances(kernel_class: type, found: Any) -> list[Kernel]:
    """``generate_kernels``' result as a list.

    Args:
        kernel_class: the class whose ``generate_kernels`` returned ``found``.
        found: what it returned.

    Returns:
        The instances; TypeError says what is wrong when they are not uniquely named kernels
        of the class's own making (None counts as no instances).
    """
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


def own_name_bound(kernel_class: type, method: Any) -> Any:
    """``kernel_class.generate_kernels`` with the class's name resolving to the class.

    A class decorator runs before the class's name is bound, so a ``generate_kernels`` that
    makes its instances by that name (``return [MyGemm(md)]``, usual in a static method) would
    raise NameError at registration, or, in a re-run notebook cell, make instances of the class
    being replaced. This calls a copy of the function whose globals (a copy of them) or empty
    closure cell bind the name to ``kernel_class``; nothing the module sees changes.

    Args:
        kernel_class: the class being registered.
        method: its ``generate_kernels`` (function, static or class method).

    Returns:
        ``method``, or a copy of it with the class's name bound.
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


def validate_kernel_class(kernel_class: Any) -> None:
    """Refuse a class registration cannot accept, and settle its arguments type.

    Args:
        kernel_class: what was passed to ``register``.

    Raises:
        RegistrationError: not a `Kernel` subclass, abstract methods left, no arguments type
            (``supported_args_type`` or ``_supports``' annotation, which is then stored as
            ``supported_args_type``), or a failing ``check_definition()`` (provider base classes
            such as `CudaSourceKernel` check their class attributes there, so an incomplete class
            is refused now instead of failing every later discovery).
    """
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
    check = getattr(kernel_class, "check_definition", None)
    if callable(check):
        try:
            check()
        except Exception as exc:  # noqa: BLE001 - any failure means the class is unusable
            message = str(exc) or type(exc).__name__
            if kernel_class.__name__ not in message:
                message = f"{kernel_class.__name__}: {message}"
            raise RegistrationError(message) from exc
