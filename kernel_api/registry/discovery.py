"""Discovery: providers → registered classes → generated instances → support checks, with the
caches that make a repeated query cost microseconds: instances per (class, cc, epilogue kind),
name owners per (arguments type, cc, epilogue kind) and metadata matches per argument
signature. A class whose generation or checks raise is skipped where it fails and reported.
"""

from __future__ import annotations

from typing import Any, Callable

from ..arguments import Arguments
from ..kernel import Kernel, prepare_class
from ..metadata import KernelMetadata
from .catalog import Catalog
from .reports import FailureReports, class_label, error_text
from .validation import accept_all, checked_instances


def check_query(args: Any, metadata_filter: Any, limit: Any) -> None:
    """TypeError or ValueError naming the parameter of a query that cannot be answered."""
    if args is not None and not isinstance(args, Arguments):
        raise TypeError(
            f"args: expected an arguments object such as GemmArguments or SoftmaxArguments, got {type(args).__name__}")
    if metadata_filter is not None and not callable(metadata_filter):
        raise TypeError(f"metadata_filter: expected a callable taking KernelMetadata, got {type(metadata_filter).__name__}")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
        raise ValueError(f"limit: expected a non-negative int or None, got {limit!r}")


class Discovery:
    """The instances a registry's classes generate, and which of them fit a problem.

    Args:
        catalog: the registry's providers and classes.
        reports: where broken classes are reported.
    """

    def __init__(self, catalog: Catalog, reports: FailureReports) -> None:
        self.catalog = catalog
        self.reports = reports
        self._instances: dict[tuple, list[Kernel]] = {}
        self._generation_errors: dict[tuple, str] = {}  # why generation failed, per _instances key
        self._owners: dict[tuple, dict[str, type]] = {}
        self._candidates: dict[tuple, list[Kernel]] = {}

    def clear(self) -> None:
        """Forget every cached instance and match (they are rebuilt on demand)."""
        self._instances.clear()
        self._generation_errors.clear()
        self._owners.clear()
        self._candidates.clear()

    def changed(self, kernel_classes: tuple[type, ...]) -> None:
        """The registered classes or providers changed: forget every match (matches and name
        owners depend on all registered classes) and the instances of ``kernel_classes``.

        Other classes keep their instances, which depend on nothing but their class: the
        kernels a caller holds (and the artifacts compiled on them) stay the ones discovery
        returns when another arguments type's kernel modules are imported later.
        """
        self._owners.clear()
        self._candidates.clear()
        for cache in (self._instances, self._generation_errors):
            for key in list(cache):  # (a copy: a discovery in another thread may add entries)
                if key[0] in kernel_classes:
                    cache.pop(key, None)

    def instances(self, kernel_class: type[Kernel], cc: int | None, epilogue_args: Any,
                  epilogue_key: Any) -> list[Kernel]:
        """Every instance of ``kernel_class`` for ``cc`` and the epilogue, generated once.

        Args:
            kernel_class: a registered class.
            cc: the target architecture, or None.
            epilogue_args: the problem's epilogue (or None), passed to ``generate_kernels``.
            epilogue_key: its signature, which the cache is keyed by.

        Returns:
            The instances; none for a class whose generation raises or returns something other
            than uniquely named kernels (reported, see `generation_error`).
        """
        key = (kernel_class, cc, epilogue_key)
        found = self._instances.get(key)
        if found is None:
            message = None
            try:
                prepare_class(kernel_class)  # methods assigned after registration, as notebooks do
                raw = kernel_class.generate_kernels(accept_all, epilogue_args, cc)
            except Exception as exc:  # noqa: BLE001 - one broken class must not break discovery
                message = f"generate_kernels(cc={cc}) raised {error_text(exc)}"
            else:
                try:
                    found = checked_instances(kernel_class, raw)
                except TypeError as exc:
                    message = str(exc)
            if message is not None:
                found = []
                self._generation_errors[key] = message
                self.reports.class_failed(kernel_class._kernel_api_provider, kernel_class, "generate", message)
            self._instances[key] = found
        return found

    def generation_error(self, kernel_class: type, cc: int | None, epilogue_key: Any) -> str | None:
        """Why `instances` gave none for these keys because generation failed, or None."""
        return self._generation_errors.get((kernel_class, cc, epilogue_key))

    def name_owners(self, args_type: type | None, cc: int | None, epilogue_args: Any,
                    epilogue_key: Any) -> dict[str, type]:
        """Instance name -> the class (registered first) whose instance of that name discovery
        uses, over every provider, so a query restricted to some providers agrees with one over all."""
        key = (args_type, cc, epilogue_key)
        owners = self._owners.get(key)
        if owners is None:
            owners = {}
            for _, kernel_class in self.catalog.registered():
                if args_type is None or issubclass(args_type, kernel_class.supported_args_type):
                    for kernel in self.instances(kernel_class, cc, epilogue_args, epilogue_key):
                        owners.setdefault(kernel.metadata.kernel_name, kernel_class)
            self._owners[key] = owners
        return owners

    def duplicate_owner(self, kernel: Kernel, kernel_class: type, owners: dict[str, type]) -> type | None:
        """The other class that owns ``kernel``'s name (see `name_owners`), if any.

        Registration refuses clashing names where it can see them; this catches the rest (names
        that depend on cc or epilogue, methods assigned after registration, classes whose
        generation needs their own module-level name) so that one name always means one
        instance. The skipped class is reported.
        """
        owner = owners.get(kernel.metadata.kernel_name, kernel_class)
        if owner is kernel_class:
            return None
        self.reports.class_failed(kernel_class._kernel_api_provider, kernel_class, "duplicate",
                                  f"instance {kernel.metadata.kernel_name!r} has the name of an instance of "
                                  f"{class_label(owner._kernel_api_provider, owner)}; it is skipped")
        return owner

    def _matching(self, args: Any, cc: int | None, chosen: tuple) -> list[Kernel]:
        """Instances of ``chosen`` providers whose metadata accepts ``args`` (cached per signature)."""
        found: list[Kernel] = []
        epilogue = getattr(args, "epilogue", None)
        args_type = type(args)
        owners = self.name_owners(args_type, cc, epilogue, args.epilogue_signature)
        for provider in chosen:
            for kernel_class in self.catalog.classes(provider):
                if not issubclass(args_type, kernel_class.supported_args_type):
                    continue
                for kernel in self.instances(kernel_class, cc, epilogue, args.epilogue_signature):
                    try:
                        fits = kernel.metadata.supports(args, cc)
                    except Exception as exc:  # noqa: BLE001 - one broken instance must not break discovery
                        self.reports.class_failed(provider, kernel_class, "metadata", f"{kernel.metadata.kernel_name}: "
                                                  f"metadata.supports raised {error_text(exc)}")
                        continue
                    if fits and self.duplicate_owner(kernel, kernel_class, owners) is None:
                        found.append(kernel)
        self._candidates[(args.signature, cc, chosen)] = found
        return found

    def _every_instance(self, cc: int | None, chosen: tuple) -> list[Kernel]:
        owners = self.name_owners(None, cc, None, None)
        return [kernel for provider in chosen for kernel_class in self.catalog.classes(provider)
                for kernel in self.instances(kernel_class, cc, None, None)
                if self.duplicate_owner(kernel, kernel_class, owners) is None]

    def find(self, args: Arguments | None, metadata_filter: Callable[[KernelMetadata], bool] | None,
             cc: int | None, chosen: tuple, limit: int | None) -> list[Kernel]:
        """The instances of ``chosen`` providers that can run ``args``, in generation order.

        Args:
            args: the problem; None lists every instance generated for ``cc``.
            metadata_filter: keeps the instances whose metadata it accepts (or None).
            cc: the target architecture (resolved), or None.
            chosen: the providers to search.
            limit: at most this many instances (or None).

        Returns:
            The instances whose metadata and ``_supports`` accept ``args``.
        """
        classes = self.catalog.classes
        for provider in chosen:  # methods assigned since (cached) instances were made, as notebooks do
            for kernel_class in classes(provider):
                prepare_class(kernel_class)
        if args is None:
            pool = self._every_instance(cc, chosen)
        else:
            pool = self._candidates.get((args.signature, cc, chosen))
            if pool is None:
                pool = self._matching(args, cc, chosen)
        result = []
        for kernel in pool:
            if metadata_filter is not None and not metadata_filter(kernel.metadata):
                continue
            if args is not None:
                try:
                    status = kernel._supports(args)
                except Exception as exc:  # noqa: BLE001 - one broken instance must not break discovery
                    self.reports.class_failed(type(kernel)._kernel_api_provider, type(kernel), "supports",
                                              f"{kernel.metadata.kernel_name}: _supports raised {error_text(exc)}")
                    continue
                if status is not None and not status:
                    continue
            result.append(kernel)
            if limit is not None and len(result) >= limit:
                break
        return result
