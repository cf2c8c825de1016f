"""benchmarks/softmax_window_sweep.py's config parsing and define sets, and the copy-only build of
benchmarks/softmax_window_copyonly.py (its own artifact, no exps), without a GPU."""

from __future__ import annotations

import hashlib

import torch

from benchmark_modules import load
from kernel_api import SoftmaxArguments
from kernel_api.providers.cuda_src.kernels import softmax_window as sw


def _forward():
    return next(k for k in sw.CudaSoftmaxWindowForward.generate_kernels(None, cc=90)
                if k.dtype.to_torch() == torch.bfloat16)


def test_sweep_configs_take_six_to_eight_fields():
    sweep = load("softmax_window_sweep")
    assert sweep.parse_configs_any("default,256x8x3x2x3x1,512x4x3x1x0x0x2,0x0x0x0x0x0x0x2", (6, 7, 8)) == [
        (0,) * 6, (256, 8, 3, 2, 3, 1), (512, 4, 3, 1, 0, 0, 2), (0, 0, 0, 0, 0, 0, 0, 2)]
    assert sweep.DEFINE_SETS["cs"] == {} and set(sweep.DEFINE_SETS) >= {"wb", "na"}


def test_extra_defines_and_the_copy_only_build_are_their_own_artifacts():
    copyonly = load("softmax_window_copyonly")
    kernel = _forward()
    x = torch.empty(4, 2**20, dtype=torch.bfloat16)
    args = SoftmaxArguments(x, torch.empty_like(x))

    def cubin() -> str:
        return hashlib.sha1(kernel.compile(args, cc=90).compiled_obj.compiled.cubin).hexdigest()

    try:
        own_key, own = kernel.compile_key(args, 90), cubin()
        kernel.extra_defines = dict(copyonly.BUILDS["copy-only"])
        assert kernel.defines_for(args) == {"WN_MIN_BLOCKS": sw.MIN_BLOCKS, "WN_COPY_ONLY": 1}
        assert kernel.compile_key(args, 90) != own_key and cubin() != own
    finally:
        kernel.extra_defines = {}
    assert kernel.compile_key(args, 90) == own_key and copyonly.BUILDS["softmax"] == {}
