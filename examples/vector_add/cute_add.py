"""Interface of the CuTe DSL vector add kernels (implementation: implementations/add_impl.py).

`CuteVectorAdd` generates one instance per element type and vector width: ``vec`` = 16 bytes'
worth of elements (128-bit accesses; the operands' pointers and length must be multiples of it)
and ``vec`` = 1 (any length, any alignment). Decorating the class registers it with the CuTe DSL
provider, so importing this module is all a plugin needs to do (see docs/adding-an-operation.md).
"""

from __future__ import annotations

from typing import Any, Callable

from kernel_api import CompiledArtifact, DataType, KernelMetadata, Status, TensorAttributes
from kernel_api.launcher import Launcher
from kernel_api.providers.cutedsl import CuTeDSLProvider
from kernel_api.providers.cutedsl.kernel import CuteDslKernel, fake_tensor
from kernel_api.utils import to_cuda_stream

from .arguments import VectorAddArguments
from .metadata import VectorAddDesign, VectorAddOperandsMetadata

DTYPES = (DataType.f16, DataType.bf16, DataType.f32, DataType.f64)
INT32_MAX = 2**31 - 1


@CuTeDSLProvider.register
class CuteVectorAdd(CuteDslKernel):
    """``out = x + y`` in CuTe DSL, one vector of ``vec`` elements per thread."""

    supported_args_type = VectorAddArguments
    workspace_free = True  # no workspace: run need not ask get_workspace_size

    def __init__(self, metadata: KernelMetadata) -> None:
        super().__init__(metadata)
        self.dtype: DataType = metadata.operands.x.dtype
        self.vec: int = metadata.design.vec
        self.threads: int = metadata.design.threads

    @classmethod
    def generate_kernels(cls, metadata_filter: Callable[[KernelMetadata], bool] | None, epilogue_args: Any = None,
                         cc: int | None = None) -> list["CuteVectorAdd"]:
        if epilogue_args is not None:  # no fused epilogue
            return []
        found = []
        for dtype in DTYPES:
            for vec in (16 // dtype.bytes, 1):
                attrs = TensorAttributes(dtype, (1,), vec)  # unit stride; pointer and length multiples of vec
                metadata = KernelMetadata(f"CuteVectorAdd_{dtype.value}_v{vec}", cls,
                                          VectorAddOperandsMetadata(attrs, attrs, attrs),
                                          design=VectorAddDesign(vec=vec), min_cc=80)
                if metadata.supports_cc(cc) and (metadata_filter is None or metadata_filter(metadata)):
                    found.append(cls(metadata))
        return found

    def _supports(self, args: VectorAddArguments) -> Status:
        # What metadata cannot say: the compiled kernel takes the length as a 32-bit extent.
        if args.n > INT32_MAX:
            return Status.fail(f"{self.name}: n={args.n:,} exceeds the 32-bit extent this kernel takes "
                               f"(2^31-1 = {INT32_MAX:,})")
        return Status.success()

    def get_workspace_size(self, args: VectorAddArguments) -> int:
        return 0

    def compile(self, args: VectorAddArguments, cc: int | None = None) -> CompiledArtifact:
        """Compile for this instance's dtype and vector width (any length; no GPU needed with cc)."""
        from cutlass.cute.runtime import make_fake_stream

        from .implementations.add_impl import VectorAddImpl

        # Fake tensors: a run-time length, unit stride, and the alignment the metadata guarantees.
        tensors = [fake_tensor(self.dtype, 1, 0, self.vec) for _ in range(3)]
        compiled = self.cute_compile(VectorAddImpl(self.vec, self.threads), *tensors, make_fake_stream())
        return CompiledArtifact(compiled, self)

    def _run(self, args: VectorAddArguments, artifact: CompiledArtifact, stream: Any, workspace: Any = None) -> None:
        if args.n == 0:  # an empty grid is not a valid launch
            return
        self.cute_run(artifact.compiled_obj, args.x, args.y, args.out, to_cuda_stream(stream))

    def _launcher(self, args: VectorAddArguments, artifact: CompiledArtifact) -> Launcher | None:
        if args.n == 0:  # _run launches nothing for an empty vector: there is no launch to repeat
            return None
        return Launcher(artifact)  # compiled(x, y, out, stream): the tensors, no constants, the stream
