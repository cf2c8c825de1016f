"""The native library (`launch_table.cc`, `python_entry.cc`), built when kernel-api is installed.

`kernel_api.ops` keeps repeated calls out of Python with it: after a front door's Python path has
chosen, checked, compiled and launched a kernel, it records what it did (a recipe:
`kernel_api.native.recipes`) under the call's key; a later call with an equal key (the settings'
policy, torch's state, every argument's value and every tensor's raw metadata) is one call into
C that finds the recipe and runs it: the kernel's TVM-FFI function on the caller's current
stream, or the torch call a torch-launched kernel offers.

The library is a CPython extension (`python_entry.cc`, see `entry()`): it reads torch tensors
through torch's DLPack exchange API without allocating (``replay``, ``bind``), which makes a
launch from Python cheaper than calling the TVM-FFI function with the tensors directly. Opened a
second time as a TVM-FFI module (`table()`), it turns a CUDA source kernel's launch into a
TVM-FFI function (`cuda_launch`).

setup.py compiles both into the extension module ``kernel_api.native._launch_table`` when the
package is installed, against the headers of the tvm_ffi present then; Python's import system
finds the build for this interpreter (ABI tag, free-threaded or not). It is imported after
tvm_ffi, whose library provides the TVM-FFI symbols it leaves unresolved. Where it was not built
(no compiler at install), or is damaged, built for other sources or another TVM-FFI, or with
``KERNEL_API_NATIVE=0``, `table()` and `entry()` return None, one `RuntimeWarning` says why, and
callers stay on their Python paths.

Two optional modules sit beside it: ``_front_door`` (`front_door_module`: the C front doors of
`kernel_api.ops.front_doors`) and ``_torch_reads`` (`torch_reads`: the call key's reads of torch
through its C++ API, built for one torch version and adopted once it agrees with torch's own).
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import struct
import sys
import threading
import warnings
from pathlib import Path
from typing import Any

from .sources import FRONT_DOOR_NAMES, TORCH_READS_NAMES, digest

_log = logging.getLogger(__name__)
_MODULE = f"{__name__}._launch_table"
_REINSTALL = ("reinstall kernel-api where a C++ compiler and tvm_ffi are found for the fast path "
              "(from a source tree: pip install -e ., or python setup.py build_ext --inplace)")
_lock = threading.Lock()
# "table": the loaded TVM-FFI module or None once tried; "error": why not; "entry": the CPython
# module or None; "entry_error": why not.
_state: dict[str, Any] = {}


class NativeUnavailable(RuntimeError):
    """The installed native module is missing, damaged or was built for something else."""


def enabled() -> bool:
    return os.environ.get("KERNEL_API_NATIVE", "1").strip().lower() not in ("0", "false", "no", "off")


def module_path() -> str | None:
    """The file of the native module this install built, or None where it was not built."""
    spec = importlib.util.find_spec(_MODULE)
    return spec.origin if spec is not None and spec.has_location else None


def _damage(path: str) -> str | None:
    """Why the library at ``path`` cannot be mapped whole, or None. dlopen maps what an ELF
    file's headers describe, so a file cut short (an interrupted copy, a full disk) kills the
    process with SIGBUS instead of failing the import: its extents are checked first."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(64)
        if head[:4] != b"\x7fELF":
            return f"not an ELF library ({size} bytes)" if sys.platform.startswith("linux") else None
        if len(head) < 64:
            return f"truncated to {size} bytes"
        order = "<" if head[5] == 1 else ">"
        if head[4] == 2:  # ELF64: e_phoff, e_shoff; e_phentsize, e_phnum, e_shentsize, e_shnum; p_offset, p_filesz
            (phoff, shoff), segment = struct.unpack_from(order + "QQ", head, 32), order + "8xQ16xQ"
            phentsize, phnum, shentsize, shnum = struct.unpack_from(order + "HHHH", head, 54)
        else:  # ELF32
            (phoff, shoff), segment = struct.unpack_from(order + "II", head, 28), order + "4xI8xI"
            phentsize, phnum, shentsize, shnum = struct.unpack_from(order + "HHHH", head, 42)
        ends = [phoff + phentsize * phnum, shoff + shentsize * shnum]
        f.seek(phoff)
        table = f.read(phentsize * phnum)
        if len(table) == phentsize * phnum:  # else the first end already exceeds the size
            ends += [offset + filesz for offset, filesz in
                     (struct.unpack_from(segment, table, i * phentsize) for i in range(phnum))]
    if max(ends) > size:
        return f"truncated: its headers describe {max(ends)} bytes, the file has {size}"
    return None


def table() -> Any:
    """The native library as a TVM-FFI module (``cuda_launch``), or None when it is disabled or
    unavailable in this install (the reason is logged once and kept in `why_not`)."""
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
    """The native library's CPython module (``replay``, ``record``, ``bind``; see python_entry.cc),
    configured for torch tensors, or None where the table is unavailable or torch offers no
    DLPack exchange API (the reason is in `why_not_entry`)."""
    if "table" not in _state:
        table()
    return _state.get("entry")


def _configure_entry(module: Any) -> Any:
    try:
        import torch

        module.configure(torch.Tensor)
        return module
    except (ImportError, AttributeError, RuntimeError, TypeError) as exc:
        _state["entry_error"] = f"{type(exc).__name__}: {exc}"
        _log.info("kernel_api: the native library's CPython entry points are unavailable: %s", exc)
        return None


def _open(tvm_ffi: Any) -> Any:
    """Import the installed native module, check it and return its TVM-FFI view."""
    path = module_path()
    if path is None:
        raise NativeUnavailable(f"{_MODULE} was not built when kernel-api was installed; {_REINSTALL}")
    try:
        damage = _damage(path)
    except OSError as exc:
        damage = str(exc)
    if damage:
        raise NativeUnavailable(f"{path} is damaged ({damage}); {_REINSTALL}")
    try:
        module = importlib.import_module(_MODULE)
    except ImportError as exc:
        raise NativeUnavailable(f"{path} does not load ({exc}); {_REINSTALL}") from exc
    built_for = getattr(module, "tvm_ffi_version", None)
    if built_for != tvm_ffi.__version__:
        raise NativeUnavailable(f"{path} was built for TVM-FFI {built_for}, not the installed "
                                f"{tvm_ffi.__version__}; {_REINSTALL}")
    sources = digest(Path(path).parent)
    if sources is not None and sources != getattr(module, "source_digest", None):
        raise NativeUnavailable(f"{path} was built from other sources than those beside it; {_REINSTALL}")
    # The same library (dlopen gives the same handle) as a TVM-FFI module.
    loaded = tvm_ffi.load_module(path)
    _state["entry"] = _configure_entry(module)
    if _state["entry"] is not None:
        for callback in _entry_callbacks:
            callback(_state["entry"])
    return loaded


def _load() -> Any:
    if not enabled():
        _state["error"] = "disabled by KERNEL_API_NATIVE=0"
        return None
    try:
        # First: tvm_ffi loads libtvm_ffi with RTLD_GLOBAL, which resolves the module's TVM-FFI symbols.
        import tvm_ffi

        return _open(tvm_ffi)
    except ImportError as exc:
        _state["error"] = f"tvm_ffi is not installed ({exc})"
    except (OSError, RuntimeError) as exc:  # NativeUnavailable, or TVM-FFI refusing the library
        _state["error"] = str(exc)
    # A warning rather than a log record: the kernel_api logger is silent until configured, and
    # a user should learn once that repeated calls are slower than they could be.
    message = f"kernel_api: the native library is unavailable, repeated ops calls stay in Python: {_state['error']}"
    warnings.warn(message, RuntimeWarning, stacklevel=2)
    return None


#: A kernel parameter of `cuda_launch` that is a tensor's data pointer: ``(TENSOR, index)``;
#: ``(8, value)`` and ``(4, value)`` are constants of that many bytes.
TENSOR = 0


def cuda_launch(kernel: int, n_tensors: int, grid: tuple[int, int, int], block: tuple[int, int, int],
                shared_bytes: int, parameters: tuple[tuple[int, int], ...]) -> Any:
    """A TVM-FFI function ``function(*tensors, stream)`` that launches the CUDA kernel ``kernel``
    (a ``CUfunction`` or ``CUkernel`` handle, as an int) with ``cuLaunchKernel``, or None where the
    table is unavailable or no CUDA driver is found (the reason is logged at DEBUG).

    What a Python launch of a CUDA source kernel did (`CudaLauncher.launch`), recorded: its
    ``grid``, ``block``, ``shared_bytes`` of dynamic shared memory and ``parameters``, one per
    kernel parameter, ``(TENSOR, i)`` for the data pointer of ``tensors[i]``, ``(8, value)`` or
    ``(4, value)`` for a constant. A `kernel_api.launcher.Launcher` of it is a TVM-FFI
    function's, so bound launches and the entry points' replays run it without
    Python. It launches on the stream given (None: the current stream of the first tensor's
    device) in the current context, or the tensors' device's primary context when the current
    one is another device's; it holds the GIL (``release_gil`` False), as a launch that short
    gains nothing from releasing it.
    """
    loaded = table()
    if loaded is None:
        return None
    flat = [value for parameter in parameters for value in parameter]
    try:
        function = loaded.cuda_launch(int(kernel), n_tensors, *grid, *block, shared_bytes, *flat)
    except (RuntimeError, ValueError) as exc:  # no CUDA driver here, or a launch it cannot record
        _log.debug("kernel_api: no recorded CUDA launch: %s", exc)
        return None
    function.release_gil = False
    return function


def why_not() -> str | None:
    """Why `table()` returned None (None when it loaded or was not tried yet)."""
    return _state.get("error")


def why_not_entry() -> str | None:
    """Why `entry()` returned None (None when it loaded or was not tried yet)."""
    return _state.get("error") or _state.get("entry_error")


_FRONT_DOOR = f"{__name__}._front_door"


def front_door_module() -> Any:
    """The front doors' module (``_front_door``, front_door.cc: `kernel_api.ops.front_doors`), or
    None where it is disabled (``KERNEL_API_NATIVE=0``), was not built or was built from other
    sources (the reason is logged at INFO). It needs neither torch nor TVM-FFI to import."""
    if "front_door" in _state:
        return _state["front_door"]
    module, why = (None, "disabled by KERNEL_API_NATIVE=0") if not enabled() else _import_built(
        _FRONT_DOOR, FRONT_DOOR_NAMES, "was not built")
    if why is not None:
        _log.info("kernel_api: the ops front doors stay Python functions: %s", why)
    _state["front_door"] = module
    return module


def _import_built(name: str, sources: tuple[str, ...], missing: str) -> tuple[Any, str | None]:
    """(the optional native module ``name``, None), or (None, why not): not built (``missing``
    says why), not loadable, or built from other ``sources`` than those beside it."""
    if importlib.util.find_spec(name) is None:
        return None, f"{name} {missing}"
    try:
        module = importlib.import_module(name)
    except ImportError as exc:
        return None, f"{name} does not load ({exc}); {_REINSTALL}"
    found = digest(Path(module.__file__).parent, sources)
    if found is not None and found != module.source_digest:
        return None, f"{name} was built from other sources than those beside it; {_REINSTALL}"
    return module, None


_TORCH_READS = f"{__name__}._torch_reads"


def torch_reads(entry_module: Any) -> Any:
    """Hand ``entry_module`` (`entry()`, its call key configured) the torch-linked reads
    (``_torch_reads``, torch_reads.cc) when they are built for the torch running and agree with
    torch's own readers; the capsule handed over, or None (the reason is in `why_not_torch_reads`).

    The agreement is checked once, here: on sample tensors (every dtype, views, offsets, strides of
    0, a size-1 dimension's odd stride, lazy bits, requires_grad, 0-d and empty; CUDA ones where CUDA
    is initialised) against the DLPack exchange API, and on torch's state (grad mode, a torch
    function mode, a torch dispatch mode, CPU and CUDA autocast) against its Python readers.
    """
    if "torch_reads" in _state:
        return _state["torch_reads"]
    _state["torch_reads"] = None
    try:
        reads = _adopt_torch_reads(entry_module)
    except Exception as exc:  # noqa: BLE001 - an unusable module only costs the faster reads
        reads, _state["torch_reads_error"] = None, f"{type(exc).__name__}: {exc}"
    if reads is None:
        _log.info("kernel_api: the call key reads torch through its Python functions: %s",
                  _state.get("torch_reads_error"))
    _state["torch_reads"] = reads
    return reads


def _adopt_torch_reads(entry_module: Any) -> Any:
    import torch

    module, why = _import_built(_TORCH_READS, TORCH_READS_NAMES, "was not built (no torch at install, or built in "
                                                                 "isolation)")
    if module is not None and module.torch_version != torch.__version__:
        module, why = None, (f"{_TORCH_READS} was built for torch {module.torch_version}, not the installed "
                             f"{torch.__version__}; {_REINSTALL}")
    if module is None:
        _state["torch_reads_error"] = why
        return None
    disagreement = _disagreement(entry_module, module.reads, torch)
    if disagreement is not None:
        _state["torch_reads_error"] = f"{_TORCH_READS} disagrees with torch ({disagreement})"
        return None
    entry_module.use_torch_reads(module.reads)
    return module.reads


def _disagreement(entry_module: Any, reads: Any, torch: Any) -> str | None:
    from torch.overrides import TorchFunctionMode
    from torch.utils._python_dispatch import TorchDispatchMode

    x = torch.arange(12.0).reshape(3, 4)
    dtypes = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16, torch.float32,
              torch.float64, torch.bfloat16, torch.bool, torch.complex64, torch.complex128, torch.float8_e4m3fn)
    samples = [x, x.t(), x[1:, 1:3], x[:, None], x.expand(2, 3, 4), torch.tensor(2.0), torch.empty(0, 5),
               torch.empty(4, 1, 3).as_strided((4, 1, 3), (3, 99, 1)), torch.ones(2, requires_grad=True),
               torch._neg_view(x), torch.ones(2, 3, dtype=torch.complex64).conj(),
               *(x.to(dtype) for dtype in dtypes)]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        samples += [torch.ones(2, 3, device="cuda")[:, 1:], torch.ones(3, device="cuda", dtype=torch.bfloat16)]

    class Passing(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    class Dispatching(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    states = [("plain", None), ("no_grad", torch.no_grad), ("a torch function mode", Passing),
              ("a torch dispatch mode", Dispatching), ("CPU autocast", lambda: torch.autocast("cpu"))]
    if torch.cuda.is_available():
        states.append(("CUDA autocast", lambda: torch.autocast("cuda")))
    for name, state in states:
        if state is None:
            found = entry_module.check_torch_reads(reads, *samples)
        else:
            with state():
                found = entry_module.check_torch_reads(reads)
        if found is not None:
            return f"{name}: {found}"
    return None


def why_not_torch_reads() -> str | None:
    """Why `torch_reads` handed nothing over (None when it did or was not tried yet)."""
    return _state.get("torch_reads_error")


def _reset_for_tests() -> None:
    with _lock:
        _state.clear()
