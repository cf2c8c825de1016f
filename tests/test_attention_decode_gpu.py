"""The CUDA C++ decode attention (cuda_src: attention_decode.py / attention_decode.cu) on a GPU:
against a float64 reference on fresh random data, outputs inside sentinel-filled buffers, one to
16 queries against odd cached lengths (0, 1, 127, 1000, 4097), MHA / GQA / MQA, head dims 64 and
128, bf16 and f16, causal or not, KV caches read through strided views; every split count;
variable-length batches (empty sequences included); then
through `kernel_api.ops.attention` with only this provider allowed (repeated calls replayed on
new data), and memcheck. The CPU half is tests/test_attention_decode.py.
"""

from __future__ import annotations

import pytest
import torch

import kernel_api
from kernel_api import ops
from kernel_api.arguments.attention import AttentionArguments
from kernel_api.providers.cuda_src.kernels.attention_decode import (D64_LONG, D64_MANY_WAVES, D64_SHORT_ONE_WAVE,
                                                                    DEFAULT_TILING, SPLITS, CudaAttentionDecode)

from attention_buffers import SENTINEL, TOL, check_out, out_in_sentinel
from memcheck import run_memcheck

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                                 reason="needs a CUDA device of sm_90 or later")]



def _reference(q, k, v, causal, scale):
    """Attention in float64: (batch, seqlen, heads, head_dim) operands, GQA by repeating k and v,
    the causal mask aligned bottom-right, rows that see no key 0."""
    lq, sk = q.shape[1], k.shape[1]
    group = q.shape[2] // k.shape[2]
    qd = q.double()
    kd = k.double().repeat_interleave(group, dim=2)
    vd = v.double().repeat_interleave(group, dim=2)
    s = torch.einsum("blhd,bshd->bhls", qd, kd) * scale
    if causal:
        i = torch.arange(lq, device=q.device).view(-1, 1)
        j = torch.arange(sk, device=q.device).view(1, -1)
        s = s.masked_fill(j > sk - lq + i, float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return torch.einsum("bhls,bshd->blhd", p, vd)


def _kv_cache(batch, sk, heads_kv, d, dtype, view):
    """k and v of ``sk`` cached tokens: dense tensors, or views of a packed (batch, capacity, 2,
    heads, d) cache with room for more tokens (strided in the batch and seqlen dims)."""
    if view:
        cache = torch.randn(batch, sk + 37, 2, heads_kv, d, device="cuda").to(dtype)
        return cache[:, :sk, 0], cache[:, :sk, 1]
    return (torch.randn(batch, sk, heads_kv, d, device="cuda").to(dtype),
            torch.randn(batch, sk, heads_kv, d, device="cuda").to(dtype))


def _queries(batch, lq, heads_q, d, dtype, view):
    """Fresh queries, as a view of a fused projection's output (strided) when ``view``."""
    if view:
        fused = torch.randn(batch, lq, heads_q + 3, d, device="cuda").to(dtype)
        return fused[:, :, 2:2 + heads_q]
    return torch.randn(batch, lq, heads_q, d, device="cuda").to(dtype)


def decode_kernel(args, splits=None):
    found = [k for k in CudaAttentionDecode.generate_kernels(None, cc=90) if k.supports(args)]
    assert len(found) == 1, kernel_api.explain(args)
    found[0].splits = splits
    return found[0]


# (batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, dtype, causal, strided views)
CASES = [
    (3, 1, 1, 8, 2, 128, torch.bfloat16, False, False),
    (2, 3, 127, 32, 8, 128, torch.bfloat16, True, True),
    (2, 16, 1000, 8, 1, 64, torch.float16, True, True),      # MQA: 128 rows, two row blocks of 64
    (1, 1, 4097, 32, 32, 128, torch.float16, False, True),   # MHA, batch 1: four splits
    (5, 3, 1000, 4, 4, 64, torch.bfloat16, False, False),
    (2, 4, 2, 16, 4, 128, torch.bfloat16, True, False),      # causal, fewer keys than queries: zero rows
    (2, 2, 0, 4, 2, 64, torch.float16, False, False),        # no keys at all
    (64, 1, 128, 32, 8, 128, torch.bfloat16, False, False),
    (1, 16, 4097, 32, 8, 128, torch.bfloat16, True, True),   # 64 rows per KV head
    (3, 5, 300, 12, 4, 64, torch.float16, True, True),       # 15 rows, odd everything
]


def _name(case):
    b, lq, sk, hq, hkv, d, dt, causal, view = case
    return f"b{b}_q{lq}_k{sk}_h{hq}x{hkv}_d{d}_{str(dt)[6:]}{'_causal' if causal else ''}{'_view' if view else ''}"


@pytest.mark.parametrize("case", CASES, ids=_name)
def test_kernel_run_against_float64(case):
    torch.manual_seed(0)
    b, lq, sk, hq, hkv, d, dtype, causal, view = case
    q = _queries(b, lq, hq, d, dtype, view)
    k, v = _kv_cache(b, sk, hkv, d, dtype, view)
    out, buf = out_in_sentinel(q)
    args = AttentionArguments(q, k, v, out, causal=causal)
    kernel = decode_kernel(args)
    kernel.run(args)
    check_out(out, buf, _reference(q, k, v, causal, args.scale), dtype, _name(case))
    # the same arguments again (the bound, recorded launch) on new data written in place
    for t in (q, k, v):
        t.copy_(torch.randn_like(t, dtype=torch.float32).to(dtype))
    kernel.run(args)
    torch.cuda.synchronize()
    check_out(out, buf, _reference(q, k, v, causal, args.scale), dtype, _name(case) + " (again)")


@pytest.mark.parametrize("splits", SPLITS)
@pytest.mark.parametrize("d,dtype", [(128, torch.bfloat16), (64, torch.float16)])
def test_every_split_count(splits, d, dtype):
    torch.manual_seed(splits)
    q = _queries(2, 3, 8, d, dtype, True)
    k, v = _kv_cache(2, 1000, 2, d, dtype, True)
    out, buf = out_in_sentinel(q)
    args = AttentionArguments(q, k, v, out, causal=True, scale=0.3)
    kernel = decode_kernel(args, splits)
    kernel.run(args)
    assert kernel.compile(args).extra.cl == splits
    check_out(out, buf, _reference(q, k, v, True, 0.3), dtype, f"splits={splits}")


TILINGS = {"default": DEFAULT_TILING, "d64_short_one_wave": D64_SHORT_ONE_WAVE, "d64_long": D64_LONG,
           "d64_many_waves": D64_MANY_WAVES}


@pytest.mark.parametrize("splits", [1, 2])
@pytest.mark.parametrize("tiling", list(TILINGS.values()), ids=list(TILINGS))
@pytest.mark.parametrize("sk", [1000, 63, 0])
def test_every_tiling(tiling, splits, sk):
    torch.manual_seed(sk + splits)
    q = _queries(2, 3, 8, 64, torch.bfloat16, True)
    k, v = _kv_cache(2, sk, 2, 64, torch.bfloat16, True)
    out, buf = out_in_sentinel(q)
    args = AttentionArguments(q, k, v, out, causal=True, scale=0.3)
    kernel = decode_kernel(args, splits)
    kernel.tiling = tiling
    kernel.run(args)
    assert kernel.compile(args).extra.tiling == tiling
    check_out(out, buf, _reference(q, k, v, True, 0.3), torch.bfloat16, f"{tiling}, splits={splits}, keys={sk}")


@pytest.mark.parametrize("causal", [False, True])
def test_variable_length(causal):
    torch.manual_seed(2)
    dtype, d, hq, hkv = torch.bfloat16, 128, 16, 4
    lq, lk = [1, 3, 0, 16, 2], [5, 1000, 7, 130, 0]
    cq = torch.tensor([0] + lq, device="cuda").cumsum(0).to(torch.int32)
    ck = torch.tensor([0] + lk, device="cuda").cumsum(0).to(torch.int32)
    tq, tk = sum(lq), sum(lk)
    q = torch.randn(tq, hq + 3, d, device="cuda").to(dtype)[:, 1:1 + hq]
    packed = torch.randn(tk, 2, hkv, d, device="cuda").to(dtype)
    k, v = packed[:, 0], packed[:, 1]
    buf = torch.full((tq, hq + 2, d), SENTINEL, dtype=dtype, device="cuda")
    out = buf[:, 1:1 + hq]
    args = AttentionArguments(q, k, v, out, causal=causal, cu_seqlens_q=cq, cu_seqlens_k=ck, max_seqlen_q=max(lq),
                              max_seqlen_k=max(lk))
    kernel = decode_kernel(args)
    assert kernel.varlen
    kernel.run(args)
    torch.cuda.synchronize()
    a = c = 0
    for n, m in zip(lq, lk):
        ref = _reference(q[a:a + n].unsqueeze(0), k[c:c + m].unsqueeze(0), v[c:c + m].unsqueeze(0), causal,
                         args.scale)[0]
        torch.testing.assert_close(out[a:a + n].double(), ref, atol=TOL[dtype], rtol=TOL[dtype],
                                   msg=lambda e: f"sequence of {n} queries, {m} keys: {e}")
        a, c = a + n, c + m
    assert bool((buf[:, 0] == SENTINEL).all()) and bool((buf[:, -1] == SENTINEL).all())


@pytest.mark.parametrize("causal", [False, True])
def test_ops_attention_with_only_this_provider(causal):
    torch.manual_seed(1)
    dtype = torch.bfloat16
    k, v = _kv_cache(4, 513, 8, 128, dtype, True)
    with kernel_api.settings(providers="cuda_src"):
        for step in range(3):  # the first call chooses and records, the next ones replay it
            q = _queries(4, 2, 32, 128, dtype, False)
            for t in (k, v):
                t.copy_(torch.randn_like(t, dtype=torch.float32).to(dtype))
            out, buf = out_in_sentinel(q)
            got = ops.attention(q, k, v, causal=causal, out=out)
            assert got is out
            check_out(out, buf, _reference(q, k, v, causal, 128 ** -0.5), dtype, f"ops.attention step {step}")
        fresh = ops.attention(q, k, v, causal=causal)  # allocating
        torch.testing.assert_close(fresh.double(), _reference(q, k, v, causal, 128 ** -0.5), atol=TOL[dtype],
                                   rtol=TOL[dtype])
    chosen = [kernel for problem, kernel in ops.chosen_kernels()
              if isinstance(problem[0], tuple) and problem[0][0] == "attention"]
    assert chosen and all(isinstance(kernel, CudaAttentionDecode) for kernel in chosen)


def test_pick_any_prefers_it_for_decode():
    q = torch.randn(64, 1, 32, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(64, 1024, 8, 128, device="cuda", dtype=torch.bfloat16)
    args = AttentionArguments(q, k, k, torch.empty_like(q))
    from kernel_api.tuning.pick_any import rank_candidates

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    ranked = rank_candidates(kernel_api.get_kernels(args), args, sms)
    assert ranked[0].metadata.kernel_name == "CudaAttentionDecode_bf16_d128"


def test_memcheck():
    code = r"""
import torch
from kernel_api.arguments.attention import AttentionArguments
from kernel_api.providers.cuda_src.kernels.attention_decode import CudaAttentionDecode
torch.manual_seed(0)
n = 0
from kernel_api.providers.cuda_src.kernels.attention_decode import D64_LONG, D64_MANY_WAVES, D64_SHORT_ONE_WAVE
for b, lq, sk, hq, hkv, d, splits, causal, tiling in (
        (2, 3, 1000, 8, 2, 128, 4, True, None), (3, 16, 1, 8, 1, 64, None, True, None),
        (1, 1, 4097, 4, 4, 128, 8, False, None), (2, 2, 0, 4, 2, 64, None, False, None),
        (3, 1, 1000, 8, 2, 64, 2, True, D64_LONG), (3, 2, 999, 8, 8, 64, None, False, D64_SHORT_ONE_WAVE),
        (2, 1, 333, 4, 4, 64, None, False, D64_MANY_WAVES)):
    cache = torch.randn(b, sk + 5, 2, hkv, d, device="cuda").to(torch.bfloat16)
    k, v = cache[:, :sk, 0], cache[:, :sk, 1]
    q = torch.randn(b, lq, hq, d, device="cuda").to(torch.bfloat16)
    args = AttentionArguments(q, k, v, torch.empty_like(q), causal=causal)
    for kern in CudaAttentionDecode.generate_kernels(None, cc=90):
        if kern.supports(args):
            kern.splits, kern.tiling = splits, tiling
            kern.run(args); kern.run(args); n += 1
torch.cuda.synchronize()
print("launched", n)
"""
    out = run_memcheck(code)
    assert "launched 7" in out
