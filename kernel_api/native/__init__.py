"""The C launch table (`launch_table.cc`), built on first use against the installed TVM-FFI.

`kernel_api.ops` keeps repeated calls out of Python with it: after the Python path has chosen,
checked, compiled and launched a kernel whose compiled function is a TVM-FFI function, the
function is recorded under the operands' raw metadata; a later call with the same dtypes,
shapes, strides, pointer alignment and devices is one call into C that looks the entry up and
launches it on the caller's current stream.

Where Python's C headers are installed, the same library is also a CPython extension
(`python_entry.cc`, see `entry()`): its ``launch`` and ``bind`` read torch tensors through
torch's DLPack exchange API without allocating, which makes a launch from Python cheaper than
calling the TVM-FFI function with the tensors directly.

The shared library is compiled once per machine (a second or two, with the C++ compiler named
by ``$CXX`` or found as ``c++``/``g++``) into the kernel_api cache directory, keyed by the
sources, the TVM-FFI version and the Python. Without tvm_ffi, without a compiler, or with
``KERNEL_API_NATIVE=0``, `table()` returns None and callers stay on their Python path.
"""

from __future__ import annotations

import atexit
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
from pathlib import Path
from typing import Any

_log = logging.getLogger(__name__)
_SOURCE = Path(__file__).with_name("launch_table.cc")
_PYTHON_SOURCE = Path(__file__).with_name("python_entry.cc")
_HEADER = Path(__file__).with_name("launch_table.h")
_PYTHON_MODULE = "_launch_table"  # the name python_entry.cc's PyInit function carries
_lock = threading.Lock()
# "table": the loaded TVM-FFI module or None once tried; "error": why not; "entry": the CPython
# module or None; "entry_error": why not.
_state: dict[str, Any] = {}


class NativeBuildError(RuntimeError):
    """The launch table could not be compiled or loaded."""


def enabled() -> bool:
    return os.environ.get("KERNEL_API_NATIVE", "1").strip().lower() not in ("0", "false", "no", "off")


def _compiler() -> str | None:
    cxx = os.environ.get("CXX")
    if cxx:
        return cxx
    return shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")


def python_headers() -> str | None:
    """The folder with this Python's ``Python.h``, or None when it is not installed."""
    include = sysconfig.get_paths().get("include")
    return include if include and (Path(include) / "Python.h").exists() else None


def library_path(directory: Path | None = None) -> Path:
    """Where the built library for these sources, TVM-FFI version and Python lives."""
    import tvm_ffi

    from ..cache import cache_dir

    digest = hashlib.sha256()
    for source in (_SOURCE, _HEADER, _PYTHON_SOURCE):
        digest.update(source.read_bytes())
    with_python = "python" if python_headers() else "no-python"
    digest.update(f"{tvm_ffi.__version__}|{sys.platform}|{sys.implementation.cache_tag}|{with_python}".encode())
    return (directory or cache_dir() / "native") / f"launch_table-{digest.hexdigest()[:16]}.so"


def build(directory: Path | None = None) -> Path:
    """Compile `launch_table.cc`, with `python_entry.cc` where Python's headers are installed
    (if not built already), and return the library's path."""
    import tvm_ffi.libinfo as libinfo

    target = library_path(directory)
    if target.exists():
        return target
    cxx = _compiler()
    if cxx is None:
        raise NativeBuildError("no C++ compiler found (set CXX, or install g++)")
    target.parent.mkdir(parents=True, exist_ok=True)
    lib = Path(libinfo.find_libtvm_ffi())
    include = python_headers()
    python = [f"-I{include}", str(_PYTHON_SOURCE)] if include else []
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        partial = Path(tmp) / target.name
        command = [cxx, "-std=c++17", "-O2", "-fPIC", "-shared", "-fvisibility=hidden",
                   f"-I{libinfo.find_include_path()}", f"-I{libinfo.find_dlpack_include_path()}",
                   str(_SOURCE), *python, "-o", str(partial), f"-L{lib.parent}", "-ltvm_ffi",
                   f"-Wl,-rpath,{lib.parent}"]
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise NativeBuildError(f"compiling {_SOURCE.name} failed ({' '.join(command)}):\n{done.stderr[-2000:]}")
        os.replace(partial, target)  # atomic: concurrent builders never load a half-written file
    return target


def table() -> Any:
    """The loaded launch table module (``launch``, ``record``, ``clear``, ``size``), or None when
    it is disabled or cannot be built here (the reason is logged once and kept in `why_not`)."""
    if "table" in _state:
        return _state["table"]
    with _lock:
        if "table" not in _state:
            _state["table"] = _load()
    return _state["table"]


_entry_callbacks: list[Any] = []


def when_entry_loads(callback: Any) -> None:
    """Call ``callback(entry_module)`` once the CPython entry points load (now, if they have):
    modules that use them bind their functions then, without a lookup per call."""
    _entry_callbacks.append(callback)
    if _state.get("entry") is not None:
        callback(_state["entry"])


def entry() -> Any:
    """The launch table library's CPython module (``launch``, ``bind``; see python_entry.cc),
    configured for torch tensors, or None where the table is unavailable, Python's headers are
    missing or torch offers no DLPack exchange API (the reason is in `why_not_entry`)."""
    if "table" not in _state:
        table()
    return _state.get("entry")


def _load_entry(path: Path) -> Any:
    if not python_headers():
        _state["entry_error"] = f"Python's C headers are not installed ({sysconfig.get_paths().get('include')})"
        return None
    try:
        import importlib.machinery
        import importlib.util

        import torch

        name = f"{__name__}.{_PYTHON_MODULE}"
        loader = importlib.machinery.ExtensionFileLoader(name, str(path))
        module = importlib.util.module_from_spec(importlib.util.spec_from_file_location(name, path, loader=loader))
        loader.exec_module(module)
        module.configure(torch.Tensor)
        return module
    except (ImportError, AttributeError, RuntimeError, TypeError) as exc:
        _state["entry_error"] = f"{type(exc).__name__}: {exc}"
        _log.info("kernel_api: the launch table's CPython entry points are unavailable: %s", exc)
        return None


def _load() -> Any:
    if not enabled():
        _state["error"] = "disabled by KERNEL_API_NATIVE=0"
        return None
    try:
        import tvm_ffi

        path = build()
        module = tvm_ffi.load_module(str(path))
        # Release the recorded functions while the interpreter is alive (some hold Python objects).
        atexit.register(module.clear)
        # The same library (dlopen gives the same handle, so the same table) as a CPython module.
        _state["entry"] = _load_entry(path)
        if _state["entry"] is not None:
            for callback in _entry_callbacks:
                callback(_state["entry"])
        return module
    except ImportError as exc:
        _state["error"] = f"tvm_ffi is not installed ({exc})"
    except (NativeBuildError, OSError, RuntimeError) as exc:
        _state["error"] = str(exc)
    _log.warning("kernel_api: the C launch table is unavailable, repeated ops calls stay in Python: %s",
                 _state["error"])
    return None


def why_not() -> str | None:
    """Why `table()` returned None (None when it loaded or was not tried yet)."""
    return _state.get("error")


def why_not_entry() -> str | None:
    """Why `entry()` returned None (None when it loaded or was not tried yet)."""
    return _state.get("error") or _state.get("entry_error")


def _reset_for_tests() -> None:
    with _lock:
        _state.clear()
