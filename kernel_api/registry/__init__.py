"""Providers, plugins and discovery.

A `Registry` holds providers and their kernel classes, plugins and the discovery caches; build
one of your own with ``Registry()``. The module-level functions here act on `default_registry`,
the one `kernel_api.get_kernels` searches. A `Provider` groups the kernel classes written with
one toolchain; ``Provider.register`` is the bring-your-own-kernel decorator. Plugins are modules
(or providers) named in the entry-point group ``kernel_api.providers``: on its first discovery
the default registry imports the built-in providers' ``register_kernels`` modules
(`BUILTIN_PROVIDER_MODULES`), then those plugins, once. A plugin module may declare its kernel
modules per arguments type (``KERNEL_MODULES``, as the built-in ones do): discovery imports a
type's the first time it is asked for that type, and all of them when it lists every kernel. A
``Registry()`` imports neither unless given a group of its own or entry points
(``load_plugins``). `get_kernels` walks providers →
registered classes → generated instances → support checks, caching instance generation per
(class, cc, epilogue kind) and metadata matches per argument signature.

The modules, bottom up: ``catalog`` (what is registered), ``reports`` (what failed),
``validation`` and ``names`` (what registration refuses), ``versions`` (each provider's version,
which tuning records are keyed on), ``plugins`` (what is imported),
``discovery`` (the instances that fit), ``explanation`` (why the others do not),
``kernel_registry`` (`Registry`, `Provider`, `default_registry`).
"""

from .explanation import Explanation, Rejection
from .kernel_registry import (Provider, Registry, default_registry, register_provider, registering_registry,
                              unregister_provider)
from .plugins import BUILTIN_PROVIDER_MODULES, ENTRY_POINT_GROUP
from .versions import release, require_library

# The default registry's methods, bound: a module-level call costs no more than the method's.
get_kernels = default_registry.get_kernels
explain = default_registry.explain
no_kernel_error = default_registry.no_kernel_error
plugin_errors = default_registry.plugin_errors
available_providers = default_registry.available_providers
get_provider = default_registry.get_provider
select_providers = default_registry.select_providers
clear_caches = default_registry.clear_caches

__all__ = ["BUILTIN_PROVIDER_MODULES", "ENTRY_POINT_GROUP", "Explanation", "Provider", "Registry", "Rejection",
           "available_providers", "clear_caches", "default_registry", "explain", "get_kernels", "get_provider",
           "no_kernel_error", "plugin_errors", "register_provider", "registering_registry", "release",
           "require_library", "select_providers",
           "unregister_provider"]
