"""Interface of the CUDA C++ softmax kernels (implementation: softmax.cu beside this file).

Two registered families, `CudaSoftmaxForward` (`SoftmaxArguments`) and `CudaSoftmaxBackward`
(`SoftmaxBackwardArguments`), each generating, per dtype (f32, f16, bf16) and alignment
(16-byte vectors, or single elements for unaligned operands), the softmax family's
register-resident strategies (``warp``; ``block`` with 16 or 32 elements per thread), named
and described as `kernel_api.providers.softmax_config` says for every provider, plus one of
their own:

- ``looped``: one CTA per row of any length, two passes over the input.

Each 16-byte-vector configuration also comes *peeled* (``..._peel<vec>``): it takes rows at
any element alignment and length, handling each row's head up to its first 16-byte boundary
and its tail as scalar elements and the rest as 16-byte vectors. It needs every operand's
rows to start at the same offset from a 16-byte boundary (true for contiguous operands of any
row length); the ``_a1`` instances take the rest.

An instance's compiled artifact is specialised on the row length's bucket (the template's
registers per thread and threads per CTA, a multiple of 32 for ``block``: the block
reductions take any number of warps), chosen at compile time; ``compile_key`` includes it, so
`Kernel.run` without an artifact compiles each bucket once.

A launch is recorded (`_launcher`, `recorded_launch`: the grid, block and row parameters fixed by
the operands' metadata), so repeated `Kernel.run` and `kernel_api.ops` calls replay it from C.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from .... import native
from ....arguments import SoftmaxArguments, SoftmaxBackwardArguments
from ....core.dtypes import DataType
from ....core.errors import UnsupportedArgumentsError
from ....metadata import KernelMetadata, RowReductionDesignMetadata, softmax_operands
from ....core.status import Status
from ....launcher import Launcher
from ....utils import MAX_GRID_X
from ... import softmax_config
from .. import CudaSourceProvider
from ..kernel import CudaSourceKernel
from ....core.streams import stream_handle

_TYPES = {DataType.f32: "ka_softmax::F32", DataType.f16: "ka_softmax::F16", DataType.bf16: "ka_softmax::BF16"}
LOOPED_THREADS = 512
LOOPED_ELEMENTS = 16  # per thread per iteration (VEC x UNROLL)
_LOOPED = {"strategy": "looped", "max_cols": None}
#: The longest row (elements) the kernels index with 32-bit ints.
MAX_COLS = 2**31 - 1


@dataclass(frozen=True)
class _Plan:
    """Launch state fixed at compile time for one template instance."""

    strategy: str
    capacity: int | None  # the longest row the instance handles (None: any)
    rows_per_cta: int
    threads: int


class _SoftmaxBase(CudaSourceKernel):
    source_file = "softmax.cu"
    convert_arguments = False  # every parameter is a pointer or a 64-bit int, passed as Python int
    backward: bool = False
    #: the family's part of an instance name (`instance_name`)
    tag: str = ""

    def __init__(self, metadata: KernelMetadata, params: dict) -> None:
        super().__init__(metadata, params)
        self.dtype: DataType = params["dtype"]
        self.strategy: str = params["strategy"]
        self.ept: int = params.get("ept", 0)
        self.vec: int = params["vec"]
        self.max_cols: int | None = params["max_cols"]
        self.peel: bool = params.get("peel", False)

    # ---- generation --------------------------------------------------------------------
    @classmethod
    def instance_name(cls, params: dict) -> str:
        return _name(cls, params)

    @classmethod
    def make_metadata(cls, params: dict) -> KernelMetadata:
        design = None
        if params["strategy"] == "looped":
            design = RowReductionDesignMetadata("block", LOOPED_THREADS, params["vec"] * params["dtype"].bytes, 1, None,
                                                extra=(("passes", 2),))
        metadata = softmax_config.kernel_metadata(cls, params, cls.backward, design)
        if not params.get("peel"):
            return metadata
        # Any element alignment: the operands need only element alignment, the design says peeled.
        design = metadata.design
        return KernelMetadata(_name(cls, params), cls, softmax_operands(params["dtype"], 1, backward=cls.backward),
                              design=dataclasses.replace(design, extra=design.extra + (("peel", True),)),
                              min_cc=metadata.min_cc)

    @classmethod
    def variant_params(cls) -> list[dict]:
        found = softmax_config.configs(cls.backward, (_LOOPED,))
        return found + [dict(p, peel=True) for p in found if p["vec"] > 1]

    @classmethod
    def check_definition(cls) -> None:
        pass  # names come from name_expression, not kernel_name

    # ---- support --------------------------------------------------------------------------
    def _supports(self, args: Any) -> Status:
        cols, rows = args.cols, args.rows
        too_long = row_length_status(self.metadata.kernel_name, cols)
        if too_long is not None:
            return too_long
        if self.peel:
            status = peel_status(self.metadata.kernel_name, args, self.vec)
            if not status:
                return status
        if self.max_cols is not None and cols > self.max_cols:
            return Status.fail(f"{self.metadata.kernel_name}: rows of {cols} elements exceed its {self.max_cols}; "
                               f"a block/looped instance handles longer rows")
        # softmax.cu takes rows, strides and row offsets as 64-bit integers (i64), so the only
        # index limit is the grid: one block per row (warp: per softmax_config.WARPS_PER_CTA rows) on gridDim.x.
        per_cta = softmax_config.rows_per_cta(self.strategy)
        blocks = -(-rows // per_cta)
        if blocks > MAX_GRID_X:
            return Status.fail(f"{self.metadata.kernel_name}: rows={rows:,} need {blocks:,} blocks of {per_cta} "
                               f"row(s), past the grid's x limit of 2^31-1 = {MAX_GRID_X:,}")
        return Status.success()

    # ---- compile: the template instance for this row length ------------------------------
    def _instance(self, cols: int) -> tuple[str, _Plan]:
        t = _TYPES[self.dtype]
        vec = self.vec
        op = "bwd" if self.backward else "fwd"
        peel = ", true" if self.peel else ""  # (PEEL defaults to false)
        if self.strategy != "looped":
            b = softmax_config.register_bucket(self.strategy, vec, self.ept, cols, self.backward, warp_granular=True)
            # the fourth template parameter: warps (rows) per CTA of *_warp, threads of *_block
            last = b.rows_per_cta if self.strategy == "warp" else b.threads_per_row
            return (f"ka_softmax::{op}_{self.strategy}<{t}, {vec}, {b.nv}, {last}{peel}>",
                    _Plan(self.strategy, b.capacity, b.rows_per_cta, b.cta_threads))
        unroll = max(1, LOOPED_ELEMENTS // vec)
        return (f"ka_softmax::{op}_looped<{t}, {vec}, {unroll}, {LOOPED_THREADS}{peel}>",
                _Plan("looped", None, 1, LOOPED_THREADS))

    def name_expression(self, args: Any) -> str:
        return self._instance(args.cols)[0]

    def launch_plan(self, args: Any, launcher: Any) -> _Plan:
        return self._instance(args.cols)[1]

    def launch_config(self, args: Any) -> tuple:
        plan = self._instance(args.cols)[1]
        return (-(-args.rows // plan.rows_per_cta), plan.threads)

    def _run(self, args: Any, artifact: Any, stream: Any, workspace: Any = None) -> None:
        plan = _launch_plan(self, args, artifact)
        if plan is None:
            return
        device = args.device.index
        artifact.compiled_obj.launch(stream_handle(stream, device), device, -(-args.rows // plan.rows_per_cta),
                                     plan.threads, 0, row_params(args))

    def _launcher(self, args: Any, artifact: Any) -> Launcher | None:
        plan = _launch_plan(self, args, artifact)
        return None if plan is None else recorded_launch(args, artifact, -(-args.rows // plan.rows_per_cta),
                                                         plan.threads)


def _name(cls: type, params: dict) -> str:
    """The shared naming, with ``_peel<vec>`` in place of ``_a<vec>`` for peeled instances."""
    name = softmax_config.kernel_name(cls, params)
    if params.get("peel"):
        name = name[: name.rindex("_a")] + f"_peel{params['vec']}"
    return name


def peel_status(name: str, args: Any, vec: int) -> Status:
    """Whether a peeled kernel of ``vec``-element vectors takes ``args``: every operand's rows
    must sit at one offset from a 16-byte boundary, so that one split of a row into head,
    vectors and tail serves them all (the row pointers and row strides agree modulo ``vec``)."""
    offsets = set()
    for op in args.tensor_attributes:
        t = getattr(args, op)
        offsets.add(((t.data_ptr() // t.element_size()) % vec,
                     _row_stride(t, args.cols) % vec if args.rows > 1 else 0))
    if len(offsets) > 1:
        return Status.fail(f"{name}: the operands' rows start at different offsets from a 16-byte boundary "
                           f"(element offset, row stride mod {vec}: {sorted(offsets)}); an _a1 instance takes them")
    return Status.success()


def _row_stride(t: torch.Tensor, cols: int) -> int:
    if t.is_contiguous() or t.dim() < 2:
        return cols
    return t.view(-1, cols).stride(0)


def row_params(args: Any) -> tuple:
    """The parameters every softmax kernel of this provider starts with: the row pointers,
    extents and row strides. Forward: (x, out, rows, cols, ld x, ld out); backward: (dy, y, dx,
    rows, cols, ld dy, ld y, ld dx). Outputs are written dense (ld = cols)."""
    rows, cols = args.rows, args.cols
    if isinstance(args, SoftmaxBackwardArguments):
        g, y, d = args.grad_out, args.out, args.grad_in
        return (g.data_ptr(), y.data_ptr(), d.data_ptr(), rows, cols, _row_stride(g, cols), _row_stride(y, cols), cols)
    x, out = args.x, args.out
    return (x.data_ptr(), out.data_ptr(), rows, cols, _row_stride(x, cols), cols)


def row_layout(args: Any) -> tuple:
    """`row_params` as `kernel_api.native.cuda_launch` parameters: the operands (in
    ``args.tensor_attributes`` order, as `row_params` takes them) by index, the rest 64-bit constants."""
    rows, cols = args.rows, args.cols
    T = native.TENSOR
    if isinstance(args, SoftmaxBackwardArguments):
        return ((T, 0), (T, 1), (T, 2), (8, rows), (8, cols), (8, _row_stride(args.grad_out, cols)),
                (8, _row_stride(args.out, cols)), (8, cols))
    return ((T, 0), (T, 1), (8, rows), (8, cols), (8, _row_stride(args.x, cols)), (8, cols))


def recorded_launch(args: Any, artifact: Any, grid: int, threads: int, shared_bytes: int = 0) -> Launcher | None:
    """The `Launcher` of one launch of ``artifact``'s kernel for operands of ``args``' metadata:
    ``grid`` CTAs of ``threads`` threads with ``shared_bytes`` of dynamic shared memory and the
    row parameters (`row_layout`), replayed from C (`kernel_api.native.cuda_launch`; the operands'
    pointers read at each call). None where that cannot be made (no native module or CUDA driver),
    or for an empty problem (nothing to launch)."""
    if args.rows == 0 or args.cols == 0:
        return None
    function = native.cuda_launch(int(artifact.compiled_obj.kernel.handle), len(args.tensor_attributes), (grid, 1, 1),
                                  (threads, 1, 1), shared_bytes, row_layout(args))
    return None if function is None else Launcher(function)


def _check_capacity(kernel: Any, plan: Any, cols: int) -> None:
    if plan.capacity is not None and cols > plan.capacity:
        raise UnsupportedArgumentsError(
            f"{kernel.metadata.kernel_name}: the compiled artifact handles rows of up to {plan.capacity} elements, "
            f"got {cols}; compile for these arguments (kernel.compile(args)) or call run without an artifact")


def _launch_plan(kernel: Any, args: Any, artifact: Any) -> Any:
    """The artifact's launch plan (this module's `_Plan` or the split family's `SplitPlan`: both
    carry the ``capacity`` it was compiled for), checked against the row length; None when there
    is no work."""
    plan = artifact.extra
    if plan.capacity is not None and args.cols > plan.capacity:
        _check_capacity(kernel, plan, args.cols)
    if args.rows == 0 or args.cols == 0:
        return None
    return plan


@CudaSourceProvider.register
class CudaSoftmaxForward(_SoftmaxBase):
    """``out = softmax(x, dim=-1)`` in CUDA C++ (f32 math; warp / CTA / looped row mappings)."""

    supported_args_type = SoftmaxArguments
    backward = False


@CudaSourceProvider.register
class CudaSoftmaxBackward(_SoftmaxBase):
    """``grad_in = out * (grad_out - sum(grad_out * out, dim=-1))`` in CUDA C++ (f32 math)."""

    supported_args_type = SoftmaxBackwardArguments
    backward = True


def row_length_status(name: str, cols: int) -> Status | None:
    """Kernel ``name``'s refusal of rows longer than the kernels index with 32-bit ints
    (`MAX_COLS`), else None."""
    if cols > MAX_COLS:
        return Status.fail(f"{name}: rows of {cols:,} elements exceed its 2^31-1")
    return None


class JoinsSoftmaxSource:
    """Mixin for the softmax families compiled after softmax.cu, whose spans, conversions,
    stores and reductions they use: their source is softmax.cu's followed by their own. Also
    what their generation shares: metadata from a design, and template names from
    ``name_expression`` rather than the kernel name; and what every instance has: its dtype
    and the elements of a 16-byte vector (``vec``), parameters passed as Python ints."""

    convert_arguments = False  # every parameter is a pointer or a 64-bit int, passed as Python int
    backward: bool = False
    #: the family's part of an instance name (`instance_name`)
    tag: str = ""

    def __init__(self, metadata: KernelMetadata, params: dict) -> None:
        super().__init__(metadata, params)
        self.dtype: DataType = params["dtype"]
        self.vec: int = 16 // self.dtype.bytes

    @classmethod
    def variant_params(cls) -> list[dict]:
        """One instance per dtype (families with more parameters override it)."""
        return [dict(dtype=dt) for dt in softmax_config.DTYPES]

    @classmethod
    def instance_name(cls, params: dict) -> str:
        """``<class>_<dtype>_<tag>_peel<vec>`` (families with more parameters override it)."""
        return f"{cls.__name__}_{params['dtype']}_{cls.tag}_peel{16 // params['dtype'].bytes}"

    @classmethod
    def family_metadata(cls, params: dict, design: RowReductionDesignMetadata, min_cc: int,
                        max_cc: int | None = None) -> KernelMetadata:
        """Metadata of instance ``params``: its name, the softmax operands of its dtype (any
        element alignment: the rows are peeled) and ``design``."""
        return KernelMetadata(cls.instance_name(params), cls,
                              softmax_operands(params["dtype"], 1, backward=cls.backward), design=design,
                              min_cc=min_cc, max_cc=max_cc)

    @classmethod
    def check_definition(cls) -> None:
        pass  # names come from name_expression, not kernel_name

    @classmethod
    def get_source(cls) -> str:
        text = cls._source_texts.get(cls)
        if text is None:
            text = cls._source_texts[cls] = CudaSoftmaxForward.get_source() + "\n" + super().get_source()
        return text
