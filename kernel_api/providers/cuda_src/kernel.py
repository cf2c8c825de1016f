"""`CudaSourceKernel`: the base class of kernels written as CUDA C++ source.

Bring your own kernel in a few lines: give the source, the kernel's name (or a name
expression with ``{field}`` placeholders filled from each variant), the operands it accepts,
and how to launch it::

    @CudaSourceProvider.register
    class ScaleKernel(CudaSourceKernel):
        source = r'''
        template <typename T>
        __global__ void scale(const T* x, T* y, long long n) { ... }
        '''
        kernel_name = "scale<{T}>"
        variants = [{"T": "float"}]
        supported_args_type = SoftmaxArguments
        operands = SoftmaxOperandsMetadata(TensorAttributes("f32", (0, 1)), TensorAttributes("f32", (0, 1)))

        def launch_config(self, args):
            n = args.x.numel()
            return (n + 255) // 256, 256            # grid, block[, dynamic shared memory bytes]

        def kernel_arguments(self, args):
            return args.x, args.out, args.x.numel()   # tensors become device pointers

Everything else has a default: ``generate_kernels`` makes one instance per entry of
``variants`` (named after the class and the variant), ``compile`` runs NVRTC (cubin cached on
disk) for the instance's name expression, ``_run`` launches on the caller's stream,
``_supports`` accepts what the metadata accepts, ``get_workspace_size`` is 0. Python ints and
floats are passed with the width of the kernel's parameter (``int`` → 32-bit, ``long long`` →
64-bit), tensors as their data pointer.
"""

from __future__ import annotations

import abc
import os
import re
import string
import sys
from typing import Any, Callable, ClassVar, Mapping, Sequence

import torch

from ...core.artifact import CompiledArtifact
from ...core.errors import CompilationError
from ...kernel import Kernel, target_cc
from ...metadata import KernelMetadata, OperandsMetadata
from ...core.status import Status
from ...nvrtc import compile_cuda
from ...core.streams import stream_handle
from ...nvrtc import CudaLauncher

_NAME_CHARS = re.compile(r"[^A-Za-z0-9]+")


class CudaSourceKernel(Kernel):
    """Base class of CUDA C++ kernels (register subclasses with ``@CudaSourceProvider.register``).

    Class attributes a subclass sets:

    - ``source`` (the CUDA C++ text) or ``source_file`` (a path, relative to the subclass's
      module file unless absolute);
    - ``kernel_name``: the ``__global__`` function, or a name expression such as
      ``"softmax<float, {N}>"`` whose ``{fields}`` each variant fills;
    - ``operands``: an `OperandsMetadata` (or override ``operands_for(params)``);
    - optionally ``variants`` (dicts, one per instance), ``design``, ``min_cc``/``max_cc``,
      ``defines``, ``include_dirs``, ``compile_options`` (extra cuda.core ProgramOptions).

    and the one method that is always kernel-specific, ``launch_config(args)``, returning
    ``(grid, block)`` or ``(grid, block, dynamic_shared_memory_bytes)``. Override
    ``kernel_arguments(args)`` when the kernel takes more than the operands' pointers, and
    ``companion_name_expressions(args)`` with ``launch_plan`` and ``_run`` when one call launches
    several kernels of the source (norm.py does).
    """

    source: ClassVar[str | None] = None
    source_file: ClassVar[str | None] = None
    kernel_name: ClassVar[str | None] = None
    operands: ClassVar[OperandsMetadata | None] = None
    design: ClassVar[Any] = None
    min_cc: ClassVar[int] = 0
    max_cc: ClassVar[int | None] = None
    variants: ClassVar[Sequence[Mapping[str, Any]]] = ({},)
    defines: ClassVar[Mapping[str, Any]] = {}
    include_dirs: ClassVar[Sequence[str]] = ()
    compile_options: ClassVar[Mapping[str, Any]] = {}
    #: adapt Python ints/floats to the kernel's parameter widths at launch
    convert_arguments: ClassVar[bool] = True

    _source_texts: ClassVar[dict[type, str]] = {}

    def __init__(self, metadata: KernelMetadata, params: Mapping[str, Any] | None = None) -> None:
        super().__init__(metadata)
        self.params = dict(params or {})

    # ---- what a user provides --------------------------------------------------------------
    @abc.abstractmethod
    def launch_config(self, args: Any) -> tuple:
        """``(grid, block)`` or ``(grid, block, dynamic_shared_memory_bytes)`` for ``args``."""

    def kernel_arguments(self, args: Any) -> Sequence[Any]:
        """The kernel's parameters, in order; default: the operands' tensors (as pointers)."""
        return tuple(getattr(args, name) for name in args.tensor_attributes)

    # ---- defaults that make the rest optional ---------------------------------------------
    @classmethod
    def get_source(cls) -> str:
        """The CUDA source text (read once from ``source_file`` when that is given)."""
        text = cls._source_texts.get(cls)
        if text is not None:
            return text
        if cls.source is not None:
            text = cls.source
        elif cls.source_file is not None:
            path = cls.source_file
            if not os.path.isabs(path):
                module = sys.modules.get(cls.__module__)
                base = os.path.dirname(getattr(module, "__file__", "") or ".")
                path = os.path.join(base, path)
            try:
                with open(path, encoding="utf-8") as f:
                    text = f.read()
            except OSError as exc:
                raise CompilationError(f"{cls.__name__}: cannot read source_file {path}: {exc}") from None
        else:
            raise CompilationError(f"{cls.__name__}: set `source` (CUDA C++ text) or `source_file`")
        cls._source_texts[cls] = text
        return text

    @classmethod
    def source_name(cls) -> str:
        """The file name NVRTC reports errors against."""
        if cls.source_file:
            return os.path.basename(cls.source_file)
        return f"{cls.__name__}.cu"

    @classmethod
    def operands_for(cls, params: Mapping[str, Any]) -> OperandsMetadata:
        """Operand description of the variant ``params`` (default: ``operands``)."""
        if cls.operands is None:
            raise TypeError(f"{cls.__name__}: set `operands` (e.g. GemmOperandsMetadata(...)) or override operands_for")
        return cls.operands

    @classmethod
    def instance_name(cls, params: Mapping[str, Any]) -> str:
        """Kernel name of a variant: the class name plus the variant's values."""
        parts = [cls.__name__] + [f"{k}{_NAME_CHARS.sub('', str(v))}" for k, v in params.items()]
        return "_".join(parts)

    @classmethod
    def make_metadata(cls, params: Mapping[str, Any]) -> KernelMetadata:
        design = cls.design(params) if callable(cls.design) and not isinstance(cls.design, type) else cls.design
        return KernelMetadata(cls.instance_name(params), cls, cls.operands_for(params), design=design,
                              min_cc=cls.min_cc, max_cc=cls.max_cc)

    @classmethod
    def variant_params(cls) -> Sequence[Mapping[str, Any]]:
        """The parameters of every instance (default: ``variants``); override to compute them."""
        return cls.variants

    @classmethod
    def check_definition(cls) -> None:
        """Raise TypeError if the class lacks what generation needs: ``kernel_name``, and in every
        variant each ``{field}`` that ``kernel_name`` names.

        Registration calls it (so an incomplete class is refused there) and so does
        ``generate_kernels`` (classes changed after registration).
        """
        name = cls.kernel_name
        if name is None:
            raise TypeError(f"{cls.__name__}: set `kernel_name` (the __global__ function or a name expression)")
        if not isinstance(name, str) or not name:
            raise TypeError(f"{cls.__name__}.kernel_name must be a non-empty string, got {name!r}")
        if "{" not in name:
            return  # name_expression uses it as it is
        fields = _template_fields(cls.__name__, name)
        for i, params in enumerate(cls.variant_params()):
            if not isinstance(params, Mapping):
                raise TypeError(f"{cls.__name__}: variant {i} must be a dict of kernel_name fields, got {params!r}")
            missing = [f for f in fields if f not in params]
            if missing:
                raise TypeError(f"{cls.__name__}.kernel_name {name!r} names field {missing[0]!r}, which variant {i} "
                                f"{dict(params)!r} lacks (each variant fills the {{fields}} of kernel_name)")

    @classmethod
    def generate_kernels(cls, metadata_filter: Callable[[KernelMetadata], bool], epilogue_args: Any = None,
                         cc: int | None = None) -> list["CudaSourceKernel"]:
        """One instance per entry of ``variants`` that passes the filter and the cc range."""
        if epilogue_args is not None:
            return []
        cls.check_definition()
        found = []
        for params in cls.variant_params():
            metadata = cls.make_metadata(params)
            if not metadata.supports_cc(cc):
                continue
            if metadata_filter is not None and not metadata_filter(metadata):
                continue
            found.append(cls(metadata, params))
        return found

    def _supports(self, args: Any) -> Status:
        return Status.success()

    def get_workspace_size(self, args: Any) -> int:
        return 0

    def name_expression(self, args: Any) -> str:
        """The kernel to compile for ``args``: ``kernel_name`` with the variant's fields filled."""
        name = self.kernel_name
        return name.format(**self.params) if "{" in name else name

    def defines_for(self, args: Any) -> Mapping[str, Any]:
        return self.defines

    def compile_key(self, args: Any, cc: int | None) -> tuple:
        return (self.name_expression(args), tuple(sorted(self.defines_for(args).items())), cc)

    compiles_from_cache_only = True  # (compile_cuda honours cache_only)

    def companion_name_expressions(self, args: Any) -> Sequence[str]:
        """More kernels compiled into the same module as ``name_expression(args)`` (default
        none), for an instance whose ``_run`` launches several: ``launch_plan`` makes their
        launchers from ``launcher.compiled``. They follow from the same parameters, so the
        compile key need not name them."""
        return ()

    def compile(self, args: Any, cc: int | None = None) -> CompiledArtifact:
        """NVRTC-compile this instance for ``cc`` (default: the current GPU); no GPU needed with a cc."""
        target = target_cc(cc)
        expr = self.name_expression(args)
        compiled = compile_cuda(self.get_source(), cc=target,
                                name_expressions=[expr, *self.companion_name_expressions(args)],
                                include_dirs=self.include_dirs, defines=self.defines_for(args),
                                source_name=self.source_name(), options=self.compile_options)
        launcher = CudaLauncher(compiled, expr, self.metadata.kernel_name, convert_args=self.convert_arguments)
        return CompiledArtifact(launcher, self, target, extra=self.launch_plan(args, launcher))

    def launch_plan(self, args: Any, launcher: CudaLauncher) -> Any:
        """What ``_run`` may precompute at compile time (stored in ``artifact.extra``)."""
        return None

    def _run(self, args: Any, artifact: CompiledArtifact, stream: Any, workspace: Any = None) -> None:
        config = self.launch_config(args)
        if not isinstance(config, tuple) or len(config) not in (2, 3):
            raise TypeError(f"{self.metadata.kernel_name}.launch_config must return (grid, block) or "
                            f"(grid, block, shared_memory_bytes), got {config!r}")
        grid, block = config[0], config[1]
        smem = config[2] if len(config) == 3 else 0
        device = args.device.index
        if device is None:
            device = torch.cuda.current_device()
        artifact.compiled_obj.launch(stream_handle(stream, device), device, _hashable(grid), _hashable(block),
                                     smem, self.kernel_arguments(args))


def _template_fields(class_name: str, name: str) -> list[str]:
    """The ``{fields}`` that ``name.format(**params)`` reads, or TypeError for a malformed template."""
    try:
        parsed = list(string.Formatter().parse(name))
    except ValueError as exc:
        raise TypeError(f"{class_name}.kernel_name {name!r} is not a valid name template: {exc}") from None
    fields = []
    for _, field, _, _ in parsed:
        if field is None:
            continue
        root = re.match(r"[^.\[]*", field).group()
        if not root or root.isdigit():
            raise TypeError(f"{class_name}.kernel_name {name!r}: fields must be named, e.g. {{T}}, not {{{field}}}")
        if root not in fields:
            fields.append(root)
    return fields


def _hashable(dims: Any) -> Any:
    return dims if isinstance(dims, (int, tuple)) else tuple(dims)
