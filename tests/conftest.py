"""Shared test set-up: `gpu`-marked tests skip cleanly on machines without a CUDA GPU; the front
door can be opened to CPU tensors (`cpu_ops`)."""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "seed"))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _isolated_cache_dir(tmp_path_factory, monkeypatch):
    """Every test writes its caches to a private directory unless it sets its own."""
    if "KERNEL_API_CACHE_DIR" not in os.environ:
        monkeypatch.setenv("KERNEL_API_CACHE_DIR", str(tmp_path_factory.mktemp("kernel_api_cache")))


@pytest.fixture
def cpu_ops(monkeypatch):
    """The front door launching on CPU tensors (the torch provider's kernels compute anywhere),
    with fresh choice caches before and after. A test module may define its own `cpu_ops`."""
    from kernel_api import ops
    from kernel_api.ops import dispatch

    monkeypatch.setattr(dispatch, "LAUNCH_DEVICE_TYPES", frozenset({"cuda", "cpu"}))
    ops.clear_dispatch_cache()
    yield
    monkeypatch.undo()
    ops.clear_dispatch_cache()
