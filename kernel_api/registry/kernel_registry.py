"""The `Registry`: one object holding providers and their kernel classes, plugins (what to
import, how far loading got, what failed) and the discovery caches, so a test or an embedding
application can build its own (``Registry()``), as pluggy's ``PluginManager`` is built.

`default_registry` is the one `kernel_api.get_kernels`, ``Provider.register`` and the other
module-level functions use. `Provider` is the handle a kernel author meets: its class methods
act on the registry that is importing plugins in this context (a plugin's
``@SomeProvider.register`` registers into the registry that imports it), else on the default.
"""

from __future__ import annotations

import contextvars
import inspect
import threading
from typing import Any, Callable, Iterable, Sequence

from ..arguments import Arguments
from ..core.arch import resolve_cc
from ..core.errors import NoKernelFoundError, RegistrationError
from ..kernel import Kernel
from ..metadata import KernelMetadata
from .catalog import Catalog
from .discovery import Discovery, check_query
from .explanation import Explanation, explain_rejections, nearest_misses_error
from .names import InstanceNames
from .plugins import (BUILTIN_PROVIDER_MODULES, ENTRY_POINT_GROUP, EntryPointLike, KernelModules, PluginList,
                      entry_point_targets, import_plugin, read_declaration)
from .reports import FailureReports
from .validation import is_builtin, validate_kernel_class
from .versions import DefaultVersion


class Provider:
    """A family of kernel classes built with one toolchain (CuTe DSL, CUDA C++, ...).

    Subclasses set ``name``. Decorating a `Kernel` subclass with ``@MyProvider.register``
    validates it and makes it discoverable. The class methods act on `registering_registry()`:
    the default registry, or the one importing plugins in this context. For a registry of your
    own, call its methods (``reg.register(MyKernel, MyProvider)``).

    ``version`` is what tuning records are keyed on for this provider's kernels: a new version
    re-tunes the problems they were candidates for. Leave it unset to use the installed version
    of the distribution the provider's package belongs to (kernel_api's own providers: kernel_api's
    version; `kernel_api.registry.versions`), read once per process; set ``version = "..."`` where
    that does not say what the kernels are (a provider defined in a notebook or a source tree).
    """

    name: str = ""
    version: str = DefaultVersion()  # type: ignore[assignment]  # a str on every subclass

    @classmethod
    def register(cls, kernel_class: type) -> type:
        """Class decorator: validate ``kernel_class`` and add it to this provider.

        Args:
            kernel_class: a complete `Kernel` subclass.

        Returns:
            ``kernel_class``; `RegistrationError` says why a class is refused (see
            `Registry.register`).
        """
        return registering_registry().register(kernel_class, cls)

    @classmethod
    def unregister(cls, kernel_class: type) -> None:
        """Remove a class registered with this provider (tests, notebooks).

        Args:
            kernel_class: the class; nothing happens when it is not registered.
        """
        registering_registry().unregister(kernel_class, cls)

    @classmethod
    def kernel_classes(cls, args_type: type | None = None) -> list[type[Kernel]]:
        """Registered classes of this provider, in registration order.

        Args:
            args_type: only the classes accepting this arguments type (default: all).

        Returns:
            The classes.
        """
        return registering_registry().kernel_classes(cls, args_type)


def _is_provider(provider: Any) -> bool:
    return isinstance(provider, type) and issubclass(provider, Provider) and provider is not Provider


class Registry:
    """Providers, their kernel classes, plugins and discovery caches.

    Args:
        entry_point_group: the entry-point group whose installed plugins discovery imports
            first (default: none; the default registry's is ``"kernel_api.providers"``).
        builtin_modules: modules imported before those plugins (the default registry's are the
            package's own providers).

    Every change (a class or provider registered or unregistered) empties the cached matches
    and forgets the instances of the classes it concerns; other classes keep theirs, so kernel
    modules imported later (another arguments type's) leave the instances in use alone. Loading
    plugins is thread-safe: other threads wait until it finished; a plugin that calls discovery
    while it loads sees what is registered so far.
    """

    def __init__(self, entry_point_group: str | None = None, builtin_modules: Sequence[str] = ()) -> None:
        self._lock = threading.RLock()
        self._catalog = Catalog()
        self._reports = FailureReports()
        self._names = InstanceNames()
        self._plugins = PluginList(entry_point_group, builtin_modules)
        self._discovery = Discovery(self._catalog, self._reports)

    def __repr__(self) -> str:
        return f"<Registry providers={self._catalog.names()}>"

    # ---- registration --------------------------------------------------------------------
    def register(self, kernel_class: type, provider: type[Provider]) -> type:
        """Validate ``kernel_class`` and add it to ``provider`` (registering the provider too).

        Args:
            kernel_class: a complete `Kernel` subclass.
            provider: the `Provider` subclass it belongs to.

        Returns:
            ``kernel_class``, whose ``_kernel_api_provider`` is now ``provider``.

        Raises:
            RegistrationError: the class is incomplete (abstract methods, no arguments type, a
                failing ``check_definition()`` classmethod where the class has one), or its
                instances reuse a kernel name another registered class generates (kernel names
                identify instances in selection and tuning records). Registering a class of the
                same module and qualified name again (a re-run notebook cell) replaces it.
        """
        if provider is Provider:
            raise RegistrationError("register kernels with a concrete provider, e.g. CuTeDSLProvider.register")
        validate_kernel_class(kernel_class)
        with self._lock:
            self.register_provider(provider)
            if not is_builtin(kernel_class):
                # Compare names with every class that discovery would load, built-ins included,
                # so that a clash is always charged to the plugin, never to a built-in class.
                self.load_plugins()
                self._names.check_unique(provider, kernel_class, self._catalog.registered())
            replaced = self._catalog.add_class(provider, kernel_class)
            for old in replaced:
                self._forget_class(provider, old)
            type.__setattr__(kernel_class, "_kernel_api_provider", provider)
            self._discovery.changed((kernel_class, *replaced))
        return kernel_class

    def unregister(self, kernel_class: type, provider: type[Provider] | None = None) -> None:
        """Remove ``kernel_class`` from its provider (tests, notebooks).

        Args:
            kernel_class: the class; nothing happens when it is not registered there.
            provider: its provider (default: the one it was last registered with).
        """
        if provider is None:
            provider = getattr(kernel_class, "_kernel_api_provider", None)
        with self._lock:
            if self._catalog.remove_class(provider, kernel_class):
                self._forget_class(provider, kernel_class)
                self._discovery.changed((kernel_class,))

    def _forget_class(self, provider: type[Provider], kernel_class: type) -> None:
        self._names.forget(kernel_class)
        self._reports.forget_class(provider, kernel_class)

    def register_provider(self, provider: type[Provider]) -> type[Provider]:
        """Make a provider known to discovery (usable as a class decorator).

        Args:
            provider: a `Provider` subclass with a non-empty ``name`` (and a non-empty string
                ``version`` where it sets one).

        Returns:
            ``provider``. Registering it again does nothing; `RegistrationError` when another
            provider has its name, or its ``name`` or ``version`` is no non-empty string.
        """
        if not _is_provider(provider):
            raise RegistrationError(f"register_provider expects a Provider subclass, got {provider!r}")
        if not provider.name or not isinstance(provider.name, str):
            raise RegistrationError(f"{provider.__name__}.name must be a non-empty string")
        version = inspect.getattr_static(provider, "version")
        if not isinstance(version, DefaultVersion) and not (isinstance(version, str) and version):
            raise RegistrationError(f"{provider.__name__}.version must be a non-empty string (or unset), "
                                    f"got {version!r}")
        with self._lock:
            existing = self._catalog.provider(provider.name)
            if existing is not None and existing is not provider:
                raise RegistrationError(f"a provider named {provider.name!r} is already registered "
                                        f"({existing.__module__}.{existing.__qualname__})")
            if existing is None:
                self._catalog.add_provider(provider)
                self._discovery.changed(())
        return provider

    def unregister_provider(self, name: str) -> None:
        """Forget a provider and its classes (tests, notebooks).

        Args:
            name: the provider's name; nothing happens when none has it.
        """
        with self._lock:
            removed = self._catalog.remove_provider(name)
            if removed is not None:
                provider, classes = removed
                for kernel_class in classes:
                    self._forget_class(provider, kernel_class)
                self._discovery.changed(classes)

    def kernel_classes(self, provider: type[Provider], args_type: type | None = None) -> list[type[Kernel]]:
        """``provider``'s registered classes, in registration order.

        Args:
            provider: a provider class.
            args_type: only the classes accepting this arguments type (default: all).

        Returns:
            The classes (none for a provider not registered here), once the plugins' kernel
            modules for ``args_type`` (all of them without one) are imported.
        """
        self._load(args_type)
        classes = self._catalog.classes(provider)
        if args_type is None:
            return list(classes)
        return [k for k in classes if issubclass(args_type, k.supported_args_type)]

    def available_providers(self) -> list[str]:
        """Names of the registered providers, in registration order (plugins imported first; a
        plugin that declares its kernel modules registers its provider when it is imported).

        Returns:
            The names.
        """
        self._load(None, kernels=False)
        return self._catalog.names()

    def get_provider(self, name: str) -> type[Provider]:
        """The provider registered as ``name`` (plugins imported first, as for `available_providers`).

        Args:
            name: a provider name such as "cutedsl".

        Returns:
            The provider class; ValueError lists the available names when none has it.
        """
        self._load(None, kernels=False)
        provider = self._catalog.provider(name)
        if provider is None:
            raise ValueError(f"providers: unknown provider {name!r}; available: {self._catalog.names()}")
        return provider

    def select_providers(self, providers: Any) -> tuple[type[Provider], ...]:
        """The providers a query names.

        Args:
            providers: None (every registered provider), a name, a `Provider` subclass, or an
                iterable of names and classes.

        Returns:
            The providers, in the order given (registration order for None). An unknown name
            raises ValueError, anything else that is neither TypeError.
        """
        if providers is None:
            return self._catalog.providers
        if isinstance(providers, (str, type)):
            providers = [providers]
        if not isinstance(providers, Iterable):
            raise TypeError(f"providers: expected provider names or classes, got {type(providers).__name__}")
        chosen = []
        for p in providers:
            if isinstance(p, str):
                chosen.append(self.get_provider(p))
            elif isinstance(p, type) and issubclass(p, Provider):
                chosen.append(p)
            else:
                raise TypeError(f"providers: {p!r} is neither a provider name nor a Provider subclass")
        return tuple(chosen)

    # ---- plugins -------------------------------------------------------------------------
    @property
    def plugins_loaded(self) -> bool:
        """Whether the registry's own plugins were imported (discovery imports them first; the
        kernel modules they declare follow per arguments type)."""
        return self._plugins.loaded

    def load_plugins(self, entry_points: Iterable[EntryPointLike] | None = None) -> None:
        """Import plugins into this registry, with every kernel module they declare: first, once,
        its own (built-in modules, then the entry points installed in its group), then
        ``entry_points``.

        A plugin is a module (``"module"``) whose imports register providers and classes, or a
        provider (``"module:Provider"``), registered here. A module may instead declare its
        kernel modules per arguments type (``KERNEL_MODULES``, `kernel_api.registry.plugins`):
        discovery of one arguments type imports only that type's, and this method all of them.
        While this registry imports them, ``Provider.register`` and `register_provider` act on
        it. Whatever an import raises is reported in `plugin_errors` and that plugin (or kernel
        module) skipped, BaseExceptions too (``sys.exit()``, GeneratorExit...): one plugin must
        not end the process or stop the plugins after it. Except KeyboardInterrupt, which
        propagates (a Ctrl-C must stop the program, and one a plugin raises cannot be told from
        it); loading counts as done only when it finished, so the next discovery tries again.

        Other threads wait until loading finished, so no discovery (and no choice the ops
        dispatch caches) sees part of the kernels it asked for. The loading thread itself may
        call discovery from a plugin's import: it sees what is registered so far.

        Args:
            entry_points: more plugins to import now, whole (objects with ``name`` and
                ``value``, such as `importlib.metadata.EntryPoint`); discovery passes none.
        """
        self._load(None)
        if entry_points is not None:
            with self._lock:
                declarations = self._import_plugins(entry_point_targets(entry_points))
                self._import_kernel_modules([(d.label, m) for d in declarations for m in d.for_type(None)])

    def _load(self, args_type: type | None, kernels: bool = True) -> None:
        """Import this registry's plugins once, then the kernel modules they declare for
        ``args_type`` (None: all; ``kernels`` False: none), waiting for another thread's loading."""
        plugins = self._plugins
        if plugins.ready(args_type, kernels):
            return
        with self._lock:
            if plugins.busy or plugins.ready(args_type, kernels):
                return  # busy: this thread is loading, and sees what is registered so far
            plugins.busy = True
            try:
                if not plugins.loaded:
                    plugins.declared(self._import_plugins(plugins.targets(self._reports)))
                if kernels:
                    self._import_kernel_modules(plugins.pending(args_type))
                    plugins.served_now(args_type)
            finally:
                plugins.busy = False

    def _import_plugins(self, targets: list[tuple[str, str]]) -> list[KernelModules]:
        """Import ``targets``; the declarations of those that declare their kernel modules."""
        declarations = []
        token = _registering_into.set(self)
        try:
            for name, value in targets:
                try:
                    module, obj = import_plugin(value)
                    if _is_provider(obj):
                        self.register_provider(obj)
                    declaration = read_declaration(name, module)
                except KeyboardInterrupt:
                    raise
                except BaseException as exc:  # noqa: BLE001 - see load_plugins
                    self._reports.plugin_failed(f"{name} ({value})", exc)
                else:
                    if declaration is not None:
                        declarations.append(declaration)
        finally:
            _registering_into.reset(token)
        return declarations

    def _import_kernel_modules(self, modules: list[tuple[str, str]]) -> None:
        """Import each (plugin label, module), reporting failures as `_import_plugins` does."""
        token = _registering_into.set(self)
        try:
            for label, module in modules:
                try:
                    __import__(module)  # as an import statement does: `python -X importtime` lists it
                except KeyboardInterrupt:
                    raise
                except BaseException as exc:  # noqa: BLE001 - see load_plugins
                    self._reports.plugin_failed(f"{label} ({module})", exc)
                self._plugins.attempted.add(module)
        finally:
            _registering_into.reset(token)

    def reset_plugins(self) -> None:
        """Forget that the plugins were loaded, and their failures: the next discovery imports
        them again (tests; modules already imported are not run again)."""
        with self._lock:
            self._plugins.forget()
            self._reports.forget_plugins()

    def plugin_errors(self) -> dict[str, str]:
        """Plugins that failed to load, and kernel classes that discovery skips (in part)
        because their generation or support checks raise (plugins loaded first).

        Returns:
            {"name (module)" or "provider/Class (module)": "what went wrong"}.
        """
        self.load_plugins()
        return self._reports.as_dict()

    # ---- discovery -----------------------------------------------------------------------
    def get_kernels(self, args: Arguments | None = None,
                    metadata_filter: Callable[[KernelMetadata], bool] | None = None, cc: Any = None,
                    providers: Any = None, limit: int | None = None) -> list[Kernel]:
        """Every kernel instance that can run ``args``, in generation order.

        Args:
            args: the problem (e.g. `GemmArguments`); None lists every generated instance (for
                ``cc``) that passes ``metadata_filter``.
            metadata_filter: keeps the instances whose `KernelMetadata` it accepts.
            cc: the target architecture, as 90, "90", "sm_90a" or (9, 0); default: the
                arguments' GPU, else the current GPU, else no filtering by architecture. A
                target that is no compute capability (outside 30..199, e.g. 0 or "0", or text
                that is none) raises ValueError naming ``cc``, another kind of value (a float, a
                bool) TypeError: a mistyped target is refused rather than answered with an empty
                list. A valid target that no kernel supports gives [].
            providers: provider names or classes to search (default: all).
            limit: at most this many instances.

        Returns:
            The instances whose metadata and ``_supports`` accept ``args``. A kernel class
            whose generation or support checks raise is skipped where it fails, with a warning,
            and listed in `plugin_errors`. The first query for an arguments type imports the
            kernel modules the plugins declare for it (with no ``args``: all of them).
        """
        check_query(args, metadata_filter, limit)
        self._load(None if args is None else type(args))
        target = resolve_cc(cc, args.device if args is not None else None)
        chosen = self._catalog.providers if providers is None else self.select_providers(providers)
        return self._discovery.find(args, metadata_filter, target, chosen, limit)

    def explain(self, args: Arguments, cc: Any = None, providers: Any = None) -> Explanation:
        """For each registered class and each rejected instance, say why it does not fit ``args``.

        Args:
            args: the problem.
            cc: the target architecture (as in `get_kernels`).
            providers: provider names or classes to explain (default: all).

        Returns:
            The `Explanation`: ``str()`` is a one-screen summary, ``.all()`` the full text.
            Alignment reasons name the problem's values that break them (e.g. "K=4095 not a
            multiple of 8"). A class whose generation or support check raises is listed with the
            error (and reported as in `get_kernels`) instead of making explain raise.
        """
        check_query(args, None, None)
        if args is None:
            raise TypeError("explain: args is required")
        self.load_plugins()
        target = resolve_cc(cc, args.device)
        return explain_rejections(self._discovery, self.select_providers(providers), args, target)

    def no_kernel_error(self, args: Arguments, cc: Any = None) -> NoKernelFoundError:
        """The error to raise when no kernel takes ``args``.

        Args:
            args: the problem.
            cc: the target architecture (as in `get_kernels`).

        Returns:
            A `NoKernelFoundError` naming the nearest misses (see `explain`).
        """
        return nearest_misses_error(args, self.explain(args, cc))

    def clear_caches(self) -> None:
        """Forget generated instances and cached matches (they are rebuilt on demand)."""
        with self._lock:
            self._discovery.clear()


#: The registry the module-level functions and ``Provider``'s class methods use.
default_registry = Registry(ENTRY_POINT_GROUP, BUILTIN_PROVIDER_MODULES)

# The registry importing plugins in this context (see Registry.load_plugins), if any.
_registering_into: contextvars.ContextVar[Registry | None] = contextvars.ContextVar(
    "kernel_api_registering_into", default=None)


def registering_registry() -> Registry:
    """The registry ``Provider.register``, `register_provider` and their kind act on: the one
    importing plugins in this context, else `default_registry`.

    Returns:
        The registry.
    """
    return _registering_into.get() or default_registry


def register_provider(provider: type[Provider]) -> type[Provider]:
    """`Registry.register_provider` on `registering_registry()` (usable as a class decorator).

    Args:
        provider: a `Provider` subclass with a non-empty ``name``.

    Returns:
        ``provider``.
    """
    return registering_registry().register_provider(provider)


def unregister_provider(name: str) -> None:
    """`Registry.unregister_provider` on `registering_registry()`: forget a provider and its classes.

    Args:
        name: the provider's name.
    """
    registering_registry().unregister_provider(name)
