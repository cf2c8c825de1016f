"""`CuteDslKernel`: the base class of CuTe DSL kernels, wrapping ``cute.compile``.

``cute_compile(impl, *args)`` compiles with TVM-FFI on and the target architecture of the
compile in progress (``kernel.compile(args, cc=90)`` works without a GPU). Torch tensors
among ``args`` become fake tensors with runtime shapes and strides, so one artifact serves
every problem size of a signature; at run time TVM-FFI takes the torch tensors directly
(DLPack, no per-call ``from_dlpack`` wrappers).
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import tempfile
import threading
import time
import types
from typing import Any

import torch

from ...core.arch import arch_string, device_cc
from ...core.cache import DiskCache, make_key, tree_digest
from ...core.dtypes import from_torch
from ...core.errors import ArtifactNotCachedError, CompilationError, DeviceError, strip_ansi
from ...core.fingerprint import code_fingerprint
from ...kernel import Kernel, cache_only, check_target_cc, compile_target_cc
from ...launcher import ffi_function  # (also imported from here by benchmarks and tests)
from ...metadata import TensorAttributes


def _target_cc() -> int:
    cc = compile_target_cc.get()
    if cc is not None:
        return cc
    if torch.cuda.is_available():
        return device_cc(None)
    raise DeviceError("no CUDA GPU to infer the target architecture from; compile with an explicit cc, e.g. kernel.compile(args, cc=90)")


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

    def cute_compile(self, impl: Any, *args: Any, **kwargs: Any) -> Any:
        """``cute.compile(impl, *args)`` with TVM-FFI and the target architecture set.

        Torch tensors are replaced by fake tensors with dynamic shapes/strides (unit stride
        kept static, no alignment assumed); pass `fake_tensor_like` results instead to let
        the compiler assume the alignment a kernel's metadata guarantees. Extra compile
        options go in ``options=``.
        """
        cc = _target_cc()
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
        key = None
        if self.enable_tvm_ffi and not kwargs:
            key = _artifact_key(name, impl, converted, options, type(self))
            loaded = _load_cached(key, name)
            if loaded is not None:
                return self._launch_ready(loaded)
        if cache_only.get():
            raise ArtifactNotCachedError(f"{name}: no cached artifact (a compile from the cache only)")
        start = time.perf_counter()
        try:
            compiled = cute.compile(impl, *converted, options=options, **kwargs)
        except Exception as exc:
            raise CompilationError(
                f"{name}: CuTe DSL compilation for {arch_string(cc)} failed: {dsl_message(exc)}") from exc
        _log.debug("cute.compile of %s for %s: %.3f s", name, arch_string(cc), time.perf_counter() - start)
        if key is not None:
            _store(key, compiled, name)
        return self._launch_ready(compiled)

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
    ``name`` (the kernel's) is for the log."""
    start = time.perf_counter()
    data = _artifacts.get(key)
    if data is None:
        _log.debug("CuTe DSL artifact cache miss: %s (key %.16s)", name, key)
        return None
    fd, path = tempfile.mkstemp(suffix=".o", prefix="kernel_api-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        module = _load_module(path)
        function = getattr(module, _FUNCTION_NAME)
    except Exception as exc:
        # A valid checksum but an object the loader rejects (e.g. other toolchain build):
        # drop it and recompile.
        _log.debug("CuTe DSL artifact cache miss: %s: the cached object does not load (%s: %s); deleted",
                   name, type(exc).__name__, exc)
        _artifacts.delete(key)
        return None
    else:
        _log.debug("CuTe DSL artifact cache hit: %s loaded in %.3f s (key %.16s)", name,
                   time.perf_counter() - start, key)
        return function
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


def _store(key: str, compiled: Any, name: str = "") -> None:
    export = getattr(compiled, "export_to_c", None)
    if export is None:
        _log.debug("CuTe DSL artifact of %s not cached: the compiled object cannot be exported", name)
        return
    fd, path = tempfile.mkstemp(suffix=".o", prefix="kernel_api-")
    os.close(fd)
    try:
        export(path, function_name=_FUNCTION_NAME)
        with open(path, "rb") as f:
            _artifacts.put(key, f.read())
    except Exception as exc:  # caching is an optimisation; the in-process artifact still works
        _log.debug("CuTe DSL artifact of %s not cached: %s: %s", name, type(exc).__name__, exc)
    finally:
        try:
            os.unlink(path)
        except OSError:
            pass
