"""Providers: one sub-package per toolchain. Importing them is cheap (toolchains load lazily)."""

from . import cuda_src, cutedsl

__all__ = ["cutedsl", "cuda_src"]
