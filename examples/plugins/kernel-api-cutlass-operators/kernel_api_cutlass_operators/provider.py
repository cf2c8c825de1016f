"""`CutlassOperatorsProvider`: the provider cutlass.operators' kernels are registered with,
versioned by this plugin, nvidia-cutlass-operators and the CuTe DSL."""

from __future__ import annotations

import importlib.metadata

from kernel_api import Provider, register_provider

from .library import PLUGIN_VERSION, check

OPERATORS_VERSION = check()


@register_provider
class CutlassOperatorsProvider(Provider):
    """NVIDIA's cutlass.operators (nvidia-cutlass-operators): its CuTe DSL GEMMs."""

    name = "cutlass_operators"
    version = (f"{PLUGIN_VERSION}+nvidia-cutlass-operators-{OPERATORS_VERSION}"
               f"+cutlass-dsl-{importlib.metadata.version('nvidia-cutlass-dsl')}")
