"""Loading a compiled cubin and launching one of its kernels through the CUDA driver API
(``cuda.bindings.driver``, which torch's CUDA support imports already).

A `CudaLauncher` is what a cuda_src `CompiledArtifact` holds. It loads the cubin once per
process as a context-independent library (``cuLibraryLoadData``; one load serves every device
and every kernel of the cubin), reads the kernel's per-device limits once per device, and keeps per-launch work to a
few dictionary look-ups, one parameter pack (`kernel_api.nvrtc.kernel_params`) and
``cuLaunchKernel``: a configuration is checked against the device's limits the first time it
is seen.

Nothing here imports ``cuda.core``: its import (NVML, checkpoint modules, numpy) cost about
120 ms of a warm first call on an H200 host, most of it.

``launch(..., cooperative=True)`` launches a grid whose CTAs wait on each other (a persistent
kernel's groups, ``cuLaunchCooperativeKernel``): the driver then guarantees that every CTA is
resident at once, or fails the launch. The grid is first checked against `max_coresident`
(occupancy x SMs), so a grid too large is a `KernelLaunchError` that says so, never a hang.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, NamedTuple, Sequence

import torch

from ..core.errors import DeviceError, KernelLaunchError
from .compiler import CompiledCuda
from .kernel_params import ParamError, ParamPacker

_log = logging.getLogger(__name__)
_drv: Any = None  # cuda.bindings.driver, imported at the first load
_contexts: dict[int, Any] = {}  # device -> its primary context, for threads with none current
_CUDA_ERROR_INVALID_CONTEXT = 201


def _driver() -> Any:
    global _drv
    if _drv is None:
        from cuda.bindings import driver

        _drv = driver
    return _drv


def _check(result: tuple, what: str) -> Any:
    """The value of a driver call's ``(CUresult, value...)``; DeviceError naming ``what`` when the
    call failed."""
    err = result[0]
    if err:
        raise DeviceError(f"{what} failed: {_error_text(err)}")
    return result[1] if len(result) == 2 else result[1:]


def _error_text(err: Any) -> str:
    try:
        name = _driver().cuGetErrorName(err)[1]
        return f"{getattr(err, 'name', err)} ({name.decode() if isinstance(name, bytes) else name})"
    except Exception:  # noqa: BLE001 - the code alone
        return str(err)


class _DeviceLimits:
    __slots__ = ("max_threads", "max_block", "max_grid", "max_smem_optin", "max_smem_default", "sms", "cooperative",
                 "threads_per_sm", "smem_per_sm", "smem_reserved")

    def __init__(self, device: int) -> None:
        drv = _driver()
        A = drv.CUdevice_attribute

        def attr(a: Any) -> int:
            return int(_check(drv.cuDeviceGetAttribute(a, device), f"cuDeviceGetAttribute({a}) on device {device}"))

        self.max_threads = attr(A.CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK)
        self.max_block = (attr(A.CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_X), attr(A.CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Y),
                          attr(A.CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Z))
        self.max_grid = (attr(A.CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_X), attr(A.CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Y),
                         attr(A.CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Z))
        self.max_smem_optin = attr(A.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
        self.max_smem_default = attr(A.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK)
        self.sms = attr(A.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
        self.cooperative = bool(attr(A.CU_DEVICE_ATTRIBUTE_COOPERATIVE_LAUNCH))
        self.threads_per_sm = attr(A.CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR)
        self.smem_per_sm = attr(A.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR)
        self.smem_reserved = attr(A.CU_DEVICE_ATTRIBUTE_RESERVED_SHARED_MEMORY_PER_BLOCK)


_library_lock = threading.Lock()


def _library(compiled: CompiledCuda) -> Any:
    """The ``CUlibrary`` of ``compiled``'s cubin, loaded once per compile: the launchers of its
    kernels (a family's companion kernels, the line copies' instances) share it."""
    with _library_lock:
        if compiled._loaded is None:
            compiled._loaded = _check(_driver().cuLibraryLoadData(compiled.cubin, [], [], 0, [], [], 0),
                                      "cuLibraryLoadData")
        return compiled._loaded


class LoadedKernel(NamedTuple):
    """A kernel of a loaded cubin: ``handle`` the driver's ``CUkernel`` (``int(handle)`` is what
    `kernel_api.native.cuda_launch` takes), ``library`` the ``CUlibrary`` holding it."""

    handle: Any
    library: Any


class _Config(NamedTuple):
    """A checked launch configuration: grid and block dimensions, dynamic shared memory bytes,
    and whether the launch is cooperative."""

    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    smem: int
    cooperative: bool


def _dims(value: Any, what: str, label: str) -> tuple[int, int, int]:
    if isinstance(value, int) and not isinstance(value, bool):
        dims = (value, 1, 1)
    else:
        try:
            dims = tuple(int(v) for v in value)
        except TypeError:
            raise KernelLaunchError(f"{label}: {what} must be an int or a tuple of up to 3 ints, got {value!r}") from None
        if not 1 <= len(dims) <= 3:
            raise KernelLaunchError(f"{label}: {what} must have 1 to 3 dimensions, got {value!r}")
        dims = dims + (1,) * (3 - len(dims))
    if any(d < 1 for d in dims):
        raise KernelLaunchError(f"{label}: {what} {dims} has a dimension below 1")
    return dims  # type: ignore[return-value]


class CudaLauncher:
    """One kernel of a compiled cubin, ready to launch on any device's streams.

    ``label`` names the kernel in error messages. ``convert_args``: give Python ints and floats
    the sizes of the kernel's parameters (4-byte int/float parameters get 32-bit values); the
    package's own kernels pass exactly typed values and turn it off (`kernel_params`).
    """

    def __init__(self, compiled: CompiledCuda, name_expression: str, label: str, convert_args: bool = True) -> None:
        self.compiled = compiled
        self.name_expression = name_expression
        self.label = label
        self.convert_args = convert_args
        self._kernel: LoadedKernel | None = None
        self._function: Any = None  # the CUkernel as the CUfunction that launches take
        self._packer = ParamPacker(label)
        self._devices: dict[int, _DeviceLimits] = {}
        self._configs: dict[tuple, _Config] = {}
        self._smem_set: dict[int, int] = {}
        self._coresident: dict[tuple, int] = {}
        self._lock = threading.Lock()

    # ---- loading (once) ----------------------------------------------------------------
    @property
    def kernel(self) -> LoadedKernel:
        """The loaded kernel (`LoadedKernel`; loads the cubin on first use)."""
        k = self._kernel
        if k is None:
            k = self._load()
        return k

    def _load(self) -> LoadedKernel:
        with self._lock:
            if self._kernel is not None:
                return self._kernel
            if not torch.cuda.is_available():
                raise DeviceError(f"{self.label}: loading a cubin needs a CUDA GPU")
            torch.cuda.init()  # the driver and torch's primary context must exist
            symbol = self.compiled.symbols.get(self.name_expression, self.name_expression)
            try:
                drv = _driver()
                library = _library(self.compiled)
                handle = _check(drv.cuLibraryGetKernel(library, symbol.encode()), f"cuLibraryGetKernel({symbol})")
            except Exception as exc:
                raise KernelLaunchError(
                    f"{self.label}: could not load kernel {self.name_expression!r} from its {self.compiled.arch} "
                    f"cubin: {exc}") from exc
            if self.convert_args:
                self._packer = ParamPacker(self.label, self._param_sizes(handle))
            self._function = drv.CUfunction(int(handle))
            self._kernel = LoadedKernel(handle, library)
            return self._kernel

    def _param_sizes(self, handle: Any) -> tuple[int, ...] | None:
        """The kernel's parameter sizes in bytes (None where the driver cannot say). The query
        probes past the last parameter, which compute-sanitizer reports as an API error, so it
        runs only where Python numbers are converted."""
        query = getattr(_driver(), "cuKernelGetParamInfo", None)
        if query is None:
            return None
        sizes = []
        try:
            while len(sizes) < 4096:
                result = query(handle, len(sizes))
                if result[0]:  # past the last parameter (or a driver without the query)
                    break
                sizes.append(int(result[2]))
        except Exception:  # noqa: BLE001 - no sizes: each value's own
            return None
        return tuple(sizes) if sizes else None

    def _limits(self, device: int) -> _DeviceLimits:
        lim = self._devices.get(device)
        if lim is None:
            lim = self._devices[device] = _DeviceLimits(device)
        return lim

    def _attribute(self, name: str, device: int) -> int | None:
        """A ``CU_FUNC_ATTRIBUTE_<name>`` of the kernel on ``device`` (None when the driver cannot say)."""
        drv = _driver()
        try:
            result = drv.cuKernelGetAttribute(getattr(drv.CUfunction_attribute, f"CU_FUNC_ATTRIBUTE_{name}"),
                                              self.kernel.handle, device)
        except Exception:  # noqa: BLE001
            return None
        return None if result[0] else int(result[1])

    def _static_smem(self, device: int) -> int:
        """The kernel's static shared memory on ``device`` (0 when the driver cannot say)."""
        return self._attribute("SHARED_SIZE_BYTES", device) or 0

    def max_dynamic_smem(self, device: int) -> int:
        """The most dynamic shared memory one CTA of this kernel may ask for on ``device``
        (the opt-in limit less the kernel's static shared memory)."""
        return self._limits(device).max_smem_optin - self._static_smem(device)

    def max_coresident(self, device: int, threads: int, smem: int) -> int:
        """How many CTAs of ``threads`` threads and ``smem`` bytes of dynamic shared memory can
        be resident on ``device`` at once (occupancy per SM x SMs): a cooperative grid's limit."""
        key = (device, threads, smem)
        found = self._coresident.get(key)
        if found is not None:
            return found
        lim = self._limits(device)
        static_smem = self._static_smem(device)
        if smem > lim.max_smem_default - static_smem and self._smem_set.get(device, -1) < smem:
            self._allow_smem(device, smem)  # (the occupancy counts only what the kernel is allowed)
        try:
            self.kernel  # noqa: B018 - loaded before the query
            with torch.cuda.device(device):  # (the query asks the current context's device)
                per_sm = int(_check(_driver().cuOccupancyMaxActiveBlocksPerMultiprocessor(self._function, threads, smem),
                                    "cuOccupancyMaxActiveBlocksPerMultiprocessor"))
        except Exception as exc:  # noqa: BLE001 - estimated from the device's limits instead
            # Threads and shared memory per SM (registers are the launch bounds'); were it too
            # many, the driver refuses the cooperative launch, which never hangs either.
            per_sm = max(0, min(lim.threads_per_sm // max(threads, 1),
                                lim.smem_per_sm // max(smem + static_smem + lim.smem_reserved, 1)))
            _log.debug("%s: occupancy query failed (%s); %d CTA(s) per SM from the device's limits", self.label,
                       exc, per_sm)
        found = self._coresident[key] = per_sm * lim.sms
        return found

    def _config(self, key: tuple, device: int) -> _Config:
        grid, block, smem = key[:3]
        cooperative = len(key) > 3 and key[3]
        label = self.label
        g = _dims(grid, "grid", label)
        b = _dims(block, "block", label)
        smem = int(smem or 0)
        lim = self._limits(device)
        self.kernel  # noqa: B018 - loaded before its attributes are read
        kmax = self._attribute("MAX_THREADS_PER_BLOCK", device) or lim.max_threads
        static_smem = self._static_smem(device)
        threads = b[0] * b[1] * b[2]
        if any(x > m for x, m in zip(b, lim.max_block)) or threads > lim.max_threads:
            raise KernelLaunchError(f"{label}: block {b} ({threads} threads) exceeds the device's limits "
                                    f"(at most {lim.max_block} and {lim.max_threads} threads per block)")
        if threads > kmax:
            raise KernelLaunchError(f"{label}: block of {threads} threads exceeds this kernel's limit of {kmax} "
                                    f"(its register use or __launch_bounds__ allow no more)")
        if any(x > m for x, m in zip(g, lim.max_grid)):
            raise KernelLaunchError(f"{label}: grid {g} exceeds the device's limits {lim.max_grid}")
        if smem < 0 or smem + static_smem > lim.max_smem_optin:
            raise KernelLaunchError(
                f"{label}: {smem} bytes of dynamic shared memory (+{static_smem} static) exceed the device's "
                f"{lim.max_smem_optin} bytes per block")
        if smem > lim.max_smem_default - static_smem and self._smem_set.get(device, -1) < smem:
            self._allow_smem(device, smem)
        if cooperative:
            self._check_cooperative(device, g, threads, smem)
        cfg = self._configs[(key, device)] = _Config(g, b, smem, bool(cooperative))
        return cfg

    def _check_cooperative(self, device: int, grid: tuple, threads: int, smem: int) -> None:
        lim = self._limits(device)
        if not lim.cooperative:
            raise KernelLaunchError(f"{self.label}: device {device} does not support cooperative launches")
        ctas = grid[0] * grid[1] * grid[2]
        fit = self.max_coresident(device, threads, smem)
        if ctas > fit:
            raise KernelLaunchError(
                f"{self.label}: a cooperative launch of {ctas} CTAs exceeds the {fit} that can be resident at once "
                f"on device {device} ({fit // max(lim.sms, 1)} per SM x {lim.sms} SMs with {threads} threads and "
                f"{smem} B of dynamic shared memory each); its CTAs wait on each other, so all must be resident")

    def _allow_smem(self, device: int, smem: int) -> None:
        # Above 48 KB a kernel must opt in to more dynamic shared memory, per device.
        drv = _driver()
        attr = drv.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        err, = drv.cuKernelSetAttribute(attr, smem, self.kernel.handle, device)
        if err:
            raise KernelLaunchError(f"{self.label}: could not allow {smem} bytes of dynamic shared memory: "
                                    f"{_error_text(err)}")
        self._smem_set[device] = smem

    @staticmethod
    def _bind_context(device: int) -> bool:
        """Make ``device``'s primary context current on this thread; whether that succeeded."""
        drv = _driver()
        try:
            ctx = _contexts.get(device)
            if ctx is None:
                ctx = _contexts[device] = _check(drv.cuDevicePrimaryCtxRetain(device), "cuDevicePrimaryCtxRetain")
            _check(drv.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
        except Exception:  # noqa: BLE001 - the caller reports the launch's own error
            return False
        return True

    def _call(self, cfg: _Config, stream: int, params: Any) -> Any:
        g, b = cfg.grid, cfg.block
        if cfg.cooperative:
            return _drv.cuLaunchCooperativeKernel(self._function, g[0], g[1], g[2], b[0], b[1], b[2], cfg.smem, stream,
                                                  params)[0]
        return _drv.cuLaunchKernel(self._function, g[0], g[1], g[2], b[0], b[1], b[2], cfg.smem, stream, params, 0)[0]

    # ---- the hot path -------------------------------------------------------------------
    def launch(self, stream: int, device: int, grid: Any, block: Any, smem: int, params: Sequence[Any],
               cooperative: bool = False) -> None:
        """Launch on the raw stream handle ``stream`` of ``device``; ``cooperative``: with every
        CTA guaranteed resident at once (or a `KernelLaunchError`), for grids whose CTAs wait
        on each other."""
        key = (grid, block, smem, True) if cooperative else (grid, block, smem)
        cfg = self._configs.get((key, device))
        if cfg is None:
            cfg = self._config(key, device)
        try:
            packed = self._packer.pack(params)
        except ParamError as exc:
            raise KernelLaunchError(str(exc)) from None
        err = self._call(cfg, stream, packed)
        if err == _CUDA_ERROR_INVALID_CONTEXT and self._bind_context(device):
            # A thread torch never bound a context to (autograd's device threads skip
            # cudaSetDevice when the device already reads as current): bind the primary one.
            err = self._call(cfg, stream, packed)
        if err:
            raise KernelLaunchError(
                f"{self.label}: {'cooperative ' if cooperative else ''}launch of {self.name_expression} with "
                f"grid={grid}, block={block}, shared memory={smem} B on stream {stream:#x} (device {device}) "
                f"failed: {_error_text(err)}")
