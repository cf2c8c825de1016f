"""Interface of the CUDA C++ rotary position embedding kernels (implementation: rope.cu beside
this file).

Two registered families, `CudaRope` (`RopeArguments`) and `CudaRopeBackward`
(`RopeBackwardArguments`), with one instance per dtype (f32, f16, bf16; cos and sin of the same
dtype) and access width: 16-byte vectors (``_v8`` for 16-bit types, ``_v4`` for f32) where every
operand's pointer, strides and half head dimension are multiples of 16 bytes, single elements
(``_v1``) for the rest.

One launch rotates q and k. A work item is one position of one batch, one group of
`HEADS_PER_THREAD` heads and one vector of the first half of head_dim: cos and sin are read once
per item, the heads' loads are all in flight before the stores, and every operand is addressed
through its own strides (transformers' transposed q and k are read in place). The problem is
streamed once: q and k read, q_out and k_out written, cos and sin read once per position (from
cache for the other heads and groups). Launches go through C launch functions recorded per
grid and constants (`RecordedLaunches`), which `_launcher` also offers for `Kernel.run`'s binding.
"""

from __future__ import annotations

from typing import Any

import torch

from ....arguments.rope import RopeArguments, RopeBackwardArguments
from ....core.dtypes import DataType
from ....core.status import Reason, Status
from ....core.streams import stream_handle
from ....launcher import Launcher
from ....metadata import TensorAttributes
from ....metadata.rope import RopeBackwardOperandsMetadata, RopeOperandsMetadata
from .. import CudaSourceProvider
from .pointwise_launch import PointwiseKernel, RecordedLaunches

_TYPES = {DataType.f32: "ka_rope::F32", DataType.f16: "ka_rope::F16", DataType.bf16: "ka_rope::BF16"}
_ROWS = (0, 1)
THREADS = 256
#: Heads one work item rotates: their 2 x HEADS_PER_THREAD 16-byte loads are in flight together,
#: and cos and sin are read once for them. One CTA per THREADS
#: items (the grid-stride loop runs once). Measured on an H200 (benchmarks/pointwise.py --sweep,
#: bf16 forward, q (4, 32, 2048, 128), k (4, 8, 2048, 128), torch's copy at 4.25 TB/s): 2 heads
#: 3.63 TB/s on transformers' transposed q and k and 3.62 on contiguous ones; 1, 4 or 8 heads and
#: grids capped at 16-32 CTAs per SM 3.48-3.65, none better on both layouts.
HEADS_PER_THREAD = 2
#: Work items are indexed with 32-bit ints.
MAX_ITEMS = 2**31 - 1
VECTOR_COST, SCALAR_COST = 1.0, 1.3


def work_items(args: Any, vec: int) -> tuple[int, int, int]:
    """(items, head groups, vectors per half head) of ``args`` for accesses of ``vec`` elements."""
    groups = -(-(args.heads_q + args.heads_k) // HEADS_PER_THREAD)
    nj = args.head_dim // 2 // vec
    return args.batch * args.seq * groups * nj, groups, nj


class _CudaRopeBase(PointwiseKernel):
    source_file = "rope.cu"

    @classmethod
    def operands_for(cls, params: dict) -> Any:
        a = TensorAttributes(params["dtype"], _ROWS, params["vec"])
        return cls._operands_type(a, a, a, a, a, a)

    @classmethod
    def check_definition(cls) -> None:
        pass  # names come from name_expression, not kernel_name

    def _supports(self, args: Any) -> Status:
        items = work_items(args, self.vec)[0]
        if items > MAX_ITEMS:
            return Status.fail(f"{self.metadata.kernel_name}: {items:,} work items (batch x seq x head groups x "
                               f"vectors) exceed its 32-bit index", kind=Reason.SHAPE,
                               operand=next(iter(args.tensor_attributes)), actual=items, required=MAX_ITEMS)
        return Status.success()

    def name_expression(self, args: Any) -> str:
        return (f"ka_rope::rope<{_TYPES[self.dtype]}, {self.vec}, {HEADS_PER_THREAD}, "
                f"{'true' if self.backward else 'false'}>")

    def compile_key(self, args: Any, cc: int | None) -> tuple:
        return (self.name_expression(args), cc)

    def estimated_cost(self, args: Any, sm_count: int) -> float:
        return VECTOR_COST if self.vec > 1 else SCALAR_COST

    def _grid(self, args: Any) -> int:
        items = work_items(args, self.vec)[0]
        return max(1, -(-items // THREADS))

    def launch_config(self, args: Any) -> tuple:
        return self._grid(args), THREADS

    def _constants(self, args: Any) -> tuple[int, ...]:
        """The kernel's parameters after the six pointers: sizes, then each operand's strides."""
        items, groups, nj = work_items(args, self.vec)
        st = args.strides
        q, k, cos, sin, qo, ko = (st[n] for n in args.tensor_attributes)
        return (items, args.seq, args.heads_q, args.heads_k, groups, nj, args.head_dim // 2,
                q.batch, q.head, q.seq, k.batch, k.head, k.seq, cos.batch, cos.seq, sin.batch, sin.seq,
                qo.batch, qo.head, qo.seq, ko.batch, ko.head, ko.seq)

    def kernel_arguments(self, args: Any) -> tuple:
        return (*[getattr(args, n).data_ptr() for n in args.tensor_attributes], *self._constants(args))

    def _empty(self, args: Any) -> bool:
        return args.batch * args.seq * args.head_dim * (args.heads_q + args.heads_k) == 0

    def _recorded(self, args: Any, artifact: Any) -> Launcher | None:
        launches = self.__dict__.get("_launches")
        if launches is None:
            launches = self.__dict__["_launches"] = RecordedLaunches()
        return launches.get(artifact, (self._grid(args), 1, 1), (THREADS, 1, 1), 6, self._constants(args))

    def _run(self, args: Any, artifact: Any, stream: Any, workspace: Any = None) -> None:
        if self._empty(args):
            return
        device = args.device.index
        if device is None:
            device = torch.cuda.current_device()
        launcher = self._recorded(args, artifact)
        if launcher is not None:
            launcher.function(*[getattr(args, n) for n in args.tensor_attributes], stream_handle(stream, device))
            return
        artifact.compiled_obj.launch(stream_handle(stream, device), device, self._grid(args), THREADS, 0,
                                     self.kernel_arguments(args))

    def _launcher(self, args: Any, artifact: Any) -> Launcher | None:
        if self._empty(args):  # nothing is launched: nothing to repeat
            return None
        return self._recorded(args, artifact)


@CudaSourceProvider.register
class CudaRope(_CudaRopeBase):
    """RoPE of q and k in one launch (transformers' ``rotate_half`` convention), f32 math."""

    supported_args_type = RopeArguments
    _operands_type = RopeOperandsMetadata


@CudaSourceProvider.register
class CudaRopeBackward(_CudaRopeBase):
    """RoPE's gradients with respect to q and k (the transposed rotation) in one launch."""

    supported_args_type = RopeBackwardArguments
    _operands_type = RopeBackwardOperandsMetadata
    backward = True
