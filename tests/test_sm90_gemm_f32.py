"""CPU checks of the f32 instances of `Sm90WarpSpecializedGemm` (tf32 and 3xTF32 math) and of
the f32 precision rule of `kernel_api.ops` (candidate filtering and cache keys)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch

import kernel_api
from kernel_api.dtypes import DataType
from kernel_api.ops import dispatch
from kernel_api.providers.cutedsl.gemm.sm90_warpspecialized import (
    TF32_CONFIGS, TF32X3_CONFIGS, Sm90WarpSpecializedGemm, split3_row_words)
from kernel_api.tuning.policies import rank_candidates

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _f32_args(b_column_major=True, M=256, N=200, K=100, L=None):
    batch = (L,) if L else ()
    A = torch.randn(*batch, M, K)
    B = torch.randn(*batch, N, K).transpose(-1, -2) if b_column_major else torch.randn(*batch, K, N)
    return kernel_api.GemmArguments(A, B, torch.empty(*batch, M, N), accumulator_type=torch.float32)


@pytest.fixture
def tf32_flag():
    saved = torch.backends.cuda.matmul.allow_tf32
    yield
    torch.backends.cuda.matmul.allow_tf32 = saved


def test_discovery_lists_tf32_and_3xtf32_instances():
    kernels = Sm90WarpSpecializedGemm.generate_kernels(lambda m: m.operands.A.dtype is DataType.f32, cc=90)
    tf32 = [k for k in kernels if k.metadata.operands.math_type is DataType.tf32]
    x3 = [k for k in kernels if k.metadata.operands.math_type is DataType.tf32x3]
    assert len(tf32) + len(x3) == len(kernels)
    # tf32: K-major A and B only (row-major A, column-major B), either out layout
    assert {(k.metadata.operands.A.layout, k.metadata.operands.B.layout) for k in tf32} == {("t", "n")}
    assert len(tf32) == 2 * len(TF32_CONFIGS)
    # 3xTF32: every layout, any A/B alignment (the pre-pass reads them), no stream-K; the wgmma
    # accumulator promoted into registers, so each consumer warpgroup holds 64 x 128 twice
    assert len(x3) == 8 * len(TF32X3_CONFIGS) and not any(k.config.stream_k for k in x3)
    for k in x3:
        tm, tn = k.config.tile_mn
        assert k.config.promote_every >= 1 and f"_promote{k.config.promote_every}_" in k.name
        assert tm * tn // (1 if k.config.schedule == "pingpong" else 2) == 64 * 128
    assert not any(k.config.promote_every for k in tf32)
    for k in kernels:
        ops, d = k.metadata.operands, k.metadata.design
        assert ops.B.dtype is ops.out.dtype is DataType.f32 and ops.accumulator_type is DataType.f32
        assert d.tile_shape[2] == 32 and f"x32_cluster" in k.name
        assert f"_{ops.math_type}_f32acc_" in k.name
        assert ops.out.divisibility == 4
        assert ops.A.divisibility == (1 if ops.math_type is DataType.tf32x3 else 4)
        assert str(ops.math_type) in ("tf32", "tf32x3")
    assert DataType("tf32x3") is DataType.tf32x3 and kernel_api.dtypes.to_dtype("3xtf32") is DataType.tf32x3
    assert DataType.tf32x3.to_torch() is torch.float32
    # the documented filter leaves them out
    assert not Sm90WarpSpecializedGemm.generate_kernels(
        lambda m: m.operands.A.dtype is DataType.f32 and not str(m.operands.math_type).startswith("tf32"), cc=90)


def test_get_kernels_by_layout():
    def sm90_f32(args):
        return [k for k in kernel_api.get_kernels(args, cc=90) if isinstance(k, Sm90WarpSpecializedGemm)]
    tn = {k.metadata.operands.math_type for k in sm90_f32(_f32_args(True, L=2))}
    assert tn == {DataType.tf32, DataType.tf32x3}
    # B row-major (N-major): the tf32 wgmma cannot read it, 3xTF32 can
    tt = {k.metadata.operands.math_type for k in sm90_f32(_f32_args(False))}
    assert tt == {DataType.tf32x3}
    # K = 101 (A's rows 404 bytes): no TMA for A, but 3xTF32 takes it
    odd = {k.metadata.operands.math_type for k in sm90_f32(_f32_args(True, K=101))}
    assert odd == {DataType.tf32x3}


def test_workspace_size_and_cost():
    args = _f32_args(True, M=300, N=200, K=101, L=3)
    k = next(k for k in kernel_api.get_kernels(args, cc=90) if isinstance(k, Sm90WarpSpecializedGemm))
    assert k.metadata.operands.math_type is DataType.tf32x3
    assert split3_row_words(101) == 304 and split3_row_words(100) == 300
    assert k.get_workspace_size(args) == 4 * 304 * (300 + 200) * 3
    assert not k.workspace_free and k._launcher(args, None) is None
    # PickAny: tf32 wgmma first when allowed; 3xTF32 costs about 3.3x the same tile's tf32
    args = _f32_args(True, M=4096, N=4096, K=4096)
    ranked = rank_candidates(kernel_api.get_kernels(args, cc=90), args)
    assert ranked[0].metadata.operands.math_type is DataType.tf32 and isinstance(ranked[0], Sm90WarpSpecializedGemm)
    x3 = next(k for k in ranked if k.metadata.operands.math_type is DataType.tf32x3)
    assert x3.estimated_cost(args, 132) > 3 * ranked[0].estimated_cost(args, 132) if ranked[0].estimated_cost(
        args, 132) else True


def test_precision_rule_filters_candidates(tf32_flag):
    args = _f32_args(True, M=4096, N=4096, K=4096)
    found = kernel_api.get_kernels(args, cc=90)
    strict = dispatch.allowed_math(found, False)
    assert strict and all(k.metadata.operands.math_type is DataType.f32 for k in strict)
    assert dispatch.allowed_math(found, True) == found
    assert rank_candidates(strict, args)[0].metadata.operands.math_type is DataType.f32
    assert rank_candidates(dispatch.allowed_math(found, True), args)[0].metadata.operands.math_type is DataType.tf32
    # bf16 kernels are untouched
    bf = torch.randn(64, 64).bfloat16()
    bf_found = kernel_api.get_kernels(kernel_api.GemmArguments(bf, bf, bf.clone()), cc=90)
    assert dispatch.allowed_math(bf_found, False) == bf_found


def test_precision_setting_is_in_the_fast_cache_key(tf32_flag):
    A, B, out = torch.randn(8, 8), torch.randn(8, 8), torch.empty(8, 8)
    torch.backends.cuda.matmul.allow_tf32 = False
    strict = dispatch._raw_gemm_key(None, A, B, out)
    torch.backends.cuda.matmul.allow_tf32 = True
    loose = dispatch._raw_gemm_key(None, A, B, out)
    assert strict != loose
    torch.set_float32_matmul_precision("highest")
    assert dispatch._raw_gemm_key(None, A, B, out) == strict
    torch.set_float32_matmul_precision("medium")
    assert dispatch._raw_gemm_key(None, A, B, out) == loose
    h = A.half()
    torch.backends.cuda.matmul.allow_tf32 = False
    key16 = dispatch._raw_gemm_key(None, h, h, h)
    torch.backends.cuda.matmul.allow_tf32 = True
    assert dispatch._raw_gemm_key(None, h, h, h) == key16  # only f32 keys carry the setting


_COMPILE = textwrap.dedent("""
    import torch, kernel_api
    from kernel_api.providers.cutedsl.gemm.sm90_warpspecialized import Sm90WarpSpecializedGemm
    A = torch.randn(2, 256, 100); B = torch.randn(2, 256, 100).transpose(-1, -2); out = torch.empty(2, 256, 256)
    args = kernel_api.GemmArguments(A, B, out, accumulator_type=torch.float32)
    for math in ("tf32", "tf32x3"):
        k = [k for k in kernel_api.get_kernels(args, cc=90) if isinstance(k, Sm90WarpSpecializedGemm)
             and str(k.metadata.operands.math_type) == math
             and ("pingpong_swz8m" if math == "tf32" else "cooperative_swz8m") in k.name][0]
        assert k.compile(args, cc=90).cc == 90
        print("compiled", k.name)
""")


def test_compile_tf32_and_3xtf32_for_sm90a(tmp_path):
    env = {**os.environ, "PYTHONPATH": ROOT, "CUTE_DSL_KEEP": "ptx", "CUTE_DSL_DUMP_DIR": str(tmp_path),
           "KERNEL_API_CACHE": "0"}
    proc = subprocess.run([sys.executable, "-c", _COMPILE], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("compiled") == 2
    ptxs = [(tmp_path / p).read_text() for p in sorted(os.listdir(tmp_path)) if p.endswith(".ptx")]
    assert len(ptxs) == 2
    for ptx in ptxs:
        assert "wgmma.mma_async.sync.aligned.m64n128k8.f32.tf32.tf32" in ptx and "cp.async.bulk.tensor" in ptx
    split = [p for p in ptxs if "cvt.rna.tf32.f32" in p]
    assert len(split) == 1 and "_split_kernel" in split[0]  # the 3xTF32 pre-pass
    # 3xTF32 promotes: once a k-tile's wgmmas are done, FADDs into the register accumulator
    promote = re.compile(r"wgmma\.wait_group\.sync\.aligned\s+0;\s*add\.f32")
    assert promote.search(split[0])
    assert not any(promote.search(p) for p in ptxs if p is not split[0])  # tf32: as before
