"""Interface of the CUDA C++ gated activation kernels (implementation: swiglu.cu beside this file).

Two registered families, `CudaGatedActivation` (`GatedActivationArguments`: SwiGLU and GeGLU
forward) and `CudaGatedActivationBackward` (`GatedActivationBackwardArguments`), each with one
instance per dtype (f32, f16, bf16) and access width: 16-byte vectors (``_v8`` for 16-bit types,
``_v4`` for f32) for operands whose pointers and row strides are multiples of 16 bytes, and
single elements (``_v1``) for the rest. An instance computes every activation of
`GATE_ACTIVATIONS`; the activation is a template parameter, so an artifact is compiled per
activation (``name_expression``; the compile key holds it).

The problem is streamed once: the forward reads gate and up and writes out (3 operands' bytes),
the backward reads grad_out, gate and up and writes both gradients (5). A CTA covers TY rows of
TX threads; dense operands come as one row. One CTA per `THREADS` x `UNROLL` vectors of a row (the
kernels' grid-stride loops run once but past CUDA's grid limits). Launches go through C launch functions recorded per grid and constants
(`RecordedLaunches`), which `_launcher` also offers for `Kernel.run`'s binding.
"""

from __future__ import annotations

from typing import Any

import torch

from ....arguments.activations import GATE_ACTIVATIONS, GatedActivationArguments, GatedActivationBackwardArguments
from ....core.dtypes import DataType
from ....core.streams import stream_handle
from ....launcher import Launcher
from ....metadata import TensorAttributes
from ....metadata.activations import GatedActivationBackwardOperandsMetadata, GatedActivationOperandsMetadata
from .. import CudaSourceProvider
from .pointwise_launch import PointwiseKernel, RecordedLaunches

_TYPES = {DataType.f32: "ka_glu::F32", DataType.f16: "ka_glu::F16", DataType.bf16: "ka_glu::BF16"}
_ACTIVATIONS = {"silu": "ka_glu::SILU", "gelu_tanh": "ka_glu::GELU_TANH", "gelu": "ka_glu::GELU_ERF"}
_ROWS = (0, 1)
#: Threads per CTA, and vectors per operand each thread moves: forward 1, backward 2. One CTA per
#: THREADS x UNROLL vectors of a row, the grid striding only past CUDA's limits. Measured on an
#: H200 (benchmarks/pointwise.py --sweep, bf16 16384x14336, torch's copy of 1 GiB at 4.25 TB/s):
#: forward 4.15-4.16 TB/s, backward 4.12 (silu and gelu tanh alike); 256-thread CTAs 4.07-4.13;
#: a grid capped at 32 CTAs per SM, each thread looping over 4 (forward) or 2 (backward) vectors
#: per step, 3.70-3.74; 8 per SM 3.3-3.65. The math (16-bit activations through expf and an
#: IEEE division) moved nothing: 3.66-3.69 against 3.70-3.74 at the capped grid.
THREADS = 128
UNROLL = {False: 1, True: 2}
#: The grid's x extent at most (CUDA's limit).
MAX_GRID_X = 2**31 - 1
#: The grid's y extent at most (CUDA's limit).
MAX_GRID_Y = 65535
#: The estimate of a 16-byte vector instance, in multiples of the problem's bytes at full
#: bandwidth (one pass), and of a single-element one (more instructions per byte).
VECTOR_COST, SCALAR_COST = 1.0, 1.3


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def launch_shape(rows: int, cols: int, vec: int, unroll: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """(grid, block) for ``rows`` rows of ``cols`` elements in accesses of ``vec``: TX threads
    along a row (enough for its vectors, 32 to `THREADS`), TY = THREADS / TX rows per CTA."""
    nvec = cols // vec
    tx = min(THREADS, max(32, _pow2_at_least(-(-nvec // unroll)) if nvec else 32))
    ty = THREADS // tx
    grid_x = max(1, min(-(-nvec // (tx * unroll)), MAX_GRID_X))
    grid_y = max(1, min(-(-rows // ty), MAX_GRID_Y))
    return (grid_x, grid_y), (tx, ty)


class _CudaGatedBase(PointwiseKernel):
    source_file = "swiglu.cu"

    @classmethod
    def operands_for(cls, params: dict) -> Any:
        a = TensorAttributes(params["dtype"], _ROWS, params["vec"])
        n = 5 if cls.backward else 3
        return cls._operands_type(*([a] * n), activations=GATE_ACTIVATIONS)

    @classmethod
    def check_definition(cls) -> None:
        pass  # names come from name_expression, not kernel_name

    def name_expression(self, args: Any) -> str:
        op = "glu_bwd" if self.backward else "glu_fwd"
        return (f"ka_glu::{op}<{_TYPES[self.dtype]}, {self.vec}, {_ACTIVATIONS[args.activation]}, "
                f"{UNROLL[self.backward]}>")

    def estimated_cost(self, args: Any, sm_count: int) -> float:
        return VECTOR_COST if self.vec > 1 else SCALAR_COST

    def _shape(self, args: Any) -> tuple:
        return launch_shape(args.rows, args.cols, self.vec, UNROLL[self.backward])

    def launch_config(self, args: Any) -> tuple:
        return self._shape(args)

    def _constants(self, args: Any) -> tuple[int, ...]:
        """The kernel's parameters after the operand pointers: rows, cols, each operand's row stride."""
        return (args.rows, args.cols, *[args.row_strides[n] for n in args.tensor_attributes])

    def kernel_arguments(self, args: Any) -> tuple:
        return (*[getattr(args, n).data_ptr() for n in args.tensor_attributes], *self._constants(args))

    def _recorded(self, args: Any, artifact: Any) -> Launcher | None:
        grid, block = self._shape(args)
        launches = self.__dict__.get("_launches")
        if launches is None:
            launches = self.__dict__["_launches"] = RecordedLaunches()
        return launches.get(artifact, (*grid, 1), (*block, 1), len(args.tensor_attributes), self._constants(args))

    def _run(self, args: Any, artifact: Any, stream: Any, workspace: Any = None) -> None:
        if args.rows == 0 or args.cols == 0:
            return
        device = args.device.index
        if device is None:
            device = torch.cuda.current_device()
        launcher = self._recorded(args, artifact)
        if launcher is not None:
            launcher.function(*[getattr(args, n) for n in args.tensor_attributes], stream_handle(stream, device))
            return
        grid, block = self._shape(args)
        artifact.compiled_obj.launch(stream_handle(stream, device), device, grid, block, 0, self.kernel_arguments(args))

    def _launcher(self, args: Any, artifact: Any) -> Launcher | None:
        if args.rows == 0 or args.cols == 0:  # nothing is launched: nothing to repeat
            return None
        return self._recorded(args, artifact)


@CudaSourceProvider.register
class CudaGatedActivation(_CudaGatedBase):
    """``out = act(gate) * up`` (SwiGLU, GeGLU) in CUDA C++, f32 math, one pass."""

    supported_args_type = GatedActivationArguments
    _operands_type = GatedActivationOperandsMetadata


@CudaSourceProvider.register
class CudaGatedActivationBackward(_CudaGatedBase):
    """The gated activation's gradients in CUDA C++, f32 math, one pass."""

    supported_args_type = GatedActivationBackwardArguments
    _operands_type = GatedActivationBackwardOperandsMetadata
    backward = True
