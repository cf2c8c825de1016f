"""Errors of the command line: a missing optional dependency, and how any error becomes one line
on stderr with an exit status instead of a traceback."""

from __future__ import annotations

import importlib
from typing import Any

from ..core.errors import DeviceError, KernelApiError

# Exit statuses: 1 a failure kernel_api reports (no kernel found, a compile error, a missing
# dependency), 2 bad command-line values (argparse's own status too), 3 a GPU is needed.
EXIT_FAILURE, EXIT_USAGE, EXIT_NEEDS_GPU = 1, 2, 3


class MissingDependencyError(KernelApiError, ImportError):
    """An optional dependency a command needs is not installed; the message says how to install it."""


def require(module: str, purpose: str, extra: str) -> Any:
    """Import ``module`` or raise `MissingDependencyError` naming the extra that installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise MissingDependencyError(f"{purpose} needs {module}, which is not installed: "
                                     f"pip install 'kernel_api[{extra}]'", name=module) from exc


def exit_status(exc: BaseException) -> int | None:
    """The exit status for an error the command line reports in one line; None for the others
    (a bug in kernel_api or below it: its traceback is the report)."""
    if isinstance(exc, DeviceError):
        return EXIT_NEEDS_GPU
    if isinstance(exc, (ValueError, TypeError)):  # bad values, unsupported arguments, bad kernel classes
        return EXIT_USAGE
    if isinstance(exc, (KernelApiError, ImportError)):
        return EXIT_FAILURE
    return None


def one_line(exc: BaseException) -> str:
    """``kernel-api: error: ...``: the first line of the message, and how to see the rest."""
    lines = str(exc).strip().splitlines() or [type(exc).__name__]
    text = f"kernel-api: error: {lines[0]}"
    if isinstance(exc, ImportError) and not isinstance(exc, KernelApiError):
        text += " (a dependency is missing or broken: `kernel-api env` lists what is installed)"
    if len(lines) > 1:
        text += f" [+{len(lines) - 1} line(s): rerun with --debug for them and the traceback]"
    return text
