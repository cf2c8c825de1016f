"""Kernel names are unique: they identify instances in selection and tuning records. At
registration a class's instance names (at cc=None, without an epilogue) are compared with
those of every class registered before it; discovery catches the clashes registration cannot
see (`Discovery.duplicate_owner`).
"""

from __future__ import annotations

import logging
from typing import Any, Iterable

from ..core.errors import RegistrationError
from .catalog import class_key
from .reports import class_label
from .validation import accept_all, checked_instances, own_name_bound

_log = logging.getLogger(__name__)


class InstanceNames:
    """The instance names of each class, cached per class and ``generate_kernels`` function
    (notebooks assign methods after registering)."""

    def __init__(self) -> None:
        self._by_class: dict[type, tuple[Any, frozenset[str] | None]] = {}

    def of(self, kernel_class: type, strict: bool = False) -> frozenset[str] | None:
        """The names of ``kernel_class``'s instances at (cc=None, no epilogue).

        Args:
            kernel_class: a kernel class.
            strict: for the class being registered: instances that are not kernels, or two
                instances of one name, raise `RegistrationError`; otherwise such a class gives None.

        Returns:
            The names, or None when generation raises (discovery reports it) or, without
            ``strict``, returns something other than uniquely named kernels.
        """
        fn = getattr(kernel_class, "generate_kernels", None)
        token = getattr(fn, "__func__", fn)
        cached = self._by_class.get(kernel_class)
        if cached is not None and cached[0] is token:
            return cached[1]
        names: frozenset[str] | None = None
        try:
            found = own_name_bound(kernel_class, fn)(accept_all, None, None)
        except Exception as exc:  # noqa: BLE001 - methods may be filled in after registration (seed notebook)
            _log.debug("instance names of %s not checked at registration: %s", kernel_class.__qualname__, exc)
        else:
            try:
                names = frozenset(k.metadata.kernel_name for k in checked_instances(kernel_class, found))
            except TypeError as exc:
                if strict:
                    raise RegistrationError(str(exc)) from None
        self._by_class[kernel_class] = (token, names)
        return names

    def forget(self, kernel_class: type) -> None:
        """Drop the cached names of ``kernel_class`` (unregistered, replaced or refused)."""
        self._by_class.pop(kernel_class, None)

    def check_unique(self, provider: Any, kernel_class: type, registered: Iterable[tuple[Any, type]]) -> None:
        """Refuse ``kernel_class`` when it generates a name that a registered class generates.

        Args:
            provider: the provider ``kernel_class`` is being registered with.
            kernel_class: the class being registered.
            registered: (provider, class) of every registered class; a class of ``provider``
                with the same module and qualified name is the one being replaced and is skipped.

        Raises:
            RegistrationError: naming both classes and the first shared name.
        """
        names = self.of(kernel_class, strict=True)
        if not names:
            return
        key = class_key(kernel_class)
        for other_provider, other in list(registered):
            if other_provider is provider and class_key(other) == key:
                continue  # the class it replaces
            other_names = self.of(other)
            clash = sorted(names & other_names) if other_names else ()
            if clash:
                self.forget(kernel_class)  # refused: forget it
                more = f" (and {len(clash) - 1} more)" if len(clash) > 1 else ""
                raise RegistrationError(
                    f"{class_label(provider, kernel_class)} generates kernel name {clash[0]!r}{more}, which "
                    f"{class_label(other_provider, other)} already generates; kernel names identify instances "
                    f"in selection and tuning records, so they must be unique (e.g. start them with the class name)")
