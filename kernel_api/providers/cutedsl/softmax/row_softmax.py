"""Interface of the CuTe DSL softmax kernels (implementation: implementations/row_softmax_impl.py).

`CuteSoftmaxForward` (`SoftmaxArguments`) and `CuteSoftmaxBackward`
(`SoftmaxBackwardArguments`) generate the softmax family's register-resident configurations
(``warp``, ``block`` with 16 or 32 elements per thread; per dtype and alignment), named and
described as `kernel_api.providers.softmax_config` says for every provider.

Rows longer than the ``block`` strategy holds are left to the cuda_src provider's two-pass
kernels. An artifact is specialised on the row length's bucket (threads per row and vectors
per thread); rows and row stride stay run-time values.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from ....arguments import SoftmaxArguments, SoftmaxBackwardArguments
from ....core.artifact import CompiledArtifact
from ....core.dtypes import DataType
from ....core.errors import UnsupportedArgumentsError
from ....launcher import Launcher
from ....metadata import KernelMetadata
from ....core.status import Status
from ....utils import to_cuda_stream
from ... import softmax_config
from ...softmax_config import RowBucket
from .. import CuTeDSLProvider
from ..kernel import CuteDslKernel, fake_tensor

INT32_MAX = 2**31 - 1


class _CuteSoftmaxBase(CuteDslKernel):
    backward: bool = False
    workspace_free = True  # no workspace: run need not ask

    def __init__(self, metadata: KernelMetadata, params: dict | None = None) -> None:
        super().__init__(metadata)
        params = params or {}
        self.dtype: DataType = params["dtype"]
        self.strategy: str = params["strategy"]
        self.ept: int = params.get("ept", 0)
        self.vec: int = params["vec"]
        self.max_cols: int = params["max_cols"]

    @classmethod
    def generate_kernels(cls, metadata_filter: Callable[[KernelMetadata], bool] | None, epilogue_args: Any = None,
                         cc: int | None = None) -> list["_CuteSoftmaxBase"]:
        if epilogue_args is not None:
            return []
        found = []
        for p in softmax_config.configs(cls.backward):
            metadata = softmax_config.kernel_metadata(cls, p, cls.backward)
            if metadata.supports_cc(cc) and (metadata_filter is None or metadata_filter(metadata)):
                found.append(cls(metadata, p))
        return found

    def _supports(self, args: Any) -> Status:
        if args.cols > self.max_cols:
            return Status.fail(f"{self.metadata.kernel_name}: rows of {args.cols} elements exceed its "
                               f"{self.max_cols} (the cuda_src looped kernels take any length)")
        # The compiled kernel takes (rows, cols) as 32-bit extents (`fake_tensor`) and computes
        # its grid, rows rounded up to the CTA's rows, in 32 bits; row strides are 64-bit.
        per_cta = softmax_config.rows_per_cta(self.strategy)
        padded = -(-args.rows // per_cta) * per_cta
        if padded > INT32_MAX:
            return Status.fail(f"{self.metadata.kernel_name}: rows={args.rows:,} (rounded up to the CTA's {per_cta} "
                               f"rows: {padded:,}) exceeds the 32-bit index limit of this kernel "
                               f"(2^31-1 = {INT32_MAX:,})")
        return Status.success()

    def get_workspace_size(self, args: Any) -> int:
        return 0

    def _bucket(self, cols: int) -> RowBucket:
        return softmax_config.register_bucket(self.strategy, self.vec, self.ept, cols, self.backward)

    def compile_key(self, args: Any, cc: int | None) -> tuple:
        return (self._bucket(args.cols), cc)

    compiles_from_cache_only = True  # (its compile's cost is in cute_compile, which honours cache_only)

    def compile(self, args: Any, cc: int | None = None) -> CompiledArtifact:
        """Compile the bucket of ``args``' row length (no GPU needed with an explicit cc)."""
        from cutlass.cute.runtime import make_fake_stream

        from .implementations.row_softmax_impl import RowSoftmaxBackward, RowSoftmaxForward

        b = self._bucket(args.cols)
        dt = self.dtype.to_cutlass()
        impl_cls = RowSoftmaxBackward if self.backward else RowSoftmaxForward
        impl = impl_cls(dt, b.vec, b.nv, b.threads_per_row, b.rows_per_cta)
        tensors = [fake_tensor(dt, 2, 1, self.vec) for _ in range(3 if self.backward else 2)]
        compiled = self.cute_compile(impl, *tensors, make_fake_stream())
        return CompiledArtifact(compiled, self, extra=b)

    def _check(self, artifact: CompiledArtifact, cols: int) -> None:
        bucket: RowBucket = artifact.extra
        if bucket is not None and cols > bucket.capacity:
            raise UnsupportedArgumentsError(
                f"{self.metadata.kernel_name}: the compiled artifact handles rows of up to {bucket.capacity} "
                f"elements, got {cols}; compile for these arguments or call run without an artifact")


    def _launcher(self, args: Any, artifact: CompiledArtifact) -> Launcher | None:
        # Two-dimensional operands go to the compiled function as they are (no rows view).
        if args.rows == 0 or args.cols == 0 or any(getattr(args, n).dim() != 2 for n in args.tensor_attributes):
            return None
        return Launcher(artifact)


def _rows_view(t: torch.Tensor, cols: int) -> torch.Tensor:
    return t if t.dim() == 2 else t.view(-1, cols)


@CuTeDSLProvider.register
class CuteSoftmaxForward(_CuteSoftmaxBase):
    """``out = softmax(x, dim=-1)`` in CuTe DSL (f32 math, row in registers)."""

    supported_args_type = SoftmaxArguments
    backward = False

    def _run(self, args: SoftmaxArguments, artifact: CompiledArtifact, stream: Any, workspace: Any = None) -> None:
        cols = args.cols
        self._check(artifact, cols)
        if args.rows == 0 or cols == 0:
            return
        self.cute_run(artifact.compiled_obj, _rows_view(args.x, cols), _rows_view(args.out, cols),
                      to_cuda_stream(stream))


@CuTeDSLProvider.register
class CuteSoftmaxBackward(_CuteSoftmaxBase):
    """``grad_in = out * (grad_out - sum(grad_out * out, dim=-1))`` in CuTe DSL (f32 math)."""

    supported_args_type = SoftmaxBackwardArguments
    backward = True

    def _run(self, args: SoftmaxBackwardArguments, artifact: CompiledArtifact, stream: Any,
             workspace: Any = None) -> None:
        cols = args.cols
        self._check(artifact, cols)
        if args.rows == 0 or cols == 0:
            return
        self.cute_run(artifact.compiled_obj, _rows_view(args.grad_out, cols), _rows_view(args.out, cols),
                      _rows_view(args.grad_in, cols), to_cuda_stream(stream))
