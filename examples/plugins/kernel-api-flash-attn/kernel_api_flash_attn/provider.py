"""`FlashAttnProvider`: the provider FlashAttention-4's kernels are registered with, versioned by
this plugin, flash-attn-4 and the CuTe DSL (a new release of any of them re-tunes)."""

from __future__ import annotations

import importlib.metadata

from kernel_api import Provider, register_provider

from .library import PLUGIN_VERSION, check

FLASH_ATTN_VERSION = check()


@register_provider
class FlashAttnProvider(Provider):
    """FlashAttention-4's CuTe DSL kernels (flash-attn-4, ``flash_attn.cute``)."""

    name = "flash_attn"
    version = (f"{PLUGIN_VERSION}+flash-attn-4-{FLASH_ATTN_VERSION}"
               f"+cutlass-dsl-{importlib.metadata.version('nvidia-cutlass-dsl')}")
