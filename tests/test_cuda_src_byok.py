"""Bring your own CUDA kernel: a user registers a kernel from a source string in a few lines."""

import pytest
import torch

import kernel_api
from kernel_api import GemmArguments, GemmOperandsMetadata, TensorAttributes
from kernel_api.errors import CompilationError, KernelLaunchError, RegistrationError
from kernel_api.providers.cuda_src import CudaSourceProvider
from kernel_api.providers.cuda_src.kernel import CudaSourceKernel
from kernel_api.status import Status

GEMM_SOURCE = r"""
template <typename T, int TILE>
__global__ void naive_gemm(const T* A, const T* B, T* C, int M, int N, int K, float alpha) {
  int m = blockIdx.y * TILE + threadIdx.y;
  int n = blockIdx.x * TILE + threadIdx.x;
  if (m < M && n < N) {
    float acc = 0.f;
    for (int k = 0; k < K; ++k) acc += float(A[m * K + k]) * float(B[k * N + n]);
    C[m * N + n] = T(alpha * acc);
  }
}
"""

ROW = (0, 0, 1)


def _f32_row():
    return TensorAttributes(torch.float32, ROW, 1)


@pytest.fixture
def user_gemm():
    """The whole user-side definition: source, name, variants, operands, launch config."""

    @CudaSourceProvider.register
    class UserNaiveGemm(CudaSourceKernel):
        source = GEMM_SOURCE
        kernel_name = "naive_gemm<float, {tile}>"
        variants = [{"tile": 16}, {"tile": 32}]
        operands = GemmOperandsMetadata(_f32_row(), _f32_row(), _f32_row(), accumulator_type=torch.float32)

        def _supports(self, args: GemmArguments) -> Status:
            return Status.success() if args.L == 1 else Status.fail("batched GEMM is not supported")

        def launch_config(self, args):
            t = self.params["tile"]
            return ((args.N + t - 1) // t, (args.M + t - 1) // t), (t, t)

        def kernel_arguments(self, args):
            # ints go to `int` parameters as 32-bit values, the float as a 32-bit float
            return args.A, args.B, args.out, args.M, args.N, args.K, 1.0

    yield UserNaiveGemm
    CudaSourceProvider.unregister(UserNaiveGemm)


def _gemm_args(M=70, N=45, K=33, device="cpu"):
    A = torch.randn(M, K, device=device)
    B = torch.randn(K, N, device=device)
    out = torch.full((M, N), float("nan"), device=device)
    return GemmArguments(A, B, out, accumulator_type=torch.float32)


def test_user_kernel_is_discovered_and_compiles_without_gpu(user_gemm):
    args = _gemm_args()
    kernels = kernel_api.get_kernels(args, cc=90, providers="cuda_src")
    names = [k.metadata.kernel_name for k in kernels]
    assert names == ["UserNaiveGemm_tile16", "UserNaiveGemm_tile32"]
    assert all(k.metadata.provider == "cuda_src" for k in kernels)
    artifact = kernels[1].compile(args, cc=90)
    assert artifact.cc == 90
    assert artifact.compiled_obj.compiled.arch == "sm_90a"
    assert artifact.compiled_obj.name_expression == "naive_gemm<float, 32>"
    # metadata filters work on user kernels as on any other
    assert len(kernel_api.get_kernels(args, cc=90, metadata_filter=lambda m: m.kernel_name.endswith("16"))) >= 1


def test_user_kernel_rejections(user_gemm):
    bf16 = GemmArguments(torch.randn(8, 8).bfloat16(), torch.randn(8, 8).bfloat16(), torch.empty(8, 8).bfloat16())
    assert not any(isinstance(k, user_gemm) for k in kernel_api.get_kernels(bf16, cc=90))
    batched = GemmArguments(torch.randn(2, 8, 8), torch.randn(2, 8, 8), torch.empty(2, 8, 8))
    assert not any(isinstance(k, user_gemm) for k in kernel_api.get_kernels(batched, cc=90))
    reasons = [r.reason for r in kernel_api.explain(bf16, cc=90) if r.kernel_class == "UserNaiveGemm"]
    assert reasons and all("dtype" in r for r in reasons)


def test_registration_needs_a_launch_config():
    class NoLaunch(CudaSourceKernel):
        source = GEMM_SOURCE
        kernel_name = "naive_gemm<float, 16>"
        supported_args_type = GemmArguments

    with pytest.raises(RegistrationError, match="launch_config"):
        CudaSourceProvider.register(NoLaunch)


def test_user_source_that_does_not_compile():
    @CudaSourceProvider.register
    class Broken(CudaSourceKernel):
        source = "__global__ void broken(float* y) { y[0] = undefined_name; }\n"
        kernel_name = "broken"
        supported_args_type = GemmArguments
        operands = GemmOperandsMetadata(_f32_row(), _f32_row(), _f32_row(), torch.float32)

        def launch_config(self, args):
            return 1, 1

    try:
        kernel = Broken.generate_kernels(None, cc=90)[0]
        with pytest.raises(CompilationError, match=r"Broken\.cu\(1\).*undefined_name"):
            kernel.compile(_gemm_args(), cc=90)
    finally:
        CudaSourceProvider.unregister(Broken)


def test_kernel_name_not_in_source():
    class Misnamed(CudaSourceKernel):
        source = GEMM_SOURCE
        kernel_name = "naive_gem<float, 16>"
        supported_args_type = GemmArguments
        operands = GemmOperandsMetadata(_f32_row(), _f32_row(), _f32_row(), torch.float32)

        def launch_config(self, args):
            return 1, 1

    kernel = Misnamed.generate_kernels(None, cc=90)[0]
    with pytest.raises(CompilationError, match="not found in the source"):
        kernel.compile(_gemm_args(), cc=90)


def test_source_file_relative_to_module():
    from kernel_api.providers.cuda_src.kernels.softmax import CudaSoftmaxForward

    assert "namespace ka_softmax" in CudaSoftmaxForward.get_source()
    assert CudaSoftmaxForward.source_name() == "softmax.cu"


@pytest.mark.gpu
def test_user_gemm_runs_on_gpu(user_gemm):
    for M, N, K in [(70, 45, 33), (128, 256, 64), (1, 1, 1)]:
        args = _gemm_args(M, N, K, device="cuda")
        kernels = [k for k in kernel_api.get_kernels(args) if isinstance(k, user_gemm)]
        assert len(kernels) == 2
        ref = (args.A.double() @ args.B.double())
        for k in kernels:
            args.out.fill_(float("nan"))
            k.run(args)
            torch.cuda.synchronize()
            assert not args.out.isnan().any()
            rel = (args.out.double() - ref).norm() / ref.norm()
            assert rel < 1e-5, (k.metadata.kernel_name, M, N, K, rel.item())
        # an explicit stream and a precompiled artifact
        s = torch.cuda.Stream()
        art = kernels[0].compile(args)
        args.out.fill_(float("nan"))
        s.wait_stream(torch.cuda.current_stream())
        kernels[0].run(args, compiled_artifact=art, stream=s)
        s.synchronize()
        assert (args.out.double() - ref).norm() / ref.norm() < 1e-5


@pytest.mark.gpu
def test_launch_config_beyond_device_limits(user_gemm):
    class TooBig(user_gemm):
        def launch_config(self, args):
            return (1, 1), (64, 64)  # 4096 threads per block

    kernel = TooBig(user_gemm.make_metadata({"tile": 16}), {"tile": 16})
    args = _gemm_args(device="cuda")
    with pytest.raises(KernelLaunchError, match=r"UserNaiveGemm_tile16.*4096 threads"):
        kernel.run(args)

    class HugeSmem(user_gemm):
        def launch_config(self, args):
            return (1, 1), (16, 16), 10 * 1024 * 1024

    kernel = HugeSmem(user_gemm.make_metadata({"tile": 16}), {"tile": 16})
    with pytest.raises(KernelLaunchError, match="shared memory"):
        kernel.run(args)


@pytest.mark.gpu
def test_wrong_number_of_kernel_arguments(user_gemm):
    class Short(user_gemm):
        def kernel_arguments(self, args):
            return args.A, args.B, args.out

    kernel = Short(user_gemm.make_metadata({"tile": 16}), {"tile": 16})
    with pytest.raises(KernelLaunchError, match="takes 7 parameter"):
        kernel.run(_gemm_args(device="cuda"))
