"""Errors of the command line: a missing optional dependency, and how any error becomes one line
on stderr with an exit status instead of a traceback.

Errors are classified by type, never by their text: kernel_api's own errors and bad values;
the operating system's (`OSError`: a missing folder, a full or failing disk) and SQLite's (the
tuning records); values too large (`OverflowError`) or nested too deeply (`RecursionError`) for
Python to handle. Other exceptions are bugs and keep their traceback.
"""

from __future__ import annotations

import importlib
import sqlite3
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
    if isinstance(exc, (OverflowError, RecursionError)):  # input too large or too deeply nested
        return EXIT_USAGE
    if isinstance(exc, (KernelApiError, ImportError, OSError, sqlite3.Error)):
        return EXIT_FAILURE
    return None


def _message(exc: BaseException) -> str:
    """The error's own words, with what it concerns where the exception type alone says it."""
    if isinstance(exc, KernelApiError):
        return str(exc)
    if isinstance(exc, OSError) and exc.strerror:
        names = [str(n) for n in (exc.filename, exc.filename2) if n is not None]
        return f"{' -> '.join(names)}: {exc.strerror}" if names else exc.strerror
    if isinstance(exc, sqlite3.Error):  # the command line's one database: the cache folder's records
        from ..core.cache import cache_dir

        return f"tuning records {cache_dir() / 'tuning.sqlite'}: {exc}"
    if isinstance(exc, RecursionError):
        return f"input nested too deeply to process ({exc})"
    if isinstance(exc, OverflowError):
        return f"a number too large to handle ({exc})"
    return str(exc)


def one_line(exc: BaseException) -> str:
    """``kernel-api: error: ...``: the first line of the message, and how to see the rest."""
    lines = _message(exc).strip().splitlines() or [type(exc).__name__]
    text = f"kernel-api: error: {lines[0]}"
    if isinstance(exc, ImportError) and not isinstance(exc, KernelApiError):
        text += " (a dependency is missing or broken: `kernel-api env` lists what is installed)"
    if len(lines) > 1:
        text += f" [+{len(lines) - 1} line(s): rerun with --debug for them and the traceback]"
    return text
