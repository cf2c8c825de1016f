"""Loading a compiled cubin and launching one of its kernels with ``cuda.core``.

A `CudaLauncher` is what a cuda_src `CompiledArtifact` holds. It loads the cubin once per
process (the library's kernels are context-independent, so one load serves every device),
reads the kernel's per-device limits once per device, and keeps per-launch work to a few
dictionary look-ups: `cuda.core` stream wrappers are cached by raw handle and
``LaunchConfig`` objects by (grid, block, shared memory); a configuration is checked against
the device's limits the first time it is seen.

``launch(..., cooperative=True)`` launches a grid whose CTAs wait on each other (a persistent
kernel's groups): the driver then guarantees that every CTA is resident at once, or fails the
launch. The grid is first checked against `max_coresident` (occupancy x SMs), so a grid too
large is a `KernelLaunchError` that says so, never a hang.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Sequence

import torch

from ..core.errors import DeviceError, KernelLaunchError
from .compiler import CompiledCuda

_log = logging.getLogger(__name__)
_streams: dict[int, Any] = {}  # raw cudaStream_t -> cuda.core Stream (borrowed, not owned)
_lock = threading.Lock()
_core: Any = None


def _core_api() -> Any:
    global _core
    if _core is None:
        try:
            import cuda.core as core

            core.LaunchConfig  # noqa: B018  (cuda.core >= 0.4 exports these at top level)
        except (ImportError, AttributeError):
            import cuda.core.experimental as core
        _core = core
    return _core


def _stream(handle: int) -> Any:
    s = _streams.get(handle)
    if s is None:
        core = _core_api()
        s = core.Stream.from_handle(handle)
        with _lock:
            _streams[handle] = s
    return s




class _DeviceLimits:
    __slots__ = ("max_threads", "max_block", "max_grid", "max_smem_optin", "max_smem_default", "sms", "cooperative",
                 "threads_per_sm", "smem_per_sm", "smem_reserved")

    def __init__(self, device: int) -> None:
        from cuda.bindings import driver as drv

        A = drv.CUdevice_attribute

        def attr(a: Any) -> int:
            err, value = drv.cuDeviceGetAttribute(a, device)
            if int(err) != 0:
                raise DeviceError(f"cuDeviceGetAttribute({a}) failed on device {device}: {err}")
            return int(value)

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


def _cooperative_config(core: Any, grid: tuple, block: tuple, smem: int, label: str) -> Any:
    """A cuda.core ``LaunchConfig`` with the cooperative attribute (``is_cooperative``; cuda.core
    0.3 named it ``cooperative_launch``)."""
    for flag in ("is_cooperative", "cooperative_launch"):
        try:
            return core.LaunchConfig(grid=grid, block=block, shmem_size=smem, **{flag: True})
        except TypeError:
            continue
    raise KernelLaunchError(f"{label}: this cuda.core ({getattr(core, '__version__', '?')}) cannot launch cooperative "
                            f"kernels (its LaunchConfig takes neither is_cooperative nor cooperative_launch)")


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

    ``label`` names the kernel in error messages. ``convert_args``: adapt Python ints and
    floats to the kernel's parameter sizes (4-byte int/float parameters get 32-bit values);
    the package's own kernels pass exactly typed values and turn it off.
    """

    def __init__(self, compiled: CompiledCuda, name_expression: str, label: str, convert_args: bool = True) -> None:
        self.compiled = compiled
        self.name_expression = name_expression
        self.label = label
        self.convert_args = convert_args
        self._kernel: Any = None
        self._param_sizes: tuple[int, ...] | None = None
        self._devices: dict[int, _DeviceLimits] = {}
        self._configs: dict[tuple, Any] = {}
        self._smem_set: dict[int, int] = {}
        self._coresident: dict[tuple, int] = {}
        self._lock = threading.Lock()

    # ---- loading (once) ----------------------------------------------------------------
    @property
    def kernel(self) -> Any:
        """The cuda.core Kernel (loads the cubin on first use)."""
        k = self._kernel
        if k is None:
            k = self._load()
        return k

    def _load(self) -> Any:
        with self._lock:
            if self._kernel is not None:
                return self._kernel
            if not torch.cuda.is_available():
                raise DeviceError(f"{self.label}: loading a cubin needs a CUDA GPU")
            torch.cuda.init()  # the driver and torch's primary context must exist
            core = _core_api()
            try:
                # NVRTC hands the lowered names over as bytes; keep that form for get_kernel.
                symbols = {k: v.encode() for k, v in self.compiled.symbols.items()}
                obj = core.ObjectCode.from_cubin(self.compiled.cubin, symbol_mapping=symbols)
                kernel = obj.get_kernel(self.name_expression)
            except Exception as exc:
                raise KernelLaunchError(
                    f"{self.label}: could not load kernel {self.name_expression!r} from its {self.compiled.arch} "
                    f"cubin: {exc}") from exc
            # Parameter sizes, to adapt Python ints/floats (only when converting: the query
            # probes past the last parameter, which compute-sanitizer reports as an API error).
            info = getattr(kernel, "arguments_info", None) if self.convert_args else None
            if info is not None:
                try:
                    self._param_sizes = tuple(int(size) for _, size in info)
                except Exception:
                    self._param_sizes = None
            self._obj = obj  # keep the library alive as long as the kernel
            self._kernel = kernel
            return kernel

    def _limits(self, device: int) -> _DeviceLimits:
        lim = self._devices.get(device)
        if lim is None:
            lim = self._devices[device] = _DeviceLimits(device)
        return lim

    def _static_smem(self, device: int) -> int:
        """The kernel's static shared memory on ``device`` (0 when cuda.core cannot say)."""
        attrs = self.kernel.attributes
        try:
            return int(attrs.shared_size_bytes(device))  # cuda.core >= 0.4: methods taking the device
        except Exception:
            pass
        try:
            return int(attrs[device].shared_size_bytes)
        except Exception:
            return 0

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
            with torch.cuda.device(device):  # (the query asks the current context's device)
                per_sm = int(self.kernel.occupancy.max_active_blocks_per_multiprocessor(threads, smem))
        except Exception as exc:  # noqa: BLE001 - estimated from the device's limits instead
            # Threads and shared memory per SM (registers are the launch bounds'); were it too
            # many, the driver refuses the cooperative launch, which never hangs either.
            per_sm = max(0, min(lim.threads_per_sm // max(threads, 1),
                                lim.smem_per_sm // max(smem + static_smem + lim.smem_reserved, 1)))
            _log.debug("%s: occupancy query failed (%s); %d CTA(s) per SM from the device's limits", self.label,
                       exc, per_sm)
        found = self._coresident[key] = per_sm * lim.sms
        return found

    def _config(self, key: tuple, device: int) -> Any:
        grid, block, smem = key[:3]
        cooperative = len(key) > 3 and key[3]
        label = self.label
        g = _dims(grid, "grid", label)
        b = _dims(block, "block", label)
        smem = int(smem or 0)
        lim = self._limits(device)
        kernel = self.kernel
        try:
            kmax = int(kernel.attributes[device].max_threads_per_block)
            static_smem = int(kernel.attributes[device].shared_size_bytes)
        except Exception:
            kmax, static_smem = lim.max_threads, 0
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
        core = _core_api()
        if cooperative:
            self._check_cooperative(device, g, threads, smem)
            cfg = _cooperative_config(core, g, b, smem, label)
        else:
            cfg = core.LaunchConfig(grid=g, block=b, shmem_size=smem)
        self._configs[(key, device)] = cfg
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
        from cuda.bindings import driver as drv

        handle = self.kernel.handle
        attr = drv.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        if type(handle).__name__ == "CUkernel":
            err, = drv.cuKernelSetAttribute(attr, smem, handle, device)
        else:
            err, = drv.cuFuncSetAttribute(handle, attr, smem)
        if int(err) != 0:
            raise KernelLaunchError(f"{self.label}: could not allow {smem} bytes of dynamic shared memory: {err}")
        self._smem_set[device] = smem

    @staticmethod
    def _bind_context(device: int) -> bool:
        """Make ``device``'s primary context current on this thread; whether that succeeded."""
        try:
            _core_api().Device(device).set_current()
        except Exception:  # noqa: BLE001 - the caller reports the launch's own error
            return False
        return True

    def _convert(self, params: Sequence[Any]) -> tuple:
        sizes = self._param_sizes
        if sizes is not None and len(sizes) != len(params):
            raise KernelLaunchError(
                f"{self.label}: the kernel takes {len(sizes)} parameter(s) but {len(params)} were given")
        out = []
        for i, p in enumerate(params):
            if isinstance(p, torch.Tensor):
                p = p.data_ptr()
            elif isinstance(p, bool):
                p = int(p)
            if sizes is not None:
                if type(p) is int and sizes[i] == 4:
                    import numpy as np

                    p = np.int32(p) if -2**31 <= p < 2**31 else np.uint32(p)
                elif type(p) is float and sizes[i] == 4:
                    import numpy as np

                    p = np.float32(p)
            out.append(p)
        return tuple(out)

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
        if self.convert_args:
            params = self._convert(params)
        s = _streams.get(stream)
        if s is None:
            s = _stream(stream)
        try:
            _core.launch(s, cfg, self._kernel, *params)
        except Exception as exc:
            if "CUDA_ERROR_INVALID_CONTEXT" in str(exc) and self._bind_context(device):
                # A thread torch never bound a context to (autograd's device threads skip
                # cudaSetDevice when the device already reads as current): bind the primary one.
                _core.launch(s, cfg, self._kernel, *params)
                return
            raise KernelLaunchError(
                f"{self.label}: {'cooperative ' if cooperative else ''}launch of {self.name_expression} with "
                f"grid={grid}, block={block}, shared memory={smem} B on stream {stream:#x} (device {device}) "
                f"failed: {exc}") from exc
