"""Interface of the CUDA C++ row norms (implementation: norm.cu beside this file; the mapping
of rows onto the machine: norm_plan.py).

Four registered families: `CudaRMSNorm` and `CudaLayerNorm` (forward, optionally fused with the
residual add: ``s = x + residual`` written to residual_out, the norm taken of ``s`` in f32) and
`CudaRMSNormBackward` and `CudaLayerNormBackward` (grad_x, and grad_weight / grad_bias summed
over the rows in two launches, the row statistics recomputed from x). Each generates one
instance per pair of types (rows, weight: equal, or f32 weights under 16-bit rows), strategy
(``warp``, ``block``, ``looped``: `norm_plan`) and alignment: 16-byte vectors (``_a<vec>``:
every row operand's pointer, row stride and row length multiples of ``vec`` elements, the
weight and bias 16-byte aligned) or single elements (``_a1``: any alignment). Names read
``<Class>_<rows>[_w<weight>]_<strategy>_a<vec>``, e.g. ``CudaRMSNorm_bf16_wf32_block_a8``.

An artifact is compiled for the template's vectors per thread (``nv``, from the row length:
`norm_plan.template_shape`), which ``compile_key`` holds through the name expression; the CTA
size follows the row length at launch. Launches are recorded (`_launcher`: ``kernel_api.native.cuda_launch``
functions, the grid, block and row parameters fixed by the operands' metadata). A forward is one
recorded launch, so repeated `Kernel.run` calls replay it from C. A backward is two, the rows'
kernel writing per-unit column sums into a workspace and the column sums' kernel reading them:
its launcher takes the workspace from torch's caching allocator on the launch stream per call
(`kernel_api.launcher.launch_workspace`), so `kernel_api.ops` replays repeated calls.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import torch

from .... import native
from ....arguments.norm import (LayerNormArguments, LayerNormBackwardArguments, RMSNormArguments,
                                RMSNormBackwardArguments)
from ....core.arch import sm_count
from ....core.dtypes import DataType
from ....core.errors import UnsupportedArgumentsError
from ....core.status import Status
from ....core.streams import stream_handle
from ....core.tensor_attributes import TensorAttributes
from ....launcher import Launcher, launch_workspace, raw_stream
from ....metadata import KernelMetadata, RowReductionDesignMetadata
from ....metadata.norm import (LayerNormBackwardOperandsMetadata, LayerNormOperandsMetadata,
                               RMSNormBackwardOperandsMetadata, RMSNormOperandsMetadata)
from ....nvrtc import CudaLauncher
from ....utils import MAX_GRID_X
from .. import CudaSourceProvider
from ..kernel import CudaSourceKernel
from . import norm_plan
from .norm_plan import Launch, Shape

_TYPES = {DataType.f32: "ka_norm::F32", DataType.f16: "ka_norm::F16", DataType.bf16: "ka_norm::BF16"}
#: (rows' type, weight's type): equal, or f32 weights under 16-bit rows
TYPE_PAIRS = ((DataType.bf16, DataType.bf16), (DataType.f16, DataType.f16), (DataType.f32, DataType.f32),
              (DataType.bf16, DataType.f32), (DataType.f16, DataType.f32))
_ROWS = (0, 1)
_VECTOR = (1,)
#: The oldest architecture the kernels run on (plain loads and stores, warp shuffles).
MIN_CC = 80
#: Recorded forward launches kept per instance (one per operand layout and row count).
_RECORDED_LIMIT = 256


@dataclass(frozen=True)
class _Build:
    """An artifact's ``extra``: the template shape it was compiled for, whether it fuses the
    residual add, the backward's column-sum launcher (None for a forward), the backward's ring
    stages and whether the forward stages its rows in shared memory."""

    shape: Shape
    residual: bool
    reduce: CudaLauncher | None
    stages: int = 0
    staged: bool = False


def _eps_bits(eps: float) -> int:
    """eps as the bits of a double, as the kernels take it (every parameter 64-bit)."""
    return struct.unpack("<q", struct.pack("<d", eps))[0]


def _row_stride(t: torch.Tensor, cols: int) -> int:
    if t.is_contiguous() or t.dim() < 2:
        return cols
    return t.view(-1, cols).stride(0)


class _NormBase(CudaSourceKernel):
    source_file = "norm.cu"
    convert_arguments = False  # every parameter is a pointer or a 64-bit int, passed as Python int
    backward: bool = False
    centred: bool = False

    def __init__(self, metadata: KernelMetadata, params: dict) -> None:
        super().__init__(metadata, params)
        self.dtype: DataType = params["dtype"]
        self.weight_type: DataType = params["weight"]
        self.strategy: str = params["strategy"]
        self.vec: int = params["vec"]
        #: The block strategy's bytes of a row per thread (None: `norm_plan.BYTES_PER_THREAD`, the
        #: staged forward's `norm_plan.STAGED_BYTES_PER_THREAD`) and the backward's resident
        #: threads per SM: settable for tuning and benchmarks.
        self.bytes_per_thread: int | None = None
        self.threads_per_sm: int = norm_plan.BACKWARD_THREADS_PER_SM
        #: The backward register rows' later rows in flight: 0, the next row in registers; 2 or
        #: more, the next ``stages - 1`` rows copied into shared memory (16-byte vectors only).
        self.stages: int = norm_plan.BACKWARD_STAGES
        #: The forward's block rows of 16-byte vectors staged in shared memory (`norm_plan.FORWARD_STAGED`).
        self.staged: bool = norm_plan.FORWARD_STAGED

    # ---- generation --------------------------------------------------------------------
    @classmethod
    def variant_params(cls) -> list[dict]:
        return [dict(dtype=x, weight=w, strategy=s, vec=vec)
                for x, w in TYPE_PAIRS for vec in (16 // x.bytes, 1) for s in norm_plan.STRATEGIES]

    @classmethod
    def instance_name(cls, params: dict) -> str:
        weight = "" if params["weight"] is params["dtype"] else f"_w{params['weight']}"
        return f"{cls.__name__}_{params['dtype']}{weight}_{params['strategy']}_a{params['vec']}"

    @classmethod
    def make_metadata(cls, params: dict) -> KernelMetadata:
        x_type, w_type, vec, strategy = params["dtype"], params["weight"], params["vec"], params["strategy"]
        rows = TensorAttributes(x_type, _ROWS, vec)
        # the weight (and bias) in 16-byte pieces where the rows are: 16 bytes of its type at most
        weight = TensorAttributes(w_type, _VECTOR, min(vec, 16 // w_type.bytes))
        longest = norm_plan.max_cols(strategy, cls.backward, vec, x_type.bytes)
        if cls.backward:
            operands = cls._operands_type(rows, rows, weight, rows, max_cols=longest)
        else:
            operands = cls._operands_type(rows, weight, rows, max_cols=longest, residual=True)
        if strategy == "warp":
            extra: tuple = (("rows_per_cta", norm_plan.WARPS_PER_CTA),)
            threads = 32
        elif strategy == "block":
            extra = (("elements_per_thread", norm_plan.BYTES_PER_THREAD[cls.backward] // x_type.bytes),)
            threads = norm_plan.MAX_THREADS[cls.backward]
        else:
            extra = (("passes", 3 if cls.centred else 2),)
            threads = norm_plan.LOOPED_THREADS
        design = RowReductionDesignMetadata("block" if strategy == "looped" else strategy, threads,
                                            vec * x_type.bytes, 1, longest, extra=extra)
        return KernelMetadata(cls.instance_name(params), cls, operands, design=design, min_cc=MIN_CC)

    @classmethod
    def check_definition(cls) -> None:
        pass  # names come from name_expression, not kernel_name

    # ---- support --------------------------------------------------------------------------
    def _supports(self, args: Any) -> Status:
        name = self.metadata.kernel_name
        if args.device.type == "cpu":  # (meta tensors plan and compile like CUDA ones)
            return Status.fail(f"{name}: operand x is on the CPU; the kernel runs on CUDA tensors")
        if self.vec > 1:
            # the operands the metadata does not name must take the same vectors
            for op, attrs in args.tensor_attributes.items():
                need = self.vec if attrs.dtype is self.dtype else min(self.vec, 16 // attrs.dtype.bytes)
                if op in ("grad_weight", "grad_bias"):
                    continue  # (written per element)
                if attrs.divisibility < need:
                    return Status.fail(f"{name}: operand {op} is aligned to {attrs.divisibility} element(s), the kernel "
                                       f"takes multiples of {need}; an _a1 instance takes it")
        shape = self.shape_for(args.cols)
        if shape is None:
            return Status.fail(f"{name}: rows of {args.cols} elements do not fit its registers; a longer-row "
                               f"strategy takes them")
        if not self.backward and norm_plan.forward_launch(shape, args.rows, args.cols).grid > MAX_GRID_X:
            return Status.fail(f"{name}: rows={args.rows:,} need more CTAs than the grid's x limit of 2^31-1")
        return Status.success()

    # ---- compile: the template instance for this row length ------------------------------
    def shape_for(self, cols: int) -> Shape | None:
        if self._may_stage():
            staged = norm_plan.staged_forward_shape(cols, self.vec, self.dtype.bytes, self.bytes_per_thread)
            if staged is not None:
                return staged
        return norm_plan.template_shape(self.strategy, self.backward, cols, self.vec, self.dtype.bytes,
                                        self.bytes_per_thread, self.backward and self._stages() > 0)

    def _may_stage(self) -> bool:
        """A forward whose block rows of 16-byte vectors may be staged (`staged`)."""
        return not self.backward and self.staged and self.strategy == "block" and self.vec * self.dtype.bytes == 16

    def _shape(self, args: Any) -> Shape:
        shape = self.shape_for(args.cols)
        if shape is None:
            raise UnsupportedArgumentsError(f"{self.metadata.kernel_name}: rows of {args.cols} elements do not fit "
                                            f"its registers")
        return shape

    def name_expression(self, args: Any) -> str:
        shape = self._shape(args)
        t, w = _TYPES[self.dtype], _TYPES[self.weight_type]
        centred = "true" if self.centred else "false"
        if self.backward:
            if shape.strategy == "looped":
                return f"ka_norm::bwd_looped<{t}, {w}, {self.vec}, {centred}>"
            per_warp = "true" if shape.strategy == "warp" else "false"
            return f"ka_norm::bwd_reg<{t}, {w}, {self.vec}, {shape.nv}, {centred}, {per_warp}, {self._stages()}>"
        resid = "true" if getattr(args, "residual", None) is not None else "false"
        if self._staged(args, shape):
            return f"ka_norm::fwd_staged<{t}, {w}, {self.vec}, {shape.nv}, {centred}, {resid}>"
        if shape.strategy == "looped":
            return f"ka_norm::fwd_looped<{t}, {w}, {self.vec}, {centred}, {resid}>"
        per_warp = "true" if shape.strategy == "warp" else "false"
        return f"ka_norm::fwd_reg<{t}, {w}, {self.vec}, {shape.nv}, {centred}, {resid}, {per_warp}>"

    def _reduce_expression(self) -> str:
        return f"ka_norm::reduce_cols<{_TYPES[self.weight_type]}>"

    def companion_name_expressions(self, args: Any) -> tuple[str, ...]:
        return (self._reduce_expression(),) if self.backward else ()

    def launch_plan(self, args: Any, launcher: CudaLauncher) -> _Build:
        reduce = None
        if self.backward:
            reduce = CudaLauncher(launcher.compiled, self._reduce_expression(),
                                  f"{self.metadata.kernel_name} (column sums)", convert_args=False)
        shape = self._shape(args)
        return _Build(shape, getattr(args, "residual", None) is not None, reduce,
                      self._stages() if self.backward else 0, self._staged(args, shape))

    def _staged(self, args: Any, shape: Shape) -> bool:
        """Whether the forward compiles fwd_staged for these rows: block rows of 16-byte vectors
        whose stage, with the residual's, fits `norm_plan.STAGE_LIMIT`."""
        return self._may_stage() and shape == norm_plan.staged_forward_shape(args.cols, self.vec, self.dtype.bytes,
                                                                             self.bytes_per_thread)

    def _stages(self) -> int:
        """The ring's stages this instance compiles (0 where it moves no 16-byte vectors)."""
        wide = self.vec * self.dtype.bytes == 16 and self.strategy != "looped"
        return self.stages if wide and self.stages >= 2 else 0

    def _artifact_shape(self, args: Any, artifact: Any) -> Shape:
        build = artifact.extra
        shape = build.shape
        if build.residual != (getattr(args, "residual", None) is not None):
            raise UnsupportedArgumentsError(
                f"{self.metadata.kernel_name}: the compiled artifact is for calls {'with' if build.residual else 'without'}"
                f" a residual; compile for these arguments (kernel.compile(args)) or call run without an artifact")
        if norm_plan.cta_threads(shape, args.cols, self.backward) is None:
            raise UnsupportedArgumentsError(
                f"{self.metadata.kernel_name}: the compiled artifact holds {shape.nv} vector(s) of {shape.vec} per "
                f"thread, too few for rows of {args.cols}; compile for these arguments (kernel.compile(args)) or call "
                f"run without an artifact")
        return shape


class _NormForward(_NormBase):
    workspace_free = True

    def launch_config(self, args: Any) -> tuple:
        launch = norm_plan.forward_launch(self._shape(args), args.rows, args.cols)
        return (launch.grid, launch.threads)

    def _parameters(self, args: Any) -> tuple:
        """The kernel's parameters after the pointers: (rows, cols, ld x, ld residual, ld out,
        ld residual_out, eps bits)."""
        cols = args.cols
        res, s_out = args.residual, args.residual_out
        return (args.rows, cols, _row_stride(args.x, cols), 0 if res is None else _row_stride(res, cols),
                _row_stride(args.out, cols), 0 if s_out is None else _row_stride(s_out, cols), _eps_bits(args.eps))

    def _run(self, args: Any, artifact: Any, stream: Any, workspace: Any = None) -> None:
        shape = self._artifact_shape(args, artifact)
        if args.rows == 0 or args.cols == 0:
            return
        launch = norm_plan.forward_launch(shape, args.rows, args.cols)
        device = args.device.index
        if device is None:
            device = torch.cuda.current_device()
        pointers = tuple(0 if t is None else t.data_ptr()
                         for t in (args.x, args.residual, args.weight, args.bias, args.out, args.residual_out))
        artifact.compiled_obj.launch(stream_handle(stream, device), device, launch.grid, launch.threads,
                                     self._stage_bytes(artifact, launch), pointers + self._parameters(args))

    @staticmethod
    def _stage_bytes(artifact: Any, launch: Launch) -> int:
        build = artifact.extra
        return norm_plan.stage_bytes(build.shape, launch.threads, build.residual) if build.staged else 0

    def _launcher(self, args: Any, artifact: Any) -> Launcher | None:
        if args.rows == 0 or args.cols == 0:
            return None
        params = self._parameters(args)
        key = (id(artifact), params, args.residual is not None, args.bias is not None)
        recorded = self.__dict__.setdefault("_recorded", {})
        found = recorded.get(key)
        if found is None:
            launch = norm_plan.forward_launch(self._artifact_shape(args, artifact), args.rows, args.cols)
            smem = self._stage_bytes(artifact, launch)
            if smem > norm_plan.STAGE_LIMIT:
                return None  # (an artifact staged for shorter rows: the launcher opts in to more, the recording not)
            names = list(args.tensor_attributes)
            T = native.TENSOR
            layout = tuple((8, 0) if getattr(args, op) is None else (T, names.index(op))
                           for op in ("x", "residual", "weight", "bias", "out", "residual_out"))
            layout += tuple((8, value) for value in params)
            function = native.cuda_launch(int(artifact.compiled_obj.kernel.handle), len(names),
                                          (launch.grid, 1, 1), (launch.threads, 1, 1), smem, layout)
            if function is None:
                return None
            if len(recorded) >= _RECORDED_LIMIT:
                recorded.clear()
            # (the artifact kept alive with its launcher: its id stays unique while recorded)
            found = recorded[key] = (Launcher(function), artifact)
        return found[0]


class _NormBackward(_NormBase):
    backward = True

    @property
    def planes(self) -> int:
        return 2 if self.centred else 1

    def _launch(self, args: Any, shape: Shape) -> Launch:
        return norm_plan.backward_launch(shape, args.rows, args.cols, sm_count(args.device), self.threads_per_sm)

    def get_workspace_size(self, args: Any) -> int:
        if args.cols == 0:
            return 0
        return norm_plan.workspace_bytes(self._launch(args, self._shape(args)), args.cols, self.planes)

    def launch_config(self, args: Any) -> tuple:
        launch = self._launch(args, self._shape(args))
        return (launch.grid, launch.threads)

    def _run(self, args: Any, artifact: Any, stream: Any, workspace: Any = None) -> None:
        shape = self._artifact_shape(args, artifact)
        cols = args.cols
        if cols == 0:
            return
        build = artifact.extra
        device = args.device.index
        if device is None:
            device = torch.cuda.current_device()
        launch = self._launch(args, shape)
        ring = norm_plan.ring_bytes(build.stages, shape, launch.threads)
        launch = norm_plan.resident_launch(launch, shape.strategy,
                                           artifact.compiled_obj.max_coresident(device, launch.threads, ring))
        need = norm_plan.workspace_bytes(launch, cols, self.planes)
        if workspace is None or workspace.numel() * workspace.element_size() < need or workspace.data_ptr() % 16:
            got = "none" if workspace is None else (f"{workspace.numel() * workspace.element_size()} bytes at "
                                                    f"{workspace.data_ptr():#x}")
            raise ValueError(f"{self.metadata.kernel_name}: needs a 16-byte aligned workspace of {need} bytes "
                             f"(get_workspace_size), got {got}")
        handle = stream_handle(stream, device)
        ws = workspace.data_ptr()
        params = (args.grad_out.data_ptr(), args.x.data_ptr(), args.weight.data_ptr(), args.grad_x.data_ptr(), ws,
                  args.rows, cols, _row_stride(args.grad_out, cols), _row_stride(args.x, cols),
                  _row_stride(args.grad_x, cols), _eps_bits(args.eps))
        artifact.compiled_obj.launch(handle, device, launch.grid, launch.threads, ring, params)
        gb = args.grad_bias.data_ptr() if args.grad_bias is not None else 0
        build.reduce.launch(handle, device, norm_plan.reduce_grid(cols, self.planes), norm_plan.REDUCE_THREADS, 0,
                            (ws, args.grad_weight.data_ptr(), gb, launch.units, cols))

    def _launcher(self, args: Any, artifact: Any) -> Launcher | None:
        """The two launches recorded (`native.cuda_launch`), behind a function that takes their
        workspace from torch's caching allocator on the launch stream, per call: launches on
        concurrent streams, and CUDA graph captures, each get their own."""
        if args.cols == 0:
            return None
        key = (id(artifact), args.rows, args.cols, _row_stride(args.grad_out, args.cols),
               _row_stride(args.x, args.cols), _row_stride(args.grad_x, args.cols), args.eps, args.device_index, self.threads_per_sm)
        recorded = self.__dict__.setdefault("_recorded", {})
        found = recorded.get(key)
        if found is None:
            launcher = self._record_backward(args, artifact)
            if launcher is None:
                return None
            if len(recorded) >= _RECORDED_LIMIT:
                recorded.clear()
            found = recorded[key] = (launcher, artifact)  # (the artifact kept alive: its id stays unique)
        return found[0]

    def _record_backward(self, args: Any, artifact: Any) -> Launcher | None:
        shape = self._artifact_shape(args, artifact)
        build, cols, device = artifact.extra, args.cols, args.device_index
        launch = self._launch(args, shape)
        ring = norm_plan.ring_bytes(build.stages, shape, launch.threads)
        # (the occupancy query also opts the kernel in to a ring past the default shared memory)
        launch = norm_plan.resident_launch(launch, shape.strategy,
                                           artifact.compiled_obj.max_coresident(device, launch.threads, ring))
        size = norm_plan.workspace_bytes(launch, cols, self.planes)
        T = native.TENSOR
        # rows: (grad_out, x, weight, grad_x, workspace); column sums: (workspace, grad_weight[, grad_bias])
        rows = native.cuda_launch(int(artifact.compiled_obj.kernel.handle), 5, (launch.grid, 1, 1),
                                  (launch.threads, 1, 1), ring,
                                  ((T, 0), (T, 1), (T, 2), (T, 3), (T, 4), (8, args.rows), (8, cols),
                                   (8, _row_stride(args.grad_out, cols)), (8, _row_stride(args.x, cols)),
                                   (8, _row_stride(args.grad_x, cols)), (8, _eps_bits(args.eps))))
        centred = self.centred
        sums = native.cuda_launch(int(build.reduce.kernel.handle), 3 if centred else 2,
                                  norm_plan.reduce_grid(cols, self.planes), (norm_plan.REDUCE_THREADS, 1, 1), 0,
                                  ((T, 0), (T, 1), (T, 2) if centred else (8, 0), (8, launch.units), (8, cols)))
        if rows is None or sums is None:
            return None
        if centred:
            def layer_norm_backward(grad_out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                                    grad_x: torch.Tensor, grad_weight: torch.Tensor, grad_bias: torch.Tensor,
                                    stream: Any) -> None:
                handle = raw_stream(stream, device)
                workspace = launch_workspace(size, device, handle)  # (kept until both launches are queued)
                rows(grad_out, x, weight, grad_x, workspace, handle)
                sums(workspace, grad_weight, grad_bias, handle)

            return Launcher(layer_norm_backward)

        def rms_norm_backward(grad_out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, grad_x: torch.Tensor,
                              grad_weight: torch.Tensor, stream: Any) -> None:
            handle = raw_stream(stream, device)
            workspace = launch_workspace(size, device, handle)  # (kept until both launches are queued)
            rows(grad_out, x, weight, grad_x, workspace, handle)
            sums(workspace, grad_weight, handle)

        return Launcher(rms_norm_backward)


@CudaSourceProvider.register
class CudaRMSNorm(_NormForward):
    """RMSNorm in CUDA C++ (f32 statistics; warp / CTA / looped rows), optionally after the
    residual add."""

    supported_args_type = RMSNormArguments
    _operands_type = RMSNormOperandsMetadata


@CudaSourceProvider.register
class CudaLayerNorm(_NormForward):
    """LayerNorm in CUDA C++ (f32 statistics, two-pass variance), optionally after the residual add."""

    supported_args_type = LayerNormArguments
    _operands_type = LayerNormOperandsMetadata
    centred = True


@CudaSourceProvider.register
class CudaRMSNormBackward(_NormBackward):
    """RMSNorm's gradients in CUDA C++: grad_x per row, grad_weight from per-unit column sums."""

    supported_args_type = RMSNormBackwardArguments
    _operands_type = RMSNormBackwardOperandsMetadata


@CudaSourceProvider.register
class CudaLayerNormBackward(_NormBackward):
    """LayerNorm's gradients in CUDA C++: grad_x per row, grad_weight and grad_bias from per-unit
    column sums."""

    supported_args_type = LayerNormBackwardArguments
    _operands_type = LayerNormBackwardOperandsMetadata
    centred = True


__all__ = ["CudaLayerNorm", "CudaLayerNormBackward", "CudaRMSNorm", "CudaRMSNormBackward", "TYPE_PAIRS"]
