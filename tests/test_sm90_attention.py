"""kernel_api's Hopper attention forward (cutedsl: attention/sm90_attention.py) without a GPU:
discovery and names, what it declines and why (`explain`), its launch's form, and compiles for
sm_90a. The GPU half is tests/test_sm90_attention_gpu.py."""

from __future__ import annotations

import pytest
import torch

import kernel_api
from kernel_api.arguments.attention import AttentionArguments
from kernel_api.core.artifact import CompiledArtifact
from kernel_api.providers.cutedsl.attention.sm90_attention import Plan, Sm90Attention, plan


def _meta(shape, dtype=torch.bfloat16, offset=0):
    n = 1
    for s in shape:
        n *= s
    return torch.empty(n + offset, dtype=dtype, device="meta")[offset:].view(shape)


def _args(batch=2, lq=1000, lk=1000, hq=8, hkv=2, d=128, dtype=torch.bfloat16, causal=True, lse=False, q=None,
          **kw):
    q = _meta((batch, lq, hq, d), dtype) if q is None else q
    k = _meta((batch, lk, hkv, d), dtype)
    out = _meta(tuple(q.shape), dtype)
    return AttentionArguments(q, k, k, out, _meta((batch, hq, lq), torch.float32) if lse else None, causal=causal,
                              **kw)


def _ours(args):
    return [k for k in kernel_api.get_kernels(args, cc=90) if isinstance(k, Sm90Attention)]


def test_one_instance_per_dtype_and_head_dim_for_sm90_only():
    names = sorted(k.metadata.kernel_name for k in Sm90Attention.generate_kernels(None, cc=90))
    assert names == ["Sm90Attention_bf16_d128", "Sm90Attention_bf16_d64", "Sm90Attention_f16_d128",
                     "Sm90Attention_f16_d64"]
    assert Sm90Attention.generate_kernels(None, cc=80) == [] and Sm90Attention.generate_kernels(None, cc=100) == []
    assert Sm90Attention.generate_kernels(None, epilogue_args=object(), cc=90) == []


@pytest.mark.parametrize("kw", [dict(), dict(d=64, causal=False), dict(lq=77, lk=300, hkv=8, lse=True),
                                dict(lq=300, lk=77, hkv=1, dtype=torch.float16), dict(lq=1, lk=129)])
def test_found_for_dense_problems(kw):
    args = _args(**kw)
    found = _ours(args)
    assert [k.metadata.kernel_name for k in found] == [f"Sm90Attention_{'f16' if kw.get('dtype') else 'bf16'}"
                                                       f"_d{kw.get('d', 128)}"]


def _verdicts(args) -> dict:
    """Each instance's `supports(args)`, by kernel name."""
    return {k.metadata.kernel_name: k.supports(args) for k in Sm90Attention.generate_kernels(None, cc=90)}


def test_declines_with_reasons():
    cpu = torch.empty(2, 100, 8, 64, dtype=torch.bfloat16)
    status = _verdicts(AttentionArguments(cpu, cpu, cpu, cpu))
    assert not any(status.values()) and "on the CPU" in status["Sm90Attention_bf16_d64"].error
    assert not _ours(_args(d=96))  # head dims 64 and 128 only
    reasons = sorted(r.reason for r in kernel_api.explain(_args(d=96)) if r.kernel_class == "Sm90Attention"
                     and "bf16" in r.kernel_name)
    assert reasons == ["head_dim 96 not in (128,)", "head_dim 96 not in (64,)"]
    q = _meta((2, 100, 8, 64), offset=1)  # a pointer 2 bytes past a 16-byte boundary
    assert not _ours(_args(q=q, d=64))
    cu = torch.zeros(3, dtype=torch.int32, device="meta")
    varlen = AttentionArguments(_meta((10, 4, 64)), _meta((10, 4, 64)), _meta((10, 4, 64)), _meta((10, 4, 64)),
                                cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=7, max_seqlen_k=7)
    assert not _ours(varlen)
    lengths = torch.zeros(2, dtype=torch.int32, device="meta")
    assert not _ours(_args(lq=1, lk=64, cache_seqlens=lengths))
    expanded = _meta((2, 100, 1, 64)).expand(2, 100, 4, 64)
    q = _meta((2, 100, 4, 64))
    status = _verdicts(AttentionArguments(q, expanded, expanded, _meta((2, 100, 4, 64))))
    assert not any(status.values())
    assert "operand k: stride 0 in dim 2 of size 4" in status["Sm90Attention_bf16_d64"].error
    for scale in (-0.1, 0.0, 1e-300, 1e39):  # (the last two round to 0 and to infinity in float32)
        status = _verdicts(_args(scale=scale))
        assert not any(status.values())
        reason = status["Sm90Attention_bf16_d128"].error
        assert f"scale: {scale}, the kernel takes scales from 2^-126 to 2^127" in reason
    assert all(_verdicts(_args(scale=scale))["Sm90Attention_bf16_d128"] for scale in (2.0**-126, 1e-30, 1e30))
    kernel = Sm90Attention.generate_kernels(lambda m: m.kernel_name == "Sm90Attention_bf16_d64", cc=90)[0]
    for batch in (1 << 14, 1 << 16):  # 2^30 and 2^32 tiles: a tile index plus the grid's stride passes 2^31
        status = kernel.supports(_args(batch=batch, lq=1 << 12, lk=1, hq=1 << 11, hkv=1 << 11, d=64))
        assert not status and "tiles of 128 queries exceed the 32-bit tile index's limit" in status.error
    assert kernel.supports(_args(batch=(1 << 14) - 1, lq=1 << 12, lk=1, hq=1 << 11, hkv=1 << 11, d=64))


def test_plan_follows_the_measurements():
    assert plan(64, True, 1024, 132) == Plan(128, 132)    # short causal: 128 rows, persistent
    assert plan(64, True, 4096, 132) == Plan(192, 0)      # long causal: 192 rows, a CTA per tile
    assert plan(64, False, 1024, 132) == Plan(192, 132)   # full: persistent
    assert plan(128, True, 4096, 132) == Plan(128, 0)
    assert plan(128, False, 77, 78) == Plan(128, 78)
    kernel = _ours(_args(d=64, lq=333, lk=333))[0]
    assert kernel.compile_key(_args(d=64, lq=333, lk=333), 90) != kernel.compile_key(_args(d=64, lq=3333, lk=3333), 90)


def test_launch_takes_the_scale_after_the_tensors():
    kernel = Sm90Attention.generate_kernels(lambda m: m.kernel_name == "Sm90Attention_bf16_d64", cc=90)[0]
    artifact = CompiledArtifact(lambda *a: None, kernel)
    assert kernel._launcher(_args(d=64), artifact).tail == (None, 64 ** -0.5)
    assert kernel._launcher(_args(d=64, lse=True, scale=0.25), artifact).tail == (0.25,)
    assert kernel._launcher(_args(d=64, lk=0), artifact) is None


def test_compile_key_holds_the_mask_and_the_lse_only():
    kernel = Sm90Attention.generate_kernels(None, cc=90)[0]
    assert kernel.compile_key(_args(lq=1025, lk=9), 90) == kernel.compile_key(_args(lq=4000, lk=17, hkv=8), 90)
    assert kernel.compile_key(_args(), 90) != kernel.compile_key(_args(causal=False), 90)
    assert kernel.compile_key(_args(), 90) != kernel.compile_key(_args(lse=True), 90)


@pytest.mark.parametrize("kw", [dict(d=64, lse=True), dict(d=64, lq=3000, lk=3000, causal=False),
                                dict(d=64, lq=3000, lk=3000), dict(lq=3000, lk=3000, lse=True),
                                dict(lq=3000, lk=3000, causal=False)],
                         ids=["two_consumers_persistent_lse", "three_consumers_persistent",
                              "three_consumers_causal_a_cta_per_tile", "d128_causal_a_cta_per_tile_lse",
                              "d128_persistent"])
def test_compiles_for_sm90a_without_a_gpu(kw):
    pytest.importorskip("cutlass")
    args = _args(**kw)
    kernel = _ours(args)[0]
    artifact = kernel.compile(args, cc=90)
    assert artifact.compiled_obj is not None and artifact.cc == 90
