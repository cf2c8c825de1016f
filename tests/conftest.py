"""Shared test set-up: `gpu`-marked tests skip cleanly on machines without a CUDA GPU."""

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
