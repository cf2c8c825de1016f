"""The plugin in the default registry for its tests: used installed, or loaded from its folder (what
an editable install gives) and forgotten afterwards."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

FOLDER = Path(__file__).resolve().parent.parent
PACKAGE = "kernel_api_flash_attn"


@pytest.fixture(scope="module")
def plugin():
    """The plugin's package, registered in the default registry (and forgotten afterwards when
    this fixture loaded it)."""
    import kernel_api
    if "flash_attn" in kernel_api.available_providers():
        yield importlib.import_module(PACKAGE)
        return
    sys.path.insert(0, str(FOLDER))
    try:
        module = importlib.import_module(PACKAGE)
    finally:
        sys.path.remove(str(FOLDER))
    yield module
    from kernel_api.registry import unregister_provider
    unregister_provider("flash_attn")
    for name in [m for m in sys.modules if m == PACKAGE or m.startswith(PACKAGE + ".")]:
        del sys.modules[name]
