"""GEMMs past 2^31 elements on the GPU: M*K and M*N just past 2^31 (K = N = 64, f16), once per
kernel class. The kernels take 32-bit extents but 64-bit strides, so element offsets past
2^31 must be right; rows on both sides of element 2^31, the tail rows and random rows are
checked against a float64 reference of those rows only (the whole reference would be huge).
"""

from __future__ import annotations

import pytest
import torch

import kernel_api
from kernel_api import GemmArguments
from kernel_api.tuning.policies import rank_candidates

pytestmark = pytest.mark.gpu

M = 2**31 // 64 + 4096  # 33,558,528 rows: A and out hold 2^31 + 2^18 elements each
K = N = 64
NEEDS = {"SimtGemm": 70, "Sm80TensorOpGemm": 80, "Sm90WarpSpecializedGemm": 90}


@pytest.fixture(scope="module")
def operands():
    free, _ = torch.cuda.mem_get_info()
    if free < 16 * 2**30:
        pytest.skip("needs about 16 GiB of free GPU memory")
    g = torch.Generator(device="cuda")
    g.manual_seed(1234)
    A = torch.randn(M, K, device="cuda", dtype=torch.float16, generator=g)
    B = torch.randn(K, N, device="cuda", dtype=torch.float16, generator=g)
    yield A, B
    del A, B
    torch.cuda.empty_cache()


def _rows_to_check() -> torch.Tensor:
    boundary = 2**31 // K  # the row holding element 2^31 of A and of out
    fixed = torch.cat([torch.arange(0, 256), torch.arange(boundary - 256, boundary + 256), torch.arange(M - 8192, M)])
    random = torch.randint(0, M, (4096,), generator=torch.Generator().manual_seed(99))
    return torch.cat([fixed, random]).unique().cuda()


@pytest.mark.parametrize("cls", sorted(NEEDS))
def test_gemm_past_2_31_elements(cls, operands):
    major, minor = torch.cuda.get_device_capability()
    cc = major * 10 + minor
    if cc < NEEDS[cls] or (cls == "Sm90WarpSpecializedGemm" and cc != 90):
        pytest.skip(f"{cls} does not run on sm_{cc}")
    A, B = operands
    out = torch.full((M, N), float("nan"), device="cuda", dtype=torch.float16)
    args = GemmArguments(A, B, out, accumulator_type=torch.float32)
    assert args.M * args.K > 2**31 and args.M * args.N > 2**31
    kernels = kernel_api.get_kernels(args, metadata_filter=lambda m: m.kernel_class.__name__ == cls)
    assert kernels, kernel_api.explain(args)
    kernel = rank_candidates(kernels, args)[0]
    kernel.run(args, compiled_artifact=kernel.compile(args))
    torch.cuda.synchronize()
    assert not torch.isnan(out).any().item(), f"{kernel.metadata.kernel_name} left rows unwritten"
    rows = _rows_to_check()
    expected = A[rows].double() @ B.double()
    torch.testing.assert_close(out[rows].double(), expected, rtol=1e-2, atol=2e-2,
                               msg=lambda m: f"{kernel.metadata.kernel_name}: {m}")
    del out, args
    torch.cuda.empty_cache()
