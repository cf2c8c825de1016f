"""`LigerProvider`: the provider Liger's kernels are registered with, versioned by this plugin,
Liger and Triton (a new release of any of them re-tunes)."""

from __future__ import annotations

import importlib.metadata

from kernel_api import Provider, register_provider

from .library import PLUGIN_VERSION, check

LIGER_VERSION = check()


@register_provider
class LigerProvider(Provider):
    """Liger-Kernel's Triton kernels."""

    name = "liger"
    version = f"{PLUGIN_VERSION}+liger-kernel-{LIGER_VERSION}+triton-{importlib.metadata.version('triton')}"
