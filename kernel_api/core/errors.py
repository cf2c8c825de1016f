"""The project's exception types. Each subclasses a builtin so callers may catch either."""

from __future__ import annotations

import re

# Terminal control sequences: CSI (colours, "\x1b[91m"), OSC (titles, links; ended by BEL or
# ST), the other escapes (ESC, intermediates, a final byte) and a stray ESC. Compilers colour
# their diagnostics for a terminal; in an exception message the codes are noise.
_ANSI = re.compile(r"\x1b(?:\[[0-?]*[ -/]*[@-~]|\][^\x07\x1b]*(?:\x07|\x1b\\)|[ -/]*[0-~]?)")


def strip_ansi(text: str) -> str:
    """``text`` without terminal escape sequences, for compiler messages we re-raise."""
    return _ANSI.sub("", text) if "\x1b" in text else text


class KernelApiError(Exception):
    """Base class of every error kernel_api raises on purpose."""


class UnsupportedArgumentsError(KernelApiError, ValueError):
    """A kernel was asked to run arguments it does not support."""


class NoKernelFoundError(KernelApiError, LookupError):
    """Discovery found no kernel for the arguments; the message lists the nearest rejections."""


class DeviceError(KernelApiError, RuntimeError):
    """A GPU is needed (or a different one) for what was asked."""


class CompilationError(KernelApiError, RuntimeError):
    """A kernel failed to compile; the message carries the compiler's log."""


class ArtifactNotCachedError(CompilationError):
    """A compile under `kernel_api.kernel.compile_from_cache_only` found no cached artifact
    (it compiles nothing): the caller compiles elsewhere, e.g. in worker processes."""


class KernelLaunchError(KernelApiError, RuntimeError):
    """A launch failed; the message names the kernel."""


class RegistrationError(KernelApiError, TypeError):
    """A class handed to ``Provider.register`` is not a usable kernel class."""
