"""The versions that compiled artifacts and tuning records depend on, read once per process.

A CuTe DSL object file is valid only for the DSL build that produced it (its version and its
CUDA variant, ``nvidia-cutlass-dsl-libs-cu12`` or ``-cu13``), the Python that ran the DSL and
the kernel_api release; a tuning record's winner holds only for the kernel_api and DSL it was
measured with. Reading installed distributions costs milliseconds, so every answer is cached.
"""

from __future__ import annotations

import functools
import platform
import sys

_DSL = "nvidia-cutlass-dsl"
_DSL_VARIANTS = ("cu12", "cu13")  # the CUDA builds of the DSL's libraries, one distribution each


@functools.lru_cache(maxsize=None)
def distribution_version(name: str) -> str | None:
    """The installed version of distribution ``name``, or None when it is not installed."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


def kernel_api_version() -> str:
    """The version of the kernel_api package that is imported (not necessarily the one installed)."""
    package = sys.modules.get("kernel_api")
    found = getattr(package, "__version__", None)
    return str(found) if found else (distribution_version("kernel-api") or "unknown")


@functools.lru_cache(maxsize=None)
def cutlass_dsl_build() -> str:
    """The CuTe DSL's version and CUDA variant, e.g. ``"4.8.1 cu12"`` ("none" when absent)."""
    variants = [v for v in _DSL_VARIANTS if distribution_version(f"{_DSL}-libs-{v}") is not None]
    return f"{distribution_version(_DSL) or 'none'} {'+'.join(variants) or 'no-cuda-variant'}"


def python_build() -> str:
    """The Python implementation and version, e.g. ``"cpython 3.11.7"``."""
    return f"{sys.implementation.name} {platform.python_version()}"


@functools.lru_cache(maxsize=None)
def tuning_toolchain() -> str:
    """What a recorded winner depends on: kernel_api's version and the DSL's build."""
    return f"kernel_api {kernel_api_version()}; {_DSL} {cutlass_dsl_build()}"


def artifact_toolchain() -> tuple[tuple[str, str], ...]:
    """What a compiled CuTe DSL artifact depends on beyond its sources: kernel_api's version, the
    DSL's version and CUDA variant, TVM-FFI's version and the Python build, as (name, version)
    pairs. Part of every CuTe DSL cache key, and what a bundle of compiled artifacts must match.
    Not cached here (its slow parts are): callers that key on it cache it themselves."""
    return (("kernel_api", kernel_api_version()), ("nvidia-cutlass-dsl", cutlass_dsl_build()),
            ("apache-tvm-ffi", distribution_version("apache-tvm-ffi") or "?"), ("python", python_build()))
