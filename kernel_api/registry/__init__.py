"""Providers, plugins and discovery."""

from .explanation import (ENTRY_POINT_GROUP, Explanation, Provider, Rejection, available_providers, clear_caches,
                          explain, get_kernels, get_provider, no_kernel_error, plugin_errors, register_provider,
                          unregister_provider)
