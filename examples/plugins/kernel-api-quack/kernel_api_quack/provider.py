"""`QuackProvider`: the provider QuACK's kernels are registered with, versioned by this plugin,
QuACK and the CuTe DSL (a new release of any of them re-tunes)."""

from __future__ import annotations

import importlib.metadata

from kernel_api import Provider, register_provider

from .library import PLUGIN_VERSION, check

QUACK_VERSION = check()


@register_provider
class QuackProvider(Provider):
    """QuACK's CuTe DSL kernels (quack-kernels)."""

    name = "quack"
    version = (f"{PLUGIN_VERSION}+quack-kernels-{QUACK_VERSION}"
               f"+cutlass-dsl-{importlib.metadata.version('nvidia-cutlass-dsl')}")
