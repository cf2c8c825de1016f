"""The library this plugin wraps and the releases it was written against.

`check` runs at import, before anything is registered: a missing or broken library raises
ImportError (kernel_api reports it in ``plugin_errors()`` and skips the plugin), and so does a
release outside `SUPPORTED`, since the forward and backward the kernels call are the library's
internal ones and may change in any release.
"""

from __future__ import annotations

from kernel_api.registry import release, require_library

#: This plugin's version (pyproject.toml's).
PLUGIN_VERSION = "0.2.0"
#: The distribution wrapped.
DISTRIBUTION = "flash-attn-4"
#: The library's modules the kernels use, imported by `check`
MODULES = ("flash_attn.cute.interface",)
#: The releases it works with: at least the first, below the second (release numbers only:
#: 4.0.0b36 counts as 4.0.0).
SUPPORTED = ("4.0.0", "4.1")


def check() -> str:
    """The installed version of `DISTRIBUTION`, once it is known to be in `SUPPORTED` and its
    `MODULES` import (`kernel_api.registry.require_library`).

    Returns:
        The version string; ImportError saying what is installed and what is needed otherwise
        (or the library's own ImportError).
    """
    return require_library("kernel-api-flash-attn", PLUGIN_VERSION, DISTRIBUTION, SUPPORTED, MODULES)


__all__ = ["DISTRIBUTION", "MODULES", "PLUGIN_VERSION", "SUPPORTED", "check", "release"]
