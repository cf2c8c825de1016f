"""Triton jit functions compiled to cubins for a stated target, cached in kernel_api's disk cache,
and launched through Triton's own machinery.

``compile_triton(spec, label)`` runs ``triton.compile(ASTSource(fn, signature, constexprs,
attrs), target=GPUTarget("cuda", cc, 32), options=...)``: no GPU is needed. The cubin and
Triton's metadata (its json) go into `kernel_api.core.cache.DiskCache` namespace ``triton``,
keyed on the jit function's cache key (its source and the jit functions it calls), its name,
the signature, the constexprs, the aligned pointers, the options, the target, the triton
version and the environment variables Triton says change its code. A second process loads the
entry through ``DiskCache.get``, so the cache's trust rule applies; Triton's own cache folder
(``~/.triton/cache``) is written by ``triton.compile`` as usual but never read for an artifact:
our compiles run with Triton's ``always_compile`` knob on.

A `TritonBinary` is launched through ``triton.compiler.CompiledKernel``, built from the cached
cubin and metadata (through a private temporary folder, which its constructor reads), once per
device on the first launch there: the launch then costs what a Triton launch costs (Triton's
C launcher, built by Triton once per signature, with a C compiler, as for any Triton kernel).

Written against triton 3.6 (the same API since 3.4: ``ASTSource(fn, signature, constexprs,
attrs)``, ``CompiledKernel(src, metadata_group, hash)``, ``CompiledKernel.run(gridX, gridY,
gridZ, stream, function, packed_metadata, launch_metadata, enter_hook, exit_hook, *args)``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import struct
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from ...core.cache import DiskCache, make_key
from ...core.errors import ArtifactNotCachedError, CompilationError, KernelLaunchError
from ...kernel import cache_only

_FORMAT = 1  # bump when the cached payload layout changes
_log = logging.getLogger(__name__)
_cache = DiskCache("triton")
_memo: dict[str, "TritonBinary"] = {}  # this process's compiles and loads, by cache key
_memo_lock = threading.Lock()
_compile_lock = threading.Lock()  # (the always_compile knob is process-wide while it is on)

#: Triton's name of the element type behind a pointer to each torch dtype (Triton's JIT's own).
POINTER_TYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.float64: "fp64",
                 torch.int8: "i8", torch.int16: "i16", torch.int32: "i32", torch.int64: "i64", torch.uint8: "u8",
                 torch.bool: "i1"}
for _name, _ty in (("float8_e4m3fn", "fp8e4nv"), ("float8_e5m2", "fp8e5")):
    if hasattr(torch, _name):
        POINTER_TYPES[getattr(torch, _name)] = _ty


def value_type(value: Any, param: str, label: str) -> str:
    """Triton's signature type of a runtime value, as Triton's JIT types it.

    Args:
        value: a tensor (a pointer to its elements), a bool, an int or a float.
        param: the jit function's parameter it is passed as (for the message).
        label: the kernel instance's name (for the message).

    Returns:
        ``"*fp32"``, ``"i32"``, ``"i64"``, ``"u64"``, ``"u1"``, ``"fp32"``...; TypeError for
        anything else.
    """
    if isinstance(value, torch.Tensor):
        element = POINTER_TYPES.get(value.dtype)
        if element is None:
            raise TypeError(f"{label}: parameter {param} is a {value.dtype} tensor, which Triton takes no pointer to")
        return "*" + element
    if isinstance(value, bool):
        return "u1"
    if isinstance(value, int):
        if -2**31 <= value < 2**31:
            return "i32"
        if 2**63 <= value < 2**64:
            return "u64"
        return "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"{label}: parameter {param} got {type(value).__name__} {value!r}; pass tensors, ints, floats "
                    f"or bools at run time, and other compile-time values as constexprs")


def require_triton() -> Any:
    """The triton module, or `CompilationError` saying which extra installs it."""
    try:
        import triton
    except ImportError as exc:
        raise CompilationError(f"the Triton provider needs triton: pip install 'kernel-api[triton]' ({exc})") from None
    return triton


@dataclass(frozen=True)
class TritonSpec:
    """What one compile is of: the parts of Triton's ``ASTSource`` and ``triton.compile``'s
    options and target.

    ``fn``: the ``@triton.jit`` function; ``signature``: ``(parameter, type)`` in parameter
    order, ``"constexpr"`` for compile-time ones; ``constexprs``: ``(parameter, value)``;
    ``aligned``: the pointer parameters compiled as 16-byte aligned; ``options``: ``(name,
    value)`` of ``triton.compile``'s options; ``cc``: the target, e.g. 90.
    """

    fn: Any
    signature: tuple[tuple[str, str], ...]
    constexprs: tuple[tuple[str, Any], ...]
    aligned: tuple[str, ...]
    options: tuple[tuple[str, Any], ...]
    cc: int

    def ast_source(self) -> Any:
        """The ``triton.compiler.ASTSource`` of this spec (imports triton)."""
        from triton.compiler import ASTSource

        index = {name: i for i, name in enumerate(self.fn.arg_names)}
        attrs = {(index[name],): [["tt.divisibility", 16]] for name in self.aligned}
        return ASTSource(self.fn, dict(self.signature), dict(self.constexprs), attrs)

    def key(self) -> str:
        """The disk cache key of this spec's compile (imports triton)."""
        triton = require_triton()

        try:
            from triton._C.libtriton import get_cache_invalidating_env_vars

            env = sorted(get_cache_invalidating_env_vars().items())
        except ImportError:  # (moved in another triton version: the version still keys)
            env = []
        fn = self.fn
        return make_key("triton", _FORMAT, fn.cache_key, getattr(fn, "__qualname__", fn.__name__), self.signature,
                        self.constexprs, self.aligned, self.options, self.cc, triton.__version__, env)


class TritonBinary:
    """A compiled Triton kernel: its cubin and Triton's metadata, loaded into Triton's
    ``CompiledKernel`` once per device on the first launch there.

    Args:
        spec: what was compiled.
        cubin: the ELF image.
        metadata: Triton's metadata of the compile (its ``<name>.json``), as a dict.
        key: the disk cache key.
        cache_hit: whether it was loaded from the disk cache rather than compiled.
    """

    def __init__(self, spec: TritonSpec, cubin: bytes, metadata: dict, key: str, cache_hit: bool = False) -> None:
        self.spec = spec
        self.cubin = cubin
        self.metadata = metadata
        self.key = key
        self.cache_hit = cache_hit
        self.seconds = 0.0
        self._kernels: dict[int, Any] = {}  # device index -> Triton CompiledKernel loaded there
        self._lock = threading.Lock()
        self._knobs: Any = None

    @property
    def name(self) -> str:
        """The kernel's symbol in the cubin (the jit function's name)."""
        return self.metadata["name"]

    @property
    def shared_bytes(self) -> int:
        """Shared memory one program uses."""
        return int(self.metadata.get("shared", 0))

    def to_bytes(self) -> bytes:
        """The disk cache payload.

        Returns:
            A length-prefixed json header (format, Triton's metadata), then the cubin.
        """
        header = json.dumps({"format": _FORMAT, "metadata": self.metadata}).encode()
        return struct.pack("<I", len(header)) + header + self.cubin

    @classmethod
    def from_bytes(cls, spec: TritonSpec, blob: bytes, key: str) -> "TritonBinary":
        """The binary of a disk cache payload.

        Args:
            spec: what the payload was compiled from.
            blob: the payload (`to_bytes`).
            key: its cache key.

        Returns:
            The binary; ValueError for another layout or no ELF image.
        """
        (n,) = struct.unpack_from("<I", blob)
        header = json.loads(blob[4:4 + n].decode())
        if header.get("format") != _FORMAT:
            raise ValueError("cached Triton kernel has another format")
        cubin = blob[4 + n:]
        if cubin[:4] != b"\x7fELF":
            raise ValueError("cached Triton kernel holds no ELF image")
        return cls(spec, cubin, header["metadata"], key, cache_hit=True)

    # ---- launching (needs a GPU) -------------------------------------------------------
    def kernel_on(self, device: int) -> Any:
        """Triton's ``CompiledKernel`` of this binary, loaded on ``device`` (once).

        Args:
            device: a CUDA device index.

        Returns:
            The loaded kernel, whose ``function`` is the device's CUfunction.
        """
        found = self._kernels.get(device)
        if found is not None:
            return found
        with self._lock:
            found = self._kernels.get(device)
            if found is None:
                found = self._kernels[device] = self._load(device)
        return found

    def compiled_kernel(self) -> Any:
        """A Triton ``CompiledKernel`` of this binary, not yet loaded on a device (no GPU needed).

        Returns:
            The kernel Triton's own compile would return, built from the cubin and metadata
            (its ``asm`` holds the cubin alone).
        """
        from triton.compiler import CompiledKernel

        name = self.name
        with tempfile.TemporaryDirectory(prefix="kernel_api-triton-") as folder:  # (mode 0700)
            paths = {f"{name}.json": os.path.join(folder, f"{name}.json"),
                     f"{name}.cubin": os.path.join(folder, f"{name}.cubin")}
            with open(paths[f"{name}.json"], "w", encoding="utf-8") as f:
                json.dump(self.metadata, f)
            with open(paths[f"{name}.cubin"], "wb") as f:
                f.write(self.cubin)
            # The constructor reads both files; nothing reads them later.
            return CompiledKernel(self.spec.ast_source(), paths, self.metadata["hash"])

    def _load(self, device: int) -> Any:
        from triton import knobs

        kernel = self.compiled_kernel()
        try:
            with torch.cuda.device(device):
                kernel.run  # noqa: B018  (loads the module on the current device, builds the launcher)
        except Exception as exc:
            raise KernelLaunchError(f"{self.name}: could not load its sm_{self.spec.cc} cubin on device {device}: "
                                    f"{exc}") from exc
        self._knobs = knobs.runtime
        return kernel

    def launch(self, device: int, grid: tuple[int, int, int], stream: int, values: tuple, label: str) -> None:
        """Launch on ``device``'s raw stream ``stream`` as Triton's JIT does.

        Args:
            device: the device the operands are on (the kernel is loaded there once; Triton's
                launcher uses the current device's context, so another current device is
                switched to ``device`` around the launch).
            grid: programs along x, y and z.
            stream: a raw ``cudaStream_t``.
            values: every parameter of the jit function in order, constexprs included (Triton's
                launcher skips them), tensors as tensors.
            label: the kernel instance's name, for messages.

        Raises:
            KernelLaunchError: Triton's launcher failed (the message names ``label``).
        """
        kernel = self._kernels.get(device)
        if kernel is None:
            kernel = self.kernel_on(device)
        runtime = self._knobs
        enter = runtime.launch_enter_hook
        try:
            metadata = None if enter is None else kernel.launch_metadata(grid, stream, *values)
            if torch.cuda.current_device() == device:
                kernel.run(grid[0], grid[1], grid[2], stream, kernel.function, kernel.packed_metadata, metadata, enter,
                           runtime.launch_exit_hook, *values)
            else:
                with torch.cuda.device(device):
                    kernel.run(grid[0], grid[1], grid[2], stream, kernel.function, kernel.packed_metadata, metadata,
                               enter, runtime.launch_exit_hook, *values)
        except Exception as exc:
            raise KernelLaunchError(f"{label}: Triton launch of {self.name} with grid={grid} on stream {stream:#x} "
                                    f"(device {device}) failed: {exc}") from exc


@contextlib.contextmanager
def _compiling_afresh() -> Iterator[None]:
    """Triton's ``always_compile`` knob on: ``triton.compile`` then never returns an artifact
    from Triton's own cache folder, which kernel_api's trust rule does not check."""
    try:
        from triton import knobs
    except ImportError:  # a triton without knobs
        yield
        return
    with _compile_lock, knobs.compilation.scope():
        knobs.compilation.always_compile = True
        yield


def compile_triton(spec: TritonSpec, label: str) -> TritonBinary:
    """Compile ``spec`` (or load it from the disk cache): no GPU needed.

    Args:
        spec: the jit function, signature, constexprs, aligned pointers, options and target.
        label: the kernel instance's name, for messages.

    Returns:
        The binary; `CompilationError` with Triton's message when Triton fails,
        `ArtifactNotCachedError` under `kernel_api.kernel.cache_only` when nothing is cached.
    """
    key = spec.key()
    with _memo_lock:
        found = _memo.get(key)
    if found is not None:
        return found
    start = time.perf_counter()
    blob = _cache.get(key)
    if blob is not None:
        try:
            binary = TritonBinary.from_bytes(spec, blob, key)
        except Exception:  # noqa: BLE001 - a well-formed entry of an unknown layout: rebuild it
            _log.debug("triton cache entry of %s has an unknown layout; deleted", label)
            _cache.delete(key)
        else:
            binary.seconds = time.perf_counter() - start
            _log.debug("triton cache hit: %s for sm_%d, loaded in %.3f s", label, spec.cc, binary.seconds)
            with _memo_lock:
                _memo[key] = binary
            return binary
    if cache_only.get():
        raise ArtifactNotCachedError(f"{label}: no cached Triton kernel for sm_{spec.cc} "
                                     f"(a compile from the cache only)")
    triton = require_triton()
    from triton.backends.compiler import GPUTarget

    try:
        with _compiling_afresh():
            compiled = triton.compile(spec.ast_source(), target=GPUTarget("cuda", spec.cc, 32),
                                      options=dict(spec.options))
    except Exception as exc:
        raise CompilationError(f"{label}: Triton {triton.__version__} could not compile {spec.fn.__name__} for "
                               f"sm_{spec.cc}: {type(exc).__name__}: {exc}") from exc
    metadata = json.loads(json.dumps(compiled.metadata._asdict(), default=vars))
    binary = TritonBinary(spec, bytes(compiled.asm["cubin"]), metadata, key)
    binary.seconds = time.perf_counter() - start
    _log.debug("Triton compiled %s for sm_%d in %.3f s", label, spec.cc, binary.seconds)
    _cache.put(key, binary.to_bytes())
    with _memo_lock:
        _memo[key] = binary
    return binary


def clear_memory_cache() -> None:
    """Forget this process's compiles and loads (the disk cache stays); for tests."""
    with _memo_lock:
        _memo.clear()


def disk_cache() -> DiskCache:
    """The `DiskCache` holding Triton kernels (its ``stats`` count hits and misses)."""
    return _cache
