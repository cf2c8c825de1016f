# The code cells of ../shared/spec/seed-adding-a-kernel.txt (CUTLASS API notebook), with
# cutlass_api spelled kernel_api and nothing else changed. Imported by the tests: the
# discovery part runs everywhere, run + assert_close on a GPU.
from collections.abc import Callable

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute


class F64GemmKernelImplementation:
    def __init__(self, cta_tile_shape_mn: tuple[int, int]):
        self.cta_tile_shape_mn = cta_tile_shape_mn

    @cute.jit
    def __call__(
        self, a: cute.Tensor, b: cute.Tensor, out: cute.Tensor, stream: cuda.CUstream
    ):
        l, m, n = out.shape
        m_tiles = (m + self.cta_tile_shape_mn[0] - 1) // self.cta_tile_shape_mn[0]
        n_tiles = (n + self.cta_tile_shape_mn[1] - 1) // self.cta_tile_shape_mn[1]

        grid = (m_tiles, n_tiles, l)
        block = [self.cta_tile_shape_mn[0], self.cta_tile_shape_mn[1], 1]
        self.kernel(a, b, out).launch(grid=grid, block=block, stream=stream)

    @cute.kernel
    def kernel(self, a: cute.Tensor, b: cute.Tensor, out: cute.Tensor):
        l, m, n = out.shape
        k = a.shape[-1]
        m_tile, n_tile, l_idx = cute.arch.block_idx()
        tidx, tidy, _ = cute.arch.thread_idx()

        m_idx = m_tile * self.cta_tile_shape_mn[0] + tidx
        n_idx = n_tile * self.cta_tile_shape_mn[1] + tidy

        if m_idx < m and n_idx < n:
            out[l_idx, m_idx, n_idx] = cutlass.Float64(0)
            for k_idx in range(k):
                out[l_idx, m_idx, n_idx] += (
                    a[l_idx, m_idx, k_idx] * b[l_idx, k_idx, n_idx]
                )


import itertools

import kernel_api
from kernel_api.arguments import GemmArguments
from kernel_api.metadata import KernelMetadata
from kernel_api.status import Status


@kernel_api.providers.cutedsl.CuTeDSLProvider.register
class F64GemmKernel(kernel_api.providers.cutedsl.kernel.CuteDslKernel):
    # Empty versions of interface methods. These will be implemented later, interspersed
    # with notebook markdown. Normally, one would define them inline with the class definition.
    def __init__(self, metadata: KernelMetadata):
        pass

    def _run(
        self,
        args: GemmArguments,
        artifact: kernel_api.artifact.CompiledArtifact,
        stream,
        workspace=None,
    ):
        pass

    def compile(
        self, args: GemmArguments, cc: int = None
    ) -> kernel_api.artifact.CompiledArtifact:
        pass

    @staticmethod
    def generate_kernels(
        metadata_filter, epilogue_args=None, cc=None
    ) -> list["F64GemmKernel"]:
        pass

    def _supports(self, args: GemmArguments) -> Status:
        pass

    def get_workspace_size(self, args: GemmArguments) -> int:
        pass


def __init__(self, metadata: KernelMetadata):
    # Using Python-2-style super() because we're defining this method outside of the class definition.
    super(F64GemmKernel, self).__init__(metadata)
    cta_tile_shape_mn = metadata.design.tile_shape[:2]
    self.impl = F64GemmKernelImplementation(cta_tile_shape_mn)


def compile(
    self, args: GemmArguments, cc: int = None
) -> kernel_api.artifact.CompiledArtifact:
    stream = cutlass.cute.runtime.make_fake_stream()
    compiled_gemm = self.cute_compile(self.impl, args.A, args.B, args.out, stream)
    return kernel_api.artifact.CompiledArtifact(compiled_gemm, self)


def _run(
    self,
    args: GemmArguments,
    artifact: kernel_api.artifact.CompiledArtifact,
    stream,
    workspace=None,
):
    stream = kernel_api.utils.to_cuda_stream(stream)
    compiled_gemm = artifact.compiled_obj
    self.cute_run(compiled_gemm, args.A, args.B, args.out, stream)


def get_workspace_size(self, args: GemmArguments) -> int:
    return 0


@staticmethod
def generate_kernels(
    metadata_filter: Callable[[KernelMetadata], bool],
    epilogue_args: kernel_api.arguments.EpilogueArguments = None,
    cc: int = None,
) -> list["F64GemmKernel"]:
    # The tile shapes this kernel supports/exposes
    supported_tile_shapes = [(32, 32, 1), (16, 16, 1)]

    if epilogue_args is not None:
        return []

    row_major_stride = (0, 0, 1)
    col_major_stride = (0, 1, 0)
    stride_combos = list(
        itertools.product([row_major_stride, col_major_stride], repeat=3)
    )
    divisibility = 1

    def stride_name(stride):
        return "T" if stride == row_major_stride else "N"

    kernels = []
    for tile_shape in supported_tile_shapes:
        design_metadata = kernel_api.metadata.BLASDesignMetadata(tile_shape, (1, 1, 1))
        for stride_A, stride_B, stride_out in stride_combos:
            # Create TensorAttributes for A, B, and out tensors
            a_attrs = kernel_api.metadata.TensorAttributes(
                cutlass.Float64, stride_A, divisibility
            )
            b_attrs = kernel_api.metadata.TensorAttributes(
                cutlass.Float64, stride_B, divisibility
            )
            out_attrs = kernel_api.metadata.TensorAttributes(
                cutlass.Float64, stride_out, divisibility
            )
            layout_str = kernel_api.utils.strides_to_layout_string(
                stride_A, stride_B, stride_out
            )

            name = f"F64GemmKernel_tile{tile_shape[0]}x{tile_shape[1]}_{layout_str}"

            metadata = KernelMetadata(
                kernel_name=name,
                kernel_class=F64GemmKernel,
                operands=kernel_api.metadata.GemmOperandsMetadata(
                    a_attrs, b_attrs, out_attrs, accumulator_type=cutlass.Float64
                ),
                design=design_metadata,
                min_cc=0,
            )

            if metadata_filter(metadata):
                kernels.append(F64GemmKernel(metadata))

    return kernels


def _supports(self, args: GemmArguments) -> Status:
    if not (
        len(args.A.shape) == 3  # A should be (L, M, K)
        and len(args.B.shape) == 3  # B should be (L, K, N)
        and len(args.out.shape) == 3  # out should be (L, M, N)
    ):
        return Status.fail("All operands must be rank 3.")
    return Status.success()


# Assign methods to the class because we interspersed notebook markdown
# with the class definition. This is not needed in a real implementation.
F64GemmKernel.__init__ = __init__
F64GemmKernel.compile = compile
F64GemmKernel._run = _run
F64GemmKernel._supports = _supports
F64GemmKernel.generate_kernels = generate_kernels
F64GemmKernel.get_workspace_size = get_workspace_size


def is_f64gemm_kernel(metadata):
    return metadata.kernel_class == F64GemmKernel


def my_filter(metadata):
    return (
        is_f64gemm_kernel(metadata)
        and isinstance(metadata.design, kernel_api.metadata.BLASDesignMetadata)
        and metadata.design.tile_shape[0] == 256
    )


def run_notebook(device: str = "cuda"):
    """The notebook's discovery-and-run cells; returns (kernels, args, A, B, out)."""
    import torch

    torch.manual_seed(2025)

    L, M, N, K = 1, 256, 1024, 128
    A = torch.randn(L, M, K, device=device, dtype=torch.float64)
    B = torch.randn(L, K, N, device=device, dtype=torch.float64)
    out = torch.empty(L, M, N, device=device, dtype=torch.float64)

    args = GemmArguments(A, B, out, accumulator_type=torch.float64)
    kernels = kernel_api.get_kernels(args, metadata_filter=is_f64gemm_kernel)
    print(kernels[0].metadata.kernel_name)
    print(kernels[1].metadata.kernel_name)
    return kernels, args, A, B, out
