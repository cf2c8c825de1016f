"""The CUDA C++ decode attention (cuda_src: attention_decode.py / attention_decode.cu) without a
GPU: discovery and names, metadata, what it declines and why (`explain`), the launch plan, the
ranking against torch's SDPA, and compiles for sm_90a through NVRTC. The GPU half is
tests/test_attention_decode_gpu.py."""

from __future__ import annotations

import pytest
import torch

import kernel_api
from kernel_api.arguments.attention import AttentionArguments
from kernel_api.providers.cuda_src.kernels.attention_decode import (MAX_SEQLEN_Q, CudaAttentionDecode, Tiling, plan,
                                                                    resident_ctas, shared_bytes)
from kernel_api.tuning.pick_any import rank_candidates


def _meta(shape, dtype=torch.bfloat16, offset=0):
    n = 1
    for s in shape:
        n *= s
    return torch.empty(n + offset, dtype=dtype, device="meta")[offset:].view(shape)


def _args(batch=64, lq=1, sk=1024, hq=32, hkv=8, d=128, dtype=torch.bfloat16, causal=False, k=None, **kw):
    q = _meta((batch, lq, hq, d), dtype)
    k = _meta((batch, sk, hkv, d), dtype) if k is None else k
    return AttentionArguments(q, k, k, _meta((batch, lq, hq, d), dtype), causal=causal, **kw)


def _ours(args, cc=90):
    return [k.metadata.kernel_name for k in kernel_api.get_kernels(args, cc=cc, providers="cuda_src")]


def _explained(args):
    return kernel_api.explain(args, cc=90).all()


def test_instances_per_dtype_head_dim_and_layout():
    names = [k.metadata.kernel_name for k in CudaAttentionDecode.generate_kernels(None, cc=90)]
    assert names == [f"CudaAttentionDecode_{t}_d{d}{layout}" for layout in ("", "_varlen") for t in ("bf16", "f16")
                     for d in (128, 64)]
    assert CudaAttentionDecode.generate_kernels(None, cc=80) == []  # thread-block clusters: sm_90


@pytest.mark.parametrize("dtype,d", [(torch.bfloat16, 128), (torch.float16, 64)])
def test_discovery_of_decode_shapes(dtype, d):
    name = f"CudaAttentionDecode_{'bf16' if dtype is torch.bfloat16 else 'f16'}_d{d}"
    for lq, hq, hkv, causal in ((1, 32, 8, False), (4, 32, 8, True), (16, 32, 1, True), (3, 8, 8, False)):
        assert _ours(_args(lq=lq, hq=hq, hkv=hkv, d=d, dtype=dtype, causal=causal)) == [name]


def test_a_kv_cache_view_is_taken_as_it_is():
    cache = _meta((4, 4096, 8, 128))
    assert _ours(_args(batch=4, sk=1000, k=cache[:, :1000])) == ["CudaAttentionDecode_bf16_d128"]
    packed = _meta((4, 4096, 2, 8, 128))  # k and v interleaved per token
    q = _meta((4, 1, 32, 128))
    args = AttentionArguments(q, packed[:, :77, 0], packed[:, :77, 1], _meta((4, 1, 32, 128)))
    assert _ours(args) == ["CudaAttentionDecode_bf16_d128"]


@pytest.mark.parametrize("args,reason", [
    (lambda: _args(lq=MAX_SEQLEN_Q + 1), "seqlen_q=17 above the decode kernel's 16"),
    (lambda: _args(d=96), "head_dim 96 not in"),
    (lambda: _args(dtype=torch.float32), "f32"),
    (lambda: _args(k=_meta((64, 1024, 8, 128), offset=4)), "k"),
])
def test_declines_with_a_reason(args, reason):
    a = args()
    assert _ours(a) == []
    text = _explained(a)
    assert "CudaAttentionDecode" in text and reason in text, text


def _varlen(max_q, d=64):
    cu = torch.empty(3, dtype=torch.int32, device="meta")
    q, k = _meta((40, 8, d)), _meta((30, 2, d))
    return AttentionArguments(q, k, k, _meta((40, 8, d)), cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max_q,
                              max_seqlen_k=20)


def test_variable_length_and_cpu_tensors():
    assert _ours(_varlen(4)) == ["CudaAttentionDecode_bf16_d64_varlen"]
    assert _ours(_varlen(4, d=128)) == ["CudaAttentionDecode_bf16_d128_varlen"]
    longest = _varlen(MAX_SEQLEN_Q + 1)
    assert _ours(longest) == [] and "seqlen_q=17 above" in _explained(longest)
    q, k = torch.zeros(1, 1, 4, 64, dtype=torch.float16), torch.zeros(1, 5, 2, 64, dtype=torch.float16)
    cpu = AttentionArguments(q, k, k, torch.empty_like(q))
    kernel = next(k for k in CudaAttentionDecode.generate_kernels(None, cc=90) if k.head_dim == 64
                  and k.dtype.name == "f16")
    status = kernel.supports(cpu, cc=90)
    assert not status and "on the CPU" in str(status.error)


@pytest.mark.skipif("lse" not in AttentionArguments.__slots__, reason="the arguments carry no lse")
def test_declines_a_requested_lse():
    q = _meta((2, 1, 8, 128))
    args = AttentionArguments(q, _meta((2, 100, 2, 128)), _meta((2, 100, 2, 128)), _meta((2, 1, 8, 128)),
                              torch.empty(2, 8, 1, device="meta"))
    assert _ours(args) == [] and "lse" in _explained(args)


def test_plan_fills_the_machine():
    gqa = plan(_args(sk=4096), 132)
    assert (gqa.mw, gqa.cl, gqa.row_blocks) == (1, 1, 1) and gqa.grid == 64 * 8
    assert plan(_args(sk=128), 132).cl == 1
    assert plan(_args(batch=8, sk=1024), 132).cl == 2
    assert plan(_args(batch=8, sk=64), 132).cl == 1  # one chunk: nothing to split
    assert plan(_args(batch=1, sk=4096), 132).cl == 8
    assert plan(_args(d=64, sk=4096), 132, tiling=Tiling(64, 3)).cl == 2  # 1.3 waves of long rows
    assert plan(_args(d=64, sk=512), 132, tiling=Tiling(64, 3)).cl == 1
    assert plan(_args(d=64, sk=4096, hkv=32), 132, tiling=Tiling(64, 3)).cl == 1  # 5.2 waves: not worth a merge
    assert plan(_args(hq=32, hkv=32), 132).cl == 1  # 2048 CTAs already
    mqa = plan(_args(batch=2, lq=16, hq=8, hkv=1, sk=1000), 132)
    assert (mqa.mw, mqa.row_blocks) == (4, 2)
    assert plan(_args(lq=2, hq=32, hkv=8), 132).mw == 1 and plan(_args(lq=8, hq=32, hkv=8), 132).mw == 2
    assert plan(_args(batch=1, sk=0), 132).cl == 1
    assert plan(_args(sk=4096), 132, splits=4).cl == 4
    assert shared_bytes(128) == 3 * 2 * 64 * 128 * 2


def test_tiling_sets_the_ring_and_the_ctas_an_sm_holds():
    assert shared_bytes(64, Tiling(128, 2)) == 2 * 2 * 128 * 64 * 2
    assert resident_ctas(128, Tiling(64, 3)) == 2 and resident_ctas(64, Tiling(64, 3)) == 3  # registers
    assert resident_ctas(64, Tiling(64, 3, 4)) == 4  # registers capped for four
    assert resident_ctas(64, Tiling(128, 3, 4)) == 2  # four 96 KB rings do not fit
    # the wave count follows the tiling: batch 64 x 8 KV heads fills one wave of four CTAs per SM
    assert plan(_args(d=64, sk=4096), 132, tiling=Tiling(64, 3, 4)).cl == 1
    assert plan(_args(d=64, sk=4096), 132, tiling=Tiling(128, 3)).tiling == Tiling(128, 3)


@pytest.mark.parametrize("fields,message", [((96, 3), "block_keys must be a multiple of 64"),
                                            ((0, 3), "block_keys must be an int >= 64"),
                                            ((64, 1), "stages must be an int >= 2"),
                                            ((64, 3, 0), "min_ctas must be an int >= 1"),
                                            ((64.0, 3), "block_keys must be an int")])
def test_a_bad_tiling_is_one_clear_error(fields, message):
    with pytest.raises(ValueError, match=message):
        Tiling(*fields)


def test_d64_tiling_follows_the_grid():
    d64 = dict(d=64, hq=32, hkv=8)
    assert plan(_args(**d64, sk=512), 132).tiling == Tiling(64, 3, 4)  # one wave of four CTAs per SM, short rows
    assert plan(_args(**d64, sk=4096), 132).tiling == Tiling(128, 3)  # one wave, long rows: 32 KB chunks
    assert plan(_args(**d64, sk=4096), 132).cl == 1
    assert plan(_args(**d64, batch=8, sk=4096), 132).tiling == Tiling(128, 3)  # a small grid, split
    assert plan(_args(**d64, batch=8, sk=4096), 132).cl == 2
    assert plan(_args(d=64, hq=32, hkv=32, sk=1024), 132).tiling == Tiling(64, 4)  # several waves
    assert plan(_args(d=64, lq=16, sk=1024), 132).tiling == Tiling(64, 3)  # row tiles past one
    assert plan(_args(sk=512), 132).tiling == Tiling(64, 3)  # d128


def test_the_compiled_tiling_is_the_launched_one():
    a = _args(d=64, sk=1000)
    kernel = next(k for k in CudaAttentionDecode.generate_kernels(None, cc=90) if k.supports(a))
    kernel.tiling = Tiling(128, 2, 3)
    artifact = kernel.compile(a, cc=90)
    assert artifact.extra.tiling == Tiling(128, 2, 3)
    assert kernel.launch_config(a)[2] == shared_bytes(64, Tiling(128, 2, 3))


def test_template_follows_the_plan():
    kernel = next(iter(CudaAttentionDecode.generate_kernels(lambda m: m.kernel_name.endswith("bf16_d128"), cc=90)))
    assert kernel.name_expression(_args(sk=128)) == "ka_attn::decode<ka_attn::BF16, 128, 1, 64, 3, 1>"
    assert (kernel.name_expression(_args(batch=1, lq=16, sk=4096))
            == "ka_attn::decode_split<ka_attn::BF16, 128, 4, 8, 64, 3, 1>")
    kernel.tiling = Tiling(128, 2, 3)
    assert kernel.name_expression(_args(sk=128)) == "ka_attn::decode<ka_attn::BF16, 128, 1, 128, 2, 3>"
    assert kernel.compile_key(_args(batch=8, sk=4096), 90) != kernel.compile_key(_args(sk=4096), 90)
    assert kernel.compile_key(_args(sk=2048), 90) == kernel.compile_key(_args(sk=4096), 90)


@pytest.mark.parametrize("args", [lambda: _args(sk=128), lambda: _args(batch=1, lq=16, sk=4097, d=64,
                                                                        dtype=torch.float16, causal=True)])
def test_compiles_for_sm90a_without_a_gpu(args):
    a = args()
    kernel = next(k for k in kernel_api.get_kernels(a, cc=90, providers="cuda_src"))
    artifact = kernel.compile(a, cc=90)
    launcher = artifact.compiled_obj
    assert launcher.compiled.arch == "sm_90a" and launcher.compiled.cubin[:4] == b"\x7fELF"
    assert artifact.extra.cl == plan(a, 132).cl


@pytest.mark.parametrize("lq,sk", [(1, 128), (1, 4096), (4, 1024), (16, 512)])
def test_pick_any_ranks_it_first_for_decode(lq, sk):
    a = _args(lq=lq, sk=sk)
    ranked = rank_candidates(kernel_api.get_kernels(a, cc=90), a, 132)
    assert ranked[0].metadata.kernel_name == "CudaAttentionDecode_bf16_d128"


def test_a_recorded_launch_takes_the_cache_lengths_as_a_tensor(monkeypatch):
    """With ``cache_seqlens`` the recorded launch reads the lengths' pointer from its fifth tensor
    (after q, k, v and out, as `tensor_attributes` lists them), never from a constant, and one
    recording serves every lengths tensor of that metadata."""
    from types import SimpleNamespace

    from kernel_api import native
    from kernel_api.providers.cuda_src.kernels import attention_decode

    recorded = []

    def cuda_launch(kernel, n_tensors, grid, block, shared, layout):
        recorded.append((n_tensors, layout))
        return lambda *a: None

    monkeypatch.setattr(native, "cuda_launch", cuda_launch)
    monkeypatch.setattr(attention_decode.torch.cuda, "current_device", lambda: 0)
    lengths = torch.empty(64, dtype=torch.int32, device="meta")
    args = _args(k=_meta((64, 4096, 8, 128)), cache_seqlens=lengths)
    assert list(args.tensor_attributes) == ["q", "k", "v", "out", "cache_seqlens"]
    kernel = next(iter(kernel_api.get_kernels(args, cc=90, providers="cuda_src")))
    artifact = kernel.compile(args, cc=90)
    monkeypatch.setattr(type(artifact.compiled_obj), "max_coresident", lambda *a: 1)
    monkeypatch.setattr(type(artifact.compiled_obj), "kernel", property(lambda self: SimpleNamespace(handle=1)))
    first = kernel._launcher(args, artifact)
    again = kernel._launcher(_args(k=_meta((64, 4096, 8, 128)), cache_seqlens=torch.empty_like(lengths)), artifact)
    assert first is again and len(recorded) == 1
    n_tensors, layout = recorded[0]
    assert n_tensors == 5 and layout[:4] == tuple((native.TENSOR, i) for i in range(4))
    assert layout[4:7] == ((8, 0), (8, 0), (native.TENSOR, 4))  # (the offsets' pointers, then the lengths)
    plain = kernel._launcher(_args(k=_meta((64, 4096, 8, 128))), artifact)
    assert plain is not first and recorded[1][0] == 4 and recorded[1][1][6] == (8, 0)
