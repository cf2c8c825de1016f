"""The seed notebook's code (tests/seed/seed_notebook.py) works with kernel_api."""

import pytest
import torch

import kernel_api

seed = pytest.importorskip("seed_notebook")


def test_notebook_discovery_and_compile_without_gpu():
    kernels, args, *_ = seed.run_notebook("cpu")
    names = [k.metadata.kernel_name for k in kernels]
    assert names == ["F64GemmKernel_tile32x32_ttt", "F64GemmKernel_tile16x16_ttt"]
    assert all(k.metadata.provider == "cutedsl" for k in kernels)
    artifact = kernels[0].compile(args, cc=90)
    assert isinstance(artifact, kernel_api.CompiledArtifact)
    assert artifact.kernel is kernels[0] and artifact.cc == 90
    assert kernel_api.get_kernels(args, metadata_filter=seed.my_filter) == []


def test_notebook_kernel_rejects_rank2_with_its_reason():
    A, B, out = (torch.randn(8, 8, dtype=torch.float64) for _ in range(3))
    args = kernel_api.GemmArguments(A, B, out, accumulator_type=torch.float64)
    assert kernel_api.get_kernels(args, metadata_filter=seed.is_f64gemm_kernel) == []
    reasons = {r.reason for r in kernel_api.explain(args) if r.kernel_class == "F64GemmKernel"}
    assert "All operands must be rank 3." in reasons


@pytest.mark.gpu
def test_notebook_runs_and_matches_torch():
    kernels, args, A, B, out = seed.run_notebook("cuda")
    out.fill_(float("nan"))
    kernels[0].run(args)
    torch.testing.assert_close(out, A @ B)
    # A second instance, an explicit artifact and an explicit stream.
    out.fill_(float("nan"))
    artifact = kernels[1].compile(args)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    kernels[1].run(args, compiled_artifact=artifact, stream=stream)
    stream.synchronize()
    torch.testing.assert_close(out, A @ B)


@pytest.mark.gpu
def test_notebook_kernel_on_other_shapes_reuses_artifact():
    kernels, args, *_ = seed.run_notebook("cuda")
    artifact = kernels[0].compile(args)
    for L, M, N, K in [(2, 33, 65, 17), (1, 1, 1, 1), (3, 100, 7, 250)]:
        A = torch.randn(L, M, K, device="cuda", dtype=torch.float64)
        B = torch.randn(L, K, N, device="cuda", dtype=torch.float64)
        out = torch.full((L, M, N), float("nan"), device="cuda", dtype=torch.float64)
        a2 = kernel_api.GemmArguments(A, B, out, accumulator_type=torch.float64)
        kernels[0].run(a2, compiled_artifact=artifact)
        torch.testing.assert_close(out, A @ B)
