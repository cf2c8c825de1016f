"""What a bug report needs to know about this machine: package versions, the CUDA driver and
NVRTC, the visible GPUs and the cache folder (``kernel-api env`` adds the tuning records and the
native module, which live above this layer).

Every probe answers instead of raising: a machine without a GPU, a driver or NVRTC is what
some reports are about, so a failure becomes the text of its answer.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from .cache import cache_dir
from .toolchain import distribution_version

# The distributions a report lists, in order (None: not installed).
DISTRIBUTIONS = (
    "kernel-api", "torch", "nvidia-cutlass-dsl", "nvidia-cutlass-dsl-libs-cu12", "nvidia-cutlass-dsl-libs-cu13",
    "apache-tvm-ffi", "cuda-python", "cuda-bindings", "cuda-core", "cuda-pathfinder", "nvidia-cuda-nvrtc",
    "nvidia-cuda-nvrtc-cu12", "torch-c-dlpack-ext", "platformdirs", "tqdm", "matplotlib",
)


def _failure(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")


def package_versions() -> dict[str, str | None]:
    """The installed version of every distribution in `DISTRIBUTIONS` (None when absent)."""
    return {name: distribution_version(name) for name in DISTRIBUTIONS}


def driver_version() -> dict[str, Any]:
    """``{"version": "13.0" or None, "error": why not or None}`` from ``cuDriverGetVersion``."""
    try:
        from cuda.bindings import driver

        err, value = driver.cuDriverGetVersion()
        if int(err) != 0:
            return {"version": None, "error": f"cuDriverGetVersion returned {err}"}
        return {"version": f"{value // 1000}.{value % 1000 // 10}", "error": None}
    except Exception as exc:  # no driver library, no cuda-bindings: that is the answer
        return {"version": None, "error": _failure(exc)}


def dsl_variants(driver: str | None) -> dict[str, Any]:
    """The CuTe DSL's installed CUDA variants and the one it loads with ``driver`` ("13.0").

    The DSL loads the newest installed variant whose major the driver supports, the newest of
    all without a driver (nvidia_cutlass_dsl's ``_mlir_libs``); None when none fits.
    """
    installed = [v for v in ("cu12", "cu13") if distribution_version(f"nvidia-cutlass-dsl-libs-{v}") is not None]
    fitting = installed if driver is None else [v for v in installed if int(v[2:]) <= int(driver.split(".")[0])]
    return {"installed": installed, "loaded": fitting[-1] if fitting else None}


def nvrtc() -> dict[str, Any]:
    """``{"version": "13.0", "library": path, "error": None}`` for the NVRTC that cuda-bindings loads."""
    found: dict[str, Any] = {"version": None, "library": None, "error": None}
    try:
        from cuda.bindings import nvrtc as bindings

        err, major, minor = bindings.nvrtcVersion()
        if int(err) != 0:
            found["error"] = f"nvrtcVersion returned {err}"
            return found
        found["version"] = f"{major}.{minor}"
    except Exception as exc:  # not installed or not loadable: the report says so
        found["error"] = _failure(exc)
        return found
    try:
        from cuda.pathfinder import load_nvidia_dynamic_lib

        found["library"] = load_nvidia_dynamic_lib("nvrtc").abs_path  # already loaded: a lookup
    except Exception:  # an old pathfinder: the version is what matters
        pass
    return found


def gpus() -> dict[str, Any]:
    """The GPUs torch sees (``CUDA_VISIBLE_DEVICES`` applies): name, compute capability, memory."""
    found: dict[str, Any] = {"visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"), "devices": [], "error": None}
    try:
        import torch

        found["torch_cuda"] = torch.version.cuda
        if not torch.cuda.is_available():
            return found
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            found["devices"].append({"index": i, "name": p.name, "cc": p.major * 10 + p.minor,
                                     "memory_gib": round(p.total_memory / 2**30, 1)})
    except Exception as exc:  # a broken driver or torch install is worth reporting, not raising
        found["error"] = _failure(exc)
    return found


def cache_usage(root: str | os.PathLike | None = None) -> dict[str, Any]:
    """The cache folder (``root`` or `cache_dir`), its total size and its entries per namespace.
    Nothing is created."""
    folder = Path(root) if root is not None else cache_dir()
    usage: dict[str, Any] = {"directory": str(folder), "exists": folder.is_dir(), "bytes": 0, "files": 0,
                             "namespaces": {}}
    if not usage["exists"]:
        return usage
    for parent, _, names in os.walk(folder):
        for name in names:
            try:
                size = os.stat(os.path.join(parent, name)).st_size
            except OSError:  # removed meanwhile
                continue
            usage["bytes"] += size
            usage["files"] += 1
    for sub in sorted(p for p in folder.iterdir() if p.is_dir()):
        usage["namespaces"][sub.name] = sum(1 for _ in sub.glob("*.bin"))
    return usage


def cuda_majors(packages: dict[str, str | None], dsl_loaded: str | None, nvrtc_version: str | None,
                driver: str | None) -> dict[str, Any]:
    """The CUDA major of each piece of the stack, whether they differ (``mixed``: what installing
    without the cu12/cu13 extra can give) and whether the driver is too old for one of them."""
    bindings = packages.get("cuda-bindings")
    majors = {"cutlass_dsl": int(dsl_loaded[2:]) if dsl_loaded else None,
              "cuda_bindings": int(bindings.split(".")[0]) if bindings else None,
              "nvrtc": int(nvrtc_version.split(".")[0]) if nvrtc_version else None}
    known = {m for m in majors.values() if m is not None}
    driver_major = int(driver.split(".")[0]) if driver else None
    newest = max(known, default=None)
    return {**majors, "driver": driver_major, "mixed": len(known) > 1,
            "driver_too_old": driver_major is not None and newest is not None and newest > driver_major,
            "newest": newest}
