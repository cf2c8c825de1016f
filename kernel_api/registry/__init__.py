"""Providers, plugins and discovery.

A `Provider` groups the kernel classes written with one toolchain; ``Provider.register`` is
the bring-your-own-kernel decorator. Plugins are modules named in the entry-point group
``kernel_api.providers``; they are imported once, on first discovery. `get_kernels` walks
providers → registered classes → generated instances → support checks, caching instance
generation per (class, cc, epilogue kind) and metadata matches per argument signature.

The modules, bottom up: ``state`` (the registered providers, caches and failure reports),
``validation`` (what registration refuses), ``registration`` (providers, plugins),
``discovery`` (`get_kernels`), ``explanation`` (`explain`, `no_kernel_error`).
"""

from .discovery import clear_caches, get_kernels
from .explanation import Explanation, Rejection, explain, no_kernel_error
from .registration import (ENTRY_POINT_GROUP, Provider, available_providers, get_provider, plugin_errors,
                           register_provider, unregister_provider)

__all__ = ["ENTRY_POINT_GROUP", "Explanation", "Provider", "Rejection", "available_providers", "clear_caches",
           "explain", "get_kernels", "get_provider", "no_kernel_error", "plugin_errors", "register_provider",
           "unregister_provider"]
