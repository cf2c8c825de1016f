"""PickBest on the GPU: wrong or non-compiling candidates are skipped and reported, the
winner is recorded, and a later tuner (as a later process would) reuses the record."""

import pytest
import torch

import kernel_api
from kernel_api import GemmArguments, GemmOperandsMetadata, TensorAttributes
from kernel_api.providers.cuda_src import CudaSourceProvider
from kernel_api.providers.cuda_src.kernel import CudaSourceKernel
from kernel_api.tuning.records import TuningRecords
from kernel_api.tuning.policies import PickBest
from kernel_api.status import Status

pytestmark = pytest.mark.gpu

SOURCE = r"""
__global__ void tuned_gemm(const float* A, const float* B, float* C, int M, int N, int K, float scale) {
  int m = blockIdx.y * 16 + threadIdx.y, n = blockIdx.x * 16 + threadIdx.x;
  if (m < M && n < N) {
    float acc = 0.f;
    for (int k = 0; k < K; ++k) acc += A[m * K + k] * B[k * N + n];
    C[m * N + n] = scale * acc;
  }
}
"""
ROW = (0, 0, 1)


def _operands():
    return GemmOperandsMetadata(*(TensorAttributes(torch.float32, ROW, 1) for _ in range(3)), accumulator_type="f32")


def _make(name, source, scale):
    class Candidate(CudaSourceKernel):
        kernel_name = "tuned_gemm"
        operands = _operands()

        def _supports(self, args: GemmArguments) -> Status:
            return Status.success() if args.L == 1 else Status.fail("2-D only")

        def launch_config(self, args):
            return ((args.N + 15) // 16, (args.M + 15) // 16), (16, 16)

        def kernel_arguments(self, args):
            return args.A, args.B, args.out, args.M, args.N, args.K, scale

    Candidate.source = source
    Candidate.__name__ = Candidate.__qualname__ = name
    return CudaSourceProvider.register(Candidate)


@pytest.fixture
def candidates():
    classes = [_make("CorrectGemm", SOURCE, 1.0), _make("WrongGemm", SOURCE, 2.0),
               _make("BrokenGemm", SOURCE.replace("acc +=", "acc +== ;"), 1.0)]
    yield classes
    for c in classes:
        CudaSourceProvider.unregister(c)


def _args():
    A, B = torch.randn(96, 80, device="cuda"), torch.randn(80, 72, device="cuda")
    return GemmArguments(A, B, torch.empty(96, 72, device="cuda"), accumulator_type=torch.float32)


def test_pick_best_skips_wrong_and_broken_candidates_and_records(tmp_path, candidates):
    args = _args()
    pool = kernel_api.get_kernels(args, providers="cuda_src",
                                  metadata_filter=lambda m: m.kernel_class in candidates)
    assert sorted(k.metadata.kernel_name.split("_")[0] for k in pool) == ["BrokenGemm", "CorrectGemm", "WrongGemm"]
    records = TuningRecords(tmp_path / "tuning.sqlite")
    result = PickBest(num_workers=1, records=records).tune(args, pool)
    assert result.winner.metadata.kernel_class.__name__ == "CorrectGemm" and not result.from_record
    failures = {m.kernel_name.split("_")[0]: m.failure for m in result.measurements if m.failure}
    assert "wrong result" in failures["WrongGemm"]
    assert "CompilationError" in failures["BrokenGemm"]
    # A new tuner over the same records (a later process) takes the record without measuring.
    again = PickBest(num_workers=1, records=TuningRecords(tmp_path / "tuning.sqlite")).tune(args, pool)
    assert again.from_record and again.winner.metadata.kernel_name == result.winner.metadata.kernel_name
    # ...and the chosen kernel computes the right thing on the caller's data.
    args.out.fill_(float("nan"))
    again.winner.run(args)
    torch.testing.assert_close(args.out, args.A @ args.B, rtol=1e-4, atol=1e-4)


def test_ops_gemm_with_pick_best_matches_torch(tmp_path, monkeypatch):
    monkeypatch.setenv("KERNEL_API_CACHE_DIR", str(tmp_path))
    A = torch.randn(256, 192, device="cuda", dtype=torch.bfloat16)
    B = torch.randn(192, 320, device="cuda", dtype=torch.bfloat16)
    with kernel_api.settings(policy=PickBest(num_workers=4, max_candidates=6)):
        out = kernel_api.ops.gemm(A, B)
    ref = A.double() @ B.double()
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-2
