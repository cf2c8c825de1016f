"""Where benchmark JSON goes: ``benchmarks/results/<name>``, and a copy in ``$OUT`` when that
folder exists (the GPU machine's run returns what is written there)."""

from __future__ import annotations

import json
import os

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def result_name(prefix: str, device: str, tag: str = "") -> str:
    """``<prefix>-<device, spaces as _>[-<tag>].json``."""
    return f"{prefix}-{device.replace(' ', '_')}{'-' + tag if tag else ''}.json"


def write_result(name: str, doc: dict, indent: int = 1) -> list[str]:
    """Write ``doc`` as JSON to the results folder and to ``$OUT`` (if it is a folder); the paths."""
    paths = [os.path.join(RESULTS, name)]
    out = os.environ.get("OUT", "")
    if out and os.path.isdir(out):
        paths.append(os.path.join(out, name))
    os.makedirs(RESULTS, exist_ok=True)
    for path in paths:
        with open(path, "w") as f:
            json.dump(doc, f, indent=indent, default=str)
    return paths
