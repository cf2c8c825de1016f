"""CUDA C++ softmax (cuda_src provider): template buckets compiled for sm_90a on the CPU,
artifact/row-length checks, and compute-sanitizer memcheck on a GPU."""

import shutil

import pytest
import torch

from memcheck import run_memcheck

from kernel_api import SoftmaxArguments, SoftmaxBackwardArguments
from kernel_api.errors import UnsupportedArgumentsError
from kernel_api.providers.cuda_src.kernels.softmax import CudaSoftmaxBackward, CudaSoftmaxForward


def _by_name(cls, name):
    return next(k for k in cls.generate_kernels(None, cc=90) if k.metadata.kernel_name == name)


@pytest.mark.parametrize("name,cols,expect", [
    ("CudaSoftmaxForward_bf16_warp_a8", 1024, "fwd_warp<ka_softmax::BF16, 8, 4, 4>"),
    ("CudaSoftmaxForward_f32_warp_a1", 7, "fwd_warp<ka_softmax::F32, 1, 1, 4>"),
    ("CudaSoftmaxForward_bf16_block_ept32_a8", 16384, "fwd_block<ka_softmax::BF16, 8, 4, 512>"),
    ("CudaSoftmaxForward_f16_block_ept16_a8", 4096, "fwd_block<ka_softmax::F16, 8, 2, 256>"),
    ("CudaSoftmaxForward_bf16_looped_a8", 262144, "fwd_looped<ka_softmax::BF16, 8, 2, 512>"),
])
def test_forward_buckets_compile_for_sm90a(name, cols, expect):
    kernel = _by_name(CudaSoftmaxForward, name)
    dtype = kernel.dtype.to_torch()
    x = torch.randn(2, cols).to(dtype)
    args = SoftmaxArguments(x, torch.empty_like(x))
    assert kernel.supports(args, 90)
    artifact = kernel.compile(args, cc=90)
    launcher = artifact.compiled_obj
    assert launcher.name_expression.endswith(expect)
    assert launcher.compiled.arch == "sm_90a" and launcher.compiled.cubin[:4] == b"\x7fELF"
    assert artifact.extra.capacity is None or artifact.extra.capacity >= cols


@pytest.mark.parametrize("name,cols", [("CudaSoftmaxBackward_bf16_block_ept32_a8", 16384),
                                       ("CudaSoftmaxBackward_f16_warp_a1", 999),
                                       ("CudaSoftmaxBackward_f32_looped_a4", 100000)])
def test_backward_buckets_compile_for_sm90a(name, cols):
    kernel = _by_name(CudaSoftmaxBackward, name)
    dtype = kernel.dtype.to_torch()
    y = torch.randn(2, cols).to(dtype)
    args = SoftmaxBackwardArguments(y, y.clone(), torch.empty_like(y))
    assert kernel.supports(args, 90)
    assert kernel.compile(args, cc=90).compiled_obj.compiled.cubin[:4] == b"\x7fELF"


def test_compile_key_follows_the_row_length_bucket():
    kernel = _by_name(CudaSoftmaxForward, "CudaSoftmaxForward_bf16_block_ept16_a8")
    keys = {}
    for cols in (2048, 4096, 4000, 8192):
        x = torch.randn(2, cols, dtype=torch.bfloat16)
        keys[cols] = kernel.compile_key(SoftmaxArguments(x, torch.empty_like(x)), 90)
    assert keys[4096] == keys[4000] != keys[2048] != keys[8192]


def test_artifact_for_shorter_rows_is_refused():
    kernel = _by_name(CudaSoftmaxForward, "CudaSoftmaxForward_f32_block_ept16_a4")
    short = torch.randn(2, 256)
    artifact = kernel.compile(SoftmaxArguments(short, torch.empty_like(short)), cc=90)
    longer = torch.randn(2, 4096)
    with pytest.raises(UnsupportedArgumentsError, match="rows of up to 512 elements"):
        kernel._run(SoftmaxArguments(longer, torch.empty_like(longer)), artifact, None)


def test_row_limits_per_strategy():
    for kernel in CudaSoftmaxForward.generate_kernels(None, cc=90) + CudaSoftmaxBackward.generate_kernels(None, cc=90):
        d = kernel.metadata.design
        if kernel.strategy == "warp":
            assert d.max_cols == 1024 and d.threads_per_row == 32
        elif kernel.strategy == "block":
            assert d.max_cols == d.threads_per_row * kernel.ept
        else:
            assert d.max_cols is None
    assert not CudaSoftmaxForward.generate_kernels(None, cc=75)  # needs sm_80+ (bf16 conversions)


_SANITIZED = r"""
import torch, kernel_api
from kernel_api import SoftmaxArguments, SoftmaxBackwardArguments
torch.manual_seed(0)
cases = [(torch.bfloat16, 5, 1000, 0), (torch.bfloat16, 3, 4104, 0), (torch.float32, 3, 333, 0),
         (torch.float16, 2, 70001, 0), (torch.bfloat16, 9, 8, 0), (torch.float32, 2, 16384, 0),
         (torch.bfloat16, 3, 4097, 3), (torch.float32, 2, 70001, 1)]
n = 0
def at(rows, cols, dtype, offset):  # its own allocation, offset elements in: rows at any alignment
    return torch.randn(rows * cols + offset, device="cuda").to(dtype)[offset:].view(rows, cols)
for dtype, rows, cols, offset in cases:
    x = at(rows, cols, dtype, offset)
    out = at(rows, cols, dtype, offset)
    a = SoftmaxArguments(x, out)
    for k in kernel_api.get_kernels(a, providers="cuda_src"):
        k.run(a); n += 1
    gi = at(rows, cols, dtype, offset)
    b = SoftmaxBackwardArguments(x, out, gi)
    for k in kernel_api.get_kernels(b, providers="cuda_src"):
        k.run(b); n += 1
torch.cuda.synchronize()
print("launches", n)
"""


@pytest.mark.gpu
@pytest.mark.skipif(shutil.which("compute-sanitizer") is None, reason="compute-sanitizer not installed")
def test_memcheck_clean():
    """Every cuda_src softmax strategy on odd shapes under compute-sanitizer memcheck; the
    caching allocator is off so each tensor is its own allocation and overruns are caught."""
    assert "launches" in run_memcheck(_SANITIZED)


@pytest.mark.parametrize("family", ["CudaSoftmax", "CudaSoftmaxSplit", "CudaSoftmaxSmem"])
@pytest.mark.parametrize("backward", [False, True])
def test_each_family_launches_its_rows_with_the_row_parameters(monkeypatch, family, backward):
    """The grid, block, shared memory and parameters a family's run hands its launcher (CPU,
    a recording launcher): rows, the row pointers, extents and strides, strided input rows."""
    import importlib

    from kernel_api import SoftmaxArguments, SoftmaxBackwardArguments
    from kernel_api.kernel import CompiledArtifact

    module = importlib.import_module({"CudaSoftmax": "kernel_api.providers.cuda_src.kernels.softmax",
                                      "CudaSoftmaxSplit": "kernel_api.providers.cuda_src.kernels.softmax_split",
                                      "CudaSoftmaxSmem": "kernel_api.providers.cuda_src.kernels.softmax_smem"}[family])
    cls = getattr(module, family + ("Backward" if backward else "Forward"))
    rows, cols = 6, 4096
    wide = torch.zeros(rows, cols + 64, dtype=torch.float16)[:, :cols]  # row stride cols + 64
    if backward:
        args = SoftmaxBackwardArguments(wide, torch.zeros(rows, cols, dtype=torch.float16),
                                        torch.empty(rows, cols, dtype=torch.float16))
        params = (wide.data_ptr(), args.out.data_ptr(), args.grad_in.data_ptr(), rows, cols, cols + 64, cols, cols)
    else:
        args = SoftmaxArguments(wide, torch.empty(rows, cols, dtype=torch.float16))
        params = (wide.data_ptr(), args.out.data_ptr(), rows, cols, cols + 64, cols)
    kernel = next(k for k in cls.generate_kernels(None, cc=90) if k.supports(args, 90).error is None)
    calls = []

    class Recorder:
        def launch(self, stream, device, grid, block, smem, launch_params, **kw):
            calls.append((grid, block, smem, launch_params))

    monkeypatch.setattr(module, "stream_handle", lambda stream, device: 0)
    artifact = CompiledArtifact(Recorder(), kernel, 90, extra=kernel.launch_plan(args, None))
    kernel._run(args, artifact, None)
    config = kernel.launch_config(args)  # (grid, block[, shared memory])
    assert calls == [(config[0], config[1], config[2] if len(config) > 2 else 0, params)]
