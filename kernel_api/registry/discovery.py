"""Discovery: `get_kernels` walks providers → registered classes → generated instances →
support checks, caching instance generation per (class, cc, epilogue kind) and metadata matches
per argument signature. A class whose generation or checks raise is skipped where it fails.
"""

from __future__ import annotations

from typing import Any, Callable

from ..arguments import Arguments
from ..core.arch import resolve_cc
from ..kernel import Kernel, _prepare_class
from ..metadata import KernelMetadata
from .registration import Provider, _load_plugins, _select_providers
from .state import (_candidates, _class_label, _error_text, _generation_errors, _instances, _invalidate, _lock,
                    _owners, _providers, _report_class_error)
from .validation import _always, _checked_instances


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

    Args:
        args: the problem (e.g. `GemmArguments`); None lists every generated instance (for
            ``cc``) that passes ``metadata_filter``.
        metadata_filter: keeps the instances whose `KernelMetadata` it accepts.
        cc: the target architecture, as 90, "90", "sm_90a" or (9, 0); default: the arguments'
            GPU, else the current GPU, else no filtering by architecture. A target that is no
            compute capability (outside 30..199, e.g. 0 or "0", or text that is none) raises
            ValueError naming ``cc``, another kind of value (a float, a bool) TypeError: a
            mistyped target is refused rather than answered with an empty list. A valid target
            that no kernel supports gives [].
        providers: provider names or classes to search (default: all).
        limit: at most this many instances.

    Returns:
        The instances whose metadata and ``_supports`` accept ``args``. A kernel class whose
        generation or support checks raise is skipped where it fails, with a warning, and
        listed in `plugin_errors`.
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


def clear_caches() -> None:
    """Forget generated instances and cached matches (they are rebuilt on demand)."""
    with _lock:
        _invalidate()
