"""CuTe DSL softmax: buckets compiled for sm_90a on the CPU, artifact checks, lazy imports."""

import subprocess
import sys

import pytest
import torch

from kernel_api import SoftmaxArguments, SoftmaxBackwardArguments
from kernel_api.errors import UnsupportedArgumentsError
from kernel_api.providers.cutedsl.softmax.row_softmax import CuteSoftmaxBackward, CuteSoftmaxForward


def _by_name(cls, name):
    return next(k for k in cls.generate_kernels(None, cc=90) if k.metadata.kernel_name == name)


@pytest.mark.parametrize("cls,name,cols", [
    (CuteSoftmaxForward, "CuteSoftmaxForward_bf16_warp_a8", 1024),
    (CuteSoftmaxForward, "CuteSoftmaxForward_bf16_block_ept32_a8", 16384),
    (CuteSoftmaxBackward, "CuteSoftmaxBackward_f32_block_ept16_a1", 1000),
])
def test_buckets_compile_for_sm90a(cls, name, cols):
    kernel = _by_name(cls, name)
    x = torch.randn(3, cols).to(kernel.dtype.to_torch())
    args = (SoftmaxBackwardArguments(x, x.clone(), torch.empty_like(x)) if cls is CuteSoftmaxBackward
            else SoftmaxArguments(x, torch.empty_like(x)))
    assert kernel.supports(args, 90)
    artifact = kernel.compile(args, cc=90)
    assert artifact.compiled_obj is not None
    assert artifact.extra.capacity >= cols


def test_bucket_keys_and_capacity_check():
    kernel = _by_name(CuteSoftmaxForward, "CuteSoftmaxForward_f32_block_ept16_a4")
    a = SoftmaxArguments(torch.randn(2, 256), torch.empty(2, 256))
    b = SoftmaxArguments(torch.randn(2, 4096), torch.empty(2, 4096))
    assert kernel.compile_key(a, 90) != kernel.compile_key(b, 90)
    artifact = kernel.compile(a, cc=90)
    with pytest.raises(UnsupportedArgumentsError, match="rows of up to 512 elements"):
        kernel._run(b, artifact, None)


def test_long_rows_are_left_to_cuda_src():
    x = torch.randn(2, 65536, dtype=torch.bfloat16)
    args = SoftmaxArguments(x, torch.empty_like(x))
    bf16 = [k for k in CuteSoftmaxForward.generate_kernels(None, cc=90) if k.dtype.value == "bf16"]
    assert bf16
    for kernel in bf16:
        status = kernel.supports(args, 90)
        assert not status and "exceed" in status.error


def test_discovery_imports_no_toolchain():
    code = ("import sys, torch, kernel_api\n"
            "x = torch.randn(4, 4096, dtype=torch.bfloat16)\n"
            "ks = kernel_api.get_kernels(kernel_api.SoftmaxArguments(x, torch.empty_like(x)), cc=90)\n"
            "assert {k.metadata.provider for k in ks} == {'cutedsl', 'cuda_src', 'torch'}, ks\n"
            "print('cutlass' in sys.modules, 'cuda.core' in sys.modules)\n")
    import os

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                                       os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-2:] == ["False", "False"], out.stdout
