"""`CuteDslKernel`: the base class of CuTe DSL kernels, wrapping ``cute.compile``.

``cute_compile(impl, *args)`` compiles with TVM-FFI on and the target architecture of the
compile in progress (``kernel.compile(args, cc=90)`` works without a GPU). Torch tensors
among ``args`` become fake tensors with runtime shapes and strides, so one artifact serves
every problem size of a signature; at run time TVM-FFI takes the torch tensors directly
(DLPack, no per-call ``from_dlpack`` wrappers).

Compiled functions are cached on disk as shared libraries (`artifact_loader`) that load
without importing the DSL. A kernel's ``compile`` itself builds DSL objects (fake tensors, the
implementation) before `cute_compile` can compute the artifact's key, so a compile whose whole
result is one cached function is also remembered under a key computed without the DSL (the
kernel's code and state, ``compile_key(args, cc)``, the toolchain, kernel_api's sources): a
later process with a warm cache loads the function without running ``compile`` at all
(`CuteDslKernel.warm_load_skips_compile`).
"""

from __future__ import annotations

import contextvars
import dataclasses
import enum
import functools
import logging
import os
import sys
import tempfile
import threading
import time
import types
from typing import Any, Callable

import torch

from ...core.arch import arch_string, device_cc
from ...core.artifact import CompiledArtifact
from ...core.cache import DiskCache, make_key, tree_digest
from ...core.dtypes import from_torch
from ...core.errors import ArtifactNotCachedError, CompilationError, strip_ansi
from ...core.fingerprint import code_fingerprint
from ...kernel import Kernel, cache_only, check_target_cc, compile_target_cc, target_cc
from ...launcher import ffi_function  # (also imported from here by benchmarks and tests)
from ...metadata import TensorAttributes
from . import artifact_loader


def _target_cc_or_none() -> int | None:
    cc = compile_target_cc.get()
    if cc is None and torch.cuda.is_available():
        cc = device_cc(None)
    return cc


def fake_tensor(dtype: Any, rank: int, contiguous_mode: int | None, divisibility: int = 1) -> Any:
    """A CuTe fake tensor of ``rank`` with runtime extents and strides.

    ``contiguous_mode`` gets the static stride 1 (None: all strides dynamic); the other
    strides and the base pointer are assumed divisible by ``divisibility`` elements.
    ``dtype`` is a `DataType`, torch dtype or cutlass type.
    """
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_tensor

    if isinstance(dtype, torch.dtype):
        dtype = from_torch(dtype)
    if not (isinstance(dtype, type) and dtype.__module__.startswith("cutlass")):
        dtype = dtype.to_cutlass()
    shape = tuple(cute.sym_int32() for _ in range(rank))
    stride = tuple(1 if m == contiguous_mode else cute.sym_int64(divisibility=divisibility) for m in range(rank))
    width = max(1, dtype.width // 8) if hasattr(dtype, "width") else 1
    return make_fake_tensor(dtype, shape, stride, assumed_align=width * divisibility)


def fake_tensor_like(attrs: TensorAttributes, rank: int) -> Any:
    """A fake tensor for an operand described by kernel metadata (its alignment included)."""
    pattern = attrs.stride
    if len(pattern) < rank:
        pattern = (0,) * (rank - len(pattern)) + pattern
    contiguous = pattern[-rank:].index(1) if 1 in pattern[-rank:] else None
    return fake_tensor(attrs.dtype, rank, contiguous, attrs.divisibility)


_artifacts = DiskCache("cutedsl")
#: Remembered compiles (`_remember`): small entries naming an artifact key, kept apart from the
#: artifacts themselves so that counting artifacts counts compiled kernels.
_compiles = DiskCache("cutedsl-compiles")
_log = logging.getLogger(__name__)
#: CuTe DSL compiles and artifact loads take turns: the DSL's compiler state (MLIR context, the
#: JIT's execution engines) is process-wide, and `tune_shapes` compiles from several threads.
#: Reentrant: a kernel's compile may compile a helper kernel of its own.
_dsl_lock = threading.RLock()


# The package whose sources every artifact is keyed on: built-in kernels import helpers
# from all over it (implementations/epilogue.py, gemm_utils.py...), and user kernels
# derive from its base class.
_PACKAGE = __name__.rpartition(".")[0]
_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
_SOURCE_SUFFIXES = (".py", ".cu", ".cuh")


@functools.lru_cache(maxsize=None)
def _toolchain_versions() -> tuple:
    """kernel_api's version, the DSL's version and CUDA variant, TVM-FFI's, and the Python."""
    from ...core.toolchain import artifact_toolchain

    return artifact_toolchain()


@functools.lru_cache(maxsize=None)
def _package_source_hash() -> str:
    """Hash of every source file of this provider package (read once per process)."""
    return tree_digest(_PACKAGE_DIR, _SOURCE_SUFFIXES)


@functools.lru_cache(maxsize=None)
def _kernel_api_source_hash() -> str:
    """Hash of every source file of kernel_api (read once per process): a remembered compile
    (`_compile_key`) skips the code that builds the artifact key's inputs (fake tensors from
    metadata and dtypes, the implementation object), wherever in kernel_api it lives."""
    return tree_digest(os.path.dirname(os.path.dirname(_PACKAGE_DIR)), _SOURCE_SUFFIXES)


def _code_hash(obj: Any) -> str:
    """What ``obj`` (an implementation object, a kernel class, or a module's name) runs: objects
    of this package are covered by `_package_source_hash`; others by `code_fingerprint`, which
    follows the bytecode of everything they reach (a kernel in a notebook's ``__main__``, whose
    source cannot be read, and helpers in other modules included)."""
    if isinstance(obj, str):
        module = obj
        obj = sys.modules.get(obj)
    else:
        owner = obj if isinstance(obj, (type, types.FunctionType)) else type(obj)
        module = getattr(owner, "__module__", None) or ""
    if module == _PACKAGE or module.startswith(_PACKAGE + "."):
        return "in-package"
    return code_fingerprint(obj) if obj is not None else make_key(module)


def _artifact_key(name: str, impl: Any, converted_args: list, options: str, kernel_class: Any) -> str:
    """The disk-cache key of a compiled function: the kernel, its implementation object, the
    compile arguments and options, this package's sources, the code the implementation and the
    kernel class (or a module, by name) run when they live elsewhere, and the toolchain."""
    impl_desc = _impl_description(impl)
    return make_key(name, impl_desc, [_describe(a) for a in converted_args], options, _toolchain_versions(),
                    _package_source_hash(), _code_hash(impl), _code_hash(kernel_class))


def _describe(value: Any) -> Any:
    """A stable description of a compile argument (fake tensors by type/shape/stride)."""
    if hasattr(value, "element_type") and hasattr(value, "stride"):
        return ("tensor", str(value.element_type), str(value.shape), str(value.stride),
                str(getattr(value, "memspace", "")), str(getattr(value, "_assumed_align", "")))
    if isinstance(value, (int, float, str, bool, type(None))):
        return value
    return type(value).__qualname__


def _impl_description(impl: Any) -> Any:
    """(module, qualified name, attribute reprs) of an implementation object; a class or
    function has no attributes here (their reprs hold addresses: `_code_hash` covers them)."""
    if isinstance(impl, (type, types.FunctionType)):
        return (impl.__module__, impl.__qualname__, ())
    state = getattr(impl, "__dict__", None)
    fields = sorted((k, repr(v)) for k, v in state.items()) if state else ()
    owner = impl if callable(impl) and not state else type(impl)
    return (getattr(owner, "__module__", ""), getattr(owner, "__qualname__", repr(owner)), fields)


def dsl_message(exc: BaseException) -> str:
    """The text of a CuTe DSL exception, fit for an exception message: terminal colour codes
    removed, and without the DSL's hint to set ``CUTE_DSL_ARCH``, which is wrong here
    (`CuteDslKernel.cute_compile` passes the target architecture itself)."""
    lines = strip_ansi(str(exc)).splitlines()
    return "\n".join(line for line in lines if "CUTE_DSL_ARCH" not in line).strip()


def _compile_arg(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        stride = value.stride()
        contiguous = stride.index(1) if 1 in stride else None
        return fake_tensor(value.dtype, value.dim(), contiguous, 1)
    return value


class CuteDslKernel(Kernel):
    """Base class of CuTe DSL kernels (register subclasses with ``@CuTeDSLProvider.register``).

    The contract is `kernel_api.kernel`'s (the provider package's docstring sums it up);
    ``cute_compile`` and ``cute_run`` are the helpers for ``compile`` and ``_run``. For the fast
    path, ``_launcher`` returns ``Launcher(artifact, tail)`` when the compiled function takes
    the operand tensors, then the constants ``tail``, then the stream.
    """

    #: compile through TVM-FFI (torch tensors passed straight to the compiled function)
    enable_tvm_ffi: bool = True
    #: TVM-FFI functions release the GIL around every call by default; a launch returns in
    #: microseconds, and dropping and re-taking the GIL is a measurable part of that. Set False
    #: for kernels whose host side may block (other Python threads then wait for the call).
    #: `cute_compile` marks the function (``release_gil``), and `Launcher.bind` reads the mark.
    keep_gil_during_launch: bool = True
    #: A compile whose result is ``CompiledArtifact(self.cute_compile(...), self)`` and nothing
    #: else (one `cute_compile` with a cached result, no ``extra``, no other kernel compiled
    #: inside, the instance's attributes unchanged) is remembered: a later ``compile`` of an
    #: instance of the same code and state, for an equal ``compile_key(args, cc)``, loads the
    #: cached function without running the method (nor importing the DSL). Set False when the
    #: method does more that launches rely on (fills in module state, writes files).
    warm_load_skips_compile: bool = True

    def __init_subclass__(cls, **kwargs: Any) -> None:
        # Inside `Kernel`'s wrapper (which super() puts around it): target checks run first.
        _remember_own_compile(cls)
        super().__init_subclass__(**kwargs)

    def cute_compile(self, impl: Any, *args: Any, **kwargs: Any) -> Any:
        """``cute.compile(impl, *args)`` with TVM-FFI and the target architecture set.

        Torch tensors are replaced by fake tensors with dynamic shapes/strides (unit stride
        kept static, no alignment assumed); pass `fake_tensor_like` results instead to let
        the compiler assume the alignment a kernel's metadata guarantees. Extra compile
        options go in ``options=``.
        """
        cc = target_cc()
        check_target_cc(self, cc)  # also when cc comes from the GPU rather than compile(cc=...)
        options = kwargs.pop("options", "") or ""
        flags = [options] if options else []
        if self.enable_tvm_ffi and "--enable-tvm-ffi" not in options:
            flags.append("--enable-tvm-ffi")
        if "--gpu-arch" not in options:
            flags.append(f"--gpu-arch {arch_string(cc)}")
        with _dsl_lock:
            return self._cute_compile_locked(impl, args, kwargs, cc, " ".join(flags))

    def _cute_compile_locked(self, impl: Any, args: tuple, kwargs: dict, cc: int, options: str) -> Any:
        import cutlass.cute as cute

        converted = [_compile_arg(a) for a in args]
        name = getattr(getattr(self, "_metadata", None), "kernel_name", type(self).__name__)
        record = _record.get()
        key = None
        if self.enable_tvm_ffi and not kwargs:
            key = _artifact_key(name, impl, converted, options, type(self))
            loaded = _load_cached(key, name)
            if loaded is not None:
                loaded = self._launch_ready(loaded)
                if record is not None:
                    record.calls.append((key, loaded))
                return loaded
        if cache_only.get():
            raise ArtifactNotCachedError(f"{name}: no cached artifact (a compile from the cache only)")
        start = time.perf_counter()
        try:
            compiled = cute.compile(impl, *converted, options=options, **kwargs)
        except Exception as exc:
            raise CompilationError(
                f"{name}: CuTe DSL compilation for {arch_string(cc)} failed: {dsl_message(exc)}") from exc
        _log.debug("cute.compile of %s for %s: %.3f s", name, arch_string(cc), time.perf_counter() - start)
        stored = key is not None and _store(key, compiled, name)
        compiled = self._launch_ready(compiled)
        if record is not None:
            record.calls.append((key if stored else None, compiled))
        return compiled

    def _launch_ready(self, compiled: Any) -> Any:
        function = ffi_function(compiled) if self.keep_gil_during_launch else None
        if function is not None:
            function.release_gil = False  # the object the adapters call, too
        return compiled

    def cute_run(self, compiled: Any, *args: Any) -> Any:
        """Call a function compiled by `cute_compile` (torch tensors go in as they are)."""
        return compiled(*args)


_FUNCTION_NAME = "kernel_api_entry"


def _load_cached(key: str, name: str = "") -> Any:
    """A compiled function from the disk cache, or None (miss, disabled, unloadable entry);
    ``name`` (the kernel's) is for the log.

    A shared-library entry loads through `artifact_loader` without the DSL; should that fail
    (its runtime library not where the entry says), through the runtime libraries the DSL
    finds. An object-file entry (stored where no C compiler could link it) loads through the
    DSL's loader."""
    start = time.perf_counter()
    data = _artifacts.get(key)
    if data is None:
        _log.debug("CuTe DSL artifact cache miss: %s (key %.16s)", name, key)
        return None
    try:
        if artifact_loader.is_shared_entry(data):
            function = _load_shared(data, name)
        else:
            function = _load_object(data)
    except Exception as exc:
        # A valid checksum but an entry the loaders reject (e.g. another toolchain's build):
        # drop it and recompile.
        _log.debug("CuTe DSL artifact cache miss: %s: the cached entry does not load (%s: %s); deleted",
                   name, type(exc).__name__, exc)
        _artifacts.delete(key)
        return None
    _log.debug("CuTe DSL artifact cache hit: %s loaded in %.3f s (key %.16s)", name,
               time.perf_counter() - start, key)
    return function


def _load_shared(data: bytes, name: str) -> Any:
    try:
        return artifact_loader.load(data, _FUNCTION_NAME)
    except artifact_loader.LoadError as exc:
        _log.debug("CuTe DSL artifact of %s: not loaded without the DSL (%s); loading with the DSL's runtime "
                   "libraries", name, exc)
    with _dsl_lock:
        from cutlass.cute.runtime import find_runtime_libraries

        artifact_loader.load_runtime_libraries(find_runtime_libraries(enable_tvm_ffi=True))
    return artifact_loader.load(data, _FUNCTION_NAME, check_runtime=False)


def _load_object(data: bytes) -> Any:
    fd, path = tempfile.mkstemp(suffix=".o", prefix="kernel_api-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        with _dsl_lock:
            return getattr(_load_module(path), _FUNCTION_NAME)
    finally:
        try:
            os.unlink(path)
        except OSError:
            pass


_module_class: list = []  # the DSL's module class, once its runtime libraries are loaded


def _load_module(path: str) -> Any:
    """``cute.runtime.load_module(path, enable_tvm_ffi=True)``. That function first finds and
    loads the DSL's runtime libraries (a search of the file system each call: about a third of
    a cached artifact's load); the libraries stay loaded, so later loads construct the module
    class it returned directly. Should that class not take the call, the function is used again."""
    if _module_class:
        try:
            return _module_class[0](path, enable_tvm_ffi=True)
        except TypeError:  # another DSL version's constructor
            _module_class.clear()
    import cutlass.cute as cute

    module = cute.runtime.load_module(path, enable_tvm_ffi=True)
    if type(module).__name__ == "ExternalBinaryModule":
        _module_class[:] = [type(module)]
    return module


def _export(export: Callable[..., None], path: str) -> None:
    """``compiled.export_to_c``, exporting only the TVM-FFI entry where the DSL can (the other
    symbols stay inside the library)."""
    try:
        export(path, function_name=_FUNCTION_NAME, export_only_tvm_ffi_symbols=True)
    except TypeError:  # a DSL without the option
        export(path, function_name=_FUNCTION_NAME)


def _store(key: str, compiled: Any, name: str = "") -> bool:
    """Cache ``compiled`` under ``key``: as a shared library, or as the object file where it
    cannot be linked. True when it went to the disk cache."""
    export = getattr(compiled, "export_to_c", None)
    if export is None:
        _log.debug("CuTe DSL artifact of %s not cached: the compiled object cannot be exported", name)
        return False
    fd, path = tempfile.mkstemp(suffix=".o", prefix="kernel_api-")
    os.close(fd)
    try:
        _export(export, path)
        try:
            from cutlass.cute.runtime import find_runtime_libraries

            data = artifact_loader.link(path, find_runtime_libraries(enable_tvm_ffi=True))
        except Exception as exc:  # noqa: BLE001 - the object file still serves (through the DSL)
            _log.debug("CuTe DSL artifact of %s cached as an object file, which loads through the DSL: %s: %s",
                       name, type(exc).__name__, exc)
            with open(path, "rb") as f:
                data = f.read()
        return _artifacts.put(key, data)
    except Exception as exc:  # caching is an optimisation; the in-process artifact still works
        _log.debug("CuTe DSL artifact of %s not cached: %s: %s", name, type(exc).__name__, exc)
        return False
    finally:
        try:
            os.unlink(path)
        except OSError:
            pass


# ---- compiles remembered under a key computed without the DSL ----------------------------

class _CompileRecord:
    """What one remembered ``compile`` did: its `cute_compile` calls, as (the artifact key, or
    None when nothing was cached, and the function returned), and whether another kernel's
    remembered compile ran inside it."""

    __slots__ = ("calls", "nested")

    def __init__(self) -> None:
        self.calls: list[tuple[str | None, Any]] = []
        self.nested = False


#: The record of the remembered compile in progress in this context (None outside one).
_record: contextvars.ContextVar[_CompileRecord | None] = contextvars.ContextVar("kernel_api_cutedsl_compile",
                                                                                 default=None)
#: A remembered compile's entry: this prefix, then the artifact key of the function it returned.
_REMEMBERED = b"kernel_api-cutedsl-compile\x00\x01"
#: `Kernel`'s per-instance caches, which ``supports`` and ``run`` fill in: not the kernel's state.
_KERNEL_CACHES = frozenset({"_support_cache", "_artifact_cache"})


def _remember_own_compile(cls: type) -> None:
    """Wrap the ``compile`` defined in ``cls``' own namespace with `_remembered`."""
    fn = cls.__dict__.get("compile")
    if (callable(fn) and not getattr(fn, "__isabstractmethod__", False)
            and not getattr(fn, "_kernel_api_wrapped", False) and not getattr(fn, "_cutedsl_remembered", False)):
        type.__setattr__(cls, "compile", _remembered(fn))


def _remembered(fn: Callable) -> Callable:
    @functools.wraps(fn)
    def compile(self: CuteDslKernel, args: Any, *rest: Any, **kwargs: Any) -> Any:
        outer = _record.get()
        if outer is not None:
            outer.nested = True
        key = state = cc = None
        if type(self).warm_load_skips_compile and self.enable_tvm_ffi and not kwargs and len(rest) <= 1:
            # (`Kernel`'s wrapper passes the target cc, when one was asked for, as the one argument)
            cc = rest[0] if rest else _target_cc_or_none()
            key, state = _compile_key(self, args, cc) if cc is not None else (None, None)
        if key is not None:
            found = _load_remembered(key, self)
            if found is not None:
                return found
        record = _CompileRecord()
        token = _record.set(record)
        try:
            artifact = fn(self, args, *rest, **kwargs)
        finally:
            _record.reset(token)
        if key is not None:
            _remember(key, self, artifact, record, state, cc)
        return artifact

    compile._cutedsl_remembered = True  # type: ignore[attr-defined]
    return compile


class _Undescribed(Exception):
    """A value with no description that is the same in every process."""


def _stable(value: Any, depth: int = 0) -> Any:
    """A description of ``value`` that is equal across processes exactly when the value is:
    containers by their items (sets sorted, as their order follows string hashing), dataclass
    and slotted objects by their fields, objects by their attributes, others by a repr that
    holds no address. Raises `_Undescribed` for functions (their code is not described here),
    addresses and nesting deeper than a kernel's state goes."""
    if depth > 12:
        raise _Undescribed("values nested too deep")
    if value is None or isinstance(value, (bool, int, float, complex, str, bytes, enum.Enum, torch.dtype)):
        return repr(value)
    if isinstance(value, type):
        return ("class", value.__module__, value.__qualname__)
    kind = type(value)
    name = (kind.__module__, kind.__qualname__)
    if isinstance(value, (tuple, list)):
        return (name, tuple(_stable(v, depth + 1) for v in value))
    if isinstance(value, (set, frozenset)):
        return (name, tuple(sorted(repr(_stable(v, depth + 1)) for v in value)))
    if isinstance(value, dict):
        return (name, tuple(sorted((repr(_stable(k, depth + 1)), _stable(v, depth + 1)) for k, v in value.items())))
    if isinstance(value, (types.FunctionType, types.MethodType, types.BuiltinFunctionType, functools.partial)):
        raise _Undescribed(f"a function ({getattr(value, '__qualname__', kind.__qualname__)})")
    if isinstance(value, Kernel):  # (another kernel held as state: its attributes, not its caches)
        return (name, _stable({k: v for k, v in vars(value).items() if k not in _KERNEL_CACHES}, depth + 1))
    if dataclasses.is_dataclass(value):
        return (name, tuple((f.name, _stable(getattr(value, f.name, None), depth + 1))
                            for f in dataclasses.fields(value)))
    slots = [s for c in kind.__mro__ for s in c.__dict__.get("__slots__", ()) if isinstance(s, str)]
    state = getattr(value, "__dict__", None)
    if slots or state:
        fields = [(s, getattr(value, s, None)) for s in slots if s not in ("__dict__", "__weakref__")]
        fields += sorted((state or {}).items())
        return (name, tuple((k, _stable(v, depth + 1)) for k, v in fields))
    text = repr(value)
    if " at 0x" in text:
        raise _Undescribed(f"an address ({text})")
    return (name, text)


def _instance_state(kernel: Kernel) -> Any:
    """`_stable` of the instance's attributes (`Kernel`'s own caches left out)."""
    return _stable({k: v for k, v in vars(kernel).items() if k not in _KERNEL_CACHES})


def _compile_key(kernel: Kernel, args: Any, cc: int) -> tuple[str | None, Any]:
    """(the key a compile is remembered under, the instance's state), computed without the
    DSL: the key covers the kernel class's code, the instance's attributes, ``compile_key(args,
    cc)``, the toolchain and kernel_api's sources. (None, None) when the state or the compile
    key has no stable description (`_stable`), or ``compile_key`` raises."""
    try:
        state = _instance_state(kernel)
        described = _stable(kernel.compile_key(args, cc))
    except _Undescribed as exc:
        _log.debug("compile of %s not remembered: its state or compile key holds %s", kernel, exc)
        return None, None
    except Exception as exc:  # noqa: BLE001 - such a compile is simply not remembered
        _log.debug("compile of %s not remembered: compile_key raised %s: %s", kernel, type(exc).__name__, exc)
        return None, None
    cls = type(kernel)
    key = make_key("remembered compile", cls.__module__, cls.__qualname__, _code_hash(cls), state, described, cc,
                   _toolchain_versions(), _kernel_api_source_hash())
    return key, state


def _load_remembered(key: str, kernel: CuteDslKernel) -> CompiledArtifact | None:
    data = _compiles.get(key)
    if data is None:
        return None
    name = getattr(getattr(kernel, "_metadata", None), "kernel_name", type(kernel).__name__)
    if not data.startswith(_REMEMBERED):
        _log.debug("remembered compile of %s: not such an entry (key %.16s); deleted", name, key)
        _compiles.delete(key)
        return None
    function = _load_cached(data[len(_REMEMBERED):].decode("ascii", "replace"), name)
    if function is None:
        return None  # (the compile that follows stores the artifact and this entry again)
    _log.debug("remembered compile of %s: loaded without compiling (key %.16s)", name, key)
    return CompiledArtifact(kernel._launch_ready(function), kernel)


def _remember(key: str, kernel: Kernel, artifact: Any, record: _CompileRecord, state: Any, cc: int) -> None:
    """Store ``key`` -> the artifact key of ``artifact``'s function, when the compile that made
    ``artifact`` did nothing else (see `CuteDslKernel.warm_load_skips_compile`)."""
    why = None
    if record.nested:
        why = "another kernel was compiled inside it"
    elif len(record.calls) != 1:
        why = f"it made {len(record.calls)} cute_compile calls"
    elif record.calls[0][0] is None:
        why = "its function is not in the disk cache"
    elif type(artifact) is not CompiledArtifact or artifact.kernel is not kernel:
        why = "it returned something other than CompiledArtifact(function, self)"
    elif artifact.compiled_obj is not record.calls[0][1] or artifact.extra is not None:
        why = "its artifact holds more than the function cute_compile returned"
    elif artifact.cc not in (None, cc):
        why = f"its artifact is for cc {artifact.cc}"
    elif _changed(kernel, state):
        why = "it changed the instance's attributes"
    if why is not None:
        _log.debug("compile of %s not remembered: %s", kernel, why)
        return
    _compiles.put(key, _REMEMBERED + record.calls[0][0].encode("ascii"))


def _changed(kernel: Kernel, state: Any) -> bool:
    try:
        return _instance_state(kernel) != state
    except _Undescribed:
        return True
