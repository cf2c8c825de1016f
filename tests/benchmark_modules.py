"""Loading a script of benchmarks/ as a module in tests (the folder is not a package)."""

from __future__ import annotations

import importlib.util
import os
from types import ModuleType

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")


def load(name: str) -> ModuleType:
    """A fresh module object of ``benchmarks/<name>.py`` (each call executes it anew)."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(BENCHMARKS, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
