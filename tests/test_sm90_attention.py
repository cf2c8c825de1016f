"""kernel_api's Hopper attention forward (cutedsl: attention/sm90_attention.py) without a GPU:
discovery and names, what it declines and why (`explain`), its launch's form, its ranking, and
compiles for sm_90a, for the dense and the variable-length layouts. The GPU half is
tests/test_sm90_attention_gpu.py."""

from __future__ import annotations

import pytest
import torch

import kernel_api
from kernel_api.arguments.attention import AttentionArguments
from kernel_api.core.artifact import CompiledArtifact
from kernel_api.providers.cutedsl.attention.sm90_attention import MAX_EXTENT, Plan, Sm90Attention, plan
from kernel_api.tuning.pick_any import rank_candidates


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


def _varlen_args(batch=3, total_q=1000, total_k=1200, max_q=700, max_k=800, hq=8, hkv=2, d=128,
                 dtype=torch.bfloat16, causal=True, lse=False, q=None, **kw):
    """Variable-length arguments on the meta device (offsets not read: the longest lengths given)."""
    q = _meta((total_q, hq, d), dtype) if q is None else q
    k = _meta((total_k, hkv, d), dtype)
    cu = torch.empty(batch + 1, dtype=torch.int32, device="meta")
    return AttentionArguments(q, k, k, _meta(tuple(q.shape), dtype),
                              _meta((hq, q.shape[0]), torch.float32) if lse else None, causal=causal,
                              cu_seqlens_q=cu, cu_seqlens_k=cu.clone(), max_seqlen_q=max_q, max_seqlen_k=max_k, **kw)


def _ours(args):
    return [k for k in kernel_api.get_kernels(args, cc=90) if isinstance(k, Sm90Attention)]


def test_one_instance_per_layout_dtype_and_head_dim_for_sm90_only():
    names = sorted(k.metadata.kernel_name for k in Sm90Attention.generate_kernels(None, cc=90))
    assert names == sorted(f"Sm90Attention_{t}_d{d}{layout}" for layout in ("", "_varlen") for t in ("bf16", "f16")
                           for d in (64, 128))
    assert [k.varlen for k in Sm90Attention.generate_kernels(None, cc=90)] == [False] * 4 + [True] * 4
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
    assert reasons == ["head_dim 96 not in (128,)", "head_dim 96 not in (64,)"] + \
        ["operand q: dense layout but the kernel takes variable-length"] * 2
    q = _meta((2, 100, 8, 64), offset=1)  # a pointer 2 bytes past a 16-byte boundary
    assert not _ours(_args(q=q, d=64))
    lengths = torch.zeros(2, dtype=torch.int32, device="meta")
    cached = _args(lq=1, lk=64, cache_seqlens=lengths)
    assert not _ours(cached)
    assert "operand cache_seqlens: the kernel reads no per-row KV cache lengths" in \
        _verdicts(cached)["Sm90Attention_bf16_d128"].error
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


@pytest.mark.parametrize("kw", [dict(), dict(d=64, causal=False, lse=True), dict(hkv=1, dtype=torch.float16),
                                dict(hkv=8, max_q=1, max_k=5000), dict(batch=1, total_q=3, total_k=0, max_q=3, max_k=0),
                                dict(max_q=5000, max_k=3)])
def test_found_for_variable_length_problems(kw):
    found = _ours(_varlen_args(**kw))
    assert [k.metadata.kernel_name for k in found] == [f"Sm90Attention_{'f16' if kw.get('dtype') else 'bf16'}"
                                                       f"_d{kw.get('d', 128)}_varlen"]


def test_variable_length_declines_with_reasons():
    """The packed layout's limits: 16-byte pointers and strides, the 32-bit longest query
    sequence and tile count; and each layout's instances decline the other's problems."""
    verdicts = _verdicts(_varlen_args(d=64))
    assert [name for name, status in verdicts.items() if status] == ["Sm90Attention_bf16_d64_varlen"]
    assert verdicts["Sm90Attention_bf16_d64"].error == "operand q: variable-length layout but the kernel takes dense"
    assert _verdicts(_args(d=64))["Sm90Attention_bf16_d64_varlen"].error == \
        "operand q: dense layout but the kernel takes variable-length"
    misaligned = _meta((1000, 8, 64), offset=1)  # a pointer 2 bytes past a 16-byte boundary
    reason = _verdicts(_varlen_args(d=64, q=misaligned))["Sm90Attention_bf16_d64_varlen"].error
    assert reason.startswith("operand q")
    # rows 8 * 64 + 4 elements apart: a row stride that is no 16-byte multiple
    rows = _meta((1000, 8 * 64 + 4))[:, :8 * 64].view(1000, 8, 64)
    reason = _verdicts(_varlen_args(d=64, q=rows))["Sm90Attention_bf16_d64_varlen"].error
    assert reason.startswith("operand q")
    kernel = Sm90Attention.generate_kernels(lambda m: m.kernel_name == "Sm90Attention_bf16_d64_varlen", cc=90)[0]
    # (a max_seqlen_q past the packed tokens is held at their count: the grid and plan follow it)
    generous = _varlen_args(d=64, hq=1, hkv=1, max_q=MAX_EXTENT + 1, max_k=10)
    assert generous.seqlen_q == 1000 and kernel.supports(generous)
    assert kernel.plan(generous) == plan(64, True, 1000, 132)
    status = kernel.supports(_varlen_args(d=64, hq=1, hkv=1, total_q=MAX_EXTENT + 1, max_q=MAX_EXTENT + 1, max_k=10))
    assert not status and "operand q: an extent of 2,147,483,456 exceeds the 32-bit limit less a tile" in status.error
    assert kernel.supports(_varlen_args(d=64, hq=1, hkv=1, total_q=MAX_EXTENT, max_q=MAX_EXTENT, max_k=10))
    # 2^14 sequences x 2^11 heads x 32 blocks of the longest sequence's queries: 2^30 tiles
    many = dict(d=64, hq=1 << 11, hkv=1 << 11, total_q=1 << 26, total_k=1 << 26, max_q=1 << 12)
    status = kernel.supports(_varlen_args(batch=1 << 14, **many))
    assert not status and "tiles of 128 queries exceed the 32-bit tile index's limit" in status.error
    assert kernel.supports(_varlen_args(batch=(1 << 14) - 1, **many))


def test_variable_length_ranks_ahead_of_torchs_and_behind_the_decode_kernel():
    """Variable-length prefill ranks ahead of torch's FlashAttention-2 and SDPA (which runs the
    sequences one by one); decoding (a few queries a sequence) stays with the decode kernel."""
    for causal in (False, True):
        for d in (64, 128):
            for lse in (False, True):
                args = _varlen_args(d=d, causal=causal, lse=lse)
                names = [k.metadata.kernel_name for k in rank_candidates(kernel_api.get_kernels(args, cc=90), args, 132)]
                assert names[0] == f"Sm90Attention_bf16_d{d}_varlen", names
                assert any(name.startswith("TorchAttention") for name in names)
    decode = _varlen_args(batch=64, total_q=64, total_k=64 * 4096, max_q=1, max_k=4096, causal=False)
    ranked = rank_candidates(kernel_api.get_kernels(decode, cc=90), decode, 132)
    assert ranked[0].metadata.kernel_name == "CudaAttentionDecode_bf16_d128_varlen"


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
    # (the compiled function's variable-length parameters are None in a dense call, before the stream)
    assert kernel._launcher(_args(d=64), artifact).tail == (None, 64 ** -0.5, None, None, None)
    assert kernel._launcher(_args(d=64, lse=True, scale=0.25), artifact).tail == (0.25, None, None, None)
    assert kernel._launcher(_args(d=64, lk=0), artifact) is None
    varlen = Sm90Attention.generate_kernels(lambda m: m.kernel_name == "Sm90Attention_bf16_d64_varlen", cc=90)[0]
    # (the sequence offsets are no operand of a recorded launch: every call goes through _run)
    assert varlen._launcher(_varlen_args(d=64), CompiledArtifact(lambda *a: None, varlen)) is None


def test_compile_key_holds_the_mask_the_lse_and_the_layout_only():
    kernel = Sm90Attention.generate_kernels(None, cc=90)[0]
    assert kernel.compile_key(_args(lq=1025, lk=9), 90) == kernel.compile_key(_args(lq=4000, lk=17, hkv=8), 90)
    assert kernel.compile_key(_args(), 90) != kernel.compile_key(_args(causal=False), 90)
    assert kernel.compile_key(_args(), 90) != kernel.compile_key(_args(lse=True), 90)


def test_variable_length_plans_and_compiles_by_the_longest_query_sequence():
    kernel = _ours(_varlen_args(d=64))[0]
    for causal, longest in ((True, 1024), (True, 1025), (False, 300)):
        args = _varlen_args(d=64, causal=causal, total_q=4000, total_k=4000, max_q=longest, max_k=longest)
        assert kernel.plan(args) == plan(64, causal, longest, 132)
    short = _varlen_args(d=64, max_q=1000)
    long = _varlen_args(d=64, total_q=4000, total_k=4000, max_q=3000, max_k=3000)
    assert kernel.compile_key(short, 90) == kernel.compile_key(_varlen_args(d=64, total_q=77, max_q=9, max_k=1), 90)
    assert kernel.compile_key(short, 90) != kernel.compile_key(long, 90)
    dense = _ours(_args(d=64))[0]
    assert dense.compile_key(_args(d=64), 90) != kernel.compile_key(_varlen_args(d=64, max_q=1000), 90)


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


@pytest.mark.parametrize("kw, expected_plan", [
    (dict(d=64, lse=True), Plan(128, 132)),
    (dict(d=64, causal=False), Plan(192, 132)),
    (dict(d=64, total_q=4000, total_k=4000, max_q=3000, max_k=3000), Plan(192, 0)),
    (dict(total_q=4000, total_k=4000, max_q=3000, max_k=3000, lse=True), Plan(128, 0)),
    (dict(causal=False, hkv=1, lse=True), Plan(128, 132)),
    (dict(dtype=torch.float16, hkv=8), Plan(128, 132)),
], ids=["d64_causal_two_consumers_persistent_lse", "d64_full_three_consumers_persistent",
        "d64_causal_three_consumers_a_cta_per_tile", "d128_causal_a_cta_per_tile_lse", "d128_full_mqa_persistent_lse",
        "f16_d128_causal_persistent"])
def test_variable_length_compiles_for_sm90a_without_a_gpu(kw, expected_plan):
    pytest.importorskip("cutlass")
    args = _varlen_args(**kw)
    kernel = _ours(args)[0]
    assert kernel.varlen and kernel.plan(args) == expected_plan
    artifact = kernel.compile(args, cc=90)
    assert artifact.compiled_obj is not None and artifact.cc == 90
