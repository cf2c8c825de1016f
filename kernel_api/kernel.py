"""The `Kernel` abstract base class every registered kernel derives from.

A subclass describes one family of kernels; each instance is one configuration, described by
its `KernelMetadata`. Subclasses implement ``generate_kernels``, ``_supports``, ``compile``,
``_run`` and ``get_workspace_size``; ``supports`` and ``run`` are final and shared.
"""

from __future__ import annotations

import abc
import contextvars
import functools
from typing import Any, Callable

import torch

from .core.arch import arch_string, device_cc, normalize_cc
from .arguments import Arguments
from .core.artifact import CompiledArtifact
from .core.errors import CompilationError, DeviceError, UnsupportedArgumentsError
from .metadata import KernelMetadata
from .core.status import _SUCCESS, Status
from . import utils as _utils
from .utils import to_cuda_stream

# The target architecture of the compile in progress, so that provider helpers such as
# CuteDslKernel.cute_compile honour ``kernel.compile(args, cc=90)`` even when a kernel's own
# compile method does not pass cc along.
compile_target_cc: contextvars.ContextVar[int | None] = contextvars.ContextVar("compile_target_cc", default=None)

_FINAL_METHODS = ("run", "supports")
_UNCHECKED = object()
_UNBINDABLE = (_UNCHECKED, None, None, None)  # arguments that cannot carry a bound launch
# A device's cc never changes and torch.cuda.get_device_capability costs microseconds.
_cc_by_device: dict[int, int] = {}


def _wrap_compile(fn: Callable) -> Callable:
    if getattr(fn, "_kernel_api_wrapped", False):
        return fn

    @functools.wraps(fn)
    def compile(self: "Kernel", args: Any, cc: Any = None, *rest: Any, **kwargs: Any) -> Any:
        target = normalize_cc(cc)
        if target is not None:
            check_target_cc(self, target)
        token = compile_target_cc.set(target)
        try:
            if target is None:
                artifact = fn(self, args, *rest, **kwargs)
            else:
                artifact = fn(self, args, target, *rest, **kwargs)
        finally:
            compile_target_cc.reset(token)
        if isinstance(artifact, CompiledArtifact) and artifact.cc is None:
            artifact.cc = target if target is not None else compile_target_cc.get()
        return artifact

    compile._kernel_api_wrapped = True  # type: ignore[attr-defined]
    return compile


def check_target_cc(kernel: "Kernel", cc: int) -> None:
    """Raise `CompilationError` when ``kernel``'s metadata excludes compute capability ``cc``.

    Compiling for an architecture a kernel was not written for fails deep in its compiler
    with a message about the compiler's settings; refusing first names the actual problem.
    """
    metadata = kernel.__dict__.get("_metadata")
    if metadata is None or metadata.supports_cc(cc).error is None:
        return
    supported = (f"{metadata.min_cc} only" if metadata.max_cc == metadata.min_cc
                 else f"{metadata.min_cc} and newer" if metadata.max_cc is None
                 else f"{metadata.min_cc} to {metadata.max_cc}")
    raise CompilationError(f"{metadata.kernel_name}: cannot compile for compute capability {cc} "
                           f"({arch_string(cc)}); the kernel supports compute capability {supported}")


class KernelMeta(abc.ABCMeta):
    """Keeps ``run``/``supports`` final and wraps ``compile`` (also when assigned later,
    as notebooks do) so the requested ``cc`` reaches provider helpers."""

    def __new__(mcls, name: str, bases: tuple, namespace: dict, **kwargs: Any) -> "KernelMeta":
        if any(isinstance(b, KernelMeta) for b in bases):
            for method in _FINAL_METHODS:
                if method in namespace:
                    raise TypeError(f"{name}.{method} is final: implement _{method} instead")
        if "compile" in namespace and callable(namespace["compile"]) and not getattr(namespace["compile"], "__isabstractmethod__", False):
            namespace["compile"] = _wrap_compile(namespace["compile"])
        return super().__new__(mcls, name, bases, namespace, **kwargs)

    def __setattr__(cls, name: str, value: Any) -> None:
        if name in _FINAL_METHODS and isinstance(cls, KernelMeta) and cls is not Kernel:
            raise TypeError(f"{cls.__name__}.{name} is final: implement _{name} instead")
        if name == "compile" and callable(value):
            value = _wrap_compile(value)
        super().__setattr__(name, value)


def _allocate_workspace(size: int, device: torch.device, stream: Any) -> torch.Tensor:
    """``size`` bytes from torch's caching allocator on ``device``, owned by the launch stream
    (so the block is not handed to another stream while the kernel may still use it)."""
    if stream is None or device.type != "cuda":
        return torch.empty(size, dtype=torch.uint8, device=device)
    if not isinstance(stream, torch.cuda.Stream):
        from .utils import stream_handle

        stream = torch.cuda.ExternalStream(stream_handle(stream), device=device)
    with torch.cuda.stream(stream):
        return torch.empty(size, dtype=torch.uint8, device=device)


class Kernel(metaclass=KernelMeta):
    """One configuration of a kernel family, discoverable through `kernel_api.get_kernels`.

    ``supported_args_type`` names the arguments class the family accepts (e.g.
    `GemmArguments`); when unset, registration reads it from the annotation of
    ``_supports(self, args: ...)``.
    """

    supported_args_type: type | None = None
    #: Relative peak speed of the family, for `PickAny`'s analytic ranking (e.g. 1.0 for wgmma
    #: tensor-core kernels, 0.05 for CUDA-core FMA); families that do not say get 0.5.
    performance_hint: float = 0.5
    _kernel_api_provider: Any = None

    def __init__(self, metadata: KernelMetadata) -> None:
        if not isinstance(metadata, KernelMetadata):
            raise TypeError(f"{type(self).__name__}: metadata must be a KernelMetadata, got {type(metadata).__name__}")
        self._metadata = metadata

    @property
    def metadata(self) -> KernelMetadata:
        return self._metadata

    @property
    def name(self) -> str:
        return self._metadata.kernel_name

    # ---- what subclasses implement -------------------------------------------------
    @abc.abstractmethod
    def compile(self, args: Any, cc: int | None = None) -> CompiledArtifact:
        """Compile for ``args``' compile-time signature; ``cc`` selects the target (no GPU needed)."""

    @abc.abstractmethod
    def _run(self, args: Any, artifact: CompiledArtifact, stream: Any, workspace: Any = None) -> None:
        """Launch ``artifact`` on ``stream`` with the tensors of ``args``."""

    @staticmethod
    @abc.abstractmethod
    def generate_kernels(metadata_filter: Callable[[KernelMetadata], bool], epilogue_args: Any = None,
                         cc: int | None = None) -> list["Kernel"]:
        """Every instance of the family that passes ``metadata_filter`` and supports the epilogue and cc."""

    @abc.abstractmethod
    def _supports(self, args: Any) -> Status:
        """Kernel-specific checks beyond what metadata expresses (shapes, limits...)."""

    @abc.abstractmethod
    def get_workspace_size(self, args: Any) -> int:
        """Bytes of device workspace ``_run`` needs (0 for none)."""

    def _fast_launcher(self, args: Any, artifact: CompiledArtifact) -> Callable[..., None] | None:
        """Optional: ``launch(*tensors, cu_stream)`` that launches ``artifact`` (already run with
        ``args``) for operands given in ``args.tensor_attributes`` order and a
        ``cuda.bindings.driver.CUstream``, valid for any operands whose dtypes, shapes, strides,
        pointer alignment and device equal ``args``'.

        ``run`` binds it to the arguments' tensors (so running the same arguments again skips
        ``_run``'s per-call work), and `kernel_api.ops` keys its dispatch on that raw tensor
        metadata and calls it without building arguments. Return None (the default) when a
        launch needs per-call work beyond the tensors (a workspace, an epilogue's extra
        operands...).
        """
        return None

    def _native_launch(self, args: Any, artifact: CompiledArtifact) -> tuple[Any, tuple] | None:
        """Optional: ``(function, tail)``, a TVM-FFI function and constants such that
        ``function(*tensors, *tail, stream)`` launches ``artifact`` for any operands whose raw
        metadata equal ``args``' (as for `_fast_launcher`). `kernel_api.ops` records it in the
        C launch table (`kernel_api.native`), so repeated calls are launched without Python
        work. None (the default): calls stay on the Python path."""
        return None

    # ---- shared, final ---------------------------------------------------------------
    def compile_key(self, args: Any, cc: int | None) -> tuple:
        """What a compiled artifact depends on; artifacts are reused across equal keys.

        The default assumes shapes are runtime values and everything in ``args.signature``
        is compile-time. Kernels that specialise on shapes extend it.
        """
        return (args.signature, cc)

    def supports(self, args: Any, cc: Any = None) -> Status:
        """Metadata checks (cached per argument signature), then the kernel's ``_supports``."""
        if not isinstance(args, Arguments):
            raise TypeError(f"{type(self).__name__}.supports: expected an arguments object, got {type(args).__name__}")
        if cc is not None and type(cc) is not int:
            cc = normalize_cc(cc)
        cache = self.__dict__.get("_support_cache")
        if cache is None:
            cache = self.__dict__["_support_cache"] = {}
        key = (args.signature, cc)
        status = cache.get(key)
        if status is None:
            status = cache[key] = self._metadata.supports(args, normalize_cc(cc))
        if status.error is not None:
            return status
        status = self._supports(args)
        if status is None or status is True:
            return _SUCCESS
        if status is False:
            return Status.fail(f"{self._metadata.kernel_name}._supports rejected the arguments")
        return status

    #: Set True (class or instance) when get_workspace_size is always 0, so run skips asking.
    workspace_free: bool = False

    def run(self, args: Any, compiled_artifact: CompiledArtifact | None = None, stream: Any = None,
            workspace: Any = None, assume_supported_args: bool = False) -> None:
        """Launch on ``stream`` (torch stream, CUstream, int handle, or None = current torch stream).

        Checks support first unless ``assume_supported_args``; compiles (and caches the
        artifact on this instance) when no ``compiled_artifact`` is given; allocates the
        workspace from torch's caching allocator when the kernel needs one and none is given.

        Running the same arguments with the same artifact again is one bound call. With
        ``assume_supported_args`` that call may use operands packed when the arguments first
        ran (the caller vouches that no operand's shape, strides or storage changed since, as
        `Arguments` requires; new data written in place is always seen).
        """
        if workspace is None:
            # The hot path: these arguments ran this artifact before, the kernel bound its launch
            # to their tensors, and (unless the caller vouches for them) a support check passed;
            # nothing is left to decide but the stream.
            try:
                bound = args._bound
            except AttributeError:
                bound = _UNBINDABLE
            if bound is not None and bound[0] is compiled_artifact:
                # The caller vouches for the operands: their snapshot launch. Otherwise the launch
                # that reads the live tensors, once this kernel's support check passed for them.
                launch = bound[3] if assume_supported_args else bound[1] if bound[2] is self else None
                if launch is not None:
                    last = _utils._last_stream  # to_cuda_stream's one-entry cache, read inline
                    launch(last[1] if stream is last[0] else to_cuda_stream(stream))
                    return
        else:
            bound = _UNBINDABLE
        if not assume_supported_args:
            # The verdict for these arguments is remembered on them: arguments are immutable
            # summaries, so running the same arguments again skips the checks.
            try:
                verdicts = args._verdicts
            except AttributeError:
                verdicts = None
            if verdicts is None or verdicts.get(self, _UNCHECKED) is not compiled_artifact:
                self._check_runnable(args, compiled_artifact)
                if args._verdicts is None:
                    args._verdicts = {}
                args._verdicts[self] = compiled_artifact
        if compiled_artifact is None:
            compiled_artifact = self._artifact_for(args)
        if workspace is None and not self.workspace_free:
            size = self.get_workspace_size(args)
            if size:
                workspace = _allocate_workspace(size, args.device, stream)
        self._run(args, compiled_artifact, stream, workspace)
        # Bind once per arguments (to the first artifact run with them); the binding names the
        # kernel whose support check passed for it, once a run with checks on has.
        if workspace is None and (bound is None or (bound[0] is compiled_artifact and not assume_supported_args)):
            self._bind(args, compiled_artifact, None if assume_supported_args else self)

    def _bind(self, args: Any, artifact: CompiledArtifact, checked_by: Kernel | None) -> None:
        launch = self._bind_launch(args, artifact)
        snapshot = None if launch is None else self._bind_snapshot_launch(args, artifact, launch)
        args._bound = (artifact, launch, checked_by, snapshot)

    def _bind_launch(self, args: Any, artifact: CompiledArtifact) -> Callable[[Any], None] | None:
        """``launch(cu_stream)`` for ``args``' tensors, which ``run`` keeps on the arguments so
        that running them again costs one call. The default binds `_fast_launcher`; kernels
        may return something cheaper (e.g. a ``functools.partial`` of the compiled function)."""
        launch = self._fast_launcher(args, artifact)
        if launch is None:
            return None
        return functools.partial(launch, *(getattr(args, name) for name in args.tensor_attributes))

    def _bind_snapshot_launch(self, args: Any, artifact: CompiledArtifact,
                              launch: Callable[[Any], None]) -> Callable[[Any], None]:
        """The bound launch that ``run(..., assume_supported_args=True)`` takes: one that may
        hold operands converted once, when the arguments were bound (no per-call conversion).
        The default is ``launch``, which reads the live tensors on every call."""
        return launch

    def _check_runnable(self, args: Any, artifact: CompiledArtifact | None) -> None:
        if not isinstance(args, Arguments):
            raise TypeError(f"{type(self).__name__}.run: expected an arguments object, got {type(args).__name__}")
        args.check_memory()
        index = args.device_index
        cc = _cc_by_device.get(index)
        if cc is None:
            if args.device.type != "cuda":
                name = next(iter(args.tensor_attributes))
                raise DeviceError(
                    f"{self._metadata.kernel_name}: operand {name} is on {args.device}; GPU kernels need CUDA "
                    f"tensors (compile without a GPU with kernel.compile(args, cc=90))")
            if not torch.cuda.is_available():
                raise DeviceError(f"{self._metadata.kernel_name}: no CUDA GPU is available to run on")
            cc = _cc_by_device[index] = normalize_cc(device_cc(index))
        status = self.supports(args, cc)
        if status.error is not None:
            raise UnsupportedArgumentsError(f"{self._metadata.kernel_name} does not support {args!r}: {status.error}")
        if artifact is not None and artifact.kernel is not self:
            owner = getattr(getattr(artifact.kernel, "metadata", None), "kernel_name", None)
            if owner is not None and owner != self._metadata.kernel_name:
                raise ValueError(f"compiled_artifact belongs to {owner}, not {self._metadata.kernel_name}")

    def _artifact_for(self, args: Any) -> CompiledArtifact:
        cc = device_cc(args.device.index) if args.device.type == "cuda" else None
        cache = self.__dict__.get("_artifact_cache")
        if cache is None:
            cache = self.__dict__["_artifact_cache"] = {}
        key = self.compile_key(args, cc)
        artifact = cache.get(key)
        if artifact is None:
            artifact = cache[key] = self.compile(args, cc)
        return artifact

    def __repr__(self) -> str:
        metadata = self.__dict__.get("_metadata")
        return f"<{type(self).__name__} {metadata.kernel_name if metadata else '?'}>"
