"""CuTe DSL artifacts as shared libraries that load without importing the DSL.

``compiled.export_to_c`` writes a relocatable object. Loading one goes through
``cute.runtime.load_module``, which imports ``cutlass`` (about half a second) and links the
object in the DSL's JIT. Linked once into a shared library at store time instead (``cc
-shared``, against the DSL's ``libcute_dsl_runtime.so`` and TVM-FFI's ``libtvm_ffi.so``: the
object's only undefined symbols), an artifact is a TVM-FFI module: ``tvm_ffi.load_module``
opens it in about a millisecond once the runtime library is loaded.

An entry is `_MAGIC`, a JSON header and the library. The header records the runtime library
the object was linked against (its path, its path inside the ``nvidia_cutlass_dsl`` package
and its size): `load` opens that library by path (the first of ``CUTE_DSL_LIBS``' runtime,
the recorded path, the same file in this environment's package, whose size matches), so
nothing of the DSL is imported. The disk cache's key holds the DSL's version and CUDA
variant, so a library that matches is the build the object was linked against.

The library is written to a private temporary file (``mkstemp``: mode 0600) for the loader
and removed once loaded.
"""

from __future__ import annotations

import ctypes
import importlib.util
import json
import os
import shutil
import subprocess
import tempfile
import threading
from typing import Any

_MAGIC = b"kernel_api-cutedsl-so\x00\x01"
_LENGTH_BYTES = 4
RUNTIME_LIBRARY = "libcute_dsl_runtime.so"
_PACKAGE = "nvidia_cutlass_dsl"  # the distribution folder that holds the DSL's runtime libraries
_COMPILERS = ("cc", "gcc", "clang")
#: Linker flags: references inside the library bind to its own definitions (two artifacts define
#: the same symbol names), and no executable stack (the object has no .note.GNU-stack section,
#: and some loaders refuse libraries that ask for one).
_LINK_FLAGS = ("-shared", "-Wl,-Bsymbolic", "-Wl,-z,noexecstack")
_LINK_TIMEOUT_S = 120

_lock = threading.Lock()
_loaded_runtimes: dict[str, ctypes.CDLL] = {}  # name -> handle, kept so the libraries stay loaded


class LinkError(RuntimeError):
    """The object could not be linked into a shared library (no C compiler, a linker error)."""


class LoadError(RuntimeError):
    """A shared-library entry that this process cannot load without the DSL (the reason says why)."""


def is_shared_entry(data: bytes) -> bool:
    """Whether a cache payload is a shared-library entry (rather than a bare object file)."""
    return data[:len(_MAGIC)] == _MAGIC


def _package_dir() -> str | None:
    """The ``nvidia_cutlass_dsl`` folder of this environment, found without importing it."""
    try:
        spec = importlib.util.find_spec(_PACKAGE)
    except (ImportError, ValueError):
        return None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    return os.path.realpath(locations[0]) if locations else None


def _compiler() -> str | None:
    for name in _COMPILERS:
        found = shutil.which(name)
        if found:
            return found
    return None


def link(object_path: str, libraries: list[str]) -> bytes:
    """A shared-library entry for the object file ``object_path``.

    Args:
        object_path: what ``export_to_c`` wrote (position-independent code).
        libraries: the DSL's runtime libraries, as ``cute.runtime.find_runtime_libraries``
            lists them (its ``libcute_dsl_runtime.so`` and TVM-FFI's library).

    Returns:
        The payload to cache: `_MAGIC`, the header, the library.

    Raises:
        LinkError: no C compiler on the PATH, no DSL runtime library among ``libraries``, or
            the link failed (its output in the message).
    """
    runtime = next((p for p in libraries if os.path.basename(p) == RUNTIME_LIBRARY), None)
    if runtime is None:
        raise LinkError(f"no {RUNTIME_LIBRARY} among the DSL's runtime libraries {libraries}")
    compiler = _compiler()
    if compiler is None:
        raise LinkError(f"no C compiler to link with (looked for {', '.join(_COMPILERS)} on the PATH)")
    runtime = os.path.realpath(runtime)
    package = _package_dir()
    relative = os.path.relpath(runtime, package) if package and runtime.startswith(package + os.sep) else None
    fd, so_path = tempfile.mkstemp(suffix=".so", prefix="kernel_api-")
    os.close(fd)
    try:
        command = [compiler, *_LINK_FLAGS, "-o", so_path, object_path, *(os.path.realpath(p) for p in libraries)]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=_LINK_TIMEOUT_S, check=False)
        except (OSError, subprocess.SubprocessError) as exc:
            raise LinkError(f"{' '.join(command)}: {type(exc).__name__}: {exc}") from exc
        if done.returncode != 0:
            output = (done.stderr or done.stdout)[-2000:]
            raise LinkError(f"{' '.join(command)} exited with {done.returncode}: {output}")
        with open(so_path, "rb") as f:
            library = f.read()
    finally:
        try:
            os.unlink(so_path)
        except OSError:
            pass
    header = json.dumps({"runtime": {"name": RUNTIME_LIBRARY, "path": runtime, "package_relative": relative,
                                     "size": os.path.getsize(runtime)}}, sort_keys=True).encode()
    return _MAGIC + len(header).to_bytes(_LENGTH_BYTES, "little") + header + library


def _split(data: bytes) -> tuple[dict, bytes]:
    start = len(_MAGIC) + _LENGTH_BYTES
    length = int.from_bytes(data[len(_MAGIC):start], "little")
    try:
        header = json.loads(data[start:start + length])
        runtime = header["runtime"]
        if not (isinstance(runtime, dict) and isinstance(runtime.get("size"), int)):
            raise ValueError("no runtime library size")
    except (ValueError, KeyError, TypeError) as exc:
        raise LoadError(f"the entry's header is not readable ({exc})") from exc
    return header, data[start + length:]


def _runtime_candidates(runtime: dict) -> list[str]:
    """Where the runtime library may be, in the DSL's own order: ``CUTE_DSL_LIBS`` first."""
    name = runtime.get("name") or RUNTIME_LIBRARY
    found = [p for p in os.environ.get("CUTE_DSL_LIBS", "").split(os.pathsep) if p and os.path.basename(p) == name]
    if isinstance(runtime.get("path"), str):
        found.append(runtime["path"])
    relative = runtime.get("package_relative")
    if isinstance(relative, str) and not os.path.isabs(relative) and ".." not in relative.split(os.sep):
        package = _package_dir()
        if package:
            found.append(os.path.join(package, relative))
    return found


def _ensure_runtime(runtime: dict) -> None:
    """Load the DSL runtime library the entry was linked against (once per process)."""
    name = runtime.get("name") or RUNTIME_LIBRARY
    if name in _loaded_runtimes:
        return
    with _lock:
        if name in _loaded_runtimes:
            return
        tried = []
        for path in _runtime_candidates(runtime):
            try:
                size = os.stat(path).st_size
            except OSError:
                tried.append(f"{path} (missing)")
                continue
            if size != runtime["size"]:
                tried.append(f"{path} ({size} bytes, not {runtime['size']})")
                continue
            try:
                _loaded_runtimes[name] = ctypes.CDLL(path)
            except OSError as exc:
                tried.append(f"{path} ({exc})")
                continue
            return
        raise LoadError(f"the DSL runtime library {name} the entry was linked against was not found: "
                        f"{'; '.join(tried) or 'no candidate'}")


def load_runtime_libraries(libraries: list[str]) -> None:
    """Load the runtime libraries the DSL found (``find_runtime_libraries``) by path: for an
    entry whose recorded library `load` could not find, once the DSL is imported."""
    with _lock:
        for path in libraries:
            name = os.path.basename(path)
            if name not in _loaded_runtimes:
                _loaded_runtimes[name] = ctypes.CDLL(path)


def load(data: bytes, function_name: str, *, check_runtime: bool = True) -> Any:
    """The TVM-FFI function ``function_name`` of a shared-library entry.

    Args:
        data: a payload `link` made (`is_shared_entry`).
        function_name: the name given to ``export_to_c``.
        check_runtime: find and load the recorded runtime library first; False when the
            caller has loaded the DSL's own (`load_runtime_libraries`).

    Returns:
        A ``tvm_ffi.Function``; its module stays loaded for the life of the process.

    Raises:
        LoadError: the header is unreadable, the runtime library is missing, or the library
            does not load or lacks the function.
    """
    header, library = _split(data)
    if check_runtime:
        _ensure_runtime(header["runtime"])
    import tvm_ffi

    fd, path = tempfile.mkstemp(suffix=".so", prefix="kernel_api-")  # mode 0600
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(library)
        try:
            return tvm_ffi.load_module(path)[function_name]
        except Exception as exc:  # noqa: BLE001 - the loader's errors have no common type
            raise LoadError(f"{type(exc).__name__}: {exc}") from exc
    finally:
        try:
            os.unlink(path)
        except OSError:
            pass
