"""`TritonKernel`: the base class of kernels written as Triton ``@triton.jit`` functions.

Registering an existing Triton kernel::

    @TritonProvider.register
    class TritonRowSoftmax(TritonKernel):
        jit_function = row_softmax             # @triton.jit (or @triton.autotune: its configs)
        configs = [triton.Config({}, num_warps=w) for w in (4, 8)]
        supported_args_type = SoftmaxArguments
        dtypes = ("f32", "f16", "bf16")
        operands = softmax_operands            # (dtype, divisibility) -> OperandsMetadata

        def launch_args(self, args):           # (out_ptr, x_ptr, x_row_stride, out_row_stride, n_cols, BLOCK)
            x_stride = args.x.view(args.rows, args.cols).stride(0) if args.rows > 1 and args.cols else args.cols
            return (args.out, args.x, x_stride, args.cols, args.cols), {"BLOCK": triton.next_power_of_2(args.cols)}

        def grid(self, args):
            return (args.rows,)

Each configuration (a ``triton.Config``), dtype and pointer alignment (``alignments``: 16
bytes, as Triton's JIT specialises aligned pointers, and 1 for the rest) is one instance; its
metadata's design is a `TritonDesignMetadata` (block sizes, num_warps, num_stages, alignment).
``compile`` builds the cubin for the requested ``cc`` without a GPU (`compile_triton`, cached
on disk); ``_run`` and the `Launcher` of ``_launcher`` launch it through Triton's own launcher.

Nothing here imports triton: the compile and launch paths do, when they run.
"""

from __future__ import annotations

import abc
import inspect
import re
from typing import Any, Callable, ClassVar, Mapping, Sequence

import torch

from ...core.artifact import CompiledArtifact
from ...core.dtypes import DataType, to_dtype
from ...core.errors import UnsupportedArgumentsError
from ...core.status import Status
from ...core.streams import stream_handle
from ...kernel import Kernel, target_cc
from ...launcher import Launcher
from ...metadata import KernelMetadata, OperandsMetadata
from .compiler import TritonBinary, TritonSpec, compile_triton, value_type
from .design import TritonDesignMetadata

_NAME_CHARS = re.compile(r"[^A-Za-z0-9]+")
_DEFAULT_CONFIG = {"kwargs": {}, "num_warps": 4, "num_stages": 3, "num_ctas": 1, "maxnreg": None}
# Scratch buffers by (device, dtype, elements): written by kernels, read by nobody, kept for the
# process so recorded launches may hold them (`scratch_buffer`).
_scratch: dict[tuple[str, torch.dtype, int], torch.Tensor] = {}
_scratch_ids: set[int] = set()


def scratch_buffer(device: Any, numel: int = 1, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A buffer a kernel may write and nobody reads, for a jit function that stores something
    the operation has no operand for (a library's per-row statistics, written with row stride 0
    into one element). One per device, dtype and size, kept for the process: unlike other
    tensors that are no operand, `TritonKernel._launcher` records launches that pass it.

    Args:
        device: the operands' device.
        numel: its elements (at least 1).
        dtype: its element type.

    Returns:
        The buffer (uninitialised).
    """
    device = torch.device(device)
    key = (str(device), dtype, max(1, int(numel)))
    found = _scratch.get(key)
    if found is None:
        found = _scratch.setdefault(key, torch.empty(key[2], dtype=dtype, device=device))
        _scratch_ids.add(id(found))
    return found


def jit_function_of(kernel_class: type) -> Any:
    """The ``@triton.jit`` function a class names, through ``@triton.autotune`` and
    ``@triton.heuristics`` wrappers.

    Args:
        kernel_class: a `TritonKernel` subclass.

    Returns:
        The jit function (it has ``arg_names``, ``params`` and ``cache_key``); TypeError naming
        the class when it names none.
    """
    fn = kernel_class.__dict__.get("jit_function", getattr(kernel_class, "jit_function", None))
    seen = 0
    while fn is not None and not _is_jit_function(fn) and seen < 8:
        fn = getattr(fn, "fn", None)  # Autotuner / Heuristics keep the function they wrap as .fn
        seen += 1
    if fn is None or not _is_jit_function(fn):
        raise TypeError(f"{kernel_class.__name__}: set `jit_function` to a @triton.jit function (or one wrapped by "
                        f"@triton.autotune), got {getattr(kernel_class, 'jit_function', None)!r}")
    return fn


def _is_jit_function(fn: Any) -> bool:
    return all(hasattr(fn, name) for name in ("arg_names", "params", "cache_key", "src"))


def _config_fields(config: Any, owner: str, i: int) -> dict:
    """A ``triton.Config``'s fields as a dict (read by attribute: no triton import)."""
    kwargs = getattr(config, "kwargs", None)
    if not isinstance(kwargs, Mapping):
        raise TypeError(f"{owner}: configs[{i}] is {config!r}, not a triton.Config")
    return {"kwargs": dict(kwargs), "num_warps": int(getattr(config, "num_warps", 4)),
            "num_stages": int(getattr(config, "num_stages", 3)), "num_ctas": int(getattr(config, "num_ctas", 1) or 1),
            "maxnreg": getattr(config, "maxnreg", None)}


class TritonKernel(Kernel):
    """Base class of Triton kernels (register subclasses with ``@TritonProvider.register``).

    Class attributes a subclass sets:

    - ``jit_function``: the ``@triton.jit`` function (an ``@triton.autotune`` one lends its
      configs too);
    - ``supported_args_type``: the `Arguments` class it serves;
    - ``operands``: a function ``(dtype, divisibility) -> OperandsMetadata`` (e.g.
      ``softmax_operands``), or override ``operands_for``;
    - optionally ``configs`` (``triton.Config``s; default: the autotuner's, else one default
      config), ``dtypes`` (default f32, f16, bf16), ``alignments`` (bytes, default (16, 1)),
      ``min_cc`` (default 80) and ``max_cc``.

    and two methods:

    - ``launch_args(self, args) -> (positional, constexprs)``: the jit function's runtime
      parameters in order (tensors, ints, floats, bools), then a dict of compile-time values
      beyond the config's (e.g. a block size following the row length). Values may depend on
      the operands' dtypes, shapes and strides, not on their data or addresses: they are
      compiled in (constexprs) or recorded for repeated launches (`Launcher`);
    - ``grid(self, args) -> tuple``: programs along x (, y, z); ``self.meta`` holds the
      configuration's meta-parameters.

    Defaults of the contract: ``generate_kernels`` (one instance per config, dtype and
    alignment), ``_supports`` (what the metadata accepts), ``compile`` (`compile_triton` for
    ``cc``), ``_run``/``_launcher`` (Triton's launcher), ``get_workspace_size`` (0).
    """

    jit_function: ClassVar[Any] = None
    configs: ClassVar[Sequence[Any] | None] = None
    operands: ClassVar[Callable[[DataType, int], OperandsMetadata] | None] = None
    dtypes: ClassVar[Sequence[Any]] = (DataType.f32, DataType.f16, DataType.bf16)
    alignments: ClassVar[Sequence[int]] = (16, 1)
    min_cc: ClassVar[int] = 80
    max_cc: ClassVar[int | None] = None
    workspace_free = True
    compiles_from_cache_only = True  # (compile_triton honours cache_only)

    def __init__(self, metadata: KernelMetadata, dtype: DataType | None = None) -> None:
        super().__init__(metadata)
        self.dtype = dtype
        design: TritonDesignMetadata = metadata.design
        #: the configuration's meta-parameters (constexprs), e.g. {"BLOCK_SIZE": 1024}
        self.meta: dict[str, Any] = design.block_sizes

    # ---- what a user provides --------------------------------------------------------------
    @abc.abstractmethod
    def launch_args(self, args: Any) -> tuple[Sequence[Any], Mapping[str, Any]]:
        """The jit function's runtime parameters in order, and compile-time values beyond the
        configuration's.

        Args:
            args: the arguments to launch for.

        Returns:
            ``(positional, constexprs)``.
        """

    @abc.abstractmethod
    def grid(self, args: Any) -> tuple[int, ...]:
        """Programs along x (, y, z) for ``args``.

        Args:
            args: the arguments to launch for.

        Returns:
            One to three ints.
        """

    # ---- generation ------------------------------------------------------------------------
    @classmethod
    def config_list(cls) -> list[dict]:
        """The configurations as dicts: ``configs``, else the autotuner's, else one default.

        Returns:
            One dict per configuration: ``kwargs`` (its meta-parameters), ``num_warps``,
            ``num_stages``, ``num_ctas`` and ``maxnreg``.
        """
        configs = cls.configs
        if configs is None:
            configs = getattr(cls.__dict__.get("jit_function", cls.jit_function), "configs", None)
        if not configs:
            return [dict(_DEFAULT_CONFIG)]
        return [_config_fields(c, cls.__name__, i) for i, c in enumerate(configs)]

    @classmethod
    def operands_for(cls, dtype: DataType, divisibility: int) -> OperandsMetadata:
        """The operands an instance of ``dtype`` takes, aligned to ``divisibility`` elements.

        Args:
            dtype: the instance's element type.
            divisibility: the elements the instance's alignment amounts to (at least 1).

        Returns:
            ``operands(dtype, divisibility)``; TypeError when that is no `OperandsMetadata`.
        """
        found = cls.operands(dtype, divisibility)
        if not isinstance(found, OperandsMetadata):
            raise TypeError(f"{cls.__name__}.operands({dtype}, {divisibility}) returned {type(found).__name__}, "
                            f"not an OperandsMetadata")
        return found

    @classmethod
    def check_definition(cls) -> None:
        """Raise TypeError, naming the class, when it names no jit function, no operands, a
        config that is not a ``triton.Config``, or a dtype or alignment that is no such thing.

        Registration calls it (an incomplete class is refused there).
        """
        fn = jit_function_of(cls)
        if cls.operands is None and cls.operands_for.__func__ is TritonKernel.operands_for.__func__:
            raise TypeError(f"{cls.__name__}: set `operands` to a function (dtype, divisibility) -> OperandsMetadata, "
                            f"e.g. softmax_operands")
        names = set(fn.arg_names)
        for config in cls.config_list():
            unknown = sorted(set(config["kwargs"]) - names)
            if unknown:
                raise TypeError(f"{cls.__name__}: a config sets {unknown}, which {fn.__name__} has no parameter of")
        for a in cls.alignments:
            if not isinstance(a, int) or a < 1 or a & (a - 1):
                raise TypeError(f"{cls.__name__}.alignments: {a!r} is not a power of two of bytes")
        for dt in cls.dtypes:
            to_dtype(dt, f"{cls.__name__}.dtypes")

    @classmethod
    def instance_name(cls, dtype: DataType, config: dict, alignment: int) -> str:
        """The kernel name of one instance.

        Args:
            dtype: its element type.
            config: one of `config_list`'s dicts.
            alignment: the bytes it assumes of the operands' pointers.

        Returns:
            ``<class>_<dtype>_<meta-parameters>_w<warps>_s<stages>_a<alignment>``.
        """
        parts = [cls.__name__, str(dtype)]
        parts += [f"{k}{_NAME_CHARS.sub('', str(v))}" for k, v in sorted(config["kwargs"].items())]
        parts += [f"w{config['num_warps']}", f"s{config['num_stages']}"]
        if config["num_ctas"] != 1:
            parts.append(f"c{config['num_ctas']}")
        if config["maxnreg"] is not None:
            parts.append(f"r{config['maxnreg']}")
        return "_".join(parts + [f"a{alignment}"])

    @classmethod
    def make_metadata(cls, dtype: DataType, config: dict, alignment: int) -> KernelMetadata:
        """The metadata of one instance.

        Args:
            dtype: its element type.
            config: one of `config_list`'s dicts.
            alignment: the bytes it assumes of the operands' pointers.

        Returns:
            Its `KernelMetadata`: name, operands, `TritonDesignMetadata`, cc range.
        """
        design = TritonDesignMetadata(tuple(sorted(config["kwargs"].items())), config["num_warps"],
                                      config["num_stages"], config["num_ctas"], config["maxnreg"], alignment)
        divisibility = max(1, alignment // dtype.bytes)
        return KernelMetadata(cls.instance_name(dtype, config, alignment), cls, cls.operands_for(dtype, divisibility),
                              design=design, min_cc=cls.min_cc, max_cc=cls.max_cc)

    @classmethod
    def generate_kernels(cls, metadata_filter: Callable[[KernelMetadata], bool] | None, epilogue_args: Any = None,
                         cc: int | None = None) -> list["TritonKernel"]:
        """One instance per configuration, dtype and alignment.

        Args:
            metadata_filter: keeps an instance when it returns True (None keeps all).
            epilogue_args: a fused epilogue; none is supported (no instances then).
            cc: the target; instances outside ``min_cc``/``max_cc`` are left out.

        Returns:
            The instances.
        """
        if epilogue_args is not None:
            return []
        cls.check_definition()
        found = []
        for dt in cls.dtypes:
            dtype = to_dtype(dt, f"{cls.__name__}.dtypes")
            for config in cls.config_list():
                for alignment in cls.alignments:
                    metadata = cls.make_metadata(dtype, config, alignment)
                    if not metadata.supports_cc(cc):
                        continue
                    if metadata_filter is not None and not metadata_filter(metadata):
                        continue
                    found.append(cls(metadata, dtype))
        return found

    def _supports(self, args: Any) -> Status:
        return Status.success()

    def get_workspace_size(self, args: Any) -> int:
        return 0

    # ---- compile -----------------------------------------------------------------------------
    def spec(self, args: Any, cc: int) -> TritonSpec:
        """What compiling for ``args`` and ``cc`` means: the signature follows the runtime
        values' types, the constexprs are the config's and ``launch_args``' own.

        Args:
            args: the arguments.
            cc: the target, e.g. 90.

        Returns:
            The `TritonSpec`; TypeError naming the parameter when the values do not fit the
            jit function.
        """
        return self._spec(self._bound(args), args, cc)

    def _bound(self, args: Any) -> dict[str, Any]:
        """Every parameter of the jit function with its value for ``args``."""
        cls = type(self)
        fn = jit_function_of(cls)
        label = self.metadata.kernel_name
        found = self.launch_args(args)
        if not (isinstance(found, tuple) and len(found) == 2 and isinstance(found[1], Mapping)):
            raise TypeError(f"{label}: launch_args must return (positional values, constexpr dict), got {found!r}")
        positional, extra = found
        names = list(fn.arg_names)
        if len(positional) > len(names):
            raise TypeError(f"{label}: launch_args gives {len(positional)} positional values, {fn.__name__} takes "
                            f"{len(names)} parameters")
        values = dict(zip(names, positional))
        for source in (self.meta, extra):
            for name, value in source.items():
                if name not in names:
                    raise TypeError(f"{label}: {fn.__name__} has no parameter {name!r}")
                if name in values:
                    raise TypeError(f"{label}: parameter {name} of {fn.__name__} is given twice")
                values[name] = value
        for param in fn.params:
            if param.name not in values:
                if param.default is inspect.Parameter.empty:
                    raise TypeError(f"{label}: no value for parameter {param.name} of {fn.__name__} (launch_args, "
                                    f"the config or a default gives each one)")
                values[param.name] = param.default
        return {name: values[name] for name in names}

    def _spec(self, bound: dict[str, Any], args: Any, cc: int) -> TritonSpec:
        fn = jit_function_of(type(self))
        label = self.metadata.kernel_name
        params = {p.name: p for p in fn.params}
        # Operands whose attributes say 16-byte aligned: the metadata checks only the operands it
        # names (a LayerNorm's bias rides along with weight's dtype, not its alignment).
        operands = [getattr(args, name) for name, attrs in args.tensor_attributes.items()
                    if attrs.divisibility * attrs.dtype.bytes >= 16]
        aligned_ok = self.metadata.design.alignment >= 16
        signature, constexprs, aligned = [], [], []
        for name, value in bound.items():
            param = params[name]
            if param.is_constexpr:
                signature.append((name, "constexpr"))
                constexprs.append((name, value))
                continue
            signature.append((name, value_type(value, name, label)))
            if param.do_not_specialize or param.do_not_specialize_on_alignment:
                continue
            # As Triton's JIT specialises: 16-byte aligned pointers (here: the operands, when the
            # instance's metadata requires it) and ints that are multiples of 16 (a stride...).
            if isinstance(value, torch.Tensor):
                if aligned_ok and any(value is t for t in operands):
                    aligned.append(name)
            elif isinstance(value, int) and not isinstance(value, bool) and value % 16 == 0:
                aligned.append(name)
        return TritonSpec(fn, tuple(signature), tuple(constexprs), tuple(aligned),
                          tuple(sorted(self.metadata.design.options().items())), cc)

    def compile_key(self, args: Any, cc: int | None) -> tuple:
        spec = self.spec(args, cc or 0)
        return (spec.signature, spec.constexprs, spec.aligned, cc)

    def compile(self, args: Any, cc: int | None = None) -> CompiledArtifact:
        """Compile this instance for ``args``' signature and ``cc`` (default: the current GPU);
        no GPU needed with a cc. The artifact's ``compiled_obj`` is a `TritonBinary`."""
        target = target_cc(cc)
        binary = compile_triton(self.spec(args, target), self.metadata.kernel_name)
        return CompiledArtifact(binary, self, target)

    # ---- launch ------------------------------------------------------------------------------
    def _checked_values(self, args: Any, binary: TritonBinary) -> tuple:
        """The jit function's values for ``args``, once the binary is known to be compiled for
        them (the same signature, constexprs and alignment assumptions)."""
        bound = self._bound(args)
        spec = self._spec(bound, args, binary.spec.cc)
        compiled = binary.spec
        if (spec.signature, spec.constexprs, spec.aligned) != (compiled.signature, compiled.constexprs,
                                                                 compiled.aligned):
            raise UnsupportedArgumentsError(
                f"{self.metadata.kernel_name}: the compiled artifact is for {_describe(compiled)}, these arguments "
                f"need {_describe(spec)}; compile for them (kernel.compile(args)) or call run without an artifact")
        return tuple(bound.values())

    def _run(self, args: Any, artifact: CompiledArtifact, stream: Any, workspace: Any = None) -> None:
        binary: TritonBinary = artifact.compiled_obj
        values = self._checked_values(args, binary)
        device = _device_index(args)
        grid = _grid3(self.grid(args), self.metadata.kernel_name)
        if grid[0] * grid[1] * grid[2] == 0:
            return
        binary.launch(device, grid, stream_handle(stream, device), values, self.metadata.kernel_name)

    def _launcher(self, args: Any, artifact: CompiledArtifact) -> Launcher | None:
        """``function(*operands, stream)``: the values ``launch_args`` gave for ``args``, its
        operands replaced by the call's; None when a value is a tensor other than an operand or
        a `scratch_buffer`."""
        binary: TritonBinary = artifact.compiled_obj
        operands = [getattr(args, name) for name in args.tensor_attributes]
        template, slots = [], []
        for value in self._checked_values(args, binary):
            if isinstance(value, torch.Tensor) and id(value) not in _scratch_ids:
                index = next((i for i, t in enumerate(operands) if t is value), None)
                if index is None:
                    return None
                slots.append((len(template), index))
                value = None  # (filled per call: the launcher keeps no operand alive)
            template.append(value)
        grid = _grid3(self.grid(args), self.metadata.kernel_name)
        if grid[0] * grid[1] * grid[2] == 0:
            return None
        device = _device_index(args)
        binary.kernel_on(device)  # loaded now, not inside a recorded launch
        label = self.metadata.kernel_name

        def launch(*call: Any) -> None:
            values = list(template)
            for position, index in slots:
                values[position] = call[index]
            binary.launch(device, grid, stream_handle(call[-1], device), tuple(values), label)

        launch.__name__ = f"launch_{self.metadata.kernel_name}"
        return Launcher(launch)


def _describe(spec: TritonSpec) -> str:
    types = ", ".join(f"{name}: {ty}" for name, ty in spec.signature if ty != "constexpr")
    constexprs = ", ".join(f"{name}={value!r}" for name, value in spec.constexprs)
    aligned = ", ".join(spec.aligned) or "none"
    return f"({types}; {constexprs or 'no constexprs'}; 16-aligned: {aligned})"


def _device_index(args: Any) -> int:
    index = args.device.index
    return torch.cuda.current_device() if index is None else index


def _grid3(grid: Any, label: str) -> tuple[int, int, int]:
    if isinstance(grid, int):
        grid = (grid,)
    try:
        dims = tuple(int(g) for g in grid)
    except TypeError:
        raise TypeError(f"{label}: grid must return one to three ints, got {grid!r}") from None
    if not 1 <= len(dims) <= 3 or any(d < 0 for d in dims):
        raise TypeError(f"{label}: grid must return one to three ints >= 0, got {grid!r}")
    return dims + (1,) * (3 - len(dims))  # type: ignore[return-value]
