"""ops.attention on a CUDA GPU in bf16 against the float64 reference of
tests/test_attention_op.py: dense, GQA / MQA, causal, decode, variable length, the backward,
and torch.compile(fullgraph=True)."""

from __future__ import annotations

import pytest
import torch

from kernel_api import ops
from kernel_api.arguments import AttentionArguments

from test_attention_op import SENTINEL, _qkv, _varlen, reference

pytestmark = pytest.mark.gpu

BF16 = dict(atol=2e-2, rtol=2e-2)


def _cuda(*tensors):
    return [t.cuda() for t in tensors]


@pytest.mark.parametrize("shape", [(1, 1, 1, 2, 2, 64), (2, 7, 7, 4, 4, 128), (1, 33, 33, 8, 2, 128),
                                   (2, 7, 33, 8, 1, 64), (2, 16, 100, 8, 2, 64), (2, 1, 100, 8, 2, 128)])
@pytest.mark.parametrize("causal", [False, True])
def test_ops_call_bf16(shape, causal):
    q, k, v = _qkv(*shape, dtype=torch.bfloat16)
    cq, ck, cv = _cuda(q, k, v)
    out = torch.full_like(cq, SENTINEL)
    assert ops.call(AttentionArguments(cq, ck, cv, out, causal=causal)) is out
    torch.testing.assert_close(out.double().cpu(), reference(q, k, v, causal), **BF16)


@pytest.mark.parametrize("causal", [False, True])
def test_varlen_bf16(causal):
    q, k, v, cu_q, cu_k = _varlen([3, 0, 7, 1], [5, 0, 7, 33], 8, 2, 64, torch.bfloat16)
    gq, gk, gv, gcu_q, gcu_k = _cuda(q, k, v, cu_q, cu_k)
    out = torch.full_like(gq, SENTINEL)
    ops.attention(gq, gk, gv, causal=causal, cu_seqlens_q=gcu_q, cu_seqlens_k=gcu_k, max_seqlen_q=7,
                  max_seqlen_k=33, out=out)
    torch.testing.assert_close(out.double().cpu(), reference(q, k, v, causal, None, cu_q, cu_k), **BF16)


def test_varlen_on_gpu_needs_max_seqlen():
    q, k, v, cu_q, cu_k = _cuda(*_varlen([3, 4], [3, 4], 2, 2, 64, torch.bfloat16))
    with pytest.raises(ValueError, match="max_seqlen_q: required"):
        AttentionArguments(q, k, v, torch.empty_like(q), cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)


def test_backward_bf16():
    q, k, v = _qkv(2, 7, 33, 8, 2, 64, dtype=torch.bfloat16)
    grad = torch.randn(q.shape, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    ref = [t.double().requires_grad_() for t in (q, k, v)]
    reference_grads = torch.autograd.grad(_differentiable_reference(*ref), ref, grad.double())
    gpu = [t.cuda().requires_grad_() for t in (q, k, v)]
    grads = torch.autograd.grad(ops.attention(*gpu, causal=True), gpu, grad.cuda())
    for got, want in zip(grads, reference_grads):
        torch.testing.assert_close(got.double().cpu(), want, atol=5e-2, rtol=5e-2)


def _differentiable_reference(q, k, v):
    """The causal bottom-right reference with autograd (seqlen_q <= seqlen_k: every query sees a key)."""
    sq, sk, groups = q.shape[1], k.shape[1], q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(groups, dim=2), v.repeat_interleave(groups, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * q.shape[-1] ** -0.5
    mask = torch.arange(sk)[None, :] > torch.arange(sq)[:, None] + sk - sq
    return torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s.masked_fill(mask, float("-inf")), -1), v)


def test_torch_compile_fullgraph():
    q, k, v = _cuda(*_qkv(2, 16, 100, 8, 2, 64, dtype=torch.bfloat16))
    compiled = torch.compile(lambda a, b, c: ops.attention(a, b, c, causal=True), fullgraph=True)
    torch.testing.assert_close(compiled(q, k, v).double().cpu(),
                               reference(q.cpu(), k.cpu(), v.cpu(), True), **BF16)
