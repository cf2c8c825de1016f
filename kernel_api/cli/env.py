"""``kernel-api env``: versions, driver, NVRTC, GPUs, cache, tuning records and the native module,
as text to paste into a bug report (or ``--json``). It works, and exits 0, without a GPU."""

from __future__ import annotations

import json
import logging
import platform
import sys
from typing import Any

from ..core import environment
from ..core.toolchain import kernel_api_version, python_build, tuning_toolchain


def _records(root: str) -> dict[str, Any]:
    from pathlib import Path

    from ..tuning.records import TuningRecords

    path = Path(root) / "tuning.sqlite"
    found: dict[str, Any] = {"path": str(path), "total": 0, "this_toolchain": 0, "error": None}
    if not path.exists():  # opening would create it
        return found
    try:
        store = TuningRecords(path)
        try:
            records = store.all()
        finally:
            store.close()
        key = tuning_toolchain()
        found["total"] = len(records)
        found["this_toolchain"] = sum(r.toolchain_key == key for r in records)
    except Exception as exc:  # a report of a broken database is still a report
        found["error"] = f"{type(exc).__name__}: {exc}"
    return found


def _drop(record: logging.LogRecord) -> bool:
    return False


def _native() -> dict[str, Any]:
    try:
        from .. import native

        # Loading logs a warning when the module is unavailable; the report says why itself.
        log = logging.getLogger(native.__name__)
        log.addFilter(_drop)
        try:
            table = native.table()
            entry = native.entry()
        finally:
            log.removeFilter(_drop)
        return {"enabled": native.enabled(), "module": native.module_path(), "table": table is not None,
                "entry_points": entry is not None, "why_not": native.why_not_entry()}
    except Exception as exc:
        return {"enabled": None, "module": None, "table": False, "entry_points": False,
                "why_not": f"{type(exc).__name__}: {exc}"}


def collect() -> dict[str, Any]:
    """Everything `kernel-api env` reports, as JSON-ready data."""
    driver = environment.driver_version()
    cache = environment.cache_usage()
    packages = environment.package_versions()
    variants = environment.dsl_variants(driver["version"])
    nvrtc = environment.nvrtc()
    return {
        "kernel_api": kernel_api_version(),
        "python": python_build(),
        "platform": platform.platform(),
        "packages": packages,
        "cutlass_dsl_variants": variants,
        "driver": driver,
        "nvrtc": nvrtc,
        "cuda_majors": environment.cuda_majors(packages, variants["loaded"], nvrtc["version"], driver["version"]),
        "gpus": environment.gpus(),
        "cache": cache,
        "tuning_records": _records(cache["directory"]),
        "native": _native(),
        "tuning_toolchain": tuning_toolchain(),
    }


def _size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n} B"


def format_report(info: dict[str, Any]) -> str:
    """The text `kernel-api env` prints."""
    lines = [f"kernel_api {info['kernel_api']} on {info['python']} ({info['platform']})", "packages:"]
    width = max(map(len, info["packages"]))
    lines += [f"  {name:<{width}}  {version or '-'}" for name, version in info["packages"].items()]
    variants = info["cutlass_dsl_variants"]
    lines.append(f"CuTe DSL CUDA variants: {'+'.join(variants['installed']) or 'none'} installed, "
                 f"{variants['loaded'] or 'none fits the driver'} loaded")
    driver = info["driver"]
    lines.append(f"CUDA driver: {driver['version'] or 'none'}" + (f" ({driver['error']})" if driver["error"] else ""))
    nv = info["nvrtc"]
    lines.append(f"NVRTC: {nv['version'] or 'not loadable'}" + (f" ({nv['library']})" if nv["library"] else "")
                 + (f" ({nv['error']})" if nv["error"] else ""))
    majors = info["cuda_majors"]
    if majors["mixed"]:
        lines.append(f"warning: mixed CUDA majors (CuTe DSL {majors['cutlass_dsl']}, cuda-bindings "
                     f"{majors['cuda_bindings']}, NVRTC {majors['nvrtc']}): reinstall with kernel_api[cu12] or "
                     "kernel_api[cu13]")
    if majors["driver_too_old"]:
        lines.append(f"warning: a CUDA {majors['driver']} driver cannot load the CUDA {majors['newest']} pieces: "
                     "reinstall with kernel_api[cu12] or update the driver")
    g = info["gpus"]
    visible = "" if g["visible_devices"] is None else f", CUDA_VISIBLE_DEVICES={g['visible_devices']}"
    lines.append(f"GPUs: {len(g['devices'])} (torch CUDA {g.get('torch_cuda') or 'none'}{visible})"
                 + (f" ({g['error']})" if g["error"] else ""))
    lines += [f"  {d['index']}: {d['name']}, cc {d['cc']}, {d['memory_gib']} GiB" for d in g["devices"]]
    c = info["cache"]
    lines.append(f"cache: {c['directory']}" + (f", {_size(c['bytes'])} in {c['files']} files" if c["exists"]
                                                  else " (not created yet)"))
    lines += [f"  {name}: {count} entries" for name, count in c["namespaces"].items()]
    r = info["tuning_records"]
    lines.append(f"tuning records: {r['total']} ({r['this_toolchain']} for this toolchain)"
                 + (f" ({r['error']})" if r["error"] else ""))
    n = info["native"]
    state = "loaded" if n["entry_points"] else ("cuda_launch only, no replay" if n["table"] else "not loaded")
    lines.append(f"native module: {state}" + (f" ({n['module']})" if n["module"] and n["table"] else "")
                 + (f": {n['why_not']}" if n["why_not"] else ""))
    lines.append(f"tuning toolchain: {info['tuning_toolchain']}")
    return "\n".join(lines)


def run_env(as_json: bool = False, out: Any = None) -> int:
    """Print the report (text or JSON) to ``out`` (stdout); always 0."""
    info = collect()
    stream = out if out is not None else sys.stdout
    stream.write((json.dumps(info, indent=2) if as_json else format_report(info)) + "\n")
    return 0
