"""CUDA C++ → cubin with NVRTC (through ``cuda.core.Program``), cached on disk.

``compile_cuda(source, cc=90, name_expressions=["softmax<float, 4>"])`` returns a
`CompiledCuda`: the cubin plus the lowered (mangled) name of every name expression, so
template instances are chosen by name and looked up after loading. No GPU is needed.

The disk cache (`kernel_api.core.cache.DiskCache` namespace ``cubin``) is keyed by a hash of the
source, the name expressions, the options, the include folders and the contents of the
headers in them, defines, the target arch and the NVRTC version; a second process compiling
the same kernel loads the cubin instead of running NVRTC, and editing a header makes a new
entry. Compile errors raise `CompilationError` carrying NVRTC's log (terminal colour codes
removed), whose lines name the source file and line.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import struct
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from ..core.arch import arch_string, normalize_cc
from ..core.cache import DiskCache, make_key, tree_digest
from ..core.errors import ArtifactNotCachedError, CompilationError, strip_ansi
from ..kernel import cache_only

_FORMAT = 1  # bump when the cached payload layout changes
_log = logging.getLogger(__name__)
_cache = DiskCache("cubin")
_memo: dict[str, "CompiledCuda"] = {}  # this process's compiles, by cache key
_memo_lock = threading.Lock()
# What may be #included from a user include folder ("": libcu++-style names without a dot).
_HEADER_SUFFIXES = (".h", ".hh", ".hpp", ".hxx", ".cuh", ".inl", ".ipp", ".tcc", ".inc", ".cu", ".c", ".cc",
                    ".cpp", ".cxx", "")


@dataclass
class CompiledCuda:
    """A cubin and what is needed to find its kernels after loading."""

    cubin: bytes
    arch: str
    symbols: dict[str, str]  # name expression -> lowered name
    log: str = ""
    key: str = ""
    cache_hit: bool = False  # loaded from the disk cache instead of compiled
    seconds: float = 0.0  # wall time of this compile (or cache load)
    source_name: str = "kernel.cu"
    _loaded: Any = field(default=None, repr=False)

    def to_bytes(self) -> bytes:
        header = json.dumps({"arch": self.arch, "symbols": self.symbols, "log": self.log,
                             "source_name": self.source_name, "format": _FORMAT}).encode()
        return struct.pack("<I", len(header)) + header + self.cubin

    @classmethod
    def from_bytes(cls, blob: bytes, key: str) -> "CompiledCuda":
        (n,) = struct.unpack_from("<I", blob)
        header = json.loads(blob[4:4 + n].decode())
        if header.get("format") != _FORMAT:
            raise ValueError("cached cubin has an older format")
        return cls(cubin=blob[4 + n:], arch=header["arch"], symbols=dict(header["symbols"]), log=header["log"],
                   key=key, cache_hit=True, source_name=header.get("source_name", "kernel.cu"))


def _program_api() -> tuple[Any, Any]:
    try:
        from cuda.core import Program, ProgramOptions
    except ImportError:  # cuda.core < 0.4 kept them under experimental
        from cuda.core.experimental import Program, ProgramOptions
    return Program, ProgramOptions


@functools.lru_cache(maxsize=1)
def nvrtc_version() -> tuple[int, int]:
    """(major, minor) of the NVRTC library cuda-python loads."""
    from cuda.bindings import nvrtc

    err, major, minor = nvrtc.nvrtcVersion()
    if int(err) != 0:
        raise CompilationError(f"NVRTC is not usable: nvrtcVersion returned {err}")
    return int(major), int(minor)


@functools.lru_cache(maxsize=1)
def default_include_dirs() -> tuple[str, ...]:
    """The CUDA toolkit's header folder (cuda_fp16.h, ...) when one can be found, for user
    kernels that include toolkit headers; the package's own kernels need none."""
    dirs = []
    try:
        from cuda.pathfinder import locate_nvidia_header_directory

        for lib in ("cudart", "cccl"):
            try:
                found = locate_nvidia_header_directory(lib)
            except Exception:
                found = None
            path = getattr(found, "abs_path", None)
            if path and os.path.isdir(path):
                dirs.append(path)
    except ImportError:
        pass
    return tuple(dirs)


#: NVRTC's pip distributions by the CUDA major of cuda-bindings, which loads the library of an
#: installed NVIDIA wheel of its major before any system toolkit's (cuda.pathfinder's search order).
_NVRTC_DISTRIBUTIONS = {12: ("nvidia-cuda-nvrtc-cu12",), 13: ("nvidia-cuda-nvrtc", "nvidia-cuda-nvrtc-cu13")}


def _installed_nvrtc_wheel() -> tuple[str, str] | tuple[()]:
    """(distribution, version) of the installed NVRTC wheel of cuda-bindings' CUDA major, or ()
    when there is none (or cuda-bindings' version cannot be read)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        major = int(version("cuda-bindings").split(".")[0])
    except (PackageNotFoundError, ValueError):
        return ()
    for dist in _NVRTC_DISTRIBUTIONS.get(major, ()):
        try:
            found = version(dist)
        except PackageNotFoundError:
            continue
        if found.split(".")[0] == str(major):
            return (dist, found)
    return ()


@functools.lru_cache(maxsize=1)
def _toolchain_versions() -> tuple:
    """What identifies the NVRTC that compiles: the installed NVRTC wheel's version, read from
    its metadata, or else the loaded library's own version. The cubin depends on NVRTC alone
    (cuda.core only drives it), and a cache hit then loads neither cuda.core nor NVRTC (importing
    and loading them costs 50-150 ms, most of a warm first call)."""
    wheel = _installed_nvrtc_wheel()
    return ("nvrtc-wheel", *wheel) if wheel else ("nvrtc", nvrtc_version())


def compile_cuda(source: str, *, cc: Any, name_expressions: Iterable[str], include_dirs: Iterable[str] = (),
                 defines: Mapping[str, Any] | None = None, std: str = "c++17", source_name: str = "kernel.cu",
                 options: Mapping[str, Any] | None = None, use_cache: bool = True,
                 toolkit_headers: bool = True) -> CompiledCuda:
    """Compile ``source`` to a cubin for ``cc`` (sm_90a for Hopper).

    ``name_expressions`` are the kernels to keep, e.g. ``"scale"`` or ``"softmax<float, 4>"``
    (templates are instantiated by naming them); a name that is not in the source is a
    compile error. ``defines`` become ``-D`` macros, ``include_dirs`` ``-I`` folders (the
    toolkit's header folder is added when found, unless ``toolkit_headers`` is False);
    ``options`` are extra `cuda.core.ProgramOptions` fields (e.g. ``{"use_fast_math": True}``).
    """
    if not isinstance(source, str) or not source.strip():
        raise CompilationError(f"{source_name}: CUDA source must be a non-empty string")
    names = tuple(name_expressions)
    if not names:
        raise CompilationError(f"{source_name}: name at least one kernel (name_expressions) to compile")
    target = normalize_cc(cc)
    if target is None:
        raise CompilationError(f"{source_name}: a target compute capability (cc, e.g. 90) is required")
    arch = arch_string(target)
    macro = tuple(sorted((str(k), str(v)) for k, v in (defines or {}).items()))
    user_incs = tuple(str(d) for d in include_dirs)
    extra = dict(options or {})
    # The toolkit's header folder is looked up only on a miss (finding it can cost a
    # subprocess); its headers ship with, and are versioned like, NVRTC. The user's folders
    # are hashed by content: the cubin changes when a header in them does.
    headers = tuple(tree_digest(d, _HEADER_SUFFIXES) for d in user_incs)
    key = make_key("cuda_src", _FORMAT, source, names, arch, std, macro, user_incs, headers, toolkit_headers,
                   sorted(extra.items(), key=str), source_name, _toolchain_versions())
    with _memo_lock:
        found = _memo.get(key)
    if found is not None:
        return found
    start = time.perf_counter()
    if use_cache:
        blob = _cache.get(key)
        if blob is not None:
            try:
                compiled = CompiledCuda.from_bytes(blob, key)
            except Exception:  # a well-formed entry of an unknown layout: rebuild it
                _log.debug("NVRTC cubin cache miss: %s for %s: the entry has an unknown layout; deleted",
                           source_name, arch)
                _cache.delete(key)
            else:
                compiled.seconds = time.perf_counter() - start
                _log.debug("NVRTC cubin cache hit: %s %s for %s, loaded in %.3f s", source_name, list(names), arch,
                           compiled.seconds)
                with _memo_lock:
                    _memo[key] = compiled
                return compiled
        else:
            _log.debug("NVRTC cubin cache miss: %s %s for %s (key %.16s)", source_name, list(names), arch, key)
    if cache_only.get():
        raise ArtifactNotCachedError(f"{source_name}: no cached cubin for {arch} (a compile from the cache only)")
    Program, ProgramOptions = _program_api()
    incs = user_incs + (default_include_dirs() if toolkit_headers else ())
    opts = ProgramOptions(name=source_name, arch=arch, std=std, define_macro=list(macro) or None,
                          include_path=list(incs) or None, ptxas_options=["-O3"], **extra)
    log = _LogSink()
    try:
        obj = Program(source, "c++", options=opts).compile("cubin", name_expressions=names, logs=log)
    except Exception as exc:
        message = strip_ansi(str(exc) or log.text).rstrip("\x00")  # NVRTC's log ends in its C string's NUL
        raise CompilationError(_explain_failure(source_name, arch, names, message)) from None
    mapping = getattr(obj, "symbol_mapping", None) or getattr(obj, "_sym_map", {}) or {}
    symbols = {str(k): (v.decode() if isinstance(v, bytes) else str(v)) for k, v in mapping.items()}
    missing = [n for n in names if n not in symbols]
    if missing:
        raise CompilationError(f"{source_name}: NVRTC returned no lowered name for {missing}")
    compiled = CompiledCuda(cubin=bytes(obj.code), arch=arch, symbols=symbols, log=strip_ansi(log.text), key=key,
                            source_name=source_name)
    compiled.seconds = time.perf_counter() - start
    _log.debug("NVRTC compiled %s %s for %s in %.3f s", source_name, list(names), arch, compiled.seconds)
    if use_cache:
        _cache.put(key, compiled.to_bytes())
    with _memo_lock:
        _memo[key] = compiled
    return compiled


class _LogSink:
    def __init__(self) -> None:
        self.parts: list[str] = []

    def write(self, text: Any) -> None:
        self.parts.append(text.decode() if isinstance(text, bytes) else str(text))

    @property
    def text(self) -> str:
        return "".join(self.parts).strip()


def _explain_failure(source_name: str, arch: str, names: tuple[str, ...], log: str) -> str:
    head = f"NVRTC failed to compile {source_name} for {arch}"
    if "__nv_name_map" in log:
        # NVRTC reports unresolvable name expressions against a pseudo file; say it plainly.
        unresolved = [n for n in names if n.replace(" ", "") in log.replace(" ", "")] or list(names)
        head += (f": kernel name(s) {unresolved} not found in the source (a __global__ function or template "
                 f"instance of that name must exist)")
    return f"{head}\n{log}"


def clear_memory_cache() -> None:
    """Forget this process's compiles (the disk cache stays); for tests."""
    with _memo_lock:
        _memo.clear()


def disk_cache() -> DiskCache:
    """The `DiskCache` holding cubins (its ``stats`` count hits and misses)."""
    return _cache
