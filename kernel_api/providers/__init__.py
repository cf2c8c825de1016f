"""Providers: one sub-package per toolchain. Importing them is cheap (toolchains load lazily)."""

from . import cuda_src, cutedsl, torch_ops

__all__ = ["cutedsl", "cuda_src", "torch_ops"]
