"""kernel_api's loggers: one hierarchy under ``kernel_api``, silent unless asked.

Every module that logs uses ``logging.getLogger(__name__)``, so its records go to the
``kernel_api`` logger, which carries a `logging.NullHandler`: a library user sees nothing
until they configure logging (``logging.basicConfig(level=logging.DEBUG)``, or handlers on
``"kernel_api"``). ``KERNEL_API_LOG_LEVEL`` is the shortcut: set to a level name (DEBUG,
INFO, WARNING, ERROR, CRITICAL) or number, it makes `configure_from_environment` attach one
stderr handler at that level to the ``kernel_api`` logger; unset or empty, nothing is attached.
A value that is no level warns once (`RuntimeWarning`) and is ignored.

What is logged: compiles (kernel, target, seconds) at INFO; the disk caches' hits, misses and
corrupt entries, the CuTe DSL and NVRTC artifact caches, `PickAny`'s choice and tuning-record
hits at DEBUG; `PickBest`'s winner and timings at INFO; the native fast path's fallbacks at
DEBUG/INFO. Hot paths (repeated ``ops`` calls, bound ``Kernel.run``, building arguments) log
nothing.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings

ROOT = "kernel_api"
ENV_LEVEL = "KERNEL_API_LOG_LEVEL"
_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_LEVELS = {"CRITICAL": logging.CRITICAL, "FATAL": logging.FATAL, "ERROR": logging.ERROR,
           "WARNING": logging.WARNING, "WARN": logging.WARNING, "INFO": logging.INFO,
           "DEBUG": logging.DEBUG, "NOTSET": logging.NOTSET}


def parse_level(text: str) -> int | None:
    """The logging level ``text`` names ("debug", "INFO", "10"...), or None when it names none."""
    text = text.strip()
    if text.isdigit():
        return int(text)
    return _LEVELS.get(text.upper())


def configure_from_environment() -> logging.Handler | None:
    """Give the ``kernel_api`` logger its `logging.NullHandler` and, when ``KERNEL_API_LOG_LEVEL``
    names a level, one stderr handler at that level (the logger's level is set to it too).

    Called once by ``import kernel_api``; calling it again adds nothing. Returns the stderr
    handler, or None when the variable is unset, empty or not a level (which warns).
    """
    logger = logging.getLogger(ROOT)
    if not any(isinstance(h, logging.NullHandler) for h in logger.handlers):
        logger.addHandler(logging.NullHandler())
    for handler in logger.handlers:
        if getattr(handler, "_kernel_api_env", False):
            return handler
    value = os.environ.get(ENV_LEVEL, "")
    if not value.strip():
        return None
    level = parse_level(value)
    if level is None:
        warnings.warn(f"kernel_api: {ENV_LEVEL}={value!r} is not a logging level (use DEBUG, INFO, WARNING, "
                      f"ERROR, CRITICAL or a number); ignored", RuntimeWarning, stacklevel=2)
        return None
    handler = logging.StreamHandler(sys.stderr)
    handler.setLevel(level)
    handler.setFormatter(logging.Formatter(_FORMAT))
    handler._kernel_api_env = True  # type: ignore[attr-defined]
    logger.addHandler(handler)
    logger.setLevel(level)
    return handler
