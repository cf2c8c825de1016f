"""The `kernel-api` command line (``python -m kernel_api``): `commands` parses and runs,
`format` lays out tables, `bench` and `demo` hold the GPU-side commands."""

from .commands import main

__all__ = ["main"]
