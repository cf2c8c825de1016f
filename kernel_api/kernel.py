"""The `Kernel` base class: the contract between a kernel author and kernel_api.

A subclass describes one family of kernels; each instance is one configuration, described by
its `KernelMetadata`. Register the class with its provider (``@CuTeDSLProvider.register``,
``@CudaSourceProvider.register``, or your own `Provider`) and discovery finds it. A subclass
names the `Arguments` class it accepts: ``supported_args_type = GemmArguments``, or the
annotation of ``_supports(self, args: GemmArguments)``.

Required hooks (abstract; `REQUIRED_HOOKS`):

- ``compile(self, args, cc=None) -> CompiledArtifact``: compile for ``args``' compile-time
  signature and target ``cc`` (no GPU needed when ``cc`` is given). kernel_api wraps it: the
  arguments' type and the target are checked first (TypeError for another operation's
  arguments, `CompilationError` for a cc outside the metadata's), provider helpers see the
  target (`compile_target_cc`), a result other than a `CompiledArtifact` raises TypeError, and
  the artifact's ``cc`` is filled in;
- ``_run(self, args, artifact, stream, workspace=None)``: launch ``artifact`` for ``args`` on
  ``stream`` (any spelling `kernel_api.core.streams` accepts; ``to_cuda_stream`` converts);
- ``generate_kernels(metadata_filter, epilogue_args=None, cc=None)`` (a static or class
  method): every instance whose metadata passes ``metadata_filter``, none for an epilogue it
  cannot fuse or a ``cc`` it cannot run on. A subclass ``__init__`` calls ``Kernel.__init__``;
- ``_supports(self, args) -> Status``: the checks metadata cannot express (shapes, limits...);
- ``get_workspace_size(self, args) -> int``: bytes of device workspace ``_run`` needs.

Optional hooks (at most these three; `OPTIONAL_HOOKS`), one per concern:

- ``_launcher(self, args, artifact) -> Launcher | None`` (the fast path): a `Launcher` says
  that every launch for operands with ``args``' raw metadata is ``function(*tensors, *tail,
  stream)``; ``run``'s repeated calls, `kernel_api.ops`' dispatch and its native replay
  follow from it. None (the default): every launch goes through ``_run``;
- ``compile_key(self, args, cc) -> tuple`` (artifact reuse): what an artifact depends on
  (default: the arguments' signature and cc), for kernels that specialise on more (shapes...);
- ``estimated_cost(self, args, sm_count) -> float | None`` (ranking): the family's own
  run-time estimate for `PickAny`, in `kernel_api.cost`'s units, where the generic model
  cannot describe it (split-K, memory-bound, vendor kernels). None (the default): the
  generic model, which ranks by ``performance_hint``.

``run`` and ``supports`` are final (defining them is a TypeError): they check, compile, cache
and allocate, then call ``_supports`` and ``_run``.

Class attributes with defaults on `Kernel` (no hooks: the provider bases set those that apply,
and a family changes one only to tune):

- ``workspace_free = False``: True (class or instance) when ``get_workspace_size`` is always
  0, so ``run`` skips asking;
- ``performance_hint = 0.5``: the family's relative peak speed, which the generic cost model
  ranks by (tensor-core families about 1.0, SIMT about 0.05);
- ``compiles_from_cache_only = False``: True, in the class that defines ``compile``, when that
  compile honours `cache_only` (loads a cached artifact or raises `ArtifactNotCachedError`
  without compiling), so tuning loads cached candidates in its own process and starts compile
  workers for the others only. The shipped families whose compiles go through the helpers that
  honour it (``cute_compile``, NVRTC's ``compile_cuda``) set it, as `CudaSourceKernel` does.

Methods may be assigned after the class is created, as notebooks do: a ``compile`` assigned
later is wrapped when the class is next instantiated or discovered (`prepare_class`), and a
``run`` or ``supports`` assigned later is refused then.
"""

from __future__ import annotations

import abc
import contextvars
import functools
import logging
import time
from typing import Any, Callable

import torch

from .core.arch import arch_string, device_cc, normalize_cc
from .arguments import Arguments
from .core.artifact import CompiledArtifact
from .core.errors import ArtifactNotCachedError, CompilationError, DeviceError, UnsupportedArgumentsError
from .core import streams as _streams
from .core.streams import stream_handle, to_cuda_stream
from .launcher import Binding, Launcher
from .metadata import KernelMetadata
from .core.status import Status

# The target architecture of the compile in progress, so that provider helpers such as
# CuteDslKernel.cute_compile honour ``kernel.compile(args, cc=90)`` even when a kernel's own
# compile method does not pass cc along.
compile_target_cc: contextvars.ContextVar[int | None] = contextvars.ContextVar("compile_target_cc", default=None)

#: While True, compiles of classes with ``compiles_from_cache_only`` load a cached artifact or
#: raise `ArtifactNotCachedError` instead of compiling: tuning asks which candidates still need
#: worker processes without compiling anything in this one (`compile_from_cache_only`).
cache_only: contextvars.ContextVar[bool] = contextvars.ContextVar("kernel_api_cache_only", default=False)

# Whether a compile is in progress: a subclass's compile calling its base's is one compile, logged once.
_compiling: contextvars.ContextVar[bool] = contextvars.ContextVar("kernel_api_compiling", default=False)
_log = logging.getLogger(__name__)

#: The hooks every subclass implements (the abstract methods of `Kernel`).
REQUIRED_HOOKS = ("compile", "_run", "generate_kernels", "_supports", "get_workspace_size")
#: The hooks a subclass may override: the fast path, artifact reuse, ranking.
OPTIONAL_HOOKS = ("_launcher", "compile_key", "estimated_cost")

_FINAL_METHODS = ("run", "supports")
_SUCCESS = Status.success()
_UNCHECKED = object()
_UNBINDABLE = Binding(_UNCHECKED, None, None, None)  # arguments that cannot carry a bound launch
# A device's cc never changes and torch.cuda.get_device_capability costs microseconds.
_cc_by_device: dict[int, int] = {}


def _wrap_compile(fn: Callable) -> Callable:
    if getattr(fn, "_kernel_api_wrapped", False):
        return fn

    @functools.wraps(fn)
    def compile(self: "Kernel", args: Any, cc: Any = None, *rest: Any, **kwargs: Any) -> Any:
        expected = type(self).supported_args_type
        if expected is not None and not isinstance(args, expected):
            raise TypeError(f"{_kernel_name(self)}.compile: expected {expected.__name__}, got {type(args).__name__} "
                            f"(arguments of another operation)")
        target = normalize_cc(cc)
        if target is not None:
            check_target_cc(self, target)
        token = compile_target_cc.set(target)
        outer = _compiling.set(True) if not _compiling.get() else None
        start = time.perf_counter()
        try:
            if target is None:
                artifact = fn(self, args, *rest, **kwargs)
            else:
                artifact = fn(self, args, target, *rest, **kwargs)
        except BaseException as exc:
            if outer is not None:
                _log.debug("compile of %s for %s failed after %.3f s: %s", _kernel_name(self), _target(target),
                           time.perf_counter() - start, type(exc).__name__)
            raise
        finally:
            compile_target_cc.reset(token)
            if outer is not None:
                _compiling.reset(outer)
        if not isinstance(artifact, CompiledArtifact):
            raise TypeError(f"{type(self).__qualname__}.compile returned {type(artifact).__name__} for "
                            f"{_kernel_name(self)}, not a CompiledArtifact (return CompiledArtifact(compiled, self))")
        if artifact.cc is None:
            artifact.cc = target if target is not None else compile_target_cc.get()
        if outer is not None:
            _log.info("compiled %s for %s in %.3f s", _kernel_name(self),
                      _target(getattr(artifact, "cc", None) or target), time.perf_counter() - start)
        return artifact

    compile._kernel_api_wrapped = True  # type: ignore[attr-defined]
    return compile


def _kernel_name(kernel: "Kernel") -> str:
    metadata = kernel.__dict__.get("_metadata")
    return metadata.kernel_name if metadata is not None else type(kernel).__qualname__


def _target(cc: Any) -> str:
    """How a compile's log record names its target: "cc 90 (sm_90a)", or the current GPU's."""
    return "the current GPU" if cc is None else f"cc {cc} ({arch_string(cc)})"


def compile_from_cache_only(kernel: "Kernel", args: Any, cc: int) -> Any:
    """``kernel.compile(args, cc)`` if that is a disk-cache hit, else None, compiling nothing:
    None too for kernels whose ``compile`` is not declared to honour `cache_only`
    (``compiles_from_cache_only`` in the class that defines it) and for a compile that fails
    (the worker that compiles it reports why)."""
    if not _declares_cache_only(type(kernel)):
        return None
    token = cache_only.set(True)
    try:
        return kernel.compile(args, cc)
    except Exception as exc:  # ArtifactNotCachedError, or an error a worker will report
        if not isinstance(exc, ArtifactNotCachedError):
            _log.debug("cache probe of %s: %s: %s", _kernel_name(kernel), type(exc).__name__, exc)
        return None
    finally:
        cache_only.reset(token)


def _declares_cache_only(cls: type) -> bool:
    """Whether the class whose ``compile`` ``cls`` uses declares ``compiles_from_cache_only``."""
    for klass in cls.__mro__:
        if "compile" in klass.__dict__:
            return klass.__dict__.get("compiles_from_cache_only", False) is True
    return False


def target_cc(cc: int | None = None) -> int:
    """The architecture a compile targets: ``cc`` when given, else the target of the compile in
    progress (`compile_target_cc`), else the current GPU's.

    Args:
        cc: an explicit target (e.g. 90), or None.

    Returns:
        The compute capability as an int.

    Raises:
        DeviceError: no target given and no CUDA GPU to infer it from.
    """
    if cc is not None:
        return cc
    cc = compile_target_cc.get()
    if cc is not None:
        return cc
    if torch.cuda.is_available():
        return device_cc(None)
    raise DeviceError("no CUDA GPU to infer the target architecture from; compile with an explicit cc, "
                      "e.g. kernel.compile(args, cc=90)")


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


def _wrap_own_compile(cls: type) -> None:
    """Wrap the ``compile`` defined in ``cls``' own namespace (abstract ones stay as they are)."""
    fn = cls.__dict__.get("compile")
    if callable(fn) and not getattr(fn, "__isabstractmethod__", False) and not getattr(fn, "_kernel_api_wrapped", False):
        type.__setattr__(cls, "compile", _wrap_compile(fn))


def _refuse_final(cls: type) -> None:
    for method in _FINAL_METHODS:
        if method in cls.__dict__:
            raise TypeError(f"{cls.__name__}.{method} is final: implement _{method} instead")


def prepare_class(cls: type) -> None:
    """Apply `Kernel.__init_subclass__`'s rules to methods assigned after ``cls`` was created.

    Notebooks fill classes in that way, and re-run such cells. Each unwrapped ``compile`` in
    the class chain is wrapped; a ``run`` or ``supports`` of its own raises TypeError. Cheap
    when nothing changed: `Kernel.__init__` inlines that check, discovery calls this before
    using a class.

    Args:
        cls: a `Kernel` subclass.
    """
    if cls._kernel_api_prepared is cls.compile and cls.run is _KERNEL_RUN and cls.supports is _KERNEL_SUPPORTS:
        return  # (the mark is inherited along with an unchanged compile)
    for klass in cls.__mro__:
        if klass is Kernel:
            break
        if issubclass(klass, Kernel):
            _refuse_final(klass)
            _wrap_own_compile(klass)
    type.__setattr__(cls, "_kernel_api_prepared", cls.compile)


def _allocate_workspace(size: int, device: torch.device, stream: Any) -> torch.Tensor:
    """``size`` bytes from torch's caching allocator on ``device``, owned by the launch stream
    (so the block is not handed to another stream while the kernel may still use it)."""
    if stream is None or device.type != "cuda":
        return torch.empty(size, dtype=torch.uint8, device=device)
    if not isinstance(stream, torch.cuda.Stream):
        stream = torch.cuda.ExternalStream(stream_handle(stream), device=device)
    with torch.cuda.stream(stream):
        return torch.empty(size, dtype=torch.uint8, device=device)


class Kernel(abc.ABC):
    """One configuration of a kernel family, discoverable through `kernel_api.get_kernels`.

    The module docstring is the contract: the five required hooks (`REQUIRED_HOOKS`), the
    three optional ones (`OPTIONAL_HOOKS`) and the class attributes with defaults. ``run`` and
    ``supports`` are final.
    """

    #: The `Arguments` class the family accepts (or ``_supports``' annotation says it).
    supported_args_type: type | None = None
    #: True (class or instance) when ``get_workspace_size`` is always 0, so ``run`` skips asking.
    workspace_free: bool = False
    #: Relative peak speed of the family, for `PickAny`'s analytic ranking (e.g. 1.0 for wgmma
    #: tensor-core kernels, 0.05 for CUDA-core FMA); families that do not say get 0.5.
    performance_hint: float = 0.5
    #: True, set by the class that defines ``compile``, when that ``compile`` honours
    #: `cache_only` (loads a cached artifact or raises `ArtifactNotCachedError`): the provider
    #: bases' do. A subclass that overrides ``compile`` without saying so again is never probed
    #: in the tuning process: its candidates are compiled in worker processes.
    compiles_from_cache_only: bool = False
    _kernel_api_provider: Any = None
    _kernel_api_prepared: Any = None  # the compile the class was last prepared with (see __init__)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        # Instead of a metaclass: final methods refused and compile wrapped at class creation;
        # methods assigned later are handled by prepare_class when the class is next
        # instantiated or discovered.
        super().__init_subclass__(**kwargs)
        _refuse_final(cls)
        _wrap_own_compile(cls)
        # Not the abstract compile itself: abc would list the mark as a missing method too.
        compile_fn = cls.compile
        type.__setattr__(cls, "_kernel_api_prepared",
                         None if getattr(compile_fn, "__isabstractmethod__", False) else compile_fn)

    def __init__(self, metadata: KernelMetadata) -> None:
        if not isinstance(metadata, KernelMetadata):
            raise TypeError(f"{type(self).__name__}: metadata must be a KernelMetadata, got {type(metadata).__name__}")
        # prepare_class's check, inline: a compile other than the one prepared, or a run or
        # supports of its own, was assigned after the class was created.
        cls = type(self)
        if cls._kernel_api_prepared is not cls.compile or cls.run is not _KERNEL_RUN or cls.supports is not _KERNEL_SUPPORTS:
            prepare_class(cls)
        self._metadata = metadata

    @property
    def metadata(self) -> KernelMetadata:
        return self._metadata

    @property
    def name(self) -> str:
        return self._metadata.kernel_name

    # ---- required hooks (REQUIRED_HOOKS) ---------------------------------------------------
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

    # ---- optional hooks (OPTIONAL_HOOKS) ---------------------------------------------------
    def compile_key(self, args: Any, cc: int | None) -> tuple:
        """Optional: what a compiled artifact depends on; artifacts are reused across equal keys.

        The default assumes shapes are runtime values and everything in ``args.signature``
        is compile-time. Kernels that specialise on shapes extend it.
        """
        return (args.signature, cc)

    def estimated_cost(self, args: Any, sm_count: int) -> float | None:
        """Optional: predicted run time on ``args`` in `kernel_api.cost`'s units (which
        `PickAny` ranks by; `cost.GEMM_COST_UNITS_PER_SECOND` per second for GEMMs), or None
        (the default) to use the generic model. For a row-wise problem `PickAny` adds the
        design's fixed time (`cost.fixed_row_cost`) to either.

        GEMMs: the generic tile model and the aligned families' own estimates leave out the few
        microseconds every launch costs (alike for all of them, it does not change their order).
        The families that take operands TMA cannot read in place compete where fixed times
        decide, so theirs are whole run times, launches and staging copies included: cuBLAS's
        alignment-1 path, `SimtGemm`, `Sm90RealignedGemm` (docs/performance.md, "Choosing").
        A new family of that kind should estimate the same way."""
        return None

    def _launcher(self, args: Any, artifact: CompiledArtifact) -> Launcher | None:
        """Optional: how to launch ``artifact`` again for operands like ``args``' without ``_run``.

        Return a `Launcher` when every launch of ``artifact`` (already run with ``args``) for
        operands whose raw metadata (dtypes, shapes, strides, pointer alignment, device) equal
        ``args``' is ``function(*tensors, *tail, stream)``, the tensors in
        ``args.tensor_attributes`` order: ``Launcher(artifact, tail)`` when the compiled object
        takes the tensors, then constants, then the stream. ``run`` then binds it to the
        arguments (running them again is one call), and `kernel_api.ops` launches later calls
        with equal operand metadata through it, replayed from C when the function is a TVM-FFI
        function. None (the default) when a launch needs per-call work beyond the tensors that
        the launcher cannot do itself; a launcher may make a workspace per call on the launch
        stream (`kernel_api.launcher.launch_workspace`).
        """
        return None

    # ---- shared, final ---------------------------------------------------------------
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
                binding = args._binding
            except AttributeError:
                binding = _UNBINDABLE
            if binding is not None and binding.artifact is compiled_artifact:
                # The caller vouches for the operands: their snapshot launch. Otherwise the launch
                # that reads the live tensors, once this kernel's support check passed for them.
                launch = (binding.snapshot if assume_supported_args
                          else binding.launch if binding.checked_by is self else None)
                if launch is not None:
                    last = _streams.last_stream  # to_cuda_stream's one-entry cache, read inline
                    launch(last[1] if stream is last[0] else to_cuda_stream(stream))
                    return
        else:
            binding = _UNBINDABLE
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
        if workspace is None and (binding is None or (binding.artifact is compiled_artifact and not assume_supported_args
                                                      and binding.checked_by is not self)):
            self._bind(args, compiled_artifact, None if assume_supported_args else self)

    def _bind(self, args: Any, artifact: CompiledArtifact, checked_by: Kernel | None) -> None:
        # (a method of its own: a comprehension over args inside run would make args a cell
        # variable, which costs every call of run)
        tensors = tuple(getattr(args, name) for name in args.tensor_attributes)
        args._binding = Binding.of(self._launcher(args, artifact), artifact, tensors, checked_by)

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


_KERNEL_RUN, _KERNEL_SUPPORTS = Kernel.run, Kernel.supports
