"""Where benchmark JSON goes: ``benchmarks/results/<name>``, and a copy in ``$OUT`` when that
folder exists (the GPU machine's run returns what is written there)."""

from __future__ import annotations

import gzip
import json
import os
import sys
from typing import Any

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def result_name(prefix: str, device: str, tag: str = "") -> str:
    """``<prefix>-<device, spaces as _>[-<tag>].json``."""
    return f"{prefix}-{device.replace(' ', '_')}{'-' + tag if tag else ''}.json"


#: Significant digits a float keeps in the results' JSON: timings are repeatable to 2-3, so 6
#: lose nothing, and the files (which travel to the GPU machine with the tree) stay small.
DIGITS = 6


def rounded(doc: Any, digits: int = DIGITS) -> Any:
    """``doc`` with every float rounded to ``digits`` significant digits (containers copied)."""
    if isinstance(doc, float):
        return float(f"{doc:.{digits}g}")
    if isinstance(doc, dict):
        return {k: rounded(v, digits) for k, v in doc.items()}
    if isinstance(doc, (list, tuple)):
        return [rounded(v, digits) for v in doc]
    return doc


def dump(doc: Any, f: Any, indent: int | None = None) -> None:
    """``doc`` as JSON into the open file ``f``: floats `rounded`, compact unless ``indent``."""
    json.dump(rounded(doc), f, indent=indent, separators=None if indent else (",", ":"), default=str)


def write_result(name: str, doc: dict, indent: int | None = None) -> list[str]:
    """Write ``doc`` as JSON (`dump`) to the results folder and to ``$OUT`` (if it is a folder);
    the paths."""
    paths = [os.path.join(RESULTS, name)]
    out = os.environ.get("OUT", "")
    if out and os.path.isdir(out):
        paths.append(os.path.join(out, name))
    os.makedirs(RESULTS, exist_ok=True)
    for path in paths:
        with open(path, "w") as f:
            dump(doc, f, indent)
    return paths


def write_result_with_text(name: str, doc: dict, lines: list[str]) -> list[str]:
    """`write_result`, and ``lines`` as a ``.txt`` beside each JSON it wrote; the JSON paths."""
    paths = write_result(name, doc)
    for path in paths:
        with open(path[:-5] + ".txt", "w") as f:
            f.write("\n".join(lines) + "\n")
    return paths


def result_doc(**fields) -> dict:
    """A results document's head: the current CUDA device's name, torch's version and the
    command line, then ``fields``."""
    import torch

    return {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "argv": sys.argv, **fields}


def load(path: str) -> Any:
    """A results document from ``path``: JSON, or gzipped JSON where the name ends in ``.gz``."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)


def gzip_result(path: str) -> str:
    """Replace the JSON file ``path`` by ``path + ".gz"`` (no timestamp inside, so the bytes
    depend on the content alone); the new path. For sweeps of many cases: their files travel
    with the tree to the GPU machine, where the whole tree shares 64 MiB with the DSL's pack."""
    target = path + ".gz"
    with open(path, "rb") as src:
        data = src.read()
    json.loads(data)  # refuse to pack what is not JSON
    tmp = target + ".tmp"
    with open(tmp, "wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw, compresslevel=9, mtime=0) as f:
        f.write(data)
    os.replace(tmp, target)
    os.remove(path)
    return target


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description="gzip results JSON in place (FILE -> FILE.gz)")
    ap.add_argument("--gzip", nargs="+", metavar="FILE", required=True)
    for name in ap.parse_args().gzip:
        print(gzip_result(name))
